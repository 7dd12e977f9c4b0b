"""Chroma (workers/families/chroma.py, workers/models/chroma.py): a tiny Chroma folder run by
the pool at one rank equals diffusers' `ChromaPipeline(..., latents=<ComfyUI noise packed>,
output_type="latent")` to 1e-4 (fp32, final latent, ComfyUI LATENT space), true CFG with a
negative prompt, 80x48 (5x3 = 15 image tokens), batch 1 and 3; prompts of different lengths
equal the intended oracle at 1 rank, Ulysses 2, Ring 2 and CFG 2. That every other method,
weight sharding and PipeFusion at full warmup equal one rank, and LoRA its merged weights,
is the conformance suite's (tests/conformance/).

Why every prompt here has the same token count and max_sequence_length is that count + 1:
diffusers 0.42.1's ChromaPipeline builds its text mask as a float 0/1 tensor that SDPA adds
to the logits (reported upstream more than once), so the pipeline computes neither the intended
mask nor no mask. The pool follows the intended mask (it trims the text to the longest real
length + 1, workers/models/chroma.py). The two agree exactly where the pipeline's mask is
all ones: every prompt and negative prompt has max_sequence_length - 1 real tokens (prompt
tokens + EOS), so the one kept pad token is the last position and nothing is masked (the
float mask then adds the same +1 to every logit, which softmax ignores).
`test_trimmed_text_equals_the_intended_mask` checks the trimming itself against diffusers'
transformer given the intended boolean mask, for a padded prompt.

Also: a BFL/ComfyUI-named single file of the tiny transformer is detected with the folder's
config (that its pool equals the folder's is the conformance suite's single-file theme); the
default cfg is ChromaPipeline's guidance_scale default. `-s` prints the max differences.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

from conftest import comfyui_noise, model_to_latent, pack_flux, unpack_flux

TOL = 1e-4
MOVED = 1e-2
STEPS = 3
CFG = 4.0
# 3 prompt tokens + EOS each in the tiny T5 vocabulary (checked in `_check_lengths`)
PROMPTS = ["a red cat", "a blue dog", "a big fox"]
NEGATIVE = "dark old photo"
MSL = 5  # = real tokens + 1: diffusers' mask is all ones
SIZE = (80, 48)  # 5 x 3 image tokens


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("chroma")


@pytest.fixture(scope="module")
def chroma_pools():
    """Warm pools by launch layout (and hooks); two kept alive (a shared 2-core machine)."""
    from conftest import LayoutPools
    cache = LayoutPools(keep=2)
    yield lambda folder, config, **kw: cache.get(folder, config, **kw)
    cache.close()


_PIPES: dict = {}
_ORACLES: dict = {}


def pipeline(folder):
    from diffusers import ChromaPipeline
    if str(folder) not in _PIPES:
        pipe = ChromaPipeline.from_pretrained(str(folder))
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(folder)] = pipe
    return _PIPES[str(folder)]


def _check_lengths(pipe, texts, msl=MSL):
    ids = pipe.tokenizer(list(texts), padding="max_length", max_length=msl,
                         return_tensors="pt").attention_mask
    assert (ids.sum(1) == msl - 1).all(), "prompts must have max_sequence_length - 1 tokens"


def oracle(folder, req: GenerationRequest, pipe=None):
    """ChromaPipeline's final latent for `req` from ComfyUI's noise, as a ComfyUI LATENT."""
    pipe = pipe or pipeline(folder)
    key = (str(folder), id(pipe), tuple(req.prompt), req.seed, req.steps, req.height,
           req.width, req.cfg, req.negative_prompt, req.max_sequence_length)
    if key not in _ORACLES:
        b, h, w = len(req.prompt), req.height, req.width
        _check_lengths(pipe, list(req.prompt) + [req.negative_prompt], req.max_sequence_length)
        noise = comfyui_noise(req.seed, (b, 16, h // 8, w // 8))
        out = pipe(prompt=list(req.prompt), negative_prompt=[req.negative_prompt] * b,
                   guidance_scale=req.cfg, height=h, width=w, num_inference_steps=req.steps,
                   latents=pack_flux(noise), max_sequence_length=req.max_sequence_length,
                   output_type="latent").images
        _ORACLES[key] = model_to_latent(unpack_flux(out, h, w), folder)
    return _ORACLES[key]


def request(batch, cfg=CFG, seed=7, **kw):
    h, w = SIZE
    base = dict(prompt=PROMPTS[:batch], seed=seed, steps=STEPS, height=h, width=w,
                max_sequence_length=MSL, cfg=cfg, negative_prompt=NEGATIVE)
    base.update(kw)
    return GenerationRequest(**base)


def check_exact(pool, folder, batches=(1, 3), cfg=CFG, label=""):
    for b in batches:
        req = request(b, cfg=cfg)
        want = oracle(folder, req)
        got = pool.generate(req).samples
        start = model_to_latent(comfyui_noise(req.seed, got.shape), folder)
        assert got.shape == want.shape == (b, 16, SIZE[0] // 8, SIZE[1] // 8)
        assert (want - start).abs().max().item() > MOVED
        err = (got - want).abs().max().item()
        print(f"chroma {label or pool.config.describe()} batch {b} cfg {cfg}: "
              f"max abs diff {err:.2e}")
        assert err <= TOL, f"{label} batch {b}: max abs diff {err:.2e}"


# ---- family facts ------------------------------------------------------------------------

def test_default_cfg_is_the_pipelines():
    from diffusers import ChromaPipeline

    default = inspect.signature(ChromaPipeline.__call__).parameters["guidance_scale"].default
    r = GenerationRequest(prompt=["x"]).resolved("chroma")
    assert (r.cfg, r.guidance) == (float(default), None)


def test_folder_is_detected_as_chroma(folder):
    from comfyui_xdit.bridge import worker_module
    detect = worker_module("models.detect")
    d = detect.describe_model(folder)
    assert (d["arch"], d["pipeline"]) == ("chroma", "ChromaPipeline")


# ---- the text: trimming = the intended mask ---------------------------------------------

def test_trimmed_text_equals_the_intended_mask(folder):
    """Our text (a padded prompt trimmed to its tokens + EOS + one pad, no mask) through
    the transformer equals diffusers' transformer given the full padded text and the mask
    ChromaPipeline means (boolean: text positions <= real length, all image tokens); and
    both differ from what the buggy float mask computes."""
    from comfyui_xdit.bridge import worker_module

    ChromaAdapter = worker_module("models.chroma").ChromaAdapter
    pipe = pipeline(folder)
    msl, (h, w) = 16, SIZE
    text = ["a red cat"]  # 4 real tokens of 16

    class Model:  # what the adapter reads of a LoadedModel
        encoder, transformer, device, dtype = pipe, pipe.transformer, "cpu", torch.float32

    ad = ChromaAdapter()
    with torch.no_grad():
        cond = ad.encode(Model, text, msl)
        assert cond["encoder_hidden_states"].shape[1] == 5
        x = pack_flux(comfyui_noise(3, (1, 16, h // 8, w // 8)))
        t = torch.tensor(700.0)
        extra = ad.forward_extra(Model, h, w)
        ours = ad.forward(Model, x, t, cond, None, extra)

        pe, ids, mask = pipe.encode_prompt(text, do_classifier_free_guidance=False,
                                           max_sequence_length=msl)[:3]
        full = torch.cat([mask, torch.ones(1, x.shape[1])], dim=1)

        def theirs(m):
            return pipe.transformer(hidden_states=x, timestep=(t / 1000).expand(1),
                                    encoder_hidden_states=pe, txt_ids=ids,
                                    img_ids=extra["img_ids"], attention_mask=m,
                                    return_dict=False)[0]
        intended, buggy = theirs(full > 0.5), theirs(full)
    err = (ours - intended).abs().max().item()
    print(f"trimmed text vs the intended boolean mask: max abs diff {err:.2e}; "
          f"vs the float mask {(ours - buggy).abs().max().item():.2e}")
    assert err <= 1e-5
    assert (ours - buggy).abs().max().item() > 1e-3


# ---- exact methods -----------------------------------------------------------------------

def test_one_rank_matches_the_pipeline(chroma_pools, folder):
    pool = chroma_pools(folder, ParallelConfig())
    check_exact(pool, folder, label="1 rank")
    check_exact(pool, folder, batches=(1,), cfg=1.0, label="1 rank, no CFG")


TWO = {
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
}


# ---- prompts of different lengths: the intended oracle ----------------------------------
MIXED = ["a red cat", "a big blue dog sitting on the green grass"]
MIXED_NEGATIVE = "dark old photo of a fox"
MIXED_MSL = 16


def intended_oracle(folder, req: GenerationRequest):
    """The intended Chroma result (docs/design.md#model-families): each prompt alone with its
    own noise row, its text and the negative's each cut to their own tokens + EOS + one pad,
    so ChromaPipeline's mask is all ones and adds nothing."""
    pipe = pipeline(folder)
    b, h, w = len(req.prompt), req.height, req.width
    noise = comfyui_noise(req.seed, (b, 16, h // 8, w // 8))

    def own(text):
        pe, _, mask = pipe.encode_prompt([text], do_classifier_free_guidance=False,
                                         max_sequence_length=req.max_sequence_length)[:3]
        n = int(mask.sum())
        assert n < req.max_sequence_length, "the text must be padded for the test to bite"
        return pe[:, :n], torch.ones(1, n), n

    neg, neg_mask, n_neg = own(req.negative_prompt)
    rows, lengths = [], {n_neg}
    for i, text in enumerate(req.prompt):
        pe, mask, n = own(text)
        lengths.add(n)
        out = pipe(prompt_embeds=pe, prompt_attention_mask=mask, negative_prompt_embeds=neg,
                   negative_prompt_attention_mask=neg_mask, guidance_scale=req.cfg, height=h,
                   width=w, num_inference_steps=req.steps, latents=pack_flux(noise[i:i + 1]),
                   output_type="latent").images
        rows.append(model_to_latent(unpack_flux(out, h, w), folder))
    assert len(lengths) == len(req.prompt) + 1, f"text lengths {lengths} must all differ"
    return torch.cat(rows)


def mixed_request() -> GenerationRequest:
    h, w = SIZE
    return GenerationRequest(prompt=MIXED, negative_prompt=MIXED_NEGATIVE, seed=5, steps=STEPS,
                             height=h, width=w, cfg=CFG, max_sequence_length=MIXED_MSL)


@pytest.mark.parametrize("name", ["1 rank", "ulysses2", "ring2", "cfg2"])
def test_prompts_of_different_lengths_equal_the_intended_oracle(chroma_pools, folder, name):
    """A batch of prompts of different lengths and a negative of a third: every row equals
    its prompt alone with its own text (it used to keep the longest prompt's pad tokens:
    2.7 away)."""
    config = ParallelConfig() if name == "1 rank" else TWO[name]
    req = mixed_request()
    with torch.no_grad():
        want = intended_oracle(folder, req)
    got = chroma_pools(folder, config).generate(req).samples
    err = float((got - want).abs().max())
    print(f"chroma {name}, prompts of different lengths vs the intended oracle: {err:.2e}")
    assert err <= TOL


# ---- a BFL / ComfyUI single file (its pool equals the folder's: the conformance suite) ----

@pytest.fixture(scope="module")
def bfl_file(folder, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from comfyui_xdit.testmodels.chroma import single_file
    sd = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    path = tmp_path_factory.mktemp("chroma_file") / "chroma.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous()
               for k, v in single_file(sd).items()}, str(path))
    return path


def test_single_file_is_detected_with_the_folders_config(folder, bfl_file):
    import json

    from comfyui_xdit.bridge import worker_module
    sf = worker_module("models.detect").single_file_config(bfl_file)
    assert (sf["arch"], sf["naming"]) == ("chroma", "bfl")
    want = json.loads((folder / "transformer" / "config.json").read_text())
    want["out_channels"] = want["out_channels"] or want["in_channels"]  # None: in_channels
    for k, v in sf["config"].items():
        assert want[k] == (list(v) if isinstance(v, tuple) else v), k


# ---- the xDiT MODEL (stock KSampler) -----------------------------------------------------
def _comfy_call(tr, batch: int, h: int, w: int, tokens: int = 6, seed: int = 0) -> dict:
    """ComfyUI's Chroma call: model-space latents [N, 16, h, w], sigma as the timestep (its
    FLUX model type), T5 states without a pooled output, guidance 0 (ComfyUI's default);
    the unconditional then the conditional chunk of `batch` rows (calc_cond_batch)."""
    import uuid
    gen = torch.Generator().manual_seed(seed)
    n = 2 * batch
    ctx = torch.randn(2, tokens, tr.config.joint_attention_dim, generator=gen)
    return dict(x=torch.randn(n, 16, h, w, generator=gen),
                timestep=torch.tensor(0.6).expand(n),
                context=torch.cat([ctx[i:i + 1].expand(batch, -1, -1) for i in range(2)]),
                guidance=torch.zeros(n),
                transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()],
                                     "cond_or_uncond": [1, 0]})


@pytest.mark.parametrize("config,batch", [(ParallelConfig(cfg_parallel=True), 1),
                                          (ParallelConfig(ulysses=2), 3),
                                          (ParallelConfig(dp=2), 3)],
                         ids=["cfg2-b1", "ulysses2-b3", "dp2-b3"])
def test_model_calls_equal_the_transformer(chroma_pools, folder, config, batch):
    from diffusers import ChromaTransformer2DModel

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    tr = ChromaTransformer2DModel.from_pretrained(str(folder), subfolder="transformer").eval()
    call = _comfy_call(tr, batch, 10, 6)
    x = call["x"]
    n, _, h, w = x.shape
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    packed = torch.nn.functional.pixel_unshuffle(x, 2).flatten(2).transpose(1, 2)
    with torch.inference_mode():
        out = tr(hidden_states=packed, timestep=call["timestep"],
                 encoder_hidden_states=call["context"],
                 txt_ids=torch.zeros(call["context"].shape[1], 3), img_ids=ids.reshape(-1, 3),
                 return_dict=False)[0]
    want = torch.nn.functional.pixel_shuffle(out.transpose(1, 2).reshape(n, -1, h // 2, w // 2), 2)
    den = PoolDenoiser(chroma_pools(folder, config), config, "chroma")
    for _ in range(2):  # the second call reuses the pool's conditioning
        got = den(**call)
        d = float((got - want).abs().max())
        assert d <= TOL, f"MODEL {config.describe()}: {d}"


def test_comfy_unet_config_has_the_channels_comfyui_reads(folder):
    """The xDiT MODEL's ComfyUI config for Chroma is what ComfyUI 0.3.64's detection sets
    (image_model chroma, in / out channels 64, patch 2): stock KSampler reads
    unet_config["in_channels"] and ["out_channels"] (model_base.Flux.concat_cond, since the
    MODEL's diffusion model has no img_in), which failed with KeyError 'in_channels' when
    only image_model was given."""
    from comfyui_xdit.planning.model_info import comfy_unet_config

    unet = comfy_unet_config(folder)
    assert unet == {"image_model": "chroma", "in_channels": 64, "out_channels": 64,
                    "patch_size": 2}
    # Flux.concat_cond's rule: no concat latent when in_channels <= out_channels
    assert unet["in_channels"] <= unet["out_channels"]

