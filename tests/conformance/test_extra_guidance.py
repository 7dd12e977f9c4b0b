"""A family's extra guidance passes (its ExtraGuidance capability, workers/sampling/
guidance.py) on the CFG axis equal one rank running them in turn, for every family that
declares them, on the family's small request with its builder's `EXTRA_GUIDANCE` settings
(comfyui_xdit/testmodels/<id>.py: every pass on, and a set of three passes that two cfg
ranks split unevenly): CFG 2, CFG 2 x Ulysses 2, and CFG 2 under weight sharding (where
the rank with fewer passes runs one more forward to keep FSDP's all-gathers in step), under
the NCCL-rules emulation. That one rank equals the family's pipeline with those settings is
the family's own test (LTX-2: tests/test_ltx2_guidance.py).

Negative control: with every pass on, the result moves (the one-rank result differs from
the one without them), so a rank that dropped the passes would show.
"""
from __future__ import annotations

import importlib

import pytest

from comfyui_xdit import ParallelConfig
from family_requests import families

from .cases import CASES, NCCL_RULES, TOL, maxdiff

LAYOUTS = {"cfg2": (ParallelConfig(cfg_parallel=True), {}),
           "cfg2xulysses2": (ParallelConfig(cfg_parallel=True, ulysses=2), {}),
           "sharded-cfg2": (ParallelConfig(cfg_parallel=True), {"shard_weights": True})}


def _settings(arch) -> tuple:
    return getattr(importlib.import_module(f"comfyui_xdit.testmodels.{arch}"),
                   "EXTRA_GUIDANCE", ())


GUIDED = [a for a in CASES if families.family(a).capability(families.ExtraGuidance)]
PARAMS = [pytest.param(a, k, name, id=f"{a}-{name}-{k}")
          for a in GUIDED for k in range(len(_settings(a))) for name in LAYOUTS]


def test_every_guided_family_declares_its_settings():
    for arch in GUIDED:
        sets = _settings(arch)
        assert sets, f"{arch} declares extra guidance but its builder has no EXTRA_GUIDANCE"
        for s in sets:
            assert not CASES[arch].request(extra_guidance=s).problems(arch), (arch, s)


@pytest.mark.parametrize("arch,k,name", PARAMS)
def test_passes_on_the_cfg_axis_equal_one_rank(arch, k, name, family_pools):
    c = CASES[arch]
    req = c.request(extra_guidance=_settings(arch)[k])
    want = family_pools.one_rank(arch, req).latents
    if k == 0:  # every pass on (a pass may move a tiny model little alone: LTX-2's STG)
        plain = family_pools.one_rank(arch, c.request()).latents
        assert maxdiff(want, plain) > 1e-3, "the extra passes do not move the result"
    config, options = LAYOUTS[name]
    pool = family_pools.get(arch, config, worker_hooks=[NCCL_RULES], **options)
    d = maxdiff(pool.generate(req).latents, want)
    print(f"{arch} {name} settings {k}: max abs vs 1 rank {d:.2e}")
    assert d <= TOL, f"{arch} {name}: {d:.3e} from one rank"
