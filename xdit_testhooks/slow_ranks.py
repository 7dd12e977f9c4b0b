"""Chosen ranks made k times slower, for the uneven-split tests and benchmark: a GPU of
another speed, on CPU. `XDIT_SLOW_RANKS="1:2"` (rank:factor, comma-separated) makes rank 1
twice as slow (`XDIT_SLOW_RANKS_FILE`: a file holding that text, read at every job, so a
benchmark changes the factors without a relaunch).

Two ways, chosen by the text:
- "1:2": after each transformer block the slow rank sleeps (k - 1) times the block's own
  time (its time outside its attention modules: the per-token work a slower GPU does slower;
  the attention's exchange waits for the others and is left out, as the share meter leaves
  it out, workers/runtime/share_meter.py);
- "1:2,base=2e-4": a simulated device: after each block every rank sleeps `base` seconds per
  row x token the block was given, times its factor (1 where none is given). On a busy CPU
  the sleeps, not the contended compute, then set each rank's speed, so timings measure the
  split rather than the machine's load.
Sleeping frees the core, as a slow GPU would leave it to the others."""
from __future__ import annotations

import os
import time


def factors(spec: str) -> dict:
    """{rank: factor, "base": seconds per row x token (0: none)}."""
    out = {"base": 0.0}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition(":" if ":" in part else "=")
        out["base" if key == "base" else int(key)] = float(value)
    return out


def _read() -> dict:
    path = os.environ.get("XDIT_SLOW_RANKS_FILE")
    spec = open(path).read() if path and os.path.exists(path) else \
        os.environ.get("XDIT_SLOW_RANKS", "")
    return factors(spec)


def install(ctx):
    import workers.sampling.denoise as denoise

    real = denoise.run_job

    def run_job(job, model, adapter, *args, **kwargs):
        spec = _read()
        setting = (spec.get(ctx.rank, 1.0), spec["base"])
        for tr in model.transformers():
            for name in adapter.block_lists:
                for block in getattr(tr, name, ()):
                    _slow(block)
                    block._xdit_slow[:] = setting
        return real(job, model, adapter, *args, **kwargs)

    denoise.run_job = run_job


def _work(args, kwargs) -> int:
    """rows x tokens of the block's first [B, S, D] input."""
    import torch
    for t in (*args, *kwargs.values()):
        if torch.is_tensor(t) and t.dim() == 3:
            return int(t.shape[0]) * int(t.shape[1])
    return 0


def _slow(block) -> None:
    if hasattr(block, "_xdit_slow"):
        return
    block._xdit_slow = [1.0, 0.0]  # factor, base
    inner = [0.0]  # this call's seconds in the block's attention modules
    started = {}

    def pre(module, args):
        started[id(module)] = time.perf_counter()

    def post(module, args, output):
        inner[0] += time.perf_counter() - started.pop(id(module), time.perf_counter())

    for m in block.modules():
        if getattr(m, "processor", None) is not None:
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)
    real = block.forward

    def forward(*args, **kwargs):
        k, base = block._xdit_slow
        inner[0] = 0.0
        t = time.perf_counter()
        out = real(*args, **kwargs)
        if base > 0:
            time.sleep(base * k * _work(args, kwargs))
        elif k > 1.0:
            own = max(0.0, time.perf_counter() - t - inner[0])
            time.sleep((k - 1.0) * own)
        return out

    block.forward = forward
