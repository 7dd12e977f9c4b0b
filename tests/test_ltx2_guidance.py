"""LTX-2's extra guidance passes (spatio-temporal guidance, modality guidance, guidance
rescale) through the pool equal diffusers' LTX2Pipeline with the same settings, and CFG
parallel over the passes (alone and with Ulysses / Ring inside, under the NCCL rules
emulation) equals one rank.

The passes of a step (workers/sampling/guidance.py): uncond, cond, stg (block 1's
self-attention skipped), modality (audio-video cross-attention off); on cfg 2 they go to the
cfg ranks in turn (0: uncond, stg; 1: cond, modality), three passes unevenly (0: uncond,
stg; 1: cond). The oracle is test_ltx2.py's pipeline and noise, with the settings passed.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.comfy_convert import job_noise
from test_ltx2 import (A, B, SIZE, check, folders, pipes, request, start_image,  # noqa: F401
                       _stats)

NCCL_RULES = "xdit_testhooks.nccl_rules:install"
LAYOUT_POOLS_KEEP = 1  # 2 shared cores: one warm pool at a time

# every setting on, the sound's apart from the video's (none 0: LTX2Pipeline reads 0 as unset)
ALL = {"stg_scale": 1.0, "stg_blocks": [1], "modality_scale": 3.0, "guidance_rescale": 0.7,
       "audio_cfg": 4.0, "audio_stg_scale": 0.5, "audio_modality_scale": 2.0,
       "audio_guidance_rescale": 0.5}
# three passes: CFG and STG
STG = {"stg_scale": 1.0, "stg_blocks": [1]}


def pipeline_kwargs(req: GenerationRequest) -> dict:
    """LTX2Pipeline's guidance arguments for a request (its extra guidance off where unset)."""
    g = dict(req.extra_guidance or {})
    stg = g.get("stg_scale", 0.0)
    mod = g.get("modality_scale", 1.0)
    res = g.get("guidance_rescale", 0.0)
    return dict(guidance_scale=req.cfg, audio_guidance_scale=g.get("audio_cfg", req.cfg),
                stg_scale=stg, audio_stg_scale=g.get("audio_stg_scale", stg),
                modality_scale=mod, audio_modality_scale=g.get("audio_modality_scale", mod),
                guidance_rescale=res, audio_guidance_rescale=g.get("audio_guidance_rescale", res),
                spatio_temporal_guidance_blocks=g.get("stg_blocks"))


@pytest.fixture(scope="module")
def oracle(pipes):
    """oracle(request) -> (video, sound) of LTX2Pipeline with the request's guidance, model
    space, from ComfyUI's noise (as test_ltx2.py's oracle)."""
    cache = {}

    def run(req: GenerationRequest, image=None):
        """`image`: LTX2ImageToVideoPipeline from it, its noise drawn from the seed (as
        test_ltx2.py's image-to-video oracle)."""
        key = repr((req.prompt, req.cfg, sorted((req.extra_guidance or {}).items()),
                    image is not None))
        if key in cache:
            return cache[key]
        pipe = pipes["t2v" if image is None else "i2v"]
        b = len(req.prompt)
        vmean, vstd = _stats(pipe.vae)
        amean, astd = _stats(pipe.audio_vae)
        if image is None:
            video, audio = job_noise("ltx2", req.seed, b, req.height, req.width, req.frames)
            kw = dict(latents=video.flatten(2).transpose(1, 2),
                      audio_latents=audio.transpose(1, 2).flatten(2, 3) * astd + amean)
        else:
            kw = dict(image=image, generator=torch.manual_seed(req.seed))
        v, a = pipe(prompt=list(req.prompt), negative_prompt=[req.negative_prompt] * b,
                    height=req.height, width=req.width, num_frames=req.frames,
                    num_inference_steps=req.steps, max_sequence_length=req.max_sequence_length,
                    output_type="latent", return_dict=False, **kw, **pipeline_kwargs(req))
        sf = pipe.vae.config.scaling_factor
        v = (v.float() - vmean.view(1, -1, 1, 1, 1)) * sf / vstd.view(1, -1, 1, 1, 1)
        tok = a.float().transpose(1, 2).flatten(2, 3)
        a = ((tok - amean) / astd).unflatten(2, (a.shape[1], a.shape[3])).transpose(1, 2)
        cache[key] = (v, a)
        return cache[key]
    return run


def both(got, want, what: str) -> None:
    check(got.samples, want[0], f"{what} video")
    check(got.audio, want[1], f"{what} sound")


def test_one_rank_with_the_extra_passes_equals_the_pipeline(folders, layout_pools, oracle):
    """1 rank, a batch of two prompts: every extra pass on (CFG, STG, modality, rescale, the
    sound's scales its own) and CFG with STG alone equal LTX2Pipeline's. Negative control:
    the modality pass and the rescale move the result (a skipped pass would show), and with
    the passes off the result is test_ltx2.py's plain CFG. (The tiny transformer's
    self-attention gives nearly each token's own value, so its STG pass differs from the
    cond pass by ~1e-6 only, in the pipeline alike: the STG check here holds the pass to
    run without breaking the result, not to move it.)"""
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    results = {}
    for name, extra in (("all", ALL), ("stg", STG), ("off", None),
                        ("no modality", {k: v for k, v in ALL.items()
                                         if not k.endswith("modality_scale")}),
                        ("no rescale", {k: v for k, v in ALL.items()
                                        if not k.endswith("guidance_rescale")})):
        req = request([A, B], 3.0, extra_guidance=extra)
        results[name] = pool.generate(req).latents
        if name in ("all", "stg", "off"):
            both(results[name], oracle(req), f"1 rank, {name}")
    for name in ("stg", "off", "no modality", "no rescale"):
        moved = float((results[name].samples - results["all"].samples).abs().max())
        assert moved > 1e-3, (name, moved)


@pytest.mark.parametrize("extra", [ALL, STG], ids=["four_passes", "three_passes"])
def test_cfg_parallel_over_the_passes_equals_one_rank(folders, layout_pools, oracle, extra):
    """Under the NCCL rules emulation: CFG parallel (the passes on the two cfg ranks in
    turn; three passes unevenly), and with Ulysses 2 and Ring 2 inside, equal the pipeline
    (and so one rank)."""
    req = request([A, B], 3.0, extra_guidance=extra)
    want = oracle(req)
    for name, config in (("cfg2", ParallelConfig(cfg_parallel=True)),
                         ("cfg2 x ulysses2", ParallelConfig(cfg_parallel=True, ulysses=2)),
                         ("cfg2 x ring2", ParallelConfig(cfg_parallel=True, ring=2))):
        pool = layout_pools.get(folders["t2v"], config, worker_hooks=[NCCL_RULES])
        both(pool.generate(req).latents, want, name)


def test_image_to_video_with_the_extra_passes_equals_the_pipeline(folders, layout_pools,
                                                                  oracle):
    """A start frame with every extra pass on (the rescale reads the start frame's own
    prediction, which the pipeline keeps in its x0 before it leaves those tokens alone):
    1 rank and CFG parallel x Ulysses 2 equal LTX2ImageToVideoPipeline."""
    image = start_image()
    req = request([A, B], 3.0, extra_guidance=ALL, reference_images=[image])
    want = oracle(req, image)
    for name, config in (("1 rank", ParallelConfig()),
                         ("cfg2 x ulysses2", ParallelConfig(cfg_parallel=True, ulysses=2))):
        both(layout_pools.get(folders["t2v"], config).generate(req).latents, want,
             f"i2v {name}")


def test_bad_extra_guidance_is_refused_in_one_line_each():
    """Each bad setting is one line naming it and what would be right; a family without
    extra passes refuses the field, naming the families that take it."""
    bad = request([A], extra_guidance={"stg_scale": -1, "modality_scale": 0.5,
                                       "guidance_rescale": 2, "stg_blocks": "29"})
    assert bad.problems("ltx2") == [
        "extra_guidance stg_scale must be a number >= 0 (got -1)",
        "extra_guidance modality_scale must be a number >= 1 (got 0.5)",
        "extra_guidance guidance_rescale must be a number in 0..1 (got 2)",
        "extra_guidance stg_blocks must be a list of block indices >= 0 (got '29')"]
    assert request([A], extra_guidance={"stg_scale": 1.0}).problems("ltx2") == [
        "extra_guidance stg_scale > 0 needs stg_blocks (the blocks the STG pass skips, e.g. "
        "[29] for LTX-2.0)"]
    assert request([A], extra_guidance={"stg": 1}).problems("ltx2") == [
        "extra_guidance ['stg']: LTX-2 takes stg_scale, stg_blocks, modality_scale, "
        "guidance_rescale, audio_cfg, audio_stg_scale, audio_modality_scale, "
        "audio_guidance_rescale"]
    flux = GenerationRequest(prompt=[A], extra_guidance={"stg_scale": 1.0}).problems("flux")
    assert flux == ["extra_guidance ['stg_scale']: FLUX.1 runs the cond and uncond passes "
                    "only (extra guidance passes: LTX-2)"]
    assert not request([A], extra_guidance=ALL).problems("ltx2")


def test_a_block_past_the_transformer_is_refused(folders, layout_pools):
    """stg_blocks beyond the transformer's blocks (the tiny one has 2) is refused before a
    step runs, in one line."""
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    with pytest.raises(Exception, match=r"stg_blocks \[5\]: this transformer has blocks 0..1"):
        pool.generate(request([A], 3.0, extra_guidance={"stg_scale": 1.0,
                                                        "stg_blocks": [5]}))
    assert torch.isfinite(pool.generate(request([A], 3.0)).latents.samples).all()


def test_sampler_options_and_the_cli_flag_set_the_extra_guidance(folders, oracle):
    """Sampler options (xDiT)'s widgets give the request's extra_guidance (None at their
    defaults, so other families are untouched); the Sampler's operation with them equals
    LTX2Pipeline with those settings. The CLI's --guide NAME=VALUE parses each setting
    (block lists comma-separated) and refuses an unknown one in one line."""
    import argparse

    from comfyui_xdit.cli.guide_flag import parse_guide
    from comfyui_xdit.nodes import settings as node_settings
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    assert node_settings.SamplerOptions().extra_guidance() is None
    options = node_settings.SamplerOptions(stg_scale=1.0, stg_blocks="1", modality_scale=3.0,
                                           guidance_rescale=0.7, audio_cfg=4.0)
    extra = options.extra_guidance()
    assert extra == {"stg_scale": 1.0, "stg_blocks": [1], "modality_scale": 3.0,
                     "guidance_rescale": 0.7, "audio_cfg": 4.0}
    assert parse_guide("stg_blocks=28,29") == ("stg_blocks", [28, 29])
    assert parse_guide("modality_scale=3") == ("modality_scale", 3.0)
    with pytest.raises(argparse.ArgumentTypeError, match="--guide wants NAME=VALUE"):
        parse_guide("stg=1")

    h, w, f = SIZE
    reg = PoolRegistry()
    try:
        handle = ModelHandle(path=str(folders["t2v"]), device="cpu", dtype="fp32",
                             threads_per_rank=1)
        empty = {"samples": torch.zeros(1, 128, (f - 1) // 8 + 1, h // 32, w // 32)}
        lat = sample(handle, SampleInputs(latent=empty, prompt=A,
                                          negative_prompt=request([A]).negative_prompt,
                                          seed=5, steps=request([A]).steps, cfg=3.0,
                                          max_sequence_length=request([A]).max_sequence_length,
                                          extra_guidance=extra), registry=reg)
    finally:
        reg.unload_all()
    want = oracle(request([A], 3.0, extra_guidance=extra))
    check(lat["samples"], want[0], "sampler node video, extra guidance")
    check(lat["audio"], want[1], "sampler node sound, extra guidance")


def test_cli_refuses_a_bad_guide_before_launching(folders, tmp_path):
    """`generate --guide stg_scale=1` without stg_blocks exits 2 with the one line, before
    any worker starts."""
    from test_cli import cli

    h, w, f = SIZE
    r = cli("generate", "--model", folders["t2v"], "--prompt", A, "--seed", "5", "--steps", "2",
            "--height", str(h),
            "--width", str(w), "--frames", str(f), "--guide", "stg_scale=1",
            "--out", tmp_path / "x.safetensors")
    assert r.returncode == 2, r.stderr
    assert "extra_guidance stg_scale > 0 needs stg_blocks" in r.stderr, r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_pipefusion_refuses_guidance_it_would_drop(folders, layout_pools):
    """PipeFusion combines plain CFG: a setting only the family's guide reads (the sound's
    own cfg) is refused in one line, not dropped; the same pool then runs a plain job."""
    pool = layout_pools.get(folders["t2v"], ParallelConfig(pipefusion=2, warmup_steps=1))
    with pytest.raises(Exception, match=r"PipeFusion combines plain CFG only.*audio_cfg"):
        pool.generate(request([A], 3.0, extra_guidance={"audio_cfg": 5.0}))
    assert torch.isfinite(pool.generate(request([A], 3.0)).latents.samples).all()
