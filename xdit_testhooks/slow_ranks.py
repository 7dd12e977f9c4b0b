"""Chosen ranks made k times slower, for the uneven-split tests and benchmark: a GPU of
another speed, on CPU. `XDIT_SLOW_RANKS="1:2"` (rank:factor, comma-separated) makes rank 1
twice as slow (`XDIT_SLOW_RANKS_FILE`: a file holding that text, read at every job, so a
benchmark changes the factors without a relaunch): after each transformer block it sleeps (k - 1) times the block's own time
(the block's time outside its attention modules: the per-token work a slower GPU does
slower; the attention's exchange waits for the others and is left out, as the share meter
leaves it out, workers/runtime/share_meter.py). Sleeping frees the core, as a slow GPU
would leave it to the others."""
from __future__ import annotations

import os
import time


def factors(spec: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        rank, _, k = part.partition(":")
        out[int(rank)] = float(k)
    return out


def _factor(rank: int) -> float:
    path = os.environ.get("XDIT_SLOW_RANKS_FILE")
    spec = open(path).read() if path and os.path.exists(path) else \
        os.environ.get("XDIT_SLOW_RANKS", "")
    return factors(spec).get(rank, 1.0)


def install(ctx):
    import workers.sampling.denoise as denoise

    real = denoise.run_job

    def run_job(job, model, adapter, *args, **kwargs):
        k = _factor(ctx.rank)
        for tr in model.transformers():
            for name in adapter.block_lists:
                for block in getattr(tr, name, ()):
                    _slow(block)
                    block._xdit_slow[0] = k
        return real(job, model, adapter, *args, **kwargs)

    denoise.run_job = run_job


def _slow(block) -> None:
    if hasattr(block, "_xdit_slow"):
        return
    block._xdit_slow = [1.0]
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
        inner[0] = 0.0
        t = time.perf_counter()
        out = real(*args, **kwargs)
        own = max(0.0, time.perf_counter() - t - inner[0])
        if block._xdit_slow[0] > 1.0:
            time.sleep((block._xdit_slow[0] - 1.0) * own)
        return out

    block.forward = forward
