"""The engine's settings: what a user sets (engine_args: EngineArgs, each
setting with its flag), what the engine runs with (engine_config: EngineConfig,
each part checking its own settings), how the one becomes the other (resolve:
against the model and who runs the engine) and the device and dtype (device)."""

from raylm.config.autoscale import MAX_DATA_PARALLEL_SIZE, AutoscaleConfig
from raylm.config.device import DEVICE_ENV, detect_device, resolve_dtype
from raylm.config.engine_args import EngineArgs, create_engine_config
from raylm.config.engine_config import (
    CacheConfig,
    EngineConfig,
    FaultToleranceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    replica_role,
)
from raylm.config.lora import LoRAConfig
from raylm.config.resolve import (
    DEFAULT_MODEL_DIR,
    USAGE_CONTEXTS,
    default_max_num_batched_tokens,
    resolve_engine_config,
)
from raylm.config.speculative import SpeculativeConfig

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
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "create_engine_config",
    "default_max_num_batched_tokens",
    "replica_role",
    "detect_device",
    "resolve_dtype",
    "resolve_engine_config",
]
