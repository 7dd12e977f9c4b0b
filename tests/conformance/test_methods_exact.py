"""Every exact method equals one rank, for every family (docs/design.md#numerics-rule-4):
Ulysses 2, Ring 2, CFG 2 and DP 2 (three prompts, split unevenly), Ulysses 2 x Ring 2,
CFG 2 x Ring 2, CFG 2 x Ulysses 2, DP 2 x Ulysses 2, Ring 4, Ulysses 4 (where 4 divides the
test model's heads), and weight sharding under Ulysses 2 and DP 2, all on
the family's small request (a token grid no rank count divides, three text lengths, true CFG),
<= 1e-4 on the final LATENT. The multi-rank pools run under the NCCL-rules emulation
(docs/design.md#nccls-rules), so a schedule NCCL would deadlock on fails here too.

That one rank is the family's diffusers pipeline is each family's own test (its oracle is
family-specific code); with it, every method here equals the pipeline.

Negative controls: the one-rank result depends on the prompt, and a Ring merge with a zero
log-sum-exp (yunchang's CPU math bug) or padded keys left in the softmax is caught by the
same comparison.
"""
from __future__ import annotations

import pytest

from comfyui_xdit import ParallelConfig
from family_requests import families

from .cases import CASES, FOUR_RANKS, NCCL_RULES, SHARDED, TOL, TWO_RANKS, maxdiff, params

LAYOUTS = {**TWO_RANKS, **FOUR_RANKS, **SHARDED}
CAPABILITY = {"ulysses2": "sequence_parallel", "ring2": "sequence_parallel",
              "cfg2": "cfg_parallel", "dp2": "data_parallel", "ulysses2xring2": "hybrid",
              "cfg2xring2": "hybrid", "cfg2xulysses2": "hybrid", "dp2xulysses2": "hybrid",
              "ring4": "sequence_parallel", "ulysses4": "sequence_parallel",
              "sharded-ulysses2": "weight_sharding", "sharded-dp2": "weight_sharding"}


def _heads(arch, model_dir) -> int:
    import json
    with open(model_dir(arch) / "transformer" / "config.json") as f:
        cfg = families.family(arch).full_config(json.load(f))
    return families.family(arch).heads(cfg)


def _params():
    return [p for name in LAYOUTS for p in params(CAPABILITY[name], {name: None})]


@pytest.mark.parametrize("arch", params("sequence_parallel"))
def test_the_reference_depends_on_the_prompt(arch, family_pools):
    """Not a degenerate reference: at the same seed, swapping the first two prompts moves
    row 0, so the text reaches the transformer's prediction."""
    c = CASES[arch]
    got = family_pools.one_rank(arch, c.request()).samples
    swapped = family_pools.one_rank(arch, c.request([c.request().prompt[1]])).samples
    assert maxdiff(got[:1], swapped) > 1e-3, arch


@pytest.mark.parametrize("arch,name", _params())
def test_method_equals_one_rank(arch, name, family_pools, model_dir):
    c = CASES[arch]
    if LAYOUTS[name].ulysses > 1:
        heads = _heads(arch, model_dir)
        if heads % LAYOUTS[name].ulysses:
            pytest.skip(f"{arch}'s test model has {heads} heads; Ulysses "
                        f"{LAYOUTS[name].ulysses} must divide them")
    want = family_pools.one_rank(arch, c.request()).latents  # every latent it returns
    options = {"shard_weights": True} if name.startswith("sharded") else {}
    pool = family_pools.get(arch, LAYOUTS[name], worker_hooks=[NCCL_RULES], **options)
    got = pool.generate(c.request()).latents
    d = maxdiff(got, want)
    print(f"{arch} {name}: max abs vs 1 rank {d:.2e}")
    assert d <= TOL, f"{arch} {name}: {d:.3e} from one rank"


@pytest.mark.parametrize("fault,config", [("lse_zero", ParallelConfig(ring=2)),
                                          ("keep_padding", ParallelConfig(ulysses=2))])
def test_negative_control_wrong_attention_is_caught(fault, config, family_pools):
    """The comparison above fails for the bug classes it exists for (Chroma's small request:
    its odd token grid pads a shard)."""
    arch = "chroma" if "chroma" in CASES else next(iter(CASES))
    c = CASES[arch]
    want = family_pools.one_rank(arch, c.request()).samples
    pool = family_pools.get(arch, config, worker_hooks=[f"xdit_testhooks.faults:{fault}"])
    d = maxdiff(pool.generate(c.request()).samples, want)
    print(f"{arch} {fault}: {d:.2e} from one rank")
    assert d > 10 * TOL, f"fault {fault} went unnoticed ({d:.2e})"
