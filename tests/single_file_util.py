"""Test helper: write a tiny diffusers transformer as a BFL / ComfyUI single file.

The names are each family's test-model builder's `single_file` (comfyui_xdit/testmodels/):
the reverse of what the loader does, written independently (per key, from the BFL layout),
so a wrong rule on either side shows up as a different latent, not a silent round trip.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "model.diffusion_model."


def _converter(arch: str):
    """The family's ComfyUI single-file names (its test-model builder's `single_file`)."""
    return importlib.import_module(f"comfyui_xdit.testmodels.{arch}").single_file


def write_single_file(model_dir, arch: str, out: Path, prefix: bool = False,
                      naming: str = "bfl", extra: dict | None = None,
                      perturb_block: int | None = None, state: dict | None = None) -> Path:
    """The tiny folder's transformer (or `state`, a diffusers state dict) as one file.
    `prefix`: under model.diffusion_model. (as in a full checkpoint; `extra` adds other parts
    such as fake VAE keys); `perturb_block`: add noise to that block's weights (negative
    control)."""
    sd = dict(state) if state is not None else \
        load_file(str(Path(model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"))
    if perturb_block is not None:
        g = torch.Generator().manual_seed(1)
        key = f"transformer_blocks.{perturb_block}."
        sd = {k: (v + 0.05 * torch.randn(v.shape, generator=g) if k.startswith(key) else v)
              for k, v in sd.items()}
    if naming == "bfl":
        sd = _converter(arch)(sd)
    if prefix:
        sd = {PREFIX + k: v for k, v in sd.items()}
    sd.update(extra or {})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out))
    return out
