"""The loader node's low_noise_model (Wan 2.2 A14B from its two expert files) and the LoRA
node's expert choice (comfyui_xdit/nodes/handles.py, pool_registry.py), without ComfyUI or
workers: the pair becomes the handle's path_2, the pool's model_path_2 and part of the pool
cache key; the handle reads as a model of two experts (ToModel's expert input and Sampler
(xDiT) take it as an A14B folder); a second file beside a model without experts is refused
in one line. LoRA entries naming an expert go to the request as (path, strength, expert);
an expert on a one-transformer model is refused in one line."""
from __future__ import annotations

import re

import pytest
import torch

from comfyui_xdit.nodes.handles import loader_handle
from comfyui_xdit.nodes.operations import SampleInputs, sample
from comfyui_xdit.nodes.pool_registry import PoolRegistry
from comfyui_xdit.nodes.settings import NO_MODEL_2, ExpertFile
from comfyui_xdit.planning.config import ConfigError
from single_file_util import write_single_file

WIDE = dict(width=256, heads=2)  # head dim 128: what a file's shapes give


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """models/diffusers with the tiny A14B folder; models/diffusion_models with its two
    transformers as ComfyUI-named files, a Wan 2.1 T2V file and a FLUX.1 file."""
    from safetensors.torch import load_file

    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    base = tmp_path_factory.mktemp("wan_loader")
    diffusers = base / "diffusers"
    a14b = ensure_tiny_model("wan", diffusers, variant="a14b", **WIDE)
    t2v = ensure_tiny_model("wan", base / "t2v")
    flux = ensure_tiny_model("flux", base / "flux")
    files = base / "diffusion_models"

    def state(sub):
        return load_file(str(a14b / sub / "diffusion_pytorch_model.safetensors"))
    write_single_file(None, "wan", files / "high.safetensors", state=state("transformer"))
    write_single_file(None, "wan", files / "low.safetensors", state=state("transformer_2"))
    write_single_file(t2v, "wan", files / "t2v.safetensors")
    write_single_file(flux, "flux", files / "flux.safetensors")
    return dict(folders=[str(diffusers)], kinds={"diffusion_models": [str(files)]},
                a14b=a14b.relative_to(diffusers).as_posix(), files=files)


def _handle(roots, model, low=NO_MODEL_2, **kw):
    """The loader with Low-noise expert (xDiT)'s value connected (`low`: its file)."""
    return loader_handle(dict(model=model, low_noise_model=ExpertFile(low), device="cpu", **kw),
                         roots["folders"], roots["kinds"], has_cuda=False)


class FakePool:
    """What the registry hands the factory, and a generate() that returns a LATENT."""

    made: list = []

    def __init__(self, path, config, **kw):
        self.path, self.config, self.kw, self.jobs = path, config, kw, []
        FakePool.made.append(self)

    def close(self):
        pass

    def reconfigure(self, config):
        self.config = config

    def generate(self, req, on_event=None, on_launch=None, **kw):
        from comfyui_xdit import bridge
        from comfyui_xdit.planning.request import GenerationResult
        self.jobs.append(req)
        shape = (req.batch, 16, (req.frames - 1) // 4 + 1, req.height // 8, req.width // 8)
        return GenerationResult(latents=bridge.protocol.Latents(samples=torch.zeros(shape)))


def test_two_expert_files_make_one_two_expert_model_and_pool(roots):
    FakePool.made = []
    h = _handle(roots, "diffusion_models/high.safetensors", "diffusion_models/low.safetensors")
    assert h.path_2 == str(roots["files"] / "low.safetensors")
    info = h.info()
    assert (info.arch, info.experts, info.path_2) == ("wan", 2, h.path_2)
    one = _handle(roots, "diffusion_models/high.safetensors")
    assert one.path_2 is None and one.info().experts == 1
    # a Python caller's plain name; ComfyUI's validation (a linked value still None): the
    # high file is checked alone, the pair at execution
    assert loader_handle(dict(model="diffusion_models/high.safetensors",
                              low_noise_model="diffusion_models/low.safetensors"),
                         roots["folders"], roots["kinds"], has_cuda=False) == h
    assert loader_handle(dict(model="diffusion_models/high.safetensors", low_noise_model=None),
                         roots["folders"], roots["kinds"], has_cuda=False).path_2 is None
    reg = PoolRegistry(pool_factory=FakePool)
    cfg = h.config_for()
    p = reg.get(h, cfg)
    assert reg.get(h, cfg) is p  # re-executed nodes: the same warm pool
    assert p.path == h.path and p.kw["model_path_2"] == h.path_2
    # the pool cache key holds the second file: the high file alone is another pool
    reg2 = PoolRegistry(max_pools=2, pool_factory=FakePool)
    a, b = reg2.get(h, cfg), reg2.get(one, cfg)
    assert a is not b and "model_path_2" not in b.kw
    # Sampler (xDiT) on the pair: a Wan request (cfg_2 reaches it) on the pair's pool
    cond = [[torch.randn(1, 5, 32), {}]]  # the tiny model's text_dim
    inp = SampleInputs(latent={"samples": torch.zeros(1, 16, 2, 4, 6)}, steps=2, cfg=4.0,
                       cfg_2=3.0, positive=cond, negative=cond)
    out = sample(h, inp, registry=reg)
    req = p.jobs[-1]
    assert out["samples"].shape == (1, 16, 2, 4, 6) and (req.frames, req.cfg_2) == (5, 3.0)
    assert req.problems(info) == []  # cfg_2 and the rest: fine on a model of two experts


def test_second_file_refused_in_one_line(roots):
    cases = [  # (model, low_noise_model, what the one line says)
        ("diffusion_models/flux.safetensors", "diffusion_models/low.safetensors",
         "FLUX.1 model, which has no experts"),
        (roots["a14b"], "diffusion_models/low.safetensors", "is a diffusers folder"),
        ("diffusion_models/high.safetensors", roots["a14b"], "is not a single file"),
        ("diffusion_models/high.safetensors", "diffusion_models/flux.safetensors",
         "low_noise_model .* is a FLUX.1 model, not Wan"),
        ("diffusion_models/high.safetensors", "diffusion_models/t2v.safetensors",
         "differ in"),
        ("diffusion_models/high.safetensors", "diffusion_models/gone.safetensors",
         "not found in diffusion_models"),
    ]
    for model, low, want in cases:
        with pytest.raises(ConfigError) as e:
            _handle(roots, model, low)
        msg = str(e.value)
        assert re.search(want, msg) and "\n" not in msg, (model, low, msg)


def test_lora_expert_choice(roots, tmp_path):
    from comfyui_xdit.planning.request import GenerationRequest
    from safetensors.numpy import save_file
    import numpy as np
    lora = tmp_path / "l.safetensors"  # a LoRA file as the host's check reads it (its header)
    save_file({"blocks.0.attn1.to_q.lora_A.weight": np.zeros((2, 4), np.float32),
               "blocks.0.attn1.to_q.lora_B.weight": np.zeros((4, 2), np.float32)}, str(lora))
    pair = _handle(roots, "diffusion_models/high.safetensors",
                   "diffusion_models/low.safetensors")
    folder = _handle(roots, roots["a14b"])
    for h in (pair, folder):
        h2 = h.with_lora(str(lora), 0.5, "high").with_lora(str(lora), 0.25, "low") \
            .with_lora(str(lora), 1.0)
        assert h2.loras == ((str(lora), 0.5, "high"), (str(lora), 0.25, "low"),
                            (str(lora), 1.0))
        req = GenerationRequest(prompt=["x"], loras=list(h2.loras))
        assert not [p for p in req.problems(h2.info()) if "LoRA" in p]
    one = _handle(roots, "diffusion_models/t2v.safetensors")
    assert one.with_lora(str(lora), 1.0, "both").loras == ((str(lora), 1.0),)
    for expert in ("high", "low"):
        with pytest.raises(ConfigError, match="has one transformer.*Choose both") as e:
            one.with_lora(str(lora), 1.0, expert)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="LoRA expert must be one of"):
        pair.with_lora(str(lora), 1.0, "middle")
