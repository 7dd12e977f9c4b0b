"""Model adapters: everything model-specific, one small module per family (its
description, workers/families/<family>.py, holds the facts the host reads too).

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
    """The adapter of family `arch`; `path` (the model) where the family has variants that
    encode differently (FLUX.2 [dev] / [klein] text encoders)."""
    from .. import families
    return families.family(arch).adapter_class()(path)


def read_arch(path: str) -> str:
    """The family id of a diffusers folder or a single .safetensors file (models/detect.py,
    the detection the host validates models with)."""
    from .detect import read_arch as detect_arch
    return detect_arch(path)
