"""`resolve_engine_config`: an EngineArgs (engine_args.py) made into the
EngineConfig (engine_config.py) that every process gets.

What the user left unset is decided here: the model (a folder, a Hub id or a
GGUF file, found once, so that every process gets a local path) and what it
implies (tokenizer, architecture, quantization, generation defaults, dtype,
context length), the device, and the defaults that depend on who runs the
engine (USAGE_CONTEXTS). The settings themselves are checked by the config
dataclasses that hold them, as they are made."""

from __future__ import annotations

import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from raylm.chat_template import read_chat_template
from raylm.config.device import resolve_device, resolve_dtype
from raylm.config.engine_config import (
    AutoscaleConfig,
    CacheConfig,
    EngineConfig,
    FaultToleranceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.config.lora import LoRAConfig
from raylm.config.speculative import SpeculativeConfig, check_draft_model
from raylm.model.generation_config import load_generation_defaults
from raylm.model.gguf import is_gguf_path, materialize_tokenizer, open_gguf
from raylm.model.hub import resolve_gguf_model, resolve_model_path
from raylm.model.loader import load_arch_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "data" / "default_model"

# Who runs the engine: "llm", offline batches (raylm.LLM), where throughput is
# what counts; "api_server", online streams (raylm serve, AsyncLLM), where time
# to first token counts as well.
USAGE_CONTEXTS = ("llm", "api_server")
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


def resolve_engine_config(args: Any, usage_context: str = "llm") -> EngineConfig:
    """Validate an EngineArgs (raylm.config.engine_args, read by attribute)
    against the model folder and the device, and resolve what it leaves unset.

    A model or tokenizer given as a Hugging Face Hub id is resolved here, once,
    to a folder in the local cache, so that every process gets a local path.
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}")
    device = resolve_device(args.device)
    model_config = _resolve_model_config(args, device)
    autoscale = _resolve_autoscale(args)
    data_parallel_size = args.data_parallel_size
    if autoscale is not None and data_parallel_size == 1:  # autoscaled replicas start at MIN
        data_parallel_size = autoscale.min_replicas
    parallel_config = _settings_of(ParallelConfig, args, data_parallel_size=data_parallel_size)
    config = EngineConfig(
        model_config=model_config,
        cache_config=_settings_of(
            CacheConfig,
            args,
            gpu_memory_utilization=0.9 if args.gpu_memory_utilization is None else args.gpu_memory_utilization,
            num_kv_shards=parallel_config.context_parallel_size,
        ),
        scheduler_config=_resolve_scheduler_config(args, usage_context, device, model_config, parallel_config),
        parallel_config=parallel_config,
        device=device,
        num_threads=args.num_threads,
        prefill_num_threads=args.prefill_num_threads,
        decode_num_threads=args.decode_num_threads,
        # Unset: vLLM's VLLM_CPU_OMP_THREADS_BIND (what its users already set), then "auto".
        cpu_bind=args.cpu_bind if args.cpu_bind is not None else os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "auto",
        fault_tolerance=FaultToleranceConfig(
            max_restarts=args.max_restarts,
            restart_window_s=args.restart_window,
            execute_model_timeout_s=args.execute_model_timeout,
            engine_start_timeout_s=args.engine_start_timeout,
            health_check_interval_s=args.health_check_interval,
            health_check_timeout_s=args.health_check_timeout,
            fault_injection=os.environ.get("RAYLM_FAULT_INJECTION") or None,
        ),
        autoscale=autoscale,
        speculative_config=_resolve_speculative(args, model_config),
        lora_config=_resolve_lora(args),
    )
    _warn_of_settings_without_effect(args, device)
    return config


def _resolve_speculative(args: Any, model_config: ModelConfig) -> SpeculativeConfig | None:
    """The speculative settings; a draft model checked against the target and found (a local folder)."""
    spec = SpeculativeConfig.from_setting(args.speculative_config)
    if spec is not None and spec.method == "draft_model":
        lora = _resolve_lora(args)
        spec.model = check_draft_model(
            spec, model_config.arch, model_config.tokenizer, model_config.max_model_len, lora
        )
    return spec


def _resolve_lora(args: Any) -> LoRAConfig | None:
    """The LoRA settings with enable_lora; without it, settings of it are refused by name."""
    if args.enable_lora:
        return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
    if args.max_cpu_loras is not None or args.max_loras != 1 or args.max_lora_rank != 16:
        raise ValueError("max_loras, max_lora_rank and max_cpu_loras need enable_lora=True")
    return None


def _resolve_autoscale(args: Any) -> AutoscaleConfig | None:
    """--autoscale MIN:MAX and its settings; None without it."""
    if args.autoscale is None:
        for name in ("autoscale_prefill", "autoscale_decode"):
            if getattr(args, name) is not None:
                raise ValueError(f"{name} needs autoscale (MIN:MAX for both pools)")
        return None
    return AutoscaleConfig.from_setting(
        args.autoscale,
        args.autoscale_target_ongoing_requests,
        args.autoscale_upscale_delay,
        args.autoscale_downscale_delay,
        prefill=args.autoscale_prefill,
        decode=args.autoscale_decode,
    )


def _resolve_scheduler_config(
    args: Any, usage_context: str, device: str, model_config: ModelConfig, parallel_config: ParallelConfig
) -> SchedulerConfig:
    """The step's token budget and the decode bursts, by usage context where unset."""
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(
            usage_context, device, parallel_config.world_size, args.max_num_seqs
        )
        if not args.enable_chunked_prefill:
            max_num_batched_tokens = max(model_config.max_model_len, max_num_batched_tokens)
    steps = args.num_scheduler_steps
    return _settings_of(
        SchedulerConfig,
        args,
        max_num_batched_tokens=max_num_batched_tokens,
        num_scheduler_steps=DEFAULT_SCHEDULER_STEPS[usage_context] if steps is None else steps,
        decode_burst_budget_s=DECODE_BURST_BUDGET_S[usage_context],
    )


def _resolve_model_config(args: Any, device: str) -> ModelConfig:
    """The model's folder (a Hub id downloaded, a GGUF file found), its
    tokenizer, architecture, quantization, generation defaults and dtype."""
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
    return ModelConfig(
        model=model_dir,
        tokenizer=tokenizer_dir,
        dtype=resolve_dtype(args.dtype, arch.dtype, device),
        seed=args.seed,
        max_model_len=arch.max_position_embeddings if args.max_model_len is None else args.max_model_len,
        arch=arch,
        model_name=str(args.model) if args.model else None,
        default_sampling_params=generation_defaults.sampling,
        generation_eos_token_ids=generation_defaults.eos_token_ids,
        chat_template=read_chat_template(args.chat_template) if args.chat_template is not None else None,
        quantization=quantization,
    )


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


def _settings_of(config_class, args, **resolved):
    """A config dataclass with the settings of `args` (EngineArgs) that share
    its field names, so they are not listed again here; `resolved` overrides
    those whose value was worked out above."""
    names = {f.name for f in fields(config_class)} & {f.name for f in fields(args)}
    return config_class(**{**{name: getattr(args, name) for name in names}, **resolved})


def _warn_of_settings_without_effect(args: Any, device: str) -> None:
    """vLLM's settings that raylm accepts and that change nothing here."""
    if args.gpu_memory_utilization is not None and device != "cuda":
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
