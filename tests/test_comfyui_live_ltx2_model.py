"""LTX-2's xDiT MODEL under stock KSampler in a real ComfyUI (skipped unless COMFYUI_PATH is
set; docs/testing.md "The live ComfyUI suites").

The tiny LTX-2 transformer (its builder's SINGLE_FILE_MODEL: the release's head widths) is
written as ComfyUI's single file (`tiny-model --comfy-file`: model.diffusion_model. keys in
the original names, with the "config" metadata ComfyUI's detection reads) into
models/diffusion_models/, with the text connectors ComfyUI 0.33.0's LTXAV holds. One graph,
two branches from the same seed, AV LATENT (the helper pack's XDiTTestEmptyAVLatent:
EmptyLTXVLatentVideo's and LTXVEmptyLatentAudio's latents nested) and random CONDITIONING
as the version's LTX-2 text encoder gives it (0.8.0: the video's and the sound's prompt
states side by side, after the connectors; 0.33.0: the states before them, flagged
unprocessed_ltxav_embeds, which both models run through the file's connectors) through
ComfyUI's LTXVConditioning (frame rate 24); the pool runs the version's block order
(0.33.0's video-to-audio attention reads the video after the audio-to-video update). Stock
KSampler (cfg 3, so every
call carries both rows) on "MODEL for KSampler (xDiT)" of the file on a 2-rank CPU fp32 pool
(Ulysses 2, then CFG parallel) and on ComfyUI's own LTXAV model loaded from the same file
(UNETLoader). The LATENT's video part and its audio part must each agree to rel L2 1e-3.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from live_comfy import COMFY, link_packs, run, running_comfyui, skip_without_comfyui, tensors, \
    twin_ksamplers, with_settings

pytestmark = skip_without_comfyui

FILE = "xdit-test-ltx2-comfy.safetensors"
TOL = 1e-3


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfyui_xdit.testmodels import ltx2
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model, write_comfy_file

    comfy = Path(COMFY)
    if not (comfy / "comfy" / "ldm" / "lightricks" / "av_model.py").exists():
        pytest.skip("this ComfyUI has no LTX-2 (LTXAV) model (0.8.0 and later have)")
    # 0.33.0's LTXAV runs the file's text connectors itself, on its text encoder's states
    connectors = "embeddings_connector" in (comfy / "comfy" / "ldm" / "lightricks" /
                                            "av_model.py").read_text()
    link_packs(comfy, "xdit-live-test-model-nodes")
    folder = ensure_tiny_model("ltx2", tmp_path_factory.mktemp("ltx2"), **ltx2.SINGLE_FILE_MODEL)
    write_comfy_file("ltx2", folder, comfy / "models" / "diffusion_models" / FILE)
    log = tmp_path_factory.mktemp("comfy-ltx2") / "comfyui.log"
    with running_comfyui(comfy, log) as server:
        yield dict(server, tmp=log.parent, connectors=connectors)


def _graph(comfy, layout: dict, tag: str, sampler="euler", scheduler="simple", cfg=3.0,
           steps=3, seed=7) -> tuple:
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    # the caption width is 32: 0.8.0's text encoder gives the video's and the sound's
    # prompt states side by side (its connectors' output), 0.33.0's the states before the
    # connectors, saying so (unprocessed_ltxav_embeds)
    width, flag = (32, "unprocessed_ltxav_embeds") if comfy["connectors"] else (2 * 32, "")
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{FILE}", "device": "cpu",
                         "dtype": "fp32", "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": FILE,
                                                      "weight_dtype": "default"}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": width, "pooled_dim": 0,
                         "guidance": -1.0, "flag": flag}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 8, "context_dim": width, "pooled_dim": 0,
                         "guidance": -1.0, "flag": flag}},
        "6": {"class_type": "XDiTTestEmptyAVLatent",
              "inputs": {"width": 96, "height": 64, "frames": 9, "frame_rate": 24}},
        "14": {"class_type": "LTXVConditioning",
               "inputs": {"positive": ["4", 0], "negative": ["5", 0], "frame_rate": 24.0}},
    }
    with_settings(wf, "1", **layout)
    twin_ksamplers(wf, out, ["14", 0], ["14", 1], seed=seed, steps=steps, cfg=cfg,
                   sampler=sampler, scheduler=scheduler)
    return wf, out


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg_parallel": True}],
                         ids=["ulysses2", "cfg_parallel"])
def test_ltx2_ksampler_on_the_pool_matches_comfyui_own_model(comfy, layout):
    tag = "ltx2-" + "-".join(map(str, layout))
    wf, out = _graph(comfy, layout, tag)
    _, msgs = run(comfy, wf, timeout=1500)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    x, n = tensors(Path(out["x"])), tensors(Path(out["n"]))
    fig = {}
    for i, part in enumerate(("video", "audio")):
        a, b = x[f"latent_{i}"], n[f"latent_{i}"]
        assert a.shape == b.shape, (part, a.shape, b.shape)
        fig[f"{part}_rel_l2"] = float((a - b).norm() / b.norm())
        fig[f"{part}_norm"] = float(b.norm())
    print(f"\n{tag}: {json.dumps(fig)}")
    for part in ("video", "audio"):
        assert fig[f"{part}_norm"] > 1e-2, fig  # a non-trivial latent: the check can fail
        assert fig[f"{part}_rel_l2"] <= TOL, fig
