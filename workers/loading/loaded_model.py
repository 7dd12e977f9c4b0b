"""A model as a rank holds it once loaded: what every loader (a diffusers folder, a single
file, a PipeFusion stage, a sharded load) returns, and what the adapters and the loop read."""
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
