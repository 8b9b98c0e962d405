"""MultiprocExecutor: one spawned process per rank on this machine; each step is
broadcast on a shared-memory MessageQueue, replies come back on per-worker queues.

Liveness is watched both ways: a monitor thread in the driver waits on the
workers' process sentinels, and each worker exits when its death pipe from the
driver hits EOF, so a `kill -9` on either side leaves no orphan and no segment.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import psutil

from raylm.config import EngineConfig
from raylm.distributed.parallel_state import host_rendezvous_store
from raylm.distributed.shm_broadcast import MessageQueue, MessageQueueHandle
from raylm.distributed.shm_ring import unlink_segment
from raylm.executor.abstract import Executor
from raylm.executor.errors import WorkerHungError
from raylm.executor.mq_rpc import MqRpcClient, WorkerDiedError, WorkerLoop
from raylm.startup_heap import freeze_startup_heap
from raylm.worker.cpu_placement import RankPlacement, apply_rank_placement, plan_cpu_placement
from raylm.worker.cpu_topology import read_topology

__all__ = ["MultiprocExecutor", "WorkerDiedError", "WorkerProc"]

logger = logging.getLogger(__name__)

WORKER_SHUTDOWN_TIMEOUT_S = 5.0
FAILED_WORKER_GRACE_S = 0.5
_HOSTNAME = socket.gethostname()


def _abnormal_state(pid: int) -> str:
    """ ", stopped" for a process that is not running normally, else "": a
    step deadline names the rank that hung, not only the one that waited."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return ", gone"
    return "" if status in (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP) else f", {status}"


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
        placement: RankPlacement,
        ready_pipe: multiprocessing.connection.Connection,
        death_pipe: multiprocessing.connection.Connection,
    ) -> None:
        # The driver owns this process's lifetime (the broadcast queue closes,
        # the death pipe hits EOF, or it kills): a signal sent to the whole
        # process group must not take a rank away while streams drain.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # Before anything starts threads or loads weights: the threads started
        # later inherit the pinning, and memory is first touched from the rank's cores.
        apply_rank_placement(placement, whole_process=True)
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
        freeze_startup_heap()
        WorkerLoop(self.wrapper, self.broadcast, self.response).run()


# ---- the driver side --------------------------------------------------------------------


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
        # The ranks' rendezvous store, served from this process (world size > 1).
        self.store = None
        # A failed executor's workers get no grace: some are dead, stopped or
        # stuck in a collective with a dead peer, and recovery is waiting.
        self.failed = False

    def shutdown(self) -> None:
        if self.shutting_down.is_set():
            return
        self.shutting_down.set()
        if self.broadcast is not None:
            self.broadcast.close()  # every worker's dequeue raises QueueClosedError: a clean exit
        grace = FAILED_WORKER_GRACE_S if self.failed else WORKER_SHUTDOWN_TIMEOUT_S
        deadline = time.monotonic() + grace
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                log = logger.info if self.failed else logger.warning
                log("worker pid %s did not exit in %.1f s; killing it", proc.pid, grace)
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
        self.store = None  # its server stops with it; the ranks that used it are gone


class MultiprocExecutor(Executor):
    """TP x PP ranks as local processes (multiprocessing spawn).

    Calls are broadcast to every rank in order and replies are consumed in the
    same order (a FIFO of pending calls), which is what lets the engine keep
    several steps in flight with `non_block=True`.
    """

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self._rpc: MqRpcClient | None = None
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.shutdown)
        try:
            self._start_workers()
            # Bounded: a rank that never joins the rendezvous is named, not waited on forever.
            self.collective_rpc("init_device", timeout=self.start_timeout_s)
            self.collective_rpc("load_model", timeout=self.start_timeout_s)
        except BaseException as e:
            if isinstance(e, TimeoutError):
                # A hung rank will not exit by itself: no grace, kill it now.
                self.is_failed = True
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        res = self._res
        # One node, one user: a collective_rpc callable may ride inline in the
        # shared-memory ring (never a socket; see raylm.executor.mq_rpc).
        res.broadcast = MessageQueue(num_local_readers=self.world_size, local_callables=True)
        init_method = "tcp://127.0.0.1:0"  # unused by a single rank
        if self.world_size > 1:
            res.store, init_method = host_rendezvous_store(self.start_timeout_s)
        plan = plan_cpu_placement(
            read_topology(),
            self.world_size,
            engine_loop_here=True,
            num_threads=self.config.num_threads,
            cpu_bind=self.config.cpu_bind,
        )
        logger.info("CPU placement: %s", plan.describe())
        ready_pipes = []
        for rank in range(self.world_size):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=WorkerProc.main,
                args=(
                    self.config,
                    rank,
                    res.broadcast.export_handle(),
                    init_method,
                    plan.ranks[rank],
                    ready_w,
                    death_r,
                ),
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
        try:
            res.broadcast.wait_until_ready(timeout=self.start_timeout_s)
        except TimeoutError:
            raise WorkerHungError(
                f"worker start-up: the ranks did not attach to the broadcast queue within "
                f"{self.start_timeout_s:g} s (engine_start_timeout)"
            ) from None
        # The failure callback must not keep the executor alive (its finalizer
        # is what shuts the workers down when it is dropped).
        self_ref = weakref.ref(self)

        def on_failure(_reason: str) -> None:
            executor = self_ref()
            if executor is not None:
                executor.is_failed = True

        processes = res.processes  # not self: the client must not keep the executor alive

        def describe_rank(rank: int) -> str:
            pid = processes[rank].pid
            return f"rank {rank} (pid {pid}, node {_HOSTNAME}{_abnormal_state(pid)})"

        self._rpc = MqRpcClient(res.broadcast, res.responses, res.shutting_down, on_failure, describe_rank)
        res.monitor_wakeup = ctx.Pipe(duplex=False)
        res.monitor = threading.Thread(target=self._monitor_workers, name="MultiprocWorkerMonitor", daemon=True)
        res.monitor.start()
        logger.info("started %d worker processes: %s", self.world_size, self.worker_pids)

    def _wait_for_ready(self, ready_pipes: list) -> list[MessageQueueHandle]:
        handles: list[MessageQueueHandle | None] = [None] * self.world_size
        timeout = self.start_timeout_s
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(ready_pipes))
        try:
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    hung = ", ".join(f"rank {r} (pid {self._res.processes[r].pid})" for r in sorted(waiting))
                    raise WorkerHungError(
                        f"worker start-up (init_worker): {hung} did not report ready within "
                        f"{timeout:g} s (engine_start_timeout)"
                    )
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

    def describe_rank(self, rank: int) -> str:
        return self._rpc.describe_rank(rank) if self._rpc is not None else f"rank {rank}"

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
            res.processes[rank].join(1.0)  # the sentinel fires a moment before the exit code can be read
            self._mark_failed(self._death_message(rank))

    def _death_message(self, rank: int) -> str:
        code = self._res.processes[rank].exitcode
        cause = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"worker {self.describe_rank(rank)} died: {cause}"

    def _mark_failed(self, reason: str) -> None:
        if self._rpc is not None:
            self._rpc.mark_failed(reason)
        else:
            self.is_failed = True

    @property
    def _failure(self) -> str | None:
        return self._rpc.failure if self._rpc is not None else None

    def _raise_if_failed(self) -> None:
        if self._rpc is None:
            raise RuntimeError("executor workers are not running")
        self._rpc.raise_if_failed()

    def check_liveness(self) -> None:
        for rank, proc in enumerate(self._res.processes):
            if not proc.is_alive():
                self._mark_failed(self._death_message(rank))
        self._raise_if_failed()

    def check_health(self) -> None:
        self.check_liveness()
        # A live process may still be wedged (SIGSTOP, a deadlock): when
        # nothing else is in flight, make every rank answer.
        if not self._rpc.pending:
            self.collective_rpc("check_health", timeout=self.config.fault_tolerance.health_check_timeout_s)

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
        if self._rpc is None:
            raise RuntimeError("executor workers are not running")
        return self._rpc.call(method, timeout, args, kwargs, non_block, unique_reply_rank)

    # ---- shutdown -------------------------------------------------------------------

    def shutdown(self) -> None:
        self._res.failed = self.is_failed
        self._finalizer()
        if self._rpc is not None:
            self._rpc.cancel_pending()
