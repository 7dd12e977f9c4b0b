"""Wan image-to-video through the pool, against diffusers' WanImageToVideoPipeline
(output_type="latent", fp32, the folder's UniPC scheduler) from ComfyUI's noise: Wan 2.1 I2V
(CLIP image states through their own K/V) and Wan 2.2 I2V A14B (two experts, boundary 0.9),
at one rank, Ulysses, Ring, CFG and data parallel (a batch of 2), a 4-rank layout under the
NCCL-rules emulation, and the start frame given as ComfyUI's WanImageToVideo values
(concat_latent_image, concat_mask, clip_vision_output) at the request level. 48x80 pixels
and 9 frames: 3 latent frames of 3 x 5 tokens, 45 tokens, which no rank count here divides.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.comfy_convert import conditioning_to_request, start_image_fields
from comfyui_xdit.errors import ConfigError
from comfyui_xdit.planning.model_info import ModelInfo, read_model_info
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
from conftest import LayoutPools, comfyui_noise

VARIANTS = ("i2v", "i2v-a14b")  # Wan 2.1 I2V, Wan 2.2 I2V A14B
H, W, FRAMES, STEPS = 48, 80, 9, 3
T = (FRAMES - 1) // 4 + 1
PROMPTS = ["a red cat walks", "a dog"]
NEGATIVE = "blurry"
TOL = 1e-4
CONFIGS = {"ulysses2": ParallelConfig(ulysses=2), "ring2": ParallelConfig(ring=2),
           "cfg2": ParallelConfig(cfg_parallel=True), "dp2": ParallelConfig(dp=2)}


def start_pixels() -> torch.Tensor:
    """An 8-bit start image (uint8 [40, 64, 3]: another size and aspect than the video, so
    the pipeline's resize is part of what is compared)."""
    g = torch.Generator().manual_seed(5)
    return (torch.rand(40, 64, 3, generator=g) * 255).round().to(torch.uint8)


def pil(x):
    from PIL import Image
    return Image.fromarray(x.numpy())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = tmp_path_factory.mktemp("wan_i2v")
    return {v: ensure_tiny_model("wan", cache, variant=v) for v in VARIANTS}


@pytest.fixture(scope="module")
def pipes(folders):
    from diffusers import WanImageToVideoPipeline
    return {v: WanImageToVideoPipeline.from_pretrained(str(p), dtype=torch.float32)
            for v, p in folders.items()}


def stats(pipe):
    c = pipe.vae.config
    return (torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1),
            torch.tensor(c.latents_std).view(1, -1, 1, 1, 1))


@pytest.fixture(scope="module")
def oracle(pipes):
    """oracle(variant, req) -> WanImageToVideoPipeline's final latent as a ComfyUI LATENT
    (raw VAE space: x * std + mean), from ComfyUI's noise for the request's seed."""
    cache = {}

    def run(variant: str, req: GenerationRequest):
        key = (variant, tuple(req.prompt), req.cfg, req.seed)
        if key not in cache:
            pipe = pipes[variant]
            noise = comfyui_noise(req.seed, (len(req.prompt), 16, T, H // 8, W // 8))
            out = pipe(image=pil(start_pixels()), prompt=list(req.prompt),
                       negative_prompt=req.negative_prompt, height=H, width=W,
                       num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=req.cfg,
                       latents=noise, output_type="latent").frames
            mean, std = stats(pipe)
            cache[key] = out.float() * std + mean
        return cache[key]
    return run



def request(batch: int = 1, cfg: float = 4.0, **kw) -> GenerationRequest:
    if "concat_latent" not in kw:
        kw["reference_images"] = [start_pixels().float() / 255]
    return GenerationRequest(prompt=PROMPTS[:batch], seed=7, steps=STEPS, height=H, width=W,
                             frames=FRAMES, cfg=cfg, negative_prompt=NEGATIVE, **kw)


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    print(f"{what}: max abs diff {diff:.2e}")
    return diff


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_rank_equals_the_pipeline(folders, layout_pools, oracle, variant):
    pool = layout_pools.get(folders[variant], ParallelConfig())
    req = request()
    got = pool.generate(req).samples
    assert got.shape == (1, 16, T, H // 8, W // 8)
    check(got, oracle(variant, req), f"{variant} 1 rank")
    if variant == "i2v":  # a shorter text is padded to the 512 tokens the image K/V reads
        short = request(max_sequence_length=32)
        check(pool.generate(short).samples, oracle(variant, req), "i2v 1 rank, text 32 tokens")


# ---- ComfyUI's WanImageToVideo values, at the request level --------------------------------
def comfy_start_values(pipe):
    """What ComfyUI's WanImageToVideo and CLIPVisionEncode put into both CONDITIONINGs, in
    ComfyUI's layouts, made here with the pipeline's own parts so the layouts agree: the
    start video (the image resized as the pipeline resizes it, then mid-grey frames: 0.5 in
    0..1 is 0 in -1..1) VAE-encoded to the raw latent [1, 16, T, h, w] (ComfyUI's VAEEncode
    gives raw VAE space); the mask [1, 1, T, h, w], 0 on the latent frames the image gives
    (one image: the first); the CLIP vision output's penultimate hidden states."""
    from types import SimpleNamespace
    image = pil(start_pixels())
    pixels = pipe.video_processor.preprocess(image, height=H, width=W).float()
    video = torch.cat([pixels.unsqueeze(2), torch.zeros(1, 3, FRAMES - 1, H, W)], 2)
    with torch.no_grad():
        latent = pipe.vae.encode(video).latent_dist.mode().float()
        states = pipe.encode_image(image, torch.device("cpu")).float()
    mask = torch.ones(1, 1, T, H // 8, W // 8)
    mask[:, :, :1] = 0.0
    return {"concat_latent_image": latent, "concat_mask": mask,
            "clip_vision_output": SimpleNamespace(penultimate_hidden_states=states)}


def comfy_request(pipe, values: dict, arch: str = "wan") -> GenerationRequest:
    """CONDITIONING as ComfyUI hands it over (text states [1, 512, D] from the pipeline's
    encode_prompt) -> the request, through comfy_convert."""
    with torch.no_grad():
        pe, ne = pipe.encode_prompt(PROMPTS[0], NEGATIVE, do_classifier_free_guidance=True,
                                    max_sequence_length=512, device=torch.device("cpu"))
    pos, _ = conditioning_to_request([[pe, dict(values)]], "positive", arch)
    neg, _ = conditioning_to_request([[ne, dict(values)]], "negative", arch)
    fields = start_image_fields(pos, neg)
    return GenerationRequest(prompt=[], seed=7, steps=STEPS, height=H, width=W, frames=FRAMES,
                             cfg=4.0, positive=pos.text(), negative=neg.text(), **fields)


def test_comfy_values_equal_the_pipeline(folders, pipes, layout_pools, oracle):
    pipe = pipes["i2v"]
    values = comfy_start_values(pipe)
    req = comfy_request(pipe, values)
    assert req.concat_latent.shape == (1, 16, T, H // 8, W // 8)
    assert req.image_embeds.shape[0] == 1 and req.concat_mask.shape == (1, 1, T, 6, 10)
    pool = layout_pools.get(folders["i2v"], ParallelConfig())
    got = pool.generate(req).samples
    want = oracle("i2v", request())
    check(got, want, "ComfyUI WanImageToVideo values, 1 rank")
    # negative control: the mask inverted (the image given on every frame but the first)
    inverted = comfy_request(pipe, dict(values, concat_mask=1.0 - values["concat_mask"]))
    moved = float((pool.generate(inverted).samples - want).abs().max())
    print(f"mask inverted: moved by {moved:.2e}")
    assert moved > 1e-3, f"an inverted mask moved the result by only {moved:.2e}"
    # and the start latent dropped (all zeros, as ComfyUI's node without a start_image)
    dropped = comfy_request(pipe, dict(values, concat_latent_image=torch.zeros_like(
        values["concat_latent_image"])))
    moved = float((pool.generate(dropped).samples - want).abs().max())
    print(f"start latent dropped: moved by {moved:.2e}")
    assert moved > 1e-3, f"a dropped start latent moved the result by only {moved:.2e}"


def test_comfy_conversion_refusals(pipes):
    values = comfy_start_values(pipes["i2v"])
    cond = torch.zeros(1, 512, 32)
    with pytest.raises(ConfigError, match="do not take"):
        conditioning_to_request([[cond, dict(values)]], "positive", "flux")
    pos, _ = conditioning_to_request([[cond, dict(values)]], "positive", "wan")
    neg, _ = conditioning_to_request([[cond, {}]], "negative", "wan")
    with pytest.raises(ConfigError, match="differ in concat_latent"):
        start_image_fields(pos, neg)
    assert set(start_image_fields(pos, None)) == {"concat_latent", "concat_mask",
                                                  "image_embeds"}


# ---- parallel methods (after the ComfyUI test, which reuses the 1-rank pool) ------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parallel_methods_equal_the_pipeline(folders, layout_pools, oracle, variant, name):
    pool = layout_pools.get(folders[variant], CONFIGS[name])
    req = request(batch=2)
    check(pool.generate(req).samples, oracle(variant, req), f"{variant} {name} batch 2")


def test_four_ranks_under_the_nccl_rules(folders, oracle):
    cache = LayoutPools()
    try:
        config = ParallelConfig(ulysses=2, ring=2)
        pool = cache.get(folders["i2v"], config,
                         worker_hooks=["xdit_testhooks.nccl_rules:install"])
        req = request()
        check(pool.generate(req).samples, oracle("i2v", req), "nccl rules ulysses 2 x ring 2")
    finally:
        cache.close()


# ---- refusals (one line each) -------------------------------------------------------------
def test_refusals(folders):
    i2v, a14b = read_model_info(folders["i2v"]), read_model_info(folders["i2v-a14b"])
    assert (i2v.start_image, i2v.image_states) == (True, True)
    assert (a14b.start_image, a14b.image_states) == (True, False)
    t2v = ModelInfo(path="x", arch="wan", heads=4, patch_size=2)  # a text-to-video folder
    latent = torch.zeros(1, 16, T, H // 8, W // 8)

    def problems(model, **kw):
        base = dict(prompt=["x"], height=H, width=W, frames=FRAMES)
        return GenerationRequest(**dict(base, **kw)).problems(model)

    image = [start_pixels().float() / 255]
    assert problems(i2v, reference_images=image) == []
    assert problems(a14b, concat_latent=latent) == []
    for model, kw, words in (
            (i2v, {}, "needs a start image"),
            (a14b, {}, "needs a start image"),
            (t2v, {"reference_images": image}, "text-to-video and takes no start image"),
            (t2v, {"concat_latent": latent}, "text-to-video and takes no start image"),
            (a14b, {"reference_images": image, "concat_latent": latent}, "not both"),
            (i2v, {"concat_latent": latent}, "CLIP vision states"),
            (a14b, {"reference_images": image * 2}, "one start image"),
            (a14b, {"concat_latent": latent[:, :, :2]}, "concat_latent must be"),
            (a14b, {"concat_mask": latent[:, :1]}, "without concat_latent")):
        got = problems(model, **kw)
        assert len(got) == 1 and words in got[0] and "\n" not in got[0], (kw.keys(), got)
