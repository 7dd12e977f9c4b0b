"""comfyui-xdit host side. Cheap to import: torch is only imported by what needs it.

Rooms: `nodes/` (what ComfyUI loads; the only code that imports ComfyUI, plus its
ComfyUI-free logic), `client/` (the worker pool and its channel), `planning/` (parallel
config, requests, GPUs, model discovery, the memory plan), `comfy_convert` (ComfyUI values
<-> requests), `cli/` (`python -m comfyui_xdit`), `testmodels/` (tiny offline models for
tests and the demo; nothing ComfyUI runs imports it).
"""
from comfyui_xdit.planning.config import ConfigError, ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest, GenerationResult

__all__ = ["WorkerPool", "ParallelConfig", "GenerationRequest", "GenerationResult",
           "ConfigError", "PoolError"]


def __getattr__(name):
    if name in ("WorkerPool", "PoolError", "JobCancelled"):
        from comfyui_xdit.client import pool
        return getattr(pool, name)
    raise AttributeError(name)
