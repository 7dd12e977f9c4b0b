"""ComfyUI values <-> pool requests, without importing ComfyUI (tested in CI).

- CONDITIONING `[[cond, {"pooled_output": p, "guidance": g, ...}]]` -> a `Conditioning`
  (workers/runtime/conditioning.py: context [b,T,D], pooled [b,P], ...) plus FluxGuidance's
  value. FLUX.2 has no pooled output (its Qwen3 / Mistral text encoder gives hidden states
  only): pooled None. WanImageToVideo's start frame (concat_latent_image, concat_mask,
  clip_vision_output) -> its concat_latent / concat_mask / image_embeds, which a job takes
  as its request's (`start_image_fields`).
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
from comfyui_xdit import bridge
from comfyui_xdit.bridge import conditioning, families

Conditioning = conditioning.Conditioning


def _spec(arch: str):
    return families.family(arch).latent


def family_name(arch: str) -> str:
    """How messages name the family (FLUX.1, SD3/3.5, ...)."""
    return families.family(arch).name


def latent_channels(arch: str) -> int:
    """Channels of the family's ComfyUI LATENT."""
    return _spec(arch).channels


def latent_downscale(arch: str) -> int:
    """Image pixels per LATENT pixel (each side) for the family."""
    return _spec(arch).downscale


def latent_shape(arch: str, batch: int, height: int, width: int, frames: int = 1) -> tuple:
    """The family's ComfyUI LATENT shape for a batch of height x width images, or of videos
    of `frames` frames (the noise's)."""
    return _spec(arch).shape(batch, height, width, frames)


def latent_shape_text(arch: str) -> str:
    """How messages write the family's LATENT shape."""
    return _spec(arch).shape_text()


def layout_hint(arch: str, t) -> str:
    """The family's word on a LATENT tensor of the right rank but other channels (FLUX.2's
    raw 32-channel latent, say); "" otherwise."""
    import torch
    spec = _spec(arch)
    ok_rank = torch.is_tensor(t) and t.dim() == len(spec.shape(1, 16, 16))
    return spec.wrong_channels if ok_rank and int(t.shape[1]) != spec.channels else ""


# ---- CONDITIONING ---------------------------------------------------------------------
def conditioning_to_request(conditioning, name: str = "positive",
                            arch: Optional[str] = None) -> tuple:
    """One ComfyUI CONDITIONING -> (its Conditioning, fp32 CPU: context [b,T,D], pooled
    [b,P] or None, and where set the second text's states, ReferenceLatent's ref_latents
    (FluxKontextMultiReferenceLatentMethod's ref_method) and WanImageToVideo's start image;
    FluxGuidance's guidance or None).

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
    # unprocessed_ltxav_embeds: text states ComfyUI's diffusion model still has to run
    # through its own connectors (0.33.0's LTXAV); the pool runs the model's own where the
    # family's ComfyUI model takes such states (`ComfySpec.raw_context_width`, told apart by
    # their width on the pool), else refused
    raw = arch is not None and families.family(arch).comfy.raw_context_width is not None
    unsupported = sorted(k for k in ("area", "mask", "control", "gligen", "hooks",
                                     "start_percent", "end_percent",
                                     *(() if raw else ("unprocessed_ltxav_embeds",)))
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
    out = {"context": cond.detach().float().cpu().contiguous()}
    refs = extra.get("reference_latents")
    if refs is not None:  # ComfyUI's ReferenceLatent: LATENT samples, in order
        if not isinstance(refs, (list, tuple)) or not all(torch.is_tensor(r) for r in refs):
            raise ConfigError(f"{name} CONDITIONING's reference_latents must be a list of "
                              f"LATENT tensors (as ComfyUI's ReferenceLatent node sets them)")
        out["ref_latents"] = [r.detach().float().cpu().contiguous() for r in refs]
        out["ref_method"] = extra.get("reference_latents_method")
    out.update(_start_image_values(extra, name, arch))
    second = None if arch is None else families.family(arch).capability(
        families.SecondTextEncoder)
    key_2 = None if second is None else second.comfy_conditioning
    if key_2 and extra.get(key_2) is not None:  # a second text encoder's states (ByT5)
        text_2 = extra[key_2]
        if not torch.is_tensor(text_2) or text_2.dim() != 3:
            raise ConfigError(f"{name} CONDITIONING's {key_2} must be [batch, tokens, dim]")
        out["context_2"] = text_2.detach().float().cpu().contiguous()
    if arch is not None and not families.family(arch).text.pooled:
        return Conditioning(**out), guidance
    if pooled is None:
        raise ConfigError(f"{name} CONDITIONING has no pooled_output; encode it with a "
                          f"FLUX/SD3 CLIP loader (CLIP-L + T5, or CLIP-L + CLIP-G + T5)")
    if pooled.dim() == 1:
        pooled = pooled.unsqueeze(0)
    return Conditioning(**out, pooled=pooled.detach().float().cpu().contiguous()), guidance


# ComfyUI's WanImageToVideo CONDITIONING keys -> the Conditioning's (and the request's)
# image-to-video fields
START_IMAGE_KEYS = (("concat_latent_image", "concat_latent"), ("concat_mask", "concat_mask"),
                    ("clip_vision_output", "image_embeds"))


def _start_image_values(extra: dict, name: str, arch: Optional[str]) -> dict:
    """WanImageToVideo's values in a CONDITIONING entry -> the Conditioning's fields
    {"concat_latent": the raw VAE latent, "concat_mask": ComfyUI's mask, "image_embeds": the
    CLIP vision output's hidden
    states the family's model reads (`ImageToVideo.clip_vision_states`: Wan's
    penultimate)} (fp32 CPU, as given: no layout change here; the workers
    build the transformer's inputs from them as ComfyUI's WAN21 does). Refused for a
    family without image-to-video models."""
    import torch

    present = [k for k, _ in START_IMAGE_KEYS if extra.get(k) is not None]
    if not present:
        return {}
    i2v = None if arch is None else families.family(arch).capability(families.ImageToVideo)
    if arch is not None and i2v is None:
        raise ConfigError(f"{name} CONDITIONING carries {', '.join(present)} (an image-to-"
                          f"video start frame), which {family_name(arch)} models do not take")
    out = {}
    # the states the family's model reads
    states = "penultimate_hidden_states" if i2v is None else i2v.clip_vision_states
    for key, field in START_IMAGE_KEYS:
        v = extra.get(key)
        if v is None:
            continue
        if key == "clip_vision_output":  # comfy.clip_vision.Output (attribute or item)
            v = getattr(v, states, None) if not isinstance(v, dict) else v.get(states)
        if not torch.is_tensor(v):
            raise ConfigError(f"{name} CONDITIONING's {key} must hold a tensor (as ComfyUI's "
                              f"WanImageToVideo / CLIPVisionEncode set it)")
        out[field] = v.detach().float().cpu().contiguous()
    return out


def start_image_fields(positive, negative=None) -> dict:
    """The request's image-to-video fields (GenerationRequest.concat_latent, concat_mask,
    image_embeds) from `conditioning_to_request`'s positive and negative Conditionings: the
    pool gives both guidance branches one start frame, so a negative CONDITIONING must carry
    the same values (route both through WanImageToVideo) or, with cfg 1, be None."""
    import torch

    fields = [f for _, f in START_IMAGE_KEYS]
    pos = {f: getattr(positive, f) for f in fields}
    if negative is not None:
        for f in fields:
            a, b = pos[f], getattr(negative, f)
            same = (a is None and b is None) or (a is not None and b is not None and
                                                 a.shape == b.shape and torch.equal(a, b))
            if not same:
                raise ConfigError(f"positive and negative CONDITIONING differ in {f}: the "
                                  f"xDiT sampler gives both guidance branches one start frame "
                                  f"(connect both through the same WanImageToVideo)")
    return {f: v for f, v in pos.items() if v is not None}


def check_text_width(c, width: int, arch: str, name: str = "positive", raw=None) -> None:
    """The text states' last dimension must be `width` (`model_text_width`: the transformer's
    joint_attention_dim, once per prompt stream), or `raw` where the model also takes states
    before its own text modules (`ModelInfo.raw_text_width`): a CONDITIONING from another
    model's text encoder is refused here, in one line, instead of failing inside a worker."""
    got = int(c.context.shape[-1])
    if got == int(width) or (raw is not None and got == int(raw)):
        return
    fam = families.family(arch)
    streams = fam.comfy.context_streams
    what = "its joint_attention_dim" if streams == 1 else \
        f"{streams} prompt states of {int(width) // streams} side by side, one per stream"
    before = "" if raw is None else f", or {int(raw)} (before the model's own text modules)"
    raise ConfigError(f"{name} CONDITIONING has text states of width {got}, but this "
                      f"{family_name(arch)} transformer takes {int(width)} ({what}){before}: "
                      f"{fam.text.hint}")


def request_to_conditioning(c, guidance: Optional[float] = None) -> list:
    """The inverse (for tests and round trips): a Conditioning (or a dict of its fields) ->
    ComfyUI CONDITIONING (a second text's states are left out: their key is the family's)."""
    c = Conditioning.given(c)
    extra = {} if c.pooled is None else {"pooled_output": c.pooled}
    if c.ref_latents is not None:
        extra["reference_latents"] = list(c.ref_latents)
        if c.ref_method is not None:
            extra["reference_latents_method"] = c.ref_method
    for key, field in START_IMAGE_KEYS:
        if getattr(c, field) is not None:
            extra[key] = getattr(c, field) if key != "clip_vision_output" else \
                {"penultimate_hidden_states": getattr(c, field)}
    if guidance is not None:
        extra["guidance"] = guidance
    return [[c.context, extra]]


# ---- LATENT ---------------------------------------------------------------------------
@dataclass
class LatentInput:
    batch: int
    height: int
    width: int
    empty: bool  # all zeros: text-to-image
    samples: Any  # [B,C,h,w] fp32 CPU (zeros of the model's C channels when empty)
    batch_index: Optional[list] = None
    frames: int = 1  # video families (Wan): frames of each video, (T - 1) x 4 + 1


def av_parts(samples) -> tuple:
    """A LATENT's samples as (video, sound or None): ComfyUI's AV LATENT nests the two
    (a NestedTensor: `is_nested`, `unbind()`), any other LATENT is the video alone."""
    if getattr(samples, "is_nested", False) and hasattr(samples, "unbind"):
        parts = list(samples.unbind())
        return parts[0], (parts[1] if len(parts) > 1 else None)
    return samples, None


def video_of(samples):
    """The video (or image) latent of a LATENT's samples (`av_parts`)."""
    return av_parts(samples)[0]


def is_empty_latent(samples) -> bool:
    """An all-zero latent (EmptySD3LatentImage / EmptyLatentImage) means text-to-image."""
    import torch
    return int(torch.count_nonzero(samples)) == 0


def latent_from_comfy(latent: dict, arch: str) -> LatentInput:
    """ComfyUI LATENT -> LatentInput for a model of family `arch` (its LatentSpec: FLUX.1 /
    SD3 / Chroma [B,16,H/8,W/8], FLUX.2 [B,128,H/16,W/16], Qwen-Image [B,16,1,H/8,W/8], Wan
    [B,16,T,H/8,W/8] of (T - 1) x 4 + 1 video frames: EmptyHunyuanLatentVideo's). An
    all-zero latent of any channel count or rank is text-to-image at its size (as ComfyUI's
    fix_empty_latent_channels treats it: the LATENT's downscale_ratio_spacial where its node
    sets one, as 0.33.0's do, else 1/16 for a 128-channel one and 1/8 for others); a
    non-empty one must be in the model's layout (one error otherwise)."""
    import torch

    if not isinstance(latent, dict) or not torch.is_tensor(video_of(latent.get("samples"))):
        raise ConfigError("LATENT input must be a dict with 'samples'; connect "
                          "EmptySD3LatentImage or a VAEEncode")
    spec = _spec(arch)
    s = video_of(latent["samples"])
    empty = is_empty_latent(s) if s.dim() in (4, 5) else False
    if s.dim() not in (4, 5) or (s.dim() == 5 and (not spec.frames or (
            s.shape[2] != 1 and not spec.video))) or \
            (not empty and s.dim() != len(spec.shape(1, 16, 16))):
        raise ConfigError(f"LATENT samples have shape {tuple(s.shape)}; expected "
                          f"{spec.shape_text()}"
                          + ("" if spec.video else " (image latents, not video)"))
    if latent.get("noise_mask") is not None:
        raise ConfigError("LATENT has a noise_mask (inpainting), which the xDiT sampler does "
                          "not support; remove SetLatentNoiseMask / use VAEEncode")
    b, c, h, w = (int(s.shape[i]) for i in (0, 1, -2, -1))
    frames = spec.video_frames(int(s.shape[2])) if spec.video and s.dim() == 5 \
        else 1
    d = spec.downscale
    # ComfyUI 0.33.0's empty-latent nodes name their pixels per latent pixel (8 for
    # EmptySD3LatentImage, 16 for FLUX.2's, 32 for LTX's); without it the channels tell
    ratio = int(latent.get("downscale_ratio_spacial") or 0) if empty else 0
    if c != spec.channels or s.dim() != len(spec.shape(1, 16, 16)) or ratio not in (0, d):
        if not empty:
            raise ConfigError(f"LATENT has {c} channels; {spec.wrong_channels}")
        # an empty latent of another layout gives only its image size (a size that is no
        # multiple of 16 is then refused by the request, not rounded here)
        d = ratio or next((f.latent.downscale for f in families.FAMILIES.values()
                           if f.latent.channels == c), 8)
        s = torch.zeros(spec.shape(b, h * d, w * d, frames))
    bi = latent.get("batch_index")
    return LatentInput(batch=b, height=h * d, width=w * d, empty=empty,
                       samples=s.detach().float().cpu().contiguous(),
                       batch_index=list(bi) if bi is not None else None, frames=frames)


def latent_to_comfy(latents) -> dict:
    """A result's Latents (already ComfyUI's layout; workers/runtime/outputs.py) -> ComfyUI
    LATENT: each of its tensors under its name ("samples": the image or video latent)."""
    return {name: t.float().cpu() for name, t in latents.items()}


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
    a family without latent->RGB factors here (FLUX.2: no preview image)."""
    import torch

    fam = families.family(arch)
    if fam.latent.rgb is None:
        return None
    scale, shift = families.latent_norm(fam.detection.released({})[1])
    x = preview[0].float()
    if x.dim() == 4:  # a frame axis: the first frame
        x = x[:, 0]
    per = (lambda v: torch.as_tensor(v, dtype=torch.float32).reshape(-1, 1, 1))
    x = (x - per(shift)) * per(scale)
    rgb = torch.nn.functional.linear(x.movedim(0, -1), torch.tensor(fam.latent.rgb).T,
                                     bias=torch.tensor(fam.latent.rgb_bias))
    return ((rgb + 1.0) / 2.0).clamp(0, 1).mul(255).round().to(torch.uint8)


# ---- ComfyUI LATENT space <-> the workers' model space -----------------------------------
# The workers speak model space (docs/design.md#numerics-rule-5): FLUX packs 2x2 latent pixels per
# token, and both scale by the VAE's factors; FLUX.2's LATENT is model space already, only
# flattened. `fmt` is what the pool reports for its model: {"scale": ..., "shift": ...}; the
# layouts are the architecture's (workers/models/latent_layout).
def comfy_to_model(arch: str, samples, fmt: dict):
    """ComfyUI LATENT samples -> model space."""
    return bridge.latent_layout.to_model(arch, samples, fmt["scale"], fmt["shift"])


def latents_to_comfy(arch: str, latents, fmt: dict, height: int, width: int):
    """A job's Latents (workers/runtime/outputs.py) from model space to ComfyUI's, each
    tensor by its kind ("samples": `model_to_comfy`; "audio": a sound track's latent, model
    space in ComfyUI too)."""
    convert = {"samples": lambda t: model_to_comfy(arch, t, fmt, height, width),
               "audio": lambda t: t.float()}
    return latents.map(lambda name, t: convert[name](t))


def model_to_comfy(arch: str, latents, fmt: dict, height: int, width: int):
    """Model-space latents -> ComfyUI LATENT samples (fp32)."""
    return bridge.latent_layout.to_comfy(
        arch, latents, fmt["scale"], fmt["shift"], height, width).float()


def noise_to_model(arch: str, noise):
    """ComfyUI's noise (drawn in the LATENT's shape) -> the transformer's layout (noise is
    not scaled). A family with a sound track: (video noise, sound noise), joined as its
    model space joins them."""
    layout = bridge.latent_layout
    if layout.sound_of(arch) is not None:
        video, audio = noise
        return layout.join_sound(video.float(), audio.float())
    return layout.comfy_pack(arch, noise.float())


def job_noise(arch: str, seed: int, batch: int, height: int, width: int, frames: int = 1):
    """ComfyUI's noise for a request's LATENT: `comfy_noise` of its shape; a family with a
    sound track: (video noise, sound noise), drawn one after the other from one generator
    as ComfyUI's prepare_noise draws a nested (AV) LATENT's."""
    import torch

    shape = latent_shape(arch, batch, height, width, frames)
    sound = bridge.latent_layout.sound_of(arch)
    if sound is None:
        return comfy_noise(seed, shape)
    gen = torch.manual_seed(seed)
    return tuple(torch.randn(list(s), dtype=torch.float32, generator=gen, device="cpu")
                 for s in (shape, sound.shape(batch, frames)))
