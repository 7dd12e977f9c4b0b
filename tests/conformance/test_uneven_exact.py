"""An uneven split equals one rank, for every family (docs/design.md#numerics-rule-7: GPUs of
different speed or memory get work in proportion to their weights, exactly): Ulysses 2 at
3:1, Ring 2 at 1:3, Ulysses 2 x Ring 2 at 1:3:2:1 (each rank's tokens by its weight,
unpadded; workers/parallel/uneven.py) and DP 2 at 1:3 (the batch's rows by weight), on the
family's small request, <= 1e-4 on the final LATENT, under the NCCL-rules emulation. Batch
independence holds under the uneven split too: row 0 of [A, B] equals [A] alone.

Weight sharding by weight (`shard_split`, workers/parallel/uneven_sharding.py): DP 2 with the
weights sharded 3:1 (rank 0 holds three quarters of every parameter's rows) equals one rank
too, under the same emulation, and each rank holds its share.

Negative controls: the split applied on one side only (the input hooks shard by weight, the
output gather reads the shards as the even split's), and the sharded weights reassembled
with the ranks' rows in the wrong order, are each caught by the same comparison.
"""
from __future__ import annotations

import pytest

from comfyui_xdit import ParallelConfig

from .cases import CASES, NCCL_RULES, TOL, maxdiff, params
from .test_batch_independence import row0_distance
from .test_methods_exact import _heads

SPLITS = {
    "ulysses2-3:1": (ParallelConfig(ulysses=2, split="3,1"), "sequence_parallel"),
    "ring2-1:3": (ParallelConfig(ring=2, split="1,3"), "sequence_parallel"),
    "ulysses2xring2-1:3:2:1": (ParallelConfig(ulysses=2, ring=2, split="1,3,2,1"), "hybrid"),
    "dp2-1:3": (ParallelConfig(dp=2, split="1,3"), "data_parallel"),
}
SHARDED = ParallelConfig(dp=2)  # with the weights sharded 3:1
SHARD_OPTIONS = {"shard_weights": True, "shard_split": "3,1"}


def _params():
    return [p for name, (_, cap) in SPLITS.items() for p in params(cap, {name: None})]


def _skip_heads(arch, config, model_dir):
    if config.ulysses > 1 and _heads(arch, model_dir) % config.ulysses:
        pytest.skip(f"{arch}'s test model's heads do not split over Ulysses {config.ulysses}")


@pytest.mark.parametrize("arch,name", _params())
def test_uneven_split_equals_one_rank(arch, name, family_pools, model_dir):
    config, _ = SPLITS[name]
    _skip_heads(arch, config, model_dir)
    c = CASES[arch]
    want = family_pools.one_rank(arch, c.request()).samples
    pool = family_pools.get(arch, config, worker_hooks=[NCCL_RULES])
    got = pool.generate(c.request()).samples
    d = maxdiff(got, want)
    print(f"{arch} {name}: max abs vs 1 rank {d:.2e}")
    assert d <= TOL, f"{arch} {name}: {d:.3e} from one rank"


@pytest.mark.parametrize("arch", params("batch_independence"))
def test_uneven_split_keeps_batch_independence(arch, family_pools, model_dir):
    config, _ = SPLITS["ulysses2-3:1"]
    _skip_heads(arch, config, model_dir)
    err, apart = row0_distance(family_pools.get(arch, config, worker_hooks=[NCCL_RULES]),
                               arch)
    print(f"{arch} ulysses2 3:1: row 0 of [A, B] vs [A] alone {err:.2e} (rows {apart:.2e})")
    assert apart > 1e-3 and err <= TOL


def test_negative_control_split_on_one_side_only(family_pools):
    arch = "chroma" if "chroma" in CASES else next(iter(CASES))
    c = CASES[arch]
    want = family_pools.one_rank(arch, c.request()).samples
    pool = family_pools.get(arch, ParallelConfig(ulysses=2, split="3,1"),
                            worker_hooks=["xdit_testhooks.faults:split_gather_even"])
    d = maxdiff(pool.generate(c.request()).samples, want)
    print(f"{arch} split on one side only: {d:.2e} from one rank")
    assert d > 10 * TOL, f"the one-sided split went unnoticed ({d:.2e})"


@pytest.mark.parametrize("arch", params("weight_sharding"))
def test_weights_sharded_by_weight_equal_one_rank(arch, family_pools):
    c = CASES[arch]
    want = family_pools.one_rank(arch, c.request()).samples
    pool = family_pools.get(arch, SHARDED, worker_hooks=[NCCL_RULES], **SHARD_OPTIONS)
    res = pool.generate(c.request())
    d = maxdiff(res.samples, want)
    held = [st["sharding"] for st in res.stats]
    print(f"{arch} dp2 weights sharded 3:1: max abs vs 1 rank {d:.2e}; weight bytes per "
          f"rank {[h['weight_bytes_local'] for h in held]}")
    assert d <= TOL, f"{arch} weights sharded 3:1: {d:.3e} from one rank"
    assert [h["shard_split"] for h in held] == [[3.0, 1.0]] * 2
    total = held[0]["block_params"]
    assert sum(h["block_params_local"] for h in held) == total  # every row held once
    share = held[0]["block_params_local"] / total
    assert 0.7 <= share <= 0.8, f"rank 0 holds {share:.2f} of the block weights, not ~3/4"


def test_negative_control_shard_rows_out_of_order(family_pools):
    arch = "chroma" if "chroma" in CASES else next(iter(CASES))
    c = CASES[arch]
    want = family_pools.one_rank(arch, c.request()).samples
    pool = family_pools.get(arch, SHARDED, worker_hooks=["xdit_testhooks.faults:"
                                                         "shard_rows_swapped"], **SHARD_OPTIONS)
    d = maxdiff(pool.generate(c.request()).samples, want)
    print(f"{arch} sharded rows out of order: {d:.2e} from one rank")
    assert d > 10 * TOL, f"rows reassembled out of order went unnoticed ({d:.2e})"
