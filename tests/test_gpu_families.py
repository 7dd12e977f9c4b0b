"""The GPU suite's family sweep: every family of the registry, every exact method, on CUDA
ranks (2 share one GPU over gloo, the shared-GPU hook checking the planes as NCCL would),
each equal to the same family's CPU pool at one rank (<= 1e-4 fp32, TF32 off), which the CPU
suite holds to the family's diffusers pipeline. A family joins by existing
(tests/family_requests.py gives its small request).

The same pools count the operations that would make a step wait on the host
(xdit_testhooks/host_syncs.py; on a GPU it also sees host-to-device copies, which a CPU pool
cannot): steps 2..N flag nothing with previews on (copied non-blocking into pinned memory),
and with the step cache on only its one decision read per transformer call.

Skipped without CUDA. `XDIT_GPU_SUITE_DEVICE=cpu` runs the module on CPU ranks, to check the
suite itself where no GPU is at hand (then the plane check and the copies are not seen).
"""
from __future__ import annotations

import os

import pytest
import torch

from comfyui_xdit import ParallelConfig, WorkerPool
from family_requests import A, B, IDS, small_request

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
PROMPTS = [A, B, "a small red house"]  # three rows: dp 2 splits them unevenly
DECISION_READS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero"}


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


@pytest.fixture(scope="module")
def reference(model_dir):
    """reference(arch, request) -> the CPU pool's LATENT at one rank (one pool at a time)."""
    held = {}

    def run(arch, req):
        if arch not in held:
            for p in held.values():
                p.close()
            held.clear()
            held[arch] = WorkerPool(str(model_dir(arch)), ParallelConfig(), device="cpu",
                                    threads_per_rank=1)
        return held[arch].generate(req).samples
    yield run
    for p in held.values():
        p.close()


@pytest.mark.parametrize("arch", IDS)
def test_every_method_of_every_family(arch, model_dir, reference):
    req = small_request(arch, PROMPTS)
    want = reference(arch, req)
    hooks = [NO_TF32, SYNCS] + ([SHARED] if DEVICE == "cuda" else [])
    gpus = {"gpus": ["0", "0"]} if DEVICE == "cuda" else {"threads_per_rank": 1}
    with WorkerPool(str(model_dir(arch)), ParallelConfig(ulysses=2), device=DEVICE,
                    worker_hooks=hooks, **gpus) as pool:
        for name, config in METHODS.items():
            pool.reconfigure(config)
            res = pool.generate(req)
            d = _maxdiff(res.samples, want)
            print(f"{arch} {name} on {DEVICE}: max abs vs the CPU pool {d:.2e}")
            assert d <= TOL, f"{arch} {name}: {d:.3e}"
            for rank, flagged in enumerate(_flagged_after_first(res.stats)):
                assert flagged == {}, (arch, name, rank, flagged)

        # previews: a low-res x0 every step, copied without waiting (nothing flagged)
        pool.reconfigure(METHODS["ulysses2"])
        events = []
        res = pool.generate(small_request(arch, PROMPTS, preview_every=1),
                            on_event=events.append)
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
