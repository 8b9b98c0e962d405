"""MultiprocExecutor: one spawned process per rank on this machine; each step is
broadcast on a shared-memory MessageQueue, replies come back on per-worker queues.

Liveness is watched both ways: a monitor thread in the driver waits on the
workers' process sentinels, and each worker exits when its death pipe from the
driver hits EOF, so a `kill -9` on either side leaves no orphan and no segment.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from raylm.config import EngineConfig
from raylm.distributed.shm_broadcast import MessageQueue, MessageQueueHandle, QueueClosedError, unlink_segment
from raylm.executor.abstract import Executor

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 300.0
WORKER_SHUTDOWN_TIMEOUT_S = 5.0
# How often a driver waiting on one rank looks at the other ranks' queues and
# at the monitor's verdict: bounds how late a death or a fatal error is seen.
_REPLY_POLL_S = 0.05

_OK, _ERROR, _FATAL = "ok", "error", "fatal"


class WorkerDiedError(RuntimeError):
    """A worker process died or failed outside a call that could report it; the
    executor is unusable (the engine turns this into EngineDeadError)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---- the worker process -----------------------------------------------------------------


class WorkerProc:
    """The loop of one worker process: dequeue a call, run it, reply."""

    def __init__(self, config: EngineConfig, rank: int, broadcast_handle: MessageQueueHandle, init_method: str):
        from raylm.worker.worker import WorkerWrapper

        self.rank = rank
        self.broadcast = MessageQueue.create_from_handle(broadcast_handle, rank)
        self.response = MessageQueue(num_local_readers=1)
        self.wrapper = WorkerWrapper(rank)
        self.wrapper.init_worker(config, local_rank=rank, distributed_init_method=init_method)

    @staticmethod
    def main(
        config: EngineConfig,
        rank: int,
        broadcast_handle: MessageQueueHandle,
        init_method: str,
        num_threads: int,
        ready_pipe: multiprocessing.connection.Connection,
        death_pipe: multiprocessing.connection.Connection,
    ) -> None:
        import torch

        torch.set_num_threads(num_threads)
        proc: WorkerProc | None = None
        segments = [broadcast_handle.shm_name]

        def exit_when_parent_dies() -> None:
            try:
                death_pipe.recv()  # the parent never sends: this returns only at EOF
            except (EOFError, OSError):
                pass
            # The driver is gone and cannot unlink its segments: the workers do
            # (the first one to try wins), then leave without running finalizers
            # that could block on peers that are gone too.
            for name in segments:
                if name:
                    unlink_segment(name)
            os._exit(1)

        threading.Thread(target=exit_when_parent_dies, name="RaylmParentDeathWatch", daemon=True).start()
        try:
            proc = WorkerProc(config, rank, broadcast_handle, init_method)
            segments.append(proc.response.shm_name)
            ready_pipe.send(("ready", proc.response.export_handle()))
        except BaseException:
            ready_pipe.send(("failed", traceback.format_exc()))
            raise
        finally:
            ready_pipe.close()
        proc.run_loop()

    def run_loop(self) -> None:
        try:
            while True:
                try:
                    seq, method, args, kwargs, reply_rank = self.broadcast.dequeue()
                except QueueClosedError:
                    return  # the executor is shutting down
                self._run_one(seq, method, args, kwargs, reply_rank)
        finally:
            if self.wrapper.worker is not None:
                self.wrapper.worker.shutdown()
            self.response.close()
            self.broadcast.close()

    def _run_one(self, seq: int, method: str | Callable, args: tuple, kwargs: dict, reply_rank: int | None) -> None:
        asked = reply_rank is None or reply_rank == self.rank
        try:
            reply = (seq, _OK, self.wrapper.execute_method(method, *args, **kwargs))
        except Exception as e:
            name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
            error = (type(e).__name__, str(e), traceback.format_exc(), self.rank, name)
            # A rank that was not asked to reply still reports its failure:
            # its peers are likely stuck in a collective waiting for it.
            reply = (seq, _ERROR if asked else _FATAL, error)
        else:
            if not asked:
                return
        try:
            self.response.enqueue(reply)
        except Exception as e:  # an unserialisable result
            error = (type(e).__name__, f"could not send the reply: {e}", traceback.format_exc(), self.rank, str(method))
            self.response.enqueue((seq, _ERROR if asked else _FATAL, error))


# ---- the driver side --------------------------------------------------------------------


def _format_worker_error(error: tuple) -> str:
    type_name, message, tb, rank, method = error
    return f"worker rank {rank} raised {type_name} in {method}: {message}\n--- worker traceback (rank {rank}) ---\n{tb}"


@dataclass
class _PendingCall:
    seq: int
    method_name: str
    ranks: list[int]
    single: bool
    deadline: float | None
    future: "_ReplyFuture"
    replies: dict[int, Any] = field(default_factory=dict)


class _ReplyFuture(Future):
    """A Future whose result() collects the replies itself, in call order, so a
    blocking call costs no hand-off to a background thread."""

    def __init__(self, executor: "MultiprocExecutor"):
        super().__init__()
        self._executor_ref = weakref.ref(executor)

    def result(self, timeout: float | None = None):
        executor = self._executor_ref()
        if executor is not None and not self.done():
            executor._collect_until(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        executor = self._executor_ref()
        if executor is not None and not self.done():
            executor._collect_until(self)
        return super().exception(timeout)


class _Resources:
    """What shutdown must release; kept apart from the executor so that
    weakref.finalize can hold it without keeping the executor alive."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.death_pipes: list[multiprocessing.connection.Connection] = []
        self.broadcast: MessageQueue | None = None
        self.responses: list[MessageQueue] = []
        self.response_segments: list[str] = []
        self.shutting_down = threading.Event()
        self.monitor_wakeup: tuple | None = None
        self.monitor: threading.Thread | None = None

    def shutdown(self) -> None:
        if self.shutting_down.is_set():
            return
        self.shutting_down.set()
        if self.broadcast is not None:
            self.broadcast.close()  # every worker's dequeue raises QueueClosedError: a clean exit
        deadline = time.monotonic() + WORKER_SHUTDOWN_TIMEOUT_S
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                logger.warning("worker pid %s did not exit in %.0f s; killing it", proc.pid, WORKER_SHUTDOWN_TIMEOUT_S)
                proc.kill()
                proc.join(2.0)
        for conn in self.death_pipes:
            conn.close()
        for queue in self.responses:
            queue.close()
        # A worker that was killed could not unlink its own response segment.
        for name in self.response_segments:
            unlink_segment(name)
        if self.monitor_wakeup is not None:
            self.monitor_wakeup[1].close()
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(2.0)
        if self.monitor_wakeup is not None:
            self.monitor_wakeup[0].close()


class MultiprocExecutor(Executor):
    """TP x PP ranks as local processes (multiprocessing spawn).

    Calls are broadcast to every rank in order and replies are consumed in the
    same order (a FIFO of pending calls), which is what lets the engine keep
    several steps in flight with `non_block=True`.
    """

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self._failure: str | None = None
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.RLock()
        self._pending: deque[_PendingCall] = deque()
        # Replies read from a rank's queue while waiting on another rank.
        self._stash: list[dict[int, tuple]] = [{} for _ in range(self.world_size)]
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.shutdown)
        try:
            self._start_workers()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        res = self._res
        res.broadcast = MessageQueue(num_local_readers=self.world_size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        num_threads = self.config.num_threads or max(1, _cpu_count() // self.world_size)
        ready_pipes = []
        for rank in range(self.world_size):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=WorkerProc.main,
                args=(self.config, rank, res.broadcast.export_handle(), init_method, num_threads, ready_w, death_r),
                name=f"RaylmWorker-{rank}",
                daemon=True,
            )
            proc.start()
            # Only the child holds these ends now; the driver keeps the death
            # pipe's write end, whose closing (at any death) the worker sees.
            ready_w.close()
            death_r.close()
            res.processes.append(proc)
            res.death_pipes.append(death_w)
            ready_pipes.append(ready_r)
        handles = self._wait_for_ready(ready_pipes)
        for handle in handles:
            res.response_segments.append(handle.shm_name)
            res.responses.append(MessageQueue.create_from_handle(handle, 0))
        res.broadcast.wait_until_ready(timeout=WORKER_STARTUP_TIMEOUT_S)
        res.monitor_wakeup = ctx.Pipe(duplex=False)
        res.monitor = threading.Thread(target=self._monitor_workers, name="MultiprocWorkerMonitor", daemon=True)
        res.monitor.start()
        logger.info("started %d worker processes: %s", self.world_size, self.worker_pids)

    def _wait_for_ready(self, ready_pipes: list) -> list[MessageQueueHandle]:
        handles: list[MessageQueueHandle | None] = [None] * self.world_size
        deadline = time.monotonic() + WORKER_STARTUP_TIMEOUT_S
        waiting = dict(enumerate(ready_pipes))
        try:
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"worker ranks {sorted(waiting)} did not start within {WORKER_STARTUP_TIMEOUT_S} s")
                sentinels = {self._res.processes[r].sentinel: r for r in waiting}
                for ready in multiprocessing.connection.wait(list(waiting.values()) + list(sentinels), remaining):
                    if ready in sentinels:
                        rank = sentinels[ready]
                        if rank in waiting and not waiting[rank].poll():
                            code = self._res.processes[rank].exitcode
                            raise WorkerDiedError(f"worker rank {rank} exited with code {code} during startup")
                        continue
                    rank = next(r for r, conn in waiting.items() if conn is ready)
                    try:
                        status, payload = ready.recv()
                    except EOFError:
                        raise WorkerDiedError(f"worker rank {rank} exited during startup") from None
                    if status != "ready":
                        raise WorkerDiedError(f"worker rank {rank} failed during startup:\n{payload}")
                    handles[rank] = payload
                    del waiting[rank]
        finally:
            for conn in ready_pipes:
                conn.close()
        return handles  # type: ignore[return-value]

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._res.processes]

    @property
    def shm_segment_names(self) -> list[str]:
        """The /dev/shm segments of this executor's queues (for diagnostics and tests)."""
        broadcast = self._res.broadcast
        return ([broadcast.shm_name] if broadcast is not None else []) + list(self._res.response_segments)

    # ---- liveness -----------------------------------------------------------------

    def _monitor_workers(self) -> None:
        res = self._res
        sentinels = {p.sentinel: rank for rank, p in enumerate(res.processes)}
        try:
            ready = multiprocessing.connection.wait(list(sentinels) + [res.monitor_wakeup[0]])
        except OSError:
            return
        if res.shutting_down.is_set():
            return
        dead = [sentinels[s] for s in ready if s in sentinels]
        if dead:
            rank = dead[0]
            proc = res.processes[rank]
            proc.join(1.0)  # the sentinel fires a moment before the exit code can be read
            self._mark_failed(f"worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")

    def _mark_failed(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            self.is_failed = True
            logger.error("multiproc executor failed: %s", reason)
        # Fail every call in flight now; nobody is going to answer them.
        for call in list(self._pending):
            if not call.future.done():
                call.future.set_exception(WorkerDiedError(self._failure))

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        if self._res.shutting_down.is_set():
            raise RuntimeError("executor is shut down")

    def check_health(self) -> None:
        self._raise_if_failed()
        for rank, proc in enumerate(self._res.processes):
            if not proc.is_alive():
                self._mark_failed(f"worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")
                raise WorkerDiedError(self._failure)
        # A live process may still be wedged: when nothing else is in flight,
        # make every rank answer.
        if not self._pending:
            self.collective_rpc("check_health", timeout=60.0)

    # ---- calls ----------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        self._raise_if_failed()
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < self.world_size:
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is outside 0..{self.world_size - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        future = _ReplyFuture(self)
        with self._send_lock:
            seq = next(self._seq)
            ranks = [unique_reply_rank] if unique_reply_rank is not None else list(range(self.world_size))
            name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
            call = _PendingCall(seq, name, ranks, unique_reply_rank is not None, deadline, future)
            # Queued before the send: a reply can never arrive for an unknown call.
            self._pending.append(call)
            try:
                self._res.broadcast.enqueue((seq, method, tuple(args), kwargs or {}, unique_reply_rank), timeout=timeout)
            except BaseException as e:
                self._pending.remove(call)
                if isinstance(e, TimeoutError):
                    raise TimeoutError(f"{name}: the workers did not take the call within {timeout} s") from None
                raise
        if non_block:
            return future
        return future.result()

    def _collect_until(self, target: _ReplyFuture) -> None:
        """Consume replies, oldest call first, until `target` is resolved."""
        with self._recv_lock:
            while not target.done() and self._pending:
                call = self._pending[0]
                if not call.future.done():
                    try:
                        call.future.set_result(self._collect(call))
                    except BaseException as e:
                        if not call.future.done():
                            call.future.set_exception(e)
                if self._pending and self._pending[0] is call:
                    self._pending.popleft()

    def _collect(self, call: _PendingCall) -> Any:
        for rank in call.ranks:
            if rank in call.replies:
                continue
            try:
                call.replies[rank] = self._next_reply(rank, call)
            except TimeoutError:
                missing = [r for r in call.ranks if r not in call.replies]
                raise TimeoutError(f"{call.method_name}: ranks {missing} did not answer in time") from None
        results = []
        for rank in call.ranks:
            _, status, payload = call.replies[rank]
            if status != _OK:
                raise RuntimeError(_format_worker_error(payload))
            results.append(payload)
        return results[0] if call.single else results

    def _next_reply(self, rank: int, call: _PendingCall) -> tuple:
        queue = self._res.responses[rank]
        stash = self._stash[rank]
        while True:
            if call.seq in stash:
                return stash.pop(call.seq)
            if call.future.done():  # failed by the monitor
                call.future.result()
            self._raise_if_failed()
            wait = _REPLY_POLL_S
            if call.deadline is not None:
                wait = min(wait, call.deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError
            try:
                reply = queue.dequeue(timeout=wait)
            except TimeoutError:
                self._poll_other_ranks(rank)
                continue
            except QueueClosedError:
                self._raise_if_failed()
                raise
            self._file_reply(rank, reply, call.seq)

    def _file_reply(self, rank: int, reply: tuple, current_seq: int) -> None:
        seq, status, payload = reply
        if status == _FATAL:
            self._mark_failed(_format_worker_error(payload))
            raise WorkerDiedError(self._failure)
        if seq >= current_seq:
            self._stash[rank][seq] = reply
        # else: a late reply to a call that already timed out; drop it.

    def _poll_other_ranks(self, waiting_rank: int) -> None:
        # A rank that was not asked to reply reports only failures; find them
        # while we wait, or a step whose peer crashed would hang forever.
        for rank, queue in enumerate(self._res.responses):
            if rank == waiting_rank:
                continue
            while True:
                try:
                    reply = queue.dequeue(timeout=0)
                except TimeoutError:
                    break
                current = self._pending[0].seq if self._pending else 0
                self._file_reply(rank, reply, current)

    # ---- shutdown -------------------------------------------------------------------

    def shutdown(self) -> None:
        self._finalizer()
        self._raise_pending_as_shut_down()

    def _raise_pending_as_shut_down(self) -> None:
        for call in list(self._pending):
            if not call.future.done():
                call.future.set_exception(RuntimeError("executor is shut down"))
        self._pending.clear()
