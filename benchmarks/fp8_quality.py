"""`python -m comfyui_xdit bench --fp8`: what fp8 weights cost in quality, and on a GPU what
they save in time, on the small trained model (`trained-model`, whose images mean
something; `--quick`: the random tiny FLUX, mechanics only).

Three warm pools of one rank run the same jobs (the same prompts, seed and steps, decoded to
images): full precision (`weights=auto`: bf16 on CUDA, fp32 on CPU, or `--dtype`), fp8
weights multiplied in fp8 (`XDIT_FP8_COMPUTE=on`: `_scaled_mm`, activations quantised per
row, once per distinct input), and fp8 weights upcast per call (`XDIT_FP8_COMPUTE=off`).
Each fp8 image is compared with the full-precision image of the same prompt: PSNR over the
decoded pixels in [0, 1] (mean and worst of the prompts). The time is the median job; on a
CPU `_scaled_mm` is a reference loop, so only the GPU's times say anything about speed.
`--compile` compiles every pool (on CUDA, where each quantisation fuses into the kernel that
produces its input).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

PROMPTS = ["a red circle on the left", "a blue square at the top",
           "a yellow triangle on the right", "a green circle at the bottom"]
STEPS = 20
VARIANTS = (("full precision", "auto", None), ("fp8 matmul", "fp8", "on"),
            ("fp8 upcast", "fp8", "off"))


def _psnr(a, b) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _warm_pool(path, device, dtype, weights, compute, compile, req):
    """A 1-rank pool, launched and warmed (compiled) by one job. The workers read
    XDIT_FP8_COMPUTE when they start, on the pool's first use, so it is set until then."""
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.planning.config import ParallelConfig
    old = os.environ.get("XDIT_FP8_COMPUTE")
    if compute:
        os.environ["XDIT_FP8_COMPUTE"] = compute
    extra = {"threads_per_rank": 2} if device == "cpu" else {"gpus": ["0"]}
    pool = WorkerPool(str(path), ParallelConfig(), device=device, dtype=dtype,
                      weights=weights, compile=compile, **extra)
    try:
        pool.generate(req)
    except BaseException:
        pool.close()
        raise
    finally:
        if old is None:
            os.environ.pop("XDIT_FP8_COMPUTE", None)
        else:
            os.environ["XDIT_FP8_COMPUTE"] = old
    return pool


def run(args, log, machine: dict) -> dict:
    import torch

    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.planning.request import GenerationRequest

    models = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    if args.quick:
        from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
        path, size, text, prompts = ensure_tiny_model("flux", models), 64, 16, PROMPTS[:2]
        steps, repeats = 4, 1
    else:
        from comfyui_xdit.testmodels.trained_model import RECIPE, ensure_trained_model
        path, size, text, prompts = (ensure_trained_model(models, log=log), RECIPE["image"],
                                     RECIPE["text_len"], PROMPTS)
        steps, repeats = args.steps or STEPS, args.repeats or 3
    req = GenerationRequest(prompt=prompts, seed=7, steps=steps, height=size, width=size,
                            cfg=1.0, guidance=3.5, max_sequence_length=text, output="image")
    rows, ref = [], None
    for name, weights, compute in VARIANTS:
        pool = _warm_pool(path, device, dtype, weights, compute, args.compile, req)
        try:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                res = pool.generate(req)
                times.append(time.perf_counter() - t)
            st = pool.status()
        finally:
            pool.close()
        images = res.images
        row = {"variant": name, "weights": weights, "time_s": statistics.median(times),
               "fp8_compute": st.get("fp8_compute")}
        if ref is None:
            ref = images
        else:
            per = [_psnr(images[i], ref[i]) for i in range(len(prompts))]
            row.update(psnr_mean_db=statistics.fmean(per), psnr_min_db=min(per))
        rows.append(row)
        log(f"fp8: {name}: {row['time_s']:.3f} s/job"
            + (f", PSNR {row['psnr_mean_db']:.1f} dB (worst {row['psnr_min_db']:.1f})"
               if "psnr_mean_db" in row else ""))
    return {"model": str(path), "device": device, "dtype": dtype, "compile": args.compile,
            "job": {"prompts": prompts, "steps": steps, "size": size, "repeats": repeats},
            "rows": rows}


def markdown(report: dict) -> str:
    rep = report["fp8_quality"]
    j = rep["job"]
    model = "trained shapes model" if "trained" in rep["model"] else "tiny random model"
    out = [f"## fp8 weights ({model}, {rep['device']}, {rep['dtype']}"
           f"{', compiled' if rep['compile'] else ''})", "",
           f"{len(j['prompts'])} images {j['size']}x{j['size']}, {j['steps']} steps, 1 rank; "
           f"PSNR of the decoded images against full precision (mean, worst); time: median "
           f"of {j['repeats']} jobs"
           + (" (CPU: `_scaled_mm` is a reference loop there, the times say nothing about "
              "a GPU)" if rep["device"] == "cpu" else "") + ".", "",
           "| weights | compute | time/job | vs full | PSNR mean | PSNR worst |",
           "|---|---|---|---|---|---|"]
    base = rep["rows"][0]["time_s"]
    for r in rep["rows"]:
        p = ("-", "-") if "psnr_mean_db" not in r else tuple(
            "identical" if math.isinf(v) else f"{v:.1f} dB"
            for v in (r["psnr_mean_db"], r["psnr_min_db"]))
        out.append(f"| {r['variant']} | {r['fp8_compute'] or '-'} | {r['time_s']:.3f} s | "
                   f"{r['time_s'] / base:.2f}x | {p[0]} | {p[1]} |")
    return "\n".join(out) + "\n"
