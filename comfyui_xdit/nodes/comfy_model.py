"""The xDiT MODEL: a ComfyUI MODEL whose diffusion model is the warm worker pool.

Imports ComfyUI, so only the node module imports it (at node execution). ComfyUI's own
model classes (the family's, workers/families) provide everything around the transformer (model sampling, latent
format, conditioning handling), so stock KSampler, KSamplerAdvanced, SamplerCustomAdvanced,
every sampler, scheduler and guider work unchanged; only the diffusion-model call is ours
(comfyui_xdit/nodes/model_calls.py: one pool request per call). The MODEL holds no weights, so
ComfyUI's memory manager neither loads nor offloads anything for it.
"""
from __future__ import annotations

import logging

import torch

import comfy.conds
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models

from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.nodes import comfy_loras, token_timesteps
from comfyui_xdit.nodes.model_calls import INPUTS, LENGTHS, PoolDenoiser
from comfyui_xdit.nodes.node_text import compiling_text, model_cache_text

log = logging.getLogger("comfyui_xdit")


def _show_compiling(event: dict) -> None:
    """A model call's compiling event, or its sampling run's step-cache counts, as text under
    the node that samples (KSampler & co., the executing node of this thread); never fails
    the call."""
    text = compiling_text(event)
    if text is None and event.get("cache"):
        text = model_cache_text(event["cache"])
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


class _RaggedText(comfy.conds.CONDRegular):
    """Text states whose length differs between conditionings (`ComfySpec.ragged_text`):
    they share a call, zero-padded to the longest; each row's real length travels beside
    (`_Lengths`), and each conditioning reaches the pool at its own (model_calls.py), so
    the answer is each one's alone. (ComfyUI's CONDCrossAttn repeats the shorter instead,
    which a model whose positions follow the text would see.)"""

    def can_concat(self, other):
        a, b = self.cond.shape, other.cond.shape
        return len(a) == len(b) == 3 and a[0] == b[0] and a[2] == b[2] and \
            self.cond.device == other.cond.device

    def concat(self, others):
        conds = [self.cond] + [o.cond for o in others]
        longest = max(c.shape[1] for c in conds)
        return torch.cat([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1]))
                          for c in conds])


class _Lengths(comfy.conds.CONDConstant):
    """Each row's real text length (host ints: no step reads the device), in the order
    ComfyUI concatenates the conditionings' rows."""

    def process_cond(self, batch_size, **kwargs):
        return _Lengths(self.cond[:1] * batch_size)

    def can_concat(self, other):
        return True

    def concat(self, others):
        return sum((o.cond for o in others), self.cond)


def pool_conds(out: dict, denoiser: PoolDenoiser) -> dict:
    """ComfyUI's model inputs of a conditioning (its model class's extra_conds) as the xDiT
    MODEL's: the family's scalar inputs read here, once per conditioning and sampling run
    (`ComfySpec.read_inputs`: no step reads the host), and a text whose length moves the
    positions padded to share calls (`ragged_text`)."""
    spec = denoiser.family.comfy
    if spec.read_inputs is not None:
        raw = {k: getattr(v, "cond", v) for k, v in out.items()}
        inputs = denoiser.read_inputs(raw)
        out = {k: v for k, v in out.items() if k in raw}  # without what it read
        out[INPUTS] = comfy.conds.CONDConstant(inputs)
    text = out.get("c_crossattn")
    if spec.ragged_text and text is not None and text.cond.dim() == 3:
        out["c_crossattn"] = _RaggedText(text.cond)
        out[LENGTHS] = _Lengths((int(text.cond.shape[1]),))
    return out


class _Weightless:
    """Mixin for ComfyUI's model classes: no transformer is built here, and the memory the
    sampler should reserve for a call is negligible (the work happens in the pool). Its
    state dict names the pool model's weights (meta tensors, no data): ComfyUI's LoRA
    loaders map a file's keys to those names (comfy.lora.model_lora_keys_unet)."""

    xdit_weights: dict = {}  # {name without "diffusion_model." and ".weight": shape}

    def memory_required(self, input_shape, cond_shapes={}):
        return 1024 * 1024

    def extra_conds(self, **kwargs):
        return pool_conds(super().extra_conds(**kwargs), self.diffusion_model.denoiser)

    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        for name, shape in self.xdit_weights.items():
            sd.setdefault(f"{comfy_loras.PREFIX}{name}{comfy_loras.SUFFIX}",
                          torch.empty(tuple(shape), device="meta"))
        return sd


class XditModelPatcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's LoRA loaders call `add_patches` on a clone: the LoRA patches are recorded in
    the clone's transformer options and applied by the pool as adapters at sampling time
    (comfyui_xdit/nodes/comfy_loras.py); what the pool cannot apply (model merges, LoKr,
    LoHa, ...) is refused in one line naming the patch, instead of ComfyUI's silent "lora
    key not loaded"."""

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        source = comfy_loras.record(patches, strength_patch, strength_model)
        comfy_loras.add(self.model_options.setdefault("transformer_options", {}), source)
        return list(patches)

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        raise ConfigError("LoRA hooks (Create Hook LoRA & co.) cannot patch the xDiT MODEL, "
                          "whose weights live in the worker pool; use LoraLoader / "
                          "LoraLoaderModelOnly, or ComfyUI's own model for this graph")

    def get_key_patches(self, filter_prefix=None):
        raise ConfigError("a model merge cannot read the xDiT MODEL's weights (they live in "
                          "the worker pool); merge ComfyUI's own models instead")


def _lora_names(model, shapes: dict) -> tuple:
    """comfy_loras.names_from_key_map for this MODEL: its state dict first names the pool
    model's own weights, then also those ComfyUI's own key map adds."""
    import comfy.lora
    model.xdit_weights = dict(shapes)
    try:
        mapped = comfy.lora.model_lora_keys_unet(model, {})
    except Exception as e:  # noqa: BLE001  (ComfyUI's map of this model; the own names stay)
        log.debug("xDiT: no ComfyUI LoRA key map: %s", e)
        mapped = {}
    return comfy_loras.names_from_key_map(mapped, shapes)


def _detected_config(unet_config: dict, path) -> None:
    """Add what ComfyUI's own detection finds in a single file (its tensors' names and
    shapes, as meta tensors) to the config where the family's leaves it out: ComfyUI's LoRA
    key maps for diffusers names are built from it (an MMDiT's depth). Never fails the
    MODEL: without it, fewer LoRA formats map."""
    try:
        import comfy.model_detection
        from comfyui_xdit import bridge
        shapes = bridge.comfy_lora.file_shapes(path)
        if not shapes:
            return
        sd = {comfy_loras.PREFIX + k: torch.empty(tuple(v), device="meta")
              for k, v in shapes.items()}
        for k, v in (comfy.model_detection.detect_unet_config(sd, comfy_loras.PREFIX)
                     or {}).items():
            unet_config.setdefault(k, v)
    except Exception as e:  # noqa: BLE001
        log.debug("xDiT: ComfyUI's detection of %s: %s", path, e)


def comfy_classes(fam, unet: dict) -> tuple:
    """(model_base class, supported_models config class, ModelType or None) of the family's
    ComfyUI model (its description's `comfy`), or a ConfigError naming what this ComfyUI
    lacks. The xDiT MODEL is ComfyUI's own model class with the transformer swapped, so
    without that class there is nothing honest to build."""
    base = getattr(comfy.model_base, fam.comfy.base(unet), None)
    conf = getattr(comfy.supported_models, fam.comfy.config(unet), None)
    if base is None or conf is None:
        raise ConfigError(f"{fam.name} on KSampler needs a ComfyUI with {fam.name} support "
                          f"(model_base.{fam.comfy.base(unet)}); this ComfyUI has none. "
                          f"Update ComfyUI, or sample this model with Sampler (xDiT), which "
                          f"runs it here")
    kind = fam.comfy.model_type(unet)
    return base, conf, None if kind is None else getattr(comfy.model_base.ModelType, kind)


def _stand_in(module: torch.nn.Module, shapes: dict) -> None:
    """Weightless stand-ins (meta tensors, plain attributes: no parameters, nothing to load)
    for what ComfyUI's model class reads of its diffusion model's weights (their shapes)."""
    import types
    for dotted, shape in shapes.items():
        *path, leaf = dotted.split(".")
        obj = module
        for name in path:
            if not hasattr(obj, name):
                object.__setattr__(obj, name, types.SimpleNamespace())
            obj = getattr(obj, name)
        setattr(obj, leaf, torch.empty(tuple(shape), device="meta"))


def _passthrough(value, *args, **kwargs):
    """A method of ComfyUI's diffusion model whose work the pool's forward does (the
    family's ComfySpec.passthrough): its input, unchanged."""
    return value


def _text_kind_check(fam, path):
    """ComfyUI's model class of a family that takes two kinds of text states (its
    `ComfySpec.raw_context_width`) hands them to its diffusion model's
    preprocess_text_embeds with the conditioning's own word on their kind (`unprocessed`:
    before the model's own text modules). The pool tells the kinds by their width; this
    holds the conditioning's word to it: the states, unchanged, or one error."""
    from comfyui_xdit.planning.model_info import _describe_model
    d = _describe_model(path)
    raw = int(fam.comfy.raw_context_width(fam.full_config(d["config"])))

    def preprocess_text_embeds(context, unprocessed=False, **kwargs):
        if unprocessed and int(context.shape[-1]) != raw:
            raise ConfigError(f"this CONDITIONING says its text states come before the "
                              f"{fam.name} model's own text modules, but they are "
                              f"{int(context.shape[-1])} wide where this model takes {raw} "
                              f"there: {fam.text.hint}")
        return context
    return preprocess_text_embeds


def build_model(pool, config, arch: str, unet: dict, cache=None, expert: int = 0,
                path=None, experts: int = 1):
    """A ComfyUI MODEL (ModelPatcher) for family `arch` whose diffusion model is `pool`.
    `unet`: what ComfyUI's detection would find in the model (model_info.comfy_unet_config:
    FLUX.1 dev vs schnell, channels, patch size, hidden sizes its config classes read).
    `expert`: which transformer of a model of several runs its calls (Wan 2.2 A14B: 0 the
    high-noise one, 1 the low-noise one)."""
    from comfyui_xdit.planning.model_info import families
    fam = families.family(arch)
    base, conf, model_type = comfy_classes(fam, unet)  # refused before anything is built
    denoiser = PoolDenoiser(pool, config, arch, on_event=_show_compiling)
    denoiser.cache = cache  # step cache settings (GenerationRequest.cache) or None
    denoiser.expert = int(expert)
    if fam.comfy.model_inputs is not None:
        try:
            denoiser.model_inputs = dict(fam.comfy.model_inputs())
        except ValueError as e:
            raise ConfigError(f"the {fam.name} xDiT MODEL: {e}; use ComfyUI's own model "
                              f"or Sampler (xDiT)") from None
    model_config = conf(dict(getattr(conf, "unet_config", {}), **unet,
                             disable_unet_model_creation=True))
    cls = type(f"Xdit{base.__name__}", (_Weightless, base), {})
    kw = {} if model_type is None else {"model_type": model_type}
    model = cls(model_config, device=torch.device("cpu"), **kw)
    model.diffusion_model = _PoolDiffusionModel(denoiser)
    _stand_in(model.diffusion_model, fam.comfy.shapes(unet))
    for name in fam.comfy.passthrough:  # work the pool's forward does itself
        setattr(model.diffusion_model, name, _passthrough)
    if path is not None and fam.comfy.raw_context_width is not None:
        model.diffusion_model.preprocess_text_embeds = _text_kind_check(fam, path)
    # a noise mask's timesteps per token: the patchifiers the model class makes them with
    token_timesteps.install(model.diffusion_model, fam)
    if path is not None:
        from comfyui_xdit import bridge
        _detected_config(model_config.unet_config, path)
        try:
            shapes = bridge.comfy_lora.weight_shapes(path)
        except Exception as e:  # noqa: BLE001  (a format without a safetensors header:
            log.warning("xDiT: ComfyUI's LoRA loaders see only the names ComfyUI's key map "
                        "gives %s (%s)", path, e)  # the MODEL itself still works)
            shapes = {}
        model.xdit_weights, denoiser.lora_rows, denoiser.lora_parts = \
            _lora_names(model, shapes)
    if experts > 1:
        denoiser.lora_expert = comfy_loras.EXPERT_NAMES[int(expert)]
    device = comfy.model_management.get_torch_device()
    return XditModelPatcher(model, load_device=device, offload_device=device, size=1)
