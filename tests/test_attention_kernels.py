"""Attention kernels and sequence-parallel attention (workers/parallel/attention.py).

* Selection rules per (device, dtype, backend, ring degree), with CUDA capabilities, the
  flash-attn package and the probes faked, so every rule is checked without a GPU; an
  explicit backend that cannot run gives one clear error.
* The probe itself (on CPU): it accepts a kernel whose LSE merges exactly and rejects one
  with yunchang TORCH_MATH's zero LSE.
* Multi-process (gloo, 2 and 4 ranks, forked from one launcher): the packed Ulysses
  all-to-all equals three separate ones; Ulysses, Ring and the hybrid equal full attention
  on uneven, padded shards (FLUX and SD3 stream orders); the plain kernel runs without Ring
  and the LSE kernel with it (call counters); the negative controls (padded keys kept, zero
  LSE) are caught.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.parallel import attention as A  # noqa: E402
from workers.parallel.sequence_parallel import SequencePlan  # noqa: E402
import gloo_worlds  # noqa: E402
from workers.streams import Attention, text_image  # noqa: E402


# -- selection rules with a faked GPU ------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(cap=(9, 0), flash=None | 2 | 3, broken=()) fakes the device: its compute
    capability, the installed flash-attn, and which kernels fail their probe."""
    def make(cap=(9, 0), flash=None, broken=()):
        monkeypatch.setattr(A, "_cuda_capability", lambda: cap)
        monkeypatch.setattr(A, "_flash_attn_module",
                            lambda: None if flash is None else (flash, lambda *a, **k: None))
        probed = []

        def probe(kernel, device_type, dtype, head_dim):
            probed.append(kernel.name)
            return "it crashed" if kernel.name in broken else None
        monkeypatch.setattr(A, "_probe", probe)
        return probed
    return make


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

RULES = [  # (backend, dtype, ring, capability, flash-attn, broken probes) -> kernel
    ("auto", BF16, 1, (9, 0), None, (), "sdpa"),
    ("auto", BF16, 2, (9, 0), None, (), "cudnn-lse"),
    ("auto", FP16, 4, (8, 0), 2, (), "cudnn-lse"),  # flash-attn only when asked for
    ("auto", BF16, 2, (9, 0), None, ("cudnn-lse",), "torch-flash-lse"),
    ("auto", BF16, 2, (9, 0), None, ("cudnn-lse", "torch-flash-lse"), "efficient-lse"),
    ("auto", BF16, 2, (7, 5), None, (), "efficient-lse"),  # Turing: no cuDNN / flash
    ("auto", FP32, 2, (9, 0), None, (), "efficient-lse"),  # cuDNN and flash: half only
    ("auto", FP32, 1, (9, 0), None, (), "sdpa"),
    ("torch", BF16, 1, (9, 0), None, (), "sdpa"),
    ("torch", BF16, 2, (9, 0), None, (), "efficient-lse"),
    ("cudnn", BF16, 1, (9, 0), None, (), "cudnn"),
    ("cudnn", BF16, 2, (9, 0), None, (), "cudnn-lse"),
    ("efficient", FP32, 1, (7, 0), None, (), "efficient"),
    ("efficient", FP32, 2, (7, 0), None, (), "efficient-lse"),
    ("flash", BF16, 2, (9, 0), 3, (), "flash-attn3-lse"),
    ("flash", BF16, 1, (9, 0), 3, (), "flash-attn3"),
    ("flash", FP16, 2, (8, 6), 2, (), "flash-attn2-lse"),
]


@pytest.mark.parametrize("backend,dtype,ring,cap,flash,broken,want", RULES)
def test_selection_rules_on_a_faked_gpu(fake_gpu, backend, dtype, ring, cap, flash, broken,
                                        want):
    probed = fake_gpu(cap, flash, broken)
    kernel = A.select_kernel(backend, "cuda", dtype, ring)
    assert kernel.name == want
    assert kernel.lse == (ring > 1)
    if want != "sdpa":  # every kernel but torch's own SDPA is probed before use
        assert want in probed


REFUSED = [  # (backend, dtype, ring, capability, flash-attn, broken) -> words of the error
    ("cudnn", FP32, 2, (9, 0), None, (), "bf16/fp16 only"),
    ("cudnn", BF16, 2, (7, 5), None, (), "compute capability 8.0"),
    ("cudnn", BF16, 1, (9, 0), None, ("cudnn",), "failed its probe: it crashed"),
    ("flash", BF16, 2, (9, 0), None, (), "flash-attn package is not installed"),
    ("flash", FP32, 2, (9, 0), 2, (), "bf16/fp16 only"),
    ("flash", BF16, 2, (8, 0), 3, (), "Hopper"),
    ("flash", BF16, 2, (7, 5), 2, (), "compute capability 8.0"),
    ("efficient", BF16, 2, (9, 0), None, ("efficient-lse",), "failed its probe"),
]


@pytest.mark.parametrize("backend,dtype,ring,cap,flash,broken,words", REFUSED)
def test_an_explicit_backend_that_cannot_run_is_refused_clearly(fake_gpu, backend, dtype,
                                                                ring, cap, flash, broken,
                                                                words):
    fake_gpu(cap, flash, broken)
    with pytest.raises(A.AttentionBackendError) as e:
        A.select_kernel(backend, "cuda", dtype, ring)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"attention {backend!r} cannot run here" in msg  # what is wrong
    assert words in msg
    assert "use 'auto'" in msg  # what would be right


def test_check_backend_reports_both_methods_and_refuses_at_pool_start(fake_gpu):
    fake_gpu((9, 0))
    assert A.check_backend("auto", "cuda", BF16) == {
        "backend": "auto", "no_ring": "sdpa", "ring": "cudnn-lse"}
    assert A.check_backend("auto", "cpu", FP32) == {
        "backend": "auto", "no_ring": "sdpa", "ring": "cpu-flash-lse"}
    with pytest.raises(A.AttentionBackendError, match="not installed"):
        A.check_backend("flash", "cuda", BF16)
    for backend in ("cudnn", "flash", "efficient"):
        with pytest.raises(A.AttentionBackendError, match="CUDA kernel .* runs on cpu"):
            A.check_backend(backend, "cpu", FP32)
    with pytest.raises(A.AttentionBackendError, match="not one of auto, cudnn"):
        A.check_backend("math", "cpu", FP32)


def test_backend_names_match_the_host_options():
    from comfyui_xdit.planning.config import ATTENTION_BACKENDS
    assert tuple(A.BACKENDS) == tuple(ATTENTION_BACKENDS)


def test_kernel_choice_resolves_once_per_dtype_and_head_dim(fake_gpu, monkeypatch):
    calls = []
    real = A.select_kernel

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(A, "select_kernel", counting)
    choice = A.KernelChoice("auto", "cpu", ring=2)
    q = torch.zeros(1, 4, 2, 8)
    for _ in range(5):
        assert choice(q) is A.CPU_FLASH
    choice(q.double())
    assert len(calls) == 2 and choice.name == "cpu-flash-lse"


# -- the probe, for real, on CPU --------------------------------------------------------------
def test_probe_accepts_an_exact_lse_kernel_and_rejects_a_zero_lse():
    dev = torch.device("cpu")
    assert A._run_probe(A.CPU_FLASH, dev, FP32, 16) is None
    assert A._run_probe(A.SDPA, dev, FP32, 16) is None
    assert A._run_probe(A.CPU_FLASH, dev, BF16, 16) is None

    def zero_lse(q, k, v, scale):  # yunchang TORCH_MATH's failure mode
        out, lse = A._cpu_flash(q, k, v, scale)
        return out, torch.zeros_like(lse)
    why = A._run_probe(A.Kernel("zero", True, zero_lse), dev, FP32, 16)
    assert why is not None and "differs from full attention" in why

    def padded_lse(q, k, v, scale):  # an unnormalised LSE layout is caught by shape
        out, lse = A._cpu_flash(q, k, v, scale)
        return out, torch.nn.functional.pad(lse, (0, 3))
    assert "shape" in A._run_probe(A.Kernel("pad", True, padded_lse), dev, FP32, 16)

    def crash(q, k, v, scale):
        raise RuntimeError("no kernel image\nmore")
    assert A._run_probe(A.Kernel("c", True, crash), dev, FP32, 16) == \
        "RuntimeError: no kernel image"


def test_lse_layouts_are_normalised():
    q = torch.zeros(2, 5, 3, 8)  # [B,S,H,D]
    assert A._lse_bhs(torch.zeros(2, 3, 32), q).shape == (2, 3, 5)  # efficient: S padded
    assert A._lse_bhs(torch.zeros(2, 3, 5, 1), q).shape == (2, 3, 5)  # trailing unit dim


def test_padded_plan_pads_each_stream_to_its_longest():
    full = torch.arange(9).view(1, 9, 1).float()
    for r, want in ((0, [0, 1, 2, 3, 4]), (1, [5, 6, 7, 8, 0])):
        plan = SequencePlan(r, 2, {"text": 3, "image": 9}, padded=True)
        assert plan.local_len("image") == 5 and plan.local_len("text") == 2
        assert plan.shard(full, 1, "image").flatten().tolist() == want
    plain = SequencePlan(1, 2, {"text": 3, "image": 9})
    assert plain.shard(full, 1, "image").shape[1] == 4


# -- multi-process ---------------------------------------------------------------------------
TEXT, IMAGE, HEADS, DIM = 5, 11, 4, 8  # uneven over 2 and 4 ranks
STREAM_ORDERS = (("text", "image"), ("image", "text"), ("image",))
# the text + image streams, each order above declared as one attention
ALL_ORDERS = text_image(attentions=tuple(Attention(s) for s in STREAM_ORDERS))


def _full_attention(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)


def _local(x, plan, streams, sp_rank):
    """This rank's (padded) tokens of a full [B, S, H, D] tensor, streams concatenated."""
    parts, at = [], 0
    for s in streams:
        n = plan.full_len(s)
        parts.append(plan.shard(x[:, at:at + n], 1, s))
        at += n
    return torch.cat(parts, dim=1)


def _real_rows(plan, streams):
    """Rows of the local output that are real tokens (the padded plan's layout)."""
    rows, at = [], 0
    for s in streams:
        n = plan.sizes(s)[plan.sp_rank]
        rows += list(range(at, at + n))
        at += plan.local_len(s)
    return torch.tensor(rows)


def _attention_cases(rank, world, ulysses, ring, report):
    import torch.distributed as dist

    from workers.parallel.attention import CALLS, ShardedAttention, ulysses_out, ulysses_qkv
    from workers.parallel.topology import build_topology

    topo = build_topology(rank, world, 1, 1, 1, ulysses, ring)
    name = f"u{ulysses}r{ring}"
    if ulysses > 1:  # packed all-to-all vs three separate ones (yunchang's) and vs a gather
        from yunchang.comm.all_to_all import SeqAllToAll4D
        g = topo.group("ulysses")
        gen = torch.Generator().manual_seed(100 + rank)
        q, k, v = (torch.randn(2, 3, HEADS, DIM, generator=gen) for _ in range(3))
        packed = ulysses_qkv(q, k, v, g, ulysses)
        separate = [SeqAllToAll4D.apply(g, t.contiguous(), 2, 1, False) for t in (q, k, v)]
        gathered = [torch.empty_like(q) for _ in range(ulysses)]
        dist.all_gather(gathered, q, group=g)
        h = HEADS // ulysses
        ui = topo.index("ulysses")
        report[f"{name}/a2a_vs_separate"] = max(
            float((a - b).abs().max()) for a, b in zip(packed, separate))
        report[f"{name}/a2a_vs_gather"] = float(
            (packed[0] - torch.cat(gathered, 1)[:, :, ui * h:(ui + 1) * h]).abs().max())
        report[f"{name}/a2a_round_trip"] = float((ulysses_out(packed[1], g, ulysses) - k)
                                                 .abs().max())
    gen = torch.Generator().manual_seed(7)
    for fault in ("", "keep_padding", "lse_zero"):
        attn = ShardedAttention(topo, "cpu", fault=fault)
        for streams in STREAM_ORDERS:
            total = sum({"text": TEXT, "image": IMAGE}[s] for s in streams)
            q, k, v = (torch.randn(2, total, HEADS, DIM, generator=gen) for _ in range(3))
            ref = _full_attention(q, k, v)
            for padded in (True, False):
                plan = SequencePlan(topo.sp_rank, topo.sp, {"text": TEXT, "image": IMAGE},
                                    padded=padded, layout=ALL_ORDERS)
                before = dict(CALLS)
                if padded:
                    ql, kl, vl = (_local(t, plan, streams, topo.sp_rank) for t in (q, k, v))
                    out = attn(ql, kl, vl, plan, streams)[:, _real_rows(plan, streams)]
                else:
                    pos = plan.positions(streams)
                    out = attn(q[:, pos], k[:, pos], v[:, pos], plan, streams)
                want = ref[:, plan.positions(streams)]
                key = f"{name}/{fault or 'exact'}/{'+'.join(streams)}/" \
                      f"{'padded' if padded else 'unpadded'}"
                report[key] = {
                    "diff": float((out - want).abs().max()),
                    "calls": {n: CALLS[n] - before.get(n, 0) for n in CALLS
                              if CALLS[n] != before.get(n, 0)}}


WORLDS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gloo_worlds.reports(__file__, tmp_path_factory.mktemp("attn"), WORLDS)


def _cases(reports, prefix):
    got = [(rank, key, val) for world in reports for rank, rep in enumerate(reports[world])
           for key, val in rep.items() if key.startswith(prefix)]
    assert got, prefix
    return got


def test_packed_all_to_all_equals_three_separate_ones(reports):
    for rank, key, val in _cases(reports, "u"):
        if "/a2a_" in key:
            assert val == 0.0, (rank, key, val)
    assert len([1 for _, key, _ in _cases(reports, "u") if "/a2a_" in key]) == 3 * (2 + 4 + 4)


@pytest.mark.parametrize("layout", ["u2r1", "u1r2", "u2r2", "u4r1"])
def test_sharded_attention_is_exact_on_uneven_shards(reports, layout):
    cases = [(r, k, v) for r, k, v in _cases(reports, f"{layout}/exact/")]
    assert len(cases) == len(STREAM_ORDERS) * 2 * (2 if layout in ("u2r1", "u1r2") else 4)
    for rank, key, val in cases:
        assert val["diff"] < 1e-5, (rank, key, val)


@pytest.mark.parametrize("layout,kernel,per_call", [
    ("u2r1", "sdpa", 1), ("u4r1", "sdpa", 1),  # no Ring: plain SDPA, one call
    ("u1r2", "cpu-flash-lse", 2), ("u2r2", "cpu-flash-lse", 2),  # Ring: LSE kernel per block
])
def test_plain_kernel_without_ring_and_lse_kernel_with_it(reports, layout, kernel, per_call):
    for rank, key, val in _cases(reports, f"{layout}/exact/"):
        assert val["calls"] == {kernel: per_call}, (rank, key, val)


@pytest.mark.parametrize("layout,fault", [
    ("u2r1", "keep_padding"), ("u1r2", "keep_padding"), ("u2r2", "keep_padding"),
    ("u1r2", "lse_zero"), ("u2r2", "lse_zero"),
])
def test_negative_controls_are_caught(reports, layout, fault):
    """The exactness checks above can fail: padded keys kept, or a zero LSE in the ring
    merge, give errors far above their tolerance."""
    worst = max(val["diff"] for _, _, val in _cases(reports, f"{layout}/{fault}/"))
    assert worst > 1e-2, (layout, fault, worst)


def test_pool_status_names_the_kernels(pools):
    """The worker keeps the kernels chosen at pool start and shows the current topology's
    kernel in status (what the bench and the status node print)."""
    from comfyui_xdit import GenerationRequest, ParallelConfig
    pool = pools("flux", 2)
    req = GenerationRequest(prompt=["a"], steps=1, height=64, width=48,
                            max_sequence_length=5, cfg=1.0)
    for config, current in ((ParallelConfig(ring=2), "cpu-flash-lse"),
                            (ParallelConfig(ulysses=2), "sdpa")):
        pool.reconfigure(config)
        pool.generate(req)
        assert pool.status()["attention"] == {"backend": "auto", "no_ring": "sdpa",
                                              "ring": "cpu-flash-lse", "current": current}


if __name__ == "__main__" and sys.argv[1:2] == ["launch"]:
    gloo_worlds.launch(sys.argv[2], WORLDS, _attention_cases)
