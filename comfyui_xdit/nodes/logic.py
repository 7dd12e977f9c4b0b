"""What the ComfyUI nodes do, without importing ComfyUI (tested in CI).

- `ModelHandle`: what the loader node outputs (path, degrees, device, dtype); nothing starts.
  `ParallelSettings` / `PipeFusionSettings` / `EngineSettings`: what the settings nodes
  output, spread into the handle by `loader_handle`.
- `PoolRegistry` (one module-level `REGISTRY`): one warm WorkerPool per (model, parallel
  config, device, dtype, gpus). Node re-execution and cache eviction only look the pool up;
  another configuration replaces the pool (the same model/device/world size keeps the warm
  workers and just rebuilds their process groups).
- `discover_models` / `discover_single_files`: diffusers folders (model_index.json +
  transformer/config.json) and single .safetensors files (diffusion_models, checkpoints).
- `decode`: LATENT -> IMAGE, on the pool (diffusers folders: patch-parallel VAE) or with
  ComfyUI's VAE (single files).
- `sample`: LATENT / CONDITIONING / widgets -> GenerationRequest -> pool -> LATENT;
  `job_text`: the node's closing line ("12 steps, 2 ranks (Ulysses 2), 3.1 s"); every node
  text is one line that fits its node (`NODE_TEXT_PX`, `fit_text`).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from comfyui_xdit.comfy_convert import (check_text_width, comfy_noise, conditioning_to_request,
                            family_name, latent_channels, latent_downscale,
                            latent_from_comfy, latent_shape,
                            latent_shape_text, latent_to_comfy, layout_hint,
                            start_image_fields)
from comfyui_xdit.planning.config import ATTENTION_BACKENDS, WEIGHTS, ConfigError, EngineOptions, ParallelConfig, \
    auto_config
from comfyui_xdit.planning import memory_plan
from comfyui_xdit.planning.gpus import gpus_for_ranks, visible_gpus
from comfyui_xdit.planning.model_info import read_model_info
from comfyui_xdit.planning.pool_fit import to_close
from comfyui_xdit.planning.room import make_room
from comfyui_xdit.planning.request import cache_problems, families, GenerationRequest, default_cfg

log = logging.getLogger("comfyui_xdit")
WORLD_SIZES = ["auto"] + [str(i) for i in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)]
DEVICES = ["auto", "cuda", "cpu"]  # auto: cuda when this ComfyUI has CUDA, else cpu
DTYPES = ["auto", "bf16", "fp16", "fp32"]  # auto: bf16 on cuda, fp32 on cpu
ATTENTION = list(ATTENTION_BACKENDS)
WEIGHT_OPTIONS = list(WEIGHTS)
TEXT_ENCODER_OPTIONS = ["auto", "cpu", "gpu"]
LORA_EXPERT_OPTIONS = ["both", "high", "low"]  # the LoRA node: Wan 2.2 A14B's experts
NO_MODEL_2 = "none"  # the loader's low_noise_model default: one model
SPLITS = ["balanced", "compute", "memory"]
MEMORY_PLAN_OPTIONS = ["auto"] + list(memory_plan.MODES)  # auto: $XDIT_MEMORY_PLAN
MAX_SEED = 2 ** 64 - 1


def text_encoder_options(gpu_count: Optional[int] = None) -> list[str]:
    """The loader's text_encoders choices: the fixed ones, then `cuda:N` for each visible GPU
    (a spare GPU can hold FLUX.2-dev's 44.7 GiB Mistral encoder beside the ranks)."""
    if gpu_count is None:
        from comfyui_xdit.planning.gpus import visible_gpus
        gpu_count = len(visible_gpus())
    return TEXT_ENCODER_OPTIONS + [f"cuda:{i}" for i in range(gpu_count)]


# ---- model discovery ------------------------------------------------------------------
def is_diffusers_folder(path) -> bool:
    p = Path(path)
    return (p / "model_index.json").is_file() and (p / "transformer" / "config.json").is_file()


def discover_models(folders, max_depth: int = 3) -> list[str]:
    """Diffusers model folders under `folders`, as '/'-separated names relative to their
    root (sorted, unique)."""
    found = set()
    for root in folders or []:
        root = Path(root)
        if not root.is_dir():
            continue
        for dirpath, dirnames, _ in os.walk(root, followlinks=True):
            d = Path(dirpath)
            rel = d.relative_to(root)
            if d != root and is_diffusers_folder(d):
                found.add(rel.as_posix())
                dirnames[:] = []  # a model's subfolders are its components
                continue
            if len(rel.parts) >= max_depth:
                dirnames[:] = []
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
    return sorted(found)


# Single files: ComfyUI folder kinds, each listed as "<kind>/<file>" so a name says where it
# is (and never collides with a diffusers folder's name). A checkpoints folder mixes model
# families, so only files holding a transformer of a known family are listed from it.
FILE_KINDS = ("diffusion_models", "checkpoints")
HEADER_CACHE_SIZE = 64  # checkpoint files whose verdict is remembered (least recently used go)


def _is_dit_file(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return _holds_dit(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=HEADER_CACHE_SIZE)
def _holds_dit(path: str, mtime_ns: int, size: int) -> bool:
    """Whether the file holds a known family's transformer, from its header; keyed on the file's
    (path, mtime, size) so a replaced file is read again."""
    from comfyui_xdit.planning.model_info import read_safetensors_header, transformer_keys
    try:
        transformer_keys(read_safetensors_header(path))
        return True
    except ConfigError:
        return False


def discover_single_files(roots_by_kind: dict, max_depth: int = 3) -> list[str]:
    """`{"diffusion_models": [dirs], "checkpoints": [dirs]}` -> sorted "<kind>/<rel path>"
    names of .safetensors files (every file of diffusion_models, known families' ones of
    checkpoints)."""
    from comfyui_xdit.planning.model_info import SINGLE_FILE_SUFFIXES
    found = set()
    for kind in FILE_KINDS:
        for root in roots_by_kind.get(kind) or []:
            root = Path(root)
            if not root.is_dir():
                continue
            for dirpath, dirnames, files in os.walk(root, followlinks=True):
                d = Path(dirpath)
                rel = d.relative_to(root)
                if len(rel.parts) >= max_depth:
                    dirnames[:] = []
                dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
                for f in files:
                    if not f.lower().endswith(SINGLE_FILE_SUFFIXES) or f.startswith("."):
                        continue
                    if kind == "checkpoints" and not _is_dit_file(d / f):
                        continue
                    found.add(f"{kind}/{(rel / f).as_posix()}")
    return sorted(found)


def resolve_model(name: str, folders, roots_by_kind: Optional[dict] = None) -> str:
    """A name from `discover_models` / `discover_single_files` (or an absolute path) ->
    the model's path. A missing file or folder gives one error naming where it looked."""
    if os.path.isabs(name) and (is_diffusers_folder(name) or os.path.isfile(name)):
        return name
    kind, _, rest = name.partition("/")
    if kind in FILE_KINDS and rest:
        roots = list((roots_by_kind or {}).get(kind) or [])
        for root in roots:
            p = Path(root) / rest
            if p.is_file():
                return str(p)
        raise ConfigError(f"model file {rest!r} not found in {kind} "
                          f"({', '.join(map(str, roots)) or 'no folder configured'}); pick a "
                          f"file from the list (refresh it after adding models)")
    for root in folders or []:
        p = Path(root) / name
        if is_diffusers_folder(p):
            return str(p)
    raise ConfigError(missing_model_message(name, folders, roots_by_kind))


def missing_model_message(name: str, folders, roots_by_kind: Optional[dict] = None) -> str:
    """One line: the name, where it was looked for, what was found there, and where the
    folder goes (the examples name FLUX.1-dev and stable-diffusion-3.5-medium)."""
    found = discover_models(folders) + discover_single_files(roots_by_kind or {})
    where = ", ".join(map(str, folders or [])) or "no models/diffusers folder configured"
    listed = ", ".join(found[:12]) + (f" (+{len(found) - 12} more)" if len(found) > 12 else "")
    present = [str(Path(r) / name) for r in folders or [] if (Path(r) / name).exists()]
    if present:  # there, but not a model folder
        return (f"model {name!r} at {present[0]} is not a diffusers folder (it needs "
                f"model_index.json and transformer/config.json, as a Hugging Face snapshot "
                f"of the repository has); found {listed or 'no FLUX.1/FLUX.2/SD3 model'}")
    return (f"model {name!r} not found: looked for a diffusers folder {name!r} (with "
            f"model_index.json and transformer/config.json) in {where}, and for single "
            f"files in models/diffusion_models and models/checkpoints; found "
            f"{listed or 'no FLUX.1/FLUX.2/SD3 model'}. Put the model folder at "
            f"models/diffusers/{name} (e.g. a Hugging Face snapshot of the repository), "
            f"then refresh the node list")


def cuda_available() -> bool:
    """Whether this process can use CUDA (torch imported lazily: never at import time)."""
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def resolve_device(device: str, has_cuda: Optional[bool] = None) -> str:
    """'auto' -> 'cuda' when CUDA is usable here (`has_cuda`, default: torch says so),
    else 'cpu'; anything else as given."""
    device = str(device or "auto").strip().lower()
    if device == "auto":
        return "cuda" if (cuda_available() if has_cuda is None else has_cuda) else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bf16 on cuda, fp32 on cpu (the dtype that actually runs)."""
    dtype = str(dtype or "auto").strip().lower()
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return dtype


# ---- the loader's handle ----------------------------------------------------------------
@dataclass(frozen=True)
class ModelHandle:
    """Output of the loader node: a description only; the pool starts at sampling."""

    path: str
    device: str = "cpu"
    dtype: str = "fp32"
    world_size: Optional[int] = None  # None: "auto"
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    dp: int = 1
    gpus: Optional[tuple] = None
    threads_per_rank: Optional[int] = None
    loras: tuple = ()  # ((path, strength[, "high" | "low"]), ...): the LoRA node; never a new pool
    pipefusion: int = 1
    warmup_steps: int = 1  # PipeFusion: full synchronous steps before the patch pipeline
    pipeline_patches: Optional[int] = None  # PipeFusion patches per step (None: the degree)
    pipefusion_split: str = "balanced"
    attention: str = "auto"  # config.ATTENTION_BACKENDS
    compile: bool = False  # EngineOptions: torch.compile of the blocks during warm-up
    weights: str = "auto"  # EngineOptions: auto | fp8 | full
    text_encoders: str = "auto"  # EngineOptions: auto | cpu | gpu | cuda:N
    shard_weights: bool = False  # EngineOptions: FSDP2 block weights over every rank
    memory_plan: str = "auto"  # enforce | advise | auto ($XDIT_MEMORY_PLAN): a misfit refused?
    # Wan 2.2 A14B from two single files: the low-noise expert's file (`path`: the high-noise
    # one); the pool's model_path_2
    path_2: Optional[str] = None

    def info(self):
        """The model's ModelInfo (a pair of expert files read as one model)."""
        return read_model_info(self.path, self.path_2)

    def with_lora(self, path: str, strength: float, expert: str = "both") -> "ModelHandle":
        """The LoRA node: chain one more adapter (the workers cache adapters, so changing
        this list between jobs never reloads the base model). `expert`: "both", or "high" /
        "low" (Wan 2.2 A14B: one of its two transformers only)."""
        import dataclasses
        if not os.path.isfile(path):
            raise ConfigError(f"LoRA file not found: {path}")
        expert = str(expert or "both").strip().lower()
        if expert not in LORA_EXPERT_OPTIONS:
            raise ConfigError(f"LoRA expert must be one of {', '.join(LORA_EXPERT_OPTIONS)} "
                              f"(got {expert!r})")
        if expert != "both" and self.info().experts < 2:
            raise ConfigError(f"LoRA expert {expert}: {os.path.basename(self.path)!r} has one "
                              f"transformer; high / low name Wan 2.2 A14B's high- and low-noise "
                              f"experts. Choose both")
        entry = (str(path), float(strength)) + (() if expert == "both" else (expert,))
        return dataclasses.replace(self, loras=self.loras + (entry,))

    @property
    def degrees_given(self) -> bool:
        return (self.ulysses > 1 or self.ring > 1 or self.cfg_parallel or self.dp > 1
                or self.pipefusion > 1)

    def default_world(self) -> int:
        """'auto': every GPU of the list, else every visible GPU (comfyui_xdit/planning/gpus.py; at
        least 1, so none visible gives the GPU check's error); 2 ranks on CPU."""
        if self.device == "cuda":
            return len(self.gpus) if self.gpus else max(1, len(visible_gpus()))
        return max(1, min(2, os.cpu_count() or 1))

    def world(self) -> int:
        """The world size this handle runs at (before a request's automatic split)."""
        if self.degrees_given:
            return self.explicit_config().ranks
        return self.world_size or self.default_world()

    def explicit_config(self) -> ParallelConfig:
        return ParallelConfig(dp=self.dp, cfg_parallel=self.cfg_parallel, ulysses=self.ulysses,
                              ring=self.ring, pipefusion=self.pipefusion,
                              warmup_steps=self.warmup_steps,
                              pipeline_patches=self.pipeline_patches,
                              pipefusion_split=self.pipefusion_split, world_size=self.world_size)

    def config_for(self, request: Optional[GenerationRequest] = None) -> ParallelConfig:
        """Degrees given: exactly those (the world size must match their product). All
        degrees 1: an automatic split of the world size ('auto': every GPU, 2 CPU ranks)."""
        if self.degrees_given:
            return self.explicit_config()
        world = self.world_size or self.default_world()
        info = self.info()
        uses_cfg = request.uses_cfg(info) if request is not None else False
        batch = request.batch if request is not None else 1
        return auto_config(world, info.heads, uses_cfg, batch).with_world_size(world)

    def engine(self) -> EngineOptions:
        return EngineOptions(device=self.device, dtype=self.dtype, attention=self.attention,
                             compile=self.compile, weights=self.weights,
                             text_encoders=self.text_encoders,
                             shard_weights=self.shard_weights)

    def problems(self, layout: bool = True) -> list[str]:
        """Every problem the loader can see before anything runs, each one phrase.
        `layout=False`: only what no settings node can change (dtype, the model itself)."""
        out = []
        if self.device in ("cpu",) and self.dtype in ("bf16", "fp16"):
            out.append(f"dtype {self.dtype} does not run on cpu (the CPU workers compute in "
                       f"fp32); use auto or fp32")
        if not layout:
            try:
                self.info()
            except ConfigError as e:
                out.append(str(e))
            return out
        out += self.engine().problems()
        try:
            mode = memory_plan.resolve_mode(self.memory_plan)
        except ConfigError as e:  # said once; no misfit refusal beside it
            out.append(str(e))
            mode = "advise"
        try:
            info = self.info()
        except ConfigError as e:
            return out + [str(e)]
        try:
            if self.degrees_given:
                self.explicit_config().validate(info)
                out += self.engine().problems_with(self.explicit_config())
            elif self.world_size is not None and self.world_size < 1:
                raise ConfigError(f"world size must be >= 1 (got {self.world_size})")
            if self.device == "cuda":  # the GPUs must hold the world, before anything starts
                gpus = gpus_for_ranks(self.world(), self.gpus)
                plan = memory_plan.check_launch(  # and its weights: refused with the numbers
                    self.path, self.config_for(), self.engine(), gpus, mode=mode,
                    model_path_2=self.path_2)
                object.__setattr__(self, "_memory_plan", plan)  # memory_summary, node_text
        except ConfigError as e:
            out.append(str(e))
        return out

    def memory_summary(self) -> str:
        """The memory plan's line for the loader ("" on CPU or GPUs of unknown size)."""
        p = self.__dict__.get("_memory_plan")
        if p is None:
            return ""
        return p.summary() + ("; memory_plan=advise: the pool launches anyway" if p.misfits
                              else "")

    def node_text(self, node: Optional[str] = "loader") -> str:
        """The loader's one line: what runs (auto resolved) and, on CUDA, the memory plan's
        peak (`loader_text`); node None: with the plan's summary, for the log."""
        if node is None:
            text = loader_text(self.device, self.dtype, self.world(), node=None)
            return text + (f"; {self.memory_summary()}" if self.memory_summary() else "")
        return loader_text(self.device, self.dtype, self.world(),
                           self.__dict__.get("_memory_plan"), node=node)

    def validate(self) -> None:
        """Raise one ConfigError holding every problem (the loader shows it once)."""
        out = self.problems()
        if out:
            raise ConfigError("; ".join(out))


def make_handle(model_path: str, device: str, dtype: str, world_size="auto", ulysses: int = 1,
                ring: int = 1, cfg_parallel: bool = False, dp: int = 1, gpus: str = "",
                threads_per_rank: Optional[int] = None, pipefusion: int = 1,
                warmup_steps: int = 1, pipeline_patches: int = 0,
                pipefusion_split: str = "balanced", attention: str = "auto",
                compile: bool = False, weights: str = "auto", text_encoders: str = "auto",
                shard_weights: bool = False, memory_plan: str = "auto",
                has_cuda: Optional[bool] = None, model_path_2: Optional[str] = None) -> ModelHandle:
    """The loader's widgets -> a handle. `pipeline_patches` 0 means "the PipeFusion degree";
    device/dtype 'auto' are resolved here (`has_cuda`: whether this ComfyUI has CUDA)."""
    ws = None if str(world_size).strip().lower() in ("auto", "", "0") else int(world_size)
    gpu_list = tuple(g.strip() for g in str(gpus or "").split(",") if g.strip()) or None
    device = resolve_device(device, has_cuda)
    dtype = resolve_dtype(dtype, device)
    return ModelHandle(path=str(Path(model_path).resolve()), device=device, dtype=dtype,
                       world_size=ws, ulysses=int(ulysses), ring=int(ring),
                       cfg_parallel=bool(cfg_parallel), dp=int(dp), gpus=gpu_list,
                       threads_per_rank=threads_per_rank, pipefusion=int(pipefusion),
                       warmup_steps=int(warmup_steps),
                       pipeline_patches=int(pipeline_patches) or None,
                       pipefusion_split=str(pipefusion_split).strip() or "balanced",
                       attention=str(attention), compile=bool(compile),
                       weights=str(weights), text_encoders=str(text_encoders),
                       shard_weights=bool(shard_weights),
                       memory_plan=str(memory_plan).strip().lower() or "auto",
                       path_2=None if not model_path_2 else str(Path(model_path_2).resolve()))


LOADER_DEFAULTS = dict(device="auto", dtype="auto", world_size="auto", ulysses=1, ring=1,
                       cfg_parallel=False, dp=1, gpus="", pipefusion=1, warmup_steps=1,
                       pipeline_patches=0, pipefusion_split="balanced", attention="auto",
                       compile=False, weights="auto", text_encoders="auto",
                       shard_weights=False, memory_plan="auto")


# ---- the settings nodes: the loader's advanced options, off the loader ------------------
# Each node outputs one frozen value; its fields are make_handle's keywords, so a settings
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


def cache_text(counts: Optional[dict], short: bool = False) -> str:
    """The step cache's counts for the node texts: "9 of 16 calls computed in full", short
    "9/16 calls in full" ("" without the cache)."""
    if not counts:
        return ""
    total = counts["computed"] + counts["skipped"]
    if short:
        return f"{counts['computed']}/{total} calls in full"
    return f"{counts['computed']} of {total} calls computed in full"


@dataclass(frozen=True)
class ExpertFile:
    """Low-noise expert (xDiT): Wan 2.2 A14B's low-noise expert file, for the loader whose
    model is the high-noise one (a name from `discover_single_files`)."""

    name: str = NO_MODEL_2


# the loader's optional inputs: input name -> (the value it takes, the node that makes it)
SETTINGS_INPUTS = {"parallel": (ParallelSettings, "Parallel settings (xDiT)"),
                   "pipefusion": (PipeFusionSettings, "PipeFusion settings (xDiT)"),
                   "engine": (EngineSettings, "Engine settings (xDiT)")}


def loader_keywords(inputs: dict) -> dict:
    """The loader's inputs -> make_handle's keywords. Settings values are spread into their
    fields; flat keywords (make_handle's names) are taken as they are, for Python callers
    and for the one removed widget a saved API workflow can still send, `pipefusion`
    (the PipeFusion input's name): a number there is the old degree."""
    import dataclasses
    kw = dict(LOADER_DEFAULTS)
    for k, v in inputs.items():
        if v is None:
            continue
        if k in SETTINGS_INPUTS and isinstance(v, SETTINGS_INPUTS[k][0]):
            kw.update(dataclasses.asdict(v))
        elif k in LOADER_DEFAULTS:
            kw[k] = v
    return kw


def settings_pending(inputs: dict) -> bool:
    """Whether a settings node is linked but its value not known yet: ComfyUI validates a
    node before its linked inputs exist and passes them as None (an unconnected optional
    input is absent)."""
    return any(k in inputs and inputs[k] is None for k in (*SETTINGS_INPUTS, "low_noise_model"))


def loader_handle(inputs: dict, folders, roots_by_kind: Optional[dict] = None,
                  has_cuda: Optional[bool] = None,
                  cuda_refusal: str = "") -> ModelHandle:
    """The loader node: its inputs (as ComfyUI passes them: widgets and the settings nodes'
    values) -> a validated handle. Every problem (model missing, cuda without CUDA, dtype,
    engine options, degrees, GPUs) is gathered into one ConfigError, shown once.
    `cuda_refusal`: why CUDA is off here (e.g. ComfyUI's --cpu), said in the cuda message.
    While a linked settings value is pending (ComfyUI's validation) only what the settings
    cannot change is checked: the layout waits for their values, so a layout that only fits
    with them (sharded weights, PipeFusion) is never refused early."""
    pending = settings_pending(inputs)
    kw = loader_keywords(inputs)
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    problems = []
    device = str(kw["device"]).strip().lower()
    if device == "cuda" and not has_cuda:
        problems.append("device cuda: " + (cuda_refusal or "this ComfyUI has no CUDA GPU "
                                           "(torch.cuda.is_available() is False)")
                        + "; use device auto (runs on cpu here) or cpu")
        kw["device"] = "cpu"  # the other checks as they would run here
        if str(kw["dtype"]).lower() in ("bf16", "fp16"):
            kw["dtype"] = "auto"
    name = str(inputs.get("model") or "")
    name_2 = inputs.get("low_noise_model") or NO_MODEL_2  # Low-noise expert (xDiT), or a name
    name_2 = str(name_2.name if isinstance(name_2, ExpertFile) else name_2)
    try:
        path = resolve_model(name, folders, roots_by_kind)
        path_2 = None if name_2 == NO_MODEL_2 else second_expert_file(
            name, path, name_2, roots_by_kind)
    except ConfigError as e:
        raise ConfigError("; ".join(problems + [str(e)])) from None
    handle = make_handle(path, has_cuda=has_cuda, model_path_2=path_2, **kw)
    problems += handle.problems(layout=not pending)
    if problems:
        raise ConfigError("; ".join(problems))
    return handle


def second_expert_file(name: str, path: str, name_2: str,
                       roots_by_kind: Optional[dict] = None) -> str:
    """The loader's low_noise_model (Wan 2.2 A14B's low-noise expert file, `name` / `path`
    being the high-noise one) -> its path; one line when the model has no second expert.
    The pair itself (same family, same config) is checked by model_info.read_pair."""
    kind = name_2.partition("/")[0]
    if kind not in FILE_KINDS and not os.path.isabs(name_2):
        raise ConfigError(f"low_noise_model {name_2!r} is not a single file: pick Wan 2.2 "
                          f"A14B's low-noise expert file from models/diffusion_models, or none")
    if not os.path.isfile(path):
        raise ConfigError(f"low_noise_model pairs two Wan 2.2 A14B expert files; model "
                          f"{name!r} is a diffusers folder, which holds its experts itself: "
                          f"set low_noise_model to none")
    info = read_model_info(path)
    if info.family.expert_boundary is None:
        raise ConfigError(f"low_noise_model: model {name!r} is a {info.family.name} model, "
                          f"which has no experts (only Wan 2.2 A14B's high-noise file takes a "
                          f"low-noise one): set low_noise_model to none")
    path_2 = resolve_model(name_2, [], roots_by_kind)
    from comfyui_xdit.planning.model_info import read_pair
    read_pair(path, path_2, names=("model", "low_noise_model"))  # the pair, in the node's words
    return path_2


# ---- the registry -----------------------------------------------------------------------
class PoolRegistry:
    """Warm pools by (path, device, dtype, gpus, ..., path_2); each pool's config follows the
    last job.

    Pools of different models stay warm side by side while the memory plan says they fit
    together on their GPUs (or in host memory), the least recently used closing first when a
    new one would not fit (planning/pool_fit.py); `max_pools` caps their number. So a graph
    with two xDiT models (a Qwen-Image still and a Wan video) keeps both pools warm."""

    def __init__(self, max_pools: int = 4, pool_factory=None, fit=None):
        """`fit(kept, new) -> pools to close` (default pool_fit.to_close); tests give
        their own."""
        self._pools: dict = {}  # (path, device, dtype, gpus) -> WorkerPool
        self._lock = threading.RLock()
        self.max_pools = max_pools
        self._factory = pool_factory
        self._fit = fit or to_close
        self.last_error: Optional[str] = None
        self.last_error_log: Optional[str] = None  # a dead worker's kept log
        self.last_job: dict = {}
        self.last_decode_text = ""  # what the last Decode ran (its node text)
        self.launching: Optional[str] = None  # "starting 2 workers", "loading 1/2", ...

    @staticmethod
    def _key(handle: ModelHandle) -> tuple:
        return (handle.path, handle.device, handle.dtype, handle.gpus, handle.threads_per_rank,
                handle.attention, handle.compile, handle.weights, handle.text_encoders,
                handle.shard_weights, handle.path_2)

    def get(self, handle: ModelHandle, config: ParallelConfig):
        """The pool for `handle` running `config`: the same one on every call with the same
        arguments (re-executed nodes do not spawn workers); another config replaces it."""
        from comfyui_xdit.client.pool import WorkerPool

        key = self._key(handle)
        with self._lock:
            pool = self._pools.pop(key, None)
            if pool is not None:
                self._pools[key] = pool  # most recently used last
            if pool is not None and pool.config != config:
                if pool.config.ranks == config.ranks:
                    pool.reconfigure(config)  # same ranks: warm workers, new process groups
                else:
                    self._close(key)
                    pool = None
            if pool is None:
                for other in list(self._pools)[: max(0, len(self._pools) - self.max_pools + 1)]:
                    self._close(other)
                factory = self._factory or WorkerPool
                # engine options away from their defaults only (test factories take **kw)
                kw = {k: getattr(handle, k) for k, default in
                      (("attention", "auto"), ("compile", False), ("weights", "auto"),
                       ("text_encoders", "auto"), ("shard_weights", False))
                      if getattr(handle, k) != default}
                if handle.memory_plan != "auto":
                    kw["memory_plan"] = handle.memory_plan
                if handle.path_2 is not None:  # Wan 2.2 A14B from its two expert files
                    kw["model_path_2"] = handle.path_2
                pool = factory(handle.path, config, device=handle.device, dtype=handle.dtype,
                               gpus=list(handle.gpus) if handle.gpus else None,
                               threads_per_rank=handle.threads_per_rank, **kw)
                by_id = {id(p): k for k, p in self._pools.items()}
                for other in self._fit(list(self._pools.values()), pool):
                    log.info("xDiT: closing the pool of %s: it and %s do not fit in "
                             "memory together", by_id[id(other)][0], handle.path)
                    self._close(by_id[id(other)])
                self._pools[key] = pool
            else:  # not in the key: the mode only acts at the pool's next launch
                pool.memory_plan = handle.memory_plan
            return pool

    def pool_for_decode(self, handle: ModelHandle):
        """The warm pool of `handle` as it is (a decode runs on any configuration of the
        right model); a new one with the handle's configuration if there is none."""
        with self._lock:
            pool = self._pools.get(self._key(handle))
            if pool is not None:
                return pool
        return self.get(handle, handle.config_for(None))

    def pools(self) -> list:
        with self._lock:
            return list(self._pools.values())

    def _close(self, key) -> None:
        pool = self._pools.pop(key, None)
        if pool is not None:
            pool.close()

    def unload_all(self) -> int:
        """Stop every pool and forget it; returns how many were stopped."""
        with self._lock:
            keys = list(self._pools)
            for k in keys:
                self._close(k)
            return len(keys)

    def restart_all(self) -> int:
        """Stop every pool's workers but keep it: the next job relaunches it."""
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            return len(self._pools)

    def status(self) -> dict:
        out = []
        for pool in self.pools():
            try:
                st = pool.status()
            except Exception as e:  # a status request must never raise into the server
                st = {"state": "error", "error": str(e)}
            st = dict(st)
            st.setdefault("model", pool.model_path)
            st["config"] = pool.config.describe()
            st["world_size"] = pool.config.ranks
            st["device"] = pool.device
            st["dtype"] = pool.dtype
            st["launches"] = pool.launches
            out.append(_jsonable(st))
        return {"pools": out, "last_error": self.last_error,
                "last_error_log": self.last_error_log, "launching": self.launching,
                "last_job": _jsonable(self.last_job)}

    def job_started(self) -> None:
        """A new job: the last one's error is history (the panel stops showing it)."""
        self.last_error = None
        self.last_error_log = None

    def job_failed(self, e: BaseException) -> None:
        self.last_error = error_text(e)
        self.last_error_log = getattr(e, "log_path", None)

    def launch_callback(self, on_launch: Optional[Callable[[str, int, int], None]] = None):
        """Wraps a node's launch-progress callback so the panel shows the launch too."""
        def cb(text: str, done: int, total: int) -> None:
            self.launching = text
            if on_launch is not None:
                on_launch(text, done, total)
        return cb


SETTINGS_CATEGORY = "xDiT/settings"  # the option nodes, beside the main nodes under "xDiT"


def family_list() -> str:
    """Every family the pack runs, for node descriptions (from the family registry, so a
    new family appears without editing a node)."""
    return families.names()


def cfg_defaults_text() -> str:
    """Each family's default classifier-free guidance scale, for the cfg tooltip."""
    parts = []
    for f in families.FAMILIES.values():
        text = f"{f.name} {f.cfg:g}" + (" (off)" if f.cfg <= 1 else "")
        if f.undistilled_cfg is not None:
            text += f", base models {f.undistilled_cfg:g}"
        parts.append(text)
    return "; ".join(parts)


def guidance_defaults_text() -> str:
    """The families with embedded guidance and their defaults, for the guidance tooltip."""
    return ", ".join(f"{f.name} {f.guidance:g}" for f in families.FAMILIES.values()
                     if f.guidance is not None)


def conditioning_hint_text() -> str:
    """How each family's CONDITIONING is made, for the positive input's tooltip."""
    return "; ".join(f"{f.name}: {f.text_hint}" for f in families.FAMILIES.values())


# ---- the node texts: ComfyUI's progress text under a node ---------------------------------
# ComfyUI's frontends (1.27, 1.35) show it in a text widget added below the node's widgets,
# 58 px tall: one 16 px line of 12 px text (a second line is cut; a long line wraps and is
# cut). So each text is one line that fits the node as the example workflows lay it out and
# as a freshly added node is sized: the node's width less the widget's margins (2 x 10 px)
# and the text's padding (2 x 16 px). The full sentence goes to ComfyUI's log.
NODE_TEXT_PX = {
    "loader": 218,  # Load model (xDiT): 270 wide in the examples, 274-278 fresh
    "sampler": 348,  # Sampler (xDiT): 400
    "decode": 88,  # Decode (xDiT): 140 fresh, 220 in the examples
    "comfy_sampler": 150,  # ComfyUI's samplers on the xDiT MODEL: SamplerCustomAdvanced 202
}                          # fresh (KSampler 270)
# Glyph widths in px, rounded up to 0.5: the larger of the two frontends' text fonts (Inter
# 12 px on 1.35, Arial 12 px on 1.27), measured in headless Chromium; others count 12.5.
_GLYPH_PX = {3.0: "ijl", 3.5: " !,.:I", 4.0: "';`t|", 4.5: "()/[\\]fr", 5.5: "-{}",
             6.0: '"*^', 6.5: "s", 7.0: "17?JL_acekvxyz", 7.5: "235689FZbdghnopqu",
             8.0: "#$&+04<=>BEPST~", 8.5: "AKVXY", 9.0: "CDHNRU", 9.5: "GOQ", 10.0: "w",
             10.5: "m", 11.0: "M", 12.0: "%W"}
_PX = {c: w for w, chars in _GLYPH_PX.items() for c in chars}


def text_px(text: str) -> float:
    """The width of `text` in a node's text widget, estimated from above (px)."""
    return sum(_PX.get(c, 12.5) for c in text)


def fit_text(candidates, node: Optional[str]) -> str:
    """The first of `candidates` (most detailed first) whose one line fits `node`'s text
    widget (NODE_TEXT_PX), else the last; node None: the first (the log's sentence)."""
    candidates = [c for c in candidates if c]
    if node is None:
        return candidates[0]
    return next((c for c in candidates if text_px(c) <= NODE_TEXT_PX[node]), candidates[-1])


def duration_text(seconds: float) -> str:
    """"0.4 s", "9.9 s", then whole seconds: "12 s", "1234 s"."""
    s = max(0.0, float(seconds or 0.0))
    return f"{s:.1f} s" if s < 9.95 else f"{s:.0f} s"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def compiling_text(event: dict) -> Optional[str]:
    """The text under a node for a compiling event (workers/runtime/compile.py: `compile` pools, while
    dynamo compiles during the first steps or calls); None for any other event. The same on
    Sampler (xDiT) and on ComfyUI's samplers (the narrower), so it fits both."""
    if event.get("phase") != "compiling":
        return None
    t = duration_text(event.get("compile_s"))
    return fit_text([f"compiling: {_count(int(event.get('compiles', 0)), 'graph')}, {t}",
                     f"compiling, {t}"], "comfy_sampler")


def model_cache_text(counts: Optional[dict], node: Optional[str] = "comfy_sampler") -> str:
    """A sampling run's step-cache counts under ComfyUI's sampler node running the xDiT MODEL
    ("xDiT: 9/16 calls in full"; node None: "xDiT step cache, 9 of 16 calls computed in
    full", for the log); "" without the cache."""
    if not counts:
        return ""
    return fit_text([f"xDiT step cache, {cache_text(counts)}",
                     f"xDiT: {cache_text(counts, short=True)}",
                     cache_text(counts, short=True)], node)


def step_text(step: int, total: int, counts: Optional[dict]) -> str:
    """Sampler (xDiT) while a cached job runs: "step 3/28, 2 of 3 calls computed in full"."""
    return fit_text([f"step {step}/{total}, {cache_text(counts)}",
                     f"step {step}/{total}, {cache_text(counts, short=True)}",
                     f"step {step}/{total}"], "sampler")


def launch_text(text: str, done: int, total: int, node: Optional[str] = "sampler") -> str:
    """The pool's launch progress ("starting 4 workers", "loading 3/4") as a node's text:
    "starting 0/4" where the node is narrow (Decode)."""
    short = f"loading {done}/{total}" if text.startswith("loading") else \
        f"starting {done}/{total}"
    return fit_text([text, short], node)


def memory_text(plan) -> str:
    """The loader's memory-plan clause: "30.1 of 79.1 GiB" (the peak rank against its GPU),
    "90.2 of 79.1 GiB: too big", "30.1 GiB peak" (GPU size unknown), "no memory plan"."""
    worst = getattr(plan, "worst", None)
    if worst is None:  # memory_plan.UnplannedLaunch
        return "no memory plan"
    peak = memory_plan.gib(worst.total, unit=False)
    if worst.gpu_memory is None:
        return f"{peak} GiB peak"
    text = f"{peak} of {memory_plan.gib(worst.gpu_memory)}"
    return text + (": too big" if plan.fits is False else "")


def loader_text(device: str, dtype: str, ranks: int, plan=None,
                node: Optional[str] = "loader") -> str:
    """What Load model (xDiT) says runs (auto resolved): "runs on cpu, fp32, 2 ranks", with
    the memory plan on CUDA: "cuda, bf16, 8 ranks, 30.1 of 79.1 GiB"."""
    head = f"{device}, {dtype}, {_count(ranks, 'rank')}"
    if plan is None:
        return fit_text([f"runs on {head}", head], node)
    mem = memory_text(plan)
    return fit_text([f"{head}, {mem}", f"{_count(ranks, 'rank')}, {mem}", mem], node)


def layout_text(config: ParallelConfig) -> str:
    """The degrees above 1, in the node's words: "Ulysses 2", "CFG parallel x Ring 2";
    "" for one rank."""
    parts = [(config.dp > 1, f"DP {config.dp}"), (config.cfg_parallel, "CFG parallel"),
             (config.pipefusion > 1, f"PipeFusion {config.pipefusion}"),
             (config.ulysses > 1, f"Ulysses {config.ulysses}"),
             (config.ring > 1, f"Ring {config.ring}")]
    return " x ".join(text for on, text in parts if on)


def job_text(steps: int, config: ParallelConfig, job_s: float, launch_s: float = 0.0,
             cache: Optional[dict] = None, node: Optional[str] = "sampler") -> str:
    """What the Sampler node says when its job is done, replacing the launch's "loading
    k/N": "12 steps, 2 ranks (Ulysses 2), 3.1 s", plus the launch when this job paid it and
    the step cache's counts; where that is too long for the node, the counts get shorter,
    then the layout goes, then the launch (node None: everything, for the log)."""
    ranks = f"{_count(steps, 'step')}, {_count(config.ranks, 'rank')}"
    layout = layout_text(config)
    head = ranks + (f" ({layout})" if layout else "")
    t = f", {duration_text(job_s)}"
    launch = f" + {duration_text(launch_s)} launch" if launch_s else ""
    full, short = (f", {cache_text(cache)}", f", {cache_text(cache, short=True)}") if cache \
        else ("", "")
    return fit_text([head + t + launch + full, head + t + launch + short,
                     ranks + t + launch + short, ranks + t + short,
                     f"{_count(steps, 'step')}{t}"], node)


def decode_text(images, ranks: int, seconds: float, launched: bool,
                node: Optional[str] = "decode") -> str:
    """What the Decode node says when done, replacing the launch's "loading k/N" when the
    decode started the pool: "2 ranks, 0.8 s" (on the pool) or "VAE, 0.8 s" (the VAE
    input); node None: "decoded 2 images 1024x1024 on 2 ranks, 0.8 s (incl. launch)", for
    the log."""
    n, h, w = int(images.shape[0]), int(images.shape[1]), int(images.shape[2])
    t = duration_text(seconds)
    where = f"on {_count(ranks, 'rank')}" if ranks else "with the VAE input"
    full = (f"decoded {_count(n, 'image')} {w}x{h} {where}, {t}"
            + (" (incl. launch)" if launched else ""))
    if node is None:
        return full
    return fit_text([f"{_count(ranks, 'rank')}, {t}" if ranks else f"VAE, {t}", t], node)


def error_text(e: BaseException) -> str:
    """The line the panel shows: the exception's type and its one-line message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


REGISTRY = PoolRegistry()


# ---- sampling ---------------------------------------------------------------------------
@dataclass
class SampleInputs:
    latent: dict
    seed: int = 0
    steps: int = 20
    cfg: float = 0.0  # 0: the model's default (FLUX 1 = off, SD3 7, FLUX.2 base klein 4)
    guidance: float = 0.0  # 0: the model's default (FLUX.1 3.5, FLUX.2 [dev] 4)
    denoise: float = 1.0
    prompt: str = ""
    negative_prompt: str = ""
    positive: Optional[list] = None  # ComfyUI CONDITIONING
    negative: Optional[list] = None
    max_sequence_length: int = 512
    preview_every: int = 0  # k: a low-res preview latent every k steps
    cache: Optional[CacheSettings] = None  # Step cache (xDiT), when connected
    cfg_2: float = 0.0  # a second expert's guidance scale (Wan 2.2 A14B); 0: cfg
    shift: float = 0.0  # the scheduler's flow shift (Wan, SD3); 0: the model's


@dataclass(frozen=True)
class SamplerOptions:
    """Sampler options (xDiT): what few models use, kept off the sampler's own widgets."""

    cfg_2: float = 0.0  # Wan 2.2 A14B's low-noise expert's guidance scale; 0: the cfg
    shift: float = 0.0  # the scheduler's flow shift (ModelSamplingSD3's); 0: the model's


EXPERTS = ("high_noise", "low_noise")  # a model's transformer, then its transformer_2




def model_text_width(path: str) -> Optional[int]:
    """The transformer's joint_attention_dim (the width its text states must have), from the
    folder's config or the single file's weight shapes; None when unknown."""
    from comfyui_xdit.planning.model_info import _describe_model, families
    d = _describe_model(path)
    # a folder's config omits what equals diffusers' class default
    defaults = families.family(d["arch"]).config_defaults
    w = d["config"].get("joint_attention_dim", defaults.get("joint_attention_dim"))
    if w is None:  # Wan's name for it
        w = d["config"].get("text_dim", defaults.get("text_dim"))
    return None if w is None else int(w)


def build_job(inp: SampleInputs, arch: str, text_width: Optional[int] = None,
              model=None) -> tuple[GenerationRequest, dict]:
    """-> (request, generate() keyword arguments: noise, init_latent, denoise) for a model
    of `arch`; `text_width`: its joint_attention_dim, checked against CONDITIONING; `model`:
    its ModelInfo, which resolves a cfg of 0 (FLUX.2 [klein] base models run CFG 4)."""
    lat = latent_from_comfy(inp.latent, arch)
    # 0: the request's per-model default (FLUX.1 3.5, FLUX.2 [dev] 4.0)
    guidance = float(inp.guidance) if inp.guidance else None
    positive = negative = None
    if inp.positive is not None:
        positive, g = conditioning_to_request(inp.positive, "positive", arch)
        if g is not None:  # FluxGuidance / CLIPTextEncodeFlux set it on the conditioning
            guidance = g
    if inp.negative is not None:
        negative, _ = conditioning_to_request(inp.negative, "negative", arch)
    if text_width is not None:
        for name, c in (("positive", positive), ("negative", negative)):
            if c is not None:
                check_text_width(c, text_width, arch, name)
    if inp.cfg:
        cfg = float(inp.cfg)
    elif model is not None or families.family(arch).undistilled_cfg is None:
        cfg = default_cfg(model if model is not None else arch)
    else:
        cfg = None  # unknown without the model: the references are checked as under CFG
    refs, method = _references(positive, negative, cfg)
    start = _start_image(positive, negative, cfg)
    if positive is None and not (inp.prompt or "").strip():
        raise ConfigError("no prompt: connect positive CONDITIONING or type a prompt")
    req = GenerationRequest(
        prompt=[] if positive is not None else [inp.prompt], negative_prompt=inp.negative_prompt or "",
        positive=positive, negative=negative, batch_size=lat.batch, seed=int(inp.seed),
        steps=int(inp.steps), height=lat.height, width=lat.width, guidance=guidance,
        cfg=None if not inp.cfg else float(inp.cfg),
        max_sequence_length=int(inp.max_sequence_length), preview_every=int(inp.preview_every),
        frames=lat.frames, cfg_2=None if not inp.cfg_2 else float(inp.cfg_2),
        shift=None if not inp.shift else float(inp.shift),
        reference_latents=refs, reference_method=method,
        cache=None if inp.cache is None else inp.cache.as_request(), **start)
    kw = {"noise": None, "init_latent": None, "denoise": 1.0}
    if lat.batch_index is not None:
        kw["noise"] = comfy_noise(int(inp.seed), latent_shape(arch, lat.batch, lat.height,
                                                              lat.width, lat.frames),
                                  lat.batch_index)
    if not lat.empty:
        if not 0.0 < float(inp.denoise) <= 1.0:
            raise ConfigError(f"denoise must be in (0, 1] (got {inp.denoise})")
        kw["init_latent"] = lat.samples
        kw["denoise"] = float(inp.denoise)
    return req, kw


def _start_image(positive: Optional[dict], negative: Optional[dict],
                 cfg: Optional[float]) -> dict:
    """WanImageToVideo's start frame on the CONDITIONING -> the request's concat_latent /
    concat_mask / image_embeds (taken off the conditionings, which the request carries as
    text only). With CFG the negative must carry the same values (both branches get one
    start frame); without it, the negative is not used."""
    from comfyui_xdit.comfy_convert import START_IMAGE_KEYS
    if positive is None:
        return {}
    use_negative = negative is not None and (cfg is None or float(cfg) > 1.0)
    fields = start_image_fields(positive, negative if use_negative else None)
    for c in (positive, negative):
        if c is not None:
            for _, f in START_IMAGE_KEYS:
                c.pop(f, None)
    return fields


def _references(positive: Optional[dict], negative: Optional[dict], cfg: Optional[float]):
    """The positive CONDITIONING's reference images (ComfyUI's ReferenceLatent) -> the
    request's (list or None, method). The pool gives both CFG branches the positive's
    references (diffusers' FLUX.2 pipelines do the same), so with CFG on a negative with
    other references is refused rather than silently given the positive's. `cfg`: the
    resolved cfg (None: not known, checked as if CFG ran)."""
    import torch

    def of(c):
        return (c or {}).get("reference_latents"), (c or {}).get("reference_method")
    refs, method = of(positive)
    if negative is not None and (cfg is None or float(cfg) > 1.0):
        nrefs, nmethod = of(negative)
        same = (nrefs is None and refs is None) or (
            nrefs is not None and refs is not None and len(nrefs) == len(refs)
            and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(refs, nrefs))
            and nmethod == method)
        if not same and nrefs is not None:
            raise ConfigError("the negative CONDITIONING has other reference latents than the "
                              "positive; the xDiT sampler gives both branches the positive's "
                              "references: connect the same ReferenceLatent to both, or none "
                              "to the negative")
    for c in (positive, negative):  # the request carries them, not the conditioning
        if c is not None:
            c.pop("reference_latents", None)
            c.pop("reference_method", None)
    return (list(refs) if refs else None), method


def sample(handle: ModelHandle, inp: SampleInputs,
           on_event: Optional[Callable[[dict], None]] = None,
           is_interrupted: Optional[Callable[[], bool]] = None,
           registry: Optional[PoolRegistry] = None,
           on_launch: Optional[Callable[[str, int, int], None]] = None,
           free_memory: Optional[Callable[[int, int], None]] = None) -> dict:
    """Run one sampler node: returns the ComfyUI LATENT. `is_interrupted` is polled from a
    watcher thread, so a cancel lands within one step even between progress events.
    `on_launch(text, done, total)`: progress while the pool starts. `free_memory(bytes,
    cuda_index)`: ComfyUI's memory manager, asked for the room the job needs on each of
    the pool's GPUs (planning/room.py)."""
    registry = registry or REGISTRY
    t0 = time.perf_counter()
    registry.job_started()
    try:
        info = handle.info()
        req, kw = build_job(inp, info.arch, model_text_width(handle.path), info)
        req.loras = list(handle.loras)
        config = handle.config_for(req)
        if req.batch < config.dp:  # said in the graph's terms (the CLI says "prompts")
            raise ConfigError(f"the LATENT batch of {req.batch} is smaller than dp {config.dp}: "
                              f"set batch_size >= {config.dp} on the empty-latent node, or "
                              f"lower dp")
        # refused before the registry is touched: a bad job never replaces a warm pool
        config.validate(info, req)
        if handle.device == "cuda":
            gpus_for_ranks(config.ranks, handle.gpus)
        pool = registry.get(handle, config)
        if free_memory is not None:
            make_room(pool, req, free_memory)
        stop = threading.Event()
        watcher = None
        if is_interrupted is not None:
            def watch():
                while not stop.wait(0.1):
                    try:
                        if is_interrupted():
                            pool.cancel()
                    except Exception:
                        pass
            watcher = threading.Thread(target=watch, name="xdit-interrupt-watch", daemon=True)
            watcher.start()
        try:
            result = pool.generate(req, on_event=on_event,
                                   on_launch=registry.launch_callback(on_launch), **kw)
        finally:
            registry.launching = None
            stop.set()
            if watcher is not None:
                watcher.join(timeout=1.0)
    except Exception as e:
        registry.job_failed(e)
        raise
    job_args = (req.steps, config, result.timings.get("job_s") or 0.0,
                result.timings.get("launch_s") or 0.0,
                result.stats[0].get("cache") if result.stats else None)
    log.info("xDiT: sampled %s", job_text(*job_args, node=None))
    registry.last_job = {"config": config.describe(), "batch": req.batch, "steps": req.steps,
                         "height": req.height, "width": req.width,
                         "img2img": kw["init_latent"] is not None,
                         "seconds": round(time.perf_counter() - t0, 3),
                         "text": job_text(*job_args),
                         "timings": {k: (round(v, 3) if isinstance(v, float) else v)
                                     for k, v in result.timings.items()}}
    return latent_to_comfy(result.samples)


# ---- decoding ---------------------------------------------------------------------------
def _decode_size(info, samples):
    """A request of the LATENT's size (pixels, batch, frames): what the memory plan sizes a
    decode's room by."""
    d = latent_downscale(info.arch)
    spec = info.family.latent
    frames = 1
    if spec.video and samples.dim() == 5:
        frames = (int(samples.shape[2]) - 1) * spec.time_downscale + 1
    kw = {"frames": frames} if spec.video else {}
    return GenerationRequest(prompt=[""] * int(samples.shape[0]),
                             height=int(samples.shape[-2]) * d,
                             width=int(samples.shape[-1]) * d, **kw)


def _check_vae(vae, info) -> None:
    """A single file's LATENT decodes with the connected ComfyUI VAE only if that VAE's
    latent width is the family's (a FLUX.2 LATENT needs ComfyUI's 128-channel FLUX.2 VAE,
    which applies the batch-norm statistics itself)."""
    want = latent_channels(info.arch)
    lc = getattr(vae, "latent_channels", None)  # comfy.sd.VAE has it
    if lc is None or int(lc) == want:
        return
    raise ConfigError(f"a {family_name(info.arch)} single file's LATENT decodes with a VAE "
                      f"of {want}-channel latents (the model's own VAE, loaded with "
                      f"VAELoader); the connected VAE has {lc} latent channels")


def decode(handle: ModelHandle, latent: dict, vae=None,
           registry: Optional[PoolRegistry] = None,
           on_launch: Optional[Callable[[str, int, int], None]] = None,
           free_memory: Optional[Callable[[int, int], None]] = None):
    """The Decode node: LATENT -> IMAGE [B,H,W,3] in 0..1. A diffusers folder decodes on
    the model's pool (its VAE, patch-parallel over the ranks); a single file has no VAE, so
    the connected ComfyUI VAE decodes (its `decode(samples)`). `free_memory`: as for
    `sample`, asked for the room a job of the latent's size needs."""
    import torch

    from comfyui_xdit.planning.model_info import read_model_info
    registry = registry or REGISTRY
    registry.job_started()
    if not isinstance(latent, dict) or not torch.is_tensor(latent.get("samples")):
        raise ConfigError("LATENT input must be a dict with 'samples'; connect the xDiT "
                          "sampler's LATENT")
    samples = latent["samples"]
    info = handle.info()
    want = latent_shape(info.arch, 1, 16, 16)
    video = info.family.latent.video  # a video LATENT: its frames as an IMAGE batch
    if samples.dim() != len(want) or samples.shape[1] != want[1] or \
            (samples.dim() == 5 and samples.shape[2] != 1 and not video):
        hint = layout_hint(info.arch, samples)
        raise ConfigError(f"LATENT samples have shape {tuple(samples.shape)}; this "
                          f"{family_name(info.arch)} model's Decode takes latents "
                          f"{latent_shape_text(info.arch)} (the xDiT sampler's LATENT)"
                          + (f". {hint}" if hint else ""))
    t0, ranks, launched = time.perf_counter(), 0, False
    try:
        if info.has_vae:
            pool = registry.pool_for_decode(handle)
            ranks, launched = pool.config.ranks, not pool.is_running()
            if free_memory is not None:
                make_room(pool, _decode_size(info, samples), free_memory)
            try:
                images = pool.decode(samples.detach().float().cpu(),
                                     on_launch=registry.launch_callback(on_launch))
            finally:
                registry.launching = None
        elif vae is not None:
            _check_vae(vae, info)
            images = vae.decode(samples)
            if images.dim() == 5:  # video VAEs: frames into the batch, as VAEDecode does
                images = images.reshape(-1, *images.shape[-3:])
        else:
            raise ConfigError(f"model {os.path.basename(handle.path)!r} is a single file with "
                              f"no VAE: connect a VAE (VAELoader with the model's VAE) to the "
                              f"Decode node's vae input")
    except Exception as e:
        registry.job_failed(e)
        raise
    seconds = time.perf_counter() - t0
    registry.last_decode_text = decode_text(images, ranks, seconds, launched)
    log.info("xDiT: %s", decode_text(images, ranks, seconds, launched, node=None))
    return images
