"""Model adapters: everything model-specific, one small module per architecture.

An adapter declares the parallel layout (`layout`) and the few model-specific steps of the
denoising loop: loading, prompt encoding, latent packing, timesteps and the transformer call.
The parallel methods themselves never look at the model class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LoadedModel:
    path: str
    arch: str
    transformer: Any
    encoder: Any  # a diffusers pipeline holding only the text encoders (rank 0), else None
    scheduler_config: dict
    vae_config: dict
    device: Any
    dtype: Any
    vae: Any = None  # loaded on first decode (rank 0)
    stage: Any = None  # PipeFusion StageInfo when this rank holds one stage of the blocks


def get_adapter(arch: str, path=None):
    """The adapter of `arch`; `path` (the model) where the arch has variants that load
    differently (FLUX.2 [dev] / [klein] text encoders)."""
    if arch == "flux":
        from .flux import FluxAdapter
        return FluxAdapter()
    if arch == "sd3":
        from .sd3 import SD3Adapter
        return SD3Adapter()
    if arch == "flux2":
        from .flux2 import Flux2Adapter
        return Flux2Adapter(path)
    raise ValueError(f"unknown architecture {arch!r} (expected flux or sd3)")


def read_arch(path: str) -> str:
    """flux | sd3 of a diffusers folder or a single .safetensors file (models/detect.py, the
    detection the host validates models with)."""
    from .detect import read_arch as detect_arch
    return detect_arch(path)
