"""Pool overheads for the bench (benchmarks/bench.py; skipped with --no-extras): warm-pool
latency against in-process diffusers, the first-use launch broken down, and the per-job
dispatch cost.

* warm pool vs diffusers: the same 1-rank, 1-thread job (prompt encoding + denoising loop,
  latent out) through a warm `WorkerPool` and through `FluxPipeline.__call__` in this process,
  alternated, median of `repeats` (target: pool <= 1.05x diffusers);
* launch: spawn, then per rank the launch breakdown the pool's status carries (process
  start, import floor, setup before the load, prefetch, load, ready, first job:
  comfyui_xdit/client/pool.py LAUNCH_KEYS), ready and first step of a fresh 2-rank pool;
* dispatch: host-measured job time minus rank 0's own denoising time on a 1-step job of the
  tiny model (what the control channel, the broadcast and result transfer cost).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest


def _diffusers_job(pipe, req: GenerationRequest) -> float:
    import torch

    from comfyui_xdit.comfy_convert import comfy_noise, noise_to_model

    # the noise the pool draws for the same request, in the transformer's (packed) layout
    noise = noise_to_model("flux", comfy_noise(req.seed, (1, 16, req.height // 8,
                                                          req.width // 8)))
    t = time.perf_counter()
    with torch.inference_mode():
        pipe(prompt=req.prompt, guidance_scale=3.5, height=req.height, width=req.width,
             num_inference_steps=req.steps, latents=noise,
             max_sequence_length=req.max_sequence_length, output_type="latent")
    return time.perf_counter() - t


def warm_pool_vs_diffusers(model: Path, job: dict, repeats: int, log=print) -> dict:
    import torch
    import diffusers

    from comfyui_xdit.client.pool import WorkerPool

    req = GenerationRequest(prompt=["a photo of a red cat"], seed=1, steps=job["steps"],
                            height=job["height"], width=job["width"], cfg=1.0,
                            max_sequence_length=job["max_sequence_length"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = diffusers.FluxPipeline.from_pretrained(str(model))
        pipe.set_progress_bar_config(disable=True)
        pool_s, diff_s = [], []
        with WorkerPool(model, ParallelConfig(), device="cpu", threads_per_rank=1) as pool:
            pool.generate(req)
            _diffusers_job(pipe, req)  # warm-up both
            for i in range(repeats):
                t = time.perf_counter()
                pool.generate(req)
                pool_s.append(time.perf_counter() - t)
                diff_s.append(_diffusers_job(pipe, req))
                log(f"  warm pool {pool_s[-1]:.3f} s   in-process diffusers {diff_s[-1]:.3f} s")
    finally:
        torch.set_num_threads(threads)
    p, d = statistics.median(pool_s), statistics.median(diff_s)
    return {"pool_s": pool_s, "diffusers_s": diff_s, "pool_median_s": p,
            "diffusers_median_s": d, "ratio": p / d}


def launch_and_dispatch(model: Path, tiny: Path, job: dict, log=print) -> dict:
    from comfyui_xdit.client.pool import WorkerPool

    req = GenerationRequest(prompt=["a photo of a red cat"], seed=1, steps=job["steps"],
                            height=job["height"], width=job["width"], cfg=1.0,
                            max_sequence_length=job["max_sequence_length"])
    with WorkerPool(model, ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1) as pool:
        t = time.perf_counter()
        first = pool.generate(req)
        total = time.perf_counter() - t
        launch = dict(pool.last_launch)
        first_job = {r["rank"]: r.get("first_job_s") for r in pool.status()["ranks"]}
    launch["ranks"] = [dict(r, first_job_s=first_job.get(r["rank"])) for r in launch["ranks"]]
    out = {"first_job_total_s": total, "spawn_s": launch["spawn_s"],
           "ready_s": launch["ready_s"], "ranks": launch["ranks"],
           "first_step_s": first.timings["first_step_s"], "job_after_ready_s": first.timings["job_s"]}
    log(f"  launch: ready after {out['ready_s']:.2f} s, first job done after {total:.2f} s")

    small = GenerationRequest(prompt=["x"], seed=1, steps=1, height=64, width=64, cfg=1.0,
                              max_sequence_length=8)
    overheads = []
    with WorkerPool(tiny, ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1) as pool:
        pool.generate(small)
        for _ in range(10):
            t = time.perf_counter()
            r = pool.generate(small)
            host = time.perf_counter() - t
            overheads.append(host - max(s["denoise_s"] for s in r.stats))
    out["dispatch_ms"] = [o * 1000 for o in overheads]
    out["dispatch_median_ms"] = statistics.median(overheads) * 1000
    log(f"  dispatch overhead median {out['dispatch_median_ms']:.1f} ms")
    return out


def breakdown_text(r: dict) -> str:
    """One rank's launch breakdown (the pool status's fields) as one table cell pair."""
    pf = r.get("prefetch") or {}
    read = (f"{pf['bytes'] / 2**20:.0f} MB in {pf['s']:.2f} s" if pf.get("state") == "done"
            else pf.get("state", "-"))
    first = r.get("first_job_s")
    return (f"process start / setup before the load (of which the import floor) / prefetch / "
            f"load / ready / first job / peak RSS while loading | {r['start_s']:.2f} s / {r['setup_s']:.2f} s "
            f"({r['import_s']:.2f} s) / {read} / {r['load_s']:.2f} s / {r['ready_s']:.2f} s / "
            f"{'-' if first is None else f'{first:.2f} s'} / {r['load_peak_rss_mb']:.0f} MB")


def markdown(res: dict) -> str:
    w, l = res["warm"], res["launch"]
    lines = ["## Pool overheads", "",
             "| measure | value |", "|---|---|",
             f"| warm 1-rank pool job (median) | {w['pool_median_s']:.3f} s |",
             f"| same job in-process diffusers `FluxPipeline` (median) | {w['diffusers_median_s']:.3f} s |",
             f"| ratio pool / diffusers (target <= 1.05) | **{w['ratio']:.3f}** |",
             f"| launch: spawn 2 processes | {l['spawn_s']:.2f} s |"]
    for r in l["ranks"]:
        lines.append(f"| launch: rank {r['rank']} {breakdown_text(r)} |")
    lines += [f"| launch: pool ready (connected, loaded) | {l['ready_s']:.2f} s |",
              f"| first step after ready (includes prompt encoding) | {l['first_step_s']:.2f} s |",
              f"| first job total (launch + job) | {l['first_job_total_s']:.2f} s |",
              f"| per-job overhead outside the loop (control channel, prompt encoding, broadcast, result), 1-step tiny job, median of 10 | "
              f"{l['dispatch_median_ms']:.1f} ms |", ""]
    return "\n".join(lines)
