"""The denoising loop every rank runs: flow-matching Euler, with CFG parallel and data parallel.

Sequence parallelism is invisible here (it lives in the transformer's hooks); this loop only
decides which batch slice (dp) and which guidance branch (cfg) a rank computes, and how the
results come together. Every input arrives in the `Job` broadcast from rank 0, so no rank
derives anything on its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .sequence_parallel import even_sizes
from .topology import Topology


class Cancelled(Exception):
    """The host asked to stop; every rank leaves the loop at the same step."""


@dataclass
class Job:
    """What rank 0 broadcasts: the resolved request plus everything derived from it once."""

    job_id: int
    request: dict  # GenerationRequest fields, defaults resolved
    config: tuple  # ParallelConfig.key()
    noise: torch.Tensor  # [B,16,H/8,W/8] fp32, ComfyUI's prepare_noise
    cond: dict
    uncond: Optional[dict]
    init_latent: Optional[torch.Tensor] = None  # ComfyUI LATENT samples (img2img)
    denoise: float = 1.0
    options: Optional[dict] = None  # PipeFusion: warmup_steps, pipeline_patches


def prepare_noise(seed: int, shape) -> torch.Tensor:
    """Exactly ComfyUI's `comfy.sample.prepare_noise` (no batch_index)."""
    return torch.randn(shape, generator=torch.manual_seed(seed), dtype=torch.float32,
                       device="cpu")


def _stop_requested(should_stop: Callable[[], bool], device) -> bool:
    """Rank 0 decides; one tiny broadcast keeps every rank on the same step."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    if dist.get_rank() == 0 and should_stop():
        flag += 1
    if dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


@dataclass
class Prepared:
    """This rank's part of a job, ready for a denoising loop."""

    sizes: list  # dp batch split
    mine: slice  # this replica's batch slice
    cond: dict
    uncond: Optional[dict]
    latents: torch.Tensor  # packed, model space, at the first timestep
    scheduler: object
    timesteps: torch.Tensor
    begin: int  # first schedule index (img2img starts part-way down)
    extra: dict  # per-size forward inputs (FLUX image ids)


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
    noise = adapter.pack(job.noise[mine].to(dev, dtype))
    latents = noise
    scheduler = adapter.make_scheduler(model)
    timesteps = adapter.timesteps(scheduler, req["steps"], latents, dev)
    begin = 0
    if job.init_latent is not None and job.denoise < 1.0:
        # img2img: start part-way down the schedule from the noised input latent
        steps = req["steps"]
        begin = steps - max(1, int(round(steps * job.denoise)))
        timesteps = timesteps[begin:]
        scheduler.set_begin_index(begin)
        x0 = adapter.from_comfy(model, job.init_latent[mine]).to(dev, dtype)
        sigma = scheduler.sigmas[begin].to(dev, dtype)
        latents = sigma * noise + (1 - sigma) * x0
    return Prepared(sizes=sizes, mine=mine, cond=cond, uncond=uncond, latents=latents,
                    scheduler=scheduler, timesteps=timesteps, begin=begin,
                    extra=adapter.forward_extra(model, req["height"], req["width"]))


def run_job(job: Job, model, adapter, topo: Topology,
            emit: Optional[Callable[[dict], None]] = None,
            should_stop: Callable[[], bool] = lambda: False) -> Optional[torch.Tensor]:
    """Run one job on this rank. Returns the full batch's ComfyUI LATENT on rank 0."""
    req = job.request
    dev = model.device
    height, width = req["height"], req["width"]
    prep = prepare(job, model, adapter, topo)
    collector = None
    if topo.degree("dp") > 1:
        collector = BatchCollector(topo, prep.sizes, (16, height // 8, width // 8), emit, dev)
    if topo.degree("pipefusion") > 1:
        from .pipefusion import run_pipefusion
        try:
            out = run_pipefusion(job, prep, model, adapter, topo, emit, should_stop)
        except Cancelled:
            if collector is not None:
                collector.cancel()
            raise
        if out is None:
            return None
        if collector is None:
            return out.cpu() if topo.rank == 0 else None
        return collector.finish(out)

    cond, uncond, scheduler, begin, extra = (prep.cond, prep.uncond, prep.scheduler,
                                             prep.begin, prep.extra)
    timesteps, latents = prep.timesteps, prep.latents
    use_cfg = uncond is not None
    cfg_parallel = topo.degree("cfg") == 2
    scale = float(req["cfg"])

    def predict(branch: dict) -> torch.Tensor:
        return adapter.forward(model, latents, t, branch, req.get("guidance"), extra)

    t0 = time.perf_counter()
    total = len(timesteps)
    for i, t in enumerate(timesteps):
        if _stop_requested(should_stop, dev):
            if collector is not None:
                collector.cancel()
            raise Cancelled(f"cancelled at step {i}/{total}")
        if cfg_parallel:
            mine_pred = predict(uncond if topo.index("cfg") == 0 else cond)
            both = [torch.empty_like(mine_pred) for _ in range(2)]
            dist.all_gather(both, mine_pred.contiguous(), group=topo.group("cfg"))
            pred = both[0] + scale * (both[1] - both[0])
        elif use_cfg:
            neg = predict(uncond)
            pred = neg + scale * (predict(cond) - neg)
        else:
            pred = predict(cond)
        every = int(req.get("preview_every") or 0)
        want_preview = emit is not None and every and ((i + 1) % every == 0 or i + 1 == total)
        if want_preview:  # flow matching's x0 estimate: x_t - sigma_t * v
            x0 = latents - scheduler.sigmas[begin + i].to(dev, latents.dtype) * pred
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        if emit is not None:
            event = {"step": i + 1, "total": total, "elapsed": time.perf_counter() - t0}
            if want_preview:
                event["preview"] = adapter.to_comfy(model, x0[:1].float(), height, width).half().cpu()
            emit(event)
        if collector is not None:
            collector.poll()

    out = adapter.to_comfy(model, latents.float(), height, width)
    if collector is None:
        return out.cpu() if topo.rank == 0 else None
    return collector.finish(out)


class BatchCollector:
    """Data parallel: rank 0 collects each dp replica's images as soon as that replica is
    done (posted receives, checked between rank 0's own steps), so the host can stream
    finished images before the whole batch is ready."""

    def __init__(self, topo: Topology, sizes: list, shape, emit, device):
        # buffers live on the compute device: NCCL only moves device tensors
        self.topo, self.sizes, self.emit, self.shape = topo, sizes, emit, tuple(shape)
        self.device = device
        self.starts = [sum(sizes[:d]) for d in range(len(sizes))]
        self.parts = {}
        self.pending = {}
        if topo.rank == 0:
            for d in range(1, len(sizes)):
                buf = torch.empty((sizes[d],) + tuple(shape), dtype=torch.float32, device=device)
                self.pending[d] = (dist.irecv(buf, src=self.leader(d)), buf)

    def leader(self, d: int) -> int:
        return self.topo.global_rank(dp=d, cfg=0, pipefusion=0, ring=0, ulysses=0)

    def poll(self, wait: bool = False) -> None:
        for d, (work, buf) in list(self.pending.items()):
            if wait:
                work.wait()
            elif not work.is_completed():
                continue
            del self.pending[d]
            self._arrived(d, buf)

    def _arrived(self, d: int, samples: torch.Tensor) -> None:
        samples = samples.cpu()
        self.parts[d] = samples
        if self.emit is not None:
            for j in range(samples.shape[0]):
                self.emit({"image_index": self.starts[d] + j, "samples": samples[j:j + 1]})

    def cancel(self) -> None:
        """Every rank stops at the same step: settle the posted receives with empty sends so
        none is left to swallow a later job's images."""
        topo = self.topo
        d = topo.index("dp")
        if topo.rank == 0:
            for work, _ in self.pending.values():
                work.wait()
            self.pending = {}
        elif topo.rank == self.leader(d):
            dist.send(torch.zeros((self.sizes[d],) + self.shape, device=self.device), dst=0)

    def finish(self, samples: torch.Tensor) -> Optional[torch.Tensor]:
        topo = self.topo
        d = topo.index("dp")
        if topo.rank == 0:
            self._arrived(0, samples)
            self.poll(wait=True)
            return torch.cat([self.parts[i] for i in range(len(self.sizes))])
        if topo.rank == self.leader(d):
            dist.send(samples.float().contiguous(), dst=0)
        return None
