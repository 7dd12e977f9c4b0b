"""LTX-2 image-to-video in ComfyUI's own graph on the xDiT MODEL (skipped unless COMFYUI_PATH
is set; docs/testing.md "The live ComfyUI suites").

ComfyUI's own LTX-2 image-to-video nodes make the LATENT: EmptyLTXVLatentVideo, then
LTXVImgToVideoInplace (the start image encoded into the first latent frame, with a noise mask
there: 0 at strength 1, 0.4 at strength 0.6), LTXVEmptyLatentAudio and LTXVConcatAVLatent
(the AV LATENT with its nested noise mask). The VAEs those nodes read are the test pack's
stand-ins (XDiTTestLTXVStandInVAEs: no LTX-2 VAE loads tiny into ComfyUI). Stock KSampler
(cfg 3) samples it on "MODEL for KSampler (xDiT)" of the tiny LTX-2 single file (a 2-rank CPU
fp32 pool, Ulysses 2, then CFG parallel) and on ComfyUI's own LTXAV model of the same file
(UNETLoader), the conditioning through LTXVConditioning (frame rate 24) as in
tests/test_comfyui_live_ltx2_model.py, whose fixture places the file. ComfyUI then calls the
model with a timestep per token (its LTXAV model class's, from the mask), which the xDiT
MODEL carries to the pool. The LATENT's video part and its audio part must each agree to
rel L2 1e-3 (the later frames too); at strength 1 the video's first latent frame is the start
image's latent on both. On ComfyUI 0.33.0, whose LTXAV gates each stream's audio-video
attention by the other stream's largest timestep (0.8.0's by the stream's own tokens'), the
xDiT MODEL detects that when it is built and the pool runs it (workers/models/ltx2_cross_gates.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from live_comfy import run, skip_without_comfyui, tensors, twin_ksamplers, with_settings
from test_comfyui_live_ltx2_model import FILE, TOL, comfy  # noqa: F401  (the fixture)

pytestmark = skip_without_comfyui


SIZE = dict(width=96, height=64, length=9)  # 2 latent frames of 2 x 3 tokens, 10 sound


def _graph(comfy, layout: dict, tag: str, strength: float = 1.0, seed: int = 7) -> tuple:
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    width = 2 * 32  # the video's and the sound's prompt states (caption width 32 each)
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{FILE}", "device": "cpu",
                         "dtype": "fp32", "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": FILE,
                                                      "weight_dtype": "default"}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": width, "pooled_dim": 0,
                         "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 8, "context_dim": width, "pooled_dim": 0,
                         "guidance": -1.0}},
        "14": {"class_type": "LTXVConditioning",
               "inputs": {"positive": ["4", 0], "negative": ["5", 0], "frame_rate": 24.0}},
        "20": {"class_type": "XDiTTestLTXVStandInVAEs", "inputs": {"seed": 3}},
        "21": {"class_type": "EmptyImage",
               "inputs": {"width": SIZE["width"], "height": SIZE["height"], "batch_size": 1,
                          "color": 0x3366CC}},
        "22": {"class_type": "EmptyLTXVLatentVideo", "inputs": dict(SIZE, batch_size=1)},
        "23": {"class_type": "LTXVImgToVideoInplace",
               "inputs": {"vae": ["20", 0], "image": ["21", 0], "latent": ["22", 0],
                          "strength": strength, "bypass": False}},
        "24": {"class_type": "LTXVEmptyLatentAudio",
               "inputs": {"frames_number": SIZE["length"], "frame_rate": 24, "batch_size": 1,
                          "audio_vae": ["20", 1]}},
        "6": {"class_type": "LTXVConcatAVLatent",
              "inputs": {"video_latent": ["23", 0], "audio_latent": ["24", 0]}},
    }
    with_settings(wf, "1", **layout)
    twin_ksamplers(wf, out, ["14", 0], ["14", 1], seed=seed, steps=3, cfg=3.0,
                   sampler="euler", scheduler="simple")
    return wf, out


@pytest.mark.parametrize("layout,strength",
                         [({"ulysses": 2}, 1.0), ({"cfg_parallel": True}, 1.0),
                          ({"ulysses": 2}, 0.6)],
                         ids=["ulysses2", "cfg_parallel", "ulysses2-strength0.6"])
def test_ltx2_image_to_video_ksampler_on_the_pool_matches_comfyui_own_model(comfy, layout,
                                                                           strength):
    """Strength 1: the start frame's tokens at timestep 0; 0.6: at 0.4 x sigma (mask 0.4),
    a timestep per token that is neither 0 nor the row's."""
    tag = f"ltx2-i2v-{'-'.join(map(str, layout))}-{strength}"
    wf, out = _graph(comfy, layout, tag, strength)
    _, msgs = run(comfy, wf, timeout=1500)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    x, n = tensors(Path(out["x"])), tensors(Path(out["n"]))
    fig = {}
    for i, part in enumerate(("video", "audio")):
        a, b = x[f"latent_{i}"], n[f"latent_{i}"]
        assert a.shape == b.shape, (part, a.shape, b.shape)
        fig[f"{part}_rel_l2"] = float((a - b).norm() / b.norm())
        fig[f"{part}_norm"] = float(b.norm())
    video_x, video_n = x["latent_0"], n["latent_0"]
    # the start frame is kept (mask 0) and the later frames are denoised from it
    fig["start_frame_max_abs"] = float((video_x[:, :, :1] - video_n[:, :, :1]).abs().max())
    fig["later_frames_rel_l2"] = float((video_x[:, :, 1:] - video_n[:, :, 1:]).norm()
                                       / video_n[:, :, 1:].norm())
    print(f"\n{tag}: {json.dumps(fig)}")
    for part in ("video", "audio"):
        assert fig[f"{part}_norm"] > 1e-2, fig  # a non-trivial latent: the check can fail
        assert fig[f"{part}_rel_l2"] <= TOL, fig
    if strength == 1.0:  # kept as encoded (mask 0); else denoised from it, compared above
        assert fig["start_frame_max_abs"] == 0.0, fig
    assert fig["later_frames_rel_l2"] <= TOL, fig
