"""`split=auto`: each rank's speed, measured, kept and turned into the split's weights.

The workers measure each rank's own speed during a job (workers/runtime/share_meter.py:
rows x tokens per second in the transformer blocks, their attention's exchange left out).
This module keeps those speeds per pool, refines them after every job (a running mean, so
one noisy job moves them half way), and caches them per GPU model, model family and job
size in a small JSON file, so a later pool on the same GPUs starts from them. Where nothing
is known yet the pool runs a probe first: the job itself for one step, split evenly, which
runs the model's own blocks at the job's size on every rank.

The cache file: $XDIT_SPLIT_CACHE, else ~/.cache/comfyui-xdit/split-speeds.json. A CPU
pool's ranks are all "cpu", so their speeds are kept per rank ("cpu/rank1").
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

HOLDS_BACK = 0.6  # a rank slower than this fraction of the fastest is named in status


def cache_path() -> Path:
    env = os.environ.get("XDIT_SPLIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "comfyui-xdit" / "split-speeds.json"


def job_key(arch: str, request) -> str:
    frames = getattr(request, "frames", None) or 1
    return f"{arch}/{request.height}x{request.width}x{frames}"


class Speeds:
    """One pool's measured speeds per rank, and the cache they are read from and written to."""

    def __init__(self, labels: list):
        self.labels = list(labels)  # per rank: its GPU model ("NVIDIA H100 80GB HBM3"), "cpu/rank1"
        self.speeds: dict = {}  # job key -> [speed per rank]
        self.last: dict = {}  # per rank: the last job's measurement (status)

    def weights(self, key: str) -> tuple:
        """The ranks' weights for a job (their speeds), () where some rank is unknown."""
        got = self.speeds.get(key)
        if got is None:
            got = self._cached(key)
            if got is not None:
                self.speeds[key] = got
        return tuple(got) if got else ()

    def update(self, key: str, stats: list) -> None:
        """Every rank's job stats (their "share" entries) -> refined speeds, cached."""
        measured = {s["rank"]: s["share"] for s in stats or () if s.get("share")}
        if len(measured) != len(self.labels) or \
                any(not m.get("speed") for m in measured.values()):
            return
        new = [float(measured[r]["speed"]) for r in range(len(self.labels))]
        old = self.speeds.get(key)
        speeds = new if old is None else [(a + b) / 2 for a, b in zip(old, new)]
        self.speeds[key] = speeds
        self.last = {r: dict(measured[r]) for r in measured}
        self._store(key, speeds)

    def status(self, weights) -> dict:
        """Each rank's share, its measured speed and own step time, and the rank that holds
        the pool back (with what to do), for `status`."""
        n = len(self.labels)
        w = list(weights) if weights else [1.0] * n
        total = sum(w)
        ranks = [{"rank": r, "gpu": self.labels[r], "share": round(w[r] / total, 4),
                  **({"speed": round(self.last[r]["speed"], 1),
                      "own_s": self.last[r]["own_s"]} if r in self.last else {})}
                 for r in range(n)]
        out = {"ranks": ranks}
        speeds = [self.last[r]["speed"] for r in range(n) if r in self.last]
        if len(speeds) == n and n > 1:
            slow = min(range(n), key=lambda r: speeds[r])
            if speeds[slow] < HOLDS_BACK * max(speeds):
                out["holds_back"] = (
                    f"rank {slow} ({self.labels[slow]}) runs at {speeds[slow] / max(speeds):.0%} "
                    f"of the fastest rank's speed: auto gives it less work; leaving it out "
                    f"of the pool may be faster still")
        return out

    # -- the cache file, per GPU model ---------------------------------------------------
    def _cached(self, key: str) -> Optional[list]:
        table = _read()
        got = [table.get(label, {}).get(key) for label in self.labels]
        return None if any(v is None for v in got) else got

    def _store(self, key: str, speeds: list) -> None:
        table = _read()
        for label, v in zip(self.labels, speeds):
            table.setdefault(label, {})[key] = v
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError:  # a read-only home: the speeds stay in this pool only
            pass


def _read() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def labels_for(device: str, ranks: int, gpu_names: Optional[list] = None) -> list:
    """Each rank's label in the cache: its GPU's model name, or "cpu/rank<r>"."""
    if device == "cuda" and gpu_names and len(gpu_names) == ranks:
        return [str(n) for n in gpu_names]
    return [f"{device}/rank{r}" for r in range(ranks)]
