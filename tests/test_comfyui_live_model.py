"""The xDiT MODEL under stock KSampler in a real ComfyUI (skipped unless COMFYUI_PATH is set).

COMFYUI_PATH: a ComfyUI checkout; COMFYUI_PYTHON: its venv's python (with this pack's
requirements). The fixture links this pack and a test-only helper pack
(tests/live_helpers/xdit_test_model_nodes: a seeded random CONDITIONING and a node that saves
IMAGE / LATENT tensors at full precision) into custom_nodes/, writes random single files that
ComfyUI's own UNETLoader detects correctly (tests/native_models.py) into
models/diffusion_models/ and a random 16-channel VAE into models/vae/, and starts
`main.py --cpu`.

Each comparison is one graph with two branches from the same seed, latent, CONDITIONING and
VAE: stock KSampler on "MODEL for KSampler (xDiT)" (xDiT.LoadModel of the file on a 2-rank
CPU fp32 pool, the layout on Parallel / Engine settings (xDiT)) and stock KSampler on ComfyUI's own model (UNETLoader, weight_dtype default),
each decoded by VAEDecode; the decoded IMAGE tensors must agree to 1e-3.
* SD3 (cfg 3.5, so every call carries the conditional and unconditional rows) at Ulysses 2
  and at CFG parallel, with euler/simple and dpmpp_2m/beta;
* FLUX (FLUX.1-wide, 1 double + 1 single block: ComfyUI hard-codes FLUX's widths) at
  Ulysses 2 through FluxGuidance, with the same two samplers.
The KSampler examples (example_workflows/xdit_{flux,sd3}_ksampler_api.json) run with the tiny
model folders, the test VAE and random conditioning substituted. ComfyUI's LoraLoader (0.8)
and LoraLoaderModelOnly (-0.6) on the xDiT MODEL equal the same loaders on ComfyUI's own model
(SD3 and FLUX, Ulysses 2 and CFG parallel; rel L2 of the LATENT <= 1e-3); a LoKr file is
refused. The same file runs under each tested ComfyUI (0.3.64, 0.8.0, 0.33.0: docs/testing.md).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from live_comfy import (COMFY, ROOT, comfy_vae, history, http, link_packs, run, running_comfyui,
                        skip_without_comfyui, tensors, wait_for_memory, with_settings)

pytestmark = skip_without_comfyui

VAE_NAME = "xdit-test-vae.safetensors"
FILES = {"sd3": "xdit-native-sd3.safetensors", "flux": "xdit-native-flux.safetensors"}
# models/diffusers/<name>: the tiny folders standing in for the KSampler examples' models
TINY = {"flux": "xdit-test-flux-ksampler", "sd3": "xdit-test-sd3-ksampler"}
EXAMPLES = {"xdit_flux_ksampler_api.json": "flux", "xdit_sd3_ksampler_api.json": "sd3"}
TOL = 1e-3
SAMPLERS = [("euler", "simple"), ("dpmpp_2m", "beta")]


@pytest.fixture(scope="module")
def comfy(model_dir, tmp_path_factory):
    from native_models import native_single_file

    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-model-nodes")
    files = comfy / "models" / "diffusion_models"
    files.mkdir(parents=True, exist_ok=True)
    # the FLUX.1-wide file is ~1.1 GB: built once, then kept beside the other models
    for arch, name in FILES.items():
        native_single_file(arch, files / name)
    comfy_vae(comfy / "models" / "vae" / VAE_NAME)
    for arch, name in TINY.items():
        tiny = comfy / "models" / "diffusers" / name
        if not tiny.exists():
            tiny.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(model_dir(arch), tiny)
    log = tmp_path_factory.mktemp("comfy-model") / "comfyui.log"
    with running_comfyui(comfy, log) as server:
        yield dict(server, tmp=log.parent,
                   tiny={a: comfy / "models" / "diffusers" / n for a, n in TINY.items()})


def _compare_graph(comfy, arch: str, layout: dict, sampler: str, scheduler: str, cfg: float,
                   tag: str, size: int = 64, steps: int = 4, seed: int = 7,
                   reference: bool = False) -> dict:
    """API graph: the same KSampler on the xDiT MODEL ("x" branch) and on ComfyUI's own model
    loaded from the same file ("n" branch), both decoded with the same VAE and saved.
    `reference`: FLUX.1 Kontext's way, a VAEEncode'd image on the positive CONDITIONING
    through ReferenceLatent (ComfyUI's own FLUX joins its tokens to the image stream)."""
    ctx_dim, pooled_dim = {"sd3": (4096, 2048), "flux": (4096, 768)}[arch]
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{FILES[arch]}", "device": "cpu",
                         "dtype": "fp32", "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": FILES[arch],
                                                      "weight_dtype": "default"}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": ctx_dim,
                         "pooled_dim": pooled_dim, "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 8, "context_dim": ctx_dim,
                         "pooled_dim": pooled_dim, "guidance": -1.0}},
        "6": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": size, "height": size, "batch_size": 1}},
        "9": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_NAME}},
    }
    with_settings(wf, "1", **layout)  # Parallel / Engine settings (xDiT)
    positive = ["4", 0]
    if arch == "flux":  # embedded guidance through ComfyUI's own node
        wf["14"] = {"class_type": "FluxGuidance", "inputs": {"conditioning": ["4", 0],
                                                             "guidance": 3.5}}
        positive = ["14", 0]
    if reference:
        wf["15"] = {"class_type": "EmptyImage",
                    "inputs": {"width": 48, "height": 64, "batch_size": 1, "color": 0x3366CC}}
        wf["16"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["15", 0], "vae": ["9", 0]}}
        wf["17"] = {"class_type": "ReferenceLatent",
                    "inputs": {"conditioning": positive, "latent": ["16", 0]}}
        positive = ["17", 0]
    for b, model, k, d, s in (("x", ["2", 0], "7", "10", "12"), ("n", ["3", 0], "8", "11", "13")):
        wf[k] = {"class_type": "KSampler",
                 "inputs": {"model": model, "seed": seed, "steps": steps, "cfg": cfg,
                            "sampler_name": sampler, "scheduler": scheduler,
                            "positive": positive, "negative": ["5", 0],
                            "latent_image": ["6", 0], "denoise": 1.0}}
        wf[d] = {"class_type": "VAEDecode", "inputs": {"samples": [k, 0], "vae": ["9", 0]}}
        wf[s] = {"class_type": "XDiTTestSaveTensors",
                 "inputs": {"images": [d, 0], "latent": [k, 0], "path": out[b]}}
    return wf, out


def _compare(comfy, arch, layout, sampler, scheduler, cfg, tag, **kw) -> dict:
    wf, out = _compare_graph(comfy, arch, layout, sampler, scheduler, cfg, tag, **kw)
    _, msgs = run(comfy, wf, timeout=1500)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    x, n = tensors(Path(out["x"])), tensors(Path(out["n"]))
    assert x["image"].shape == n["image"].shape and x["image"].shape[-1] == 3
    fig = {"image_max_abs": float((x["image"] - n["image"]).abs().max()),
           "latent_max_abs": float((x["latent"] - n["latent"]).abs().max()),
           "latent_max": float(n["latent"].abs().max()),
           "image_std": float(n["image"].std())}
    print(f"\n{tag}: {json.dumps(fig)}")
    # the comparison can see a difference: a non-trivial latent and image
    assert fig["latent_max"] > 0.05 and fig["image_std"] > 1e-3, fig
    assert fig["image_max_abs"] <= TOL, fig
    assert fig["latent_max_abs"] <= TOL, fig
    return {"x": x, "n": n, "fig": fig, "msgs": msgs}


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg_parallel": True}],
                         ids=["ulysses2", "cfg_parallel"])
def test_sd3_ksampler_on_the_pool_matches_comfyui_own_model(comfy, layout):
    results = {}
    for sampler, scheduler in SAMPLERS:
        tag = f"sd3-{'-'.join(map(str, layout.values()))}-{sampler}"
        results[sampler] = _compare(comfy, "sd3", layout, sampler, scheduler, 3.5, tag)
    # the two samplers give different images: the 1e-3 agreement above is not vacuous
    a, b = (results[s]["n"]["image"] for s, _ in SAMPLERS)
    assert float((a - b).abs().max()) > 1e-2
    st = http(comfy["base"], "/xdit/status")
    pool = next(p for p in st["pools"] if p["model"].endswith(FILES["sd3"]))
    assert pool["world_size"] == 2


def test_flux_ksampler_on_the_pool_matches_comfyui_own_model(comfy):
    """FLUX.1-wide (1 + 1 blocks, bf16 file, fp32 compute) at Ulysses 2, FluxGuidance 3.5."""
    http(comfy["base"], "/xdit/unload", {})  # room for the 0.55 B-parameter ranks
    results = {}
    for sampler, scheduler in SAMPLERS:
        results[sampler] = _compare(comfy, "flux", {"ulysses": 2}, sampler, scheduler, 1.0,
                                    f"flux-ulysses2-{sampler}", steps=3)
    a, b = (results[s]["n"]["image"] for s, _ in SAMPLERS)
    assert float((a - b).abs().max()) > 1e-2
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})


def test_step_cache_on_the_model_under_ksampler(comfy):
    """Step cache (xDiT) into MODEL for KSampler (xDiT): stock KSampler (SD3, cfg 3.5: both
    rows in every call) skips calls, the KSampler node's text counts this run's calls computed
    in full, and the result moves away from ComfyUI's own uncached model but stays finite;
    the next run (another seed: ComfyUI would reuse an unchanged graph's outputs) counts from
    zero again."""
    wf, out = _compare_graph(comfy, "sd3", {"ulysses": 2}, "euler", "simple", 3.5,
                             "sd3-cache", steps=6)
    wf["20"] = {"class_type": "xDiT.CacheSettings",
                "inputs": {"threshold": 5.0, "warmup": 1, "head_blocks": 1, "tail_blocks": 0,
                           "max_skips": 0, "taylor": False}}
    wf["2"]["inputs"]["cache"] = ["20", 0]
    for seed in (7, 8):
        wf["7"]["inputs"]["seed"] = wf["8"]["inputs"]["seed"] = seed
        _, msgs = run(comfy, wf, timeout=1500)
        assert msgs[-1]["type"] == "execution_success", msgs[-1]
        texts = [m["text"] for m in msgs if m.get("type") == "progress_text" and m["node"] == "7"]
        # per row: call 1 computes, the other 5 skip; 2 rows on rank 0 (one replica)
        assert texts and texts[-1] == "xDiT: 2/12 calls in full", texts
        x, n = tensors(Path(out["x"])), tensors(Path(out["n"]))
        assert torch.isfinite(x["latent"]).all()
        assert float((x["latent"] - n["latent"]).abs().max()) > TOL


def test_flux_kontext_reference_ksampler_matches_comfyui_own_model(comfy):
    """KSampler + ReferenceLatent + xDiT.ToModel (FLUX.1 Kontext's graph) against the same
    KSampler on ComfyUI's own FLUX model from the same file: the references travel with the
    conditioning to the pool and land where ComfyUI puts them (Ulysses 2, euler)."""
    http(comfy["base"], "/xdit/unload", {})
    with_ref = _compare(comfy, "flux", {"ulysses": 2}, "euler", "simple", 1.0,
                        "flux-kontext-ulysses2", steps=2, reference=True)
    plain = _compare(comfy, "flux", {"ulysses": 2}, "euler", "simple", 1.0,
                     "flux-plain-ulysses2", steps=2)["n"]
    # the reference changed ComfyUI's own result too: the agreement is about the reference
    assert float((with_ref["n"]["latent"] - plain["latent"]).abs().max()) > 1e-3
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_ksampler_example_workflow_runs(comfy, name):
    """The KSampler example (API format) with the tiny model folder, the test VAE and a random
    CONDITIONING of the tiny model's widths (in place of ComfyUI's text encoders, which only
    load the real encoders) substituted; everything else as shipped."""
    arch = EXAMPLES[name]
    wf = json.loads((ROOT / "example_workflows" / name).read_text())
    by_type = {}
    for nid, node in wf.items():
        by_type.setdefault(node["class_type"], []).append(nid)
    assert {"xDiT.LoadModel", "xDiT.ToModel", "KSampler", "SaveImage"} <= set(by_type)
    loader = wf[by_type["xDiT.LoadModel"][0]]["inputs"]
    assert loader["device"] == "auto" and loader["world_size"] == "auto"
    loader.update(model=TINY[arch], device="cpu")  # auto layout on 2 CPU ranks
    cfg = json.loads((comfy["tiny"][arch] / "transformer" / "config.json").read_text())
    for nid in by_type.get("CLIPTextEncode", []):  # the text encoders' CONDITIONING
        wf[nid] = {"class_type": "XDiTTestRandomConditioning",
                   "inputs": {"seed": int(nid), "tokens": 8,
                              "context_dim": cfg["joint_attention_dim"],
                              "pooled_dim": cfg["pooled_projection_dim"], "guidance": -1.0}}
    for t in ("DualCLIPLoader", "TripleCLIPLoader"):
        for nid in by_type.get(t, []):
            del wf[nid]
    for nid in by_type.get("VAELoader", []):
        wf[nid]["inputs"]["vae_name"] = VAE_NAME
    latent = next(n for n in wf.values() if n["class_type"] == "EmptySD3LatentImage")
    latent["inputs"].update(width=64, height=64)
    ks = wf[by_type["KSampler"][0]]["inputs"]
    ks["steps"] = 3
    save = by_type["SaveImage"][0]
    wf[save]["inputs"]["filename_prefix"] = f"xdit-live-ksampler-{arch}"
    pid, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    progress = [m["data"] for m in msgs if m.get("type") == "progress"
                and m["data"].get("node") == by_type["KSampler"][0]]
    assert progress and progress[-1]["value"] == 3  # KSampler's own progress bar
    images = history(comfy, pid)["outputs"][save]["images"]
    assert images[0]["filename"].startswith(f"xdit-live-ksampler-{arch}")
    st = http(comfy["base"], "/xdit/status")
    pool = next(p for p in st["pools"] if p["model"].endswith(TINY[arch]))
    assert pool["world_size"] == 2


def test_compiled_pool_under_ksampler_says_compiling_and_matches(comfy):
    """compile=True behind the xDiT MODEL: the KSampler node shows "compiling" while the
    pool's first calls compile, and the result still equals ComfyUI's own model."""
    http(comfy["base"], "/xdit/unload", {})
    got = _compare(comfy, "sd3", {"ulysses": 2, "compile": True}, "euler", "simple", 3.5,
                   "sd3-compiled")
    texts = [m["text"] for m in got["msgs"] if m.get("type") == "progress_text"
             and m["node"] == "7"]
    assert any(t.startswith("compiling") for t in texts), texts
    http(comfy["base"], "/xdit/unload", {})



def _lora_pair(g, rows: int, cols: int, prefix: str, kind: str) -> dict:
    """One layer's LoRA tensors (rank 4, alpha 8, entries ~0.05) in a file format's names:
    "diffusers" (PEFT's lora_A / lora_B) or "kohya" (lora_down / lora_up)."""
    down = torch.randn(4, cols, generator=g) * 0.05
    up = torch.randn(rows, 4, generator=g) * 0.05
    a, b = ("lora_A", "lora_B") if kind == "diffusers" else ("lora_down", "lora_up")
    return {f"{prefix}.{a}.weight": down, f"{prefix}.{b}.weight": up,
            f"{prefix}.alpha": torch.tensor(8.0)}


def _write_lora(arch: str, path: Path, native: Path, seed: int) -> None:
    """A LoRA for the native file's widths, in the formats ComfyUI maps onto it.
    SD3: diffusers names on to_q, to_k and to_out.0 of every block's image stream (to_q /
    to_k are rows of ComfyUI's fused qkv). FLUX (seed 1): kohya's BFL names on the double
    block's fused img qkv and txt proj and the single block's linear1 (whole weights);
    FLUX (seed 2): diffusers names on to_q / to_k (rows of the fused img qkv), to_out.0 and
    the single block's to_q (rows of linear1)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(native), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    g = torch.Generator().manual_seed(seed)
    sd = {}
    if arch == "sd3":
        qkv = [k for k in shapes if k.endswith("x_block.attn.qkv.weight")]
        h = shapes[qkv[0]][1]
        for k in qkv:
            i = k.split("joint_blocks.")[1].split(".")[0]
            for n in ("to_q", "to_k", "to_out.0"):
                sd.update(_lora_pair(g, h, h, f"transformer.transformer_blocks.{i}.attn.{n}",
                                     "diffusers"))
    elif seed == 1:
        for name in ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.proj",
                     "single_blocks.0.linear1"):
            rows, cols = shapes[f"{name}.weight"]
            sd.update(_lora_pair(g, rows, cols, "lora_unet_" + name.replace(".", "_"),
                                 "kohya"))
    else:
        h = shapes["double_blocks.0.img_attn.qkv.weight"][1]
        for n in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                  "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.attn.to_q"):
            sd.update(_lora_pair(g, h, h, f"transformer.{n}", "diffusers"))
    save_file(sd, str(path))


def _clip_stand_in(path: Path) -> None:
    """A text-encoder file CLIPLoader (type stable_diffusion) takes as a CLIP-L: one CLIP-L
    weight (the rest stays uninitialised in ComfyUI; the CLIP is never run): LoraLoader
    needs a CLIP beside the MODEL, and these LoRA files hold no CLIP weights."""
    from safetensors.torch import save_file
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"text_model.encoder.layers.0.mlp.fc1.weight":
                   torch.zeros(3072, 768, dtype=torch.float16)}, str(path))


LORA_CFG = {"sd3": 3.5, "flux": 2.0}  # both CFG rows in every call (CFG parallel splits them)


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg_parallel": True}],
                         ids=["ulysses2", "cfg_parallel"])
@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_lora_loaders_on_the_xdit_model_match_comfyui_own_model(comfy, arch, layout):
    """LoraLoader (strength 0.8, with a CLIP beside the MODEL) then LoraLoaderModelOnly
    (-0.6) on the xDiT MODEL (2 ranks) and on ComfyUI's own model, from the same single file
    and the same LoRA files (SD3: diffusers, rows of the fused qkv; FLUX.1-wide: kohya BFL
    names, then diffusers names on rows of the fused qkv and linear1): KSampler's LATENTs
    agree to rel L2 1e-3, and the LoRAs move ComfyUI's own result (a third branch without
    them, same graph): the agreement is not vacuous."""
    comfy_path = Path(COMFY)
    loras = comfy_path / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    native = comfy_path / "models" / "diffusion_models" / FILES[arch]
    clip_name = "xdit-test-clip-stand-in.safetensors"
    _clip_stand_in(comfy_path / "models" / "text_encoders" / clip_name)
    names = []
    for seed in (1, 2):
        name = f"xdit-test-{arch}-lora-{seed}.safetensors"
        _write_lora(arch, loras / name, native, seed)
        names.append(name)
    if arch == "flux":
        http(comfy["base"], "/xdit/unload", {})  # room for the 0.55 B-parameter ranks
    tag = f"{arch}-lora-{'-'.join(map(str, layout.values()))}"
    wf, out = _compare_graph(comfy, arch, layout, "euler", "simple", LORA_CFG[arch], tag,
                             steps=3 if arch == "flux" else 4)
    wf["29"] = {"class_type": "CLIPLoader",
                "inputs": {"clip_name": clip_name, "type": "stable_diffusion"}}
    for branch, model, k in (("x", ["2", 0], "7"), ("n", ["3", 0], "8")):
        first, second = f"{30 + (branch == 'n')}", f"{32 + (branch == 'n')}"
        wf[first] = {"class_type": "LoraLoader",
                     "inputs": {"model": model, "clip": ["29", 0], "lora_name": names[0],
                                "strength_model": 0.8, "strength_clip": 1.0}}
        wf[second] = {"class_type": "LoraLoaderModelOnly",
                      "inputs": {"model": [first, 0], "lora_name": names[1],
                                 "strength_model": -0.6}}
        wf[k]["inputs"]["model"] = [second, 0]
    plain = str(comfy["tmp"] / f"{tag}-plain.safetensors")  # ComfyUI's model, no LoRA
    wf["40"] = dict(wf["8"], inputs=dict(wf["8"]["inputs"], model=["3", 0]))
    wf["41"] = {"class_type": "XDiTTestSaveTensors",
                "inputs": {"latent": ["40", 0], "path": plain}}
    # ComfyUI's branches, then (its model freed) the pool's: never both models in memory
    # at once (FLUX.1-wide: ~2 GB in ComfyUI, ~2.4 GB per rank)
    own = {"3", "8", "11", "13", "31", "33", "40", "41"}
    pool = {k for k in wf if k in ("1", "2", "7", "10", "12", "30", "32")
            or k.startswith("10") and len(k) == 3}
    for part in (own, pool):
        wait_for_memory(8 if arch == "flux" else 3, f"{arch}'s LoRA branches")
        graph = {k: v for k, v in wf.items() if k in part or k not in own | pool}
        _, msgs = run(comfy, graph, timeout=1800)
        assert msgs[-1]["type"] == "execution_success", msgs[-1]
        http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})
    x, n = tensors(Path(out["x"])), tensors(Path(out["n"]))
    p = tensors(Path(plain))
    rel = float((x["latent"] - n["latent"]).norm() / n["latent"].norm())
    moved = float((p["latent"] - n["latent"]).norm() / n["latent"].norm())
    print(f"\n{tag}: rel L2 xDiT vs ComfyUI = {rel:.2e}; LoRA vs none = {moved:.2e}")
    assert float(n["latent"].abs().max()) > 0.05
    assert rel <= TOL, rel
    assert moved > 3 * TOL, moved  # (SD3: 6.6e-3 measured, against 3e-7 for the agreement)
    http(comfy["base"], "/xdit/unload", {})


def test_comfyui_lokr_loader_on_the_xdit_model_is_refused(comfy):
    """ComfyUI's LoraLoaderModelOnly with a LoKr file on the xDiT MODEL fails with one line
    naming the LoKr adapter and the weight (the pool applies LoRA patches only; ComfyUI
    would otherwise sample without it), and ComfyUI keeps serving."""
    from safetensors.torch import save_file
    loras = Path(COMFY) / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    name = "xdit-test-lokr.safetensors"
    # ComfyUI's own name of a weight of the SD3 file (its generic `diffusion_model.` format)
    save_file({"diffusion_model.joint_blocks.0.x_block.attn.proj.lokr_w1": torch.ones(8, 8),
               "diffusion_model.joint_blocks.0.x_block.attn.proj.lokr_w2": torch.ones(8, 8)},
              str(loras / name))
    wf, _ = _compare_graph(comfy, "sd3", {}, "euler", "simple", 1.0, "lokr-refused")
    wf["20"] = {"class_type": "LoraLoaderModelOnly",
                "inputs": {"model": ["2", 0], "lora_name": name, "strength_model": 0.8}}
    wf["7"]["inputs"]["model"] = ["20", 0]
    for k in ("3", "8", "11", "13"):  # the native branch is not needed here
        wf.pop(k)
    _, msgs = run(comfy, wf, timeout=600)
    last = msgs[-1]
    assert last["type"] == "execution_error", last
    assert last["data"]["node_type"] == "LoraLoaderModelOnly", last["data"]
    msg = last["data"]["exception_message"]
    assert "LoKr adapter" in msg and "joint_blocks.0.x_block.attn.proj" in msg, msg
    assert "xDiT.LoadModel" in http(comfy["base"], "/object_info")  # still serving
