"""Qwen-Image and Chroma in a real ComfyUI (skipped unless COMFYUI_PATH is set).

COMFYUI_PATH: a ComfyUI checkout; COMFYUI_PYTHON: its venv's python (with this pack's
requirements). The fixture links this pack and the test-only helper packs into custom_nodes/,
puts the tiny Qwen-Image and Chroma folders into models/diffusers/ under the example
workflows' names (Qwen-Image, Chroma1-HD), a random Qwen-Image single file that ComfyUI's own
UNETLoader loads (tests/native_models.py: the released widths, 1 block, bf16) into
models/diffusion_models/, and starts `main.py --cpu --preview-method latent2rgb`. Then:
* the loader lists both folders and the Qwen-Image single file;
* the three examples run: xdit_qwen_image_text_to_image and xdit_chroma_text_to_image as
  shipped (device / world size auto, 1024x1024, their steps, the prompts typed into the
  sampler, decoded on the pool), xdit_qwen_image_ksampler with CLIPLoader + CLIPTextEncode
  replaced by a random CONDITIONING of the tiny model's text width (ComfyUI's CLIPLoader only
  loads the real Qwen2.5-VL) and 3 steps; each sampler's LATENT (saved by an added node) has
  ComfyUI's shape for the family (Qwen-Image: 5-D, one frame) and latent2rgb previews show;
* Qwen-Image: stock KSampler on the xDiT MODEL (xDiT.LoadModel of the single file, 2 CPU
  fp32 ranks) equals the same KSampler on ComfyUI's own model from the same file (UNETLoader),
  LATENT max abs difference <= 1e-3 (TOL), at Ulysses 2 and at CFG parallel, euler/simple and
  dpmpp_2m/beta, cfg 2.5 (both rows in every call), 64x64 pixels (an even 4x4 token grid:
  ComfyUI's and diffusers' RoPE centring differ by one position on odd grids). Both sides
  sample with ComfyUI's own schedule (ModelSamplingFlux, shift 1.15). Latents only: the
  single file has no VAE, and ComfyUI's VAEDecode of the 5-D latent needs a Wan 2.1 VAE.
* Chroma: ComfyUI hard-codes the released depths in its modulation-index table (344 rows)
  and the released widths, so a tiny Chroma cannot load into ComfyUI's own model and the
  comparison above is not possible. Instead stock KSampler on xDiT.ToModel of the tiny
  Chroma folder (CFG parallel, cfg 4 with a negative CONDITIONING) must equal a reference
  computed in this test process without the pool: diffusers' ChromaTransformer2DModel from
  the same folder driven by ComfyUI's sampling (ModelSamplingFlux shift 1.15 sigmas,
  "simple" scheduler, CFG on the denoised predictions, Euler, FLUX's latent format),
  written here from ComfyUI 0.3.64's formulas.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from live_comfy import (COMFY, ROOT, history, http, link_packs, place, run, running_comfyui,
                        skip_without_comfyui, tensors, twin_ksamplers, with_settings)

pytestmark = skip_without_comfyui

QWEN_NAME, CHROMA_NAME = "Qwen-Image", "Chroma1-HD"  # the examples' folder names
QWEN_FILE = "xdit-native-qwen-image.safetensors"
EXAMPLES = {"xdit_qwen_image_text_to_image_api.json": QWEN_NAME,
            "xdit_qwen_image_ksampler_api.json": QWEN_NAME,
            "xdit_chroma_text_to_image_api.json": CHROMA_NAME}
TOL = 1e-3
SAMPLERS = [("euler", "simple"), ("dpmpp_2m", "beta")]


@pytest.fixture(scope="module")
def comfy(model_dir, tmp_path_factory):
    from native_models import native_single_file

    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-helpers", "xdit-live-test-model-nodes")
    diffusers_dir = comfy / "models" / "diffusers"
    place(model_dir("qwen_image"), diffusers_dir / QWEN_NAME)
    place(model_dir("chroma"), diffusers_dir / CHROMA_NAME)
    files = comfy / "models" / "diffusion_models"
    files.mkdir(parents=True, exist_ok=True)
    native_single_file("qwen_image", files / QWEN_FILE)  # ~0.7 GB, kept between runs
    log = tmp_path_factory.mktemp("comfy-families") / "comfyui.log"
    with running_comfyui(comfy, log, "--preview-method", "latent2rgb") as server:
        yield dict(server, tmp=log.parent, qwen=diffusers_dir / QWEN_NAME,
                   chroma=diffusers_dir / CHROMA_NAME)


def _ok(msgs):
    last = msgs[-1]
    assert last["type"] == "execution_success", \
        (last["data"].get("node_type"), last["data"].get("exception_message"),
         "".join(last["data"].get("traceback") or [])[-3000:])


def _tiny_config(folder: Path) -> dict:
    return json.loads((folder / "transformer" / "config.json").read_text())


def test_loader_lists_the_folders_and_the_single_file(comfy):
    info = http(comfy["base"], "/object_info/xDiT.LoadModel")["xDiT.LoadModel"]
    models = json.dumps(info["input"]["required"]["model"])
    for name in (QWEN_NAME, CHROMA_NAME, f"diffusion_models/{QWEN_FILE}"):
        assert f'"{name}"' in models, (name, models)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_workflow_runs(comfy, name):
    wf = json.loads((ROOT / "example_workflows" / name).read_text())
    by_type = {}
    for nid, node in wf.items():
        by_type.setdefault(node["class_type"], []).append(nid)
    loader = wf[by_type["xDiT.LoadModel"][0]]["inputs"]
    assert loader["model"] == EXAMPLES[name]
    assert (loader["device"], loader["world_size"]) == ("auto", "auto")
    ksampler = by_type.get("KSampler", [None])[0]
    if ksampler is not None:  # the text encoders' CONDITIONING, 3 steps
        cfg = _tiny_config(comfy["qwen"])
        for nid in by_type["CLIPTextEncode"]:
            wf[nid] = {"class_type": "XDiTTestRandomConditioning",
                       "inputs": {"seed": int(nid), "tokens": 8,
                                  "context_dim": cfg["joint_attention_dim"], "pooled_dim": 1,
                                  "guidance": -1.0}}
        for nid in by_type["CLIPLoader"]:
            del wf[nid]
        wf[ksampler]["inputs"]["steps"] = 3
    sampler = ksampler or by_type["xDiT.Sampler"][0]
    latent_file = comfy["tmp"] / f"{name}-latent.safetensors"  # an added saver, at the end
    wf["99"] = {"class_type": "XDiTTestSaveTensors",
                "inputs": {"latent": [sampler, 0], "path": str(latent_file)}}
    pid, msgs = run(comfy, wf, timeout=1500)
    _ok(msgs)
    # ComfyUI's LATENT conventions: Qwen-Image's is 5-D with one frame (latent_formats.Wan21)
    latent = tensors(latent_file)["latent"]
    want = (1, 16, 1, 128, 128) if EXAMPLES[name] == QWEN_NAME else (1, 16, 128, 128)
    assert latent.shape == want and torch.isfinite(latent).all(), latent.shape
    saved = [o for o in history(comfy, pid)["outputs"].values()
             if o.get("images")]
    prefix = wf[by_type["SaveImage"][0]]["inputs"]["filename_prefix"]
    assert saved and saved[0]["images"][0]["filename"].startswith(prefix)
    img = http(comfy["base"], "/view?filename={filename}&subfolder={subfolder}&type={type}"
                .format(**saved[0]["images"][0]))
    from PIL import Image
    import io
    assert Image.open(io.BytesIO(img)).size == (1024, 1024)
    steps = wf[sampler]["inputs"]["steps"]
    progress = [m["data"] for m in msgs if m.get("type") == "progress"
                and m["data"].get("node") == sampler]
    assert progress and progress[-1]["value"] == steps, progress[-3:]
    # latent2rgb previews from the family's factors while it samples
    assert any(m.get("type") == "binary_preview" for m in msgs)
    pool = next(p for p in http(comfy["base"], "/xdit/status")["pools"]
                if p["model"].endswith(EXAMPLES[name]))
    done = [m["text"] for m in msgs if m.get("type") == "progress_text"
            and m["node"] == sampler]
    print(f"\n{name}: pool {pool['config']!r}; sampler text {done[-1:]}")
    if ksampler is None:  # cfg 4 with a negative prompt: auto splits the CFG branches
        assert done and done[-1].startswith(f"{steps} steps, 2 ranks (CFG parallel)"), done
    # auto on this CPU-only ComfyUI: cpu, fp32, 2 ranks
    assert (pool["device"], pool["dtype"], pool["world_size"]) == ("cpu", "fp32", 2), pool


def _qwen_compare_graph(comfy, layout: dict, sampler: str, scheduler: str, tag: str,
                        cfg: float = 2.5, steps: int = 3, size: int = 64, seed: int = 7):
    """The same KSampler on the xDiT MODEL ("x") and on ComfyUI's own Qwen-Image ("n"),
    both from the single file, CONDITIONING of width 3584 (no pooled output needed)."""
    out = {b: str(comfy["tmp"] / f"{tag}-{b}.safetensors") for b in ("x", "n")}
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": f"diffusion_models/{QWEN_FILE}", "device": "cpu",
                         "dtype": "fp32", "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": QWEN_FILE,
                                                      "weight_dtype": "default"}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": 3584, "pooled_dim": 1,
                         "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 6, "context_dim": 3584, "pooled_dim": 1,
                         "guidance": -1.0}},
        "6": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": size, "height": size, "batch_size": 1}},
    }
    with_settings(wf, "1", **layout)
    twin_ksamplers(wf, out, ["4", 0], ["5", 0], seed=seed, steps=steps, cfg=cfg,
                   sampler=sampler, scheduler=scheduler)
    return wf, out


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg_parallel": True}],
                         ids=["ulysses2", "cfg_parallel"])
def test_qwen_image_ksampler_on_the_pool_matches_comfyui_own_model(comfy, layout):
    """Qwen-Image's released widths with 1 block (bf16 file, fp32 on both sides)."""
    got = {}
    for sampler, scheduler in SAMPLERS:
        tag = f"qwen-{'-'.join(map(str, layout))}-{sampler}"
        wf, out = _qwen_compare_graph(comfy, layout, sampler, scheduler, tag)
        _, msgs = run(comfy, wf, timeout=1500)
        _ok(msgs)
        x, n = tensors(Path(out["x"]))["latent"], tensors(Path(out["n"]))["latent"]
        # ComfyUI's Qwen-Image latent: 5-D, one frame
        assert x.shape == n.shape == (1, 16, 1, 8, 8), (x.shape, n.shape)
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


def _comfy_flux_sigmas(steps: int, shift: float = 1.15) -> list:
    """ComfyUI 0.3.64: ModelSamplingFlux(shift).sigmas (10000 points of flux_time_shift) and
    the "simple" scheduler over them."""
    t = torch.arange(1, 10001, 1) / 10000
    sigmas = math.exp(shift) / (math.exp(shift) + (1 / t - 1) ** 1.0)
    ss = len(sigmas) / steps
    return [float(sigmas[-(1 + int(x * ss))]) for x in range(steps)] + [0.0]


def _chroma_reference(folder: Path, seed: int, steps: int, cfg: float, size: int,
                      cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
    """KSampler (euler / simple) on Chroma, ComfyUI's way, with diffusers' transformer."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    tr = ChromaTransformer2DModel.from_pretrained(str(folder / "transformer"),
                                                  torch_dtype=torch.float32).eval()
    h = w = size // 8
    noise = torch.randn((1, 16, h, w), generator=torch.manual_seed(seed), device="cpu")
    sigmas = _comfy_flux_sigmas(steps)
    x = noise * sigmas[0]  # CONST noise scaling of an empty latent
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)

    def denoised(x, sigma, ctx):
        packed = FluxPipeline._pack_latents(x, 1, 16, h, w)
        with torch.no_grad():
            v = tr(hidden_states=packed, timestep=torch.tensor([sigma]), encoder_hidden_states=ctx,
                   txt_ids=torch.zeros(ctx.shape[1], 3), img_ids=img_ids, return_dict=False)[0]
        v = FluxPipeline._unpack_latents(v, size, size, 8)
        return x - sigma * v

    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        c, u = denoised(x, s, cond), denoised(x, s, uncond)
        d = u + (c - u) * cfg
        x = x + (x - d) / s * (s_next - s)
    return x / 0.3611 + 0.1159  # latent_formats.Flux.process_out


def _random_conditioning(seed: int, tokens: int, dim: int) -> torch.Tensor:
    """XDiTTestRandomConditioning's tensor (tests/live_helpers/xdit_test_model_nodes)."""
    return torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(seed))


def test_chroma_ksampler_on_the_model_equals_a_reference(comfy):
    """Stock KSampler on xDiT.ToModel of the tiny Chroma folder (CFG parallel, 2 ranks) equals
    ComfyUI's sampling re-done here on diffusers' transformer (see the module docstring for
    why ComfyUI's own Chroma model cannot be the reference)."""
    dim = _tiny_config(comfy["chroma"])["joint_attention_dim"]
    out = str(comfy["tmp"] / "chroma-model.safetensors")
    seed, steps, cfg, size = 5, 3, 4.0, 64
    wf = {
        "1": {"class_type": "xDiT.LoadModel",
              "inputs": {"model": CHROMA_NAME, "device": "cpu", "dtype": "fp32",
                         "world_size": "2"}},
        "2": {"class_type": "xDiT.ToModel", "inputs": {"model": ["1", 0]}},
        "4": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 1, "tokens": 8, "context_dim": dim, "pooled_dim": 1,
                         "guidance": -1.0}},
        "5": {"class_type": "XDiTTestRandomConditioning",
              "inputs": {"seed": 2, "tokens": 6, "context_dim": dim, "pooled_dim": 1,
                         "guidance": -1.0}},
        "6": {"class_type": "EmptySD3LatentImage",
              "inputs": {"width": size, "height": size, "batch_size": 1}},
        "7": {"class_type": "KSampler",
              "inputs": {"model": ["2", 0], "seed": seed, "steps": steps, "cfg": cfg,
                         "sampler_name": "euler", "scheduler": "simple",
                         "positive": ["4", 0], "negative": ["5", 0],
                         "latent_image": ["6", 0], "denoise": 1.0}},
        "8": {"class_type": "XDiTTestSaveTensors", "inputs": {"latent": ["7", 0], "path": out}},
    }
    with_settings(wf, "1", cfg_parallel=True)
    _, msgs = run(comfy, wf, timeout=1500)
    _ok(msgs)
    x = tensors(Path(out))["latent"]
    ref = _chroma_reference(comfy["chroma"], seed, steps, cfg, size,
                            _random_conditioning(1, 8, dim), _random_conditioning(2, 6, dim))
    assert x.shape == ref.shape == (1, 16, 8, 8)
    fig = {"latent_max_abs": float((x - ref).abs().max()), "latent_max": float(ref.abs().max())}
    print(f"\nchroma cfg_parallel euler: {json.dumps(fig)}")
    assert torch.isfinite(x).all() and fig["latent_max"] > 0.05, fig
    assert fig["latent_max_abs"] <= TOL, fig
    # the reference sees the negative CONDITIONING and cfg: the agreement is not vacuous
    other = _chroma_reference(comfy["chroma"], seed, steps, 1.0, size,
                              _random_conditioning(1, 8, dim), _random_conditioning(2, 6, dim))
    assert float((other - ref).abs().max()) > 1e-2
    pool = next(p for p in http(comfy["base"], "/xdit/status")["pools"]
                if p["model"].endswith(CHROMA_NAME))
    assert pool["world_size"] == 2
