"""Request intake: validate and tokenize a prompt, finish its SamplingParams,
and build the request's one form on its way to the core.

Everything a user can get wrong is caught here, before the request reaches the
engine core, and reported as a ValueError naming the field, so one bad request
never disturbs the others. It is the only check: `process` validates a
request once, `core_requests` turns what it returned into the
EngineCoreRequests the supervisor and the core carry unchanged (LLMEngine,
AsyncLLM and the OpenAI server all come in this way). `prompt_worth_a_thread`
and `params_worth_a_thread` say when that work is long enough for a caller on
an event loop to move it to a thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylm.config import LoRAConfig, ModelConfig
from raylm.core.structured_output import validate_structured_outputs
from raylm.engine.protocol import EngineCoreRequest
from raylm.lora.registry import AdapterRegistry
from raylm.lora.request import LoRARequest
from raylm.sampling_params import SamplingParams, check_prompt_logprobs_size


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    # vLLM's prompt field: prefix-cache blocks are shared only within one salt.
    cache_salt: str | None = None
    # Its LoRA adapter, checked and stamped with its content digest (raylm.lora.registry).
    lora_request: LoRARequest | None = None


# What `InputProcessor.process` costs, for a caller on an event loop (AsyncLLM)
# that moves the long ones to a thread.
#
# Text prompts up to this many characters are tokenized on the event loop
# (well under a millisecond); longer ones in a thread.
_MAX_INLINE_PROMPT_CHARS = 4096
# bad_words up to this many characters in all are tokenized on the event loop
# (two encodes of a few words); token sequences up to this many ids are
# checked and copied there. Up to the caps (MAX_BAD_WORDS words, 64 K
# characters) it takes tens of milliseconds: in a thread.
_MAX_INLINE_BAD_WORDS_CHARS = 256
_MAX_INLINE_BAD_WORD_TOKENS = 1024


def prompt_worth_a_thread(prompt: Any) -> bool:
    """Whether tokenizing `prompt` takes long enough to move off the event loop."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return False
        prompt = prompt.get("prompt")
    return isinstance(prompt, str) and len(prompt) > _MAX_INLINE_PROMPT_CHARS


def params_worth_a_thread(params: SamplingParams) -> bool:
    """Whether finishing `params` (InputProcessor.finish_params: bad_words
    tokenized, every id checked, the params copied) takes long enough to move
    off the event loop."""
    if params.bad_words_token_ids is not None:  # tokenized already (a server does it in a thread)
        return sum(len(seq) for seq in params.bad_words_token_ids) > _MAX_INLINE_BAD_WORD_TOKENS
    return sum(len(word) for word in params.bad_words or ()) > _MAX_INLINE_BAD_WORDS_CHARS


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, lora_config: LoRAConfig | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        # Adapters checked so far; None: LoRA is off (enable_lora=False).
        self.adapters = None if lora_config is None else AdapterRegistry(model_config.arch, lora_config)
        eos = tokenizer.eos_token_id
        if eos is None:
            arch_eos = model_config.arch.eos_token_id
            eos = arch_eos[0] if isinstance(arch_eos, list) else arch_eos
        self.eos_token_id = eos
        # Extra end-of-sequence ids from config.json and generation_config.json
        # (e.g. chat models list several).
        arch_eos = model_config.arch.eos_token_id
        listed = [*(arch_eos if isinstance(arch_eos, list) else [arch_eos]), *model_config.generation_eos_token_ids]
        self.extra_eos_ids = {t for t in listed if t is not None} - {eos}

    def process(
        self, prompt: Any, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> tuple[ProcessedPrompt, SamplingParams]:
        """Validate one request: its prompt, tokenized and checked, its
        adapter checked, and its params finished (a clone; `params` itself is
        left as it was)."""
        processed = self.process_prompt(prompt, params)
        processed.lora_request = self.check_lora_request(lora_request)
        return processed, self.finish_params(params)

    def check_lora_request(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The request's adapter, loaded once and checked against the base
        model, stamped with its content digest; refused without enable_lora."""
        if lora_request is None:
            return None
        if self.adapters is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters; start it with enable_lora=True")
        return self.adapters.resolve(lora_request)

    def core_requests(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams
    ) -> list[EngineCoreRequest]:
        """The requests for the core of one validated request (from `process`):
        itself, or its n completions as children `{request_id}-{i}`."""
        if params.n == 1:
            return [self._core_request(request_id, prompt, params)]
        requests = []
        for i in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                # Distinct but reproducible streams per completion.
                child_params.seed = params.seed + i
            requests.append(self._core_request(f"{request_id}-{i}", prompt, child_params))
        return requests

    def _core_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id,
            prompt.prompt_token_ids,
            params,
            self.eos_token_id,
            cache_salt=prompt.cache_salt,
            lora_request=prompt.lora_request,
        )

    def process_prompt(self, prompt: Any, params: SamplingParams | None = None) -> ProcessedPrompt:
        """Tokenize and check one prompt; `params` brings truncate_prompt_tokens,
        which applies before the length checks, so a long prompt may fit."""
        if isinstance(prompt, dict):
            cache_salt = _cache_salt(prompt)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                all_ints = isinstance(ids, (list, tuple)) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                )
                if not all_ints:
                    raise ValueError("prompt_token_ids must be a list of integers")
                processed = ProcessedPrompt(prompt.get("prompt"), list(ids), cache_salt)
            elif "prompt" in prompt:
                processed = self.process_prompt(prompt["prompt"], params)
                processed.cache_salt = cache_salt
                return processed
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt must not be empty")
            processed = ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        else:
            raise ValueError(f"prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if params is not None and params.truncate_prompt_tokens is not None:
            processed.prompt_token_ids = self._truncate(processed.prompt_token_ids, params.truncate_prompt_tokens)
        ids = processed.prompt_token_ids
        if not ids:
            raise ValueError("prompt must not be empty (no prompt tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len ({max_len})")
        if params is not None:
            check_prompt_logprobs_size(len(ids), params.prompt_logprobs)
        return processed

    def _truncate(self, ids: list[int], keep: int) -> list[int]:
        # Left truncation, as vLLM does: the end of the prompt is what the
        # continuation depends on most.
        if keep == -1:
            keep = self.model_config.max_model_len
        return list(ids[-keep:])

    def finish_params(self, params: SamplingParams) -> SamplingParams:
        params = params.clone()
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains ids outside the vocabulary [0, {vocab}): {bad}")
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = sorted(t for t in ids if t >= vocab)
            if bad:
                raise ValueError(f"{name} contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        self.tokenize_bad_words(params)
        bad = sorted({t for seq in params.bad_words_token_ids or [] for t in seq if t >= vocab})
        if bad:
            raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be <= the vocabulary size ({vocab}), got {value}")
        validate_structured_outputs(params.structured_outputs)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            # EOS counts as a stop token for min_tokens masking; with
            # ignore_eos it must stay sampleable.
            stop_ids |= {self.eos_token_id} | self.extra_eos_ids
            params.stop_token_ids = sorted(set(params.stop_token_ids) | self.extra_eos_ids)
        stop_ids.discard(None)
        params.all_stop_token_ids = stop_ids
        return params

    def tokenize_bad_words(self, params: SamplingParams) -> None:
        """Fills params.bad_words_token_ids from params.bad_words, unless a
        caller did already: a server does it once per request, in a thread
        (up to MAX_BAD_WORDS words, two encodes each), before the request's
        prompts are processed on the event loop."""
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self._tokenize_bad_words(params.bad_words)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, as vLLM builds them: the word as
        written (without leading spaces), and also with one leading space when
        that spelling is a different word token of the same length (BPE
        vocabularies spell a word inside a sentence with its space)."""
        sequences: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens")
            sequences.append(bare)
            if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
                sequences.append(spaced)
        return sequences


def _cache_salt(prompt: dict) -> str | None:
    salt = prompt.get("cache_salt")
    # As in vLLM: an empty salt is a client mistake, not a secret of its own.
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    return salt
