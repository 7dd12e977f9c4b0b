"""`python -m benchmarks --pipefusion --trained`: PipeFusion's quality table (PSNR of the
decoded image against the exact run, per warmup_steps, at degrees 2 and 4) on the small
trained shapes model (`trained-model`), whose velocity field is smooth along the trajectory,
beside the random-weight table of `--pipefusion` (benchmarks/pipefusion.py)."""
from __future__ import annotations

from pathlib import Path

from .pipefusion import DEFAULT_SPLIT, _config, _psnr, measure_quality

PROMPT = ["a red circle on the left"]


def run(args, log, machine: dict) -> dict:
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.testmodels.trained_model import RECIPE, ensure_trained_model

    models = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    path = ensure_trained_model(models, log=log)
    steps = args.steps or 20
    q = dict(height=RECIPE["image"], width=RECIPE["image"], steps=steps,
             warmups=(0, 1, 2, 4, steps), degrees=(2, 4), prompt=PROMPT,
             max_sequence_length=RECIPE["text_len"])
    exact_pool = WorkerPool(str(path), _config(1), device="cpu", threads_per_rank=2)
    try:
        from .pipefusion import _quality_request
        exact = exact_pool.generate(_quality_request(q))
        other = exact_pool.generate(_quality_request(q, seed=12))
    finally:
        exact_pool.close()
    reference = {"image": exact.images, "latent": exact.samples}
    scale = _psnr(other.images, exact.images)
    rows = []
    for degree in q["degrees"]:
        pool = WorkerPool(str(path), _config(degree), device="cpu", threads_per_rank=1)
        try:
            rows += measure_quality(pool, {"split": DEFAULT_SPLIT}, degree, q, reference, log)
        finally:
            pool.close()
    return {"model": str(path), "quality_job": q, "quality": rows, "scale_psnr_db":
            scale["psnr_db"]}


def markdown(report: dict) -> str:
    rep = report["pipefusion_trained"]
    q = rep["quality_job"]
    L = ["## PipeFusion on the trained shapes model", "",
         f"\"{q['prompt'][0]}\", {q['width']}x{q['height']}, {q['steps']} steps, seed 11; PSNR "
         f"of the decoded image against pipefusion 1 (exact); warmup_steps = steps is all "
         f"synchronous (must be identical). Scale: another seed's exact image scores "
         f"{rep['scale_psnr_db']:.1f} dB.", "",
         "| pipefusion | warmup_steps | PSNR (dB) | max abs pixel diff |", "|---|---|---|---|"]
    for r in rep["quality"]:
        psnr = "identical" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}"
        L.append(f"| {r['degree']} | {r['warmup_steps']} | {psnr} | {r['max_abs']:.4f} |")
    return "\n".join(L) + "\n"
