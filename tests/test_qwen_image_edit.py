"""Qwen-Image-Edit through the pool equals diffusers' QwenImageEditPipeline (DESIGN.md
numerics 4) with a reference image, at 1 rank, Ulysses 2, Ring 2, CFG 2 and Ulysses 2 x
Ring 2, with a reference of the target's size and one of another size (wider than the
target, so the text RoPE starts past the reference's grid, and 15 + 32 = 47 image tokens:
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
from conftest import LayoutPools

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


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, 16, 1, h, w] -> [B, h/2 * w/2, 64], as QwenImagePipeline._pack_latents."""
    b, c, _, h, w = x.shape
    return x[:, :, 0].view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5) \
        .reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    b, _, c = x.shape
    h, w = height // 16, width // 16
    return x.view(b, h, w, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5) \
        .reshape(b, c // 4, 1, 2 * h, 2 * w)


def ref_image(size):
    from PIL import Image
    h, w = size
    rng = np.random.default_rng(h * 1000 + w)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    """The tiny Qwen-Image-Edit folder (QwenImageEditPipeline: the processor gives the text
    encoder the image), built offline."""
    from comfyui_xdit.testmodels import tiny_qwen_image
    from comfyui_xdit.testmodels.tiny_model import resolve_config

    out = tmp_path_factory.mktemp("models") / "qwen_image_edit"
    tiny_qwen_image.build_pipeline(resolve_config("qwen_image"), edit=True) \
        .save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def pipe(edit_dir):
    from diffusers import QwenImageEditPipeline

    from comfyui_xdit.testmodels.tiny_qwen_image import patch_processor_without_video
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


@pytest.fixture(scope="module")
def layout_pools():
    cache = LayoutPools(keep=1)
    yield cache
    cache.close()


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
