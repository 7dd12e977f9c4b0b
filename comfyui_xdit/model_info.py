"""What the host needs to know about a model folder, read from its JSON (no torch import)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError

_ARCH_BY_CLASS = {
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str  # "flux" | "sd3"
    heads: int
    patch_size: int


def read_model_info(path) -> ModelInfo:
    """Detect FLUX vs SD3 from a diffusers folder; one clear error for anything else."""
    p = Path(path)
    cfg_file = p / "transformer" / "config.json"
    if not p.is_dir():
        raise ConfigError(f"model {str(p)!r} is not a directory; give a diffusers model folder "
                          f"(with model_index.json and transformer/)")
    if not cfg_file.is_file():
        raise ConfigError(f"model folder {str(p)!r} has no transformer/config.json; "
                          f"give a FLUX or SD3 diffusers folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {cfg_file}: {e}") from None
    cls = cfg.get("_class_name")
    arch = _ARCH_BY_CLASS.get(cls)
    if arch is None:
        raise ConfigError(f"model {str(p)!r} has a {cls!r} transformer; supported: "
                          f"{', '.join(sorted(_ARCH_BY_CLASS))} (FLUX.1, SD3/3.5)")
    return ModelInfo(path=str(p), arch=arch, heads=int(cfg.get("num_attention_heads", 24)),
                     patch_size=int(cfg.get("patch_size", 2 if arch == "sd3" else 1)))
