"""Per-request sampling settings, validated once when the request enters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this, a temperature is treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5
# OpenAI documents logit_bias values in [-100, 100]; larger ones are clamped, as
# the biases already decide the choice at those magnitudes.
_MAX_LOGIT_BIAS = 100.0

# ---- What one request may ask for (vLLM sets none of these bounds) ----------
# Each bad word is tokenized at intake (twice: with and without a leading
# space) and matched against the output at every step; thousands would cost
# the engine more than the request's own tokens.
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORDS_TOTAL_CHARS = 64 * 1024
# Every sampled token is checked against them, and min_tokens masks them all.
MAX_STOP_TOKEN_IDS = 1024
# Prompt logprobs are (prompt positions) x (prompt_logprobs + 1) entries, each
# a Python object on the way back and a JSON entry in the response: 2**18 is a
# full 128k-token prompt with its own tokens' logprobs only, or ~12k positions
# with the top 20.
MAX_PROMPT_LOGPROBS_ENTRIES = 2**18
# A structured-outputs grammar (JSON schema as JSON text, regex, EBNF, or the
# choices together) is compiled to an automaton at intake and in the engine;
# real schemas are a few KiB.
MAX_GRAMMAR_CHARS = 128 * 1024
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """A grammar the request's output must follow, in vLLM's shape: exactly
    one of the fields is set. Here only the shape is checked (this also runs
    where a message is decoded); the grammar itself is checked at request
    intake, see raylm.core.structured_output.validate_structured_outputs."""

    # A JSON schema (dict, or its JSON text): the output is one instance of it.
    json: str | dict | None = None
    # Any JSON object.
    json_object: bool | None = None
    regex: str | None = None
    # The output is one of these strings.
    choice: list[str] | None = None
    # An EBNF (GBNF) grammar whose start rule is `root`.
    grammar: str | None = None
    # JSON (json, json_object): by default the whitespace between tokens is
    # bounded as llama.cpp bounds it (one space, or a newline and an indent of
    # at most 20), so a weak model cannot spin on blanks; vLLM's knobs:
    # disable_any_whitespace (none at all: "," and ":" alone separate) or
    # whitespace_pattern (a regex for what may stand between tokens).
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # Reasoning models: the grammar holds only after the output has produced
    # these tokens (the end of its reasoning, e.g. "</think>"); before them the
    # output is free. None: from the first token.
    starts_after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        chosen = [
            name
            for name in ("json", "json_object", "regex", "choice", "grammar")
            if getattr(self, name) not in (None, False)
        ]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                f"structured_outputs: exactly one of json, json_object, regex, choice, grammar must be set, got {got}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}"
            )
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must contain only strings")
            self.choice = list(self.choice)
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError(
                    f"structured_outputs.whitespace_pattern must be a string, got {self.whitespace_pattern!r}"
                )
            if self.disable_any_whitespace:
                raise ValueError(
                    "structured_outputs: disable_any_whitespace and whitespace_pattern exclude each other; give one"
                )
            if self.json is None and not self.json_object:
                raise ValueError("structured_outputs.whitespace_pattern applies to json and json_object only")
        if self.starts_after_token_ids is not None:
            ids = self.starts_after_token_ids
            if (
                not isinstance(ids, (list, tuple))
                or not 0 < len(ids) <= 16
                or not all(type(t) is int and 0 <= t < 2**31 for t in ids)
            ):
                raise ValueError(f"structured_outputs.starts_after_token_ids must be 1 to 16 token ids, got {ids!r}")
            self.starts_after_token_ids = list(ids)
        self._check_size()

    def _check_size(self) -> None:
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} choices, got {len(self.choice)}")
        for name in ("json", "regex", "grammar", "choice", "whitespace_pattern"):
            value = getattr(self, name)
            if value is None:
                continue
            size = _grammar_chars(value)
            if size > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.{name}: at most {MAX_GRAMMAR_CHARS} characters, got {size}")


# Integer fields checked to fit the wire format (msgpack: 64 bits).
_INTEGER_FIELDS = (
    "n",
    "top_k",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
# Completions per request, as OpenAI's API caps `n`.
MAX_N = 128


@dataclass
class SamplingParams:
    """How to sample one request's tokens, with vLLM's field names and defaults.

    Validation raises ``ValueError`` naming the offending field, so a caller
    learns what to fix and the engine never sees a bad request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> value added to its logit before sampling (and before greedy argmax).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated (see bad_words_token_ids).
    bad_words: list[str] | None = None
    # Keep only the last k prompt tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = None
    # Filled by the engine from the tokenizer/config, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # bad_words tokenized by the front end, one token sequence per variant; the
    # workers ban each sequence's last token once the output ends with the rest.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self._validate_token_constraints()
        if self.top_k == 0:
            self.top_k = -1  # vLLM and client libraries send 0 for "no top-k"
        if self.temperature < _GREEDY_EPS:
            # Greedy: the truncation knobs are meaningless, normalise them so
            # the sampler can batch greedy rows without special cases.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        # Union, not overwrite: a transport that decodes these params runs this
        # again, and must keep the ids the engine added (EOS) at intake.
        self.all_stop_token_ids = set(self.all_stop_token_ids or ()) | set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{field_name} {why}")

        for name in _INTEGER_FIELDS:
            value = getattr(self, name)
            # Past 64 bits no transport carries it: refused here, not by a failing step.
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                raise bad(name, f"must fit in a signed 64-bit integer, got {value}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > MAX_N:
            raise bad("n", f"may be at most {MAX_N} (each completion is a request of its own), got {self.n}")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise bad("top_k", f"must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must contain only non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must contain only non-negative integers")
        # Deduplicated (in order): a repeated id changes nothing but the cost.
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(
                "stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} distinct ids, got {len(self.stop_token_ids)}"
            )
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            kind = type(self.structured_outputs).__name__
            raise bad("structured_outputs", f"must be a StructuredOutputsParams, got {kind}")

    def _validate_token_constraints(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens.

        Their ids are checked against the vocabulary at intake
        (InputProcessor), the one place that knows its size. This also runs
        again when a transport decodes the params, so it must accept its own
        normalised output.
        """
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            clamped: dict[int, float] = {}
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {token_id!r}")
                if not _is_number(bias) or math.isnan(bias):
                    raise ValueError(f"logit_bias[{token_id}] must be a number, got {bias!r}")
                clamped[token_id] = float(min(max(bias, -_MAX_LOGIT_BIAS), _MAX_LOGIT_BIAS))
            self.logit_bias = clamped or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, (list, tuple, set)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids must contain only non-negative integers")
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {words!r}")
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError("bad_words must contain only non-blank strings")
            _check_bad_words_size(words)
            self.bad_words = list(words)
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, list) or not all(
                isinstance(seq, list) and seq and all(_is_int(t) and t >= 0 for t in seq) for seq in seqs
            ):
                raise ValueError("bad_words_token_ids must be a list of non-empty lists of token ids")
            if len(seqs) > 2 * MAX_BAD_WORDS or sum(len(seq) for seq in seqs) > MAX_BAD_WORDS_TOTAL_CHARS:
                raise ValueError(
                    f"bad_words_token_ids: at most {2 * MAX_BAD_WORDS} sequences of "
                    f"{MAX_BAD_WORDS_TOTAL_CHARS} tokens in all"
                )
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not _is_int(tpt) or (tpt < 1 and tpt != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, got {tpt!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_own_output(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad
        words, min_tokens), so that its inputs change from step to step."""
        return self.min_tokens > 0 or bool(self.bad_words_token_ids) or self.uses_penalties

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


def _check_bad_words_size(words: list[str]) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
    longest = max(len(w) for w in words) if words else 0
    if longest > MAX_BAD_WORD_CHARS:
        raise ValueError(f"bad_words: a word may have at most {MAX_BAD_WORD_CHARS} characters, got one of {longest}")
    total = sum(len(w) for w in words)
    if total > MAX_BAD_WORDS_TOTAL_CHARS:
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS_TOTAL_CHARS} characters in all, got {total}")


def check_prompt_logprobs_size(num_positions: int, prompt_logprobs: int | None) -> None:
    """ValueError naming prompt_logprobs when a request's prompt logprobs
    (over `num_positions` prompt tokens, all its prompts) would be too many."""
    if prompt_logprobs is None:
        return
    entries = num_positions * (prompt_logprobs + 1)
    if entries > MAX_PROMPT_LOGPROBS_ENTRIES:
        raise ValueError(
            f"prompt_logprobs: {num_positions} prompt positions x {prompt_logprobs + 1} logprobs "
            f"each is {entries} entries; at most {MAX_PROMPT_LOGPROBS_ENTRIES} per request"
        )


def _grammar_chars(value: object) -> int:
    """The size of a grammar as text: a JSON schema given as a dict counts as
    its JSON (measured without building it past the limit)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(c) for c in value)
    import json

    size = 0
    for chunk in json.JSONEncoder().iterencode(value):
        size += len(chunk)
        if size > MAX_GRAMMAR_CHARS:
            break
    return size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
