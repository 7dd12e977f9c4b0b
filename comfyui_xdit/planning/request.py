"""The job a pool runs: every default lives here, resolved on the host before broadcast."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from comfyui_xdit import bridge
from comfyui_xdit.bridge import families


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


def _reference_methods(fam) -> tuple:
    """The reference methods a family takes (() for a family without reference images)."""
    refs = fam.capability(families.References)
    return () if refs is None else refs.methods


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
    loras: list = field(default_factory=list)
    output: str = "latent"  # "latent" or "image" (decoded by rank 0 with the model's VAE)
    preview_every: int = 0  # 0: no previews; k: a low-res x0 preview every k steps
    # Pre-encoded text (ComfyUI CONDITIONING, diffusers layout): {"cond": [b,T,D],
    # "pooled": [b,P]} with b 1 or the batch; replaces prompt / negative_prompt encoding.
    positive: Optional[dict] = None
    negative: Optional[dict] = None
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
    # comfy_convert.conditioning_to_request carries out of the CONDITIONING and
    # comfy_convert.start_image_fields lifts here (positive and negative must agree):
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
    # Step cache: a dict of workers/sampling/cache_settings.py CacheSettings' fields (threshold,
    # warmup, head, tail, max_skips, taylor; those left out take its defaults), or None / a
    # threshold of 0: off. Resolved to every field.
    cache: Optional[dict] = None

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
        def tokens(r):  # an odd side (a family that pads it) is one token more
            per = 1 if int(r.shape[1]) == 128 else 2
            return -(-int(r.shape[-2]) // per) * -(-int(r.shape[-1]) // per)
        n = sum(tokens(r) for r in (self.reference_latents or [])
                if getattr(r, "ndim", 0) in (4, 5))
        arch = model if isinstance(model, str) else getattr(model, "arch", None)
        refs = None if arch is None else families.family(arch).capability(families.References)
        resize = None if refs is None else refs.image_size
        for im in (self.reference_images or []) if resize is not None else []:
            size = _image_size(im)
            if size is not None:
                w, h = resize(*size)
                n += (h // 16) * (w // 16)
        return n

    def problems(self, model: Any = None) -> list[str]:
        out = []
        if self.positive is None and (not self.prompt or
                                      not all(isinstance(p, str) for p in self.prompt)):
            out.append("prompt must be one or more strings (or give positive conditioning)")
        for name in ("positive", "negative"):
            c = getattr(self, name)
            if c is None:
                continue
            # FLUX.2 has no pooled output: "pooled" None (refused for the families that need it)
            arch = getattr(model, "arch", None)
            needs_pooled = arch is not None and families.family(arch).text.pooled
            if not isinstance(c, dict) or "cond" not in c or "pooled" not in c:
                out.append(f"{name} conditioning must be {{'cond': [b,T,D], 'pooled': [b,P]}}")
            elif c["pooled"] is None and needs_pooled:
                out.append(f"{name} conditioning has no pooled output [b,P], which "
                           f"{families.family(arch).name} needs")
            elif c["cond"].dim() != 3 or (c["pooled"] is not None and c["pooled"].dim() != 2):
                pooled = None if c["pooled"] is None else tuple(c["pooled"].shape)
                out.append(f"{name} conditioning has shapes {tuple(c['cond'].shape)} / "
                           f"{pooled}; expected [b,T,D] and [b,P]")
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
        side = _token_side(model)
        for name in ("height", "width") if side > 16 else ():  # LTX-2: 32 pixels a token
            v = getattr(self, name)
            if isinstance(v, int) and v % side:
                out.append(f"{name} {v} is not a multiple of {side}, this model's pixels per "
                           f"token (try {max(side, round(v / side) * side)})")
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
        out.extend(_lora_problems(self.loras, getattr(model, "experts", None)))
        if self.output not in ("latent", "image"):
            out.append(f"output must be 'latent' or 'image' (got {self.output!r})")
        out.extend(_single_file_problems(self, model))
        out.extend(_reference_problems(self, model))
        out.extend(_reference_image_problems(self, model))
        out.extend(start_image_problems(self, model))
        out.extend(cache_problems(self.cache))
        return out


def frames_problems(frames, model) -> list[str]:
    """`frames` for the model's family: 4k + 1 for a video family, 1 for an image one."""
    arch = model if isinstance(model, str) else getattr(model, "arch", None)
    spec = None if arch is None else families.family(arch).latent
    if not isinstance(frames, int) or frames < 1:
        return [f"frames must be an integer >= 1 (got {frames!r})"]
    if spec is not None and spec.video:
        k = spec.time_downscale
        if (frames - 1) % k:
            lo = (frames - 1) // k * k + 1
            return [f"frames {frames} is not of the form {k}k + 1 ({families.family(arch).name} "
                    f"video: try {lo} or {lo + k})"]
    elif spec is not None and frames != 1:
        return [f"frames {frames}: {families.family(arch).name} makes images (frames 1); "
                f"video needs a video model (Wan)"]
    return []


def cache_settings():
    """The step cache's settings type (workers/sampling/cache_settings.py), its one definition."""
    return bridge.cache_settings.CacheSettings


def resolved_cache(cache: Optional[dict]) -> Optional[dict]:
    """Every field of the step cache's settings, or None when it is off (no settings, or a
    threshold of 0)."""
    if not cache:
        return None
    settings = cache_settings().from_dict(cache)
    return settings.to_dict() if settings.enabled else None


def cache_problems(cache) -> list[str]:
    if cache is None:
        return []
    if not isinstance(cache, dict):
        return [f"cache must be a dict of step-cache settings (got {type(cache).__name__})"]
    try:
        return cache_settings().from_dict(cache).problems()
    except (TypeError, ValueError) as e:
        return [str(e)]


def _reference_problems(req: "GenerationRequest", model) -> list[str]:
    """Reference latents: a list of ComfyUI LATENT samples [1 or batch, C, h, w] in the
    model's layout (FLUX.1: even sizes, 2x2 latent pixels make one token)."""
    refs, method = req.reference_latents, req.reference_method
    arch = getattr(model, "arch", None)
    if refs is None:
        return []
    import torch  # only now: a request without references is checked without torch
    if not isinstance(refs, (list, tuple)) or not refs:
        return [f"reference_latents must be a non-empty list of LATENT samples [1 or batch, C, "
                f"height/8, width/8] (got {type(refs).__name__}"
                f"{' (empty)' if isinstance(refs, (list, tuple)) else ''}); leave it None for "
                f"no reference"]
    fam = None if arch is None else families.family(arch)
    methods = None if fam is None else _reference_methods(fam)
    if fam is not None and not methods:
        return [f"reference images are not supported by {fam.name} models (remove the "
                f"reference latents)"]
    out = []
    if fam is not None and method is not None and method not in methods:
        out.append(f"reference_method {method!r} is not one of {list(methods)} "
                   f"for {fam.name}")
    elif fam is None and method is not None and \
            method not in {m for f in families.FAMILIES.values() for m in _reference_methods(f)}:
        out.append(f"reference_method {method!r} is unknown")
    spec = None if fam is None else fam.latent
    down = 8 if spec is None else spec.downscale
    # a family whose LATENT has a frame axis takes its one-frame LATENT as well as a 4-D one
    frames = spec is None or spec.frames
    for i, r in enumerate(refs):
        name = f"reference latent #{i + 1}"
        framed = torch.is_tensor(r) and r.dim() == 5 and frames and int(r.shape[2]) == 1
        if not torch.is_tensor(r) or (r.dim() != 4 and not framed) or \
                not r.is_floating_point():
            got = tuple(r.shape) if torch.is_tensor(r) else type(r).__name__
            shape = f"[1 or batch, C, height/{down}, width/{down}]"
            if spec is not None and spec.frames:
                shape += f" or [1 or batch, C, 1, height/{down}, width/{down}]"
            out.append(f"{name} must be a float LATENT tensor {shape} (got {got})")
            continue
        b, c, h, w = (int(r.shape[k]) for k in (0, 1, -2, -1))
        if spec is not None and c != spec.channels:
            out.append(f"{name} has {c} channels; {spec.wrong_channels}")
        if b not in (1, req.batch):
            out.append(f"{name} has batch {b}; give 1 (shared) or the batch {req.batch}")
        # a token is 2x2 latent pixels unless the LATENT is patchified (FLUX.2)
        per_token = (1 if c == 128 else 2) if spec is None else spec.per_token
        odd = fam is not None and fam.tokens.latent.pads_odd_references  # padded instead
        if per_token == 2 and (h < 2 or w < 2 or (h % 2 or w % 2) and not odd):
            out.append(f"{name} is {h}x{w} latent pixels; height and width must be even "
                       f"(reference images a multiple of 16 pixels, e.g. "
                       f"{max(2, h // 2 * 2) * 8}x{max(2, w // 2 * 2) * 8})")
    return out


def _image_size(im):
    """(width, height) of a PIL image or an [(1,) H, W, 3] tensor; None for anything else."""
    if hasattr(im, "size") and not callable(im.size):
        return tuple(im.size)
    shape = getattr(im, "shape", None)
    if shape is not None and len(shape) in (3, 4) and shape[-1] == 3 and min(shape[-3:-1]) > 0:
        return int(shape[-2]), int(shape[-3])
    return None


def _token_side(model) -> int:
    """Image pixels per token side of `model`'s family (a ModelInfo or a family id; 16 when
    unknown)."""
    arch = model if isinstance(model, str) else getattr(model, "arch", None)
    return 16 if arch is None else families.family(arch).latent.pixels_per_token


def image_tensors(images) -> list:
    """Reference images (PIL, or float [H, W, 3] / [1, H, W, 3] in 0..1) -> float32 CPU
    tensors [H, W, 3] (what travels to the workers)."""
    import numpy as np
    import torch

    out = []
    for im in images:
        if torch.is_tensor(im):
            t = im.detach().float().cpu()
            out.append((t[0] if t.dim() == 4 else t).contiguous())
        else:
            arr = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
            out.append(torch.from_numpy(arr))
    return out


def _reference_image_problems(req: "GenerationRequest", model) -> list[str]:
    images = req.reference_images
    if images is None:
        return []
    import torch
    if not isinstance(images, (list, tuple)) or not images:
        return ["reference_images must be a non-empty list of images (float [H, W, 3] in "
                "0..1, or PIL); leave it None for no reference"]
    arch = getattr(model, "arch", None)
    fam = None if arch is None else families.family(arch)
    if fam is not None and not _reference_methods(fam) and \
            fam.capability(families.ImageToVideo) is None:
        return [f"reference images are not supported by {fam.name} models (remove the "
                f"reference image)"]
    if model is not None and not getattr(model, "has_vae", True):
        return [bridge.messages.REFERENCE_IMAGES_NEED_VAE]
    out = []
    if req.reference_latents:
        out.append("give reference_latents or reference_images, not both")
    for i, im in enumerate(images):
        name = f"reference image #{i + 1}"
        if torch.is_tensor(im):
            shape = tuple(im.shape)
            ok = (im.dim() == 3 or (im.dim() == 4 and shape[0] == 1)) and shape[-1] == 3 \
                and im.is_floating_point()
            if not ok:
                out.append(f"{name} must be a float tensor [H, W, 3] in 0..1 (got "
                           f"{shape} {str(im.dtype).replace('torch.', '')})")
            elif shape[-3] < 16 or shape[-2] < 16:
                out.append(f"{name} is {shape[-3]}x{shape[-2]} pixels; give at least 16x16")
            elif float(im.min()) < 0 or float(im.max()) > 1:
                out.append(f"{name} has values outside 0..1")
        elif not (hasattr(im, "convert") and hasattr(im, "size")):
            out.append(f"{name} must be a float tensor [H, W, 3] in 0..1 or a PIL image "
                       f"(got {type(im).__name__})")
        elif min(im.size) < 16:
            out.append(f"{name} is {im.size[1]}x{im.size[0]} pixels; give at least 16x16")
    return out


def start_image_problems(req: "GenerationRequest", model) -> list[str]:
    """Image-to-video: an I2V model needs exactly one start image (reference_images or
    ComfyUI's concat_latent), a text-to-video one takes none; shapes as the request's
    comment gives them. `model`: a ModelInfo (its start_image / image_states), or None."""
    messages = bridge.messages
    arch = getattr(model, "arch", None)
    fam = None if arch is None else families.family(arch)
    given = {k: getattr(req, k) for k in ("concat_latent", "concat_mask", "image_embeds")
             if getattr(req, k) is not None}
    images = req.reference_images
    if fam is not None and fam.capability(families.ImageToVideo) is None:
        return [f"{', '.join(given)}: image-to-video inputs, which {fam.name} models do not "
                f"take"] if given else []
    if "concat_latent" not in given and given:
        return [f"{', '.join(given)} without concat_latent: ComfyUI's WanImageToVideo sets "
                f"them with the start image's latent (concat_latent_image)"]
    if fam is None:
        return []
    name = fam.name
    start = bool(getattr(model, "start_image", False))
    if start and fam.capability(families.ImageToVideo).optional and not given and not images:
        return []  # a model that takes a start image or none (LTX-2): text-to-video
    if not start:
        return [messages.NO_START_IMAGE.format(name=name)] if given or images else []
    if given and images:
        return [messages.START_IMAGE_TWICE]
    if not given and not images:
        return [messages.NEEDS_START_IMAGE.format(name=name)]
    if images:
        return [] if len(images) == 1 else [f"{name} image-to-video takes one start image "
                                            f"(got {len(images)})"]
    import torch  # only now: a request without start-image tensors is checked without it

    out = []
    lat, mask, emb = req.concat_latent, req.concat_mask, req.image_embeds
    spec = fam.latent
    t = (req.frames - 1) // spec.time_downscale + 1 if isinstance(req.frames, int) else None
    h, w = (v // spec.downscale if isinstance(v, int) else None
            for v in (req.height, req.width))
    want = f"[1 or {req.batch}, {spec.channels}, {t}, {h}, {w}]"
    if not torch.is_tensor(lat) or lat.dim() != 5 or not lat.is_floating_point() \
            or int(lat.shape[0]) not in (1, req.batch) \
            or tuple(int(v) for v in lat.shape[1:]) != (spec.channels, t, h, w):
        got = tuple(lat.shape) if torch.is_tensor(lat) else type(lat).__name__
        out.append(f"concat_latent must be the start video's raw VAE latent {want} for "
                   f"{req.frames} frames of {req.width}x{req.height} (got {got}); encode it "
                   f"at the LATENT's size (WanImageToVideo does)")
    if mask is not None and (
            not torch.is_tensor(mask) or mask.dim() != 5 or int(mask.shape[0]) not in
            (1, req.batch) or int(mask.shape[1]) not in (1, 4) or
            int(mask.shape[2]) > (t or 0) or tuple(int(v) for v in mask.shape[3:]) != (h, w)):
        got = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        out.append(f"concat_mask must be [1 or {req.batch}, 1 or 4, <= {t}, {h}, {w}] "
                   f"(WanImageToVideo's; got {got})")
    if emb is not None and (not torch.is_tensor(emb) or emb.dim() != 3
                            or int(emb.shape[0]) not in (1, req.batch)):
        got = tuple(emb.shape) if torch.is_tensor(emb) else type(emb).__name__
        out.append(f"image_embeds must be CLIP vision states [1 or {req.batch}, tokens, dim] "
                   f"(clip_vision_output.penultimate_hidden_states; got {got})")
    if emb is None and getattr(model, "image_states", False):
        out.append(messages.NEEDS_IMAGE_EMBEDS.format(name=name))
    return out


def _single_file_problems(req: "GenerationRequest", model) -> list[str]:
    """A single-file model has no text encoders and no VAE (model: a ModelInfo)."""
    messages = bridge.messages  # the workers give the same two messages

    out = []
    if model is None:
        return out
    if not getattr(model, "has_text_encoders", True):
        if req.positive is None:
            out.append(messages.NO_TEXT_ENCODERS)
        elif req.uses_cfg(model) and req.negative is None:
            out.append(f"cfg {req.resolved_cfg(model)} needs negative CONDITIONING too: "
                       f"this single-file model has no text encoders to encode the negative "
                       f"prompt text (connect one, or set cfg 1)")
    if req.output == "image" and not getattr(model, "has_vae", True):
        out.append(messages.NO_VAE)
    return out


LORA_EXPERTS = ("high", "low")  # Wan 2.2 A14B: the high-noise / low-noise transformer


def _lora_entry(item):
    """One LoRA entry -> (path, strength, expert or None), or a str saying what is wrong:
    (path, strength), (path, strength, "high" | "low") or {"path", "strength", "expert"}
    (strength defaults to 1, expert to both)."""
    if isinstance(item, dict):
        unknown = set(item) - {"path", "strength", "expert"}
        if "path" not in item or unknown:
            return (f"must be a dict of path, strength and expert (got keys "
                    f"{sorted(item)})")
        return item["path"], item.get("strength", 1.0), item.get("expert")
    if not isinstance(item, (list, tuple)) or len(item) not in (2, 3):
        return f"must be a (file, strength) pair or (file, strength, expert) (got {item!r})"
    return item[0], item[1], (item[2] if len(item) == 3 else None)


def lora_entries(loras) -> list:
    """The entries as the workers take them: (path, strength), or (path, strength, expert)
    for one naming its expert (call after `_lora_problems` found none)."""
    if not isinstance(loras, (list, tuple)):
        return loras
    out = []
    for item in loras:
        entry = _lora_entry(item)
        if isinstance(entry, str):  # left as it is, for `_lora_problems` to name
            out.append(item)
            continue
        path, strength, expert = entry
        out.append((path, strength) if expert is None else (path, strength, expert))
    return out


def _lora_problems(loras, experts=None) -> list[str]:
    """`loras` is a list of (file, strength) or (file, strength, expert): the files must
    exist (the workers read them again, by the same path, and check their keys against the
    model); an expert ("high" | "low", Wan 2.2 A14B's transformers; none: both) only on a
    model of two (`experts`: the model's count, None where unknown)."""
    import math
    import os

    if not isinstance(loras, (list, tuple)):
        return [f"loras must be a list of (file, strength) pairs (got {type(loras).__name__})"]
    out = []
    for i, item in enumerate(loras):
        entry = _lora_entry(item)
        if isinstance(entry, str):
            out.append(f"LoRA #{i + 1} {entry}")
            continue
        path, strength, expert = entry
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            out.append(f"LoRA #{i + 1}: the file must be a path (got {path!r})")
        elif not os.path.isfile(os.path.expanduser(str(path))):
            out.append(f"LoRA file not found: {path}")
        else:  # its header only: under a second, before any worker starts
            problem = bridge.lora_file.lora_file_problem(
                os.path.expanduser(str(path)))
            if problem:
                out.append(problem)
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) \
                or not math.isfinite(strength):
            out.append(f"LoRA {path}: strength must be a finite number (got {strength!r})")
        if expert is not None and expert not in LORA_EXPERTS:
            out.append(f"LoRA {path}: expert must be 'high' or 'low' (Wan 2.2 A14B's "
                       f"high- / low-noise transformer; leave it out for both), got {expert!r}")
        elif expert is not None and experts is not None and experts < 2:
            out.append(f"LoRA {path}: expert {expert!r} names one of Wan 2.2 A14B's two "
                       f"transformers; this model has one (leave the expert out)")
    return out


@dataclass
class GenerationResult:
    """`latents`: the job's Latents (workers/runtime/outputs.py) in ComfyUI's LATENT space
    (fp32, CPU); `samples` is its image or video latent: [B,16,H/8,W/8] raw VAE space
    (FLUX.1, SD3); [B,128,H/16,W/16] patchified and normalised (FLUX.2); ...
    `decoded`: its Decoded when the request asked for output="image", whose `images` are
    [B,H,W,3] in 0..1."""

    latents: Any
    decoded: Any = None
    timings: dict = field(default_factory=dict)
    config: Any = None
    stats: list = field(default_factory=list)  # per rank: denoise_s, comm bytes (when metered)

    @property
    def samples(self):
        return self.latents.samples

    @property
    def images(self):
        return None if self.decoded is None else self.decoded.images
