"""The job a pool runs. The request is one type for the host and the workers,
`GenerationRequest` (workers/runtime/request.py: its fields, defaults and checks); the host
fills it, resolves every default before it is sent, and gets a `GenerationResult` back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from comfyui_xdit import bridge
from comfyui_xdit.bridge import families  # noqa: F401  (the host's modules read it here)

_request = bridge.request
GenerationRequest = _request.GenerationRequest
default_cfg = _request.default_cfg
frames_problems = _request.frames_problems
cache_problems = _request.cache_problems
resolved_cache = _request.resolved_cache


def cache_settings():
    """The step cache's settings type (workers/sampling/cache_settings.py), its one definition."""
    return bridge.cache_settings.CacheSettings


@dataclass
class GenerationResult:
    """`latents`: the job's Latents (workers/runtime/outputs.py) in ComfyUI's LATENT space
    (fp32, CPU); `samples` is its image or video latent: [B,16,H/8,W/8] raw VAE space
    (FLUX.1, SD3); [B,128,H/16,W/16] patchified and normalised (FLUX.2); ...
    `decoded`: its Decoded when the request asked for output="image", whose `images` are
    [B,H,W,3] in 0..1."""

    latents: Any
    decoded: Any = None
    timings: dict = field(default_factory=dict)
    config: Any = None
    stats: list = field(default_factory=list)  # per rank: denoise_s, comm bytes (when metered)

    @property
    def samples(self):
        return self.latents.samples

    @property
    def images(self):
        return None if self.decoded is None else self.decoded.images
