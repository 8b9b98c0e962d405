"""EngineCore: the scheduler and the executor, stepping together.

It sizes the KV cache once (the smallest rank decides, so every rank holds the
same block ids), then each `step` schedules, runs the forward and sampling on
the executor, and turns the sampled tokens into per-request outputs.

With pipeline parallelism the executor can hold `max_concurrent_batches`
(= PP size) steps in flight; the core keeps a queue of them so stage 0 starts
batch N+1 while later stages still work on batch N. Requests of an in-flight
batch have no tokens left to schedule (see Scheduler), so consecutive batches
hold disjoint requests.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future

from raylm.config import EngineConfig
from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request
from raylm.core.scheduler import Scheduler
from raylm.executor.abstract import Executor
from raylm.messages import KVCacheConfig, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        executor_class = Executor.get_class(config)
        self.executor = executor_class(config)
        # PP keeps one batch per stage in flight; async scheduling keeps two
        # (the next step is scheduled while the current one computes).
        self.batch_queue_size = self.executor.max_concurrent_batches
        if config.scheduler_config.async_scheduling:
            self.batch_queue_size = max(self.batch_queue_size, 2)
        self.batch_queue: deque[tuple[SchedulerOutput, Future]] = deque()
        try:
            self._initialize_kv_cache()
            self.scheduler = Scheduler(config.scheduler_config, config.cache_config, config.model_config.max_model_len)
        except BaseException:
            self.executor.shutdown()
            raise

    def _initialize_kv_cache(self) -> None:
        cc = self.config.cache_config
        available = min(self.executor.determine_available_memory())
        per_block = max(self.executor.get_kv_cache_bytes_per_block())
        num_blocks = available // per_block if per_block else 0
        # One sequence of max_model_len must fit, or nothing long could ever run.
        min_blocks = -(-self.config.model_config.max_model_len // cc.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"KV cache budget of {available} bytes holds {num_blocks} blocks of {cc.block_size} tokens, "
                f"fewer than the {min_blocks} one sequence of max_model_len "
                f"({self.config.model_config.max_model_len}) needs; raise kv_cache_memory_bytes or lower max_model_len"
            )
        cc.num_blocks = int(num_blocks)
        self.executor.initialize_from_config(KVCacheConfig(num_blocks=cc.num_blocks, block_size=cc.block_size))
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB per rank)",
            cc.num_blocks, cc.block_size, cc.num_blocks * per_block / 2**20,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if self.batch_queue_size > 1:
            return self._step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self.executor.execute_model(scheduler_output)
        runner_output = self.executor.sample_tokens(None)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Launch a new batch if there is room and work; otherwise (or when the
        queue is full) wait for the oldest batch and apply its output."""
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                self.executor.execute_model(scheduler_output, non_block=True)
                future = self.executor.sample_tokens(None, non_block=True)
                self.batch_queue.append((scheduler_output, future))
                if len(self.batch_queue) < self.batch_queue_size:
                    return []
        if not self.batch_queue:
            return []
        scheduler_output, future = self.batch_queue.popleft()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def has_work_in_flight(self) -> bool:
        return bool(self.batch_queue)

    def stats(self) -> dict:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
