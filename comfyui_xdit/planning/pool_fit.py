"""Which warm pools may stay beside a new one: as many as fit together in memory.

A graph with two xDiT models (a Qwen-Image still and a Wan video, say) would otherwise
replace one pool with the other on every run, relaunching and reloading each time. Each
pool's footprint is what the memory plan says it holds between jobs (weights, text encoders,
VAE, the CUDA reserve), per GPU it uses (CUDA) or in host memory (CPU: the ranks' plan less
the CUDA reserve). Pools stay while every GPU's (or the host's) sum fits its capacity; the
least recently used close first until the new one fits. A footprint or capacity that cannot
be known counts as not fitting beside others (the safe side: one pool, as before).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

from comfyui_xdit.planning import gpus as gpus_mod
from comfyui_xdit.planning.memory_arithmetic import plan
from comfyui_xdit.planning.model_facts import model_facts

_log = logging.getLogger("comfyui_xdit")
HOST = "host"
HOST_SHARE = 0.8  # of physical memory the pools may hold together (the rest: ComfyUI, OS)


def footprint(pool) -> Optional[dict]:
    """{memory: bytes} a pool holds between jobs: "gpu:<id>" per CUDA GPU, or "host" for a
    CPU pool; None where the plan cannot be made (an attached pool holds nothing here)."""
    if getattr(pool, "_attached", None):
        return {}
    try:
        facts = model_facts(pool.model_path, pool.engine.dtype)
        if getattr(pool, "model_path_2", None):  # a Wan 2.2 A14B pair of files
            import dataclasses
            facts = dataclasses.replace(facts, experts=2)
        p = plan(facts, pool.config.with_world_size(None), pool.engine, None)
    except Exception as e:  # noqa: BLE001  unknown: handled as "does not fit beside others"
        _log.debug("xDiT: no footprint for %s: %s", getattr(pool, "model_path", pool), e)
        return None
    if pool.device != "cuda":
        return {HOST: sum(max(0, r.total - r.reserve) for r in p.ranks)}
    gpus = getattr(pool, "_launched_gpus", None) or gpus_mod.gpus_for_ranks(pool.config.ranks,
                                                                            pool.gpus)
    out: dict = {}
    for gpu, r in zip(gpus, p.ranks):
        out[f"gpu:{gpu}"] = out.get(f"gpu:{gpu}", 0) + int(r.total)
    return out


def capacity(memory: str) -> Optional[int]:
    """Bytes a memory offers the pools: a GPU's total, or HOST_SHARE of physical memory."""
    if memory == HOST:
        try:
            import psutil
            return int(psutil.virtual_memory().total * HOST_SHARE)
        except Exception:  # noqa: BLE001
            return None
    return gpus_mod.gpu_memory_bytes([memory[len("gpu:"):]])[0]


def fits(footprints: Iterable[Optional[dict]],
         capacity_of: Callable[[str], Optional[int]] = capacity) -> bool:
    """Whether these pools fit together: every memory's sum within its capacity."""
    prints = list(footprints)
    if len(prints) <= 1:
        return True
    if any(f is None for f in prints):
        return False
    total: dict = {}
    for f in prints:
        for mem, n in f.items():
            total[mem] = total.get(mem, 0) + n
    for mem, n in total.items():
        cap = capacity_of(mem)
        if cap is None or n > cap:
            return False
    return True


def to_close(kept: list, new, footprint_of: Callable = footprint,
             capacity_of: Callable[[str], Optional[int]] = capacity) -> list:
    """Of `kept` (least recently used first), the pools to close so that they and `new` fit
    together: the oldest first, no more than needed."""
    prints = {id(p): footprint_of(p) for p in kept}
    mine = footprint_of(new)
    keep = list(kept)
    closing = []
    while keep and not fits([prints[id(p)] for p in keep] + [mine], capacity_of):
        closing.append(keep.pop(0))
    return closing
