"""A family's extra guidance passes (its ExtraGuidance capability, workers/sampling/
guidance.py) on the CFG axis equal one rank running them in turn, for every family that
declares them, on the family's small request with its builder's `EXTRA_GUIDANCE` settings
(comfyui_xdit/testmodels/<id>.py: every pass on, and a set of three passes that two cfg
ranks split unevenly): CFG 2, CFG 2 x Ulysses 2, and CFG 2 under weight sharding (where
the rank with fewer passes runs one more forward to keep FSDP's all-gathers in step), under
the NCCL-rules emulation; and at a cfg degree equal to the pass count (CFG 4 with every
pass on, CFG 3 with three), each pass on ranks of its own. That one rank equals the family's
pipeline with those settings is the family's own test (LTX-2: tests/test_ltx2_guidance.py).

A degree above a run's passes is refused before the job, in one line; ComfyUI's KSampler
on the xDiT MODEL at that degree (one call of its uncond and cond rows, split over the
replicas, two of them idle) equals the call at one rank.

Negative controls: with every pass on, the result moves (the one-rank result differs from
the one without them), so a rank that dropped the passes would show; and at CFG 4 a gather
that files each pass's prediction under the next pass's name is caught.
"""
from __future__ import annotations

import importlib

import pytest

from comfyui_xdit import ConfigError, ParallelConfig
from family_requests import families

from .cases import CASES, NCCL_RULES, TOL, maxdiff
from .test_model_call import call_model, one_rank

LAYOUTS = {"cfg2": (ParallelConfig(cfg_parallel=True), {}),
           "cfg2xulysses2": (ParallelConfig(cfg_parallel=True, ulysses=2), {}),
           "sharded-cfg2": (ParallelConfig(cfg_parallel=True), {"shard_weights": True}),
           # a degree above 2 runs where it equals the settings' pass count
           "cfg3": (ParallelConfig(cfg_parallel=3), {}),
           "cfg4": (ParallelConfig(cfg_parallel=4), {})}
CFG4 = LAYOUTS["cfg4"][0]
WRONG_RANK = "xdit_testhooks.faults:passes_from_the_wrong_rank"


def _settings(arch) -> tuple:
    return getattr(importlib.import_module(f"comfyui_xdit.testmodels.{arch}"),
                   "EXTRA_GUIDANCE", ())


def _passes(arch, settings) -> tuple:
    """The names of the passes a step of the family's small request with `settings` runs."""
    req = CASES[arch].request(extra_guidance=settings)
    return families.guidance_pass_names(families.family(arch), settings, req.resolved_cfg(arch))


def _runs(arch, k, name) -> bool:
    degree = LAYOUTS[name][0].cfg
    return degree <= 2 or degree == len(_passes(arch, _settings(arch)[k]))


GUIDED = [a for a in CASES if families.family(a).capability(families.ExtraGuidance)]
PARAMS = [pytest.param(a, k, name, id=f"{a}-{name}-{k}")
          for a in GUIDED for k in range(len(_settings(a))) for name in LAYOUTS
          if _runs(a, k, name)]
# the settings with the most passes, for the degree-4 checks
MOST = {a: max(range(len(_settings(a))), key=lambda k: len(_passes(a, _settings(a)[k])))
        for a in GUIDED}


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


def test_the_degrees_above_two_are_checked():
    """Every guided family's settings give CFG 4 (every pass on) and CFG 3 a run each."""
    for arch in GUIDED:
        got = {name for a, k, name in (p.values for p in PARAMS) if a == arch}
        assert {"cfg3", "cfg4"} <= got, (arch, got)


def test_the_workers_refuse_a_degree_above_the_passes():
    """The workers' own check (a job the host did not validate): the same line; a degree up
    to the pass count runs."""
    from workers.sampling.guidance import COND, UNCOND, Pass, check_degree
    passes = [UNCOND, COND, Pass("stg")]
    with pytest.raises(ValueError, match=r"^cfg-parallel 4 needs 4 guidance passes per step; "
                                         r"this run has 3 \(uncond, cond, stg\): use "
                                         r"cfg-parallel 3 or less$"):
        check_degree(passes, 4)
    with pytest.raises(ValueError, match=r"this run has 1 \(cond\): turn cfg-parallel off"):
        check_degree([COND], 2)
    for degree in (1, 2, 3):
        check_degree(passes, degree)


@pytest.mark.parametrize("arch", GUIDED)
def test_a_degree_above_the_passes_is_refused_and_the_model_call_runs(arch, family_pools,
                                                                       model_dir):
    """On the CFG 4 pool: a request with fewer than 4 passes is refused before the job, in
    one line naming the degree and the passes; ComfyUI's MODEL call (its uncond and cond
    rows) equals the call at one rank; the pool then runs a job of 4 passes."""
    c = CASES[arch]
    pool = family_pools.get(arch, CFG4, worker_hooks=[NCCL_RULES])
    fewer = [s for s in _settings(arch) if len(_passes(arch, s)) < 4] + [None]
    for settings in fewer:
        names = _passes(arch, settings)
        with pytest.raises(ConfigError) as e:
            pool.generate(c.request(extra_guidance=settings))
        msg = str(e.value)
        assert "\n" not in msg
        assert (f"cfg-parallel 4 needs 4 guidance passes per step; this run has {len(names)} "
                f"({', '.join(names)}): use cfg-parallel {len(names)} or less") in msg, msg
    call, want = one_rank(arch, family_pools, model_dir)
    pool = family_pools.get(arch, CFG4, worker_hooks=[NCCL_RULES])
    d = maxdiff(call_model(pool, CFG4, arch, call), want)
    print(f"{arch} MODEL call cfg4: {d:.2e} from 1 rank")
    assert d <= TOL, f"{arch} MODEL call cfg4: {d:.3e}"


@pytest.mark.parametrize("arch", GUIDED)
def test_a_pass_read_from_the_wrong_rank_is_caught(arch, family_pools):
    """Negative control: CFG 4 with each pass's prediction filed under the next pass's name
    moves the result far beyond the tolerance the tests above hold."""
    req = CASES[arch].request(extra_guidance=_settings(arch)[MOST[arch]])
    want = family_pools.one_rank(arch, req).latents
    pool = family_pools.get(arch, CFG4, tag="wrong-rank", worker_hooks=[WRONG_RANK])
    d = maxdiff(pool.generate(req).latents, want)
    print(f"{arch} cfg4, passes read from the wrong rank: {d:.2e} from 1 rank")
    assert d > 100 * TOL, f"{arch}: a misfiled pass moved the result by {d:.3e} only"
