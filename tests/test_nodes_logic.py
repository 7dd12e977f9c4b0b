"""The nodes' logic without ComfyUI: LATENT / CONDITIONING conversion, model discovery, the
pool registry (reuse, reconfigure, replace), sampling through it, img2img and interrupt."""
from __future__ import annotations

import json

import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig
from comfyui_xdit.comfy_convert import (comfy_noise, conditioning_to_request, is_empty_latent,
                                        latent_from_comfy, latent_to_comfy, preview_rgb,
                                        request_to_conditioning)
from comfyui_xdit.node_logic import (ModelHandle, PoolRegistry, SampleInputs, build_job,
                                     discover_models, make_handle, resolve_model, sample)
from comfyui_xdit.pool import JobCancelled
from workers.denoise import prepare_noise

from test_conditioning import encode


# ---- conversions -------------------------------------------------------------------------
def test_latent_round_trip_and_empty_detection():
    x = torch.randn(3, 16, 8, 12)
    lat = latent_from_comfy({"samples": x})
    assert (lat.batch, lat.height, lat.width, lat.empty) == (3, 64, 96, False)
    assert torch.equal(latent_to_comfy(lat.samples)["samples"], x)
    assert torch.equal(latent_from_comfy(latent_to_comfy(x)).samples, x)
    # EmptySD3LatentImage (16 ch) and EmptyLatentImage (4 ch, expanded like ComfyUI does)
    for c in (16, 4):
        e = latent_from_comfy({"samples": torch.zeros(2, c, 8, 8)})
        assert e.empty and e.samples.shape == (2, 16, 8, 8) and is_empty_latent(e.samples)
    with pytest.raises(ConfigError, match="4 channels; FLUX and SD3 use 16"):
        latent_from_comfy({"samples": torch.ones(1, 4, 8, 8)})
    with pytest.raises(ConfigError, match="noise_mask"):
        latent_from_comfy({"samples": x, "noise_mask": torch.ones(1, 64, 96)})


def test_noise_is_comfyui_prepare_noise():
    shape = (3, 16, 8, 8)
    assert torch.equal(comfy_noise(7, shape), prepare_noise(7, shape))
    assert torch.equal(comfy_noise(2 ** 64 - 1, shape), prepare_noise(2 ** 64 - 1, shape))
    # batch_index: ComfyUI draws one [1,...] per index up to the max, in order
    gen = torch.manual_seed(5)
    per = [torch.randn((1, 16, 8, 8), generator=gen) for _ in range(4)]
    got = comfy_noise(5, shape, [3, 1, 3])
    assert torch.equal(got, torch.cat([per[3], per[1], per[3]]))


def test_conditioning_conversion():
    cond, pooled = torch.randn(2, 7, 32), torch.randn(2, 16)
    c, g = conditioning_to_request([[cond, {"pooled_output": pooled, "guidance": 2.5}]])
    assert torch.equal(c["cond"], cond) and torch.equal(c["pooled"], pooled) and g == 2.5
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
                                     seed=3, steps=4, denoise=0.5))
    assert req.batch == 2 and (req.height, req.width) == (64, 80) and req.prompt == ["a"]
    assert kw == {"noise": None, "init_latent": None, "denoise": 1.0} and req.cfg is None
    x = torch.randn(1, 16, 8, 8)
    cond = [[torch.randn(1, 5, 32), {"pooled_output": torch.randn(1, 16), "guidance": 5.0}]]
    req, kw = build_job(SampleInputs(latent={"samples": x, "batch_index": [2]}, positive=cond,
                                     cfg=2.0, denoise=0.6, guidance=1.0))
    assert req.prompt == [] and req.guidance == 5.0 and req.cfg == 2.0
    assert torch.equal(kw["init_latent"], x) and kw["denoise"] == 0.6
    assert torch.equal(kw["noise"], comfy_noise(0, (1, 16, 8, 8), [2]))
    with pytest.raises(ConfigError, match="no prompt"):
        build_job(SampleInputs(latent={"samples": x}))


def test_preview_rgb_matches_comfyui_latent2rgb():
    x = torch.randn(1, 16, 4, 6)
    img = preview_rgb(x, "flux")
    assert img.shape == (4, 6, 3) and img.dtype == torch.uint8
    from comfyui_xdit.comfy_convert import LATENT_FORMATS
    f = LATENT_FORMATS["flux"]
    m = (x[0] - f["shift"]) * f["scale"]
    ref = (torch.einsum("chw,cr->hwr", m, torch.tensor(f["rgb"])) + torch.tensor(f["bias"]))
    ref = ((ref + 1) / 2).clamp(0, 1) * 255
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


def test_handle_validation_and_auto_config(model_dir):
    path = str(model_dir("flux"))  # tiny FLUX: 4 heads
    with pytest.raises(ConfigError, match="ulysses 3 does not divide the model's 4"):
        make_handle(path, "cpu", "fp32", "auto", ulysses=3).validate()
    with pytest.raises(ConfigError, match="world size 4 != dp 1 x cfg 1 .* ulysses 2"):
        make_handle(path, "cpu", "fp32", "4", ulysses=2).validate()
    make_handle(path, "cpu", "fp32", "2", ulysses=2).validate()
    h = make_handle(path, "cpu", "fp32", "4")
    h.validate()
    assert h.config_for(GenerationRequest(prompt=["a"], cfg=1.0)).key() == (1, 1, 1, 4, 1)
    assert h.config_for(GenerationRequest(prompt=["a"], cfg=3.0)).key() == (1, 2, 1, 2, 1)
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
    b = sample(h, SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert registry.pools() == [pool] and pool.worker_pids() == pids and pool.launches == 1
    assert torch.equal(a["samples"], b["samples"])
    # same world size, other degrees: the warm workers are kept
    r = sample(_handle(model_dir, world_size=2, ring=2),
               SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert registry.pools() == [pool] and pool.worker_pids() == pids
    assert pool.config.key() == (1, 1, 1, 1, 2)
    assert (r["samples"] - a["samples"]).abs().max() <= 1e-4
    # another world size / device setting: the old pool is closed and replaced
    one = sample(_handle(model_dir, world_size=1),
                 SampleInputs(latent=latent, prompt="a cat", **COMMON), registry=registry)
    assert registry.pools() != [pool] or pool.worker_pids() != pids
    assert len(registry.pools()) == 1 and len(registry.pools()[0].worker_pids()) == 1
    assert (one["samples"] - a["samples"]).abs().max() <= 1e-4
    assert registry.status()["pools"][0]["world_size"] == 1
    # a second model replaces the first (max_pools=1): never two models in memory
    sd3 = ModelHandle(path=str(model_dir("sd3")), device="cpu", dtype="fp32", world_size=1,
                      threads_per_rank=1)
    first = registry.pools()[0]
    sample(sd3, SampleInputs(latent=latent, prompt="a cat", cfg=1.0, **COMMON), registry=registry)
    assert len(registry.pools()) == 1 and not first.is_running()
    assert registry.unload_all() == 1 and registry.pools() == []


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
