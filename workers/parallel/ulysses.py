"""Ulysses' exchanges: q, k and v from tokens to heads in one all-to-all, and the output
back in one more."""
from __future__ import annotations

import torch

from .topology import all_to_all_single


def ulysses_qkv(q, k, v, group, world: int):
    """[B, S, H, D] x3 (this rank's tokens, all heads) -> [B, world*S, H/world, D] x3 (the
    group's tokens in rank order, this rank's heads), in one `all_to_all_single`. The keys
    and values may hold another count of tokens than the queries (cross-attention)."""
    b, s, h, d = q.shape
    hl = h // world
    if k.shape[1] != s:
        return _ulysses_cross(q, k, v, group, world)
    send = q.new_empty((world, 3, b, s, hl, d))
    for i, t in enumerate((q, k, v)):  # head block j goes to rank j
        send[:, i].copy_(t.view(b, s, world, hl, d).permute(2, 0, 1, 3, 4))
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens, our heads
    qkv = recv.permute(1, 2, 0, 3, 4, 5).reshape(3, b, world * s, hl, d)
    return qkv[0], qkv[1], qkv[2]


def _ulysses_cross(q, k, v, group, world: int):
    """`ulysses_qkv` where q holds another token count than k and v: the three packed along
    the tokens of one buffer, still one all-to-all."""
    b, sq, h, d = q.shape
    sk, hl = k.shape[1], h // world
    send = q.new_empty((world, b, sq + 2 * sk, hl, d))
    at = 0
    for t in (q, k, v):
        n = t.shape[1]
        send[:, :, at:at + n].copy_(t.view(b, n, world, hl, d).permute(2, 0, 1, 3, 4))
        at += n
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group=group)

    def part(lo, n):
        return recv[:, :, lo:lo + n].permute(1, 0, 2, 3, 4).reshape(b, world * n, hl, d)
    return part(0, sq), part(sq, sk), part(sq + sk, sk)


def ulysses_out(out, group, world: int):
    """Inverse for the output: [B, world*S, H/world, D] -> [B, S, H, D]."""
    b, sw, hl, d = out.shape
    s = sw // world
    send = out.view(b, world, s, hl, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group=group)  # recv[j]: our tokens, rank j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, world * hl, d)
