"""The one denoising loop every rank runs, for every parallel method.

It is the plain loop: the job's noise (prepared once, `prepare`), then for each step the stop
decision, the step's work, and rank 0's progress event and preview; at the end data
parallel's gather of the batch. The step's work is a `StepStrategy`:

* `WholeImage` (below): each guidance pass of this rank on the whole image (cond, uncond
  and a family's extra passes, workers/sampling/guidance.py), the family's guidance
  combination (in one process, or over the cfg ranks) and the scheduler's step. Exact.
* `PatchPipeline` (patch_pipeline.py, over workers/parallel/pipefusion/): PipeFusion's patch
  pipeline, which owns its tick table, stages, patch transfers and K/V caches.

The stop decision: rank 0 asks the host at the start of each step and tells every rank over
the control plane (gloo), at the same point on every rank. Sequence parallelism is invisible
here (it lives in the transformer's hooks). Everything arrives in the `Job` that rank 0
broadcast (workers/runtime/protocol.py's, as rank 0 prepared it; `job` below); no rank
derives anything on its own. The loop speaks model space (packed latents,
model timesteps); the host converts to ComfyUI's conventions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from ..messages import CACHE_WITH_PIPEFUSION
from ..parallel.sequence_parallel import all_gather_tokens
from ..parallel.shares import dp_weights, sizes_for
from ..parallel.sharding import is_sharded
from ..parallel.topology import Topology, broadcast
from .cache_settings import CacheSettings
from .flow_step import make_steps
from .guidance import assigned, check_degree, forwards_per_rank, gather_passes
from .step_cache import RunCache, call_on_ranks, gated
from .step_scope import no_step_scope


class Cancelled(Exception):
    """The host asked to stop; every rank leaves the loop at the same step."""


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
    steps: object = None  # the scheduler's step (workers/sampling/flow_step.py EulerSteps / UniPCSteps)
    # per step (host values): the guidance scale, and the forward inputs (`extra`, joined by
    # "expert": k for a model of several experts, Wan 2.2's high- / low-noise transformers)
    scales: Optional[list] = None
    extras: Optional[list] = None
    passes: tuple = ()  # the step's guidance passes (workers/sampling/guidance.py), in order
    request: object = None  # the job's request (the family's guidance settings)


def _released_with(scheduler_class: str) -> str:
    """The families whose released scheduler is `scheduler_class`, from the registry (a
    released config without a class name is FlowMatchEuler's, as the FLUX-style ones)."""
    from .. import families
    return ", ".join(f.name for f in families.FAMILIES.values()
                     if f.detection.released({})[0].get(
                         "_class_name", "FlowMatchEulerDiscreteScheduler") == scheduler_class)


def _own_schedulers() -> str:
    """The released schedulers a family's adapter turns into the loop's step itself (its
    `make_scheduler`: MiniMax-H3's two schedules as one Euler step), for the message."""
    from .. import families
    known = ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")
    own = {}
    for f in families.FAMILIES.values():
        name = f.detection.released({})[0].get("_class_name", known[0])
        if name not in known:
            own.setdefault(name, []).append(f.name)
    return "".join(f", and {n} ({', '.join(fs)}) through its adapter" for n, fs in own.items())


def check_scheduler(scheduler) -> None:
    """The loop's step is flow-matching Euler or UniPC with flow prediction on the
    scheduler's sigmas (workers/sampling/flow_step.py): refuse a scheduler configuration it would not
    reproduce, rather than run it wrong."""
    c = scheduler.config
    name = type(scheduler).__name__
    if name == "UniPCMultistepScheduler":
        want = {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                "predict_x0": True, "thresholding": False, "solver_p": None,
                "final_sigmas_type": "zero"}
        for key, value in want.items():
            if c.get(key, value) != value:
                raise ValueError(f"UniPCMultistepScheduler with {key}={c.get(key)!r} is not "
                                 f"supported; the pool runs it with {key}={value!r} (Wan)")
        if c.get("solver_type", "bh2") not in ("bh1", "bh2"):
            raise ValueError(f"UniPC solver_type {c.get('solver_type')!r}: bh1 or bh2")
    elif name != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"scheduler {name} is not supported; the pool runs "
                         f"FlowMatchEulerDiscreteScheduler "
                         f"({_released_with('FlowMatchEulerDiscreteScheduler')}) and flow "
                         f"UniPCMultistepScheduler ({_released_with('UniPCMultistepScheduler')})"
                         + _own_schedulers())
    for key in ("stochastic_sampling", "use_karras_sigmas", "use_exponential_sigmas",
                "use_beta_sigmas"):
        if c.get(key):
            raise ValueError(f"scheduler option {key} is not supported by the pool's loop")


def prepare(job, model, adapter, topo: Topology) -> Prepared:
    req = job.request
    dev, dtype = model.device, model.dtype
    batch = job.noise.shape[0]
    # data parallel: a near-even slice of the batch (3 prompts on dp 2 -> 2 + 1), or rows
    # by the dp slices' weights where the split is uneven (workers/parallel/shares.py)
    sizes = sizes_for(batch, topo.degree("dp"),
                      dp_weights(getattr(job.config, "split", ()), topo))
    start = sum(sizes[: topo.index("dp")])
    mine = slice(start, start + sizes[topo.index("dp")])

    def to_dev(cond):  # host values (a slice's text lengths) stay on the host
        if cond is None:
            return None
        return {k: (v.to(dev, dtype if v.is_floating_point() else None)
                    if torch.is_tensor(v) else v)
                for k, v in adapter.slice_cond(cond, mine).items()}

    cond, uncond = to_dev(job.cond), to_dev(job.uncond)
    passes = tuple(adapter.guidance_passes(model, req))
    if any(p.negative for p in passes) and uncond is None:
        raise RuntimeError("a guidance pass reads the negative prompt, and the job has none")
    check_degree(passes, topo.degree("cfg"))
    # the loop's latents: the model's dtype, or fp32 where the family's pipeline keeps them
    # so (Wan: its multistep history); the adapter's forward casts what the model takes
    noise = job.noise[mine].to(dev, torch.float32 if adapter.latents_fp32 else dtype)
    scheduler = adapter.make_scheduler(model, shift=req.shift)
    check_scheduler(scheduler)
    img2img = job.init_latent is not None and job.denoise < 1.0
    total, begin = schedule_window(req.steps, job.denoise if img2img else 1.0)
    extra = adapter.job_extra(model, req)
    timesteps = adapter.job_timesteps(scheduler, total, noise, dev, extra)[begin:]
    sigmas = scheduler.sigmas[begin:].to(dev, torch.float32)
    latents = noise
    if img2img:  # start part-way down the schedule from the noised input latent
        x0 = job.init_latent[mine].to(dev, noise.dtype)
        latents = (sigmas[0] * noise.float() + (1 - sigmas[0]) * x0.float()).to(noise.dtype)
    if job.reference_inputs is not None:  # a batch of references is sliced like the latents
        for key, v in job.reference_inputs.items():  # the rest: what the adapter's forward needs
            if key == "tokens":   # of them ("ids": FLUX's RoPE ids; "shapes": Qwen's grids)
                extra["ref_tokens"] = (v[mine] if v.shape[0] > 1 else v).to(dev, dtype)
            else:
                extra["ref_" + key] = v.to(dev, dtype) if torch.is_tensor(v) else v
    latents = adapter.initial_latents(latents, extra)  # a start frame's clean tokens (LTX-2)
    # made once here on the device (a fill, not a host copy), so no step waits on the host
    g = req.guidance
    guidance = None if g is None else torch.full((), float(g), device=dev,
                                                  dtype=torch.float32)
    # per step, decided here from host values: which expert, at which guidance scale
    experts = adapter.experts_per_step(model, scheduler, total)[begin:]
    scales = [float(req.cfg) if e == 0 else float(req.cfg_2 or req.cfg)
              for e in experts]
    by_expert = {e: (extra if e == 0 else dict(extra, expert=e)) for e in set(experts)}
    steps = make_steps(scheduler, sigmas, scheduler.sigmas[begin:], begin)
    return Prepared(sizes=sizes, mine=mine, cond=cond, uncond=uncond, latents=latents,
                    sigmas=sigmas, timesteps=timesteps, extra=extra, guidance=guidance,
                    steps=steps, scales=scales, extras=[by_expert[e] for e in experts],
                    passes=passes, request=req)


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
    """PipeFusion's guidance branches (plain CFG): {0: uncond, 1: cond}, or this cfg rank's."""
    if [p.name for p in prep.passes] not in (["cond"], ["uncond", "cond"]):
        raise ValueError(f"PipeFusion runs the cond and uncond passes only; this request's "
                         f"guidance runs {[p.name for p in prep.passes]}: turn the extra "
                         f"guidance off or use another method")
    # its combine is plain CFG: a setting the family's own guide reads (the sound's own cfg,
    # a rescale) would be dropped without a word
    given = getattr(prep.request, "extra_guidance", None)
    if given:
        raise ValueError(f"PipeFusion combines plain CFG only; this request's extra guidance "
                         f"settings {sorted(given)} need the family's own guidance: leave "
                         f"them unset or use another method")
    if prep.uncond is None:
        return {1: prep.cond}
    if topo.degree("cfg") == 2:
        mine = topo.index("cfg")
        return {mine: prep.uncond if mine == 0 else prep.cond}
    return {0: prep.uncond, 1: prep.cond}


class StepStrategy(Protocol):
    """How a rank computes a job's steps, in place on its latents."""

    def step(self, i: int, latents: torch.Tensor, finished: Callable[[int], None]) -> None:
        """Do step i's work; call `finished(j)` the moment step j's result is complete in
        `latents`, on a rank that holds the whole latent (every rank of the exact path,
        stage 0 of a pipeline)."""

    def close(self) -> None:
        """Drop the job's state (also after a cancel or a failure)."""


class WholeImage:
    """The exact step: this rank's guidance passes on the whole image, the family's guidance
    combination (over the cfg ranks: every pass's prediction gathered), the scheduler's step.
    With the step cache (workers/sampling/step_cache.py), each pass of each image is a row
    with its own state; a transformer call skips its middle blocks when all its rows do."""

    def __init__(self, model, adapter, prep: Prepared, topo: Topology,
                 cache=None, control=None, sequence=None):
        self.model, self.adapter, self.prep = model, adapter, prep
        # the forward's sequence plan, for the cache's decision (`sequence`: the installed
        # SequenceParallel, whose plan holds for the duration of one forward)
        self.plan = None if sequence is None else (lambda: sequence.plan)
        n, self.degree = len(prep.passes), topo.degree("cfg")
        self.mine = assigned(n, self.degree, topo.index("cfg"))
        self.cfg_group = topo.group("cfg") if self.degree > 1 else None
        self.topo, self.control, self.cache = topo, control, cache
        self.sharded = is_sharded(model.transformer)
        # weight sharding: every rank runs every block equally often (its last pass again
        # where the passes do not split evenly; the result is not read)
        self.calls = list(self.mine)
        if self.sharded:
            self.calls += self.mine[-1:] * (forwards_per_rank(n, self.degree) - len(self.mine))

    def _forward(self, index, latents, i, padding: bool = False):
        """`padding`: sharding's extra forward, whose result is not read: its rows are the
        step cache's followers (keys None: they skip with the others and keep no state), so
        the real pass's residuals and skip counts are not touched twice a step."""
        p = self.prep
        guide = p.passes[index]
        cond = p.uncond if guide.negative else p.cond
        extra = guide.extra(p.extras[i])
        # rows: (pass, image), and the expert where a model has several (each its own
        # residuals: the first step of the next expert computes)
        expert = extra.get("expert")
        keys = [None if padding else (index, j) if expert is None else (index, j, expert)
                for j in range(p.mine.start, p.mine.stop)]
        call = call_on_ranks(self.cache, self.model, self.adapter, keys, self.topo,
                             self.control, self.cache is not None and self.sharded,
                             self.adapter.transformer_for(self.model, extra), self.plan)
        with gated(call):
            return self.adapter.forward(self.model, latents, p.timesteps[i], cond, p.guidance,
                                        extra)

    def step(self, i: int, latents: torch.Tensor, finished: Callable[[int], None]) -> None:
        p = self.prep
        preds = [self._forward(k, latents, i, padding=c >= len(self.mine))
                 for c, k in enumerate(self.calls)]
        if self.cfg_group is not None:
            preds = gather_passes(preds, len(p.passes), self.degree, self.cfg_group)
        by_name = {g.name: v for g, v in zip(p.passes, preds)}
        pred = self.adapter.guide(by_name, latents, p.sigmas[i], p.scales[i], p.extras[i],
                                  p.request)
        latents.copy_(p.steps.step(latents, pred, i))
        finished(i)

    def close(self) -> None:
        pass


def _strategy(job, model, adapter, prep: Prepared, topo: Topology,
              control=None, cache=None, sequence=None) -> StepStrategy:
    if topo.degree("pipefusion") > 1:  # each step's guidance scale: prep.scales
        if cache is not None:
            raise ValueError(CACHE_WITH_PIPEFUSION)
        from .patch_pipeline import PatchPipeline
        return PatchPipeline(job, model, adapter, prep, _branches(prep, topo), topo)
    return WholeImage(model, adapter, prep, topo, cache, control, sequence)



class _Progress:
    """Rank 0's step events, each `preview_every` steps (and the last) with a low-res
    preview of the first image: flow matching's x0 = x_i - sigma_i * v, v from the step's
    input and output.

    A preview never stalls a step: it is copied to the host without waiting (into pinned
    memory on a GPU) and travels with the next step's event, by when the copy is long done
    (`preview_step` says which step it shows); the last step's preview is read at once (the
    job's result is read there anyway)."""

    def __init__(self, emit, every: int, total: int, sigmas: torch.Tensor, latents,
                 cache=None, as_image=lambda x: x):
        self.emit, self.every, self.total, self.cache = emit, every, total, cache
        self.as_image = as_image  # a preview shows the image part (not a sound track)
        self.sigmas, self.latents = sigmas, latents
        self.t0 = time.perf_counter()
        self.x = latents[:1].clone() if self._wanted(0) else None  # the step's input
        self.pending = None  # (step, host tensor, copy-done event or None)

    def _wanted(self, i: int) -> bool:
        return bool(self.emit is not None and self.every
                    and ((i + 1) % self.every == 0 or i + 1 == self.total))

    def _start_copy(self, i: int) -> None:
        x, s = self.x.float(), self.sigmas
        v = (self.latents[:1].float() - x) / (s[i + 1] - s[i])
        preview = self.as_image(x - s[i] * v).half()
        cuda = preview.is_cuda
        host = torch.empty(preview.shape, dtype=preview.dtype, pin_memory=cuda)
        host.copy_(preview, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        self.pending = (i, host, done)

    def _take(self, event: dict) -> None:
        step, host, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()  # recorded a step ago: complete, no stall
        event["preview"], event["preview_step"] = host, step + 1

    def finished(self, i: int) -> None:
        if self.emit is None:
            return
        event = {"step": i + 1, "total": self.total, "elapsed": time.perf_counter() - self.t0}
        if self.cache is not None:  # rank 0's rows: calls computed in full / cached
            event["cache"] = self.cache.stats()
        if self.pending is not None:  # an earlier step's preview, copied meanwhile
            self._take(event)
        if self._wanted(i):
            self._start_copy(i)
            if i + 1 == self.total:  # the last step's own, in place of an older one
                self._take(event)
        self.emit(event)
        self.x = self.latents[:1].clone() if self._wanted(i + 1) else None


def run_job(job, model, adapter, topo: Topology, control,
            emit: Optional[Callable[[dict], None]] = None,
            should_stop: Callable[[], bool] = lambda: False,
            step_scope=None, report: Optional[dict] = None,
            sequence=None) -> Optional[torch.Tensor]:
    """Run one job on this rank (`control`: the world's control-plane group). Returns the
    whole batch's final latent (model space) on rank 0, None elsewhere. `step_scope(kind,
    step)`: a context entered around each step's work after the stop flag (test hooks that
    watch what a step does, xdit_testhooks/host_syncs.py); none in production. `report`:
    filled with this rank's step-cache counts when the cache is on. `sequence`: the
    SequenceParallel the worker installed (the step cache reads its per-forward plan)."""
    scope = step_scope or no_step_scope
    prep = prepare(job, model, adapter, topo)
    cache = None
    if job.request.cache is not None:
        cache = RunCache(CacheSettings.from_wire(job.request.cache))
    steps = _strategy(job, model, adapter, prep, topo, control, cache, sequence)
    latents = prep.latents.clone()
    total = len(prep.timesteps)
    # each image as the job's result holds it (a family with sound: its video part)
    as_image = (lambda x: adapter.outputs(x, job.request)["samples"])
    progress = _Progress(emit, int(job.request.preview_every or 0), total,
                         prep.sigmas, latents, cache, as_image)
    try:
        for i in range(total):
            if _stop_requested(should_stop, control):
                raise Cancelled(f"cancelled at step {i}/{total}")
            with scope("job", i):
                steps.step(i, latents, progress.finished)
    finally:
        steps.close()
        if cache is not None and report is not None:
            report["cache"] = cache.stats()
    return _gather_batch(latents, prep, topo, emit, as_image)


def _gather_batch(latents, prep: Prepared, topo: Topology, emit,
                  as_image=lambda x: x) -> Optional[torch.Tensor]:
    """Data parallel: the replicas' latents to rank 0 in one all-gather over the dp leaders
    (uneven replicas padded; every replica ends at the same step, so no receive is ever left
    posted). Rank 0 reports each image, then returns the whole batch. Only a replica's
    leader holds its whole latent (a pipeline's stage 0)."""
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
            emit({"image_index": j, "samples": as_image(out[j:j + 1])})
    return out
