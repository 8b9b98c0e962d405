"""Calls over MessageQueues, shared by the multiprocess executor and the Ray
executor's `mq` transport: the worker-side dequeue-run-reply loop and the
driver-side client (call FIFO, reply collection, timeouts, error formatting).

The driver broadcasts an RpcRequest to every rank; each rank replies with an
RpcReply on its own response queue (raylm.distributed.rpc_messages). Replies
are consumed in call order, so several calls may be in flight (`non_block`).

Where a callable goes: the queues carry typed msgpack only, and a callable is
code. The multiprocess executor's broadcast (one node, shared memory of one
user) may carry it inline (`local_callables`); the Ray executor registers it
on every actor through Ray and sends a CallableRef, which the worker resolves
in its CallableRegistry. A worker's exception comes back as a RemoteError
record and is raised on the driver as WorkerCallError.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raylm.distributed.mq_wait import QueueClosedError
from raylm.distributed.rpc_messages import CallableRef, RemoteError, RpcReply, RpcRequest
from raylm.distributed.shm_broadcast import MessageQueue
from raylm.executor.errors import ExecutorFailedError, WorkerDiedError, WorkerHungError, WorkerStepError

logger = logging.getLogger(__name__)

# How often a driver waiting on one rank looks at the other ranks' queues and
# at the liveness verdict: bounds how late a death or a fatal error is seen.
REPLY_POLL_S = 0.05

OK, ERROR, FATAL = "ok", "error", "fatal"


def method_name(method: str | CallableRef | Callable) -> str:
    if isinstance(method, str):
        return method
    if isinstance(method, CallableRef):
        return method.name
    return getattr(method, "__name__", repr(method))


def format_worker_error(error: RemoteError) -> str:
    rank = error.rank
    return (
        f"worker rank {rank} raised {error.type_name} in {error.method}: {error.message}\n"
        f"--- worker traceback (rank {rank}) ---\n{error.traceback}"
    )


class WorkerCallError(RuntimeError):
    """A worker raised in a call; the driver's copy of its RemoteError (type
    name, message, traceback text), never the worker's exception object."""

    def __init__(self, error: RemoteError):
        super().__init__(format_worker_error(error))
        self.remote = error


class CallableRegistry:
    """The worker side of callables that travel through Ray: registered by an
    actor call before the queue names them, taken (once) when the call runs."""

    def __init__(self) -> None:
        self._callables: dict[int, Callable] = {}

    def register(self, token: int, fn: Callable) -> None:
        self._callables[token] = fn

    def take(self, ref: CallableRef) -> Callable:
        fn = self._callables.pop(ref.token, None)
        if fn is None:
            raise LookupError(f"callable {ref.name!r} (token {ref.token}) was not registered on this worker")
        return fn


# ---- the worker side ----------------------------------------------------------------


class WorkerLoop:
    """Dequeue a call, run it on the worker wrapper, reply; until the queue closes.

    `wrapper` is a WorkerWrapper (it has `rank`, `worker` and `execute_method`);
    the loop owns both queues and closes them, and shuts the worker down, on exit.
    """

    def __init__(
        self, wrapper: Any, broadcast: MessageQueue, response: MessageQueue, callables: CallableRegistry | None = None
    ):
        self.wrapper = wrapper
        self.broadcast = broadcast
        self.response = response
        self.callables = callables

    @property
    def rank(self) -> int:
        return self.wrapper.rank

    def run(self) -> None:
        try:
            while True:
                try:
                    request = self.broadcast.dequeue()
                    if type(request) is not RpcRequest:
                        raise TypeError(f"expected an RpcRequest, got {type(request).__name__}")
                except QueueClosedError:
                    return  # the executor is shutting down
                except Exception as e:
                    # A call this rank cannot read (say, a callable from a module
                    # it cannot import): it misses the call and its peers may
                    # wait for it in a collective, so the failure is fatal.
                    error = RemoteError(
                        type(e).__name__, f"could not read a call: {e}", traceback.format_exc(), self.rank, "?"
                    )
                    self.response.enqueue(RpcReply(-1, FATAL, error))
                    continue
                self.run_one(request.seq, request.method, request.args, request.kwargs, request.reply_rank)
        finally:
            if self.wrapper.worker is not None:
                try:
                    self.wrapper.worker.shutdown()
                except Exception:
                    logger.exception("rank %d: worker shutdown failed", self.rank)
            self.response.close()
            self.broadcast.close()

    def run_one(
        self, seq: int, method: str | CallableRef | Callable, args: tuple, kwargs: dict, reply_rank: int | None
    ) -> None:
        asked = reply_rank is None or reply_rank == self.rank
        try:
            if isinstance(method, CallableRef):
                if self.callables is None:
                    raise LookupError(f"callable {method.name!r}: this worker takes no registered callables")
                method = self.callables.take(method)
            reply = RpcReply(seq, OK, self.wrapper.execute_method(method, *args, **kwargs))
        except Exception as e:
            error = RemoteError(type(e).__name__, str(e), traceback.format_exc(), self.rank, method_name(method))
            # A rank that was not asked to reply still reports its failure:
            # its peers are likely stuck in a collective waiting for it.
            reply = RpcReply(seq, ERROR if asked else FATAL, error)
        else:
            if not asked:
                return
        try:
            self.response.enqueue(reply)
        except QueueClosedError:
            raise
        except Exception as e:  # a result of a type the queue does not carry
            error = RemoteError(
                type(e).__name__,
                f"could not send the reply: {e}",
                traceback.format_exc(),
                self.rank,
                method_name(method),
            )
            self.response.enqueue(RpcReply(seq, ERROR if asked else FATAL, error))


# ---- the driver side ----------------------------------------------------------------


@dataclass
class _PendingCall:
    seq: int
    method_name: str
    ranks: list[int]
    single: bool
    deadline: float | None
    future: ReplyFuture
    replies: dict[int, Any] = field(default_factory=dict)


class ReplyFuture(Future):
    """A Future whose result() collects the replies itself, in call order, so a
    blocking call costs no hand-off to a background thread."""

    def __init__(self, client: MqRpcClient):
        super().__init__()
        self._client_ref = weakref.ref(client)

    def result(self, timeout: float | None = None):
        client = self._client_ref()
        if client is not None and not self.done():
            client.collect_until(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        client = self._client_ref()
        if client is not None and not self.done():
            client.collect_until(self, timeout)
        return super().exception(timeout)


class _WaitExpired(Exception):
    """The caller's own wait (Future.result(timeout)) ran out; the call itself
    stays pending with the replies gathered so far, and a later wait resumes."""


class MqRpcClient:
    """The driver end: broadcasts calls and collects the replies of `world_size`
    ranks from their response queues.

    Liveness stays with the executor (process sentinels, Ray refs): it calls
    `mark_failed`, which fails every call in flight. `shutting_down` is the
    executor's; once set, new calls are refused.
    """

    def __init__(
        self,
        broadcast: MessageQueue,
        responses: list[MessageQueue],
        shutting_down: threading.Event,
        on_failure: Callable[[str], None] | None = None,
        describe_rank: Callable[[int], str] | None = None,
    ):
        self.broadcast = broadcast
        self.responses = responses
        self.world_size = len(responses)
        self.shutting_down = shutting_down
        self.failure: str | None = None
        self.failure_type: type[ExecutorFailedError] = WorkerDiedError
        self._on_failure = on_failure
        # "rank 1 (pid 4242, node 10.0.0.2)": what a failure message names.
        self.describe_rank = describe_rank or (lambda rank: f"rank {rank}")
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.RLock()
        # Set by collect_until for a caller's bounded wait (Future.result(timeout)).
        self._wait_until: float | None = None
        self.pending: deque[_PendingCall] = deque()
        # Replies read from a rank's queue while waiting on another rank.
        self._stash: list[dict[int, RpcReply]] = [{} for _ in range(self.world_size)]

    # ---- state --------------------------------------------------------------------

    def mark_failed(self, reason: str, error_type: type[ExecutorFailedError] = WorkerDiedError) -> None:
        """The executor is unusable. A death overrides an earlier step error: a
        killed rank's peers often raise (connection reset) before its death is
        seen, and the death is the cause worth reporting."""
        if self.failure is None or (error_type is WorkerDiedError and self.failure_type is not WorkerDiedError):
            self.failure = reason
            self.failure_type = error_type
            logger.error("executor failed: %s", reason)
            if self._on_failure is not None:
                self._on_failure(reason)
        # Fail every call in flight now; nobody is going to answer them.
        for call in list(self.pending):
            if not call.future.done():
                call.future.set_exception(self.failure_type(self.failure))

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure_type(self.failure)
        if self.shutting_down.is_set():
            raise RuntimeError("executor is shut down")

    def cancel_pending(self) -> None:
        """At shutdown: every unanswered call fails."""
        for call in list(self.pending):
            if not call.future.done():
                call.future.set_exception(RuntimeError("executor is shut down"))
        self.pending.clear()

    # ---- calls --------------------------------------------------------------------

    def call(
        self,
        method: str | CallableRef | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        self.raise_if_failed()
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < self.world_size:
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is outside 0..{self.world_size - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        future = ReplyFuture(self)
        name = method_name(method)
        with self._send_lock:
            seq = next(self._seq)
            ranks = [unique_reply_rank] if unique_reply_rank is not None else list(range(self.world_size))
            call = _PendingCall(seq, name, ranks, unique_reply_rank is not None, deadline, future)
            # Queued before the send: a reply can never arrive for an unknown call.
            self.pending.append(call)
            try:
                request = RpcRequest(seq, method, tuple(args), kwargs or {}, unique_reply_rank)
                self.broadcast.enqueue(request, timeout=timeout)
            except BaseException as e:
                self.pending.remove(call)
                if isinstance(e, TimeoutError):
                    raise WorkerHungError(f"{name}: the workers did not take the call within {timeout} s") from None
                raise
        if non_block:
            return future
        return future.result()

    def collect_until(self, target: ReplyFuture, timeout: float | None = None) -> None:
        """Consume replies, oldest call first, until `target` is resolved;
        TimeoutError after `timeout` seconds (the calls stay pending)."""
        if not self._recv_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"no reply within {timeout} s")
        try:
            self._wait_until = None if timeout is None else time.monotonic() + timeout
            while not target.done() and self.pending:
                call = self.pending[0]
                if not call.future.done():
                    try:
                        call.future.set_result(self._collect(call))
                    except _WaitExpired:
                        raise TimeoutError(f"{call.method_name}: no reply within {timeout} s") from None
                    except BaseException as e:
                        if not call.future.done():
                            call.future.set_exception(e)
                if self.pending and self.pending[0] is call:
                    self.pending.popleft()
        finally:
            self._wait_until = None
            self._recv_lock.release()

    def _collect(self, call: _PendingCall) -> Any:
        for rank in call.ranks:
            if rank in call.replies:
                continue
            try:
                call.replies[rank] = self._next_reply(rank, call)
            except TimeoutError:
                missing = [r for r in call.ranks if r not in call.replies]
                waited = ", ".join(self.describe_rank(r) for r in missing)
                # The rank that hangs may not be the one that was asked (it may
                # wait for the hung one in a collective): describe them all.
                ranks = "; ".join(self.describe_rank(r) for r in range(self.world_size))
                raise WorkerHungError(
                    f"{call.method_name}: {waited} did not answer within its deadline (ranks: {ranks})"
                ) from None
        results = []
        for rank in call.ranks:
            reply = call.replies[rank]
            if reply.status != OK:
                raise WorkerCallError(reply.payload)
            results.append(reply.payload)
        return results[0] if call.single else results

    def _next_reply(self, rank: int, call: _PendingCall) -> RpcReply:
        queue = self.responses[rank]
        stash = self._stash[rank]
        while True:
            if call.seq in stash:
                return stash.pop(call.seq)
            if call.future.done():  # failed by the liveness monitor
                call.future.result()
            self.raise_if_failed()
            wait = REPLY_POLL_S
            if call.deadline is not None:
                wait = min(wait, call.deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError
            if self._wait_until is not None:
                left = self._wait_until - time.monotonic()
                if left <= 0:
                    raise _WaitExpired
                wait = min(wait, left)
            try:
                reply = queue.dequeue(timeout=wait)
            except TimeoutError:
                self._poll_other_ranks(rank)
                self._raise_if_a_peer_failed(call)
                continue
            except QueueClosedError:
                self.raise_if_failed()
                # Only the worker's own loop closes its response queue.
                self.mark_failed(f"worker {self.describe_rank(rank)} stopped answering: its response queue was closed")
                self.raise_if_failed()
            self._file_reply(rank, reply, call.seq)

    def _file_reply(self, rank: int, reply: RpcReply, current_seq: int) -> None:
        if type(reply) is not RpcReply:
            self.mark_failed(f"worker {self.describe_rank(rank)} sent a {type(reply).__name__}, not an RpcReply")
            self.raise_if_failed()
        if reply.status == FATAL:
            self.mark_failed(format_worker_error(reply.payload), WorkerStepError)
            self.raise_if_failed()
        if reply.seq >= current_seq:
            self._stash[rank][reply.seq] = reply
        # else: a late reply to a call that already timed out; drop it.

    def _raise_if_a_peer_failed(self, call: _PendingCall) -> None:
        """Another rank already answered this call with an error: raise it now.
        The rank being waited on may never answer: it may wait for the failed
        one in a collective (a rendezvous, an all-reduce) until a far timeout.
        A reply already collected (the ranks are collected in order, so rank
        0's, while rank 1 is waited on) counts as much as one still stashed."""
        for rank in call.ranks:
            reply = call.replies.get(rank) or self._stash[rank].get(call.seq)
            if reply is not None and reply.status != OK:
                raise WorkerCallError(reply.payload)

    def _poll_other_ranks(self, waiting_rank: int) -> None:
        # A rank that was not asked to reply reports only failures; find them
        # while we wait, or a step whose peer crashed would hang forever.
        for rank, queue in enumerate(self.responses):
            if rank == waiting_rank:
                continue
            while True:
                try:
                    reply = queue.dequeue(timeout=0)
                except TimeoutError:
                    break
                current = self.pending[0].seq if self.pending else 0
                self._file_reply(rank, reply, current)
