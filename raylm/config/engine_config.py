"""EngineConfig: the engine's settings as it runs with them, one object shipped
to every worker, made of one dataclass per concern (model, KV cache,
scheduling, parallelism, fault tolerance; autoscaling's is autoscale.py,
LoRA's lora.py, speculative decoding's speculative.py).

Each dataclass checks its own settings when it is made (`__post_init__`: a
ValueError naming the setting as the user spells it), and EngineConfig the
rules between them; filling in what the user left unset, from the model
folder, the device and who runs the engine, is resolve.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from raylm.config.autoscale import AutoscaleConfig
from raylm.config.lora import LoRAConfig
from raylm.config.speculative import SpeculativeConfig
from raylm.cpu_bind import parse_cpu_bind
from raylm.model.arch_config import ArchConfig


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    seed: int
    max_model_len: int
    arch: ArchConfig
    # The model as the user named it (a folder or a Hub id); `model` is its local folder.
    model_name: str | None = None
    # SamplingParams defaults from generation_config.json, for requests that
    # leave those fields unset; and the end-of-sequence ids that file lists.
    default_sampling_params: dict = field(default_factory=dict)
    generation_eos_token_ids: list[int] = field(default_factory=list)
    # Replaces the tokenizer's chat template (--chat-template), already read.
    chat_template: str | None = None
    # "int8" (weights quantized at load), "gguf" (`model` is a GGUF file), or None.
    quantization: str | None = None

    def __post_init__(self):
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                f"({self.arch.max_position_embeddings})"
            )

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # An explicit KV budget in bytes; None sizes it from the device (see Worker).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Decided after profiling, identical on every rank.
    num_blocks: int | None = None
    # Context parallelism: the blocks are spread over this many ranks (block
    # id g on CP rank g % num_kv_shards); set from context_parallel_size.
    num_kv_shards: int = 1
    # The node-local tier of evicted blocks (raylm.core.host_tier), in GiB
    # for the whole node (its data-parallel replicas share it out); None: off.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # Where the cores' tier files go: the supervisor's private folder in
    # /dev/shm on its host, set when it starts (None: each core makes its
    # own, as a core on another host does).
    kv_offloading_folder: str | None = None
    kv_offloading_host: str | None = None
    # How many cores share the node's tier out: set with the folder (a Ray
    # replica's own config says data_parallel_size 1); None: this core alone.
    kv_offloading_replicas: int | None = None

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        size = self.kv_offloading_size
        if size is not None and (not isinstance(size, (int, float)) or isinstance(size, bool) or not 0 < size < 2**20):
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {size!r}")
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native', got {self.kv_offloading_backend!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}")


# A decode burst holds new requests back for its length (see
# raylm.core.decode_burst): past this many steps nothing is gained.
MAX_SCHEDULER_STEPS = 64


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    # Most decode steps one schedule() may hand out at once (a decode burst,
    # see raylm.core.decode_burst); 1 schedules every step.
    num_scheduler_steps: int = 8
    # How long a burst may take, at the pace of the last decode steps: what a
    # request arriving meanwhile waits at most to start. Online serving keeps
    # it short; offline every request is queued before the first step, so a
    # burst holds nobody back (see resolve.DECODE_BURST_BUDGET_S).
    decode_burst_budget_s: float = 0.01

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        steps = self.num_scheduler_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps must be an integer from 1 to {MAX_SCHEDULER_STEPS}, got {steps!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


def replica_role(index: int, prefill_replicas: int) -> str:
    """A data-parallel replica's role under P/D: "prefill" for the first
    `prefill_replicas` indices, "decode" for the others, "both" without P/D.
    By index, so that a restarted or replaced replica keeps its role, a
    scale-out adds decode replicas and a scale-in removes them first."""
    if not prefill_replicas:
        return "both"
    return "prefill" if index < prefill_replicas else "decode"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Context parallelism: each sequence's KV cache sharded across this many
    # ranks (the pp x cp x tp layout of docs/architecture.md, "Collectives";
    # raylm.model.layers.attention).
    context_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"
    ray_placement_timeout: float = 60.0
    # "mq" by measurement (benchmarks/bench_ray_transport.py, 7M-param bf16 llama,
    # 16 x 64 in / 64 out, TP=2, 1 thread per worker, 2 shared CPU cores):
    # mq 662 out tok/s, 24.2 ms/step, idle workers 3% CPU each; cgraph 294 tok/s,
    # 54.4 ms/step, idle workers 73% CPU each (its channel readers spin).
    ray_step_transport: str = "mq"
    # A Ray placement group to run in (else the current one, else a new one),
    # and which of its bundles the ranks may take (None: any that fit). A
    # data-parallel replica hands its executor the bundles after its own.
    placement_group: object | None = None
    placement_group_bundles: list[int] | None = None
    # Data parallelism: replicas of the whole engine core (docs/architecture.md,
    # "Data parallel and the supervisor"), placed packed onto few nodes or
    # spread one per node.
    data_parallel_size: int = 1
    data_parallel_backend: str = "ray"
    data_parallel_placement: str = "pack"
    # How a new request picks its replica (raylm.engine.routing, which checks
    # the name): kv_aware, load or vllm.
    routing_policy: str = "kv_aware"
    # Live migration from a much busier replica to the least busy (raylm.engine.migration).
    data_parallel_rebalance: bool = False
    # A new request's cached prefix pulled from the replica that holds it to
    # the one routing chose, instead of computed again (raylm.engine.prefix_pull).
    prefix_pull: bool = True
    # Prefill/decode disaggregation (raylm.engine.handoff): replicas 0..P-1
    # prefill new requests and hand each to a decode replica (P..N-1) after
    # its first token. 0: every replica does both.
    prefill_replicas: int = 0
    # Conditional disaggregation (raylm.engine.handoff): a prompt shorter than
    # this many tokens is prefilled and decoded on one decode replica, never
    # handed off. None: PD_MIN_PROMPT_TOKENS, at most a quarter of the context.
    pd_min_prompt_tokens: int | None = None
    # Finished prefills waiting for decode room (raylm.engine.handoff): at
    # most this many per prefill replica; a full one takes no new prompt.
    pd_handoff_queue: int = 8

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.ray_step_transport not in ("cgraph", "mq"):
            raise ValueError(f"ray_step_transport must be 'cgraph' or 'mq', got {self.ray_step_transport!r}")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.data_parallel_backend not in ("ray", "mp"):
            raise ValueError(f"data_parallel_backend must be 'ray' or 'mp', got {self.data_parallel_backend!r}")
        if self.data_parallel_placement not in ("pack", "spread"):
            raise ValueError(
                f"data_parallel_placement must be 'pack' or 'spread', got {self.data_parallel_placement!r}"
            )
        self._check_context_parallel()
        self._check_prefill_replicas()

    def _check_prefill_replicas(self) -> None:
        """P/D needs a replica of each role, and live migration to move requests between them."""
        p, n = self.prefill_replicas, self.data_parallel_size
        threshold = self.pd_min_prompt_tokens
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
            raise ValueError(f"pd_min_prompt_tokens must be an integer >= 0, got {threshold!r}")
        queue = self.pd_handoff_queue
        if not isinstance(queue, int) or isinstance(queue, bool) or queue < 0:
            raise ValueError(f"pd_handoff_queue must be an integer >= 0, got {queue!r}")
        if p == 0:
            return
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(f"prefill_replicas must be an integer >= 0, got {p!r}")
        if n < 2:
            raise ValueError(f"prefill_replicas needs data_parallel_size >= 2 (a replica of each role), got -dp {n}")
        if p >= n:
            raise ValueError(
                f"prefill_replicas must be from 1 to data_parallel_size - 1 ({n - 1}): at least one decode replica, "
                f"got {p}"
            )
        if self.context_parallel_size > 1:
            raise ValueError(
                "prefill_replicas cannot be combined with context_parallel_size > 1 (a CP cache does not move)"
            )
        if self.data_parallel_rebalance:
            # Rebalancing knows no roles: it would move decodes onto prefill replicas.
            raise ValueError("prefill_replicas cannot be combined with data_parallel_rebalance yet")

    def role_of(self, index: int) -> str:
        """Replica `index`'s role (see replica_role)."""
        return replica_role(index, self.prefill_replicas)

    def _check_context_parallel(self) -> None:
        """What context parallelism cannot be combined with yet, refused here
        rather than run wrong (issue 26 lands in steps)."""
        cp = self.context_parallel_size
        if cp == 1:
            return
        refused = []
        # Data-parallel replicas are each a CP group of their own; only moving a
        # request between them is not done: live migration moves KV blocks rank
        # by rank and knows no sharded cache (a scale-in lets requests finish).
        if self.data_parallel_rebalance:
            refused.append(
                "data_parallel_rebalance (live migration moves KV blocks rank by rank and knows no sharded cache yet)"
            )
        if self.distributed_executor_backend == "ray" and self.ray_step_transport == "cgraph":
            refused.append("ray_step_transport 'cgraph' (use mq)")
        if refused:
            raise ValueError(f"context_parallel_size {cp} cannot be combined yet with: " + "; ".join(refused))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size


@dataclass
class FaultToleranceConfig:
    """How failures are detected and how often the engine may recover from them
    (docs/architecture.md, "The failure model")."""

    # Executor rebuilds allowed within `restart_window_s`; one more is fatal.
    max_restarts: int = 3
    restart_window_s: float = 600.0
    # A step that has not finished by then is a hung worker. Generous: a long
    # prefill on a big model, or a first step that compiles, may take minutes.
    execute_model_timeout_s: float = 300.0
    # Starting an engine core (loading the model, sizing the KV cache), and
    # each start-up call of an executor (a worker reporting ready, init_device,
    # load_model, ...), must be done by then, or it is taken for hung: killed,
    # torn down, and counted as a failed (re)start. Generous: loading a big
    # model from a slow disk takes minutes. /health turns 503 once a recovery
    # has run this long.
    engine_start_timeout_s: float = 600.0
    # An idle engine asks every worker for a sign of life this often, and
    # gives them `health_check_timeout_s` to answer.
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 30.0
    # Recoveries pinned on a poison request (it was failed) are forgiven by
    # the restart budget, up to this many within `restart_window_s`; past
    # that the engine reports itself unhealthy and stops forgiving, so a node
    # that fails every step cannot pass for healthy behind a stream of blamed
    # requests. Each poison request costs two or three recoveries.
    max_blamed_recoveries: int = 64
    # RAYLM_FAULT_INJECTION as the front end read it (raylm.worker.fault_injection):
    # carried in the config so that every worker and replica sees the same.
    fault_injection: str | None = None

    def __post_init__(self):
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        # Named as the user gives them (EngineArgs: restart_window, ...).
        for name in (
            "restart_window",
            "execute_model_timeout",
            "engine_start_timeout",
            "health_check_interval",
            "health_check_timeout",
        ):
            value = getattr(self, name + "_s")
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
            setattr(self, name + "_s", float(value))


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str = "cpu"
    # Torch threads per worker on CPU; None = planned from the usable cores
    # (raylm.worker.cpu_placement), which cpu_bind ("auto", "all", "0-3|4-7")
    # can override with one CPU group per rank of a node.
    num_threads: int | None = None
    # P/D (parallel_config.prefill_replicas): each role's own threads per
    # worker, in place of num_threads on that role's replicas (None: num_threads).
    prefill_num_threads: int | None = None
    decode_num_threads: int | None = None
    cpu_bind: str = "auto"
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    autoscale: AutoscaleConfig | None = None
    # Speculative decoding (raylm.core.spec_decode); None: off.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (raylm.lora); None: off (enable_lora=False).
    lora_config: LoRAConfig | None = None

    def __post_init__(self):
        """The rules between the parts, each part having checked its own."""
        sc, pc = self.scheduler_config, self.parallel_config
        max_model_len = self.model_config.max_model_len
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is off"
            )
        if sc.async_scheduling and pc.pipeline_parallel_size > 1:
            raise ValueError("async_scheduling needs pipeline_parallel_size = 1 (PP already keeps batches in flight)")
        autoscale = self.autoscale
        if autoscale is not None and not autoscale.min_replicas <= pc.data_parallel_size <= autoscale.max_replicas:
            raise ValueError(f"data_parallel_size {pc.data_parallel_size} is outside autoscale {autoscale.setting}")
        if autoscale is not None:
            autoscale.check_roles(pc.data_parallel_size, pc.prefill_replicas)
        if self.lora_config is not None and pc.context_parallel_size > 1:
            # A CP rank computes a share of a chunk's rows; the adapters' row
            # mask is laid out for whole steps.
            raise ValueError("enable_lora cannot be combined yet with context_parallel_size > 1")
        self.cpu_bind = self._checked_cpu_bind()
        self._check_role_threads()

    def _check_role_threads(self) -> None:
        """Per-role threads: positive, and only where there are roles."""
        for name in ("prefill_num_threads", "decode_num_threads"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_positive_int(value):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            if not self.parallel_config.prefill_replicas:
                raise ValueError(f"{name} needs prefill_replicas (prefill/decode roles)")

    def threads_of_role(self, role: str) -> int | None:
        """Torch threads per worker on a replica of `role` ("prefill",
        "decode" or "both"; see replica_role)."""
        own = {"prefill": self.prefill_num_threads, "decode": self.decode_num_threads}.get(role)
        return own if own is not None else self.num_threads

    def for_role(self, role: str) -> EngineConfig:
        """This config as one replica of `role` runs it: its role's threads
        as num_threads (the executor and the CPU plan read only that). The
        TP/PP layout is the same for every role: the K/V transport moves a
        request between equal layouts only."""
        threads = self.threads_of_role(role)
        if threads == self.num_threads:
            return self
        return dataclasses.replace(self, num_threads=threads)

    def _checked_cpu_bind(self) -> str:
        num_threads, cpu_bind = self.num_threads, self.cpu_bind
        if num_threads is not None and not _is_positive_int(num_threads):
            raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
        if not isinstance(cpu_bind, str):
            raise ValueError(f"cpu_bind must be a string like 'auto', 'all' or '0-3|4-7', got {cpu_bind!r}")
        groups = parse_cpu_bind(cpu_bind)
        world_size = self.parallel_config.world_size
        if isinstance(groups, list) and len(groups) > world_size:
            raise ValueError(f"cpu_bind has {len(groups)} CPU groups for {world_size} rank(s); give one group per rank")
        return cpu_bind.strip()


def engine_step_aside_reason(config: EngineConfig) -> str | None:
    """Why this engine never speculates (every decode steps aside), or None."""
    pc, sc, mc = config.parallel_config, config.scheduler_config, config.model_config
    if pc.pipeline_parallel_size > 1:
        return "pipeline_parallel"  # non-last stages would need the drafts' rows too
    if pc.context_parallel_size > 1:
        return "context_parallel"  # a verification chunk would be split over the CP ranks
    if sc.async_scheduling:
        return "async_scheduling"  # the next step is scheduled before the drafts are verified
    if config.device == "cpu" and (mc.dtype != torch.float32 or mc.quantization is not None):
        # bfloat16 or quantized weights decode on the C++ path (model/llama_decode.py),
        # whose kernels a multi-row verification forward does not run: its tokens
        # could differ in the last bits from decoding's.
        return "cpu_kernels"
    return None
