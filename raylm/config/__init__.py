"""The engine's settings: what a user sets (engine_args: EngineArgs, each
setting with its flag) and what the engine runs with (engine_config:
EngineConfig, validated and resolved against the model and the device)."""

from raylm.config.engine_args import EngineArgs, create_engine_config
from raylm.config.engine_config import (
    DEFAULT_MODEL_DIR,
    DEVICE_ENV,
    MAX_DATA_PARALLEL_SIZE,
    USAGE_CONTEXTS,
    AutoscaleConfig,
    CacheConfig,
    EngineConfig,
    FaultToleranceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_max_num_batched_tokens,
    detect_device,
    resolve_dtype,
    resolve_engine_config,
)

__all__ = [
    "DEFAULT_MODEL_DIR",
    "DEVICE_ENV",
    "MAX_DATA_PARALLEL_SIZE",
    "USAGE_CONTEXTS",
    "AutoscaleConfig",
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "FaultToleranceConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "create_engine_config",
    "default_max_num_batched_tokens",
    "detect_device",
    "resolve_dtype",
    "resolve_engine_config",
]
