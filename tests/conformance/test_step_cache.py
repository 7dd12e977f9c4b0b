"""The step cache decides alike on every rank, for every family: at a threshold where the
family's one-rank run both skips and computes (found per family on its tiny model: the
residuals' scale is the model's), Ulysses 2, Ring 2, CFG 2 and DP 2 give the one-rank latent
(<= 1e-4) and its decisions: each sequence-parallel rank of a row makes the row's decisions,
and the CFG / DP ranks' counts add up to one rank's. Negative control: the cached result is
not the uncached one (the skips change the latent), and the decisions are not all forced
(some calls computed after the warmup, some skipped).
"""
from __future__ import annotations

import pytest

from .cases import CASES, NCCL_RULES, TOL, TWO_RANKS, maxdiff, params

STEPS = 8
THRESHOLDS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def cache(threshold: float) -> dict:
    return {"threshold": threshold, "warmup": 1, "head": 1, "tail": 0, "max_skips": STEPS}


def _mixed(counts: dict) -> bool:
    """Some calls skipped and some computed after the warmup step (whose calls always are)."""
    warm = (counts["computed"] + counts["skipped"]) // STEPS
    return counts["skipped"] > 0 and counts["computed"] > warm


def _deciding_threshold(arch, family_pools):
    """A threshold at which the one-rank run skips some calls and computes some after the
    warmup, with its result: the first of THRESHOLDS that does, else the geometric midpoint
    of the last that skips nothing and the first that skips, bisected (a tiny model's
    residuals can sit close together)."""
    c = CASES[arch]

    def run(t):
        res = family_pools.one_rank(arch, c.request(steps=STEPS, cache=cache(t)))
        seen[t] = res.stats[0]["cache"]
        return res

    seen: dict = {}
    lo = None
    for t in THRESHOLDS:
        res = run(t)
        if _mixed(seen[t]):
            return t, res
        if seen[t]["skipped"] == 0:
            lo = t
        elif lo is not None:
            hi = t
            for _ in range(8):
                mid = (lo * hi) ** 0.5
                res = run(mid)
                if _mixed(seen[mid]):
                    return mid, res
                lo, hi = (mid, hi) if seen[mid]["skipped"] == 0 else (lo, mid)
            break
    raise AssertionError(f"{arch}: no threshold both skips and computes: {seen}")


@pytest.mark.parametrize("arch,name", params("step_cache", TWO_RANKS))
def test_step_cache_decides_alike_on_every_rank(arch, name, family_pools):
    c = CASES[arch]
    threshold, base = _deciding_threshold(arch, family_pools)
    counts = base.stats[0]["cache"]
    exact = family_pools.one_rank(arch, c.request(steps=STEPS)).samples
    assert maxdiff(base.samples, exact) > 10 * TOL, f"{arch}: the skips changed nothing"
    config = TWO_RANKS[name]
    pool = family_pools.get(arch, config, worker_hooks=[NCCL_RULES])
    other = pool.generate(c.request(steps=STEPS, cache=cache(threshold)))
    d = maxdiff(other.samples, base.samples)
    per_rank = [r["cache"] for r in other.stats]
    print(f"{arch} {name} step cache at {threshold}: {d:.2e} from 1 rank; {counts} vs "
          f"{per_rank}")
    assert d <= TOL, f"{arch} {name}: {d:.3e}"
    if config.sp > 1:
        assert all(r == counts for r in per_rank), (arch, name, counts, per_rank)
    else:
        assert {k: sum(r[k] for r in per_rank) for k in counts} == counts, (counts, per_rank)
