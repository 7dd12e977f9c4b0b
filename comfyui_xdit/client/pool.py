"""The persistent worker pool, host side: launch on first use, authenticated control,
streamed events, cancel, and fault detection (a dead worker fails the job, never hangs it).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from comfyui_xdit.client.channel import Channel, connect, parse_address
from comfyui_xdit.client.exit_cleanup import install_sigterm
from comfyui_xdit.client.pool_folders import make_pool_folder
from comfyui_xdit.comfy_convert import (comfy_noise, comfy_to_model, latent_shape, latent_shape_text,
                            layout_hint, model_to_comfy, noise_to_model)
from comfyui_xdit.planning import calibration, launch_policy
from comfyui_xdit.planning.config import ConfigError, EngineOptions, ParallelConfig
from comfyui_xdit.planning.gpus import gpus_for_ranks, text_encoder_gpu
from comfyui_xdit.planning.model_info import ModelInfo, read_model_info
from comfyui_xdit.client.worker_modules import worker_module

P = worker_module("runtime.protocol")  # the typed host <-> rank 0 messages
from comfyui_xdit.planning.request import GenerationRequest, GenerationResult

REPO_ROOT = Path(__file__).resolve().parents[2]
_log = logging.getLogger("comfyui_xdit")
_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
# log lines of workers/runtime/worker.py around each rank's weight load (launch progress)
LOAD_STARTED = "xdit: loading weights"
LOAD_DONE = "xdit: weights loaded"
# each rank's launch breakdown (workers/runtime/worker.py; docs/performance.md "Pool
# overheads") as `last_launch` keeps it; `status()` has the same and, after the first job,
# each rank's "first_job_s"
LAUNCH_KEYS = ("rank", "start_s", "import_s", "setup_s", "prefetch", "load_s", "ready_s",
               "rss_after_import_mb", "load_peak_rss_mb", "rss_mb")


class PoolError(RuntimeError):
    """A job failed inside the pool; the message names the rank and what happened."""


class JobCancelled(PoolError):
    pass


_UNPLANNED = object()  # _launch: no memory plan checked yet for this launch


def _check_engine(engine: EngineOptions, config: ParallelConfig) -> None:
    """Engine options a parallel layout cannot run with (shard_weights or compile with
    PipeFusion): one ConfigError before anything launches."""
    out = engine.problems_with(config)
    if out:
        raise ConfigError("invalid configuration: " + "; ".join(out))


def _default_threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


class WorkerPool:
    """`WorkerPool(model_path, ParallelConfig(...))`: nothing starts until `generate`."""

    def __init__(self, model_path, config: Optional[ParallelConfig] = None, device: str = "cpu",
                 dtype: str = "fp32", threads_per_rank: Optional[int] = None,
                 gpus: Optional[list] = None, start_timeout: float = 900.0,
                 step_timeout: float = 600.0, load_in_turn: Optional[bool] = None,
                 attention: str = "auto", worker_hooks=(), compile: bool = False,
                 weights: str = "auto", text_encoders: str = "auto",
                 shard_weights: bool = False, memory_plan: Optional[str] = None,
                 model_path_2=None):
        """`model_path_2`: Wan 2.2 A14B from two single files, `model_path` the high-noise
        expert's file and this the low-noise one's (checked here, headers only:
        model_info.read_pair). `attention`, `compile`, `weights`, `text_encoders`: see
        `EngineOptions`.
        `memory_plan`: "enforce" refuses a CUDA launch the memory plan predicts will not fit,
        "advise" warns and launches (the plan is an estimate); None: $XDIT_MEMORY_PLAN, else
        enforce. It acts at the next launch (the attribute may be changed before one).
        `worker_hooks`: "module:function" specs every worker runs at start (tests and
        benchmarks: NCCL-rules emulation, communication meter, fault injection; see
        workers/runtime/hooks.py). Not for production use."""
        self.engine = EngineOptions(device=device, dtype=dtype, attention=attention,
                                    compile=compile, weights=weights,
                                    text_encoders=text_encoders,
                                    shard_weights=shard_weights).validate()
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
        return self._with_memory(info)

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
            if self._procs and config.launch_key() != self.config.launch_key():
                self._shutdown()
            self.config = config

    # ---- lifecycle ------------------------------------------------------------------
    def _log_path(self, rank: int) -> str:
        return os.path.join(self._tmp, f"rank{rank}.log")

    def log_tail(self, rank: int, lines: int = 15) -> str:
        try:
            with open(self._log_path(rank), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except (OSError, TypeError):
            return ""

    def _dead(self, when: str = "") -> Optional[str]:
        """One sentence naming the dead rank (the first that died of its own cause, not of a
        lost peer), where it ran and the exception's own message from its log; None while
        every worker lives. The full log is kept (the pool's temp folder goes with it), its
        path is in the sentence and in `last_death`, and it is printed to the console."""
        from comfyui_xdit.client import worker_log as W

        dead = []
        for rank, p in enumerate(self._procs):
            code = p.poll()
            if code is not None:
                try:
                    with open(self._log_path(rank), errors="replace") as f:
                        text = f.read()
                except (OSError, TypeError):
                    text = ""
                dead.append({"rank": rank, "pid": p.pid, "code": code, "log": text,
                             "cause": W.death_cause(code, text)})
        culprit = W.pick_culprit(dead)
        if culprit is None:
            return None
        rank = culprit["rank"]
        kept = {}
        if self._tmp:
            kept = W.keep_logs({r: self._log_path(r) for r in range(len(self._procs))},
                               label=f"rank{rank}")
        gpus = getattr(self, "_launched_gpus", None)
        where = f"GPU {gpus[rank]}" if gpus and rank < len(gpus) else f"pid {culprit['pid']}"
        if when and not when.startswith("while "):
            when = "while " + when
        sentence = W.death_sentence(rank, culprit["cause"], when, where, kept.get(rank))
        self.last_death = {"rank": rank, "cause": culprit["cause"], "log": kept.get(rank),
                           "logs": kept, "message": sentence}
        tail = "".join(culprit["log"].splitlines(keepends=True)[-200:])
        _log.error("xDiT: %s\n---- rank %d log (%s) ----\n%s---- end of rank %d log ----",
                   sentence, rank, kept.get(rank, "not kept"), tail, rank)
        return sentence

    def _connect_attached(self) -> None:
        address, secret = self._attached
        self._chan = connect(address, secret)
        msg = self._recv(self.step_timeout, f"waiting for the pool at {address[0]}:{address[1]}")
        if isinstance(msg, P.Busy):
            self._shutdown()
            raise PoolError(f"the pool at {address[0]}:{address[1]} is in use: {msg.reason}")
        if not isinstance(msg, P.Ready):
            raise PoolError(f"unexpected first message from rank 0: {msg.KIND!r}")
        self._remote = msg.info
        if self._config_given and self.config.ranks != self._remote["world_size"]:
            n = self._remote["world_size"]
            self._shutdown()
            raise ConfigError(f"the pool at {address[0]}:{address[1]} has {n} ranks but "
                              f"{self.config.describe()} = {self.config.ranks}; give a "
                              f"configuration whose degrees multiply to {n}")

    def _rank_gpus(self) -> Optional[list]:
        """CUDA: one GPU id per rank (the GPU list, else the visible GPUs); a world size they
        cannot hold raises one ConfigError naming both (comfyui_xdit/planning/gpus.py)."""
        if self.device != "cuda" or self._attached:
            return None
        gpus = gpus_for_ranks(self.config.ranks, self.gpus)
        text_encoder_gpu(self.engine.text_encoders, gpus)  # so is a text-encoder GPU not there
        return gpus

    def _launch(self, on_launch: Optional[Callable[[str, int, int], None]] = None,
                plan=_UNPLANNED) -> None:
        """`on_launch(text, done, total)`: launch progress ("starting 4 workers",
        "loading 3/4"); whatever it raises (ComfyUI's cancel) stops the half-started pool.
        `plan`: the memory plan `generate` already checked for its job (else the launch
        checks the fixed parts), so a misfit is refused or warned about once."""
        self._phase = "loading"
        try:
            self._launch_inner(on_launch, plan)
        except BaseException:
            if self._chan is None:  # never a half-started pool left behind
                self._shutdown()
            raise
        finally:
            self._phase = "ready" if self._chan is not None else "stopped"

    def _launch_progress(self, on_launch, seen: dict, world: int) -> None:
        """Ranks log LOAD_STARTED / LOAD_DONE (workers/runtime/worker.py) around their weight load:
        counted here from their logs, since the control channel opens only once all are
        loaded."""
        if on_launch is None:
            return
        for rank in range(world):
            if seen.get(rank) == "done":
                continue
            text = self.log_tail(rank, lines=400)
            if LOAD_DONE in text:
                seen[rank] = "done"
            elif LOAD_STARTED in text:
                seen[rank] = "loading"
        done = sum(1 for v in seen.values() if v in ("done",))
        loading = any(v in ("done", "loading") for k, v in seen.items() if isinstance(k, int))
        state = f"loading {done}/{world}" if loading else f"starting {world} workers"
        now = time.monotonic()
        # on a change, and again every second: the caller's cancel check (ComfyUI's
        # progress hook) then lands within a second even in a long phase
        if state != seen.get("_reported") or now - seen.get("_at", 0.0) >= 1.0:
            seen["_reported"], seen["_at"] = state, now
            on_launch(state, done, world)

    def _launch_inner(self, on_launch=None, plan=_UNPLANNED) -> None:
        if self._attached:
            return self._connect_attached()
        t0 = time.perf_counter()
        world = self.config.ranks
        gpus = self._rank_gpus()  # refuses a world the GPUs cannot hold, before anything starts
        if plan is _UNPLANNED:  # and one whose weights their memory cannot (mode "enforce")
            plan = launch_policy.check_pool(self, None, gpus)
        self._memory = calibration.plan_status(plan, self.memory_plan) \
            if self.device == "cuda" else {}
        install_sigterm()  # a pool launched from the main thread (CLI, Python API)
        self._tmp = make_pool_folder()  # (removes the folders of hosts killed outright)
        secret = os.urandom(32)
        secret_file = os.path.join(self._tmp, "secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex())
        addr_file = os.path.join(self._tmp, "address")
        threads = self.threads_per_rank or _default_threads(world)
        te_gpu = text_encoder_gpu(self.engine.text_encoders, gpus or [])
        for rank in range(world):
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                                env.get("PYTHONPATH", "").split(os.pathsep) if p])
            env["GLOO_SOCKET_IFNAME"] = env.get("XDIT_GLOO_IFNAME", "lo")
            env["OMP_NUM_THREADS"] = str(threads)
            env["RANK"] = str(rank)
            engine = self.engine
            if self.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = gpus[rank]  # one GPU per rank
                env["LOCAL_RANK"] = "0"
                if rank == 0 and te_gpu is not None:  # and rank 0 its text encoders' GPU
                    env["CUDA_VISIBLE_DEVICES"] = te_gpu.rank0_visible
                    engine = dataclasses.replace(engine, text_encoders=te_gpu.worker_option)
            cmd = [sys.executable, "-m", "workers.runtime.serve", "--model", self.model_path,
                   *(["--model-2", self.model_path_2] if self.model_path_2 else []),
                   "--rank", str(rank), "--world-size", str(world),
                   "--store", os.path.join(self._tmp, "store"), "--threads", str(threads),
                   *engine.worker_argv()]
            if rank == 0:
                cmd += ["--address-file", addr_file, "--secret-file", secret_file]
            if self.load_in_turn:
                cmd += ["--load-in-turn"]
            for spec in self.worker_hooks:
                cmd += ["--hook", spec]
            if self.config.pipefusion > 1:
                cmd += ["--pipefusion", str(self.config.pipefusion), "--pipefusion-inner",
                        str(self.config.sp), "--pipefusion-split",
                        str(self.config.pipefusion_split)]
            log = open(self._log_path(rank), "wb")
            self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env,
                                                start_new_session=True))
            log.close()
        self._launched_gpus = gpus
        t_spawn = time.perf_counter()
        deadline = time.monotonic() + self.start_timeout
        seen: dict = {}
        while not os.path.exists(addr_file):
            self._check_alive("while starting")
            self._launch_progress(on_launch, seen, world)
            if time.monotonic() > deadline:
                raise PoolError(f"pool did not start within {self.start_timeout:.0f}s")
            time.sleep(0.05)
        self._launch_progress(on_launch, seen, world)  # every rank has loaded by now
        with open(addr_file) as f:
            address = parse_address(f.read())
        self._chan = connect(address, secret)
        msg = self._recv(deadline - time.monotonic(), "while loading")
        if not isinstance(msg, P.Ready):
            raise PoolError(f"unexpected first message from rank 0: {msg.KIND!r}")
        self._remote = msg.info
        self.launches += 1
        self.last_launch = {"spawn_s": t_spawn - t0, "ready_s": time.perf_counter() - t0,
                            "load_s_rank0": msg.info["load_seconds"],
                            "ranks": [{k: r.get(k) for k in LAUNCH_KEYS}
                                      for r in msg.info["ranks"]]}

    def _send(self, msg) -> None:
        self._chan.send(P.to_wire(msg))

    def _check_alive(self, when: str) -> None:
        dead = self._dead(when)
        if dead:
            self._shutdown()
            err = PoolError(dead)
            err.log_path = self.last_death.get("log")
            raise err

    def _recv(self, timeout: float, when: str):
        """Next message from rank 0, watching every worker while waiting."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                if self._chan.poll(0.1):
                    return P.from_wire(self._chan.recv())
            except (ConnectionError, OSError, EOFError):
                time.sleep(0.2)  # let the exit code of a dying worker appear
                self._check_alive(when)
                self._shutdown()
                raise PoolError(f"lost the control connection to rank 0 ({when})") from None
            self._check_alive(when)
            if time.monotonic() > deadline:
                self._shutdown()
                raise PoolError(f"no answer from the pool for {timeout:.0f}s ({when}); "
                                f"workers were stopped")

    def _shutdown(self) -> None:
        """Stop every worker (polite, then SIGTERM, then SIGKILL) and free the port/files."""
        procs, self._procs = self._procs, []
        if self._chan is not None and not self._attached:
            try:
                self._send(P.Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sig in ("terminate", "kill"):
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                getattr(p, sig)()
            for p in alive:
                try:
                    p.wait(timeout=3.0)
                except subprocess.TimeoutExpired:
                    pass
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _stop_for_exit(self) -> None:
        """The host is stopping (SIGTERM): terminate the workers (they exit quietly) and
        remove the pool's folder; no message, no lock, a few seconds at most."""
        procs, tmp = list(self._procs), self._tmp
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 3.0
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- jobs -----------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the running job within one denoising step (safe from any thread)."""
        job, chan = self._running_job, self._chan
        if job is not None and chan is not None:
            try:
                chan.send(P.to_wire(P.Cancel(job)))
            except OSError:
                pass

    def generate(self, request: GenerationRequest,
                 on_event: Optional[Callable[[dict], None]] = None,
                 noise=None, init_latent=None, denoise: float = 1.0,
                 on_launch: Optional[Callable[[str, int, int], None]] = None
                 ) -> GenerationResult:
        """`on_launch(text, done, total)`: progress while the pool starts (see `_launch`)."""
        info = self.model_info
        self.config.validate(info, request)
        _check_engine(self.engine, self.config)
        _check_job_inputs(request, noise, init_latent, denoise, info.arch)
        plan = _UNPLANNED
        if not self.is_running():
            self._rank_gpus()  # a world the GPUs cannot hold is refused before the launch
            plan = launch_policy.check_pool(self, request)  # so is one their memory cannot
        req = request.resolved(info)
        with self._lock:
            t0 = time.perf_counter()
            launched = False
            if not self.is_running():
                self._shutdown()
                self._launch(on_launch, plan)
                launched = True
            t_ready = time.perf_counter()
            self._job_id += 1
            job_id = self._job_id
            # the workers speak model space; ComfyUI's conventions are converted here only
            fmt = self._remote["latent"]
            if noise is None:  # ComfyUI's prepare_noise on the LATENT's shape, drawn once
                noise = comfy_noise(req.seed, latent_shape(info.arch, req.batch, req.height,
                                                           req.width, req.frames))
            refs = req.reference_latents  # ComfyUI LATENTs; the workers convert them
            images = req.reference_images  # [H, W, 3] tensors (resolved); rank 0 encodes
            req = dataclasses.replace(req, reference_latents=None, reference_images=None)
            job = P.Job(job_id=job_id, request=dataclasses.asdict(req), config=self.config.key(),
                        noise=noise_to_model(info.arch, noise),
                        init_latent=None if init_latent is None else
                        comfy_to_model(info.arch, init_latent, fmt),
                        denoise=denoise, options=self.config.options(),
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
                        return GenerationResult(
                            samples=to_comfy(msg.samples), images=msg.images,
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

    def decode(self, samples, on_launch: Optional[Callable[[str, int, int], None]] = None):
        """ComfyUI LATENT samples -> IMAGE [B,H,W,3] in 0..1, decoded with the
        model folder's VAE, patch-parallel over every rank (launches the pool if needed).
        Bad input is refused on rank 0 before anything is broadcast: the pool stays warm."""
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
                        return msg.images
                    if isinstance(msg, P.Error):
                        if msg.fatal:
                            self._raise_fatal(msg.message, f"decoding (job {job_id})")
                        raise PoolError(msg.message)
            finally:
                self._running_job = None

    def model_call(self, config: ParallelConfig, x, timestep, guidance, chunks: list,
                   conds: dict, known: set,
                   on_event: Optional[Callable[[dict], None]] = None, timed: bool = False,
                   cache: Optional[dict] = None, expert: int = 0, loras=()):
        """One denoiser evaluation (workers/sampling/model_call.py) for a host-side sampler: `x`
        [N, C, h, w] model space, `timestep` [N] (sigma * 1000), `guidance` [N] or None,
        `chunks` [(key, rows)], `conds` {key: {"context", "pooled"}} for every chunk key,
        of which those in `known` are not sent (rank 0 has them). Returns (prediction,
        stats, keys sent). Launches the pool if needed; a bad call leaves it warm.

        Reference latents (FLUX Kontext / ReferenceLatent) belong to a conditioning and are
        cached with it: a conds entry may add "ref_latents", a list of tensors
        [rows, C, h, w] in x's space (model space, unpacked: what ComfyUI's FLUX model gets
        as `ref_latents`, sliced to the chunk's rows), and "ref_method" ("offset" (default),
        "index" or "uxo": ComfyUI's `ref_latents_method`). The chunks of one call must
        agree on the references' shapes and method. `on_event` receives the call's events: the
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
        expert])] active for this call, as a job's (switched, never reloading the base)."""
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
                self._send(P.Predict(call_id=call_id, config=config.key(), x=_np(x),
                                     timestep=_np(timestep), guidance=_np(guidance),
                                     chunks=[(k, int(r)) for k, r in chunks], conds=new,
                                     timed=timed, cache=cache, expert=int(expert),
                                     loras=[tuple(e) for e in loras]))
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

    def _raise_fatal(self, reported: str, when: str) -> None:
        """Rank 0 gave up (its collective failed): name the rank that actually died, if one
        did (rank 0's own report is then only the lost peer: it stays in the logs), then
        stop the pool."""
        deadline = time.monotonic() + 2.0
        dead = self._dead(when)
        while dead is None and time.monotonic() < deadline and self._procs:
            time.sleep(0.1)
            dead = self._dead(when)
        self._shutdown()
        if dead:
            err = PoolError(dead)
            err.log_path = self.last_death.get("log")
            raise err
        raise PoolError(" ".join(str(reported).split()))

    def _cancel_and_drain(self, job_id: int) -> None:
        """The caller gave up on the job (e.g. ComfyUI's interrupt): stop it on the workers
        and wait until they are idle again, so the next job starts clean."""
        try:
            self._send(P.Cancel(job_id))
            while True:
                msg = self._recv(self.step_timeout, f"cancelling job {job_id}")
                if isinstance(msg, (P.Cancelled, P.Result, P.Error)) and \
                        msg.job_id in (job_id, None):
                    if isinstance(msg, P.Error) and msg.fatal:
                        self._raise_fatal(msg.message, f"cancelling job {job_id}")
                    return
        except PoolError:
            return


def _check_job_inputs(request: GenerationRequest, noise, init_latent, denoise,
                      arch: str) -> None:
    """The tensors `generate` takes beside the request, checked before anything is sent: a
    wrong one is one clear error and the pool stays as it is."""
    import torch

    if not isinstance(denoise, (int, float)) or not 0.0 < float(denoise) <= 1.0:
        raise ConfigError(f"denoise must be in (0, 1] (got {denoise!r})")
    shape = latent_shape(arch, request.batch, request.height, request.width, request.frames)
    for name, t in (("noise", noise), ("init_latent", init_latent)):
        if t is not None and (not torch.is_tensor(t) or tuple(t.shape) != shape):
            got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            hint = layout_hint(arch, t)
            raise ConfigError(f"{name} must be a ComfyUI LATENT tensor of shape {list(shape)} "
                              f"{latent_shape_text(arch)} for this request; got {got}"
                              + (f" ({hint})" if hint else ""))


def rss_mb(pid="self") -> float:
    """Resident memory of a process in MiB (Linux /proc; 0 where unavailable)."""
    return worker_module("runtime.messages").rss_mb(pid)


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
