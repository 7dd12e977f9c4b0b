"""How each architecture lays out its latent for the transformer ("model space"), written
once for the workers and the host (which converts ComfyUI LATENTs with it, in its
comfy_convert module). Pure tensor functions: cheap to import.

FLUX packs 2x2 latent pixels into one token ([B,16,h,w] -> [B, h/2*w/2, 64]); SD3 takes
the [B,16,h,w] latent as is. Model space is also scaled: `(raw - shift) * scale`.
"""
from __future__ import annotations


def pack(arch: str, x):
    """[B,C,h,w] -> what the transformer takes."""
    if arch != "flux":
        return x
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(arch: str, x, height: int, width: int):
    """Inverse of `pack` for an image of height x width pixels."""
    if arch != "flux":
        return x
    b, n, c = x.shape
    h, w = height // 16, width // 16
    x = x.view(b, h, w, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c // 4, h * 2, w * 2)


def to_model(arch: str, raw, scale: float, shift: float):
    """Raw-VAE-space [B,C,h,w] (ComfyUI's LATENT) -> model space."""
    return pack(arch, (raw.float() - shift) * scale)


def to_raw(arch: str, latents, scale: float, shift: float, height: int, width: int):
    """Model space -> raw-VAE-space [B,C,h,w] (what a VAE decodes; ComfyUI's LATENT)."""
    return unpack(arch, latents, height, width).float() / scale + shift
