"""EngineArgs and AsyncEngineArgs: the engine's settings as one dataclass, for
programs written against vLLM's `EngineArgs(model=..., ...).create_engine_config()`.

The fields are exactly the parameters of `raylm.config.create_engine_config`
(tests/entrypoints/test_vllm_flags.py checks names and defaults match), which
validates them; `from_cli_args` reads them from the `raylm` command's flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from raylm.config import EngineConfig, create_engine_config


@dataclass
class EngineArgs:
    # Model: a folder or a Hugging Face Hub id, and how to read it.
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    generation_config: str = "auto"
    chat_template: str | None = None
    quantization: str | None = None
    trust_remote_code: bool = False
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # Model parallelism.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    # KV cache and scheduling.
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    usage_context: str = "llm"  # "api_server" for online serving (AsyncLLM sets it)
    # Device and CPU placement.
    device: str | None = None
    num_threads: int | None = None
    cpu_bind: str | None = None
    # Ray.
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"
    ray_placement_timeout: float = 60.0
    ray_step_transport: str = "mq"
    placement_group: object | None = None
    # Data parallelism.
    data_parallel_size: int = 1
    data_parallel_backend: str = "ray"
    data_parallel_placement: str = "pack"
    data_parallel_prefix_affinity: bool = False
    # Failures and recovery.
    max_restarts: int = 3
    restart_window: float = 600.0
    execute_model_timeout: float = 300.0
    engine_start_timeout: float = 600.0
    health_check_interval: float = 5.0
    health_check_timeout: float = 30.0

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The settings the parsed flags give; a flag left unset (None) keeps
        the engine's default."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls(**given)

    def to_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `raylm.LLM` or `AsyncLLM.from_engine_args`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def create_engine_config(self) -> EngineConfig:
        """Validated settings (a Hub model resolved to its local folder)."""
        return create_engine_config(**self.to_kwargs())


@dataclass
class AsyncEngineArgs(EngineArgs):
    """The same settings for the serving engine (AsyncLLM.from_engine_args)."""
