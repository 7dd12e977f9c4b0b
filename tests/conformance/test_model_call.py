"""The xDiT MODEL's call (ComfyUI's diffusion-model call, on the pool) for every family:
one batched call of an uncond and a cond row (inputs from the registry alone,
tests/family_requests.model_call_inputs) under CFG 2, Ulysses 2, Ring 2 and DP 2 equals the
call at one rank (<= 1e-4; a LATENT of parts, as LTX-2's video and sound, part by part). Negative control: the conditionings swapped change the prediction.

That the call at one rank is the family's diffusers transformer in ComfyUI's conventions is
each family's own test (the conventions are family-specific).
"""
from __future__ import annotations

import uuid

import pytest

from comfyui_xdit import ParallelConfig
from family_requests import families, model_call_inputs

from .cases import NCCL_RULES, TOL, TWO_RANKS, maxdiff, params

_ONE_RANK: dict = {}


def call_model(pool, config: ParallelConfig, arch: str, call: dict):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    return PoolDenoiser(pool, config.with_world_size(config.product), arch)(**call)


def one_rank(arch, family_pools, model_dir):
    if arch not in _ONE_RANK:
        call = model_call_inputs(arch, model_dir(arch))
        _ONE_RANK[arch] = call, call_model(family_pools.get(arch, ParallelConfig()),
                                           ParallelConfig(), arch, call)
    return _ONE_RANK[arch]


@pytest.mark.parametrize("arch,name", params("model_call", TWO_RANKS))
def test_model_call_equals_one_rank(arch, name, family_pools, model_dir):
    call, want = one_rank(arch, family_pools, model_dir)
    pool = family_pools.get(arch, TWO_RANKS[name], worker_hooks=[NCCL_RULES])
    got = call_model(pool, TWO_RANKS[name], arch, call)
    d = maxdiff(got, want)
    print(f"{arch} MODEL call {name}: {d:.2e} from 1 rank")
    assert d <= TOL, f"{arch} MODEL call {name}: {d:.3e}"
    swapped = dict(call, transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()],
                                              "cond_or_uncond": [1, 0]})
    second = families.family(arch).capability(families.SecondTextEncoder)
    for key in ("context", "y", second.comfy_input if second else None):
        if key in call:
            swapped[key] = call[key].flip(0)
    other = call_model(pool, TWO_RANKS[name], arch, swapped)
    assert maxdiff(first_row(other), first_row(got)) > 1e-3, \
        f"{arch} {name}: the conditioning is not read"


def first_row(pred):
    """The first row of a prediction (of each part, for a LATENT of parts)."""
    return [p[:1] for p in pred] if isinstance(pred, (list, tuple)) else pred[:1]
