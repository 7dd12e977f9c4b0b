"""How each architecture lays out its latent for the transformer ("model space"), written
once for the workers and the host (which converts ComfyUI LATENTs with it, in its
comfy_convert module). Pure tensor functions: cheap to import.

Three spaces:
- ComfyUI's LATENT ("comfy"): FLUX.1 / SD3: the raw VAE latent [B,16,H/8,W/8]. FLUX.2: its
  latent_formats.Flux2 one, the 2x2-patchified, batch-norm-normalised latent
  [B,128,H/16,W/16] (ComfyUI's FLUX.2 VAE patchifies and normalises inside encode/decode).
- model space: what the transformer takes. FLUX packs 2x2 latent pixels into one token
  ([B,16,h,w] -> [B, h/2*w/2, 64]) and scales, `(raw - shift) * scale`; SD3 only scales;
  FLUX.2's LATENT is already model space, only flattened to tokens [B, H/16*W/16, 128].
- raw VAE space ("raw"): what the diffusers VAE decodes. FLUX.1 / SD3: = ComfyUI's LATENT.
  FLUX.2: the 32-channel [B,32,H/8,W/8], un-normalised and unpatchified.
"""
from __future__ import annotations


def pack(arch: str, x):
    """Raw-layout [B,C,h,w] (unpatchified) -> tokens, unscaled."""
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


def comfy_pack(arch: str, x):
    """ComfyUI-LATENT-layout [B,C,h,w] -> tokens, unscaled (the noise takes this path).
    FLUX.2's LATENT is patchified already: one token per pixel, a plain flatten (diffusers'
    Flux2 _pack_latents)."""
    if arch == "flux2":
        return x.flatten(2).transpose(1, 2)
    return pack(arch, x)


def comfy_unpack(arch: str, x, height: int, width: int):
    """Inverse of `comfy_pack` for an image of height x width pixels."""
    if arch == "flux2":
        b, n, c = x.shape
        return x.transpose(1, 2).reshape(b, c, height // 16, width // 16)
    return unpack(arch, x, height, width)


def to_model(arch: str, latent, scale: float, shift: float):
    """ComfyUI LATENT samples [B,C,h,w] -> model space (FLUX.2: no scaling, see above)."""
    if arch == "flux2":
        return comfy_pack(arch, latent.float())
    return pack(arch, (latent.float() - shift) * scale)


def to_comfy(arch: str, latents, scale: float, shift: float, height: int, width: int):
    """Model space -> ComfyUI LATENT samples [B,C,h,w] (fp32)."""
    if arch == "flux2":
        return comfy_unpack(arch, latents.float(), height, width)
    return unpack(arch, latents, height, width).float() / scale + shift


def to_raw(arch: str, latents, scale: float, shift: float, height: int, width: int):
    """Model space -> raw-VAE-space [B,C,h,w] (what the diffusers VAE decodes)."""
    if arch == "flux2":
        x = latents.float()
        return unpack(arch, x / _per_channel(scale, x) + _per_channel(shift, x), height, width)
    return to_comfy(arch, latents, scale, shift, height, width)


def comfy_to_raw(arch: str, latent, scale, shift):
    """ComfyUI LATENT samples -> raw VAE space (the Decode node's path to the VAE)."""
    if arch != "flux2":
        return latent.float()
    b, c, h, w = latent.shape
    return to_raw(arch, to_model(arch, latent, scale, shift), scale, shift, 16 * h, 16 * w)


# FLUX.2 normalises per packed channel (its VAE's batch-norm statistics over the 128
# channels of the 2x2-patchified latent), so its `scale` and `shift` are 128 numbers each:
# model = (pack(raw) - shift) * scale, with shift = running mean, scale = 1 / running std.
def _per_channel(v, like):
    import torch
    return torch.as_tensor(v, dtype=torch.float32, device=like.device).reshape(-1)
