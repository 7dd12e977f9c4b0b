"""How each architecture lays out its latent for the transformer ("model space"), written
once for the workers and the host (which converts ComfyUI LATENTs with it, in its
comfy_convert module). Pure tensor functions: cheap to import.

FLUX packs 2x2 latent pixels into one token ([B,16,h,w] -> [B, h/2*w/2, 64]); SD3 takes
the [B,16,h,w] latent as is. Model space is also scaled: `(raw - shift) * scale`.
"""
from __future__ import annotations


def pack(arch: str, x):
    """[B,C,h,w] -> what the transformer takes."""
    if arch not in ("flux", "flux2"):  # FLUX.2 packs [B,32,h,w] 2x2 alike, into 128 channels
        return x
    import torch.nn.functional as F
    # token (i, j) holds channels c*4 + 2*dy + dx of latent pixels (2i+dy, 2j+dx):
    # exactly pixel_unshuffle's channel order, in one copy
    return F.pixel_unshuffle(x, 2).flatten(2).transpose(1, 2)


def unpack(arch: str, x, height: int, width: int):
    """Inverse of `pack` for an image of height x width pixels."""
    if arch not in ("flux", "flux2"):
        return x
    import torch.nn.functional as F
    b, n, c = x.shape
    return F.pixel_shuffle(x.transpose(1, 2).reshape(b, c, height // 16, width // 16), 2)


def to_model(arch: str, raw, scale: float, shift: float):
    """Raw-VAE-space [B,C,h,w] (ComfyUI's LATENT) -> model space."""
    if arch == "flux2":
        return _flux2_to_model(raw, scale, shift)
    return pack(arch, (raw.float() - shift) * scale)


def to_raw(arch: str, latents, scale: float, shift: float, height: int, width: int):
    """Model space -> raw-VAE-space [B,C,h,w] (what a VAE decodes; ComfyUI's LATENT)."""
    if arch == "flux2":
        return _flux2_to_raw(latents, scale, shift, height, width)
    return unpack(arch, latents, height, width).float() / scale + shift


# FLUX.2 normalises per packed channel (its VAE's batch-norm statistics over the 128
# channels of the 2x2-patchified latent), so its `scale` and `shift` are 128 numbers each:
# model = (pack(raw) - shift) * scale, with shift = running mean, scale = 1 / running std.
def _per_channel(v, like):
    import torch
    return torch.as_tensor(v, dtype=torch.float32, device=like.device).reshape(-1)


def _flux2_to_model(raw, scale, shift):
    x = pack("flux2", raw.float())
    return (x - _per_channel(shift, x)) * _per_channel(scale, x)


def _flux2_to_raw(latents, scale, shift, height, width):
    x = latents.float()
    return unpack("flux2", x / _per_channel(scale, x) + _per_channel(shift, x), height, width)
