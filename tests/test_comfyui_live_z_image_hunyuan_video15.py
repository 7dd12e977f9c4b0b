"""Z-Image and HunyuanVideo 1.5 in a real ComfyUI (skipped unless COMFYUI_PATH is
set; COMFYUI_PYTHON: its venv's python, with this pack's requirements).

The fixture links this pack and the test-only helper packs into custom_nodes/, puts the tiny
Z-Image and HunyuanVideo 1.5 (text- and image-to-video) folders into models/diffusers/ under
the example workflows' names, and, on a ComfyUI that has both families (0.8.0), one random
single file of each that ComfyUI's own UNETLoader loads into models/diffusion_models/, then
starts `main.py --cpu --preview-method latent2rgb`. Then:
* the loader lists the three folders (and the two single files where they were placed);
* the three examples run through /prompt (the HunyuanVideo 1.5 ones only where ComfyUI has
  its nodes: 0.8.0), shrunk (sizes, frames, steps): Z-Image
  text-to-image and HunyuanVideo 1.5 text-to-video as shipped otherwise (the prompt typed
  into the sampler, decoded on the pool); HunyuanVideo 1.5 image-to-video with its text
  encoders replaced by a random CONDITIONING of the tiny model's text width and
  VAELoader + CLIPVisionLoader + HunyuanVideo15ImageToVideo stood in for by seeded values of
  the same shapes (XDiTTestWanStartFrame at 32 channels, 1/16; XDiTTestClipVisionOutput):
  neither ComfyUI loader builds a tiny model. Each sampler's LATENT has ComfyUI's shape for
  the family, progress reaches the steps and latent2rgb previews show;
* (ComfyUI 0.8.0: 0.3.64 has neither family) stock KSampler on the xDiT MODEL
  (xDiT.LoadModel of the single file, 2 CPU fp32 ranks) equals the same KSampler on
  ComfyUI's own model from the same file (UNETLoader), LATENT max abs <= 1e-3, at Ulysses 2
  and at CFG parallel, cfg 2.5 (both rows in every call), euler/simple and dpmpp_2m/beta.
  Z-Image: ComfyUI builds it only at the released width (3840, 30 heads), so the file is
  that width with 1 main block and the 2 + 2 refiner blocks ComfyUI's NextDiT always has,
  bf16 (~1.8 GB); HunyuanVideo 1.5: ComfyUI reads the hidden size and text width from the
  shapes, so the file is 2 heads of 128, 1 block, at the SigLIP / ByT5 widths it matches on
  (tests/test_hunyuan_video15.py's COMFY_SHAPED);
* (0.8.0) HunyuanVideo 1.5 image-to-video on KSampler: HunyuanVideo15ImageToVideo's values
  (stood in for, as above) on the xDiT MODEL equal ComfyUI's own model (CFG parallel), and
  another start frame moves the result.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from live_comfy import (COMFY, ROOT, history, http, link_packs, place, run, running_comfyui,
                        skip_without_comfyui, tensors, with_settings)

pytestmark = skip_without_comfyui

Z_NAME = "Z-Image-Turbo"
T2V_NAME, I2V_NAME = "HunyuanVideo-1.5-Diffusers-720p_t2v", "HunyuanVideo-1.5-Diffusers-720p_i2v"
Z_FILE = "xdit-native-z-image.safetensors"
HV_FILE = "xdit-native-hunyuanvideo1.5.safetensors"
EXAMPLES = {"xdit_z_image_text_to_image_api.json": Z_NAME,
            "xdit_hunyuan_video15_text_to_video_api.json": T2V_NAME,
            "xdit_hunyuan_video15_image_to_video_api.json": I2V_NAME}
TOL = 1e-3
SAMPLERS = [("euler", "simple"), ("dpmpp_2m", "beta")]
# the examples shrunk: pixels (w, h), frames, steps
SMALL = {Z_NAME: ((128, 96), None, 3), T2V_NAME: ((64, 48), 5, 2), I2V_NAME: ((64, 48), 5, 2)}


def z_image_file(out: Path, seed: int = 0) -> Path:
    """Once: a random Z-Image transformer at ComfyUI 0.8.0's only Z-Image width (3840, 30
    heads, Qwen3-4B's 2560-wide text, RoPE lengths 1536/512/512), 1 main block and 2 + 2
    refiner blocks, bf16, in ComfyUI's NextDiT names (comfyui_xdit/testmodels/z_image.single_file)."""
    from diffusers import ZImageTransformer2DModel
    from safetensors.torch import save_file
    from comfyui_xdit.testmodels.z_image import single_file as comfy_names

    if out.exists():
        return out
    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(dim=3840, n_layers=1, n_refiner_layers=2, n_heads=30,
                                     n_kv_heads=30, cap_feat_dim=2560,
                                     axes_lens=[1536, 512, 512])
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    del model
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.contiguous() for k, v in comfy_names(state).items()}, str(tmp))
    tmp.rename(out)
    return out


def hunyuan_video15_file(out: Path, seed: int = 15) -> Path:
    """Once: a random HunyuanVideo 1.5 transformer of test_hunyuan_video15's COMFY_SHAPED
    (heads of 128, the widths ComfyUI 0.8.0 matches on, text width 32), bf16, in ComfyUI's
    names (no prefix, as split_files ship them)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from safetensors.torch import save_file
    from test_hunyuan_video15 import COMFY_SHAPED
    from comfyui_xdit.testmodels.hunyuan_video15 import single_file as comfy_named

    if out.exists():
        return out
    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(**COMFY_SHAPED)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    tmp = out.with_name(out.name + ".tmp")
    save_file(comfy_named(state), str(tmp))
    tmp.rename(out)
    return out


def comfyui_has_both(comfy: Path) -> bool:
    """Whether this ComfyUI checkout has both families' model classes (0.8.0; 0.3.64 has
    neither): asked before the server starts, to place the single files only where its
    UNETLoader can read them."""
    base = (comfy / "comfy" / "model_base.py").read_text()
    return "class HunyuanVideo15(" in base and "z_image_modulation" in (
        comfy / "comfy" / "model_detection.py").read_text()


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-helpers", "xdit-live-test-model-nodes")
    cache = tmp_path_factory.mktemp("new-family-models")
    diffusers_dir = comfy / "models" / "diffusers"
    folders = {Z_NAME: ensure_tiny_model("z_image", cache),
               T2V_NAME: ensure_tiny_model("hunyuan_video15", cache, variant="t2v"),
               I2V_NAME: ensure_tiny_model("hunyuan_video15", cache, variant="i2v")}
    for name, src in folders.items():
        place(src, diffusers_dir / name)
    native = comfyui_has_both(comfy)
    if native:
        files = comfy / "models" / "diffusion_models"
        files.mkdir(parents=True, exist_ok=True)
        z_image_file(files / Z_FILE)  # ~1.8 GB, kept between runs
        hunyuan_video15_file(files / HV_FILE)
    log = tmp_path_factory.mktemp("comfy-new-families") / "comfyui.log"
    with running_comfyui(comfy, log, "--preview-method", "latent2rgb") as server:
        nodes = http(server["base"], "/object_info")
        yield dict(server, tmp=log.parent, native=native,
                   folders={n: diffusers_dir / n for n in folders},
                   hv_nodes="EmptyHunyuanVideo15Latent" in nodes)


def _ok(msgs):
    last = msgs[-1]
    assert last["type"] == "execution_success", \
        (last["data"].get("node_type"), last["data"].get("exception_message"),
         "".join(last["data"].get("traceback") or [])[-3000:])


def _config(folder: Path) -> dict:
    return json.loads((folder / "transformer" / "config.json").read_text())


def test_loader_lists_the_folders_and_the_single_files(comfy):
    info = http(comfy["base"], "/object_info/xDiT.LoadModel")["xDiT.LoadModel"]
    models = json.dumps(info["input"]["required"]["model"])
    names = [Z_NAME, T2V_NAME, I2V_NAME]
    if comfy["native"]:
        names += [f"diffusion_models/{Z_FILE}", f"diffusion_models/{HV_FILE}"]
    for name in names:
        assert f'"{name}"' in models, (name, models)


def _shrink(wf: dict, by_type: dict, name: str, comfy) -> str:
    """The example at SMALL's sizes; image-to-video's ComfyUI loaders stood in for (see the
    module docstring). -> the sampler's node id."""
    (w, h), frames, steps = SMALL[name]
    (sampler,) = by_type["xDiT.Sampler"]
    wf[sampler]["inputs"]["steps"] = steps
    for cls in ("EmptySD3LatentImage", "EmptyHunyuanVideo15Latent"):
        for nid in by_type.get(cls, []):
            wf[nid]["inputs"].update(width=w, height=h)
            if frames:
                wf[nid]["inputs"]["length"] = frames
    if name == I2V_NAME:
        cfg = _config(comfy["folders"][I2V_NAME])
        for nid in by_type["CLIPTextEncode"]:
            wf[nid] = {"class_type": "XDiTTestRandomConditioning",
                       "inputs": {"seed": int(nid), "tokens": 8,
                                  "context_dim": cfg["text_embed_dim"], "pooled_dim": 0,
                                  "guidance": -1.0}}
        (i2v,) = by_type["HunyuanVideo15ImageToVideo"]
        old = wf[i2v]["inputs"]
        wf["90"] = {"class_type": "XDiTTestClipVisionOutput",
                    "inputs": {"seed": 3, "tokens": 729, "width": cfg["image_embed_dim"]}}
        wf[i2v] = {"class_type": "XDiTTestWanStartFrame",
                   "inputs": {"positive": old["positive"], "negative": old["negative"],
                              "width": w, "height": h, "length": frames, "seed": 4,
                              "clip_vision_output": ["90", 0], "channels": 32, "scale": 16}}
        for cls in ("DualCLIPLoader", "VAELoader", "LoadImage", "CLIPVisionLoader",
                    "CLIPVisionEncode"):
            for nid in by_type[cls]:
                del wf[nid]
    return sampler


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_workflow_runs(comfy, name):
    wf = json.loads((ROOT / "example_workflows" / name).read_text())
    by_type = {}
    for nid, node in wf.items():
        by_type.setdefault(node["class_type"], []).append(nid)
    loader = wf[by_type["xDiT.LoadModel"][0]]["inputs"]
    model = EXAMPLES[name]
    assert loader["model"] == model
    if model != Z_NAME and not comfy["hv_nodes"]:
        pytest.skip("the HunyuanVideo 1.5 examples use ComfyUI's HunyuanVideo 1.5 nodes "
                    "(0.8.0; 0.3.64 has none)")
    assert (loader["device"], loader["world_size"]) == ("auto", "auto")
    sampler = _shrink(wf, by_type, model, comfy)
    latent_file = comfy["tmp"] / f"{name}-latent.safetensors"
    wf["99"] = {"class_type": "XDiTTestSaveTensors",
                "inputs": {"latent": [sampler, 0], "path": str(latent_file)}}
    pid, msgs = run(comfy, wf, timeout=1500)
    _ok(msgs)
    (w, h), frames, steps = SMALL[model]
    latent = tensors(latent_file)["latent"]
    # ComfyUI's LATENTs: Z-Image latent_formats.Flux [B, 16, H/8, W/8]; HunyuanVideo 1.5
    # latent_formats.HunyuanVideo15 [B, 32, (F - 1)/4 + 1, H/16, W/16]
    want = (1, 16, h // 8, w // 8) if model == Z_NAME else \
        (1, 32, (frames - 1) // 4 + 1, h // 16, w // 16)
    assert latent.shape == want and torch.isfinite(latent).all(), latent.shape
    assert float(latent.abs().max()) > 0
    outputs = history(comfy, pid)["outputs"]
    if model == Z_NAME:
        saved = [o for o in outputs.values() if o.get("images")]
        img = http(comfy["base"], "/view?filename={filename}&subfolder={subfolder}&type={type}"
                   .format(**saved[0]["images"][0]))
        from PIL import Image
        assert Image.open(io.BytesIO(img)).size == (w, h)
    else:  # SaveVideo wrote the video
        (save,) = by_type["SaveVideo"]
        assert save in outputs and json.dumps(outputs[save]).count(".mp4"), outputs.get(save)
    progress = [m["data"] for m in msgs if m.get("type") == "progress"
                and m["data"].get("node") == sampler]
    assert progress and progress[-1]["value"] == steps, progress[-3:]
    assert any(m.get("type") == "binary_preview" for m in msgs)
    pool = next(p for p in http(comfy["base"], "/xdit/status")["pools"]
                if p["model"].endswith(model))
    done = [m["text"] for m in msgs if m.get("type") == "progress_text"
            and m["node"] == sampler]
    print(f"\n{name}: pool {pool['config']!r}; sampler text {done[-1:]}")
    assert (pool["device"], pool["dtype"], pool["world_size"]) == ("cpu", "fp32", 2), pool
    http(comfy["base"], "/xdit/unload", {})


# ---- stock KSampler on the xDiT MODEL vs ComfyUI's own model from the same file ----------
# (file, context width, empty latent node and its inputs, LATENT shape)
NATIVE = {"z_image": (Z_FILE, 2560, "EmptySD3LatentImage",
                      {"width": 64, "height": 64, "batch_size": 1}, (1, 16, 8, 8)),
          "hunyuan_video15": (HV_FILE, 32, "EmptyHunyuanVideo15Latent",
                              {"width": 64, "height": 48, "length": 5, "batch_size": 1},
                              (1, 32, 2, 3, 4))}


def _compare_graph(comfy, arch: str, layout: dict, sampler: str, scheduler: str, tag: str,
                   cfg: float = 2.5, steps: int = 3, seed: int = 7, start: int | None = None):
    """The same KSampler on the xDiT MODEL ("x") and on ComfyUI's own model ("n"), both from
    the single file; a positive and a negative CONDITIONING of other lengths. `start`
    (HunyuanVideo 1.5): image-to-video, HunyuanVideo15ImageToVideo's values stood in for by
    XDiTTestWanStartFrame (that seed) with a SigLIP-wide CLIP vision output."""
    file, width, empty, empty_inputs, _ = NATIVE[arch]
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{file}", "device": "cpu",
                         "dtype": "fp32", "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": file,
                                                      "weight_dtype": "default"}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": width, "pooled_dim": 0,
                         "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 6, "context_dim": width, "pooled_dim": 0,
                         "guidance": -1.0}},
        "6": {"class_type": empty, "inputs": dict(empty_inputs)},
    }
    with_settings(wf, "1", **layout)
    pos, neg, latent = ["4", 0], ["5", 0], ["6", 0]
    if start is not None:
        wf["20"] = {"class_type": "XDiTTestClipVisionOutput",
                    "inputs": {"seed": 3, "tokens": 729, "width": 1152}}
        wf["21"] = {"class_type": "XDiTTestWanStartFrame",
                    "inputs": {"positive": pos, "negative": neg, "width": empty_inputs["width"],
                               "height": empty_inputs["height"],
                               "length": empty_inputs["length"], "seed": start,
                               "clip_vision_output": ["20", 0], "channels": 32, "scale": 16}}
        pos, neg, latent = ["21", 0], ["21", 1], ["21", 2]
    for b, model, k, s in (("x", ["2", 0], "7", "12"), ("n", ["3", 0], "8", "13")):
        wf[k] = {"class_type": "KSampler",
                 "inputs": {"model": model, "seed": seed, "steps": steps, "cfg": cfg,
                            "sampler_name": sampler, "scheduler": scheduler,
                            "positive": pos, "negative": neg,
                            "latent_image": latent, "denoise": 1.0}}
        wf[s] = {"class_type": "XDiTTestSaveTensors",
                 "inputs": {"latent": [k, 0], "path": out[b]}}
    return wf, out


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg_parallel": True}],
                         ids=["ulysses2", "cfg_parallel"])
@pytest.mark.parametrize("arch", sorted(NATIVE))
def test_ksampler_on_the_pool_matches_comfyui_own_model(comfy, arch, layout):
    if not comfy["native"]:
        pytest.skip("this ComfyUI has no Z-Image / HunyuanVideo 1.5 model (0.8.0 has both)")
    got = {}
    for sampler, scheduler in SAMPLERS:
        tag = f"{arch}-{'-'.join(map(str, layout))}-{sampler}"
        wf, out = _compare_graph(comfy, arch, layout, sampler, scheduler, tag)
        _, msgs = run(comfy, wf, timeout=1500)
        _ok(msgs)
        x, n = tensors(Path(out["x"]))["latent"], tensors(Path(out["n"]))["latent"]
        assert x.shape == n.shape == NATIVE[arch][4], (x.shape, n.shape)
        fig = {"latent_max_abs": float((x - n).abs().max()),
               "latent_max": float(n.abs().max())}
        print(f"\n{tag}: {json.dumps(fig)}")
        assert torch.isfinite(x).all() and fig["latent_max"] > 0.05, fig
        assert fig["latent_max_abs"] <= TOL, fig
        got[sampler] = n
    a, b = (got[s] for s, _ in SAMPLERS)  # the agreement above is not vacuous
    assert float((a - b).abs().max()) > 1e-2
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})


def test_hunyuan_video15_image_to_video_on_ksampler_matches_comfyui_own_model(comfy):
    """Image-to-video on KSampler: HunyuanVideo15ImageToVideo's values (a start-frame latent
    and mask, which ComfyUI's model joins to x as concat_cond, and SigLIP states as clip_fea;
    stood in for) give the same LATENT on the xDiT MODEL (CFG parallel) as on ComfyUI's own
    model; another start frame moves it (the values reach the pool)."""
    if not comfy["native"]:
        pytest.skip("this ComfyUI has no HunyuanVideo 1.5 model (0.8.0 has it)")
    got = []
    for start in (4, 5):
        tag = f"hunyuan_video15-i2v-{start}"
        wf, out = _compare_graph(comfy, "hunyuan_video15", {"cfg_parallel": True}, "euler",
                                 "simple", tag, start=start)
        _, msgs = run(comfy, wf, timeout=1500)
        _ok(msgs)
        x, n = tensors(Path(out["x"]))["latent"], tensors(Path(out["n"]))["latent"]
        assert x.shape == n.shape == NATIVE["hunyuan_video15"][4], (x.shape, n.shape)
        fig = {"latent_max_abs": float((x - n).abs().max()),
               "latent_max": float(n.abs().max())}
        print(f"\n{tag}: {json.dumps(fig)}")
        assert torch.isfinite(x).all() and fig["latent_max"] > 0.05, fig
        assert fig["latent_max_abs"] <= TOL, fig
        got.append(n)
    assert float((got[0] - got[1]).abs().max()) > 1e-2
    http(comfy["base"], "/xdit/unload", {})
