"""SpeculativeConfig: speculative decoding, as vLLM's `speculative_config`
spells it (`LLM(speculative_config={...})`, `--speculative-config '<json>'`).

A proposer drafts up to `num_speculative_tokens` tokens for a decoding
request, the target model verifies them in one forward of the k + 1
positions, and every committed token is the one decoding without
speculation would have sampled (raylm.core.spec_decode). Methods: `ngram`
(prompt lookup: the tokens that followed the last earlier occurrence of the
request's last n tokens, n from prompt_lookup_max down to prompt_lookup_min)
and `suffix` (the most frequent continuation in earlier outputs of requests
with the same cache_salt, else prompt lookup). `draft_model` is vLLM's name
for a method not built yet: refused by name rather than run as something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "draft_model")
NOT_YET = {"draft_model": "a draft model beside the target is not built yet; use ngram or suffix"}
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
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config.method {self.method!r}: {NOT_YET[self.method]}")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (the draft length)")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
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
