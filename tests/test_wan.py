"""Wan 2.1 / 2.2 text-to-video through the pool equals diffusers' WanPipeline
(docs/design.md#numerics-rule-4): the UniPC flow step against the scheduler's own, one rank at
a token count no rank count divides (3 frames x 3 x 5 tokens) and an even one, batches of 1 and
2, with and without CFG; Wan 2.2 A14B's two experts switching at the pipeline's step, each with
its guidance scale, on several layouts; the video decode; the NCCL-rules emulation with the
experts. That Wan 2.1's other methods equal one rank is the conformance suite's
(tests/conformance/).

The noise is ComfyUI's for the LATENT [B, 16, (frames - 1) / 4 + 1, H/8, W/8], which
WanPipeline takes as its latents unchanged; its result is brought to ComfyUI's LATENT (x * std
+ mean, latent_formats.Wan21) to compare with the pool's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
from conftest import LayoutPools

TOL = 1e-4
SIZES = {"odd": (48, 80, 9), "even": (64, 64, 5)}  # (h, w, frames): 45 and 32 tokens
PROMPTS = ["a red cat", "a big blue dog sitting on a green field"]
NEGATIVE = "ugly dark"
MSL = 32
STEPS = 4  # shift 3: timesteps 999, 900, 750, 500 -> A14B's experts 0, 0, 1, 1

# ---- the step ------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 2, 3, 7])
@pytest.mark.parametrize("order,solver", [(2, "bh2"), (1, "bh2"), (3, "bh2"), (2, "bh1")])
def test_unipc_steps_equal_the_scheduler(steps, order, solver):
    """UniPCSteps (coefficients made once from the sigmas) against
    UniPCMultistepScheduler.step on the same model, the caller writing each step's result
    over its input in place as the loop does (the history must not alias it)."""
    from diffusers import UniPCMultistepScheduler

    from workers.sampling.flow_step import UniPCSteps
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    flow_shift=3.0, solver_order=order, solver_type=solver)
    sched.set_timesteps(steps)
    mine = UniPCSteps(sched.sigmas, sched.config)
    gen = torch.Generator().manual_seed(steps)
    x = torch.randn(2, 4, 3, 5, generator=gen)
    w = torch.randn(5, 5, generator=gen) * 0.5
    y = x.clone()
    compared = 0
    for i, t in enumerate(sched.timesteps):
        x = sched.step(torch.tanh(x @ w), t, x, return_dict=False)[0]
        y.copy_(mine.step(y, torch.tanh(y @ w), i))
        assert torch.isfinite(y).all()
        if not torch.isfinite(x).all():
            # diffusers' bh1 meets inf * 0 at the final sigma 0 (its first-order update
            # multiplies a zero residual by B(h) = -inf); ours gives x0 there, as bh2 does
            assert solver == "bh1" and i == steps - 1
            break
        assert float((x - y).abs().max()) <= 1e-6, f"step {i}"
        compared += 1
    assert compared >= min(steps, 1 if solver == "bh2" else steps - 1)


def test_unipc_history_per_key():
    """PipeFusion steps patches in turn: each key keeps its own history, so stepping two
    halves under two keys equals stepping the whole."""
    from diffusers import UniPCMultistepScheduler

    from workers.sampling.flow_step import UniPCSteps
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    flow_shift=3.0)
    sched.set_timesteps(5)
    whole, parts = UniPCSteps(sched.sigmas, sched.config), UniPCSteps(sched.sigmas, sched.config)
    x = torch.randn(1, 4, 6)
    y = x.clone()
    for i in range(5):
        v = torch.sin(3 * x)
        x = whole.step(x, v, i)
        vy = torch.sin(3 * y)
        y = torch.cat([parts.step(y[..., :3], vy[..., :3], i, key=0),
                       parts.step(y[..., 3:], vy[..., 3:], i, key=1)], -1)
    assert float((x - y).abs().max()) <= 1e-6


@pytest.mark.parametrize("kind", ["unipc", "euler"])
def test_step_rows_follows_pipefusions_bands(kind):
    """PipeFusion's last stage steps row ranges: the whole image (warmup), then bands that
    continue from their rows of its history, then the whole again (warmup restarted at an
    expert switch: each band steps with its own history), then bands. The rows end where
    stepping the whole latent every step ends (the whole image's own history, last written
    at the first warmup, could not continue: it lacks the steps between)."""
    from diffusers import UniPCMultistepScheduler

    from workers.sampling.flow_step import EulerSteps, UniPCSteps, step_rows
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    flow_shift=3.0)
    sched.set_timesteps(6)

    def steps():
        return UniPCSteps(sched.sigmas, sched.config) if kind == "unipc" \
            else EulerSteps(sched.sigmas.float())

    def take(t, a, b):  # rows are dim 2 of [B, C, rows, cols]
        return t[:, :, a:b]

    x0 = torch.randn(1, 2, 5, 3)
    whole, banded = steps(), steps()
    x, y = x0.clone(), x0.clone()
    bands = [(0, 3), (3, 5)]
    for i, plan in enumerate(["whole", "bands", "bands", "whole", "bands", "bands"]):
        x = whole.step(x, torch.sin(3 * x), i)
        rows = [(0, 5)] if plan == "whole" else bands
        v = torch.sin(3 * y)
        for a, b in rows:
            step_rows(banded, y[:, :, a:b], v[:, :, a:b], i, (a, b), take)
    assert float((x - y).abs().max()) <= 1e-6
    if kind == "unipc":  # the whole image's own history stopped at the first warmup step
        assert len(banded.state[(0, 5)]["m"]) == 1


def test_unsupported_scheduler_options_are_refused():
    from diffusers import UniPCMultistepScheduler

    from workers.sampling.denoise import check_scheduler
    with pytest.raises(ValueError, match="prediction_type"):
        check_scheduler(UniPCMultistepScheduler(prediction_type="epsilon"))
    check_scheduler(UniPCMultistepScheduler(prediction_type="flow_prediction",
                                            use_flow_sigmas=True))


# ---- the pool against WanPipeline ------------------------------------------------------------
@pytest.fixture(scope="module")
def wan_dirs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("wan")
    return {"t2v": ensure_tiny_model("wan", cache),
            "a14b": ensure_tiny_model("wan", cache, variant="a14b")}


@pytest.fixture(scope="module")
def pipes(wan_dirs):
    from diffusers import WanPipeline
    return {k: WanPipeline.from_pretrained(str(p)).to(torch.float32) for k, p in wan_dirs.items()}


@pytest.fixture(scope="module")
def oracle(pipes):
    """oracle(request, variant[, boundary]) -> WanPipeline's latent as a ComfyUI LATENT."""
    def run(req: GenerationRequest, variant: str = "t2v", boundary=None) -> torch.Tensor:
        pipe = pipes[variant]
        cfg = pipe.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        b, h, w, f = len(req.prompt), req.height, req.width, req.frames
        noise = torch.randn([b, 16, (f - 1) // 4 + 1, h // 8, w // 8],
                            generator=torch.manual_seed(req.seed))
        kw = {}
        if req.cfg_2 is not None:
            kw["guidance_scale_2"] = req.cfg_2
        saved, sched = pipe.config.boundary_ratio, pipe.scheduler
        if boundary is not None:
            pipe.register_to_config(boundary_ratio=boundary)
        if req.shift is not None:  # the scheduler made at the request's flow shift
            pipe.scheduler = type(sched).from_config(sched.config, flow_shift=req.shift)
        try:
            out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, height=h,
                       width=w, num_frames=f, num_inference_steps=req.steps,
                       guidance_scale=req.cfg, latents=noise, max_sequence_length=MSL,
                       output_type="latent", **kw).frames
        finally:
            pipe.register_to_config(boundary_ratio=saved)
            pipe.scheduler = sched
        return out * std + mean
    return run



def request(size: str, batch: int, cfg: float = 4.0, seed: int = 5, **kw) -> GenerationRequest:
    h, w, f = SIZES[size]
    kw.setdefault("frames", f)
    kw.setdefault("steps", STEPS)
    return GenerationRequest(prompt=PROMPTS[:batch], seed=seed, height=h, width=w, cfg=cfg, negative_prompt=NEGATIVE,
                             max_sequence_length=MSL, **kw)


def check(got, want, what: str):
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"


def test_one_rank_equals_the_pipeline(wan_dirs, layout_pools, oracle):
    pool = layout_pools.get(wan_dirs["t2v"], ParallelConfig())
    for size in SIZES:
        for batch, cfg in ((1, 4.0), (2, 2.5), (1, 1.0)):
            req = request(size, batch, cfg)
            got = pool.generate(req).samples
            h, w, f = SIZES[size]
            assert got.shape == (batch, 16, (f - 1) // 4 + 1, h // 8, w // 8)
            check(got, oracle(req), f"1 rank {size} batch {batch} cfg {cfg}")


@pytest.mark.parametrize("config", [ParallelConfig(), ParallelConfig(ulysses=2),
                                    ParallelConfig(cfg_parallel=True), ParallelConfig(dp=2)],
                         ids=["1rank", "ulysses2", "cfg2", "dp2"])
def test_two_experts_equal_the_pipeline(wan_dirs, layout_pools, oracle, config):
    """Wan 2.2 A14B: the high-noise expert for t >= 875, the low-noise one after, each at its
    own guidance scale (cfg_2), at the pipeline's step."""
    pool = layout_pools.get(wan_dirs["a14b"], config)
    req = request("odd", 2, cfg=4.0, cfg_2=2.0)
    got = pool.generate(req).samples
    check(got, oracle(req, "a14b"), f"a14b {config.describe()}")
    if config.world_size == 1:
        # negative controls: one expert for every step, or the first scale throughout,
        # move the result well beyond the tolerance
        assert float((got - oracle(req, "a14b", boundary=0.0)).abs().max()) > 1e-3
        same = request("odd", 2, cfg=4.0, cfg_2=None)
        assert float((got - oracle(same, "a14b")).abs().max()) > 1e-3


@pytest.mark.parametrize("config", [ParallelConfig(), ParallelConfig(ulysses=2)],
                         ids=["1rank", "ulysses2"])
def test_shift_equals_the_pipeline_at_that_flow_shift(wan_dirs, layout_pools, oracle, config):
    """A request's `shift` replaces the folder's UniPC flow_shift (3): Wan 2.2 A14B equals
    WanPipeline with its scheduler made at flow_shift 12 (the original code's T2V A14B
    value), the expert switch following the shifted timesteps (experts 0, 0, 0, 1 instead
    of 0, 0, 1, 1); the folder's own shift is far from it."""
    pool = layout_pools.get(wan_dirs["a14b"], config)
    req = request("odd", 1, cfg=4.0, cfg_2=2.0, steps=4, shift=12.0)
    got = pool.generate(req).samples
    check(got, oracle(req, "a14b"), f"a14b shift 12 {config.describe()}")
    if config.world_size == 1:
        plain = dataclasses.replace(req, shift=None)
        assert float((got - oracle(plain, "a14b")).abs().max()) > 1e-3
        from diffusers import UniPCMultistepScheduler
        sched = UniPCMultistepScheduler.from_pretrained(str(wan_dirs["a14b"]),
                                                        subfolder="scheduler")
        bound = 0.875 * 1000
        for shift, want in ((None, [0, 0, 1, 1]), (12.0, [0, 0, 0, 1])):
            s = sched if shift is None else UniPCMultistepScheduler.from_config(
                sched.config, flow_shift=shift)
            s.set_timesteps(4)
            assert [0 if float(t) >= bound else 1 for t in s.timesteps] == want, shift


def test_bad_frame_counts_are_refused(wan_dirs, layout_pools):
    from comfyui_xdit.planning.config import ConfigError
    pool = layout_pools.get(wan_dirs["t2v"], ParallelConfig())
    with pytest.raises((ConfigError, ValueError), match=r"4k \+ 1.*try 5 or 9"):
        pool.generate(request("even", 1, frames=6))
    got = pool.generate(request("even", 1, frames=1)).samples  # one frame: an image
    assert got.shape[2] == 1


def test_video_decode_equals_the_vae(wan_dirs, layout_pools, pipes):
    """The pool's patch-parallel decode of a multi-frame LATENT = the VAE in one process,
    as an IMAGE batch of the frames in order."""
    vae = pipes["t2v"].vae
    lat = torch.randn(2, 16, 3, 6, 10, generator=torch.manual_seed(0))
    want = vae.decode(lat, return_dict=False)[0]
    want = (want / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).flatten(0, 1)
    got = layout_pools.get(wan_dirs["t2v"], ParallelConfig(ulysses=2)).decode(lat)
    assert got.shape == (18, 48, 80, 3) and want.std() > 1e-3
    assert float((got - want).abs().max()) <= 1e-4


def test_methods_under_the_nccl_rules(wan_dirs, oracle):
    cache = LayoutPools()
    try:
        # (Wan 2.1's methods under the rules are the conformance suite's; here the experts)
        for variant, config, batch, opts in (
                ("a14b", ParallelConfig(cfg_parallel=True, ulysses=2), 1, {}),
                # both experts sharded over 4 ranks; each stage of a pipeline holding both
                ("a14b", ParallelConfig(dp=2, ulysses=2), 2, {"shard_weights": True}),
                ("a14b", ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=STEPS), 1, {})):
            pool = cache.get(wan_dirs[variant], config,
                             worker_hooks=["xdit_testhooks.nccl_rules:install"], **opts)
            req = request("odd", batch, cfg_2=3.0 if variant == "a14b" else None)
            check(pool.generate(req).samples, oracle(req, variant),
                  f"nccl rules {variant} {config.describe()} {opts}")
            if config.pipefusion > 1:  # pipelined, the warmup restarting at the switch
                pool.reconfigure(dataclasses.replace(config, warmup_steps=1))
                req = request("odd", batch, cfg_2=3.0, steps=4)  # experts 0, 0, 1, 1
                piped = pool.generate(req).samples
            cache.close()  # one 4-rank pool at a time
    finally:
        cache.close()
    # the same pipelined run on plain PipeFusion 2 without the rules (Ulysses inside the
    # stages changes nothing)
    with WorkerPool(wan_dirs["a14b"], ParallelConfig(pipefusion=2, warmup_steps=1),
                    device="cpu", threads_per_rank=1) as plain:
        check(piped, plain.generate(req).samples, "nccl rules: PipeFusion 2 x Ulysses 2, "
                                                  "warmup 1 over the expert switch")


def test_step_cache_decides_alike_on_every_layout(wan_dirs, layout_pools, oracle):
    """The step cache on Wan's blocks (called positionally) and 2.2's two experts (each its
    own residuals): it skips, stays near the exact run, and gives the 1-rank latent and
    counts under Ulysses / Ring with uneven (padded) token shards, CFG and DP."""
    cache = {"threshold": 0.5, "warmup": 1, "head": 1, "tail": 0, "max_skips": 3}
    req = request("odd", 2, cfg=3.0, cfg_2=2.0, steps=8, cache=cache)
    base = layout_pools.get(wan_dirs["a14b"], ParallelConfig())
    res = base.generate(req)
    counts = res.stats[0]["cache"]
    assert counts["skipped"] > 0 and counts["computed"] > 0, counts
    exact = base.generate(request("odd", 2, cfg=3.0, cfg_2=2.0, steps=8)).samples
    d = float((res.samples - exact).abs().max())
    assert 0 < d < 0.5 * float(exact.abs().max()), f"cached vs exact {d}"
    for config in (ParallelConfig(ulysses=2), ParallelConfig(ring=2),
                   ParallelConfig(cfg_parallel=True), ParallelConfig(dp=2)):
        other = layout_pools.get(wan_dirs["a14b"], config).generate(req)
        check(other.samples, res.samples, f"step cache {config.describe()}")
        per_rank = [r["cache"] for r in other.stats]
        if config.sp > 1:
            assert all(c == counts for c in per_rank), (config.describe(), per_rank)
        else:
            assert {k: sum(c[k] for c in per_rank) for k in counts} == counts, per_rank


def test_cache_reads_the_plan_of_blocks_not_given_it():
    """Wan's blocks get no sequence plan in their keywords: the cache's decision reads it
    from the installed SequenceParallel, so a padded shard's extra token is left out."""
    from workers import families
    from workers.parallel.sequence_parallel import SequencePlan
    from workers.sampling.step_cache import _parameter_names, _real_image_tokens
    plan = SequencePlan(sp_rank=1, sp_size=2, tokens={"image": 45, "text": 7}, padded=True,
                        layout=families.FAMILIES["wan"].tokens)
    assert _real_image_tokens({}, 23) == 23  # without the plan: padding counted
    assert _real_image_tokens({}, 23, lambda: plan) == 22
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    block = WanTransformerBlock(8, 16, 2, cross_attn_norm=True)
    assert _parameter_names(block)[:2] == ("hidden_states", "encoder_hidden_states")


def test_no_host_waits_in_the_steps(wan_dirs):
    """Wan's steps wait on nothing host-side (xdit_testhooks/host_syncs.py, as
    tests/test_gpu_step.py for the image families): the UniPC step's scalars, the expert and
    guidance scale of each step are host values decided in `prepare`, under Ulysses x Ring
    with uneven shards and under CFG x DP, across the expert switch."""
    hook = "xdit_testhooks.host_syncs:install"
    cache = LayoutPools()
    try:
        for config in (ParallelConfig(ulysses=2, ring=2), ParallelConfig(cfg_parallel=True, dp=2)):
            pool = cache.get(wan_dirs["a14b"], config, worker_hooks=[hook])
            res = pool.generate(request("odd", 2, cfg_2=2.0))
            for st in res.stats:
                counts = st["hooks"][hook]["counts"]
                steps = sorted(int(k.split(":")[1]) for k in counts
                               if k.startswith("job:") and k.split(":")[1] != "None")
                assert steps == list(range(STEPS)), list(counts)
                late = {k: v for k, v in counts.items()
                        if k.startswith("job:") and k.split(":")[1] not in ("None", "0")}
                assert all(not v for v in late.values()), (config.describe(), late,
                                                          st["hooks"][hook]["where"])
    finally:
        cache.close()
