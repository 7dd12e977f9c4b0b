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

With ulysses/ring inside a stage, each stage's sp ranks hold a shard of the patch; the
attention gathers the patch's keys/values over the sp group (heads by all-to-all, tokens by
all-gather) before it refreshes the cache, so every rank's cache holds the full sequence for
its heads. cfg-parallel pipelines exchange the last stage's predictions per patch; dp
replicas are independent pipelines.

Message order between two ranks is fixed by the schedule, and receives are posted at most one
message ahead and never beyond what the sender has committed to send, so a cancel at a step
boundary leaves nothing unmatched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .attention import plain_attention
from .sequence_parallel import SequencePlan, even_sizes


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
    filled: torch.Tensor  # bool [S] on the host: positions written at least once
    complete: bool = False


class PatchAttention:
    """A patch's queries against the layer's K/V cache, refreshed with the patch's own K/V."""

    def __init__(self, topo, backend: str = "auto"):
        self.topo = topo
        self.backend = backend

    def __call__(self, q, k, v, plan: SequencePlan, streams, module=None):
        ctx = plan.patch
        if ctx is None:
            raise RuntimeError("PipeFusion attention called without a patch context")
        topo = self.topo
        pos = plan.positions(streams)  # host tensors: no device sync for the bookkeeping
        if topo.sp > 1:
            q, k, v, pos, back = _gather_patch(q, k, v, plan, streams, topo)
        cache = ctx.run.kv_cache(module, ctx.branch, streams, plan, k)
        dev_pos = pos.to(k.device)
        cache.k.index_copy_(1, dev_pos, k)
        cache.v.index_copy_(1, dev_pos, v)
        kk, vv = cache.k, cache.v
        if not cache.complete:
            cache.filled[pos] = True
            cache.complete = bool(cache.filled.all())
            if not cache.complete:  # warmup 0, first step: only the tokens computed so far
                idx = cache.filled.nonzero().squeeze(1).to(k.device)
                kk, vv = kk.index_select(1, idx), vv.index_select(1, idx)
        out = plain_attention(q, kk, vv, self.backend)
        if topo.sp > 1:
            out = back(out)
        return out


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, world: int):
    """Split `x` into `world` chunks on `scatter_dim`, exchange, concatenate on `gather_dim`."""
    parts = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    got = [torch.empty_like(parts[0]) for _ in range(world)]
    dist.all_to_all(got, parts, group=group)
    return torch.cat(got, dim=gather_dim)


def _gather_patch(q, k, v, plan, streams, topo):
    """sp > 1 inside a stage: Ulysses all-to-all (tokens of the Ulysses group, H/U heads),
    then an all-gather of K/V over the ring group, so the cache and the keys are complete
    for this rank's heads. Returns the gathered q/k/v, the cache positions of k/v, and the
    inverse map for the attention output."""
    U, R = topo.degree("ulysses"), topo.degree("ring")
    lengths = plan.lengths(streams)
    chunk = max(max(lengths), 1)
    n_local = q.shape[1]

    def pad(x):
        return F.pad(x, (0, 0, 0, 0, 0, chunk - x.shape[1])) if x.shape[1] < chunk else x

    def positions_of(sp_rank):
        p = plan.positions(streams, sp_rank)
        return torch.cat([p, p.new_full((chunk - p.numel(),), -1)])

    ring_i = topo.index("ring")
    q, k, v = pad(q), pad(k), pad(v)
    if U > 1:
        g = topo.group("ulysses")
        q, k, v = (_all_to_all(t, 2, 1, g, U) for t in (q, k, v))
    uly_ranks = [ring_i * U + u for u in range(U)]
    q_pos = torch.cat([positions_of(r) for r in uly_ranks])
    if R > 1:
        g = topo.group("ring")
        kv = torch.stack([k, v])
        parts = [torch.empty_like(kv) for _ in range(R)]
        dist.all_gather(parts, kv.contiguous(), group=g)
        kv = torch.cat(parts, dim=2)
        k, v = kv[0], kv[1]
        kv_pos = torch.cat([positions_of(r) for r in range(R * U)])
    else:
        kv_pos = q_pos
    keep = (kv_pos >= 0).nonzero().squeeze(1)
    kv_pos = kv_pos[keep]
    keep = keep.to(k.device)
    k, v = k.index_select(1, keep), v.index_select(1, keep)

    def back(out):
        if U > 1:
            out = _all_to_all(out, 1, 2, topo.group("ulysses"), U)
        return out[:, :n_local]

    return q, k, v, kv_pos, back


class _Inbox:
    """Ordered receives from one peer: message i is posted when `take` reaches it (or one
    ahead, as prefetch), and never beyond `allowed` (what the peer has committed to send)."""

    def __init__(self, src: int, device):
        self.src, self.device = src, device
        self.specs: list = []  # (shape, dtype) per message, in send order
        self.allowed = 0
        self.next_take = 0
        self.posted: dict = {}  # index -> (work, buffer)

    def expect(self, shape, dtype) -> int:
        self.specs.append((tuple(shape), dtype))
        return len(self.specs) - 1

    def allow(self, upto: int) -> None:
        self.allowed = max(self.allowed, upto)

    def _post(self, i: int) -> None:
        if i not in self.posted and i < min(self.allowed, len(self.specs)):
            shape, dtype = self.specs[i]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self.posted[i] = (dist.irecv(buf, src=self.src), buf)

    def take(self) -> torch.Tensor:
        i = self.next_take
        if i >= self.allowed:
            raise RuntimeError(f"pipeline schedule error: message {i} taken before it was "
                               f"allowed ({self.allowed})")
        self._post(i)
        work, buf = self.posted.pop(i)
        self.next_take += 1
        self._post(i + 1)  # prefetch: overlap the next transfer with this compute
        work.wait()
        return buf

    def drain(self) -> None:
        """Take every allowed message (cancel / end of job)."""
        while self.next_take < min(self.allowed, len(self.specs)):
            self.take()


class _Outbox:
    def __init__(self):
        self.works: list = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        t = tensor.contiguous()
        self.works.append((dist.isend(t, dst=dst), t))
        self.works = [(w, t) for w, t in self.works if not w.is_completed()]

    def wait(self) -> None:
        for w, _ in self.works:
            w.wait()
        self.works = []


@dataclass
class _Micro:
    patch: int
    rows: tuple  # token rows (r0, r1)
    branch: int
    with_text: bool


@dataclass
class PipelineRun:
    """One job's PipeFusion state on one rank: schedule, links to the neighbour stages,
    K/V caches (allocated per job from the job's shapes, so nothing stale survives)."""

    topo: Any
    stage: int
    stages: int
    rows: int  # token rows of the image
    cols: int
    text_len: dict  # branch -> text tokens
    batch: int
    hidden: int
    device: Any
    caches: dict = field(default_factory=dict)

    def __post_init__(self):
        topo = self.topo
        self.prev = topo.global_rank(pipefusion=self.stage - 1) if self.stage > 0 else None
        self.next = topo.global_rank(pipefusion=self.stage + 1) \
            if self.stage < self.stages - 1 else None
        self.head = topo.global_rank(pipefusion=0)
        self.tail = topo.global_rank(pipefusion=self.stages - 1)
        self.acts = _Inbox(self.prev, self.device) if self.prev is not None else None
        self.latents_in = _Inbox(self.tail, self.device) if self.stage == 0 else None
        self.out = _Outbox()

    # -- shapes ---------------------------------------------------------------------------
    def plan(self, m: _Micro) -> SequencePlan:
        return SequencePlan(self.topo.sp_rank, self.topo.sp, self.text_len[m.branch],
                            self.rows * self.cols,
                            image_range=(m.rows[0] * self.cols, m.rows[1] * self.cols),
                            with_text=m.with_text)

    def activation_shape(self, plan: SequencePlan) -> tuple:
        r = self.topo.sp_rank
        return (self.batch, plan.sizes("text")[r] + plan.sizes("image")[r], self.hidden)

    # -- called by the stage hooks --------------------------------------------------------
    def receive_activations(self, plan: SequencePlan):
        buf = self.acts.take()
        if tuple(buf.shape) != self.activation_shape(plan):
            raise RuntimeError(f"pipeline message {tuple(buf.shape)} does not fit the patch "
                               f"{self.activation_shape(plan)}")
        t = plan.sizes("text")[self.topo.sp_rank]
        return buf[:, :t], buf[:, t:]

    def send_activations(self, plan: SequencePlan, encoder_hidden_states, hidden_states):
        parts = [hidden_states] if encoder_hidden_states is None \
            else [encoder_hidden_states, hidden_states]
        self.out.send(torch.cat(parts, dim=1), self.next)

    # -- called by PatchAttention -------------------------------------------------------
    def kv_cache(self, module, branch: int, streams, plan: SequencePlan, k) -> _KV:
        key = (id(module), branch, tuple(streams))
        entry = self.caches.get(key)
        full = sum(plan.full_len(s) for s in streams)
        shape = (k.shape[0], full) + tuple(k.shape[2:])
        if entry is None or tuple(entry.k.shape) != shape or entry.k.dtype != k.dtype:
            entry = _KV(k.new_zeros(shape), k.new_zeros(shape),
                        torch.zeros(full, dtype=torch.bool))
            self.caches[key] = entry
        return entry


def patch_rows(rows: int, patches: int) -> list:
    """Token-row bands of near-equal height."""
    sizes = even_sizes(rows, patches)
    out, r = [], 0
    for s in sizes:
        out.append((r, r + s))
        r += s
    return out


def run_pipefusion(job, prep, model, adapter, topo, emit: Optional[Callable] = None,
                   should_stop: Callable[[], bool] = lambda: False):
    """The denoising loop under PipeFusion (see the module docstring). `prep` is the
    prepared job from denoise.prepare (conds, latents, scheduler, timesteps). Returns this
    replica's final ComfyUI LATENT on its stage-0 ranks, None elsewhere."""
    from .denoise import Cancelled

    req = job.request
    opts = job.options or {}
    stage_info = model.stage
    stages = topo.degree("pipefusion")
    stage = topo.index("pipefusion")
    if stage_info is None or stage_info.count != stages or stage_info.index != stage:
        held = "the whole model" if stage_info is None else \
            f"stage {stage_info.index} of {stage_info.count}"
        raise RuntimeError(f"this rank holds {held}, the job asks for stage {stage} of "
                           f"{stages}; relaunch the pool for this pipefusion degree")
    rows, cols = req["height"] // 16, req["width"] // 16
    warmup = int(opts.get("warmup_steps", 1))
    patches = int(opts.get("pipeline_patches") or stages)
    patches = min(patches, rows)
    dev, dtype = model.device, model.dtype
    cfg_parallel = topo.degree("cfg") == 2
    branches = {}
    if prep.uncond is None:
        branches[1] = prep.cond
    elif cfg_parallel:
        mine = topo.index("cfg")
        branches[mine] = prep.uncond if mine == 0 else prep.cond
    else:
        branches[0], branches[1] = prep.uncond, prep.cond
    order = sorted(branches)
    tconf = model.transformer.config
    run = PipelineRun(topo=topo, stage=stage, stages=stages, rows=rows, cols=cols,
                      text_len={b: c["encoder_hidden_states"].shape[1] for b, c in branches.items()},
                      batch=prep.latents.shape[0],
                      hidden=int(tconf.num_attention_heads) * int(tconf.attention_head_dim),
                      device=dev)
    timesteps = prep.timesteps
    total = len(timesteps)
    sigmas = prep.scheduler.sigmas[prep.begin:].to(dev)
    latents = prep.latents.clone()
    scale = float(req["cfg"])

    bands = [patch_rows(rows, 1 if i < warmup else patches) for i in range(total)]
    schedule = [[_Micro(m, band, b, m == 0) for m, band in enumerate(bands[i]) for b in order]
                for i in range(total)]

    # every message of the job, in order, per link
    flag_index, last_piece = [], []  # per step: its flag's / its last latent piece's index
    for i in range(total):
        if run.acts is not None:
            flag_index.append(run.acts.expect((1,), torch.int32))
            for mb in schedule[i]:
                run.acts.expect(run.activation_shape(run.plan(mb)), dtype)
        if run.latents_in is not None:
            for band in bands[i]:
                last = run.latents_in.expect(
                    adapter.latent_rows(latents, band[0], band[1], cols).shape, dtype)
            last_piece.append(last)
    stage_group = topo.group("stage")
    every = int(req.get("preview_every") or 0)
    t0 = time.perf_counter()
    pending = {}  # last stage: patch -> {branch: pred rows} waiting for the other branch
    x_before = None  # stage 0: the step's input latents, for the x0 preview
    covered = 0  # stage 0: rows of the previous step's output received so far

    def finish_step_event(i):
        if emit is None:
            return
        event = {"step": i + 1, "total": total, "elapsed": time.perf_counter() - t0}
        if x_before is not None:  # flow matching: x0 = x_i - sigma_i * v, v = dx / dsigma
            s, s_next = sigmas[i], sigmas[i + 1]
            x0 = x_before - s * (latents - x_before) / (s_next - s)
            event["preview"] = adapter.to_comfy(model, x0[:1].float(), req["height"],
                                                req["width"]).half().cpu()
        emit(event)

    def receive_rows(covered, upto):
        """Stage 0: take the last stage's new latent rows (in send order) until rows
        [0, upto) of the previous step's output are here; returns the rows covered."""
        while covered < upto:
            piece = run.latents_in.take()
            h = piece.numel() // adapter.latent_rows(latents, 0, 1, cols).numel()
            adapter.latent_rows(latents, covered, covered + h, cols).copy_(piece)
            covered += h
        return covered

    def want_preview(i):
        return emit is not None and every and ((i + 1) % every == 0 or i + 1 == total)

    try:
        for i, t in enumerate(timesteps):
            # 1. continue or stop, decided by rank 0, passed down each pipeline
            flag = torch.zeros(1, dtype=torch.int32, device=dev)
            if stage == 0:
                if topo.rank == 0 and should_stop():
                    flag += 1
                if dist.get_world_size(stage_group) > 1:
                    dist.broadcast(flag, src=0, group=stage_group)
            else:
                run.acts.allow(flag_index[i] + 1)
                flag = run.acts.take()
            if run.next is not None:
                run.out.send(flag, run.next)
            if bool(flag.item()):
                if run.latents_in is not None:
                    run.latents_in.drain()
                run.out.wait()
                raise Cancelled(f"cancelled at step {i}/{total}")
            if run.acts is not None:  # the previous stage now sends step i, then flag i+1
                run.acts.allow(flag_index[i + 1] + 1 if i + 1 < total else len(run.acts.specs))
            if run.latents_in is not None:
                run.latents_in.allow(last_piece[i] + 1)
            if stage == 0:
                covered = 0
            # 2. this step's micro-batches
            for mb in schedule[i]:
                if stage == 0 and i > 0:
                    covered = receive_rows(covered, mb.rows[1])
                ctx = PatchContext(image_range=(mb.rows[0] * cols, mb.rows[1] * cols),
                                   with_text=mb.with_text, branch=mb.branch, run=run)
                out = adapter.forward(model, latents, t, branches[mb.branch], req.get("guidance"),
                                      prep.extra, jak={"patch": ctx})
                if stage == stages - 1:
                    pred = adapter.latent_rows(out, mb.rows[0], mb.rows[1], cols)
                    _finish_patch(mb, pred, pending, order, cfg_parallel, topo, scale, latents,
                                  adapter, sigmas, run, i)
            if stage == 0 and i > 0:
                finish_step_event(i - 1)
            if stage == 0:
                x_before = latents.clone() if want_preview(i) else None
        if stage == 0:  # the last step's output
            receive_rows(0, rows)
            finish_step_event(total - 1)
        run.out.wait()
    finally:
        run.caches.clear()
    if stage != 0:
        return None
    return adapter.to_comfy(model, latents.float(), req["height"], req["width"])


def _finish_patch(mb, pred, pending, order, cfg_parallel, topo, scale, latents, adapter,
                  sigmas, run, i):
    """Last stage: combine the guidance branches of a patch, take its Euler step, send the
    new rows to stage 0."""
    if cfg_parallel:
        both = [torch.empty_like(pred) for _ in range(2)]
        dist.all_gather(both, pred.contiguous(), group=topo.group("cfg"))
        pred = both[0] + scale * (both[1] - both[0])
    elif len(order) == 2:
        got = pending.setdefault(mb.patch, {})
        got[mb.branch] = pred.clone()
        if len(got) < 2:
            return
        del pending[mb.patch]
        pred = got[0] + scale * (got[1] - got[0])
    rows = adapter.latent_rows(latents, mb.rows[0], mb.rows[1], run.cols)
    dt = sigmas[i + 1] - sigmas[i]
    new = (rows.float() + dt * pred.float()).to(pred.dtype)  # diffusers' Euler, per patch
    rows.copy_(new)
    run.out.send(new, run.head)
