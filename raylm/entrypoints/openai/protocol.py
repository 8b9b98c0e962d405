"""Pydantic models of the OpenAI API subset raylm serves: completions, chat
completions, models, errors; plus vLLM's extra request fields (top_k, ...).

Bounds here keep values the engine could not carry (ints past 64 bits, NaN)
out, so a client mistake is a 400, never an engine failure.

Nothing a client sends is silently dropped: every field of vLLM's completion
and chat requests is honoured (declared on the models below), refused with a
400 unless it holds the value that changes nothing (UNSUPPORTED_FIELDS), or
accepted as carrying no meaning for generation (NO_EFFECT_FIELDS); any other
field is a 400, as in OpenAI's API. See "Request fields" below.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

# Seeds feed torch generators (64-bit), plus one per extra completion of n.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1 - 1024
_INT32_MAX = 2**31 - 1
MAX_N = 128
MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # NaN and infinity are valid Python JSON but never a valid sampling value.
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's usage on every chunk: not implemented, refused when true.
    continuous_usage_stats: bool = False


# ---- Request fields ----------------------------------------------------------
# Fields of OpenAI's and vLLM's requests that carry no meaning for generation
# (bookkeeping for the client or OpenAI's platform): accepted and ignored.
NO_EFFECT_FIELDS: dict[str, str] = {
    "user": "an end-user id for the client's abuse monitoring",
    "metadata": "tags OpenAI stores with the completion",
    "store": "whether OpenAI stores the completion",
    "service_tier": "OpenAI's processing tier",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "OpenAI's cache routing hint",
    # vLLM names its engine request after it; raylm's ids stay its own, so
    # that two clients choosing the same id cannot collide in the engine.
    "request_id": "a client-chosen id for logs",
    # vLLM ignores it outside its /render endpoints.
    "return_token_offsets": "offsets for vLLM's /render endpoints only",
}

# vLLM fields raylm does not implement, with the values that leave generation
# unchanged (vLLM's defaults, which clients often send explicitly). Any other
# value is refused: 400 "<field> is not supported".
_UNSUPPORTED_BOTH: dict[str, tuple] = {
    "use_beam_search": (False,),
    "best_of": (None, 1),
    "length_penalty": (1.0, 1),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (None,),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "priority": (0,),
    "mm_processor_kwargs": (None,),
    "guided_decoding_backend": (None, "xgrammar", "auto"),
}
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple] = {
    **_UNSUPPORTED_BOTH,
    "structural_tag": (None,),
    "max_repetition_pattern_size": (0,),
    "min_repetition_pattern_size": (0,),
    "repetition_min_count": (0,),
}
UNSUPPORTED_COMPLETION_FIELDS: dict[str, tuple] = {
    **_UNSUPPORTED_BOTH,
    "suffix": (None,),
    "prompt_embeds": (None,),
    "truncation_side": (None, "left"),  # truncate_prompt_tokens keeps the last tokens
    "logprob_token_ids": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
    "ec_transfer_params": (None,),
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    # By type too: True == 1 must not pass for best_of=1.
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


def refused_field(declared: set[str], sent: dict[str, Any], unsupported: dict[str, tuple]) -> tuple[str, str] | None:
    """(field, message) for the first field of a request body that raylm
    refuses, or None. `sent`: the fields not declared on the model."""
    for name, value in sent.items():
        if name in declared or name in NO_EFFECT_FIELDS:
            continue
        if name in unsupported:
            if not _is_neutral(value, unsupported[name]):
                return name, f"{name} is not supported by this server"
            continue
        return name, f"Unrecognized request argument supplied: {name}"
    return None


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    # "schema" on the wire; the attribute name would shadow BaseModel.schema.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    # "text", "json_object" or "json_schema"; others are refused when mapped.
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` object (raylm's StructuredOutputsParams);
    vLLM's other knobs in it (structural_tag, ...) are unknown fields here,
    so a 400."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", populate_by_name=True)
    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # None: the server's default (--structured-outputs-config), else bounded whitespace.
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


class SamplingFields(OpenAIModel):
    """The sampling knobs both endpoints share (OpenAI's and vLLM's extras).

    Fields not declared here are kept (extra="allow") so that the server can
    refuse them by name (refused_field), rather than drop them unseen."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=1e6)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, le=1e6)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Token constraints (SamplingParams fields of the same names); logit_bias
    # keys are token ids as strings, as OpenAI sends them.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT32_MAX)
    # Prefix-cache blocks are shared only among requests with the same salt.
    cache_salt: str | None = Field(None, min_length=1)
    # Structured outputs: at most one of these (StructuredOutputsParams).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's older spelling of structured_outputs.whitespace_pattern.
    guided_whitespace_pattern: str | None = None
    # The server's structured-output defaults, set by the app, never by the client.
    _structured_outputs_defaults: Any = PrivateAttr(None)

    def refused_field(self) -> tuple[str, str] | None:
        """(field, message) of the first field sent that raylm refuses."""
        unsupported = (
            UNSUPPORTED_CHAT_FIELDS if isinstance(self, ChatCompletionRequest) else UNSUPPORTED_COMPLETION_FIELDS
        )
        return refused_field(set(type(self).model_fields), self.model_extra or {}, unsupported)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, le=_INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # False: a text prompt is tokenized without BOS (and other added tokens).
    add_special_tokens: bool = True


# ---- Tool calling (rendering, choice and parsing: serving_tools.py) ----------
class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON schema of the arguments; none means the function takes none.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn's calls (its content may then be null) ...
    tool_calls: list[ToolCall] | None = None
    # ... and, on a role "tool" message, the call it answers.
    tool_call_id: str | None = None

    def text(self) -> str:
        """Text content; a list of parts must be text parts only."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, le=_INT32_MAX)
    max_completion_tokens: int | None = Field(None, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # The last (assistant) message is left open for the model to continue.
    continue_final_message: bool = False
    # The reply starts with the last message's content when that is the
    # assistant's (with continue_final_message: the whole continued message).
    echo: bool = False
    # Special tokens (BOS) added on top of what the template writes.
    add_special_tokens: bool = False
    # Per request: a template replacing the tokenizer's, and extra variables
    # for it (vLLM passes documents and reasoning_effort to it too).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # Tool calling; tool_choice defaults to "auto" when tools are given, else "none".
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # With --reasoning-parser: false leaves the thinking out of the reply.
    include_reasoning: bool = True


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    # The model's thinking (--reasoning-parser), apart from its answer.
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raylm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
