"""Qwen-Image-Edit 2509 and 2511 (QwenImageEditPlusPipeline: several reference images, all
read by the text encoder) through the pool equal the pipeline (docs/design.md#numerics-rule-4) at 1
rank, Ulysses 2, Ring 2 and CFG 2, with two references of different sizes.

2511's transformer has `zero_cond_t`: the reference tokens are modulated at timestep 0, the
target's at the step's, by a per-token index over the image stream. The sequence split puts
the target/reference boundary inside rank 0's slice here (15 target + 32 + 24 reference
tokens = 71: ranks hold 36 and 35), so rank 1 holds reference tokens only and each rank's
index must be its own slice of the whole one. A negative control shows that modulating
every token at the noisy timestep moves the result far past the tolerance.

The references travel as ComfyUI's TextEncodeQwenImageEditPlus leaves them (the raw VAE
latents [1, 16, 1, h, w] in `reference_latents`): exactly the latents the pipeline's VAE
encoded (a spy records them); prompt embeddings are the pipeline's own, encoded with both
condition images. The pipeline resizes images to ~1024^2 (VAE) and ~384^2 (text encoder)
areas; here `calculate_dimensions` is pointed at each reference's small size so the tiny
model stays fast. One Ulysses-2 run takes the images themselves (`reference_images`, the
pipeline's own sizes) with typed prompts.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

from test_qwen_image import pack, unpack  # noqa: E402  the pipeline's packing, once

TOL = 1e-4
STEPS = 2
SEED = 5
CFG = 4.0
PROMPT, OTHER, NEGATIVE = "a red cat", "a blue dog", "ugly dark"
SIZE = (80, 48)  # target: 5 x 3 = 15 tokens
REFS = ((64, 128), (96, 64))  # 4 x 8 = 32 and 6 x 4 = 24 tokens (height, width)
VARIANTS = ("edit-plus", "edit-2511")

CONFIGS = {
    "1rank": ParallelConfig(),
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
}


def ref_image(size):
    from PIL import Image
    h, w = size
    rng = np.random.default_rng(h * 1000 + w)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


IMAGES = [ref_image(s) for s in REFS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """variant -> the tiny folder (edit-plus: 2509-style; edit-2511: zero_cond_t)."""
    from comfyui_xdit.testmodels import qwen_image
    from comfyui_xdit.testmodels.tiny_model import resolve_config

    out = {}
    for v in VARIANTS:
        path = tmp_path_factory.mktemp("models") / v
        qwen_image.build_pipeline(resolve_config("qwen_image", variant=v)) \
            .save_pretrained(str(path), safe_serialization=True)
        out[v] = path
    return out


@pytest.fixture(scope="module")
def pipes(folders):
    from diffusers import QwenImageEditPlusPipeline

    from comfyui_xdit.testmodels.qwen_image import patch_processor_without_video
    patch_processor_without_video()
    out = {}
    for v, path in folders.items():
        p = QwenImageEditPlusPipeline.from_pretrained(str(path)).to(torch.float32)
        p.set_progress_bar_config(disable=True)
        out[v] = p
    assert out["edit-2511"].transformer.config.zero_cond_t
    assert not out["edit-plus"].transformer.config.zero_cond_t
    return out


@contextlib.contextmanager
def small_references():
    """QwenImageEditPlusPipeline's resizes (~1024^2 for the VAE, ~384^2 for the text encoder)
    pointed at each reference's own size (told apart by aspect ratio)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as mod
    by_ratio = {round(w / h, 6): (w, h) for h, w in REFS}
    orig = mod.calculate_dimensions
    mod.calculate_dimensions = lambda area, ratio: by_ratio[round(ratio, 6)]
    try:
        yield
    finally:
        mod.calculate_dimensions = orig


class VaeSpy:
    """Records the raw latents (the mode) the pipeline's VAE encodes."""

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


def every_token_noisy(index):
    """A wrong modulation index: every image token at the step's timestep."""
    return index * 0


def first_slice_on_every_rank(index):
    """A wrong split, emulated in one process: the index cut as if each of 2 ranks took the
    first rows of the whole one (rank 1's reference tokens get rank 0's target ones)."""
    n = index.shape[1]
    return torch.cat([index[:, :(n + 1) // 2], index[:, :n // 2]], 1)


@contextlib.contextmanager
def wrong_modulation(transformer, wrong):
    def hook(block, args, kwargs):
        index = kwargs.get("modulate_index")
        return args, (kwargs if index is None else dict(kwargs, modulate_index=wrong(index)))
    handles = [b.register_forward_pre_hook(hook, with_kwargs=True)
               for b in transformer.transformer_blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def latent_space(pipe, packed, h, w):
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    return unpack(packed, h, w) * std + mean


@pytest.fixture(scope="module")
def oracle(pipes):
    """oracle(variant) -> dict(raws: the two reference latents the pipeline encoded, want:
    its final latent as a ComfyUI LATENT, noisy / first_slice: the same with a wrong
    modulation index (2511's negative controls), pos / neg / other: prompt embeddings,
    noise)."""
    cache = {}

    def run(variant):
        if variant in cache:
            return cache[variant]
        pipe = pipes[variant]
        h, w = SIZE
        cond = [pipe.image_processor.resize(im, s[0], s[1]) for im, s in zip(IMAGES, REFS)]
        with torch.no_grad():
            pos, other, neg = (pipe.encode_prompt([p], image=cond)[0]
                               for p in (PROMPT, OTHER, NEGATIVE))
        assert pos.shape == other.shape  # a batch of the two needs no padding
        noise = torch.randn([1, 16, 1, h // 8, w // 8], generator=torch.manual_seed(SEED))
        kw = dict(prompt_embeds=pos,
                  prompt_embeds_mask=torch.ones(pos.shape[:2], dtype=torch.long),
                  negative_prompt_embeds=neg,
                  negative_prompt_embeds_mask=torch.ones(neg.shape[:2], dtype=torch.long),
                  true_cfg_scale=CFG, height=h, width=w, num_inference_steps=STEPS,
                  output_type="latent")
        with small_references(), VaeSpy(pipe.vae) as spy:
            out = pipe(image=IMAGES, latents=pack(noise), **kw).images
        raws = spy.seen
        assert [tuple(r.shape) for r in raws] == [(1, 16, 1, rh // 8, rw // 8) for rh, rw in REFS]
        o = dict(raws=raws, want=latent_space(pipe, out, h, w), pos=pos, neg=neg, other=other,
                 noise=noise)
        if pipe.transformer.config.zero_cond_t:
            for name, wrong in (("noisy", every_token_noisy),
                                ("first_slice", first_slice_on_every_rank)):
                with small_references(), wrong_modulation(pipe.transformer, wrong):
                    bad = pipe(image=IMAGES, latents=pack(noise), **kw).images
                o[name] = latent_space(pipe, bad, h, w)
        cache[variant] = o
        return o
    return run


LAYOUT_POOLS_KEEP = 1  # pools kept warm at once (conftest's layout_pools)


def request(o, **kw) -> GenerationRequest:
    h, w = SIZE
    return GenerationRequest(prompt=[], positive={"cond": o["pos"], "pooled": None},
                             negative={"cond": o["neg"], "pooled": None}, cfg=CFG, seed=SEED,
                             steps=STEPS, height=h, width=w,
                             reference_latents=list(o["raws"]), **kw)


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    print(f"{what}: {diff:.2e}")
    return diff


@pytest.mark.parametrize("variant", VARIANTS)
def test_edit_plus_equals_the_pipeline(folders, layout_pools, oracle, variant):
    """Every layout of one folder in turn (one world-2 pool serves Ulysses, Ring and CFG)."""
    o = oracle(variant)
    for name, config in CONFIGS.items():
        pool = layout_pools.get(folders[variant], config)
        check(pool.generate(request(o)).samples, o["want"], f"{variant} {name}")


def test_2511_modulation_split_matters(oracle):
    """Negative controls: 2511 with every token at the noisy timestep (an index that
    ignores the references), or with the index cut as if every rank held the first tokens,
    is over ten times the tolerance away, and 2509's result (the same weights, no zero_cond_t)
    differs too: the equality above is the per-rank index's work."""
    o, plain = oracle("edit-2511"), oracle("edit-plus")
    for what, other in (("noisy", o["noisy"]), ("first_slice", o["first_slice"]),
                        ("2509", plain["want"])):
        diff = float((other - o["want"]).abs().max())
        print(f"2511 vs {what}: {diff:.2e}")
        assert diff > 10 * TOL, what


@pytest.mark.parametrize("config", [ParallelConfig(ulysses=2), ParallelConfig(dp=2)],
                         ids=["ulysses2", "dp2"])
def test_batch_rows_are_independent(folders, layout_pools, oracle, config):
    """2511: row 0 of the batch [A, B] (two prompts, one noise draw of the whole batch, the
    references shared) equals A alone, in one sequence-parallel call and with each row on
    its own data-parallel replica."""
    o = oracle("edit-2511")
    pool = layout_pools.get(folders["edit-2511"], config)
    pair = request(o)
    pair.positive = {"cond": torch.cat([o["pos"], o["other"]]), "pooled": None}
    pair.negative = {"cond": o["neg"].expand(2, -1, -1), "pooled": None}
    rows = pool.generate(pair).samples
    assert rows.shape[0] == 2 and float((rows[1] - rows[0]).abs().max()) > 1e-3
    check(rows[:1], o["want"], f"2511 batch row 0 {config.describe()}")


def test_comfy_conditioning_references(folders, layout_pools, oracle):
    """What TextEncodeQwenImageEditPlus gives the sampler: CONDITIONING whose options carry
    both raw reference latents (frame axis kept), on the positive and the negative, with
    ComfyUI's 2511 method name."""
    from comfyui_xdit.nodes.operations import SampleInputs, build_job
    from comfyui_xdit.planning.model_info import read_model_info
    o = oracle("edit-2511")
    info = read_model_info(folders["edit-2511"])
    h, w = SIZE
    # ComfyUI's 2511 workflows may name the method (FluxKontextMultiReferenceLatentMethod)
    refs = {"reference_latents": list(o["raws"]),
            "reference_latents_method": "index_timestep_zero"}
    inputs = SampleInputs(latent={"samples": torch.zeros(1, 16, 1, h // 8, w // 8)},
                          seed=SEED, steps=STEPS, cfg=CFG, positive=[[o["pos"], dict(refs)]],
                          negative=[[o["neg"], dict(refs)]])
    req, kw = build_job(inputs, "qwen_image", model=info)
    assert len(req.reference_latents) == 2 and req.problems(info) == []
    assert req.reference_method == "index_timestep_zero"
    pool = layout_pools.get(folders["edit-2511"], ParallelConfig(ring=2))
    check(pool.generate(req, **kw).samples, o["want"], "2511 ComfyUI CONDITIONING")


def test_odd_reference_is_padded_as_comfyui_pads_it(folders, layout_pools, oracle):
    """A reference of odd latent size (TextEncodeQwenImageEditPlus rounds its VAE image to
    8 pixels) runs as ComfyUI's model runs it: padded circularly to whole tokens. The 12x8
    reference cut to 11x7 gives what its circularly padded 12x8 copy gives (an even
    reference, the path proven against the pipeline above), 2511 at Ring 2."""
    import torch.nn.functional as F
    o = oracle("edit-2511")
    pool = layout_pools.get(folders["edit-2511"], ParallelConfig(ring=2))
    odd = o["raws"][1][..., :11, :7]
    padded = F.pad(odd[:, :, 0], (0, 1, 0, 1), mode="circular").unsqueeze(2)
    samples = {}
    for name, ref in (("padded", padded), ("odd", odd)):
        req = request(o)
        req.reference_latents = [o["raws"][0], ref]
        samples[name] = pool.generate(req).samples
    want, got = samples["padded"], samples["odd"]
    assert float((want - o["want"]).abs().max()) > 10 * TOL  # the cut reference matters
    check(got, want, "2511 odd reference vs its padded copy")


def test_reference_images_and_prompts_equal_the_pipeline(folders, pipes, layout_pools):
    """The images themselves with typed prompts (`reference_images`): the pool resizes,
    VAE-encodes and encodes the prompts with both images as QwenImageEditPlusPipeline does
    (its own ~1024^2 / ~384^2 sizes), 2511 at Ulysses 2."""
    pipe = pipes["edit-2511"]
    h, w = SIZE
    noise = torch.randn([1, 16, 1, h // 8, w // 8], generator=torch.manual_seed(SEED))
    out = pipe(image=IMAGES, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=CFG,
               height=h, width=w, num_inference_steps=STEPS, latents=pack(noise),
               output_type="latent").images
    want = latent_space(pipe, out, h, w)
    pool = layout_pools.get(folders["edit-2511"], ParallelConfig(ulysses=2))
    req = GenerationRequest(prompt=[PROMPT], negative_prompt=NEGATIVE, cfg=CFG, seed=SEED,
                            steps=STEPS, height=h, width=w, reference_images=IMAGES)
    check(pool.generate(req, noise=noise).samples, want, "2511 reference_images")


def test_plus_pipeline_detected(folders):
    from comfyui_xdit.bridge import worker_module
    detect = worker_module("models.detect")
    fam = worker_module("families").family("qwen_image")
    assert detect.pipeline_class(fam, folders["edit-2511"]) == "QwenImageEditPlusPipeline"
    assert fam.pipeline_for("QwenImageEditPipeline") == "QwenImageEditPipeline"
    # a ComfyUI 2511 file carries the marker tensor: the config gets zero_cond_t, and the
    # xDiT MODEL's ComfyUI config ComfyUI's own reference method for it
    shapes = {"img_in.weight": (64, 64), "transformer_blocks.0.attn.norm_q.weight": (16,),
              "transformer_blocks.0.x": (1,), "proj_out.weight": (64, 64),
              "txt_in.weight": (64, 32)}
    assert "zero_cond_t" not in fam.detection.config_from_shapes(shapes, "diffusers")
    cfg = fam.detection.config_from_shapes(dict(shapes, __index_timestep_zero__=(0,)), "diffusers")
    assert cfg["zero_cond_t"] is True
    assert fam.comfy.unet(cfg)["default_ref_method"] == "index_timestep_zero"


def test_model_call_2511_equals_the_transformer(folders, pipes, layout_pools):
    """The xDiT MODEL (stock KSampler) on a 2511 folder: ComfyUI's QwenImage call with two
    `ref_latents` equals diffusers' zero_cond_t transformer on the joined stream (ComfyUI's
    own 2511 model gives references timestep 0 alike: default_ref_method
    "index_timestep_zero"), at Ulysses 2."""
    from test_qwen_image_edit import comfy_edit_call, edit_model_reference

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    config = ParallelConfig(ulysses=2)
    pool = layout_pools.get(folders["edit-2511"], config)
    den = PoolDenoiser(pool, config, "qwen_image")
    tr = pipes["edit-2511"].transformer
    call = comfy_edit_call(tr, 1, 12, 10, [(8, 6), (4, 10)])
    want = edit_model_reference(tr, call["x"], call["timestep"], call["context"],
                                call["ref_latents"])
    check(den(**call), want, "2511 MODEL")
    check(den(**call, ref_latents_method="index_timestep_zero"), want,
          "2511 MODEL index_timestep_zero")


def test_timestep_zero_method_needs_a_2511_transformer():
    """ComfyUI's `index_timestep_zero` on a transformer without zero_cond_t (2509, the
    first Edit) is refused in one line, on the sampler path (rank 0, before any step) and
    the MODEL path alike; `index` runs on both."""
    from types import SimpleNamespace

    from comfyui_xdit.bridge import worker_module
    mod = worker_module("models.qwen_image")
    adapter = mod.QwenImageAdapter()
    plain = SimpleNamespace(config=SimpleNamespace(zero_cond_t=False))
    zero = SimpleNamespace(config=SimpleNamespace(zero_cond_t=True))
    with pytest.raises(ValueError, match="needs a Qwen-Image-Edit 2511 transformer"):
        adapter._check_method("index_timestep_zero", plain)
    for method, tr in (("index_timestep_zero", zero), ("index", plain), ("index", zero)):
        adapter._check_method(method, tr)
    extra = dict(img_shape=(1, 2, 2), ref_tokens=torch.zeros(1, 4, 64),
                 **adapter.reference_extra({}, [(4, 4)], "index_timestep_zero", 32, 32, "cpu"))
    with pytest.raises(ValueError, match="needs a Qwen-Image-Edit 2511 transformer"):
        adapter.with_references(torch.zeros(1, 4, 64), extra, zero_cond=False)
    hidden, shapes, n = adapter.with_references(torch.zeros(1, 4, 64), extra, zero_cond=True)
    assert hidden.shape == (1, 8, 64) and shapes == [(1, 2, 2), (1, 2, 2)] and n == 4


def test_comfy_2511_single_file(pipes, oracle, tmp_path):
    """ComfyUI's 2511 file (diffusers' names under `model.diffusion_model.`, with the empty
    `__index_timestep_zero__` tensor ComfyUI detects it by): read as zero_cond_t, loaded
    without that tensor, equal to the pipeline at Ulysses 2 with both references."""
    from safetensors.torch import save_file

    from comfyui_xdit import WorkerPool
    from comfyui_xdit.planning.model_info import read_model_info
    prefix = "model.diffusion_model."
    sd = {prefix + k: v.contiguous() for k, v in pipes["edit-2511"].transformer.state_dict().items()}
    sd[prefix + "__index_timestep_zero__"] = torch.tensor([])
    path = tmp_path / "qwen_image_edit_2511_tiny.safetensors"
    save_file(sd, str(path))
    info = read_model_info(path)
    assert info.arch == "qwen_image" and info.kind == "file"
    o = oracle("edit-2511")
    config = ParallelConfig(ulysses=2)
    with WorkerPool(str(path), config, device="cpu", threads_per_rank=1) as pool:
        check(pool.generate(request(o)).samples, o["want"], "2511 single file")
