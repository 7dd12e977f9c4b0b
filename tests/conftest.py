"""Shared fixtures: tiny models built once, warm pools shared across tests, the oracle.

Pools are expensive to start (~5 s of imports per rank), so one pool per (arch, world size,
fault) serves every test that needs it; tests switch configurations with `reconfigure`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from comfyui_xdit import GenerationRequest, ParallelConfig  # noqa: E402
from comfyui_xdit.tiny_model import ensure_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    built = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = ensure_tiny_model(arch, cache)
        return built[arch]
    return get


@pytest.fixture(scope="session")
def pools(model_dir):
    """pools(arch, world, fault=None) -> a warm WorkerPool with `world` CPU ranks."""
    from comfyui_xdit import WorkerPool

    made = {}

    def get(arch: str, world: int, fault: str | None = None):
        key = (arch, world, fault)
        if key not in made:
            hooks = [f"xdit_testhooks.faults:{fault}"] if fault else []
            pool = WorkerPool(model_dir(arch), ParallelConfig(ulysses=world),
                              device="cpu", threads_per_rank=1, worker_hooks=hooks)
            pool.generate(GenerationRequest(prompt=["warm"], steps=1, height=64, width=64,
                                            max_sequence_length=8, cfg=1.0))
            made[key] = pool
        return made[key]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="session")
def oracle(model_dir):
    """oracle(arch, request) -> the single-process diffusers pipeline's final latent, in
    ComfyUI's LATENT space, from the same noise (DESIGN.md numerics 4)."""
    import diffusers


    def prepare_noise(seed, shape):  # ComfyUI's comfy.sample.prepare_noise
        return torch.randn(shape, generator=torch.manual_seed(seed), dtype=torch.float32,
                           device="cpu")
    from workers.models import get_adapter

    pipes, cache = {}, {}

    def run(arch: str, req: GenerationRequest, path=None) -> torch.Tensor:
        """`path`: another model folder of `arch` (default: the session's tiny model)."""
        path = str(path or model_dir(arch))
        key = (path, tuple(req.prompt), req.seed, req.steps, req.height, req.width, req.cfg,
               req.guidance, req.max_sequence_length, req.negative_prompt)
        if key in cache:
            return cache[key]
        adapter = get_adapter(arch)
        noise = prepare_noise(req.seed, (len(req.prompt), 16, req.height // 8, req.width // 8))
        r = req.resolved(arch)
        if arch == "flux":
            pipe = pipes.get(path) or diffusers.FluxPipeline.from_pretrained(path)
            kw = dict(true_cfg_scale=r.cfg, negative_prompt=[r.negative_prompt] * len(r.prompt)
                      ) if r.cfg > 1 else {}
            out = pipe(prompt=r.prompt, guidance_scale=r.guidance, height=r.height,
                       width=r.width, num_inference_steps=r.steps, latents=adapter.pack(noise),
                       max_sequence_length=r.max_sequence_length, output_type="latent", **kw)
            lat = adapter.unpack(out.images, r.height, r.width)
        else:
            pipe = pipes.get(path) or diffusers.StableDiffusion3Pipeline.from_pretrained(path)
            out = pipe(prompt=r.prompt, negative_prompt=[r.negative_prompt] * len(r.prompt),
                       guidance_scale=r.cfg, height=r.height, width=r.width,
                       num_inference_steps=r.steps, latents=noise,
                       max_sequence_length=r.max_sequence_length, output_type="latent")
            lat = out.images
        pipes[path] = pipe
        vae = pipe.vae.config
        cache[key] = lat.float() / vae.scaling_factor + vae.shift_factor
        return cache[key]

    return run
