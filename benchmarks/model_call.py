"""Per-call overhead of the xDiT MODEL (`python -m comfyui_xdit bench --model-call`).

ComfyUI's samplers call the MODEL once per step (twice the rows with CFG); each call is one
pool request (comfyui_xdit/nodes/model_calls.py -> workers/sampling/model_call.py). What a call costs beyond
the transformer is the overhead this section measures: the host's conversions, pickling and
the loopback channel both ways, rank 0's checks, the broadcast of the call to the other
ranks, the all-gather of their rows and the copies around them.

For a 1-rank and two 2-rank CPU pools (CFG parallel: one row per rank; Ulysses 2: both rows
on both ranks) running the tiny FLUX model, `PoolDenoiser` is called as ComfyUI calls it,
with latents of a 1024x1024 image (x [2, 16, 128, 128]: the conditional and unconditional
rows), and each call's wall time on the host minus the slowest rank's transformer forward
(`forward_max_s`, timed inside the workers) is its overhead; the medians are reported (and
the min / max), with rank 0's breakdown (checks, broadcast, work before / after the forward,
gather) and the host <-> rank 0 transport (wall time minus rank 0's whole call). The issue's target is <= 2 ms per call. `--quick`: 256x256, 3 calls.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from pathlib import Path


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def measure(pool, config, arch: str, size: int, calls: int, warmup: int = 2,
            tokens: int = 16) -> dict:
    """Time `calls` PoolDenoiser calls (after `warmup`) on `pool`; medians in ms."""
    import torch

    from comfyui_xdit.nodes.model_calls import PoolDenoiser

    cfg = json.loads((Path(pool.model_path) / "transformer" / "config.json").read_text())
    den = PoolDenoiser(pool, config, arch)
    den.timed = True
    g = torch.Generator().manual_seed(0)
    h = size // 8
    x = torch.randn(2, 16, h, h, generator=g)
    ctx_dim, pooled_dim = int(cfg["joint_attention_dim"]), int(cfg["pooled_projection_dim"])
    context = torch.randn(2, tokens, ctx_dim, generator=g)
    y = torch.randn(2, pooled_dim, generator=g)
    guidance = torch.full((2,), 3.5) if arch == "flux" else None
    options = {"uuids": [uuid.uuid4(), uuid.uuid4()]}  # cond + uncond, as KSampler sends
    rows = []
    for i in range(warmup + calls):
        sigma = torch.full((1,), 1.0 - i / (warmup + calls + 1))
        t = time.perf_counter()
        out = den(x, sigma, context=context, y=y, guidance=guidance,
                  transformer_options=options)
        wall = time.perf_counter() - t
        assert out.shape == x.shape
        if i >= warmup:
            st = den.last_stats
            rows.append({"wall": wall, "forward": st["forward_max_s"],
                         "forward_rank0": st["forward_s"], "call": st["call_s"],
                         "prepare": st["prepare_s"], "broadcast": st["broadcast_s"],
                         "pre": st["pre_s"], "post": st["post_s"],
                         # the all-gather's own time: it also waits for the slowest
                         # rank's forward (none when there is one replica: no gather)
                         "gather": max(0.0, st["gather_s"] - (st["forward_max_s"]
                                                              - st["forward_s"]))})
    ms = {k: 1000 * _median([r[k] for r in rows]) for k in rows[0]}
    overhead = [1000 * (r["wall"] - r["forward"]) for r in rows]
    transport = [1000 * (r["wall"] - r["call"]) for r in rows]
    return {"calls": calls, "conds_sent": den.conds_sent,
            "wall_ms": ms["wall"], "forward_ms": ms["forward"],
            "overhead_ms": _median(overhead), "overhead_min_ms": min(overhead),
            "overhead_max_ms": max(overhead),
            "rank0_prepare_ms": ms["prepare"], "rank0_broadcast_ms": ms["broadcast"],
            "rank0_pre_ms": ms["pre"], "rank0_post_ms": ms["post"],
            "rank0_gather_ms": ms["gather"], "transport_ms": _median(transport)}


def run(args) -> int:
    from comfyui_xdit.planning.config import ParallelConfig
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    from .measure import loadavg, machine_facts

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    quick = bool(args.quick)
    size = 256 if quick else 1024
    calls = args.repeats or (3 if quick else 20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    model = ensure_tiny_model("flux", cache)
    layouts = [("1 rank", ParallelConfig()), ("2 ranks, CFG parallel",
                                              ParallelConfig(cfg_parallel=True)),
               ("2 ranks, Ulysses 2", ParallelConfig(ulysses=2))]
    machine = machine_facts()
    results = []
    for name, config in layouts:
        pool = WorkerPool(str(model), config, device="cpu")
        try:
            log(f"model-call bench: {name}, x [2, 16, {size // 8}, {size // 8}], {calls} calls")
            r = measure(pool, config, "flux", size, calls)
        finally:
            pool.close()
        r.update(layout=name, world_size=config.product)
        results.append(r)
        log(f"  overhead {r['overhead_ms']:.2f} ms/call (median), forward "
            f"{r['forward_ms']:.1f} ms")
    machine["loadavg_end"] = loadavg()
    report = {"machine": machine, "model": str(model), "image": f"{size}x{size}",
              "x_shape": [2, 16, size // 8, size // 8], "target_ms": 2.0,
              "model_call": results}
    md = markdown(report)
    (out / "model_call.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "model_call.md").write_text(md)
    print(md)
    return 0


def markdown(report: dict) -> str:
    lines = [f"## xDiT MODEL: per-call overhead ({report['image']}, x {report['x_shape']}, "
             f"CPU loopback)", "",
             "Overhead = host wall time of one `PoolDenoiser` call minus the slowest rank's "
             f"transformer forward (median; target <= {report['target_ms']:g} ms). Rank "
             "0's parts (checks, call broadcast, work before / after the forward: copies, "
             "packing; the all-gather less the wait for a slower rank) and the host <-> "
             "rank 0 transport (wall minus rank 0's whole call) are medians too.", "",
             "| pool | wall ms | forward ms | overhead ms (min-max) | checks ms | "
             "broadcast ms | pre ms | post ms | gather ms | transport ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["model_call"]:
        lines.append(f"| {r['layout']} | {r['wall_ms']:.1f} | {r['forward_ms']:.1f} | "
                     f"**{r['overhead_ms']:.2f}** ({r['overhead_min_ms']:.2f}-"
                     f"{r['overhead_max_ms']:.2f}) | {r['rank0_prepare_ms']:.2f} | "
                     f"{r['rank0_broadcast_ms']:.2f} | {r['rank0_pre_ms']:.2f} | "
                     f"{r['rank0_post_ms']:.2f} | {r['rank0_gather_ms']:.2f} | "
                     f"{r['transport_ms']:.2f} |")
    m = report["machine"]
    lines += ["", f"Machine: {m.get('cpu_model', '')}, {m.get('cpu_count', '')} cores, "
                  f"load {m.get('loadavg_start')} -> {m.get('loadavg_end')}", ""]
    return "\n".join(lines)
