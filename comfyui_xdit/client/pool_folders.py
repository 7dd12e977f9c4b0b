"""A pool's private folder (its secret, address, rendezvous store and rank logs) under the
temp dir, and the sweep that removes the folders of hosts that are gone.

A host that exits or is signalled removes its own folder; one killed with SIGKILL cannot, so
its secret would stay on disk. Each folder therefore records its host (pid and the process's
start time, so a reused pid is not taken for the host), and every launch removes the folders
whose host is no longer running. A live pool's folder is never touched, and a folder without
the record (another program's, or an older version's) is left alone."""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

PREFIX = "xdit-pool-"
_HOST_FILE = "host.json"


def _start_time(pid: int):
    """The process's start time in clock ticks since boot (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _host_alive(record: dict) -> bool:
    pid = int(record["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    started = record.get("started")
    return started is None or _start_time(pid) in (None, started)


def remove_stale(tmpdir=None) -> list:
    """Remove the pool folders whose host is gone; -> the folders removed."""
    removed = []
    for folder in glob.glob(os.path.join(tmpdir or tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(folder, _HOST_FILE)) as f:
                record = json.load(f)
            if _host_alive(record):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no record, or not ours: leave it
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def make_pool_folder() -> str:
    """A new private folder for a pool of this process, after sweeping stale ones."""
    remove_stale()
    folder = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(folder, _HOST_FILE), "w") as f:
        json.dump({"pid": os.getpid(), "started": _start_time(os.getpid())}, f)
    return folder
