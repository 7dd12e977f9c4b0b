"""The nodes' logic without ComfyUI: LATENT / CONDITIONING conversion, model discovery, the
pool registry (reuse, reconfigure, replace), sampling through it, img2img and interrupt."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import re

import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig
from comfyui_xdit.comfy_convert import (comfy_noise, conditioning_to_request, is_empty_latent,
                                        latent_from_comfy, latent_to_comfy, preview_rgb,
                                        request_to_conditioning)
from comfyui_xdit.nodes.discovery import discover_models, discover_single_files, resolve_model
from comfyui_xdit.nodes.handles import LOADER_DEFAULTS, ModelHandle, loader_handle, make_handle
from comfyui_xdit.nodes.operations import SampleInputs, build_job, decode, sample
from comfyui_xdit.nodes.pool_registry import PoolRegistry
from comfyui_xdit.nodes.settings import (EngineSettings, ParallelSettings, PipeFusionSettings,
                                         node_value)
from comfyui_xdit.client.pool import JobCancelled

from single_file_util import write_single_file
from test_conditioning import encode

ROOT = Path(__file__).resolve().parent.parent


# ---- conversions -------------------------------------------------------------------------
def test_latent_round_trip_and_empty_detection():
    x = torch.randn(3, 16, 8, 12)
    lat = latent_from_comfy({"samples": x}, "flux")
    assert (lat.batch, lat.height, lat.width, lat.empty) == (3, 64, 96, False)
    from workers.runtime.outputs import Latents
    assert torch.equal(latent_to_comfy(Latents(samples=lat.samples))["samples"], x)
    assert torch.equal(latent_from_comfy(latent_to_comfy(Latents(samples=x)), "flux").samples, x)
    # EmptySD3LatentImage (16 ch) and EmptyLatentImage (4 ch, expanded like ComfyUI does)
    for c in (16, 4):
        e = latent_from_comfy({"samples": torch.zeros(2, c, 8, 8)}, "flux")
        assert e.empty and e.samples.shape == (2, 16, 8, 8) and is_empty_latent(e.samples)
    with pytest.raises(ConfigError, match="4 channels; FLUX.1 uses 16"):
        latent_from_comfy({"samples": torch.ones(1, 4, 8, 8)}, "flux")
    with pytest.raises(ConfigError, match="noise_mask"):
        latent_from_comfy({"samples": x, "noise_mask": torch.ones(1, 64, 96)}, "flux")


# ComfyUI's comfy/sample.py `prepare_noise(latent_image, seed, noise_inds=None)` (Comfy-Org/
# ComfyUI a125cd84, Oct 2025): `generator = torch.manual_seed(seed)`; without noise_inds
# `torch.randn(latent_image.size(), dtype=latent_image.dtype, ..., generator=generator,
# device="cpu")` (an EmptySD3LatentImage is fp32); with noise_inds (LATENT "batch_index") one
# `torch.randn([1] + size[1:])` per index 0..max(noise_inds), in order, and the draws at the
# given indices concatenated. Written out here, not imported from the product.
def test_noise_is_comfyui_prepare_noise():
    shape = (3, 16, 8, 8)
    for seed in (7, 2 ** 64 - 1):
        want = torch.randn(shape, generator=torch.manual_seed(seed), dtype=torch.float32,
                           device="cpu")
        got = comfy_noise(seed, shape)
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        assert torch.equal(got, want)
    assert not torch.equal(comfy_noise(8, shape), comfy_noise(7, shape))
    # batch_index: ComfyUI draws one [1,...] per index up to the max, in order
    gen = torch.manual_seed(5)
    per = [torch.randn((1, 16, 8, 8), generator=gen, dtype=torch.float32) for _ in range(4)]
    got = comfy_noise(5, shape, [3, 1, 3])
    assert torch.equal(got, torch.cat([per[3], per[1], per[3]]))


def test_conditioning_conversion():
    cond, pooled = torch.randn(2, 7, 32), torch.randn(2, 16)
    c, g = conditioning_to_request([[cond, {"pooled_output": pooled, "guidance": 2.5}]])
    assert torch.equal(c.context, cond) and torch.equal(c.pooled, pooled) and g == 2.5
    back = request_to_conditioning(c, g)
    assert conditioning_to_request(back)[1] == 2.5
    _, g = conditioning_to_request([[cond, {"pooled_output": pooled}]])
    assert g is None
    with pytest.raises(ConfigError, match="2 entries"):
        conditioning_to_request([[cond, {"pooled_output": pooled}]] * 2)
    with pytest.raises(ConfigError, match="no pooled_output"):
        conditioning_to_request([[cond, {}]])
    with pytest.raises(ConfigError, match="uses area"):
        conditioning_to_request([[cond, {"pooled_output": pooled, "area": (8, 8, 0, 0)}]])


def test_build_job_txt2img_and_img2img():
    req, kw = build_job(SampleInputs(latent={"samples": torch.zeros(2, 16, 8, 10)}, prompt="a",
                                     seed=3, steps=4, denoise=0.5), "flux")
    assert req.batch == 2 and (req.height, req.width) == (64, 80) and req.prompt == ["a"]
    assert kw == {"noise": None, "init_latent": None, "denoise": 1.0} and req.cfg is None
    x = torch.randn(1, 16, 8, 8)
    cond = [[torch.randn(1, 5, 32), {"pooled_output": torch.randn(1, 16), "guidance": 5.0}]]
    req, kw = build_job(SampleInputs(latent={"samples": x, "batch_index": [2]}, positive=cond,
                                     cfg=2.0, denoise=0.6, guidance=1.0), "flux")
    assert req.prompt == [] and req.guidance == 5.0 and req.cfg == 2.0
    assert torch.equal(kw["init_latent"], x) and kw["denoise"] == 0.6
    assert torch.equal(kw["noise"], comfy_noise(0, (1, 16, 8, 8), [2]))
    with pytest.raises(ConfigError, match="no prompt"):
        build_job(SampleInputs(latent={"samples": x}), "flux")


# Constants copied from ComfyUI's comfy/latent_formats.py (Comfy-Org/ComfyUI a125cd84, Oct
# 2025), classes `SD3` and `Flux`: `scale_factor`, `shift_factor`, `latent_rgb_factors`
# (16 x RGB) and `latent_rgb_factors_bias`.
COMFYUI_LATENT_FORMATS = {
    "sd3": dict(
        scale_factor=1.5305, shift_factor=0.0609,
        latent_rgb_factors=[
            [-0.0922, -0.0175, 0.0749], [0.0311, 0.0633, 0.0954], [0.1994, 0.0927, 0.0458],
            [0.0856, 0.0339, 0.0902], [0.0587, 0.0272, -0.0496], [-0.0006, 0.1104, 0.0309],
            [0.0978, 0.0306, 0.0427], [-0.0042, 0.1038, 0.1358], [-0.0194, 0.0020, 0.0669],
            [-0.0488, 0.0130, -0.0268], [0.0922, 0.0988, 0.0951], [-0.0278, 0.0524, -0.0542],
            [0.0332, 0.0456, 0.0895], [-0.0069, -0.0030, -0.0810], [-0.0596, -0.0465, -0.0293],
            [-0.1448, -0.1463, -0.1189]],
        latent_rgb_factors_bias=[0.2394, 0.2135, 0.1925]),
    "flux": dict(
        scale_factor=0.3611, shift_factor=0.1159,
        latent_rgb_factors=[
            [-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433],
            [-0.0174, 0.0160, 0.0617], [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115],
            [0.0405, 0.0861, 0.0915], [-0.0236, -0.0185, -0.0259], [-0.0245, 0.0250, 0.1180],
            [0.1008, 0.0755, -0.0421], [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036],
            [0.0817, 0.0765, 0.0749], [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499],
            [-0.1262, -0.0982, -0.0778]],
        latent_rgb_factors_bias=[-0.0329, -0.0718, -0.0851]),
}


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_preview_rgb_matches_comfyui_latent2rgb(arch):
    """ComfyUI's latent2rgb preview of a raw-VAE-space latent: the sampler hands the
    previewer model-space x0 (`process_in`: (x - shift_factor) * scale_factor, latent_formats
    .py), latent_preview.py `Latent2RGBPreviewer.decode_latent_to_preview` applies
    `F.linear(x0.movedim(0, -1), latent_rgb_factors^T, bias=latent_rgb_factors_bias)` and
    `preview_to_image` maps ((v + 1) / 2).clamp(0, 1) * 255 to uint8. ComfyUI's uint8 cast
    truncates; the product rounds, so it is within half a level of ComfyUI's float value
    (ComfyUI's own uint8 is within one level)."""
    f = COMFYUI_LATENT_FORMATS[arch]
    # a raw latent whose model-space x0 is ~N(0, 1), as a real latent is
    x = torch.randn(1, 16, 4, 6, generator=torch.manual_seed(3)) / f["scale_factor"] \
        + f["shift_factor"]
    img = preview_rgb(x, arch)
    assert img.shape == (4, 6, 3) and img.dtype == torch.uint8
    x0 = (x[0] - f["shift_factor"]) * f["scale_factor"]
    rgb = torch.nn.functional.linear(x0.movedim(0, -1),
                                     torch.tensor(f["latent_rgb_factors"]).transpose(0, 1),
                                     bias=torch.tensor(f["latent_rgb_factors_bias"]))
    ref = ((rgb + 1.0) / 2.0).clamp(0, 1).mul(0xFF)
    inside = ((ref > 0) & (ref < 255)).float().mean().item()
    assert inside > 0.9, f"only {inside:.0%} unsaturated: the comparison would be weak"
    assert (img.float() - ref).abs().max() <= 0.5 + 1e-4


# ---- discovery and handles -------------------------------------------------------------------
def test_discover_models(tmp_path, model_dir):
    root = tmp_path / "diffusers"
    (root / "sub").mkdir(parents=True)
    (root / "flux-tiny").symlink_to(model_dir("flux"), target_is_directory=True)
    (root / "sub" / "sd3-tiny").symlink_to(model_dir("sd3"), target_is_directory=True)
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "model_index.json").write_text(json.dumps({}))
    (root / "single.safetensors").write_bytes(b"")
    names = discover_models([root, tmp_path / "missing"])
    assert names == ["flux-tiny", "sub/sd3-tiny"]
    assert resolve_model("sub/sd3-tiny", [root]) == str(root / "sub" / "sd3-tiny")
    with pytest.raises(ConfigError, match="not a diffusers folder"):
        resolve_model("not-a-model", [root])


def test_discover_and_resolve_single_files(tmp_path, model_dir):
    """The loader lists diffusion_models (and legacy unet) files and the FLUX/SD3 files of
    checkpoints, each as '<kind>/<file>', next to the diffusers folders' plain names."""
    unet, dm, ck = tmp_path / "unet", tmp_path / "diffusion_models", tmp_path / "checkpoints"
    write_single_file(model_dir("flux"), "flux", dm / "flux1-tiny.safetensors")
    write_single_file(model_dir("flux"), "flux", unet / "sub" / "old.safetensors")
    write_single_file(model_dir("flux"), "flux", ck / "flux1-ckpt.safetensors", prefix=True)
    from safetensors.torch import save_file
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2)},
              str(ck / "sdxl.safetensors"))  # another family: not listed from checkpoints
    (dm / "notes.txt").write_text("x")
    roots = {"diffusion_models": [unet, dm], "checkpoints": [ck]}
    names = discover_single_files(roots)
    assert names == ["checkpoints/flux1-ckpt.safetensors", "diffusion_models/flux1-tiny.safetensors",
                     "diffusion_models/sub/old.safetensors"]
    for n in names:
        p = resolve_model(n, [], roots)
        assert p.endswith(n.split("/", 1)[1]) and make_handle(p, "cpu", "fp32").path == p
        make_handle(p, "cpu", "fp32", "2", ulysses=2).validate()
    with pytest.raises(ConfigError, match="'gone.safetensors' not found in diffusion_models"):
        resolve_model("diffusion_models/gone.safetensors", [], roots)


def test_handle_validation_and_auto_config(model_dir):
    path = str(model_dir("flux"))  # tiny FLUX: 4 heads
    with pytest.raises(ConfigError, match="ulysses 3 does not divide the model's 4"):
        make_handle(path, "cpu", "fp32", "auto", ulysses=3).validate()
    with pytest.raises(ConfigError, match="world size 4 != dp 1 x cfg 1 .* ulysses 2"):
        make_handle(path, "cpu", "fp32", "4", ulysses=2).validate()
    make_handle(path, "cpu", "fp32", "2", ulysses=2).validate()
    h = make_handle(path, "cpu", "fp32", "4")
    h.validate()
    assert h.config_for(GenerationRequest(prompt=["a"], cfg=1.0)).degrees().to_wire() == \
        dict(dp=1, cfg=1, pipefusion=1, ulysses=4, ring=1)
    assert h.config_for(GenerationRequest(prompt=["a"], cfg=3.0)).degrees().to_wire() == \
        dict(dp=1, cfg=2, pipefusion=1, ulysses=2, ring=1)
    assert make_handle(path, "cpu", "fp32", "auto").config_for().ranks == 2


# ---- through real pools ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry():
    reg = PoolRegistry()
    yield reg
    reg.unload_all()


def _handle(model_dir, **kw):
    return ModelHandle(path=str(model_dir("flux")), device="cpu", dtype="fp32",
                       threads_per_rank=1, **kw)


COMMON = dict(seed=11, steps=2, max_sequence_length=12)


def test_registry_reuses_reconfigures_and_replaces(registry, model_dir):
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    h = _handle(model_dir, world_size=2, ulysses=2)
    a = sample(h, SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    pool = registry.pools()[0]
    pids = pool.worker_pids()
    # ComfyUI re-executing the node: the same pool, the same workers
    text = registry.last_job["text"]  # the Sampler node's closing line, launch included
    assert text.startswith("2 steps, 2 ranks (Ulysses 2), ") and text.endswith(" s launch"), text
    b = sample(h, SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert registry.pools() == [pool] and pool.worker_pids() == pids and pool.launches == 1
    assert "launch" not in registry.last_job["text"]  # warm: no launch this time
    assert torch.equal(a["samples"], b["samples"])
    # same world size, other degrees: the warm workers are kept
    r = sample(_handle(model_dir, world_size=2, ring=2),
               SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert registry.pools() == [pool] and pool.worker_pids() == pids
    assert pool.config.degrees().to_wire() == dict(dp=1, cfg=1, pipefusion=1, ulysses=1, ring=2)
    assert (r["samples"] - a["samples"]).abs().max() <= 1e-4
    # another world size / device setting: the old pool is closed and replaced
    one = sample(_handle(model_dir, world_size=1),
                 SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert registry.pools() != [pool] or pool.worker_pids() != pids
    assert len(registry.pools()) == 1 and len(registry.pools()[0].worker_pids()) == 1
    assert (one["samples"] - a["samples"]).abs().max() <= 1e-4
    assert registry.status()["pools"][0]["world_size"] == 1
    # a second model beside the first: two tiny pools fit in memory together, both stay warm
    sd3 = ModelHandle(path=str(model_dir("sd3")), device="cpu", dtype="fp32", world_size=1,
                      threads_per_rank=1)
    first = registry.pools()[0]
    sample(sd3, SampleInputs(latent=latent, prompt="a cat", cfg=1.0, **COMMON), registry=registry)
    assert len(registry.pools()) == 2 and first.is_running()
    assert len(registry.status()["pools"]) == 2  # the sidebar shows each
    again = sample(_handle(model_dir, world_size=1),
                   SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert first.launches == 1 and torch.equal(again["samples"], one["samples"])  # no relaunch
    assert registry.unload_all() == 2 and registry.pools() == []


def test_conditioning_path_equals_prompt_path(registry, model_dir):
    h = _handle(model_dir, world_size=2, ulysses=2)
    latent = {"samples": torch.zeros(2, 16, 8, 12)}
    by_text = sample(h, SampleInputs(latent=latent, prompt="a red cat", guidance=4.0, **COMMON),
                     registry=registry)["samples"]
    pos = encode("flux", str(model_dir("flux")), "a red cat", 12)
    cond = request_to_conditioning(pos, guidance=4.0)  # as FluxGuidance leaves it
    by_cond = sample(h, SampleInputs(latent=latent, positive=cond, guidance=1.0, **COMMON),
                     registry=registry)["samples"]
    assert by_cond.shape == (2, 16, 8, 12)
    assert (by_cond - by_text).abs().max().item() <= 1e-5
    # the oracle can fail: guidance from the conditioning matters
    cond_other = request_to_conditioning(pos, guidance=1.0)
    moved = sample(h, SampleInputs(latent=latent, positive=cond_other, **COMMON),
                   registry=registry)["samples"]
    assert (moved - by_text).abs().max().item() > 1e-4


def test_img2img_and_interrupt(registry, model_dir):
    h = _handle(model_dir, world_size=2, ulysses=2)
    x = torch.randn(1, 16, 8, 8) * 0.5
    steps = dict(COMMON, steps=4)
    out = sample(h, SampleInputs(latent={"samples": x}, prompt="a cat", denoise=0.5, **steps),
                 registry=registry)["samples"]
    pool = registry.pools()[0]
    ref = pool.generate(GenerationRequest(prompt=["a cat"], batch_size=1, height=64, width=64,
                                          guidance=3.5, **steps),
                        init_latent=x, denoise=0.5).samples
    assert (out - ref).abs().max().item() <= 1e-6
    txt = sample(h, SampleInputs(latent={"samples": torch.zeros_like(x)}, prompt="a cat",
                                 **steps), registry=registry)["samples"]
    assert (out - txt).abs().max().item() > 1e-3
    # ComfyUI's interrupt flag, seen by the watcher: the job stops, the pool stays warm
    pids = pool.worker_pids()
    seen = []
    with pytest.raises(JobCancelled):
        sample(h, SampleInputs(latent={"samples": torch.zeros(1, 16, 8, 8)}, prompt="a",
                               **dict(COMMON, steps=200)),
               on_event=seen.append, is_interrupted=lambda: len(seen) >= 1, registry=registry)
    assert 1 <= len(seen) < 200 and "JobCancelled" in registry.last_error
    assert pool.worker_pids() == pids and pool.is_running()
    again = sample(h, SampleInputs(latent={"samples": torch.zeros_like(x)}, prompt="a cat",
                                   **steps), registry=registry)["samples"]
    assert torch.equal(again, txt)


def test_pack_entry_is_v3_and_cheap(tmp_path):
    """The root __init__ defines comfy_entrypoint (V3) and no NODE_CLASS_MAPPINGS, and
    importing it loads neither torch.distributed nor ComfyUI."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    code = ("import importlib.util, sys, inspect\n"
            f"spec = importlib.util.spec_from_file_location('pack_under_test', {str(root / '__init__.py')!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert not hasattr(m, 'NODE_CLASS_MAPPINGS')\n"
            "assert inspect.iscoroutinefunction(m.comfy_entrypoint) and m.WEB_DIRECTORY == './web'\n"
            "bad = [n for n in ('torch', 'comfy', 'comfy_api', 'folder_paths', 'server') if n in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


# ---- the Decode node ------------------------------------------------------------------
def test_decode_on_the_pool_and_with_a_comfyui_vae(registry, model_dir, tmp_path):
    """A diffusers folder decodes on its warm pool (patch-parallel over 2 ranks), equal to
    the single-process VAE decode; a single file uses the connected VAE; neither: an error."""
    from diffusers import AutoencoderKL
    h = _handle(model_dir, world_size=2, ulysses=2)
    lat = sample(h, SampleInputs(latent={"samples": torch.zeros(2, 16, 8, 12)}, prompt="a cat",
                                 **COMMON), registry=registry)
    pool = registry.pools()[0]
    pids = pool.worker_pids()
    img = decode(h, lat, registry=registry)
    assert img.shape == (2, 64, 96, 3) and 0 <= img.min() and img.max() <= 1
    # the node's text says what ran (the pool was warm: no launch)
    assert re.fullmatch(r"2 ranks, \d+(\.\d)? s", registry.last_decode_text)
    assert registry.pools() == [pool] and pool.worker_pids() == pids  # the same warm pool
    vae = AutoencoderKL.from_pretrained(str(model_dir("flux")), subfolder="vae")
    with torch.no_grad():
        ref = (vae.decode(lat["samples"]).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
    diff = (img - ref).abs().max().item()
    print("pool decode vs single-process VAE: max abs diff", diff)
    assert diff <= 1e-4
    other = decode(h, {"samples": lat["samples"].flip(0)}, registry=registry)
    assert (other - img).abs().max().item() > 1e-3  # the comparison can fail
    # bad samples: refused before the pool (node) and on rank 0 before broadcast (pool)
    with pytest.raises(ConfigError, match=r"FLUX.1 model's Decode takes latents \[batch, 16"):
        decode(h, {"samples": torch.zeros(1, 4, 8, 8)}, registry=registry)
    from comfyui_xdit.client.pool import PoolError
    with pytest.raises(PoolError, match="decode takes LATENT samples \\[batch, 16"):
        pool.decode(torch.zeros(1, 4, 8, 8))
    assert pool.worker_pids() == pids and torch.equal(decode(h, lat, registry=registry), img)

    # a single file: ComfyUI's VAE object decodes (its decode(samples) -> IMAGE)
    f = write_single_file(model_dir("flux"), "flux", tmp_path / "flux1.safetensors")
    hf = ModelHandle(path=str(f), device="cpu", dtype="fp32", world_size=2, ulysses=2)

    class FakeVAE:
        def decode(self, s):
            self.got = s
            return torch.full((s.shape[0], s.shape[2] * 8, s.shape[3] * 8, 3), 0.25)
    fake = FakeVAE()
    out = decode(hf, lat, vae=fake, registry=registry)
    assert fake.got is lat["samples"] and out.shape == (2, 64, 96, 3) and out[0, 0, 0, 0] == 0.25
    with pytest.raises(ConfigError, match="single file with no VAE: connect a VAE"):
        decode(hf, lat, registry=registry)
    assert registry.pools() == [pool] and pool.worker_pids() == pids


# ---- bad inputs at node level, against a real 2-rank pool ----------------------------------
def test_bad_inputs_give_one_clear_error_and_the_pool_survives(registry, model_dir, tmp_path):
    from safetensors.torch import save_file

    from comfyui_xdit.client.pool import PoolError
    h = _handle(model_dir, world_size=2, ulysses=2)
    empty = {"samples": torch.zeros(1, 16, 8, 8)}
    good = sample(h, SampleInputs(latent=empty, prompt="a cat", **COMMON), registry=registry)
    pool = registry.pools()[0]
    pids = pool.worker_pids()
    roots = {"diffusion_models": [tmp_path], "checkpoints": [tmp_path]}

    def loader(name):  # what the loader node does with a model name
        make_handle(resolve_model(name, [], roots), "cpu", "fp32", "2", ulysses=2).validate()

    with pytest.raises(ConfigError, match="'flux1-missing.safetensors' not found in "
                                          "diffusion_models.*pick a file from the list"):
        loader("diffusion_models/flux1-missing.safetensors")
    with pytest.raises(ConfigError, match="does not exist; give a diffusers folder"):
        make_handle(str(tmp_path / "nothing-here"), "cpu", "fp32").validate()
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2),
               "first_stage_model.decoder.conv_in.weight": torch.zeros(2)},
              str(tmp_path / "sdxl.safetensors"))
    with pytest.raises(ConfigError, match="not a transformer of FLUX.1, FLUX.2, SD3/3.5.*: it "
                                          "looks like an SD1.x/SDXL-style UNet.*Give one of those"):
        loader("checkpoints/sdxl.safetensors")
    f = write_single_file(model_dir("flux"), "flux", tmp_path / "flux1.safetensors")
    raw = f.read_bytes()
    (tmp_path / "corrupt.safetensors").write_bytes(raw[:8] + b"#" * 64 + raw[72:])
    with pytest.raises(ConfigError, match="not a valid .safetensors file .*re-download"):
        loader("diffusion_models/corrupt.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(ConfigError, match="truncated download"):
        loader("diffusion_models/cut.safetensors")
    lora = tmp_path / "sdxl_lora.safetensors"
    save_file({"lora_unet_input_blocks_1_0_emb_layers_1.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_input_blocks_1_0_emb_layers_1.lora_up.weight": torch.zeros(8, 4)},
              str(lora))
    with pytest.raises(PoolError, match="LoRA file .*sdxl_lora.safetensors could not be read "
                                        "as a flux LoRA .*Give a diffusers/PEFT or kohya"):
        sample(h.with_lora(str(lora), 1.0), SampleInputs(latent=empty, prompt="a cat", **COMMON),
               registry=registry)
    other = tmp_path / "sd3_lora.safetensors"  # PEFT keys of layers FLUX does not have
    save_file({"transformer.pos_embed.proj.lora_A.weight": torch.zeros(4, 64),
               "transformer.pos_embed.proj.lora_B.weight": torch.zeros(64, 4)}, str(other))
    with pytest.raises(PoolError, match="sd3_lora.safetensors has no key that matches this "
                                        "flux model .*is it a LoRA for another model"):
        sample(h.with_lora(str(other), 1.0), SampleInputs(latent=empty, prompt="a cat", **COMMON),
               registry=registry)
    with pytest.raises(ConfigError, match="height 72 is not a positive multiple of 16 "
                                          "\\(try 64\\)"):
        sample(h, SampleInputs(latent={"samples": torch.zeros(1, 16, 9, 8)}, prompt="a cat",
                               **COMMON), registry=registry)
    with pytest.raises(ConfigError, match="LATENT batch of 1 is smaller than dp 2: set "
                                          "batch_size >= 2 on the empty-latent node, or lower dp"):
        sample(_handle(model_dir, world_size=2, dp=2), SampleInputs(latent=empty, prompt="a cat",
                                                                    **COMMON), registry=registry)
    # the same workers, still warm, still right
    assert registry.pools() == [pool] and pool.worker_pids() == pids
    again = sample(h, SampleInputs(latent=empty, prompt="a cat", **COMMON), registry=registry)
    assert torch.equal(again["samples"], good["samples"]) and pool.worker_pids() == pids


def test_pipefusion_handle_relaunches_once_and_is_exact_with_full_warmup(registry, model_dir):
    """The loader's PipeFusion inputs: another stage layout relaunches the pool (each rank
    holds one stage); warmup/patches are per job and keep the workers."""
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    inputs = SampleInputs(latent=latent, prompt="a cat", **COMMON)
    exact = sample(_handle(model_dir, world_size=2, ulysses=2), inputs, registry=registry)
    pf = _handle(model_dir, world_size=2, pipefusion=2, warmup_steps=2)
    got = sample(pf, inputs, registry=registry)
    assert (got["samples"] - exact["samples"]).abs().max() <= 1e-4
    pool = registry.pools()[0]
    pids = pool.worker_pids()
    assert [r["stage"]["index"] for r in pool.status()["ranks"]] == [0, 1]
    stale = sample(_handle(model_dir, world_size=2, pipefusion=2, warmup_steps=0,
                           pipeline_patches=2), inputs, registry=registry)
    assert (stale["samples"] - exact["samples"]).abs().max() > 1e-4
    assert registry.pools() == [pool] and pool.worker_pids() == pids


def test_loader_refuses_bad_pipefusion_and_attention(model_dir):
    path = str(model_dir("flux"))
    with pytest.raises(ConfigError, match="world size 2 != dp 1 x cfg 1 x pipefusion 4"):
        make_handle(path, "cpu", "fp32", "2", pipefusion=4).validate()
    with pytest.raises(ConfigError, match="pipefusion 8 exceeds the model's 4 transformer"):
        make_handle(path, "cpu", "fp32", "8", pipefusion=8).validate()
    with pytest.raises(ConfigError, match="attention 'flash' .* needs device cuda"):
        make_handle(path, "cpu", "fp32", "2", ulysses=2, attention="flash").validate()
    h = make_handle(path, "cpu", "fp32", "auto", pipefusion=2, pipeline_patches=0)
    assert h.pipeline_patches is None and h.explicit_config().pipefusion == 2


# ---- what the user sees: the loader's one message, worker deaths, launch progress -------------
def comfy_validation_errors(validate, inputs: dict) -> list:
    """ComfyUI 0.3.64's rule (execution.py `validate_inputs`), written out: a V3
    `validate_inputs(cls, **kwargs)` gets every input; a returned message becomes one
    "custom_validation_failed" error per input it got; a raised exception is caught once by
    the node downstream ("exception_during_inner_validation"), one error for the node."""
    try:
        r = validate(**inputs)
    except Exception as e:
        return [str(e)]
    return [] if r is True else [f"{x} - {r}" for x in inputs]


# the loader's widgets as ComfyUI passes them with no settings node connected
LOADER_INPUTS = dict(device="auto", dtype="auto", world_size="auto")


# the node modules that import ComfyUI at import time (imported afresh against the stand-ins)
NODE_MODULES = ("extension", "node_io", "loader_nodes", "settings_nodes", "sampler_nodes")


@pytest.fixture
def loader_node(monkeypatch, tmp_path, model_dir):
    """nodes.LoadModel imported against stand-ins for ComfyUI's modules (a CPU-only
    ComfyUI whose models/diffusers holds the tiny FLUX as FLUX.1-dev)."""
    import sys
    import types
    from unittest import mock

    diffusers_dir = tmp_path / "diffusers"
    diffusers_dir.mkdir()
    (diffusers_dir / "FLUX.1-dev").symlink_to(model_dir("flux"), target_is_directory=True)
    io = mock.MagicMock()
    io.ComfyNode = object
    api = types.SimpleNamespace(ComfyExtension=object, io=io)
    folder_paths = types.SimpleNamespace(
        get_folder_paths=lambda kind: [str(diffusers_dir)] if kind == "diffusers" else [],
        get_filename_list=lambda kind: [])
    mm = types.SimpleNamespace(cpu_state="gpu", CPUState=types.SimpleNamespace(CPU="cpu"))
    comfy = types.SimpleNamespace(model_management=mm, utils=mock.MagicMock())
    for name, mod in {"comfy": comfy, "comfy.model_management": mm, "comfy.utils": comfy.utils,
                      "folder_paths": folder_paths, "comfy_api": types.SimpleNamespace(),
                      "comfy_api.v0_0_2": api}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in NODE_MODULES:
        monkeypatch.delitem(sys.modules, f"comfyui_xdit.nodes.{name}", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import comfyui_xdit.nodes.extension as nodes
    yield nodes.LoadModel, mm
    for name in NODE_MODULES:
        sys.modules.pop(f"comfyui_xdit.nodes.{name}", None)


def test_loader_reports_a_bad_configuration_once(loader_node):
    LoadModel, mm = loader_node
    ok = dict(LOADER_INPUTS, model="FLUX.1-dev")
    assert comfy_validation_errors(LoadModel.validate_inputs, ok) == []
    h = LoadModel._handle(**ok)  # auto on a CPU-only ComfyUI: what actually runs
    assert (h.device, h.dtype, h.world()) == ("cpu", "fp32", 2)
    bad = dict(ok, world_size="4", parallel=ParallelSettings(ulysses=3))
    errors = comfy_validation_errors(LoadModel._handle, bad)  # at execution: values known
    assert len(errors) == 1, errors
    assert "world size 4 != dp 1 x cfg 1 x pipefusion 1 x ulysses 3" in errors[0]
    # at validation ComfyUI passes a linked input as None: the layout waits for its value
    assert comfy_validation_errors(LoadModel.validate_inputs, dict(bad, parallel=None)) == []
    # the rule can fail: a returned message would have been shown once per input
    assert len(comfy_validation_errors(lambda **kw: "invalid", bad)) == len(bad) > 4
    # cuda forced on a CPU-only ComfyUI: one line, with whatever else is wrong in it
    errors = comfy_validation_errors(LoadModel._handle, dict(bad, device="cuda", dtype="bf16"))
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith("device cuda: this ComfyUI has no CUDA GPU"), errors[0]
    assert "use device auto (runs on cpu here) or cpu" in errors[0]
    assert "world size 4 != " in errors[0]
    mm.cpu_state = "cpu"  # ComfyUI started with --cpu: said so
    errors = comfy_validation_errors(LoadModel.validate_inputs, dict(ok, device="cuda"))
    assert errors == ["device cuda: ComfyUI runs with --cpu; use device auto (runs on cpu "
                      "here) or cpu"]
    # what cannot run is refused rather than silently changed
    errors = comfy_validation_errors(LoadModel.validate_inputs, dict(ok, dtype="bf16"))
    assert len(errors) == 1 and "dtype bf16 does not run on cpu" in errors[0]
    errors = comfy_validation_errors(LoadModel._handle, dict(ok, engine=EngineSettings(
        attention="cudnn", text_encoders="gpu")))
    assert len(errors) == 1 and "attention 'cudnn' is a CUDA kernel" in errors[0] \
        and "text_encoders 'gpu' needs device cuda" in errors[0], errors


def _schema_inputs(nodes, node_cls) -> list:
    """(kind, name, kwargs) of every input `node_cls.define_schema()` declares, read from
    the mocked `io` (widgets) and the pack's io.Custom types (sockets)."""
    io = nodes.io
    kinds = {"Combo": io.Combo.Input, "Int": io.Int.Input, "Boolean": io.Boolean.Input,
             "String": io.String.Input, "Float": io.Float.Input}
    sockets = {"parallel": nodes.XDiTParallel.Input, "pipefusion": nodes.XDiTPipeFusion.Input,
               "engine": nodes.XDiTEngine.Input,
               "low_noise_model": nodes.XDiTExpertFile.Input}
    for m in list(kinds.values()) + list(sockets.values()):
        m.reset_mock()
    node_cls.define_schema()
    return [(kind, c.args[0], c.kwargs) for kind, m in {**kinds, **sockets}.items()
            for c in m.call_args_list]


def test_loader_has_four_widgets_and_three_settings_inputs(loader_node):
    """The loader keeps what every user sets; the rest is on settings nodes,
    each plugged into an optional input of its own type."""
    import sys
    LoadModel, _ = loader_node
    import types
    nodes = types.SimpleNamespace(**{k: v for name in NODE_MODULES for k, v in
                                     vars(sys.modules[f"comfyui_xdit.nodes.{name}"]).items()})
    got = _schema_inputs(nodes, LoadModel)
    widgets = [name for kind, name, _ in got if kind in ("Combo", "Int", "Boolean", "String")]
    assert sorted(widgets) == ["device", "dtype", "model", "world_size"]
    assert {name: kw.get("optional") for kind, name, kw in got
            if kind in ("parallel", "pipefusion", "engine", "low_noise_model")} == \
        {"parallel": True, "pipefusion": True, "engine": True, "low_noise_model": True}
    # every removed widget is on exactly one settings node, with today's default
    import dataclasses
    moved = {}
    for node in (nodes.ParallelSettings, nodes.PipeFusionSettings, nodes.EngineSettings):
        for _, name, kw in _schema_inputs(nodes, node):
            assert name not in moved
            moved[name] = kw.get("default")
    assert set(moved) == set(LOADER_DEFAULTS) - set(LOADER_INPUTS)
    assert {k: v for k, v in moved.items() if k != "pipefusion"} == \
        {k: LOADER_DEFAULTS[k] for k in moved if k != "pipefusion"}
    assert moved["pipefusion"] == 2  # connecting PipeFusion settings means PipeFusion
    for cls in (ParallelSettings, PipeFusionSettings, EngineSettings):  # same names as the
        assert {f.name for f in dataclasses.fields(cls)} <= set(moved)  # nodes' widgets
    combo = [kw for kind, name, kw in _schema_inputs(nodes, nodes.EngineSettings)
             if name == "memory_plan"]
    assert combo[0]["options"] == ["auto", "enforce", "advise"]
    # widgets added after the settings nodes shipped are optional: a workflow saved before
    # them validates, and the node gives their defaults
    for node, value, name, default in (
            (nodes.ParallelSettings, ParallelSettings, "split", "even"),
            (nodes.ParallelSettings, ParallelSettings, "cfg_degree", 2),
            (nodes.EngineSettings, EngineSettings, "shard_split", "even")):
        kw = next(kw for _, n, kw in _schema_inputs(nodes, node) if n == name)
        assert kw.get("optional") is True, (name, kw)
        assert getattr(node_value(value, {}), name) == default
    # and last among the node's inputs: a saved workflow's widget values are in order
    from comfyui_xdit.nodes.settings import node_inputs
    names = [w.name for w in node_inputs(ParallelSettings)]
    assert names[-2:] == ["split", "cfg_degree"], names


def test_settings_nodes_are_their_values_fields(loader_node):
    """Each settings node's widgets are the fields of the value it outputs, defined once
    (nodes/settings.py): the widgets at their defaults give the value's defaults, and Step
    cache (xDiT) outputs the workers' own CacheSettings (one type, one set of defaults)."""
    import sys
    from comfyui_xdit.nodes import settings as node_settings
    from comfyui_xdit.planning.request import cache_settings
    import types
    nodes = types.SimpleNamespace(**{k: v for name in NODE_MODULES for k, v in
                                     vars(sys.modules[f"comfyui_xdit.nodes.{name}"]).items()})
    pairs = {nodes.ParallelSettings: node_settings.ParallelSettings,
             nodes.PipeFusionSettings: node_settings.PipeFusionSettings,
             nodes.EngineSettings: node_settings.EngineSettings,
             nodes.CacheSettings: cache_settings(),
             nodes.SamplerOptions: node_settings.SamplerOptions}
    for node, value_type in pairs.items():
        widgets = {name: kw["default"] for _, name, kw in _schema_inputs(nodes, node)}
        assert len(widgets) == len(dataclasses.fields(value_type)), node
        node.execute(**widgets)
        assert nodes.io.NodeOutput.call_args.args[0] == value_type(), node
    cache = dict(threshold=0.2, warmup=1, head_blocks=2, tail_blocks=1, max_skips=0,
                 taylor=True)
    nodes.CacheSettings.execute(**cache)
    assert nodes.io.NodeOutput.call_args.args[0] == cache_settings()(
        threshold=0.2, warmup=1, head=2, tail=1, max_skips=0, taylor=True)
    nodes.EngineSettings.execute(memory_plan=" Advise ")  # what the loader takes
    assert nodes.io.NodeOutput.call_args.args[0].memory_plan == "advise"


def test_loader_memory_plan_option(loader_node):
    """Engine settings' memory_plan reaches the handle as chosen; none connected: auto."""
    LoadModel, _ = loader_node
    h = LoadModel._handle(**dict(LOADER_INPUTS, model="FLUX.1-dev",
                                 engine=EngineSettings(memory_plan="advise")))
    assert h.memory_plan == "advise"
    assert LoadModel._handle(**dict(LOADER_INPUTS, model="FLUX.1-dev")).memory_plan == "auto"


def test_missing_model_says_where_it_looked_and_what_it_found(loader_node, tmp_path):
    LoadModel, _ = loader_node
    errors = comfy_validation_errors(LoadModel.validate_inputs,
                                     dict(LOADER_INPUTS, model="stable-diffusion-3.5-medium"))
    assert len(errors) == 1
    msg = errors[0]
    assert "model 'stable-diffusion-3.5-medium' not found" in msg
    assert str(tmp_path / "diffusers") in msg and "found FLUX.1-dev" in msg
    assert "models/diffusers/stable-diffusion-3.5-medium" in msg


def test_engine_options_reach_the_pool_and_key_it(model_dir):
    made = []

    class FakePool:
        def __init__(self, path, config, **kw):
            self.config, self.kw = config, kw
            made.append(kw)

        def close(self):
            pass
    reg = PoolRegistry(pool_factory=FakePool)
    h = make_handle(str(model_dir("flux")), "auto", "auto", "2", has_cuda=False)
    assert (h.device, h.dtype) == ("cpu", "fp32")
    cfg = h.config_for()
    p1 = reg.get(h, cfg)
    assert reg.get(h, cfg) is p1 and made == [{"gpus": None, "threads_per_rank": None,
                                               "device": "cpu", "dtype": "fp32"}]
    import dataclasses
    for change in (dict(compile=True), dict(weights="full"), dict(text_encoders="cpu"),
                   dict(attention="torch"), dict(shard_weights=True),
                   dict(shard_weights=True, shard_split="3,1")):
        p = reg.get(dataclasses.replace(h, **change), cfg)
        assert p is not p1 and made[-1].items() >= change.items(), (change, made[-1])
    assert make_handle(h.path, "auto", "auto", has_cuda=True).dtype == "bf16"
    # a combination the layout cannot run is the loader's one message, before any launch
    bad = make_handle(h.path, "auto", "auto", "2", pipefusion=2, shard_weights=True,
                      compile=True, has_cuda=False)
    with pytest.raises(ConfigError) as e:
        bad.validate()
    msg = str(e.value)
    assert msg.count("shard_weights") >= 1 and "compile is not supported with PipeFusion" in msg
    assert "compile and shard_weights together" in msg
    # shares of the sharded weights by memory need each GPU's memory: refused on CPU
    mem = make_handle(h.path, "auto", "auto", "2", shard_weights=True, shard_split="memory",
                      has_cuda=False)
    with pytest.raises(ConfigError, match="shard_split 'memory'.*needs device cuda"):
        mem.validate()


def test_worker_traceback_becomes_one_sentence(tmp_path):
    from comfyui_xdit.client import worker_log as W
    log = """2026-01-01 10:00:00 rank2 xdit: weights loaded
Traceback (most recent call last):
  File "/x/workers/runtime/serve.py", line 150, in main
    _follower_loop(worker)
    ~~~~~~~~~~~~~~^^^^^^^^
  File "/x/workers/sampling/denoise.py", line 80, in step
    out = block(x)
          ^^^^^^^^
RuntimeError: first failure

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/x/torch/nn/modules/module.py", line 1775, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.2 GiB is free.
"""
    cause = W.death_cause(1, log)
    assert cause.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00")
    text = W.death_sentence(2, cause, "while running job 3", "GPU 2", "/tmp/k/rank2.log")
    assert text.startswith("worker rank 2 (GPU 2) failed while running job 3: "
                           "torch.OutOfMemoryError: CUDA out of memory.")
    assert text.endswith("Full log: /tmp/k/rank2.log") and "\n" not in text
    assert "^^^" not in text and "File " not in text and "first failure" not in text
    # a message on the lines after the type, a kill without traceback, a lost peer
    assert W.death_cause(1, "Traceback (most recent call last):\n  File \"a\"\nValueError:\n"
                            "  bad shape\n") == "ValueError: bad shape"
    killed = W.death_cause(-9, "2026 rank1 xdit: weights loaded\n")
    assert killed.startswith("killed by SIGKILL (killed by hand or by the system's out-of-memory")
    assert W.death_sentence(1, killed, "while running job 2", "pid 7").startswith(
        "worker rank 1 (pid 7) was killed by SIGKILL")
    peer = W.death_cause(1, "Traceback (most recent call last):\n  File \"x\"\n"
                            "torch.distributed.DistBackendError: [../gloo] Connection closed "
                            "by peer [127.0.0.1]:5000\n")
    assert W.is_peer_loss(peer) and not W.is_peer_loss(cause) and not W.is_peer_loss(killed)
    dead = [{"rank": 0, "cause": peer}, {"rank": 2, "cause": cause}]
    assert W.pick_culprit(dead)["rank"] == 2 and W.pick_culprit(dead[:1])["rank"] == 0
    # logs are kept out of the pool's temp folder
    src = tmp_path / "rank2.log"
    src.write_text(log)
    kept = W.keep_logs({2: str(src)}, label="test")
    assert open(kept[2]).read() == log and str(tmp_path) not in kept[2]


def test_killed_worker_is_one_sentence_and_the_next_job_clears_it(model_dir):
    """A real 2-rank pool: the launch reports progress, a SIGKILLed rank fails the job with
    one sentence whose log path exists, the panel's last error is cleared by the next job."""
    import os
    import signal

    reg = PoolRegistry()
    try:
        h = _handle(model_dir, world_size=2, ulysses=2)
        empty = {"samples": torch.zeros(1, 16, 8, 8)}

        class Cancel(Exception):  # what ComfyUI's progress hook raises on its cancel
            pass
        started = []

        def cancel_in_launch(*a):
            started.append(a)
            if len(started) == 2:  # the repeat a second later: the cancel check lands
                raise Cancel()
        with pytest.raises(Cancel):
            sample(h, SampleInputs(latent=empty, prompt="a cat", **COMMON), registry=reg,
                   on_launch=cancel_in_launch)
        pool = reg.pools()[0]
        assert not pool.is_running() and pool.worker_pids() == [] and pool.launches == 0
        launch = []
        sample(h, SampleInputs(latent=empty, prompt="a cat", **COMMON), registry=reg,
               on_launch=lambda *a: launch.append(a))
        assert launch[0] == ("starting 2 workers", 0, 2), launch
        assert launch[-1] == ("loading 2/2", 2, 2), launch
        assert [d for _, d, _ in launch] == sorted(d for _, d, _ in launch)
        assert pool.launches == 1 and reg.pools() == [pool]
        victim = pool.worker_pids()[1]
        seen = []

        def on_event(ev):
            seen.append(ev)
            if len(seen) == 1:
                os.kill(victim, signal.SIGKILL)
        from comfyui_xdit.client.pool import PoolError
        with pytest.raises(PoolError) as info:
            sample(h, SampleInputs(latent=empty, prompt="a cat", **dict(COMMON, steps=200)),
                   on_event=on_event, registry=reg)
        msg = str(info.value)
        assert msg.startswith("worker rank 1 (pid ") and "was killed by SIGKILL" in msg, msg
        assert "\n" not in msg and "last log lines" not in msg
        assert reg.last_error_log and os.path.isfile(reg.last_error_log)
        assert msg.endswith(f"Full log: {reg.last_error_log}")
        assert reg.status()["last_error"].endswith(msg)
        sample(h, SampleInputs(latent=empty, prompt="a cat", **COMMON), registry=reg)
        assert reg.status()["last_error"] is None and reg.status()["last_error_log"] is None
    finally:
        reg.unload_all()


def test_compiling_text_for_both_sampling_paths():
    """Sampler (xDiT) and the xDiT MODEL under KSampler show the same text while compiling."""
    from comfyui_xdit.nodes.node_text import compiling_text
    assert compiling_text({"phase": "compiling", "compiles": 3, "compile_s": 12.4}) == \
        "compiling: 3 graphs, 12 s"
    assert compiling_text({"phase": "compiling", "compiles": 1, "compile_s": 0.5}) == \
        "compiling: 1 graph, 0.5 s"
    assert compiling_text({"step": 1, "total": 4}) is None


def test_text_encoder_choices_list_each_visible_gpu():
    from comfyui_xdit.nodes.settings import text_encoder_options
    assert text_encoder_options(0) == ["auto", "cpu", "gpu"]
    assert text_encoder_options(3)[3:] == ["cuda:0", "cuda:1", "cuda:2"]
    assert text_encoder_options()[:3] == ["auto", "cpu", "gpu"]  # counts without a GPU


# ---- the settings nodes: the loader's old widgets, moved -------------------------------------
# the loader's former widgets -> the settings nodes that now carry them
OLD_WIDGET_CASES = [
    dict(world_size="2", ulysses=2),
    dict(world_size="4", ulysses=2, ring=2, gpus="0,1,2,3"),
    dict(world_size="auto", cfg_parallel=True, dp=2, attention="torch", weights="full"),
    dict(world_size="2", pipefusion=2, warmup_steps=3, pipeline_patches=4,
         pipefusion_split="memory", compile=True, text_encoders="cpu", memory_plan="advise"),
    dict(world_size="2", ulysses=2, shard_weights=True, weights="fp8"),
    dict(world_size="4", cfg_parallel=True, cfg_degree=4),
]


def _as_settings(old: dict) -> dict:
    """The same choices made with the settings nodes (a node only where one is non-default)."""
    import dataclasses
    inputs = {k: old[k] for k in ("world_size",) if k in old}
    for name, cls in (("parallel", ParallelSettings), ("pipefusion", PipeFusionSettings),
                      ("engine", EngineSettings)):
        fields = {f.name for f in dataclasses.fields(cls)}
        if fields & set(old):
            mine = {k: v for k, v in old.items() if k in fields}
            if cls is PipeFusionSettings:
                mine.setdefault("pipefusion", 1)
            inputs[name] = cls(**mine)
    return inputs


@pytest.mark.parametrize("old", OLD_WIDGET_CASES, ids=lambda d: ",".join(d))
def test_settings_nodes_give_what_the_old_widgets_gave(model_dir, old):
    path = str(model_dir("flux"))
    want = make_handle(path, "cpu", "fp32", **old)
    got = loader_handle(dict(_as_settings(old), model=path, device="cpu", dtype="fp32"), [],
                        has_cuda=False) if not want.problems() else None
    if got is None:  # e.g. the tiny model's layout limits: the same problems either way
        with pytest.raises(ConfigError) as e:
            loader_handle(dict(_as_settings(old), model=path, device="cpu", dtype="fp32"), [],
                          has_cuda=False)
        assert str(e.value) == "; ".join(want.problems())
        return
    assert got == want
    assert got.explicit_config() == want.explicit_config()
    assert got.config_for() == want.config_for() and got.engine() == want.engine()


def test_loader_without_settings_is_todays_loader(model_dir):
    """Nothing connected = today's default widget values; Parallel and Engine settings at
    their defaults change nothing either (PipeFusion settings' default degree is 2)."""
    path = str(model_dir("flux"))
    plain = loader_handle(dict(model=path, device="auto", dtype="auto", world_size="auto"),
                          [], has_cuda=False)
    today = make_handle(path, **{k: v for k, v in LOADER_DEFAULTS.items()}, has_cuda=False)
    assert plain == today and not plain.degrees_given
    assert (plain.device, plain.dtype, plain.world(), plain.gpus) == ("cpu", "fp32", 2, None)
    assert plain.config_for().degrees().to_wire() == \
        dict(dp=1, cfg=1, pipefusion=1, ulysses=2, ring=1)  # the automatic split, as today
    assert plain.engine() == today.engine() and plain.memory_plan == "auto"
    defaults = loader_handle(dict(model=path, device="auto", dtype="auto", world_size="auto",
                                  parallel=ParallelSettings(), engine=EngineSettings()),
                             [], has_cuda=False)
    assert defaults == plain
    pf = loader_handle(dict(model=path, device="auto", dtype="auto", world_size="auto",
                            pipefusion=PipeFusionSettings()), [], has_cuda=False)
    assert pf.explicit_config().pipefusion == 2 and pf.world() == 2


def test_conflicting_settings_give_one_clear_line(model_dir):
    path = str(model_dir("flux"))
    base = dict(model=path, device="cpu", dtype="fp32")

    def error(**inputs) -> str:
        with pytest.raises(ConfigError) as e:
            loader_handle(dict(base, **inputs), [], has_cuda=False)
        assert "\n" not in str(e.value)
        return str(e.value)
    # Ulysses on one node, PipeFusion on another: their product is not the world size
    msg = error(world_size="2", parallel=ParallelSettings(ulysses=2),
                pipefusion=PipeFusionSettings(pipefusion=2))
    assert "world size 2 != dp 1 x cfg 1 x pipefusion 2 x ulysses 2 x ring 1" in msg, msg
    # sharding and compile with PipeFusion: the engine's conflicts, said in the same line
    msg = error(world_size="2", pipefusion=PipeFusionSettings(pipefusion=2),
                engine=EngineSettings(shard_weights=True, compile=True))
    assert "compile is not supported with PipeFusion" in msg and "shard_weights" in msg, msg
    # a number where a settings node goes (a saved API workflow's old pipefusion widget)
    # is read as that widget was
    h = loader_handle(dict(base, world_size="2", pipefusion=2), [], has_cuda=False)
    assert h.explicit_config().pipefusion == 2


def test_cfg_degree_reaches_the_config_and_the_text(model_dir):
    """Parallel settings' cfg_degree is cfg-parallel's degree while cfg_parallel is on (a
    saved workflow without it: 2, the config as before); off, it changes nothing; the node
    text numbers a degree above 2."""
    from comfyui_xdit.nodes.node_text import layout_text
    path = str(model_dir("flux"))
    base = dict(model=path, device="cpu", dtype="fp32", world_size="auto")

    def config(**parallel):
        value = node_value(ParallelSettings, parallel)
        return loader_handle(dict(base, parallel=value), [], has_cuda=False).explicit_config()
    saved = config(cfg_parallel=True)  # a workflow saved before cfg_degree
    assert saved.cfg_parallel is True and saved.cfg == 2 and layout_text(saved) == "CFG parallel"
    four = config(cfg_parallel=True, cfg_degree=4, ulysses=2)
    assert (four.cfg, four.ranks) == (4, 8)
    assert layout_text(four) == "CFG parallel 4 x Ulysses 2"
    assert config(cfg_parallel=False, cfg_degree=4).cfg == 1


def test_sampler_text_after_the_job():
    from comfyui_xdit.nodes.node_text import job_text, layout_text
    from comfyui_xdit import ParallelConfig
    assert job_text(12, ParallelConfig(ulysses=2), 3.14) == "12 steps, 2 ranks (Ulysses 2), 3.1 s"
    assert job_text(1, ParallelConfig(), 0.5) == "1 step, 1 rank, 0.5 s"
    both = ParallelConfig(dp=2, cfg_parallel=True, pipefusion=2, ulysses=2, ring=2)
    assert layout_text(both) == "DP 2 x CFG parallel x PipeFusion 2 x Ulysses 2 x Ring 2"
    assert job_text(28, ParallelConfig(cfg_parallel=True), 9.96, launch_s=12.04) == \
        "28 steps, 2 ranks (CFG parallel), 10 s + 12 s launch"
    # too long for the node: shorter cache counts, then no layout, then no launch
    cache = {"computed": 9, "skipped": 19}
    assert job_text(28, ParallelConfig(ulysses=2), 3.14, 17.4, cache) == \
        "28 steps, 2 ranks, 3.1 s + 17 s launch, 9/28 calls in full"
    assert job_text(28, ParallelConfig(ulysses=2), 3.14, 0, cache) == \
        "28 steps, 2 ranks (Ulysses 2), 3.1 s, 9/28 calls in full"
    assert job_text(1000, ParallelConfig(cfg_parallel=True, ulysses=2, ring=2), 1234, 999,
                    cache) == "1000 steps, 8 ranks, 1234 s, 9/28 calls in full"
    assert job_text(28, both, 3.14, 17.4, cache, node=None) == \
        ("28 steps, 32 ranks (DP 2 x CFG parallel x PipeFusion 2 x Ulysses 2 x Ring 2), "
         "3.1 s + 17 s launch, 9 of 28 calls computed in full")  # the log's sentence
    from comfyui_xdit.nodes.node_text import decode_text
    assert decode_text(torch.zeros(1, 64, 96, 3), 2, 1.04, True) == "2 ranks, 1.0 s"
    assert decode_text(torch.zeros(1, 64, 96, 3), 2, 1.04, True, node=None) == \
        "decoded 1 image 96x64 on 2 ranks, 1.0 s (incl. launch)"
    assert decode_text(torch.zeros(3, 8, 8, 3), 0, 0.2, False) == "VAE, 0.2 s"
    assert decode_text(torch.zeros(3, 8, 8, 3), 0, 0.2, False, node=None) == \
        "decoded 3 images 8x8 with the VAE input, 0.2 s"
    assert decode_text(torch.zeros(1, 8, 8, 3), 16, 1234.0, False) == "1234 s"  # too long


# ---- the node texts fit their nodes (Decode's text was once cut to "decoded 1 imag", the
# loader's ran into the node below) -------------------------------------------------------
# Widths in px measured in headless Chromium (canvas measureText in the text widget's font),
# the larger of ComfyUI 0.8.0's frontend 1.35.9 (Inter 12 px) and 0.3.64's 1.27.10 (Arial 12 px)
MEASURED_PX = {"decoded 1 image 64x64 on 2 ranks, 0.2 s": 235.5,  # the old Decode text
               "runs on cpu, fp32, 2 rank(s)": 158.3,  # the old loader text
               "2 steps, 2 ranks (Ulysses 2), 0.4 s + 17.4 s launch": 279.7,
               "xDiT step cache, 2 of 12 calls computed in full": 260.4,
               "runs on cpu, fp32, 2 ranks": 149.5, "2 ranks, 0.2 s": 76.5,
               "16 ranks, 999 s": 85.8, "starting 0/16": 70.6, "loading 16/16": 74.0,
               "cuda, bf16, 16 ranks, 130.1 of 141.0 GiB": 215.5,
               "step 999/1000, 1000/1000 calls in full": 211.5,
               "compiling: 12 graphs, 123 s so far": 188.8, "0123456789": 71.0}


def test_text_width_estimate_is_from_above():
    from comfyui_xdit.nodes.node_text import text_px
    for text, px in MEASURED_PX.items():
        assert px <= text_px(text) <= px * 1.12, (text, text_px(text), px)
    # the old texts did not fit: Decode (fresh, 140 px wide) and the loader (270 px)
    from comfyui_xdit.nodes.node_text import NODE_TEXT_PX
    assert MEASURED_PX["decoded 1 image 64x64 on 2 ranks, 0.2 s"] > NODE_TEXT_PX["decode"]
    assert NODE_TEXT_PX == {"loader": 270 - 52, "sampler": 400 - 52, "decode": 140 - 52,
                            "comfy_sampler": 202 - 52}


def _plan(peak, cap, fits):
    from types import SimpleNamespace
    gib = 2 ** 30
    worst = SimpleNamespace(total=int(peak * gib),
                            gpu_memory=None if cap is None else int(cap * gib))
    return SimpleNamespace(worst=worst, fits=fits)


def node_texts():
    """(node, text): every text the nodes send, typical and worst cases (16 ranks, every
    layout, long runs, launches, step-cache counts, memory plans, long model names)."""
    from types import SimpleNamespace
    from comfyui_xdit.nodes import node_text
    from comfyui_xdit.nodes.settings import WORLD_SIZES
    out = []
    ranks = [int(w) for w in WORLD_SIZES if w != "auto"]
    plans = [None, _plan(30.1, 79.1, True), _plan(999.9, 141.0, True), _plan(1234.5, 79.1, False),
             _plan(999.9, None, None), SimpleNamespace(error="RuntimeError: no", fits=None)]
    for device, dtype in (("cpu", "fp32"), ("cuda", "bf16"), ("cuda", "fp16")):
        for n in ranks:
            for plan in plans:
                out.append(("loader", node_text.loader_text(device, dtype, n, plan)))
    long_name = make_handle("/models/diffusers/" + "FLUX.1-dev-with-a-very-long-name" * 8,
                            "cpu", "fp32", world_size="16")
    out.append(("loader", long_name.node_text()))
    layouts = [ParallelConfig(), ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True),
               ParallelConfig(cfg_parallel=True, ulysses=2, ring=2),
               ParallelConfig(dp=2, pipefusion=2, ulysses=2, ring=2),
               ParallelConfig(dp=2, cfg_parallel=True, pipefusion=2, ulysses=2),
               ParallelConfig(cfg_parallel=True, pipefusion=2, ulysses=2, ring=2)]
    caches = [None, {"computed": 2, "skipped": 1}, {"computed": 9999, "skipped": 10001}]
    for steps in (1, 28, 10000):
        for config in layouts:
            for job_s in (0.04, 9.96, 99999.0):
                for launch_s in (0.0, 17.4, 9999.0):
                    for cache in caches:
                        out.append(("sampler", node_text.job_text(steps, config, job_s,
                                                                  launch_s, cache)))
    for step, total in ((3, 28), (10000, 10000)):
        for cache in caches[1:]:
            out.append(("sampler", node_text.step_text(step, total, cache)))
    for node in ("sampler", "decode"):
        for n in ranks:
            for k in (0, n):
                out.append((node, node_text.launch_text(f"starting {n} workers", k, n, node)))
                out.append((node, node_text.launch_text(f"loading {k}/{n}", k, n, node)))
    for compiles in (1, 3, 120, 10000):
        for compile_s in (0.4, 59.0, 3600.0, 99999.0):
            out.append(("comfy_sampler", node_text.compiling_text(
                {"phase": "compiling", "compiles": compiles, "compile_s": compile_s})))
    for cache in caches[1:]:
        out.append(("comfy_sampler", node_text.model_cache_text(cache)))
    for n in [0] + ranks:
        for seconds in (0.04, 9.96, 99.4, 999.0, 99999.0):
            for images in (torch.zeros(1, 64, 64, 3), SimpleNamespace(shape=(81, 1280, 720, 3))):
                for launched in (False, True):
                    out.append(("decode", node_text.decode_text(images, n, seconds, launched)))
    return out


def test_every_node_text_is_one_line_that_fits_its_node():
    """ComfyUI shows a node's progress text in a widget one line tall: each text is one line
    no wider than its node's text area (the example layout's width, or the fresh node's where
    narrower, less the widget's margins and padding), estimated from above by text_px."""
    from comfyui_xdit.nodes.node_text import NODE_TEXT_PX, text_px
    texts = node_texts()
    assert len(texts) > 1000
    for node, text in texts:
        assert text and "\n" not in text, (node, text)
        assert text_px(text) <= NODE_TEXT_PX[node], (node, text, text_px(text))
    widest = {}
    for node, text in texts:
        widest[node] = max(widest.get(node, 0.0), text_px(text))
    print("\nwidest text per node (px, estimated):",
          {k: f"{v:.1f} of {NODE_TEXT_PX[k]}" for k, v in widest.items()})


def test_node_texts_keep_the_detail_where_it_fits():
    from comfyui_xdit.nodes import node_text
    # the typical texts stay whole
    assert node_text.loader_text("cpu", "fp32", 2) == "runs on cpu, fp32, 2 ranks"
    assert node_text.loader_text("cuda", "bf16", 1) == "runs on cuda, bf16, 1 rank"
    assert node_text.loader_text("cuda", "bf16", 8, _plan(30.1, 79.1, True)) == \
        "cuda, bf16, 8 ranks, 30.1 of 79.1 GiB"
    assert node_text.loader_text("cuda", "bf16", 16, _plan(130.1, 141.0, False)) == \
        "16 ranks, 130.1 of 141.0 GiB: too big"
    assert node_text.loader_text("cuda", "bf16", 2, _plan(30.1, None, None)) == \
        "cuda, bf16, 2 ranks, 30.1 GiB peak"
    assert node_text.step_text(3, 28, {"computed": 2, "skipped": 1}) == \
        "step 3/28, 2 of 3 calls computed in full"
    assert node_text.model_cache_text({"computed": 2, "skipped": 10}) == "xDiT: 2/12 calls in full"
    assert node_text.model_cache_text({"computed": 2, "skipped": 10}, node=None) == \
        "xDiT step cache, 2 of 12 calls computed in full"
    assert node_text.model_cache_text(None) == ""
    assert node_text.launch_text("starting 2 workers", 0, 2) == "starting 2 workers"
    assert node_text.launch_text("starting 2 workers", 0, 2, "decode") == "starting 0/2"
    assert node_text.launch_text("loading 1/2", 1, 2, "decode") == "loading 1/2"
    assert node_text.duration_text(0.04) == "0.0 s" and node_text.duration_text(9.96) == "10 s"
    h = make_handle("/m/x", "cuda", "bf16", world_size="2", has_cuda=True)
    object.__setattr__(h, "_memory_plan", _plan(30.1, 79.1, True))
    assert h.node_text() == "cuda, bf16, 2 ranks, 30.1 of 79.1 GiB"


def test_step_cache_settings_node(registry, model_dir):
    """Step cache (xDiT): its value becomes the request's cache, a bad value is one line, the
    Sampler's text counts the calls computed in full, and 0 turns it off."""
    from comfyui_xdit.nodes.node_text import cache_text
    from comfyui_xdit.nodes.settings import CacheSettings, cache_request
    assert cache_request(CacheSettings()) == {"threshold": 0.08, "warmup": 2, "head": 1,
                                              "tail": 0, "max_skips": 3, "taylor": False}
    assert cache_request(CacheSettings(threshold=0.0)) is None
    with pytest.raises(ConfigError, match="cache head blocks must be >= 1") as e:
        cache_request(CacheSettings(head=0))
    assert "\n" not in str(e.value)
    assert cache_text({"computed": 9, "skipped": 7}) == "9 of 16 calls computed in full"
    assert cache_text({"computed": 9, "skipped": 7}, short=True) == "9/16 calls in full"
    assert cache_text(None) == ""
    h = _handle(model_dir, world_size=2, ulysses=2)
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    sample(h, SampleInputs(latent=latent, prompt="a cat", cache=CacheSettings(threshold=5.0,
                                                                             warmup=1),
                           **dict(COMMON, steps=4)), registry=registry)
    text = registry.last_job["text"]
    # shortened to fit the node when the job also launched the pool
    assert re.search(r", (1 of 4 calls computed|1/4 calls) in full$", text), text


# ---- what the nodes say (the Sampler once said "FLUX.1 / FLUX.2 / SD3") --------------------
SETTINGS_NODES = {"xDiT.LowNoiseExpert", "xDiT.ParallelSettings", "xDiT.PipeFusionSettings",
                  "xDiT.EngineSettings", "xDiT.CacheSettings", "xDiT.SamplerOptions"}


def test_node_texts_name_every_family():
    from comfyui_xdit.nodes import node_text
    from comfyui_xdit.planning.request import families
    names, cfgs = node_text.family_list(), node_text.cfg_defaults_text()
    for f in families.FAMILIES.values():
        assert f.name in names and f"{f.name}: " in node_text.conditioning_hint_text()
        assert f"{f.name} {f.defaults.cfg:g}" in cfgs, (f.name, cfgs)
    assert "FLUX.2 1 (off), base models 4" in cfgs and "Wan 5" in cfgs
    assert node_text.guidance_defaults_text() == "FLUX.1 3.5, FLUX.2 4"


def test_loader_tooltip_names_the_example_workflows_folders(tmp_path):
    """The loader's tooltip lists the folders the example workflows load, read from the
    examples (a new example's folder appears without editing the node), one each, in family
    order; every family with an example is in it."""
    import json

    from comfyui_xdit.nodes import node_text
    from comfyui_xdit.planning.request import families
    examples = ROOT / "example_workflows"
    ui = {w for p in examples.glob("*.json") if not p.name.endswith("_api.json")
          for n in json.loads(p.read_text())["nodes"] if n["type"] == "xDiT.LoadModel"
          for w in n["widgets_values"][:1]}
    got = node_text.example_models()
    assert len(got) == len(set(got)) and set(got) == ui  # the UI-format examples agree
    text = node_text.example_models_text()
    assert all(f"models/diffusers/{m}" in text for m in got) and " or " in text
    with_example = [f for f in families.IDS if any(examples.glob(f"xdit_{f}_*_api.json"))]
    assert len(with_example) == len(families.IDS)  # every family ships an example
    # a folder of examples: family order (the registry's), a missing folder lists none
    fids = list(families.IDS)
    for i, fid in enumerate((fids[-1], fids[0])):
        (tmp_path / f"xdit_{fid}_x_api.json").write_text(json.dumps(
            {"1": {"class_type": "xDiT.LoadModel", "inputs": {"model": f"M{i}"}},
             "2": {"class_type": "xDiT.Sampler", "inputs": {}}}))
    assert node_text.example_models(tmp_path) == ["M1", "M0"]
    assert node_text.example_models_text(tmp_path) == "models/diffusers/M1 or models/diffusers/M0"
    assert node_text.example_models(tmp_path / "none") == []
    assert "example_models_text()" in _schemas()["xDiT.LoadModel"]["inputs"]


def _schemas() -> dict:
    """node_id -> the keyword source of its io.Schema(...) in the node modules (read, not
    imported: they import ComfyUI)."""
    import ast
    src = "".join((ROOT / "comfyui_xdit" / "nodes" / f"{name}.py").read_text()
                  for name in ("loader_nodes", "settings_nodes", "sampler_nodes"))
    src += (ROOT / "comfyui_xdit" / "nodes" / "model_nodes.py").read_text()
    out = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Schema":
            kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
            out[ast.literal_eval(kw["node_id"])] = kw
    return out


def test_option_nodes_sit_in_a_settings_subcategory_and_texts_come_from_the_families():
    schemas = _schemas()
    assert SETTINGS_NODES <= set(schemas)
    for nid, kw in schemas.items():
        want = "SETTINGS_CATEGORY" if nid in SETTINGS_NODES else "CATEGORY"
        assert kw["category"] == want, (nid, kw["category"])
        assert "FLUX.1 / FLUX.2 / SD3" not in kw.get("description", ""), nid
    assert "family_list()" in schemas["xDiT.Sampler"]["description"]
    assert "family_list()" in schemas["xDiT.LoadModel"]["description"]
    from comfyui_xdit.nodes.settings import SETTINGS_CATEGORY
    assert SETTINGS_CATEGORY == "xDiT/settings"


# ---- several pools: as many as fit together (planning/pool_fit.py) -------------------------
def test_pools_fit_together_by_memory_and_close_oldest_first():
    from comfyui_xdit.planning import pool_fit
    GiB = 2 ** 30
    caps = {"gpu:0": 80 * GiB, "gpu:1": 80 * GiB, "host": 100 * GiB}.get
    a, b, c = {"gpu:0": 50 * GiB}, {"gpu:1": 50 * GiB}, {"gpu:0": 40 * GiB, "gpu:1": 20 * GiB}
    assert pool_fit.fits([a, b], caps)  # different GPUs
    assert not pool_fit.fits([a, c], caps)  # 90 GiB on GPU 0
    assert pool_fit.fits([b, c], caps)  # 70 on GPU 1, 40 on GPU 0
    assert not pool_fit.fits([a, None], caps)  # unknown: not beside others
    assert pool_fit.fits([None], caps)  # one pool always "fits" (the launch's own check)
    assert not pool_fit.fits([{"gpu:7": GiB}, {"gpu:7": GiB}], caps)  # capacity unknown
    prints = {"A": a, "B": b, "C": c}
    closing = pool_fit.to_close(["A", "B"], "C", footprint_of=prints.get, capacity_of=caps)
    assert closing == ["A"]  # the least recently used, and only it
    assert pool_fit.to_close(["B"], "A", footprint_of=prints.get, capacity_of=caps) == []


def test_footprints_of_real_pools(model_dir, monkeypatch):
    from comfyui_xdit import WorkerPool
    from comfyui_xdit.planning import gpus, pool_fit
    cpu = WorkerPool(str(model_dir("flux")), ParallelConfig(ulysses=2), device="cpu")
    f = pool_fit.footprint(cpu)
    assert list(f) == ["host"] and 0 < f["host"] < 2 ** 30  # two ranks of a tiny model
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [80 * 2 ** 30] * len(ids))
    gpu = WorkerPool(str(model_dir("flux")), ParallelConfig(ulysses=2), device="cuda",
                     dtype="bf16")
    g = pool_fit.footprint(gpu)
    assert sorted(g) == ["gpu:0", "gpu:1"] and all(n > 2 * 2 ** 30 for n in g.values())
    assert pool_fit.to_close([cpu], gpu) == []  # host memory and GPUs: no overlap
    assert pool_fit.footprint(object()) is None


def test_registry_keeps_what_fits_and_closes_the_least_recently_used(model_dir):
    closed = []

    class FakePool:
        def __init__(self, path, config, **kw):
            self.model_path, self.config = path, config

        def close(self):
            closed.append(self.model_path)

    def two_fit(kept, new):  # a stand-in plan: any two pools fit together, three do not
        return kept[: max(0, len(kept) - 1)]
    reg = PoolRegistry(pool_factory=FakePool, fit=two_fit)
    handles = {n: ModelHandle(path=str(model_dir(n)), device="cpu", dtype="fp32", world_size=1)
               for n in ("flux", "sd3", "chroma")}
    cfg = handles["flux"].config_for()
    a = reg.get(handles["flux"], cfg)
    b = reg.get(handles["sd3"], cfg)
    assert reg.get(handles["flux"], cfg) is a  # used again: now the most recent
    reg.get(handles["chroma"], cfg)
    assert closed == [b.model_path] and a in reg.pools() and len(reg.pools()) == 2
