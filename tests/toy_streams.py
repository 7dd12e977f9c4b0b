"""The toy multi-stream attention the stream tests run: each declared attention's queries
attend to its key streams, and a stream's output sums its results over every attention it is
a query of. Whole on one process or one rank's shards under a parallel `attend`."""
from __future__ import annotations

import torch


def attend_streams(qkv: dict, attentions, attend, local_len) -> dict:
    """`qkv`: stream -> (q, k, v) [B, S, H, D] of this rank's tokens; `attend(q, k, v,
    queries, keys)`; `local_len(stream)`: its tokens here. Returns stream -> output."""
    out = {s: 0 for s in qkv}
    for a in attentions:
        q = torch.cat([qkv[s][0] for s in a.queries], 1)
        k = torch.cat([qkv[s][1] for s in a.key_streams], 1)
        v = torch.cat([qkv[s][2] for s in a.key_streams], 1)
        o, at = attend(q, k, v, a.queries, a.key_streams), 0
        for s in a.queries:
            out[s] = out[s] + o[:, at:at + local_len(s)]
            at += local_len(s)
    return out
