"""FLUX.2 and reference images through the xDiT nodes in a real ComfyUI (issue #14; skipped
unless COMFYUI_PATH is set).

COMFYUI_PATH: a ComfyUI checkout; COMFYUI_PYTHON: its venv's python (with this pack's
requirements). The fixture links this pack and the test-only helper packs into custom_nodes/,
puts the tiny FLUX.2 folder into models/diffusers/ under the example's name
(FLUX.2-klein-4B) and the tiny FLUX.1 folder as a Kontext stand-in, and starts
`main.py --cpu`. Then:
* the FLUX.2 example workflow runs as shipped (text -> Sampler (xDiT) -> Decode (xDiT) ->
  SaveImage);
* FLUX.2 CONDITIONING (hidden states, no pooled output) gives the prompt path's LATENT, and a
  LATENT in with denoise < 1 is image-to-image;
* xDiT.ToModel refuses FLUX.2 on a ComfyUI without a FLUX.2 model class, in one message;
* FLUX.1 Kontext the ComfyUI way: EmptyImage -> VAEEncode -> ReferenceLatent on the
  positive CONDITIONING -> Sampler (xDiT), and the reference changes the image.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from live_comfy import (COMFY, ROOT, comfy_vae, http, link_packs, place, run,
                        running_comfyui, skip_without_comfyui, tensors)

pytestmark = skip_without_comfyui

EXAMPLE = "xdit_flux2_text_to_image_api.json"
FLUX2_NAME = "FLUX.2-klein-4B"  # the example's folder name; the tiny model stands in
KONTEXT_NAME = "xdit-test-flux-kontext"
VAE_NAME = "xdit-test-vae.safetensors"


@pytest.fixture(scope="module")
def comfy(model_dir, tmp_path_factory):
    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-helpers", "xdit-live-test-model-nodes")
    diffusers_dir = comfy / "models" / "diffusers"
    place(model_dir("flux2"), diffusers_dir / FLUX2_NAME)
    place(model_dir("flux"), diffusers_dir / KONTEXT_NAME)
    comfy_vae(comfy / "models" / "vae" / VAE_NAME)
    log = tmp_path_factory.mktemp("comfy-flux2") / "comfyui.log"
    with running_comfyui(comfy, log) as server:
        yield dict(server, tmp=log.parent, flux2=diffusers_dir / FLUX2_NAME,
                   kontext=diffusers_dir / KONTEXT_NAME)


def _ok(msgs):
    assert msgs[-1]["type"] == "execution_success", msgs[-1]


def test_flux2_example_workflow_runs_unmodified(comfy):
    """The FLUX.2 example as shipped (device auto, 1024x1024, 4 steps, the prompt typed into
    the sampler): sampled on the pool, decoded with the folder's FLUX.2 VAE, saved."""
    wf = json.loads((ROOT / "example_workflows" / EXAMPLE).read_text())
    loader = next(n for n in wf.values() if n["class_type"] == "xDiT.LoadModel")
    assert loader["inputs"]["model"] == FLUX2_NAME and loader["inputs"]["device"] == "auto"
    pid, msgs = run(comfy, wf, timeout=1200)
    _ok(msgs)
    saved = [o for o in http(comfy["base"], f"/history/{pid}")[pid]["outputs"].values()
             if o.get("images")]
    assert saved and saved[0]["images"][0]["filename"].startswith("xdit-flux2")
    img = http(comfy["base"], "/view?filename={filename}&subfolder={subfolder}&type={type}"
                .format(**saved[0]["images"][0]))
    assert img[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    import io
    assert Image.open(io.BytesIO(img)).size == (1024, 1024)
    pool = http(comfy["base"], "/xdit/status")["pools"][0]
    assert pool["model"].endswith(FLUX2_NAME) and pool["world_size"] == 2


def _flux2_graph(comfy, out: str, text: str = "a small red cube") -> dict:
    """Two xDiT samplers on one FLUX.2 pool, same seed: "3" from the prompt text, "7" from
    FLUX.2 CONDITIONING of the same text; "9" image-to-image from "7"'s LATENT (denoise
    0.6); all three decoded on the pool, latents and images saved at full precision."""
    common = {"model": ["1", 0], "latent": ["2", 0], "negative_prompt": "", "seed": 4,
              "steps": 3, "cfg": 1.0, "guidance": 0.0, "denoise": 1.0,
              "max_sequence_length": 16}
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": FLUX2_NAME, "device": "cpu", "dtype": "fp32",
                         "world_size": "2", "parallel": ["101", 0]}},
        "101": {"class_type": "xDiT.ParallelSettings",
                "inputs": {"ulysses": 2, "ring": 1, "cfg_parallel": False, "dp": 1, "gpus": ""}},
        "2": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": 64, "height": 48, "batch_size": 1}},
        "3": {"class_type": "xDiT.Sampler", "inputs": dict(common, prompt=text)},
        "6": {"class_type": "XDiTTestFlux2Conditioning",
              "inputs": {"text": text, "model_folder": str(comfy["flux2"]),
                         "max_sequence_length": 16}},
        "7": {"class_type": "xDiT.Sampler",
              "inputs": dict(common, prompt="", positive=["6", 0])},
        "9": {"class_type": "xDiT.Sampler",
              "inputs": dict(common, prompt="", positive=["6", 0], latent=["7", 0],
                             denoise=0.6, steps=4)},
    }
    for k, src in (("a", "3"), ("b", "7"), ("c", "9")):
        wf[f"d{k}"] = {"class_type": "xDiT.Decode",
                       "inputs": {"model": ["1", 0], "samples": [src, 0]}}
        wf[f"s{k}"] = {"class_type": "XDiTTestSaveTensors",
                       "inputs": {"images": [f"d{k}", 0], "latent": [src, 0],
                                  "path": f"{out}-{k}.safetensors"}}
    return wf


def test_flux2_conditioning_equals_prompt_and_img2img(comfy):
    out = str(comfy["tmp"] / "flux2")
    _, msgs = run(comfy, _flux2_graph(comfy, out))
    _ok(msgs)
    a, b, c = (tensors(f"{out}-{k}.safetensors") for k in "abc")
    assert a["latent"].shape == (1, 128, 3, 4) and a["image"].shape == (1, 48, 64, 3)
    print(f"\nflux2 cond vs prompt: latent {float((a['latent'] - b['latent']).abs().max()):.2e}"
          f", image {float((a['image'] - b['image']).abs().max()):.2e}")
    assert float((a["latent"] - b["latent"]).abs().max()) <= 1e-5
    assert float((a["image"] - b["image"]).abs().max()) <= 1e-4
    assert float(a["image"].std()) > 1e-3
    # image-to-image from the LATENT: a new image, not the text-to-image one
    assert float((c["latent"] - b["latent"]).abs().max()) > 1e-3
    # another text's CONDITIONING changes the result (the comparison above can fail)
    out2 = str(comfy["tmp"] / "flux2-other")
    _, msgs = run(comfy, _flux2_graph(comfy, out2, text="a blue dog"))
    _ok(msgs)
    assert float((tensors(f"{out2}-b.safetensors")["latent"] - b["latent"]).abs().max()) > 1e-4


def test_flux2_ksampler_model_refused_on_this_comfyui(comfy):
    """ComfyUI 0.3.64 has no FLUX.2 model class: xDiT.ToModel says so in one message, the
    next job runs on the warm pool."""
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": FLUX2_NAME, "device": "cpu", "dtype": "fp32",
                         "world_size": "2", "parallel": ["101", 0]}},
        "101": {"class_type": "xDiT.ParallelSettings",
                "inputs": {"ulysses": 2, "ring": 1, "cfg_parallel": False, "dp": 1, "gpus": ""}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "XDiTTestFlux2Conditioning",
              "inputs": {"text": "a cube", "model_folder": str(comfy["flux2"]),
                         "max_sequence_length": 16}},
        "4": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": ["2", 0], "seed": 1, "steps": 2, "cfg": 1.0,
                         "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
                         "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "XDiTTestSaveTensors",
              "inputs": {"images": ["7", 0], "path": str(comfy["tmp"] / "never.safetensors")}},
        "7": {"class_type": "xDiT.Decode", "inputs": {"model": ["1", 0], "samples": ["5", 0]}},
    }
    _, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_error", msgs[-1]
    err = msgs[-1]["data"]["exception_message"]
    assert "ComfyUI with FLUX.2 support" in err and "Sampler (xDiT)" in err, err
    assert msgs[-1]["data"]["node_type"] == "xDiT.ToModel"
    out = str(comfy["tmp"] / "flux2-after")
    _, msgs = run(comfy, _flux2_graph(comfy, out))
    _ok(msgs)


def _kontext_graph(comfy, out: str, reference: bool, method: str = "") -> dict:
    """FLUX.1 (the tiny folder as a Kontext stand-in): EmptyImage -> VAEEncode (the test VAE)
    -> ReferenceLatent on the positive CONDITIONING -> Sampler (xDiT) -> saved LATENT."""
    positive = ["3", 0]
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": KONTEXT_NAME, "device": "cpu", "dtype": "fp32",
                         "world_size": "2", "parallel": ["101", 0]}},
        "101": {"class_type": "xDiT.ParallelSettings",
                "inputs": {"ulysses": 2, "ring": 1, "cfg_parallel": False, "dp": 1, "gpus": ""}},
        "2": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "XDiTTestConditioning",
              "inputs": {"text": "make it red", "model_folder": str(comfy["kontext"]),
                         "max_sequence_length": 16}},
        "4": {"class_type": "EmptyImage",
              "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 0x3366CC}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_NAME}},
        "6": {"class_type": "VAEEncode", "inputs": {"pixels": ["4", 0], "vae": ["5", 0]}},
        "8": {"class_type": "xDiT.Sampler",
              "inputs": {"model": ["1", 0], "latent": ["2", 0], "prompt": "",
                         "negative_prompt": "", "seed": 2, "steps": 3, "cfg": 1.0,
                         "guidance": 2.5, "denoise": 1.0, "max_sequence_length": 16}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["5", 0]}},
        "10": {"class_type": "XDiTTestSaveTensors",
               "inputs": {"images": ["9", 0], "latent": ["8", 0], "path": out}},
    }
    if reference:
        wf["7"] = {"class_type": "ReferenceLatent",
                   "inputs": {"conditioning": ["3", 0], "latent": ["6", 0]}}
        positive = ["7", 0]
        if method:
            wf["11"] = {"class_type": "FluxKontextMultiReferenceLatentMethod",
                        "inputs": {"conditioning": ["7", 0],
                                   "reference_latents_method": method}}
            positive = ["11", 0]
    wf["8"]["inputs"]["positive"] = positive
    return wf


def test_flux_kontext_reference_latent_through_the_xdit_sampler(comfy):
    """ReferenceLatent's reference reaches the pool: the image changes with it, its layout
    method (FluxKontextMultiReferenceLatentMethod) is honoured, and the same graph twice
    gives the same latent."""
    paths = {k: str(comfy["tmp"] / f"kontext-{k}.safetensors") for k in ("none", "ref", "again",
                                                                        "index")}
    for key, ref, method in (("none", False, ""), ("ref", True, ""), ("again", True, ""),
                             ("index", True, "index")):
        _, msgs = run(comfy, _kontext_graph(comfy, paths[key], ref, method))
        _ok(msgs)
    t = {k: tensors(p)["latent"] for k, p in paths.items()}
    assert t["ref"].shape == (1, 16, 8, 8)
    assert float((t["ref"] - t["none"]).abs().max()) > 1e-3
    assert float((t["ref"] - t["again"]).abs().max()) == 0.0
    # one reference: "index" puts it at index 1 like "offset" (ComfyUI's own rule)
    assert float((t["ref"] - t["index"]).abs().max()) <= 1e-5
