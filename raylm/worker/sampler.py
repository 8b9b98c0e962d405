"""Turns a batch's last-position logits into next tokens (and logprobs), vectorized over rows.

Order (vLLM's): the grammar bitmask (structured outputs, applied by the model runner), raw logprobs,
allowed_token_ids, bad_words, min_tokens mask, logit_bias, penalties, then greedy argmax or
temperature/top-k/top-p/min-p sampling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from raylm.messages import GrammarOutput
from raylm.worker.sampling_metadata import BadWordsIndex, SamplingMetadata

logger = logging.getLogger(__name__)

# Exp(1) noise can be exactly 0; dividing by it would turn a zero probability into NaN.
_MIN_NOISE = 1e-10


@dataclass
class LogprobsTensors:
    """Logprobs of the chosen token and the top-k alternatives, one row per position."""

    token_ids: torch.Tensor  # [B, k+1] int64: column 0 is the sampled/target token
    logprobs: torch.Tensor  # [B, k+1] float32
    ranks: torch.Tensor  # [B] int64: rank of column 0's token, 1 = most likely


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Pick each row's own token plus its ``num_top`` most likely tokens out of full logprobs."""
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    # Rank counts strictly better tokens, so ties share the best rank.
    ranks = (logprobs > chosen).sum(dim=1) + 1
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=1)
        all_ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        all_logprobs = torch.cat([chosen, top_logprobs], dim=1)
    else:
        all_ids, all_logprobs = token_ids.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=all_ids, logprobs=all_logprobs, ranks=ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprobs of each prompt position's next prompt token, from raw logits [N, V]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, target_token_ids, num_top)


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, set[int]]) -> torch.Tensor:
    """Forbid stop tokens for rows that have not yet generated their min_tokens."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in min_tokens.items():
        for token_id in token_ids:
            if token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        logits[rows, cols] = float("-inf")
    return logits


def apply_bad_words(
    logits: torch.Tensor, bad_words: dict[int, BadWordsIndex], output_token_ids: list[list[int]]
) -> None:
    """Forbid, in place, the last token of each bad word whose other tokens
    end the row's output so far (a one-token word is always forbidden). A
    step's cost per row is one indexed fill plus the words whose prefix ends
    with the output's last token, however many bad words the row has."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, index in bad_words.items():
        always = index.always_tensor(vocab_size, logits.device)
        if always.numel():
            logits[row].index_fill_(0, always, float("-inf"))
        for last in index.completed_by_next(output_token_ids[row]):
            if last < vocab_size:
                rows.append(row)
                cols.append(last)
    if rows:
        logits[rows, cols] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Add each row's biases to its tokens' logits, in place."""
    rows, token_ids, biases = entries
    logits.index_put_((rows, token_ids), biases, accumulate=True)


def apply_grammar_bitmask(
    logits: torch.Tensor, sample_req_ids: list[str], grammar_output: GrammarOutput | None
) -> None:
    """Forbid, in place, every token the grammar of a constrained row does not
    allow. `sample_req_ids` names the rows of `logits`, one each; the engine
    lists the constrained ones in `grammar_output` (see GrammarOutput for the layout)."""
    if grammar_output is None or not grammar_output.req_ids:
        return
    spans = grammar_output.row_spans()
    _forbid(logits, [(row, spans[rid][0]) for row, rid in enumerate(sample_req_ids) if rid in spans], grammar_output)


def apply_draft_grammar_bitmask(
    logits: torch.Tensor, drafts: list[tuple[str, int, int]], grammar_output: GrammarOutput | None
) -> None:
    """The same for the verification rows of speculative drafts: `drafts`
    holds (req_id, its first row of `logits`, its rows: 1 + its draft's
    length); a constrained request's row j gets its grammar row j, the
    tokens allowed after the draft's first j tokens."""
    if grammar_output is None or not grammar_output.req_ids:
        return
    spans = grammar_output.row_spans()
    pairs = []
    for rid, first, count in drafts:
        span = spans.get(rid)
        if span is None:
            continue
        if span[1] != count:
            raise RuntimeError(f"request {rid}: {span[1]} grammar rows for a draft verified in {count}")
        pairs.extend((first + j, span[0] + j) for j in range(count))
    _forbid(logits, pairs, grammar_output)


def _forbid(logits: torch.Tensor, pairs: list[tuple[int, int]], grammar_output: GrammarOutput) -> None:
    """Masks row r of `logits` with bitmask row k, for each (r, k) in `pairs`."""
    if not pairs:
        return
    words = torch.frombuffer(bytearray(grammar_output.bitmask), dtype=torch.int32)
    words = words.view(-1, grammar_output.num_words)[[k for _, k in pairs]]
    shifts = torch.arange(32, dtype=torch.int32)
    # Bit j of word w is token 32 * w + j; the arithmetic shift of a negative
    # word still leaves the wanted bit lowest.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1).to(logits.device)
    vocab_size = logits.shape[1]
    if allowed.shape[1] < vocab_size:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    rows = torch.tensor([row for row, _ in pairs], dtype=torch.int64, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))


def _output_token_counts(output_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-row occurrence counts of each generated token, [B, V] float32."""
    num_rows = len(output_token_ids)
    max_len = max((len(tokens) for tokens in output_token_ids), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len > 0:
        # Pad with an extra "vocab_size" column that absorbs the padding and is dropped.
        padded = [tokens + [vocab_size] * (max_len - len(tokens)) for tokens in output_token_ids]
        index = torch.tensor(padded, dtype=torch.int64, device=device)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties."""
    num_rows, vocab_size = logits.shape
    output_counts = _output_token_counts(metadata.output_token_ids, vocab_size, logits.device)
    in_output = output_counts > 0

    in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    if metadata.prompt_token_ids is not None and metadata.prompt_token_ids.numel() > 0:
        in_prompt.scatter_(1, metadata.prompt_token_ids, True)
    seen = in_prompt[:, :vocab_size] | in_output

    repetition = metadata.repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - metadata.presence_penalties.unsqueeze(1) * in_output.float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest head reaching top_p; one sort serves both."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[1]
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # the most likely token always survives
        # Rounding in the cumsum must not cut a tail off rows that asked for no truncation.
        drop &= (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row: argmax(p / q), q ~ Exp(1), equals a draw from p.

    Seeded rows draw their noise from their own generator, V values per step,
    so their tokens do not depend on which other rows share the batch.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return _argmax(probs / noise.clamp_min_(_MIN_NOISE))


def advance_generator(generator: torch.Generator, num_steps: int, vocab_size: int) -> None:
    """Replay the draws of `num_steps` sampled steps (exponential_race draws
    one row of V values per step), so a request resumed on new workers (after
    a failure) continues its seeded stream exactly where it stopped."""
    row = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_steps):
        row.exponential_(generator=generator)


class Sampler(torch.nn.Module):
    """Samples the next token of every row of the batch in one vectorized pass."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.plain_greedy:
            return SamplerOutput(sampled_token_ids=greedy_tokens(logits), logprobs=None)
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            # Logprobs describe the model's own distribution, before any request-side shaping.
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if (
            metadata.disallowed_mask is not None
            or metadata.bad_words_token_ids
            or metadata.min_tokens
            or metadata.logit_bias is not None
        ):
            # Copy first: the edits below work in place and must not mutate the caller's logits tensor.
            logits = logits.clone()
            if metadata.disallowed_mask is not None:
                logits.masked_fill_(metadata.disallowed_mask, float("-inf"))
            if metadata.bad_words_token_ids:
                apply_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)
            if metadata.min_tokens:
                logits = apply_min_tokens(logits, metadata.min_tokens)
            if metadata.logit_bias is not None:
                apply_logit_bias(logits, metadata.logit_bias)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)

        sampled = self._sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = None
        if not metadata.all_random:
            greedy_tokens = _argmax(logits)
            if metadata.all_greedy:
                return greedy_tokens

        temperature = metadata.temperature
        if not metadata.all_random:
            # Greedy rows ride along through the random path; 1.0 keeps them finite.
            temperature = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        if metadata.min_p is not None:
            max_probs = probs.max(dim=-1, keepdim=True).values
            # The race ignores row scale, so zeroing is enough; no renormalisation needed.
            probs = probs.masked_fill(probs < metadata.min_p.unsqueeze(1) * max_probs, 0.0)
        random_tokens = exponential_race(probs, metadata.generators)

        if greedy_tokens is None:
            return random_tokens
        return torch.where(metadata.temperature == 0.0, greedy_tokens, random_tokens)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (the first on ties), as the full sampler
    picks it for a greedy row."""
    logits = logits.float()
    if logits.is_cpu and logits.dim() == 2:
        # numpy's argmax picks the same token (the first maximum) at a fraction
        # of a torch reduction's fixed cost, which is most of a small batch's.
        return torch.from_numpy(logits.numpy().argmax(-1))
    return _argmax(logits)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    # Same result as x.argmax(-1) (first maximum on ties) but 2-3x faster on
    # CPU, where argmax takes a slower reduction path than max.
    return x.max(dim=-1).indices
