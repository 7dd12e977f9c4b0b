"""A LATENT made of several typed tensors (ComfyUI's nested LATENT, e.g. a video with its
sound track) through one MODEL call.

ComfyUI hands such a model its `x` as a list of tensors, one per part, each [N, ...] with
its own shape, and takes the prediction back as the same list. On the wire and across the
ranks the parts travel as one tensor, [N, total]: each row is its parts flattened and laid
end to end (the order ComfyUI's own pack_latents uses), with the parts' per-row shapes
beside it. Rows stay rows, so everything the call does by rows (the split over the dp x cfg
replicas, the gather of their predictions, the step cache) is the same as for one tensor;
only the family's adapter sees the parts (`pack_parts` / `unpack_parts` /
`parts_extra`, workers/models/base.py).

Torch only: the host (through comfyui_xdit.bridge) and the workers both use it.
"""
from __future__ import annotations

import math

import torch


def shapes_of(parts) -> tuple:
    """The per-row shapes of a list of [N, ...] tensors: ((d1, d2, ...), ...)."""
    return tuple(tuple(int(d) for d in p.shape[1:]) for p in parts)


def flatten(parts) -> tuple:
    """[N, ...] tensors -> (one [N, total] fp32 CPU tensor, their per-row shapes). Every
    part must have the same N rows."""
    rows = {int(p.shape[0]) for p in parts}
    if len(rows) != 1:
        raise ValueError(f"the parts of a LATENT have different batch sizes "
                         f"{[tuple(p.shape) for p in parts]}")
    n = rows.pop()
    flat = torch.cat([p.detach().float().cpu().reshape(n, -1) for p in parts], 1)
    return flat.contiguous(), shapes_of(parts)


def width(shapes) -> int:
    """Values per row of parts of these shapes."""
    return sum(math.prod(s) for s in shapes)


def unflatten(flat, shapes) -> list:
    """[N, total] -> the parts [N, *shape] (views of `flat`)."""
    if flat.dim() != 2 or int(flat.shape[1]) != width(shapes):
        raise ValueError(f"a flattened LATENT of shape {tuple(flat.shape)} does not hold "
                         f"parts {[list(s) for s in shapes]} ({width(shapes)} values a row)")
    out, at = [], 0
    for s in shapes:
        size = math.prod(s)
        out.append(flat[:, at:at + size].reshape(flat.shape[0], *s))
        at += size
    return out


def problem(x, shapes, names) -> str:
    """What is wrong with a call's flattened parts (`x` [N, total], `shapes`) for a model
    whose LATENT has the parts `names`, or ""."""
    if len(shapes) != len(names):
        return (f"the model takes a LATENT of {len(names)} parts ({', '.join(names)}); "
                f"the call has {len(shapes)}")
    if not torch.is_tensor(x) or x.dim() != 2 or int(x.shape[1]) != width(shapes):
        got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        return (f"the parts {[list(s) for s in shapes]} travel as [rows, {width(shapes)}] "
                f"(got {got})")
    if any(min(s, default=0) < 1 for s in shapes):
        return f"every part of the LATENT needs a non-empty shape (got {[list(s) for s in shapes]})"
    return ""
