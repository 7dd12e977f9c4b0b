"""A small request for any family's tiny test model, from the registry: what the family-wide
tests (batch independence, the GPU suite) run, so a new family joins them by existing.

A family's test-model builder (comfyui_xdit/testmodels/<id>.py) may declare
`TEST_REQUEST = dict(size=(h, w), msl=n, padded=True)` where the defaults do not suit it:
`size` an image whose tokens split unevenly over 2 and 4 ranks (default 80x48: 5x3 tokens
at 16 pixels a token), `msl` the text length (default 24), `padded` a batch's prompts are
padded to the longest (each row carries its own text length). Video families get 5 frames.
"""
from __future__ import annotations

import importlib
import json
import os
import uuid

import torch

from comfyui_xdit import GenerationRequest
from comfyui_xdit.bridge import worker_module

families = worker_module("families")
IDS = families.IDS
A = "a cat"
B = "a big blue dog sitting on a green field under the sky"
NEGATIVE = "ugly dark old photo"


def _minimax_sound(rows: int, frames: int) -> tuple:
    """ComfyUI's MiniMaxH3 sound part of a video of `frames` frames: [rows, 32, 2, latents]."""
    mod = worker_module("families.minimax_h3")
    return ((rows, mod.AUDIO_CHANNELS, mod.STEREO, mod.audio_latents(frames)),)


# the LATENT parts after the first of a family whose other parts are not a SoundTrack's:
# (rows, frames) -> their per-row-batched shapes (what a test call holds)
PART_SHAPES = {"minimax_h3": _minimax_sound}


def settings(arch: str) -> dict:
    declared = getattr(importlib.import_module(f"comfyui_xdit.testmodels.{arch}"),
                       "TEST_REQUEST", {})
    out = dict(size=(80, 48), msl=24, padded=False)
    if families.family(arch).latent.video:
        out["frames"] = 5
    out.update(declared)
    return out


def small_request(arch: str, prompts, **kw) -> GenerationRequest:
    s = settings(arch)
    h, w = s["size"]
    extra = {"frames": s["frames"]} if "frames" in s else {}
    negative = NEGATIVE if families.family(arch).text.negative else ""  # (else refused)
    base = dict(prompt=list(prompts), negative_prompt=negative, seed=11, steps=3, height=h,
                width=w, cfg=3.0, max_sequence_length=s["msl"], **extra)
    return GenerationRequest(**dict(base, **kw))


def model_call_inputs(arch: str, folder, seed: int = 4) -> dict:
    """One batched call of ComfyUI's diffusion model for the family's test model, from the
    registry alone: the uncond and the cond row (a conditioning each), the LATENT of the
    family's small request (the transformer's input channels: a pack2x2 family's in_channels
    are 4 latent channels a token; HunyuanVideo 1.5's include its concat condition), random
    text states of the config's width (a pooled output, embedded guidance and a second
    text's states where the family's model takes them), sigma 0.7 on ComfyUI's timestep
    scale. A family whose ComfyUI LATENT has several parts (`ComfySpec.latent_parts`) gets
    x as ComfyUI's list of them (the latent's, then its sound track's) and one timestep per
    part, its context one text width per `context_streams`. The same seed gives the same
    tensors (the CPU reference and the CUDA pool)."""
    fam = families.family(arch)
    with open(os.path.join(str(folder), "transformer", "config.json")) as f:
        cfg = fam.full_config(json.load(f))
    s = settings(arch)
    gen = torch.Generator().manual_seed(seed)
    shape = list(fam.latent.shape(2, *s["size"], s.get("frames", 1)))
    in_ch = int(cfg["in_channels"])
    shape[1] = in_ch // 4 if fam.latent.tokens == "pack2x2" else in_ch
    x = torch.randn(*shape, generator=gen)
    timestep = torch.full((2,), 700.0 / fam.comfy.timestep_scale)
    if fam.comfy.latent_parts:
        sound = fam.capability(families.SoundTrack)
        more = [sound.shape(2, s.get("frames", 1))] if sound is not None else \
            list(PART_SHAPES[arch](2, s.get("frames", 1))) if arch in PART_SHAPES else []
        x = [x] + [torch.randn(*shape, generator=gen) for shape in more]
        assert len(x) == len(fam.comfy.latent_parts), "a part without a test shape"
        timestep = tuple(timestep.clone() for _ in x)
    width = fam.text_width(cfg) * fam.comfy.context_streams
    call = dict(x=x, timestep=timestep,
                context=torch.randn(2, 7, width, generator=gen),
                transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()],
                                     "cond_or_uncond": [1, 0]})
    if fam.text.pooled:
        call["y"] = torch.randn(2, int(cfg["pooled_projection_dim"]), generator=gen)
    if fam.defaults.guidance is not None:
        call["guidance"] = torch.full((2,), float(fam.defaults.guidance))
    second = fam.capability(families.SecondTextEncoder)
    if second is not None:
        call[second.comfy_input] = torch.randn(2, 5, fam.config_width("text_2_width", cfg),
                                               generator=gen)
    return call


def masked_call(arch: str, folder, seed: int = 4) -> dict:
    """`model_call_inputs` with a timestep per token, as ComfyUI's model class makes it from
    a noise mask on the LATENT for a family that takes one (its TokenTimesteps): the first
    part's first index along its first token axis (a video's first latent frame: an
    image-to-video node's start frame) masked to 0, every other token of every part at the
    row's sigma; each part's mask times the timestep flattened to its tokens by the
    patchifier the xDiT MODEL gives ComfyUI's model class ([rows, tokens, 1])."""
    from comfyui_xdit.nodes.token_timesteps import TokenPatchifier
    spec = families.family(arch).capability(families.TokenTimesteps)
    call = model_call_inputs(arch, folder, seed)
    parts = call["x"] if isinstance(call["x"], list) else [call["x"]]
    sigma = call["timestep"][0] if isinstance(call["timestep"], tuple) else call["timestep"]
    steps = []
    for i, (x, axes) in enumerate(zip(parts, spec.token_axes)):
        row = x.shape[1:]
        mask = torch.ones(x.shape[0], *[row[a] if a in axes else 1 for a in range(len(row))])
        if i == 0:
            mask.narrow(axes[0] + 1, 0, 1).zero_()
        steps.append(TokenPatchifier(axes).patchify(mask * sigma.view(-1, *[1] * len(row)))[0])
    call["timestep"] = tuple(steps) if isinstance(call["x"], list) else steps[0]
    return call
