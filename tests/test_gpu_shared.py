"""Shared-GPU mode: 2 CUDA ranks on one GPU over gloo, bf16, every method against 1 rank.

Skipped without CUDA. On a machine with one GPU this is the multi-rank GPU check: NCCL
refuses two ranks on one device, gloo does not, and in this mode the data plane refuses CPU
tensors (so control data sent on it fails here as it would on NCCL). Point-to-point is
staged through the host (gloo has no CUDA send/recv). Figures (max difference vs 1 rank,
time per job) are printed for the record: `pytest -s tests/test_gpu_shared.py`.
"""
from __future__ import annotations

import time

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HOOK = "xdit_testhooks.shared_gpu:install"
CONFIGS = {
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
    "dp2": ParallelConfig(dp=2),
}


def _req(arch, **kw):
    base = dict(prompt=["a red fox", "a blue bird"], seed=5, steps=3, height=128, width=96,
                max_sequence_length=16, cfg=3.0 if arch == "sd3" else 2.0,
                negative_prompt="blurry")
    base.update(kw)
    return GenerationRequest(**base)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def gpu_pools(model_dir):
    from comfyui_xdit import WorkerPool
    made = {}

    def get(arch, world, config=None):
        key = (arch, world, None if config is None else config.launch_key())
        if key not in made:
            if config is None:
                config = ParallelConfig(ulysses=world) if world > 1 else ParallelConfig()
            made[key] = WorkerPool(model_dir(arch), config,
                                   device="cuda", dtype="bf16", gpus=["0"] * world,
                                   worker_hooks=[HOOK] if world > 1 else [])
        return made[key]
    yield get
    for p in made.values():
        p.close()


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_two_ranks_on_one_gpu_match_one_rank(gpu_pools, arch):
    req = _req(arch)
    one = gpu_pools(arch, 1).generate(req).samples
    pool = gpu_pools(arch, 2)
    for name, config in CONFIGS.items():
        pool.reconfigure(config)
        t = time.perf_counter()
        got = pool.generate(req).samples
        dt = time.perf_counter() - t
        rel = _rel(got, one)
        print(f"{arch} {name}: relative L2 vs 1 rank {rel:.2e}, max abs "
              f"{float((got - one).abs().max()):.2e}, job {dt:.2f}s")
        assert got.shape == one.shape
        assert rel < 3e-2, f"{name}: {rel}"


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_pipefusion_and_image_output_on_one_gpu(gpu_pools, arch):
    req = _req(arch, steps=3)
    one = gpu_pools(arch, 1).generate(req).samples
    pf = gpu_pools(arch, 2, ParallelConfig(pipefusion=2, warmup_steps=3))
    got = pf.generate(req).samples
    rel = _rel(got, one)
    print(f"{arch} pipefusion2 (full warmup): relative L2 vs 1 rank {rel:.2e}")
    assert rel < 3e-2
    pf.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=1))
    stale = pf.generate(req).samples
    assert torch.isfinite(stale).all()
    # image output: patch-parallel VAE decode over both ranks vs one rank
    img1 = gpu_pools(arch, 1).generate(_req(arch, output="image")).images
    pool = gpu_pools(arch, 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    img2 = pool.generate(_req(arch, output="image")).images
    diff = float((img1 - img2).abs().max())
    print(f"{arch} image output: max abs pixel difference 2 ranks vs 1: {diff:.3e}")
    assert img1.shape == img2.shape and diff < 5e-2
    dec = pool.decode(one)
    assert dec.shape == img1.shape


# -- attention kernels (workers/attention.py) on this GPU --------------------------------------
def _kernel_inputs(heads=4, seq=1031, head_dim=128, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, seq, heads, head_dim, generator=gen).to("cuda", dtype)
            for _ in range(3)]  # [B, S, H, D], an odd length on purpose


def _lse_kernels(dtype):
    """Every LSE kernel this GPU runs for `dtype` (by its explicit backend), plus the one
    `auto` picks for Ring."""
    from workers import attention as A
    got = {}
    for backend in ("cudnn", "flash", "efficient"):
        try:
            k = A.select_kernel(backend, "cuda", dtype, 2, 128)
        except A.AttentionBackendError as e:
            print(f"{backend}: not available: {e}")
            continue
        got[k.name] = k
    auto = A.select_kernel("auto", "cuda", dtype, 2, 128)
    got[auto.name] = auto
    return got, auto.name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lse_kernels_merge_halves_into_full_attention(dtype):
    """What Ring relies on: each LSE kernel's two uneven key halves, merged by their LSE,
    equal the same kernel over all keys (bf16: ~5e-4 on H100) and fp64 math."""
    import torch.nn.functional as F
    kernels, auto = _lse_kernels(dtype)
    q, k, v = _kernel_inputs(dtype=dtype)
    scale = q.shape[-1] ** -0.5
    ref = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)),
                                         scale=scale).transpose(1, 2)
    tol_full, tol_ref = (1e-5, 1e-4) if dtype == torch.float32 else (4e-3, 2e-2)
    for name, kernel in kernels.items():
        full, lse = kernel(q, k, v, scale)
        assert lse.shape == (1, q.shape[2], q.shape[1]) and lse.dtype == torch.float32, name
        o1, l1 = kernel(q, k[:, :517], v[:, :517], scale)
        o2, l2 = kernel(q, k[:, 517:], v[:, 517:], scale)
        w = torch.sigmoid(l1 - l2).transpose(1, 2).unsqueeze(-1)
        merged = w * o1.float() + (1 - w) * o2.float()
        d_full = float((merged - full.float()).abs().max())
        d_ref = float((merged.double() - ref).abs().max())
        print(f"{name} {dtype}: merged halves vs full {d_full:.2e}, vs fp64 {d_ref:.2e}")
        assert d_full < tol_full and d_ref < tol_ref, name
    if torch.cuda.get_device_capability() >= (8, 0) and dtype != torch.float32:
        assert auto in ("cudnn-lse", "torch-flash-lse"), auto  # not the slow fallback


@pytest.mark.parametrize("ring", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chosen_kernel_matches_diffusers_attention(ring, head_dim):
    """The kernel `auto` picks (plain without Ring, LSE with it) computes what diffusers'
    own attention dispatch computes, in bf16."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from workers import attention as A
    kernel = A.select_kernel("auto", "cuda", torch.bfloat16, ring, head_dim)
    q, k, v = _kernel_inputs(heads=6, head_dim=head_dim)
    out = kernel(q, k, v, head_dim ** -0.5)
    out = out[0] if kernel.lse else out
    ref = dispatch_attention_fn(q, k, v)  # [B, S, H, D] in and out
    d = float((out.float() - ref.float()).abs().max())
    print(f"{kernel.name} (ring {ring}, head dim {head_dim}) vs diffusers: {d:.2e}")
    assert out.shape == ref.shape and d < 2e-2


def test_kernel_times_for_the_record():
    """Per-call time of each LSE kernel at FLUX.1 size, printed only (no timing assertion):
    what `auto` gains over the efficient fallback on this GPU."""
    kernels, auto = _lse_kernels(torch.bfloat16)
    q, k, v = _kernel_inputs(heads=24, seq=4608, head_dim=128)
    for name, kernel in kernels.items():
        for _ in range(3):
            kernel(q, k, v, 128 ** -0.5)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            kernel(q, k, v, 128 ** -0.5)
        stop.record()
        torch.cuda.synchronize()
        print(f"{name}: {start.elapsed_time(stop) / 20:.3f} ms per call"
              + (" (auto)" if name == auto else ""))
    assert auto in kernels
