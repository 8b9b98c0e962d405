"""EngineConfig: the engine's settings as it runs with them, one object shipped
to every worker: an EngineArgs (engine_args.py) validated, and resolved against
the model folder and the device (`resolve_engine_config`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from raylm.chat_template import read_chat_template
from raylm.cpu_bind import parse_cpu_bind
from raylm.model.arch_config import ArchConfig
from raylm.model.generation_config import load_generation_defaults
from raylm.model.gguf import is_gguf_path, materialize_tokenizer, open_gguf
from raylm.model.hub import resolve_gguf_model, resolve_model_path
from raylm.model.loader import load_arch_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "data" / "default_model"

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


# Pins the default device ("cpu" or "cuda") where the engine's callers cannot
# pass one, e.g. the test suite on a GPU host keeps to CPU except tests/gpu.
DEVICE_ENV = "RAYLM_DEVICE"


def detect_device() -> str:
    pinned = os.environ.get(DEVICE_ENV, "").strip().lower()
    if pinned:
        if pinned not in ("cpu", "cuda"):
            raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', got {pinned!r}")
        return pinned
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(requested: str | torch.dtype, config_dtype: str | None, device: str) -> torch.dtype:
    """Turn the user's dtype (or "auto") into a torch dtype for this device.

    "auto" follows the checkpoint, except: float16 on CPU becomes bfloat16
    (CPU float16 matmuls are emulated and slow, and bf16 keeps fp32's range),
    and a float32 checkpoint on CUDA runs in bfloat16, as serving engines do,
    because fp32 halves throughput for no practical accuracy gain at inference.
    """
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        dtype = _DTYPES.get(str(config_dtype or "float32").replace("torch.", ""), torch.float32)
        if device == "cpu" and dtype == torch.float16:
            dtype = torch.bfloat16
        if device == "cuda" and dtype == torch.float32:
            dtype = torch.bfloat16
        return dtype
    else:
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {requested!r}")
        dtype = _DTYPES[requested]
    if device == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use bfloat16 or float32")
    return dtype


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
    # burst holds nobody back (see DECODE_BURST_BUDGET_S).
    decode_burst_budget_s: float = 0.01


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
    # How a new request picks its replica (raylm.engine.routing): kv_aware, load or vllm.
    routing_policy: str = "kv_aware"
    # Live migration from a much busier replica to the least busy (raylm.engine.migration).
    data_parallel_rebalance: bool = False

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


# A sane ceiling on data-parallel replicas whatever the cluster (each is a
# whole engine: weights, KV cache, processes, sockets): POST /scale and
# --autoscale MAX both stop there.
MAX_DATA_PARALLEL_SIZE = 64


@dataclass
class AutoscaleConfig:
    """Data-parallel replicas scaled with the load (raylm.engine.autoscaler),
    in Ray Serve's terms."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0


def resolve_autoscale(args) -> AutoscaleConfig | None:
    """--autoscale MIN:MAX and its settings, checked; None without it."""
    if args.autoscale is None:
        return None
    try:
        low, high = (int(part) for part in str(args.autoscale).split(":"))
    except ValueError:
        raise ValueError(f"autoscale must be MIN:MAX (two integers), got {args.autoscale!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"autoscale: need 1 <= MIN <= MAX, got {args.autoscale!r}")
    if high == 1:
        raise ValueError("autoscale: MAX must be at least 2 (one replica has nothing to scale)")
    if high > MAX_DATA_PARALLEL_SIZE:
        raise ValueError(f"autoscale: MAX is at most {MAX_DATA_PARALLEL_SIZE} replicas, got {args.autoscale!r}")
    if not args.autoscale_target_ongoing_requests > 0:
        raise ValueError(
            f"autoscale_target_ongoing_requests must be > 0, got {args.autoscale_target_ongoing_requests!r}"
        )
    for name in ("autoscale_upscale_delay", "autoscale_downscale_delay"):
        if not getattr(args, name) >= 0:
            raise ValueError(f"{name} must be >= 0 seconds, got {getattr(args, name)!r}")
    if args.data_parallel_size != 1 and not low <= args.data_parallel_size <= high:
        raise ValueError(f"data_parallel_size {args.data_parallel_size} is outside autoscale {args.autoscale}")
    return AutoscaleConfig(
        low,
        high,
        float(args.autoscale_target_ongoing_requests),
        float(args.autoscale_upscale_delay),
        float(args.autoscale_downscale_delay),
    )


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
    cpu_bind: str = "auto"
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    autoscale: AutoscaleConfig | None = None


# Who runs the engine: "llm", offline batches (raylm.LLM), where throughput is
# what counts; "api_server", online streams (raylm serve, AsyncLLM), where time
# to first token counts as well.
USAGE_CONTEXTS = ("llm", "api_server")
# A decode burst holds new requests back for its length (see
# raylm.core.decode_burst): past this many steps nothing is gained.
MAX_SCHEDULER_STEPS = 64
# SchedulerConfig.decode_burst_budget_s by usage context.
DECODE_BURST_BUDGET_S = {"llm": 0.05, "api_server": 0.01}
# num_scheduler_steps when not given, by usage context. Serving keeps single
# steps: at 64 streams of the ~7M model on 2 cores, bursts gave 7-15% less
# output throughput and 11-12% longer median TTFT (benchmarks/history/llamacpp.md,
# "Serving, bursts on against off"), where the server's front end shares the cores.
DEFAULT_SCHEDULER_STEPS = {"llm": 8, "api_server": 1}


def default_max_num_batched_tokens(usage_context: str, device: str, world_size: int, max_num_seqs: int) -> int:
    """The token budget of one step when the user sets none. Online on CPU a
    step is small (2048 tokens per rank, vLLM's CPU default too): a burst of
    prompts is prefilled in chunks, so the first of them start streaming after
    one chunk, not after the whole burst (`raylm bench serve`, 64 x 128-token
    prompts, 7M model, 2 cores: median TTFT 786 ms with 8192, 577 ms with 2048,
    3.7-3.8k output tok/s either way).
    Offline, and on GPUs, a bigger step keeps the device busy."""
    budget = 8192
    if usage_context == "api_server" and device == "cpu":
        budget = 2048 * world_size
    return max(budget, max_num_seqs)


def _resolve_cpu_bind(cpu_bind: str | None, num_threads: int | None, world_size: int) -> str:
    """The cpu_bind setting, validated; unset falls back to vLLM's
    VLLM_CPU_OMP_THREADS_BIND (what its users already set), then "auto"."""
    if num_threads is not None and (
        not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
    if cpu_bind is None:
        cpu_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto"
    if not isinstance(cpu_bind, str):
        raise ValueError(f"cpu_bind must be a string like 'auto', 'all' or '0-3|4-7', got {cpu_bind!r}")
    groups = parse_cpu_bind(cpu_bind)
    if isinstance(groups, list) and len(groups) > world_size:
        raise ValueError(f"cpu_bind has {len(groups)} CPU groups for {world_size} rank(s); give one group per rank")
    return cpu_bind.strip()


def _settings_of(config_class, args, **resolved):
    """A config dataclass with the settings of `args` (EngineArgs) that share
    its field names, so they are not listed again here; `resolved` overrides
    those whose value was worked out above."""
    names = {f.name for f in fields(config_class)} & {f.name for f in fields(args)}
    return config_class(**{**{name: getattr(args, name) for name in names}, **resolved})


def _is_quant_selector(model: str) -> bool:
    """org/name:Q4_K_M, vLLM's way of naming one GGUF file of a Hub repository."""
    return ":" in model and not os.path.exists(model)


def _check_quantization_method(quantization: str | None) -> str | None:
    method = None if quantization is None or str(quantization).lower() == "none" else str(quantization).lower()
    if method not in (None, "int8", "gguf"):
        raise ValueError(
            f"quantization {quantization!r} is not supported; supported: int8 (weights quantized at "
            "load from a float checkpoint), gguf (a GGUF file's own types); unset loads the "
            "checkpoint unquantized"
        )
    return method


def _resolve_quantization(quantization: str | None, is_gguf: bool) -> str | None:
    method = _check_quantization_method(quantization)
    if is_gguf:
        if method == "int8":
            raise ValueError(
                "quantization 'int8' quantizes a float safetensors checkpoint; a GGUF file runs in "
                "its own types (leave quantization unset, or gguf)"
            )
        return "gguf"
    if method == "gguf":
        raise ValueError("quantization 'gguf' needs a GGUF model file (model.gguf, or a Hub id with --gguf-file)")
    return method


def _check_context_parallel(args: Any) -> None:
    """What context parallelism cannot be combined with yet, refused here
    rather than run wrong (issue 26 lands in steps)."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    refused = []
    # Data-parallel replicas are each a CP group of their own; only moving a
    # request between them is not done: live migration moves KV blocks rank
    # by rank and knows no sharded cache (a scale-in lets requests finish).
    if args.data_parallel_rebalance:
        refused.append(
            "data_parallel_rebalance (live migration moves KV blocks rank by rank and knows no sharded cache yet)"
        )
    if args.distributed_executor_backend == "ray" and args.ray_step_transport == "cgraph":
        refused.append("ray_step_transport 'cgraph' (use mq)")
    if refused:
        raise ValueError(f"context_parallel_size {cp} cannot be combined yet with: " + "; ".join(refused))


def resolve_engine_config(args: Any, usage_context: str = "llm") -> EngineConfig:
    """Validate an EngineArgs (raylm.config.engine_args, read by attribute)
    against the model folder and the device, and resolve what it leaves unset.

    A model or tokenizer given as a Hugging Face Hub id is resolved here, once,
    to a folder in the local cache, so that every process gets a local path.
    """
    _check_quantization_method(args.quantization)  # before a model is looked for
    model_dir = str(DEFAULT_MODEL_DIR)
    gguf_file = getattr(args, "gguf_file", None)
    if args.model and (gguf_file or is_gguf_path(args.model) or _is_quant_selector(args.model)):
        model_dir = resolve_gguf_model(args.model, gguf_file, args.revision, args.download_dir)
    elif gguf_file:
        raise ValueError(f"gguf_file {gguf_file!r} needs a Hugging Face Hub id as model")
    elif args.model:
        model_dir = resolve_model_path(args.model, args.revision, args.download_dir)
    is_gguf = is_gguf_path(model_dir)
    quantization = _resolve_quantization(args.quantization, is_gguf)
    if args.tokenizer and args.tokenizer != args.model:
        tokenizer_dir = resolve_model_path(args.tokenizer, args.tokenizer_revision, args.download_dir, what="tokenizer")
    elif is_gguf:
        tokenizer_dir = materialize_tokenizer(model_dir)  # from the file's metadata
    else:
        tokenizer_dir = model_dir
    arch = load_arch_config(model_dir)
    if is_gguf:  # before any worker starts: a split inside a quantized block
        open_gguf(model_dir).check_tensor_parallel(args.tensor_parallel_size)
    # A GGUF file carries no generation_config.json: the tokenizer's folder may.
    generation_defaults = load_generation_defaults(tokenizer_dir if is_gguf else model_dir, args.generation_config)
    chat_template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    device = args.device or detect_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    gpu_memory_utilization = args.gpu_memory_utilization
    if gpu_memory_utilization is None:
        gpu_memory_utilization = 0.9
    elif not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {gpu_memory_utilization!r}")
    elif device != "cuda":
        logger.warning(
            "gpu_memory_utilization applies to GPUs; on %s the KV cache is sized by "
            "kv_cache_memory_bytes (or a default)",
            device,
        )
    if args.trust_remote_code:
        logger.warning(
            "trust_remote_code: accepted, but raylm runs no code from model repositories; "
            "it supports the architectures it implements"
        )
    if args.enforce_eager:
        logger.warning("enforce_eager: accepted; raylm always runs eagerly (it captures no CUDA graphs)")
    torch_dtype = resolve_dtype(args.dtype, arch.dtype, device)

    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = arch.max_position_embeddings
    elif not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    elif max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
            f"({arch.max_position_embeddings})"
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size * args.context_parallel_size
    if args.block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {args.block_size}")
    if args.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {args.max_num_seqs}")
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}")
    steps = args.num_scheduler_steps
    if steps is None:
        steps = DEFAULT_SCHEDULER_STEPS[usage_context]
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_SCHEDULER_STEPS:
        raise ValueError(f"num_scheduler_steps must be an integer from 1 to {MAX_SCHEDULER_STEPS}, got {steps!r}")
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(usage_context, device, world_size, args.max_num_seqs)
        if not args.enable_chunked_prefill:
            max_num_batched_tokens = max(max_model_len, max_num_batched_tokens)
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if not args.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}) when chunked prefill is off"
        )
    if args.async_scheduling and args.pipeline_parallel_size > 1:
        raise ValueError("async_scheduling needs pipeline_parallel_size = 1 (PP already keeps batches in flight)")
    if args.ray_step_transport not in ("cgraph", "mq"):
        raise ValueError(f"ray_step_transport must be 'cgraph' or 'mq', got {args.ray_step_transport!r}")
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes <= 0:
        raise ValueError(f"kv_cache_memory_bytes must be > 0, got {args.kv_cache_memory_bytes}")

    if not isinstance(args.data_parallel_size, int) or args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {args.data_parallel_size!r}")
    autoscale = resolve_autoscale(args)
    data_parallel_size = args.data_parallel_size
    if autoscale is not None and data_parallel_size == 1:
        data_parallel_size = autoscale.min_replicas
    if args.data_parallel_backend not in ("ray", "mp"):
        raise ValueError(f"data_parallel_backend must be 'ray' or 'mp', got {args.data_parallel_backend!r}")
    if args.data_parallel_placement not in ("pack", "spread"):
        raise ValueError(f"data_parallel_placement must be 'pack' or 'spread', got {args.data_parallel_placement!r}")
    if not isinstance(args.max_restarts, int) or args.max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {args.max_restarts!r}")
    for name in (
        "restart_window",
        "execute_model_timeout",
        "engine_start_timeout",
        "health_check_interval",
        "health_check_timeout",
    ):
        value = getattr(args, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")

    _check_context_parallel(args)

    return EngineConfig(
        model_config=ModelConfig(
            model=model_dir,
            tokenizer=tokenizer_dir,
            dtype=torch_dtype,
            seed=args.seed,
            max_model_len=max_model_len,
            arch=arch,
            model_name=str(args.model) if args.model else None,
            default_sampling_params=generation_defaults.sampling,
            generation_eos_token_ids=generation_defaults.eos_token_ids,
            chat_template=chat_template,
            quantization=quantization,
        ),
        cache_config=_settings_of(
            CacheConfig, args, gpu_memory_utilization=gpu_memory_utilization, num_kv_shards=args.context_parallel_size
        ),
        scheduler_config=_settings_of(
            SchedulerConfig,
            args,
            max_num_batched_tokens=max_num_batched_tokens,
            num_scheduler_steps=steps,
            decode_burst_budget_s=DECODE_BURST_BUDGET_S[usage_context],
        ),
        parallel_config=_settings_of(ParallelConfig, args, data_parallel_size=data_parallel_size),
        device=device,
        num_threads=args.num_threads,
        cpu_bind=_resolve_cpu_bind(args.cpu_bind, args.num_threads, world_size),
        fault_tolerance=FaultToleranceConfig(
            max_restarts=args.max_restarts,
            restart_window_s=float(args.restart_window),
            execute_model_timeout_s=float(args.execute_model_timeout),
            engine_start_timeout_s=float(args.engine_start_timeout),
            health_check_interval_s=float(args.health_check_interval),
            health_check_timeout_s=float(args.health_check_timeout),
            fault_injection=os.environ.get("RAYLM_FAULT_INJECTION") or None,
        ),
        autoscale=autoscale,
    )
