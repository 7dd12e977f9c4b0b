"""FLUX.2 through the nodes' logic, without ComfyUI: ComfyUI's FLUX.2 LATENTs
(latent_formats.Flux2: 2x2-patchified, batch-norm-normalised, [B,128,H/16,W/16]) in and out,
raw 32-channel ones refused in one line, CONDITIONING without a pooled output (FLUX.2's text encoder gives hidden states only),
the text width checked against the transformer, Decode on the pool with the folder's VAE,
FLUX.2 single files, and the xDiT MODEL's calls for a FLUX.2 caller."""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest
from comfyui_xdit.comfy_convert import (conditioning_to_request, latent_from_comfy,
                                        request_to_conditioning)
from comfyui_xdit.nodes.handles import ModelHandle
from comfyui_xdit.nodes.operations import SampleInputs, build_job, decode, model_text_width, sample
from comfyui_xdit.nodes.pool_registry import PoolRegistry


def encode_flux2(path, texts, msl):
    """The folder's own Qwen3 encoder, as diffusers' Flux2KleinPipeline encodes a prompt:
    the hidden states ComfyUI's FLUX.2 text encoder node would hand over (no pooled)."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(path, transformer=None, vae=None)
    pe, _ = pipe.encode_prompt(prompt=list(texts), max_sequence_length=msl)
    return pe.detach().float()


# ---- conversions (no pool) ---------------------------------------------------------------
def test_flux2_latents_are_comfyuis_128_channel_ones():
    x = torch.randn(2, 128, 4, 3)
    lat = latent_from_comfy({"samples": x}, "flux2")
    assert (lat.batch, lat.height, lat.width, lat.empty) == (2, 64, 48, False)
    assert torch.equal(lat.samples, x)  # model space already: no conversion
    # any empty latent gives the size: EmptySD3LatentImage (16 ch, 1/8), EmptyLatentImage
    # (4 ch) and EmptyFlux2LatentImage (128 ch, 1/16)
    for shape in ((1, 16, 8, 6), (1, 4, 8, 6), (1, 128, 4, 3)):
        e = latent_from_comfy({"samples": torch.zeros(shape)}, "flux2")
        assert e.empty and e.samples.shape == (1, 128, 4, 3) and (e.height, e.width) == (64, 48)
    # the raw VAE latent (this pack's FLUX.2 LATENT before) is refused, saying what to do
    with pytest.raises(ConfigError, match=r"32 channels; FLUX.2 LATENTs are ComfyUI's "
                                          r"128-channel \[batch, 128, height/16, width/16\].*"
                                          r"must be patchified and normalised first"):
        latent_from_comfy({"samples": torch.randn(1, 32, 8, 6)}, "flux2")
    with pytest.raises(ConfigError, match="16 channels; FLUX.2 LATENTs are ComfyUI's"):
        latent_from_comfy({"samples": torch.randn(1, 16, 8, 8)}, "flux2")
    with pytest.raises(ConfigError, match="128 channels; FLUX.1 uses 16"):
        latent_from_comfy({"samples": x}, "flux")  # FLUX.1 unchanged
    f1 = latent_from_comfy({"samples": torch.zeros(1, 16, 8, 6)}, "flux")
    assert f1.samples.shape == (1, 16, 8, 6) and (f1.height, f1.width) == (64, 48)


def test_flux2_conditioning_needs_no_pooled_output():
    cond = torch.randn(1, 7, 96)
    c, g = conditioning_to_request([[cond, {}]], "positive", "flux2")
    assert torch.equal(c.context, cond) and c.pooled is None and g is None
    # a pooled output some encoder adds is not used (FLUX.2 has no pooled projection)
    c, _ = conditioning_to_request([[cond, {"pooled_output": torch.randn(1, 8)}]], "p", "flux2")
    assert c.pooled is None
    assert request_to_conditioning(c) == [[c.context, {}]]
    with pytest.raises(ConfigError, match="no pooled_output"):  # FLUX.1 still needs one
        conditioning_to_request([[cond, {}]], "positive", "flux")
    req = GenerationRequest(prompt=[], positive={"cond": cond, "pooled": None}, height=64,
                            width=64)
    assert not req.problems()

    class Flux1:
        arch, has_text_encoders, has_vae = "flux", True, True
    assert any("no pooled output" in p for p in req.problems(Flux1()))


def test_flux2_build_job_noise_and_text_width():
    lat = {"samples": torch.zeros(2, 128, 4, 4), "batch_index": [4, 1]}
    cond = [[torch.randn(1, 5, 96), {}]]
    req, kw = build_job(SampleInputs(latent=lat, positive=cond, seed=9), "flux2", 96)
    assert req.positive.pooled is None and req.batch == 2
    assert (req.height, req.width) == (64, 64)
    gen = torch.manual_seed(9)  # ComfyUI's prepare_noise with batch_index, on the LATENT
    per = [torch.randn((1, 128, 4, 4), generator=gen) for _ in range(5)]
    assert torch.equal(kw["noise"], torch.cat([per[4], per[1]]))
    # FLUX.1's T5 states on a FLUX.2 transformer: one line naming both widths
    with pytest.raises(ConfigError, match=r"positive CONDITIONING has text states of width "
                                          r"4096, but this FLUX.2 transformer takes 96"):
        build_job(SampleInputs(latent=lat, positive=[[torch.randn(1, 5, 4096), {}]]),
                  "flux2", 96)
    with pytest.raises(ConfigError, match="negative CONDITIONING has text states of width 64"):
        build_job(SampleInputs(latent=lat, positive=cond, cfg=2.0,
                               negative=[[torch.randn(1, 5, 64), {}]]), "flux2", 96)


def test_flux2_negative_references_checked_at_the_resolved_cfg():
    """cfg 0 on the node is the model's default: CFG 4 on a FLUX.2 base [klein] model, so a
    negative with other references than the positive is refused there (the pool would give
    both branches the positive's); a distilled model (CFG off) takes it; without the model
    the check is made (it cannot tell)."""
    from types import SimpleNamespace

    lat = {"samples": torch.zeros(1, 128, 4, 3)}
    ref = torch.randn(1, 128, 2, 2)
    pos = [[torch.randn(1, 5, 96), {"reference_latents": [ref]}]]

    def neg():
        return [[torch.randn(1, 5, 96), {"reference_latents": [ref + 1]}]]
    base = SimpleNamespace(arch="flux2", distilled=False)
    distilled = SimpleNamespace(arch="flux2", distilled=True)
    for model in (base, None):
        with pytest.raises(ConfigError, match="negative CONDITIONING has other reference"):
            build_job(SampleInputs(latent=lat, positive=pos, negative=neg()), "flux2", 96,
                      model=model)
    req, _ = build_job(SampleInputs(latent=lat, positive=pos, negative=neg()), "flux2", 96,
                       model=distilled)
    assert torch.equal(req.reference_latents[0], ref)
    build_job(SampleInputs(latent=lat, positive=pos, negative=neg(), cfg=1.0), "flux2", 96,
              model=base)  # an explicit cfg 1: no CFG, no check


# ---- through a real pool -------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry():
    reg = PoolRegistry()
    yield reg
    reg.unload_all()


def _handle(path, **kw):
    return ModelHandle(path=str(path), device="cpu", dtype="fp32", threads_per_rank=1, **kw)


COMMON = dict(seed=5, steps=2, max_sequence_length=16)


def test_flux2_text_conditioning_latent_image_and_img2img(registry, model_dir):
    """prompt -> pool -> ComfyUI's 128-channel FLUX.2 LATENT; the same text as CONDITIONING
    (hidden states, no pooled) gives the same LATENT; Decode on the pool gives the IMAGE the
    folder's VAE decodes from it (un-normalised, unpatchified); a LATENT in with
    denoise < 1 is image-to-image; a wrong-width CONDITIONING is refused and the pool still
    works."""
    path = model_dir("flux2")
    assert model_text_width(str(path)) == 96
    h = _handle(path, world_size=2, ulysses=2)
    empty = {"samples": torch.zeros(1, 16, 8, 6)}  # EmptySD3LatentImage 48x64
    by_text = sample(h, SampleInputs(latent=empty, prompt="a red cat", **COMMON),
                     registry=registry)["samples"]
    assert by_text.shape == (1, 128, 4, 3) and torch.isfinite(by_text).all()
    pe = encode_flux2(str(path), ["a red cat"], 16)
    assert pe.shape[-1] == 96
    by_cond = sample(h, SampleInputs(latent=empty, positive=[[pe, {}]], **COMMON),
                     registry=registry)["samples"]
    assert (by_cond - by_text).abs().max().item() <= 1e-5
    other = sample(h, SampleInputs(latent=empty, positive=[[encode_flux2(str(path), ["a dog"],
                                                                         16), {}]], **COMMON),
                   registry=registry)["samples"]
    assert (other - by_text).abs().max().item() > 1e-4  # the comparison can fail
    pool = registry.pools()[0]
    pids = pool.worker_pids()

    image = decode(h, {"samples": by_text}, registry=registry)
    assert image.shape == (1, 64, 48, 3) and 0 <= image.min() and image.max() <= 1
    assert image.std() > 1e-3
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline
    vae = AutoencoderKLFlux2.from_pretrained(path, subfolder="vae").eval()
    mean, std = _bn(path)
    raw = Flux2KleinPipeline._unpatchify_latents(
        by_text * std.float().view(1, -1, 1, 1) + mean.float().view(1, -1, 1, 1))
    with torch.no_grad():
        want = (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
    assert (image - want).abs().max().item() <= 1e-4
    with pytest.raises(ConfigError, match=r"FLUX.2 model's Decode takes latents \[batch, 128, "
                                          r"height/16, width/16\]"):
        decode(h, {"samples": torch.randn(1, 16, 8, 6)}, registry=registry)
    with pytest.raises(ConfigError, match="raw 32-channel .* must be patchified and normalised"):
        decode(h, {"samples": torch.randn(1, 32, 8, 6)}, registry=registry)

    steps = dict(COMMON, steps=4)
    init = by_text
    i2i = sample(h, SampleInputs(latent={"samples": init}, prompt="a red cat", denoise=0.5,
                                 **steps), registry=registry)["samples"]
    ref = pool.generate(GenerationRequest(prompt=["a red cat"], batch_size=1, height=64,
                                          width=48, **steps), init_latent=init,
                        denoise=0.5).samples
    assert torch.equal(i2i, ref)
    t2i = sample(h, SampleInputs(latent=empty, prompt="a red cat", **steps),
                 registry=registry)["samples"]
    assert (i2i - t2i).abs().max().item() > 1e-3

    with pytest.raises(ConfigError, match="width 4096, but this FLUX.2 transformer takes 96"):
        sample(h, SampleInputs(latent=empty, positive=[[torch.randn(1, 4, 4096), {}]],
                               **COMMON), registry=registry)
    again = sample(h, SampleInputs(latent=empty, prompt="a red cat", **COMMON),
                   registry=registry)["samples"]
    assert torch.equal(again, by_text) and pool.worker_pids() == pids


# ---- FLUX.2 single files -------------------------------------------------------------------
def _bn(path):
    """The folder VAE's per-packed-channel statistics (mean, std), read here directly."""
    import json

    from safetensors.torch import load_file
    vae = load_file(str(path / "vae" / "diffusion_pytorch_model.safetensors"))
    eps = json.loads((path / "vae" / "config.json").read_text())["batch_norm_eps"]
    return vae["bn.running_mean"].double(), torch.sqrt(vae["bn.running_var"].double() + eps)


@pytest.mark.parametrize("prefix,naming", [(True, "bfl"), (False, "bfl"),
                                           (False, "diffusers")])
def test_flux2_single_file_detected_with_the_folders_config(model_dir, tmp_path, prefix,
                                                             naming):
    import json

    from comfyui_xdit.planning.model_info import read_model_info, single_file_config
    from single_file_util import write_single_file

    path = model_dir("flux2")
    f = write_single_file(path, "flux2", tmp_path / "f2.safetensors", prefix=prefix,
                          naming=naming)
    sf = single_file_config(f)
    assert (sf["arch"], sf["naming"]) == ("flux2", naming)
    folder = json.loads((path / "transformer" / "config.json").read_text())
    for k in ("in_channels", "num_layers", "num_single_layers", "attention_head_dim",
              "num_attention_heads", "joint_attention_dim", "mlp_ratio", "guidance_embeds",
              "axes_dims_rope", "rope_theta", "timestep_guidance_channels", "patch_size"):
        assert sf["config"][k] == folder[k], k
    info = read_model_info(f)
    assert (info.arch, info.kind, info.heads, info.blocks) == ("flux2", "file", 4, 4)
    assert model_text_width(str(f)) == 96


def test_flux2_single_file_equals_the_folder(registry, model_dir, tmp_path):
    """The tiny folder's transformer written as a BFL FLUX.2 file (under the checkpoint
    prefix): with the same CONDITIONING and seed the 2-rank pool's LATENT is the folder's
    (<= 1e-4): ComfyUI's FLUX.2 LATENT is the normalised latent for both (the file, with no
    VAE statistics, needs none); a file with one block perturbed is not."""
    from single_file_util import write_single_file

    path = model_dir("flux2")
    f = write_single_file(path, "flux2", tmp_path / "models" / "flux2-tiny.safetensors",
                          prefix=True)
    bad = write_single_file(path, "flux2", tmp_path / "models" / "flux2-bad.safetensors",
                            prefix=True, perturb_block=1)
    cond = [[encode_flux2(str(path), ["a red cat"], 16), {}]]
    empty = {"samples": torch.zeros(1, 16, 8, 6)}
    folder = sample(_handle(path, world_size=2, ulysses=2),
                    SampleInputs(latent=empty, positive=cond, **COMMON),
                    registry=registry)["samples"]
    got = sample(_handle(f, world_size=2, ulysses=2),
                 SampleInputs(latent=empty, positive=cond, **COMMON),
                 registry=registry)["samples"]
    assert got.shape == folder.shape == (1, 128, 4, 3)
    assert (got - folder).abs().max().item() <= 1e-4
    assert folder.abs().max() > 0.1
    other = sample(_handle(bad, world_size=2, ulysses=2),
                   SampleInputs(latent=empty, positive=cond, **COMMON),
                   registry=registry)["samples"]
    assert (other - got).abs().max().item() > 1e-3
    # a file has no text encoders: prompt text is refused in one line, the pool stays
    with pytest.raises(ConfigError, match="no text encoders"):
        sample(_handle(f, world_size=2, ulysses=2),
               SampleInputs(latent=empty, prompt="a cat", **COMMON), registry=registry)


# ---- the xDiT MODEL's calls for a FLUX.2 caller (model_calls.PoolDenoiser) ----------------
def _transformer_oracle(path, x128, sigma, pe, refs=()):
    """diffusers' Flux2Transformer2DModel on ComfyUI's patchified FLUX.2 latent [N,128,h,w]
    (tokens row-major), with the Flux2 pipelines' ids; references (same layout) join the
    image stream after the latent with time coordinates 10, 20, ... as Flux2KleinPipeline
    places them, and only the latent's tokens are returned."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    tr = Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer").eval()
    P = Flux2KleinPipeline
    tokens, ids = P._pack_latents(x128), P._prepare_latent_ids(x128)
    n = tokens.shape[1]
    if refs:
        ref_ids = P._prepare_image_ids([r[:1] for r in refs]).expand(x128.shape[0], -1, -1)
        tokens = torch.cat([tokens] + [P._pack_latents(r) for r in refs], dim=1)
        ids = torch.cat([ids, ref_ids.to(ids.dtype)], dim=1)
    with torch.no_grad():
        out = tr(hidden_states=tokens, timestep=sigma.expand(x128.shape[0]), guidance=None,
                 encoder_hidden_states=pe, txt_ids=P._prepare_text_ids(pe), img_ids=ids,
                 return_dict=False)[0]
    b, c, h, w = x128.shape
    return out[:, :n].transpose(1, 2).reshape(b, c, h, w)


def test_pool_denoiser_flux2_layout_timestep_and_references(pools, model_dir):
    """ComfyUI's FLUX.2 model calls its diffusion model with the patchified latent [N,128,
    h,w], sigma and the text states (no pooled y); PoolDenoiser returns the velocity in that
    layout, equal to the diffusers transformer (<= 1e-4) on 2 Ulysses ranks, with and without
    a reference latent (ReferenceLatent's `ref_latents`)."""
    from comfyui_xdit import ParallelConfig
    from comfyui_xdit.nodes.model_calls import PoolDenoiser

    path = model_dir("flux2")
    pool = pools("flux2", 2)
    config = ParallelConfig(ulysses=2)
    pool.reconfigure(config)
    den = PoolDenoiser(pool, config, "flux2")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, 4, 3, generator=g)
    pe = encode_flux2(str(path), ["a red cat", "a blue dog"], 12)
    sigma = torch.tensor([0.7])
    got = den(x, sigma, context=pe, y=None, transformer_options={"uuids": ["u1"]})
    want = _transformer_oracle(path, x, sigma, pe)
    assert got.shape == x.shape
    assert (got - want).abs().max().item() <= 1e-4 and want.abs().max() > 1e-2
    # the 32-channel unpatchified layout is the same call
    same = den(torch.nn.functional.pixel_shuffle(x, 2), sigma, context=pe, y=None,
               transformer_options={"uuids": ["u1"]})
    assert torch.allclose(torch.nn.functional.pixel_unshuffle(same, 2), got, atol=1e-6)
    # the timestep is sigma (x1000 on the pool): another sigma gives another velocity
    other = den(x, torch.tensor([0.2]), context=pe, y=None, transformer_options={"uuids": ["u1"]})
    assert (other - got).abs().max().item() > 1e-3
    with pytest.raises(ConfigError, match=r"FLUX.2 xDiT MODEL takes latents \[N, 128"):
        den(torch.randn(2, 16, 8, 6), sigma, context=pe, y=None)

    ref = torch.randn(1, 128, 2, 3, generator=g)
    with_ref = den(x, sigma, context=pe, y=None, ref_latents=[ref],
                   transformer_options={"uuids": ["u2"]})
    want_ref = _transformer_oracle(path, x, sigma, pe, refs=[ref.expand(2, -1, -1, -1)])
    assert (with_ref - want_ref).abs().max().item() <= 1e-4
    assert (with_ref - got).abs().max().item() > 1e-3  # the reference changed the result


def test_pool_denoiser_refuses_references_for_sd3():
    """Before any pool is asked: a ReferenceLatent on an SD3 MODEL is one clear error."""
    from comfyui_xdit import ParallelConfig
    from comfyui_xdit.nodes.model_calls import PoolDenoiser

    def no_pool():
        raise AssertionError("the pool must not be reached")
    den = PoolDenoiser(no_pool, ParallelConfig(), "sd3")
    with pytest.raises(ConfigError, match="reference latents .* not supported by SD3"):
        den(torch.randn(1, 16, 8, 8), torch.tensor([500.0]), context=torch.randn(1, 4, 32),
            y=torch.randn(1, 16), ref_latents=[torch.randn(1, 16, 8, 8)])


# ---- reference images from CONDITIONING (ComfyUI's ReferenceLatent) -------------------------
def test_reference_latents_move_from_conditioning_to_the_request():
    ref = torch.randn(1, 16, 4, 4)
    cond = [[torch.randn(1, 5, 32), {"pooled_output": torch.randn(1, 8),
                                     "reference_latents": [ref],
                                     "reference_latents_method": "index"}]]
    lat = {"samples": torch.zeros(1, 16, 8, 8)}
    req, _ = build_job(SampleInputs(latent=lat, positive=cond), "flux")
    assert len(req.reference_latents) == 1 and torch.equal(req.reference_latents[0], ref)
    assert req.reference_method == "index"
    assert req.positive.ref_latents is None  # carried once, by the request
    # the negative: the same references (or none) with CFG; other ones are refused
    same = [[torch.randn(1, 5, 32), {"pooled_output": torch.randn(1, 8),
                                     "reference_latents": [ref.clone()],
                                     "reference_latents_method": "index"}]]
    build_job(SampleInputs(latent=lat, positive=cond, negative=same, cfg=2.0), "flux")
    build_job(SampleInputs(latent=lat, positive=cond, negative=[[torch.randn(1, 5, 32),
              {"pooled_output": torch.randn(1, 8)}]], cfg=2.0), "flux")
    other = [[torch.randn(1, 5, 32), {"pooled_output": torch.randn(1, 8),
                                      "reference_latents": [ref + 1]}]]
    with pytest.raises(ConfigError, match="negative CONDITIONING has other reference latents"):
        build_job(SampleInputs(latent=lat, positive=cond, negative=other, cfg=2.0), "flux")
    build_job(SampleInputs(latent=lat, positive=cond, negative=other, cfg=1.0), "flux")


def test_flux2_sampler_with_a_reference_latent(registry, model_dir):
    """positive CONDITIONING + ReferenceLatent -> the pool's reference path: the same result
    as the request API with that reference, and not the result without it."""
    path = model_dir("flux2")
    h = _handle(path, world_size=2, ulysses=2)
    pe = encode_flux2(str(path), ["a red cat"], 16)
    ref = torch.randn(1, 128, 2, 3, generator=torch.Generator().manual_seed(2))
    empty = {"samples": torch.zeros(1, 16, 8, 6)}
    got = sample(h, SampleInputs(latent=empty, positive=[[pe, {"reference_latents": [ref]}]],
                                 **COMMON), registry=registry)["samples"]
    pool = registry.pools()[0]
    want = pool.generate(GenerationRequest(prompt=[], positive={"cond": pe, "pooled": None},
                                           batch_size=1, height=64, width=48,
                                           reference_latents=[ref], seed=COMMON["seed"],
                                           steps=COMMON["steps"])).samples
    assert torch.equal(got, want)
    plain = sample(h, SampleInputs(latent=empty, positive=[[pe, {}]], **COMMON),
                   registry=registry)["samples"]
    assert (plain - got).abs().max().item() > 1e-3
    with pytest.raises(ConfigError, match="reference latent #1 has 16 channels"):
        sample(h, SampleInputs(latent=empty, positive=[[pe, {"reference_latents": [
            torch.randn(1, 16, 4, 6)]}]], **COMMON), registry=registry)
    with pytest.raises(ConfigError, match="reference latent #1 has 32 channels; FLUX.2 "
                                          "LATENTs are ComfyUI's 128-channel"):
        sample(h, SampleInputs(latent=empty, positive=[[pe, {"reference_latents": [
            torch.randn(1, 32, 4, 6)]}]], **COMMON), registry=registry)


def test_flux2_single_file_sharded_and_pipefusion_equal_the_whole_load(registry, model_dir,
                                                                      tmp_path):
    """The FLUX.2 file's other loaders: FSDP2 weight sharding (each rank reads its rows of
    the BFL tensors) and PipeFusion 2 (each stage reads its blocks), with warmup covering
    every step, give the whole load's latent."""
    from single_file_util import write_single_file

    path = model_dir("flux2")
    f = write_single_file(path, "flux2", tmp_path / "flux2.safetensors")
    cond = [[encode_flux2(str(path), ["a red cat"], 16), {}]]
    empty = {"samples": torch.zeros(1, 16, 8, 6)}
    whole = sample(_handle(f, world_size=2, ulysses=2),
                   SampleInputs(latent=empty, positive=cond, **COMMON),
                   registry=registry)["samples"]
    for kw in ({"world_size": 2, "ulysses": 2, "shard_weights": True},
               {"world_size": 2, "pipefusion": 2, "warmup_steps": COMMON["steps"]}):
        got = sample(_handle(f, **kw), SampleInputs(latent=empty, positive=cond, **COMMON),
                     registry=registry)["samples"]
        assert (got - whole).abs().max().item() <= 1e-4, kw
    assert whole.abs().max() > 0.1


def test_flux2_single_file_decodes_with_a_flux2_comfyui_vae_only(tmp_path, model_dir):
    """A FLUX.2 file has no VAE: Decode hands its LATENT (ComfyUI's FLUX.2 one, 128
    channels) to the connected ComfyUI VAE as it is (ComfyUI's FLUX.2 VAE applies the
    statistics), and refuses a VAE of another width in one line before decoding anything."""
    from single_file_util import write_single_file

    f = write_single_file(model_dir("flux2"), "flux2", tmp_path / "f2.safetensors")
    h = _handle(f, world_size=1)
    lat = torch.randn(1, 128, 4, 3)

    class VAE:
        def __init__(self, channels):
            self.latent_channels, self.got = channels, None

        def decode(self, x):
            self.got = x
            return torch.zeros(x.shape[0], x.shape[2] * 16, x.shape[3] * 16, 3)

    vae = VAE(128)
    img = decode(h, {"samples": lat}, vae=vae, registry=PoolRegistry())
    assert torch.equal(vae.got, lat) and img.shape == (1, 64, 48, 3)
    flux1 = VAE(16)
    with pytest.raises(ConfigError, match="128-channel latents .* the connected VAE has 16 latent"):
        decode(h, {"samples": lat}, vae=flux1, registry=PoolRegistry())
    assert flux1.got is None


def test_flux2_img2img_and_reference_latents_go_in_unchanged():
    """ComfyUI's FLUX.2 LATENT, as img2img input and as a ReferenceLatent, reaches the
    request as it is (model space: no statistics needed, folders and files alike); raw
    32-channel ones and other widths are refused in one line."""
    comfy128 = torch.randn(1, 128, 4, 3, generator=torch.Generator().manual_seed(4))
    ref128 = comfy128.flip(-1).contiguous()
    cond = [[torch.randn(1, 5, 96), {"reference_latents": [ref128]}]]
    req, kw = build_job(SampleInputs(latent={"samples": comfy128}, positive=cond,
                                     denoise=0.5), "flux2", 96)
    assert torch.equal(kw["init_latent"], comfy128) and (req.height, req.width) == (64, 48)
    assert kw["denoise"] == 0.5 and torch.equal(req.reference_latents[0], ref128)
    assert not req.problems(type("M", (), {"arch": "flux2"})())
    raw_ref = [[torch.randn(1, 5, 96), {"reference_latents": [torch.randn(1, 32, 8, 6)]}]]
    req, _ = build_job(SampleInputs(latent={"samples": comfy128}, positive=raw_ref), "flux2", 96)
    assert any("has 32 channels; FLUX.2 LATENTs are ComfyUI's 128-channel" in p
               for p in req.problems(type("M", (), {"arch": "flux2"})()))
    with pytest.raises(ConfigError, match="64 channels; FLUX.2 LATENTs are ComfyUI's"):
        latent_from_comfy({"samples": torch.randn(1, 64, 4, 4)}, "flux2")


def test_comfy_unet_config_for_the_xdit_model(model_dir, tmp_path):
    """What the xDiT MODEL tells ComfyUI's model config classes, from folders and single files
    alike: FLUX.1 dev vs schnell, FLUX.2's 128-channel patch-1 layout and hidden size (newer
    ComfyUI's FLUX.2 config reads `hidden_size`; its detection sets these keys from the
    weights). The defaults assumed for an omitted config key are diffusers' own."""
    import inspect
    import json

    import diffusers

    from comfyui_xdit.planning.model_info import comfy_unet_config, families
    from single_file_util import write_single_file

    for arch, cls in (("flux", diffusers.FluxTransformer2DModel),
                      ("flux2", diffusers.Flux2Transformer2DModel)):
        params = inspect.signature(cls.__init__).parameters
        defaults = families.family(arch).detection.config_defaults
        assert {k: params[k].default for k in defaults} == defaults
    flux2 = model_dir("flux2")
    want = {"image_model": "flux2", "guidance_embed": False, "in_channels": 128,
            "out_channels": 128, "patch_size": 1, "hidden_size": 64, "context_in_dim": 96}
    assert comfy_unet_config(flux2) == want
    assert comfy_unet_config(write_single_file(flux2, "flux2", tmp_path / "f2.safetensors",
                                               prefix=True)) == want
    flux = model_dir("flux")
    assert comfy_unet_config(flux) == {"image_model": "flux", "guidance_embed": True,
                                       "in_channels": 16, "out_channels": 16, "patch_size": 2}
    # a folder whose config omits guidance_embeds: FLUX.1 schnell, FLUX.2 [dev] style
    for arch, path, default in (("flux", flux, False), ("flux2", flux2, True)):
        copy = tmp_path / f"{arch}-omitted"
        (copy / "transformer").mkdir(parents=True)
        cfg = json.loads((path / "transformer" / "config.json").read_text())
        cfg.pop("guidance_embeds", None)
        (copy / "transformer" / "config.json").write_text(json.dumps(cfg))
        assert comfy_unet_config(copy)["guidance_embed"] is default
    assert comfy_unet_config(model_dir("sd3")) == {"image_model": "sd3", "out_channels": 16}
