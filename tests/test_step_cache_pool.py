"""The step cache on the pool: the same latent and the same skips at any layout, equal to a
single-process reference written here from diffusers alone (its transformer and its
published First Block Cache, one cache context per row, the rule applied row by row).

MODEL path (ComfyUI's samplers call the pool once per step with the unconditional and
conditional rows side by side): an Euler sampler with CFG run here on the host, over Ulysses
2, Ring 2, CFG parallel, DP 2 and Ulysses x Ring, batch 1 and 2; threshold 0 is the uncached
result exactly; a new sampling run (new conditioning keys) starts with a fresh cache; a
two-call sampler step (Heun) counts each call.
"""
from __future__ import annotations

import copy
import uuid

import pytest
import torch

from comfyui_xdit import ParallelConfig
from comfyui_xdit.nodes.model_calls import PoolDenoiser

from conftest import pack_flux, unpack_flux

STEPS = 8
SCALE = 3.0


@pytest.fixture(scope="module")
def flux(model_dir):
    import diffusers
    return diffusers.FluxTransformer2DModel.from_pretrained(
        str(model_dir("flux")), subfolder="transformer", torch_dtype=torch.float32).eval()


def _inputs(tr, batch, h=8, w=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    x = torch.randn(batch, 16, h, w, generator=g)
    ctx = torch.randn(2, 7, cfg.joint_attention_dim, generator=g)  # uncond, cond
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g)
    return x, ctx, pooled


def _sigmas():
    return torch.linspace(1.0, 0.0, STEPS + 1)


def reference(tr, x, ctx, pooled, threshold, heun=False):
    """Euler (or Heun) with CFG on the diffusers transformer; with threshold > 0, diffusers'
    First Block Cache applied per row (each row its own cache context). Returns (latent,
    row-calls computed in full)."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    ref = copy.deepcopy(tr)
    computed = []
    if threshold > 0:
        apply_first_block_cache(ref, FirstBlockCacheConfig(threshold=threshold))
        ref.transformer_blocks[1].attn.register_forward_pre_hook(lambda m, a: computed.append(1))
    b, _, h, w = x.shape
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    ids = ids.reshape(-1, 3)

    def model(x, sigma):
        rows = []
        for branch in (0, 1):
            for i in range(b):
                with torch.inference_mode(), ref.cache_context(f"{branch}-{i}"):
                    out = ref(hidden_states=pack_flux(x[i:i + 1]), timestep=sigma.view(1),
                              guidance=torch.full((1,), 3.5), pooled_projections=pooled[branch:branch + 1],
                              encoder_hidden_states=ctx[branch:branch + 1],
                              txt_ids=torch.zeros(ctx.shape[1], 3), img_ids=ids,
                              return_dict=False)[0]
                rows.append(unpack_flux(out, h * 8, w * 8))
        un, co = torch.cat(rows[:b]), torch.cat(rows[b:])
        return un + SCALE * (co - un)

    x = _sample(model, x, heun)
    return x, (len(computed) if threshold > 0 else None)


def _sample(model, x, heun):
    s = _sigmas()
    for i in range(STEPS):
        d = model(x, s[i])
        if heun and s[i + 1] > 0:
            x2 = x + (s[i + 1] - s[i]) * d
            d = (d + model(x2, s[i + 1])) / 2
        x = x + (s[i + 1] - s[i]) * d
    return x


def on_pool(den, x, ctx, pooled, heun=False):
    """The same sampler through the xDiT MODEL: one call per model evaluation, the
    unconditional and conditional rows side by side (ComfyUI's batched call)."""
    b = x.shape[0]
    keys = [uuid.uuid4(), uuid.uuid4()]  # one sampling run

    def model(x, sigma):
        out = den(torch.cat([x, x]), sigma.expand(2 * b),
                  context=torch.cat([ctx[0:1].expand(b, -1, -1), ctx[1:2].expand(b, -1, -1)]),
                  y=torch.cat([pooled[0:1].expand(b, -1), pooled[1:2].expand(b, -1)]),
                  guidance=torch.full((2 * b,), 3.5),
                  transformer_options={"uuids": keys, "cond_or_uncond": [1, 0]})
        un, co = out[:b], out[b:]
        return un + SCALE * (co - un)

    return _sample(model, x, heun)


def _threshold(flux, x, ctx, pooled):
    """A threshold at which the reference skips some calls but not all."""
    total = 2 * x.shape[0] * STEPS
    for t in (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8):
        _, computed = reference(flux, x, ctx, pooled, t)
        if total // 4 <= total - computed <= 3 * total // 4:
            return t, computed
    pytest.fail("no threshold skips between a quarter and three quarters of the calls")


SETTINGS = dict(warmup=0, head=1, tail=0, max_skips=0)  # the published rule's
CASES = [(2, ParallelConfig(ulysses=2), 1), (2, ParallelConfig(ring=2), 2),
         (2, ParallelConfig(cfg_parallel=True), 1), (2, ParallelConfig(dp=2), 2),
         (4, ParallelConfig(ulysses=2, ring=2), 2)]


@pytest.mark.parametrize("world,config,batch", CASES,
                         ids=[f"{c.describe().replace(' ', '')}-b{b}" for _, c, b in CASES])
def test_model_path_equals_the_per_row_reference(pools, flux, world, config, batch):
    x, ctx, pooled = _inputs(flux, batch, seed=batch)
    threshold, computed = _threshold(flux, x, ctx, pooled)
    want, _ = reference(flux, x, ctx, pooled, threshold)
    den = PoolDenoiser(pools("flux", world), config.with_world_size(world), "flux")
    den.cache = dict(threshold=threshold, **SETTINGS)
    got = on_pool(den, x, ctx, pooled)
    assert (got - want).abs().max().item() <= 1e-4
    # rank 0's rows only: the other replica's rows are counted there
    replicas = config.dp * (2 if config.cfg_parallel else 1)
    assert sum(den.cache_counts.values()) == 2 * batch * STEPS // replicas
    if replicas == 1:
        assert den.cache_counts["computed"] == computed
    assert den.cache_counts["skipped"] > 0
    # negative control: the uncached result is another latent
    plain, _ = reference(flux, x, ctx, pooled, 0)
    assert (got - plain).abs().max().item() > 1e-3


def test_model_path_threshold_zero_and_fresh_runs(pools, flux):
    x, ctx, pooled = _inputs(flux, 1, seed=11)
    config = ParallelConfig(ulysses=2).with_world_size(2)
    den = PoolDenoiser(pools("flux", 2), config, "flux")
    plain = on_pool(den, x, ctx, pooled)
    den.cache = dict(threshold=0.0, **SETTINGS)
    assert torch.equal(on_pool(den, x, ctx, pooled), plain)
    threshold, _ = _threshold(flux, x, ctx, pooled)
    den.cache = dict(threshold=threshold, **SETTINGS)
    first = on_pool(den, x, ctx, pooled)
    counts = dict(den.cache_counts)
    # a second run (new keys) starts fresh: the same latent and the same counts again
    second = on_pool(den, x, ctx, pooled)
    assert torch.equal(first, second)
    assert {k: v - counts[k] for k, v in den.cache_counts.items()} == counts


def test_model_path_two_call_steps(pools, flux):
    """Heun calls the model twice per step: each call is one cache call, as in the
    reference."""
    x, ctx, pooled = _inputs(flux, 1, seed=13)
    threshold, _ = _threshold(flux, x, ctx, pooled)
    want, computed = reference(flux, x, ctx, pooled, threshold, heun=True)
    den = PoolDenoiser(pools("flux", 2), ParallelConfig(ulysses=2).with_world_size(2), "flux")
    den.cache = dict(threshold=threshold, **SETTINGS)
    got = on_pool(den, x, ctx, pooled, heun=True)
    assert (got - want).abs().max().item() <= 1e-4
    assert den.cache_counts["computed"] == computed and den.cache_counts["skipped"] > 0


# ---- Sampler (xDiT): the pool's own Euler loop -------------------------------------------
# (the second half of this module: the same model, pools by layout)

@pytest.fixture(scope="module")
def layouts():
    from conftest import LayoutPools
    cache = LayoutPools(keep=2)
    yield cache
    cache.close()


def _request(threshold, batch=1, **cache):
    from comfyui_xdit import GenerationRequest
    prompts = ["a photo of a red cat", "a dog on the grass", "blue sky"][:batch]
    settings = None if threshold is None else dict(threshold=threshold, **{**SETTINGS, **cache})
    return GenerationRequest(prompt=prompts, negative_prompt="blurry", seed=5, steps=STEPS,
                             height=80, width=48, cfg=SCALE, max_sequence_length=16,
                             cache=settings)


def _pipeline_reference(model_dir, threshold):
    """FluxPipeline with true CFG and diffusers' First Block Cache: the pipeline runs each
    branch in its own cache context, so at batch 1 each row has its own state, as ours."""
    import diffusers
    from diffusers.hooks import FirstBlockCacheConfig

    from conftest import comfyui_noise, model_to_latent
    path = str(model_dir("flux"))
    pipe = diffusers.FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    computed = []
    if threshold:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        pipe.transformer.transformer_blocks[1].attn.register_forward_pre_hook(
            lambda m, a: computed.append(1))
    req = _request(None)
    noise = comfyui_noise(req.seed, (1, 16, req.height // 8, req.width // 8))
    with torch.inference_mode():
        out = pipe(prompt=req.prompt, negative_prompt=[req.negative_prompt],
                   true_cfg_scale=SCALE, guidance_scale=3.5, height=req.height,
                   width=req.width, num_inference_steps=STEPS, latents=pack_flux(noise),
                   max_sequence_length=req.max_sequence_length, output_type="latent")
    return model_to_latent(unpack_flux(out.images, req.height, req.width), path), len(computed)


def _skips(result):
    """Per rank: (computed, skipped) row-calls."""
    return [tuple(st["cache"].values()) for st in result.stats]


@pytest.fixture(scope="module")
def sampler_threshold(model_dir):
    total = 2 * STEPS
    for t in (0.05, 0.1, 0.2, 0.35, 0.5, 0.8):
        _, computed = _pipeline_reference(model_dir, t)
        if total // 4 <= total - computed <= 3 * total // 4:
            return t
    pytest.fail("no threshold skips between a quarter and three quarters of the calls")


def test_sampler_one_rank_equals_the_pipeline_with_first_block_cache(model_dir, layouts,
                                                                     sampler_threshold):
    want, computed = _pipeline_reference(model_dir, sampler_threshold)
    pool = layouts.get(model_dir("flux"), ParallelConfig())
    got = pool.generate(_request(sampler_threshold))
    assert (got.samples - want).abs().max().item() <= 1e-4
    assert _skips(got) == [(computed, 2 * STEPS - computed)]
    # an almost-zero threshold runs the gates but never skips: the uncached latent exactly
    plain = pool.generate(_request(None))
    nearly = pool.generate(_request(1e-12))
    assert torch.equal(nearly.samples, plain.samples)
    assert _skips(nearly) == [(2 * STEPS, 0)]
    assert pool.status()["step_cache"] == {"computed": 2 * STEPS, "skipped": 0, "entry": "job"}
    assert (got.samples - plain.samples).abs().max().item() > 1e-3  # it did skip


SAMPLER_CASES = [(ParallelConfig(ulysses=2), 1), (ParallelConfig(ring=2), 3),
                 (ParallelConfig(cfg_parallel=True), 1), (ParallelConfig(dp=2), 3),
                 (ParallelConfig(ulysses=2, ring=2), 1)]


@pytest.mark.parametrize("config,batch", SAMPLER_CASES,
                         ids=[f"{c.describe().replace(' ', '')}-b{b}" for c, b in SAMPLER_CASES])
def test_sampler_layouts_give_one_rank_latent_and_skips(model_dir, layouts, sampler_threshold,
                                                        config, batch):
    """Same latent and same decisions as one rank: the sequence-parallel ranks of a row
    reduce its measure (each shard alone would decide differently), CFG / DP replicas
    decide their own rows."""
    one = layouts.get(model_dir("flux"), ParallelConfig()).generate(
        _request(sampler_threshold, batch, warmup=1, max_skips=2))
    pool = layouts.get(model_dir("flux"), config.with_world_size(config.ranks))
    got = pool.generate(_request(sampler_threshold, batch, warmup=1, max_skips=2))
    assert (got.samples - one.samples).abs().max().item() <= 1e-4
    sp = config.ulysses * config.ring
    per_rank = _skips(got)
    if sp > 1:  # every shard of a row made the one rank's decisions
        assert all(s == _skips(one)[0] for s in per_rank)
    else:  # the replicas' rows add up to the one rank's
        assert tuple(map(sum, zip(*per_rank))) == _skips(one)[0]
    assert _skips(one)[0][1] > 0


def test_sampler_refuses_the_cache_with_pipefusion(model_dir, layouts):
    from comfyui_xdit import ConfigError
    pool = layouts.get(model_dir("flux"), ParallelConfig(pipefusion=2).with_world_size(2))
    with pytest.raises(ConfigError, match="step cache cannot be combined with PipeFusion"):
        pool.generate(_request(0.1))


def test_model_path_reports_each_runs_counts(pools, flux):
    """The MODEL's text under KSampler counts this sampling run's calls (a new run starts
    from zero)."""
    x, ctx, pooled = _inputs(flux, 1, seed=17)
    events = []
    den = PoolDenoiser(pools("flux", 2), ParallelConfig(ulysses=2).with_world_size(2), "flux",
                       on_event=events.append)
    den.cache = dict(threshold=1e9, warmup=1, max_skips=0, head=1, tail=0)
    on_pool(den, x, ctx, pooled)
    assert events[-1] == {"cache": {"computed": 2, "skipped": 2 * STEPS - 2}}
    on_pool(den, x, ctx, pooled)
    assert events[-1] == {"cache": {"computed": 2, "skipped": 2 * STEPS - 2}}
    assert den.cache_counts == {"computed": 4, "skipped": 4 * STEPS - 4}


def test_sampler_with_weight_sharding(model_dir, layouts, sampler_threshold):
    """Under weight sharding a skipped block is not called, so not gathered; every rank must
    then run the same blocks, so the run/skip choice is unanimous while the rows keep their
    own decisions: DP 2 (rows on different replicas) and Ulysses 2 give the unsharded 1-rank
    latent, skip, and the pool serves the next job (no gather left pending)."""
    kw = dict(warmup=1, max_skips=2)
    one = layouts.get(model_dir("flux"), ParallelConfig()).generate(
        _request(sampler_threshold, 3, **kw))
    for config in (ParallelConfig(dp=2), ParallelConfig(ulysses=2)):
        pool = layouts.get(model_dir("flux"), config.with_world_size(2), tag="sharded",
                           shard_weights=True)
        got = pool.generate(_request(sampler_threshold, 3, **kw))
        assert (got.samples - one.samples).abs().max().item() <= 1e-4, config.describe()
        assert sum(st["cache"]["skipped"] for st in got.stats) > 0
        again = pool.generate(_request(None, 3))
        assert torch.isfinite(again.samples).all()
