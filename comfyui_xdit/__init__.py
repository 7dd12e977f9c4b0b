"""comfyui-xdit host side. Cheap to import: torch is only imported by what needs it."""
from .config import ConfigError, ParallelConfig
from .request import GenerationRequest, GenerationResult

__all__ = ["WorkerPool", "ParallelConfig", "GenerationRequest", "GenerationResult",
           "ConfigError", "PoolError"]


def __getattr__(name):
    if name in ("WorkerPool", "PoolError", "JobCancelled"):
        from . import pool
        return getattr(pool, name)
    raise AttributeError(name)
