"""Ideogram 4 through the pool at one rank equals diffusers' Ideogram4Pipeline
(docs/design.md#numerics-rule-4), with its unconditional branch on its own transformer; that
every other method equals one rank is the conformance suite's (tests/conformance/).

The tiny model (comfyui_xdit/testmodels/ideogram4.py) has two transformers of different
weights, so a pool that ran the unconditional pass on the conditional transformer (or gave
it the prompt) fails. At 80 x 48 the image is 5 x 3 tokens; the prompts have different
lengths, so a batch's rows carry their own text lengths.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

TOL = 1e-4
ARCH = "ideogram4"
H, W = 80, 48  # 5 x 3 tokens
A = "a red cat"
B = "a big blue dog sitting on a green field with many flowers and trees near a river"
C = "sky"
MSL = 48


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import Ideogram4Pipeline
    p = Ideogram4Pipeline.from_pretrained(str(model_dir(ARCH))).to(torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def to_pipeline_tokens(latent: torch.Tensor) -> torch.Tensor:
    """ComfyUI's FLUX.2 LATENT [B, 128, h, w] (channel, row, column in patch) -> the
    pipeline's tokens [B, h * w, 128] (row, column in patch, channel), as ComfyUI's own
    Ideogram 4 reorders them."""
    b, c, h, w = latent.shape
    return latent.view(b, c // 4, 2, 2, h, w).permute(0, 4, 5, 2, 3, 1).reshape(b, h * w, c)


def from_pipeline_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, n, c = tokens.shape
    return tokens.view(b, h, w, 2, 2, c // 4).permute(0, 5, 3, 4, 1, 2).reshape(b, c, h, w)


def run_pipeline(pipe, req: GenerationRequest) -> torch.Tensor:
    """Ideogram4Pipeline from ComfyUI's noise for the request (a FLUX.2 LATENT), a constant
    guidance scale of the request's cfg; the result as a FLUX.2 LATENT."""
    b = len(req.prompt)
    h, w = req.height // 16, req.width // 16
    noise = torch.randn([b, 128, h, w], generator=torch.manual_seed(req.seed))
    out = pipe(prompt=list(req.prompt), height=req.height, width=req.width,
               num_inference_steps=req.steps, latents=to_pipeline_tokens(noise),
               guidance_scale=float(req.cfg), guidance_schedule=None,
               max_sequence_length=req.max_sequence_length, output_type="latent").images
    return from_pipeline_tokens(out, h, w)


def request(prompts, cfg: float = 3.0, **kw) -> GenerationRequest:
    return GenerationRequest(**dict(dict(prompt=list(prompts), seed=11, steps=3, height=H,
                                         width=W, cfg=cfg, max_sequence_length=MSL), **kw))


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    print(f"{what}: max abs diff {diff:.2e}")
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    return diff


def test_one_rank_equals_the_pipeline(model_dir, layout_pools, pipe):
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig())
    for prompts, cfg in (([A], 3.0), ([A, B, C], 4.0), ([B], 1.0)):
        req = request(prompts, cfg)
        got = pool.generate(req).samples
        assert got.shape == (len(prompts), 128, H // 16, W // 16)
        check(got, run_pipeline(pipe, req), f"1 rank, {len(prompts)} prompt(s), cfg {cfg}")


def test_the_unconditional_transformer_is_used(model_dir, layout_pools, pipe):
    """Negative control: the pipeline with its unconditional transformer swapped for the
    conditional one is far from the pool's result, so the pool runs the second one."""
    req = request([A], 3.0)
    got = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    saved = pipe.unconditional_transformer
    pipe.unconditional_transformer = pipe.transformer
    try:
        moved = run_pipeline(pipe, req)
    finally:
        pipe.unconditional_transformer = saved
    d = float((moved - got).abs().max())
    print(f"unconditional branch on the conditional transformer: {d:.2e}")
    assert d > 1e-2
