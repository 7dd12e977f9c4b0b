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
from conftest import pack_flux, unpack_flux
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
    kpipe = diffusers.FluxKontextPipeline(**diffusers.FluxPipeline.from_pretrained(path)
                                         .components)
    kpipe.set_progress_bar_config(disable=True)
    scale, shift = kpipe.vae.config.scaling_factor, kpipe.vae.config.shift_factor
    cache = {}

    def run(prompt, img, size, seed=5, steps=2):
        key = (prompt, id(img), size, seed, steps)
        if key not in cache:
            h, w = SIZES[size]
            x = noise(16, 1, h, w, seed)
            out = kpipe(prompt=[prompt], image=img, height=h, width=w, num_inference_steps=steps,
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


LAYOUT_POOLS_KEEP = 1  # pools kept warm at once (conftest's layout_pools)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwen_edit_image_equals_the_pipeline(edit_dir, layout_pools, edit_oracle, name):  # noqa: F811
    h, w = 80, 48
    want, x = edit_oracle(h, w)
    pool = layout_pools.get(edit_dir, CONFIGS[name][1])
    req = GenerationRequest(prompt=[PROMPT], negative_prompt=NEGATIVE, cfg=CFG, seed=5,
                            steps=2, height=h, width=w, reference_images=[EDIT_IMAGE])
    check(pool.generate(req, noise=x).samples, want, x, f"Qwen-Image-Edit {name}")


def test_qwen_edit_refusals_keep_the_pool(edit_dir, layout_pools, edit_oracle):  # noqa: F811
    """An Edit folder: two images (the pipeline's text encoder reads one) and a typed prompt
    with a reference latent but no image are refused in one line; the pool keeps serving."""
    from comfyui_xdit.client.pool import PoolError
    h, w = 80, 48
    pool = layout_pools.get(edit_dir, ParallelConfig(ulysses=2))
    base = dict(prompt=[PROMPT], negative_prompt=NEGATIVE, cfg=CFG, seed=5, steps=2,
                height=h, width=w)
    with pytest.raises((PoolError, ValueError), match="with one reference image; got 2"):
        pool.generate(GenerationRequest(**base, reference_images=[EDIT_IMAGE, EDIT_IMAGE]))
    with pytest.raises((PoolError, ValueError), match="give the image"):
        pool.generate(GenerationRequest(**base,
                                        reference_latents=[torch.zeros(1, 16, 1, 8, 8)]))
    want, x = edit_oracle(h, w)
    check(pool.generate(GenerationRequest(**base, reference_images=[EDIT_IMAGE]),
                        noise=x).samples, want, x, "Qwen-Image-Edit after refusals")


# ---- refusals ------------------------------------------------------------------------------

def test_request_refusals():
    from types import SimpleNamespace

    from workers.messages import REFERENCE_IMAGES_NEED_VAE

    def problems(arch, images, has_vae=True):
        m = SimpleNamespace(arch=arch, has_text_encoders=True, has_vae=has_vae)
        return GenerationRequest(prompt=["x"], reference_images=images).problems(m)

    img = image((64, 64))
    assert problems("sd3", [img]) == ["reference images are not supported by SD3/3.5 models "
                                      "(remove the reference image)"]
    assert problems("flux", [img], has_vae=False) == \
        [REFERENCE_IMAGES_NEED_VAE]
    assert "give the reference as a LATENT instead" in REFERENCE_IMAGES_NEED_VAE
    for arch in ("flux", "flux2", "qwen_image"):
        assert problems(arch, [img, torch.rand(32, 48, 3)]) == []
    assert any("non-empty list" in p for p in problems("flux", []))
    assert any("float tensor [H, W, 3]" in p for p in problems("flux", [torch.rand(3, 32, 32)]))
    assert any("outside 0..1" in p for p in problems("flux", [torch.rand(32, 32, 3) * 2]))
    assert any("must be a float tensor [H, W, 3] in 0..1 or a PIL image" in p
               for p in problems("flux", ["x.png"]))
    both = GenerationRequest(prompt=["x"], reference_images=[img],
                             reference_latents=[torch.zeros(1, 16, 8, 8)])
    assert "give reference_latents or reference_images, not both" in both.problems(
        SimpleNamespace(arch="flux", has_text_encoders=True, has_vae=True))
    # PipeFusion refuses Qwen-Image references given as images too
    model = SimpleNamespace(arch="qwen_image", heads=4, blocks=2, has_text_encoders=True,
                            has_vae=True)
    with pytest.raises(ConfigError, match="PipeFusion does not run Qwen-Image reference"):
        ParallelConfig(pipefusion=2).validate(model, GenerationRequest(
            prompt=["x"], height=96, width=64, reference_images=[img]))


def _cli_line(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_cli_refusals_exit_2(model_dir, tmp_path):
    from single_file_util import write_single_file

    png = tmp_path / "ref.png"
    image((64, 64)).save(png)
    args = ["--prompt", "a cat", "--seed", "1", "--steps", "1", "--height", "64", "--width",
            "64", "--out", tmp_path / "o.safetensors"]
    line = _cli_line(cli("generate", "--model", model_dir("sd3"), "--image", png, *args))
    assert "reference images are not supported by SD3/3.5 models" in line
    single = write_single_file(model_dir("flux"), "flux", tmp_path / "flux.safetensors")
    line = _cli_line(cli("generate", "--model", single, "--image", png, *args))
    assert "give the reference as a LATENT instead" in line
    line = _cli_line(cli("generate", "--model", model_dir("flux"), "--image",
                         tmp_path / "missing.png", *args))
    assert "--image" in line and "no such file" in line
    (tmp_path / "bad.png").write_text("not an image")
    line = _cli_line(cli("generate", "--model", model_dir("flux"), "--image",
                         tmp_path / "bad.png", *args))
    assert "is not an image" in line


def test_cli_image_equals_the_pipeline(model_dir, kontext, tmp_path):
    """`generate --image FILE` at Ulysses 2 (a pool of its own) writes the Kontext
    pipeline's final latent (ComfyUI's noise for the seed, as the oracle's)."""
    from safetensors.torch import load_file

    png = tmp_path / "ref.png"
    KONTEXT_IMAGE.save(png)
    want, x = kontext("a red cat", KONTEXT_IMAGE, "B")
    h, w = SIZES["B"]
    out = tmp_path / "o.safetensors"
    r = cli("generate", "--model", model_dir("flux"), "--prompt", "a red cat", "--seed", "5",
            "--steps", "2", "--height", h, "--width", w, "--max-sequence-length", MSL,
            "--image", png, "--world-size", "2", "--ulysses", "2", "--threads-per-rank", "1",
            "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    check(load_file(str(out))["samples"], want, x, "CLI --image ulysses2")


def test_reference_image_sizes_follow_the_pipelines():
    """The host's count of a reference image's tokens (split check, memory plan) uses each
    family's resize rule, which follows its diffusers pipeline's."""
    from types import SimpleNamespace

    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from workers import families
    from workers.families.flux import KONTEXT_RESOLUTIONS
    assert [tuple(r) for r in PREFERRED_KONTEXT_RESOLUTIONS] == list(KONTEXT_RESOLUTIONS)

    def size_of(fid):
        return families.family(fid).capability(families.References).image_size
    sizes = [(64, 80), (80, 64), (1000, 333), (333, 1000), (2048, 1536), (517, 519)]
    for w, h in sizes:
        cw, ch, _ = calculate_dimensions(1024 * 1024, w / h)
        assert size_of("qwen_image")(w, h) == (cw, ch)
        img = image((h, w))
        if w * h > 1024 * 1024:
            img = Flux2ImageProcessor._resize_to_target_area(img, 1024 * 1024)
        assert size_of("flux2")(w, h) == \
            (img.size[0] // 16 * 16, img.size[1] // 16 * 16)
    assert size_of("flux")(80, 64) == (1104, 944)
    assert families.family("sd3").capability(families.References) is None
    req = GenerationRequest(prompt=["x"], reference_images=[image((64, 80)),
                                                            torch.rand(96, 64, 3)])
    assert req.reference_tokens() == 0  # the size rule needs the family
    model = SimpleNamespace(arch="flux2")
    assert req.reference_tokens(model) == 4 * 5 + 6 * 4
    assert req.reference_tokens("qwen_image") == sum(
        (h // 16) * (w // 16) for w, h in (calculate_dimensions(1024 ** 2, 80 / 64)[:2],
                                           calculate_dimensions(1024 ** 2, 64 / 96)[:2]))
