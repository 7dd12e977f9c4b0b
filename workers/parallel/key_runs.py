"""Which keys of a sharded attention are real: the runs of real tokens in each rank's block
(padding of uneven shards, a short prompt's padded text), the index lists built from them
once per shape, and the per-block function yunchang's ring loop calls, which drops the
padded keys before the kernel runs. Read by the sharded attention
(workers/parallel/attention.py), its uneven-split path (workers/parallel/uneven.py) and
PipeFusion's K/V-cache attention."""
from __future__ import annotations

from typing import Optional

import torch


def _valid_runs(plan, streams, padded: bool, text_real: Optional[int] = None):
    """(block length, per sp rank the list of (start, count) runs of real tokens in its
    block). Padded plans pad each stream's shard to that stream's longest; unpadded input
    (direct callers) is padded here as one tail. `text_real`: a row whose prompt fills only
    the first `text_real` text tokens (the rest is padding its text mask drops)."""
    def real(stream, r, n):  # tokens of rank r's shard of `stream` that are real
        if stream != plan.text_stream or text_real is None:
            return n
        start = plan.local_slice(stream, r).start - plan.selected(stream)[0]
        return max(0, min(n, text_real - start))

    if padded:
        per = [plan.sizes(s) for s in streams]
        chunk = sum(max(p) for p in per)
        runs = []
        for r in range(len(per[0])):
            at, mine = 0, []
            for s, p in zip(streams, per):
                mine.append((at, real(s, r, p[r])))
                at += max(p)
            runs.append(mine)
        return chunk, runs
    lengths = plan.lengths(streams)
    if text_real is None:
        return max(lengths), [[(0, n)] for n in lengths]
    runs = []
    for r in range(len(lengths)):
        at, mine = 0, []
        for s in streams:
            n = plan.sizes(s)[r]
            mine.append((at, real(s, r, n)))
            at += n
        runs.append(mine)
    return max(lengths), runs


def short_rows(plan, text_lengths, keys=None) -> Optional[list]:
    """The rows' real text lengths when some row's prompt is shorter than the call's text
    (padded to a common length) and the keys (`keys`: streams, None: any) hold the text
    stream, else None (every key is real)."""
    text = plan.text_stream
    if text_lengths is None or text is None or (keys is not None and text not in keys):
        return None
    full = plan.full_len(text)
    rows = [min(int(n), full) for n in text_lengths]
    return None if all(n == full for n in rows) else rows


def check_declared(plan, queries, keys, seen: set) -> None:
    """An attention runs only as the family's token layout declares it (queries attending
    to keys); `seen`: the caller's record of what it found declared, so each layout and
    stream set is checked once."""
    if torch.compiler.is_compiling():  # checked by the eager calls; no side effect traced
        return
    key = (plan.layout, tuple(queries), tuple(keys))
    if key not in seen:
        plan.layout.attention(queries, keys)  # raises with what is declared
        seen.add(key)


class _Layout:
    """Index lists of the real keys of each ring block (built once per shape, kept on the
    device): block `src` holds ranks src*U .. src*U+U-1 of the sp group, each `chunk` long."""

    def __init__(self, chunk, runs, ulysses, ring, device):
        self.chunk = chunk
        self.valid = []
        for src in range(ring):
            parts, full = [], True
            for u in range(ulysses):
                for start, n in runs[src * ulysses + u]:
                    parts.append(torch.arange(start, start + n) + u * chunk)
                full = full and sum(n for _, n in runs[src * ulysses + u]) == chunk
            self.valid.append(None if full else torch.cat(parts).to(device))


class _RingBlock:
    """The per-block function yunchang's ring loop calls, once per ring step. Built once per
    ShardedAttention; `start` arms it for one attention call.

    Ring step s on ring rank r holds the K/V block of ring rank (r - s) mod R; padded keys of
    that block are dropped before the kernel runs."""

    def __init__(self, ring: int, ring_rank: int, fault: str):
        self.ring, self.ring_rank, self.fault = ring, ring_rank, fault
        self.kernel, self.layout, self.step = None, None, 0

    def start(self, kernel, layout):
        self.kernel, self.layout, self.step = kernel, layout, 0

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
        if causal or dropout_p:
            raise ValueError("sequence-parallel attention is non-causal and has no dropout")
        src = (self.ring_rank - self.step) % self.ring
        self.step += 1
        idx = self.layout.valid[src]
        if idx is not None and self.fault != "keep_padding":
            k, v = k.index_select(1, idx), v.index_select(1, idx)
        out, lse = self.kernel(q, k, v, softmax_scale)
        if self.fault == "lse_zero":  # the TORCH_MATH failure mode (negative control)
            lse = torch.zeros_like(lse)
        return out, lse
