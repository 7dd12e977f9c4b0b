"""FLUX.2 [klein]-style tiny models: the builder writes a folder the
stock diffusers Flux2KleinPipeline loads and runs offline, with a head count Ulysses 2 and 4
divide."""

import json

import pytest
import torch

from comfyui_xdit.testmodels.tiny_model import build_tiny_model, ensure_tiny_model, resolve_config

from conftest import flux2_comfy_from_raw, flux2_noise


@pytest.fixture(scope="module")
def flux2_folder(tmp_path_factory):
    return build_tiny_model("flux2", tmp_path_factory.mktemp("tiny") / "flux2")


def _pipe(path):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux2_folder_loads_and_generates_a_latent(flux2_folder):
    index = json.loads((flux2_folder / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline"
    assert {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(index)
    pipe = _pipe(flux2_folder)
    tr = pipe.transformer.config
    assert tr.in_channels == 128 and tr.num_attention_heads == 4
    assert tr.num_attention_heads % 2 == 0 and tr.num_attention_heads % 4 == 0
    assert len(tr.axes_dims_rope) == 4 and sum(tr.axes_dims_rope) == tr.attention_head_dim
    assert tr.joint_attention_dim == 3 * pipe.text_encoder.config.hidden_size
    assert pipe.text_encoder.config.num_hidden_layers == 28
    assert pipe.vae.config.latent_channels == 32 and pipe.vae_scale_factor == 8

    seen = []

    def record(_pipe, _i, _t, tensors):
        seen.append(tensors["latents"].clone())
        return {}

    out = pipe(prompt="a photo of a red cat", height=128, width=96, num_inference_steps=2,
               output_type="latent", generator=torch.Generator().manual_seed(0),
               max_sequence_length=64, callback_on_step_end=record).images
    assert out.shape == (1, 32, 128 // 8, 96 // 8)
    assert torch.isfinite(out).all()
    assert len(seen) == 2 and (seen[0] - seen[1]).abs().max() > 1e-3
    # the prompt reaches the latent: another prompt, same noise, differs
    other = pipe(prompt="a blue dog", height=128, width=96, num_inference_steps=2,
                 output_type="latent", generator=torch.Generator().manual_seed(0),
                 max_sequence_length=64).images
    assert (other - out).abs().max() > 1e-4


def test_flux2_tokenizer_words_are_single_tokens(flux2_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(flux2_folder / "tokenizer")
    assert len(tok(" cat").input_ids) == 1
    assert tok.decode(tok("a photo of a red cat!").input_ids) == "a photo of a red cat!"
    text = tok.apply_chat_template([{"role": "user", "content": "cat"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\ncat<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_flux2_build_is_reproducible_and_cached(flux2_folder, tmp_path):
    again = ensure_tiny_model("flux2", tmp_path)
    assert ensure_tiny_model("flux2", tmp_path) == again
    for sub in ("transformer", "vae", "text_encoder"):
        for f in (flux2_folder / sub).glob("*.safetensors"):
            assert (again / sub / f.name).read_bytes() == f.read_bytes()


def test_flux2_knobs_validated():
    assert resolve_config("flux2")["heads"] == 4
    with pytest.raises(ValueError, match="flux2"):
        resolve_config("flux2", heads=4, width=4 * 12)  # head dim 12: not 4 RoPE axes of 8k
    with pytest.raises(ValueError, match="sd35"):
        resolve_config("flux2", sd35=True)


# ---- detection and the pool --------------------------------------------------------------

def test_flux2_folder_detected(flux2_folder):
    from comfyui_xdit.planning.model_info import read_model_info

    info = read_model_info(flux2_folder)
    assert (info.arch, info.heads, info.patch_size, info.blocks) == ("flux2", 4, 1, 4)


def test_flux2_latent_layout_round_trip():
    """ComfyUI's FLUX.2 LATENT [B,128,h,w] is model space: to tokens is diffusers' plain
    _pack_latents, no scaling; the raw VAE latent (decode path) is the BN-un-normalised,
    unpatchified one, and `pack` of a raw latent is diffusers' patchify + pack."""
    from diffusers import Flux2KleinPipeline

    from comfyui_xdit.bridge import worker_module

    ll = worker_module("models.latent_layout")
    raw = torch.randn(2, 32, 16, 12, generator=torch.manual_seed(1))
    want = Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(raw))
    assert torch.equal(ll.pack("flux2", raw), want)
    scale, shift = torch.rand(128) + 0.5, torch.randn(128)
    comfy = torch.randn(2, 128, 8, 6, generator=torch.manual_seed(2))
    tokens = ll.to_model("flux2", comfy, scale.tolist(), shift.tolist())
    assert torch.equal(tokens, Flux2KleinPipeline._pack_latents(comfy))  # no scaling
    assert torch.equal(ll.comfy_pack("flux2", comfy), tokens)
    assert torch.equal(ll.to_comfy("flux2", tokens, scale.tolist(), shift.tolist(), 128, 96),
                       comfy)
    # decode path: the pipeline's `latents * bn_std + bn_mean`, then its unpatchify
    decoded = Flux2KleinPipeline._unpatchify_latents(comfy / scale.view(1, -1, 1, 1)
                                                     + shift.view(1, -1, 1, 1))
    torch.testing.assert_close(ll.to_raw("flux2", tokens, scale.tolist(), shift.tolist(),
                                         128, 96), decoded, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ll.comfy_to_raw("flux2", comfy, scale.tolist(), shift.tolist()),
                               decoded, atol=1e-6, rtol=1e-6)


def _oracle(path, prompts, seed, steps, height, width, msl):
    """The single-process Flux2KleinPipeline from ComfyUI's noise on the FLUX.2 LATENT
    ([B,128,h/16,w/16], which the pipeline takes as is), its raw 32-channel result turned
    into ComfyUI's FLUX.2 LATENT (patchified, BN-normalised)."""
    noise = flux2_noise(seed, len(prompts), height, width)
    pipe = _pipe(path)
    out = pipe(prompt=list(prompts), height=height, width=width, num_inference_steps=steps,
               latents=noise, max_sequence_length=msl, output_type="latent").images
    return noise, flux2_comfy_from_raw(out, path)


@pytest.mark.parametrize("ulysses", [1, 2])
def test_flux2_pool_matches_pipeline(flux2_folder, ulysses):
    from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool

    req = GenerationRequest(prompt=["a photo of a red cat"], seed=3, steps=3, height=128,
                            width=96, max_sequence_length=32)
    noise, want = _oracle(flux2_folder, req.prompt, req.seed, req.steps, req.height, req.width,
                          req.max_sequence_length)
    pool = WorkerPool(str(flux2_folder), ParallelConfig(ulysses=ulysses), device="cpu",
                      threads_per_rank=1)
    try:
        got = pool.generate(req, noise=noise).samples
        drawn = pool.generate(req).samples  # the pool's own noise: ComfyUI's, 128 channels
    finally:
        pool.close()
    assert got.shape == want.shape == (1, 128, 8, 6)
    assert (want - noise).abs().max() > 1e-2  # the model moved the latent
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drawn, got, atol=1e-6, rtol=0)  # same seed -> same noise


def test_flux2_pool_noise_is_comfyuis_on_the_128_channel_latent(flux2_folder):
    """The pool's own FLUX.2 noise for a seed is torch.randn([B,128,H/16,W/16],
    manual_seed(seed)) (ComfyUI's prepare_noise on the LATENT, diffusers' draw shape): the
    run from that explicit noise gives the same LATENT bit for bit, and the run from the old
    32-channel draw (patchified) does not. A raw 32-channel noise is refused in one line."""
    from diffusers import Flux2KleinPipeline

    from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig, WorkerPool

    req = GenerationRequest(prompt=["a cat", "a dog"], seed=11, steps=1, height=64,
                            width=80, max_sequence_length=16)
    mine = torch.randn([2, 128, 4, 5], generator=torch.manual_seed(11))
    old = Flux2KleinPipeline._patchify_latents(
        torch.randn([2, 32, 8, 10], generator=torch.manual_seed(11)))
    with WorkerPool(str(flux2_folder), ParallelConfig(), device="cpu",
                    threads_per_rank=1) as pool:
        drawn = pool.generate(req).samples
        given = pool.generate(req, noise=mine).samples
        from_old = pool.generate(req, noise=old).samples
        with pytest.raises(ConfigError, match=r"raw 32-channel \[batch, 32, height/8"):
            pool.generate(req, noise=torch.randn(2, 32, 8, 10))
    assert drawn.shape == (2, 128, 4, 5)
    assert torch.equal(drawn, given)
    assert (drawn - from_old).abs().max() > 0.1


def test_flux2_pool_image_matches_pipeline(flux2_folder):
    """output="image": the pool decodes the raw 32-channel latent like the pipeline does."""
    from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool

    req = GenerationRequest(prompt=["a photo of a red cat"], seed=3, steps=2, height=128,
                            width=96, max_sequence_length=32, output="image")
    noise = flux2_noise(3, 1, 128, 96)
    want = _pipe(flux2_folder)(prompt=req.prompt, height=128, width=96, num_inference_steps=2,
                               latents=noise, max_sequence_length=32, output_type="pt").images
    pool = WorkerPool(str(flux2_folder), ParallelConfig(), device="cpu", threads_per_rank=1)
    try:
        got = pool.generate(req, noise=noise).images
    finally:
        pool.close()
    assert got.shape == (1, 128, 96, 3) and want.std() > 1e-2
    torch.testing.assert_close(got, want.permute(0, 2, 3, 1), atol=1e-4, rtol=1e-4)
