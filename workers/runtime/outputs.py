"""What a job gives back, typed: its latents and, when it was asked for, their decode. Each is a
few named tensors, one field per kind, so a family whose result is more than one stream (a
video with its sound) adds a field here, not a key convention on both sides.

The protocol's `Result` carries them as `to_wire()` dicts; the host converts the latents to
ComfyUI's conventions (comfyui_xdit/comfy_convert.py) and keeps both in its GenerationResult.
Cheap to import (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable


class _Named:
    """Shared by the result types: the tensors that are set, by name, and their wire form."""

    def items(self) -> list:
        return [(f.name, getattr(self, f.name)) for f in fields(self)
                if getattr(self, f.name) is not None]

    def map(self, fn: Callable[[str, Any], Any]):
        """A copy with each set tensor replaced by `fn(name, tensor)`."""
        return replace(self, **{name: fn(name, v) for name, v in self.items()})

    def to_wire(self) -> dict:
        return dict(self.items())

    @classmethod
    def from_wire(cls, d):
        if not isinstance(d, dict):  # the same type under the host's package name
            d = d.to_wire()
        names = [f.name for f in fields(cls)]
        if set(d) - set(names):
            raise ValueError(f"{cls.__name__} holds {names} (got {sorted(d)})")
        return cls(**d)


@dataclass
class Latents(_Named):
    """A job's latents. `samples`: the image or video latent [B, C, (T,) h, w] (model space
    from the workers, ComfyUI's LATENT space on the host)."""

    samples: Any
    audio: Any = None  # a sound track's latent [B, C, ...] (model space), families with sound


@dataclass
class Decoded(_Named):
    """Latents decoded with the model's VAE. `images`: IMAGE [B, H, W, 3] in 0..1 (a video's
    frames along the batch); a family with sound adds its waveform and sample rate (ComfyUI's
    AUDIO is `{"waveform": audio, "sample_rate": sample_rate}`)."""

    images: Any
    audio: Any = None  # the sound track's waveform [B, channels, samples] in -1..1
    sample_rate: Any = None  # its samples per second (an int, set with `audio`)

    def map(self, fn: Callable[[str, Any], Any]):
        """As `_Named.map`, over the tensors only (the sample rate stays as it is)."""
        return replace(self, **{name: fn(name, v) for name, v in self.items()
                                if name != "sample_rate"})
