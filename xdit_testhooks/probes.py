"""Worker hooks that let tests observe a worker from outside: files it opens, a launch held
open. (Kept out of tests/ so a worker never imports a test module.)"""
from __future__ import annotations

import os
import time

GATE_ENV = "XDIT_TEST_LAUNCH_GATE"


def count_safetensors_reads(ctx):
    """Worker hook: count every safetensors file this rank opens (safetensors' `safe_open`,
    which `safetensors.torch.load_file` and so diffusers' `from_pretrained` go through), by
    real path; each job's stats carry the counts so far."""
    import safetensors
    import safetensors.torch

    real = safetensors.safe_open
    reads: dict = {}

    def counting_safe_open(filename, *args, **kwargs):
        key = os.path.realpath(os.fspath(filename))
        reads[key] = reads.get(key, 0) + 1
        return real(filename, *args, **kwargs)

    safetensors.safe_open = counting_safe_open
    safetensors.torch.safe_open = counting_safe_open

    class Reads:
        def job_stats(self):
            return dict(reads)

    return Reads()


def hold_launch(ctx):
    """Worker hook (runs in each worker before its process group and model load): say so
    in `<gate>.rank<N>`, then wait until the file named by $XDIT_TEST_LAUNCH_GATE exists, so
    the pool stays in its launch for as long as the test needs to look at it."""
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    with open(f"{gate}.rank{ctx.rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{gate}.rank{ctx.rank}.tmp", f"{gate}.rank{ctx.rank}")
    deadline = time.monotonic() + 300
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)


def measure_sharding(ctx):
    """Worker hook: weight sharding's forwards, residency peaks and all-gather bytes in each
    job's sharding counts (xdit_testhooks/sharding_probe.py; off in production)."""
    from .sharding_probe import ShardingProbe
    ctx.options["sharding_probe"] = ShardingProbe


def attention_calls(ctx):
    """Worker hook: each job's stats carry the attention kernels this rank ran during it
    ({kernel name: calls}, from workers/parallel/attention.py's per-kernel counter): a spy on what
    actually runs, not on what was configured."""
    from workers.parallel import attention

    class Calls:
        def __init__(self):
            self.before = {}

        def job_started(self):
            self.before = dict(attention.CALLS)

        def job_stats(self):
            return {k: n - self.before.get(k, 0) for k, n in attention.CALLS.items()
                    if n != self.before.get(k, 0)}

    return Calls()


def count_scaled_mm(ctx):
    """Worker hook: count this rank's `torch._scaled_mm` calls (the fp8 matmul path of
    workers/loading/weights.py looks it up on torch at call time), so a test sees which path really
    ran rather than reading a setting; each job's stats carry that job's count (the load's
    one probe call is not counted)."""
    import torch

    real = torch._scaled_mm
    calls = {"scaled_mm": 0}

    def counting_scaled_mm(*args, **kwargs):
        calls["scaled_mm"] += 1
        return real(*args, **kwargs)

    torch._scaled_mm = counting_scaled_mm

    class Calls:
        def job_started(self):
            calls["scaled_mm"] = 0

        def job_stats(self):
            return dict(calls)

    return Calls()


def no_tf32(ctx):
    """Worker hook: fp32 means fp32 on the GPU (no TF32 in matmuls or convolutions), so a
    CUDA pool can be held to the CPU oracle's fp32 tolerance."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# module families a worker defers past its first job where it does not need them
# (docs/performance.md "Launch breakdown"): text-encoder models and diffusers pipelines
WATCHED_MODULES = ("transformers.models.", "diffusers.pipelines.")


def modules_at_first_job(ctx):
    """Worker hook: the watched modules (WATCHED_MODULES prefixes) this rank had imported
    when its first job started, in every job's stats (a deferred import shows up only
    after)."""
    import sys

    class Seen:
        first = None

        def job_started(self):
            if self.first is None:
                self.first = sorted(m for m in list(sys.modules)
                                    if m.startswith(WATCHED_MODULES))

        def job_stats(self):
            return {"at_first_job": self.first}

    return Seen()


PROCESS_ENV = ("RANK", "LOCAL_RANK", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
               "CUDA_VISIBLE_DEVICES", "XDIT_TEST_MARK")


def process_facts(ctx):
    """Worker hook: what a rank's process looks like from inside (its environment's launch
    variables, session, standard streams, working folder, argv, main module, torch threads),
    in each job's stats: the same whichever launcher started it (plain process or forked
    from the preloaded helper)."""
    import sys
    import threading

    import torch

    def link(fd):
        try:
            return os.path.realpath(f"/proc/self/fd/{fd}")
        except OSError:
            return None

    class Facts:
        def job_stats(self):
            main = sys.modules.get("__main__")
            return {"env": {k: os.environ.get(k) for k in PROCESS_ENV},
                    "own_session": os.getsid(0) == os.getpid(),
                    "stdin": link(0), "stdout": link(1), "stderr": link(2),
                    "cwd": os.getcwd(), "argv": sys.argv[1:],
                    "main": getattr(getattr(main, "__spec__", None), "name", None),
                    "torch_threads": torch.get_num_threads(),
                    "python_threads": sorted(t.name for t in threading.enumerate())}

    return Facts()
