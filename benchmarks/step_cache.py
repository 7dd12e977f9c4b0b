"""`python -m benchmarks --cache`: the step cache's speed-up and its distance from the
uncached image, ours beside cache-dit's, on the small trained model.

A cache only means something on a model whose velocity field is smooth along the sampling
trajectory, so this runs on `trained-model` (comfyui_xdit/testmodels/trained_model.py:
FLUX-shaped, trained on drawn shapes; `--quick`: the random tiny FLUX, mechanics only). For
each threshold:

* ours: a warm pool at 1 rank and at Ulysses 2 (the same settings: head 1, tail 0, warmup
  `WARMUP`, no skip cap, no forecast), the time per image (median of `repeats` jobs), the
  calls skipped and the PSNR of the decoded image against the same pool's uncached image;
* cache-dit (if installed: `pip install cache-dit`): `FluxPipeline` in this process with
  `cache_dit.enable_cache(DBCacheConfig(Fn=1, Bn=0, the threshold, the same warmup, no
  cap))`, the same three figures against the uncached pipeline.

Each side is measured against its own uncached run, so the ratios compare the caches, not
the pool with diffusers. Timings are wall-clock on this machine, with its load recorded.
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

STEPS = 28
WARMUP = 4
THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.3)
PROMPTS = ["a red circle on the left", "a blue square at the top"]


def _psnr(a, b) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _ours(pool, threshold, job, repeats):
    from comfyui_xdit.planning.request import GenerationRequest
    cache = None if threshold is None else {"threshold": threshold, "warmup": WARMUP,
                                            "head": 1, "tail": 0, "max_skips": 0}
    req = GenerationRequest(prompt=job["prompts"], seed=3, steps=job["steps"],
                            height=job["size"], width=job["size"], cfg=1.0, guidance=3.5,
                            max_sequence_length=job["text"], output="image", cache=cache)
    pool.generate(req)  # warm
    t, res = _median_time(lambda: pool.generate(req), repeats)
    # rank 0 holds every row here (1 rank, or Ulysses): skipped row-calls per image
    skipped = res.stats[0].get("cache", {}).get("skipped", 0) / len(job["prompts"])
    return t, res.images, skipped


def _cache_dit(path, threshold, job, repeats):
    import torch
    from diffusers import FluxPipeline

    import cache_dit
    from cache_dit import DBCacheConfig

    pipe = FluxPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if threshold is not None:
        cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold,
            max_warmup_steps=WARMUP, max_continuous_cached_steps=-1))

    def run():
        with torch.inference_mode():
            return pipe(job["prompts"], height=job["size"], width=job["size"],
                        num_inference_steps=job["steps"], guidance_scale=3.5,
                        max_sequence_length=job["text"], output_type="pt",
                        generator=torch.Generator().manual_seed(3)).images
    run()
    t, images = _median_time(run, repeats)
    skipped = 0
    if threshold is not None:
        stats = cache_dit.summary(pipe)
        s = stats[0] if isinstance(stats, list) and stats else stats
        skipped = len(getattr(s, "cached_steps", []) or [])  # the last run's (reset per run)
        cache_dit.disable_cache(pipe)
    return t, images.permute(0, 2, 3, 1), skipped


def run(args, log, machine: dict) -> dict:
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.planning.config import ParallelConfig

    models = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    if args.quick:
        from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
        path = ensure_tiny_model("flux", models)
        job = dict(prompts=PROMPTS[:1], steps=6, size=64, text=16)
        thresholds, repeats, ranks = (0.5,), 1, (1,)
    else:
        from comfyui_xdit.testmodels.trained_model import RECIPE, ensure_trained_model
        path = ensure_trained_model(models, log=log)
        job = dict(prompts=PROMPTS, steps=args.steps or STEPS, size=RECIPE["image"],
                   text=RECIPE["text_len"])
        thresholds, repeats, ranks = THRESHOLDS, args.repeats or 3, (1, 2)
    rows = []
    for n in ranks:
        config = ParallelConfig(ulysses=n) if n > 1 else ParallelConfig()
        pool = WorkerPool(str(path), config.with_world_size(n), device="cpu",
                          threads_per_rank=max(1, 2 // n))
        try:
            base_t, base_img, _ = _ours(pool, None, job, repeats)
            log(f"cache: ours at {n} rank(s), uncached {base_t:.3f} s")
            for th in thresholds:
                t, img, skipped = _ours(pool, th, job, repeats)
                rows.append({"impl": "ours", "ranks": n, "threshold": th, "time_s": t,
                             "speedup": base_t / t, "skipped": skipped,
                             "psnr_db": _psnr(img, base_img)})
                log(f"  threshold {th}: {t:.3f} s ({base_t / t:.2f}x), {skipped} of "
                    f"{job['steps']} steps skipped, PSNR {rows[-1]['psnr_db']:.1f} dB")
        finally:
            pool.close()
    try:
        import cache_dit  # noqa: F401
        have = True
    except ImportError:
        have = False
        log("cache: cache-dit is not installed (pip install cache-dit): its rows are skipped")
    if have:
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            base_t, base_img, _ = _cache_dit(path, None, job, repeats)
            log(f"cache: cache-dit, uncached {base_t:.3f} s")
            for th in thresholds:
                t, img, skipped = _cache_dit(path, th, job, repeats)
                rows.append({"impl": "cache-dit", "ranks": 1, "threshold": th, "time_s": t,
                             "speedup": base_t / t, "skipped": skipped,
                             "psnr_db": _psnr(img, base_img)})
                log(f"  threshold {th}: {t:.3f} s ({base_t / t:.2f}x), {skipped} of "
                    f"{job['steps']} steps cached, PSNR {rows[-1]['psnr_db']:.1f} dB")
        finally:
            torch.set_num_threads(threads)
    return {"model": str(path), "job": job, "warmup": WARMUP, "rows": rows,
            "cache_dit": have}


def markdown(report: dict) -> str:
    rep = report["step_cache"]
    j = rep["job"]
    out = [f"## Step cache ({'trained shapes model' if 'trained' in rep['model'] else 'tiny random model'})",
           "",
           f"{len(j['prompts'])} images {j['size']}x{j['size']}, {j['steps']} steps, head 1 / "
           f"tail 0, warmup {rep['warmup']}, no skip cap; PSNR of the decoded images against "
           f"the same implementation's uncached run; time: median per job on this machine.",
           "", "| implementation | ranks | threshold | steps skipped | time | speed-up | PSNR |",
           "|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        psnr = "identical" if math.isinf(r["psnr_db"]) else f"{r['psnr_db']:.1f} dB"
        out.append(f"| {r['impl']} | {r['ranks']} | {r['threshold']} | {r['skipped']:g} of "
                   f"{j['steps']} | {r['time_s']:.3f} s | {r['speedup']:.2f}x | {psnr} |")
    if not rep["cache_dit"]:
        out += ["", "cache-dit was not installed: its rows are missing."]
    return "\n".join(out) + "\n"
