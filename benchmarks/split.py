"""`python -m comfyui_xdit bench --split`: GPUs of different speed, on CPU. Each rank is a
simulated device (xdit_testhooks/slow_ranks.py with a base delay: after each block it sleeps
a fixed time per row x token it was given, so a busy shared CPU's contention does not set
the ranks' speeds), one of them k times slower, and the time per denoising step is measured with
the even split and with `auto` (the ranks' speeds measured by a one-step probe, then refined
from every job), beside the ideal: the work divided by the sum of the speeds, i.e. the
all-fast step time x N / (N - 1 + 1/k).

Per rank count (2 and 4, one pool each, reconfigured between methods and splits: no
relaunch), per method (Ulysses, Ring, DP), per slowdown (1.5x and 3x): ideal, even and auto,
seconds per step (the slowest rank's denoising time / steps, median of the timed jobs; the
all-fast, even and auto jobs interleaved round by round, so a busy machine slows all three
alike).
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig

PRESETS = {
    "full": dict(width=256, heads=8, depth=2, size=384, steps=2, timed=3, auto_jobs=3,
                 ranks=(2, 4), slowdowns=(1.5, 3.0), batch=2, base=4e-4),
    "quick": dict(width=64, heads=4, depth=1, size=128, steps=2, timed=1, auto_jobs=1,
                  ranks=(2,), slowdowns=(2.0,), batch=2, base=4e-4),
}
METHODS = {"ulysses": lambda n: dict(ulysses=n), "ring": lambda n: dict(ring=n),
           "dp": lambda n: dict(dp=n)}


def _step_s(result, steps: int) -> float:
    return max(s["denoise_s"] for s in result.stats) / steps


def run(args, log, machine) -> dict:
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.planning.request import GenerationRequest
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    p = dict(PRESETS["quick" if args.quick else "full"])
    if args.steps is not None:
        p["steps"] = max(1, args.steps)
    if args.repeats is not None:
        p["timed"] = max(1, args.repeats)
    if getattr(args, "ranks", None):
        p["ranks"] = tuple(int(x) for x in str(args.ranks).split(","))
    if getattr(args, "slowdowns", None):
        p["slowdowns"] = tuple(float(x) for x in str(args.slowdowns).split(","))
    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    model = ensure_tiny_model("flux", cache, depth=p["depth"], width=p["width"],
                              heads=p["heads"])
    tmp = Path(tempfile.mkdtemp(prefix="xdit-split-bench-"))
    slow_file = tmp / "slow"
    slow_file.write_text("")
    saved = {k: os.environ.get(k) for k in ("XDIT_SLOW_RANKS_FILE", "XDIT_SPLIT_CACHE")}
    os.environ["XDIT_SLOW_RANKS_FILE"] = str(slow_file)
    rows, out = [], {"preset": "quick" if args.quick else "full", **{k: p[k] for k in (
        "width", "heads", "depth", "size", "steps", "timed", "base")}, "model": str(model)}

    def req(batch):
        return GenerationRequest(prompt=["a red cube on a table"] * batch, seed=1,
                                 steps=p["steps"], height=p["size"], width=p["size"])

    try:
        for n in p["ranks"]:
            pool = WorkerPool(str(model), ParallelConfig(ulysses=n), device="cpu",
                              threads_per_rank=1,
                              worker_hooks=["xdit_testhooks.slow_ranks:install"])
            try:
                for method, degrees in METHODS.items():
                    batch = p["batch"] * n if method == "dp" else 1  # rows to share out

                    def job(split, slow):
                        slow_file.write_text(f"{slow},base={p['base']}")
                        pool.reconfigure(ParallelConfig(**degrees(n), split=split))
                        return pool.generate(req(batch))

                    job("even", "")  # warm this method's hooks
                    for k in p["slowdowns"]:
                        slow = f"{n - 1}:{k}"
                        os.environ["XDIT_SPLIT_CACHE"] = str(tmp / f"speeds-{n}-{method}-{k}")
                        pool._split_speeds = None  # a fresh measurement per slowdown
                        for _ in range(p["auto_jobs"]):  # auto: the probe, then refined
                            job("auto", slow)
                        times = {"fast": [], "even": [], "auto": []}
                        for _ in range(p["timed"]):  # interleaved: load hits all three alike
                            for name, split, sl in (("fast", "even", ""), ("even", "even", slow),
                                                    ("auto", "auto", slow)):
                                times[name].append(_step_s(job(split, sl), p["steps"]))
                        fast, even, auto = (statistics.median(times[x])
                                            for x in ("fast", "even", "auto"))
                        weights = pool.status()["split"]["ranks"]
                        ideal = fast * n / (n - 1 + 1 / k)
                        # the hook slows the per-token work only (a fraction f of the step,
                        # read off the even run: even = fast x (k f + 1 - f)); the ideal for
                        # that work alone, the rest (attention, exchange) as it was
                        f = min(1.0, max(0.0, (even / fast - 1) / (k - 1)))
                        ideal_part = fast * (f * n / (n - 1 + 1 / k) + 1 - f)
                        row = {"ranks": n, "method": method, "slowdown": k, "fast_s": fast,
                               "ideal_s": ideal, "ideal_part_s": ideal_part, "slowed_f": f,
                               "even_s": even, "auto_s": auto,
                               "auto_vs_ideal": auto / ideal - 1, "even_vs_ideal": even / ideal - 1,
                               "shares": [r["share"] for r in weights]}
                        log(f"split bench: {n} ranks {method} slow x{k}: ideal {ideal:.3f}s "
                            f"even {even:.3f}s auto {auto:.3f}s (shares {row['shares']})")
                        rows.append(row)
            finally:
                pool.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out["rows"] = rows
    return out


def markdown(report) -> str:
    r = report["split"]
    lines = [f"# Uneven split: one rank k times slower (CPU, {r['preset']} preset)", "",
             f"Tiny FLUX (width {r['width']}, {r['heads']} heads, depth {r['depth']}), "
             f"{r['size']}x{r['size']}, {r['steps']} steps, 1 thread per rank, each rank a "
             f"simulated device sleeping {r['base'] * 1e6:.0f} us per row x token per block "
             f"(times its factor); seconds per "
             f"step, median of {r['timed']} timed jobs. Ideal = all-fast step x N / "
             f"(N - 1 + 1/k) (the work over the sum of the speeds); the hook slows the "
             f"per-token work only, a fraction f of the step read off the even run, so "
             f"'ideal (f)' is that work balanced and the rest as it was.", "",
             "| ranks | method | slowdown | all fast | ideal | ideal (f) | even | auto | "
             "auto vs ideal | auto shares |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['ranks']} | {x['method']} | {x['slowdown']}x | {x['fast_s']:.3f} "
                     f"| {x['ideal_s']:.3f} | {x['ideal_part_s']:.3f} (f {x['slowed_f']:.2f}) "
                     f"| {x['even_s']:.3f} | {x['auto_s']:.3f} | {x['auto_vs_ideal']:+.0%} | "
                     f"{', '.join(f'{s:.2f}' for s in x['shares'])} |")
    return "\n".join(lines) + "\n"
