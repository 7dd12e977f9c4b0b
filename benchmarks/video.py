"""`python -m comfyui_xdit bench --video`: a video-shaped job, where the tokens far outnumber
the text's, at 1 rank vs 2 ranks (Ulysses 2, Ring 2, CFG parallel), in one run.

On a tiny-width random-weight Wan 2.1 model (default: 8 heads x 32 = width 256, 2 blocks)
at 256x256 x 33 frames = 9 latent frames x 16 x 16 = 2,304 video tokens (16 text tokens,
reached by cross-attention, outside the sequence), it measures on CPU, one configuration
after the other, warm pools timed round-robin (benchmarks/measure.py, as the image bench):

* time per denoising step, 1 rank x 1 thread against 2 ranks x 1 thread;
* bytes each rank sends per step on the data plane (benchmarks/comm_meter.py) against the
  memory plan's per-step traffic (comfyui_xdit/planning/memory_arithmetic.py `step_traffic`, the
  one formula the docs' 720p x 81 frames table is printed with): Ulysses 4(N-1)/N^2 x A x L,
  Ring 2(N-1)/N x A x L, CFG parallel one prediction (the LATENT's size), where A = the
  video tokens x width x 4 B (fp32) and L = the blocks.
"""
from __future__ import annotations

import statistics
import time

from comfyui_xdit.planning.config import ParallelConfig

PRESETS = {
    "full": dict(heads=8, width=256, depth=2, height=256, width_px=256, frames=33, steps=3,
                 max_sequence_length=16, warmup=1, repeats=3),
    # the default tiny Wan (4 heads x 16, 2 blocks): every code path in seconds (tests)
    "quick": dict(heads=4, width=64, depth=2, height=64, width_px=64, frames=5, steps=2,
                  max_sequence_length=8, warmup=1, repeats=1),
}
TOLERANCE = 0.10  # measured bytes within 10% of the formula
# (run name, workload, ParallelConfig kwargs, meter kind, step_traffic key) at 2 ranks
RUNS = [("ulysses2", "base", dict(ulysses=2), "all_to_all", "Ulysses"),
        ("ring2", "base", dict(ring=2), "p2p", "Ring"),
        ("cfg_parallel", "cfg", dict(cfg_parallel=True), "all_gather", "CFG parallel")]


def run(args, log, machine) -> dict:
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client.pool import WorkerPool
    from comfyui_xdit.planning import memory_arithmetic as arith
    from comfyui_xdit.planning.model_facts import model_facts, transformer_facts
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    from .measure import (METER_HOOKS, Ceiling, Contention, Entry, measure_interleaved,
                          summarize_entry)
    from pathlib import Path

    p = dict(PRESETS["quick" if args.quick else "full"])
    if args.steps is not None:
        p["steps"] = max(1, args.steps)
    if args.repeats is not None:
        p["repeats"] = max(1, args.repeats)
    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    kw = {} if args.quick else dict(depth=p["depth"], width=p["width"], heads=p["heads"])
    model_path = ensure_tiny_model("wan", cache, **kw)
    facts = model_facts(str(model_path), "fp32")
    tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    job = {"height": p["height"], "width": p["width_px"], "frames": p["frames"],
           "steps": p["steps"], "max_sequence_length": p["max_sequence_length"],
           "guidance": None, "dtype": "fp32", "warmup_jobs": p["warmup"],
           "timed_jobs": p["repeats"], "preset": "quick" if args.quick else "full"}
    size = arith.JobSize(height=job["height"], width=job["width"], frames=job["frames"],
                         text_tokens=job["max_sequence_length"])
    job["video_tokens"] = arith.job_tokens(facts, size)
    theory = {"base": arith.step_traffic(facts, size, "fp32", 2),
              "cfg": arith.step_traffic(facts, arith.JobSize(**{**size.__dict__, "cfg": True}),
                                        "fp32", 2)}
    model = {"path": str(model_path), "heads": tr.heads, "width": tr.hidden,
             "blocks": len(tr.blocks),
             "transformer_params": sum(n for b in tr.blocks for n, _, _ in b) +
             sum(n for n, _, _ in tr.rest)}
    log(f"bench --video: {model['transformer_params'] / 1e6:.2f}M-parameter Wan, "
        f"{job['width']}x{job['height']} x {job['frames']} frames = {job['video_tokens']} "
        f"video tokens + {job['max_sequence_length']} text tokens, {job['steps']} steps")

    attempts = p["repeats"] if args.quick else p["repeats"] + max(0, args.max_retries)
    quiet = Contention(args.max_foreign_load, 0.0 if args.quick else args.max_wait, log)
    pools, ceiling = {}, None
    try:
        ceiling = Ceiling(0.4 if args.quick else 1.5)
        pools[1] = WorkerPool(model_path, ParallelConfig(), device="cpu", threads_per_rank=1,
                              worker_hooks=METER_HOOKS)
        pools[2] = WorkerPool(model_path, ParallelConfig(ulysses=2), device="cpu",
                              threads_per_rank=1, worker_hooks=METER_HOOKS)
        entries = [Entry("1x1", pools[1], ParallelConfig(), "base", 1),
                   Entry("1x1_cfg", pools[1], ParallelConfig(), "cfg", 1)]
        entries += [Entry(name, pools[2], ParallelConfig(**kw), wl, 1)
                    for name, wl, kw, _, _ in RUNS]
        samples = measure_interleaved(entries, job, p["warmup"], p["repeats"], attempts,
                                      quiet, ceiling, log)
    finally:
        for pool in pools.values():
            pool.close()
        if ceiling is not None:
            ceiling.close()
    runs = {e.name: summarize_entry(e, job) for e in entries}
    checks = []
    for name, wl, _, kind, key in RUNS:
        r = runs[name]
        base = runs["1x1" if wl == "base" else "1x1_cfg"]
        r["speedup_vs_1x1"] = base["step_s_median"] / r["step_s_median"]
        want = theory[wl][key]
        got = [float(c.get(kind, 0.0)) for c in r["comm_bytes_per_step"]]
        checks.append({"run": name, "collective": kind, "formula": key,
                       "theory_bytes_per_step_per_rank": want,
                       "measured_bytes_per_step_per_rank": got,
                       "ratio": [g / want if want else None for g in got],
                       "others": {k: max(float(c.get(k, 0.0)) for c in r["comm_bytes_per_step"])
                                  for k in ("all_to_all", "p2p", "all_gather", "broadcast",
                                            "send") if k != kind}})
    clean = [s["ratio"] for s in samples if not s["contended"]] or [s["ratio"] for s in samples]
    return {"model": model, "job": job, "theory": theory, "runs": runs, "checks": checks,
            "two_core_ceiling": statistics.median(clean) if clean else None,
            "bytes_met": all(x is not None and abs(x - 1) <= TOLERANCE
                             for c in checks for x in c["ratio"]),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def markdown(report: dict) -> str:
    m, rep = report["machine"], report["video"]
    mo, j = rep["model"], rep["job"]
    L = ["# comfyui-xdit bench --video", "",
         f"- machine: {m['cpu_count']} CPUs ({m['cpu_model'] or 'unknown'}), torch {m['torch']}, "
         f"load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}; "
         f"{rep['measured_at']}",
         f"- model: Wan 2.1-shaped random weights, {mo['transformer_params']:,} transformer "
         f"parameters: {mo['blocks']} blocks, {mo['heads']} heads, width {mo['width']}",
         f"- job: {j['width']}x{j['height']} x {j['frames']} frames = {j['video_tokens']:,} "
         f"video tokens; {j['max_sequence_length']} text tokens (cross-attention, on every "
         f"rank); {j['steps']} steps, fp32, CPU, 1 thread per rank; {j['warmup_jobs']} warm-up "
         f"job then {j['timed_jobs']} timed job(s) per configuration, round-robin", "",
         "| run | ranks | workload | time/step median (s) | speed-up vs 1 rank | "
         "timed jobs used | other processes (cores, max) |", "|---|---|---|---|---|---|---|"]
    for name, r in rep["runs"].items():
        sp = r.get("speedup_vs_1x1")
        f = r.get("foreign_cores_max")
        foreign = "?" if f is None else f"{f:.2f}"
        L.append(f"| {name} | {r['ranks']} | {'true CFG 2.0' if r['workload'] == 'cfg' else 'no CFG'}"
                 f" | {r['step_s_median']:.3f} | {'baseline' if sp is None else f'{sp:.2f}x'} | "
                 f"{r['timed_jobs_used']}/{len(r['jobs'])}"
                 f"{' (all contended)' if r['contended'] else ''} | "
                 f"{foreign} |")
    c = rep.get("two_core_ceiling")
    if c:
        L += ["", f"Two-core ceiling (two 1-thread matmul processes at once vs one): {c:.2f}x. "
              "Other processes = cores used outside this bench during a timed job; jobs above "
              "the --max-foreign-load threshold are re-run until --max-wait is spent, then "
              "kept and flagged (all contended): their times measure the neighbours too."]
    L += ["", "Bytes a rank sends per step, against the memory plan's `step_traffic`:", "",
          "| run | collective | theory | measured rank 0 | measured rank 1 | measured / theory "
          "| other data-plane bytes (max rank) |", "|---|---|---|---|---|---|---|"]
    for k in rep["checks"]:
        got = k["measured_bytes_per_step_per_rank"]
        ratio = ", ".join("-" if x is None else f"{x:.3f}" for x in k["ratio"])
        others = ", ".join(f"{n} {v:,.0f} B" for n, v in k["others"].items() if v) or "none"
        L.append(f"| {k['run']} | {k['collective']} | {k['theory_bytes_per_step_per_rank']:,.0f}"
                 f" B | {got[0]:,.0f} B | {got[1]:,.0f} B | {ratio} | {others} |")
    L += ["", f"Within {int(TOLERANCE * 100)}% of theory: "
          f"{'yes' if rep['bytes_met'] else 'NO'}.", ""]
    return "\n".join(L)
