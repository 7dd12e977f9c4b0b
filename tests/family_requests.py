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

from comfyui_xdit import GenerationRequest
from comfyui_xdit.bridge import worker_module

families = worker_module("families")
IDS = families.IDS
A = "a cat"
B = "a big blue dog sitting on a green field under the sky"
NEGATIVE = "ugly dark old photo"


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
    base = dict(prompt=list(prompts), negative_prompt=NEGATIVE, seed=11, steps=3, height=h,
                width=w, cfg=3.0, max_sequence_length=s["msl"], **extra)
    return GenerationRequest(**dict(base, **kw))
