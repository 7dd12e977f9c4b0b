"""Room for a pool's job on the GPUs it uses, as bytes per GPU in ComfyUI's numbering.

ComfyUI's models (text encoders, VAE, other diffusion models) may sit on the GPUs a pool
uses. Before a job the node asks ComfyUI's memory manager to free, on each of the pool's
GPUs, what the pool needs there (`comfy.model_management.free_memory(bytes, device)`, which
unloads ComfyUI's models only while that GPU has less free memory than asked), and nothing
on GPUs the pool does not use. What the pool needs comes from the memory plan:

- a pool not running yet: every rank's predicted total (weights, activations, text
  encoders, VAE, reserve), summed over the ranks sharing a GPU;
- a running pool: only what the job adds to the fixed parts (its weights are resident,
  so ComfyUI already sees that memory as used).

The pool's GPU ids are the ones its workers get in `CUDA_VISIBLE_DEVICES`; ComfyUI's
`cuda:N` is the N-th visible GPU of this process. A GPU named by UUID that is not in the
visible list cannot be matched to a ComfyUI device and is left alone. No ComfyUI import
here: the node passes ComfyUI's free_memory in (nodes/sampler_nodes.py).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from comfyui_xdit.planning.gpus import gpus_for_ranks, visible_gpus
from comfyui_xdit.planning.launch_policy import PlanUnavailable, plan_launch

_log = logging.getLogger("comfyui_xdit")


def room_needed(pool, request=None, visible: Optional[list] = None) -> dict:
    """{ComfyUI cuda index: bytes} the pool needs free for a job of `request` (None: a
    launch or decode without a job); {} on CPU, for an attached pool, or where the GPUs'
    memory cannot be read. A plan that cannot be made raises PlanUnavailable."""
    if pool.device != "cuda" or getattr(pool, "_attached", None):
        return {}
    gpus = gpus_for_ranks(pool.config.ranks, pool.gpus)
    args = (pool.model_path, pool.config, pool.engine, gpus)
    path_2 = getattr(pool, "model_path_2", None)
    plan = plan_launch(*args, request, path_2)
    if plan is None:
        return {}
    need = [r.total for r in plan.ranks]
    if pool.is_running():
        fixed = plan_launch(*args, None, path_2)
        need = [max(0, a.total - b.total) for a, b in zip(plan.ranks, fixed.ranks)]
    visible = visible_gpus() if visible is None else visible
    out: dict = {}
    for gpu, n in zip(gpus, need):
        if gpu not in visible:
            _log.debug("xDiT: GPU %s is not in this process's visible list; ComfyUI's models "
                       "on it are left as they are", gpu)
            continue
        i = visible.index(gpu)
        out[i] = out.get(i, 0) + int(n)
    return out


def make_room(pool, request, free_memory: Callable[[int, int], None],
              visible: Optional[list] = None) -> dict:
    """Ask ComfyUI's memory manager (`free_memory(bytes, cuda_index)`) for the room the pool
    needs on each of its GPUs; returns what was asked. A plan that cannot be made asks
    nothing (the launch's own check refuses or warns, by the memory_plan mode)."""
    try:
        needs = room_needed(pool, request, visible)
    except PlanUnavailable as e:
        _log.warning("xDiT: no memory plan, so ComfyUI's models are not offloaded: %s", e)
        return {}
    for index, n in sorted(needs.items()):
        free_memory(n, index)
    return needs
