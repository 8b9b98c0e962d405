"""One request of AsyncLLM (async_llm.py), as each side holds it: the
RequestStream its caller reads, whose early close aborts the request, and the
RequestState AsyncLLM keeps until the request ends: the queue that stream
reads, and the times its latency metrics are worked out from."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raylm.engine.errors import RequestFailedError
from raylm.outputs import RequestOutput


class RequestStream:
    """The outputs of one submitted request, as an async iterator. Closing it
    before the last output (`close`, `aclose`) aborts the request in the core,
    freeing its KV blocks; closing after the end does nothing."""

    def __init__(self, request_id: str, queue: asyncio.Queue, abort: Callable[[str], None]):
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        failed = [c.error for c in item.outputs if c.finish_reason == "error"]
        if failed:
            # The engine blamed this request for a failing step and dropped it
            # (the others carried on): an error, not a result.
            self.close()  # its other completions, if any
            raise RequestFailedError(f"the engine failed this request: {failed[0]}")
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


@dataclass
class RequestState:
    """What AsyncLLM keeps of a request in flight: where its outputs go
    (`queue`: RequestOutputs, or the error that ended the engine), whether
    they go as deltas, and its times for the stat loggers."""

    queue: asyncio.Queue
    deltas: bool
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    prefill_seconds: float | None = None  # as the core measured it
    # The completions (by index) whose finish the stat loggers have counted.
    counted_finished: set[int] = field(default_factory=set)
    # Its LoRA adapter's id (LoRARequest.lora_int_id), if any: a server's
    # unload waits for the requests that run with it.
    lora_int_id: int | None = None
