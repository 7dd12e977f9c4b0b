"""The xDiT MODEL's call with a timestep per token (a noise mask on the LATENT: a start frame
at timestep 0; tests/family_requests.masked_call), for every family whose ComfyUI model takes
one (its TokenTimesteps): Ulysses 2, Ring 2, CFG 2, CFG 2 x Ulysses 2 and Ulysses 2 split
3:1 (each rank's tokens by weight, unpadded) equal the call at one rank (<= 1e-4, part by part), under
the NCCL-rules emulation: the timesteps are sharded with their tokens (and whole where a
stream is replicated). That one rank is the family's transformer in ComfyUI's conventions is
the family's own test (LTX-2: tests/test_ltx2.py).

Negative control: the same call with the mask ignored (every token at the row's timestep)
moves the prediction, at one rank and on the split, so a pool that dropped the per-token
timesteps would show.

A family's `TokenTimesteps.variants` (other ways ComfyUI versions use the timesteps per token,
sent as model inputs: LTX-2 on ComfyUI 0.33.0 gates each stream's audio-video attention by the
other stream's largest timestep) run alike on every layout, equal to the variant at one rank;
negative controls: the variant at one rank differs from the plain call's, and from the variant
with any one of its inputs left out (each is read), and the split's result from the plain
one-rank result (the variant is not dropped on the way).
"""
from __future__ import annotations

import pytest

from comfyui_xdit import ParallelConfig
from family_requests import families, masked_call

from .cases import CASES, NCCL_RULES, TOL, maxdiff

LAYOUTS = {"ulysses2": ParallelConfig(ulysses=2), "ring2": ParallelConfig(ring=2),
           "cfg2": ParallelConfig(cfg_parallel=True),
           "cfg2xulysses2": ParallelConfig(cfg_parallel=True, ulysses=2),
           "ulysses2-3:1": ParallelConfig(ulysses=2, split="3,1")}
TAKERS = [a for a in CASES if families.family(a).capability(families.TokenTimesteps)]
_ONE_RANK: dict = {}


VARIANTS = [(a, name, inputs) for a in TAKERS
            for name, inputs in families.family(a).capability(families.TokenTimesteps).variants]


def call_model(pool, config: ParallelConfig, arch: str, call: dict, inputs=None):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    den = PoolDenoiser(pool, config.with_world_size(config.product), arch)
    den.model_inputs = dict(inputs or {})  # what the MODEL detects in ComfyUI
    return den(**call)


def unmasked(call: dict) -> dict:
    """The call with every token at its row's timestep (the mask ignored)."""
    steps = call["timestep"]
    one = lambda s: s.reshape(s.shape[0], -1).amax(1)  # noqa: E731  (the row's sigma)
    return dict(call, timestep=tuple(one(s) for s in steps) if isinstance(steps, tuple)
                else one(steps))


def one_rank(arch, family_pools, model_dir):
    if arch not in _ONE_RANK:
        call = masked_call(arch, model_dir(arch))
        pool = family_pools.get(arch, ParallelConfig())
        _ONE_RANK[arch] = (call, call_model(pool, ParallelConfig(), arch, call),
                           call_model(pool, ParallelConfig(), arch, unmasked(call)))
    return _ONE_RANK[arch]


def test_some_family_takes_a_timestep_per_token():
    assert TAKERS, "no family declares TokenTimesteps; this suite would check nothing"


@pytest.mark.parametrize("arch,name", [pytest.param(a, n, id=f"{a}-{n}")
                                       for a in TAKERS for n in LAYOUTS])
def test_token_timesteps_on_two_ranks_equal_one_rank(arch, name, family_pools, model_dir):
    call, want, plain = one_rank(arch, family_pools, model_dir)
    moved = maxdiff(want, plain)
    assert moved > 1e-3, f"{arch}: the timestep per token does not move the prediction " \
                         f"({moved:.2e})"
    pool = family_pools.get(arch, LAYOUTS[name], worker_hooks=[NCCL_RULES])
    got = call_model(pool, LAYOUTS[name], arch, call)
    d = maxdiff(got, want)
    print(f"{arch} MODEL call, a timestep per token, {name}: {d:.2e} from 1 rank "
          f"(the mask ignored moves it {moved:.2e})")
    assert d <= TOL, f"{arch} {name}: {d:.3e} from one rank"
    ignored = maxdiff(call_model(pool, LAYOUTS[name], arch, unmasked(call)), want)
    assert ignored > 1e-3, f"{arch} {name}: the mask ignored is not caught ({ignored:.2e})"


@pytest.mark.parametrize("arch", [pytest.param(a, id=a) for a in TAKERS])
def test_token_timesteps_run_under_the_step_cache(arch, family_pools, model_dir):
    """The step cache on the MODEL (a row's decision reads the first block's output, per
    token here): the same call with a timestep per token twice at Ulysses 2, the cache on,
    computes the first call's rows and skips the second's (nothing changed), both equal to
    one rank without the cache."""
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    call, want, _ = one_rank(arch, family_pools, model_dir)
    config = LAYOUTS["ulysses2"]
    den = PoolDenoiser(family_pools.get(arch, config, worker_hooks=[NCCL_RULES]),
                       config.with_world_size(config.product), arch)
    den.cache = dict(threshold=1e-3, warmup=0, head=1, tail=0, max_skips=0)
    for _ in range(2):
        got = den(**call)
        assert maxdiff(got, want) <= TOL, f"{arch}: {maxdiff(got, want):.3e} under the cache"
    assert den.cache_counts == {"computed": 2, "skipped": 2}, den.cache_counts


@pytest.mark.parametrize("arch,variant,inputs,name",
                         [pytest.param(a, v, i, n, id=f"{a}-{v}-{n}")
                          for a, v, i in VARIANTS for n in LAYOUTS])
def test_token_timestep_variants_on_two_ranks_equal_one_rank(arch, variant, inputs, name,
                                                             family_pools, model_dir):
    call, plain, _ = one_rank(arch, family_pools, model_dir)
    pool1 = family_pools.get(arch, ParallelConfig())
    key = (arch, variant)
    if key not in _ONE_RANK:
        want = call_model(pool1, ParallelConfig(), arch, call, inputs)
        moved = maxdiff(want, plain)
        assert moved > 1e-3, f"{arch} {variant}: the variant does not move the call ({moved:.2e})"
        for left in inputs:  # each input is read
            partial = {k: v for k, v in inputs.items() if k != left}
            d = maxdiff(call_model(pool1, ParallelConfig(), arch, call, partial), want)
            print(f"{arch} {variant} without {left}: {d:.2e} from the variant")
            assert d > 1e-4, f"{arch} {variant}: without {left} the call is unchanged ({d:.2e})"
        _ONE_RANK[key] = want
    want = _ONE_RANK[key]
    pool = family_pools.get(arch, LAYOUTS[name], worker_hooks=[NCCL_RULES])
    got = call_model(pool, LAYOUTS[name], arch, call, inputs)
    d, other = maxdiff(got, want), maxdiff(got, plain)
    print(f"{arch} MODEL call, a timestep per token, {variant}, {name}: {d:.2e} from 1 rank "
          f"(the plain call {other:.2e} away)")
    assert d <= TOL, f"{arch} {variant} {name}: {d:.3e} from one rank"
    assert other > 1e-3, f"{arch} {variant} {name}: the variant was dropped ({other:.2e})"
