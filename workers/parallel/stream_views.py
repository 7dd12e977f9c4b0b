"""A replicated stream seen as if it were sharded, for the attention's exchanges
(workers/parallel/attention.py): where one attention mixes a replicated stream (every rank holds
all of it) with sharded ones, each rank takes the replicated stream's shard, the exchange runs
as for sharded streams, and the replicated queries' output is gathered whole again. Every key
is still seen exactly once."""
from __future__ import annotations

import torch

from .sequence_parallel import all_gather_tokens, pad_tokens


def as_view(x, plan, view, streams, dim: int = 1):
    """`x`, the local tokens of `streams` as `plan` holds them, as `view` (every stream
    sharded) holds them: each replicated stream cut to its shard (and padded as the view
    pads)."""
    parts, at = [], 0
    for s in streams:
        n = plan.local_len(s)
        if plan.sharded(s):
            seg = x.narrow(dim, at, n)
        else:  # held whole: its selected tokens from the first
            sl = view.local_slice(s)
            seg = x.narrow(dim, at + sl.start - view.selected(s)[0], sl.stop - sl.start)
            seg = pad_tokens(seg, dim, view.local_len(s))
        at += n
        parts.append(seg)
    return torch.cat(parts, dim=dim)


def from_view(out, plan, view, streams, group):
    """Inverse of `as_view` for the attention output: each replicated stream's shards
    gathered from the sp group into the whole stream again."""
    parts, at = [], 0
    for s in streams:
        n = view.local_len(s)
        seg = out.narrow(1, at, n)
        at += n
        if not plan.sharded(s) and any(view.sizes(s)):  # (none selected: nothing to gather)
            sizes = view.sizes(s)
            seg = all_gather_tokens(seg.narrow(1, 0, sizes[view.sp_rank]), 1, sizes, group)
        parts.append(seg)
    return torch.cat(parts, dim=1)
