"""Uneven splits: how work is divided over ranks of different speed or memory, exactly.

A split is a tuple of positive per-rank weights, one per world rank (empty: even, every
rank alike). Each method takes the weights of the ranks on its own axis: the sequence
plan the sequence-parallel group's (`sp_weights`), data parallel the summed weight of each
dp slice (`dp_weights`). Apportioning is integer arithmetic on exact fractions, so every
rank computes the same sizes from the same weights; with equal weights it is exactly the
near-even split (the first `n % parts` ranks one more), so `even` stays today's layout.

Exactness does not depend on the sizes: every method computes each token (row, block,
band) exactly once whoever holds it, and the attention sees every real key once
(workers/parallel/uneven.py), so an uneven split gives the even split's result.
Plain Python, no torch: the host's plans read it too.
"""
from __future__ import annotations

import math
from fractions import Fraction


def is_even(weights) -> bool:
    """No weights, or all equal: the near-even split."""
    w = tuple(weights or ())
    return len(set(w)) <= 1


def check_weights(weights, ranks: int) -> list:
    """Problems of a split for `ranks` ranks, each a phrase naming what would be right."""
    w = tuple(weights or ())
    if not w:
        return []
    out = []
    if len(w) != ranks:
        out.append(f"split gives {len(w)} weights for {ranks} ranks; give one weight per "
                   f"rank (e.g. {','.join(['1'] * ranks)})")
    bad = [x for x in w if isinstance(x, bool) or not isinstance(x, (int, float))
           or not math.isfinite(x) or x <= 0]
    if bad:
        out.append(f"split weights must be positive numbers (got {list(w)})")
    return out


def share_sizes(n: int, weights) -> list:
    """`n` items over `len(weights)` ranks in proportion to the weights (largest remainder,
    ties to the lower rank); while there are enough, a rank left with none takes one from
    the rank holding the most. Equal weights give exactly the near-even split."""
    w = [Fraction(x) for x in weights]
    parts = len(w)
    if parts == 0:
        raise ValueError("a split needs at least one rank")
    total = sum(w)
    quotas = [n * x / total for x in w]
    sizes = [int(q) for q in quotas]  # floor (non-negative)
    order = sorted(range(parts), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in order[:n - sum(sizes)]:
        sizes[i] += 1
    if n >= parts:
        for i in range(parts):
            if sizes[i] == 0:
                sizes[sizes.index(max(sizes))] -= 1
                sizes[i] = 1
    return sizes


def sizes_for(n: int, parts: int, weights=()) -> list:
    """`n` items over `parts` ranks: by `weights` where they are uneven, else near-evenly."""
    if is_even(weights):
        return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    if len(weights) != parts:
        raise ValueError(f"{len(weights)} weights for {parts} ranks")
    return share_sizes(n, weights)


def gather_buffer(mine, largest) -> tuple:
    """Weight sharding by weight: one rank's shares of the units back to back (`mine`, bytes
    each), and every rank's all-gather of unit k sends the window of the unit's `largest`
    share from where its rows start (NCCL's all-gather takes equal sizes; what runs past
    its rows is the next unit's, trimmed on receipt). -> ([start of each unit's rows], the
    buffer's length: the furthest window's end)."""
    starts, at, end = [], 0, 0
    for m, big in zip(mine, largest):
        starts.append(at)
        end = max(end, at + big)
        at += m
    return starts, max(end, at)


def sp_weights(split, topo) -> tuple:
    """The weights of this rank's sequence-parallel group, in sp-rank order (ring-major,
    as workers/parallel/topology.py numbers them); () where the split is even."""
    if is_even(split):
        return ()
    u = topo.degree("ulysses")
    w = tuple(split[topo.global_rank(ring=j // u, ulysses=j % u)] for j in range(topo.sp))
    return () if is_even(w) else w


def dp_weights(split, topo) -> tuple:
    """Each dp slice's weight: the sum of its ranks' (a slice works as fast as its ranks
    together, whatever it splits inside); () where the split is even."""
    if is_even(split):
        return ()
    dp = topo.degree("dp")
    per_slice = len(split) // dp  # dp is the outermost axis: slices are runs of ranks
    per = [sum(float(x) for x in split[i * per_slice:(i + 1) * per_slice]) for i in range(dp)]
    return () if is_even(per) else tuple(per)


def parse_split(text, ranks: int):
    """A user's split: "even" -> (), "auto" -> "auto", "3,2" -> (3.0, 2.0); a ValueError
    that says what is wrong and what would be right."""
    if isinstance(text, (tuple, list)):
        w = tuple(float(x) for x in text)
    else:
        s = str(text).strip().lower()
        if s in ("", "even"):
            return ()
        if s == "auto":
            return "auto"
        try:
            w = tuple(float(x) for x in s.split(","))
        except ValueError:
            w = None
        if w is None:
            raise ValueError(f"split {text!r} must be 'even', 'auto' or {ranks} positive "
                             f"weights like {','.join(['1'] * ranks)}")
    problems = check_weights(w, ranks)
    if problems:
        raise ValueError(f"split {text!r}: " + "; ".join(problems))
    return () if is_even(w) else w
