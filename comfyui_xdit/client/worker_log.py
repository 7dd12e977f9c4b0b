"""A dead worker, said in one sentence: which rank, where it ran, and the exception's own
message read from its log (not a log tail). The full log is kept at a path the message gives
and is printed to the host's console, since the pool's temp folder goes with the pool.

Pure functions of the log text and exit code (tested in CI), plus `keep_logs`.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from typing import Optional

MAX_CAUSE = 400  # characters of the exception message kept in the sentence
KEEP_CRASHES = 20  # crash-log folders kept; older ones are removed
CRASH_ROOT = os.path.join(tempfile.gettempdir(), "xdit-crash-logs")

# A rank that failed only because another one went away: blamed last.
_PEER_LOSS = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|DistBackendError|"
    r"ProcessGroupGloo|recvBytes|sendBytes|parent process \d+ is gone|"
    r"NCCL communicator was aborted|remote process exited|Connection refused",
    re.IGNORECASE)
_SIGNAL_HINTS = {
    signal.SIGKILL: "killed by hand or by the system's out-of-memory killer",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "aborted, usually by a CUDA/NCCL error",
    signal.SIGTERM: "stopped from outside",
}


def exception_line(log_text: str) -> Optional[str]:
    """The final exception of the last Python traceback in a log, as `Type: message` (the
    message's first line; continuation lines joined when the first is only the type)."""
    lines = log_text.splitlines()
    start = None
    for i, ln in enumerate(lines):
        if ln.startswith("Traceback (most recent call last):"):
            start = i
    if start is None:
        return None
    for j in range(start + 1, len(lines)):
        ln = lines[j]
        if not ln.strip() or ln[0].isspace():  # frames, source lines, ^^^^ markers
            continue
        text = ln.strip()
        if text.endswith(":") or text.endswith(": "):  # message on the next lines
            more = [x.strip() for x in lines[j + 1:j + 4] if x.strip()]
            text = " ".join([text] + more)
        return text
    return None


def _shorten(text: str, limit: int = MAX_CAUSE) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def death_cause(returncode: Optional[int], log_text: str) -> str:
    """What killed a worker, in words: the exception's own message when the log has a
    traceback, else the signal (with its usual meaning) or the exit code."""
    exc = exception_line(log_text)
    if exc:
        return _shorten(exc)
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = _SIGNAL_HINTS.get(-returncode)
        return f"killed by {name}" + (f" ({hint})" if hint else "")
    last = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in last if re.search(r"error|fatal|failed", ln, re.IGNORECASE)]
    code = f"exited with code {returncode}" if returncode is not None else "stopped"
    return code + (f": {_shorten(errors[-1])}" if errors else "")


def is_peer_loss(cause: str) -> bool:
    """Whether a cause only says that another rank went away."""
    return bool(_PEER_LOSS.search(cause or ""))


def pick_culprit(dead: list) -> Optional[dict]:
    """From dead ranks `[{"rank", "cause", ...}]`, the one to blame: the first whose cause
    is its own (not a lost peer), else the first."""
    if not dead:
        return None
    own = [d for d in dead if not is_peer_loss(d["cause"])]
    return (own or dead)[0]


def death_sentence(rank: int, cause: str, when: str = "", where: str = "",
                   log_path: Optional[str] = None) -> str:
    """One sentence for the user: `worker rank 2 (GPU 2) failed while running job 3:
    torch.OutOfMemoryError: CUDA out of memory. ... Full log: /tmp/...`."""
    place = f" ({where})" if where else ""
    during = f" {when}" if when else ""
    verb = "was" if cause.startswith("killed by") else "failed"
    if verb == "was":
        head = f"worker rank {rank}{place} was {cause}{during}"
    else:
        head = f"worker rank {rank}{place} failed{during}: {cause}"
    head = head.rstrip(". ")
    return head + (f". Full log: {log_path}" if log_path else ".")


def keep_logs(paths: dict, label: str = "") -> dict:
    """Copy rank logs `{rank: path}` out of a pool's temp folder (removed with the pool)
    into a crash folder under the system temp dir; returns `{rank: kept path}`. Keeps the
    newest KEEP_CRASHES folders."""
    os.makedirs(CRASH_ROOT, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-") + (label or "pool") + "-",
                              dir=CRASH_ROOT)
    kept = {}
    for rank, path in paths.items():
        dst = os.path.join(folder, f"rank{rank}.log")
        try:
            shutil.copyfile(path, dst)
            kept[rank] = dst
        except OSError:
            pass
    try:
        old = sorted((os.path.join(CRASH_ROOT, d) for d in os.listdir(CRASH_ROOT)),
                     key=os.path.getmtime)
        for d in old[:-KEEP_CRASHES]:
            shutil.rmtree(d, ignore_errors=True)
    except OSError:
        pass
    return kept
