"""Which Executor class a config asks for: beside the backends it chooses,
not in the contract's base class, which would then import its own
subclasses (an import circle; docs/architecture.md, "The import rule")."""

from __future__ import annotations

from raylm.config import EngineConfig
from raylm.executor.abstract import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    """`distributed_executor_backend`: "uni", "mp", "ray", or an Executor
    subclass; unset: "uni" for one rank, else "mp". A backend is imported only
    when chosen (the Ray one sets Ray's compiled-graph defaults on import)."""
    backend = config.parallel_config.distributed_executor_backend
    if isinstance(backend, type):
        if not issubclass(backend, Executor):
            raise ValueError(f"distributed_executor_backend class {backend} must subclass raylm Executor")
        return backend
    if backend is None:
        backend = "uni" if config.parallel_config.world_size == 1 else "mp"
    if backend == "uni":
        if config.parallel_config.world_size != 1:
            raise ValueError(
                "distributed_executor_backend 'uni' needs tensor_parallel_size = pipeline_parallel_size = "
                "context_parallel_size = 1"
            )
        from raylm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from raylm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from raylm.executor.ray_executor import RayDistributedExecutor

        return RayDistributedExecutor
    raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', got {backend!r}")
