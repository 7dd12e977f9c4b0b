"""Shared fixtures: tiny models built once, warm pools shared across tests, the oracle.

Pools are expensive to start (~5 s of imports per rank), so one pool per (arch, world size,
fault) serves every test that needs it; tests switch configurations with `reconfigure`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from comfyui_xdit import GenerationRequest, ParallelConfig  # noqa: E402
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model  # noqa: E402


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


class LayoutPools:
    """Warm CPU pools by (model, launch layout, pool options, tag): a configuration a pool
    can serve reuses it (reconfigured); with `keep`, only that many most recently used stay
    warm and the others are closed (memory on a shared 2-core CI machine)."""

    def __init__(self, keep: int | None = None):
        self.keep = keep
        self.made: dict = {}
        self.infos: dict = {}  # path -> ModelInfo, read once

    def get(self, path, config: ParallelConfig, tag: str = "", **pool_options):
        from comfyui_xdit import WorkerPool
        # the model's launch key: a layout that loads other weights (a cfg rank holding one
        # guidance branch's transformer) is a pool of its own, not a relaunch of another
        key = (str(path), config.launch_key(self._info(path)), tag,
               tuple(sorted((k, repr(v)) for k, v in pool_options.items())))
        pool = self.made.pop(key, None)
        if pool is None:
            while self.keep is not None and len(self.made) >= self.keep:
                self.made.pop(next(iter(self.made))).close()
            pool = WorkerPool(str(path), config, device="cpu", threads_per_rank=1,
                              **pool_options)
        elif pool.config != config:
            pool.reconfigure(config)
        self.made[key] = pool  # most recently used last
        return pool

    def _info(self, path):
        """The path's ModelInfo, read once (None where it cannot be read: the pool's own
        launch then says why)."""
        from comfyui_xdit.planning.model_info import read_model_info
        if str(path) not in self.infos:
            try:
                self.infos[str(path)] = read_model_info(str(path))
            except Exception:  # noqa: BLE001
                self.infos[str(path)] = None
        return self.infos[str(path)]

    def close(self) -> None:
        for pool in self.made.values():
            pool.close()
        self.made.clear()



@pytest.fixture(scope="module")
def layout_pools(request):
    """One test module's warm pools (LayoutPools): its LAYOUT_POOLS_KEEP (default 2) says how
    many stay warm at once."""
    cache = LayoutPools(keep=getattr(request.module, "LAYOUT_POOLS_KEEP", 2))
    yield cache
    cache.close()

# What the oracle assumes for every request field the test did not set: written here, not
# taken from the product (docs/design.md#command-line: the CLI's defaults, which are
# diffusers' FluxPipeline / StableDiffusion3Pipeline guidance values). The oracle checks that
# the request resolves to the same values, so a drifted default fails with a clear message
# instead of a diff.
ORACLE_DEFAULTS = {
    "flux": {"cfg": 1.0, "guidance": 3.5},
    "sd3": {"cfg": 7.0, "guidance": None},
}
ORACLE_MAX_SEQUENCE_LENGTH = 512
ORACLE_NEGATIVE_PROMPT = ""
VAE_SCALE = 8  # pixels per latent pixel (ComfyUI's LATENT is [B,16,H/8,W/8])


def comfyui_noise(seed: int, shape) -> torch.Tensor:
    """ComfyUI's comfy.sample.prepare_noise (no batch_index), written out: one draw of the
    whole latent from torch.manual_seed(seed), fp32, on the CPU."""
    return torch.randn(tuple(shape), generator=torch.manual_seed(seed), dtype=torch.float32,
                       device="cpu")


def vae_factors(path) -> tuple:
    """(scaling_factor, shift_factor) from the model folder's vae/config.json."""
    import json
    with open(Path(path) / "vae" / "config.json") as f:
        c = json.load(f)
    return float(c["scaling_factor"]), float(c.get("shift_factor") or 0.0)


def model_to_latent(x: torch.Tensor, path) -> torch.Tensor:
    """Model-space [B,16,h,w] (unpacked) -> ComfyUI LATENT (raw VAE space):
    model_latent / scaling_factor + shift_factor (docs/design.md#numerics-rule-5)."""
    scale, shift = vae_factors(path)
    return x.float() / scale + shift


def latent_to_model(x: torch.Tensor, path) -> torch.Tensor:
    """ComfyUI LATENT (raw VAE space) -> model space [B,16,h,w] (unpacked)."""
    scale, shift = vae_factors(path)
    return (x.float() - shift) * scale


def oracle_settings(arch: str, req: GenerationRequest) -> dict:
    """The request's generation settings, with the test's defaults for unset fields; the
    product must resolve the request to the same values."""
    d = ORACLE_DEFAULTS[arch]
    out = {
        "cfg": float(req.cfg) if req.cfg is not None else d["cfg"],
        "guidance": float(req.guidance) if req.guidance is not None else d["guidance"],
        "max_sequence_length": int(req.max_sequence_length),
        "negative_prompt": req.negative_prompt,
    }
    r = req.resolved(arch)
    got = {"cfg": r.cfg, "guidance": r.guidance, "max_sequence_length": r.max_sequence_length,
           "negative_prompt": r.negative_prompt}
    assert got == out, f"the request resolves to {got}; the oracle assumes {out}"
    assert GenerationRequest(prompt=["x"]).max_sequence_length == ORACLE_MAX_SEQUENCE_LENGTH
    assert GenerationRequest(prompt=["x"]).negative_prompt == ORACLE_NEGATIVE_PROMPT
    return out


def flux2_noise(seed: int, batch: int, height: int, width: int) -> torch.Tensor:
    """ComfyUI's prepare_noise on a FLUX.2 LATENT (latent_formats.Flux2: 128 channels at
    1/16), which is also the shape diffusers' Flux2 pipelines draw their noise in."""
    return comfyui_noise(seed, (batch, 128, height // 16, width // 16))


def flux2_bn(path):
    """(mean, std) [1,128,1,1] of a FLUX.2 folder's VAE batch norm, read from its files."""
    import json

    from safetensors.torch import load_file
    folder = Path(path) / "vae"
    eps = json.loads((folder / "config.json").read_text()).get("batch_norm_eps", 1e-4)
    for f in sorted(folder.glob("*.safetensors")):
        sd = load_file(str(f))
        if "bn.running_mean" in sd:
            mean, var = sd["bn.running_mean"].float(), sd["bn.running_var"].float()
            return mean.view(1, -1, 1, 1), torch.sqrt(var + eps).view(1, -1, 1, 1)
    raise AssertionError(f"{folder} has no bn.running_mean")


def flux2_comfy_from_raw(raw: torch.Tensor, path) -> torch.Tensor:
    """A Flux2KleinPipeline output_type="latent" result (the raw 32-channel VAE latent) ->
    ComfyUI's FLUX.2 LATENT [B,128,h/16,w/16]: diffusers' own patchify, then the inverse of
    the pipeline's `latents * bn_std + bn_mean`."""
    from diffusers import Flux2KleinPipeline
    mean, std = flux2_bn(path)
    return (Flux2KleinPipeline._patchify_latents(raw.float()) - mean) / std


def pack_flux(x: torch.Tensor) -> torch.Tensor:
    """[B,16,h,w] -> FLUX's packed [B, h/2*w/2, 64], with diffusers' own packing."""
    import diffusers
    b, c, h, w = x.shape
    return diffusers.FluxPipeline._pack_latents(x, b, c, h, w)


def unpack_flux(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse, with diffusers' own unpacking (height/width in pixels)."""
    import diffusers
    return diffusers.FluxPipeline._unpack_latents(x, height, width, VAE_SCALE)


@pytest.fixture(scope="session")
def unmoved_latent(model_dir):
    """unmoved_latent(arch, req, path=None) -> the request's initial noise as a ComfyUI
    LATENT: exactly what the pool would return if the transformer predicted zero velocity
    (every Euler step then adds 0 to the noise). A result "moved away from the noise" must
    be compared with this, in the same space, never with the raw noise."""
    def get(arch: str, req: GenerationRequest, path=None) -> torch.Tensor:
        noise = comfyui_noise(req.seed, (req.batch, 16, req.height // VAE_SCALE,
                                         req.width // VAE_SCALE))
        return model_to_latent(noise, path or model_dir(arch))
    return get


@pytest.fixture(scope="session")
def oracle(model_dir):
    """oracle(arch, request) -> the single-process diffusers pipeline's final latent, in
    ComfyUI's LATENT space, from the same noise (docs/design.md#numerics-rule-4).

    Nothing here comes from the product: the noise is ComfyUI's prepare_noise written out,
    FLUX's packing is diffusers' `FluxPipeline._pack_latents` / `_unpack_latents`, the
    defaults are `ORACLE_DEFAULTS`, and LATENT space uses the model folder's VAE config. So a
    wrong but self-consistent packing, noise or default in the product is caught."""
    import diffusers

    pipes, cache = {}, {}

    def run(arch: str, req: GenerationRequest, path=None) -> torch.Tensor:
        """`path`: another model folder of `arch` (default: the session's tiny model)."""
        path = str(path or model_dir(arch))
        key = (path, tuple(req.prompt), req.seed, req.steps, req.height, req.width, req.cfg,
               req.guidance, req.max_sequence_length, req.negative_prompt)
        if key in cache:
            return cache[key]
        s = oracle_settings(arch, req)
        batch, h, w = len(req.prompt), req.height, req.width
        noise = comfyui_noise(req.seed, (batch, 16, h // VAE_SCALE, w // VAE_SCALE))
        negative = [s["negative_prompt"]] * batch
        if arch == "flux":
            pipe = pipes.get(path) or diffusers.FluxPipeline.from_pretrained(path)
            kw = dict(true_cfg_scale=s["cfg"], negative_prompt=negative) if s["cfg"] > 1 else {}
            out = pipe(prompt=list(req.prompt), guidance_scale=s["guidance"], height=h,
                       width=w, num_inference_steps=req.steps, latents=pack_flux(noise),
                       max_sequence_length=s["max_sequence_length"], output_type="latent",
                       **kw)
            lat = unpack_flux(out.images, h, w)
        else:
            pipe = pipes.get(path) or diffusers.StableDiffusion3Pipeline.from_pretrained(path)
            out = pipe(prompt=list(req.prompt), negative_prompt=negative,
                       guidance_scale=s["cfg"], height=h, width=w,
                       num_inference_steps=req.steps, latents=noise,
                       max_sequence_length=s["max_sequence_length"], output_type="latent")
            lat = out.images
        pipes[path] = pipe
        cache[key] = model_to_latent(lat, path)
        return cache[key]

    return run
