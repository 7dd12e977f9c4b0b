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

# the numerics contract's exactness bound for a parallel run against 1 rank (fp32)
TOLERANCE, TOLERANCE_TEXT = 1e-4, "1e-4"


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
    ok = diff <= TOLERANCE
    verdict = (f"OK: 2 ranks match 1 rank ({diff:.1e} <= {TOLERANCE_TEXT})" if ok else
               f"FAILED: 2 ranks differ from 1 rank by {diff:.1e} (> {TOLERANCE_TEXT})")
    timings = {  # seconds
        "model build (cached after the first run)": t_model,
        "first job, launch included": first.timings["launch_s"] + first.timings["job_s"],
        "pool launch": first.timings["launch_s"],
        "warm job, 2 ranks": warm.timings["job_s"],
        "same job, 1 rank": ref.timings["job_s"],
    }
    report = {
        "verdict": verdict, "model": str(model), "prompt": args.prompt, "seed": args.seed,
        "size": f"{request.width}x{request.height}", "steps": request.steps,
        "config": parallel.describe(), "worker_pids": pids,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "launch_breakdown": launch, "max_abs_diff_vs_1_rank": diff, "png": str(png),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report))
    print(f"wrote {png} and {out / 'report.md'}")
    print(verdict)
    return 0 if ok else 1


def report_markdown(report: dict) -> str:
    """report.md: the verdict first, the run's settings, then the timings as a table."""
    lines = ["# comfyui-xdit demo", "", f"**{report['verdict']}**", ""]
    for key in ("model", "prompt", "seed", "size", "steps", "config", "png"):
        lines.append(f"- {key}: {report[key]}")
    lines += ["", "| what | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in report["timings_s"].items()]
    return "\n".join(lines) + "\n"
