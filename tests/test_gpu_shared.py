"""The GPU suite's GPU-only checks, on FLUX's tiny model (the family sweep,
tests/test_gpu_families.py, runs every method of every family against the CPU pools).

Skipped without CUDA. One command runs it with the family sweep and the engine figures
(`bash benchmarks/gpu_suite.sh`, docs/testing.md). On 2 CUDA ranks sharing one GPU (over
gloo: NCCL refuses two ranks on one device), fp32 with TF32 off: patch-parallel VAE decode
equals one rank's, and the shared-GPU hook turns the plane check on
(workers/parallel/topology.py), so a CPU tensor on the data plane fails here as NCCL would
fail it; the negative control puts one there on purpose. On one rank, bf16: fp8 compute
(`_scaled_mm`, counted) close to bf16, and `compile`'s CUDA graphs captured once and
replayed. The attention kernels this GPU runs: the LSE kernels' halves merge into full
attention, `auto`'s choice equals diffusers' attention, and their times at FLUX.1 size.
Figures are printed for the record: `pytest -s tests/test_gpu_shared.py`. The pools the
tests share launch together at module start (WARM), not one after another.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, PoolError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHARED = "xdit_testhooks.shared_gpu:install"
NO_TF32 = "xdit_testhooks.probes:no_tf32"
SCALED_MM = "xdit_testhooks.probes:count_scaled_mm"
TOL = 1e-4
# gpu_pools(...) arguments of the pools launched (a one-step job each) at module start;
# not the compile pool (its first job must capture) nor the faulty one (its job fails)
WARM = [
    dict(arch="flux", world=1),
    dict(arch="flux", world=2),
    dict(arch="flux", world=1, dtype="bf16"),
    dict(arch="flux", world=1, dtype="bf16", weights="fp8", hooks=(SCALED_MM,)),
]


def _req(arch, **kw):
    base = dict(prompt=["a red fox", "a blue bird", "a cat"], seed=5, steps=3, height=80,
                width=48, max_sequence_length=7, cfg=3.0 if arch == "sd3" else 2.0,
                negative_prompt="blurry")
    base.update(kw)
    return GenerationRequest(**base)


def _maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _psnr(a, b) -> float:
    a, b = a.float(), b.float()
    mse = float(((a - b) ** 2).mean())
    peak = float(b.abs().max())
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


@pytest.fixture(scope="module")
def gpu_pools(model_dir):
    from comfyui_xdit import WorkerPool
    made, warm = {}, {}

    def get(arch, world, config=None, dtype="fp32", hooks=(), **options):
        key = (arch, world, None if config is None else config.launch_key(), dtype,
               tuple(hooks), tuple(sorted(options.items())))
        if key not in made:
            if config is None:
                config = ParallelConfig(ulysses=world) if world > 1 else ParallelConfig()
            made[key] = WorkerPool(model_dir(arch), config, device="cuda", dtype=dtype,
                                   gpus=["0"] * world,
                                   worker_hooks=[NO_TF32, *hooks]
                                   + ([SHARED] if world > 1 else []), **options)
        if key in warm:
            warm.pop(key).result()  # launched (or its failure raised here)
        return made[key]

    with ThreadPoolExecutor(len(WARM)) as ex:
        # the fp8 test's sizes (_scaled_mm wants aligned shapes), one step
        first = _req("flux", prompt=["warm"], steps=1, cfg=1.0, height=256, width=256,
                     max_sequence_length=16)
        for spec in WARM:
            pool = get(**spec)
            key = next(k for k, p in made.items() if p is pool)
            warm[key] = ex.submit(pool.generate, first)
        yield get
    for p in made.values():
        p.close()


def test_patch_parallel_decode_matches_one_rank(gpu_pools):
    req = _req("flux", output="image")
    img1 = gpu_pools("flux", 1).generate(req).images
    pool = gpu_pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    img2 = pool.generate(req).images
    d = _maxdiff(img1, img2)
    print(f"image output: max abs pixel difference 2 ranks vs 1: {d:.2e}")
    assert d <= TOL


def test_a_cpu_tensor_on_the_data_plane_is_reported(gpu_pools):
    """Negative control: the plane check (on in the shared-GPU mode) names the operation,
    the plane and the tensor's device, as NCCL would fail (less kindly) on real GPUs."""
    pool = gpu_pools("flux", 2, ParallelConfig(cfg_parallel=True),
                     hooks=("xdit_testhooks.faults:cpu_on_data_plane",))
    with pytest.raises(PoolError) as e:
        pool.generate(_req("flux"))
    msg = str(e.value)
    print(f"reported: {msg[:300]}")
    assert "all_gather" in msg and "data plane" in msg and "cpu" in msg, msg


def test_fp8_compute_on_one_rank(gpu_pools):
    req = _req("flux", cfg=1.0, height=256, width=256, max_sequence_length=16)
    bf16 = gpu_pools("flux", 1, dtype="bf16").generate(req).samples
    pool = gpu_pools("flux", 1, dtype="bf16", weights="fp8", hooks=(SCALED_MM,))
    res = pool.generate(req)
    calls = res.stats[0]["hooks"][SCALED_MM]["scaled_mm"]
    psnr = _psnr(res.samples, bf16)
    print(f"fp8 compute: {calls} scaled_mm calls, PSNR vs bf16 {psnr:.1f} dB; "
          f"{pool.status().get('fp8_compute')}")
    assert calls > 0 and psnr > 30


def test_cuda_graphs_on_one_rank(gpu_pools):
    req = _req("flux", cfg=1.0, prompt=["a red fox"], height=256, width=256,
               max_sequence_length=16, steps=4)
    eager = gpu_pools("flux", 1, dtype="bf16").generate(req).samples
    pool = gpu_pools("flux", 1, dtype="bf16", compile=True)
    first = pool.generate(req)
    again = pool.generate(req)
    c1, c2 = first.stats[0]["compile"], again.stats[0]["compile"]
    print(f"CUDA graphs: first job {c1}, second job {c2}; rel vs eager "
          f"{float((again.samples - eager).norm() / eager.norm()):.2e}")
    assert c1["cuda_graphs"] and c1["graph_records"] > 0
    assert c2["graph_records"] == 0 and c2["compiles"] == 0  # replayed, nothing re-captured
    assert torch.equal(first.samples, again.samples)
    assert float((again.samples - eager).norm() / eager.norm()) < 2e-2


# -- attention kernels (workers/parallel/attention.py) on this GPU --------------------------------------
def _kernel_inputs(heads=4, seq=1031, head_dim=128, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, seq, heads, head_dim, generator=gen).to("cuda", dtype)
            for _ in range(3)]  # [B, S, H, D], an odd length on purpose


def _lse_kernels(dtype):
    """Every LSE kernel this GPU runs for `dtype` (by its explicit backend), plus the one
    `auto` picks for Ring."""
    from workers.parallel import attention as A
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

    from workers.parallel import attention as A
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
