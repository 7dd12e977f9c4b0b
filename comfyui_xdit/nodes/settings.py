"""What the nodes' inputs take, without ComfyUI: the widgets' choices and the values the
settings nodes output (the loader's advanced options, the step cache, the sampler's rarely
used options, Wan 2.2 A14B's second file), which `handles.loader_handle` spreads into the
model handle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
# Each node outputs one frozen value; its fields are handles.make_handle's keywords, so a settings
# node at its defaults gives exactly what the loader gives with nothing connected (except
# PipeFusion settings, whose degree defaults to 2: connecting it means "use PipeFusion").
@dataclass(frozen=True)
class ParallelSettings:
    """Parallel settings (xDiT): the degrees and which GPUs hold the ranks."""

    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    dp: int = 1
    gpus: str = ""


@dataclass(frozen=True)
class PipeFusionSettings:
    """PipeFusion settings (xDiT): the patch pipeline over blocks split into stages."""

    pipefusion: int = 2
    warmup_steps: int = 1
    pipeline_patches: int = 0  # 0: the PipeFusion degree
    pipefusion_split: str = "balanced"


@dataclass(frozen=True)
class EngineSettings:
    """Engine settings (xDiT): how each rank runs the model (a change relaunches the pool)."""

    attention: str = "auto"
    compile: bool = False
    weights: str = "auto"
    text_encoders: str = "auto"
    shard_weights: bool = False
    memory_plan: str = "auto"


@dataclass(frozen=True)
class CacheSettings:
    """Step cache (xDiT): skip a call's middle blocks while the first blocks' output barely
    changes (workers/sampling/step_cache.py). Connecting the node turns it on; 0.08 is First Block
    Cache's suggestion for FLUX.1 (ParaAttention), not a figure measured here."""

    threshold: float = 0.08
    warmup: int = 2
    head: int = 1
    tail: int = 0
    max_skips: int = 3
    taylor: bool = False

    def as_request(self) -> Optional[dict]:
        """GenerationRequest.cache (None when the threshold is 0: off)."""
        from dataclasses import asdict
        d = asdict(self)
        problems = cache_problems(d)
        if problems:
            raise ConfigError(problems[0])
        return d if self.threshold > 0 else None


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

    cfg_2: float = 0.0  # Wan 2.2 A14B's low-noise expert's guidance scale; 0: the cfg
    shift: float = 0.0  # the scheduler's flow shift (ModelSamplingSD3's); 0: the model's


EXPERTS = ("high_noise", "low_noise")  # a model's transformer, then its transformer_2
