"""PipeFusion: patch-level pipeline parallelism over the transformer's blocks.

Each pipeline stage holds a contiguous run of blocks (workers/pipefusion_stages.py). The
image's token rows are cut into `patches` bands. During `warmup_steps` a whole image goes
through the stages in one piece (exact; it fills every layer's K/V cache). After that the
patches flow through the stages one after another: while stage 1 works on patch 0, stage 0
already computes patch 1. In every attention layer a patch's queries see a K/V cache of the
full sequence in which only that patch's slice (and the text, carried by each step's first
patch) is fresh; the rest is one step stale. The last stage finishes a patch's Euler step and
sends those latent rows straight back to stage 0, which starts the next step with them: there
is no bubble between steps, only the fill at the start.

Reference images (FLUX.1 Kontext, FLUX.2) are context like the text: their tokens are
computed with each step's first patch (per guidance branch) and their K/V cached and
refreshed like the text's, so later patches attend to them one patch stale at most within a
step, and with warmup_steps >= steps the run is exact. For that the adapter puts them at the
front of the image stream in patch calls (workers/models/flux.py `with_references`): the
first patch's image tokens are then one range, [references, its rows], and the plans,
shards and caches need no second range.

With ulysses/ring inside a stage, each stage's sp ranks hold a shard of the patch; the
attention gathers the patch's keys/values over the sp group (heads by all-to-all, tokens by
all-gather) before it refreshes the cache, so every rank's cache holds the full sequence for
its heads. cfg-parallel pipelines exchange the last stage's predictions per patch; dp
replicas are independent pipelines.

The denoising loop itself (workers/denoise.py) is the same for every method; this module adds
what a stage needs inside it: the patch attention, the K/V caches and the activation slots
the stage hooks read and fill. When patches move is fixed by the job's tick table
(workers/schedule.py): both sides of a transfer exchange at the same tick, grouped, so the
schedule is NCCL-safe and a cancel at a step boundary leaves nothing unmatched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .attention import KernelChoice, ulysses_out, ulysses_qkv
from .schedule import Micro
from .sequence_parallel import SequencePlan
from .topology import all_gather


@dataclass(frozen=True)
class PatchContext:
    """What one PipeFusion forward computes; reaches hooks and attention via `sp_plan.patch`."""

    image_range: tuple  # image tokens of the patch (start, stop)
    with_text: bool  # the branch's first patch of a step also computes the text tokens
    branch: int  # 0 = negative, 1 = positive (separate K/V caches)
    run: Any  # the job's PipelineRun


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

    def __call__(self, q, k, v, plan: SequencePlan, streams, module=None):
        ctx = plan.patch
        if ctx is None:
            raise RuntimeError("PipeFusion attention called without a patch context")
        topo, run = self.topo, ctx.run
        if topo.sp > 1:
            q, k, v, back = _gather_patch(q, k, v, plan, streams, topo, run)
        # cache positions: host numbers for the bookkeeping, a device index made once per
        # patch shape and job (copying it in per layer would stall the stream each time)
        pos, dev_pos = run.cache_positions(plan, streams, topo, k.device)
        cache = run.kv_cache(module, ctx.branch, streams, plan, k)
        cache.k.index_copy_(1, dev_pos, k)
        cache.v.index_copy_(1, dev_pos, v)
        kk, vv = cache.k, cache.v
        if not cache.complete:  # host bookkeeping only (numpy): no device sync
            cache.filled[pos] = True
            cache.complete = bool(cache.filled.all())
            if not cache.complete:  # warmup 0, first step: only the tokens computed so far
                idx = torch.from_numpy(cache.filled.nonzero()[0]).to(k.device)
                kk, vv = kk.index_select(1, idx), vv.index_select(1, idx)
        out = self._kernel(q)(q, kk, vv, q.shape[-1] ** -0.5)
        if topo.sp > 1:
            out = back(out)
        return out


def _gather_patch(q, k, v, plan, streams, topo, run):
    """sp > 1 inside a stage: Ulysses all-to-all (tokens of the Ulysses group, H/U heads),
    then an all-gather of K/V over the ring group, so the cache and the keys are complete
    for this rank's heads. Returns the gathered q/k/v (padding dropped from k/v) and the
    inverse map for the attention output."""
    U, R = topo.degree("ulysses"), topo.degree("ring")
    chunk = max(max(plan.lengths(streams)), 1)
    n_local = q.shape[1]
    if n_local < chunk:  # one pad of the packed q/k/v, not three
        qkv = F.pad(torch.stack((q, k, v)), (0, 0, 0, 0, 0, chunk - n_local))
        q, k, v = qkv[0], qkv[1], qkv[2]
    if U > 1:  # q, k and v in one all-to-all
        q, k, v = ulysses_qkv(q, k, v, topo.group("ulysses"), U)
    if R > 1:
        kv = torch.stack([k, v])
        parts = [torch.empty_like(kv) for _ in range(R)]
        all_gather(parts, kv.contiguous(), group=topo.group("ring"))
        kv = torch.cat(parts, dim=2)
        k, v = kv[0], kv[1]
    keep = run.gathered_keep(plan, streams, topo, k.device)
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


def check_stage(model, topo) -> None:
    """This rank must hold the stage the job's layout gives it."""
    info, stages, stage = model.stage, topo.degree("pipefusion"), topo.index("pipefusion")
    if info is None or info.count != stages or info.index != stage:
        held = "the whole model" if info is None else f"stage {info.index} of {info.count}"
        raise RuntimeError(f"this rank holds {held}, the job asks for stage {stage} of "
                           f"{stages}; relaunch the pool for this pipefusion degree")


@dataclass
class PipelineRun:
    """One job's PipeFusion state on one rank: its neighbours, the activation slots the
    stage hooks use, and the K/V caches (allocated per job from the job's shapes, so nothing
    stale survives)."""

    topo: Any
    rows: int  # token rows of the image
    cols: int
    text_len: dict  # branch -> text tokens
    batch: int
    hidden: int
    device: Any
    ref_tokens: int = 0  # reference tokens at the front of the image stream (module doc)
    caches: dict = field(default_factory=dict)
    indices: dict = field(default_factory=dict)  # per patch shape: (host positions, device index)
    incoming: Optional[torch.Tensor] = None  # this tick's activations from the previous stage
    outgoing: Optional[torch.Tensor] = None  # this tick's activations for the next stage

    def __post_init__(self):
        topo = self.topo
        n, s = topo.degree("pipefusion"), topo.index("pipefusion")
        self.prev = topo.global_rank(pipefusion=s - 1) if s > 0 else None
        self.next = topo.global_rank(pipefusion=s + 1) if s < n - 1 else None
        self.head = topo.global_rank(pipefusion=0)
        self.tail = topo.global_rank(pipefusion=n - 1)

    def image_range(self, m: Micro) -> tuple:
        """Image-stream tokens of a micro: its rows, after the references, which the
        branch's first patch of a step (the one with the text) computes too."""
        lo, hi = (self.ref_tokens + r * self.cols for r in m.rows)
        return (0 if m.with_text else lo), hi

    def plan(self, m: Micro) -> SequencePlan:
        return SequencePlan(self.topo.sp_rank, self.topo.sp, self.text_len[m.branch],
                            self.ref_tokens + self.rows * self.cols,
                            image_range=self.image_range(m), with_text=m.with_text)

    def context(self, m: Micro) -> PatchContext:
        return PatchContext(image_range=self.image_range(m), with_text=m.with_text,
                            branch=m.branch, run=self)

    def activation_shape(self, m: Micro) -> tuple:
        plan, r = self.plan(m), self.topo.sp_rank
        return (self.batch, plan.sizes("text")[r] + plan.sizes("image")[r], self.hidden)

    # -- called by the stage hooks (workers/pipefusion_stages.py) -------------------------
    def receive_activations(self, plan: SequencePlan, joined: bool = False):
        """The previous stage's [text, image] activations: split in two, or as one joined
        tensor for a block that takes the streams joined (FLUX.2's single blocks)."""
        buf, self.incoming = self.incoming, None
        t = plan.sizes("text")[self.topo.sp_rank]
        want = t + plan.sizes("image")[self.topo.sp_rank]
        if buf is None or buf.shape[1] != want:
            got = None if buf is None else tuple(buf.shape)
            raise RuntimeError(f"pipeline activations {got} do not fit the patch ({want} tokens)")
        return buf if joined else (buf[:, :t], buf[:, t:])

    def send_activations(self, plan: SequencePlan, encoder_hidden_states, hidden_states):
        parts = [hidden_states] if encoder_hidden_states is None \
            else [encoder_hidden_states, hidden_states]
        self.outgoing = torch.cat(parts, dim=1)

    def take_outgoing(self) -> torch.Tensor:
        out, self.outgoing = self.outgoing, None
        if out is None:
            raise RuntimeError("the stage produced no activations for the next stage")
        return out

    # -- called by PatchAttention -------------------------------------------------------
    def _index(self, key, make, device):
        if key not in self.indices:
            host = make()
            self.indices[key] = (host.numpy(), host.to(device))
        return self.indices[key]

    @staticmethod
    def _plan_key(plan: SequencePlan, streams) -> tuple:
        return (plan.text_len, plan.image_len, plan.image_range, plan.with_text, tuple(streams))

    def cache_positions(self, plan: SequencePlan, streams, topo, device) -> tuple:
        """(host positions, device index) in the K/V cache of this call's keys: this rank's
        tokens, or with sp > 1 the gathered (unpadded) ones."""
        def make():
            if topo.sp == 1:
                return plan.positions(streams)
            p = _gathered_positions(plan, streams, topo)
            return p[p >= 0]
        return self._index(("pos",) + self._plan_key(plan, streams), make, device)

    def gathered_keep(self, plan: SequencePlan, streams, topo, device) -> torch.Tensor:
        """Device index of the gathered k/v rows that are real tokens (not padding)."""
        def make():
            return (_gathered_positions(plan, streams, topo) >= 0).nonzero().squeeze(1)
        return self._index(("keep",) + self._plan_key(plan, streams), make, device)[1]

    def kv_cache(self, module, branch: int, streams, plan: SequencePlan, k) -> _KV:
        key = (id(module), branch, tuple(streams))
        entry = self.caches.get(key)
        full = sum(plan.full_len(s) for s in streams)
        shape = (k.shape[0], full) + tuple(k.shape[2:])
        if entry is None or tuple(entry.k.shape) != shape or entry.k.dtype != k.dtype:
            entry = _KV(k.new_zeros(shape), k.new_zeros(shape), np.zeros(full, dtype=bool))
            self.caches[key] = entry
        return entry

    def close(self) -> None:
        self.caches.clear()
        self.indices.clear()
        self.incoming = self.outgoing = None
