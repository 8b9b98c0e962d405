"""The in-process executor: one Worker, called directly.

With async scheduling the worker runs on one background thread, so the engine
can schedule the next step while this one computes (torch releases the GIL in
its kernels); every call goes through that thread, in order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from raylm.executor.abstract import Executor
from raylm.worker.worker import WorkerWrapper


class UniProcExecutor(Executor):
    workers_die_apart = False  # the worker is this process: no death to wait for

    def _init_executor(self) -> None:
        self._shutdown = False
        self._thread: ThreadPoolExecutor | None = None
        if self.config.scheduler_config.async_scheduling:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="raylm-uniproc-worker")
        self.driver_worker = WorkerWrapper(rank=0)
        self.driver_worker.init_worker(self.config, local_rank=0, distributed_init_method="tcp://127.0.0.1:0")
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _call(self, method, args, kwargs, unique_reply_rank):
        result = self.driver_worker.execute_method(method, *args, **(kwargs or {}))
        return result if unique_reply_rank is not None else [result]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        if self._shutdown:
            raise RuntimeError("executor is shut down")
        if self._thread is not None:
            future = self._thread.submit(self._call, method, args, kwargs, unique_reply_rank)
            return future if non_block else future.result(timeout)
        if not non_block:
            return self._call(method, args, kwargs, unique_reply_rank)
        future: Future = Future()
        try:
            future.set_result(self._call(method, args, kwargs, unique_reply_rank))
        except Exception as e:
            future.set_exception(e)
        return future

    def check_health(self) -> None:
        # The worker lives in this process: if we are running, so is it.
        if self._shutdown:
            raise RuntimeError("executor is shut down")

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self.driver_worker.worker is not None:
            self.driver_worker.worker.shutdown()
