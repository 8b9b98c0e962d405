"""Core clients: how a front end talks to its EngineCore. `InprocClient` calls it
directly (LLMEngine); `MPClient` runs it in its own process over ZMQ (AsyncLLM).

Both have the same small interface: add_request, abort_requests, get_output
(async on MPClient, where it waits on a socket), shutdown.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from raylm.config import EngineConfig
from raylm.core.request import Request
from raylm.engine.core_proc import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Ping,
    RunningAloneRecord,
    SchedulerStats,
    Shutdown,
    run_engine_core,
)

logger = logging.getLogger(__name__)

# How often a waiting client checks that the core process is still alive.
_LIVENESS_POLL_MS = 500
# How often it retries messages the core's socket could not take yet.
_RESEND_POLL_MS = 20
# A core that failed sends its error, then exits: once it is gone, what it
# sent last is already in our socket's queue or arrives within this time.
_LAST_WORDS_MS = 200
_SHUTDOWN_TIMEOUT_S = 30.0


def send_pending(socket: zmq.Socket, unsent: collections.deque) -> None:
    """Send what the socket takes now, in order, without blocking; the rest
    waits in `unsent` (a bound PUSH socket refuses while no peer is connected:
    a core not yet connected, or one that died)."""
    while unsent:
        try:
            socket.send(unsent[0], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        unsent.popleft()


class EngineDeadError(RuntimeError):
    """The engine core is gone; no request can be served any more."""


class EngineCoreDiedError(EngineDeadError):
    """The core process vanished without saying why (killed, crashed), or hung
    and was killed: unlike a core that reported its error, a new one may well
    do better."""

    def __init__(self, exitcode: int | None, hung_s: float | None = None, rebuilding: bool = False):
        if hung_s is None:
            super().__init__(f"engine core process exited with code {exitcode}")
        elif rebuilding:
            super().__init__(f"engine core process was rebuilding its executor for {hung_s:.0f} s, past "
                             f"engine_start_timeout; killed it")
        else:
            super().__init__(f"engine core process made no progress for {hung_s:.0f} s with requests in flight; "
                             f"killed it")
        self.exitcode = exitcode


class EngineStartTimeoutError(EngineDeadError):
    """A new engine core was not ready within `engine_start_timeout_s` (hung
    loading, or in an executor start-up call); it was killed. Like a death, a
    new core may do better: a front end that restarts cores counts it as a
    failed restart."""


class InprocClient:
    """The EngineCore in this process: `get_output` runs one step."""

    def __init__(self, config: EngineConfig):
        from raylm.engine.engine_core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: Request) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs=self.engine_core.step())

    def stats(self) -> dict:
        return self.engine_core.stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _stop_process(process: multiprocessing.process.BaseProcess, input_socket: zmq.Socket,
                  contexts: list, tmpdir: str) -> None:
    """Ask the core to stop, then insist; runs from shutdown() or a finalizer."""
    if process.is_alive():
        try:
            input_socket.send(msgspec.msgpack.encode(Shutdown()), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        process.join(_SHUTDOWN_TIMEOUT_S)
    if process.is_alive():
        # It ignores SIGTERM (see run_engine_core): only SIGKILL stops it now.
        logger.warning("engine core did not stop in %.0fs; killing it", _SHUTDOWN_TIMEOUT_S)
        process.kill()
        process.join(5)
    input_socket.close(linger=0)
    for ctx in contexts:
        ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


class MPClient:
    """The EngineCore in a spawned process, over two ipc:// ZMQ sockets.

    The constructor blocks until the core has loaded the model and sized its
    KV cache (or raises with the core's error). Requests go out on a PUSH
    socket; outputs come back on a PULL socket read by the async `get_output`.

    Sends never block the caller's event loop: a bound PUSH socket blocks while
    no peer is connected (a core not yet connected, or one that died), so a
    message it cannot take waits in `_unsent` and is retried by `get_output`.
    Whatever is still unsent when the core dies is the front end's to redo.
    """

    def __init__(self, config: EngineConfig, log_level: int | None = None,
                 is_busy: Callable[[], bool] | None = None):
        """`is_busy`: whether requests are in flight. A core that sends nothing
        for longer than the step deadline (execute_model_timeout) while they
        are is hung (the uni backend runs the model in the core process, so
        nothing else would notice), and is killed."""
        self._is_busy = is_busy
        self._hang_timeout_s = config.fault_tolerance.execute_model_timeout_s
        self._start_timeout_s = config.fault_tolerance.engine_start_timeout_s
        # Set while the core rebuilds its executor in place (it says so before
        # each attempt, and sends nothing else until done): when it began.
        self.rebuilding_since: float | None = None
        self._last_heard = time.monotonic()
        self._tmpdir = tempfile.mkdtemp(prefix="raylm-core-")
        input_address = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        output_address = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        # No high-water mark: a full queue would make sends fail while the core lives.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(input_address)
        self._unsent: collections.deque[bytes] = collections.deque()
        self._actx = zmq.asyncio.Context()
        self._output = self._actx.socket(zmq.PULL)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._nonces = itertools.count(1)

        # Names the quarantined request the core runs alone, if any: read
        # after the core died, to know whom to blame (raylm.core.quarantine).
        self._running_alone = RunningAloneRecord(os.path.join(self._tmpdir, "running_alone"))
        mp = multiprocessing.get_context("spawn")
        ready_recv, ready_send = mp.Pipe(duplex=False)
        if log_level is None:
            log_level = logging.getLogger().getEffectiveLevel()
        # Not a daemon: the core may start worker processes of its own.
        self.process = mp.Process(
            target=run_engine_core, name="RaylmEngineCore",
            args=(config, input_address, output_address, ready_send, log_level, self._running_alone.path),
        )
        self.process.start()
        ready_send.close()
        self._finalizer = weakref.finalize(
            self, _stop_process, self.process, self._input, [self._ctx, self._actx], self._tmpdir
        )
        try:
            self._wait_ready(ready_recv)
        except BaseException:
            self._finalizer()
            raise
        finally:
            ready_recv.close()

    def _wait_ready(self, ready_recv) -> None:
        timeout = self._start_timeout_s
        deadline = time.monotonic() + timeout
        while not ready_recv.poll(min(_LIVENESS_POLL_MS / 1000, max(0.0, deadline - time.monotonic()))):
            if not self.process.is_alive():
                raise EngineDeadError(f"engine core process exited with code {self.process.exitcode} during startup")
            if time.monotonic() >= deadline:
                self._kill_unready(timeout)
        try:
            status, detail = ready_recv.recv()
        except EOFError:
            raise EngineDeadError("engine core process exited during startup") from None
        if status != "ready":
            # The core's own message (a bad setting, a missing file) says what to fix.
            raise ValueError(f"engine core failed to start: {detail}")
        logger.info("engine core ready (pid %d, %s KV blocks)", self.process.pid, detail)

    def _kill_unready(self, timeout: float) -> None:
        """A core still starting at its deadline is hung: it would not read a
        Shutdown message (its sockets are not connected yet), so SIGKILL it.
        Its mp workers exit on their death pipes, its Ray actors and placement
        group go with their owner."""
        logger.error("engine core (pid %d) was not ready within %g s (engine_start_timeout): killing it",
                     self.process.pid, timeout)
        self.process.kill()
        self.process.join(5)
        raise EngineStartTimeoutError(
            f"engine core was not ready within {timeout:g} s (engine_start_timeout; hung loading the model "
            "or starting its workers); killed it")

    def _send(self, message) -> None:
        self._send_frame(self._encoder.encode(message))

    def _send_frame(self, frame: bytes) -> None:
        self._unsent.append(frame)
        self._flush()

    def _flush(self) -> None:
        send_pending(self._input, self._unsent)

    def add_request(self, request: Request) -> None:
        try:
            payload = self._encoder.encode(EngineCoreRequest.from_request(request))
        except (OverflowError, msgspec.EncodeError) as e:
            raise ValueError(f"request cannot be encoded: {e}") from e
        self._send_frame(payload)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def ping(self) -> int:
        """Ask the core for a sign of life; its reply carries `pong` = the nonce."""
        nonce = next(self._nonces)
        self._send(Ping(nonce))
        return nonce

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def running_alone(self) -> str | None:
        """The quarantined request the core was running alone when it last
        said so (its last words, for a core that died)."""
        return self._running_alone.read()

    async def get_output(self) -> EngineCoreOutputs:
        """The next message from the core. Once it is gone: EngineDeadError
        with its error if it sent one, else EngineCoreDiedError."""
        while True:
            self._flush()
            timeout = _RESEND_POLL_MS if self._unsent else _LIVENESS_POLL_MS
            if await self._output.poll(timeout):
                frame = await self._output.recv(copy=False)
                self._last_heard = time.monotonic()
                outputs = self._decoder.decode(frame.buffer)
                self._note_rebuilding(outputs.rebuilding)
                if outputs.error is not None:
                    raise EngineDeadError(f"engine core failed: {outputs.error.strip().splitlines()[-1]}")
                return outputs
            if not self.process.is_alive():
                if await self._output.poll(_LAST_WORDS_MS):
                    continue
                raise EngineCoreDiedError(self.process.exitcode)
            self._kill_if_hung()

    def _note_rebuilding(self, rebuilding: bool) -> None:
        """Any message but the announcement says the core's loop runs again."""
        if not rebuilding:
            self.rebuilding_since = None
        elif self.rebuilding_since is None:
            self.rebuilding_since = self._last_heard
            logger.warning("engine core (pid %d) is rebuilding its executor", self.process.pid)

    def _kill_if_hung(self) -> None:
        """Kill a core silent for too long. A rebuild announced by the core
        may take as long as a start (it loads the model again), so the start
        timeout is its deadline, whether requests wait or not (each attempt
        announces itself, so the silence counts from the latest); otherwise
        the step deadline, while requests are in flight."""
        silent_s = time.monotonic() - self._last_heard
        rebuilding = self.rebuilding_since is not None
        if rebuilding:
            limit = self._start_timeout_s
        elif self._is_busy is None:
            return
        elif not self._is_busy():
            self._last_heard = time.monotonic()  # idle: its silence is not a hang
            return
        else:
            limit = self._hang_timeout_s
        if silent_s <= limit:
            return
        logger.error("engine core (pid %d) sent nothing for %.0f s %s: killing it", self.process.pid, silent_s,
                     "while rebuilding its executor" if rebuilding else "with requests in flight")
        self.process.kill()
        self.process.join(5)
        raise EngineCoreDiedError(self.process.exitcode, hung_s=silent_s, rebuilding=rebuilding)

    def shutdown(self) -> None:
        """Idempotent: stops the core process (and through it its executor)."""
        self._finalizer()


__all__ = ["EngineCoreDiedError", "EngineDeadError", "EngineStartTimeoutError", "InprocClient", "MPClient",
           "SchedulerStats"]
