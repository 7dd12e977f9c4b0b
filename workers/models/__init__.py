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
    audio_vae: Any = None  # a family with sound: its audio VAE, likewise
    stage: Any = None  # PipeFusion StageInfo when this rank holds one stage of the blocks
    # a second expert (Wan 2.2 A14B's low-noise transformer; `transformer` is the high-noise
    # one) and the folder's model_index.json settings the adapter reads (boundary_ratio)
    transformer_2: Any = None
    index: Any = None

    def transformers(self) -> tuple:
        """Every transformer of the model (hooks, LoRA, compile go on each)."""
        return tuple(t for t in (self.transformer, self.transformer_2) if t is not None)


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
