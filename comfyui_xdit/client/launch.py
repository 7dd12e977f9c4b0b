"""Launching a local pool's workers: one `python -m workers.runtime.serve` process per rank
(forked from the preloaded helper or a plain process: comfyui_xdit/client/rank_launcher.py),
their logs and launch progress, the sentence naming a dead one, and stopping them all.

`PoolLaunch` is the part of `WorkerPool` (comfyui_xdit/client/pool.py) that owns the worker
processes (`_procs`) and the pool's private folder (`_tmp`: secret, address, logs); an
attached pool (`WorkerPool.attach`) launches nothing and only connects.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from comfyui_xdit.bridge import protocol as P
from comfyui_xdit.client import rank_launcher
from comfyui_xdit.client.channel import connect, parse_address
from comfyui_xdit.client.exit_cleanup import install_sigterm
from comfyui_xdit.client.pool_folders import make_pool_folder
from comfyui_xdit.errors import PoolError
from comfyui_xdit.planning import calibration, launch_policy
from comfyui_xdit.planning.gpus import gpu_memory_bytes, gpus_for_ranks, text_encoder_gpu

REPO_ROOT = Path(__file__).resolve().parents[2]
_log = logging.getLogger("comfyui_xdit")
# log lines of workers/runtime/worker.py around each rank's weight load (launch progress)
LOAD_STARTED = "xdit: loading weights"
LOAD_DONE = "xdit: weights loaded"
# each rank's launch breakdown (workers/runtime/worker.py; docs/performance.md "Pool
# overheads") as `last_launch` keeps it; `status()` has the same and, after the first job,
# each rank's "first_job_s". A rank forked from the preloaded helper finds the import floor
# already imported: its import_s is then ~0 and its start_s the fork's, not an interpreter's;
# `last_launch["launcher"]` says which ("preload" or "spawn"), and its spawn_s holds the
# helper's own start when a launch had to start one.
LAUNCH_KEYS = ("rank", "start_s", "import_s", "setup_s", "prefetch", "load_s", "ready_s",
               "rss_after_import_mb", "load_peak_rss_mb", "rss_mb")

UNPLANNED = object()  # _launch: no memory plan checked yet for this launch


def _default_threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _launcher_name(procs) -> str:
    """"preload" when every rank was forked by the preloaded helper, else "spawn"."""
    forked = all(isinstance(p, rank_launcher.ForkedRank) for p in procs)
    return "preload" if procs and forked else "spawn"


class PoolLaunch:
    """A local pool's worker processes, from launch to stop (mixed into `WorkerPool`)."""

    def _rank_gpus(self) -> Optional[list]:
        """CUDA: one GPU id per rank (the GPU list, else the visible GPUs); a world size they
        cannot hold raises one ConfigError naming both (comfyui_xdit/planning/gpus.py)."""
        if self.device != "cuda" or self._attached:
            return None
        gpus = gpus_for_ranks(self.config.ranks, self.gpus)
        text_encoder_gpu(self.engine.text_encoders, gpus)  # so is a text-encoder GPU not there
        return gpus

    def _launch(self, on_launch: Optional[Callable[[str, int, int], None]] = None,
                plan=UNPLANNED) -> None:
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

    def _launch_inner(self, on_launch=None, plan=UNPLANNED) -> None:
        if self._attached:
            return self._connect_attached()
        t0 = time.perf_counter()
        world = self.config.ranks
        gpus = self._rank_gpus()  # refuses a world the GPUs cannot hold, before anything starts
        if plan is UNPLANNED:  # and one whose weights their memory cannot (mode "enforce")
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
        shard_w = self.engine.shard_weights_for(  # by memory: each rank's GPU's size
            world, gpu_memory_bytes(gpus) if gpus else None)
        self.shard_weights_split = shard_w
        # PipeFusion's stages: under split=auto, by the speeds known for this launch's job
        # (`_stage_speeds`, set by the pool before it launches; () while nothing is measured)
        stages = self.config.stage_split(self.model_info.blocks,
                                         getattr(self, "_stage_speeds", ()))
        self.launched_stages = stages if self.config.pipefusion > 1 else None
        # a model with a transformer per guidance branch, under CFG parallel: each rank
        # loads its branch's only (weight sharding spreads it over that branch's ranks,
        # which alone run it: a gather over every rank would pair the two transformers)
        branches = self.config.branch_layout(self.model_info.family)
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
                   *engine.worker_argv(),
                   *(["--shard-split", ",".join(f"{x:g}" for x in shard_w)] if shard_w else [])]
            if rank == 0:
                cmd += ["--address-file", addr_file, "--secret-file", secret_file]
            if self.load_in_turn:
                cmd += ["--load-in-turn"]
            for spec in self.worker_hooks:
                cmd += ["--hook", spec]
            if branches:
                cmd += ["--branch", branches[rank], "--branch-layout", ",".join(branches)]
            if self.config.pipefusion > 1:
                cmd += ["--pipefusion", str(self.config.pipefusion), "--pipefusion-inner",
                        str(self.config.sp), "--pipefusion-split", stages]
            self._procs.append(rank_launcher.start_rank(cmd, env, self._log_path(rank)))
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
        self.last_launch = {"launcher": _launcher_name(self._procs), "spawn_s": t_spawn - t0, "ready_s": time.perf_counter() - t0,
                            "load_s_rank0": msg.info["load_seconds"],
                            "ranks": [{k: r.get(k) for k in LAUNCH_KEYS}
                                      for r in msg.info["ranks"]]}

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
                # a forked rank whose helper died says so (its own exit code cannot)
                cause = getattr(p, "failure", None) or W.death_cause(code, text)
                dead.append({"rank": rank, "pid": p.pid, "code": code, "log": text,
                             "cause": cause})
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
