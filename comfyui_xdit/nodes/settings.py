"""What the nodes' inputs take, without ComfyUI: the widgets' choices, and the settings
nodes (the loader's advanced options, the step cache, the sampler's rarely used options, Wan
2.2 A14B's second file): the values they output, which `handles.loader_handle` spreads into
the model handle, and each one's widgets, defined once beside its value's fields."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from comfyui_xdit import bridge
from comfyui_xdit.planning import launch_policy
from comfyui_xdit.planning.config import ATTENTION_BACKENDS, WEIGHTS, ConfigError
from comfyui_xdit.planning.request import cache_problems

WORLD_SIZES = ["auto"] + [str(i) for i in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)]
DEVICES = ["auto", "cuda", "cpu"]  # auto: cuda when this ComfyUI has CUDA, else cpu
DTYPES = ["auto", "bf16", "fp16", "fp32"]  # auto: bf16 on cuda, fp32 on cpu
ATTENTION = list(ATTENTION_BACKENDS)
WEIGHT_OPTIONS = list(WEIGHTS)
TEXT_ENCODER_OPTIONS = ["auto", "cpu", "gpu"]
LORA_EXPERT_OPTIONS = ["both", "high", "low"]  # the LoRA node: Wan 2.2 A14B's experts
NO_MODEL_2 = "none"  # the loader's low_noise_model default: one model
SPLITS = ["balanced", "compute", "memory"]
MEMORY_PLAN_OPTIONS = ["auto"] + list(launch_policy.MODES)  # auto: $XDIT_MEMORY_PLAN
MAX_SEED = 2 ** 64 - 1


def text_encoder_options(gpu_count: Optional[int] = None) -> list[str]:
    """The loader's text_encoders choices: the fixed ones, then `cuda:N` for each visible GPU
    (a spare GPU can hold FLUX.2-dev's 44.7 GiB Mistral encoder beside the ranks)."""
    if gpu_count is None:
        from comfyui_xdit.planning.gpus import visible_gpus
        gpu_count = len(visible_gpus())
    return TEXT_ENCODER_OPTIONS + [f"cuda:{i}" for i in range(gpu_count)]


SETTINGS_CATEGORY = "xDiT/settings"  # the option nodes, beside the main nodes under "xDiT"


# ---- the settings nodes: the loader's advanced options, off the loader ------------------
# Each node outputs one frozen value, and each of its inputs is one field of that value: the
# field's default is the widget's, its `Widget` says how the widget looks (extension.py builds
# the inputs and the value from these, so a node's inputs are defined here once). The loader's
# settings' fields are handles.make_handle's keywords, so a settings node at its defaults
# gives exactly what the loader gives with nothing connected (except PipeFusion settings,
# whose degree defaults to 2: connecting it means "use PipeFusion").
@dataclass(frozen=True)
class Widget:
    """How a settings node shows one field: a Combo when it has `options` (a list, or a
    function giving it when the schema is built), else by the default's type (Boolean, Int,
    Float, String). `name`: the input's name where it is not the field's."""

    tooltip: str
    name: str = ""
    options: Any = None
    min: Optional[float] = None
    max: Optional[float] = None
    step: Optional[float] = None
    round: Optional[float] = None
    optional: bool = False
    read: Optional[Callable] = None  # the widget's value -> the field's (default: its type)


def widget(default, tooltip: str, **kw):
    """A settings field shown as a widget (see `Widget`)."""
    return field(default=default, metadata={"widget": Widget(tooltip, **kw)})


@dataclass(frozen=True)
class ParallelSettings:
    """Parallel settings (xDiT): the degrees and which GPUs hold the ranks."""

    ulysses: int = widget(1, "Ulysses degree (splits attention heads; must divide them)",
                          min=1, max=64)
    ring: int = widget(1, "Ring attention degree (K/V passed around a ring)", min=1, max=64)
    cfg_parallel: bool = widget(False, "Positive and negative branch on different ranks "
                                       "(needs cfg > 1); cfg_degree spreads more guidance "
                                       "passes")
    dp: int = widget(1, "Data parallel: the latent batch split over ranks", min=1, max=64)
    gpus: str = widget("", "Comma-separated GPU ids for the ranks, as this ComfyUI numbers "
                           "them (empty: all visible)", read=lambda v: str(v or ""))
    # optional, and last (a saved workflow's widget values are in order), so a workflow
    # saved before them still validates
    split: str = widget("even", "Work per rank for GPUs of different speed or memory (exact "
                                "whatever it is): even, auto (measured per GPU) or one weight "
                                "per rank, e.g. 3,2", read=lambda v: str(v or "").strip() or "even",
                        optional=True)
    cfg_degree: int = widget(2, "With cfg_parallel: the ranks a step's guidance passes are "
                                "spread over. 2: positive and negative branch; 3 or 4: "
                                "LTX-2's STG and modality passes each on ranks of their own "
                                "(at most the passes a step runs)", min=2, max=4,
                             optional=True)  # max: the most passes a step runs (LTX-2's 4)


@dataclass(frozen=True)
class PipeFusionSettings:
    """PipeFusion settings (xDiT): the patch pipeline over blocks split into stages."""

    pipefusion: int = widget(2, "PipeFusion degree: pipeline stages (1: off)", min=1, max=64)
    warmup_steps: int = widget(1, "Full synchronous steps first (exact); >= steps makes the "
                                  "whole run exact", min=0, max=1000)
    pipeline_patches: int = widget(0, "Patches per step (0: the PipeFusion degree)", min=0,
                                   max=64)
    pipefusion_split: str = widget("balanced", "Stages: balanced (least work on the slowest "
                                               "stage, each <= 1/N + 5% of the weights), "
                                               "compute, or memory", options=SPLITS)


@dataclass(frozen=True)
class EngineSettings:
    """Engine settings (xDiT): how each rank runs the model (a change relaunches the pool)."""

    attention: str = widget("auto", "Attention kernel, chosen once per pool. auto: the "
                                    "fastest this device has; cudnn, flash (flash-attn) and "
                                    "efficient force one (CUDA only); torch: torch's own SDPA "
                                    "choice", options=ATTENTION)
    compile: bool = widget(False, "torch.compile of the transformer blocks during warm-up: "
                                  "faster steps, a much slower first job")
    weights: str = widget("auto", "auto: as the checkpoint stores them (an fp8 file stays fp8 "
                                  "on the GPU, others in dtype); fp8: block weights stored in "
                                  "fp8 e4m3fn (half of bf16's memory), computed in dtype; "
                                  "full: every weight in dtype, fp8 files included",
                          options=WEIGHT_OPTIONS)
    text_encoders: str = widget("auto", "Where rank 0 runs the text encoders for prompt text: "
                                        "auto (rank 0's GPU when they fit beside the "
                                        "transformer, else CPU), cpu, gpu (rank 0's GPU), or "
                                        "cuda:N (that GPU: a spare one, or another rank's)",
                                options=lambda: text_encoder_options())
    shard_weights: bool = widget(False, "Keep 1/N of the transformer's weights on each GPU "
                                        "(torch FSDP2; each block gathered just before it "
                                        "runs): exact, for models larger than one GPU; costs "
                                        "one all-weight gather per step (fast on NVLink, slow "
                                        "on PCIe). Not with PipeFusion or compile")
    # optional, so a workflow saved before it still validates
    shard_split: str = widget("even", "With shard_weights: each GPU's share of the weights. "
                                      "even (equal chunks), memory (by each GPU's memory, for "
                                      "GPUs of different sizes) or one weight per rank like "
                                      "3,2; exact whatever it is", optional=True)
    memory_plan: str = widget("auto", "The per-GPU memory plan made before a CUDA pool "
                                      "launches (an estimate): enforce refuses a layout it "
                                      "predicts will not fit, advise warns and launches "
                                      "anyway; auto: the XDIT_MEMORY_PLAN environment "
                                      "variable, else enforce", options=MEMORY_PLAN_OPTIONS,
                              read=lambda v: str(v).strip().lower() or "auto")


# Step cache (xDiT) outputs the workers' own settings type, whose defaults its widgets show
CacheSettings = bridge.cache_settings.CacheSettings
CACHE_WIDGETS = {
    "threshold": Widget("Skip when the first blocks' output changed less than this "
                        "(relative); higher: faster, further from the uncached image; 0: off",
                        min=0.0, max=10.0, step=0.01, round=0.001),
    "warmup": Widget("Model calls that always compute first", min=0, max=1000),
    "head": Widget("First blocks that always run (their change is measured)",
                   name="head_blocks", min=1, max=100),
    "tail": Widget("Last blocks that always run", name="tail_blocks", min=0, max=100),
    "max_skips": Widget("Most skipped calls in a row (0: no limit)", min=0, max=1000),
    "taylor": Widget("Forecast the skipped blocks' output to first order (TaylorSeer) instead "
                     "of reusing it"),
}


def cache_request(settings) -> Optional[dict]:
    """A Step cache (xDiT) value -> GenerationRequest.cache (None when the threshold is 0:
    off); settings no model can take are refused here, in one line."""
    d = settings.to_dict()
    problems = cache_problems(d)
    if problems:
        raise ConfigError(problems[0])
    return d if settings.enabled else None


@dataclass(frozen=True)
class ExpertFile:
    """Low-noise expert (xDiT): Wan 2.2 A14B's low-noise expert file, for the loader whose
    model is the high-noise one (a name from `discover_single_files`)."""

    name: str = NO_MODEL_2


# the loader's optional inputs: input name -> (the value it takes, the node that makes it)
SETTINGS_INPUTS = {"parallel": (ParallelSettings, "Parallel settings (xDiT)"),
                   "pipefusion": (PipeFusionSettings, "PipeFusion settings (xDiT)"),
                   "engine": (EngineSettings, "Engine settings (xDiT)")}


@dataclass(frozen=True)
class SamplerOptions:
    """Sampler options (xDiT): what few models use, kept off the sampler's own widgets."""

    cfg_2: float = widget(0.0, "Wan 2.2 A14B: the low-noise expert's guidance scale (the "
                               "released pipeline's guidance_scale_2). 0: the sampler's cfg "
                               "for both experts", min=0.0, max=100.0, step=0.1, round=0.01)
    shift: float = widget(0.0, "The scheduler's flow shift, as ModelSamplingSD3's shift on a "
                               "MODEL (Wan, SD3; e.g. 12 for Wan 2.2 T2V A14B as its original "
                               "code samples). 0: the model's own", min=0.0, max=100.0,
                          step=0.01, round=0.01, optional=True)
    # extra guidance passes (LTX-2's, the request's extra_guidance): each at its "off" value
    # by default; optional, so a workflow saved before them loads unchanged
    stg_scale: float = widget(0.0, "LTX-2: spatio-temporal guidance scale, one more forward "
                                   "pass a step with the stg_blocks' self-attention skipped "
                                   "(LTX2Pipeline's stg_scale). 0: off", min=0.0, max=100.0,
                              step=0.1, round=0.01, optional=True)
    stg_blocks: str = widget("", "LTX-2: the blocks the STG pass skips, comma-separated "
                                 "(29 for LTX-2.0, as LTX2Pipeline recommends)", optional=True)
    modality_scale: float = widget(1.0, "LTX-2: modality guidance scale, one more forward pass "
                                        "a step with the audio-video cross-attention off. 1: "
                                        "off", min=1.0, max=100.0, step=0.1, round=0.01,
                                   optional=True)
    guidance_rescale: float = widget(0.0, "LTX-2: the guided prediction rescaled toward the "
                                          "conditional one's spread (LTX2Pipeline's "
                                          "guidance_rescale). 0: off", min=0.0, max=1.0,
                                     step=0.01, round=0.01, optional=True)
    audio_cfg: float = widget(0.0, "LTX-2: the sound's guidance scale (LTX2Pipeline's "
                                   "audio_guidance_scale). 0: the sampler's cfg", min=0.0,
                              max=100.0, step=0.1, round=0.01, optional=True)

    def extra_guidance(self) -> Optional[dict]:
        """The request's extra_guidance from the widgets that are not at their off value."""
        out = {}
        if self.stg_scale:
            out["stg_scale"] = float(self.stg_scale)
        blocks = [b.strip() for b in str(self.stg_blocks or "").split(",") if b.strip()]
        if blocks:
            out["stg_blocks"] = [int(b) if b.isdigit() else b for b in blocks]
        if self.modality_scale and self.modality_scale != 1.0:
            out["modality_scale"] = float(self.modality_scale)
        if self.guidance_rescale:
            out["guidance_rescale"] = float(self.guidance_rescale)
        if self.audio_cfg:
            out["audio_cfg"] = float(self.audio_cfg)
        return out or None


@dataclass(frozen=True)
class NodeInput:
    """One widget of a settings node, as extension.py declares it: `kind` is the io class
    (Combo, Boolean, Int, Float, String), `kwargs` its keywords."""

    kind: str
    name: str
    field: str
    kwargs: dict


def _widgets(value_type) -> list:
    """(field, default, Widget) of every widget of a settings value type, in order."""
    table = CACHE_WIDGETS if value_type is CacheSettings else {}
    out = []
    for f in fields(value_type):
        w = table.get(f.name) or f.metadata.get("widget")
        if w is not None:
            out.append((f.name, f.default, w))
    return out


def node_inputs(value_type) -> list:
    """The widgets of the node that outputs `value_type`, defaults from its fields."""
    out = []
    for name, default, w in _widgets(value_type):
        kw = {"default": default, "tooltip": w.tooltip}
        if w.options is not None:
            kind = "Combo"
            kw["options"] = list(w.options() if callable(w.options) else w.options)
        else:
            kind = {bool: "Boolean", int: "Int", float: "Float", str: "String"}[type(default)]
        for k in ("min", "max", "step", "round"):
            if getattr(w, k) is not None:
                kw[k] = getattr(w, k)
        if w.optional:
            kw["optional"] = True
        out.append(NodeInput(kind, w.name or name, name, kw))
    return out


def node_value(value_type, inputs: dict):
    """The node's widget values (by input name; optional ones may be missing) -> its value."""
    values = {}
    for name, default, w in _widgets(value_type):
        key = w.name or name
        if key not in inputs:
            continue
        read = w.read or type(default)
        values[name] = read(inputs[key])
    return value_type(**values)


EXPERTS = ("high_noise", "low_noise")  # a model's transformer, then its transformer_2
