"""POST /tokenize and /detokenize, as vLLM serves them: the token ids the
server would generate from (a prompt, or chat messages through the chat
template, with the same template fields as /v1/chat/completions), and the
text of token ids.

The body's shape picks the kind: with "messages" it is a chat request, else
a prompt. Unknown fields are a 400, as on the generation endpoints.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raylm.engine.async_llm import AsyncLLM
from raylm.entrypoints.openai.protocol import ChatMessage
from raylm.entrypoints.openai.limits import check_request_chat_template
from raylm.entrypoints.openai.serving_chat import render_chat, run_render
from raylm.entrypoints.openai.serving_common import OpenAIError, check_model

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


async def _body(raw_request: Request) -> Any:
    try:
        return json.loads(await raw_request.body())
    except ValueError as e:
        raise OpenAIError(f"malformed JSON body: {e}", 400) from e


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # The server's handler turns it into a 400 naming the field.
        raise RequestValidationError(e.errors()) from e


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], trust_request_chat_template: bool = False):
        self.engine = engine
        self.served_model_names = served_model_names
        self.trust_request_chat_template = trust_request_chat_template

    def _tokens(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        """Runs in a worker thread: templating and tokenizing can take a while."""
        tokenizer = self.engine.tokenizer
        if isinstance(request, TokenizeChatRequest):
            return render_chat(tokenizer, request)[1]
        return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)

    async def tokenize(self, raw_request: Request) -> TokenizeResponse:
        body = await _body(raw_request)
        kind = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        request = _parse(kind, body)
        check_model(request.model, self.served_model_names)
        if isinstance(request, TokenizeChatRequest):
            check_request_chat_template(request.chat_template, self.trust_request_chat_template)
            tokens = await run_render(request, self._tokens, request)
        else:
            tokens = await asyncio.get_running_loop().run_in_executor(None, self._tokens, request)
        token_strs = self.engine.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.config.model_config.max_model_len,
                                tokens=tokens, token_strs=token_strs)

    async def detokenize(self, raw_request: Request) -> DetokenizeResponse:
        request = _parse(DetokenizeRequest, await _body(raw_request))
        check_model(request.model, self.served_model_names)
        vocab = self.engine.config.model_config.vocab_size
        outside = [t for t in request.tokens if not 0 <= t < vocab]
        if outside:
            raise OpenAIError(f"tokens contains ids outside the vocabulary [0, {vocab}): {outside[:5]}", 400,
                              "tokens")
        prompt = await asyncio.get_running_loop().run_in_executor(None, self.engine.tokenizer.decode,
                                                                  request.tokens)
        return DetokenizeResponse(prompt=prompt)


def install_tokenize_routes(app: FastAPI, engine: AsyncLLM, served_model_names: list[str],
                            trust_request_chat_template: bool = False) -> None:
    serving = OpenAIServingTokenization(engine, served_model_names, trust_request_chat_template)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> TokenizeResponse:
        return await serving.tokenize(raw_request)

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> DetokenizeResponse:
        return await serving.detokenize(raw_request)
