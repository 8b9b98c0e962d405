"""Executors that hang at start-up or in a rebuild, for the deadline tests
(test_start_deadlines.py, test_rebuild_watchdog.py). They live in a module of
their own, not in a test module, because an engine-core process started with
`spawn` (and a Ray actor, for a callable) imports them by name."""

from __future__ import annotations

import functools
import os
import threading
import time

from raylm.executor.errors import WorkerHungError
from raylm.executor.multiproc_executor import MultiprocExecutor
from raylm.executor.uniproc_executor import UniProcExecutor


def _hang() -> None:
    threading.Event().wait()


class HangingUniExecutor(UniProcExecutor):
    """Never finishes starting: stands for a core hung loading its model."""

    def _init_executor(self) -> None:
        _hang()


def hang_in_on_rank_1(method: str, worker) -> None:
    """Run on every rank (as functools.partial(hang_in_on_rank_1, method)):
    from now on rank 1 hangs in `method`, as a wedged worker would."""
    if worker.rank == 1:
        setattr(worker, method, lambda *args, **kwargs: _hang())


# The deadline of the start-up calls that follow a finished `_init_executor`
# (sizing and creating the KV cache) in an executor that hangs in one of them.
# It is the deadline under test (Executor.start_timeout_s, handed to every
# start-up call), only shorter than the engine_start_timeout that starting the
# ranks and loading the model need on a busy machine: the hung call waits it
# out in seconds, not the whole start-up budget.
HUNG_AFTER_START_S = 3.0


class HangOnRank1Executor(MultiprocExecutor):
    """Rank 1 hangs in the start-up call named by `hang_in`."""

    hang_in = "load_model"
    hangs = True
    started = False  # _init_executor is done: the ranks are up and the model loaded

    def _init_executor(self) -> None:
        super()._init_executor()
        self.started = True

    @property
    def start_timeout_s(self) -> float:
        if self.hangs and self.started:
            return HUNG_AFTER_START_S
        return super().start_timeout_s

    def collective_rpc(self, method, *args, **kwargs):
        if method == self.hang_in:
            super().collective_rpc(functools.partial(hang_in_on_rank_1, method), timeout=self.start_timeout_s)
        return super().collective_rpc(method, *args, **kwargs)


class HangInSizingOnRank1Executor(HangOnRank1Executor):
    """Rank 1 hangs while the KV cache is sized (a start-up collective with
    no deadline of its own before: determine_available_memory)."""

    hang_in = "determine_available_memory"


# ---- a rebuild held open by the test ---------------------------------------------------------
# The engine core runs in a process of its own: the test steers it through
# files in the folder named by this variable (set before the core starts).
GATE_DIR_ENV = "RAYLM_TEST_REBUILD_GATE"


def gate(name: str) -> str:
    return os.path.join(os.environ[GATE_DIR_ENV], name)


class GatedRebuildUniExecutor(UniProcExecutor):
    """Its health check fails once when the file `fail` appears (the idle
    core then rebuilds it), and it does not start while `hold` exists: a
    rebuild that takes as long as the test wants."""

    def _init_executor(self) -> None:
        while os.path.exists(gate("hold")):
            time.sleep(0.05)
        super()._init_executor()

    def check_health(self) -> None:
        if os.path.exists(gate("fail")):
            os.remove(gate("fail"))
            raise WorkerHungError("injected: a worker stopped answering health checks")
        super().check_health()


class HangInFirstRebuildOnRank1Executor(HangOnRank1Executor):
    """Starts normally; in the first rebuild (its second instance) rank 1
    hangs while the KV cache is sized. Instances are counted in the process
    that builds the executors (an offline LLM: the test's own)."""

    hang_in = "determine_available_memory"
    instances = 0
    all_worker_pids: list[int] = []  # of every instance, for the test to check they are gone

    def __init__(self, config):
        type(self).instances += 1
        self.hangs = type(self).instances == 2
        super().__init__(config)
        type(self).all_worker_pids = type(self).all_worker_pids + self.worker_pids

    def collective_rpc(self, method, *args, **kwargs):
        if not self.hangs:
            return MultiprocExecutor.collective_rpc(self, method, *args, **kwargs)
        return super().collective_rpc(method, *args, **kwargs)
