"""Facts about the supported models, each written once, for the workers and the host (which
loads this module through its worker_modules helper). Plain data and arithmetic: no torch,
cheap to import.
"""
from __future__ import annotations

# diffusers transformer class <-> architecture
ARCH_BY_CLASS = {
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "Flux2Transformer2DModel": "flux2",  # FLUX.2 (dev / klein)
}
CLASS_BY_ARCH = {v: k for k, v in ARCH_BY_CLASS.items()}
ARCHS = tuple(CLASS_BY_ARCH)

# The released VAEs' latent statistics (their vae/config.json; also ComfyUI's
# comfy/latent_formats.py Flux / SD3 scale_factor and shift_factor): raw VAE space ->
# model space is `(raw - shift_factor) * scaling_factor`.
VAE_LATENT = {
    "flux": {"scaling_factor": 0.3611, "shift_factor": 0.1159},
    "sd3": {"scaling_factor": 1.5305, "shift_factor": 0.0609},
}

# The resolution-dependent ("dynamic") timestep shift of FLUX.1-dev's scheduler config.
_DYNAMIC_SHIFT = {"base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                  "max_image_seq_len": 4096}

# Scheduler configs of the released models (their diffusers folders'
# scheduler_config.json): FLUX.1-dev (guidance-distilled: has guidance_in) uses the dynamic
# shift, FLUX.1-schnell (no guidance_in) a plain shift of 1, SD3/3.5 a shift of 3. Single
# files (which carry no scheduler) and the tiny test models use these.
SCHEDULER_DEFAULTS = {
    "flux-dev": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                 **_DYNAMIC_SHIFT},
    "flux-schnell": {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False,
                     **_DYNAMIC_SHIFT},
    "sd3": {"num_train_timesteps": 1000, "shift": 3.0},
}

# What diffusers' FluxPipeline / StableDiffusion3Pipeline take for a dynamic-shift key the
# scheduler config lacks (SD3's pipeline says max_shift 1.16 where FLUX's says 1.15).
DYNAMIC_SHIFT_FALLBACK = {
    "flux": dict(_DYNAMIC_SHIFT),
    "sd3": dict(_DYNAMIC_SHIFT, max_shift=1.16),
}


def dynamic_shift_args(arch: str, config) -> tuple:
    """(base_image_seq_len, max_image_seq_len, base_shift, max_shift) of a scheduler config,
    with the pipelines' fallbacks: the last four arguments of diffusers' calculate_shift."""
    fb = DYNAMIC_SHIFT_FALLBACK[arch]
    return tuple(config.get(k, fb[k]) for k in ("base_image_seq_len", "max_image_seq_len",
                                                 "base_shift", "max_shift"))


# FLUX.1's RoPE axes (not stored in a single file) for its head dim of 128
FLUX_ROPE_AXES_128 = (16, 56, 56)


def flux_rope_axes(head_dim: int) -> tuple:
    """FLUX's RoPE axes (index, row, column): FLUX.1's (16, 56, 56) for head dim 128; other
    head dims (test models) split into three even axes, the two spatial ones equal."""
    if head_dim == 128:
        return FLUX_ROPE_AXES_128
    spatial = ((head_dim - 2) // 2) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


# Reference images (FLUX.1 Kontext, FLUX.2): how several references are laid out in RoPE
# position space, per architecture; the first is the default. FLUX.1 has ComfyUI's methods
# (comfy/ldm/flux/model.py): "offset" (index 1, later references shifted beside the earlier
# ones; one reference = diffusers' FluxKontextPipeline), "index" (index 1, 2, ...), "uxo"
# (index 0, placed diagonally past the image). FLUX.2 has diffusers' Flux2 pipelines' layout
# only: "index", time coordinate 10, 20, ... per reference.
REFERENCE_METHODS = {"flux": ("offset", "index", "uxo"), "flux2": ("index",)}
