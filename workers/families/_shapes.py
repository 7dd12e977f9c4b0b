"""Small helpers the families' `config_from_shapes` share: reading a single file's weight
shapes in either naming."""
from __future__ import annotations

import re


def pick(shapes: dict, bfl: bool, a: str, b: str):
    """The shape of `a` (BFL/ComfyUI naming) or `b` (diffusers naming)."""
    return shapes[a if bfl else b]


def indices(keys, prefix: str) -> list:
    """The block numbers N of keys `prefix` N `.`..., sorted."""
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in keys for m in [pat.match(k)] if m})


def numbered(keys, prefix: str, what: str) -> list:
    """`indices`, refused unless they run 0..n-1 (a truncated or merged file)."""
    idx = indices(keys, prefix)
    if not idx or idx != list(range(len(idx))):
        raise ValueError(f"{what} blocks are not numbered 0..n-1 (found {idx[:8]}...)")
    return idx
