"""EngineCore: the scheduler and the executor, stepping together.

It sizes the KV cache once (the smallest rank decides, so every rank holds the
same block ids), then each `step` schedules, runs the forward and sampling on
the executor, and turns the sampled tokens into per-request outputs.
"""

from __future__ import annotations

import logging

from raylm.config import EngineConfig
from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request
from raylm.core.scheduler import Scheduler
from raylm.executor.abstract import Executor
from raylm.messages import KVCacheConfig

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        executor_class = Executor.get_class(config)
        self.executor = executor_class(config)
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
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self.executor.execute_model(scheduler_output)
        runner_output = self.executor.sample_tokens(None)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def stats(self) -> dict:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
