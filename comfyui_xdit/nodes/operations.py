"""What the Sampler and Decode nodes do, without ComfyUI. `sample`: LATENT / CONDITIONING /
widgets -> GenerationRequest -> the handle's pool -> LATENT. `decode`: LATENT -> IMAGE, on
the pool (diffusers folders: patch-parallel VAE) or with the connected ComfyUI VAE (single
files). Each records what ran on the registry, for its node's text."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from comfyui_xdit.comfy_convert import (check_text_width, comfy_noise, conditioning_to_request,
                                        family_name, latent_channels, latent_downscale,
                                        latent_from_comfy, latent_shape, latent_shape_text,
                                        latent_to_comfy, layout_hint, start_image_fields,
                                        av_parts, video_of)
from comfyui_xdit.nodes.handles import ModelHandle
from comfyui_xdit.nodes.node_text import decode_text, job_text
from comfyui_xdit.nodes.pool_registry import REGISTRY, PoolRegistry
from comfyui_xdit.nodes.settings import CacheSettings, cache_request
from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.planning.gpus import gpus_for_ranks
from comfyui_xdit.planning.room import make_room
from comfyui_xdit.planning.request import GenerationRequest, default_cfg, families

log = logging.getLogger("comfyui_xdit")


# ---- sampling ---------------------------------------------------------------------------
@dataclass
class SampleInputs:
    latent: dict
    seed: int = 0
    steps: int = 20
    cfg: float = 0.0  # 0: the model's default (FLUX 1 = off, SD3 7, FLUX.2 base klein 4)
    guidance: float = 0.0  # 0: the model's default (FLUX.1 3.5, FLUX.2 [dev] 4)
    denoise: float = 1.0
    prompt: str = ""
    negative_prompt: str = ""
    positive: Optional[list] = None  # ComfyUI CONDITIONING
    negative: Optional[list] = None
    max_sequence_length: int = 512
    preview_every: int = 0  # k: a low-res preview latent every k steps
    cache: Optional[CacheSettings] = None  # Step cache (xDiT), when connected
    cfg_2: float = 0.0  # a second expert's guidance scale (Wan 2.2 A14B); 0: cfg
    shift: float = 0.0  # the scheduler's flow shift (Wan, SD3); 0: the model's
    extra_guidance: Optional[dict] = None  # a family's extra guidance passes (LTX-2's)
    # IMAGE frames [H, W, 3] the pool encodes itself: a start frame (LTX-2, Wan I2V folders)
    # or reference images, as the CLI's --image (the request's reference_images)
    images: Optional[list] = None


def model_text_width(path: str) -> Optional[int]:
    """The width a CONDITIONING's text states must have, from the folder's config or the
    single file's weight shapes: the transformer's joint_attention_dim, once per prompt
    stream that ComfyUI's context carries side by side (`ComfySpec.context_streams`: a
    video's and its sound's); None when unknown."""
    from comfyui_xdit.planning.model_info import _describe_model, families
    d = _describe_model(path)
    # a folder's config omits what equals diffusers' class default
    fam = families.family(d["arch"])
    return fam.text_width(fam.full_config(d["config"])) * fam.comfy.context_streams


def build_job(inp: SampleInputs, arch: str, text_width: Optional[int] = None,
              model=None) -> tuple[GenerationRequest, dict]:
    """-> (request, generate() keyword arguments: noise, init_latent, denoise) for a model
    of `arch`; `text_width`: its joint_attention_dim, checked against CONDITIONING; `model`:
    its ModelInfo, which resolves a cfg of 0 (FLUX.2 [klein] base models run CFG 4)."""
    lat = latent_from_comfy(inp.latent, arch)
    # 0: the request's per-model default (FLUX.1 3.5, FLUX.2 [dev] 4.0)
    guidance = float(inp.guidance) if inp.guidance else None
    positive = negative = None
    if inp.positive is not None:
        positive, g = conditioning_to_request(inp.positive, "positive", arch)
        if g is not None:  # FluxGuidance / CLIPTextEncodeFlux set it on the conditioning
            guidance = g
    if inp.negative is not None:
        negative, _ = conditioning_to_request(inp.negative, "negative", arch)
    if text_width is not None:
        for name, c in (("positive", positive), ("negative", negative)):
            if c is not None:
                check_text_width(c, text_width, arch, name,
                                 getattr(model, "raw_text_width", None))
    if inp.cfg:
        cfg = float(inp.cfg)
    elif model is not None or families.family(arch).defaults.undistilled_cfg is None:
        cfg = default_cfg(model if model is not None else arch)
    else:
        cfg = None  # unknown without the model: the references are checked as under CFG
    refs, method = _references(positive, negative, cfg)
    start = _start_image(positive, negative, cfg)
    # the request's conditionings carry text only: the job's references and start image
    # are its own fields
    positive, negative = (None if c is None else c.text() for c in (positive, negative))
    if positive is None and not (inp.prompt or "").strip():
        raise ConfigError("no prompt: connect positive CONDITIONING or type a prompt")
    req = GenerationRequest(
        prompt=[] if positive is not None else [inp.prompt], negative_prompt=inp.negative_prompt or "",
        positive=positive, negative=negative, batch_size=lat.batch, seed=int(inp.seed),
        steps=int(inp.steps), height=lat.height, width=lat.width, guidance=guidance,
        cfg=None if not inp.cfg else float(inp.cfg),
        max_sequence_length=int(inp.max_sequence_length), preview_every=int(inp.preview_every),
        frames=lat.frames, cfg_2=None if not inp.cfg_2 else float(inp.cfg_2),
        shift=None if not inp.shift else float(inp.shift),
        reference_latents=refs, reference_method=method,
        cache=None if inp.cache is None else cache_request(inp.cache),
        extra_guidance=inp.extra_guidance or None,
        reference_images=list(inp.images) if inp.images else None, **start)
    kw = {"noise": None, "init_latent": None, "denoise": 1.0}
    if lat.batch_index is not None:
        kw["noise"] = comfy_noise(int(inp.seed), latent_shape(arch, lat.batch, lat.height,
                                                              lat.width, lat.frames),
                                  lat.batch_index)
    if not lat.empty:
        if not 0.0 < float(inp.denoise) <= 1.0:
            raise ConfigError(f"denoise must be in (0, 1] (got {inp.denoise})")
        kw["init_latent"] = lat.samples
        kw["denoise"] = float(inp.denoise)
    return req, kw


def _start_image(positive, negative, cfg: Optional[float]) -> dict:
    """WanImageToVideo's start frame on the CONDITIONING -> the request's concat_latent /
    concat_mask / image_embeds. With CFG the negative must carry the same values (both
    branches get one start frame); without it, the negative is not used."""
    if positive is None:
        return {}
    use_negative = negative is not None and (cfg is None or float(cfg) > 1.0)
    return start_image_fields(positive, negative if use_negative else None)


def _references(positive, negative, cfg: Optional[float]):
    """The positive Conditioning's reference images (ComfyUI's ReferenceLatent) -> the
    request's (list or None, method). The pool gives both CFG branches the positive's
    references (diffusers' FLUX.2 pipelines do the same), so with CFG on a negative with
    other references is refused rather than silently given the positive's. `cfg`: the
    resolved cfg (None: not known, checked as if CFG ran)."""
    import torch

    def of(c):
        return (None, None) if c is None else (c.ref_latents, c.ref_method)
    refs, method = of(positive)
    if negative is not None and (cfg is None or float(cfg) > 1.0):
        nrefs, nmethod = of(negative)
        same = (nrefs is None and refs is None) or (
            nrefs is not None and refs is not None and len(nrefs) == len(refs)
            and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(refs, nrefs))
            and nmethod == method)
        if not same and nrefs is not None:
            raise ConfigError("the negative CONDITIONING has other reference latents than the "
                              "positive; the xDiT sampler gives both branches the positive's "
                              "references: connect the same ReferenceLatent to both, or none "
                              "to the negative")
    return (list(refs) if refs else None), method


def sample(handle: ModelHandle, inp: SampleInputs,
           on_event: Optional[Callable[[dict], None]] = None,
           is_interrupted: Optional[Callable[[], bool]] = None,
           registry: Optional[PoolRegistry] = None,
           on_launch: Optional[Callable[[str, int, int], None]] = None,
           free_memory: Optional[Callable[[int, int], None]] = None) -> dict:
    """Run one sampler node: returns the ComfyUI LATENT. `is_interrupted` is polled from a
    watcher thread, so a cancel lands within one step even between progress events.
    `on_launch(text, done, total)`: progress while the pool starts. `free_memory(bytes,
    cuda_index)`: ComfyUI's memory manager, asked for the room the job needs on each of
    the pool's GPUs (planning/room.py)."""
    registry = registry or REGISTRY
    t0 = time.perf_counter()
    registry.job_started()
    try:
        info = handle.info()
        req, kw = build_job(inp, info.arch, model_text_width(handle.path), info)
        req.loras = list(handle.loras)
        config = handle.config_for(req)
        if req.batch < config.dp:  # said in the graph's terms (the CLI says "prompts")
            raise ConfigError(f"the LATENT batch of {req.batch} is smaller than dp {config.dp}: "
                              f"set batch_size >= {config.dp} on the empty-latent node, or "
                              f"lower dp")
        # refused before the registry is touched: a bad job never replaces a warm pool
        config.validate(info, req)
        if handle.device == "cuda":
            gpus_for_ranks(config.ranks, handle.gpus)
        pool = registry.get(handle, config)
        if free_memory is not None:
            make_room(pool, req, free_memory)
        stop = threading.Event()
        watcher = None
        if is_interrupted is not None:
            def watch():
                while not stop.wait(0.1):
                    try:
                        if is_interrupted():
                            pool.cancel()
                    except Exception:
                        pass
            watcher = threading.Thread(target=watch, name="xdit-interrupt-watch", daemon=True)
            watcher.start()
        try:
            result = pool.generate(req, on_event=on_event,
                                   on_launch=registry.launch_callback(on_launch), **kw)
        finally:
            registry.launching = None
            stop.set()
            if watcher is not None:
                watcher.join(timeout=1.0)
    except Exception as e:
        registry.job_failed(e)
        raise
    job_args = (req.steps, config, result.timings.get("job_s") or 0.0,
                result.timings.get("launch_s") or 0.0,
                result.stats[0].get("cache") if result.stats else None)
    log.info("xDiT: sampled %s", job_text(*job_args, node=None))
    registry.last_job = {"config": config.describe(), "batch": req.batch, "steps": req.steps,
                         "height": req.height, "width": req.width,
                         "img2img": kw["init_latent"] is not None,
                         "seconds": round(time.perf_counter() - t0, 3),
                         "text": job_text(*job_args),
                         "timings": {k: (round(v, 3) if isinstance(v, float) else v)
                                     for k, v in result.timings.items()}}
    return latent_to_comfy(result.latents)


# ---- decoding ---------------------------------------------------------------------------
def _decode_size(info, samples):
    """A request of the LATENT's size (pixels, batch, frames): what the memory plan sizes a
    decode's room by."""
    d = latent_downscale(info.arch)
    spec = info.family.latent
    frames = 1
    if spec.video and samples.dim() == 5:
        frames = spec.video_frames(int(samples.shape[2]))
    kw = {"frames": frames} if spec.video else {}
    return GenerationRequest(prompt=[""] * int(samples.shape[0]),
                             height=int(samples.shape[-2]) * d,
                             width=int(samples.shape[-1]) * d, **kw)


def _check_vae(vae, info) -> None:
    """A single file's LATENT decodes with the connected ComfyUI VAE only if that VAE's
    latent width is the family's (a FLUX.2 LATENT needs ComfyUI's 128-channel FLUX.2 VAE,
    which applies the batch-norm statistics itself)."""
    want = latent_channels(info.arch)
    lc = getattr(vae, "latent_channels", None)  # comfy.sd.VAE has it
    if lc is None or int(lc) == want:
        return
    raise ConfigError(f"a {family_name(info.arch)} single file's LATENT decodes with a VAE "
                      f"of {want}-channel latents (the model's own VAE, loaded with "
                      f"VAELoader); the connected VAE has {lc} latent channels")


def decode(handle: ModelHandle, latent: dict, vae=None,
           registry: Optional[PoolRegistry] = None,
           on_launch: Optional[Callable[[str, int, int], None]] = None,
           free_memory: Optional[Callable[[int, int], None]] = None, with_audio: bool = False):
    """The Decode node: LATENT -> IMAGE [B,H,W,3] in 0..1. A diffusers folder decodes on
    the model's pool (its VAE, patch-parallel over the ranks); a single file has no VAE, so
    the connected ComfyUI VAE decodes (its `decode(samples)`). `free_memory`: as for
    `sample`, asked for the room a job of the latent's size needs. `with_audio`: returns
    (IMAGE, AUDIO or None): a LATENT with a sound track (ComfyUI's AV LATENT, or the
    sampler's "audio" entry) also decodes to ComfyUI's AUDIO {"waveform": [B, channels,
    samples], "sample_rate"}."""
    import torch

    registry = registry or REGISTRY
    registry.job_started()
    if not isinstance(latent, dict) or not torch.is_tensor(video_of(latent.get("samples"))):
        raise ConfigError("LATENT input must be a dict with 'samples'; connect the xDiT "
                          "sampler's LATENT")
    samples, sound = av_parts(latent["samples"])
    if sound is None:
        sound = latent.get("audio")
    info = handle.info()
    want = latent_shape(info.arch, 1, 16, 16)
    video = info.family.latent.video  # a video LATENT: its frames as an IMAGE batch
    if samples.dim() != len(want) or samples.shape[1] != want[1] or \
            (samples.dim() == 5 and samples.shape[2] != 1 and not video):
        hint = layout_hint(info.arch, samples)
        raise ConfigError(f"LATENT samples have shape {tuple(samples.shape)}; this "
                          f"{family_name(info.arch)} model's Decode takes latents "
                          f"{latent_shape_text(info.arch)} (the xDiT sampler's LATENT)"
                          + (f". {hint}" if hint else ""))
    t0, ranks, launched, audio = time.perf_counter(), 0, False, None
    try:
        if info.has_vae:
            pool = registry.pool_for_decode(handle)
            ranks, launched = pool.config.ranks, not pool.is_running()
            if free_memory is not None:
                make_room(pool, _decode_size(info, samples), free_memory)
            given = samples.detach().float().cpu()
            if sound is not None:  # the workers decode the two together
                given = (given, sound.detach().float().cpu())
            try:
                decoded = pool.decode(given, on_launch=registry.launch_callback(on_launch),
                                      full=True)
            finally:
                registry.launching = None
            images = decoded.images
            if decoded.audio is not None:
                audio = {"waveform": decoded.audio, "sample_rate": int(decoded.sample_rate)}
        elif vae is not None:
            _check_vae(vae, info)
            images = vae.decode(samples)
            if images.dim() == 5:  # video VAEs: frames into the batch, as VAEDecode does
                images = images.reshape(-1, *images.shape[-3:])
        else:
            raise ConfigError(f"model {os.path.basename(handle.path)!r} is a single file with "
                              f"no VAE: connect a VAE (VAELoader with the model's VAE) to the "
                              f"Decode node's vae input")
    except Exception as e:
        registry.job_failed(e)
        raise
    seconds = time.perf_counter() - t0
    registry.last_decode_text = decode_text(images, ranks, seconds, launched)
    log.info("xDiT: %s", decode_text(images, ranks, seconds, launched, node=None))
    return (images, audio) if with_audio else images
