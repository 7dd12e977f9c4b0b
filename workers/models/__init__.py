"""Model adapters: everything model-specific, one small module per family (its
description, workers/families/<family>.py, holds the facts the host reads too).

An adapter declares the parallel layout (`layout`) and the few model-specific steps of the
denoising loop: loading, prompt encoding, latent packing, timesteps and the transformer call.
The parallel methods themselves never look at the model class.
"""
from __future__ import annotations

from ..loading.loaded_model import LoadedModel  # noqa: F401  (the adapters' name for it)


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
