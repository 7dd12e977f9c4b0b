"""GGUF files: KSampler on the xDiT MODEL against KSampler on ComfyUI-GGUF's model of the same
file, in a real ComfyUI (skipped unless COMFYUI_PATH is set and ComfyUI-GGUF, city96's custom
node pack with UnetLoaderGGUF, is installed in its custom_nodes/; docs/testing.md).

The GGUF files are ComfyUI-GGUF-style copies (comfyui_xdit/testmodels/gguf_file.py) of the
single files ComfyUI's own UNETLoader detects (tests/native_models.py: SD3 with 2 blocks,
FLUX.1-wide with 1 + 1 blocks), in Q8_0, Q4_K, F16 and BF16, written once into models/diffusion_models/.
Per file, one graph from the same seed, latent and CONDITIONING: stock KSampler on
UnetLoaderGGUF's MODEL and on "MODEL for KSampler (xDiT)" of the same file on a 2-rank CPU fp32
pool at Ulysses 2 and at CFG parallel (cfg > 1: every call carries both rows). The LATENTs
agree to rel L2 1e-3. ComfyUI-GGUF dequantises in fp16 by default (its scales times the
quants, rounded to fp16), the pool in fp32: the figures printed are that rounding, not 0.
Then LoraLoaderModelOnly with the same LoRA on both models (Q8_0, Ulysses 2): they agree too,
and the LoRA moves the result.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from live_comfy import (COMFY, http, link_packs, run, running_comfyui,
                        skip_without_comfyui, tensors, wait_for_memory, with_settings)


def _gguf_pack() -> Path | None:
    """ComfyUI-GGUF's folder in COMFYUI_PATH/custom_nodes (the pack defining UnetLoaderGGUF,
    whatever its folder is called), or None."""
    nodes = Path(COMFY or ".") / "custom_nodes"
    for d in sorted(nodes.iterdir()) if COMFY and nodes.is_dir() else ():
        f = d / "nodes.py"
        if f.is_file() and "class UnetLoaderGGUF" in f.read_text(errors="replace"):
            return d
    return None


pytestmark = [skip_without_comfyui, pytest.mark.skipif(
    bool(COMFY) and _gguf_pack() is None,
    reason=f"ComfyUI-GGUF (UnetLoaderGGUF) is not installed in {COMFY}/custom_nodes "
           "(github.com/city96/ComfyUI-GGUF, and the gguf package in ComfyUI's venv)")]

NATIVE = {"sd3": "xdit-native-sd3.safetensors", "flux": "xdit-native-flux.safetensors"}
COND = {"sd3": (4096, 2048), "flux": (4096, 768)}  # (context, pooled) widths
CFG = {"sd3": 3.5, "flux": 2.0}
STEPS = {"sd3": 4, "flux": 3}
QTYPES = ["Q8_0", "Q4_K", "F16", "BF16"]  # quantised blocks and plain floats
LAYOUTS = {"ulysses2": {"ulysses": 2}, "cfg_parallel": {"cfg_parallel": True}}
TOL = 1e-3


def _writer_key() -> str:
    """A digest of the GGUF writer's source: a file written by an older writer is rebuilt."""
    import hashlib
    from comfyui_xdit.testmodels import gguf_file
    return hashlib.sha256(Path(gguf_file.__file__).read_bytes()).hexdigest()[:8]


def gguf_name(arch: str, qtype: str) -> str:
    return f"xdit-gguf-{arch}-{qtype}-{_writer_key()}.gguf"


def gguf_file(arch: str, qtype: str) -> str:
    """The GGUF copy of the `arch` native file in `qtype`, in models/diffusion_models/
    (written once per writer version, when a test first needs it); its name."""
    from comfyui_xdit.testmodels.gguf_file import write_gguf_file
    files = Path(COMFY) / "models" / "diffusion_models"
    dst = files / gguf_name(arch, qtype)
    for old in files.glob(f"xdit-gguf-{arch}-{qtype}-*.gguf"):
        if old != dst:
            old.unlink()
    if not dst.exists():  # written aside, then renamed: never a half file
        tmp = write_gguf_file(files / NATIVE[arch], files / f".{dst.name}.part", qtype, arch)
        tmp.rename(dst)
    return dst.name


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from native_models import native_single_file

    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-model-nodes")
    files = comfy / "models" / "diffusion_models"
    files.mkdir(parents=True, exist_ok=True)
    for arch, name in NATIVE.items():  # built once and kept (FLUX.1-wide: ~1.1 GB)
        native_single_file(arch, files / name)
    log = tmp_path_factory.mktemp("comfy-gguf") / "comfyui.log"
    with running_comfyui(comfy, log) as server:
        info = http(server["base"], "/object_info/UnetLoaderGGUF")
        assert info, "ComfyUI-GGUF is in custom_nodes but UnetLoaderGGUF is not registered"
        yield dict(server, tmp=log.parent)


def _graph(comfy, arch: str, qtype: str, layouts: dict, tag: str, lora: str = "") -> tuple:
    """API graph: KSampler on UnetLoaderGGUF's MODEL ("gguf" branch) and on the xDiT MODEL of
    the same file at each of `layouts` (branch = layout name), LATENTs saved; with `lora`,
    LoraLoaderModelOnly (0.8) on each MODEL first. -> (graph, {branch: saved file})."""
    ctx, pooled = COND[arch]
    name = gguf_file(arch, qtype)  # ComfyUI lists a file added after its start
    wf = {
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": ctx, "pooled_dim": pooled,
                         "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 8, "context_dim": ctx, "pooled_dim": pooled,
                         "guidance": -1.0}},
        "6": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "10": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}},
    }
    positive = ["4", 0]
    if arch == "flux":  # embedded guidance through ComfyUI's own node
        wf["7"] = {"class_type": "FluxGuidance",
                   "inputs": {"conditioning": ["4", 0], "guidance": 3.5}}
        positive = ["7", 0]
    models = {"gguf": ["10", 0]}
    for i, (branch, layout) in enumerate(layouts.items()):
        load, to = f"2{i}", f"3{i}"
        wf[load] = {"class_type": "xDiT.LoadModel",
                    "inputs": {"model": f"diffusion_models/{name}", "device": "cpu",
                               "dtype": "fp32", "world_size": "2"}}
        with_settings(wf, load, **layout)
        wf[to] = {"class_type": "xDiT.ToModel", "inputs": {"model": [load, 0]}}
        models[branch] = [to, 0]
    out = {}
    for i, (branch, model) in enumerate(models.items()):
        if lora:
            wf[f"4{i}"] = {"class_type": "LoraLoaderModelOnly",
                           "inputs": {"model": model, "lora_name": lora,
                                      "strength_model": 0.8}}
            model = [f"4{i}", 0]
        out[branch] = str(comfy["tmp"] / f"{tag}-{branch}.safetensors")
        wf[f"5{i}"] = {"class_type": "KSampler",
                       "inputs": {"model": model, "seed": 7, "steps": STEPS[arch],
                                  "cfg": CFG[arch], "sampler_name": "euler",
                                  "scheduler": "simple", "positive": positive,
                                  "negative": ["5", 0], "latent_image": ["6", 0],
                                  "denoise": 1.0}}
        wf[f"6{i}"] = {"class_type": "XDiTTestSaveTensors",
                       "inputs": {"latent": [f"5{i}", 0], "path": out[branch]}}
    return wf, out


def _latents(comfy, wf: dict, out: dict) -> tuple:
    """Run `wf`; ({branch: LATENT}, the pools /xdit/status showed), then everything freed."""
    _, msgs = run(comfy, wf, timeout=1800)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    pools = http(comfy["base"], "/xdit/status")["pools"]
    http(comfy["base"], "/xdit/unload", {})
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})
    return {b: tensors(Path(p))["latent"] for b, p in out.items()}, pools


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_ksampler_on_the_xdit_model_of_a_gguf_file_matches_comfyui_gguf(comfy, arch, qtype):
    """UnetLoaderGGUF vs xDiT.LoadModel of the same GGUF file (2 ranks, Ulysses 2 and CFG
    parallel) under the same KSampler: rel L2 of the LATENTs <= 1e-3."""
    if arch == "flux":  # FLUX.1-wide: ComfyUI-GGUF's copy and two 2-rank pools
        wait_for_memory(8, "FLUX.1-wide's GGUF comparison")
    tag = f"gguf-{arch}-{qtype}"
    wf, out = _graph(comfy, arch, qtype, LAYOUTS, tag)
    lat, pools = _latents(comfy, wf, out)
    # the xDiT branches ran on 2-rank pools of the GGUF file
    assert {p["world_size"] for p in pools if p["model"].endswith(gguf_name(arch, qtype))} \
        == {2}, pools
    ref = lat.pop("gguf")
    assert float(ref.abs().max()) > 0.05  # a non-trivial latent: the agreement can fail
    rel = {b: _rel(x, ref) for b, x in lat.items()}
    print(f"\n{tag}: rel L2 xDiT vs ComfyUI-GGUF = {json.dumps(rel)}")
    assert all(r <= TOL for r in rel.values()), rel


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_lora_on_the_xdit_model_of_a_gguf_file_matches_comfyui_gguf(comfy, arch):
    """LoraLoaderModelOnly (0.8, one LoRA file: SD3 diffusers names on rows of the fused
    qkv; FLUX kohya BFL names) on UnetLoaderGGUF's MODEL and on the xDiT MODEL (Q8_0,
    Ulysses 2): rel L2 <= 1e-3, and the LoRA moves ComfyUI-GGUF's result (same graph
    without it)."""
    from test_comfyui_live_model import _write_lora
    comfy_path = Path(COMFY)
    loras = comfy_path / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    lora = f"xdit-test-gguf-{arch}-lora.safetensors"
    _write_lora(arch, loras / lora, comfy_path / "models" / "diffusion_models" / NATIVE[arch],
                seed=1)
    if arch == "flux":
        wait_for_memory(8, "FLUX.1-wide's GGUF LoRA comparison")
    tag = f"gguf-{arch}-lora"
    layouts = {"ulysses2": LAYOUTS["ulysses2"]}
    with_lora = _latents(comfy, *_graph(comfy, arch, "Q8_0", layouts, tag, lora=lora))[0]
    plain = _latents(comfy, *_graph(comfy, arch, "Q8_0", {}, tag + "-none"))[0]["gguf"]
    rel = _rel(with_lora["ulysses2"], with_lora["gguf"])
    moved = _rel(plain, with_lora["gguf"])
    print(f"\n{tag}: rel L2 xDiT vs ComfyUI-GGUF = {rel:.2e}; LoRA vs none = {moved:.2e}")
    assert rel <= TOL, rel
    assert moved > 3 * TOL, moved
