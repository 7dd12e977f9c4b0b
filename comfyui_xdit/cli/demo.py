"""`python -m comfyui_xdit demo`: the main job on an embedded default, no download.

Builds (or reuses) a small random-weight FLUX model, starts a 2-worker CPU pool, generates
at Ulysses 2, checks the parallel result against a 1-rank run of the same seed, and writes
a PNG and a report.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest


def default_cache() -> Path:
    base = os.environ.get("XDIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "comfyui-xdit")
    return Path(base)


def add_cli(sub):
    p = sub.add_parser("demo", help="generate with a tiny random-weight FLUX model on a "
                                    "2-worker CPU pool (the picture is noise; the report "
                                    "times the pool and checks it against 1 rank)")
    p.add_argument("--out", default="xdit-demo", help="folder for the PNG and report")
    p.add_argument("--prompt", default="a photo of a red cat",
                   help="the prompt (random weights: it does not shape the picture)")
    p.add_argument("--seed", type=int, default=42, help="noise seed (default 42)")
    p.set_defaults(func=run)


def run(args) -> int:
    from comfyui_xdit.cli.images import save_pngs
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = ensure_tiny_model("flux", default_cache() / "models")
    t_model = time.perf_counter() - t
    request = GenerationRequest(prompt=[args.prompt], seed=args.seed, steps=8, height=256,
                                width=256, max_sequence_length=64, output="image")
    parallel = ParallelConfig(ulysses=2)
    with WorkerPool(model, parallel, device="cpu", threads_per_rank=1) as pool:
        first = pool.generate(request)
        warm = pool.generate(request)
        pids = pool.worker_pids()
        launch = dict(pool.last_launch)
    with WorkerPool(model, ParallelConfig(), device="cpu", threads_per_rank=1) as single:
        ref = single.generate(request)
    diff = float((warm.samples - ref.samples).abs().max())
    png = save_pngs(warm.images, out / "demo.png")[0]
    report = {
        "model": str(model), "prompt": args.prompt, "seed": args.seed,
        "size": f"{request.width}x{request.height}", "steps": request.steps,
        "config": parallel.describe(), "worker_pids": pids,
        "model_build_s": round(t_model, 3),
        "first_job_s": round(first.timings["launch_s"] + first.timings["job_s"], 3),
        "launch_s": round(first.timings["launch_s"], 3), "launch_breakdown": launch,
        "warm_job_s": round(warm.timings["job_s"], 3),
        "single_rank_job_s": round(ref.timings["job_s"], 3),
        "max_abs_diff_vs_1_rank": diff, "png": str(png),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = ["# comfyui-xdit demo", ""] + [f"- **{k}**: {v}" for k, v in report.items()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if diff > 1e-4:
        print(f"error: the 2-rank result differs from the 1-rank result by {diff:.2e}")
        return 1
    return 0
