"""A generation request, typed and defined once: the host's Python API, CLI and Sampler node
fill it (`from comfyui_xdit import GenerationRequest` is this class, loaded through
comfyui_xdit/bridge.py), checks it (`problems`, workers/runtime/request_checks.py) and makes
its defaults concrete (`resolved`); the protocol's `Job` carries it as its `to_wire()` and
rank 0 and every rank read it back (`from_wire`). Cheap to import: no torch until a tensor
is checked or converted.

Conditioning fields (`positive`, `negative`) are `Conditioning`s (workers/runtime/
conditioning.py) holding text only; a dict of its fields is taken too.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

from .. import families
from ..sampling.cache_settings import CacheSettings
from .conditioning import Conditioning
from .request_checks import (extra_guidance_problems, reference_image_problems,
                             reference_problems,
                             single_file_problems, cache_problems, conditioning_problems,
                             frames_problems, image_tensors, lora_entries, lora_problems,
                             resolved_cache, start_image_problems)


def default_cfg(model) -> float:
    """The cfg a request without one runs at: the family's (workers/families), or its
    undistilled variant's where the model says it is one (FLUX.2 [klein] base models take
    CFG 4.0, as Flux2KleinPipeline does). `model`: a ModelInfo (anything with `.arch` and
    `.distilled`), or a family id where the default does not depend on the model."""
    fam = families.family(_arch(model))
    if fam.defaults.undistilled_cfg is not None:
        if isinstance(model, str):
            raise ValueError(f"the default cfg of a {fam.name} model depends on whether it is "
                             f"distilled; pass its ModelInfo (read_model_info), not {model!r}")
        if getattr(model, "distilled", None) is False:
            return float(fam.defaults.undistilled_cfg)
    return float(fam.defaults.cfg)


def _arch(model) -> str:
    return model if isinstance(model, str) else model.arch


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
    # video families (Wan): frames of each video, 4k + 1 (ComfyUI's LATENT has (frames - 1)
    # / 4 + 1 of them); images: 1
    frames: int = 1
    # the second expert's guidance scale (Wan 2.2 A14B's low-noise transformer; None: cfg)
    cfg_2: Optional[float] = None
    # the scheduler's flow shift in place of the model's (ComfyUI's ModelSamplingSD3 shift;
    # Wan, SD3; a model whose schedule shifts by image size refuses it); None: the model's
    shift: Optional[float] = None
    # [(path, strength)] or (path, strength, "high" | "low") for one expert of two, or
    # {"path", "strength", "expert"} dicts; resolved to tuples
    loras: list = field(default_factory=list)
    output: str = "latent"  # "latent" or "image" (decoded by rank 0 with the model's VAE)
    preview_every: int = 0  # 0: no previews; k: a low-res x0 preview every k steps
    # Pre-encoded text (ComfyUI CONDITIONING, diffusers layout), replacing prompt /
    # negative_prompt encoding: a Conditioning of context [b,T,D], pooled [b,P] (None for a
    # family without, FLUX.2) and a second text's states (context_2), b 1 or the batch; a
    # dict of its fields is taken too ({"context" or "cond": ..., "pooled": ...}).
    positive: Optional[Conditioning] = None
    negative: Optional[Conditioning] = None
    batch_size: Optional[int] = None  # default: len(prompt), or the conditioning's batch
    # Reference images (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit; ComfyUI's ReferenceLatent):
    # a list of ComfyUI LATENT samples, each [1 or batch, C, h, w] (FLUX.1: raw VAE space, 16
    # channels at 1/8, h, w even; FLUX.2: patchified and normalised, 128 channels at 1/16;
    # Qwen-Image: raw VAE space [1 or batch, 16, 1, h, w] or without the frame axis, h, w
    # even), in reference order. Their tokens join the image stream after the latent's;
    # `reference_method` places several of them in RoPE position space (the family's
    # reference_methods; None: its default, "offset" / "index").
    reference_latents: Optional[list] = None
    reference_method: Optional[str] = None
    # Reference images instead of their latents (the CLI's --image): each a float tensor
    # [H, W, 3] in 0..1 (or [1, H, W, 3], ComfyUI's IMAGE) or a PIL image, in reference order.
    # Rank 0 resizes and VAE-encodes them with the folder's own VAE exactly as the family's
    # diffusers pipeline prepares its references (FluxKontextPipeline, Flux2KleinPipeline,
    # QwenImageEditPipeline, whose text encoder also reads the image with the prompt); a
    # diffusers folder is needed. They go through 8-bit RGB, as the pipelines take PIL images.
    reference_images: Optional[list] = None
    # Image-to-video (Wan I2V folders, WanImageToVideoPipeline): the start frame, shared by
    # every guidance branch (and both experts of Wan 2.2). Either one `reference_images`
    # entry (the CLI's --image: rank 0 resizes it to height x width, VAE-encodes it followed
    # by black frames, and, for Wan 2.1, reads it with the folder's CLIP image encoder, all
    # as the pipeline does), or ComfyUI's WanImageToVideo values, which
    # comfy_convert.conditioning_to_request reads into the CONDITIONING's Conditioning and
    # the Sampler node lifts here (positive and negative must agree):
    #   concat_latent: its "concat_latent_image", the RAW VAE latent (ComfyUI's LATENT space,
    #     not normalised) of the start video (the image, then mid-grey frames)
    #     [1 or batch, 16, T, height/8, width/8], T = (frames - 1) / 4 + 1, the LATENT's own
    #     size (sizes are not rescaled: a mismatch is refused);
    #   concat_mask: its "concat_mask" as the node sets it, [1 or batch, 1 or 4, T' <= T,
    #     height/8, width/8], 0 on the latent frames the image gives (WanImageToVideo: the
    #     first (images - 1) // 4 + 1), 1 elsewhere; None as in ComfyUI's WAN21.concat_cond
    #     (the transformer's mask channels all 0). The pool builds the transformer's 20
    #     extra input channels as WAN21.concat_cond does: cat([1 - mask (channel mean,
    #     frames padded with 0, repeated to 4 channels), (concat_latent - mean) / std]);
    #   image_embeds: "clip_vision_output".penultimate_hidden_states [1 or batch, N, D], the
    #     CLIP image tokens Wan 2.1 I2V attends to (a model without image K/V ignores them,
    #     as ComfyUI does).
    concat_latent: Any = None
    concat_mask: Any = None
    image_embeds: Any = None
    # Step cache: workers/sampling/cache_settings.py's CacheSettings, or a dict of its fields
    # (threshold, warmup, head, tail, max_skips, taylor; those left out take its defaults),
    # or None / a threshold of 0: off. Resolved to CacheSettings (or None).
    cache: Any = None
    # Guidance passes beyond cond / uncond, as the model's family declares them (its
    # ExtraGuidance capability, workers/sampling/guidance.py): {setting: value}, e.g. LTX-2's
    # {"stg_scale": 1.0, "stg_blocks": [29], "modality_scale": 3.0}; None or {}: cond /
    # uncond only. Each extra pass is one more forward per step (CFG parallel spreads them).
    extra_guidance: Optional[dict] = None

    def __post_init__(self):
        if isinstance(self.prompt, str):
            self.prompt = [self.prompt]
        self.prompt = list(self.prompt or [])

    def __setattr__(self, name, value):
        """A conditioning given as a dict of its fields (or another package's Conditioning)
        is read here, whenever it is set; one that does not read is left as given, for
        `problems` to name."""
        if name in ("positive", "negative") and value is not None and \
                not isinstance(value, Conditioning):
            try:
                value = Conditioning.given(value)
            except (AttributeError, TypeError, ValueError):
                pass
        object.__setattr__(self, name, value)

    @property
    def batch(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        if self.prompt:
            return len(self.prompt)
        return self.positive.rows if isinstance(self.positive, Conditioning) else 0

    def resolved_cfg(self, model) -> float:
        """An explicit cfg as given (cfg > 1 runs CFG even on a distilled model, as
        ComfyUI's KSampler does); else `default_cfg(model)`."""
        return float(self.cfg if self.cfg is not None else default_cfg(model))

    def uses_cfg(self, model) -> bool:
        return self.resolved_cfg(model) > 1.0

    def resolved(self, model) -> "GenerationRequest":
        """A copy with every default made concrete for `model` (a ModelInfo, or an
        architecture name, see `default_cfg`): what the workers receive."""
        fam = families.family(_arch(model))
        guidance = self.guidance if self.guidance is not None else fam.defaults.guidance
        method = self.reference_method
        if (self.reference_latents or self.reference_images) and method is None:
            refs = fam.capability(families.References)
            method = None if refs is None else refs.methods[0]
        return replace(self, cfg=self.resolved_cfg(model), guidance=guidance,
                       prompt=list(self.prompt), loras=lora_entries(self.loras),
                       cache=resolved_cache(self.cache),
                       reference_latents=None if self.reference_latents is None
                       else list(self.reference_latents), reference_method=method,
                       reference_images=None if self.reference_images is None
                       else image_tensors(self.reference_images))

    def reference_tokens(self, model=None) -> int:
        """Tokens the references add to the image stream (2x2 latent pixels per token at 1/8;
        one per pixel of a 128-channel FLUX.2 LATENT at 1/16; a reference image: 16 x 16
        pixels a token at the size the family's pipeline resizes it to, known with `model`
        (a ModelInfo or a family id))."""
        from .request_checks import image_size

        def tokens(r):  # an odd side (a family that pads it) is one token more
            per = 1 if int(r.shape[1]) == 128 else 2
            return -(-int(r.shape[-2]) // per) * -(-int(r.shape[-1]) // per)
        n = sum(tokens(r) for r in (self.reference_latents or [])
                if getattr(r, "ndim", 0) in (4, 5))
        arch = model if isinstance(model, str) else getattr(model, "arch", None)
        refs = None if arch is None else families.family(arch).capability(families.References)
        resize = None if refs is None else refs.image_size
        for im in (self.reference_images or []) if resize is not None else []:
            size = image_size(im)
            if size is not None:
                w, h = resize(*size)
                n += (h // 16) * (w // 16)
        return n

    def problems(self, model: Any = None) -> list[str]:
        """What is wrong, one line each (`model`: a ModelInfo, or None where unknown)."""
        out = []
        if self.positive is None and (not self.prompt or
                                      not all(isinstance(p, str) for p in self.prompt)):
            out.append("prompt must be one or more strings (or give positive conditioning)")
        out.extend(conditioning_problems(self, model))
        arch = model if isinstance(model, str) else getattr(model, "arch", None)
        if arch is not None and not families.family(arch).text.negative and (
                (self.negative_prompt or "").strip() or self.negative is not None):
            out.append(f"{families.family(arch).name}'s unconditional pass runs without text, "
                       f"so a negative prompt would change nothing: leave it empty (and the "
                       f"negative CONDITIONING unconnected)")
        if self.batch_size is not None and self.prompt and len(self.prompt) not in (1, self.batch_size):
            out.append(f"{len(self.prompt)} prompts for a batch of {self.batch_size}; give 1 or "
                       f"{self.batch_size}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64:
            out.append(f"seed must be an integer in [0, 2^64) (got {self.seed!r})")
        if not isinstance(self.steps, int) or self.steps < 1:
            out.append(f"steps must be an integer >= 1 (got {self.steps!r})")
        # a token's side in pixels: 16, or the family's own (MiniMax-H3's 32)
        arch = model if isinstance(model, str) else getattr(model, "arch", None)
        side = 16 if arch is None else families.family(arch).latent.pixels_per_token
        for name in ("height", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < side or v % side:
                near = max(side, round(v / side) * side) if isinstance(v, (int, float)) \
                    else 1024
                out.append(f"{name} {v!r} is not a positive multiple of {side} (try {near})")
        if not isinstance(self.max_sequence_length, int) or not 1 <= self.max_sequence_length <= 512:
            out.append(f"max_sequence_length must be in 1..512 (got {self.max_sequence_length!r})")
        if self.cfg is not None and self.cfg < 1.0:
            out.append(f"cfg must be >= 1 (got {self.cfg}); 1 disables classifier-free guidance")
        if self.cfg_2 is not None and (not isinstance(self.cfg_2, (int, float))
                                       or self.cfg_2 < 1.0):
            out.append(f"cfg_2 must be >= 1 (got {self.cfg_2!r})")
        if self.shift is not None and (not isinstance(self.shift, (int, float))
                                       or isinstance(self.shift, bool) or self.shift <= 0):
            out.append(f"shift must be a number > 0 (got {self.shift!r}); unset: the model's")
        out.extend(frames_problems(self.frames, model))
        out.extend(lora_problems(self.loras, getattr(model, "experts", None)))
        if self.output not in ("latent", "image"):
            out.append(f"output must be 'latent' or 'image' (got {self.output!r})")
        out.extend(single_file_problems(self, model))
        out.extend(reference_problems(self, model))
        out.extend(reference_image_problems(self, model))
        out.extend(start_image_problems(self, model))
        out.extend(cache_problems(self.cache))
        out.extend(extra_guidance_problems(self, model))
        return out

    # ---- the wire (workers/runtime/protocol.py: a Job's `request` part) ---------------------
    def to_wire(self) -> dict:
        """Every field by name: plain values and tensors, the typed parts (conditionings,
        cache settings) as their `to_wire()`."""
        return {f.name: (getattr(self, f.name).to_wire()
                         if hasattr(getattr(self, f.name), "to_wire")
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_wire(cls, d) -> "GenerationRequest":
        """A wire dict (or a request of either package name) -> GenerationRequest."""
        if not isinstance(d, dict):
            d = d.to_wire()
        unknown = sorted(set(d) - set(FIELDS))
        if unknown:
            raise ValueError(f"a request has the fields {list(FIELDS)} (got unknown "
                             f"{unknown})")
        d = dict(d)
        for name, read in (("positive", Conditioning.from_wire),
                           ("negative", Conditioning.from_wire),
                           ("cache", CacheSettings.from_wire)):
            if d.get(name) is not None:
                d[name] = read(d[name])
        return cls(**d)


FIELDS = tuple(f.name for f in fields(GenerationRequest))
