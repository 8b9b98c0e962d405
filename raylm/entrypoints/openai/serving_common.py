"""What both endpoints share: OpenAI-style errors, request fields to
SamplingParams, prompt-length checks, server-sent events, disconnect handling.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from raylm.engine.async_llm import AsyncLLM
from raylm.engine.errors import EngineDeadError
from raylm.engine.input_processor import ProcessedPrompt
from raylm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingFields
from raylm.lora.request import LoRARequest
from raylm.sampling_params import SamplingParams, StructuredOutputsParams

_OPTIONAL_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_TOKEN_CONSTRAINTS = ("logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens")


class OpenAIError(Exception):
    """An error the client should see as an OpenAI-shaped body."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.error_type = error_type or _default_type(status_code)

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status_code, self.param, self.error_type)


def _default_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def error_response(
    message: str, status_code: int = 400, param: str | None = None, error_type: str | None = None
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=error_type or _default_type(status_code), param=param, code=status_code)
    )
    return JSONResponse(body.model_dump(), status_code=status_code)


_FIELD_WORD = re.compile(r"^([a-z_][a-z0-9_]*)\b")


def bad_request_from(error: Exception, known_params: set[str], default_param: str | None = None) -> OpenAIError:
    """A ValueError from the engine names its field first; that is the `param`."""
    message = " ".join(str(error).split()) or type(error).__name__
    match = _FIELD_WORD.match(message)
    param = match.group(1) if match and match.group(1) in known_params else default_param
    return OpenAIError(message, 400, param)


def check_request_fields(request: SamplingFields) -> None:
    """400 naming the first field sent that raylm does not honour (see
    protocol.py, "Request fields")."""
    refused = request.refused_field()
    if refused is not None:
        field, message = refused
        raise OpenAIError(message, 400, field)
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        raise OpenAIError(
            "stream_options.continuous_usage_stats is not supported by this server", 400, "stream_options"
        )


def _token_constraints(request: SamplingFields) -> dict[str, Any]:
    """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens, when
    sent, as SamplingParams arguments (logit_bias keyed by int token id)."""
    kwargs: dict[str, Any] = {}
    for name in _TOKEN_CONSTRAINTS:
        value = getattr(request, name)
        if value is None or (name == "bad_words" and not value):
            continue
        if name == "logit_bias":
            try:
                value = {int(token_id): bias for token_id, bias in value.items()}
            except ValueError:
                raise OpenAIError(
                    "logit_bias keys must be token ids (integers as strings)", 400, "logit_bias"
                ) from None
        kwargs[name] = value
    return kwargs


def sampling_params_from(
    request: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """`defaults` (the model's generation_config.json settings, see
    ModelConfig.default_sampling_params) fill the fields the request leaves unset."""
    kwargs: dict[str, Any] = {
        **(defaults or {}),
        "n": request.n,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "skip_special_tokens": request.skip_special_tokens,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "structured_outputs": structured_outputs,
        **_token_constraints(request),
    }
    for name in _OPTIONAL_FLOATS:
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = value
    if request.top_k is not None:
        kwargs["top_k"] = request.top_k  # 0 (how clients say "no top-k") is SamplingParams' to read
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request_from(e, set(kwargs)) from e


async def tokenize_bad_words(engine: AsyncLLM, params: SamplingParams) -> None:
    """The request's bad_words to token ids, once for all its prompts and
    completions, in a thread (up to MAX_BAD_WORDS words, two encodes each)."""
    if not params.bad_words:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.input_processor.tokenize_bad_words, params)
    except ValueError as e:
        raise bad_request_from(e, set(), "bad_words") from e


async def prepare_prompt(
    engine: AsyncLLM,
    prompt: Any,
    params: SamplingParams,
    requested_max_tokens: int | None,
    prompt_param: str,
    lora_request: LoRARequest | None = None,
) -> tuple[ProcessedPrompt, SamplingParams]:
    """Validate and tokenize (off the loop when long), then fit max_tokens to
    the context: an explicit value that does not fit is the client's
    mistake, a missing one fills it. What it returns goes to the engine as
    is (`submit_all`): the request is not checked again. `lora_request`:
    the adapter its `model` named (serving_lora.py)."""
    try:
        processed, params = await engine.process_prompt(prompt, params, lora_request)
    except (ValueError, TypeError) as e:
        raise bad_request_from(e, {"prompt_token_ids", "prompt_logprobs"}, prompt_param) from e
    return fit_max_tokens(engine, processed, params, requested_max_tokens, prompt_param)


async def submit_all(
    engine: AsyncLLM, requests: list[tuple[ProcessedPrompt, SamplingParams, str]], stream: bool
) -> list[Any]:
    """Submit (prompt, params, request_id), as `prepare_prompt` validated
    them, to the engine now, in order; the streams of their outputs. If one
    fails, the ones already in are aborted."""
    streams = []
    try:
        for prompt, params, request_id in requests:
            streams.append(engine.add_validated_request(request_id, prompt, params, stream=stream))
    except BaseException:
        for submitted in streams:
            submitted.close()
        raise
    return streams


def fit_max_tokens(
    engine: AsyncLLM,
    processed: ProcessedPrompt,
    params: SamplingParams,
    requested_max_tokens: int | None,
    prompt_param: str,
) -> tuple[ProcessedPrompt, SamplingParams]:
    max_model_len = engine.config.model_config.max_model_len
    num_prompt = len(processed.prompt_token_ids)
    room = max_model_len - num_prompt
    if requested_max_tokens is None:
        if room < 1:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens; the prompt is "
                f"{num_prompt} tokens, which leaves no room for a completion.",
                400,
                prompt_param,
            )
        params.max_tokens = room
        if params.min_tokens > room:
            raise OpenAIError(
                f"min_tokens ({params.min_tokens}) exceeds the room left in the context ({room})", 400, "min_tokens"
            )
    elif requested_max_tokens > room:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + requested_max_tokens} tokens ({num_prompt} in the prompt, {requested_max_tokens} "
            f"in the completion). Please reduce the prompt or the completion length.",
            400,
            "max_tokens" if room >= 1 else prompt_param,
        )
    return processed, params


def check_not_ended_early(completions) -> None:
    """A whole (non-streamed) result that the server ended before it finished
    (finish_reason "abort": shutdown ended it) is a 503, not a truncated 200."""
    if any(c.finish_reason == "abort" for c in completions):
        raise OpenAIError(
            "the server is shutting down: the request was ended before it finished", 503, None, "service_unavailable"
        )


def check_model(model: str | None, served_model_names: list[str]) -> str:
    """The model name answered with; an unknown name is a 404, as in OpenAI's
    and vLLM's servers."""
    if model is None or model == "":
        return served_model_names[0]
    if model not in served_model_names:
        raise OpenAIError(
            f"The model `{model}` does not exist; this server serves {served_model_names}.",
            404,
            "model",
            "NotFoundError",
        )
    return model


def model_and_adapter(
    model: str | None, served_model_names: list[str], adapters=None
) -> tuple[str, LoRARequest | None]:
    """(the model name answered with, the LoRA adapter it names): through
    the server's catalogue of adapters (serving_lora.ServedAdapters) when
    it has one, else the base model's names alone."""
    if adapters is not None:
        return adapters.resolve(model)
    return check_model(model, served_model_names), None


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json(exclude_none=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error_event(error: Exception) -> str:
    """An error inside a stream, after the 200 status line went out."""
    if isinstance(error, OpenAIError):
        status, param = error.status_code, error.param
    elif isinstance(error, ValueError):
        status, param = 400, None
    else:
        status, param = (503 if isinstance(error, EngineDeadError) else 500), None
    body = ErrorResponse(error=ErrorInfo(message=str(error), type=_default_type(status), param=param, code=status))
    return sse(body)


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(index, item) from several async iterators as items arrive; closing the
    merged stream cancels (and so aborts) the ones still running."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as e:  # handed to the consumer, who re-raises it
            await queue.put((index, e))
            return
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    pass


async def cancel_on_disconnect(request: Request, coro):
    """Run `coro`, cancelling it if the client hangs up first (which aborts its
    requests in the engine, freeing their KV blocks)."""
    task = asyncio.ensure_future(coro)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
