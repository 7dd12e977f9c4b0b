"""FLUX and SD3 at one rank reproduce their single-process diffusers pipelines
(docs/design.md#numerics-rule-4) at two sizes, batches 1 and 3, with and without CFG; the
result moved away from its noise, a check that fails for a zero transformer. That every
method equals one rank, for these and every other family, is the conformance suite's
(tests/conformance/).

Size A is non-square with an even split; size B has 63 image tokens and an odd text length.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest

TOL = 1e-4
SIZES = {"A": (128, 96, 16), "B": (144, 112, 11)}  # height, width, max_sequence_length
PROMPTS = ["a photo of a red cat", "a dog on the grass", "blue sky"]


def make_request(size: str, batch: int, cfg: float, seed: int = 7) -> GenerationRequest:
    h, w, msl = SIZES[size]
    return GenerationRequest(prompt=PROMPTS[:batch], seed=seed, steps=3, height=h, width=w,
                             max_sequence_length=msl, cfg=cfg, negative_prompt="ugly")


# A result counts as "moved" when it is this far (max abs, LATENT space) from the initial
# noise in LATENT space: a transformer that predicts zero velocity leaves the noise exactly
# where it was (distance 0.0), whatever the configuration.
MOVED = 1e-2


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_one_rank_matches_diffusers(pools, oracle, unmoved_latent, arch):
    """The baseline every method is compared with (tests/conformance/) is exact, and not a
    degenerate pass: both results moved away from the initial noise, in one space."""
    pool = pools(arch, 1)
    for size in SIZES:
        for batch, cfg in ((3, 2.5), (1, 2.5 if arch == "sd3" else 1.0)):
            req = make_request(size, batch, cfg)
            got = pool.generate(req).samples
            want = oracle(arch, req)
            assert got.shape == want.shape
            diff = (got - want).abs().max().item()
            assert diff <= TOL, f"{arch} {size} batch {batch}: max abs diff {diff:.3e}"
            start = unmoved_latent(arch, req)
            for name, x in (("oracle", want), ("pool", got)):
                moved = (x - start).abs().max().item()
                assert moved > MOVED, f"{name} result is the initial noise ({moved:.2e})"


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_moved_check_fails_for_a_zero_transformer(model_dir, oracle, unmoved_latent, tmp_path,
                                                  arch):
    """The "not degenerate" check above can fail: with the transformer's output projection
    zeroed (every velocity is 0), the diffusers result is the initial noise in LATENT space,
    at distance 0 from `unmoved_latent`, so `moved > MOVED` would fail. (Compared with the
    raw noise instead, the same result is ~1/scale away and would pass.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    zero = tmp_path / "zero"
    shutil.copytree(model_dir(arch), zero)
    f = zero / "transformer" / "diffusion_pytorch_model.safetensors"
    w = load_file(str(f))
    keys = [k for k in w if k.startswith("proj_out.")]
    assert keys, sorted(w)[:5]
    save_file({k: (torch.zeros_like(v) if k in keys else v) for k, v in w.items()}, str(f))
    req = make_request("B", 1, 2.5)
    got = oracle(arch, req, path=zero)
    assert (got - unmoved_latent(arch, req, path=zero)).abs().max().item() <= MOVED / 100
    assert (oracle(arch, req) - unmoved_latent(arch, req)).abs().max().item() > MOVED
