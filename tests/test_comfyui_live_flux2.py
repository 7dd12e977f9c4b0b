"""FLUX.2 and reference images through the xDiT nodes in a real ComfyUI (skipped
unless COMFYUI_PATH is set).

COMFYUI_PATH: a ComfyUI checkout; COMFYUI_PYTHON: its venv's python (with this pack's
requirements). The fixture links this pack and the test-only helper packs into custom_nodes/,
puts the tiny FLUX.2 folder into models/diffusers/ under the example's name
(FLUX.2-klein-4B) and the tiny FLUX.1 folder as a Kontext stand-in, and starts
`main.py --cpu`. Then:
* the FLUX.2 example workflow runs as shipped (text -> Sampler (xDiT) -> Decode (xDiT) ->
  SaveImage);
* FLUX.2 CONDITIONING (hidden states, `pooled_output` None as CLIPTextEncode sets it) gives
  the prompt path's LATENT, and a LATENT in with denoise < 1 is image-to-image;
* stock KSampler on xDiT.ToModel's MODEL: on a ComfyUI without FLUX.2 (0.3.64) refused in
  one message; on one with FLUX.2 (0.8.0) it samples on the pool;
* (ComfyUI with FLUX.2 only) KSampler on the xDiT MODEL of a FLUX.2 single file equals
  KSampler on ComfyUI's own FLUX.2 model loaded from the same file (UNETLoader), LATENT and
  VAEDecode'd image, for a [dev]- and a [klein]-shaped file at Ulysses 2 and CFG parallel;
* FLUX.1 Kontext the ComfyUI way: EmptyImage -> VAEEncode -> ReferenceLatent on the
  positive CONDITIONING -> Sampler (xDiT), and the reference changes the image.

Whether the ComfyUI under test has FLUX.2 is asked of the running server (`/object_info`
lists ComfyUI 0.8.0's EmptyFlux2LatentImage node, which came with its FLUX.2 model classes;
0.3.64 has neither), not read from comfyui_version.py: the server is what runs the graphs,
and a version number would need a table of which release brought FLUX.2 (and says nothing
of a checkout between releases).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from live_comfy import (COMFY, ROOT, comfy_flux2_vae, comfy_vae, history, http, link_packs, place,
                        run, running_comfyui, skip_without_comfyui, tensors, wait_for_memory,
                        SETTINGS, with_settings)

pytestmark = skip_without_comfyui

EXAMPLE = "xdit_flux2_text_to_image_api.json"
FLUX2_NAME = "FLUX.2-klein-4B"  # the example's folder name; the tiny model stands in
KONTEXT_NAME = "xdit-test-flux-kontext"
VAE_NAME = "xdit-test-vae.safetensors"
# ComfyUI-loadable FLUX.2 files (tests/native_models.py: 0.8.0's widths, 1 + 1 blocks, fp8
# storage, ~2.2 GB each) and VAE, built once into the ComfyUI's model folders
NATIVE_FLUX2 = {"flux2-dev": "xdit-native-flux2-dev.safetensors",
                "flux2-klein": "xdit-native-flux2-klein.safetensors"}
FLUX2_VAE_NAME = "xdit-test-flux2-vae.safetensors"
REL_TOL = 1e-3
ULYSSES2 = dict(SETTINGS["xDiT.ParallelSettings"][1], ulysses=2)  # the node's inputs


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
                   kontext=diffusers_dir / KONTEXT_NAME,
                   has_flux2=comfyui_has_flux2(server["base"]))


def comfyui_has_flux2(base: str) -> bool:
    """Whether the running ComfyUI has FLUX.2 (comfy.model_base.Flux2 and co.): its
    /object_info lists EmptyFlux2LatentImage (comfy_extras/nodes_flux.py), the FLUX.2 latent
    node that ComfyUI ships with its FLUX.2 model (0.8.0 has both, 0.3.64 neither)."""
    return "EmptyFlux2LatentImage" in http(base, "/object_info")


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
    saved = [o for o in history(comfy, pid)["outputs"].values()
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
                "inputs": ULYSSES2},
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


def test_flux2_ksampler_on_the_xdit_model_refused_or_runs(comfy):
    """Stock KSampler on xDiT.ToModel's MODEL of the FLUX.2 folder. A ComfyUI without a FLUX.2
    model class (0.3.64): xDiT.ToModel says so in one message. A ComfyUI with one (0.8.0):
    the MODEL is built on ComfyUI's FLUX.2 class and KSampler samples on the pool (FLUX.2's
    128-channel LATENT, decoded by xDiT.Decode). Either way the next job runs on the warm
    pool."""
    image = str(comfy["tmp"] / "flux2-ksampler.safetensors")
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": FLUX2_NAME, "device": "cpu", "dtype": "fp32",
                         "world_size": "2", "parallel": ["101", 0]}},
        "101": {"class_type": "xDiT.ParallelSettings",
                "inputs": ULYSSES2},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "XDiTTestFlux2Conditioning",
              "inputs": {"text": "a cube", "model_folder": str(comfy["flux2"]),
                         "max_sequence_length": 16}},
        # FLUX.2's own empty latent where ComfyUI has FLUX.2 ([1, 128, 4, 4]: 64 x 64
        # pixels); the size an EmptySD3LatentImage stands for on FLUX.2 is ComfyUI's choice
        # and changed (0.8.0: 16x its size, 0.33.0: 8x, its downscale_ratio_spacial)
        "4": {"class_type": "EmptyFlux2LatentImage" if comfy["has_flux2"]
              else "EmptySD3LatentImage",
              "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": ["2", 0], "seed": 1, "steps": 2, "cfg": 1.0,
                         "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
                         "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "XDiTTestSaveTensors",
              "inputs": {"images": ["7", 0], "latent": ["5", 0], "path": image}},
        "7": {"class_type": "xDiT.Decode", "inputs": {"model": ["1", 0], "samples": ["5", 0]}},
    }
    _, msgs = run(comfy, wf)
    if comfy["has_flux2"]:
        _ok(msgs)
        got = tensors(image)
        assert got["latent"].shape == (1, 128, 4, 4), got["latent"].shape
        assert got["image"].shape == (1, 64, 64, 3), got["image"].shape
        assert torch.isfinite(got["latent"]).all() and float(got["latent"].std()) > 1e-2
        steps = [m["data"]["value"] for m in msgs
                 if m.get("type") == "progress" and m["data"].get("node") == "5"]
        assert steps and steps[-1] == 2  # KSampler's own progress, 2 steps
    else:
        assert msgs[-1]["type"] == "execution_error", msgs[-1]
        err = msgs[-1]["data"]["exception_message"]
        assert "ComfyUI with FLUX.2 support" in err and "Sampler (xDiT)" in err, err
        assert msgs[-1]["data"]["node_type"] == "xDiT.ToModel"
    out = str(comfy["tmp"] / "flux2-after")
    _, msgs = run(comfy, _flux2_graph(comfy, out))
    _ok(msgs)


def _rel_l2(a, b) -> float:
    return float((a - b).double().norm() / b.double().norm())


def _file_graph(branch: str, variant: str, layout: dict, out: str, cfg: float) -> dict:
    """KSampler (euler / simple, 2 steps, cfg `cfg`) on one FLUX.2 single file, then
    VAEDecode with the FLUX.2 test VAE; latent and image saved. branch "n": ComfyUI's own
    model (UNETLoader, weight_dtype fp8_e4m3fn: the file's fp8 weights kept, computed in
    fp32); branch "x": the xDiT MODEL (xDiT.LoadModel of the same file, 2 CPU ranks, fp32,
    the layout on Parallel settings (xDiT))."""
    from native_models import COND_DIMS
    ctx, _ = COND_DIMS[variant]  # FLUX.2: no pooled text
    wf = {
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": ctx, "pooled_dim": 0,
                         "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 8, "context_dim": ctx, "pooled_dim": 0,
                         "guidance": -1.0}},
        "6": {"class_type": "EmptyFlux2LatentImage",
              "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "9": {"class_type": "VAELoader", "inputs": {"vae_name": FLUX2_VAE_NAME}},
        # [dev] embeds guidance (FluxGuidance, as its ComfyUI graphs set it); [klein] has no
        # guidance embedding: ComfyUI's model and the pool's both ignore the value
        "14": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["4", 0],
                                                        "guidance": 4.0}},
        "7": {"class_type": "KSampler",
              "inputs": {"model": ["2", 0], "seed": 7, "steps": 2, "cfg": cfg,
                         "sampler_name": "euler", "scheduler": "simple",
                         "positive": ["14", 0], "negative": ["5", 0],
                         "latent_image": ["6", 0], "denoise": 1.0}},
        "10": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["9", 0]}},
        "12": {"class_type": "XDiTTestSaveTensors",
               "inputs": {"images": ["10", 0], "latent": ["7", 0], "path": out}},
    }
    if branch == "n":
        wf["2"] = {"class_type": "UNETLoader", "inputs": {"unet_name": NATIVE_FLUX2[variant],
                                                           "weight_dtype": "fp8_e4m3fn"}}
    else:
        wf["1"] = {"class_type": "xDiT.LoadModel",
                   "inputs": {"model": f"diffusion_models/{NATIVE_FLUX2[variant]}",
                              "device": "cpu", "dtype": "fp32", "world_size": "2"}}
        wf["2"] = {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}}
        with_settings(wf, "1", **layout)
    return wf


LAYOUTS = {"ulysses2": {"ulysses": 2}, "cfg_parallel": {"cfg_parallel": True}}


@pytest.mark.parametrize("variant", sorted(NATIVE_FLUX2))
def test_flux2_ksampler_on_the_pool_matches_comfyui_own_flux2(comfy, variant):
    """KSampler on the xDiT MODEL of a FLUX.2 single file == KSampler on ComfyUI's own FLUX.2
    model from the same file (<= 1e-3 relative L2, LATENT and decoded image), at Ulysses 2
    and at CFG parallel (cfg 2: every call carries the conditional and unconditional rows).
    The file is FLUX.2-wide (ComfyUI fixes the widths) with 1 double + 1 single block and
    fp8 weights (tests/native_models.py says why); [dev]-shaped (guidance embedding,
    Mistral-3 text width) and [klein]-shaped (neither; Qwen3 text width). The branches run
    one after the other, never side by side: ComfyUI's once (its process peaks at ~5.2 GB),
    then the pool's per layout (~9-10 GB for both ranks: 4.7 GB of weights each, one layer's
    fp32 copy while it runs, torch). ~6-7 minutes per variant on 2 CPU cores."""
    if not comfy["has_flux2"]:
        pytest.skip("this ComfyUI has no FLUX.2 model (EmptyFlux2LatentImage is not in its "
                    "/object_info): nothing native to compare with")
    from native_models import native_single_file
    models = Path(COMFY) / "models"
    native_single_file(variant, models / "diffusion_models" / NATIVE_FLUX2[variant])
    comfy_flux2_vae(models / "vae" / FLUX2_VAE_NAME)
    http(comfy["base"], "/xdit/unload", {})
    cfg = 2.0
    paths = {b: str(comfy["tmp"] / f"{variant}-{b}.safetensors")
             for b in ("n", *LAYOUTS)}
    wait_for_memory(6, "ComfyUI's own FLUX.2 model (fp8, ~2.3 GB, plus its load)")
    _, msgs = run(comfy, _file_graph("n", variant, {}, paths["n"], cfg), timeout=1800)
    _ok(msgs)
    # ComfyUI's queue wakes on /free and drops its model (and cached outputs) at once
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})
    native = tensors(paths["n"])
    assert native["latent"].shape == (1, 128, 4, 4) and native["image"].shape == (1, 64, 64, 3)
    # a non-trivial result: the comparison can see a difference. FLUX.2's latent format is
    # the identity, so a model whose predictions did not matter would give back the seed's
    # noise (ComfyUI's prepare_noise)
    noise = torch.randn(native["latent"].shape, generator=torch.manual_seed(7))
    moved = _rel_l2(native["latent"], noise)
    assert moved > 0.1 and float(native["image"].std()) > 1e-3, moved
    figs = {}
    for name, layout in LAYOUTS.items():
        # 2 ranks x (fp8 blocks 1.5 GB + the fp32 rest 2.9-3.3 GB + a layer's fp32 copy +
        # torch): MemAvailable fell by ~9-10 GB while they ran
        wait_for_memory(11, "a 2-rank FLUX.2-wide pool")
        _, msgs = run(comfy, _file_graph("x", variant, layout, paths[name], cfg),
                      timeout=1800)
        _ok(msgs)
        http(comfy["base"], "/xdit/unload", {})  # the next layout's ranks load afresh
        got = tensors(paths[name])
        figs[name] = {"latent_rel_l2": _rel_l2(got["latent"], native["latent"]),
                      "image_rel_l2": _rel_l2(got["image"], native["image"]),
                      "latent_max_abs": float((got["latent"] - native["latent"]).abs().max())}
        print(f"\n{variant} {name}: {json.dumps(figs[name])} (native latent vs noise "
              f"{moved:.3f})")
    for name, fig in figs.items():
        assert fig["latent_rel_l2"] <= REL_TOL and fig["image_rel_l2"] <= REL_TOL, (name, fig)


def _kontext_graph(comfy, out: str, reference: bool, method: str = "") -> dict:
    """FLUX.1 (the tiny folder as a Kontext stand-in): EmptyImage -> VAEEncode (the test VAE)
    -> ReferenceLatent on the positive CONDITIONING -> Sampler (xDiT) -> saved LATENT."""
    positive = ["3", 0]
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": KONTEXT_NAME, "device": "cpu", "dtype": "fp32",
                         "world_size": "2", "parallel": ["101", 0]}},
        "101": {"class_type": "xDiT.ParallelSettings",
                "inputs": ULYSSES2},
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
