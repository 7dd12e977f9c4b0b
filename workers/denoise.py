"""The one denoising loop every rank runs, for every parallel method.

The loop walks the job's tick table (workers/schedule.py). Without PipeFusion a tick is one
guidance branch of one step on the whole image; with PipeFusion each stage computes one
patch per tick. Written once here, for every method:

* the stop decision: rank 0 asks the host at the start of each step and tells every rank
  over the control plane (gloo), at the same tick on every rank;
* the transfers between ticks: one grouped exchange with the neighbour stages (data plane);
* the guidance combination (CFG in one process, or over the cfg ranks: one all-gather of
  the two predictions on the data plane);
* the scheduler's step (flow-matching Euler, on the rows a micro-batch finished);
* progress events and previews (rank 0), and data parallel's gather of the batch.

Sequence parallelism is invisible here (it lives in the transformer's hooks). Everything
arrives in the `Job` that rank 0 broadcast; no rank derives anything on its own. The loop
speaks model space (packed latents, model timesteps); the host converts to ComfyUI's
conventions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .hooks import no_step_scope
from .p2p import exchange
from .schedule import Micro, build_schedule
from .sequence_parallel import all_gather_tokens, even_sizes
from .topology import Topology, all_gather, broadcast


class Cancelled(Exception):
    """The host asked to stop; every rank leaves the loop at the same step."""


@dataclass
class Job:
    """What rank 0 broadcasts: the resolved request plus everything derived from it once."""

    job_id: int
    request: dict  # GenerationRequest fields, defaults resolved
    config: tuple  # ParallelConfig.key()
    noise: torch.Tensor  # model space (packed for FLUX), fp32, the whole batch
    cond: dict
    uncond: Optional[dict]
    init_latent: Optional[torch.Tensor] = None  # model space, the whole batch (img2img)
    denoise: float = 1.0
    options: Optional[dict] = None  # PipeFusion: warmup_steps, pipeline_patches
    # reference images: {"tokens": [1 or B, M, C] model space, "ids": [M, axes]}, shared by
    # both guidance branches (the adapter joins them to the image stream)
    references: Optional[dict] = None


def schedule_window(steps: int, denoise: float) -> tuple:
    """(schedule length, first index) of ComfyUI's KSampler rule: with denoise < 1 it builds
    the schedule for int(steps / denoise) steps and runs the last `steps` of them."""
    if denoise >= 1.0:
        return steps, 0
    total = max(steps, int(steps / denoise))
    return total, total - steps


@dataclass
class Prepared:
    """This rank's part of a job, ready for the loop."""

    sizes: list  # dp batch split
    mine: slice  # this replica's batch slice
    cond: dict
    uncond: Optional[dict]
    latents: torch.Tensor  # model space, at the first timestep
    sigmas: torch.Tensor  # the run's sigmas, one more than timesteps (fp32, device)
    timesteps: torch.Tensor
    extra: dict  # per-size forward inputs (FLUX image ids, this replica's references)
    guidance: Optional[torch.Tensor] = None  # embedded guidance, a device scalar (or None)


def check_scheduler(scheduler) -> None:
    """The loop's step is flow-matching Euler on the scheduler's sigmas: refuse a scheduler
    configuration it would not reproduce, rather than run it wrong."""
    c = scheduler.config
    if type(scheduler).__name__ != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"scheduler {type(scheduler).__name__} is not supported; the pool "
                         f"runs FlowMatchEulerDiscreteScheduler (FLUX, SD3)")
    for key in ("stochastic_sampling", "use_karras_sigmas", "use_exponential_sigmas",
                "use_beta_sigmas"):
        if c.get(key):
            raise ValueError(f"scheduler option {key} is not supported by the pool's loop")


def prepare(job: Job, model, adapter, topo: Topology) -> Prepared:
    req = job.request
    dev, dtype = model.device, model.dtype
    batch = job.noise.shape[0]
    # data parallel: a near-even slice of the batch (3 prompts on dp 2 -> 2 + 1)
    sizes = even_sizes(batch, topo.degree("dp"))
    start = sum(sizes[: topo.index("dp")])
    mine = slice(start, start + sizes[topo.index("dp")])

    def to_dev(cond):
        return None if cond is None else {k: v.to(dev, dtype if v.is_floating_point() else None)
                                          for k, v in adapter.slice_cond(cond, mine).items()}

    cond, uncond = to_dev(job.cond), to_dev(job.uncond)
    if topo.degree("cfg") == 2 and uncond is None:
        raise RuntimeError("cfg-parallel job without a negative branch")
    noise = job.noise[mine].to(dev, dtype)
    scheduler = adapter.make_scheduler(model)
    check_scheduler(scheduler)
    img2img = job.init_latent is not None and job.denoise < 1.0
    total, begin = schedule_window(req["steps"], job.denoise if img2img else 1.0)
    timesteps = adapter.timesteps(scheduler, total, noise, dev)[begin:]
    sigmas = scheduler.sigmas[begin:].to(dev, torch.float32)
    latents = noise
    if img2img:  # start part-way down the schedule from the noised input latent
        x0 = job.init_latent[mine].to(dev, dtype)
        latents = (sigmas[0] * noise.float() + (1 - sigmas[0]) * x0.float()).to(dtype)
    extra = adapter.forward_extra(model, req["height"], req["width"])
    if job.references is not None:  # a batch of references is sliced like the latents
        tokens = job.references["tokens"]
        extra["ref_tokens"] = (tokens[mine] if tokens.shape[0] > 1 else tokens).to(dev, dtype)
        extra["ref_ids"] = job.references["ids"].to(dev, extra["img_ids"].dtype)
    # made once here on the device (a fill, not a host copy), so no step waits on the host
    g = req.get("guidance")
    guidance = None if g is None else torch.full((), float(g), device=dev,
                                                  dtype=torch.float32)
    return Prepared(sizes=sizes, mine=mine, cond=cond, uncond=uncond, latents=latents,
                    sigmas=sigmas, timesteps=timesteps, extra=extra, guidance=guidance)


def euler_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step without noise: x + (sigma_{i+1} - sigma_i) v,
    in fp32, back to the prediction's dtype (rows or the whole latent alike)."""
    return (x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(v.dtype)


def combine(neg: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance (SD3's guidance scale, FLUX's true CFG)."""
    return neg + scale * (pos - neg)


def _stop_requested(should_stop: Callable[[], bool], control) -> bool:
    """Rank 0 decides; one tiny broadcast on the control plane keeps every rank on the same
    step."""
    flag = torch.zeros(1, dtype=torch.int32)
    if dist.get_rank() == 0 and should_stop():
        flag += 1
    if dist.get_world_size(control) > 1:
        broadcast(flag, src=0, group=control)
    return bool(flag.item())


def _branches(prep: Prepared, topo: Topology) -> dict:
    if prep.uncond is None:
        return {1: prep.cond}
    if topo.degree("cfg") == 2:
        mine = topo.index("cfg")
        return {mine: prep.uncond if mine == 0 else prep.cond}
    return {0: prep.uncond, 1: prep.cond}


def run_job(job: Job, model, adapter, topo: Topology, control,
            emit: Optional[Callable[[dict], None]] = None,
            should_stop: Callable[[], bool] = lambda: False,
            step_scope=None) -> Optional[torch.Tensor]:
    """Run one job on this rank (`control`: the world's control-plane group). Returns the
    whole batch's final latent (model space) on rank 0, None elsewhere. `step_scope(kind,
    step)`: a context entered around each tick's work after the stop flag (test hooks that
    watch what a step does, xdit_testhooks/host_syncs.py); none in production."""
    scope = step_scope or no_step_scope
    req = job.request
    dev, dtype = model.device, model.dtype
    prep = prepare(job, model, adapter, topo)
    branches = _branches(prep, topo)
    stages, stage = topo.degree("pipefusion"), topo.index("pipefusion")
    rows, cols = req["height"] // 16, req["width"] // 16
    opts = job.options or {}
    sched = build_schedule(len(prep.timesteps), stages, rows, sorted(branches),
                           warmup=int(opts.get("warmup_steps", 1)),
                           patches=int(opts.get("pipeline_patches") or stages))
    run = None
    if stages > 1:
        from .pipefusion import PipelineRun, check_stage
        check_stage(model, topo)
        run = PipelineRun(topo=topo, rows=rows, cols=cols, batch=prep.latents.shape[0],
                          text_len={b: c["encoder_hidden_states"].shape[1]
                                    for b, c in branches.items()},
                          hidden=int(model.transformer.config.num_attention_heads)
                          * int(model.transformer.config.attention_head_dim), device=dev,
                          ref_tokens=int(prep.extra["ref_tokens"].shape[1])
                          if "ref_tokens" in prep.extra else 0)
    pipe = topo.group("pipefusion")
    latents = prep.latents.clone()
    sigmas, scale = prep.sigmas, float(req["cfg"])
    total = sched.steps
    every = int(req.get("preview_every") or 0)
    t0 = time.perf_counter()
    first, last = stage == 0, stage == stages - 1
    outgoing = None  # activations computed at the previous tick, for the next stage
    pending = {}  # last stage, CFG in one pipeline: patch -> negative prediction rows

    def want_preview(i):
        return emit is not None and every and ((i + 1) % every == 0 or i + 1 == total)

    # stage 0: the first image at the start of a step whose preview is wanted
    x_step = latents[:1].clone() if (first and want_preview(0)) else None

    def rows_of(x, m: Micro):
        return adapter.latent_rows(x, m.rows[0], m.rows[1], cols)

    try:
        for tick in range(sched.ticks):
            if tick in sched.stop_ticks and _stop_requested(should_stop, control):
                raise Cancelled(f"cancelled at step {sched.stop_ticks[tick]}/{total}")
            micro = sched.compute_at(stage, tick)
            with scope("job", None if micro is None else micro.step):
                arrivals = sched.arrivals(tick) if stages > 1 else []
                # 1. transfers: activations to the next stage, finished rows back to stage 0
                sends, recvs = [], []
                if outgoing is not None:
                    sends.append((outgoing, run.next))
                    outgoing = None
                if run is not None and not first and micro is not None:
                    recvs.append((run.activation_shape(micro), dtype, run.prev))
                for m in arrivals:
                    if last:
                        sends.append((rows_of(latents, m), run.head))
                    if first:
                        recvs.append((tuple(rows_of(latents, m).shape), dtype, run.tail))
                got = exchange(sends, recvs, pipe, dev)
                if run is not None and not first and micro is not None:
                    run.incoming = got.pop(0)
                if first:
                    for m, piece in zip(arrivals, got):
                        rows_of(latents, m).copy_(piece)
                    for i in sched.steps_done(tick):
                        if emit is None:
                            continue
                        event = {"step": i + 1, "total": total,
                                 "elapsed": time.perf_counter() - t0}
                        if want_preview(i):  # flow matching: x0 = x_i - sigma_i * v
                            x = x_step.float()
                            v = (latents[:1].float() - x) / (sigmas[i + 1] - sigmas[i])
                            event["preview"] = (x - sigmas[i] * v).half().cpu()
                        emit(event)
                        x_step = latents[:1].clone() if want_preview(i + 1) else None
                if micro is None:
                    continue
                # 2. this tick's forward
                t = prep.timesteps[micro.step]
                jak = None
                if run is not None:
                    jak = {"patch": run.context(micro)}
                out = adapter.forward(model, latents, t, branches[micro.branch], prep.guidance,
                                      prep.extra, jak=jak)
                if run is not None and not last:
                    outgoing = run.take_outgoing()
                    continue
                # 3. last stage: guidance, then the scheduler's step on the micro's rows
                pred = rows_of(out, micro) if run is not None else out
                if topo.degree("cfg") == 2:
                    both = [torch.empty_like(pred) for _ in range(2)]
                    all_gather(both, pred.contiguous(), group=topo.group("cfg"))
                    pred = combine(both[0], both[1], scale)
                elif len(branches) == 2:
                    if not micro.finishes:
                        pending[micro.patch] = pred.clone()
                        continue
                    pred = combine(pending.pop(micro.patch), pred, scale)
                x = rows_of(latents, micro)
                x.copy_(euler_step(x, pred, sigmas, micro.step))
    finally:
        if run is not None:
            run.close()
    return _gather_batch(latents, prep, topo, emit) if first else None


def _gather_batch(latents, prep: Prepared, topo: Topology, emit) -> Optional[torch.Tensor]:
    """Data parallel: the replicas' latents to rank 0 in one all-gather over the dp leaders
    (uneven replicas padded; every replica ends at the same tick, so no receive is ever left
    posted). Rank 0 reports each image, then returns the whole batch."""
    leader = all(topo.index(a) == 0 for a in ("cfg", "pipefusion", "ring", "ulysses"))
    if topo.degree("dp") == 1:
        return latents.float().cpu() if topo.rank == 0 else None
    if not leader:
        return None
    gathered = all_gather_tokens(latents.float(), 0, prep.sizes, topo.group("dp"))
    if topo.rank != 0:
        return None
    out = gathered.cpu()
    if emit is not None:
        for j in range(out.shape[0]):
            emit({"image_index": j, "samples": out[j:j + 1]})
    return out
