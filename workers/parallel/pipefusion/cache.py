"""PipeFusion's attention: a patch's queries against a K/V cache of the full sequence.

In every attention layer the cache holds one step's keys and values for every token; a
patch call first writes its own fresh K/V (and the text's and references', carried by each
step's first patch) into it, then attends over the whole cache, so the rest of the sequence
is one step stale. With ulysses/ring inside a stage, each stage's sp ranks hold a shard of
the patch; the attention gathers the patch's keys/values over the sp group (heads by
all-to-all, tokens by all-gather) before it refreshes the cache, so every rank's cache holds
the full sequence for its heads. A stream every rank keeps whole (replicated: LTX-2's text
and sound) is exchanged only where it meets a sharded one, as its shard would be
(stream_views.py); keys that are all replicated stay local, their cache over all heads.
Caches are allocated per job from the job's shapes (`KVCache`, held by the job's
PatchPlans), so nothing stale survives a job.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..attention import KernelChoice, check_declared, short_rows, ulysses_out, ulysses_qkv
from ..stream_views import as_view, from_view
from ..topology import all_gather
from .plan import PatchPlan


@dataclass
class _KV:
    k: torch.Tensor
    v: torch.Tensor
    filled: np.ndarray  # bool [S] on the host: positions written at least once
    complete: bool = False


class PatchAttention:
    """A patch's queries against the layer's K/V cache, refreshed with the patch's own K/V."""

    def __init__(self, topo, backend: str = "auto", device_type: Optional[str] = None,
                 dtype=None):
        """The cache attention needs no log-sum-exp: the pool's plain kernel (ring degree 1
        in the selection rules), chosen once from the first call's device, dtype, head dim."""
        self.topo = topo
        self.backend = backend
        self._declared: set = set()  # attentions found declared (check_declared)
        self._kernels = {}  # device type -> KernelChoice
        if device_type is not None:
            self._kernels[device_type] = KernelChoice(backend, device_type, 1, dtype)

    @property
    def kernel_name(self):
        return next((c.name for c in self._kernels.values()), None)

    def _kernel(self, q):
        choice = self._kernels.get(q.device.type)
        if choice is None:
            choice = self._kernels[q.device.type] = KernelChoice(self.backend, q.device.type, 1)
        return choice(q)

    def exchanges(self, plan: PatchPlan, streams, keys) -> bool:
        """Whether the stage's sp ranks exchange this attention's tokens: not at sp 1, nor
        where every key stream is replicated (LTX-2's text, its sound): each rank holds
        those whole, so its queries attend to them over all heads."""
        return self.topo.sp > 1 and any(plan.sharded(s) for s in keys)

    def __call__(self, q, k, v, plan: PatchPlan, streams, module=None, text_lengths=None,
                 keys=None):
        """`streams`: the query streams; `keys`: the key streams of a cross-attention (None:
        `streams`). The cache holds the key streams' K/V."""
        if not isinstance(plan, PatchPlan):
            raise RuntimeError("PipeFusion attention called without a patch plan")
        keys = tuple(streams) if keys is None else tuple(keys)
        check_declared(plan, streams, keys, self._declared)
        topo, kv = self.topo, plan.cache
        rows = short_rows(plan, text_lengths, keys)
        exchange = self.exchanges(plan, streams, keys)
        view = plan
        if exchange and not all(plan.sharded(s) for s in (*streams, *keys)):
            # a replicated stream among sharded ones (LTX-2's sound queries over the video):
            # it takes part as its shard would (stream_views), so no rank computes it twice
            view = plan.all_sharded()
            q = as_view(q, plan, view, streams)
            kv_ = as_view(torch.stack((k, v)), plan, view, keys, dim=2)
            k, v = kv_[0], kv_[1]
        if exchange:
            q, k, v, back = _gather_patch(q, k, v, view, streams, keys, topo, kv)
        # cache positions: host numbers for the bookkeeping, a device index made once per
        # patch shape and job (copying it in per layer would stall the stream each time)
        pos, dev_pos = kv.positions(view, keys, k.device, exchange)
        if not exchange and k.shape[1] != len(pos):
            # key streams every call holds whole, whatever its patch (an input each block
            # reads, LTX-2's text): all of them fresh
            if k.shape[1] != sum(plan.full_len(s) for s in keys):
                raise RuntimeError(f"{k.shape[1]} keys of {'+'.join(keys)}: neither the "
                                   f"patch's {len(pos)} nor the whole streams'")
            pos, dev_pos = kv.whole(plan, keys, k.device)
        cache = kv.layer(module, plan.branch, keys, plan, k)
        cache.k.index_copy_(1, dev_pos, k)
        cache.v.index_copy_(1, dev_pos, v)
        kk, vv = cache.k, cache.v
        if not cache.complete:  # host bookkeeping only (numpy): no device sync
            cache.filled[pos] = True
            cache.complete = bool(cache.filled.all())
        kernel, scale = self._kernel(q), q.shape[-1] ** -0.5
        if rows is None:
            if not cache.complete:  # warmup 0, first step: only the tokens computed so far
                idx = torch.from_numpy(cache.filled.nonzero()[0]).to(k.device)
                kk, vv = kk.index_select(1, idx), vv.index_select(1, idx)
            out = kernel(q, kk, vv, scale)
        else:  # rows padded to a common text length: each over its own real keys
            outs = []
            for b, n in enumerate(rows):
                idx = kv.row_keys(plan, keys, n, cache, k.device)
                out = kernel(q[b:b + 1], kk[b:b + 1].index_select(1, idx),
                             vv[b:b + 1].index_select(1, idx), scale)
                outs.append(out[0] if kernel.lse else out)
            out = torch.cat(outs)
        if exchange:
            out = back(out)
            if view is not plan:  # the replicated queries' output whole again
                out = from_view(out, plan, view, streams, topo.group("sp"))
        return out


def _gather_patch(q, k, v, plan, streams, keys, topo, cache):
    """sp > 1 inside a stage: Ulysses all-to-all (tokens of the Ulysses group, H/U heads),
    then an all-gather of K/V over the ring group, so the cache and the keys are complete
    for this rank's heads. Returns the gathered q/k/v (padding dropped from k/v) and the
    inverse map for the attention output."""
    U, R = topo.degree("ulysses"), topo.degree("ring")
    chunk = max(max(plan.lengths(keys)), 1)
    n_local = q.shape[1]
    if tuple(keys) == tuple(streams):
        if n_local < chunk:  # one pad of the packed q/k/v, not three
            qkv = F.pad(torch.stack((q, k, v)), (0, 0, 0, 0, 0, chunk - n_local))
            q, k, v = qkv[0], qkv[1], qkv[2]
    else:  # cross-attention: the queries and the keys each padded to their own block
        q = F.pad(q, (0, 0, 0, 0, 0, max(max(plan.lengths(streams)), 1) - n_local))
        kv = F.pad(torch.stack((k, v)), (0, 0, 0, 0, 0, chunk - k.shape[1]))
        k, v = kv[0], kv[1]
    if U > 1:  # q, k and v in one all-to-all
        q, k, v = ulysses_qkv(q, k, v, topo.group("ulysses"), U)
    if R > 1:
        kv = torch.stack([k, v])
        parts = [torch.empty_like(kv) for _ in range(R)]
        all_gather(parts, kv.contiguous(), group=topo.group("ring"))
        kv = torch.cat(parts, dim=2)
        k, v = kv[0], kv[1]
    keep = cache.gathered_keep(plan, keys, k.device)
    k, v = k.index_select(1, keep), v.index_select(1, keep)

    def back(out):
        if U > 1:
            out = ulysses_out(out, topo.group("ulysses"), U)
        return out[:, :n_local]

    return q, k, v, back


def _gathered_positions(plan, streams, topo) -> torch.Tensor:
    """Cache positions of the gathered k/v rows (host), -1 where a shard was padded: the
    ring group's shards in order, each the Ulysses group's shards padded to one chunk."""
    U, R = topo.degree("ulysses"), topo.degree("ring")
    chunk = max(max(plan.lengths(streams)), 1)

    def positions_of(sp_rank):
        p = plan.positions(streams, sp_rank)
        return torch.cat([p, p.new_full((chunk - p.numel(),), -1)])

    ranks = range(R * U) if R > 1 else [topo.index("ring") * U + u for u in range(U)]
    return torch.cat([positions_of(r) for r in ranks])


class KVCache:
    """One job's K/V caches on one rank (per attention module, guidance branch and streams)
    and the cache index of each patch shape."""

    def __init__(self, topo):
        self.topo = topo
        self.caches: dict = {}
        self.indices: dict = {}  # per patch shape: (host positions, device index)

    def _index(self, key, make, device):
        if key not in self.indices:
            host = make()
            self.indices[key] = (host.numpy(), host.to(device))
        return self.indices[key]

    def positions(self, plan: PatchPlan, streams, device, gathered: bool) -> tuple:
        """(host positions, device index) in the K/V cache of this call's keys: this rank's
        tokens, or where they were `gathered` over the sp ranks the gathered (unpadded)
        ones."""
        topo = self.topo

        def make():
            if not gathered:
                return plan.positions(streams)
            p = _gathered_positions(plan, streams, topo)
            return p[p >= 0]
        return self._index(("pos", gathered) + plan.key(streams), make, device)

    def whole(self, plan: PatchPlan, streams, device) -> tuple:
        """(host positions, device index) of every token of `streams` in their cache."""
        def make():
            return torch.arange(sum(plan.full_len(s) for s in streams))
        return self._index(("whole",) + plan.key(streams), make, device)

    def gathered_keep(self, plan: PatchPlan, streams, device) -> torch.Tensor:
        """Device index of the gathered k/v rows that are real tokens (not padding)."""
        def make():
            return (_gathered_positions(plan, streams, self.topo) >= 0).nonzero().squeeze(1)
        return self._index(("keep",) + plan.key(streams), make, device)[1]

    def row_keys(self, plan: PatchPlan, streams, n: int, cache: _KV, device) -> torch.Tensor:
        """Device index of the cache positions a row whose prompt fills `n` text tokens
        attends to: every filled position but the text after its first `n` (the cache holds
        the streams in order). Made once per shape and length once the cache is complete;
        before that (warmup 0, first step) from the positions filled so far."""
        def make():
            keep = cache.filled.copy()
            at = 0
            for s in streams:
                full = plan.full_len(s)
                if s == plan.text_stream:
                    keep[at + n: at + full] = False
                at += full
            return torch.from_numpy(keep.nonzero()[0])
        if not cache.complete:
            return make().to(device)
        return self._index(("row", n) + plan.key(streams), make, device)[1]

    def layer(self, module, branch: int, streams, plan: PatchPlan, k) -> _KV:
        key = (id(module), branch, tuple(streams))
        entry = self.caches.get(key)
        full = sum(plan.full_len(s) for s in streams)
        shape = (k.shape[0], full) + tuple(k.shape[2:])
        if entry is None or tuple(entry.k.shape) != shape or entry.k.dtype != k.dtype:
            entry = _KV(k.new_zeros(shape), k.new_zeros(shape), np.zeros(full, dtype=bool))
            self.caches[key] = entry
        return entry

    def clear(self) -> None:
        self.caches.clear()
        self.indices.clear()
