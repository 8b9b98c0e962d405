"""POST /v1/completions: one or more prompts (text or token ids), n completions
each, whole or streamed as server-sent events; echo and logprobs as in OpenAI."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.engine.async_llm import AsyncLLM
from raylm.engine.input_processor import ProcessedPrompt
from raylm.entrypoints.openai.limits import (
    AdmissionControl,
    ReleasingStreamingResponse,
    check_prompt_count,
    check_stop,
)
from raylm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from raylm.entrypoints.openai.serving_common import (
    SSE_DONE,
    OpenAIError,
    cancel_on_disconnect,
    check_not_ended_early,
    check_request_fields,
    merge_streams,
    model_and_adapter,
    prepare_prompt,
    sampling_params_from,
    sse,
    stream_error_event,
    submit_all,
    tokenize_bad_words,
)
from raylm.entrypoints.openai.structured_outputs import checked_structured_outputs
from raylm.log_text import loggable
from raylm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from raylm.sampling_params import check_prompt_logprobs_size

logger = logging.getLogger(__name__)


def _split_prompts(prompt: Any) -> list[Any]:
    """The request's prompts as engine inputs: text, or {"prompt_token_ids": ...}."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", 400, "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    check_prompt_count(len(prompt))
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def _without_special_tokens(tokenizer, prompts: list[Any]) -> list[Any]:
    """Text prompts tokenized without the tokens the tokenizer adds (BOS);
    prompts given as token ids are the client's own already."""
    return [
        {"prompt": p, "prompt_token_ids": tokenizer.encode(p, add_special_tokens=False)} if isinstance(p, str) else p
        for p in prompts
    ]


def completion_logprobs(
    tokenizer, token_ids: list[int], positions: list[PositionLogprobs | None], start_offset: int
) -> CompletionLogprobs:
    """OpenAI's parallel lists; a position without logprobs (the first prompt token) gets None."""
    result = CompletionLogprobs()
    offset = start_offset
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else tokenizer.decode([token_id])
        result.tokens.append(text)
        result.token_logprobs.append(chosen.logprob if chosen else None)
        top = None
        if position:
            top = {}
            # The chosen token comes first; a later token that decodes alike ("\ufffd") must not hide it.
            for lp in position.values():
                top.setdefault(lp.decoded_token or "", lp.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _check_prompt_logprobs(prepared: list[tuple[ProcessedPrompt, Any]], prompt_logprobs: int | None) -> None:
    """Echo with logprobs over all of a request's prompts: each prompt is
    checked alone at intake, the request's total here."""
    positions = sum(len(prompt.prompt_token_ids) for prompt, _ in prepared)
    try:
        check_prompt_logprobs_size(positions, prompt_logprobs)
    except ValueError as e:
        raise OpenAIError(f"echo with logprobs: {e}", 400, "logprobs") from e


class OpenAIServingCompletion:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        admission: AdmissionControl | None = None,
        adapters=None,
    ):
        """`adapters`: the LoRA adapters served by name (serving_lora.ServedAdapters), if any."""
        self.engine = engine
        self.served_model_names = served_model_names
        self.adapters = adapters
        self.admission = admission or AdmissionControl.for_engine(engine)

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        model, lora_request = model_and_adapter(request.model, self.served_model_names, self.adapters)
        check_request_fields(request)
        if request.echo and request.stream and request.logprobs is not None and request.n > 1:
            # Keeps echo bookkeeping to one choice per prompt; rare in practice.
            raise OpenAIError("echo with logprobs supports n=1 only when streaming", 400, "echo")
        prompts = _split_prompts(request.prompt)
        if not request.add_special_tokens:
            prompts = await asyncio.get_running_loop().run_in_executor(
                None, _without_special_tokens, self.engine.tokenizer, prompts
            )
        if request.cache_salt is not None:
            prompts = [
                {"prompt": p, "cache_salt": request.cache_salt}
                if isinstance(p, str)
                else {**p, "cache_salt": request.cache_salt}
                for p in prompts
            ]
        check_stop(request.stop)
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        structured_outputs = await checked_structured_outputs(request)
        base_params = sampling_params_from(
            request,
            request.max_tokens,
            request.logprobs,
            prompt_logprobs,
            structured_outputs=structured_outputs,
            defaults=self.engine.config.model_config.default_sampling_params,
        )
        # Admitted before tokenizing, so that a burst of arrivals is counted at once.
        reservation = self.admission.admit(len(prompts) * request.n, "n" if request.n > 1 else "prompt")
        streams = None
        try:
            await tokenize_bad_words(self.engine, base_params)  # once, for every prompt's clone
            prepared = []
            for prompt in prompts:
                prepared.append(await self._prepare(prompt, base_params.clone(), request.max_tokens, lora_request))
            _check_prompt_logprobs(prepared, prompt_logprobs)
            request_id = random_id("cmpl")
            streams = await submit_all(
                self.engine,
                [(prompt, params, f"{request_id}-{i}") for i, (prompt, params) in enumerate(prepared)],
                request.stream,
            )
            if request.stream:
                response = ReleasingStreamingResponse(
                    reservation,
                    self._stream(request, model, request_id, streams),
                    media_type="text/event-stream",
                    streams=streams,
                )
                reservation = streams = None  # the response releases and closes them once sent
                return response
            outputs: dict[int, RequestOutput] = await cancel_on_disconnect(raw_request, self._collect(streams))
            check_not_ended_early(c for output in outputs.values() for c in output.outputs)
            return JSONResponse(self._response(request, model, request_id, outputs).model_dump())
        finally:
            if reservation is not None:
                reservation.release()
            for stream in streams or ():
                stream.close()

    async def _prepare(self, prompt: Any, params, max_tokens: int | None, lora_request) -> tuple[ProcessedPrompt, Any]:
        try:
            return await prepare_prompt(self.engine, prompt, params, max_tokens, "prompt", lora_request)
        except OpenAIError as e:
            if e.param != "prompt_logprobs":
                raise
            # The client asked for them as echo with logprobs.
            raise OpenAIError(f"echo with logprobs: {e.message}", 400, "logprobs") from e

    @staticmethod
    async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> dict[int, RequestOutput]:
        return {index: output async for index, output in merge_streams(streams)}

    def _echo_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids)

    def _choice(
        self, request: CompletionRequest, output: RequestOutput, completion: CompletionOutput, index: int, echo: bool
    ) -> CompletionChoice:
        text, logprobs = completion.text, None
        prefix = self._echo_text(output) if echo else ""
        if request.logprobs is not None:
            token_ids, positions = list(completion.token_ids), list(completion.logprobs or [])
            if echo and output.prompt_logprobs is not None:
                token_ids = output.prompt_token_ids + token_ids
                positions = list(output.prompt_logprobs) + positions
            logprobs = completion_logprobs(self.engine.tokenizer, token_ids, positions, 0)
        return CompletionChoice(
            index=index,
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _response(
        self, request: CompletionRequest, model: str, request_id: str, outputs: dict[int, RequestOutput]
    ) -> CompletionResponse:
        choices, usage = [], UsageInfo()
        for prompt_index in sorted(outputs):
            output = outputs[prompt_index]
            usage.prompt_tokens += len(output.prompt_token_ids)
            for completion in output.outputs:
                usage.completion_tokens += len(completion.token_ids)
                index = prompt_index * request.n + completion.index
                choices.append(self._choice(request, output, completion, index, request.echo))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(
        self, request: CompletionRequest, model: str, request_id: str, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[str]:
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        finished: set[int] = set()
        echoed: set[int] = set()
        try:
            async for prompt_index, output in merge_streams(streams):
                prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    if index in finished:
                        continue
                    if not completion.token_ids and not completion.text and completion.finish_reason is None:
                        continue
                    completion_tokens += len(completion.token_ids)
                    echo = request.echo and index not in echoed
                    echoed.add(index)
                    if completion.finish_reason is not None:
                        finished.add(index)
                    choice = self._choice(request, output, completion, index, echo)
                    yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
            if request.stream_options and request.stream_options.include_usage:
                total = sum(prompt_tokens.values()) + completion_tokens
                usage = UsageInfo(
                    prompt_tokens=sum(prompt_tokens.values()), completion_tokens=completion_tokens, total_tokens=total
                )
                yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
        except Exception as e:  # the status line is gone; the stream itself must say it failed
            logger.warning("completion stream %s failed: %s", loggable(request_id), loggable(e))
            yield stream_error_event(e)
        yield SSE_DONE
