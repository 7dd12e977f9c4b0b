"""Worker hook: count, per denoising step (or model call), the operations that would stall a
GPU stream or copy host memory to the device.

A CUDA step that waits on the host (`.item()`, `float()` / `bool()` of a device tensor, a
`nonzero()` whose output size the host must learn, a tensor built from Python data and copied
over) serialises the CPU's kernel launches with the GPU's work. On CPU pools such a stall costs
nothing, so no timing can see it; the operations themselves are visible to a
`TorchDispatchMode` on any device, which is what this hook installs around each step's work.

The worker enters `ctx.options["step_scope"](kind, index)` around one step of the denoising
loop (kind "job", index = the step; under PipeFusion the ticks from that step's first patch
on stage 0 to the next step's) or one model call (kind "call", index = the call's number on
this rank), after the control plane's stop flag. Each job's (and call's) stats carry
`{"counts": {"job:3": {"aten._local_scalar_dense": 1, ...}}, "where": {op: [frames]}}`.
"""
from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that make the host wait for the device or learn a data-dependent size
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item"}
# a tensor made from Python data (torch.tensor(...), a list or a float): a host buffer that
# the device then has to copy in
FROM_HOST = {"lift_fresh", "lift_fresh_copy"}


def _flagged(func, args, kwargs) -> str:
    name = func.overloadpacket.__name__
    if name in SYNCING or name in FROM_HOST:
        return f"aten.{name}"
    if name in ("_to_copy", "copy_"):  # across devices: a transfer the stream waits for
        if name == "copy_" and (args[2] if len(args) > 2 else kwargs.get("non_blocking")) \
                and args[0].device.type == "cpu" and args[0].is_pinned():
            return ""  # into pinned memory without waiting (a preview, read a step later)
        src = args[1] if name == "copy_" else args[0]
        dst = args[0].device if name == "copy_" else kwargs.get("device", src.device)
        if torch.is_tensor(src) and dst is not None and torch.device(dst).type != src.device.type:
            return f"aten.{name} {src.device.type}->{torch.device(dst).type}"
    return ""


class _Counter(TorchDispatchMode):
    def __init__(self, counts: dict, where: dict):
        super().__init__()
        self.counts, self.where = counts, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _flagged(func, args, kwargs)
        if what:
            self.counts[what] = self.counts.get(what, 0) + 1
            seen = self.where.setdefault(what, [])
            if len(seen) < 3:  # a few call sites, enough to find the culprit
                frames = [f for f in traceback.extract_stack()[:-2]
                          if "torch/" not in f.filename and "host_syncs" not in f.filename]
                seen.append(" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                        for f in reversed(frames[-4:])))
        return func(*args, **kwargs)


class HostSyncs:
    def __init__(self):
        self.counts: dict = {}
        self.where: dict = {}

    def job_started(self):
        self.counts, self.where = {}, {}

    def job_stats(self) -> dict:
        return {"counts": self.counts, "where": self.where}

    @contextlib.contextmanager
    def scope(self, kind: str, index):
        counts = self.counts.setdefault(f"{kind}:{index}", {})
        with _Counter(counts, self.where):
            yield


def install(ctx):
    hs = HostSyncs()
    ctx.options["step_scope"] = hs.scope
    return hs


def install_with_host_guidance(ctx):
    """Negative control: the counter, plus FLUX's guidance built as it used to be, a host
    tensor made from the Python value on every forward and copied to the device."""
    from workers.models.base import DiTAdapter

    def guidance_rows(guidance, rows, device):
        if guidance is None:
            return None
        g = guidance if not torch.is_tensor(guidance) else float(guidance.reshape(-1)[0])
        return torch.tensor(float(g)).to(device, torch.float32).expand(rows)

    DiTAdapter.guidance_rows = staticmethod(guidance_rows)
    return install(ctx)
