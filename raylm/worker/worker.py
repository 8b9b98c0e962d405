"""The Worker: one model rank. It owns the device, joins the process groups,
loads its shard of the model, holds its KV cache and runs steps.

Every executor backend runs this same class; they differ only in how a call
reaches it (a direct call, a shared-memory queue, a Ray actor method).
"""

from __future__ import annotations

import logging
import os

import psutil
import torch

from raylm.config import EngineConfig
from raylm.distributed import parallel_state
from raylm.messages import GrammarOutput, KVCacheConfig, ModelRunnerOutput, SchedulerOutput
from raylm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Default KV budget on CPU when none is given (vLLM's CPU backend uses 4 GiB too);
# capped at a quarter of the memory that is free when the worker starts.
_CPU_DEFAULT_KV_BYTES = 4 << 30


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str = "tcp://127.0.0.1:0",
    ):
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        cfg = self.config
        pc = cfg.parallel_config
        if cfg.device == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            if cfg.num_threads:
                torch.set_num_threads(cfg.num_threads)
            backend = "gloo"
        parallel_state.init_distributed_environment(
            pc.world_size, self.rank, self.distributed_init_method, backend,
            timeout_s=cfg.fault_tolerance.execute_model_timeout_s,
        )
        parallel_state.initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size, backend)
        torch.manual_seed(cfg.model_config.seed)
        self.model_runner = ModelRunner(cfg, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.kv_cache_bytes_per_block()

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to the KV cache."""
        cc = self.config.cache_config
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return max(int(total * cc.gpu_memory_utilization) - used, 0)
        return min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 4)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config.num_blocks)

    @property
    def _pp_over_torch_distributed(self) -> bool:
        # A compiled Ray graph carries stage-to-stage tensors itself; every
        # other transport moves them with torch.distributed send/recv.
        pc = self.config.parallel_config
        return not (pc.distributed_executor_backend == "ray" and pc.ray_step_transport == "cgraph")

    def execute_model(self, scheduler_output: SchedulerOutput, intermediate: torch.Tensor | None = None):
        """Run this rank's part of the forward.

        With torch.distributed PP transport, a non-first stage receives the
        previous stage's state and a non-last stage sends its own on (and
        returns None). Every rank of stage k sends to the same TP rank of
        stage k+1, in step order, so sends and receives pair up without tags.
        """
        pp = parallel_state.get_pp_group()
        via_dist = self._pp_over_torch_distributed
        if via_dist and not pp.is_first_rank and scheduler_output.total_num_scheduled_tokens > 0:
            buffer = self.model_runner.make_empty_intermediate(scheduler_output.total_num_scheduled_tokens)
            intermediate = pp.recv(buffer, pp.rank_in_group - 1)
        out = self.model_runner.execute_model(scheduler_output, intermediate)
        if via_dist and out is not None and not pp.is_last_rank:
            pp.send(out, pp.rank_in_group + 1)
            return None
        return out

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        return self.model_runner.sample_tokens(grammar_output)

    def check_health(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.model_runner = None
        parallel_state.destroy_model_parallel()


class WorkerWrapper:
    """Creates the Worker lazily and dispatches calls to it by name.

    Lazy because a rank's final identity is only known after the executor has
    sorted its workers (`adjust_rank`), which happens after the process or actor
    exists; and a callable may be sent instead of a name for ad-hoc work.
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.worker: Worker | None = None

    def adjust_rank(self, rank_mapping: dict[int, int]) -> None:
        self.rank = rank_mapping[self.rank]

    def init_worker(self, config: EngineConfig, local_rank: int, distributed_init_method: str) -> None:
        self.worker = Worker(config, self.rank, local_rank, distributed_init_method)

    def execute_method(self, method, *args, **kwargs):
        if callable(method):
            return method(self.worker, *args, **kwargs)
        target = self if hasattr(self, method) and method != "execute_method" else self.worker
        return getattr(target, method)(*args, **kwargs)
