"""The preloaded rank launcher's process (host side: comfyui_xdit/client/rank_launcher.py).

A long-lived helper of the host that imports what every rank imports before its work
(torch, diffusers, transformers, yunchang, peft, the worker's modules, each family's
transformer, adapter and VAE classes) once, then forks each rank from there: a rank skips
the 4-5 s of CPU those imports cost a fresh `python -m workers.runtime.serve`.

Fork after importing torch is safe only while nothing here has started a thread pool or
touched CUDA: no torch op runs here, no thread is started, and the helper refuses to serve
(the host then launches plain processes) when a Python thread runs or CUDA's driver library
was loaded after its imports. A native thread a BLAS library started at load (numpy's
OpenBLAS when OMP_NUM_THREADS > 1) is shut down by the library's own fork handler.

Messages: one JSON object per SOCK_SEQPACKET message on the socket inherited as fd
`--fd`. Host -> helper: {"op": "start", "argv", "env", "cwd"} with the rank's log file
descriptor attached; {"op": "signal", "pid", "sig"}. Helper -> host: {"op": "ready",
"import_s"} or {"op": "refused", "why"} once, {"op": "started", "pid"} per start,
{"op": "exit", "pid", "code"} per rank that ended (`code` as subprocess's returncode), and
{"op": "rejected", "why"} (one line) for a message it cannot act on (a start without its
log file, say), after which it goes on serving.

A forked rank then does what `python -m workers.runtime.serve ARGV` with that environment
and working folder would (and says it is a rank where ps and top look: `_title`): new session, its own environment before anything reads it, log
file on stdout and stderr, /dev/null on stdin, the module run as __main__, the
interpreter's own exit (atexit, threads joined, streams flushed). The helper leaves when
the host does (its socket closes) or when its parent changes.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time

MAX_MSG = 1 << 20


def _preload() -> None:
    """Import what every rank imports before its work; no op runs, no thread starts."""
    import diffusers
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import yunchang  # noqa: F401
    try:
        import peft  # noqa: F401  (diffusers' hooks import it whenever it is installed)
    except ImportError:
        pass
    from workers import families
    from . import control, serve, worker  # noqa: F401
    # a class this install lacks is skipped here: a rank of that family meets it itself
    for fam in families.FAMILIES.values():
        for load in (lambda: getattr(diffusers, fam.classes.transformer), fam.adapter_class):
            try:
                load()
            except (ImportError, AttributeError):
                pass
    for name in families.vae_classes():
        getattr(diffusers, name, None)


def unsafe_to_fork() -> str:
    """Why forking from this process would not be safe, or "" when it is."""
    import threading

    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads run"
    try:
        with open("/proc/self/maps") as f:
            if any("libcuda.so" in line for line in f):
                return "CUDA's driver library was loaded"
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised"
    return ""


def _send(sock, msg: dict, fds=()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)  # -N for a signal, as subprocess reports


def _serve(sock, parent: int):
    """The helper's loop; returns (request, log fd) in a forked rank, None when it ends."""
    alive: set = set()
    while True:
        if os.getppid() != parent:
            return None
        while alive:  # reap: each ended rank is reported once
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            alive.discard(pid)
            _send(sock, {"op": "exit", "pid": pid, "code": _code(status)})
        ready, _, _ = select.select([sock], [], [], 0.05)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 4)
        if not data:  # the host is gone
            return None
        msg, why = _message(data, fds)
        if why:
            for fd in fds:
                os.close(fd)
            _send(sock, {"op": "rejected", "why": why})
            continue
        if msg["op"] == "signal":
            if msg["pid"] in alive:  # never a pid this helper has reaped
                try:
                    os.kill(msg["pid"], msg["sig"])
                except ProcessLookupError:
                    pass
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            return msg, fds[0]
        for fd in fds:
            os.close(fd)
        alive.add(pid)
        _send(sock, {"op": "started", "pid": pid})


def _message(data: bytes, fds: list) -> tuple:
    """(the message, "") or (None, why it cannot be acted on, in one line)."""
    try:
        msg = json.loads(data)
    except ValueError:
        return None, "a message that is not JSON"
    op = msg.get("op") if isinstance(msg, dict) else None
    if op == "signal":
        ok = all(isinstance(msg.get(k), int) for k in ("pid", "sig")) and not fds
        return (msg, "") if ok else (None, "a signal message needs an int pid and sig, no fd")
    if op != "start":
        return None, f"unknown message {str(op)[:40]!r}; expected start or signal"
    if len(fds) != 1:
        return None, (f"a start message carries {len(fds)} file descriptors; it needs "
                      f"exactly one, the rank's log file")
    if not (isinstance(msg.get("argv"), list) and isinstance(msg.get("env"), dict)
            and isinstance(msg.get("cwd"), str)):
        return None, "a start message needs argv (a list), env (an object) and cwd"
    return msg, ""


def _title(rank: str) -> None:
    """Say in ps and top that this forked process is a rank, not the helper whose image it
    is: its name (prctl PR_SET_NAME, what `ps -e` and top show) and its command line
    (`ps -f`, `ps aux`: the helper's argv memory, rewritten in place, no longer than it was;
    only where the kernel's /proc/self/stat says where it lies and it holds what
    /proc/self/cmdline reads). Either is skipped where unavailable."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(f"xdit-rank{rank}".encode()[:15]), 0, 0, 0)
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        with open("/proc/self/cmdline", "rb") as f:
            now = f.read()
        if end <= start or ctypes.string_at(start, end - start) != now:
            return
        title = f"xdit rank {rank} (workers.runtime.serve, forked by the preloader)".encode()
        title = title[:end - start - 1]
        ctypes.memmove(start, title + b"\0" * (end - start - len(title)), end - start)
    except (OSError, AttributeError, ValueError, IndexError):
        pass


def _become_rank(msg: dict, log_fd: int) -> None:
    """In the forked child: turn into `python -m workers.runtime.serve ARGV`."""
    import random
    import runpy

    os.setsid()
    _title(str(msg["env"].get("RANK", "")))
    os.environ.clear()
    os.environ.update(msg["env"])
    os.chdir(msg["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    random.seed()  # a fresh process's own state, not the helper's copy
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    from . import serve

    sys.argv = [serve.__file__, *msg["argv"]]
    # as `python -m` finds it: not yet imported (the preloaded copy would make runpy warn
    # in every rank's log that __main__ and the package's module differ)
    sys.modules.pop("workers.runtime.serve", None)
    runpy.run_module("workers.runtime.serve", run_name="__main__", alter_sys=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="xdit-preloader")
    p.add_argument("--fd", type=int, required=True, help="the host's socket (inherited)")
    args = p.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    parent = os.getppid()
    t0 = time.perf_counter()
    try:
        _preload()
    except Exception as e:  # the host launches plain processes and logs why
        _send(sock, {"op": "refused", "why": f"preloading failed: {type(e).__name__}: {e}"})
        return None
    why = unsafe_to_fork()
    if why:
        _send(sock, {"op": "refused", "why": why})
        return None
    _send(sock, {"op": "ready", "import_s": time.perf_counter() - t0})
    return _serve(sock, parent)


if __name__ == "__main__":
    child = main()
    if child is not None:  # a forked rank: the helper's frames are gone, the rank runs here
        _become_rank(*child)
