"""How a local pool starts its ranks: forked from a preloaded helper (the default), or as
plain `python -m workers.runtime.serve` processes (`XDIT_LAUNCHER=spawn`).

The helper (workers/runtime/preloader.py) is one long-lived child of the host per launch
environment that has already imported torch, diffusers, transformers and the worker's
modules, so a rank starts in milliseconds instead of paying those imports' 4-5 s of CPU. It
is our own small zygote over a Unix socket, not multiprocessing's forkserver: the forkserver
is one per interpreter with process-wide preload settings (ComfyUI or another node pack may
use it too), re-imports the host's `__main__` in every child (ComfyUI's main.py), swallows
a failed preload silently, and has no way to give a child a new session, an environment of
its own or a log file as stdout.

A rank forked there behaves as the subprocess would (see the helper's docstring); the pool
keeps `ForkedRank` objects in `_procs`, with Popen's poll/wait/terminate/kill/pid/
returncode. Ranks are signalled through the helper (their parent, so never a reaped pid).
One helper serves one environment (the rank's minus RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES,
which each rank sets before anything reads them, and minus our own XDIT_* switches, read
only when used) and working folder, so whatever torch or a library read at import (libgomp
reads OMP_NUM_THREADS when it loads) is what the rank would have read; another environment
gets its own helper; idle helpers beyond a few are closed.

A helper that cannot start or refuses (preloading failed, a thread or CUDA's driver found
in it) or dies is replaced by plain processes with one logged warning: the ranks then run
exactly as with `XDIT_LAUNCHER=spawn`, so results do not change, only the launch's time.
A refusal holds for its environment `RETRY_S`, then a launch tries a helper again (the
cause may have gone). A helper starts outside the registry's lock: a slow start holds up
only launches of its own environment. The helper leaves with the host: it exits when its
socket to the host closes (the host exited, was killed or closed it at exit), and its ranks
leave with it (their parent watch): such a rank is a failure (`ForkedRank.failure` says
why), not the parent watch's exit 0.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from comfyui_xdit.errors import ConfigError

ENV = "XDIT_LAUNCHER"
CHOICES = ("preload", "spawn")
PER_RANK = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")  # set in each forked rank
KEEP_IDLE = 2  # helpers without a live rank kept for later launches
START_TIMEOUT_S = 300.0
RETRY_S = 60.0  # a refused environment tries a helper again after this
HELPER_GONE = 1  # the exit code of a rank whose helper died under it
_log = logging.getLogger("comfyui_xdit")


def choice() -> str:
    """The launcher $XDIT_LAUNCHER names (default "preload"); a wrong name raises."""
    value = os.environ.get(ENV, "").strip().lower() or "preload"
    if value not in CHOICES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(CHOICES)}")
    return value


class Unavailable(RuntimeError):
    """The preloaded launcher cannot serve (why in the message)."""


class ForkedRank:
    """A rank forked by a helper, with the Popen methods the pool uses."""

    def __init__(self, helper: "Helper", pid: int, args: list):
        self._helper, self.pid, self.args = helper, pid, args
        self.returncode: Optional[int] = None

    @property
    def failure(self) -> Optional[str]:
        """Why the rank ended, where its own exit code cannot say: its helper died."""
        return self._helper.lost.get(self.pid)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._helper.collect()
            self.returncode = self._helper.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._helper.signal(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Helper:
    """One preloaded helper process and the socket to it."""

    def __init__(self, env: dict, cwd: str):
        self._lock = threading.Lock()
        self._codes: dict = {}  # pid -> exit code, from the helper's reports
        self.lost: dict = {}  # pid -> why, for ranks that left with their dead helper
        self._live: set = set()
        self.gone = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workers.runtime.preloader", "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        msg = self._recv(START_TIMEOUT_S)
        if msg is None or msg.get("op") != "ready":
            why = (msg or {}).get("why") or "it exited while preloading"
            self.close()
            raise Unavailable(why)
        self.import_s = msg["import_s"]

    def _recv(self, timeout: float) -> Optional[dict]:
        poller = select.poll()  # not select.select: a busy host's fd may be above 1023
        poller.register(self._sock, select.POLLIN)
        if not poller.poll(max(0, int(timeout * 1000))):
            return None
        try:
            data = self._sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self.gone = True
            return None
        return json.loads(data)

    def _take(self, msg: dict) -> None:
        if msg.get("op") == "exit":
            self._codes[msg["pid"]] = msg["code"]
            self._live.discard(msg["pid"])

    def collect(self) -> None:
        """Read the exit reports waiting on the socket (without blocking)."""
        with self._lock:
            while not self.gone:
                msg = self._recv(0.0)
                if msg is None:
                    break
                self._take(msg)

    def exit_code(self, pid: int) -> Optional[int]:
        if pid in self._codes:
            return self._codes[pid]
        if self.gone and not _alive(pid):
            # the helper died: its ranks left with their parent watch, whose exit 0 would
            # read as success
            self.lost[pid] = f"its preloaded launcher (pid {self.proc.pid}) {self._end()}, " \
                             f"and the rank left with it"
            self._codes[pid] = HELPER_GONE
            return HELPER_GONE
        return None

    def _end(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "closed its socket"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def start(self, argv: list, env: dict, log_path: str) -> ForkedRank:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with self._lock:
                if self.gone:
                    raise Unavailable("the helper exited")
                msg = {"op": "start", "argv": argv, "env": env, "cwd": os.getcwd()}
                try:
                    socket.send_fds(self._sock, [json.dumps(msg).encode()], [fd])
                except OSError as e:
                    self.gone = True
                    raise Unavailable(f"the helper went away ({e})") from e
                deadline = time.monotonic() + 30.0
                while True:
                    reply = self._recv(deadline - time.monotonic())
                    if reply is None:
                        # it may have forked the rank all the same: closing the helper takes
                        # such a rank with it, so the plain process started next is alone
                        self.close()
                        raise Unavailable("the helper did not start the rank")
                    if reply.get("op") == "started":
                        break
                    if reply.get("op") == "rejected":
                        raise Unavailable(f"the helper rejected the start: {reply.get('why')}")
                    self._take(reply)
                self._live.add(reply["pid"])
        finally:
            os.close(fd)
        return ForkedRank(self, reply["pid"], argv)

    def signal(self, pid: int, sig: int) -> None:
        with self._lock:
            if not self.gone:
                try:
                    self._sock.send(json.dumps({"op": "signal", "pid": pid,
                                                "sig": int(sig)}).encode())
                    return
                except OSError:
                    self.gone = True
        try:  # no helper: the rank is the init process's child now
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def idle(self) -> bool:
        self.collect()
        return not self._live

    def close(self) -> None:
        """Close the socket: the helper exits (its ranks follow through their parent watch)."""
        self.gone = True
        self._sock.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_helpers: dict = {}  # launch environment -> Helper, oldest first
_refused: dict = {}  # launch environment -> (why its helper could not serve, retry after)
_starting: dict = {}  # launch environment -> the lock its helper's start holds
_registry_lock = threading.Lock()
_clock = time.monotonic


def _helper_env(rank_env: dict) -> dict:
    env = {k: v for k, v in rank_env.items() if k not in PER_RANK}
    env.update({k: os.environ[k] for k in PER_RANK if k in os.environ})
    return env


def helper_key(env: dict) -> tuple:
    """Launches whose helpers would import alike share one. Our own XDIT_* switches are
    read when used, never at import (tests/test_rank_launcher.py checks), and pytest's
    PYTEST_CURRENT_TEST names each test (a helper per test otherwise): neither counts."""
    return (json.dumps(sorted((k, v) for k, v in env.items()
                              if not k.startswith(("XDIT_", "PYTEST_")))),
            os.getcwd(), sys.executable)


def _helper_for(rank_env: dict) -> Helper:
    env = _helper_env(rank_env)
    key = helper_key(env)
    with _registry_lock:
        gate = _starting.setdefault(key, threading.Lock())
    with gate:  # one start per environment; the registry's lock is held only briefly
        with _registry_lock:
            why, until = _refused.get(key, ("", 0.0))
            if why and _clock() < until:
                raise Unavailable(why)
            helper = _helpers.get(key)
            stale = _helpers.pop(key) if helper is not None and helper.gone else None
        if stale is not None:
            stale.close()  # its socket and process too, not only our entry
            helper = None
        if helper is not None:
            return helper
        try:
            helper = Helper(env, os.getcwd())
        except (Unavailable, OSError) as e:
            with _registry_lock:
                _refused[key] = (str(e), _clock() + RETRY_S)
            raise Unavailable(str(e)) from e
        with _registry_lock:
            _refused.pop(key, None)
            idle = [k for k, h in _helpers.items() if h.idle()]
            closing = [_helpers.pop(k) for k in idle[:max(0, len(idle) - KEEP_IDLE + 1)]]
            _helpers[key] = helper
        for h in closing:
            h.close()
        return helper


def start_rank(cmd: list, env: dict, log_path: str):
    """Start one rank (`cmd`: python -m workers.runtime.serve ARGV) with `env`, its output
    in `log_path`, in a new session: a ForkedRank from the preloaded helper, else (spawn
    chosen, or no helper: logged once per environment) a subprocess.Popen."""
    if choice() == "preload":
        try:
            return _helper_for(env).start(cmd[3:], env, log_path)
        except Unavailable as e:
            _warn_once(str(e))
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


_warned: set = set()


def _warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        _log.warning("xDiT: the preloaded rank launcher is not available (%s); ranks start "
                     "as plain processes (%s=spawn), same results, slower launch", why, ENV)


def close_all() -> None:
    """Stop every helper (host exit)."""
    with _registry_lock:
        helpers = list(_helpers.values())
        _helpers.clear()
    for h in helpers:
        try:
            h.close()
        except OSError:
            pass


atexit.register(close_all)
