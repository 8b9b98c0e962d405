"""Batch tensors the Sampler needs, built once per step from each row's SamplingParams.

Only the tensors some row actually uses are built, so an all-greedy batch costs almost nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SamplingRow:
    """One sequence to sample this step, as the model runner knows it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator (seeded requests only); it lives as long as the request.
    generator: torch.Generator | None = None


@dataclass
class SamplingMetadata:
    """Per-row sampling settings as batch tensors; optional knobs are None when no row uses them."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size for rows without top-k
    top_p: torch.Tensor | None  # [B] float32, 1.0 for rows without top-p
    min_p: torch.Tensor | None  # [B] float32, 0.0 for rows without min-p
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64, padded with vocab_size
    output_token_ids: list[list[int]]
    min_tokens: dict[int, set[int]] = field(default_factory=dict)
    # [B, V] bool, True where a row with allowed_token_ids forbids the token; None when no row sets it.
    disallowed_mask: torch.Tensor | None = None
    # row -> its bad words, indexed for the per-step check (only rows that have some).
    bad_words_token_ids: dict[int, BadWordsIndex] = field(default_factory=dict)
    # (rows [N] int64, token ids [N] int64, biases [N] float32), one entry per
    # (row, token) pair of the rows' logit_bias; None when no row sets it.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes its most likely token and nothing edits or reads the
        logits first (no logprobs, masks, bad words, min_tokens, bias or
        penalties): the whole sampler is one argmax."""
        return (
            self.all_greedy
            and self.max_num_logprobs is None
            and self.no_penalties
            and self.disallowed_mask is None
            and not self.bad_words_token_ids
            and not self.min_tokens
            and self.logit_bias is None
        )


class BadWordsIndex:
    """One request's bad words arranged for the check at every step: the
    one-token words are banned outright, and the longer ones are found by the
    last token of their prefix, so that a step looks only at the words the
    output's last token could be completing, never at the whole list."""

    def __init__(self, sequences: list[list[int]]):
        self.sequences = sequences  # what it was built from (see bad_words_index)
        self.always = sorted({seq[0] for seq in sequences if len(seq) == 1})
        self.by_prefix_end: dict[int, list[tuple[list[int], int]]] = {}
        for seq in sequences:
            if len(seq) > 1:
                *prefix, last = seq
                self.by_prefix_end.setdefault(prefix[-1], []).append((prefix, last))
        self._always_tensors: dict[tuple, torch.Tensor] = {}

    def always_tensor(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """The one-token words' ids within the vocabulary, on `device` (made once)."""
        key = (vocab_size, str(device))
        tensor = self._always_tensors.get(key)
        if tensor is None:
            ids = [t for t in self.always if t < vocab_size]
            tensor = self._always_tensors[key] = torch.tensor(ids, dtype=torch.int64, device=device)
        return tensor

    def completed_by_next(self, output: list[int]) -> list[int]:
        """Last tokens of the multi-token words whose prefix ends the output."""
        if not output:
            return []
        banned = []
        for prefix, last in self.by_prefix_end.get(output[-1], ()):
            if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                banned.append(last)
        return banned


def bad_words_index(params: SamplingParams) -> BadWordsIndex:
    """The request's BadWordsIndex, built at its first step and kept on its
    params (which live as long as the request on this worker; not a field, so
    it never travels)."""
    index = getattr(params, "_bad_words_index", None)
    if index is None or index.sequences is not params.bad_words_token_ids:
        index = BadWordsIndex(params.bad_words_token_ids)
        params._bad_words_index = index
    return index


def same_every_step(params: SamplingParams) -> bool:
    """Whether a row's part of SamplingMetadata stays the same from step to
    step (it does unless it reads the output so far: penalties, bad words,
    min_tokens), so that a batch of such rows can reuse one step's metadata."""
    return not params.reads_own_output


def _float_tensor(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _pad_token_lists(lists: list[list[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    """Stack ragged token lists into [B, max_len] int64, padding with ``pad_id``."""
    max_len = max((len(tokens) for tokens in lists), default=0)
    padded = [tokens + [pad_id] * (max_len - len(tokens)) for tokens in lists]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(lists), max_len)


def _disallowed_mask(
    params_list: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    restricted = [(i, p.allowed_token_ids) for i, p in enumerate(params_list) if p.allowed_token_ids]
    if not restricted:
        return None
    mask = torch.zeros(len(params_list), vocab_size, dtype=torch.bool, device=device)
    rows = torch.tensor([i for i, _ in restricted], dtype=torch.int64, device=device)
    mask[rows] = True
    # One scatter for all rows: the (row, id) pairs of every allowed token.
    pair_rows = [i for i, ids in restricted for t in ids if t < vocab_size]
    pair_ids = [t for _, ids in restricted for t in ids if t < vocab_size]
    mask[pair_rows, pair_ids] = False
    return mask


def _logit_bias_entries(
    params_list: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, params in enumerate(params_list):
        for token_id, bias in (params.logit_bias or {}).items():
            if token_id < vocab_size:
                rows.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
        _float_tensor(biases, device),
    )


def build_sampling_metadata(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingMetadata:
    """Gather every row's settings into the batch tensors the Sampler reads."""
    params_list = [row.params for row in rows]
    temperatures = [p.temperature for p in params_list]
    num_greedy = sum(1 for t in temperatures if t == 0.0)
    all_greedy = num_greedy == len(rows)
    all_random = num_greedy == 0

    top_k = top_p = min_p = None
    generators: dict[int, torch.Generator] = {}
    if not all_greedy:
        # Greedy rows had their truncation knobs normalised to "off" by SamplingParams.
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params_list]
        if any(k < vocab_size for k in top_ks):
            top_k = torch.tensor(top_ks, dtype=torch.int64, device=device)
        top_ps = [p.top_p for p in params_list]
        if any(tp < 1.0 for tp in top_ps):
            top_p = _float_tensor(top_ps, device)
        min_ps = [p.min_p for p in params_list]
        if any(mp > 0.0 for mp in min_ps):
            min_p = _float_tensor(min_ps, device)
        # A greedy row never draws noise, so its generator would go unused.
        generators = {
            i: row.generator
            for i, row in enumerate(rows)
            if row.generator is not None and row.params.temperature != 0.0
        }

    requested = [p.logprobs for p in params_list if p.logprobs is not None]
    max_num_logprobs = max(requested) if requested else None

    no_penalties = not any(p.uses_penalties for p in params_list)
    presence = frequency = repetition = prompt_ids = None
    if not no_penalties:
        presence = _float_tensor([p.presence_penalty for p in params_list], device)
        frequency = _float_tensor([p.frequency_penalty for p in params_list], device)
        repetition = _float_tensor([p.repetition_penalty for p in params_list], device)
        prompt_ids = _pad_token_lists([row.prompt_token_ids for row in rows], vocab_size, device)

    # The engine leaves EOS out of all_stop_token_ids when ignore_eos is set, so this
    # set is exactly what must not end the sequence early.
    min_tokens: dict[int, set[int]] = {}
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            forbidden = set(row.params.all_stop_token_ids) | set(row.params.stop_token_ids)
            if forbidden:
                min_tokens[i] = forbidden

    return SamplingMetadata(
        temperature=_float_tensor(temperatures, device),
        all_greedy=all_greedy,
        all_random=all_random,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=generators,
        max_num_logprobs=max_num_logprobs,
        no_penalties=no_penalties,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        prompt_token_ids=prompt_ids,
        output_token_ids=[row.output_token_ids for row in rows],
        min_tokens=min_tokens,
        disallowed_mask=_disallowed_mask(params_list, vocab_size, device),
        bad_words_token_ids={i: bad_words_index(p) for i, p in enumerate(params_list) if p.bad_words_token_ids},
        logit_bias=_logit_bias_entries(params_list, vocab_size, device),
    )
