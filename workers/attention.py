"""Exact joint attention over a sequence sharded across the sequence-parallel ranks.

yunchang's `LongContextAttention` does the communication (Ulysses all-to-all over heads,
Ring K/V passing, or both). We hand it our own block kernel, which
  * returns a true log-sum-exp (yunchang's TORCH_MATH returns zeros, so its ring merge
    averages blocks and is silently wrong), and
  * drops padding keys. Shards may differ in length by a token or two (odd sizes); each is
    padded to the longest so the collectives see equal shapes, and the kernel removes the
    padded keys of whichever block it is given, so the result is exact.

Full (non-causal, unmasked) attention is invariant to the order of the keys, so any
assignment of text and image tokens to ranks is correct as long as each query sees every key
exactly once.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .topology import Topology


def _cpu_kernel(q, k, v, scale):
    # aten's CPU flash kernel: (B,H,S,D) in, (out, lse[B,H,S] fp32) out.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, scale=scale)
    return out.transpose(1, 2), lse


BACKENDS = ("auto", "flash", "torch")


def _flash_attn_func():
    try:
        from flash_attn.flash_attn_interface import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def check_backend(backend: str, device_type: str, dtype) -> None:
    """One clear error, at pool start, for a backend this device/dtype cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if backend != "flash":
        return
    if device_type != "cuda":
        raise ValueError("attention backend 'flash' needs CUDA GPUs; use 'auto' or 'torch'")
    if _flash_attn_func() is None:
        raise ValueError("attention backend 'flash' needs the flash-attn package; install it "
                         "or use 'auto' (flash-attn when present, else torch)")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("flash-attn runs in bf16/fp16 only; use dtype bf16 or backend 'torch'")


def _cuda_kernel(q, k, v, scale, backend="auto"):
    flash = _flash_attn_func() if backend != "torch" else None
    if flash is not None and q.dtype in (torch.float16, torch.bfloat16):
        # flash-attn returns the LSE natively in the layout yunchang merges
        out, lse, _ = flash(q, k, v, softmax_scale=scale, return_attn_probs=True)
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, False,
        scale=scale)[:2]
    return out.transpose(1, 2), lse[..., : q.shape[1]]  # efficient attn pads the LSE


def block_kernel(device_type: str, backend: str = "auto") -> Callable:
    """(q, k, v [B,S,H,D], scale) -> (out [B,S,H,D], lse [B,H,S] fp32)."""
    if device_type == "cuda":
        return lambda q, k, v, scale: _cuda_kernel(q, k, v, scale, backend)
    return _cpu_kernel


def plain_attention(q, k, v, backend: str = "auto") -> torch.Tensor:
    """Full attention without LSE, [B,S,H,D] in and out (PipeFusion's cache attention)."""
    flash = _flash_attn_func() if backend != "torch" and q.is_cuda else None
    if flash is not None and q.dtype in (torch.float16, torch.bfloat16):
        return flash(q, k, v)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)


class _BlockAttention:
    """The per-block function yunchang's ring calls, once per ring step.

    Ring step s on ring rank r holds the K/V block of ring rank (r - s) mod R; that block is
    the concatenation of the (padded) shards of its Ulysses group, whose valid lengths we
    know, so padded keys can be dropped exactly. One instance serves one attention call.
    """

    def __init__(self, kernel, lengths: Sequence[int], chunk: int, ulysses: int, ring: int,
                 ring_rank: int, fault: str = ""):
        self.kernel = kernel
        self.lengths = lengths
        self.chunk = chunk
        self.ulysses = ulysses
        self.ring = ring
        self.ring_rank = ring_rank
        self.step = 0
        self.fault = fault

    def _valid_keys(self, src: int, device) -> Optional[torch.Tensor]:
        lens = self.lengths[src * self.ulysses:(src + 1) * self.ulysses]
        if all(n == self.chunk for n in lens):
            return None
        return torch.cat([torch.arange(n, device=device) + u * self.chunk
                          for u, n in enumerate(lens)])

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
        if causal or dropout_p:
            raise ValueError("sequence-parallel attention is non-causal and has no dropout")
        src = (self.ring_rank - self.step) % self.ring
        self.step += 1
        idx = self._valid_keys(src, k.device)
        if idx is not None and self.fault != "keep_padding":
            k = k.index_select(1, idx)
            v = v.index_select(1, idx)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, lse = self.kernel(q, k, v, scale)
        if self.fault == "lse_zero":  # the TORCH_MATH failure mode (negative control)
            lse = torch.zeros_like(lse)
        return out, lse


class ShardedAttention:
    """Attention of local query shards against the keys of every sequence-parallel rank."""

    def __init__(self, topo: Topology, device_type: str, fault: str = "",
                 backend: str = "auto"):
        """`fault` injects a known bug for the tests' negative controls ("lse_zero": zero
        log-sum-exp as yunchang's TORCH_MATH returns; "keep_padding": padded keys kept)."""
        from yunchang import LongContextAttention
        from yunchang.globals import PROCESS_GROUP

        self.topo = topo
        self.kernel = block_kernel(device_type, backend)
        self.fault = fault
        # yunchang's constructor insists on its global groups being set; set them to ours
        # (fixed for the life of this topology) and also pass ours explicitly below.
        PROCESS_GROUP.ULYSSES_PG = topo.group("ulysses")
        PROCESS_GROUP.RING_PG = topo.group("ring")
        self._lca_cls = LongContextAttention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, streams,
                 module=None) -> torch.Tensor:
        """q, k, v: [B, S_local, H, D], the local tokens of `streams` under `plan`."""
        topo = self.topo
        lengths = plan.lengths(streams)
        s_local = q.shape[1]
        if s_local != lengths[topo.sp_rank]:
            raise RuntimeError(f"local sequence {s_local} != planned {lengths[topo.sp_rank]}")
        chunk = max(lengths)
        if s_local < chunk:
            pad = (0, 0, 0, 0, 0, chunk - s_local)
            q, k, v = (F.pad(t, pad) for t in (q, k, v))
        block = _BlockAttention(self.kernel, lengths, chunk, topo.degree("ulysses"),
                                topo.degree("ring"), topo.index("ring"), self.fault)
        lca = self._lca_cls(ring_impl_type="basic", attn_type=None, attn_processor=block)
        lca.ulysses_pg = topo.group("ulysses")
        lca.ring_pg = topo.group("ring")
        out = lca(q.contiguous(), k.contiguous(), v.contiguous())
        return out[:, :s_local]
