"""The server's bounds: how much work it admits, how big a request body may be,
and what one request may ask for. Past a bound the client gets a clear refusal
(OpenAI-style error body), never a slow death of the server.

- Admission (`AdmissionControl`): the server holds at most
  `max_num_seqs x serving replicas + max_waiting_requests` sequences: what
  the engine can run at once plus a bounded queue. The replicas are counted
  at each admission (`running_capacity`), so the bound follows `/scale`, the
  autoscaler and replicas that leave or restart. Sequences are counted as the
  scheduler counts them: each of a request's `n` completions, for each of its
  prompts, is one. A request arriving when they would not fit is answered 429
  with `Retry-After`; one that could never fit (its prompts x n alone exceed the
  bound) is a 400. Requests are counted from admission (before tokenizing)
  until their response is sent, so a burst of arrivals cannot all slip past
  the check while they tokenize. /tokenize and /detokenize are admitted too,
  as one sequence each, counted until their work (which runs in a thread) is
  done, even if the client has gone (`run_admitted`). Once shutdown starts,
  new requests get 503.
- Request bodies (`BodySizeLimitMiddleware`): a declared Content-Length past
  the limit is a 413 before a byte is read; a body that grows past it while it
  streams in (chunked encoding, or a client sending more than it declared) is
  a 413 as soon as it does.
- Per request (`check_prompt_count`, `check_stop`, and `n` in protocol.py):
  at most MAX_PROMPTS_PER_REQUEST prompts, n <= MAX_N, at most
  MAX_STOP_STRINGS stop strings of at most MAX_STOP_STRING_CHARS characters;
  a 400 naming the field. OpenAI allows 4 stop strings and n <= 128; raylm
  allows more stop strings (vLLM sets no bound) but not unboundedly many, as
  every generated token is checked against each of them.
- Request-supplied chat templates (`check_request_chat_template`): refused
  (400 naming `chat_template`) unless the server runs with
  --trust-request-chat-template (vLLM's flag), and then at most
  MAX_REQUEST_CHAT_TEMPLATE_CHARS long. Every render, the model's template
  too, is bounded in CPU time, work and output (raylm.chat_template).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raylm.entrypoints.openai.serving_common import OpenAIError, error_response

# A queue 16 full batches deep (at the default --max-num-seqs 256): a request at
# its back starts within ~16 generations' time, and waiting requests cost little
# memory (their prompt tokens). Past that, a 429 lets a load balancer or client
# go elsewhere instead of every request's latency growing without bound.
DEFAULT_MAX_WAITING_REQUESTS = 4096
# A full-context prompt as JSON token ids is ~1 MiB at 128k tokens; 16 MiB
# leaves room for many prompts per request, and bounds what a client can make
# the server buffer.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
# One request never brings more prompts than a default full batch.
MAX_PROMPTS_PER_REQUEST = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# Real chat templates are a few KiB (the longest common ones ~20 KiB); parsing
# and compiling one costs time proportional to its length.
MAX_REQUEST_CHAT_TEMPLATE_CHARS = 128 * 1024
# What a 429 suggests: a slot frees up as soon as any request finishes.
RETRY_AFTER_S = 1
# Before a 413, the rest of an oversized body is read and dropped, up to another
# limit's worth and this long: most clients send the whole body before reading
# the answer, and a server that closes on unread data resets the connection,
# which loses the answer. A larger body gets the answer at once, then a close.
DRAIN_TIME_S = 2.0


@dataclass
class ServerLimits:
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")


class Overloaded(OpenAIError):
    """429: the engine's queue is full; retry later."""

    def __init__(self, message: str):
        super().__init__(message, 429, None, "rate_limit_exceeded")

    def response(self):
        response = super().response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


class ShuttingDown(OpenAIError):
    """503: the server no longer takes requests."""

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(message, 503, None, "service_unavailable")

    def response(self):
        response = super().response()
        response.headers["Connection"] = "close"
        return response


class Reservation:
    """A request's share of the admission bound; `release` (idempotent) gives it back."""

    def __init__(self, admission: AdmissionControl, cost: int):
        self._admission = admission
        self.cost = cost

    def release(self) -> None:
        if self._admission is not None:
            self._admission._release(self.cost)
            self._admission = None


class AdmissionControl:
    """Counts the sequences the server has admitted and not yet answered."""

    def __init__(
        self,
        max_running: int | Callable[[], int],
        max_waiting: int,
        on_change: Callable[[int], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ):
        # A callable is asked at each admission: what the engine runs at once
        # changes with its replica count.
        self._max_running = max_running if callable(max_running) else (lambda: max_running)
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.closed = False
        self._on_change = on_change
        self._on_refused = on_refused

    @classmethod
    def for_engine(
        cls, engine: Any, max_waiting: int = DEFAULT_MAX_WAITING_REQUESTS, **kwargs: Any
    ) -> AdmissionControl:
        return cls(running_capacity(engine), max_waiting, **kwargs)

    @property
    def max_running(self) -> int:
        return self._max_running()

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_waiting

    def refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    def admit(self, cost: int, param: str | None) -> Reservation:
        """Reserve `cost` sequences, or raise: 503 shutting down, 400 never
        fits, 429 not now."""
        if self.closed:
            self.refused("shutting_down")
            raise ShuttingDown()
        max_running = self.max_running  # read once: the replica count may change meanwhile
        capacity = max_running + self.max_waiting
        if cost > capacity:
            raise OpenAIError(
                f"this request asks for {cost} sequences (prompts x n); the server holds at most "
                f"{capacity} at once ({max_running} running + {self.max_waiting} waiting)",
                400,
                param,
            )
        if self.in_flight + cost > capacity:
            self.refused("queue_full")
            raise Overloaded(
                f"the server is at capacity ({self.in_flight} sequences in flight: {max_running} can run "
                f"and {self.max_waiting} may wait); retry after {RETRY_AFTER_S}s"
            )
        self.in_flight += cost
        self._changed()
        return Reservation(self, cost)

    def _release(self, cost: int) -> None:
        self.in_flight -= cost
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.in_flight)

    def close(self) -> None:
        """From now on every request is a 503 (the server is shutting down)."""
        self.closed = True


def check_prompt_count(num_prompts: int) -> None:
    if num_prompts > MAX_PROMPTS_PER_REQUEST:
        raise OpenAIError(
            f"prompt: at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {num_prompts}", 400, "prompt"
        )


def check_stop(stop: str | list[str] | None) -> None:
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", 400, "stop")
    for s in stops:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise OpenAIError(
                f"stop: a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}",
                400,
                "stop",
            )


def check_request_chat_template(template: str | None, trusted: bool) -> None:
    """A template sent with the request is code the server would run; only a
    server told to trust its clients with it (--trust-request-chat-template)
    does, and only a bounded one."""
    if template is None:
        return
    if not trusted:
        raise OpenAIError(
            "chat_template: this server does not render chat templates sent with requests "
            "(start it with --trust-request-chat-template to allow them)",
            400,
            "chat_template",
        )
    if len(template) > MAX_REQUEST_CHAT_TEMPLATE_CHARS:
        raise OpenAIError(
            f"chat_template: at most {MAX_REQUEST_CHAT_TEMPLATE_CHARS} characters, got {len(template)}",
            400,
            "chat_template",
        )


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`: from Content-Length before
    reading, and while the body streams in (chunked, or longer than declared).
    Whatever the app made of the cut-off body is dropped for the 413. The rest
    of the body is drained (bounded: DRAIN_TIME_S) before answering."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[str], None] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    def _message(self) -> str:
        return f"the request body is larger than this server accepts ({self.max_bytes} bytes)"

    async def _reject(self, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        if status == 413 and self.on_refused is not None:
            self.on_refused("body_too_large")
        response = error_response(message, status)
        # The rest of the body is never read: the connection cannot be reused.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == "invalid":
            await self._reject(scope, receive, send, 400, "invalid Content-Length header")
            return
        if declared is not None and declared > self.max_bytes:
            if declared <= 2 * self.max_bytes:
                await self._drain(receive, declared)
            await self._reject(scope, receive, send, 413, self._message())
            return

        received = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            if exceeded:
                raise _BodyTooLarge()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the app's answer to a truncated body: the 413 goes instead
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded or started:
                raise
        if exceeded and not started:
            await self._drain(receive, 2 * self.max_bytes - received)
            await self._reject(scope, receive, send, 413, self._message())

    @staticmethod
    async def _drain(receive: Receive, budget: int) -> None:
        """Read and drop up to `budget` more body bytes, for DRAIN_TIME_S at most."""

        async def drain() -> None:
            nonlocal budget
            while budget > 0:
                message = await receive()
                if message["type"] != "http.request":
                    return
                budget -= len(message.get("body", b""))
                if not message.get("more_body", False):
                    return

        try:
            await asyncio.wait_for(drain(), DRAIN_TIME_S)
        except asyncio.TimeoutError:
            pass


def _content_length(scope: Scope) -> Any:
    """The declared length: an int, None if absent, "invalid" if unparsable."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return "invalid"
            return length if length >= 0 else "invalid"
    return None


async def run_admitted(
    admission: AdmissionControl, cost: int, param: str | None, work: Callable[[], Awaitable[Any]]
) -> Any:
    """work(), admitted for `cost` sequences (429/400/503 as `admit` refuses)
    and started once admitted. The reservation is held until the work ends,
    not merely until its caller stops waiting: a client that goes away cannot
    free its slot while a thread still works for it."""
    reservation = admission.admit(cost, param)
    task = asyncio.ensure_future(work())

    def done(finished: asyncio.Future) -> None:
        reservation.release()
        if not finished.cancelled():
            finished.exception()  # retrieved: nobody may be waiting for it any more

    task.add_done_callback(done)
    return await asyncio.shield(task)


class ReleasingStreamingResponse(StreamingResponse):
    """A stream that gives its request's reservation back once it is sent,
    cut off by the client, or never started: whatever happens, exactly once.
    It closes the engine streams it sends too (aborting any unfinished one),
    which the body iterator cannot do when it never started."""

    def __init__(self, reservation: Reservation, *args: Any, streams: Sequence[Any] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reservation = reservation
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.reservation.release()
            for stream in self.streams:
                stream.close()


def max_running_sequences(config: Any) -> int:
    """What the engine runs at once at its start: max_num_seqs per engine-core replica."""
    replicas = getattr(config.parallel_config, "data_parallel_size", 1) or 1
    return config.scheduler_config.max_num_seqs * replicas


def running_capacity(engine: Any) -> Callable[[], int]:
    """What `engine` runs at once now, for AdmissionControl: max_num_seqs per
    replica that serves (a starting, draining or restarting one takes no new
    request), read from the engine at each call, so that it follows /scale
    and the autoscaler. At least one replica's worth: while the only one
    recovers, requests wait for it rather than all being refused."""
    per_replica = engine.config.scheduler_config.max_num_seqs
    start = max_running_sequences(engine.config)

    def current() -> int:
        states = engine.replica_states()
        if states is None:  # no data parallelism: the size never changes
            return start
        return per_replica * max(1, sum(1 for s in states if s.get("state") == "serving"))

    return current
