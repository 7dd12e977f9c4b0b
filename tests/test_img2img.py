"""img2img (a LATENT in, denoise < 1) follows ComfyUI's KSampler rule, checked through the pool
against a single-process diffusers reference built here.

ComfyUI (Comfy-Org/ComfyUI a125cd84, Oct 2025):
- comfy/samplers.py `KSampler.set_steps(steps, denoise)`: for `denoise > 0.9999` the
  schedule of `steps` steps; otherwise `new_steps = int(steps / denoise)`, the schedule is
  computed for `new_steps` steps and `sigmas[-(steps + 1):]` is kept: `steps` steps are run,
  over the low-noise end of the longer schedule (not `round(steps * denoise)` steps).
- comfy/model_sampling.py `CONST.noise_scaling(sigma, noise, latent_image)`:
  `sigma * noise + (1 - sigma) * latent_image` at the first kept sigma, on the model-space
  latent (the latent format's `process_in` of the LATENT).

The reference: the full schedule of `int(steps / denoise)` steps as diffusers builds it
(FLUX: `FluxPipeline`'s linear sigmas 1 .. 1/N, shifted by the dynamic shift `mu` of the image
token count; SD3: the scheduler's own linspace between its sigma_max and sigma_min, shifted
by its static shift), the last `steps` of them passed to the pipeline as `sigmas=` (the shift
is elementwise, so shifting the kept ones equals keeping the shifted ones), and
`latents = sigma0 * noise + (1 - sigma0) * x0` in model space, with ComfyUI's noise and
diffusers' own FLUX packing.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

from conftest import (comfyui_noise, latent_to_model, model_to_latent, oracle_settings,
                      pack_flux, unpack_flux)

TOL = 1e-4


def comfyui_schedule_length(steps: int, denoise: float) -> int:
    """comfy/samplers.py KSampler.set_steps: the length of the schedule whose last `steps`
    sigmas are run."""
    return steps if denoise > 0.9999 else int(steps / denoise)


def kept_sigmas(arch: str, scheduler, steps: int, denoise: float) -> list:
    """The unshifted sigmas of the `steps` steps ComfyUI's rule runs, as diffusers' pipelines
    build the full schedule (before the scheduler's shift)."""
    n = comfyui_schedule_length(steps, denoise)
    if arch == "flux":  # FluxPipeline.__call__: np.linspace(1.0, 1 / N, N)
        full = np.linspace(1.0, 1.0 / n, n)
    else:  # FlowMatchEulerDiscreteScheduler.set_timesteps(N) without sigmas
        t = scheduler.config.num_train_timesteps
        full = np.linspace(scheduler.sigma_max * t, scheduler.sigma_min * t, n) / t
    return [float(s) for s in full[n - steps:]]


def diffusers_img2img(path, arch: str, req: GenerationRequest, init_latent: torch.Tensor,
                      denoise: float) -> tuple:
    """(final latent in ComfyUI LATENT space, the sigmas it ran) from the single-process
    diffusers pipeline."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    s = oracle_settings(arch, req)
    b, h, w = len(req.prompt), req.height, req.width
    noise = comfyui_noise(req.seed, (b, 16, h // 8, w // 8))
    x0 = latent_to_model(init_latent, path)
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    kept = kept_sigmas(arch, sched, req.steps, denoise)
    kw = {}
    if sched.config.get("use_dynamic_shifting"):  # FLUX: mu from the image token count
        c = sched.config
        tokens = (h // 16) * (w // 16)
        kw["mu"] = calculate_shift(tokens, c.get("base_image_seq_len", 256),
                                   c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                   c.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=kept, **kw)
    sigma0 = sched.sigmas[0].float()
    start = sigma0 * noise + (1 - sigma0) * x0  # comfy CONST.noise_scaling, model space
    negative = [s["negative_prompt"]] * b
    if arch == "flux":
        pipe = diffusers.FluxPipeline.from_pretrained(path)
        extra = dict(true_cfg_scale=s["cfg"], negative_prompt=negative) if s["cfg"] > 1 else {}
        out = pipe(prompt=list(req.prompt), guidance_scale=s["guidance"], height=h, width=w,
                   num_inference_steps=req.steps, sigmas=kept, latents=pack_flux(start),
                   max_sequence_length=s["max_sequence_length"], output_type="latent",
                   **extra)
        lat = unpack_flux(out.images, h, w)
    else:
        pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(path)
        out = pipe(prompt=list(req.prompt), negative_prompt=negative, guidance_scale=s["cfg"],
                   height=h, width=w, num_inference_steps=req.steps, sigmas=kept,
                   latents=start, max_sequence_length=s["max_sequence_length"],
                   output_type="latent")
        lat = out.images
    assert len(pipe.scheduler.timesteps) == req.steps
    assert torch.allclose(pipe.scheduler.sigmas, sched.sigmas)
    return model_to_latent(lat, path), sched.sigmas


# (steps, denoise): ComfyUI runs `steps` steps; the old rule round(steps * denoise) would run
# 2, 2 and 4 (and so a different schedule)
CASES = [(4, 0.6), (3, 0.5), (4, 1.0)]


@pytest.mark.parametrize("arch", ["flux", "sd3"])
@pytest.mark.parametrize("steps,denoise", CASES)
def test_img2img_runs_comfyui_schedule(pools, model_dir, oracle, arch, steps, denoise):
    path = model_dir(arch)
    pool = pools(arch, 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    cfg = 1.0 if arch == "flux" else 2.0
    req = GenerationRequest(prompt=["a house by the lake"], seed=21, steps=steps, height=64,
                            width=80, max_sequence_length=8, cfg=cfg, guidance=3.0,
                            negative_prompt="")
    # an "encoded image": a LATENT (raw VAE space) unlike the noise
    init = torch.randn(1, 16, 8, 10, generator=torch.manual_seed(99)) * 0.8 + 0.1
    events = []
    got = pool.generate(req, init_latent=init, denoise=denoise,
                        on_event=lambda e: events.append(e) if "step" in e else None).samples
    want, sigmas = diffusers_img2img(path, arch, req, init, denoise)

    n = comfyui_schedule_length(steps, denoise)
    assert len(sigmas) == steps + 1 and float(sigmas[-1]) == 0.0
    assert [e["step"] for e in events] == list(range(1, steps + 1)), \
        f"ComfyUI runs {steps} steps (the last of a {n}-step schedule); the pool ran " \
        f"{[e['step'] for e in events]} of {[e['total'] for e in events][:1]}"
    assert all(e["total"] == steps for e in events)
    assert got.shape == want.shape == init.shape
    diff = (got - want).abs().max().item()
    print(f"{arch} img2img steps {steps} denoise {denoise}: |pool - diffusers| = {diff:.2e}")
    assert diff <= TOL, f"img2img steps {steps} denoise {denoise}: max abs diff {diff:.3e}"

    # not degenerate: the run moved the latent from where it started, and the input latent
    # matters below denoise 1 (at denoise 1 the start is pure noise: text-to-image)
    start = model_to_latent(sigmas[0] * comfyui_noise(req.seed, init.shape)
                            + (1 - sigmas[0]) * latent_to_model(init, path), path)
    assert (got - start).abs().max().item() > 1e-2
    txt2img = oracle(arch, req)
    if denoise < 1.0:
        assert float(sigmas[0]) < 1.0
        assert (got - txt2img).abs().max().item() > 1e-2
    else:
        assert (got - txt2img).abs().max().item() <= TOL


def test_shift_is_the_schedulers_static_shift(pools, model_dir, oracle):
    """A request's `shift` (ComfyUI's ModelSamplingSD3 shift) replaces SD3's FlowMatch Euler
    `shift` (3.0 in the tiny folder, as released): the pool at Ulysses 2 equals
    StableDiffusion3Pipeline with its scheduler made at that shift, and differs from the
    folder's own. FLUX's schedule shifts by the image size: its pool refuses a shift in one
    line, naming what would work, and runs the next job."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    path = model_dir("sd3")
    pool = pools("sd3", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    req = GenerationRequest(prompt=["a house by the lake"], seed=21, steps=4, height=64,
                            width=80, max_sequence_length=8, cfg=2.0, negative_prompt="",
                            shift=6.0)
    got = pool.generate(req).samples
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(path)
    assert pipe.scheduler.config.shift == 3.0
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config,
                                                                 shift=6.0)
    s = oracle_settings("sd3", req)
    noise = comfyui_noise(req.seed, (1, 16, 8, 10))
    want = model_to_latent(pipe(prompt=list(req.prompt), negative_prompt=[""],
                                guidance_scale=2.0, height=64, width=80, num_inference_steps=4,
                                latents=noise, max_sequence_length=s["max_sequence_length"],
                                output_type="latent").images, path)
    diff = (got - want).abs().max().item()
    print(f"sd3 shift 6 Ulysses 2: |pool - diffusers| = {diff:.2e}")
    assert diff <= TOL
    assert (got - oracle("sd3", dataclasses.replace(req, shift=None))).abs().max().item() > 1e-2

    flux = pools("flux", 2)
    flux.reconfigure(ParallelConfig(ulysses=2))
    bad = dataclasses.replace(req, cfg=1.0, guidance=3.0)
    with pytest.raises(Exception, match=r"shift 6: .*shifts its schedule by the image size.*"
                                        r"leave shift unset"):
        flux.generate(bad)
    assert flux.generate(dataclasses.replace(bad, shift=None)).samples.shape == (1, 16, 8, 10)
