"""One denoiser evaluation for a sampler that runs on the host (ComfyUI's KSampler & co.).

The host sends a batch of latent rows in model space (unpacked, [N, C, h, w]), one timestep
per row (the diffusers pipelines' scale: sigma * 1000) and, per chunk of rows, a key naming
its conditioning. A conditioning crosses the wire once: rank 0 broadcasts it with the first
call that uses it and every rank keeps it (on its device) in a small cache with the same
eviction order everywhere, so later calls carry only latents, timesteps and keys.

Rows are independent, so the xDiT split is exact: the rows are divided near-evenly over the
dp x cfg replicas (ComfyUI's batched call puts the conditional and unconditional rows side by
side, so CFG parallel falls out of the row split), and each replica runs its rows through the
transformer with Ulysses/Ring inside (the usual sequence-parallel hooks). One all-gather on
the data plane brings every replica's rows to rank 0, which returns the prediction.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .sequence_parallel import even_sizes
from .sharding import is_sharded

COND_CACHE = 16  # conditionings kept per rank (a sampling run uses 1-3)


@dataclass
class ModelCall:
    """What rank 0 broadcasts for one call (control plane; small apart from `x`)."""

    call_id: int
    config: tuple  # ParallelConfig.key()
    x: torch.Tensor  # [N, C, h, w] model space, fp32, CPU
    timestep: torch.Tensor  # [N], sigma * 1000
    guidance: Optional[torch.Tensor]  # [N] FLUX embedded guidance, else None
    chunks: list  # [(key, rows)], rows summing to N, in row order
    new_conds: dict = field(default_factory=dict)  # key -> {"context", "pooled"} (CPU)


class CondCache:
    """Per-rank LRU of conditionings on the device; every rank applies the same sequence of
    puts and touches, so every rank holds the same keys."""

    def __init__(self, capacity: int = COND_CACHE):
        self.capacity = capacity
        self.items: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self.puts = 0

    def missing(self, keys) -> list:
        return [k for k in dict.fromkeys(keys) if k not in self.items]

    def put(self, key: str, value: dict) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        self.puts += 1

    def get(self, key: str) -> dict:
        self.items.move_to_end(key)
        return self.items[key]

    def trim(self, keep=()) -> None:
        keep = set(keep)
        for k in list(self.items):
            if len(self.items) <= self.capacity:
                break
            if k not in keep:
                del self.items[k]


def call_problem(model, adapter, x, timestep, guidance, chunks, new_conds, cache) -> str:
    """Rank 0, before anything is broadcast: what is wrong with a call, or ""."""
    cfg = model.transformer.config
    channels = int(cfg.in_channels) // (4 if adapter.arch == "flux" else 1)
    if not torch.is_tensor(x) or x.dim() != 4 or x.shape[1] != channels:
        got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        return f"the model takes latents [batch, {channels}, height/8, width/8] (got {got})"
    n, _, h, w = x.shape
    if h % 2 or w % 2 or min(n, h, w) < 1:
        return f"latent height and width must be even and non-zero (got {h}x{w})"
    if not torch.is_tensor(timestep) or tuple(timestep.shape) != (n,):
        return f"one timestep per latent row expected ({n})"
    if guidance is not None and (not torch.is_tensor(guidance) or tuple(guidance.shape) != (n,)):
        return f"one guidance value per latent row expected ({n})"
    if sum(int(r) for _, r in chunks) != n or any(int(r) < 1 for _, r in chunks):
        return f"conditioning chunks cover {[r for _, r in chunks]} rows, the batch has {n}"
    lengths = set()
    for key, rows in chunks:
        c = new_conds.get(key)
        if c is None:  # cached: checked when it arrived
            cached = cache.items.get(key)
            if cached is not None:
                lengths.add(int(cached["encoder_hidden_states"].shape[1]))
            continue
        ctx, pooled = c["context"], c["pooled"]
        if ctx.dim() != 3 or ctx.shape[0] != rows or ctx.shape[2] != int(cfg.joint_attention_dim):
            return (f"conditioning {key}: text states must be [{rows}, tokens, "
                    f"{int(cfg.joint_attention_dim)}] (got {tuple(ctx.shape)})")
        if pooled.dim() != 2 or pooled.shape[0] != rows or \
                pooled.shape[1] != int(cfg.pooled_projection_dim):
            return (f"conditioning {key}: pooled output must be [{rows}, "
                    f"{int(cfg.pooled_projection_dim)}] (got {tuple(pooled.shape)})")
        lengths.add(int(ctx.shape[1]))
    if len(lengths) > 1:
        return f"the conditionings of one call have different token counts {sorted(lengths)}"
    return ""


def _cached(cache: CondCache, key: str, value: dict, model, adapter) -> None:
    """Convert a ComfyUI conditioning to the transformer's inputs on this rank's device."""
    dev, dtype = model.device, model.dtype
    d = adapter.conditioning(value["context"], value["pooled"])
    cache.put(key, {k: v.to(dev, dtype if v.is_floating_point() else None) for k, v in d.items()})


def replica_rows(n: int, topo) -> tuple:
    """(row counts of every dp x cfg replica, this rank's replica index)."""
    replicas = topo.degree("dp") * topo.degree("cfg")
    me = topo.index("dp") * topo.degree("cfg") + topo.index("cfg")
    return even_sizes(n, replicas), me


def run_call(call: ModelCall, model, adapter, topo, cache: CondCache, data_group):
    """Every rank: this rank's replica's rows, then one all-gather; the prediction
    [N, C, h, w] (fp32, CPU) on rank 0, None elsewhere."""
    dev, dtype = model.device, model.dtype
    for key, value in call.new_conds.items():
        _cached(cache, key, value, model, adapter)
    conds = [cache.get(k) for k, _ in call.chunks]
    cache.trim(keep=[k for k, _ in call.chunks])
    n, c, h, w = call.x.shape
    sizes, me = replica_rows(n, topo)
    start = sum(sizes[:me])
    mine = slice(start, start + sizes[me])
    longest = max(sizes)
    out = torch.zeros(longest, c, h, w, device=dev, dtype=torch.float32)
    # weight sharding (workers/sharding.py): every rank must run every block's forward, so a
    # replica with no rows runs one dummy row (the first) and discards it
    dummy = not sizes[me] and is_sharded(model.transformer)
    if dummy:
        mine = slice(0, 1)
    if sizes[me] or dummy:
        cond = {}
        for k in conds[0]:
            if k in ("encoder_hidden_states", "pooled_projections"):
                cond[k] = torch.cat([cd[k] for cd in conds])[mine]
            else:
                cond[k] = conds[0][k]  # per-token ids, shared by the batch
        x = call.x[mine].to(dev, dtype)
        t = call.timestep[mine].to(dev, torch.float32)
        g = None if call.guidance is None else call.guidance[mine].to(dev, torch.float32)
        extra = adapter.forward_extra(model, h * 8, w * 8)
        pred = adapter.forward(model, adapter.pack(x), t, cond, g, extra)
        if not dummy:
            out[: sizes[me]] = adapter.unpack(pred, h * 8, w * 8).float()
    if dist.get_world_size(data_group) > 1:
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(data_group))]
        dist.all_gather(parts, out, group=data_group)
    else:
        parts = [out]
    if topo.rank != 0:
        return None
    rows = []
    for r, size in enumerate(sizes):
        dp_i, cfg_i = divmod(r, topo.degree("cfg"))
        src = topo.global_rank(dp=dp_i, cfg=cfg_i, pipefusion=0, ring=0, ulysses=0)
        rows.append(parts[src][:size])
    return torch.cat(rows).cpu()
