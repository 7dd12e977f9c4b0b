"""MiniMax-H3 on stock KSampler in a real ComfyUI (skipped unless COMFYUI_PATH is set and
its ComfyUI has the MiniMaxH3 model, 0.33.0; COMFYUI_PYTHON: its venv's python).

The tiny MiniMax-H3's transformer is written as a ComfyUI single file (`tiny-model
--comfy-file`: comfy/ldm/minimax's names, under model.diffusion_model.) into
models/diffusion_models/. The same KSampler (cfg 2.5: a positive and a negative random
CONDITIONING of the tiny Qwen3-VL width and other lengths, so each step makes an uncond and
a cond call) runs on the xDiT MODEL (xDiT.LoadModel of the file + xDiT.ToModel, 2 CPU fp32
ranks) and on ComfyUI's own MiniMaxH3 (UNETLoader of the file), from ComfyUI's Empty MiniMax
H3 AV Latent: the nested LATENT's video and sound parts each agree (relative L2 <= 1e-3) at
Ulysses 2 and at CFG parallel, for euler/simple and dpmpp_2m/beta (which disagree with each
other: the agreement is not vacuous). The xDiT MODEL's calls are counted (each one pool
request): one a step, holding both the cond and the uncond row, so CFG parallel's two ranks
each get a row of every call.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from live_comfy import (COMFY, http, link_packs, run, running_comfyui, skip_without_comfyui,
                        tensors, twin_ksamplers, with_settings)

pytestmark = skip_without_comfyui

FILE = "xdit-tiny-minimax-h3.safetensors"
TOL = 1e-3  # relative L2, each part
SAMPLERS = [("euler", "simple"), ("dpmpp_2m", "beta")]
# 96 x 64 pixels, 22 frames (17 + 5): 7 latent frames of 6 x 4, 37 sound latents a channel
EMPTY = {"width": 96, "height": 64, "length": 22}
SHAPES = ((1, 24, 7, 4, 6), (1, 32, 2, 37))


def has_minimax(comfy: Path) -> bool:
    return "class MiniMaxH3(" in (comfy / "comfy" / "model_base.py").read_text()


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model, write_comfy_file

    comfy = Path(COMFY)
    if not has_minimax(comfy):
        pytest.skip("this ComfyUI has no MiniMaxH3 model (0.33.0 has it)")
    link_packs(comfy, "xdit-live-test-helpers", "xdit-live-test-model-nodes")
    folder = ensure_tiny_model("minimax_h3", tmp_path_factory.mktemp("minimax-models"))
    write_comfy_file("minimax_h3", folder, comfy / "models" / "diffusion_models" / FILE)
    text = json.loads((folder / "transformer" / "config.json").read_text())["text_dim"]
    log = tmp_path_factory.mktemp("comfy-minimax") / "comfyui.log"
    with running_comfyui(comfy, log) as server:
        yield dict(server, tmp=log.parent, text=text)


def _graph(comfy, layout: dict, sampler: str, scheduler: str, tag: str, cfg: float = 2.5,
           steps: int = 3, seed: int = 7):
    """The same KSampler on the xDiT MODEL ("x") and on ComfyUI's own model ("n")."""
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    out["calls"] = str(comfy["tmp"] / f"{tag}-calls.json")
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{FILE}", "device": "cpu",
                         "dtype": "fp32", "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": FILE,
                                                      "weight_dtype": "default"}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": comfy["text"],
                         "pooled_dim": 0, "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 6, "context_dim": comfy["text"],
                         "pooled_dim": 0, "guidance": -1.0}},
        "6": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": dict(EMPTY)},
    }
    with_settings(wf, "1", **layout)
    twin_ksamplers(wf, out, ["4", 0], ["5", 0], seed=seed, steps=steps, cfg=cfg,
                   sampler=sampler, scheduler=scheduler)
    # the xDiT MODEL's KSampler through a wrapper that records each model call
    wf["9"] = {"class_type": "XDiTTestCountCalls",
               "inputs": {"model": ["2", 0], "path": out["calls"]}}
    wf["7"]["inputs"]["model"] = ["9", 0]
    return wf, out


def _ok(msgs):
    last = msgs[-1]
    assert last["type"] == "execution_success", \
        (last["data"].get("node_type"), last["data"].get("exception_message"),
         "".join(last["data"].get("traceback") or [])[-3000:])


def calls_per_step(path: str) -> dict:
    """The recorded model calls: how many a step (a sigma) makes, and how many rows each."""
    calls = json.loads(Path(path).read_text())
    steps = len({c["sigma"][0] for c in calls})
    return {"calls": len(calls), "steps": steps, "calls_per_step": len(calls) / steps,
            "conds_per_call": sorted({len(c["cond_or_uncond"]) for c in calls})}


def rel_l2(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg_parallel": True}],
                         ids=["ulysses2", "cfg_parallel"])
def test_ksampler_on_the_pool_matches_comfyui_own_model(comfy, layout):
    got = {}
    for sampler, scheduler in SAMPLERS:
        tag = f"minimax_h3-{'-'.join(map(str, layout))}-{sampler}"
        wf, out = _graph(comfy, layout, sampler, scheduler, tag)
        _, msgs = run(comfy, wf, timeout=1500)
        _ok(msgs)
        x, n = tensors(Path(out["x"])), tensors(Path(out["n"]))
        fig = {}
        for part, key, shape in (("video", "latent_0", SHAPES[0]), ("audio", "latent_1",
                                                                   SHAPES[1])):
            assert tuple(x[key].shape) == tuple(n[key].shape) == shape, \
                (part, x[key].shape, n[key].shape)
            assert torch.isfinite(x[key]).all()
            fig[f"{part}_rel_l2"] = rel_l2(x[key], n[key])
            fig[f"{part}_max_abs"] = float((x[key] - n[key]).abs().max())
            fig[f"{part}_norm"] = float(n[key].norm())
        counted = calls_per_step(out["calls"])
        print(f"\n{tag}: {json.dumps(fig)} pool calls: {json.dumps(counted)}")
        assert fig["video_rel_l2"] <= TOL and fig["audio_rel_l2"] <= TOL, fig
        # cond and uncond (other text lengths) share each step's one call
        assert counted["calls_per_step"] == 1 and counted["conds_per_call"] == [2], counted
        got[sampler] = n
    a, b = (got[s] for s, _ in SAMPLERS)  # the agreement above is not vacuous
    for key in ("latent_0", "latent_1"):
        assert rel_l2(a[key], b[key]) > 1e-2, key
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})
