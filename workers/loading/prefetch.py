"""Checkpoint prefetch: a worker reads its transformer's files while it is still importing.

A worker spends its first seconds importing (torch, diffusers: see docs/performance.md
"Pool overheads") before it can read a byte of weights. It knows its checkpoint at launch
(`--model`, `--model-2`), so `serve.py` starts this reader first: one daemon thread reading
the files sequentially, in large chunks, into one reusable buffer. The bytes go nowhere; the
point is the page cache, so the load that follows (workers/loading/weights.py, unchanged:
it reads the same files the same way) finds them in memory instead of on disk. The prefetch
can never change which bytes are loaded.

Rank r starts r/world of the way through the files and wraps around, so on a cold cache
the ranks read different parts at once and each finds the rest already read by the others.
It stops when the load is done (`stop`), and dies with its process when the pool closes.
Off (with the reason in the status) where a rank reads only part of the files (PipeFusion
stages, weight sharding), where ranks load in turn to bound host memory, where the files
would not fit in half the available memory (they would evict each other), and with
`XDIT_PREFETCH=off`. Reading costs CPU (a cold read on the CI VM: 0.7 s of a core for
432 MB), and the imports keep one core per rank busy, so by default (`auto`) it runs only
where the worker's cores number at least twice the ranks: on the 2-core CI machine a 2-rank
pool's prefetch cost its imports what it saved the load (docs/performance.md).
`XDIT_PREFETCH=on` runs it there too.

Standard library only: it must start before `import torch`.
"""
from __future__ import annotations

import json
import os
import threading
import time

CHUNK = 64 * 2 ** 20  # bytes per read: large and sequential, the disk's best case
ENV = "XDIT_PREFETCH"  # auto (default) | on | off: see the module's docstring


def checkpoint_paths(model: str) -> list:
    """The transformer files a worker will read for `model`: the file itself, or a diffusers
    folder's transformer (and transformer_2) safetensors, shards as the index names them."""
    if os.path.isfile(model):
        return [model]
    out = []
    for sub in ("transformer", "transformer_2"):
        folder = os.path.join(model, sub)
        if not os.path.isdir(folder):
            continue
        names = sorted(os.listdir(folder))
        index = [n for n in names if n.endswith(".safetensors.index.json")]
        if index:
            with open(os.path.join(folder, index[0])) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = [n for n in names if n.endswith(".safetensors")]
        out += [os.path.join(folder, n) for n in files]
    return out


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def off_reason(args, paths, sizes, world: int = 1) -> str | None:
    """Why this worker, one of `world` ranks, should not prefetch (None: it should)."""
    mode = os.environ.get(ENV, "auto").lower()
    if mode in ("off", "0", "no", "false"):
        return f"off (${ENV})"
    if getattr(args, "pipefusion", 1) > 1 or getattr(args, "shard_weights", False):
        return "off (this rank reads only part of the checkpoint)"
    if getattr(args, "load_in_turn", False):
        return "off (ranks load in turn)"
    if not paths:
        return "off (no safetensors checkpoint)"
    avail = _available_bytes()
    if avail is not None and sum(sizes) > avail // 2:
        return "off (the checkpoint is over half the available memory)"
    cores, world = _cores(), max(1, int(world))
    if mode not in ("on", "1", "yes", "true") and cores < 2 * world:
        return f"off ({cores} cores for {world} importing ranks; ${ENV}=on runs it)"
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Prefetch:
    """One background reader over `paths`; `report()` says what it did."""

    def __init__(self, paths, rank: int = 0, world: int = 1, chunk: int = CHUNK,
                 reason: str | None = None):
        self.paths = list(paths)
        self.sizes = [os.path.getsize(p) for p in self.paths] if reason is None else []
        self.rank, self.world, self.chunk = rank, max(1, world), chunk
        self.reason = reason
        self.bytes = 0
        self.seconds = 0.0
        self.state = reason or "reading"
        self._stop = threading.Event()
        self._thread = None

    @classmethod
    def for_worker(cls, args, rank: int, world: int) -> "Prefetch":
        """The prefetch of a worker launched with `args` (serve.py's), started unless off."""
        try:
            paths = checkpoint_paths(args.model)
            if getattr(args, "model_2", None):
                paths += checkpoint_paths(args.model_2)
            sizes = [os.path.getsize(p) for p in paths]
        except (OSError, ValueError, KeyError) as e:  # the load will say what is wrong
            return cls([], reason=f"off ({type(e).__name__})")
        p = cls(paths, rank, world, reason=off_reason(args, paths, sizes, world))
        if p.reason is None:
            p.start()
        return p

    def _spans(self):
        """(path, start, end) ranges in reading order: from this rank's share of the way
        through the concatenated files to the end, then from the beginning."""
        total = sum(self.sizes)
        first = (total * self.rank // self.world) // self.chunk * self.chunk
        at, spans = 0, []
        for path, size in zip(self.paths, self.sizes):
            spans.append((path, at, at + size))
            at += size
        head, tail = [], []
        for path, a, b in spans:
            if b <= first:
                tail.append((path, 0, b - a))
            elif a >= first:
                head.append((path, 0, b - a))
            else:
                head.append((path, first - a, b - a))
                tail.append((path, 0, first - a))
        return head + tail

    def _run(self) -> None:
        t = time.perf_counter()
        buf = bytearray(self.chunk)
        view = memoryview(buf)
        try:
            for path, pos, end in self._spans():
                fd = os.open(path, os.O_RDONLY)
                try:
                    while pos < end and not self._stop.is_set():
                        got = os.preadv(fd, [view[:min(self.chunk, end - pos)]], pos)
                        if got <= 0:
                            break
                        pos += got
                        self.bytes += got
                finally:
                    os.close(fd)
                if self._stop.is_set():
                    break
            self.state = "done" if self.bytes >= sum(self.sizes) else "stopped"
        except OSError as e:  # a prefetch never fails the worker: the load reads anyway
            self.state = f"failed ({e.strerror or e})"
        self.seconds = time.perf_counter() - t

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="xdit-prefetch")
        self._thread.start()

    def stop(self) -> None:
        """Stop reading (the load is done); waits for the current chunk."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self) -> dict:
        """What the status shows: state, bytes read of the checkpoint's, seconds spent."""
        return {"state": self.state, "bytes": self.bytes, "of_bytes": sum(self.sizes),
                "s": round(self.seconds, 3)}
