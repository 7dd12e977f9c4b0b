"""The warm worker pools, without ComfyUI: one `PoolRegistry` (`REGISTRY`) keeps a pool per
(model, device, dtype, gpus, engine options). Node re-execution and cache eviction only look
the pool up; another parallel configuration reconfigures it (same ranks: the warm workers
keep their weights) or replaces it; pools of different models stay warm side by side while
they fit in memory together. It also holds what the status panel shows."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from comfyui_xdit.nodes.handles import ModelHandle
from comfyui_xdit.nodes.node_text import error_text
from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.pool_fit import to_close

log = logging.getLogger("comfyui_xdit")


class PoolRegistry:
    """Warm pools by (path, device, dtype, gpus, ..., path_2); each pool's config follows the
    last job.

    Pools of different models stay warm side by side while the memory plan says they fit
    together on their GPUs (or in host memory), the least recently used closing first when a
    new one would not fit (planning/pool_fit.py); `max_pools` caps their number. So a graph
    with two xDiT models (a Qwen-Image still and a Wan video) keeps both pools warm."""

    def __init__(self, max_pools: int = 4, pool_factory=None, fit=None):
        """`fit(kept, new) -> pools to close` (default pool_fit.to_close); tests give
        their own."""
        self._pools: dict = {}  # (path, device, dtype, gpus) -> WorkerPool
        self._lock = threading.RLock()
        self.max_pools = max_pools
        self._factory = pool_factory
        self._fit = fit or to_close
        self.last_error: Optional[str] = None
        self.last_error_log: Optional[str] = None  # a dead worker's kept log
        self.last_job: dict = {}
        self.last_decode_text = ""  # what the last Decode ran (its node text)
        self.launching: Optional[str] = None  # "starting 2 workers", "loading 1/2", ...

    @staticmethod
    def _key(handle: ModelHandle) -> tuple:
        return (handle.path, handle.device, handle.dtype, handle.gpus, handle.threads_per_rank,
                handle.attention, handle.compile, handle.weights, handle.text_encoders,
                handle.shard_weights, handle.shard_split, handle.path_2)

    def get(self, handle: ModelHandle, config: ParallelConfig):
        """The pool for `handle` running `config`: the same one on every call with the same
        arguments (re-executed nodes do not spawn workers); another config replaces it."""
        from comfyui_xdit.client.pool import WorkerPool

        key = self._key(handle)
        with self._lock:
            pool = self._pools.pop(key, None)
            if pool is not None:
                self._pools[key] = pool  # most recently used last
            if pool is not None and pool.config != config:
                if pool.config.ranks == config.ranks:
                    pool.reconfigure(config)  # same ranks: warm workers, new process groups
                else:
                    self._close(key)
                    pool = None
            if pool is None:
                for other in list(self._pools)[: max(0, len(self._pools) - self.max_pools + 1)]:
                    self._close(other)
                factory = self._factory or WorkerPool
                # engine options away from their defaults only (test factories take **kw)
                kw = {k: getattr(handle, k) for k, default in
                      (("attention", "auto"), ("compile", False), ("weights", "auto"),
                       ("text_encoders", "auto"), ("shard_weights", False),
                       ("shard_split", "even"))
                      if getattr(handle, k) != default}
                if handle.memory_plan != "auto":
                    kw["memory_plan"] = handle.memory_plan
                if handle.path_2 is not None:  # Wan 2.2 A14B from its two expert files
                    kw["model_path_2"] = handle.path_2
                pool = factory(handle.path, config, device=handle.device, dtype=handle.dtype,
                               gpus=list(handle.gpus) if handle.gpus else None,
                               threads_per_rank=handle.threads_per_rank, **kw)
                by_id = {id(p): k for k, p in self._pools.items()}
                for other in self._fit(list(self._pools.values()), pool):
                    log.info("xDiT: closing the pool of %s: it and %s do not fit in "
                             "memory together", by_id[id(other)][0], handle.path)
                    self._close(by_id[id(other)])
                self._pools[key] = pool
            else:  # not in the key: the mode only acts at the pool's next launch
                pool.memory_plan = handle.memory_plan
            return pool

    def pool_for_decode(self, handle: ModelHandle):
        """The warm pool of `handle` as it is (a decode runs on any configuration of the
        right model); a new one with the handle's configuration if there is none."""
        with self._lock:
            pool = self._pools.get(self._key(handle))
            if pool is not None:
                return pool
        return self.get(handle, handle.config_for(None))

    def pools(self) -> list:
        with self._lock:
            return list(self._pools.values())

    def _close(self, key) -> None:
        pool = self._pools.pop(key, None)
        if pool is not None:
            pool.close()

    def unload_all(self) -> int:
        """Stop every pool and forget it; returns how many were stopped."""
        with self._lock:
            keys = list(self._pools)
            for k in keys:
                self._close(k)
            return len(keys)

    def restart_all(self) -> int:
        """Stop every pool's workers but keep it: the next job relaunches it."""
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            return len(self._pools)

    def status(self) -> dict:
        out = []
        for pool in self.pools():
            try:
                st = pool.status()
            except Exception as e:  # a status request must never raise into the server
                st = {"state": "error", "error": str(e)}
            st = dict(st)
            st.setdefault("model", pool.model_path)
            st["config"] = pool.config.describe()
            st["world_size"] = pool.config.ranks
            st["device"] = pool.device
            st["dtype"] = pool.dtype
            st["launches"] = pool.launches
            out.append(_jsonable(with_shares(st)))
        return {"pools": out, "last_error": self.last_error,
                "last_error_log": self.last_error_log, "launching": self.launching,
                "last_job": _jsonable(self.last_job)}

    def job_started(self) -> None:
        """A new job: the last one's error is history (the panel stops showing it)."""
        self.last_error = None
        self.last_error_log = None

    def job_failed(self, e: BaseException) -> None:
        self.last_error = error_text(e)
        self.last_error_log = getattr(e, "log_path", None)

    def launch_callback(self, on_launch: Optional[Callable[[str, int, int], None]] = None):
        """Wraps a node's launch-progress callback so the panel shows the launch too."""
        def cb(text: str, done: int, total: int) -> None:
            self.launching = text
            if on_launch is not None:
                on_launch(text, done, total)
        return cb


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


REGISTRY = PoolRegistry()


def with_shares(st: dict) -> dict:
    """A pool's status as the panel reads it: each rank's row also carries its share of the
    work (`share`, a fraction), its measured block time in the last job (`step_s`) and speed,
    and, where weights are sharded by weight, its share of the weights (`weight_share`); a
    rank that holds the pool back is named in `slow_rank` with the suggestion
    (comfyui_xdit/client/split_auto.py)."""
    split = st.get("split") or {}
    by_rank = {r.get("rank"): r for r in split.get("ranks") or ()}
    shard_w = (st.get("sharding") or {}).get("shard_split") or ()
    rows = []
    for row in st.get("ranks") or ():
        row = dict(row)
        got = by_rank.get(row.get("rank"), {})
        if "share" in got:
            row["share"] = got["share"]
        if "own_s" in got:
            row["step_s"] = got["own_s"]
        if "speed" in got:
            row["speed"] = got["speed"]
        if shard_w and isinstance(row.get("rank"), int) and row["rank"] < len(shard_w):
            row["weight_share"] = round(shard_w[row["rank"]] / sum(shard_w), 4)
        rows.append(row)
    if rows:
        st["ranks"] = rows
    if split.get("holds_back"):
        st["slow_rank"] = split["holds_back"]
    if split.get("mode"):
        st["split_mode"] = split["mode"]
    return st
