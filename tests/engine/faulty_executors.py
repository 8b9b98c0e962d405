"""Executors whose workers fail on purpose, for test_recovery.py.

They live in a module of their own, not in the test module, because every
worker process the multiprocessing executor spawns unpickles the engine
config, and with it imports the module of its executor class by name: a test
module would cost each worker the imports of a test (transformers for the
oracle, Ray), seconds of a busy 2-core machine at each of a test's rebuilds.
So this module imports raylm's executors only, and the callables it sends to
the workers where they are used (they travel by value)."""

from __future__ import annotations

from raylm.executor.multiproc_executor import MultiprocExecutor
from raylm.executor.uniproc_executor import UniProcExecutor

POISON = 700  # a token id the poisoned workers refuse to run (see install_poison)


class PoisonedUniProcExecutor(UniProcExecutor):
    """A worker that raises on any step holding the POISON token: every
    executor the engine builds is poisoned again, like a real bug would be."""

    def _init_executor(self) -> None:
        from tests.executor.worker_callables import install_poison

        super()._init_executor()
        self.collective_rpc(install_poison, args=(POISON,))


class PoisonedMultiprocExecutor(MultiprocExecutor):
    def _init_executor(self) -> None:
        from tests.executor.worker_callables import install_poison

        super()._init_executor()
        self.collective_rpc(install_poison, args=(POISON,))


class CorruptCopyOnRank1Executor(MultiprocExecutor):
    """Rank 1 loads the weights from `corrupt_dir`, as a node whose local copy
    of the checkpoint is damaged would."""

    corrupt_dir = ""

    def collective_rpc(self, method, *args, **kwargs):
        if method == "load_model":
            from tests.executor.worker_callables import point_rank_at_model_folder

            super().collective_rpc(point_rank_at_model_folder, args=(1, self.corrupt_dir))
        return super().collective_rpc(method, *args, **kwargs)
