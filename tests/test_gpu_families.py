"""The GPU suite's family sweep: every family of the registry, every method, on CUDA ranks
(2 share one GPU over gloo, the shared-GPU hook checking the planes as NCCL would), against
the same family's CPU pools (fp32, TF32 off, <= 1e-4), which the CPU suite holds to the
family's diffusers pipeline and PipeFusion's oracle. A family joins by existing
(tests/family_requests.py gives its small request).

Per family, one CUDA pool (reconfigured) runs Ulysses 2, Ring 2, CFG 2 and DP 2 (3 prompts:
dp 2 splits them unevenly) and the xDiT MODEL's call (CFG / Ulysses / Ring), each equal to
the CPU pool at one rank (exact methods). Two more CUDA pools hold what reconfiguring
cannot reach (each would be a relaunch of the first): `shard_weights` runs the same four
methods, and pipelined PipeFusion 2 (each rank holds one stage) equals a CPU pool running
the same PipeFusion config (it is not exact).

The first pool also counts the operations that would make a step wait on the host
(xdit_testhooks/host_syncs.py; on a GPU it also sees host-to-device copies, which a CPU pool
cannot): steps 2..N flag nothing under each method and with previews on (copied
non-blocking into pinned memory), and with the step cache on only its one decision read
per transformer call.

Speed (the suite's 8 minutes, benchmarks/gpu_suite.sh): every selected family's CPU
references start at module start in background threads (1 thread per rank), and the three
CUDA pools of the next families launch while a family is checked (XDIT_GPU_SUITE_AHEAD of them,
default cores // 8); each test waits only for its own.

Skipped without CUDA. `XDIT_GPU_SUITE_DEVICE=cpu` runs the module on CPU ranks, to check the
suite itself where no GPU is at hand (then the plane check and the copies are not seen).
"""
from __future__ import annotations

import os
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from comfyui_xdit import ParallelConfig, WorkerPool
from family_requests import A, B, IDS, families, model_call_inputs, small_request
from conformance.cases import CASES


def runs(arch: str, capability: str) -> bool:
    """The family runs `capability` (not in its builder's CONFORMANCE_EXEMPT)."""
    return capability not in CASES[arch].exempt

DEVICE = os.environ.get("XDIT_GPU_SUITE_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = pytest.mark.skipif(not DEVICE, reason="needs a CUDA GPU "
                                "(XDIT_GPU_SUITE_DEVICE=cpu checks this module on CPU)")

TOL = 1e-4
SYNCS = "xdit_testhooks.host_syncs:install"
NO_TF32 = "xdit_testhooks.probes:no_tf32"
SHARED = "xdit_testhooks.shared_gpu:install"
METHODS = {
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
    "dp2": ParallelConfig(dp=2),
}
MODEL_CALLS = ("cfg2", "ulysses2", "ring2")

PROMPTS = [A, B, "a small red house"]  # three rows: dp 2 splits them unevenly
DECISION_READS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero"}
CORES = os.cpu_count() or 1
REF_THREADS = int(os.environ.get("XDIT_GPU_SUITE_REF_THREADS") or max(1, CORES // 2))
AHEAD = int(os.environ.get("XDIT_GPU_SUITE_AHEAD") or max(1, CORES // 8))


def pipefusion(blocks: int) -> ParallelConfig:
    """Pipelined PipeFusion 2 (warmup 1 of 3 steps, 2 patches), every block but the last on
    the first stage: a split every family runs (Z-Image's test model needs its 4 refiners and
    a main block there, which "balanced" does not give; the CPU suite covers the splits)."""
    return ParallelConfig(pipefusion=2, warmup_steps=1, pipeline_patches=2,
                          pipefusion_split=f"{blocks - 1},1")


def _flagged_after_first(stats) -> list:
    """Per rank: the flagged operations of steps >= 1, merged."""
    out = []
    for st in stats:
        merged = {}
        for key, ops in st["hooks"][SYNCS]["counts"].items():
            kind, _, index = key.partition(":")
            if kind == "job" and index != "None" and int(index) >= 1:
                for op, n in ops.items():
                    merged[op] = merged.get(op, 0) + n
        out.append(merged)
    return out


def _maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _call_model(pool, config: ParallelConfig, arch: str, call: dict):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    return PoolDenoiser(pool, config.with_world_size(config.product), arch)(**call)


def _cpu_exact(arch, folder) -> dict:
    """The CPU pool at one rank: the methods' request and the MODEL's call."""
    with WorkerPool(str(folder), ParallelConfig(), device="cpu", threads_per_rank=1) as pool:
        out = {"samples": pool.generate(small_request(arch, PROMPTS)).samples}
        if runs(arch, "model_call"):
            out["model_call"] = _call_model(pool, ParallelConfig(), arch,
                                            model_call_inputs(arch, folder))
        return out


def _cpu_pipefusion(arch, folder):
    """A CPU pool running `pipefusion` on the same request."""
    with WorkerPool(str(folder), device="cpu", threads_per_rank=1) as pool:
        pool.reconfigure(pipefusion(pool.model_info.blocks))
        return pool.generate(small_request(arch, PROMPTS)).samples


def _pool(folder, hooks: bool = True, **options) -> WorkerPool:
    """A 2-rank pool on DEVICE (TF32 off, the plane check on CUDA); `hooks`: with the
    host-sync counter."""
    hooks = [NO_TF32] + ([SYNCS] if hooks else []) + ([SHARED] if DEVICE == "cuda" else [])
    where = {"gpus": ["0", "0"]} if DEVICE == "cuda" else {"threads_per_rank": 1}
    return WorkerPool(str(folder), METHODS["ulysses2"], device=DEVICE, worker_hooks=hooks,
                      **where, **options)


class Sweep:
    """The selected families' CPU references and warm device pools, started in background
    threads; `pools(arch)` / `reference(arch, part)` wait for one family's."""

    def __init__(self, archs, model_dir):
        self.slots = threading.Semaphore(AHEAD + 1)  # families whose pools are open
        self.stopping = threading.Event()
        self.open: dict = {}
        # built one after another: the builders seed torch's global generator
        folders = {arch: model_dir(arch) for arch in archs}
        self._refs = ThreadPoolExecutor(REF_THREADS, thread_name_prefix="cpu-ref")
        self._warm = ThreadPoolExecutor(AHEAD, thread_name_prefix="warm")
        self.refs = {}
        for arch in archs:
            self.refs[arch, "exact"] = self._refs.submit(_cpu_exact, arch, folders[arch])
            if runs(arch, "pipefusion"):
                self.refs[arch, "pipefusion"] = self._refs.submit(_cpu_pipefusion, arch,
                                                                  folders[arch])
        self.warm = {arch: self._warm.submit(self._launch, arch, folders[arch])
                     for arch in archs}

    def _launch(self, arch, folder):
        while not self.slots.acquire(timeout=1):
            if self.stopping.is_set():
                return None
        made = self.open[arch] = {"plain": _pool(folder),
                                  "sharded": _pool(folder, shard_weights=True)}
        if runs(arch, "pipefusion"):
            made["pipefusion"] = _pool(folder, hooks=False)
            made["pipefusion"].reconfigure(pipefusion(made["plain"].model_info.blocks))
        warm = small_request(arch, [A], steps=1, cfg=1.0)
        with ThreadPoolExecutor(len(made)) as ex:  # launches the ranks (a one-step job)
            list(ex.map(lambda pool: pool.generate(warm), made.values()))
        return made

    def pools(self, arch) -> dict:
        return self.warm[arch].result()

    def reference(self, arch, part):
        return self.refs[arch, part].result()

    def done(self, arch) -> None:
        for pool in self.open.pop(arch, {}).values():
            pool.close()
        self.slots.release()

    def close(self) -> None:
        self.stopping.set()
        self._warm.shutdown(wait=True, cancel_futures=True)
        self._refs.shutdown(wait=True, cancel_futures=True)
        for arch in list(self.open):
            self.done(arch)


@pytest.fixture(scope="module")
def sweep(request, model_dir):
    here = sys.modules[__name__]
    archs = [item.callspec.params["arch"] for item in request.session.items
             if getattr(item, "module", None) is here and hasattr(item, "callspec")]
    s = Sweep(list(dict.fromkeys(archs)), model_dir)
    yield s
    s.close()


@pytest.mark.parametrize("arch", IDS)
def test_every_method_of_every_family(arch, model_dir, sweep):
    try:
        made = sweep.pools(arch)
        with ThreadPoolExecutor(2, thread_name_prefix=f"{arch}-side") as side:
            # the other two pools' jobs run beside the first pool's (the GPU has room)
            sharded = side.submit(_sharded, arch, made["sharded"], sweep)
            piped = side.submit(_pipefusion, arch, made["pipefusion"], sweep) \
                if runs(arch, "pipefusion") else None
            _previews_and_cache(arch, made["plain"])
            _exact_methods(arch, made["plain"], sweep.reference(arch, "exact"))
            if runs(arch, "model_call"):
                _model_calls(arch, made["plain"], sweep.reference(arch, "exact"),
                             model_dir(arch))
            sharded.result()
            if piped is not None:
                piped.result()
    finally:
        sweep.done(arch)


def _exact_methods(arch, pool, exact) -> None:
    """Each method equal to the CPU pool at one rank, with nothing flagged after step 1."""
    for name, config in METHODS.items():
        pool.reconfigure(config)
        res = pool.generate(small_request(arch, PROMPTS))
        d = _maxdiff(res.samples, exact["samples"])
        print(f"{arch} {name} on {DEVICE}: max abs vs the CPU pool {d:.2e}")
        assert d <= TOL, f"{arch} {name}: {d:.3e}"
        for rank, flagged in enumerate(_flagged_after_first(res.stats)):
            assert flagged == {}, (arch, name, rank, flagged)


def _model_calls(arch, pool, exact, folder) -> None:
    """The xDiT MODEL's call under CFG / Ulysses / Ring equal to the CPU pool's at one
    rank; the conditionings swapped change the prediction (not a degenerate pass)."""
    call = model_call_inputs(arch, folder)
    for name in MODEL_CALLS:
        got = _call_model(pool, METHODS[name], arch, call)
        d = _maxdiff(got, exact["model_call"])
        print(f"{arch} MODEL call {name}: max abs vs the CPU pool {d:.2e}")
        assert d <= TOL, f"{arch} MODEL call {name}: {d:.3e}"
    swapped = dict(call, transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()],
                                              "cond_or_uncond": [1, 0]})
    second = families.family(arch).capability(families.SecondTextEncoder)
    for key in ("context", "y", second and second.comfy_input):
        if key in call:
            swapped[key] = call[key].flip(0)
    other = _call_model(pool, METHODS[MODEL_CALLS[-1]], arch, swapped)
    assert _maxdiff(other[:1], got[:1]) > 1e-3, arch


def _sharded(arch, pool, sweep) -> None:
    """`shard_weights`: each method equal to the CPU pool at one rank."""
    exact = sweep.reference(arch, "exact")
    for name, config in METHODS.items():
        pool.reconfigure(config)
        d = _maxdiff(pool.generate(small_request(arch, PROMPTS)).samples, exact["samples"])
        print(f"{arch} sharded {name}: max abs vs the CPU pool {d:.2e}")
        assert d <= TOL, f"{arch} sharded {name}: {d:.3e}"


def _pipefusion(arch, pool, sweep) -> None:
    """Pipelined PipeFusion equal to the CPU pool's of the same config, and not the exact
    run (the stale K/V really used, and reproduced)."""
    got = pool.generate(small_request(arch, PROMPTS)).samples
    want = sweep.reference(arch, "pipefusion")
    d = _maxdiff(got, want)
    d_exact = _maxdiff(got, sweep.reference(arch, "exact")["samples"])
    print(f"{arch} pipelined PipeFusion 2: max abs vs the CPU pool's {d:.2e} "
          f"(vs the exact run {d_exact:.2e})")
    assert d <= TOL, f"{arch} PipeFusion: {d:.3e}"
    assert d_exact > 2 * TOL, arch  # the exact run would fail the check above (SD3: 5e-4)


def _previews_and_cache(arch, pool) -> None:
    """No host waits after step 1 with previews on, and with the step cache only its
    decision reads."""
    # previews: a low-res x0 every step, copied without waiting (nothing flagged)
    pool.reconfigure(METHODS["ulysses2"])
    events = []
    res = pool.generate(small_request(arch, PROMPTS, preview_every=1), on_event=events.append)
    assert any(e.get("preview") is not None for e in events), arch
    for rank, flagged in enumerate(_flagged_after_first(res.stats)):
        assert flagged == {}, (arch, "previews", rank, flagged)

    # the step cache: its decision is one host read per transformer call, nothing else
    # (a threshold no change reaches: every call after the warmup may skip, up to 3)
    cache = {"threshold": 100.0, "warmup": 1, "head": 1, "tail": 0, "max_skips": 3}
    res = pool.generate(small_request(arch, PROMPTS, steps=5, cache=cache))
    assert res.stats[0]["cache"]["skipped"] > 0, (arch, res.stats[0]["cache"])
    for rank, flagged in enumerate(_flagged_after_first(res.stats)):
        assert set(flagged) <= DECISION_READS, (arch, "step cache", rank, flagged)
        calls = 4 * 2  # steps 1..4, a positive and a negative call each (CFG on one rank)
        assert sum(flagged.values()) <= calls, (arch, "step cache", rank, flagged)
