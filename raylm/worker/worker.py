"""The Worker: one model rank. It owns the device, joins the process groups,
loads its shard of the model, holds its KV cache and runs steps.

Every executor backend runs this same class; they differ only in how a call
reaches it (a direct call, a shared-memory queue, a Ray actor method).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import psutil
import torch

from raylm.config import EngineConfig
from raylm.distributed import parallel_state
from raylm.kv_transfer.host_tier import RankHostTier, slots_for_budget
from raylm.kv_transfer.rank import RankTransfers
from raylm.messages import GrammarOutput, KVCacheConfig, ModelRunnerOutput, SchedulerOutput
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.worker import cpu_placement, cpu_topology, thread_governance
from raylm.worker.fault_injection import FaultInjector
from raylm.worker.memory_profiling import (
    CudaMemory,
    kv_cache_budget_bytes,
    largest_prefill_attention,
    measure_peak_activation_bytes,
    run_profiling_step,
)
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
        self.kv = RankTransfers(rank)  # K/V transfers between engines, and their copies beside the steps
        # CPU seconds of unpaced copies (on a request's path: a prefix pull, a
        # migration's final stage), taken by the core after each pull's copy.
        self.kv_copy_cpu_s = 0.0
        self.kv_tier = RankHostTier(rank)  # the node's tier of evicted K/V blocks: this rank's file
        # Free GPU memory before this rank allocated anything (see determine_available_memory).
        self._cuda_free_at_start: int | None = None
        self.cpu_placement: cpu_placement.RankPlacement | None = None
        # (thread id, its CPUs) when this worker pinned a thread it does not own.
        self._affinity_before: tuple[int, set[int]] | None = None
        # Watches the forward passes of a rank the plan pinned (for other work on
        # its cores) or of a single rank (whose thread count follows them).
        self.contention_watch: thread_governance.ContentionWatch | thread_governance.ThreadGovernor | None = None
        # Tests of the failure model only (RAYLM_FAULT_INJECTION); None otherwise.
        self.fault_injector = FaultInjector.from_config(
            config.fault_tolerance.fault_injection, rank, config.parallel_config.world_size
        )

    def init_device(self) -> None:
        cfg = self.config
        pc = cfg.parallel_config
        if cfg.device == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
            # What this process's allocator caches, and what an engine shut
            # down before this one in the same process still holds in reference
            # cycles, is free for this one too; it must not be freed while this
            # one measures what it holds (below).
            gc.collect()
            torch.cuda.empty_cache()
            self._cuda_free_at_start = torch.cuda.mem_get_info(self.device)[0]
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            # A worker process or Ray actor was placed by its executor before it
            # got here; the uni backend's model shares the engine's process.
            self.cpu_placement = cpu_placement.process_placement() or self._place_in_engine_process()
            self.contention_watch = thread_governance.watch_for(self.cpu_placement)
            backend = "gloo"
        parallel_state.init_distributed_environment(
            pc.world_size,
            self.rank,
            self.distributed_init_method,
            backend,
            timeout_s=cfg.fault_tolerance.execute_model_timeout_s,
        )
        parallel_state.initialize_model_parallel(
            pc.tensor_parallel_size, pc.pipeline_parallel_size, backend, cp_size=pc.context_parallel_size
        )
        torch.manual_seed(cfg.model_config.seed)
        self.model_runner = ModelRunner(cfg, self.device)

    def _place_in_engine_process(self) -> cpu_placement.RankPlacement:
        """Threads (and, with an explicit cpu_bind, cores) for a model that runs
        in the engine's own process: only this thread is pinned, so the engine
        loop's other threads keep the cores the plan leaves them."""
        cfg = self.config
        plan = cpu_placement.plan_cpu_placement(
            cpu_topology.read_topology(),
            1,
            engine_loop_here=True,
            num_threads=cfg.num_threads,
            cpu_bind=cfg.cpu_bind,
        )
        placement = plan.ranks[0]
        if placement.cpus is not None:
            self._affinity_before = (threading.get_native_id(), os.sched_getaffinity(0))
        cpu_placement.apply_rank_placement(placement, whole_process=False)
        logger.info("CPU placement: %s", plan.describe())
        return placement

    def load_model(self) -> None:
        self.model_runner.load_model()
        if self.device.type == "cpu":
            # Build (the first run on a machine: about a minute) or load the C++
            # kernels while the engine starts, not inside its first request's step.
            get_cpu_kernels()

    def get_kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.kv_cache_bytes_per_block()

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to the KV cache."""
        cc = self.config.cache_config
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes
        if self.device.type == "cuda":
            return self._cuda_kv_budget()
        return min(_CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 4)

    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization as vLLM means it: this instance may use that
        fraction of the GPU's total memory for weights, activations and KV
        cache together; memory other processes hold is theirs, but must leave
        that fraction free when the worker starts. Activations are measured by
        a profiling step at the largest batch (memory_profiling.py)."""
        cfg = self.config
        util = cfg.cache_config.gpu_memory_utilization
        free, total = torch.cuda.mem_get_info(self.device)
        free_at_start = self._cuda_free_at_start if self._cuda_free_at_start is not None else free
        budget = int(total * util)
        if free_at_start < budget:
            raise ValueError(
                f"gpu_memory_utilization: {util} of {self.device}'s {total / 2**30:.1f} GiB is "
                f"{budget / 2**30:.1f} GiB, but only {free_at_start / 2**30:.1f} GiB was free at start-up "
                "(other processes hold the rest); lower gpu_memory_utilization"
            )
        num_tokens, max_len = cfg.scheduler_config.max_num_batched_tokens, cfg.model_config.max_model_len
        with largest_prefill_attention(self.model_runner, num_tokens, max_len) as attention:
            peak_activation = measure_peak_activation_bytes(
                lambda: run_profiling_step(
                    self.model_runner, num_tokens, cfg.scheduler_config.max_num_seqs, max_len, attention
                ),
                CudaMemory(self.device),
            )
        torch.cuda.empty_cache()  # the scratch caches' blocks: free memory below must not count them
        free = torch.cuda.mem_get_info(self.device)[0]
        # At least what torch's allocator holds for this rank (the weights):
        # memory something else in this process freed meanwhile must not make
        # the difference of the two readings small, or negative.
        weights_and_context = max(free_at_start - free, torch.cuda.memory_allocated(self.device))
        kv_bytes = kv_cache_budget_bytes(total, util, weights_and_context, peak_activation)
        logger.info(
            "KV cache budget on %s: %.2f GiB (%.0f%% of %.1f GiB; this rank holds %.2f GiB, "
            "its largest step peaks at %.2f GiB more)",
            self.device,
            kv_bytes / 2**30,
            util * 100,
            total / 2**30,
            weights_and_context / 2**30,
            peak_activation / 2**30,
        )
        return kv_bytes

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        # The scheduler counts the blocks of the whole CP group; this rank holds
        # block ids g with g % cp == its cp rank, as its blocks g // cp
        # (raylm.worker.cp_input.cp_shard_of_blocks).
        cp = self.config.parallel_config.context_parallel_size
        self.model_runner.initialize_kv_cache(-(-kv_cache_config.num_blocks // cp))

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
        if self.fault_injector is not None:
            self.fault_injector.before_step(scheduler_output)
        pp = parallel_state.get_pp_group()
        via_dist = self._pp_over_torch_distributed
        if via_dist and not pp.is_first_rank and scheduler_output.total_num_scheduled_tokens > 0:
            num_rows = self.model_runner.num_rows_on_this_rank(scheduler_output)  # a CP rank's share
            buffer = self.model_runner.make_empty_intermediate(num_rows)
            intermediate = pp.recv(buffer, pp.rank_in_group - 1)
        watch = self.contention_watch
        if watch is not None:
            watch.begin()
        out = self.model_runner.execute_model(scheduler_output, intermediate)
        if watch is not None and watch.end(scheduler_output.total_num_scheduled_tokens):
            self._unpin(watch)
        if via_dist and out is not None and not pp.is_last_rank:
            pp.send(out, pp.rank_in_group + 1)
            return None
        return out

    def _unpin(self, watch: thread_governance.ContentionWatch) -> None:
        """Its cores are shared with other work: let the OS place this rank."""
        pinned_to = self.cpu_placement.cpus
        cpus = cpu_placement.unpin_process()
        self.contention_watch = None
        self.cpu_placement = cpu_placement.process_placement()
        logger.warning(
            "rank %d: its forward passes got %.0f%% of the CPU time of %d thread(s) on cores %s: other "
            "work shares them; unpinned, the OS now places it on %s",
            self.rank,
            100 * watch.last_share,
            watch.num_threads,
            cpu_placement.format_cpus(pinned_to),
            cpu_placement.format_cpus(cpus),
        )

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | None:
        return self.model_runner.sample_tokens(grammar_output)

    def check_health(self) -> int:
        return os.getpid()

    def torch_threads(self) -> int:
        """The torch threads this rank's forward passes run with (read in
        the thread that runs them): what /health shows per replica."""
        import torch

        return torch.get_num_threads()

    # ---- K/V transfers (raylm.kv_transfer): the ranks' side of the one transport interface ----------
    # Each call's `route` names its transfer kind (raylm.kv_transfer.transport); `kv` dispatches to it.

    def kv_export(self, route: dict, block_ids: list[int], background: bool = False) -> list:
        """This rank's K/V of `block_ids` for a stage; [bytes, where to fetch them or None]
        (`background`: gathered by a thread beside the steps; the size is returned at once)."""
        return self._counting_cpu(background, self.kv.export, self.model_runner.kv_caches, route, block_ids, background)

    def kv_import(self, route: dict, block_ids: list[int], background: bool = False) -> int | None:
        """The same source rank's K/V of a stage into `block_ids` of this rank's cache
        (`background`: by a thread beside the steps; its outcome is `kv_copies_done`'s)."""
        return self._counting_cpu(
            background, self.kv.import_, self.model_runner.kv_caches, route, block_ids, background
        )

    def _counting_cpu(self, background: bool, copy, *args):
        """`copy(*args)`; when not `background`, its CPU time (this thread's) is
        added to `kv_copy_cpu_s`. Background copies are paced by their own
        budget (raylm.kv_transfer.background) and not counted here."""
        if background:
            return copy(*args)
        started = time.thread_time()
        try:
            return copy(*args)
        finally:
            self.kv_copy_cpu_s += time.thread_time() - started

    def kv_take_copy_cpu(self) -> float:
        """The CPU seconds of unpaced copies since the last call."""
        spent, self.kv_copy_cpu_s = self.kv_copy_cpu_s, 0.0
        return spent

    def kv_copies_done(self, names: list[str]) -> dict:
        """The background imports of `names` that have ended: name -> [ok, bytes or error]."""
        return self.kv.copies_done(names)

    def kv_cancel(self, names: list[str]) -> None:
        """Background imports of `names` (their migration was abandoned) stop
        waiting for their source; their outcome is still `kv_copies_done`'s."""
        self.kv.cancel(names)

    def kv_withdraw(self, route: dict, prefix: str) -> int:
        """Drop what this rank still offers of the transfers named `prefix...` (nobody fetched it)."""
        return self.kv.withdraw(route, prefix)

    # ---- the tier of evicted K/V blocks (raylm.kv_transfer.host_tier) ---------------------------------

    def kv_tier_slots(self, budget_bytes: int) -> int:
        """How many blocks of this rank's K/V fit in `budget_bytes` of tier."""
        return slots_for_budget(self.model_runner.kv_caches, budget_bytes)

    def kv_tier_open(self, prefix: str, num_slots: int) -> None:
        self.kv_tier.open(self.model_runner.kv_caches, prefix, num_slots)

    def kv_tier_copy(self, stores: list, loads: list) -> None:
        """Evicted blocks into their slots, then slots into the blocks of tier hits."""
        self.kv_tier.copy(self.model_runner.kv_caches, stores, loads)

    def kv_tier_read(self, prefix: str, slots: list[int], hashes: list[bytes], block_ids: list[int]) -> int:
        """Another core's slots into `block_ids`: how many, from the first, held their blocks."""
        return self.kv_tier.read_other(self.model_runner.kv_caches, prefix, slots, hashes, block_ids)

    @property
    def kv_network(self):
        """This rank's endpoint for transfers between nodes, once an export started it."""
        return self.kv.network

    def shutdown(self) -> None:
        self.kv.close()
        self.kv_tier.close()
        runner, self.model_runner = self.model_runner, None
        if runner is not None and self.device is not None and self.device.type == "cuda":
            # Hand the device memory back now, even where something still holds
            # the runner (a test's traceback, a user's reference).
            runner.release_device_memory()
            torch.cuda.empty_cache()
        if self._affinity_before is not None:
            # The pinned thread is the engine's (maybe the user's main thread):
            # give it back its cores.
            thread_id, cpus = self._affinity_before
            self._affinity_before = None
            try:
                os.sched_setaffinity(thread_id, cpus)
            except OSError:  # that thread has ended
                pass
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
