"""Single-file FLUX / SD3 transformers (ComfyUI's models/diffusion_models and checkpoints):
detection and the folder's config read from a file, the converters against diffusers', bad
files, what a file pool refuses, SD3.5 and schnell layouts, PipeFusion from a file.

The tiny diffusers transformers are written out as BFL / ComfyUI single files by an
independent reverse mapping (the builders' `single_file`, through tests/single_file_util.py).
That a file's pool equals its folder's, for every family, is the conformance suite's
single-file theme (tests/conformance/test_single_file.py).
"""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.planning.model_info import (families, read_model_info, read_safetensors_header,
                                     single_file_config)
from single_file_util import PREFIX, write_single_file
from test_conditioning import encode

TOL = 1e-4
SD3_WIDE = dict(width=256, heads=4)  # SD3 stores no head dim without qk-norm: 64, as released


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    flux = model_dir("flux")
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    sd3 = ensure_tiny_model("sd3", d / "models", **SD3_WIDE)
    fake_vae = {"vae.decoder.conv_in.weight": torch.zeros(4, 16, 3, 3),
                "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight":
                    torch.zeros(4)}
    return {
        "flux_dir": flux, "sd3_dir": sd3,
        "flux": write_single_file(flux, "flux", d / "flux1-tiny.safetensors"),
        # a full checkpoint: the transformer under model.diffusion_model. plus other parts
        "flux_ckpt": write_single_file(flux, "flux", d / "flux1-tiny-ckpt.safetensors",
                                       prefix=True, extra=fake_vae),
        "flux_diffusers": write_single_file(flux, "flux", d / "flux-diffusers.safetensors",
                                            naming="diffusers"),
        "sd3": write_single_file(sd3, "sd3", d / "sd3-tiny.safetensors"),
        "sd3_ckpt": write_single_file(sd3, "sd3", d / "sd3-tiny-ckpt.safetensors", prefix=True,
                                      extra=fake_vae),
    }


# ---- host side: header, detection, config -------------------------------------------------
@pytest.mark.parametrize("name,arch", [("flux", "flux"), ("flux_ckpt", "flux"),
                                       ("flux_diffusers", "flux"), ("sd3", "sd3"),
                                       ("sd3_ckpt", "sd3")])
def test_detects_arch_and_derives_the_folders_config(files, name, arch):
    info = read_model_info(files[name])
    assert (info.arch, info.heads, info.kind) == (arch, 4, "file")
    assert not info.has_text_encoders and not info.has_vae
    cfg = single_file_config(files[name])["config"]
    folder = json.loads((files[f"{arch}_dir"] / "transformer" / "config.json").read_text())
    assert families.BY_CLASS[folder["_class_name"]].id == arch
    for k, v in cfg.items():
        if k == "sample_size":
            continue  # SD3's default grid, cropped per input (not stored in a file)
        want = folder.get(k)
        if k == "out_channels" and want is None:
            want = folder["in_channels"]
        assert (list(v) if isinstance(v, (list, tuple)) else v) == \
            (list(want) if isinstance(want, (list, tuple)) else want), k
    from workers.models import read_arch
    assert read_arch(str(files[name])) == arch == read_arch(str(files[f"{arch}_dir"]))


def test_bad_files_give_one_clear_error(tmp_path, files):
    unet = tmp_path / "sdxl_unet.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3),
               "model.diffusion_model.middle_block.0.in_layers.0.weight": torch.zeros(4)},
              str(unet))
    with pytest.raises(ConfigError, match=r"not a transformer of FLUX.1, FLUX.2, SD3/3.5.*: it "
                                          r"looks like an SD1.x/SDXL-style UNet.*Give one of those"):
        read_model_info(unet)
    raw = files["flux"].read_bytes()
    cut = tmp_path / "truncated.safetensors"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConfigError, match="truncated download.*re-download"):
        read_model_info(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(ConfigError, match="not a valid .safetensors file.*corrupt or truncated"):
        read_model_info(junk)
    bad_json = tmp_path / "badjson.safetensors"
    bad_json.write_bytes(struct.pack("<Q", 6) + b"{oops}" + b"\0" * 8)
    with pytest.raises(ConfigError, match="header unreadable"):
        read_safetensors_header(bad_json)
    with pytest.raises(ConfigError, match="does not exist"):
        read_model_info(tmp_path / "missing.safetensors")
    from safetensors.torch import load_file
    sd = load_file(str(files["flux"]))
    sd["double_blocks.0.img_attn.qkv.scale_weight"] = torch.ones(1)
    save_file(sd, str(tmp_path / "fp8_scaled.safetensors"))
    # scaled-fp8 files are supported now (workers/loading/weights.py): detected, not refused
    assert read_model_info(tmp_path / "fp8_scaled.safetensors").arch == "flux"


def test_flux_conversion_matches_diffusers_converter():
    """diffusers' own converter hard-codes FLUX.1's width (3072), so compare on tensors with
    FLUX.1's row counts and a thin second dimension: every key, split and swap must agree."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from workers.loading.single_file import convert_flux_bfl
    h, g = 3072, torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g)
    sd = {}
    for p, rows in (("img_in", h), ("txt_in", h), ("time_in.in_layer", h),
                    ("time_in.out_layer", h), ("vector_in.in_layer", h),
                    ("vector_in.out_layer", h), ("guidance_in.in_layer", h),
                    ("guidance_in.out_layer", h), ("final_layer.linear", 64),
                    ("final_layer.adaLN_modulation.1", 2 * h)):
        sd[f"{p}.weight"], sd[f"{p}.bias"] = t(rows, 2), t(rows)
    b = "double_blocks.0."
    for p, rows in (("img_mod.lin", 6 * h), ("txt_mod.lin", 6 * h), ("img_attn.qkv", 3 * h),
                    ("txt_attn.qkv", 3 * h), ("img_attn.proj", h), ("txt_attn.proj", h),
                    ("img_mlp.0", 4 * h), ("img_mlp.2", h), ("txt_mlp.0", 4 * h),
                    ("txt_mlp.2", h)):
        sd[f"{b}{p}.weight"], sd[f"{b}{p}.bias"] = t(rows, 2), t(rows)
    for p in ("img_attn", "txt_attn"):
        for n in ("query_norm", "key_norm"):
            sd[f"{b}{p}.norm.{n}.scale"] = t(128)
    s = "single_blocks.0."
    for p, rows in (("modulation.lin", 3 * h), ("linear1", 7 * h), ("linear2", h)):
        sd[f"{s}{p}.weight"], sd[f"{s}{p}.bias"] = t(rows, 2), t(rows)
    for n in ("query_norm", "key_norm"):
        sd[f"{s}norm.{n}.scale"] = t(128)
    ours = convert_flux_bfl(dict(sd), h)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(sd))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    with pytest.raises(ValueError, match="no FLUX rule"):
        convert_flux_bfl(dict(sd, **{"double_blocks.0.img_attn.qkv.scale_weight": t(1)}), h)


# ---- through pools: the same latent as the diffusers folder ----------------------------
COMMON = dict(seed=5, steps=2, height=64, width=96, max_sequence_length=12)


def _cond(arch, folder, text="a red cube on a table"):
    return encode(arch, str(folder), text, COMMON["max_sequence_length"])


def _sd3_reference(folder, pos, neg, cfg):
    """SD3 from the folder, single process: diffusers' pipeline fed the same conditioning and
    ComfyUI's noise (the pool reproduces this pipeline, docs/design.md#numerics-rule-4)."""
    import diffusers

    from comfyui_xdit.comfy_convert import comfy_noise as prepare_noise
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(str(folder))
    noise = prepare_noise(COMMON["seed"], (1, 16, COMMON["height"] // 8, COMMON["width"] // 8))
    out = pipe(prompt_embeds=pos["cond"], pooled_prompt_embeds=pos["pooled"],
               negative_prompt_embeds=neg["cond"], negative_pooled_prompt_embeds=neg["pooled"],
               guidance_scale=cfg, height=COMMON["height"], width=COMMON["width"],
               num_inference_steps=COMMON["steps"], latents=noise, output_type="latent")
    vae = pipe.vae.config
    return out.images.float() / vae.scaling_factor + vae.shift_factor


def _file_pool(path, world):
    return WorkerPool(path, ParallelConfig(ulysses=world), device="cpu", threads_per_rank=1)


def test_a_file_pool_refuses_what_needs_a_folder(files):
    """A file holds no text encoders or VAE: a prompt-text job and an image output are each
    refused in one line, and so is true CFG without a negative CONDITIONING; the pool stays
    usable. (That a file's pool equals its folder's is the conformance suite's single-file
    theme, for every family.)"""
    pos = _cond("flux", files["flux_dir"])
    req = GenerationRequest(prompt=[], positive=pos, guidance=4.0, **COMMON)
    with _file_pool(files["flux"], 1) as pool:
        got = pool.generate(req).samples
        pids = pool.worker_pids()
        with pytest.raises(ConfigError, match="single .safetensors file, which has no "
                                              "text encoders: connect positive"):
            pool.generate(GenerationRequest(prompt=["a cat"], **COMMON))
        with pytest.raises(ConfigError, match="no VAE for the pool"):
            pool.generate(GenerationRequest(prompt=[], positive=pos, output="image", **COMMON))
        assert torch.equal(pool.generate(req).samples, got)
        assert pool.worker_pids() == pids
    sd3_pos = _cond("sd3", files["sd3_dir"])
    with _file_pool(files["sd3"], 1) as pool:
        with pytest.raises(ConfigError, match="needs negative CONDITIONING too"):
            pool.generate(GenerationRequest(prompt=[], positive=sd3_pos, cfg=4.0, **COMMON))
    assert PREFIX == "model.diffusion_model."


# ---- in process: variants the tiny folders do not cover ------------------------------------
def _round_trip(arch, model, tmp_path, **kw):
    """diffusers model -> BFL file -> our loader: the same config, tensors and outputs."""
    from workers.models import get_adapter
    from workers.loading.single_file import load_single_file
    f = write_single_file(None, arch, tmp_path / f"{arch}.safetensors",
                          state=model.state_dict(), **kw)
    loaded = load_single_file(get_adapter(arch), str(f), torch.device("cpu"),
                              torch.float32).transformer
    a, b = model.state_dict(), loaded.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    for k, v in single_file_config(f)["config"].items():
        if k != "sample_size":
            want = model.config.get(k)
            want = model.config["in_channels"] if (k, want) == ("out_channels", None) else want
            assert (list(v) if isinstance(v, (list, tuple)) else v) == \
                (list(want) if isinstance(want, (list, tuple)) else want), k
    return f, loaded


def test_sd35_dual_attention_and_qk_norm_file(tmp_path):
    """SD3.5 layout: RMS qk-norm (its weights give the head dim) and dual-attention blocks."""
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, out_channels=16,
                                  num_layers=3, attention_head_dim=8, num_attention_heads=4,
                                  joint_attention_dim=24, caption_projection_dim=32,
                                  pooled_projection_dim=20, pos_embed_max_size=16,
                                  dual_attention_layers=(0, 1), qk_norm="rms_norm").eval()
    f, loaded = _round_trip("sd3", model, tmp_path, prefix=True)
    cfg = single_file_config(f)["config"]
    assert cfg["dual_attention_layers"] == [0, 1] and cfg["qk_norm"] == "rms_norm"
    assert cfg["attention_head_dim"] == 8  # from ln_q, not SD3's default 64
    x, ctx, pooled = torch.randn(1, 16, 8, 8), torch.randn(1, 5, 24), torch.randn(1, 20)
    with torch.no_grad():
        ref = model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled,
                    timestep=torch.tensor([500.0])).sample
        got = loaded(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled,
                     timestep=torch.tensor([500.0])).sample
    assert torch.equal(got, ref)


def test_flux_schnell_file_gets_schnell_defaults(tmp_path):
    """No guidance_in: FLUX schnell (scheduler shift 1, no dynamic shift); dev keeps its own."""
    from diffusers import FluxTransformer2DModel

    from workers.families import family
    from workers.families.flux import SCHEDULER_SCHNELL

    def defaults_for(arch, cfg):
        return family(arch).detection.released(cfg)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=64, num_layers=1, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=24, pooled_projection_dim=12,
                                   guidance_embeds=False, axes_dims_rope=(4, 6, 6)).eval()
    f, _ = _round_trip("flux", model, tmp_path)
    cfg = single_file_config(f)["config"]
    assert cfg["guidance_embeds"] is False
    sched, vae = defaults_for("flux", cfg)
    assert sched == SCHEDULER_SCHNELL and sched["shift"] == 1.0
    assert not sched["use_dynamic_shifting"]
    assert defaults_for("flux", dict(cfg, guidance_embeds=True))[0]["use_dynamic_shifting"]
    assert vae == {"scaling_factor": 0.3611, "shift_factor": 0.1159}
    assert defaults_for("sd3", {})[0] == {"num_train_timesteps": 1000, "shift": 3.0}


@pytest.mark.parametrize("name", ["flux_ckpt", "flux_diffusers", "sd3_ckpt"])
def test_pipefusion_from_a_single_file(files, pools, name):
    """Each rank builds only its stage from the file (FLUX / diffusers naming: other blocks
    are never read); with every step in warmup the result equals the folder's exact one."""
    arch = name.split("_")[0]
    folder = files[f"{arch}_dir"]
    pos = _cond(arch, folder)
    if arch == "flux":
        req = GenerationRequest(prompt=[], positive=pos, guidance=4.0, **COMMON)
        ref = pools("flux", 1).generate(req).samples
    else:
        neg = _cond(arch, folder, "blurry")
        req = GenerationRequest(prompt=[], positive=pos, negative=neg, cfg=4.0, **COMMON)
        ref = _sd3_reference(folder, pos, neg, 4.0)
    config = ParallelConfig(pipefusion=2, warmup_steps=COMMON["steps"])
    with WorkerPool(files[name], config, device="cpu", threads_per_rank=1) as pool:
        got = pool.generate(req).samples
        ranks = pool.status()["ranks"]
    assert (got - ref).abs().max().item() <= TOL
    assert [r["stage"]["index"] for r in ranks] == [0, 1]
    assert ranks[0]["stage"]["blocks"][1] == ranks[1]["stage"]["blocks"][0]
