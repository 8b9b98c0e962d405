"""The executor contract: every backend runs the same Worker code and differs
only in how a call travels (see docs/architecture.md, "The executor contract"). Which
backend a config asks for is raylm.executor.factory's to say."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from raylm.config import EngineConfig
from raylm.messages import GrammarOutput, KVCacheConfig, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Executor(ABC):
    uses_ray = False
    # Whether a worker runs apart from the engine core (another process or an
    # actor), so that it can die on its own and its death be seen a moment
    # after its peers' errors (a connection reset): the core then waits a short
    # grace before it calls a failed step a step error (EngineCore._diagnose).
    workers_die_apart = True

    def __init__(self, config: EngineConfig):
        self.config = config
        self.is_failed = False
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call `method` on every worker; a list of replies (or the one reply of
        `unique_reply_rank`), or a Future of it when `non_block`."""

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    @property
    def step_timeout_s(self) -> float:
        """A step not done by then means a hung worker (WorkerHungError)."""
        return self.config.fault_tolerance.execute_model_timeout_s

    @property
    def start_timeout_s(self) -> float:
        """Each start-up call (a worker reporting ready, init_device,
        load_model, sizing and creating the KV cache) not done by then means a
        hung worker: the executor names it, tears down what it started, and
        raises, so that neither a first start nor a rebuild waits forever."""
        return self.config.fault_tolerance.engine_start_timeout_s

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        return self.collective_rpc(
            "execute_model",
            timeout=self.step_timeout_s,
            args=(scheduler_output,),
            non_block=non_block,
            unique_reply_rank=self._output_rank,
        )

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        return self.collective_rpc(
            "sample_tokens",
            timeout=self.step_timeout_s,
            args=(grammar_output,),
            non_block=non_block,
            unique_reply_rank=self._output_rank,
        )

    @property
    def _output_rank(self) -> int:
        # The first TP rank of the last PP stage's first CP slot samples and
        # replies (every CP rank samples the same tokens).
        pc = self.config.parallel_config
        return (pc.pipeline_parallel_size - 1) * pc.context_parallel_size * pc.tensor_parallel_size

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory", timeout=self.start_timeout_s)

    def get_kv_cache_bytes_per_block(self) -> list[int]:
        return self.collective_rpc("get_kv_cache_bytes_per_block", timeout=self.start_timeout_s)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_from_config", timeout=self.start_timeout_s, args=(kv_cache_config,))

    def check_liveness(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Raise WorkerDiedError if a worker is known to be dead. Cheap and
        local (no call to the workers), so it is safe while a step hangs."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if any worker is dead or hung: liveness, then (when no step is
        in flight) a heartbeat every rank must answer within
        `fault_tolerance.health_check_timeout_s` (WorkerHungError)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Idempotent; leaves no process, actor or placement group behind."""
