"""Qwen-Image-Edit through the pool equals diffusers' QwenImageEditPipeline
(docs/design.md#numerics-rule-4) with a reference image, at 1 rank, Ulysses 2, Ring 2, CFG 2 and
Ulysses 2 x Ring 2, with a reference of the target's size and one of another size (wider than
the target, so the text RoPE starts past the reference's grid, and 15 + 32 = 47 image tokens:
every sequence shard uneven).

The references travel as ComfyUI passes them (ReferenceLatent / TextEncodeQwenImageEdit put
the raw VAE latent [1, 16, 1, h, w] in the CONDITIONING; GenerationRequest.reference_latents
takes the same): exactly the latent the pipeline's VAE encoded from its `image` (the
distribution's mode, recorded by a spy), so the pool's conversion ((raw - mean) / std,
packing, img_shapes) is checked against the pipeline's own. Both get the same prompt
embeddings (encoded by the pipeline with the image, as the Edit text encoder sees it) and
ComfyUI's noise for the LATENT [1, 16, 1, H/8, W/8].

The pipeline resizes its image to a ~1024 x 1024 area (`calculate_dimensions`); here that
helper is pointed at the case's reference size, so the tiny model runs small references (the
pipeline's transformer call, img_shapes and slicing are untouched).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

from test_qwen_image import pack, unpack  # noqa: E402  the pipeline's packing, once

TOL = 1e-4
STEPS = 3
SEED = 5
CFG = 4.0
PROMPT, NEGATIVE = "a red cat", "ugly dark"
# (target height, width), (reference height, width), pixels
CASES = {"same": ((96, 64), (96, 64)),     # 24 + 24 tokens
         "other": ((80, 48), (64, 128))}   # 15 (5 x 3) + 32 (4 x 8): a wider reference

CONFIGS = {
    "1rank": ParallelConfig(),
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
    "ulysses2xring2": ParallelConfig(ulysses=2, ring=2),
}


def ref_image(size):
    from PIL import Image
    h, w = size
    rng = np.random.default_rng(h * 1000 + w)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    """The tiny Qwen-Image-Edit folder (QwenImageEditPipeline: the processor gives the text
    encoder the image), built offline."""
    from comfyui_xdit.testmodels import qwen_image
    from comfyui_xdit.testmodels.tiny_model import resolve_config

    out = tmp_path_factory.mktemp("models") / "qwen_image_edit"
    qwen_image.build_pipeline(resolve_config("qwen_image"), edit=True) \
        .save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def pipe(edit_dir):
    from diffusers import QwenImageEditPipeline

    from comfyui_xdit.testmodels.qwen_image import patch_processor_without_video
    patch_processor_without_video()
    p = QwenImageEditPipeline.from_pretrained(str(edit_dir)).to(torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


@contextlib.contextmanager
def reference_size(size):
    """QwenImageEditPipeline's reference resize (to a ~1024^2 area) pointed at `size`."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as mod
    orig = mod.calculate_dimensions
    mod.calculate_dimensions = lambda area, ratio: (size[1], size[0], None)
    try:
        yield
    finally:
        mod.calculate_dimensions = orig


class VaeSpy:
    """Records the raw latents the pipeline's VAE encodes (the mode, its sample_mode
    "argmax")."""

    def __init__(self, vae):
        self.vae, self.seen = vae, []

    def __enter__(self):
        orig = self.vae.encode

        def encode(x, *a, **k):
            out = orig(x, *a, **k)
            self.seen.append(out.latent_dist.mode().detach().clone())
            return out
        self.vae.encode = encode
        return self

    def __exit__(self, *exc):
        del self.vae.encode


@pytest.fixture(scope="module")
def oracle(pipe):
    """oracle(case) -> dict(raw: the reference latent the pipeline encoded [1,16,1,h,w],
    want: its final latent as a ComfyUI LATENT, plain: the same run without the reference
    (QwenImagePipeline from the same components, the same embeddings), pos / neg: the
    prompt embeddings, noise)."""
    from diffusers import QwenImagePipeline

    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    plain_pipe = QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae,
                                   text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                                   transformer=pipe.transformer)
    plain_pipe.set_progress_bar_config(disable=True)
    cache = {}

    def run(case):
        if case in cache:
            return cache[case]
        (h, w), rsize = CASES[case]
        image = ref_image(rsize)
        with torch.no_grad():
            pos, _ = pipe.encode_prompt([PROMPT], image=image)
            neg, _ = pipe.encode_prompt([NEGATIVE], image=image)
        noise = torch.randn([1, 16, 1, h // 8, w // 8], generator=torch.manual_seed(SEED))
        kw = dict(prompt_embeds=pos, prompt_embeds_mask=torch.ones(pos.shape[:2], dtype=torch.long),
                  negative_prompt_embeds=neg,
                  negative_prompt_embeds_mask=torch.ones(neg.shape[:2], dtype=torch.long),
                  true_cfg_scale=CFG, height=h, width=w, num_inference_steps=STEPS,
                  output_type="latent")
        with reference_size(rsize), VaeSpy(pipe.vae) as spy:
            out = pipe(image=image, latents=pack(noise), **kw).images
        assert len(spy.seen) == 1
        raw = spy.seen[0]
        assert raw.shape == (1, 16, 1, rsize[0] // 8, rsize[1] // 8)
        plain = plain_pipe(latents=pack(noise), **kw).images
        cache[case] = dict(raw=raw, want=unpack(out, h, w) * std + mean,
                           plain=unpack(plain, h, w) * std + mean, pos=pos, neg=neg,
                           noise=noise)
        return cache[case]
    return run


LAYOUT_POOLS_KEEP = 1  # pools kept warm at once (conftest's layout_pools)


def request(case, o, refs=True, **kw) -> GenerationRequest:
    (h, w), _ = CASES[case]
    return GenerationRequest(prompt=[], positive={"cond": o["pos"], "pooled": None},
                             negative={"cond": o["neg"], "pooled": None}, cfg=CFG, seed=SEED,
                             steps=STEPS, height=h, width=w,
                             reference_latents=[o["raw"]] if refs else None, **kw)


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    return diff


@pytest.mark.parametrize("name", list(CONFIGS))
def test_edit_equals_the_pipeline(edit_dir, layout_pools, oracle, name):
    pool = layout_pools.get(edit_dir, CONFIGS[name])
    for case in CASES:
        o = oracle(case)
        got = pool.generate(request(case, o)).samples
        check(got, o["want"], f"{name} {case}")


def test_reference_reaches_the_prediction(edit_dir, layout_pools, oracle):
    """Negative control: without the reference the pipeline's result is far from the Edit
    result, and the pool without it gives that plain result (so the equality above is the
    reference's work); a 4-D reference (no frame axis) is the same reference."""
    pool = layout_pools.get(edit_dir, ParallelConfig(ulysses=2))
    o = oracle("other")
    assert float((o["want"] - o["plain"]).abs().max()) > 1e-2
    check(pool.generate(request("other", o, refs=False)).samples, o["plain"], "no reference")
    flat = request("other", o, refs=False)
    flat.reference_latents = [o["raw"][:, :, 0]]
    check(pool.generate(flat).samples, o["want"], "4-D reference")


# ---- the xDiT MODEL (stock KSampler): ComfyUI's QwenImage call with ref_latents ------------
def comfy_edit_call(tr, batch: int, h: int, w: int, ref_sizes, seed: int = 0) -> dict:
    """ComfyUI's QwenImage diffusion-model call with references: latents [N, 16, 1, h, w]
    and `ref_latents` [1, 16, 1, hr, wr] in model space (model_base applied process_in),
    sigma as the timestep, the unconditional then the conditional chunk (calc_cond_batch)."""
    import uuid
    gen = torch.Generator().manual_seed(seed)
    n = 2 * batch
    x = torch.randn(n, 16, 1, h, w, generator=gen)
    ctx = torch.randn(2, 9, tr.config.joint_attention_dim, generator=gen)
    context = torch.cat([ctx[i:i + 1].expand(batch, -1, -1) for i in range(2)])
    refs = [torch.randn(1, 16, 1, rh, rw, generator=gen) for rh, rw in ref_sizes]
    options = {"uuids": [uuid.uuid4(), uuid.uuid4()], "cond_or_uncond": [1, 0]}
    return dict(x=x, timestep=torch.tensor(0.7).expand(n), context=context,
                transformer_options=options, ref_latents=refs)


def edit_model_reference(tr, x, timestep, context, refs) -> torch.Tensor:
    """diffusers' transformer on the joined stream: the target's tokens, then each
    reference's, img_shapes with one entry each, the prediction sliced to the target."""
    n, _, _, h, w = x.shape
    hidden = torch.cat([pack(x)] + [pack(r).expand(n, -1, -1) for r in refs], 1)
    shapes = [(1, h // 2, w // 2)] + [(1, r.shape[-2] // 2, r.shape[-1] // 2) for r in refs]
    with torch.inference_mode():
        out = tr(hidden_states=hidden, timestep=timestep, encoder_hidden_states=context,
                 img_shapes=[shapes] * n, return_dict=False)[0]
    return unpack(out[:, : (h // 2) * (w // 2)], h * 8, w * 8)


# references no larger than the target: there ComfyUI's model (text RoPE after the target's
# grid) and diffusers' (after the largest grid) agree
MODEL_CASES = [(ParallelConfig(ulysses=2), 1, 10, 6, [(10, 6)]),
               (ParallelConfig(cfg_parallel=True, ring=2), 1, 12, 10, [(8, 6), (4, 10)])]


@pytest.mark.parametrize("config,batch,h,w,ref_sizes", MODEL_CASES,
                         ids=[f"{c.describe().replace(' ', '')}-refs{len(r)}"
                              for c, _, _, _, r in MODEL_CASES])
def test_model_calls_with_references_equal_the_transformer(edit_dir, layout_pools, pipe, config,
                                                           batch, h, w, ref_sizes):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    pool = layout_pools.get(edit_dir, config)
    den = PoolDenoiser(pool, config, "qwen_image")
    call = comfy_edit_call(pipe.transformer, batch, h, w, ref_sizes)
    want = edit_model_reference(pipe.transformer, call["x"], call["timestep"],
                                call["context"], call["ref_latents"])
    for _ in range(2):  # the second call reuses the pool's conditioning and references
        got = den(**call)
        assert got.shape == call["x"].shape
        check(got, want, f"MODEL {config.describe()} refs {ref_sizes}")
    import uuid
    plain = dict(call, ref_latents=None, transformer_options={
        "uuids": [uuid.uuid4(), uuid.uuid4()], "cond_or_uncond": [1, 0]})
    assert float((den(**plain) - want).abs().max()) > 1e-3  # the references matter


# ---- ComfyUI's path: the references in the CONDITIONING, the LATENT with its frame axis -----
def comfy_inputs(o, case):
    """What the xDiT sampler node receives from TextEncodeQwenImageEdit (or ReferenceLatent):
    CONDITIONING whose options carry `reference_latents` (the raw VAE latent, frame axis
    kept), the same on the negative, and an empty [1, 16, 1, H/8, W/8] LATENT."""
    from comfyui_xdit.nodes.operations import SampleInputs
    (h, w), _ = CASES[case]
    pos = [[o["pos"], {"reference_latents": [o["raw"]]}]]
    neg = [[o["neg"], {"reference_latents": [o["raw"]]}]]
    return SampleInputs(latent={"samples": torch.zeros(1, 16, 1, h // 8, w // 8)}, seed=SEED,
                        steps=STEPS, cfg=CFG, positive=pos, negative=neg)


def test_comfy_conditioning_references(edit_dir, layout_pools, oracle):
    from comfyui_xdit.nodes.operations import build_job
    from comfyui_xdit.planning.model_info import read_model_info
    o = oracle("other")
    info = read_model_info(edit_dir)
    req, kw = build_job(comfy_inputs(o, "other"), "qwen_image", model=info)
    assert len(req.reference_latents) == 1 and req.reference_latents[0].dim() == 5
    assert req.reference_method is None and req.problems(info) == []
    pool = layout_pools.get(edit_dir, ParallelConfig(ulysses=2))
    check(pool.generate(req, **kw).samples, o["want"], "ComfyUI CONDITIONING")


def test_reference_latents_checked():
    from types import SimpleNamespace
    model = SimpleNamespace(arch="qwen_image", has_text_encoders=True, has_vae=True)

    def problems(*refs, method=None):
        return GenerationRequest(prompt=["x"], reference_latents=list(refs),
                                 reference_method=method).problems(model)
    assert problems(torch.zeros(1, 16, 1, 8, 6)) == problems(torch.zeros(1, 16, 8, 6)) == []
    assert any("[1 or batch, C, 1, height/8, width/8]" in p
               for p in problems(torch.zeros(1, 16, 2, 8, 6)))
    assert any("has 32 channels; Qwen-Image uses 16" in p
               for p in problems(torch.zeros(1, 32, 1, 8, 6)))
    # odd sizes (TextEncodeQwenImageEditPlus sizes images to 8 pixels) are padded to whole
    # tokens, as ComfyUI's model pads them: taken, and counted as the padded grid
    assert problems(torch.zeros(1, 16, 1, 7, 5)) == []
    assert GenerationRequest(prompt=["x"], reference_latents=[
        torch.zeros(1, 16, 1, 7, 5)]).reference_tokens("qwen_image") == 12
    assert any("'offset' is not one of ['index', 'index_timestep_zero'] for Qwen-Image" in p
               for p in problems(torch.zeros(1, 16, 1, 8, 6), method="offset"))
    req = GenerationRequest(prompt=["x"], reference_latents=[torch.zeros(1, 16, 1, 8, 6)])
    assert req.reference_tokens() == 12
    # a family whose LATENT has no frame axis keeps refusing 5-D references
    flux = SimpleNamespace(arch="flux", has_text_encoders=True, has_vae=True)
    assert any("must be a float LATENT tensor" in p for p in GenerationRequest(
        prompt=["x"], reference_latents=[torch.zeros(1, 16, 1, 8, 6)]).problems(flux))


def test_edit_folder_prompt_text_refused(edit_dir, layout_pools, oracle):
    """An Edit folder's text encoder reads the prompt with the image, which the pool does not
    have: prompt text is refused in one line (not encoded without the image) and the pool
    keeps serving."""
    from comfyui_xdit.client.pool import PoolError
    pool = layout_pools.get(edit_dir, ParallelConfig(ulysses=2))
    o = oracle("same")
    (h, w), _ = CASES["same"]
    with pytest.raises((PoolError, ValueError), match="encodes each prompt together with"):
        pool.generate(GenerationRequest(prompt=[PROMPT], seed=SEED, steps=STEPS, height=h,
                                        width=w, cfg=1.0, reference_latents=[o["raw"]]))
    check(pool.generate(request("same", o)).samples, o["want"], "after the refusal")


def test_pipefusion_with_references_refused():
    """PipeFusion puts references first in the image stream; Qwen-Image's RoPE follows the
    token order (img_shapes), so the request is refused before any rank runs it."""
    from types import SimpleNamespace

    from comfyui_xdit.planning.config import ConfigError
    model = SimpleNamespace(arch="qwen_image", heads=4, blocks=2, has_text_encoders=True,
                            has_vae=True)
    req = GenerationRequest(prompt=["x"], height=96, width=64,
                            reference_latents=[torch.zeros(1, 16, 1, 12, 8)])
    with pytest.raises(ConfigError, match="PipeFusion does not run Qwen-Image reference"):
        ParallelConfig(pipefusion=2).validate(model, req)
    ParallelConfig(ulysses=2).validate(model, req)
    req.reference_latents = None
    ParallelConfig(pipefusion=2).validate(model, req)
