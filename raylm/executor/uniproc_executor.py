"""The in-process executor: one Worker, called directly."""

from __future__ import annotations

from concurrent.futures import Future

from raylm.executor.abstract import Executor
from raylm.worker.worker import WorkerWrapper


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = WorkerWrapper(rank=0)
        self.driver_worker.init_worker(self.config, local_rank=0, distributed_init_method="tcp://127.0.0.1:0")
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")
        self._shutdown = False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        if self._shutdown_called():
            raise RuntimeError("executor is shut down")
        future: Future = Future()
        try:
            result = self.driver_worker.execute_method(method, *args, **(kwargs or {}))
            future.set_result(result if unique_reply_rank is not None else [result])
        except Exception as e:
            if not non_block:
                raise
            future.set_exception(e)
        return future if non_block else future.result()

    def _shutdown_called(self) -> bool:
        return getattr(self, "_shutdown", False)

    def check_health(self) -> None:
        # The worker lives in this process: if we are running, so is it.
        if self._shutdown_called():
            raise RuntimeError("executor is shut down")

    def shutdown(self) -> None:
        if self._shutdown_called():
            return
        self._shutdown = True
        if self.driver_worker.worker is not None:
            self.driver_worker.worker.shutdown()
