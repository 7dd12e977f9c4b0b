"""Every parallel method under NCCL's point-to-point rules, emulated on gloo
(xdit_testhooks/nccl_rules.py): one ordered stream per pair of ranks, both directions alike;
a pair's first send/recv blocks both hosts until each has made it. A schedule that gloo
forgives and NCCL would deadlock on fails here within seconds, naming the ranks and the
operation. Negative controls: the old data-parallel collector and the old PipeFusion
transfer order must be caught (and must pass on plain gloo, so the emulation is what
catches them).

The exact methods (two and four ranks, every family) under the rules are the conformance
suite's (tests/conformance/test_methods_exact.py); here are the schedules it does not run:
the MODEL call's subgroup gather, decode and cancel, PipeFusion's transfers, FLUX.2's
references, the step cache with collective matching, and the negative controls.

Pools are shared across cases (one launch per layout); results are checked against the
single-process diffusers oracle (exact methods) or the same layout on plain gloo
(pipelined PipeFusion).
"""
from __future__ import annotations

import os

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

RULES = "xdit_testhooks.nccl_rules:install"
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def short_deadlock_timeout():
    old = os.environ.get("XDIT_NCCL_RULES_TIMEOUT")
    os.environ["XDIT_NCCL_RULES_TIMEOUT"] = "8"
    yield
    if old is None:
        os.environ.pop("XDIT_NCCL_RULES_TIMEOUT", None)
    else:
        os.environ["XDIT_NCCL_RULES_TIMEOUT"] = old


@pytest.fixture(scope="module")
def rule_pools(model_dir):
    from conftest import LayoutPools
    cache = LayoutPools()

    def get(arch, config, hooks=(RULES,), name=""):
        return cache.get(model_dir(arch), config, tag=name, worker_hooks=list(hooks))
    yield get
    cache.close()


def _req(arch, batch=1, cfg=None, **kw):
    prompts = ["a red fox", "a blue bird", "a green tree"][:batch]
    base = dict(prompt=prompts, seed=11, steps=3, height=64, width=96, max_sequence_length=8,
                negative_prompt="blurry")
    base["cfg"] = cfg if cfg is not None else (3.0 if arch == "sd3" else 1.0)
    base.update(kw)
    return GenerationRequest(**base)


def test_model_calls_under_nccl_rules(rule_pools):
    """The xDiT MODEL's calls: only the dp x cfg leaders gather the rows (a subgroup), the
    other ranks return; with an uneven row split and one replica holding none."""
    import diffusers
    from test_model_calls import comfy_call, reference

    from comfyui_xdit.nodes.model_calls import PoolDenoiser

    pool = rule_pools("flux", ParallelConfig(ulysses=2, ring=2))
    tr = diffusers.FluxTransformer2DModel.from_pretrained(
        str(pool.model_path), subfolder="transformer", torch_dtype=torch.float32).eval()
    call = comfy_call("flux", tr, 1, 10, 6, seed=5)  # 2 rows, 15 image tokens
    want = reference("flux", tr, call["x"], call["timestep"], call["context"], call["y"],
                     call["guidance"])
    for config in (ParallelConfig(dp=2, ulysses=2), ParallelConfig(cfg_parallel=True, ring=2),
                   ParallelConfig(dp=4)):  # dp 4: two replicas have no row
        den = PoolDenoiser(pool, config.with_world_size(4), "flux")
        for _ in range(2):
            d = float((den(**call) - want).abs().max())
            assert d <= TOL, f"{config.describe()}: {d}"


def test_image_output_decode_and_cancel_under_nccl_rules(rule_pools):
    from comfyui_xdit.client.pool import JobCancelled

    pool = rule_pools("flux", ParallelConfig(ulysses=2))
    pool.reconfigure(ParallelConfig(ulysses=2))
    res = pool.generate(_req("flux", output="image", height=128, width=128))
    assert res.images is not None and res.images.shape == (1, 128, 128, 3)
    again = pool.decode(res.samples)
    assert float((again - res.images).abs().max()) < 1e-5
    # cancel mid-job: every rank leaves at the same step; the pool stays warm
    steps = []

    def stop_after_first(event):
        if "step" in event:
            steps.append(event["step"])
            pool.cancel()
    # many steps: the cancel is sent from step 1's event and must land before the job could
    # end on its own, even on a loaded machine (6 steps raced it once)
    with pytest.raises(JobCancelled):
        pool.generate(_req("flux", steps=100), on_event=stop_after_first)
    assert steps and steps[-1] < 100
    assert pool.generate(_req("flux")).samples.shape == (1, 16, 8, 12)


def test_pipefusion_under_nccl_rules(rule_pools, oracle):
    req = _req("flux", steps=4, height=96, width=64, batch=2)
    sync = ParallelConfig(pipefusion=2, warmup_steps=4)
    pool = rule_pools("flux", sync)
    diff = float((pool.generate(req).samples - oracle("flux", req)).abs().max())
    assert diff <= TOL, f"synchronous PipeFusion: {diff}"
    piped = ParallelConfig(pipefusion=2, warmup_steps=1, pipeline_patches=3)
    pool.reconfigure(piped)
    got = pool.generate(req).samples
    plain = rule_pools("flux", piped, hooks=()).generate(req).samples
    assert float((got - plain).abs().max()) <= 1e-6  # same schedule, same numbers
    # with CFG in one pipeline, and a cancel in the middle of the pipeline
    cfg_req = _req("flux", steps=3, height=96, width=64, cfg=2.0)
    pool.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=3))
    diff = float((pool.generate(cfg_req).samples - oracle("flux", cfg_req)).abs().max())
    assert diff <= TOL


def test_mixed_pipefusion_layouts_under_nccl_rules(rule_pools, oracle):
    req = _req("sd3", steps=3, height=96, width=64)
    for config in (ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3),
                   ParallelConfig(pipefusion=2, cfg_parallel=True, warmup_steps=3)):
        pool = rule_pools("sd3", config)
        diff = float((pool.generate(req).samples - oracle("sd3", req)).abs().max())
        assert diff <= TOL, f"{config.describe()}: {diff}"
    piped = ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=1, pipeline_patches=2)
    pool = rule_pools("sd3", piped)
    assert torch.isfinite(pool.generate(req).samples).all()


# ---- negative controls -------------------------------------------------------------------
NEGATIVE = [
    ("xdit_testhooks.faults:early_dp_receive", ParallelConfig(dp=2), {"batch": 2}),
    ("xdit_testhooks.faults:ungrouped_exchange",
     ParallelConfig(pipefusion=2, warmup_steps=1, pipeline_patches=2), {"steps": 3}),
]


@pytest.mark.parametrize("fault,config,kw", NEGATIVE, ids=["old-dp-collector",
                                                          "old-pipefusion-order"])
def test_old_schedules_pass_on_gloo_and_deadlock_under_nccl_rules(rule_pools, fault, config,
                                                                  kw):
    from comfyui_xdit.client.pool import PoolError

    req = _req("flux", height=96, width=64, **kw)
    forgiving = rule_pools("flux", config, hooks=(fault,))
    assert forgiving.generate(req).samples.shape[0] == req.batch  # gloo lets it through
    strict = rule_pools("flux", config, hooks=(RULES, fault))
    with pytest.raises(PoolError) as err:
        strict.generate(req)
    msg = str(err.value)
    assert "NCCL" in msg and "rank" in msg, msg


# ---- FLUX.2 with reference images ----------------------------------------------------------
def test_flux2_with_references_under_nccl_rules(rule_pools):
    """FLUX.2 with two reference images (joined to the image stream, split over the sp ranks;
    under PipeFusion computed with each step's first patch) under NCCL's rules gives exactly
    what the same layout gives on plain gloo. Exactness against diffusers is
    tests/test_flux2_methods.py's and tests/test_references.py's; here the question is the
    transfer order alone."""
    g = torch.Generator().manual_seed(5)
    refs = [torch.randn(1, 128, 4, 5, generator=g), torch.randn(1, 128, 3, 4, generator=g)]
    for config, kw in [(ParallelConfig(ulysses=2), {"batch": 3, "cfg": 2.0}),
                       (ParallelConfig(ring=2), {}),
                       (ParallelConfig(pipefusion=2, warmup_steps=1, pipeline_patches=2),
                        {"steps": 4, "cfg": 2.0})]:
        req = _req("flux2", height=112, width=80, reference_latents=refs, **kw)
        got = rule_pools("flux2", config).generate(req).samples
        plain = rule_pools("flux2", config, hooks=()).generate(req).samples
        assert got.shape == (req.batch, 128, 7, 5)
        assert float((got - plain).abs().max()) <= 1e-6, config.describe()


def test_step_cache_under_nccl_rules(rule_pools, monkeypatch):
    """The step cache's skips under NCCL's ordering rules, with the emulation's collective
    matching on (every rank of a group must issue the same collectives in order: a rank that
    skipped blocks its peers ran would break it): Ulysses x Ring, CFG x Ring and DP x Ulysses
    give the one-rank latent with skips on; the negative control, ranks of one row deciding
    apart (xdit_testhooks/faults.py:unreduced_cache), is reported instead of hanging, and
    the pool serves the next job."""
    from comfyui_xdit.client.pool import PoolError
    monkeypatch.setenv("XDIT_NCCL_RULES_COLLECTIVES", "1")  # the pools below start with it

    cache = {"threshold": 0.5, "warmup": 1, "max_skips": 2}
    req = _req("flux", steps=6, cfg=2.5, batch=3, cache=cache)
    one = rule_pools("flux", ParallelConfig(), name="one").generate(req)
    assert one.stats[0]["cache"]["skipped"] > 0
    pool = rule_pools("flux", ParallelConfig(ulysses=2, ring=2), name="cache")
    for config in (ParallelConfig(ulysses=2, ring=2), ParallelConfig(cfg_parallel=True, ring=2),
                   ParallelConfig(dp=2, ulysses=2)):
        pool.reconfigure(config)
        got = pool.generate(req)
        diff = float((got.samples - one.samples).abs().max())
        assert diff <= TOL, f"{config.describe()}: {diff}"
    bad = rule_pools("flux", ParallelConfig(ulysses=2), name="unreduced",
                     hooks=(RULES, "xdit_testhooks.faults:unreduced_cache"))
    with pytest.raises(PoolError, match="NCCL rules .emulation.: (collective|rank)"):
        bad.generate(_req("flux", steps=6, cache={"threshold": 1e-9, "warmup": 1}))
    assert bad.generate(_req("flux", steps=2)).samples.shape == (1, 16, 8, 12)
