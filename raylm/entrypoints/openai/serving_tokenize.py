"""POST /tokenize and /detokenize, as vLLM serves them: the token ids the
server would generate from (a prompt, or chat messages through the chat
template, with the same template fields as /v1/chat/completions), and the
text of token ids.

The body's shape picks the kind: with "messages" it is a chat request, else
a prompt. Unknown fields are a 400, as on the generation endpoints.

Bounded as generation requests are (issue 48, finding 7): each is admitted
through the server's admission control (one sequence, counted until its work
is done: a 429 at capacity, a 503 at shutdown); a prompt (or rendered chat)
longer than max_model_len tokens, or ids past it to detokenize, are a 400
naming the field, as /v1/completions answers such a prompt, so an answer never
holds more than max_model_len tokens; and everything past reading the body
(parsing, rendering, tokenizing, the token strings, the answer's JSON) runs in
a thread, the JSON written in slices so that the thread lets go of the GIL
between them: the event loop keeps every stream going meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raylm.engine.async_llm import AsyncLLM
from raylm.entrypoints.openai.limits import AdmissionControl, check_request_chat_template, run_admitted
from raylm.entrypoints.openai.protocol import ChatMessage
from raylm.entrypoints.openai.serving_chat import render_chat, run_render
from raylm.entrypoints.openai.serving_common import OpenAIError, model_and_adapter

_STRICT = ConfigDict(allow_inf_nan=False, extra="forbid")


class TokenizeCompletionRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """The chat template fields of ChatCompletionRequest (see render_chat)."""

    model_config = _STRICT
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _loads(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise OpenAIError(f"malformed JSON body: {e}", 400) from e


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # The server's handler turns it into a 400 naming the field.
        raise RequestValidationError(e.errors()) from e


# What a /tokenize or /detokenize counts against admission: one sequence, as
# a one-prompt completion is counted (it holds a thread and its body's memory
# meanwhile, not a place in a batch, but a flood of them must meet the same 429).
_ADMISSION_COST = 1
# Token ids (or strings) per json.dumps call when an answer is written: a few
# milliseconds of holding the GIL, after which the event loop may run.
_JSON_SLICE = 16384


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _json_list(items: list) -> str:
    """_dumps(items), in slices: each is one C call that holds the GIL."""
    return "[" + ",".join(_dumps(items[i : i + _JSON_SLICE])[1:-1] for i in range(0, len(items), _JSON_SLICE)) + "]"


def _json_response(fields: dict[str, Any]) -> Response:
    """A JSON answer, its lists written by _json_list, made where it is
    called (a thread): the loop only sends its bytes."""
    body = ",".join(
        f"{_dumps(name)}:{_json_list(value) if isinstance(value, list) else _dumps(value)}"
        for name, value in fields.items()
    )
    return Response(("{" + body + "}").encode(), media_type="application/json")


class OpenAIServingTokenization:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        trust_request_chat_template: bool = False,
        admission: AdmissionControl | None = None,
    ):
        self.engine = engine
        self.served_model_names = served_model_names
        self.trust_request_chat_template = trust_request_chat_template
        self.admission = admission or AdmissionControl.for_engine(engine)
        self.adapters = None  # the LoRA adapters served by name (serving_lora.ServedAdapters), if any

    def _max_model_len(self) -> int:
        return self.engine.config.model_config.max_model_len

    def _parse_tokenize(self, body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
        """In a thread: a body may be up to the server's limit (16 MiB)."""
        body = _loads(body)
        kind = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        request = _parse(kind, body)
        model_and_adapter(request.model, self.served_model_names, self.adapters)
        if isinstance(request, TokenizeChatRequest):
            check_request_chat_template(request.chat_template, self.trust_request_chat_template)
        return request

    def _tokenize_answer(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        """In a thread: templating, tokenizing and the answer's JSON can take a while."""
        tokenizer = self.engine.tokenizer
        if isinstance(request, TokenizeChatRequest):
            field, tokens = "messages", render_chat(tokenizer, request)[1]
        else:
            field, tokens = "prompt", tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        max_model_len = self._max_model_len()
        if len(tokens) > max_model_len:
            # As /v1/completions refuses such a prompt (the input processor's words).
            raise OpenAIError(
                f"{field} is {len(tokens)} tokens, longer than max_model_len ({max_model_len})", 400, field
            )
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return _json_response(
            {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}
        )

    def _detokenize_answer(self, body: bytes) -> Response:
        """In a thread, from the body on: a list of ids may be up to the body limit."""
        request = _parse(DetokenizeRequest, _loads(body))
        model_and_adapter(request.model, self.served_model_names, self.adapters)
        max_model_len = self._max_model_len()
        if len(request.tokens) > max_model_len:
            raise OpenAIError(
                f"tokens: at most max_model_len ({max_model_len}) ids, got {len(request.tokens)}", 400, "tokens"
            )
        vocab = self.engine.config.model_config.vocab_size
        outside = [t for t in request.tokens if not 0 <= t < vocab]
        if outside:
            raise OpenAIError(f"tokens contains ids outside the vocabulary [0, {vocab}): {outside[:5]}", 400, "tokens")
        return _json_response({"prompt": self.engine.tokenizer.decode(request.tokens)})

    async def _tokenize(self, body: bytes) -> Response:
        loop = asyncio.get_running_loop()
        request = await loop.run_in_executor(None, self._parse_tokenize, body)
        if isinstance(request, TokenizeChatRequest):
            # A request's own template renders in the executor kept for those.
            return await run_render(request, self._tokenize_answer, request)
        return await loop.run_in_executor(None, self._tokenize_answer, request)

    async def _detokenize(self, body: bytes) -> Response:
        return await asyncio.get_running_loop().run_in_executor(None, self._detokenize_answer, body)

    async def tokenize(self, raw_request: Request) -> Response:
        body = await raw_request.body()
        return await run_admitted(self.admission, _ADMISSION_COST, None, lambda: self._tokenize(body))

    async def detokenize(self, raw_request: Request) -> Response:
        body = await raw_request.body()
        return await run_admitted(self.admission, _ADMISSION_COST, None, lambda: self._detokenize(body))


def install_tokenize_routes(
    app: FastAPI,
    engine: AsyncLLM,
    served_model_names: list[str],
    trust_request_chat_template: bool = False,
    admission: AdmissionControl | None = None,
) -> None:
    """`admission`: the generation requests' (app.state.admission, where the
    app has one); else one of their own. A model name may be a LoRA
    adapter's the app serves (app.state.adapters): its tokenizer is the base's."""
    admission = admission or getattr(app.state, "admission", None)
    serving = OpenAIServingTokenization(engine, served_model_names, trust_request_chat_template, admission)
    serving.adapters = getattr(app.state, "adapters", None)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(raw_request: Request) -> Response:
        return await serving.tokenize(raw_request)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(raw_request: Request) -> Response:
        return await serving.detokenize(raw_request)
