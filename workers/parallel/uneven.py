"""Sharded attention over shards of uneven length (a split with uneven weights,
workers/parallel/shares.py): each rank holds its own share of every sharded stream, unpadded,
so its per-token layers compute its share and no more.

- Ulysses: one `all_to_all_single` with per-rank split sizes moves q, k and v from tokens to
  heads (each rank sends its tokens' head block j to rank j and receives every group
  member's tokens, as many as that member holds); the output returns the same way. The
  heads still split evenly, so the attention itself costs every rank alike.
- Ring: a block's K/V travel padded to the longest block (yunchang's ring loop receives
  into a tensor like the one it sends); the queries stay unpadded, the padded keys are
  dropped before the kernel runs (workers/parallel/key_runs.py), and the blocks merge by
  their log-sum-exp as for an even split.
- The hybrid: Ulysses inside each ring block, then Ring across the blocks.

Every query sees every real key exactly once, and full attention does not depend on the
keys' order, so the result is the even split's (and one rank's) to fp32 rounding.
"""
from __future__ import annotations

import torch
from yunchang.ring.ring_flash_attn import ring_flash_attn_forward

from .key_runs import _valid_runs, short_rows
from .topology import all_to_all_single


def tokens_to_heads(ts, lengths, group, world: int):
    """Tensors [B, s, H, D] of this rank's s tokens (one s for all) -> [n, B, sum(lengths),
    H/world, D]: the group's tokens in rank order (rank j holds lengths[j]), this rank's
    heads; one all-to-all."""
    b, s, h, d = ts[0].shape
    hl = h // world
    send = torch.stack([t.reshape(b, s, world, hl, d).permute(2, 1, 0, 3, 4) for t in ts], 2)
    send = send.reshape(world * s, -1)  # [world blocks of s tokens, n * b * hl * d]
    recv = send.new_empty((sum(lengths), send.shape[1]))
    all_to_all_single(recv, send, group, out_splits=list(lengths), in_splits=[s] * world)
    return recv.view(sum(lengths), len(ts), b, hl, d).permute(1, 2, 0, 3, 4)


def heads_to_tokens(out, lengths, me: int, group, world: int):
    """Inverse for the output: [B, sum(lengths), H/world, D] -> [B, lengths[me], H, D]."""
    b, total, hl, d = out.shape
    s = lengths[me]
    send = out.permute(1, 0, 2, 3).reshape(total, -1)
    recv = send.new_empty((world * s, send.shape[1]))
    all_to_all_single(recv, send, group, out_splits=[s] * world, in_splits=list(lengths))
    return recv.view(world, s, b, hl, d).permute(2, 1, 0, 3, 4).reshape(b, s, world * hl, d)


class UnevenAttention:
    """The uneven path of one `ShardedAttention` (its groups, kernels and ring block), with
    the real-key index lists of each shape kept on the device."""

    def __init__(self, att):
        self.att = att
        self._valid: dict = {}

    def _block_valid(self, plan, keys, text_real, device):
        """(padded block length, per ring block the index list of its real keys or None)."""
        att = self.att
        key = (plan.counts(), tuple(plan.weights), tuple(keys), text_real, device)
        if key not in self._valid:
            u, r = att.ulysses, att.ring
            lens = plan.lengths(keys)
            _, runs = _valid_runs(plan, keys, False, text_real)
            blocks = [sum(lens[src * u:(src + 1) * u]) for src in range(r)]
            longest = max(blocks)
            valid = []
            for src in range(r):
                parts, off = [], 0
                for j in range(src * u, (src + 1) * u):
                    parts += [torch.arange(at, at + n) + off for at, n in runs[j]]
                    off += lens[j]
                idx = torch.cat(parts)
                valid.append(None if idx.numel() == longest else idx.to(device))
            if len(self._valid) > 64:  # shapes change with jobs; keep the cache bounded
                self._valid.clear()
            self._valid[key] = (longest, valid)
        return self._valid[key]

    def __call__(self, q, k, v, plan, streams, keys, text_lengths):
        att = self.att
        u, me = att.ulysses, att.topo.sp_rank
        lq, lk = plan.lengths(streams), plan.lengths(keys)
        if (q.shape[1], k.shape[1]) != (lq[me], lk[me]):
            raise RuntimeError(f"local sequence {q.shape[1]} (keys {k.shape[1]}) != planned "
                               f"{lq[me]} (keys {lk[me]}) of an uneven split")
        mine = slice(me // u * u, me // u * u + u)  # this rank's Ulysses group, in sp ranks
        if u > 1:
            if tuple(keys) == tuple(streams):
                q, k, v = tokens_to_heads((q, k, v), lk[mine], att.uly_group, u)
            else:
                q = tokens_to_heads((q,), lq[mine], att.uly_group, u)[0]
                k, v = tokens_to_heads((k, v), lk[mine], att.uly_group, u)
        rows = short_rows(plan, text_lengths, keys)
        if rows is None:
            out = self._attend(q, k, v, *self._block_valid(plan, keys, None, q.device))
        else:  # every rank has the same rows: the collectives stay matched
            out = torch.cat([self._attend(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                          *self._block_valid(plan, keys, n, q.device))
                             for b, n in enumerate(rows)])
        out = out.to(q.dtype)
        if u > 1:
            out = heads_to_tokens(out, lq[mine], me % u, att.uly_group, u)
        return out

    def _attend(self, q, k, v, longest, valid):
        att = self.att
        kernel, scale = att.kernels(q), q.shape[-1] ** -0.5
        if att.ring == 1:
            if valid[0] is not None:
                k, v = k.index_select(1, valid[0]), v.index_select(1, valid[0])
            out = kernel(q, k, v, scale)
            return out[0] if kernel.lse else out
        pad = longest - k.shape[1]
        if pad:  # the ring loop receives K/V into tensors like those it sends
            k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
            v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
        block = att.block
        block.start(kernel, _Valid(valid))
        out, _ = ring_flash_attn_forward(att.ring_group, q, k.contiguous(), v.contiguous(),
                                         softmax_scale=scale, dropout_p=0.0, causal=False,
                                         attn_type=None, attn_processor=block)
        return out


class _Valid:
    """What `_RingBlock` reads of a layout: each ring block's real-key index list."""

    def __init__(self, valid):
        self.valid = valid
