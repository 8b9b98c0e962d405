"""POST /v1/chat/completions: messages rendered with the model's chat template
(tokenizer.apply_chat_template), n choices, whole or streamed as deltas."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.chat_template import ChatTemplateNotBounded, render_bounded
from raylm.chat_template_budget import ChatTemplateRenderError
from raylm.engine.async_llm import AsyncLLM
from raylm.engine.input_processor import ProcessedPrompt
from raylm.engine.tokenizer import encode_rendered_chat
from raylm.entrypoints.openai.limits import (
    AdmissionControl,
    ReleasingStreamingResponse,
    check_request_chat_template,
    check_stop,
)
from raylm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from raylm.entrypoints.openai.reasoning_parsers import END_TAG, ReasoningStream, get_reasoning_parser
from raylm.entrypoints.openai.serving_common import (
    SSE_DONE,
    OpenAIError,
    bad_request_from,
    cancel_on_disconnect,
    check_not_ended_early,
    check_request_fields,
    fit_max_tokens,
    model_and_adapter,
    sampling_params_from,
    sse,
    stream_error_event,
    tokenize_bad_words,
)
from raylm.entrypoints.openai.serving_tools import (
    ToolCallConfig,
    ToolPlan,
    add_tool_fields,
    plan_tools,
    tools_for_template,
)
from raylm.entrypoints.openai.structured_outputs import checked_structured_outputs
from raylm.log_text import loggable
from raylm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_k: int) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        if chosen is None:
            continue
        top = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= top_k), key=lambda lp: lp.rank
        )
        content.append(
            TokenLogprob(
                token=chosen.decoded_token or "",
                logprob=chosen.logprob,
                bytes=list((chosen.decoded_token or "").encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode("utf-8")),
                    )
                    for lp in top[:top_k]
                ],
            )
        )
    return ChatLogprobs(content=content)


# apply_chat_template's own arguments, which chat_template_kwargs must not
# set: each is the server's business or has a request field of its own.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "documents",
        "tools",
    }
)


def conversation_of(request) -> list[dict]:
    """The messages as the chat template reads them."""
    conversation = [{"role": m.role, "content": m.text()} for m in request.messages]
    add_tool_fields(conversation, request.messages)
    return conversation


def render_chat(tokenizer, request) -> tuple[str, list[int]]:
    """(text, token ids) of a request's messages through the chat template,
    with its template fields (add_generation_prompt, continue_final_message,
    chat_template, chat_template_kwargs, documents, reasoning_effort,
    add_special_tokens); for /v1/chat/completions and /tokenize alike.
    Bounded in time, work and output (raylm.chat_template.render_bounded)."""
    if not (request.chat_template or getattr(tokenizer, "chat_template", None)):
        raise OpenAIError("the model's tokenizer has no chat template", 400, "messages")
    if request.continue_final_message and request.add_generation_prompt:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt to false)",
            400,
            "continue_final_message",
        )
    variables = dict(request.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(variables))
    if reserved:
        raise OpenAIError(f"chat_template_kwargs must not set {', '.join(reserved)}", 400, "chat_template_kwargs")
    if request.reasoning_effort is not None:
        variables["reasoning_effort"] = request.reasoning_effort
    tools = tools_for_template(getattr(request, "tools", None), request.chat_template or tokenizer.chat_template)
    try:
        text = render_bounded(
            tokenizer,
            conversation_of(request),
            tools=tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            documents=request.documents,
            **variables,
        )
    except ChatTemplateRenderError as e:
        raise OpenAIError(str(e), 400, "chat_template" if request.chat_template is not None else "messages") from e
    except ChatTemplateNotBounded:
        raise  # the server's fault, not the request's
    except Exception as e:  # jinja raises its own types for unsupported conversations
        raise OpenAIError(f"messages could not be rendered with the chat template: {e}", 400, "messages") from e
    if request.add_special_tokens:
        return text, tokenizer.encode(text, add_special_tokens=True)
    return text, encode_rendered_chat(tokenizer, text)


# Renders of request-supplied templates (--trust-request-chat-template) get
# threads of their own: each may run up to its CPU limit, and a client sending
# many must not hold up the tokenizing and rendering of everyone else's
# requests in the default executor. Two: the machine's cores are the engine's.
_REQUEST_TEMPLATE_THREADS = 2
_request_template_executor: ThreadPoolExecutor | None = None


def _executor_for(request) -> ThreadPoolExecutor | None:
    global _request_template_executor
    if request.chat_template is None:
        return None  # the loop's default executor
    if _request_template_executor is None:
        _request_template_executor = ThreadPoolExecutor(
            _REQUEST_TEMPLATE_THREADS, thread_name_prefix="raylm-request-template"
        )
    return _request_template_executor


async def run_render(request, function: Callable[..., Any], *args: Any) -> Any:
    """function(*args) off the event loop: rendering is the request's work."""
    return await asyncio.get_running_loop().run_in_executor(_executor_for(request), function, *args)


def _split_delta(stream: ReasoningStream, text: str, done: bool) -> tuple[str, str]:
    """(thinking, answer) of one streamed delta; at the end, whatever was held back."""
    piece = stream.feed(text)
    if done:
        tail = stream.finish()
        piece.reasoning += tail.reasoning
        piece.content += tail.content
    return piece.reasoning, piece.content


def echoed_text(request: ChatCompletionRequest) -> str:
    """With echo, the reply starts with the last message when it is the
    assistant's (vLLM's behaviour): the text continue_final_message continues."""
    if request.echo and request.messages[-1].role == "assistant":
        return request.messages[-1].text()
    return ""


class OpenAIServingChat:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        admission: AdmissionControl | None = None,
        tool_config: ToolCallConfig | None = None,
        trust_request_chat_template: bool = False,
        reasoning_parser: str | None = None,
        adapters=None,
    ):
        """`reasoning_parser`: --reasoning-parser's name, or None (the thinking stays in the content).
        `adapters`: the LoRA adapters served by name (serving_lora.ServedAdapters), if any."""
        self.engine = engine
        self.adapters = adapters
        self.served_model_names = served_model_names
        self.admission = admission or AdmissionControl.for_engine(engine)
        self.tool_config = tool_config or ToolCallConfig()
        self.trust_request_chat_template = trust_request_chat_template
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self._reasoning_end_ids: list[int] | None = None

    def _reasoning_plan(
        self, processed: ProcessedPrompt, request: ChatCompletionRequest, params: SamplingParams
    ) -> tuple[bool, SamplingParams]:
        """(whether the reply starts inside the thinking, params): a grammar
        (response_format, tool_choice, ...) holds only after the thinking
        ends, unless the prompt closed it already (thinking switched off)."""
        state = self.reasoning_parser.prompt_state(processed.prompt, request.chat_template_kwargs)
        if params.structured_outputs is not None and state != "closed":
            if self._reasoning_end_ids is None:
                self._reasoning_end_ids = self.engine.tokenizer.encode(END_TAG, add_special_tokens=False)
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, starts_after_token_ids=self._reasoning_end_ids
            )
        return self.reasoning_parser.reply_starts_in_reasoning(state), params

    def _split(self, text: str, in_reasoning: bool, request: ChatCompletionRequest) -> tuple[str | None, str]:
        """(thinking, answer) of a whole reply."""
        if self.reasoning_parser is None:
            return None, text
        split = self.reasoning_parser.split(text, in_reasoning)
        return (split.reasoning if request.include_reasoning else None), split.content

    def _render(
        self, request: ChatCompletionRequest, params: SamplingParams, lora_request=None
    ) -> tuple[ProcessedPrompt, SamplingParams]:
        """Runs in a worker thread: templating and tokenizing can take a while.
        The request's validation (InputProcessor.process), once: `params`
        brings truncate_prompt_tokens, which applies to the rendered
        conversation, and comes back finished."""
        text, ids = render_chat(self.engine.tokenizer, request)
        return self.engine.input_processor.process(
            {"prompt": text, "prompt_token_ids": ids, "cache_salt": request.cache_salt}, params, lora_request
        )

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model, lora_request = model_and_adapter(request.model, self.served_model_names, self.adapters)
        check_request_fields(request)
        check_request_chat_template(request.chat_template, self.trust_request_chat_template)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        top_logprobs = request.top_logprobs or 0
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        check_stop(request.stop)
        structured_outputs = await checked_structured_outputs(request)
        params = sampling_params_from(
            request,
            max_tokens,
            top_logprobs if request.logprobs else None,
            structured_outputs=structured_outputs,
            defaults=self.engine.config.model_config.default_sampling_params,
        )
        tool_plan = plan_tools(request, self.tool_config)
        params = await asyncio.get_running_loop().run_in_executor(None, tool_plan.apply, params)
        # Admitted before rendering, so that a burst of arrivals is counted at once.
        reservation = self.admission.admit(request.n, "n")
        stream = None
        try:
            await tokenize_bad_words(self.engine, params)
            try:
                processed, params = await run_render(request, self._render, request, params, lora_request)
            except ValueError as e:
                raise bad_request_from(e, set(), "messages") from e
            param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            try:
                processed, params = fit_max_tokens(self.engine, processed, params, max_tokens, "messages")
            except OpenAIError as e:
                e.param = param if e.param == "max_tokens" else e.param
                raise
            in_reasoning = False
            if self.reasoning_parser is not None:
                in_reasoning, params = self._reasoning_plan(processed, request, params)
            request_id = random_id("chatcmpl")
            stream = self.engine.add_validated_request(request_id, processed, params, stream=request.stream)
            if request.stream:
                response = ReleasingStreamingResponse(
                    reservation,
                    self._stream(request, model, request_id, stream, top_logprobs, tool_plan, in_reasoning),
                    media_type="text/event-stream",
                    streams=[stream],
                )
                reservation = stream = None  # the response releases and closes them once sent
                return response
            output = await cancel_on_disconnect(raw_request, self._last(stream))
            check_not_ended_early(output.outputs)
            return JSONResponse(
                self._response(request, model, request_id, output, top_logprobs, tool_plan, in_reasoning).model_dump()
            )
        finally:
            if reservation is not None:
                reservation.release()
            if stream is not None:
                stream.close()

    @staticmethod
    async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        output = None
        async for item in stream:
            output = item
        return output

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput, top_k: int
    ) -> ChatLogprobs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs or [], top_k)

    def _response(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        output: RequestOutput,
        top_k: int,
        tool_plan: ToolPlan,
        in_reasoning: bool = False,
    ) -> ChatCompletionResponse:
        choices = []
        echo = echoed_text(request)
        for completion in output.outputs:
            reasoning, answer = self._split(completion.text, in_reasoning, request)
            message, finish_reason = tool_plan.message(answer, completion.finish_reason)
            message.reasoning_content = reasoning
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(request, completion, top_k),
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        usage = UsageInfo(
            prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(output.prompt_token_ids) + completion_tokens,
        )
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
        top_k: int,
        tool_plan: ToolPlan,
        in_reasoning: bool = False,
    ) -> AsyncIterator[str]:
        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]))

        prompt_tokens = completion_tokens = 0
        finished: set[int] = set()
        choice_streams = [tool_plan.stream() for _ in range(request.n)]
        reasoning_streams = (
            [self.reasoning_parser.streaming(in_reasoning) for _ in range(request.n)]
            if self.reasoning_parser is not None
            else None
        )
        try:
            # The role comes first, in a delta of its own, as OpenAI sends it.
            echo = echoed_text(request)
            for index in range(request.n):
                yield chunk(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))
                if echo:
                    yield chunk(ChatStreamChoice(index=index, delta=ChatDelta(content=echo)))
            async for output in stream:
                prompt_tokens = len(output.prompt_token_ids)
                for completion in output.outputs:
                    if completion.index in finished:
                        continue
                    if not completion.token_ids and not completion.text and completion.finish_reason is None:
                        continue
                    completion_tokens += len(completion.token_ids)
                    if completion.finish_reason is not None:
                        finished.add(completion.index)
                    choice_stream = choice_streams[completion.index]
                    done = completion.finish_reason is not None
                    reasoning, answer = "", completion.text
                    if reasoning_streams is not None:
                        reasoning, answer = _split_delta(reasoning_streams[completion.index], answer, done)
                        reasoning = reasoning if request.include_reasoning else ""
                    # None: held back (a tool parser waits for more text), or nothing of the answer yet.
                    delta = choice_stream.step(answer, done) if answer or done else None
                    if reasoning:
                        delta = delta or ChatDelta()
                        delta.reasoning_content = reasoning
                    if delta is None and completion.finish_reason is None and not request.logprobs:
                        continue
                    yield chunk(
                        ChatStreamChoice(
                            index=completion.index,
                            delta=delta or ChatDelta(),
                            logprobs=self._logprobs(request, completion, top_k),
                            finish_reason=choice_stream.finish_reason(completion.finish_reason),
                        )
                    )
            if request.stream_options and request.stream_options.include_usage:
                usage = UsageInfo(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                )
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        except Exception as e:  # the status line is gone; the stream itself must say it failed
            logger.warning("chat stream %s failed: %s", loggable(request_id), loggable(e))
            yield stream_error_event(e)
        yield SSE_DONE
