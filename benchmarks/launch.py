"""`bench --launch`: a tiny 2-rank CPU pool's launch, plain processes (`XDIT_LAUNCHER=spawn`)
against ranks forked from the preloaded helper (comfyui_xdit/client/rank_launcher.py), side
by side in one run, launches interleaved so a shared machine's drifts hit both alike.

Per launch: the pool's ready time on the host's clock (`last_launch["ready_s"]`: spawn to
connected and loaded), the ranks' import floor (`import_s`, slowest rank), and the CPU
seconds the launch cost (user + sys of everything it started, ranks and helper, launch to
close; on a loaded machine this is the fair comparison, wall time is not). The helper's own
start (its imports, once per host and launch environment) is reported apart, as "cold".
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig

LAUNCHERS = ("spawn", "preload")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _helpers_cpu() -> float:
    """CPU of the live helpers, their reaped ranks included (/proc: cutime, cstime)."""
    from comfyui_xdit.client import rank_launcher as L

    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for h in list(L._helpers.values()):
        try:
            with open(f"/proc/{h.proc.pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += sum(int(x) for x in fields[11:15]) / tick
        except (OSError, ValueError):
            pass
    return total


def _launch_once(model: str, launcher: str) -> dict:
    from comfyui_xdit.client.pool import WorkerPool

    os.environ["XDIT_LAUNCHER"] = launcher
    cpu0 = _children_cpu() + _helpers_cpu()
    with WorkerPool(model, ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1) as pool:
        with pool._lock:  # the launch alone, as a job's first step does it (no job)
            pool._launch()
        launch = dict(pool.last_launch)
    time.sleep(0.3)  # the helper reaps and reports its ranks
    cpu = _children_cpu() + _helpers_cpu() - cpu0
    return {"launcher": launch["launcher"], "ready_s": launch["ready_s"],
            "spawn_s": launch["spawn_s"], "cpu_s": cpu,
            "import_s": max(r["import_s"] for r in launch["ranks"])}


def run(args, log, machine) -> dict:
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client import rank_launcher as L
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    model = str(ensure_tiny_model("flux", cache))
    repeats = max(1, args.repeats or (2 if args.quick else 5))
    saved = os.environ.get("XDIT_LAUNCHER")
    L.close_all()
    rows = {name: [] for name in LAUNCHERS}
    try:
        t = time.perf_counter()
        cold = _launch_once(model, "preload")  # starts the helper: its imports, once
        cold["wall_s"] = time.perf_counter() - t
        helper = next(iter(L._helpers.values()), None)
        cold["helper_import_s"] = helper.import_s if helper else None
        log(f"  preload, cold helper: ready {cold['ready_s']:.2f} s, {cold['cpu_s']:.1f} s CPU")
        for i in range(repeats):
            for name in LAUNCHERS:
                r = _launch_once(model, name)
                rows[name].append(r)
                log(f"  {name} #{i + 1}: ready {r['ready_s']:.2f} s, import {r['import_s']:.2f} s, "
                    f"{r['cpu_s']:.1f} s CPU ({r['launcher']})")
    finally:
        if saved is None:
            os.environ.pop("XDIT_LAUNCHER", None)
        else:
            os.environ["XDIT_LAUNCHER"] = saved
    summary = {name: {k: statistics.median(r[k] for r in rows[name])
                      for k in ("ready_s", "import_s", "cpu_s")} for name in LAUNCHERS}
    return {"model": model, "repeats": repeats, "cold_preload": cold, "runs": rows,
            "median": summary}


def markdown(report: dict) -> str:
    r = report["launch"]
    m, cold = r["median"], r["cold_preload"]
    lines = ["## Pool launch: plain processes vs the preloaded launcher", "",
             f"Tiny FLUX, 2 ranks x 1 thread, CPU; median of {r['repeats']} launches each, "
             "interleaved.", "",
             "| launcher | pool ready | rank import floor | CPU per launch (user+sys) |",
             "|---|---|---|---|"]
    for name in LAUNCHERS:
        lines.append(f"| {name} | {m[name]['ready_s']:.2f} s | {m[name]['import_s']:.2f} s | "
                     f"{m[name]['cpu_s']:.1f} s |")
    lines += ["", f"The helper's own start (once per host and launch environment): imports "
              f"{cold['helper_import_s']:.2f} s; that first pool was ready after "
              f"{cold['ready_s']:.2f} s for {cold['cpu_s']:.1f} s CPU, helper included.", ""]
    return "\n".join(lines)
