"""ComfyUI values <-> pool requests, without importing ComfyUI (tested in CI).

- CONDITIONING `[[cond, {"pooled_output": p, "guidance": g, ...}]]` -> the request's
  `{"cond": [b,T,D], "pooled": [b,P]}` plus FluxGuidance's value. FLUX.2 has no pooled
  output (its Qwen3 / Mistral text encoder gives hidden states only): `"pooled": None`.
- LATENT `{"samples": [B,C,h,w], "batch_index"?: [...]}` -> batch, size, noise and, when
  not all zeros, the img2img input; and the pool's samples -> LATENT. FLUX.1 / SD3: the raw
  VAE latent [B,16,H/8,W/8]. FLUX.2: ComfyUI's latent_formats.Flux2, the 2x2-patchified,
  batch-norm-normalised latent [B,128,H/16,W/16] (model space; its VAE normalises).
- A raw-VAE-space preview latent -> an RGB preview with ComfyUI's latent_rgb_factors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.client.worker_modules import worker_module

LATENT_CHANNELS = 16
# ComfyUI LATENT channels and downscale of the archs that differ from FLUX.1 / SD3's 16 at
# 1/8: FLUX.2 is latent_formats.Flux2 (latent_channels 128, spacial_downscale_ratio 16)
LATENT_CHANNELS_BY_ARCH = {"flux2": 128}
LATENT_DOWNSCALE_BY_ARCH = {"flux2": 16}


# how messages name the architectures
ARCH_NAMES = {"flux": "FLUX.1", "flux2": "FLUX.2", "sd3": "SD3"}


def latent_channels(arch: str) -> int:
    """Channels of `arch`'s ComfyUI LATENT."""
    return LATENT_CHANNELS_BY_ARCH.get(arch, LATENT_CHANNELS)


def latent_downscale(arch: str) -> int:
    """Image pixels per LATENT pixel (each side) for `arch`."""
    return LATENT_DOWNSCALE_BY_ARCH.get(arch, 8)


def latent_shape(arch: str, batch: int, height: int, width: int) -> tuple:
    """`arch`'s ComfyUI LATENT shape for a batch of height x width images (the noise's)."""
    d = latent_downscale(arch)
    return (int(batch), latent_channels(arch), int(height) // d, int(width) // d)


def latent_shape_text(arch: str) -> str:
    """How messages write `arch`'s LATENT shape."""
    d = latent_downscale(arch)
    return f"[batch, {latent_channels(arch)}, height/{d}, width/{d}]"


# what a FLUX.2 pool says about a LATENT of the raw VAE's 32 channels
FLUX2_RAW_LATENT = ("FLUX.2 LATENTs are ComfyUI's 128-channel [batch, 128, height/16, "
                    "width/16] (the VAE latent 2x2-patchified and normalised by the VAE's "
                    "batch-norm statistics, as ComfyUI's FLUX.2 VAEEncode, "
                    "EmptyFlux2LatentImage and this pack's sampler give it); a raw "
                    "32-channel [batch, 32, height/8, width/8] latent must be patchified and "
                    "normalised first")


_VAE_LATENT = worker_module("models.facts").VAE_LATENT  # the VAEs' scaling / shift factors

# ComfyUI's comfy/latent_formats.py (SD3 and Flux): scale/shift of the VAE (the released
# VAEs' own, written once in workers/models/facts.py) and the linear latent->RGB map
# ComfyUI's latent2rgb previewer applies to model-space latents.
LATENT_FORMATS = {
    "sd3": {
        "scale": _VAE_LATENT["sd3"]["scaling_factor"],
        "shift": _VAE_LATENT["sd3"]["shift_factor"],
        "rgb": [[-0.0922, -0.0175, 0.0749], [0.0311, 0.0633, 0.0954], [0.1994, 0.0927, 0.0458],
                [0.0856, 0.0339, 0.0902], [0.0587, 0.0272, -0.0496], [-0.0006, 0.1104, 0.0309],
                [0.0978, 0.0306, 0.0427], [-0.0042, 0.1038, 0.1358], [-0.0194, 0.0020, 0.0669],
                [-0.0488, 0.0130, -0.0268], [0.0922, 0.0988, 0.0951], [-0.0278, 0.0524, -0.0542],
                [0.0332, 0.0456, 0.0895], [-0.0069, -0.0030, -0.0810], [-0.0596, -0.0465, -0.0293],
                [-0.1448, -0.1463, -0.1189]],
        "bias": [0.2394, 0.2135, 0.1925],
    },
    "flux": {
        "scale": _VAE_LATENT["flux"]["scaling_factor"],
        "shift": _VAE_LATENT["flux"]["shift_factor"],
        "rgb": [[-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433],
                [-0.0174, 0.0160, 0.0617], [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115],
                [0.0405, 0.0861, 0.0915], [-0.0236, -0.0185, -0.0259], [-0.0245, 0.0250, 0.1180],
                [0.1008, 0.0755, -0.0421], [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036],
                [0.0817, 0.0765, 0.0749], [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499],
                [-0.1262, -0.0982, -0.0778]],
        "bias": [-0.0329, -0.0718, -0.0851],
    },
}


# ---- CONDITIONING ---------------------------------------------------------------------
def conditioning_to_request(conditioning, name: str = "positive",
                            arch: Optional[str] = None) -> tuple[dict, Optional[float]]:
    """One ComfyUI CONDITIONING -> ({"cond": [b,T,D], "pooled": [b,P] or None} fp32 CPU,
    guidance), plus "reference_latents" / "reference_method" when ReferenceLatent (and
    FluxKontextMultiReferenceLatentMethod) set them.

    Only plain text conditioning can run on the pool: several entries (ConditioningCombine,
    area / mask / ControlNet conditioning) are refused with a message, never ignored. For
    `arch` "flux2" a pooled output is not needed (and, when a text encoder adds one, not
    used: FLUX.2 has no pooled projection)."""
    import torch

    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ConfigError(f"{name} CONDITIONING is empty; connect a text encode node")
    if len(conditioning) != 1:
        raise ConfigError(f"{name} CONDITIONING has {len(conditioning)} entries (combined "
                          f"conditioning); the xDiT sampler takes one text encoding, use a "
                          f"single CLIPTextEncode / CLIPTextEncodeFlux / CLIPTextEncodeSD3")
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2:
        raise ConfigError(f"{name} CONDITIONING entry must be [cond, options]")
    cond, extra = entry[0], dict(entry[1] or {})
    unsupported = sorted(k for k in ("area", "mask", "control", "gligen", "hooks",
                                     "start_percent", "end_percent")
                         if extra.get(k) is not None and
                         not (k == "start_percent" and extra[k] == 0.0) and
                         not (k == "end_percent" and extra[k] == 1.0))
    if unsupported:
        raise ConfigError(f"{name} CONDITIONING uses {', '.join(unsupported)}, which the xDiT "
                          f"sampler does not support; use plain text conditioning")
    pooled = extra.get("pooled_output")
    if not torch.is_tensor(cond) or cond.dim() != 3:
        raise ConfigError(f"{name} CONDITIONING tensor must be [batch, tokens, dim]")
    guidance = extra.get("guidance")
    guidance = None if guidance is None else float(guidance)
    cond = cond.detach().float().cpu().contiguous()
    out = {"cond": cond}
    refs = extra.get("reference_latents")
    if refs is not None:  # ComfyUI's ReferenceLatent: LATENT samples, in order
        if not isinstance(refs, (list, tuple)) or not all(torch.is_tensor(r) for r in refs):
            raise ConfigError(f"{name} CONDITIONING's reference_latents must be a list of "
                              f"LATENT tensors (as ComfyUI's ReferenceLatent node sets them)")
        out["reference_latents"] = [r.detach().float().cpu().contiguous() for r in refs]
        out["reference_method"] = extra.get("reference_latents_method")
    if arch == "flux2":
        return dict(out, pooled=None), guidance
    if pooled is None:
        raise ConfigError(f"{name} CONDITIONING has no pooled_output; encode it with a "
                          f"FLUX/SD3 CLIP loader (CLIP-L + T5, or CLIP-L + CLIP-G + T5)")
    if pooled.dim() == 1:
        pooled = pooled.unsqueeze(0)
    return dict(out, pooled=pooled.detach().float().cpu().contiguous()), guidance


def check_text_width(c: dict, width: int, arch: str, name: str = "positive") -> None:
    """The text states' last dimension must be the transformer's joint_attention_dim: a
    CONDITIONING from another model's text encoder is refused here, in one line, instead of
    failing inside a worker."""
    got = int(c["cond"].shape[-1])
    if got == int(width):
        return
    hint = {"flux2": "encode with this FLUX.2 model's own text encoder (klein 4B: Qwen3-4B, "
                     "klein 9B: Qwen3-8B, dev: Mistral Small 3.1) or type the prompt into "
                     "the sampler",
            "flux": "encode with FLUX.1's CLIP-L + T5-XXL (DualCLIPLoader type flux)",
            "sd3": "encode with SD3's CLIP-L + CLIP-G + T5-XXL (TripleCLIPLoader)"}.get(
        arch, "encode with this model's text encoders")
    raise ConfigError(f"{name} CONDITIONING has text states of width {got}, but this "
                      f"{ARCH_NAMES.get(arch, arch)} transformer takes {int(width)} (its "
                      f"joint_attention_dim): {hint}")


def request_to_conditioning(c: dict, guidance: Optional[float] = None) -> list:
    """The inverse (for tests and round trips): request dict -> ComfyUI CONDITIONING."""
    extra = {} if c.get("pooled") is None else {"pooled_output": c["pooled"]}
    if c.get("reference_latents") is not None:
        extra["reference_latents"] = list(c["reference_latents"])
        if c.get("reference_method") is not None:
            extra["reference_latents_method"] = c["reference_method"]
    if guidance is not None:
        extra["guidance"] = guidance
    return [[c["cond"], extra]]


# ---- LATENT ---------------------------------------------------------------------------
@dataclass
class LatentInput:
    batch: int
    height: int
    width: int
    empty: bool  # all zeros: text-to-image
    samples: Any  # [B,C,h,w] fp32 CPU (zeros of the model's C channels when empty)
    batch_index: Optional[list] = None


def is_empty_latent(samples) -> bool:
    """An all-zero latent (EmptySD3LatentImage / EmptyLatentImage) means text-to-image."""
    import torch
    return int(torch.count_nonzero(samples)) == 0


def latent_from_comfy(latent: dict, arch: str = "flux") -> LatentInput:
    """ComfyUI LATENT -> LatentInput for a model of `arch` (FLUX.1 / SD3: [B,16,H/8,W/8];
    FLUX.2: [B,128,H/16,W/16]). An all-zero latent of any channel count is text-to-image at
    its size (as ComfyUI's fix_empty_latent_channels treats it; 1/16 for a 128-channel one,
    else 1/8); a non-empty one must be in the model's layout (one error otherwise)."""
    import torch

    if not isinstance(latent, dict) or not torch.is_tensor(latent.get("samples")):
        raise ConfigError("LATENT input must be a dict with 'samples'; connect "
                          "EmptySD3LatentImage or a VAEEncode")
    channels = latent_channels(arch)
    s = latent["samples"]
    if s.dim() != 4:
        raise ConfigError(f"LATENT samples have shape {tuple(s.shape)}; expected "
                          f"{latent_shape_text(arch)} (image latents, not video)")
    if latent.get("noise_mask") is not None:
        raise ConfigError("LATENT has a noise_mask (inpainting), which the xDiT sampler does "
                          "not support; remove SetLatentNoiseMask / use VAEEncode")
    empty = is_empty_latent(s)
    b, c, h, w = (int(v) for v in s.shape)
    d = latent_downscale(arch)
    if c != channels:
        if not empty:
            if arch == "flux2":
                raise ConfigError(f"LATENT has {c} channels; {FLUX2_RAW_LATENT}")
            raise ConfigError(f"LATENT has {c} channels; FLUX and SD3 use 16 (encode with "
                              f"the model's VAE, or start from EmptySD3LatentImage)")
        # an empty latent of another layout gives only its image size (a size that is no
        # multiple of 16 is then refused by the request, not rounded here)
        d = 16 if c == LATENT_CHANNELS_BY_ARCH["flux2"] else 8
        s = torch.zeros(latent_shape(arch, b, h * d, w * d))
    bi = latent.get("batch_index")
    return LatentInput(batch=b, height=h * d, width=w * d, empty=empty,
                       samples=s.detach().float().cpu().contiguous(),
                       batch_index=list(bi) if bi is not None else None)


def latent_to_comfy(samples) -> dict:
    """Pool result samples (already ComfyUI's layout) -> ComfyUI LATENT."""
    return {"samples": samples.float().cpu()}


def comfy_noise(seed: int, shape, batch_index=None):
    """Exactly ComfyUI's `comfy.sample.prepare_noise` (fp32, CPU), batch_index included."""
    import torch

    gen = torch.manual_seed(seed)
    if batch_index is None:
        return torch.randn(list(shape), dtype=torch.float32, generator=gen, device="cpu")
    uniq = sorted(set(int(i) for i in batch_index))
    drawn = {}
    for i in range(uniq[-1] + 1):
        n = torch.randn([1] + list(shape)[1:], dtype=torch.float32, generator=gen, device="cpu")
        if i in uniq:
            drawn[i] = n
    return torch.cat([drawn[int(i)] for i in batch_index], dim=0)


# ---- previews -------------------------------------------------------------------------
def preview_rgb(preview, arch: str):
    """Raw-VAE-space latent [1,16,h,w] -> uint8 RGB [h,w,3] the way ComfyUI's latent2rgb
    previewer shows it (it works on model-space latents, hence process_in first); None for
    an architecture without latent->RGB factors here (FLUX.2: no preview image)."""
    import torch

    fmt = LATENT_FORMATS.get(arch)
    if fmt is None:
        return None
    x = (preview[0].float() - fmt["shift"]) * fmt["scale"]
    rgb = torch.nn.functional.linear(x.movedim(0, -1), torch.tensor(fmt["rgb"]).T,
                                     bias=torch.tensor(fmt["bias"]))
    return ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).round().to(torch.uint8)


# ---- ComfyUI LATENT space <-> the workers' model space -----------------------------------
# The workers speak model space (DESIGN.md numerics 5): FLUX packs 2x2 latent pixels per
# token, and both scale by the VAE's factors; FLUX.2's LATENT is model space already, only
# flattened. `fmt` is what the pool reports for its model: {"scale": ..., "shift": ...}; the
# layouts are the architecture's (workers/models/latent_layout).
def comfy_to_model(arch: str, samples, fmt: dict):
    """ComfyUI LATENT samples -> model space."""
    return worker_module("models.latent_layout").to_model(arch, samples, fmt["scale"], fmt["shift"])


def model_to_comfy(arch: str, latents, fmt: dict, height: int, width: int):
    """Model-space latents -> ComfyUI LATENT samples (fp32)."""
    return worker_module("models.latent_layout").to_comfy(
        arch, latents, fmt["scale"], fmt["shift"], height, width).float()


def noise_to_model(arch: str, noise):
    """ComfyUI's noise (drawn in the LATENT's shape) -> the transformer's layout (noise is
    not scaled)."""
    return worker_module("models.latent_layout").comfy_pack(arch, noise.float())
