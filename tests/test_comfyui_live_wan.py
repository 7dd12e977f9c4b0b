"""Wan in a real ComfyUI (skipped unless COMFYUI_PATH is set; COMFYUI_PYTHON: its venv).

The fixture links this pack and the test-only helper packs into custom_nodes/, puts the tiny
Wan 2.1 T2V and Wan 2.2 A14B folders into models/diffusers/ under the example workflows'
names, a ComfyUI-loadable tiny A14B folder (tests/wan_comfy.py: heads of 128, text_dim 4096)
and its two transformers as ComfyUI-named single files (high and low noise) into
models/diffusion_models/, and starts `main.py --cpu --preview-method latent2rgb`. Then:

* xdit_wan_text_to_video (Sampler (xDiT) on EmptyHunyuanLatentVideo, Decode (xDiT),
  CreateVideo + SaveVideo) runs with its latent shrunk to 64x48 pixels, 9 frames, 3 steps:
  the sampler's LATENT is [1, 16, 3, 6, 8], progress reaches the steps and latent2rgb previews
  show, Decode gives 9 frames in order as an IMAGE batch and SaveVideo writes the video;
* xdit_wan_ksampler (two xDiT.ToModel, high_noise and low_noise, of one A14B loader; two
  KSamplerAdvanced split at a step; Decode (xDiT)) runs with CLIPLoader + CLIPTextEncode
  replaced by a random CONDITIONING of the tiny folder's text width, shrunk likewise, and
  one pool serves both experts;
* xdit_wan_image_to_video runs as shipped (VAELoader, LoadImage, WanImageToVideo: only the
  text encoder replaced and the sizes shrunk) on the tiny Wan 2.2 I2V A14B transformers with
  a VAE of the released Wan 2.1 structure (tests/wan_comfy_vae.py, the same weights in the
  folder and as a ComfyUI file); Decode (xDiT) equals ComfyUI's VAEDecode, and a mirrored
  start image changes the video;
* stock KSampler on the xDiT MODEL of the native folder equals KSampler on ComfyUI's own
  WAN21 model loaded from the converted file (UNETLoader), LATENT max abs difference
  <= 1e-3, at 1 rank, Ulysses 2 and CFG parallel, euler/simple and uni_pc/simple (cfg 3.5,
  both CFG rows in every call, 9 frames at 64x48);
* image-to-video on KSampler: WanImageToVideo's values (stood in for) on the xDiT MODEL of
  a 36-channel Wan 2.2 I2V expert (ComfyUI concatenates the start frame's channels to the
  latent) equal ComfyUI's own model from the converted file, CFG parallel;
* Wan 2.1 image-to-video on KSampler: the start frame and a CLIP vision output (stood in
  for) in the conditioning, as WanImageToVideo puts them; ComfyUI gives the vision states
  to the model as clip_fea, the xDiT MODEL of the Wan 2.1 I2V folder (image K/V) equals
  ComfyUI's own model from the converted file at Ulysses 2, and another image embedding
  moves the result (the image tokens reach the pool);
* ComfyUI's Wan 2.2 graph (two KSamplerAdvanced, the high-noise expert for the first steps,
  the low-noise one for the rest) on the two xDiT MODELs equals the same graph on ComfyUI's
  own two models from the two files, with the xDiT loader on the A14B folder and on the same
  two files (Low-noise expert (xDiT) giving the loader its low_noise_model).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from live_comfy import (COMFY, ROOT, history, http, link_packs, place, run, running_comfyui,
                        skip_without_comfyui, tensors, with_settings)

pytestmark = skip_without_comfyui

T2V_NAME, A14B_NAME = "Wan2.1-T2V-1.3B-Diffusers", "Wan2.2-T2V-A14B-Diffusers"
I2V_NAME = "Wan2.2-I2V-A14B-Diffusers"
I2V_NATIVE, I2V_FILE = "xdit-test-wan-i2v-native", "xdit-native-wan-i2v-high.safetensors"
I2V21_NATIVE, I2V21_FILE = "xdit-test-wan21-i2v-native", "xdit-native-wan21-i2v.safetensors"
NATIVE = "xdit-test-wan-native"
FILES = {"high_noise": "xdit-native-wan-high.safetensors",
         "low_noise": "xdit-native-wan-low.safetensors"}
TOL = 1e-3
SAMPLERS = [("euler", "simple"), ("uni_pc", "simple")]
SIZE = dict(width=64, height=48, length=9)  # latent [1, 16, 3, 6, 8]: 36 video tokens
LATENT = (1, 16, 3, 6, 8)


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    from wan_comfy import comfy_wan_file, native_wan_folder

    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-helpers", "xdit-live-test-model-nodes")
    cache = tmp_path_factory.mktemp("wan-models")
    t2v = ensure_tiny_model("wan", cache)
    a14b = ensure_tiny_model("wan", cache, variant="a14b")
    diffusers_dir = comfy / "models" / "diffusers"
    place(t2v, diffusers_dir / T2V_NAME)
    place(a14b, diffusers_dir / A14B_NAME)
    i2v = ensure_tiny_model("wan", cache, variant="i2v-a14b")
    place(i2v, diffusers_dir / I2V_NAME)
    i2v_native = native_wan_folder(i2v, cache / I2V_NATIVE)
    place(i2v_native, diffusers_dir / I2V_NATIVE)
    comfy_wan_file(i2v_native / "transformer", comfy / "models" / "diffusion_models" / I2V_FILE)
    i2v21 = native_wan_folder(ensure_tiny_model("wan", cache, variant="i2v"),
                              cache / I2V21_NATIVE)
    place(i2v21, diffusers_dir / I2V21_NATIVE)
    comfy_wan_file(i2v21 / "transformer", comfy / "models" / "diffusion_models" / I2V21_FILE)
    native = native_wan_folder(a14b, cache / NATIVE)
    place(native, diffusers_dir / NATIVE)
    files = comfy / "models" / "diffusion_models"
    for sub, expert in (("transformer", "high_noise"), ("transformer_2", "low_noise")):
        comfy_wan_file(native / sub, files / FILES[expert])
    log = tmp_path_factory.mktemp("comfy-wan") / "comfyui.log"
    with running_comfyui(comfy, log, "--preview-method", "latent2rgb") as server:
        yield dict(server, tmp=log.parent, t2v=diffusers_dir / T2V_NAME,
                   a14b=diffusers_dir / A14B_NAME, i2v=diffusers_dir / I2V_NAME)


def _ok(msgs):
    last = msgs[-1]
    assert last["type"] == "execution_success", \
        (last["data"].get("node_type"), last["data"].get("exception_message"),
         "".join(last["data"].get("traceback") or [])[-3000:])


def _by_type(wf: dict) -> dict:
    out = {}
    for nid, node in wf.items():
        out.setdefault(node["class_type"], []).append(nid)
    return out


def _random_text(wf: dict, by_type: dict, width: int) -> None:
    """The example's CLIPLoader + CLIPTextEncode replaced by random CONDITIONING of 6 tokens
    at `width` (the ids kept, so the samplers' links stay)."""
    for nid in by_type["CLIPTextEncode"]:
        wf[nid] = {"class_type": "XDiTTestRandomConditioning",
                   "inputs": {"seed": int(nid), "tokens": 6, "context_dim": width,
                              "pooled_dim": 1, "guidance": -1.0}}
    for nid in by_type["CLIPLoader"]:
        del wf[nid]


def _shrink(wf: dict, by_type: dict, steps: int) -> None:
    for nid in by_type["EmptyHunyuanLatentVideo"]:
        wf[nid]["inputs"].update(SIZE)
    for nid in by_type.get("xDiT.Sampler", []):
        wf[nid]["inputs"]["steps"] = steps
    for nid in by_type.get("KSamplerAdvanced", []):
        i = wf[nid]["inputs"]
        i["steps"] = steps
        if i["start_at_step"] > 0:
            i["start_at_step"] = steps // 2
        else:
            i["end_at_step"] = steps // 2


def _saved_video(comfy, pid, wf, by_type):
    outs = history(comfy, pid)["outputs"]
    saver = by_type["SaveVideo"][0]
    files = outs[saver].get("images") or []
    assert files, outs[saver]
    prefix = wf[saver]["inputs"]["filename_prefix"].split("/")[-1]
    assert files[0]["filename"].startswith(prefix), files
    data = http(comfy["base"], "/view?filename={filename}&subfolder={subfolder}&type={type}"
                .format(**files[0]))
    assert len(data) > 1000
    return files[0]


def test_text_to_video_example_runs(comfy):
    name = "xdit_wan_text_to_video_api.json"
    wf = json.loads((ROOT / "example_workflows" / name).read_text())
    by_type = _by_type(wf)
    loader = wf[by_type["xDiT.LoadModel"][0]]["inputs"]
    assert (loader["model"], loader["device"], loader["world_size"]) == (T2V_NAME, "auto", "auto")
    steps = 3
    _shrink(wf, by_type, steps)
    sampler, decode = by_type["xDiT.Sampler"][0], by_type["xDiT.Decode"][0]
    out = comfy["tmp"] / "t2v.safetensors"
    wf["99"] = {"class_type": "XDiTTestSaveTensors",
                "inputs": {"latent": [sampler, 0], "images": [decode, 0], "path": str(out)}}
    pid, msgs = run(comfy, wf, timeout=1500)
    _ok(msgs)
    saved = tensors(out)
    latent, images = saved["latent"], saved["image"]
    assert latent.shape == LATENT and torch.isfinite(latent).all(), latent.shape
    assert images.shape == (9, 48, 64, 3) and images.min() >= 0 and images.max() <= 1
    assert float(images.std()) > 1e-3
    progress = [m["data"] for m in msgs if m.get("type") == "progress"
                and m["data"].get("node") == sampler]
    assert progress and progress[-1]["value"] == steps, progress[-3:]
    assert any(m.get("type") == "binary_preview" for m in msgs)  # the first frame's
    video = _saved_video(comfy, pid, wf, by_type)
    print(f"\n{name}: LATENT {tuple(latent.shape)}, IMAGE {tuple(images.shape)}, "
          f"video {video['filename']}")


def test_ksampler_example_runs_with_both_experts_on_one_pool(comfy):
    name = "xdit_wan_ksampler_api.json"
    wf = json.loads((ROOT / "example_workflows" / name).read_text())
    by_type = _by_type(wf)
    loader = wf[by_type["xDiT.LoadModel"][0]]["inputs"]
    assert loader["model"] == A14B_NAME
    assert sorted(wf[n]["inputs"]["expert"] for n in by_type["xDiT.ToModel"]) == \
        ["high_noise", "low_noise"]
    width = json.loads((comfy["a14b"] / "transformer" / "config.json").read_text())["text_dim"]
    _random_text(wf, by_type, width)
    _shrink(wf, by_type, 4)
    low = next(n for n in by_type["KSamplerAdvanced"] if wf[n]["inputs"]["start_at_step"])
    out = comfy["tmp"] / "ksampler.safetensors"
    wf["99"] = {"class_type": "XDiTTestSaveTensors",
                "inputs": {"latent": [low, 0], "path": str(out)}}
    pid, msgs = run(comfy, wf, timeout=1500)
    _ok(msgs)
    latent = tensors(out)["latent"]
    assert latent.shape == LATENT and torch.isfinite(latent).all()
    _saved_video(comfy, pid, wf, by_type)
    pools = [p for p in http(comfy["base"], "/xdit/status")["pools"]
             if p["model"].endswith(A14B_NAME)]
    assert len(pools) == 1, pools  # both experts' MODELs call one pool


def test_sampler_options_cfg_2_reaches_the_low_noise_expert(comfy):
    """Sampler (xDiT) on the A14B folder: Sampler options (xDiT)'s cfg_2 changes the result
    (the low-noise expert's steps), a cfg_2 equal to cfg does not; its shift likewise (the
    folder's flow_shift is 3)."""
    out = {}
    for tag, options in (("none", None), ("same", {"cfg_2": 4.0}), ("other", {"cfg_2": 1.5}),
                         ("shift3", {"cfg_2": 0.0, "shift": 3.0}),
                         ("shift12", {"cfg_2": 0.0, "shift": 12.0})):
        path = comfy["tmp"] / f"cfg2-{tag}.safetensors"
        wf = {"1": {"class_type": "xDiT.LoadModel",
                    "inputs": {"model": A14B_NAME, "device": "cpu", "dtype": "fp32",
                               "world_size": "2"}},
              "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": dict(SIZE, batch_size=1)},
              "3": {"class_type": "xDiT.Sampler",
                    "inputs": {"model": ["1", 0], "latent": ["2", 0], "prompt": "a fox",
                               "negative_prompt": "blurry", "seed": 3, "steps": 3, "cfg": 4.0,
                               "guidance": 0.0, "denoise": 1.0, "max_sequence_length": 16}},
              "4": {"class_type": "XDiTTestSaveTensors",
                    "inputs": {"latent": ["3", 0], "path": str(path)}}}
        if options is not None:
            wf["5"] = {"class_type": "xDiT.SamplerOptions", "inputs": options}
            wf["3"]["inputs"]["options"] = ["5", 0]
        _, msgs = run(comfy, wf, timeout=1500)
        _ok(msgs)
        out[tag] = tensors(path)["latent"]
        assert out[tag].shape == LATENT and torch.isfinite(out[tag]).all()
    assert float((out["none"] - out["same"]).abs().max()) <= 1e-5
    assert float((out["none"] - out["other"]).abs().max()) > 1e-3
    assert float((out["none"] - out["shift3"]).abs().max()) <= 1e-5
    assert float((out["none"] - out["shift12"]).abs().max()) > 1e-3


def _random_conds() -> dict:
    """Nodes "4" (positive, 8 tokens) and "5" (negative, 6 tokens): random CONDITIONING at
    the ComfyUI-loadable Wan's text width."""
    return {k: {"class_type": "XDiTTestRandomConditioning",
                "inputs": {"seed": seed, "tokens": tokens, "context_dim": 4096,
                           "pooled_dim": 1, "guidance": -1.0}}
            for k, seed, tokens in (("4", 1, 8), ("5", 2, 6))}


def _compare_graph(comfy, layout: dict, world: str, tag: str, sampler="euler",
                   scheduler="simple", split=None, cfg=3.5, steps=3, seed=7, files=False):
    """KSampler on the xDiT MODEL ("x") and on ComfyUI's own WAN21 ("n"); with `split` the
    Wan 2.2 graph: KSamplerAdvanced on the high-noise expert for steps [0, split), then on
    the low-noise one to the end. `files`: the xDiT loader loads the two ComfyUI files
    (Low-noise expert (xDiT) giving the second) instead of the native folder."""
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{FILES['high_noise']}" if files
                         else NATIVE, "device": "cpu", "dtype": "fp32",
                         "world_size": world}},
        **_random_conds(),
        "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": dict(SIZE, batch_size=1)},
    }
    with_settings(wf, "1", **layout)
    if files:
        wf["10"] = {"class_type": "xDiT.LowNoiseExpert",
                    "inputs": {"low_noise_model": f"diffusion_models/{FILES['low_noise']}"}}
        wf["1"]["inputs"]["low_noise_model"] = ["10", 0]
    experts = ["high_noise"] + (["low_noise"] if split else [])
    for k, expert in enumerate(experts):
        wf[f"2{k}"] = {"class_type": "xDiT.ToModel",
                       "inputs": {"model": ["1", 0], "expert": expert}}
        wf[f"3{k}"] = {"class_type": "UNETLoader",
                       "inputs": {"unet_name": FILES[expert], "weight_dtype": "default"}}
    common = {"cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
              "positive": ["4", 0], "negative": ["5", 0]}
    for b, models in (("x", "2"), ("n", "3")):
        if split is None:
            wf[f"7{b}"] = {"class_type": "KSampler",
                           "inputs": dict(common, model=[f"{models}0", 0], seed=seed,
                                          steps=steps, latent_image=["6", 0], denoise=1.0)}
            last = f"7{b}"
        else:
            wf[f"7{b}"] = {"class_type": "KSamplerAdvanced",
                           "inputs": dict(common, model=[f"{models}0", 0], add_noise="enable",
                                          noise_seed=seed, steps=steps, start_at_step=0,
                                          end_at_step=split, latent_image=["6", 0],
                                          return_with_leftover_noise="enable")}
            wf[f"8{b}"] = {"class_type": "KSamplerAdvanced",
                           "inputs": dict(common, model=[f"{models}1", 0], add_noise="disable",
                                          noise_seed=0, steps=steps, start_at_step=split,
                                          end_at_step=10000, latent_image=[f"7{b}", 0],
                                          return_with_leftover_noise="disable")}
            last = f"8{b}"
        wf[f"9{b}"] = {"class_type": "XDiTTestSaveTensors",
                       "inputs": {"latent": [last, 0], "path": out[b]}}
    return wf, out


def _compare(comfy, wf, out, tag):
    _, msgs = run(comfy, wf, timeout=1500)
    _ok(msgs)
    x, n = tensors(Path(out["x"]))["latent"], tensors(Path(out["n"]))["latent"]
    assert x.shape == n.shape == LATENT, (x.shape, n.shape)
    fig = {"latent_max_abs": float((x - n).abs().max()), "latent_max": float(n.abs().max())}
    print(f"\n{tag}: {json.dumps(fig)}")
    assert torch.isfinite(x).all() and fig["latent_max"] > 0.05, fig
    assert fig["latent_max_abs"] <= TOL, fig
    return n


LAYOUTS = [({}, "1"), ({"ulysses": 2}, "2"), ({"cfg_parallel": True}, "2")]


@pytest.mark.parametrize("layout,world", LAYOUTS, ids=["1rank", "ulysses2", "cfg_parallel"])
def test_wan_ksampler_on_the_pool_matches_comfyui_own_model(comfy, layout, world):
    got = {}
    for sampler, scheduler in SAMPLERS:
        tag = f"wan-{'-'.join(map(str, layout)) or 'one'}-{sampler}"
        wf, out = _compare_graph(comfy, layout, world, tag, sampler, scheduler)
        got[sampler] = _compare(comfy, wf, out, tag)
    a, b = (got[s] for s, _ in SAMPLERS)  # the agreement above is not vacuous
    assert float((a - b).abs().max()) > 1e-2
    pool = next(p for p in http(comfy["base"], "/xdit/status")["pools"]
                if p["model"].endswith(NATIVE))
    want = "ulysses 2" if layout.get("ulysses") else "cfg 2" if layout else "cfg 1"
    assert pool["world_size"] == int(world) and want in pool["config"], pool


def test_wan22_two_expert_graph_matches_comfyui_own_models(comfy):
    wf, out = _compare_graph(comfy, {"cfg_parallel": True}, "2", "wan22-experts", split=2,
                             steps=4)
    both = _compare(comfy, wf, out, "wan22-experts cfg_parallel euler")
    # the low-noise expert mattered: the high-noise one alone for every step differs
    wf, out = _compare_graph(comfy, {"cfg_parallel": True}, "2", "wan22-high-only", steps=4)
    high_only = _compare(comfy, wf, out, "wan22-high-only")
    assert float((both - high_only).abs().max()) > 1e-2
    pools = [p for p in http(comfy["base"], "/xdit/status")["pools"]
             if p["model"].endswith(NATIVE)]
    assert len(pools) == 1, pools
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})


def test_wan22_two_files_graph_matches_comfyui_own_models(comfy):
    """The same Wan 2.2 graph with the xDiT loader on the two expert files (Low-noise expert
    (xDiT)) instead of the folder: one pool serves both files' experts."""
    wf, out = _compare_graph(comfy, {"cfg_parallel": True}, "2", "wan22-files", split=2,
                             steps=4, files=True)
    _compare(comfy, wf, out, "wan22-two-files cfg_parallel euler")
    pools = [p for p in http(comfy["base"], "/xdit/status")["pools"]
             if p["model"].endswith(FILES["high_noise"])]
    assert len(pools) == 1 and pools[0]["model_2"].endswith(FILES["low_noise"]), pools
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})


def _pool_and_native(folder: str, file: str, tokens: tuple) -> dict:
    """Nodes 1-5 of a pool-vs-ComfyUI graph: the xDiT MODEL of `folder` (2 ranks), ComfyUI's
    own model of `file` (UNETLoader), and random positive / negative CONDITIONING of
    `tokens` tokens at UMT5's width."""
    wf = {"1": {"class_type": "xDiT.LoadModel",
                "inputs": {"model": folder, "device": "cpu", "dtype": "fp32",
                           "world_size": "2"}},
          "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0],
                                                         "expert": "high_noise"}},
          "3": {"class_type": "UNETLoader", "inputs": {"unet_name": file,
                                                        "weight_dtype": "default"}}}
    for nid, seed, n in (("4", 1, tokens[0]), ("5", 2, tokens[1])):
        wf[nid] = {"class_type": "XDiTTestRandomConditioning",
                   "inputs": {"seed": seed, "tokens": n, "context_dim": 4096,
                              "pooled_dim": 1, "guidance": -1.0}}
    return wf


def test_wan_i2v_ksampler_on_the_pool_matches_comfyui_own_model(comfy):
    out = {b: str(comfy["tmp"] / f"i2v-ks-{b}.safetensors") for b in ("x", "n")}
    wf = _pool_and_native(I2V_NATIVE, I2V_FILE, tokens=(8, 6))
    wf["6"] = {"class_type": "XDiTTestWanStartFrame",
               "inputs": {"positive": ["4", 0], "negative": ["5", 0], "width": SIZE["width"],
                          "height": SIZE["height"], "length": SIZE["length"], "seed": 3}}
    with_settings(wf, "1", cfg_parallel=True)
    for b, model in (("x", ["2", 0]), ("n", ["3", 0])):
        wf[f"7{b}"] = {"class_type": "KSampler",
                       "inputs": {"model": model, "seed": 7, "steps": 3, "cfg": 3.5,
                                  "sampler_name": "euler", "scheduler": "simple",
                                  "positive": ["6", 0], "negative": ["6", 1],
                                  "latent_image": ["6", 2], "denoise": 1.0}}
        wf[f"9{b}"] = {"class_type": "XDiTTestSaveTensors",
                       "inputs": {"latent": [f"7{b}", 0], "path": out[b]}}
    _compare(comfy, wf, out, "wan22-i2v cfg_parallel euler")


def test_wan21_i2v_clip_fea_on_the_pool_matches_comfyui_own_model(comfy):
    """Wan 2.1 I2V's CLIP image conditioning on the MODEL path: WanImageToVideo's values
    with a clip_vision_output (XDiTTestWanStartFrame + XDiTTestClipVisionOutput stand in: no
    tiny Wan VAE or CLIP vision model loads into ComfyUI) reach ComfyUI's WAN21 as clip_fea;
    KSampler on the xDiT MODEL (Ulysses 2) equals KSampler on ComfyUI's own i2v model from
    the same weights. The text is 24 tokens, not the 512 diffusers' image cross-attention
    assumes (ComfyUI's model takes the clip_fea-many first context tokens as the image's,
    the rest as text; so does the pool). A second image embedding on the pool must move the
    LATENT, so the agreement cannot come from the image tokens being dropped."""
    out = {b: str(comfy["tmp"] / f"i2v21-ks-{b}.safetensors") for b in ("x", "n", "xb")}
    wf = _pool_and_native(I2V21_NATIVE, I2V21_FILE, tokens=(24, 24))
    with_settings(wf, "1", ulysses=2)
    for b, model, image in (("x", "2", 3), ("n", "3", 3), ("xb", "2", 4)):
        wf[f"c{b}"] = {"class_type": "XDiTTestClipVisionOutput",
                       "inputs": {"seed": image, "tokens": 257, "width": 1280}}
        wf[f"6{b}"] = {"class_type": "XDiTTestWanStartFrame",
                       "inputs": {"positive": ["4", 0], "negative": ["5", 0],
                                  "width": SIZE["width"], "height": SIZE["height"],
                                  "length": SIZE["length"], "seed": 3,
                                  "clip_vision_output": [f"c{b}", 0]}}
        wf[f"7{b}"] = {"class_type": "KSampler",
                       "inputs": {"model": [model, 0], "seed": 7, "steps": 3, "cfg": 3.5,
                                  "sampler_name": "euler", "scheduler": "simple",
                                  "positive": [f"6{b}", 0], "negative": [f"6{b}", 1],
                                  "latent_image": [f"6{b}", 2], "denoise": 1.0}}
        wf[f"9{b}"] = {"class_type": "XDiTTestSaveTensors",
                       "inputs": {"latent": [f"7{b}", 0], "path": out[b]}}
    n = _compare(comfy, wf, out, "wan21-i2v clip_fea ulysses2 euler")
    other = tensors(Path(out["xb"]))["latent"]
    moved = float((other - n).abs().max())
    print(f"another image embedding moved the LATENT by {moved:.3e}")
    assert moved > TOL
    pool = next(p for p in http(comfy["base"], "/xdit/status")["pools"]
                if p["model"].endswith(I2V21_NATIVE))
    assert pool["world_size"] == 2 and "ulysses 2" in pool["config"], pool
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})


# --- the image-to-video example as shipped: ComfyUI's VAELoader + WanImageToVideo on a Wan
# 2.1 VAE of the released structure (tests/wan_comfy_vae.py), the pool decoding with the same
# weights in its folder.
VAE_FILE = "wan_2.1_vae.safetensors"  # the example's VAELoader name
I2V_SIZE = dict(width=32, height=32, length=5)  # latent [1, 16, 2, 4, 4]: the VAE is ~127M
I2V_LATENT = (1, 16, 2, 4, 4)


@pytest.fixture(scope="module")
def wan_vae(tmp_path_factory):
    """The tiny I2V A14B folder with the released-structure VAE, and that VAE as a ComfyUI
    file in the original Wan names."""
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    from wan_comfy_vae import comfy_vae_file, wan_vae_folder
    cache = tmp_path_factory.mktemp("wan-vae")
    folder = wan_vae_folder(ensure_tiny_model("wan", cache, variant="i2v-a14b"),
                            cache / "i2v-real-vae")
    return {"folder": folder, "file": comfy_vae_file(folder / "vae", cache / VAE_FILE)}


def test_wan_vae_file_is_the_folder_vae_in_comfyui(wan_vae, tmp_path):
    """ComfyUI's own WanVAE (built as comfy/sd.py builds it for a Wan 2.1 file, loaded
    strictly from the file) decodes a latent and encodes a video as diffusers'
    AutoencoderKLWan does from the folder: the name rules put every tensor in its place."""
    import os
    import subprocess
    import sys

    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file
    from wan_comfy_vae import COMFY_SIDE
    g = torch.Generator().manual_seed(11)
    x = {"latent": torch.randn(1, 16, 2, 4, 4, generator=g),
         "video": torch.rand(1, 3, 5, 32, 32, generator=g) * 2 - 1}
    save_file(x, str(tmp_path / "in.safetensors"))
    py = os.environ.get("COMFYUI_PYTHON", sys.executable)
    r = subprocess.run([py, "-c", COMFY_SIDE, str(wan_vae["file"]),
                        str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")],
                       cwd=COMFY, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    comfy_side = tensors(tmp_path / "out.safetensors")
    vae = AutoencoderKLWan.from_pretrained(str(wan_vae["folder"] / "vae")).eval()
    with torch.no_grad():
        decoded = vae.decode(x["latent"]).sample  # diffusers clamps to [-1, 1]
        encoded = vae.encode(x["video"]).latent_dist.mode()
    dec = float((comfy_side["decoded"].clamp(-1, 1) - decoded).abs().max())
    enc = float((comfy_side["encoded"] - encoded).abs().max())
    print(f"\nWan 2.1 VAE file in ComfyUI vs diffusers folder: decode {dec:.2e} "
          f"(frames std {float(decoded.std()):.3f}), encode {enc:.2e} "
          f"(latent std {float(encoded.std()):.3f})")
    assert decoded.shape == (1, 3, 5, 32, 32) and encoded.shape == (1, 16, 2, 4, 4)
    assert float(decoded.std()) > 0.05 and float(encoded.std()) > 0.01  # not vacuous
    assert dec <= 1e-4 and enc <= 1e-4, (dec, enc)


def _start_images(comfy_path: Path) -> list:
    """The example's start image (ComfyUI's input/example.png, written if a checkout lacks
    it) and a second one, its mirror image, to show the start frame reaches the video."""
    from PIL import Image
    inputs = comfy_path / "input"
    inputs.mkdir(exist_ok=True)
    first = inputs / "example.png"
    if not first.is_file():
        g = torch.Generator().manual_seed(0)
        pixels = (torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(first)
    Image.open(first).convert("RGB").transpose(Image.FLIP_LEFT_RIGHT).save(
        inputs / "xdit-test-start-mirrored.png")
    return ["example.png", "xdit-test-start-mirrored.png"]


def test_image_to_video_example_runs_as_shipped(comfy, wan_vae):
    """xdit_wan_image_to_video with ComfyUI's own VAELoader, LoadImage and WanImageToVideo
    (the start frame encoded by ComfyUI's WanVAE), only the text encoder replaced by random
    CONDITIONING and the sizes / steps shrunk; the pool's folder carries the same VAE. Decode
    (xDiT) on the pool and ComfyUI's VAEDecode of the same LATENT give the same frames; of
    another LATENT (WanImageToVideo's empty one) they do not; a mirrored start image moves
    the LATENT (the start frame reaches the model)."""
    import shutil
    name = "xdit_wan_image_to_video_api.json"
    base = json.loads((ROOT / "example_workflows" / name).read_text())
    by_type = _by_type(base)
    assert base[by_type["xDiT.LoadModel"][0]]["inputs"]["model"] == I2V_NAME
    (vae_loader,) = by_type["VAELoader"]
    assert base[vae_loader]["inputs"]["vae_name"] == VAE_FILE
    comfy_path = Path(COMFY)
    shipped = comfy_path / "models" / "diffusers" / I2V_NAME
    aside = comfy["tmp"] / "i2v-tiny-vae"
    http(comfy["base"], "/xdit/unload", {})
    shutil.move(str(shipped), str(aside))
    place(wan_vae["folder"], shipped)
    vae_path = comfy_path / "models" / "vae" / VAE_FILE
    vae_path.parent.mkdir(parents=True, exist_ok=True)
    vae_path.unlink(missing_ok=True)
    vae_path.symlink_to(wan_vae["file"])
    width = json.loads((shipped / "transformer" / "config.json").read_text())["text_dim"]
    sampler, decode = by_type["xDiT.Sampler"][0], by_type["xDiT.Decode"][0]
    (i2v,) = by_type["WanImageToVideo"]
    got = {}
    try:
        for image in _start_images(comfy_path):
            wf = json.loads(json.dumps(base))
            _random_text(wf, by_type, width)
            wf[by_type["LoadImage"][0]]["inputs"]["image"] = image
            wf[i2v]["inputs"].update(I2V_SIZE)
            wf[sampler]["inputs"]["steps"] = 3
            out = {k: comfy["tmp"] / f"i2v-shipped-{k}-{image}.safetensors"
                   for k in ("xdit", "comfy", "empty")}
            wf["97"] = {"class_type": "VAEDecode",
                        "inputs": {"samples": [sampler, 0], "vae": [vae_loader, 0]}}
            wf["96"] = {"class_type": "VAEDecode",  # WanImageToVideo's empty LATENT
                        "inputs": {"samples": [i2v, 2], "vae": [vae_loader, 0]}}
            wf["98"] = {"class_type": "XDiTTestSaveTensors",
                        "inputs": {"images": ["97", 0], "path": str(out["comfy"])}}
            wf["95"] = {"class_type": "XDiTTestSaveTensors",
                        "inputs": {"images": ["96", 0], "path": str(out["empty"])}}
            wf["99"] = {"class_type": "XDiTTestSaveTensors",
                        "inputs": {"latent": [sampler, 0], "images": [decode, 0],
                                   "path": str(out["xdit"])}}
            pid, msgs = run(comfy, wf, timeout=1500)
            _ok(msgs)
            xdit, native = tensors(out["xdit"]), tensors(out["comfy"])
            assert xdit["latent"].shape == I2V_LATENT and torch.isfinite(xdit["latent"]).all()
            frames = (I2V_SIZE["length"], I2V_SIZE["height"], I2V_SIZE["width"], 3)
            assert xdit["image"].shape == native["image"].shape == frames
            progress = [m["data"] for m in msgs if m.get("type") == "progress"
                        and m["data"].get("node") == sampler]
            assert progress and progress[-1]["value"] == 3
            _saved_video(comfy, pid, wf, by_type)
            got[image] = dict(latent=xdit["latent"], xdit=xdit["image"], comfy=native["image"],
                              empty=tensors(out["empty"])["image"])
    finally:
        http(comfy["base"], "/xdit/unload", {})
        shutil.rmtree(shipped)
        shutil.move(str(aside), str(shipped))
    a, b = got.values()
    fig = {"decode_max_abs": float((a["xdit"] - a["comfy"]).abs().max()),
           "empty_latent_max_abs": float((a["xdit"] - a["empty"]).abs().max()),
           "other_start_max_abs": float((a["xdit"] - b["comfy"]).abs().max()),
           "start_image_moved_latent": float((a["latent"] - b["latent"]).abs().max()),
           "frames_std": float(a["xdit"].std())}
    print(f"\n{name} as shipped: {json.dumps(fig)}")
    assert fig["frames_std"] > 0.02, fig
    assert fig["decode_max_abs"] <= 1e-4, fig
    assert fig["empty_latent_max_abs"] > 0.05, fig  # a different LATENT decodes far away
    assert float((b["xdit"] - b["comfy"]).abs().max()) <= 1e-4
    assert fig["start_image_moved_latent"] > 1e-3, fig


def test_sampler_on_a_wan_file_schedules_as_comfyuis_own_model(comfy):
    """Sampler (xDiT) on a Wan single file samples at ComfyUI's shift for Wan (8,
    supported_models.WAN21_T2V), so it and KSampler (uni_pc_bh2, simple) on ComfyUI's own
    model from the same file schedule alike (the sigmas: tests/test_wan_single_file.py);
    the two UniPC implementations still differ (measured on 0.3.64: rel L2 0.068 at the
    default, 0.081 at the folders' shift 3, the file default before), so the check here is
    that the default is shift 8 exactly and lands nearer ComfyUI's result than shift 3."""
    out = {}
    for tag, options in (("default", None), ("shift3", {"cfg_2": 0.0, "shift": 3.0}),
                         ("shift8", {"cfg_2": 0.0, "shift": 8.0})):
        path = comfy["tmp"] / f"file-shift-{tag}.safetensors"
        wf = {"1": {"class_type": "xDiT.LoadModel",
                    "inputs": {"model": f"diffusion_models/{FILES['high_noise']}",
                               "device": "cpu", "dtype": "fp32", "world_size": "1"}},
              **_random_conds(),
              "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": dict(SIZE, batch_size=1)},
              "3": {"class_type": "xDiT.Sampler",
                    "inputs": {"model": ["1", 0], "latent": ["6", 0], "prompt": "",
                               "negative_prompt": "", "seed": 7, "steps": 6, "cfg": 3.5,
                               "guidance": 0.0, "denoise": 1.0, "positive": ["4", 0],
                               "negative": ["5", 0]}},
              "9": {"class_type": "XDiTTestSaveTensors",
                    "inputs": {"latent": ["3", 0], "path": str(path)}}}
        if options is not None:
            wf["7"] = {"class_type": "xDiT.SamplerOptions", "inputs": options}
            wf["3"]["inputs"]["options"] = ["7", 0]
        if tag == "default":  # and ComfyUI's own model from the file, same noise and text
            wf["2"] = {"class_type": "UNETLoader",
                       "inputs": {"unet_name": FILES["high_noise"], "weight_dtype": "default"}}
            wf["8"] = {"class_type": "KSampler",
                       "inputs": {"model": ["2", 0], "seed": 7, "steps": 6, "cfg": 3.5,
                                  "sampler_name": "uni_pc_bh2", "scheduler": "simple",
                                  "positive": ["4", 0], "negative": ["5", 0],
                                  "latent_image": ["6", 0], "denoise": 1.0}}
            native = comfy["tmp"] / "file-shift-native.safetensors"
            wf["10"] = {"class_type": "XDiTTestSaveTensors",
                        "inputs": {"latent": ["8", 0], "path": str(native)}}
        _, msgs = run(comfy, wf, timeout=1500)
        _ok(msgs)
        out[tag] = tensors(path)["latent"]
    n = tensors(comfy["tmp"] / "file-shift-native.safetensors")["latent"]
    assert float((out["default"] - out["shift8"]).abs().max()) == 0.0

    def rel(a):
        return float((a - n).norm() / n.norm())
    fig = {"default (8) vs native": rel(out["default"]), "shift 3 vs native": rel(out["shift3"])}
    print(f"\nWan file, Sampler (xDiT) vs KSampler uni_pc_bh2 on ComfyUI's model, rel L2: {fig}")
    assert fig["default (8) vs native"] < fig["shift 3 vs native"], fig
