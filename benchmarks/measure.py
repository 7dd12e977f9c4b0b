"""The measuring machinery the benchmarks share: machine facts, the CPU-contention monitor,
the two-core ceiling, and warm pools timed round-robin with the communication meter.

A shared 2-core machine is the norm here, so every timed job records how many cores *other*
processes used meanwhile (`Contention`), jobs above a threshold are re-run, and the pools
compared stay warm side by side and are timed one job at a time, round-robin
(`measure_interleaved`), next to samples of what two cores give right now (`Ceiling`).
Bytes come from the communication meter (benchmarks/comm_meter.py), a worker hook: pools
that report them are launched with `worker_hooks=METER_HOOKS`.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest

from .comm_meter import SPEC as METER

METER_HOOKS = (METER,)  # WorkerPool(..., worker_hooks=METER_HOOKS): the workers count bytes

# workload name -> request overrides. Every 2-rank configuration is compared with the 1-rank
# time of its own workload (true CFG doubles the work per step, 2 prompts double the batch).
WORKLOADS = {
    "base": dict(prompt=["a photo of a red cat"], cfg=1.0),
    "cfg": dict(prompt=["a photo of a red cat"], cfg=2.0, negative_prompt="blurry"),
    "batch2": dict(prompt=["a photo of a red cat", "a blue bird on a tree"], cfg=1.0),
}


def meter_stats(stats: list) -> list:
    """Each rank's communication-meter snapshot from a job's `result.stats`."""
    out = [s.get("hooks", {}).get(METER) for s in stats]
    if any(c is None for c in out):
        raise RuntimeError(f"a rank reported no {METER} stats: launch the pool with "
                           f"worker_hooks=METER_HOOKS")
    return out


def machine_facts(device: str = "cpu") -> dict:
    """The machine a report was measured on; on `device` "cuda" also its GPUs and CUDA."""
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu_count": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
           "python": platform.python_version(), "torch": torch.__version__,
           "host_torch_threads": torch.get_num_threads(),
           "loadavg_start": loadavg()}
    if device == "cuda" and torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["cuda"] = torch.version.cuda
    return out


def cpu_seconds(pid: int):
    """user + system CPU seconds of a process and all its threads (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- measuring ------------------------------------------------------------------------------
def request(workload: str, job: dict) -> GenerationRequest:
    return GenerationRequest(seed=7, steps=job["steps"], height=job["height"], width=job["width"],
                             max_sequence_length=job["max_sequence_length"],
                             guidance=job.get("guidance", 3.5), frames=job.get("frames", 1),
                             **WORKLOADS[workload])


def _busy_cpu_seconds():
    """CPU seconds every process of the machine has used so far (Linux /proc/stat), else None."""
    try:
        f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Contention:
    """Measures how many cores *other* processes use (machine CPU time minus ours), waits for a
    quiet machine before timed jobs, and tells which jobs ran on a contended machine. On a
    shared 2-core box one busy neighbour halves a rank's speed, so a median over contended
    jobs would measure the neighbour, not the engine."""

    def __init__(self, threshold: float, max_wait: float, log):
        self.threshold = threshold  # foreign cores tolerated during a timed job
        self.budget = max_wait  # total seconds this bench may spend waiting
        self.waited = 0.0
        self.log = log

    @property
    def exhausted(self) -> bool:
        return self.waited >= self.budget

    def _ours(self, pids) -> float:
        t = os.times()
        return sum(cpu_seconds(p) or 0.0 for p in pids) + t.user + t.system

    def sample(self, pids):
        return time.perf_counter(), _busy_cpu_seconds(), self._ours(pids)

    def foreign(self, before, pids):
        """Cores used by other processes since `before` (a `sample`)."""
        t1, busy1, ours1 = self.sample(pids)
        t0, busy0, ours0 = before
        if busy0 is None or busy1 is None or t1 <= t0:
            return None
        return max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / (t1 - t0))

    def wait_quiet(self, pids, window: float = 0.5) -> None:
        """Return once other processes used at most `threshold` cores over `window` seconds,
        or when the wait budget is spent (only time spent on a busy machine counts)."""
        while not self.exhausted:
            s = self.sample(pids)
            time.sleep(window)
            f = self.foreign(s, pids)
            if f is None or f <= self.threshold:
                return
            self.waited += window + 2.0
            if self.exhausted:
                self.log(f"    machine still busy ({f:.2f} cores used by other processes); "
                         f"the wait budget is spent, measuring anyway")
                return
            time.sleep(2.0)


_HELPER = r"""
import sys, time
import torch
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
for _ in range(3):
    a @ b
print("ready", flush=True)
for line in sys.stdin:
    seconds = float(line)
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < seconds:
        a @ b
        n += 1
    print(2 * 1024 ** 3 * n / (time.perf_counter() - t) / 1e9, flush=True)
"""


class Ceiling:
    """What two cores give this machine right now: GFLOP/s of a 1-thread 1024^3 fp32 matmul
    loop alone, and of two such loops in two processes at once. Their ratio is the best
    speed-up any 2-process x 1-thread split of compute-bound work can reach at that moment.
    On a virtual machine it is not a constant (vCPUs that share a physical core, neighbours
    on the host): it has been seen anywhere from ~1.3x to ~1.9x here, so it is sampled in
    every round, next to the jobs it explains."""

    def __init__(self, seconds: float):
        import subprocess

        self.seconds = seconds
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs = [subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env)
                      for _ in range(2)]
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("the matmul helper of the bench did not start")
        self.samples: list = []

    def pids(self) -> list:
        return [p.pid for p in self.procs]

    def _go(self, procs) -> list:
        for p in procs:
            p.stdin.write(f"{self.seconds}\n")
            p.stdin.flush()
        return [float(p.stdout.readline()) for p in procs]

    def sample(self, quiet: "Contention", all_pids: list, log) -> dict:
        quiet.wait_quiet(all_pids)
        before = quiet.sample(all_pids)
        alone = self._go(self.procs[:1])[0]
        pair = self._go(self.procs)
        foreign = quiet.foreign(before, all_pids)
        rec = {"alone_gflops": alone, "pair_gflops": pair, "ratio": sum(pair) / alone,
               "foreign_cores": foreign,
               "contended": foreign is not None and foreign > quiet.threshold}
        self.samples.append(rec)
        log(f"  {'ceiling':12s} 1 core {alone:.0f} GFLOP/s, 2 cores {sum(pair):.0f} GFLOP/s "
            f"-> {rec['ratio']:.2f}x" + (" (contended)" if rec["contended"] else ""))
        return rec

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


class NoCeiling:
    """Stands in for Ceiling where it is not wanted (--quick): no helper processes, no
    samples."""

    def pids(self) -> list:
        return []

    def sample(self, quiet, all_pids, log) -> dict:
        return {"ratio": None, "contended": False, "skipped": True}

    def close(self) -> None:
        pass


class Entry:
    """One measured configuration: a run name, its pool, its ParallelConfig and workload."""

    def __init__(self, name: str, pool, config: ParallelConfig, workload: str, threads: int):
        self.name, self.pool, self.config, self.workload = name, pool, config, workload
        self.threads = threads
        self.jobs: list = []

    def clean(self) -> int:
        return sum(not j["contended"] for j in self.jobs)


def _job(entry: Entry, job: dict, quiet: Contention, all_pids: list, log, rnd: int) -> dict:
    pool = entry.pool
    if pool.config != entry.config:
        pool.reconfigure(entry.config)  # same world size: the workers stay warm
    req = request(entry.workload, job)
    pids = pool.worker_pids()
    others = [p for p in all_pids if p not in pids]  # idle pools of this bench
    quiet.wait_quiet(all_pids)
    cpu0 = [cpu_seconds(p) for p in pids]
    idle0 = sum(cpu_seconds(p) or 0.0 for p in others)
    before = quiet.sample(all_pids)
    res = pool.generate(req)
    foreign = quiet.foreign(before, all_pids)
    cpu1 = [cpu_seconds(p) for p in pids]
    idle1 = sum(cpu_seconds(p) or 0.0 for p in others)
    wall = res.timings["job_s"]
    # CPU seconds each worker got per wall second of the job (text encoding on rank 0
    # included): near 1.0 per 1-thread rank when it never waits
    share = [None if a is None or b is None else (b - a) / wall for a, b in zip(cpu0, cpu1)]
    contended = foreign is not None and foreign > quiet.threshold
    rec = {"round": rnd, "job_s": wall, "denoise_s": [s["denoise_s"] for s in res.stats],
           "cpu_share": share, "foreign_cores": foreign, "idle_pool_cores": (idle1 - idle0) / wall,
           "contended": contended, "comm": meter_stats(res.stats)}
    d = max(rec["denoise_s"])
    log(f"  {entry.name:12s} job {len(entry.jobs) + 1}: {d / job['steps']:.3f} s/step, other "
        f"processes {'?' if foreign is None else f'{foreign:.2f}'} cores"
        + (" -> contended, not counted" if contended else ""))
    return rec


def measure_interleaved(entries: list, job: dict, warmup: int, repeats: int, max_attempts: int,
                        quiet: Contention, ceiling: Ceiling, log) -> list:
    """Warm every entry up, then time them round-robin (one job of each in turn, plus one
    ceiling sample per round) until each has `repeats` jobs on a quiet machine or
    `max_attempts` jobs. Interleaving spreads slow drifts of the machine (neighbours, clock,
    memory) evenly over the configurations compared, instead of charging them all to
    whichever ran last. Jobs never overlap. Returns this section's ceiling samples."""
    all_pids = list(ceiling.pids())
    for e in entries:
        log(f"  {e.name}: warming up ({e.config.describe()}, {e.threads} thread(s)/rank, "
            f"workload {e.workload})")
        if e.pool.config != e.config:
            e.pool.reconfigure(e.config)
        for _ in range(warmup):
            e.pool.generate(request(e.workload, job))
        all_pids += [p for p in e.pool.worker_pids() if p not in all_pids]
    samples = []
    rnd = 0
    while True:
        # once the wait budget is spent, re-running contended jobs cannot help: stop at repeats
        cap = repeats if quiet.exhausted else max_attempts
        todo = [e for e in entries if e.clean() < repeats and len(e.jobs) < cap]
        if not todo:
            return samples
        samples.append(dict(ceiling.sample(quiet, all_pids, log), round=rnd))
        for e in todo:
            e.jobs.append(_job(e, job, quiet, all_pids, log, rnd))
        rnd += 1


def summarize_entry(e: Entry, job: dict) -> dict:
    clean = [j for j in e.jobs if not j["contended"]]
    used = clean or e.jobs
    per_step = [max(j["denoise_s"]) / job["steps"] for j in used]
    shares = [x for j in used for x in j["cpu_share"] if x is not None]
    steps = job["steps"]
    comm_per_step = [{k: v / steps for k, v in c["bytes"].items()} for c in e.jobs[-1]["comm"]]
    req = request(e.workload, job)
    return {"name": e.name, "config": e.config.describe(), "ranks": e.config.ranks,
            "threads_per_rank": e.threads, "workload": e.workload, "batch": len(req.prompt),
            "cfg": req.cfg, "step_s_median": statistics.median(per_step),
            "step_s_min": min(per_step), "step_s_all": per_step, "timed_jobs_used": len(used),
            "contended": not clean, "cpu_share_min": min(shares) if shares else None,
            "foreign_cores_max": max((j["foreign_cores"] for j in used
                                      if j["foreign_cores"] is not None), default=None),
            "idle_pool_cores_max": max(j["idle_pool_cores"] for j in used),
            "jobs": e.jobs, "comm_bytes_per_step": comm_per_step}


def paired(base: dict, r: dict, steps: int) -> list:
    """base/r time per step of the jobs that ran in the same round, both uncontended."""
    b = {j["round"]: max(j["denoise_s"]) for j in base["jobs"] if not j["contended"]}
    return [b[j["round"]] / max(j["denoise_s"]) for j in r["jobs"]
            if not j["contended"] and j["round"] in b]

