"""How a family lays out its latent for the transformer ("model space"), written once for
the workers and the host (which converts ComfyUI LATENTs with it, in its comfy_convert
module). Pure tensor functions driven by the family's LatentSpec (workers/families): cheap
to import.

Three spaces:
- ComfyUI's LATENT ("comfy"): the family's latent_formats one. FLUX.1 / SD3 / Chroma: the raw
  VAE latent [B,16,H/8,W/8]; Qwen-Image: the same with a frame axis [B,16,1,H/8,W/8];
  FLUX.2: the 2x2-patchified, batch-norm-normalised latent [B,128,H/16,W/16] (ComfyUI's
  FLUX.2 VAE patchifies and normalises inside encode/decode).
- model space: what the transformer takes. "pack2x2" families pack 2x2 latent pixels into
  one token ([B,16,h,w] -> [B, h/2*w/2, 64]) and normalise, `(raw - shift) * scale` (per
  channel where scale / shift are lists: Qwen-Image's 1/std and mean); "in_model" ones (SD3)
  only normalise; FLUX.2's LATENT is already model space, only flattened to tokens.
- raw VAE space ("raw"): what the diffusers VAE decodes. = ComfyUI's LATENT except FLUX.2's:
  the 32-channel [B,32,H/8,W/8], un-normalised and unpatchified.
"""
from __future__ import annotations

from .. import families


def _spec(arch: str):
    return families.family(arch).latent


def _per_channel(v, like, dim: int = 1):
    """A scalar stays; a list of per-channel values is shaped to broadcast along `dim`."""
    import torch
    if not isinstance(v, (list, tuple)) and not torch.is_tensor(v):
        return float(v)
    t = torch.as_tensor(v, dtype=torch.float32, device=like.device).reshape(-1)
    dim %= like.dim()
    return t.reshape([-1 if i == dim else 1 for i in range(like.dim())])


def pack(arch: str, x):
    """Raw-layout [B,C,(1,)h,w] (unpatchified) -> what the transformer takes, unscaled."""
    s = _spec(arch)
    if s.tokens == "in_model":
        return x
    import torch.nn.functional as F
    if s.frames and x.dim() == 5:  # an image family with a frame axis: one frame
        x = x.squeeze(2)
    # token (i, j) holds channels c*4 + 2*dy + dx of latent pixels (2i+dy, 2j+dx):
    # exactly pixel_unshuffle's channel order, in one copy
    return F.pixel_unshuffle(x, 2).flatten(2).transpose(1, 2)


def unpack(arch: str, x, height: int, width: int):
    """Inverse of `pack` for an image of height x width pixels."""
    s = _spec(arch)
    if s.tokens == "in_model":
        return x
    import torch.nn.functional as F
    b, n, c = x.shape
    out = F.pixel_shuffle(x.transpose(1, 2).reshape(b, c, height // 16, width // 16), 2)
    return out.unsqueeze(2) if s.frames else out


def comfy_pack(arch: str, x):
    """ComfyUI-LATENT-layout samples -> tokens, unscaled (the noise takes this path). A
    "flat" LATENT is patchified already: one token per pixel, a plain flatten."""
    if _spec(arch).tokens == "flat":
        return x.flatten(2).transpose(1, 2)
    return pack(arch, x)


def comfy_unpack(arch: str, x, height: int, width: int):
    """Inverse of `comfy_pack` for an image of height x width pixels."""
    if _spec(arch).tokens == "flat":
        b, n, c = x.shape
        return x.transpose(1, 2).reshape(b, c, height // 16, width // 16)
    return unpack(arch, x, height, width)


def to_model(arch: str, latent, scale, shift):
    """ComfyUI LATENT samples -> model space (a batch-norm LATENT: no scaling, see above)."""
    if _spec(arch).norm == "batchnorm":
        return comfy_pack(arch, latent.float())
    x = latent.float()
    return pack(arch, (x - _per_channel(shift, x)) * _per_channel(scale, x))


def to_comfy(arch: str, latents, scale, shift, height: int, width: int):
    """Model space -> ComfyUI LATENT samples (fp32)."""
    if _spec(arch).norm == "batchnorm":
        return comfy_unpack(arch, latents.float(), height, width)
    x = unpack(arch, latents, height, width).float()
    return x / _per_channel(scale, x) + _per_channel(shift, x)


def to_raw(arch: str, latents, scale, shift, height: int, width: int):
    """Model space -> raw-VAE-space (what the diffusers VAE decodes)."""
    if _spec(arch).norm == "batchnorm":
        # normalised per packed channel (the VAE's batch-norm statistics over the channels
        # of the 2x2-patchified latent): model = (pack(raw) - shift) * scale
        x = latents.float()
        return unpack(arch, x / _per_channel(scale, x, -1) + _per_channel(shift, x, -1),
                      height, width)
    return to_comfy(arch, latents, scale, shift, height, width)


def comfy_to_raw(arch: str, latent, scale, shift):
    """ComfyUI LATENT samples -> raw VAE space (the Decode node's path to the VAE)."""
    if _spec(arch).norm != "batchnorm":
        return latent.float()
    d = _spec(arch).downscale
    return to_raw(arch, to_model(arch, latent, scale, shift), scale, shift,
                  d * latent.shape[-2], d * latent.shape[-1])


# ---- a sound track beside the video (families with a SoundTrack capability) --------------
# Model space is one token sequence: the video latent's tokens (one per latent pixel, frame by
# frame, row by row) then the sound latent's (one per latent frame: channels x mel bins), as
# wide as each other. ComfyUI's LATENT keeps the two apart (its AV LATENT nests them).
def sound_of(arch: str):
    """The family's SoundTrack, or None."""
    return families.family(arch).capability(families.SoundTrack)


def join_sound(video, audio):
    """Video latent [B, C, T, h, w] and sound latent [B, c, L, m] (c * m == C) -> the tokens
    [B, T*h*w + L, C] (both as they are: no scaling)."""
    b, c = video.shape[:2]
    if audio.shape[1] * audio.shape[3] != c:
        raise ValueError(f"a sound latent [B, {audio.shape[1]}, L, {audio.shape[3]}] makes "
                         f"tokens {audio.shape[1] * audio.shape[3]} wide, the video's are {c}")
    import torch
    return torch.cat([video.flatten(2).transpose(1, 2),
                      audio.transpose(1, 2).flatten(2, 3)], 1)


def split_sound(arch: str, tokens, height: int, width: int, frames: int) -> tuple:
    """Inverse of `join_sound` for a `frames`-frame video of height x width pixels: (video
    [B, C, T, h, w], sound [B, c, L, m])."""
    spec, sound = _spec(arch), sound_of(arch)
    b, _, c = tokens.shape
    t, d = spec.latent_frames(frames), spec.downscale
    h, w = int(height) // d, int(width) // d
    nv, length = t * h * w, sound.length(frames)
    if tokens.shape[1] != nv + length:
        raise ValueError(f"{tokens.shape[1]} tokens; a {frames}-frame {height}x{width} video "
                         f"with its sound has {nv} + {length}")
    video = tokens[:, :nv].transpose(1, 2).reshape(b, c, t, h, w)
    audio = tokens[:, nv:].reshape(b, length, sound.channels, sound.mel_bins).transpose(1, 2)
    return video, audio
