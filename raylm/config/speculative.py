"""SpeculativeConfig: speculative decoding, as vLLM's `speculative_config`
spells it (`LLM(speculative_config={...})`, `--speculative-config '<json>'`).

A proposer drafts up to `num_speculative_tokens` tokens for a decoding
request, the target model verifies them in one forward of the k + 1
positions, and every committed token is the one decoding without
speculation would have sampled (raylm.core.spec_decode). Methods: `ngram`
(prompt lookup: the tokens that followed the last earlier occurrence of the
request's last n tokens, n from prompt_lookup_max down to prompt_lookup_min)
and `suffix` (the most frequent continuation in earlier outputs of requests
with the same cache_salt, else prompt lookup) from the core; `draft_model`
(a smaller model of the same tokenizer, `model`, drafting greedily in the
workers beside the target: raylm.worker.draft_model). A draft model is
checked against the target when the engine's settings are resolved
(`check_draft_model`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from raylm.model.arch_config import ArchConfig
from raylm.model.hub import resolve_model_path
from raylm.model.loader import load_arch_config

METHODS = ("ngram", "suffix", "draft_model")
# The longest draft: the verification forward computes 1 + k positions of the
# request; past a few tokens the chance that every one is accepted is small
# and each rejected position is computed in vain.
MAX_SPECULATIVE_TOKENS = 16
# The longest n-gram prompt lookup matches (longer ones are rare and slower to find).
MAX_PROMPT_LOOKUP = 64
# Unset lookup bounds: n from 4 down to 2 (one-token matches propose too much
# that is rejected; vLLM's documentation example uses a maximum of 4).
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # A draft model's folder or Hub id (method draft_model only).
    model: str | None = None

    @classmethod
    def from_setting(cls, setting) -> SpeculativeConfig | None:
        """A dict of vLLM's keys, its JSON text (the flag's), an instance, or
        None (no speculation). An unknown key is refused by name."""
        if setting is None or isinstance(setting, SpeculativeConfig):
            return setting
        if isinstance(setting, str):
            try:
                setting = json.loads(setting)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e.msg}): {setting!r}") from None
        if not isinstance(setting, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON text), got {setting!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(setting) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
            )
        return cls(**setting)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (the draft length)")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        if self.method == "draft_model":
            if isinstance(self.model, os.PathLike):  # a pathlib.Path from Python, as LLM(model=...) takes
                self.model = os.fspath(self.model)
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model (the draft's folder or Hub id) is required by draft_model")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for ngram and suffix, not draft_model")
            return
        if self.model is not None:
            raise ValueError(f"speculative_config.model is for method draft_model, not {self.method!r}")
        self._resolve_lookup_bounds()

    def _resolve_lookup_bounds(self) -> None:
        """One bound given: the other follows it (min <= max); none: the defaults."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None and (not _is_int(value) or not 1 <= value <= MAX_PROMPT_LOOKUP):
                raise ValueError(
                    f"speculative_config.{name} must be an integer from 1 to {MAX_PROMPT_LOOKUP}, got {value!r}"
                )
        if high is None:
            high = max(DEFAULT_PROMPT_LOOKUP_MAX, low or 1)
        if low is None:
            low = min(DEFAULT_PROMPT_LOOKUP_MIN, high)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high


def check_draft_model(spec: SpeculativeConfig, target: ArchConfig, tokenizer: str, max_model_len: int, lora) -> str:
    """The draft model's local folder (a Hub id found once, so that every
    worker gets a path), after checking that it can draft for the target:
    the same vocabulary (token ids mean the same text, and the drafts are the
    target's token ids), a context at least as long as the target's (it reads
    every position the target does), and no LoRA (the target's output under an
    adapter is not what a plain draft predicts, and the draft has no adapter
    slots). Each refusal names its setting."""
    if lora is not None:
        raise ValueError("speculative_config.method 'draft_model' is not served with enable_lora (use ngram or suffix)")
    path = resolve_model_path(spec.model, what="speculative_config.model")
    draft = load_arch_config(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {spec.model!r}: vocabulary size {draft.vocab_size} differs from the "
            f"target's {target.vocab_size}; a draft model must share the target's tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model {spec.model!r}: max_position_embeddings {draft.max_position_embeddings} "
            f"is shorter than the target's max_model_len {max_model_len}"
        )
    if os.path.isdir(path) and _tokenizer_vocab(path) not in (None, _tokenizer_vocab(tokenizer)):
        raise ValueError(
            f"speculative_config.model {spec.model!r}: its tokenizer differs from the target's "
            "(the same vocabulary size, other tokens)"
        )
    return path


def _tokenizer_vocab(folder: str) -> dict[str, int] | None:
    """Token text -> id of the tokenizer in `folder`; None where it has none."""
    from transformers import AutoTokenizer

    if not any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder).get_vocab()
