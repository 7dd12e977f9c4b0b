"""The job a pool runs: every default lives here, resolved on the host before broadcast."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .worker_modules import worker_module

# Per-architecture defaults, the only place they are written. FLUX dev is guidance-distilled
# (no CFG by default); SD3 uses classic CFG.
ARCH_DEFAULTS = {
    "flux": {"cfg": 1.0, "guidance": 3.5},
    "sd3": {"cfg": 7.0, "guidance": None},
    "flux2": {"cfg": 1.0, "guidance": None},  # FLUX.2 [klein]: step-distilled, no guidance embed
}


@dataclass
class GenerationRequest:
    """One generation. `prompt` is a list (its length is the batch)."""

    prompt: list
    seed: int = 0
    steps: int = 20
    height: int = 1024
    width: int = 1024
    negative_prompt: str = ""
    guidance: Optional[float] = None
    cfg: Optional[float] = None
    max_sequence_length: int = 512
    loras: list = field(default_factory=list)
    output: str = "latent"  # "latent" or "image" (decoded by rank 0 with the model's VAE)
    preview_every: int = 0  # 0: no previews; k: a low-res x0 preview every k steps
    # Pre-encoded text (ComfyUI CONDITIONING, diffusers layout): {"cond": [b,T,D],
    # "pooled": [b,P]} with b 1 or the batch; replaces prompt / negative_prompt encoding.
    positive: Optional[dict] = None
    negative: Optional[dict] = None
    batch_size: Optional[int] = None  # default: len(prompt), or the conditioning's batch

    def __post_init__(self):
        if isinstance(self.prompt, str):
            self.prompt = [self.prompt]
        self.prompt = list(self.prompt or [])

    @property
    def batch(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        if self.prompt:
            return len(self.prompt)
        return int(self.positive["cond"].shape[0]) if self.positive else 0

    def resolved_cfg(self, arch: str) -> float:
        return float(self.cfg if self.cfg is not None else ARCH_DEFAULTS[arch]["cfg"])

    def uses_cfg(self, arch: str) -> bool:
        return self.resolved_cfg(arch) > 1.0

    def resolved(self, arch: str) -> "GenerationRequest":
        """A copy with every default made concrete for `arch`: what the workers receive."""
        guidance = self.guidance if self.guidance is not None else ARCH_DEFAULTS[arch]["guidance"]
        return replace(self, cfg=self.resolved_cfg(arch), guidance=guidance,
                       prompt=list(self.prompt), loras=list(self.loras))

    def problems(self, model: Any = None) -> list[str]:
        out = []
        if self.positive is None and (not self.prompt or
                                      not all(isinstance(p, str) for p in self.prompt)):
            out.append("prompt must be one or more strings (or give positive conditioning)")
        for name in ("positive", "negative"):
            c = getattr(self, name)
            if c is None:
                continue
            if not isinstance(c, dict) or "cond" not in c or "pooled" not in c:
                out.append(f"{name} conditioning must be {{'cond': [b,T,D], 'pooled': [b,P]}}")
            elif c["cond"].dim() != 3 or c["pooled"].dim() != 2:
                out.append(f"{name} conditioning has shapes {tuple(c['cond'].shape)} / "
                           f"{tuple(c['pooled'].shape)}; expected [b,T,D] and [b,P]")
            elif int(c["cond"].shape[0]) not in (1, self.batch):
                out.append(f"{name} conditioning batch {int(c['cond'].shape[0])} is neither 1 "
                           f"nor the batch {self.batch}")
        if self.batch_size is not None and self.prompt and len(self.prompt) not in (1, self.batch_size):
            out.append(f"{len(self.prompt)} prompts for a batch of {self.batch_size}; give 1 or "
                       f"{self.batch_size}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64:
            out.append(f"seed must be an integer in [0, 2^64) (got {self.seed!r})")
        if not isinstance(self.steps, int) or self.steps < 1:
            out.append(f"steps must be an integer >= 1 (got {self.steps!r})")
        for name in ("height", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v % 16:
                near = max(16, round(v / 16) * 16) if isinstance(v, (int, float)) else 1024
                out.append(f"{name} {v!r} is not a positive multiple of 16 (try {near})")
        if not isinstance(self.max_sequence_length, int) or not 1 <= self.max_sequence_length <= 512:
            out.append(f"max_sequence_length must be in 1..512 (got {self.max_sequence_length!r})")
        if self.cfg is not None and self.cfg < 1.0:
            out.append(f"cfg must be >= 1 (got {self.cfg}); 1 disables classifier-free guidance")
        out.extend(_lora_problems(self.loras))
        if self.output not in ("latent", "image"):
            out.append(f"output must be 'latent' or 'image' (got {self.output!r})")
        out.extend(_single_file_problems(self, model))
        return out


def _single_file_problems(req: "GenerationRequest", model) -> list[str]:
    """A single-file model has no text encoders and no VAE (model: a ModelInfo)."""
    messages = worker_module("messages")  # the workers give the same two messages

    out = []
    if model is None:
        return out
    if not getattr(model, "has_text_encoders", True):
        if req.positive is None:
            out.append(messages.NO_TEXT_ENCODERS)
        elif req.uses_cfg(model.arch) and req.negative is None:
            out.append(f"cfg {req.resolved_cfg(model.arch)} needs negative CONDITIONING too: "
                       f"this single-file model has no text encoders to encode the negative "
                       f"prompt text (connect one, or set cfg 1)")
    if req.output == "image" and not getattr(model, "has_vae", True):
        out.append(messages.NO_VAE)
    return out


def _lora_problems(loras) -> list[str]:
    """`loras` is a list of (file, strength); the files must exist (the workers read them
    again, by the same path, and check their keys against the model)."""
    import math
    import os

    if not isinstance(loras, (list, tuple)):
        return [f"loras must be a list of (file, strength) pairs (got {type(loras).__name__})"]
    out = []
    for i, item in enumerate(loras):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            out.append(f"LoRA #{i + 1} must be a (file, strength) pair (got {item!r})")
            continue
        path, strength = item
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            out.append(f"LoRA #{i + 1}: the file must be a path (got {path!r})")
        elif not os.path.isfile(os.path.expanduser(str(path))):
            out.append(f"LoRA file not found: {path}")
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) \
                or not math.isfinite(strength):
            out.append(f"LoRA {path}: strength must be a finite number (got {strength!r})")
    return out


@dataclass
class GenerationResult:
    """`samples`: ComfyUI LATENT samples [B,16,H/8,W/8] in raw VAE space (fp32, CPU).
    `images`: [B,H,W,3] in 0..1 when the request asked for output="image"."""

    samples: Any
    images: Any = None
    timings: dict = field(default_factory=dict)
    config: Any = None
    stats: list = field(default_factory=list)  # per rank: denoise_s, comm bytes (when metered)
