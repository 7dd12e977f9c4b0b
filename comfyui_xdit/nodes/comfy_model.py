"""The xDiT MODEL: a ComfyUI MODEL whose diffusion model is the warm worker pool.

Imports ComfyUI, so only the node module imports it (at node execution). ComfyUI's own
FLUX / SD3 model classes provide everything around the transformer (model sampling, latent
format, conditioning handling), so stock KSampler, KSamplerAdvanced, SamplerCustomAdvanced,
every sampler, scheduler and guider work unchanged; only the diffusion-model call is ours
(comfyui_xdit/nodes/model_calls.py: one pool request per call). The MODEL holds no weights, so
ComfyUI's memory manager neither loads nor offloads anything for it.
"""
from __future__ import annotations

import logging

import torch

import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models

from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.nodes.model_calls import PoolDenoiser
from comfyui_xdit.nodes.logic import cache_text, compiling_text

log = logging.getLogger("comfyui_xdit")


def _show_compiling(event: dict) -> None:
    """A model call's compiling event, or its sampling run's step-cache counts, as text under
    the node that samples (KSampler & co., the executing node of this thread); never fails
    the call."""
    text = compiling_text(event)
    if text is None and event.get("cache"):
        text = "xDiT step cache" + cache_text(event["cache"])
    if text is None:
        return
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer
        ctx = get_executing_context()
        if ctx is not None:
            PromptServer.instance.send_progress_text(text, ctx.node_id)
    except Exception as e:
        log.debug("xDiT: no compiling text: %s", e)


class _PoolDiffusionModel(torch.nn.Module):
    """Stands where ComfyUI keeps the transformer; forwards each call to the pool."""

    def __init__(self, denoiser: PoolDenoiser):
        super().__init__()
        self.denoiser = denoiser
        self.dtype = torch.float32  # what ComfyUI casts inputs to (the workers cast again)

    def forward(self, x, timestep, context=None, y=None, guidance=None, control=None,
                transformer_options={}, **kwargs):
        return self.denoiser(x, timestep, context=context, y=y, guidance=guidance,
                             control=control, transformer_options=transformer_options, **kwargs)


class _Weightless:
    """Mixin for ComfyUI's model classes: no transformer is built here, and the memory the
    sampler should reserve for a call is negligible (the work happens in the pool)."""

    def memory_required(self, input_shape, cond_shapes={}):
        return 1024 * 1024


class XditFlux(_Weightless, comfy.model_base.Flux):
    pass


class XditSD3(_Weightless, comfy.model_base.SD3):
    pass


class XditModelPatcher(comfy.model_patcher.ModelPatcher):
    """Weight patches (LoRA loaders, model merging) have no weights to act on here: refused
    with a message instead of ComfyUI's silent "lora key not loaded"."""

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        raise ConfigError("the xDiT MODEL's weights live in the worker pool, so ComfyUI's "
                          "LoRA loaders and model merges cannot patch them; use LoRA (xDiT) "
                          "with Sampler (xDiT), or ComfyUI's own model for this graph")


FLUX2_MISSING = ("FLUX.2 on KSampler needs a ComfyUI with FLUX.2 support (a model_base.Flux2 "
                 "class, ComfyUI releases from late November 2025 on); this ComfyUI has none. "
                 "Update ComfyUI, or sample this FLUX.2 model with Sampler (xDiT), which "
                 "runs it here")


def flux2_support() -> tuple:
    """(model_base class, supported_models config class) of this ComfyUI's FLUX.2, or a
    ConfigError naming what is missing. The xDiT MODEL is ComfyUI's own model class with the
    transformer swapped, so without that class there is nothing honest to build."""
    base = getattr(comfy.model_base, "Flux2", None)
    conf = getattr(comfy.supported_models, "Flux2", None)
    if base is None or conf is None:
        raise ConfigError(FLUX2_MISSING)
    return base, conf


def build_model(pool, config, arch: str, unet: dict, cache=None):
    """A ComfyUI MODEL (ModelPatcher) for `arch` whose diffusion model is `pool`. `unet`:
    what ComfyUI's detection would find in the model (model_info.comfy_unet_config): FLUX.1
    dev vs schnell, the channels, patch size and FLUX.2's hidden size its config classes
    read."""
    if arch == "flux2":
        flux2_support()  # refused before anything is built
    denoiser = PoolDenoiser(pool, config, arch, on_event=_show_compiling)
    denoiser.cache = cache  # step cache settings (GenerationRequest.cache) or None
    if arch == "flux2":
        base, conf = flux2_support()
        model_config = conf(dict(getattr(conf, "unet_config", {}), **unet,
                                 disable_unet_model_creation=True))
        cls = type("XditFlux2", (_Weightless, base), {})
        model = cls(model_config, device=torch.device("cpu"))
    elif arch == "flux":
        guidance_embeds = unet["guidance_embed"]
        cls = comfy.supported_models.Flux if guidance_embeds else comfy.supported_models.FluxSchnell
        model_config = cls(dict(cls.unet_config, **unet, disable_unet_model_creation=True))
        model_type = comfy.model_base.ModelType.FLUX if guidance_embeds else \
            comfy.model_base.ModelType.FLOW
        model = XditFlux(model_config, model_type=model_type, device=torch.device("cpu"))
    elif arch == "sd3":
        model_config = comfy.supported_models.SD3(
            dict(comfy.supported_models.SD3.unet_config, disable_unet_model_creation=True,
                 out_channels=16))
        model = XditSD3(model_config, device=torch.device("cpu"))
    else:
        raise ConfigError(f"the xDiT MODEL supports flux, flux2 and sd3, not {arch!r}")
    model.diffusion_model = _PoolDiffusionModel(denoiser)
    device = comfy.model_management.get_torch_device()
    return XditModelPatcher(model, load_device=device, offload_device=device, size=1)
