"""`python -m comfyui_xdit bench`: speed-up and communication volume of the parallel engine.

On a FLUX-shaped random-weight model big enough that compute dominates (default: 12 heads x
48 head dim, 2 double + 2 single blocks, ~36M transformer parameters; 512x512 image = 1024
image tokens), it measures on CPU, one configuration after the other (never concurrently):

* time per denoising step at 1 rank x 1 thread, and at 2 ranks x 1 thread with Ulysses 2 and
  Ring 2 (the same warm 2-rank pool, switched with `reconfigure`); a 1 rank x 2 threads run
  is shown as a reference (the other way to use two cores);
* bytes each rank sends per step, per collective (the workers' `XDIT_COMM_METER`), against
  the theoretical volume of one full attention activation A per attention layer:
  Ulysses 4(N-1)/N^2 * A, Ring 2(N-1)/N * A;
* a small comparison of ulysses 2 / ring 2 / cfg-parallel (true CFG 2.0) / dp 2 (2 prompts),
  each against the 1-rank time of the same workload.

Time per step = a job's denoising-loop seconds (slowest rank) / steps, median over the timed
jobs of a warm pool (one warm-up job per configuration first). Writes `bench.json` (raw
numbers) and `bench.md` under `--out`, and prints the markdown.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from .config import ParallelConfig
from .request import GenerationRequest

SPEEDUP_TARGET = 1.7
BYTES_TOLERANCE = 0.10
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}

# name -> model/job sizes. "full" is the benchmark; "quick" exercises every code path
# of the bench in seconds (tests).
PRESETS = {
    "full": dict(heads=12, head_dim=48, depth=2, height=512, width=512, steps=5,
                 max_sequence_length=32, warmup=1, repeats=3),
    "quick": dict(heads=4, head_dim=16, depth=1, height=128, width=128, steps=2,
                  max_sequence_length=8, warmup=1, repeats=1),
}

# workload name -> request overrides. Every 2-rank configuration is compared with the 1-rank
# time of its own workload (true CFG doubles the work per step, 2 prompts double the batch).
WORKLOADS = {
    "base": dict(prompt=["a photo of a red cat"], cfg=1.0),
    "cfg": dict(prompt=["a photo of a red cat"], cfg=2.0, negative_prompt="blurry"),
    "batch2": dict(prompt=["a photo of a red cat", "a blue bird on a tree"], cfg=1.0),
}

# (run name, workload, ParallelConfig kwargs) on the 2-rank pool, in order.
TWO_RANK_RUNS = [
    ("ulysses2", "base", dict(ulysses=2)),
    ("ring2", "base", dict(ring=2)),
    ("cfg_parallel", "cfg", dict(cfg_parallel=True)),
    ("dp2", "batch2", dict(dp=2)),
]


def add_cli(sub):
    p = sub.add_parser("bench", help="time/step and bytes/step of 1 vs 2 CPU ranks",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench.md")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 128x128, 2 steps, no 1x2-thread reference: checks the "
                        "bench itself in seconds")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per job")
    p.add_argument("--repeats", type=int, default=None, help="timed jobs per configuration")
    p.add_argument("--cache", default=None,
                   help="model cache folder (default: the demo's cache/models)")
    p.add_argument("--no-extras", action="store_true",
                   help="skip the 1x2-thread reference and the cfg/dp comparison")
    p.set_defaults(func=run)


# ---- model facts -----------------------------------------------------------------------------
def model_facts(path: Path) -> dict:
    """Parameter count (from the safetensors headers) and attention geometry of a FLUX folder."""
    from safetensors import safe_open

    tdir = path / "transformer"
    cfg = json.loads((tdir / "config.json").read_text())
    params = 0
    for f in sorted(tdir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                n = 1
                for d in fh.get_slice(k).get_shape():
                    n *= d
                params += n
    double, single = int(cfg["num_layers"]), int(cfg["num_single_layers"])
    return {"path": str(path), "class": cfg.get("_class_name"), "transformer_params": params,
            "heads": int(cfg["num_attention_heads"]), "head_dim": int(cfg["attention_head_dim"]),
            "width": int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"]),
            "double_blocks": double, "single_blocks": single,
            "attention_layers": double + single, "out_channels": int(cfg.get("out_channels")
                                                                     or cfg["in_channels"])}


def machine_facts() -> dict:
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "host_torch_threads": torch.get_num_threads(),
            "loadavg_start": _loadavg()}


def _cpu_seconds(pid: int):
    """user + system CPU seconds of a process and all its threads (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- theory ----------------------------------------------------------------------------------
def theory(model: dict, job: dict, n: int, batch: int = 1, dtype: str = "fp32") -> dict:
    """Bytes one rank sends per denoising step (one forward, batch `batch`) at sp degree n."""
    tokens = job["text_tokens"] + job["image_tokens"]
    act = batch * tokens * model["heads"] * model["head_dim"] * BYTES_PER_ELEMENT[dtype]
    layers = model["attention_layers"]
    image_shard = job["image_tokens"] // n  # even split in every preset
    return {
        "activation_bytes": act,
        "ulysses_all_to_all": 4 * (n - 1) / n ** 2 * act * layers,
        "ring_p2p": 2 * (n - 1) / n * act * layers,
        # proj_out's image tokens, all-gathered once per forward
        "output_all_gather": batch * image_shard * model["out_channels"]
        * BYTES_PER_ELEMENT[dtype] * (n - 1),
        "stop_flag_broadcast_rank0": 4 * (n - 1),
    }


# ---- measuring -------------------------------------------------------------------------------
def _request(workload: str, job: dict) -> GenerationRequest:
    return GenerationRequest(seed=7, steps=job["steps"], height=job["height"], width=job["width"],
                             max_sequence_length=job["max_sequence_length"], guidance=3.5,
                             **WORKLOADS[workload])


def measure(pool, workload: str, job: dict, warmup: int, repeats: int, log) -> dict:
    """Warm-up job(s), then `repeats` timed jobs on the pool's current configuration."""
    req = _request(workload, job)
    for _ in range(warmup):
        pool.generate(req)
    jobs = []
    for i in range(repeats):
        pids = pool.worker_pids()
        cpu0 = [_cpu_seconds(p) for p in pids]
        res = pool.generate(req)
        cpu1 = [_cpu_seconds(p) for p in pids]
        wall = res.timings["job_s"]
        # CPU seconds each worker got per wall second of the job: ~1.0 (or a little more,
        # gloo's threads) on a quiet machine; well below 1 means other processes took the cores
        share = [None if a is None or b is None else (b - a) / wall for a, b in zip(cpu0, cpu1)]
        jobs.append({"job_s": wall,
                     "denoise_s": [s["denoise_s"] for s in res.stats],
                     "cpu_share": share,
                     "comm": [s.get("comm") for s in res.stats]})
        log(f"    job {i + 1}/{repeats}: denoise {max(jobs[-1]['denoise_s']):.3f}s "
            f"({max(jobs[-1]['denoise_s']) / job['steps']:.3f}s/step)")
    per_step = [max(j["denoise_s"]) / job["steps"] for j in jobs]
    shares = [x for j in jobs for x in j["cpu_share"] if x is not None]
    comm = jobs[-1]["comm"]
    steps = job["steps"]
    comm_per_step = [None if c is None else {k: v / steps for k, v in c["bytes"].items()}
                     for c in comm]
    return {"workload": workload, "batch": len(req.prompt), "cfg": req.cfg,
            "step_s_median": statistics.median(per_step), "step_s_min": min(per_step),
            "step_s_all": per_step, "jobs": jobs,
            "cpu_share_min": min(shares) if shares else None, "comm_bytes_per_step": comm_per_step}


def _run_pool(model, config: ParallelConfig, threads: int, plan: list, job, warmup, repeats,
              log) -> dict:
    """Run `plan` = [(run name, workload, ParallelConfig or None)] on one pool, in order."""
    from .pool import WorkerPool

    out = {}
    with WorkerPool(model, config, device="cpu", threads_per_rank=threads) as pool:
        for name, workload, cfg in plan:
            if cfg is not None:
                pool.reconfigure(cfg)
            log(f"  {name}: {pool.config.describe()}, {threads} thread(s)/rank, "
                f"workload {workload}")
            t = time.perf_counter()
            r = measure(pool, workload, job, warmup, repeats, log)
            r.update(name=name, config=pool.config.describe(), ranks=pool.config.ranks,
                     threads_per_rank=threads, wall_s=time.perf_counter() - t)
            if pool.launches == 1 and "launch" not in out:
                out["launch"] = dict(pool.last_launch)
            out[name] = r
    return out


def run(args) -> int:
    from .demo import default_cache
    from .tiny_model import ensure_tiny_model

    t_start = time.perf_counter()
    preset = dict(PRESETS["quick" if args.quick else "full"])
    if args.steps is not None:
        preset["steps"] = max(1, args.steps)
    if args.repeats is not None:
        preset["repeats"] = max(1, args.repeats)
    extras = not args.no_extras
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    cache = Path(args.cache) if args.cache else default_cache() / "models"
    t = time.perf_counter()
    model_path = ensure_tiny_model("flux", cache, depth=preset["depth"],
                                   width=preset["heads"] * preset["head_dim"],
                                   heads=preset["heads"])
    model = model_facts(Path(model_path))
    model["build_or_reuse_s"] = time.perf_counter() - t
    job = {"height": preset["height"], "width": preset["width"], "steps": preset["steps"],
           "max_sequence_length": preset["max_sequence_length"],
           "text_tokens": preset["max_sequence_length"],  # FLUX pads T5 to this length
           "image_tokens": (preset["height"] // 16) * (preset["width"] // 16),
           "dtype": "fp32", "warmup_jobs": preset["warmup"], "timed_jobs": preset["repeats"],
           "guidance": 3.5, "preset": "quick" if args.quick else "full"}
    log(f"bench: model {model_path} ({model['transformer_params'] / 1e6:.1f}M params), "
        f"{job['width']}x{job['height']} = {job['image_tokens']} image tokens, "
        f"{job['steps']} steps")

    # the workers inherit the environment: the meter must be on before any pool launches
    old_meter = os.environ.get("XDIT_COMM_METER")
    os.environ["XDIT_COMM_METER"] = "1"
    machine = machine_facts()
    runs, launches = {}, {}
    try:
        w, r = preset["warmup"], preset["repeats"]
        one_plan = [("1x1", "base", None)]
        if extras:
            one_plan += [("1x1_cfg", "cfg", None), ("1x1_batch2", "batch2", None)]
        log("1 rank x 1 thread")
        res = _run_pool(model_path, ParallelConfig(), 1, one_plan, job, w, r, log)
        launches["1x1"] = res.pop("launch", None)
        runs.update(res)
        if extras and not args.quick:  # one more launch; --quick keeps to two pools
            log("1 rank x 2 threads (reference)")
            res = _run_pool(model_path, ParallelConfig(), 2, [("1x2", "base", None)], job, w, r,
                            log)
            launches["1x2"] = res.pop("launch", None)
            runs.update(res)
        two_plan = [(n, wl, ParallelConfig(**kw)) for n, wl, kw in TWO_RANK_RUNS
                    if extras or wl == "base"]
        log("2 ranks x 1 thread")
        res = _run_pool(model_path, two_plan[0][2], 1, two_plan, job, w, r, log)
        launches["2x1"] = res.pop("launch", None)
        runs.update(res)
    finally:
        if old_meter is None:
            os.environ.pop("XDIT_COMM_METER", None)
        else:
            os.environ["XDIT_COMM_METER"] = old_meter
    machine["loadavg_end"] = _loadavg()

    report = summarize(machine, model, job, runs, launches)
    report["wall_s"] = time.perf_counter() - t_start
    md = markdown(report)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(md)
    print(md)
    return 0


# ---- summary ---------------------------------------------------------------------------------
_BASELINE = {"base": "1x1", "cfg": "1x1_cfg", "batch2": "1x1_batch2"}


def _rank_bytes(run: dict, kind: str) -> list:
    return [0.0 if c is None else float(c.get(kind, 0.0)) for c in run["comm_bytes_per_step"]]


def summarize(machine, model, job, runs, launches) -> dict:
    n = 2
    th = theory(model, job, n)
    speedup = {}
    for name, r in runs.items():
        base = runs.get(_BASELINE[r["workload"]])
        if base is not None and name != base["name"]:
            speedup[name] = base["step_s_median"] / r["step_s_median"]
            r["speedup_vs_1x1"] = speedup[name]
    checks = []
    for name, kind, key, formula in (("ulysses2", "all_to_all", "ulysses_all_to_all",
                                      "4(N-1)/N^2 * A * layers"),
                                     ("ring2", "p2p", "ring_p2p", "2(N-1)/N * A * layers")):
        per_rank = _rank_bytes(runs[name], kind)
        checks.append({"run": name, "collective": kind, "formula": formula,
                       "theory_bytes_per_step_per_rank": th[key],
                       "measured_bytes_per_step_per_rank": per_rank,
                       "ratio": [m / th[key] for m in per_rank]})
    other = []
    for name in ("ulysses2", "ring2"):
        for kind, key in (("all_gather", "output_all_gather"),
                          ("broadcast", "stop_flag_broadcast_rank0")):
            per_rank = _rank_bytes(runs[name], kind)
            other.append({"run": name, "collective": kind, "expected_bytes_per_step": th[key],
                          "measured_bytes_per_step_per_rank": per_rank})
    # the comm of the extra configurations, for the comparison table
    for r in runs.values():
        r["comm_total_bytes_per_step_max_rank"] = max(
            (sum(c.values()) for c in r["comm_bytes_per_step"] if c), default=0.0)
    bytes_ok = all(abs(x - 1.0) <= BYTES_TOLERANCE for c in checks for x in c["ratio"])
    best = max((speedup[k] for k in ("ulysses2", "ring2") if k in speedup), default=None)
    return {"machine": machine, "model": model, "job": job, "theory": th, "runs": runs,
            "launches": launches, "speedup_vs_1x1": speedup, "bytes_checks": checks,
            "other_traffic": other,
            "targets": {"speedup": SPEEDUP_TARGET, "bytes_tolerance": BYTES_TOLERANCE,
                        "best_sp_speedup": best,
                        "speedup_met": best is not None and best >= SPEEDUP_TARGET,
                        "bytes_met": bytes_ok}}


def _mb(x: float) -> str:
    return f"{x / 2 ** 20:.3f} MiB"


def markdown(rep: dict) -> str:
    m, mo, j, runs = rep["machine"], rep["model"], rep["job"], rep["runs"]
    L = ["# comfyui-xdit bench", ""]
    L.append(f"- machine: {m['cpu_count']} CPUs ({m['cpu_model'] or 'unknown'}), torch "
             f"{m['torch']}, python {m['python']}, load average at start {m['loadavg_start']}"
             f", at end {m.get('loadavg_end')}")
    L.append(f"- model: FLUX-shaped random weights, {mo['transformer_params']:,} transformer "
             f"parameters ({mo['transformer_params'] / 1e6:.1f}M): {mo['double_blocks']} double + "
             f"{mo['single_blocks']} single blocks, {mo['heads']} heads x {mo['head_dim']} "
             f"head dim (width {mo['width']})")
    L.append(f"- job: {j['width']}x{j['height']} = {j['image_tokens']} image tokens + "
             f"{j['text_tokens']} text tokens (max_sequence_length {j['max_sequence_length']}), "
             f"{j['steps']} steps, {j['dtype']}, CPU; per configuration {j['warmup_jobs']} "
             f"warm-up job then {j['timed_jobs']} timed job(s); time/step = denoising loop "
             f"(slowest rank) / steps, median")
    L += ["", "## Time per step", "",
          "| run | configuration | ranks x threads | workload | time/step median (s) | min (s) "
          "| speed-up vs 1 rank x 1 thread | CPU share (min) |",
          "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        sp = r.get("speedup_vs_1x1")
        L.append(f"| {name} | {r['config']} | {r['ranks']} x {r['threads_per_rank']} | "
                 f"{_workload_label(r)} | {r['step_s_median']:.3f} | {r['step_s_min']:.3f} | "
                 f"{'1.00 (baseline)' if sp is None else f'{sp:.2f}x'} | "
                 f"{_fmt(r.get('cpu_share_min'))} |")
    L += ["", "CPU share = CPU seconds a worker process got per wall second of a job (all its "
          "threads); about 1.0 per 1-thread rank on a quiet machine. Lower means other "
          "processes were competing for the cores and the times are inflated."]
    t = rep["targets"]
    best = t["best_sp_speedup"]
    L += ["", f"Best sequence-parallel speed-up at 2 ranks x 1 thread: "
          f"**{best:.2f}x** (target >= {t['speedup']}x: "
          f"{'met' if t['speedup_met'] else 'NOT met'})." if best is not None else ""]
    A = rep["theory"]["activation_bytes"]
    L += ["", "## Bytes sent per step per rank (attention collectives)", "",
          f"One full attention activation A = batch 1 x {j['text_tokens'] + j['image_tokens']} "
          f"tokens x {mo['heads']} heads x {mo['head_dim']} x 4 B = {A:,} B "
          f"({_mb(A)}); {mo['attention_layers']} attention layers; N = 2.", "",
          "| run | collective | theory | measured rank 0 | measured rank 1 | measured / theory |",
          "|---|---|---|---|---|---|"]
    for c in rep["bytes_checks"]:
        meas = c["measured_bytes_per_step_per_rank"]
        L.append(f"| {c['run']} | {c['collective']} = {c['formula']} | "
                 f"{c['theory_bytes_per_step_per_rank']:,.0f} B | "
                 + " | ".join(f"{x:,.0f} B" for x in meas)
                 + " | " + ", ".join(f"{x:.4f}" for x in c["ratio"]) + " |")
    L += ["", f"Within {int(t['bytes_tolerance'] * 100)}% of theory: "
          f"{'yes' if t['bytes_met'] else 'NO'}.", "",
          "Other traffic per step (not attention):", "",
          "| run | collective | expected | measured per rank |", "|---|---|---|---|"]
    for o in rep["other_traffic"]:
        L.append(f"| {o['run']} | {o['collective']} | {o['expected_bytes_per_step']:,.0f} B | "
                 + ", ".join(f"{x:,.0f} B" for x in o["measured_bytes_per_step_per_rank"])
                 + " |")
    L.append("")
    L.append("(all_gather: the image tokens of `proj_out`, gathered once per forward; "
             "broadcast: the 4-byte stop flag, counted on rank 0 only.)")
    extra = [r for r in runs.values() if r["ranks"] == 2]
    if any(r["workload"] != "base" for r in extra):
        L += ["", "## 2 ranks: ulysses vs ring vs cfg-parallel vs dp", "",
              "| run | workload | 1 rank x 1 thread (s/step) | 2 ranks x 1 thread (s/step) "
              "| speed-up | bytes sent/step (max rank) |", "|---|---|---|---|---|---|"]
        for r in extra:
            base = runs.get(_BASELINE[r["workload"]])
            L.append(f"| {r['name']} | {_workload_label(r)} | "
                     f"{base['step_s_median']:.3f} | {r['step_s_median']:.3f} | "
                     f"{r.get('speedup_vs_1x1', float('nan')):.2f}x | "
                     f"{r['comm_total_bytes_per_step_max_rank']:,.0f} B |")
    L += ["", f"Wall time of the bench: {rep['wall_s']:.0f} s.", ""]
    return "\n".join(L)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _workload_label(r: dict) -> str:
    return {"base": "1 prompt", "cfg": f"1 prompt, true CFG {r['cfg']}",
            "batch2": "2 prompts"}[r["workload"]]
