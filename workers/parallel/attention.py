"""Exact attention over token streams sharded across the sequence-parallel ranks: each
attention as the family's token layout declares it (workers/streams.py), joint (the
queries' own streams as keys) or cross (other streams' keys), with replicated streams held
whole (`ShardedAttention.__call__` says how each case runs).

The block kernel is chosen once per pool (device, dtype, backend) and per method: without
Ring (ring degree 1) no log-sum-exp is needed, so plain SDPA (torch picks its best backend);
Ring and the hybrid merge blocks by their log-sum-exp, so they need a kernel that returns it
(cuDNN attention where it runs, torch's flash kernel, efficient attention as the fallback;
flash-attn when asked for; aten's CPU flash kernel on CPU). yunchang's TORCH_MATH returns a
zero LSE, which makes Ring silently wrong: every LSE kernel is probed once against full
attention (two key halves merged) before it is used.

Communication (`ShardedAttention`): Ulysses moves q, k and v in one `all_to_all_single` of a
packed tensor (sequence in, heads out; workers/parallel/ulysses.py) and the output back in one
more; Ring passes K/V with yunchang's ring loop (batched point-to-point, verified under the
NCCL-rules emulation) around our block function.

Uneven shards: the sequence-parallel hooks pad each stream's local shard to the longest once
per forward (`SequencePlan.padded`), so every layer's q/k/v already have equal lengths on all
ranks; the kernels drop the padded keys (index lists built once per shape) and the output
gather drops the padded queries. Full (non-causal, unmasked) attention is invariant to the
order of the keys, so any assignment of tokens to ranks is exact as long as each query sees
every real key exactly once.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from yunchang.ring.ring_flash_attn import ring_flash_attn_forward  # imported once, here

from .key_runs import _Layout, _RingBlock, _valid_runs, check_declared, short_rows  # noqa: F401
from .stream_views import as_view, from_view
from .topology import Topology
from .ulysses import ulysses_out, ulysses_qkv  # noqa: F401  (PipeFusion and tests use them here)
from .uneven import UnevenAttention

BACKENDS = ("auto", "cudnn", "flash", "efficient", "torch")  # = comfyui_xdit.planning.config's list
HALF = (torch.float16, torch.bfloat16)

# kernel name -> calls in this process. Tests read it to see which path ran; one dict
# increment per attention call costs nothing next to the kernel.
CALLS: collections.Counter = collections.Counter()


class AttentionBackendError(ValueError):
    """An explicit attention backend this device/dtype cannot run (raised at pool start)."""


@dataclass(frozen=True)
class Kernel:
    """One attention kernel on [B, S, H, D] tensors. `lse`: returns (out, lse [B,H,S] fp32)
    (what Ring's merge needs); otherwise returns out only."""

    name: str
    lse: bool
    fn: Callable

    def __call__(self, q, k, v, scale):
        if not torch.compiler.is_compiling():  # traced into a compiled block: no side effect
            CALLS[self.name] += 1
        return self.fn(q, k, v, scale)


def _t(x):
    return x.transpose(1, 2)  # [B,S,H,D] <-> [B,H,S,D]; last dim stays contiguous


def _lse_bhs(lse, q):
    """The kernels differ in LSE shape: efficient pads S to a multiple of 32, cuDNN may add a
    trailing unit dim. Normalise to [B, H, S] fp32."""
    if lse.dim() == 4:
        lse = lse[..., 0]
    return lse[..., : q.shape[1]].float()


def _sdpa(q, k, v, scale):
    return _t(F.scaled_dot_product_attention(_t(q), _t(k), _t(v), scale=scale))


def _cpu_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _t(q), _t(k), _t(v), 0.0, False, scale=scale)
    return _t(out), lse


def _cudnn(lse: bool):
    def fn(q, k, v, scale):
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _t(q), _t(k), _t(v), None, lse, 0.0, False, False, scale=scale)
        return (_t(r[0]), _lse_bhs(r[1], q)) if lse else _t(r[0])
    return fn


def _torch_flash(q, k, v, scale):
    r = torch.ops.aten._scaled_dot_product_flash_attention(
        _t(q), _t(k), _t(v), 0.0, False, False, scale=scale)
    return _t(r[0]), _lse_bhs(r[1], q)


def _efficient(lse: bool):
    def fn(q, k, v, scale):
        r = torch.ops.aten._scaled_dot_product_efficient_attention(
            _t(q), _t(k), _t(v), None, lse, 0.0, False, scale=scale)
        return (_t(r[0]), _lse_bhs(r[1], q)) if lse else _t(r[0])
    return fn


def _flash_attn(version: int, func, lse: bool):
    """flash-attn takes [B,S,H,D] directly. v2 returns (out, lse, p) with
    return_attn_probs; v3's return differs between releases, so take what is there (the
    probe checks the LSE before the kernel is used)."""
    def fn(q, k, v, scale):
        if version == 2:
            r = func(q, k, v, softmax_scale=scale, return_attn_probs=lse)
        else:
            r = func(q, k, v, softmax_scale=scale, return_attn_probs=True) if lse \
                else func(q, k, v, softmax_scale=scale)
        if not lse:
            return r[0] if isinstance(r, tuple) else r
        if not isinstance(r, tuple) or len(r) < 2:
            raise RuntimeError("this flash-attn release does not return the log-sum-exp")
        return r[0], _lse_bhs(r[1], q)
    return fn


# -- what this machine has (monkeypatched in the tests to fake any GPU) ------------------
def _cuda_capability() -> tuple:
    return tuple(torch.cuda.get_device_capability())


def _flash_attn_module():
    """(version, flash_attn_func) of the installed flash-attn (3 preferred), else None.
    Called at kernel selection only, never per attention call."""
    try:
        from flash_attn_interface import flash_attn_func  # flash-attn 3 (Hopper)
        return 3, flash_attn_func
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_func
        return 2, flash_attn_func
    except ImportError:
        return None


_PROBED: dict = {}


def _probe(kernel: Kernel, device_type: str, dtype, head_dim: int) -> Optional[str]:
    """None if `kernel` computes full attention on this device (an LSE kernel: two uneven key
    halves merged by their LSE), else why not. One tiny call, cached per process."""
    key = (kernel.name, kernel.lse, device_type, dtype, head_dim)
    if key not in _PROBED:
        _PROBED[key] = _run_probe(kernel, torch.device(device_type), dtype, head_dim)
    return _PROBED[key]


def _run_probe(kernel, device, dtype, head_dim) -> Optional[str]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, head_dim, generator=gen) for _ in range(3))
    scale = head_dim ** -0.5
    ref = _sdpa(q.double(), k.double(), v.double(), scale)
    qd, kd, vd = (t.to(device, dtype) for t in (q, k, v))
    try:
        if kernel.lse:
            o1, l1 = kernel.fn(qd, kd[:, :23], vd[:, :23], scale)
            o2, l2 = kernel.fn(qd, kd[:, 23:], vd[:, 23:], scale)
            if tuple(l1.shape) != (1, 2, 40):
                return f"its log-sum-exp has shape {tuple(l1.shape)}, expected (1, 2, 40)"
            w = torch.sigmoid((l1 - l2).transpose(1, 2).unsqueeze(-1).double())
            out = w * o1.double() + (1 - w) * o2.double()
        else:
            out = kernel.fn(qd, kd, vd, scale).double()
    except Exception as e:  # noqa: BLE001  (the reason is reported, or auto moves on)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    err = float((out.cpu() - ref).abs().max())
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if not math.isfinite(err) or err > tol:
        return f"its result differs from full attention by {err:.2e} (tolerance {tol:.0e})"
    return None


# -- the selection rules ----------------------------------------------------------------
SDPA = Kernel("sdpa", False, _sdpa)
CPU_FLASH = Kernel("cpu-flash-lse", True, _cpu_flash)
CUDNN_LSE = Kernel("cudnn-lse", True, _cudnn(True))
CUDNN = Kernel("cudnn", False, _cudnn(False))
TORCH_FLASH_LSE = Kernel("torch-flash-lse", True, _torch_flash)
EFFICIENT_LSE = Kernel("efficient-lse", True, _efficient(True))
EFFICIENT = Kernel("efficient", False, _efficient(False))


def _why_not(backend: str, dtype, head_dim: int, lse: bool):
    """(kernel, None) if `backend` runs on this CUDA device, else (None, reason)."""
    cap = _cuda_capability()
    half = dtype in HALF
    if backend == "cudnn":
        if cap < (8, 0):
            return None, f"cuDNN attention needs compute capability 8.0+ (this GPU: {cap})"
        if not half:
            return None, "cuDNN attention runs in bf16/fp16 only"
        kernel = CUDNN_LSE if lse else CUDNN
    elif backend == "torch-flash":
        if cap < (8, 0) or not half:
            return None, "torch's flash kernel needs compute capability 8.0+ and bf16/fp16"
        kernel = TORCH_FLASH_LSE
    elif backend == "flash":
        found = _flash_attn_module()
        if found is None:
            return None, "the flash-attn package is not installed (flash_attn or " \
                         "flash_attn_interface)"
        version, func = found
        if not half:
            return None, "flash-attn runs in bf16/fp16 only"
        if version == 3 and cap[0] != 9:
            return None, f"flash-attn 3 runs on Hopper GPUs (compute capability 9.x; this " \
                         f"GPU: {cap})"
        if version == 2 and cap < (8, 0):
            return None, f"flash-attn 2 needs compute capability 8.0+ (this GPU: {cap})"
        kernel = Kernel(f"flash-attn{version}" + ("-lse" if lse else ""), lse,
                        _flash_attn(version, func, lse))
    elif backend == "efficient":
        kernel = EFFICIENT_LSE if lse else EFFICIENT
    else:
        raise AssertionError(backend)
    why = _probe(kernel, "cuda", dtype, head_dim)
    return (None, f"{kernel.name} failed its probe: {why}") if why else (kernel, None)


def select_kernel(backend: str, device_type: str, dtype, ring: int,
                  head_dim: int = 64) -> Kernel:
    """The kernel for one pool (backend, device, dtype) and method (ring degree).

    auto:  no Ring -> SDPA; Ring on CUDA -> cuDNN, else torch's flash, else efficient
           (the first that passes its probe); on CPU -> aten's CPU flash kernel.
    torch: SDPA without Ring; with Ring, efficient attention (CUDA) / CPU flash (CPU).
    cudnn, flash (flash-attn), efficient: that kernel, with or without its LSE, or an
           AttentionBackendError saying why not and what would work.
    """
    lse = ring > 1
    if backend not in BACKENDS:
        raise AttentionBackendError(f"attention backend {backend!r} is not one of "
                                    f"{', '.join(BACKENDS)}")
    if device_type != "cuda":
        if backend not in ("auto", "torch"):
            raise AttentionBackendError(
                f"attention {backend!r} is a CUDA kernel and this pool runs on "
                f"{device_type}; use 'auto' or 'torch'")
        return CPU_FLASH if lse else SDPA
    if backend in ("auto", "torch") and not lse:
        return SDPA
    if backend == "auto":
        for candidate in ("cudnn", "torch-flash"):
            kernel, _ = _why_not(candidate, dtype, head_dim, lse)
            if kernel is not None:
                return kernel
    kernel, why = _why_not(backend if backend in ("cudnn", "flash") else "efficient", dtype,
                           head_dim, lse)
    if kernel is None:
        dt = str(dtype).replace("torch.", "")
        raise AttentionBackendError(
            f"attention {backend!r} cannot run here ({dt}, head dim {head_dim}): {why}; use "
            f"'auto' (the fastest kernel that works here)"
            + ("" if backend in ("auto", "torch", "efficient") else " or 'efficient'"))
    return kernel


def check_backend(backend: str, device_type: str, dtype, head_dim: int = 64) -> dict:
    """At pool start: refuse a backend this device/dtype cannot run (one clear error), and
    return the kernel each method will use, for `status` and the bench."""
    return {"backend": backend,
            "no_ring": select_kernel(backend, device_type, dtype, 1, head_dim).name,
            "ring": select_kernel(backend, device_type, dtype, 2, head_dim).name}


class KernelChoice:
    """The kernel of one attention site, resolved on its first call from the tensors' dtype
    and head dim (the probe needs them) and then reused: no selection or import per call."""

    def __init__(self, backend: str, device_type: str, ring: int, dtype=None):
        self.backend, self.device_type, self.ring = backend, device_type, ring
        self._by_shape: dict = {}
        self.name = select_kernel(backend, device_type, dtype, ring).name \
            if dtype is not None else None

    def __call__(self, q) -> Kernel:
        kernel = self._by_shape.get((q.dtype, q.shape[-1]))
        return kernel if kernel is not None else self.resolve(q.dtype, q.shape[-1])

    def resolve(self, dtype, head_dim: int) -> Kernel:
        kernel = select_kernel(self.backend, self.device_type, dtype, self.ring, head_dim)
        self._by_shape[(dtype, head_dim)] = kernel
        self.name = kernel.name
        return kernel


class LocalAttention:
    """Attention over the whole sequence on one rank (no sequence parallelism: 1 rank, CFG
    or DP only): the pool's chosen kernel, so the loader's `attention` choice holds at every
    degree. No collectives, so compiled blocks trace straight through it."""

    def __init__(self, backend: str, device_type: str, dtype=None, head_dim=None):
        """`head_dim` (the model's) resolves the kernel now: a compiled block then traces a
        settled choice instead of filling the cache (which would recompile on the next
        call)."""
        self.kernels = KernelChoice(backend, device_type, 1, dtype)
        if dtype is not None and head_dim is not None:
            self.kernels.resolve(dtype, int(head_dim))
        self._rows: dict = {}  # a row's real-key index on the device, per shape
        self._declared: set = set()  # attentions found declared (check_declared)

    @property
    def kernel_name(self) -> Optional[str]:
        return self.kernels.name

    def _row_keys(self, plan, streams, n: int, device):
        """The real keys of a row whose prompt fills `n` text tokens: made once per shape
        and kept on the device (made per layer and step, each would be a host copy)."""
        key = (tuple(streams), plan.counts(), n, device)
        if key not in self._rows:
            if len(self._rows) > 64:  # shapes change with jobs; keep the cache bounded
                self._rows.clear()
            self._rows[key] = _Layout(*_valid_runs(plan, streams, False, n), 1, 1,
                                      device).valid[0]
        return self._rows[key]

    def __call__(self, q, k, v, plan, streams, module=None, text_lengths=None,
                 keys=None) -> torch.Tensor:
        """`keys`: the key streams of a cross-attention (None: `streams`, joint)."""
        keys = tuple(streams) if keys is None else tuple(keys)
        check_declared(plan, streams, keys, self._declared)
        kernel, scale = self.kernels(q), q.shape[-1] ** -0.5
        rows = short_rows(plan, text_lengths, keys)
        if rows is None:
            return kernel(q, k, v, scale)
        outs = []
        for b, n in enumerate(rows):  # each row's own real keys
            idx = self._row_keys(plan, keys, n, q.device)
            kb, vb = k[b:b + 1], v[b:b + 1]
            if idx is not None:
                kb, vb = kb.index_select(1, idx), vb.index_select(1, idx)
            out = kernel(q[b:b + 1], kb, vb, scale)
            outs.append(out[0] if kernel.lse else out)
        return torch.cat(outs)


class ShardedAttention:
    """Attention of local query shards against the keys of every sequence-parallel rank.
    One instance per topology: groups, kernel choice, ring block and index lists are built
    once and reused by every layer and step."""

    def __init__(self, topo: Topology, device_type: str, fault: str = "",
                 backend: str = "auto", dtype=None):
        """`fault` injects a known bug for the tests' negative controls ("lse_zero": zero
        log-sum-exp as yunchang's TORCH_MATH returns; "keep_padding": padded keys kept)."""
        self.topo = topo
        self.fault = fault
        self.ulysses, self.ring = topo.degree("ulysses"), topo.degree("ring")
        self.uly_group, self.ring_group = topo.group("ulysses"), topo.group("ring")
        self.kernels = KernelChoice(backend, device_type, self.ring, dtype)
        self.block = _RingBlock(self.ring, topo.index("ring"), fault)
        self._layouts: dict = {}
        self._declared: set = set()  # attentions found declared (check_declared)
        self.uneven = UnevenAttention(self)  # shards sized by uneven weights

    @property
    def kernel_name(self) -> Optional[str]:
        return self.kernels.name

    def _layout(self, plan, streams, padded, device, text_real=None) -> _Layout:
        names = None if streams is None else tuple(streams)  # direct callers may pass None
        key = (padded, names, tuple(plan.lengths(streams)),
               tuple(tuple(plan.sizes(s)) for s in streams) if padded else None, device,
               text_real)
        lay = self._layouts.get(key)
        if lay is None:
            chunk, runs = _valid_runs(plan, streams, padded, text_real)
            lay = _Layout(chunk, runs, self.ulysses, self.ring, device)
            if len(self._layouts) > 64:  # shapes change with jobs; keep the cache bounded
                self._layouts.clear()
            self._layouts[key] = lay
        return lay

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, streams,
                 module=None, text_lengths=None, keys=None) -> torch.Tensor:
        """q: [B, S_local, H, D], the local tokens of the query streams `streams` under
        `plan`; k, v: those of the key streams `keys` (None: `streams`, joint attention;
        else a cross-attention the layout declares). Padded to the block length when
        `plan.padded` (the hooks' layout), else unpadded. `text_lengths`: the rows' real
        text lengths where prompts were padded to a common length; such a batch attends
        row by row, each over its own real keys. A replicated stream is held whole: keys
        that are all replicated need no exchange; otherwise each replicated stream takes
        part as its shard would, and its queries' output is gathered back."""
        keys = tuple(streams) if keys is None else tuple(keys)
        check_declared(plan, streams, keys, self._declared)
        if not any(plan.sharded(s) for s in keys):
            return self._whole_keys(q, k, v, plan, keys, text_lengths)
        if not all(plan.sharded(s) for s in (*streams, *keys)):
            return self._with_replicated(q, k, v, plan, streams, keys, module, text_lengths)
        if getattr(plan, "uneven", False):  # unpadded shards of an uneven split
            return self.uneven(q, k, v, plan, streams, keys, text_lengths)
        topo = self.topo
        padded = bool(getattr(plan, "padded", False))
        lay = self._layout(plan, keys, padded, q.device)
        s_local, kv_local = q.shape[1], k.shape[1]
        q_chunk = lay.chunk if keys == tuple(streams) else _chunk(plan, streams, padded)
        want = (q_chunk, lay.chunk) if padded else \
            (plan.lengths(streams)[topo.sp_rank], plan.lengths(keys)[topo.sp_rank])
        if (s_local, kv_local) != want:
            raise RuntimeError(f"local sequence {s_local} (keys {kv_local}) != planned "
                               f"{want[0]} (keys {want[1]})")
        if q_chunk == lay.chunk and s_local == kv_local:
            if s_local < lay.chunk:  # unpadded caller with uneven shards: pad here, once
                qkv = F.pad(torch.stack((q, k, v)), (0, 0, 0, 0, 0, lay.chunk - s_local))
                q, k, v = qkv[0], qkv[1], qkv[2]
        else:  # cross-attention: queries and keys padded each to their own block
            q = F.pad(q, (0, 0, 0, 0, 0, q_chunk - s_local))
            kv = F.pad(torch.stack((k, v)), (0, 0, 0, 0, 0, lay.chunk - kv_local))
            k, v = kv[0], kv[1]
        if self.ulysses > 1:
            q, k, v = ulysses_qkv(q, k, v, self.uly_group, self.ulysses)
        rows = short_rows(plan, text_lengths, keys)
        if rows is None:
            out = self._attend(q, k, v, lay)
        else:  # every rank of the group has the same rows: the collectives stay matched
            out = torch.cat([self._attend(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                          self._layout(plan, keys, padded, q.device, n))
                             for b, n in enumerate(rows)])
        out = out.to(q.dtype)
        if self.ulysses > 1:
            out = ulysses_out(out, self.uly_group, self.ulysses)
        return out if out.shape[1] == s_local else out[:, :s_local]

    def _whole_keys(self, q, k, v, plan, keys, text_lengths) -> torch.Tensor:
        """Keys of replicated streams only: every rank holds them all, so its queries attend
        here, without a collective (Wan's video tokens over the text)."""
        kernel, scale = self.kernels(q), q.shape[-1] ** -0.5
        if k.shape[1] != sum(plan.full_len(s) for s in keys):
            raise RuntimeError(f"keys of {'+'.join(keys)}: {k.shape[1]} tokens, planned "
                               f"{sum(plan.full_len(s) for s in keys)}")
        rows = short_rows(plan, text_lengths, keys)
        if rows is None:
            out = kernel(q, k, v, scale)
            return out[0] if kernel.lse else out
        outs = []
        for b, n in enumerate(rows):
            idx = _Layout(*_valid_runs(plan, keys, False, n), 1, 1, q.device).valid[0]
            kb, vb = k[b:b + 1], v[b:b + 1]
            if idx is not None:
                kb, vb = kb.index_select(1, idx), vb.index_select(1, idx)
            out = kernel(q[b:b + 1], kb, vb, scale)
            outs.append(out[0] if kernel.lse else out)
        return torch.cat(outs)

    def _with_replicated(self, q, k, v, plan, streams, keys, module, text_lengths):
        """Some replicated stream among sharded ones: each replicated stream narrowed to the
        shard it would have if it were sharded (`plan.all_sharded()`), the attention run on
        that, and the replicated queries' output gathered whole again."""
        view = plan.all_sharded()
        qv = as_view(q, plan, view, streams)
        kv = as_view(torch.stack((k, v)), plan, view, keys, dim=2)
        out = self(qv, kv[0], kv[1], view, streams, module, text_lengths, keys)
        return from_view(out, plan, view, streams, self.topo.group("sp"))

    def _attend(self, q, k, v, lay: _Layout) -> torch.Tensor:
        """Attention of the (Ulysses-gathered) queries over the real keys of every ring
        block of `lay`."""
        kernel = self.kernels(q)
        scale = q.shape[-1] ** -0.5
        if self.ring == 1:
            idx = lay.valid[0]
            if idx is not None and self.fault != "keep_padding":
                k, v = k.index_select(1, idx), v.index_select(1, idx)
            out = kernel(q, k, v, scale)
            if kernel.lse:
                out = out[0]
        else:
            self.block.start(kernel, lay)
            out, _ = ring_flash_attn_forward(self.ring_group, q, k.contiguous(), v.contiguous(),
                                        softmax_scale=scale, dropout_p=0.0, causal=False,
                                        attn_type=None, attn_processor=self.block)
        return out


def _chunk(plan, streams, padded: bool) -> int:
    """The block length of `streams`' local tokens: the padded plan's (each stream padded to
    its longest shard), else the longest rank's."""
    if padded:
        return sum(max(plan.sizes(s)) for s in streams)
    return max(plan.lengths(streams))

