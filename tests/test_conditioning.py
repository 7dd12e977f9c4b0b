"""Pre-encoded conditioning (ComfyUI CONDITIONING, diffusers layout) gives exactly the prompt
path's result when it comes from the same encoders; batch-1 conditioning is expanded."""
from __future__ import annotations

import diffusers
import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig


def encode(arch, path, text, msl):
    if arch == "flux":
        pipe = diffusers.FluxPipeline.from_pretrained(path, transformer=None, vae=None)
        pe, pooled, _ = pipe.encode_prompt(prompt=[text], prompt_2=None,
                                           max_sequence_length=msl)
    else:
        pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(path, transformer=None,
                                                                  vae=None)
        pe, _, pooled, _ = pipe.encode_prompt(prompt=[text], prompt_2=None, prompt_3=None,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=msl)
    return {"cond": pe.detach(), "pooled": pooled.detach()}


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_conditioning_path_equals_prompt_path(pools, model_dir, arch):
    pool = pools(arch, 2)
    pool.reconfigure(ParallelConfig(cfg_parallel=True))
    common = dict(seed=21, steps=2, height=64, width=96, max_sequence_length=12, cfg=3.0)
    by_text = pool.generate(GenerationRequest(prompt=["a red cat", "a red cat"],
                                              negative_prompt="blurry", **common)).samples
    pos = encode(arch, str(model_dir(arch)), "a red cat", 12)
    neg = encode(arch, str(model_dir(arch)), "blurry", 12)
    by_cond = pool.generate(GenerationRequest(prompt=[], positive=pos, negative=neg,
                                              batch_size=2, **common)).samples
    assert by_cond.shape == (2, 16, 8, 12)
    assert (by_cond - by_text).abs().max().item() <= 1e-5
    # the comparison can fail: other conditioning gives another image
    other = encode(arch, str(model_dir(arch)), "a dog", 12)
    moved = pool.generate(GenerationRequest(prompt=[], positive=other, negative=neg,
                                            batch_size=2, **common)).samples
    assert (moved - by_text).abs().max().item() > 1e-3


def test_bad_conditioning_is_refused(pools):
    pool = pools("flux", 2)
    bad = {"cond": torch.zeros(3, 8, 96), "pooled": torch.zeros(3, 32)}
    with pytest.raises(ConfigError, match="conditioning batch 3 is neither 1 nor the batch 2"):
        pool.generate(GenerationRequest(prompt=[], positive=bad, batch_size=2, steps=1,
                                        height=64, width=64))
    with pytest.raises(ConfigError, match="expected \\[b,T,D\\] and \\[b,P\\]"):
        pool.generate(GenerationRequest(prompt=[], positive={"cond": torch.zeros(8, 96),
                                                             "pooled": torch.zeros(1, 32)},
                                        steps=1, height=64, width=64))
