"""PipeFusion's step strategy: the patch pipeline plugged into the plain loop
(workers/sampling/denoise.py, `StepStrategy`).

The loop's step `i` is the ticks of the job's tick table (parallel/pipefusion/schedule.py) from that step's first
patch on stage 0 to the next step's. At each tick a rank does one grouped exchange with its
neighbours (the activations it computed at the previous tick go to the next stage, this
tick's come from the previous one, and the rows a patch finished go from the last stage back
to stage 0), then computes its micro-batch, if any, as one transformer call with a PatchPlan
(parallel/pipefusion/plan.py). The last stage combines the guidance branches of a patch and takes the Euler step
on its rows; stage 0 reports a step finished once all its rows are back.

A stream the model denoises beside the latent's (a sound track: `Stream.denoised`) goes with
the text: each guidance branch's first patch of a step computes all of its tokens, every
other patch reads their K/V from the cache, and once that patch's branches are done the last
stage steps the stream's rows and sends them back to stage 0 with the patch's latent rows
(the adapter's `denoised_parts` says where they are in the loop's latent).
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import families
from ..parallel.p2p import exchange
from ..parallel.pipefusion.activations import Activations, stage_transfers
from ..parallel.pipefusion.cache import KVCache
from ..parallel.pipefusion.plan import PatchPlan
from ..parallel.pipefusion.schedule import Micro, build_schedule
from .flow_step import combine, combine_across, step_rows


def check_stage(model, topo) -> None:
    """This rank must hold the stage the job's layout gives it."""
    info, stages, stage = model.stage, topo.degree("pipefusion"), topo.index("pipefusion")
    if info is None or info.count != stages or info.index != stage:
        held = "the whole model" if info is None else f"stage {info.index} of {info.count}"
        raise RuntimeError(f"this rank holds {held}, the job asks for stage {stage} of "
                           f"{stages}; relaunch the pool for this pipefusion degree")


class PatchPipeline:
    """One job's PipeFusion on one rank: its tick table, neighbours, activation slots, K/V
    caches and the last stage's half-guided patches (all per job, so nothing stale
    survives)."""

    def __init__(self, job, model, adapter, prep, branches: dict, topo):
        check_stage(model, topo)
        req, opts = job.request, job.options or {}
        self.model, self.adapter, self.prep, self.topo = model, adapter, prep, topo
        self.branches = branches
        n, s = topo.degree("pipefusion"), topo.index("pipefusion")
        self.stage, self.first, self.last = s, s == 0, s == n - 1
        self.prev = topo.global_rank(pipefusion=s - 1) if s > 0 else None
        self.next = topo.global_rank(pipefusion=s + 1) if s < n - 1 else None
        self.head, self.tail = topo.global_rank(pipefusion=0), topo.global_rank(pipefusion=n - 1)
        self.group = topo.group("pipefusion")
        self.cfg_group = topo.group("cfg") if topo.degree("cfg") == 2 else None
        # token rows of the whole sequence (a video's run across its frames, frame by frame)
        self.rows, self.cols = adapter.token_grid(req.height, req.width,
                                                  int(req.frames or 1))
        experts = [e.get("expert") for e in prep.extras]  # Wan 2.2: warm up again at the switch
        self.sched = build_schedule(len(prep.timesteps), n, self.rows, sorted(branches),
                                    warmup=int(opts.get("warmup_steps", 1)),
                                    patches=int(opts.get("pipeline_patches") or n),
                                    restarts=[i for i in range(1, len(experts))
                                              if experts[i] != experts[i - 1]])
        # reference images are context like the text: put first in the image stream, a
        # step's first patch computes them with the text as one token range, so the plans,
        # shards and caches need no second range (with warmup_steps >= steps: exact)
        # (a start frame is no such context: Wan's and HunyuanVideo 1.5's join the noise
        # along channels, LTX-2's is the video's own first frame, `initial_latents`)
        refs = prep.extra.get("ref_tokens") \
            if adapter.family.capability(families.References) else None
        # a family that pads the image to a multiple of tokens (Z-Image's learned pads)
        # puts the pads first in the image stream: context like the references
        self.streams = adapter.layout.streams  # the family's token streams
        m, image = self.streams.latent.pad_multiple, self.rows * self.cols
        self.ref_tokens = (0 if refs is None else int(refs.shape[1])) + (-image) % m
        self.extras = prep.extras if refs is None else [dict(e, references_first=True)
                                                        for e in prep.extras]
        # each branch's tokens of the streams beside the latent's (its own prompt's text)
        self.context = {b: adapter.context_tokens(c) for b, c in branches.items()}
        config = model.transformer.config
        self.hidden = adapter.family.stream_width(config)  # the blocks' activations
        # blocks that pass on several streams by keyword: (keyword, stream, width) each
        self.states = tuple(adapter.stage_states(config))
        self.denoised = None  # {stream: tokens} of the denoised streams (first step)
        self.cache = KVCache(topo)
        self.activations = Activations(topo.sp_rank)
        self.outgoing = None  # (plan, activations) of the previous tick's micro, for the next stage
        self.pending = {}  # last stage, CFG in one pipeline: patch -> negative prediction rows

    def plan(self, m: Micro) -> PatchPlan:
        """A micro's tokens: its rows, after the references, which the branch's first patch
        of a step (the one with the text) computes too."""
        lo, hi = (self.ref_tokens + r * self.cols for r in m.rows)
        tokens = dict(self.context[m.branch], **self.denoised, **{
            self.streams.latent.name: self.ref_tokens + self.rows * self.cols})
        return PatchPlan(self.topo.sp_rank, self.topo.sp, tokens, layout=self.streams,
                         image_range=(0 if m.with_text else lo, hi), with_text=m.with_text,
                         branch=m.branch, cache=self.cache, activations=self.activations,
                         states=tuple((k, s) for k, s, _ in self.states))

    def _rows(self, x, m: Micro):
        latent, _ = self.adapter.denoised_parts(x, self.rows, self.cols)
        return self.adapter.latent_rows(latent, m.rows[0], m.rows[1], self.cols)

    def _pieces(self, x, m: Micro) -> list:
        """The micro's rows of `x` (the loop's latent or a prediction): its latent rows, and
        for a step's first patch every denoised stream's (module doc)."""
        _, parts = self.adapter.denoised_parts(x, self.rows, self.cols)
        return [self._rows(x, m)] + (list(parts.values()) if m.with_text else [])

    def _transfers(self, plan, batch: int) -> list:
        """[(shape, dtype)] of the activations that pass between two stages for `plan`'s
        micro: what the sender checks and the receiver posts (one rule for both)."""
        return stage_transfers(plan, self.topo.sp_rank, batch, self.hidden, self.states,
                               self.model.dtype)

    def _outgoing(self, batch: int) -> list:
        """This rank's sends to the next stage: the activations of the micro it computed at
        the previous tick, checked against that micro's transfers before any is posted (a
        mismatch would hang the pair under NCCL); a state of no tokens is not sent."""
        plan, out = self.outgoing
        self.outgoing = None
        out = out if isinstance(out, list) else [out]
        want = self._transfers(plan, batch)
        got = [(tuple(t.shape), t.dtype) for t in out]
        if got != want:
            raise RuntimeError(f"stage {self.stage} produced activations {got}, the next "
                               f"stage receives {want} for the patch")
        return [(t, self.next) for t, (shape, _) in zip(out, want) if shape[1]]

    def step(self, i: int, latents, finished: Callable[[int], None]) -> None:
        if self.denoised is None:
            _, parts = self.adapter.denoised_parts(latents, self.rows, self.cols)
            self.denoised = {s: int(v.shape[1]) for s, v in parts.items()}
        for tick in self.sched.ticks_of(i):
            self._tick(tick, latents, finished)

    def _tick(self, tick: int, latents, finished) -> None:
        sched, dtype, dev = self.sched, latents.dtype, self.model.device
        micro = sched.compute_at(self.stage, tick)
        plan = None if micro is None else self.plan(micro)
        arrivals = sched.arrivals(tick)
        # 1. transfers: activations to the next stage, finished rows back to stage 0
        sends, recvs = [], []
        if self.outgoing is not None:
            sends += self._outgoing(latents.shape[0])
        incoming = [] if self.first or plan is None else self._transfers(plan, latents.shape[0])
        recvs += [(shape, dt, self.prev) for shape, dt in incoming if shape[1]]
        back = [p for m in arrivals for p in self._pieces(latents, m)]
        for p in back:
            if self.last:
                sends.append((p, self.head))
            if self.first:
                recvs.append((tuple(p.shape), dtype, self.tail))
        got = exchange(sends, recvs, self.group, dev)
        if incoming:
            parts = [got.pop(0) if shape[1] else torch.zeros(shape, dtype=dt, device=dev)
                     for shape, dt in incoming]
            self.activations.incoming = parts if self.states else parts[0]
        if self.first:
            for p, piece in zip(back, got):
                p.copy_(piece)
            for j in sched.steps_done(tick):
                finished(j)
        if micro is None:
            return
        # 2. this tick's forward
        prep = self.prep
        out = self.adapter.forward(self.model, latents, prep.timesteps[micro.step],
                                   self.branches[micro.branch], prep.guidance,
                                   self.extras[micro.step],
                                   jak={"sp_plan": plan})
        if not self.last:
            self.outgoing = (plan, self.activations.take())  # sent at the next tick
            return
        # 3. last stage: guidance, then the scheduler's step on the micro's rows (and, for a
        # step's first patch, the denoised streams')
        preds = self._pieces(out, micro)
        scale, rescale = prep.scales[micro.step], self.adapter.cfg_rescale
        if self.cfg_group is not None:
            preds = [combine_across(p, self.cfg_group, scale, rescale) for p in preds]
        elif len(self.branches) == 2:
            if not micro.finishes:
                self.pending[micro.patch] = [p.clone() for p in preds]
                return
            preds = [combine(n, p, scale, rescale)
                     for n, p in zip(self.pending.pop(micro.patch), preds)]
        pieces = self._pieces(latents, micro)
        # a multistep scheduler (UniPC) keeps its history per row band (step_rows), and
        # per denoised stream under the stream's own key
        step_rows(prep.steps, pieces[0], preds[0], micro.step, micro.rows,
                  lambda t, a, b: self.adapter.latent_rows(t, a, b, self.cols))
        for name, x, v in zip(self.denoised, pieces[1:], preds[1:]):
            x.copy_(prep.steps.step(x, v, micro.step, key="denoised:" + name))

    def close(self) -> None:
        self.cache.clear()
        self.activations.clear()
        self.outgoing, self.pending = None, {}
