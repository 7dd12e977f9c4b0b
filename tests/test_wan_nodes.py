"""Sampler (xDiT) and Decode (xDiT) with Wan's video LATENT (comfyui_xdit/comfy_convert.py,
comfyui_xdit/nodes/operations.py), without ComfyUI or a pool: EmptyHunyuanLatentVideo's
[B, 16, T, H/8, W/8] becomes a request of (T - 1) x 4 + 1 frames with KSampler's noise
drawn in the LATENT's 5-D shape, Sampler options' cfg_2 reaches the request, and image
families still refuse video latents."""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit.comfy_convert import comfy_noise, latent_from_comfy
from comfyui_xdit.nodes.operations import SampleInputs, build_job
from comfyui_xdit.planning.config import ConfigError


def _cond(width=32, tokens=5):
    return [[torch.randn(1, tokens, width), {}]]


def test_video_latent_gives_frames_and_5d_noise():
    lat = latent_from_comfy({"samples": torch.zeros(2, 16, 3, 8, 6)}, "wan")
    assert (lat.batch, lat.frames, lat.height, lat.width, lat.empty) == (2, 9, 64, 48, True)
    inp = SampleInputs(latent={"samples": torch.zeros(1, 16, 5, 8, 6), "batch_index": [3]},
                       seed=11, steps=4, cfg=5.0, positive=_cond(), negative=_cond(),
                       cfg_2=3.0, shift=12.0)
    req, kw = build_job(inp, "wan", text_width=32)
    assert (req.frames, req.height, req.width, req.cfg, req.cfg_2, req.shift) == \
        (17, 64, 48, 5.0, 3.0, 12.0)
    # KSampler's prepare_noise on the LATENT's own 5-D shape, batch_index honoured
    assert torch.equal(kw["noise"], comfy_noise(11, (1, 16, 5, 8, 6), [3]))
    assert kw["init_latent"] is None
    req2, _ = build_job(SampleInputs(latent={"samples": torch.zeros(1, 16, 1, 8, 6)},
                                     positive=_cond()), "wan", text_width=32)
    # one latent frame: one video frame; Sampler options' 0s: the model's own values
    assert (req2.frames, req2.cfg_2, req2.shift) == (1, None, None)


def test_video_latent_checks():
    # a non-empty video latent is the img2img input with its frames
    x = torch.randn(1, 16, 2, 8, 6)
    req, kw = build_job(SampleInputs(latent={"samples": x}, positive=_cond(), denoise=0.5),
                        "wan", text_width=32)
    assert req.frames == 5 and torch.equal(kw["init_latent"], x) and kw["denoise"] == 0.5
    with pytest.raises(ConfigError, match="width 8, but this Wan transformer takes 32"):
        build_job(SampleInputs(latent={"samples": x}, positive=_cond(width=8)), "wan",
                  text_width=32)
    # image families: still no video
    with pytest.raises(ConfigError, match="image latents, not video"):
        latent_from_comfy({"samples": torch.zeros(1, 16, 3, 8, 6)}, "qwen_image")


def test_expert_count_reads_the_folders_transformer_2(tmp_path):
    import json

    from comfyui_xdit.nodes.settings import EXPERTS
    from comfyui_xdit.planning.model_info import expert_count as model_experts
    for name, index, want in (("a14b", {"transformer_2": ["diffusers", "WanTransformer3DModel"]}, 2),
                              ("t2v", {"transformer_2": [None, None]}, 1), ("flux", {}, 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(json.dumps(index))
        assert model_experts(tmp_path / name) == want, name
    assert model_experts(tmp_path / "x.safetensors") == 1  # a single file: one transformer
    assert EXPERTS == ("high_noise", "low_noise")


def test_wan_image_to_video_values_reach_the_request():
    """WanImageToVideo's CONDITIONING values (start latent, mask) -> the request's
    concat_latent / concat_mask, off the text conditionings; the negative must agree under
    CFG and is not read without it."""
    lat = torch.randn(1, 16, 3, 8, 6)
    mask = torch.ones(1, 1, 3, 8, 6)
    mask[:, :, :1] = 0
    vals = {"concat_latent_image": lat, "concat_mask": mask}

    def cond(**extra):
        return [[torch.randn(1, 5, 32), dict(extra)]]
    inp = SampleInputs(latent={"samples": torch.zeros(1, 16, 3, 8, 6)}, cfg=4.0,
                       positive=cond(**vals), negative=cond(**vals))
    req, _ = build_job(inp, "wan", text_width=32)
    assert torch.equal(req.concat_latent, lat) and torch.equal(req.concat_mask, mask)
    assert req.image_embeds is None and req.frames == 9
    for c in (req.positive, req.negative):  # text only: the start image is the request's
        assert c.concat_latent is None and c.concat_mask is None and c.image_embeds is None
    with pytest.raises(ConfigError, match="differ in concat_latent"):
        build_job(SampleInputs(latent=inp.latent, cfg=4.0, positive=cond(**vals),
                               negative=cond()), "wan", text_width=32)
    req1, _ = build_job(SampleInputs(latent=inp.latent, cfg=1.0, positive=cond(**vals),
                                     negative=cond()), "wan", text_width=32)
    assert torch.equal(req1.concat_latent, lat)
    with pytest.raises(ConfigError, match="do not take"):  # an image family
        build_job(SampleInputs(latent={"samples": torch.zeros(1, 16, 8, 6)},
                               positive=[[torch.randn(1, 5, 32), dict(vals, pooled_output=torch.randn(1, 8))]]),
                  "sd3")
