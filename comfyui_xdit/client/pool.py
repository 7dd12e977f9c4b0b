"""The persistent worker pool, host side: its API (`WorkerPool`: launch on first use, jobs,
decode, model calls, status, reconfigure, close) over two parts with a job each:
launching and stopping the local workers (launch.py) and the control connection to rank 0,
which watches every worker while it waits (connection.py). A dead worker fails the job,
never hangs it.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from comfyui_xdit.bridge import messages
from comfyui_xdit.bridge import protocol as P
from comfyui_xdit.client import split_auto
from comfyui_xdit.client.channel import Channel, parse_address
from comfyui_xdit.client.connection import PoolConnection
from comfyui_xdit.client.launch import UNPLANNED, PoolLaunch
from comfyui_xdit.comfy_convert import (comfy_to_model, job_noise, latent_shape, latent_shape_text,
                            latents_to_comfy, layout_hint, model_to_comfy, noise_to_model)
from comfyui_xdit.errors import JobCancelled, PoolError  # noqa: F401  (the API's errors)
from comfyui_xdit.planning import calibration, launch_policy
from comfyui_xdit.planning.gpus import gpu_names
from comfyui_xdit.planning.config import ConfigError, EngineOptions, ParallelConfig
from comfyui_xdit.planning.model_info import ModelInfo, read_model_info
from comfyui_xdit.planning.request import GenerationRequest, GenerationResult

_log = logging.getLogger("comfyui_xdit")
_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _check_engine(engine: EngineOptions, config: ParallelConfig) -> None:
    """Engine options a parallel layout cannot run with (shard_weights or compile with
    PipeFusion): one ConfigError before anything launches."""
    out = engine.problems_with(config)
    if out:
        raise ConfigError("invalid configuration: " + "; ".join(out))


class WorkerPool(PoolLaunch, PoolConnection):
    """`WorkerPool(model_path, ParallelConfig(...))`: nothing starts until `generate`."""

    def __init__(self, model_path, config: Optional[ParallelConfig] = None, device: str = "cpu",
                 dtype: str = "fp32", threads_per_rank: Optional[int] = None,
                 gpus: Optional[list] = None, start_timeout: float = 900.0,
                 step_timeout: float = 600.0, load_in_turn: Optional[bool] = None,
                 attention: str = "auto", worker_hooks=(), compile: bool = False,
                 weights: str = "auto", text_encoders: str = "auto",
                 shard_weights: bool = False, memory_plan: Optional[str] = None,
                 model_path_2=None, shard_split="even"):
        """`model_path_2`: Wan 2.2 A14B from two single files, `model_path` the high-noise
        expert's file and this the low-noise one's (checked here, headers only:
        model_info.read_pair). `attention`, `compile`, `weights`, `text_encoders`: see
        `EngineOptions`; `shard_split`: each rank's share of the sharded weights ("even",
        "memory", "3,2": `EngineOptions.shard_split`).
        `memory_plan`: "enforce" refuses a CUDA launch the memory plan predicts will not fit,
        "advise" warns and launches (the plan is an estimate); None: $XDIT_MEMORY_PLAN, else
        enforce. It acts at the next launch (the attribute may be changed before one).
        `worker_hooks`: "module:function" specs every worker runs at start (tests and
        benchmarks: NCCL-rules emulation, communication meter, fault injection; see
        workers/runtime/hooks.py). Not for production use."""
        self.engine = EngineOptions(device=device, dtype=dtype, attention=attention,
                                    compile=compile, weights=weights,
                                    text_encoders=text_encoders,
                                    shard_weights=shard_weights,
                                    shard_split=shard_split).validate()
        self.memory_plan = memory_plan  # validated by the property's setter
        self._memory: dict = {}  # the last launch's plan and measured peaks (status())
        self.attention = attention
        self.worker_hooks = tuple(worker_hooks or ())
        self.model_path = str(Path(model_path).resolve())
        self.model_path_2 = None if model_path_2 is None else str(Path(model_path_2).resolve())
        self._info: Optional[ModelInfo] = None
        if self.model_path_2 is not None:  # refused before anything starts
            self._info = read_model_info(self.model_path, self.model_path_2)
        self.config = config or ParallelConfig()
        self.device = device
        self.dtype = dtype
        self.threads_per_rank = threads_per_rank
        self.gpus = gpus
        self.start_timeout = start_timeout
        self.step_timeout = step_timeout
        # every rank streams its weights tensor by tensor to its device (no host copy), so
        # ranks load at once; load_in_turn=True serialises them (e.g. for .bin folders)
        self.load_in_turn = bool(load_in_turn)
        self._phase = "stopped"
        self._procs: list = []
        self._chan: Optional[Channel] = None
        self._tmp: Optional[str] = None
        self._lock = threading.Lock()
        self._job_id = 0
        self._running_job: Optional[int] = None
        self.launches = 0
        self.last_launch: dict = {}
        self._attached: Optional[tuple] = None  # (address, secret) of an external pool
        self._remote: dict = {}  # rank 0's self-description (model, ranks, state)
        self._progress: dict = {}  # last event of the running job (for status())
        self._split_speeds = None  # split_auto.Speeds: the ranks' measured speeds (auto)
        self._probing = False  # auto's one-step probe is running
        _LIVE_POOLS.add(self)

    @classmethod
    def attach(cls, address, secret, config: Optional[ParallelConfig] = None,
               step_timeout: float = 600.0) -> "WorkerPool":
        """Use a pool started elsewhere (`python -m comfyui_xdit serve` under torchrun).
        `address` is "HOST:PORT" or a tuple; `secret` bytes or hex. `close()` disconnects and
        leaves the external pool running."""
        pool = cls.__new__(cls)
        WorkerPool.__init__(pool, ".", config, step_timeout=step_timeout)
        pool.model_path = pool.model_path_2 = None
        if isinstance(address, str):
            address = parse_address(address)
        if isinstance(secret, str):
            secret = bytes.fromhex(secret.strip())
        pool._attached = (tuple(address), secret)
        pool._config_given = config is not None
        return pool

    # ---- info -----------------------------------------------------------------------
    @property
    def memory_plan(self) -> str:
        return self._memory_mode

    @memory_plan.setter
    def memory_plan(self, value: Optional[str]) -> None:
        self._memory_mode = launch_policy.resolve_mode(value)

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            if self._attached:
                with self._lock:
                    if self._chan is None:
                        self._launch()
                r = self._remote
                single = r.get("kind") == "file"
                self._info = ModelInfo(path=r["model"], arch=r["arch"], heads=r["heads"],
                                       patch_size=r["patch_size"],
                                       kind="file" if single else "diffusers",
                                       has_text_encoders=not single, has_vae=not single,
                                       blocks=r.get("blocks"))
            else:
                self._info = read_model_info(self.model_path, self.model_path_2)
        return self._info

    def worker_pids(self) -> list:
        if self._attached:
            return [r["pid"] for r in self._remote.get("ranks", [])]
        return [p.pid for p in self._procs]

    def is_running(self) -> bool:
        if self._attached:
            return self._chan is not None
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def status(self) -> dict:
        """Ranks, pids, devices, memory per rank and state (idle, loading, running k/n).
        Asks rank 0 when idle; while a job runs, answers from the job's own event stream."""
        if not self.is_running() and self._phase != "loading":
            return self._with_memory({"state": "stopped", "world_size": self.config.ranks,
                                      "ranks": [], "model": self.model_path,
                                      **({"model_2": self.model_path_2}
                                         if self.model_path_2 else {})})
        if self._lock.acquire(blocking=False):
            try:
                self._send(P.StatusQuery())
                msg = self._recv(30.0, "asking for status")
                while not isinstance(msg, P.Status):
                    msg = self._recv(30.0, "asking for status")
                self._remote = msg.info
            finally:
                self._lock.release()
            info = dict(self._remote)
        elif self._phase == "loading":
            return self._with_memory({
                "state": "loading", "world_size": self.config.ranks, "model": self.model_path,
                "ranks": [{"rank": r, "pid": p.pid, "rss_mb": rss_mb(p.pid)}
                          for r, p in enumerate(self._procs)]})
        else:
            info = dict(self._remote, state="running", **self._progress)
        ranks = [dict(r) for r in info.get("ranks", [])]
        if not self._attached:  # local: read each worker's memory now
            for r, p in zip(ranks, self._procs):
                r["rss_mb"] = rss_mb(p.pid)
        info["ranks"] = ranks
        info["attached"] = bool(self._attached)
        info["split"] = self._split_status(info)
        return self._with_memory(info)

    # ---- uneven splits (split_auto.py) -----------------------------------------------
    def _speeds(self, launching: bool = False) -> split_auto.Speeds:
        """The ranks' measured speeds, labelled by their GPU models (CPU: by rank; before a
        launch, nvidia-smi's names of the GPUs the ranks will have)."""
        names = [r.get("gpu_name") for r in self._remote.get("ranks", [])]
        if launching and self.device == "cuda" and not names:
            names = gpu_names(self._rank_gpus() or [])
        labels = split_auto.labels_for(self.device, self.config.ranks,
                                       names if all(names) else None)
        if self._split_speeds is None or self._split_speeds.labels != labels:
            self._split_speeds = split_auto.Speeds(labels)
        return self._split_speeds

    def _auto_weights(self, request, launching: bool = False) -> tuple:
        """auto's weights for this job: the measured (or cached) speeds, () if unknown.
        `launching`: before a launch, where CUDA's GPU models come from nvidia-smi."""
        if self.device == "cuda" and not self.is_running() and not launching:
            return ()  # the GPUs' models are read from the running ranks
        return self._speeds(launching).weights(split_auto.job_key(self.model_info.arch,
                                                                  request))

    def _restage(self, request) -> bool:
        """Whether a running PipeFusion pool under auto holds other stages than the speeds
        now measured for this job give (its stages were chosen before they were known): the
        stages' blocks are loaded at launch, so a relaunch takes them."""
        if self.config.split != "auto" or self.config.pipefusion == 1 or \
                not self.is_running() or self._attached:  # an external pool keeps its own
            return False
        want = self.config.stage_split(self.model_info.blocks, self._auto_weights(request))
        return want != getattr(self, "launched_stages", None)

    def _split_status(self, info: dict) -> dict:
        """The split: its mode, each rank's share and measured speed and own step time,
        and the rank that holds the pool back."""
        weights = (info.get("config") or {}).get("split") or ()
        return {"mode": str(self.config.split), **self._speeds().status(weights)}

    def _with_memory(self, info: dict) -> dict:
        """A CUDA pool's status carries its memory plan: mode, predicted and (after the first
        job) measured MiB per rank, to calibrate the plan with."""
        if self.device == "cuda" and not self._attached:
            info["memory_plan"] = dict(self._memory) or {"mode": self.memory_plan}
        return info

    def reconfigure(self, config: ParallelConfig) -> None:
        """Switch the parallel configuration. The same world size keeps the warm workers
        (they rebuild their process groups); another world size or PipeFusion layout (each
        rank holds one stage's weights) relaunches on next use."""
        config.validate(self.model_info)
        _check_engine(self.engine, config)
        with self._lock:
            if self._procs and config.launch_key(self.model_info) != \
                    self.config.launch_key(self.model_info):
                self._shutdown()
            self.config = config

    # ---- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- jobs -----------------------------------------------------------------------
    def generate(self, request: GenerationRequest,
                 on_event: Optional[Callable[[dict], None]] = None,
                 noise=None, init_latent=None, denoise: float = 1.0,
                 on_launch: Optional[Callable[[str, int, int], None]] = None
                 ) -> GenerationResult:
        """`on_launch(text, done, total)`: progress while the pool starts (see `_launch`)."""
        info = self.model_info
        self.config.validate(info, request)
        auto = self.config.split == "auto"
        if auto and not self._probing and not self._auto_weights(request):
            # nothing measured for these GPUs at this size: the job for one step, split
            # evenly, measures every rank's speed first (comfyui_xdit/client/split_auto.py)
            self._probing = True
            try:
                self.generate(dataclasses.replace(request, steps=1, output="latent"),
                              noise=noise, on_launch=on_launch)  # same tokens, one full step
            finally:
                self._probing = False
            if self._restage(request):  # PipeFusion: stages by the speeds just measured
                self._shutdown()  # are loaded at the relaunch just below
        _check_engine(self.engine, self.config)
        _check_job_inputs(request, noise, init_latent, denoise, info.arch)
        plan = UNPLANNED
        if not self.is_running():
            self._rank_gpus()  # a world the GPUs cannot hold is refused before the launch
            plan = launch_policy.check_pool(self, request)  # so is one their memory cannot
        req = request.resolved(info)
        with self._lock:
            t0 = time.perf_counter()
            launched = False
            if not self.is_running():
                self._shutdown()
                self._stage_speeds = self._auto_weights(request, launching=True) \
                    if auto and self.config.pipefusion > 1 else ()
                self._launch(on_launch, plan)
                launched = True
            t_ready = time.perf_counter()
            self._job_id += 1
            job_id = self._job_id
            # the workers speak model space; ComfyUI's conventions are converted here only
            fmt = self._remote["latent"]
            if noise is None:  # ComfyUI's prepare_noise on the LATENT's shape, drawn once
                noise = job_noise(info.arch, req.seed, req.batch, req.height, req.width,
                                  req.frames)
            refs = req.reference_latents  # ComfyUI LATENTs; the workers convert them
            images = req.reference_images  # [H, W, 3] tensors (resolved); rank 0 encodes
            req = dataclasses.replace(req, reference_latents=None, reference_images=None)
            job = P.Job(job_id=job_id, request=req,
                        config=self.config.degrees(self._auto_weights(request) if auto else ()),
                        noise=noise_to_model(info.arch, noise),
                        init_latent=None if init_latent is None else
                        comfy_to_model(info.arch, init_latent, fmt),
                        denoise=denoise,
                        options=dict(self.config.options(), **({"measure_share": True}
                                                                if auto else {})),
                        references=None if refs is None else
                        [r.detach().float().cpu().contiguous() for r in refs],
                        reference_images=images)

            def to_comfy(latents):
                return model_to_comfy(info.arch, latents, fmt, req.height, req.width)
            self._running_job = job_id  # before sending: a cancel() racing the send counts
            self._send(job)
            first_step = None
            try:
                while True:
                    msg = self._recv(self.step_timeout, f"running job {job_id}")
                    if isinstance(msg, P.Event) and msg.job_id == job_id:
                        if "step" in msg.event:
                            self._progress = {"job_id": job_id, "step": msg.event["step"],
                                              "total": msg.event["total"]}
                        if first_step is None and "step" in msg.event:
                            first_step = time.perf_counter() - t_ready
                        event = dict(msg.event)
                        for key in ("preview", "samples"):  # model space -> ComfyUI's
                            if key in event:
                                event[key] = to_comfy(event[key])
                        if on_event is not None:
                            try:
                                on_event(event)
                            except BaseException:
                                self._cancel_and_drain(job_id)
                                raise
                    elif isinstance(msg, P.Result) and msg.job_id == job_id:
                        self._note_measured(request, msg.stats)
                        if auto:
                            self._speeds().update(split_auto.job_key(info.arch, request),
                                                  msg.stats)
                        return GenerationResult(
                            latents=latents_to_comfy(info.arch, msg.latents, fmt, req.height,
                                                     req.width), decoded=msg.decoded,
                            config=self.config, stats=msg.stats or [],
                            timings={"launch_s": (t_ready - t0) if launched else 0.0,
                                     "first_step_s": first_step,
                                     "job_s": time.perf_counter() - t_ready})
                    elif isinstance(msg, P.Cancelled) and msg.job_id == job_id:
                        raise JobCancelled(f"job cancelled ({msg.reason})")
                    elif isinstance(msg, P.Error):
                        if msg.fatal:  # a dead peer usually shows up as rank 0's error
                            self._raise_fatal(msg.message, f"running job {job_id}")
                        raise PoolError(msg.message)
            finally:
                self._running_job = None
                self._progress = {}

    def _note_measured(self, request: GenerationRequest, stats) -> None:
        """After the first job on a CUDA pool: the plan's per-rank prediction for that job
        beside the ranks' measured CUDA peaks, logged once and kept in status(). A pool
        launched without a job (decode, model calls) is planned for this one first."""
        if self.device != "cuda" or self._attached or not self._memory or \
                self._memory.get("measured_peak_mb") is not None:
            return
        try:
            if self._memory.get("predicted_mb_per_rank") and self._memory.get("job") is None:
                plan = launch_policy.plan_launch(
                    self.model_path, self.config, self.engine,
                    getattr(self, "_launched_gpus", None), request, self.model_path_2)
                self._memory = calibration.plan_status(plan, self.memory_plan)
            line = calibration.record_measured(self._memory, stats, self.config.ranks)
        except Exception as e:  # noqa: BLE001  calibration must never fail a finished job
            _log.debug("xDiT: no memory plan comparison: %s", e)
            return
        if line:
            _log.info("%s", line)

    def decode(self, samples, on_launch: Optional[Callable[[str, int, int], None]] = None,
               full: bool = False):
        """ComfyUI LATENT samples -> IMAGE [B,H,W,3] in 0..1, decoded with the
        model folder's VAE, patch-parallel over every rank (launches the pool if needed).
        Bad input is refused on rank 0 before anything is broadcast: the pool stays warm.
        A video with its sound: samples (video, sound); `full`: the whole Decoded (the
        frames and, with them, the sound's waveform and sample rate)."""
        info = self.model_info
        if not info.has_vae:
            from comfyui_xdit.planning.model_info import NO_VAE
            raise ConfigError(NO_VAE)
        with self._lock:
            if not self.is_running():
                self._shutdown()
                self._launch(on_launch)
            self._job_id += 1
            job_id = self._job_id
            self._running_job = job_id
            self._send(P.Decode(job_id, samples))
            try:
                while True:
                    msg = self._recv(self.step_timeout, f"decoding (job {job_id})")
                    if isinstance(msg, P.Result) and msg.job_id == job_id:
                        return msg.decoded if full else msg.decoded.images
                    if isinstance(msg, P.Error):
                        if msg.fatal:
                            self._raise_fatal(msg.message, f"decoding (job {job_id})")
                        raise PoolError(msg.message)
            finally:
                self._running_job = None

    def model_call(self, config: ParallelConfig, x, timestep, guidance, chunks: list,
                   conds: dict, known: set,
                   on_event: Optional[Callable[[dict], None]] = None, timed: bool = False,
                   cache: Optional[dict] = None, expert: int = 0, loras=(), parts=(),
                   inputs: Optional[dict] = None):
        """One denoiser evaluation (workers/sampling/model_call.py) for a host-side sampler: `x`
        [N, C, h, w] model space, `timestep` [N] (sigma * 1000), `guidance` [N] or None,
        `chunks` [(key, rows)], `conds` {key: Conditioning} (workers/runtime/conditioning.py,
        or a dict of its fields) for every chunk key, of which those in `known` are not sent
        (rank 0 has them). Returns (prediction, stats, keys sent). Launches the pool if
        needed; a bad call leaves it warm.

        Reference latents (FLUX Kontext / ReferenceLatent) belong to a conditioning and are
        cached with it (its `ref_latents`, in x's space, and `ref_method`). The chunks of one
        call must agree on the references' shapes and method. `on_event` receives the call's events: the
        compiling ones of a `compile` pool's first calls (a failing callback is logged, never
        fails the call). `timed` (benchmarks): the stats carry the call's phases
        (`forward_s`, `forward_max_s`: the slowest rank's, `gather_s`, `pre_s`, `post_s`),
        timed with CUDA events on GPUs; untimed calls measure nothing on the device.
        `cache`: the step cache's settings (GenerationRequest.cache; None: off); the rows'
        state lives on the workers per conditioning key, so a sampling run with new keys
        starts fresh, and the stats carry this call's `cache` counts (rank 0's rows).
        Video families (Wan) take `x` [N, C, T, h, w]. `expert`: which transformer of a
        model of several runs the call (Wan 2.2 A14B: 0 the high-noise one, 1 the
        low-noise `transformer_2`); the pool keeps both loaded. `loras`: [(path, strength[,
        expert])] active for this call, as a job's (switched, never reloading the base).
        `parts`: a LATENT of several tensors (workers/sampling/latent_parts.py) travels as
        `x` [N, total] with the parts' per-row shapes here, and so does the prediction;
        `inputs`: the family's scalar model inputs ({name: value}, its ComfySpec's)."""
        from comfyui_xdit.planning.request import cache_problems, resolved_cache
        problems = cache_problems(cache)
        if problems:
            raise ConfigError(problems[0])
        cache = resolved_cache(cache)

        def _np(v):
            return v.detach().cpu().numpy() if hasattr(v, "detach") else v

        config.validate(self.model_info)
        _check_engine(self.engine, config)
        with self._lock:
            if not self.is_running():
                self._shutdown()
                self._launch()
                known = set()
            sent = []
            for _ in range(2):
                self._job_id += 1
                call_id = self._job_id
                new = {k: conds[k] for k, _ in chunks if k not in known and k not in sent}
                sent += list(new)
                self._running_job = call_id
                # latents as numpy: a tensor pickles through torch.save, ~30x slower
                self._send(P.Predict(call_id=call_id, config=config.degrees(), x=_np(x),
                                     timestep=_np(timestep), guidance=_np(guidance),
                                     chunks=[(k, int(r)) for k, r in chunks], conds=new,
                                     timed=timed, cache=cache, expert=int(expert),
                                     loras=[tuple(e) for e in loras],
                                     parts=[list(s) for s in parts],
                                     inputs=dict(inputs or {})))
                try:
                    while True:
                        msg = self._recv(self.step_timeout, f"model call {call_id}")
                        if isinstance(msg, P.Prediction) and msg.call_id == call_id:
                            break
                        if isinstance(msg, P.Event) and msg.job_id == call_id:
                            if on_event is not None:
                                try:
                                    on_event(dict(msg.event))
                                except Exception as e:  # progress display only
                                    _log.debug("model call event callback failed: %s", e)
                            continue
                        if isinstance(msg, P.Error) and msg.job_id in (call_id, None):
                            if msg.fatal:
                                self._raise_fatal(msg.message, f"model call {call_id}")
                            raise PoolError(msg.message)
                finally:
                    self._running_job = None
                if not msg.missing:
                    out = msg.out
                    if out is not None and not hasattr(out, "detach"):  # numpy
                        import torch
                        out = torch.from_numpy(out)
                    return out, dict(msg.stats), sent
                known = set(known) - set(msg.missing)  # the pool forgot them: send again
            raise PoolError(f"the pool kept asking for conditionings {msg.missing}")


def bridge_sound(arch: str):
    """The family's SoundTrack (workers/families), or None."""
    from comfyui_xdit import bridge
    return bridge.latent_layout.sound_of(arch)


def _check_job_inputs(request: GenerationRequest, noise, init_latent, denoise,
                      arch: str) -> None:
    """The tensors `generate` takes beside the request, checked before anything is sent: a
    wrong one is one clear error and the pool stays as it is."""
    import torch

    if not isinstance(denoise, (int, float)) or not 0.0 < float(denoise) <= 1.0:
        raise ConfigError(f"denoise must be in (0, 1] (got {denoise!r})")
    shape = latent_shape(arch, request.batch, request.height, request.width, request.frames)
    sound = bridge_sound(arch)
    if sound is not None:  # a video with its sound: noise is (video noise, sound noise)
        want = (shape, sound.shape(request.batch, request.frames))
        if noise is not None and (not isinstance(noise, (tuple, list)) or len(noise) != 2 or
                                  any(not torch.is_tensor(t) or tuple(t.shape) != w
                                      for t, w in zip(noise, want))):
            raise ConfigError(f"noise must be (video noise {list(want[0])}, sound noise "
                              f"{list(want[1])}) for this request (ComfyUI's AV LATENT)")
        if init_latent is not None:
            raise ConfigError("init_latent (denoise < 1) is not supported for a video with "
                              "its sound yet")
        return
    for name, t in (("noise", noise), ("init_latent", init_latent)):
        if t is not None and (not torch.is_tensor(t) or tuple(t.shape) != shape):
            got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            hint = layout_hint(arch, t)
            raise ConfigError(f"{name} must be a ComfyUI LATENT tensor of shape {list(shape)} "
                              f"{latent_shape_text(arch)} for this request; got {got}"
                              + (f" ({hint})" if hint else ""))


def rss_mb(pid="self") -> float:
    """Resident memory of a process in MiB (Linux /proc; 0 where unavailable)."""
    return messages.rss_mb(pid)


def _close_all() -> None:
    for pool in list(_LIVE_POOLS):
        try:
            pool.close()
        except Exception:
            pass


def stop_all_for_exit() -> None:
    """SIGTERM (client/exit_cleanup.py): every pool's workers stopped and folders removed
    at once, without the pools' locks (the signal may land while a job thread holds one)."""
    for pool in list(_LIVE_POOLS):
        try:
            pool._stop_for_exit()
        except Exception:
            pass


atexit.register(_close_all)
