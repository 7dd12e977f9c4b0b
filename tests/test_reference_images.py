"""Reference images given as images (`generate --image FILE`, GenerationRequest.
reference_images): rank 0 resizes and VAE-encodes them with the folder's own VAE as the
family's diffusers pipeline does, and (Qwen-Image-Edit) encodes the typed prompt and the
negative prompt together with the image.

Oracles: the stock pipelines given the same PIL image, with their own preprocessing and
resize rules untouched (FluxKontextPipeline's `_auto_resize` to the preferred Kontext
resolution, Flux2KleinPipeline's, QwenImageEditPipeline's ~1024^2 `calculate_dimensions`),
the same ComfyUI noise, output_type="latent": final latents agree to 1e-4 at 1 rank and at
Ulysses 2. Families without references (SD3) and single files (no VAE) are refused in one
line, by the API and by the CLI (exit 2).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.planning.config import ConfigError
from conftest import LayoutPools, pack_flux, unpack_flux
from test_cli import cli
from test_qwen_image import pack, unpack  # noqa: E402  the pipeline's packing
from test_qwen_image_edit import edit_dir, pipe  # noqa: F401  fixtures
from test_references import MSL, SIZES, flux2_oracle, noise  # noqa: F401  (fixture too)

TOL = 1e-4
CONFIGS = {"1rank": (1, ParallelConfig()), "ulysses2": (2, ParallelConfig(ulysses=2))}


def image(size, seed=0):
    from PIL import Image
    h, w = size
    rng = np.random.default_rng(1000 * seed + h + w)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def check(got, want, start, what):
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e} > {TOL}"
    assert float((want - start).abs().max()) > 1e-2  # the model moved the latent
    print(f"{what}: max abs diff {diff:.2e}")
    return diff


# ---- FLUX.1 Kontext ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def kontext(model_dir):
    """FluxKontextPipeline from the tiny FLUX folder's components, its image preprocessing
    at its defaults: (prompt, image, size) -> (final raw latent [1,16,h/8,w/8], noise)."""
    import diffusers

    path = str(model_dir("flux"))
    pipe = diffusers.FluxKontextPipeline(**diffusers.FluxPipeline.from_pretrained(path)
                                         .components)
    pipe.set_progress_bar_config(disable=True)
    scale, shift = pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor
    cache = {}

    def run(prompt, img, size, seed=5, steps=2):
        key = (prompt, id(img), size, seed, steps)
        if key not in cache:
            h, w = SIZES[size]
            x = noise(16, 1, h, w, seed)
            out = pipe(prompt=[prompt], image=img, height=h, width=w, num_inference_steps=steps,
                       guidance_scale=3.5, latents=pack_flux(x), max_sequence_length=MSL,
                       max_area=h * w, output_type="latent").images
            cache[key] = (unpack_flux(out, h, w) / scale + shift, x)
        return cache[key]
    return run


KONTEXT_IMAGE = image((64, 80))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kontext_image_equals_the_pipeline(pools, kontext, name):
    world, config = CONFIGS[name]
    want, x = kontext("a red cat", KONTEXT_IMAGE, "B")
    pool = pools("flux", world)
    pool.reconfigure(config.with_world_size(world))
    h, w = SIZES["B"]
    req = GenerationRequest(prompt=["a red cat"], seed=5, steps=2, height=h, width=w,
                            max_sequence_length=MSL, reference_images=[KONTEXT_IMAGE])
    check(pool.generate(req, noise=x).samples, want, x, f"Kontext {name}")
    # the same image as a float tensor [H, W, 3] in 0..1 is the same reference
    t = torch.from_numpy(np.asarray(KONTEXT_IMAGE, dtype=np.float32) / 255)
    req.reference_images = [t]
    check(pool.generate(req, noise=x).samples, want, x, f"Kontext {name} tensor")


# ---- FLUX.2 --------------------------------------------------------------------------------

FLUX2_IMAGES = [image((64, 80), 1), image((96, 64), 2)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flux2_images_equal_the_pipeline(pools, flux2_oracle, name):
    world, config = CONFIGS[name]
    _, want, x = flux2_oracle(["a red cat"], 3, 2, "B", FLUX2_IMAGES)
    pool = pools("flux2", world)
    pool.reconfigure(config.with_world_size(world))
    h, w = SIZES["B"]
    req = GenerationRequest(prompt=["a red cat"], seed=3, steps=2, height=h, width=w,
                            max_sequence_length=MSL, cfg=1.0, reference_images=FLUX2_IMAGES)
    check(pool.generate(req, noise=x).samples, want, x, f"FLUX.2 {name}")


# ---- Qwen-Image-Edit ----------------------------------------------------------------------

EDIT_IMAGE = image((64, 96), 3)
PROMPT, NEGATIVE, CFG = "a red cat", "ugly dark", 4.0


@pytest.fixture(scope="module")
def edit_oracle(pipe):  # noqa: F811
    """QwenImageEditPipeline with `image=` (its own resize, its prompt encoding with the
    image, negative prompt too) -> (final latent as ComfyUI's LATENT, noise)."""
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    cache = {}

    def run(h, w):
        if (h, w) not in cache:
            x = torch.randn([1, 16, 1, h // 8, w // 8], generator=torch.manual_seed(5))
            out = pipe(image=EDIT_IMAGE, prompt=PROMPT, negative_prompt=NEGATIVE,
                       true_cfg_scale=CFG, height=h, width=w, num_inference_steps=2,
                       latents=pack(x), output_type="latent").images
            cache[(h, w)] = (unpack(out, h, w) * std + mean, x)
        return cache[(h, w)]
    return run


@pytest.fixture(scope="module")
def layout_pools():
    cache = LayoutPools(keep=1)
    yield cache
    cache.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwen_edit_image_equals_the_pipeline(edit_dir, layout_pools, edit_oracle, name):  # noqa: F811
    h, w = 80, 48
    want, x = edit_oracle(h, w)
    pool = layout_pools.get(edit_dir, CONFIGS[name][1])
    req = GenerationRequest(prompt=[PROMPT], negative_prompt=NEGATIVE, cfg=CFG, seed=5,
                            steps=2, height=h, width=w, reference_images=[EDIT_IMAGE])
    check(pool.generate(req, noise=x).samples, want, x, f"Qwen-Image-Edit {name}")
