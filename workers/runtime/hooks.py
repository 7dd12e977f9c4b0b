"""Worker hooks: test and benchmark code that runs inside each worker, chosen by the host.

A hook is `"module:function"`, importable in the worker (the repository root is on its
path), called once per rank before the process group exists, so it can wrap
`torch.distributed` (the NCCL-rules emulation, the communication meter) or set per-pool
test switches in `ctx.options` (fault injection; `check_planes`, the plane check of
workers/parallel/topology.py, which the NCCL-rules and shared-GPU modes turn on). The product never
installs one itself: `WorkerPool(..., worker_hooks=[...])` passes them as `--hook`
arguments.

A hook may return an object with `job_started()` and/or `job_stats() -> dict`; the worker
calls them around every job and reports the stats under `stats["hooks"][spec]`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass
class HookContext:
    rank: int
    world: int
    device: str  # "cpu" | "cuda"
    options: dict = field(default_factory=dict)  # switches hooks set for the worker to read


def _resolve(spec: str):
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"worker hook {spec!r} is not 'module:function'")
    return getattr(importlib.import_module(module), name)


def install(specs, ctx: HookContext) -> dict:
    """Call each hook; returns {spec: the object it returned} for those that returned one."""
    out = {}
    for spec in specs or ():
        got = _resolve(spec)(ctx)
        if got is not None:
            out[spec] = got
    return out


def job_started(installed: dict) -> None:
    for obj in installed.values():
        fn = getattr(obj, "job_started", None)
        if fn is not None:
            fn()


def job_stats(installed: dict) -> dict:
    out = {}
    for spec, obj in installed.items():
        fn = getattr(obj, "job_stats", None)
        if fn is not None:
            out[spec] = fn()
    return out
