"""A generation request's checks, one line per bad field, saying what is wrong and what would
be right (workers/runtime/request.py holds the fields). `model` is what the host knows of the
model before any worker starts (comfyui_xdit/planning/model_info.py's ModelInfo: `arch`,
`has_text_encoders`, `has_vae`, `experts`, `start_image`, `image_states`, `distilled`), or
None where it is not known. Cheap to import: torch only where a tensor is checked."""
from __future__ import annotations

from typing import Optional

from .. import families, messages
from ..loading.lora_file import lora_file_problem
from ..sampling.cache_settings import CacheSettings
from .conditioning import Conditioning


def _reference_methods(fam) -> tuple:
    """The reference methods a family takes (() for a family without reference images)."""
    refs = fam.capability(families.References)
    return () if refs is None else refs.methods


def conditioning_problems(req, model) -> list[str]:
    """The request's pre-encoded text (`positive`, `negative`: Conditionings of text states,
    pooled and a second text's states, rows 1 or the batch)."""
    arch = getattr(model, "arch", None)
    # FLUX.2 has no pooled output: pooled None (refused for the families that need it)
    needs_pooled = arch is not None and families.family(arch).text.pooled
    out = []
    for name in ("positive", "negative"):
        c = getattr(req, name)
        if c is None:
            continue
        if not isinstance(c, Conditioning):
            out.append(f"{name} conditioning must be a Conditioning or a dict of its fields "
                       f"({', '.join(Conditioning.TEXT)}) with context [b,T,D] (got "
                       f"{sorted(c) if isinstance(c, dict) else type(c).__name__})")
            continue
        lifted = [(f, to) for f, to in Conditioning.TO_REQUEST if getattr(c, f) is not None]
        if lifted:  # the job's own fields, not one branch's
            out.append(f"{name} conditioning carries {', '.join(f for f, _ in lifted)}: give "
                       f"them as the request's {', '.join(to for _, to in lifted)}")
            continue
        ctx, pooled = (getattr(v, "shape", None) for v in (c.context, c.pooled))
        if c.pooled is None and needs_pooled:
            out.append(f"{name} conditioning has no pooled output [b,P], which "
                       f"{families.family(arch).name} needs")
        elif ctx is None or len(ctx) != 3 or (c.pooled is not None and
                                             (pooled is None or len(pooled) != 2)):
            shapes = [None if s is None else tuple(s) for s in (ctx, pooled)]
            out.append(f"{name} conditioning has shapes {shapes[0]} / {shapes[1]}; expected "
                       f"[b,T,D] and [b,P]")
        elif c.rows not in (1, req.batch):
            out.append(f"{name} conditioning batch {c.rows} is neither 1 nor the batch "
                       f"{req.batch}")
        elif getattr(model, "text_width", None) not in (None, int(ctx[-1])) and \
                getattr(model, "raw_text_width", None) != int(ctx[-1]):
            out.append(_width_problem(name, int(ctx[-1]), model.text_width, arch,
                                      getattr(model, "raw_text_width", None)))
        else:
            out.extend(f"{name} conditioning: {p}" for p in c.problems(c.rows))
    return out


def _width_problem(name: str, got: int, width: int, arch: str, raw=None) -> str:
    """A context of another width than the model's (`ModelInfo.text_width`, or its
    `raw_text_width` where it has one), in one line."""
    fam = families.family(arch)
    streams = fam.comfy.context_streams
    what = "its text width" if streams == 1 else \
        f"{streams} prompt states of {width // streams} side by side, one per stream"
    before = "" if raw is None else f", or {raw} (before the model's own text modules)"
    return (f"{name} conditioning has text states of width {got}, but this {fam.name} "
            f"transformer takes {width} ({what}){before}: {fam.text.hint}")


def frames_problems(frames, model) -> list[str]:
    """`frames` for the model's family: 4k + 1 for a video family, 1 for an image one."""
    arch = model if isinstance(model, str) else getattr(model, "arch", None)
    spec = None if arch is None else families.family(arch).latent
    if not isinstance(frames, int) or frames < 1:
        return [f"frames must be an integer >= 1 (got {frames!r})"]
    if spec is not None and spec.video:
        problem = spec.frames_problem(frames)
        if problem is not None:
            what, (lo, hi) = problem
            return [f"frames {frames} {what} ({families.family(arch).name} "
                    f"video: try {lo} or {hi})"]
    elif spec is not None and frames != 1:
        return [f"frames {frames}: {families.family(arch).name} makes images (frames 1); "
                f"video needs a video model (Wan)"]
    return []


def resolved_cache(cache) -> Optional[CacheSettings]:
    """The step cache's settings (given as CacheSettings or a dict of its fields, those left
    out taking its defaults), or None when it is off (no settings, or a threshold of 0)."""
    if cache is None or cache == {}:
        return None
    settings = CacheSettings.from_wire(cache)
    return settings if settings.enabled else None


def cache_problems(cache) -> list[str]:
    if cache is None:
        return []
    if not isinstance(cache, dict) and not hasattr(cache, "to_dict"):
        return [f"cache must be CacheSettings or a dict of their fields (got "
                f"{type(cache).__name__})"]
    try:
        return CacheSettings.from_wire(cache).problems()
    except (TypeError, ValueError) as e:
        return [str(e)]


def extra_guidance_problems(req, model) -> list[str]:
    """`extra_guidance`: {setting: value} of the guidance passes beyond cond / uncond that the
    model's family declares (its ExtraGuidance capability), one line per bad setting."""
    given = req.extra_guidance
    if given is None:
        return []
    if not isinstance(given, dict):
        return [f"extra_guidance must be a dict of settings (got {type(given).__name__})"]
    arch = model if isinstance(model, str) else getattr(model, "arch", None)
    if arch is None or not given:
        return []
    fam = families.family(arch)
    extra = fam.capability(families.ExtraGuidance)
    if extra is None:
        takers = ", ".join(f.name for f in families.FAMILIES.values()
                           if f.capability(families.ExtraGuidance) is not None)
        return [f"extra_guidance {sorted(given)}: {fam.name} runs the cond and uncond passes "
                f"only (extra guidance passes: {takers})"]
    unknown = sorted(set(given) - set(extra.settings))
    if unknown:
        return [f"extra_guidance {unknown}: {fam.name} takes {', '.join(extra.settings)}"]
    return list(extra.problems(given, req.cfg, getattr(model, "blocks", None)))


def reference_problems(req, model) -> list[str]:
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


def image_size(im):
    """(width, height) of a PIL image or an [(1,) H, W, 3] tensor; None for anything else."""
    if hasattr(im, "size") and not callable(im.size):
        return tuple(im.size)
    shape = getattr(im, "shape", None)
    if shape is not None and len(shape) in (3, 4) and shape[-1] == 3 and min(shape[-3:-1]) > 0:
        return int(shape[-2]), int(shape[-3])
    return None


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


def reference_image_problems(req, model) -> list[str]:
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
        return [messages.REFERENCE_IMAGES_NEED_VAE]
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


def start_image_problems(req, model) -> list[str]:
    """Image-to-video: an I2V model needs exactly one start image (reference_images or
    ComfyUI's concat_latent), a text-to-video one takes none; shapes as the request's
    comment gives them. `model`: a ModelInfo (its start_image / image_states), or None."""
    arch = getattr(model, "arch", None)
    fam = None if arch is None else families.family(arch)
    given = {k: getattr(req, k) for k in Conditioning.START_IMAGE if getattr(req, k) is not None}
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
    t = spec.latent_frames(req.frames) if isinstance(req.frames, int) else None
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


def single_file_problems(req, model) -> list[str]:
    """A single-file model has no text encoders and no VAE (model: a ModelInfo)."""
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
    for one naming its expert (call after `lora_problems` found none)."""
    if not isinstance(loras, (list, tuple)):
        return loras
    out = []
    for item in loras:
        entry = _lora_entry(item)
        if isinstance(entry, str):  # left as it is, for `lora_problems` to name
            out.append(item)
            continue
        path, strength, expert = entry
        out.append((path, strength) if expert is None else (path, strength, expert))
    return out


def lora_problems(loras, experts=None) -> list[str]:
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
            problem = lora_file_problem(os.path.expanduser(str(path)))
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
