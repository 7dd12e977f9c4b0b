"""Reference images on the pool: FLUX.2 multi-reference and FLUX.1 Kontext.

The oracles are the stock diffusers pipelines given PIL reference images:
`Flux2KleinPipeline(image=[...])` and `FluxKontextPipeline(image=...)` assembled from the
tiny FLUX folder's components. A spy on the pipeline's VAE records the raw latents it
encoded (the distribution's mode, which is what the pipelines use), and exactly those
latents go to the pool as `GenerationRequest.reference_latents` in ComfyUI's LATENT space
(FLUX.1: the raw latent; FLUX.2: patchified and normalised with the VAE's batch-norm
statistics, here by diffusers' own patchify, as ComfyUI's FLUX.2 VAE encodes them), so the
pool's conversion (FLUX.1's shift and scale, packing, position ids) is checked against the
pipelines' own. Final latents agree to 1e-4 (FLUX.2's in ComfyUI's 128-channel LATENT).

Sizes: A (128x96, 48 latent tokens) and B (144x112, 63 tokens): with one reference of 20
tokens B's image stream has 83 tokens and with two references (20 + 24) 107, which no sp
degree splits evenly, so the padded shards are exercised.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.client.pool import PoolError

from conftest import flux2_comfy_from_raw, pack_flux, unpack_flux

TOL = 1e-4
SIZES = {"A": (128, 96), "B": (144, 112)}
PROMPTS = ["a photo of a red cat", "a dog on the grass", "blue sky"]
# reference images (pixels, height x width): different sizes, multiples of 16
REF_SIZES = [(64, 80), (96, 64)]  # FLUX.2's pipeline takes >= 64 px a side
MSL = 16


def ref_image(i: int, size=None, seed: int = 0):
    from PIL import Image
    h, w = size or REF_SIZES[i]
    rng = np.random.default_rng(100 * seed + i)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def noise(channels: int, batch: int, height: int, width: int, seed: int) -> torch.Tensor:
    """ComfyUI's prepare_noise on the LATENT, written out (128 channels: FLUX.2's, at 1/16)."""
    down = 16 if channels == 128 else 8
    return torch.randn((batch, channels, height // down, width // down),
                       generator=torch.manual_seed(seed), dtype=torch.float32)


class VaeSpy:
    """Records the raw latents the pipeline's VAE encodes (the distribution's mode, as the
    pipelines take it with sample_mode="argmax")."""

    def __init__(self, vae):
        self.vae, self.seen = vae, []
        self.orig = vae.encode

    def __enter__(self):
        def encode(x, *a, **k):
            out = self.orig(x, *a, **k)
            self.seen.append(out.latent_dist.mode().detach().clone())
            return out
        self.vae.encode = encode
        return self

    def __exit__(self, *exc):
        del self.vae.encode  # back to the class's method


# ---- oracles ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux2_oracle(model_dir):
    """(prompts, seed, steps, size, images, cfg) -> (the reference latents the pipeline
    encoded, its final latent, the noise), all as ComfyUI's FLUX.2 LATENTs [B,128,h/16,w/16]."""
    from diffusers import Flux2KleinPipeline

    path = str(model_dir("flux2"))
    pipes, cache = {}, {}

    def run(prompts, seed, steps, size, images, cfg=1.0):
        key = (tuple(prompts), seed, steps, size, len(images), cfg)
        if key in cache:
            return cache[key]
        distilled = cfg <= 1.0  # a base (undistilled) FLUX.2 runs CFG with negative ""
        if distilled not in pipes:
            pipes[distilled] = Flux2KleinPipeline.from_pretrained(path, is_distilled=distilled)
            pipes[distilled].set_progress_bar_config(disable=True)
        pipe = pipes[distilled]
        h, w = SIZES[size]
        x = noise(128, len(prompts), h, w, seed)
        with VaeSpy(pipe.vae) as spy:
            out = pipe(prompt=list(prompts), image=list(images) or None, height=h, width=w,
                       num_inference_steps=steps, guidance_scale=cfg, latents=x,
                       max_sequence_length=MSL, output_type="latent").images
        assert [r.shape[1] for r in spy.seen] == [32] * len(images)  # raw VAE latents
        cache[key] = ([flux2_comfy_from_raw(r, path) for r in spy.seen],
                      flux2_comfy_from_raw(out, path), x)
        return cache[key]
    return run


@pytest.fixture(scope="module")
def kontext_oracle(model_dir):
    """FluxKontextPipeline from the tiny FLUX folder's components: (prompts, seed, steps,
    size, images (one per prompt, or one shared), cfg) -> (raw reference latent [b,16,h,w],
    final raw latent [B,16,h/8,w/8], noise)."""
    import diffusers

    path = str(model_dir("flux"))
    base = diffusers.FluxPipeline.from_pretrained(path)
    pipe = diffusers.FluxKontextPipeline(**base.components)
    pipe.set_progress_bar_config(disable=True)
    scale, shift = pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor
    cache = {}

    def run(prompts, seed, steps, size, images, cfg=1.0):
        key = (tuple(prompts), seed, steps, size, len(images), cfg)
        if key in cache:
            return cache[key]
        h, w = SIZES[size]
        x = noise(16, len(prompts), h, w, seed)
        kw = dict(true_cfg_scale=cfg, negative_prompt=[""] * len(prompts)) if cfg > 1 else {}
        with VaeSpy(pipe.vae) as spy:
            out = pipe(prompt=list(prompts), image=images if images else None, height=h,
                       width=w, num_inference_steps=steps, guidance_scale=3.5,
                       latents=pack_flux(x), max_sequence_length=MSL, output_type="latent",
                       _auto_resize=False, max_area=h * w, **kw).images
        raw = unpack_flux(out, h, w) / scale + shift
        cache[key] = (spy.seen, raw, x)
        return cache[key]
    return run


def check(got, want, start):
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3e} > {TOL}"
    assert (want - start).abs().max().item() > 1e-2  # the model moved the latent
    return diff


# ---- FLUX.2 ------------------------------------------------------------------------------

FLUX2_CASES = [  # (world, config, size, references, batch, cfg)
    (1, ParallelConfig(), "A", 1, 1, 1.0),
    (1, ParallelConfig(), "B", 2, 1, 1.0),
    (1, ParallelConfig(), "A", 2, 1, 2.5),  # CFG in one process (FLUX.2 base)
    (2, ParallelConfig(ulysses=2), "B", 2, 1, 1.0),
    (2, ParallelConfig(ring=2), "B", 1, 1, 1.0),
    (2, ParallelConfig(dp=2), "A", 1, 3, 1.0),
    (2, ParallelConfig(cfg_parallel=True), "B", 2, 1, 2.5),
    (4, ParallelConfig(ulysses=2, ring=2), "B", 2, 1, 1.0),
]


@pytest.mark.parametrize("world,config,size,nref,batch,cfg", FLUX2_CASES,
                         ids=[f"{c.describe().replace(' ', '')}-{s}-refs{n}-b{b}-cfg{g}"
                              for _, c, s, n, b, g in FLUX2_CASES])
def test_flux2_references_match_pipeline(pools, flux2_oracle, world, config, size, nref,
                                         batch, cfg):
    prompts = PROMPTS[:batch]
    images = [ref_image(i) for i in range(nref)]
    raws, want, x = flux2_oracle(prompts, 3, 3, size, images, cfg)
    assert [tuple(r.shape[1:]) for r in raws] == [(128, h // 16, w // 16)
                                                  for h, w in REF_SIZES[:nref]]
    pool = pools("flux2", world)
    pool.reconfigure(config.with_world_size(world))
    h, w = SIZES[size]
    req = GenerationRequest(prompt=prompts, seed=3, steps=3, height=h, width=w,
                            max_sequence_length=MSL, cfg=cfg, reference_latents=raws)
    got = pool.generate(req, noise=x).samples
    check(got, want, x)


def test_flux2_references_change_the_result(pools, flux2_oracle):
    """Negative control: the references reach the prediction (the oracle without them
    differs, and so does the pool), and the order of two references matters (their ids)."""
    pool = pools("flux2", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    images = [ref_image(0), ref_image(1)]
    raws, want, x = flux2_oracle(PROMPTS[:1], 3, 3, "B", images)
    _, plain, _ = flux2_oracle(PROMPTS[:1], 3, 3, "B", [])
    assert (want - plain).abs().max().item() > 1e-2
    h, w = SIZES["B"]
    base = dict(prompt=PROMPTS[:1], seed=3, steps=3, height=h, width=w,
                max_sequence_length=MSL)
    without = pool.generate(GenerationRequest(**base), noise=x).samples
    check(without, plain, x)
    swapped = pool.generate(GenerationRequest(**base, reference_latents=raws[::-1]),
                            noise=x).samples
    assert (swapped - want).abs().max().item() > 1e-3


def test_flux2_wrong_references_refused_pool_keeps_working(pools, flux2_oracle):
    pool = pools("flux2", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    h, w = SIZES["A"]
    base = dict(prompt=PROMPTS[:1], seed=3, steps=3, height=h, width=w,
                max_sequence_length=MSL)
    bad = [  # (references, method, what the one message must say)
        ([torch.zeros(1, 16, 8, 6)], None, "has 16 channels; FLUX.2 LATENTs are ComfyUI's "
                                           "128-channel [batch, 128, height/16, width/16]"),
        ([torch.zeros(1, 32, 8, 6)], None, "has 32 channels; FLUX.2 LATENTs are ComfyUI's "
                                           "128-channel"),
        ([torch.zeros(1, 32, 8, 6)], None, "a raw 32-channel [batch, 32, height/8, width/8] "
                                           "latent must be patchified and normalised first"),
        ([torch.zeros(2, 128, 4, 3)], None, "give 1 (shared) or the batch 1"),
        ([torch.zeros(1, 128, 4, 3)], "offset", "'offset' is not one of ['index'] for FLUX.2"),
        ([], None, "non-empty list"),
    ]
    for refs, method, text in bad:
        with pytest.raises(ConfigError) as e:
            pool.generate(GenerationRequest(**base, reference_latents=refs,
                                            reference_method=method))
        assert text in str(e.value) and str(e.value).count("reference") <= 3, str(e.value)
    raws, want, x = flux2_oracle(PROMPTS[:1], 3, 3, "A", [ref_image(0)])
    got = pool.generate(GenerationRequest(**base, reference_latents=raws), noise=x).samples
    check(got, want, x)


def test_references_refused_for_sd3():
    from types import SimpleNamespace

    req = GenerationRequest(prompt=["x"], reference_latents=[torch.zeros(1, 16, 8, 8)])
    problems = req.problems(SimpleNamespace(arch="sd3"))
    assert problems == ["reference images are not supported by SD3/3.5 models (remove the "
                        "reference latents)"]


def test_reference_tokens_count_in_the_split_check():
    """8x8 px image: 0 latent tokens... the smallest image has 1 token; with a reference of
    4 tokens the stream of 5 splits over 4 sp ranks."""
    from types import SimpleNamespace

    model = SimpleNamespace(arch="flux2", heads=4, blocks=4, has_text_encoders=True,
                            has_vae=True)
    req = GenerationRequest(prompt=["x"], height=16, width=16)
    with pytest.raises(ConfigError, match="1 image tokens cannot be split"):
        ParallelConfig(ulysses=4).validate(model, req)
    req.reference_latents = [torch.zeros(1, 128, 2, 2)]  # FLUX.2's LATENT: a token a pixel
    assert req.reference_tokens() == 4
    ParallelConfig(ulysses=4).validate(model, req)
    # odd sizes are whole tokens at 1/16 (48x80 px), with or without the model; not at 1/8
    odd = GenerationRequest(prompt=["x"], reference_latents=[torch.zeros(1, 128, 3, 5)])
    assert odd.problems() == odd.problems(model) == [] and odd.reference_tokens() == 15
    odd.reference_latents = [torch.zeros(1, 16, 3, 5)]
    assert any("must be even" in p for p in odd.problems())


@pytest.fixture(scope="module")
def flux2_pipefusion(model_dir):
    pool = WorkerPool(str(model_dir("flux2")), ParallelConfig(pipefusion=2, warmup_steps=3),
                      device="cpu", threads_per_rank=1)
    yield pool
    pool.close()


def test_flux2_references_pipefusion(flux2_pipefusion, flux2_oracle):
    """PipeFusion 2 with warmup >= steps is exact with references (they are in every
    stage's K/V); pipelined (warmup 1, 2 patches) it stays near the exact result, much
    nearer than a run without references is."""
    pool = flux2_pipefusion
    images = [ref_image(0), ref_image(1)]
    raws, want, x = flux2_oracle(PROMPTS[:1], 3, 3, "B", images)
    _, plain, _ = flux2_oracle(PROMPTS[:1], 3, 3, "B", [])
    h, w = SIZES["B"]
    req = GenerationRequest(prompt=PROMPTS[:1], seed=3, steps=3, height=h, width=w,
                            max_sequence_length=MSL, reference_latents=raws)
    check(pool.generate(req, noise=x).samples, want, x)
    pool.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=1, pipeline_patches=2))
    try:
        piped = pool.generate(req, noise=x).samples
    finally:
        pool.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=3))
    near, far = (piped - want).abs().max().item(), (plain - want).abs().max().item()
    assert 0 < near < far / 3, (near, far)


# ---- FLUX.1 Kontext --------------------------------------------------------------------

KONTEXT_CASES = [  # (world, config, size, batch, per-image references, cfg)
    (1, ParallelConfig(), "A", 1, False, 1.0),
    (2, ParallelConfig(ulysses=2), "B", 1, False, 1.0),
    (2, ParallelConfig(ring=2), "B", 1, False, 2.0),
    (2, ParallelConfig(dp=2), "A", 3, True, 1.0),
    (2, ParallelConfig(cfg_parallel=True), "A", 1, False, 2.0),
]


@pytest.mark.parametrize("world,config,size,batch,per_image,cfg", KONTEXT_CASES,
                         ids=[f"{c.describe().replace(' ', '')}-{s}-b{b}-"
                              f"{'per-image' if p else 'shared'}-cfg{g}"
                              for _, c, s, b, p, g in KONTEXT_CASES])
def test_kontext_reference_matches_pipeline(pools, kontext_oracle, world, config, size, batch,
                                            per_image, cfg):
    prompts = PROMPTS[:batch]
    images = [ref_image(0, seed=j) for j in range(batch if per_image else 1)]
    raws, want, x = kontext_oracle(prompts, 5, 3, size, images, cfg)
    assert len(raws) == 1 and raws[0].shape == (len(images), 16, 8, 10)
    pool = pools("flux", world)
    pool.reconfigure(config.with_world_size(world))
    h, w = SIZES[size]
    req = GenerationRequest(prompt=prompts, seed=5, steps=3, height=h, width=w, cfg=cfg,
                            max_sequence_length=MSL, reference_latents=raws)
    got = pool.generate(req, noise=x).samples
    check(got, want, x)
    if per_image:  # each image's own reference reached its own row: sharing the first
        shared = pool.generate(GenerationRequest(  # changes the other rows only
            prompt=prompts, seed=5, steps=3, height=h, width=w, max_sequence_length=MSL,
            reference_latents=[raws[0][:1]]), noise=x).samples
        assert (shared[0] - got[0]).abs().max().item() <= 1e-5
        assert (shared[1:] - got[1:]).abs().max().item() > 1e-3


def test_kontext_reference_changes_the_result(pools, kontext_oracle):
    raws, want, x = kontext_oracle(PROMPTS[:1], 5, 3, "B", [ref_image(0)])
    _, plain, _ = kontext_oracle(PROMPTS[:1], 5, 3, "B", [])
    assert (want - plain).abs().max().item() > 1e-2
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    h, w = SIZES["B"]
    req = GenerationRequest(prompt=PROMPTS[:1], seed=5, steps=3, height=h, width=w,
                            max_sequence_length=MSL)
    check(pool.generate(req, noise=x).samples, plain, x)
    with pytest.raises(ConfigError, match="has 32 channels; FLUX.1 uses 16"):
        pool.generate(GenerationRequest(prompt=PROMPTS[:1], height=h, width=w,
                                        reference_latents=[torch.zeros(1, 32, 8, 6)]))


# ---- model calls (KSampler path): ComfyUI's FLUX with ref_latents ---------------------------

def comfy_ref_ids(ref_sizes, method, h, w):
    """ComfyUI's FLUX reference ids (comfy/ldm/flux/model.py `_forward`), written from its
    rules: "index": index i+1, no shift; "offset": index 1, each reference beside the
    previous ones (to the right when that keeps the canvas squarer, else below); "uxo": index
    0, past the image diagonally. Offsets are in latent pixels, rounded to tokens."""
    out, used_h, used_w = [], 0, 0
    for i, (rh, rw) in enumerate(ref_sizes):
        if method == "index":
            index, oh, ow = i + 1, 0, 0
        elif method == "uxo":
            index, oh, ow = 0, (h + 1) // 2 * 2 + used_h, (w + 1) // 2 * 2 + used_w
            used_h, used_w = used_h + rh, used_w + rw
        else:
            index, oh, ow = 1, 0, 0
            if rh + used_h > rw + used_w:
                ow = used_w
            else:
                oh = used_h
            used_h, used_w = max(used_h, rh + oh), max(used_w, rw + ow)
        th, tw = (rh + 1) // 2, (rw + 1) // 2
        ids = torch.zeros(th, tw, 3)
        ids[..., 0] = index
        ids[..., 1] = torch.arange(th)[:, None] + (oh + 1) // 2
        ids[..., 2] = torch.arange(tw)[None, :] + (ow + 1) // 2
        out.append(ids.reshape(-1, 3))
    return torch.cat(out)


def test_comfy_ref_ids_hand_computed():
    """The test's ComfyUI rules on a case worked by hand: references of 8x6 and 5x7 latent
    pixels beside a 10x8 latent. offset: both index 1; the second goes below the first
    (13 rows vs 13 columns: not wider, so down) at token row (8 + 1) // 2 = 4. index: 1, 2,
    no shift. uxo: index 0, the first at tokens (5, 4), the second at ((10 + 8 + 1) // 2,
    (8 + 6 + 1) // 2) = (9, 7)."""
    sizes = [(8, 6), (5, 7)]
    off = comfy_ref_ids(sizes, "offset", 10, 8)
    assert off.shape == (12 + 12, 3)
    assert off[0].tolist() == [1, 0, 0] and off[12].tolist() == [1, 4, 0]
    idx = comfy_ref_ids(sizes, "index", 10, 8)
    assert idx[0].tolist() == [1, 0, 0] and idx[12].tolist() == [2, 0, 0]
    uxo = comfy_ref_ids(sizes, "uxo", 10, 8)
    assert uxo[0].tolist() == [0, 5, 4] and uxo[12].tolist() == [0, 9, 7]


def comfy_flux_call(tr, x, sigma, context, y, guidance, refs, method):
    """ComfyUI's FLUX model output with ref_latents, from the diffusers transformer: the
    references (model space, padded circularly to whole tokens) packed after the latent."""
    import torch.nn.functional as F

    n, _, h, w = x.shape
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    toks = [pack_flux(F.pad(r, (0, r.shape[-1] % 2, 0, r.shape[-2] % 2), mode="circular"))
            for r in refs]
    hidden = torch.cat([pack_flux(x)] + toks, 1)
    img_ids = torch.cat([ids.reshape(-1, 3),
                         comfy_ref_ids([tuple(r.shape[-2:]) for r in refs], method, h, w)])
    with torch.inference_mode():
        out = tr(hidden_states=hidden, timestep=sigma, guidance=guidance,
                 pooled_projections=y, encoder_hidden_states=context,
                 txt_ids=torch.zeros(context.shape[1], 3), img_ids=img_ids,
                 return_dict=False)[0]
    return unpack_flux(out[:, : (h // 2) * (w // 2)], h * 8, w * 8)


@pytest.fixture(scope="module")
def flux_transformer(model_dir):
    import diffusers
    return diffusers.FluxTransformer2DModel.from_pretrained(
        str(model_dir("flux")), subfolder="transformer", torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("method", ["offset", "index", "uxo"])
def test_model_call_with_ref_latents(pools, flux_transformer, method):
    """pool.model_call with two references of different sizes (one of odd size) in the
    conditioning equals ComfyUI's FLUX computation; the references cross once (cached with
    the conditioning) and change the prediction."""
    pool = pools("flux", 2)
    config = ParallelConfig(ulysses=2).with_world_size(2)
    tr = flux_transformer
    gen = torch.Generator().manual_seed(11)
    rows, h, w = 2, 10, 8
    x = torch.randn(2 * rows, 16, h, w, generator=gen)
    ctx = torch.randn(2, 7, tr.config.joint_attention_dim, generator=gen)
    pooled = torch.randn(2, tr.config.pooled_projection_dim, generator=gen)
    refs = [torch.randn(1, 16, 8, 6, generator=gen), torch.randn(1, 16, 5, 7, generator=gen)]
    sigma = torch.full((2 * rows,), 0.6)
    guidance = torch.full((2 * rows,), 3.5)
    keys = [f"{uuid.uuid4()}:{rows}:7" for _ in range(2)]
    conds = {k: {"context": ctx[i:i + 1].expand(rows, -1, -1).contiguous(),
                 "pooled": pooled[i:i + 1].expand(rows, -1).contiguous(),
                 "ref_latents": [r.expand(rows, -1, -1, -1).contiguous() for r in refs],
                 "ref_method": method}
             for i, k in enumerate(keys)}
    chunks = [(k, rows) for k in keys]
    got, _, sent = pool.model_call(config, x, sigma * 1000, guidance, chunks, conds, set())
    assert sent == keys
    context = torch.cat([c["context"] for c in conds.values()])
    y = torch.cat([c["pooled"] for c in conds.values()])
    want = comfy_flux_call(tr, x, sigma, context, y, guidance,
                           [r.expand(2 * rows, -1, -1, -1) for r in refs], method)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff:.3e}"
    # the methods place the references differently, and that reaches the prediction
    other_method = "index" if method != "index" else "offset"
    moved = comfy_flux_call(tr, x, sigma, context, y, guidance,
                            [r.expand(2 * rows, -1, -1, -1) for r in refs], other_method)
    assert (moved - got).abs().max().item() > 1e-4
    # the second call of the run carries no conditioning and no references
    again, _, sent = pool.model_call(config, x, sigma * 1000, guidance, chunks, conds,
                                     set(keys))
    assert sent == [] and torch.equal(again, got)
    # negative control: without references the prediction differs
    plain_keys = [k + ":plain" for k in keys]
    plain = {pk: {"context": conds[k]["context"], "pooled": conds[k]["pooled"]}
             for k, pk in zip(keys, plain_keys)}
    other, _, _ = pool.model_call(config, x, sigma * 1000, guidance,
                                  [(k, rows) for k in plain_keys], plain, set())
    assert (other - got).abs().max().item() > 1e-3


def test_model_call_bad_ref_latents_refused(pools, flux_transformer):
    pool = pools("flux", 2)
    config = ParallelConfig(ulysses=2).with_world_size(2)
    cfg = flux_transformer.config
    x = torch.randn(2, 16, 8, 6)
    c = {"context": torch.randn(1, 7, cfg.joint_attention_dim),
         "pooled": torch.randn(1, cfg.pooled_projection_dim)}
    with pytest.raises(PoolError, match=r"reference latent #1 must be \[1, 16, h, w\]"):
        pool.model_call(config, x, torch.full((2,), 500.0), torch.full((2,), 3.5),
                        [("a", 1), ("b", 1)],
                        {"a": dict(c, ref_latents=[torch.randn(1, 32, 8, 6)]), "b": c}, set())
    with pytest.raises(PoolError, match="different reference latents"):
        pool.model_call(config, x, torch.full((2,), 500.0), torch.full((2,), 3.5),
                        [("c", 1), ("d", 1)],
                        {"c": dict(c, ref_latents=[torch.randn(1, 16, 8, 6)]), "d": c}, set())
    out, _, _ = pool.model_call(config, x, torch.full((2,), 500.0), torch.full((2,), 3.5),
                                [("e", 2)], {"e": {"context": c["context"].expand(2, -1, -1),
                                                   "pooled": c["pooled"].expand(2, -1)}}, set())
    assert out.shape == x.shape


def test_memory_plan_counts_reference_tokens():
    """The memory plan sees the references' tokens: activations and PipeFusion's K/V grow
    as if the image were that much larger (a 1024x1024 reference doubles the stream)."""
    from comfyui_xdit.planning.memory_arithmetic import JobSize, plan
    from comfyui_xdit.planning.model_facts import preset_facts
    from comfyui_xdit.planning.config import EngineOptions

    facts = preset_facts("flux2-dev")
    bf16 = EngineOptions(device="cuda", dtype="bf16", weights="full", text_encoders="cpu")
    req = GenerationRequest(prompt=["x"], height=1024, width=1024,
                            reference_latents=[torch.zeros(1, 128, 64, 64)])
    assert req.reference_tokens() == 64 * 64
    for config in (ParallelConfig(ulysses=2), ParallelConfig(pipefusion=2)):
        plain = plan(facts, config, bf16, JobSize(1024, 1024)).ranks[0]
        refs = plan(facts, config, bf16, JobSize(1024, 1024, reference_tokens=4096))
        refs = refs.ranks[0]
        assert refs.activations > plain.activations and refs.weights == plain.weights
        if config.pipefusion > 1:
            assert refs.kv_cache > plain.kv_cache


def test_flux2_references_pipefusion_with_ulysses(model_dir, flux2_oracle):
    """PipeFusion 2 x Ulysses 2 (4 ranks): each stage's patch, references included, is
    sharded over the stage's two ranks (107 tokens: uneven); warmup >= steps is exact."""
    images = [ref_image(0), ref_image(1)]
    raws, want, x = flux2_oracle(PROMPTS[:1], 3, 3, "B", images)
    h, w = SIZES["B"]
    req = GenerationRequest(prompt=PROMPTS[:1], seed=3, steps=3, height=h, width=w,
                            max_sequence_length=MSL, reference_latents=raws)
    with WorkerPool(str(model_dir("flux2")),
                    ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3),
                    device="cpu", threads_per_rank=1) as pool:
        check(pool.generate(req, noise=x).samples, want, x)
