"""The loader node's output, without ComfyUI: `ModelHandle` describes a model and how it
runs (path, degrees, device, dtype, engine options); nothing starts until a job.
`loader_handle` turns the loader's inputs (widgets and the settings nodes' values) into a
validated handle, every problem in one error."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from comfyui_xdit.nodes.discovery import FILE_KINDS, resolve_model
from comfyui_xdit.nodes.node_text import loader_text
from comfyui_xdit.nodes.settings import (LORA_EXPERT_OPTIONS, NO_MODEL_2, SETTINGS_INPUTS,
                                         ExpertFile)
from comfyui_xdit.planning import launch_policy
from comfyui_xdit.planning.config import ConfigError, EngineOptions, ParallelConfig, auto_config
from comfyui_xdit.planning.gpus import gpus_for_ranks, visible_gpus
from comfyui_xdit.planning.model_info import read_model_info
from comfyui_xdit.planning.request import GenerationRequest, families


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


@dataclass(frozen=True)
class ModelHandle:
    """Output of the loader node: a description only; the pool starts at sampling."""

    path: str
    device: str = "cpu"
    dtype: str = "fp32"
    world_size: Optional[int] = None  # None: "auto"
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool | int = False  # ParallelConfig's: True degree 2, an int the degree
    dp: int = 1
    gpus: Optional[tuple] = None
    split: str = "even"  # work per rank: even | auto | weights "3,2" (exact whatever it is)
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
    shard_split: str = "even"  # each rank's share of the sharded weights: even | memory | 3,2
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
        return (self.ulysses > 1 or self.ring > 1 or self.explicit_config().cfg > 1
                or self.dp > 1 or self.pipefusion > 1)

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
                              pipefusion_split=self.pipefusion_split, world_size=self.world_size,
                              split=self.split)

    def config_for(self, request: Optional[GenerationRequest] = None) -> ParallelConfig:
        """Degrees given: exactly those (the world size must match their product). All
        degrees 1: an automatic split of the world size ('auto': every GPU, 2 CPU ranks)."""
        if self.degrees_given:
            return self.explicit_config()
        world = self.world_size or self.default_world()
        info = self.info()
        uses_cfg = request.uses_cfg(info) if request is not None else False
        batch = request.batch if request is not None else 1
        import dataclasses
        return dataclasses.replace(auto_config(world, info.heads, uses_cfg, batch),
                                   world_size=world, split=self.split)

    def engine(self) -> EngineOptions:
        return EngineOptions(device=self.device, dtype=self.dtype, attention=self.attention,
                             compile=self.compile, weights=self.weights,
                             text_encoders=self.text_encoders,
                             shard_weights=self.shard_weights, shard_split=self.shard_split)

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
            mode = launch_policy.resolve_mode(self.memory_plan)
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
                plan = launch_policy.check_launch(  # and its weights: refused with the numbers
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
                cfg_degree: int = 2,
                split: str = "even", threads_per_rank: Optional[int] = None, pipefusion: int = 1,
                warmup_steps: int = 1, pipeline_patches: int = 0,
                pipefusion_split: str = "balanced", attention: str = "auto",
                compile: bool = False, weights: str = "auto", text_encoders: str = "auto",
                shard_weights: bool = False, shard_split: str = "even",
                memory_plan: str = "auto", has_cuda: Optional[bool] = None, model_path_2: Optional[str] = None) -> ModelHandle:
    """The loader's widgets -> a handle. `pipeline_patches` 0 means "the PipeFusion degree";
    `cfg_degree`: cfg-parallel's degree while `cfg_parallel` is on (2: cond / uncond);
    device/dtype 'auto' are resolved here (`has_cuda`: whether this ComfyUI has CUDA)."""
    ws = None if str(world_size).strip().lower() in ("auto", "", "0") else int(world_size)
    gpu_list = tuple(g.strip() for g in str(gpus or "").split(",") if g.strip()) or None
    device = resolve_device(device, has_cuda)
    dtype = resolve_dtype(dtype, device)
    return ModelHandle(path=str(Path(model_path).resolve()), device=device, dtype=dtype,
                       world_size=ws, ulysses=int(ulysses), ring=int(ring),
                       cfg_parallel=_cfg_degree(cfg_parallel, cfg_degree), dp=int(dp),
                       gpus=gpu_list,
                       split=str(split or "").strip() or "even",
                       threads_per_rank=threads_per_rank, pipefusion=int(pipefusion),
                       warmup_steps=int(warmup_steps),
                       pipeline_patches=int(pipeline_patches) or None,
                       pipefusion_split=str(pipefusion_split).strip() or "balanced",
                       attention=str(attention), compile=bool(compile),
                       weights=str(weights), text_encoders=str(text_encoders),
                       shard_weights=bool(shard_weights),
                       shard_split=str(shard_split or "").strip() or "even",
                       memory_plan=str(memory_plan).strip().lower() or "auto",
                       path_2=None if not model_path_2 else str(Path(model_path_2).resolve()))


def _cfg_degree(on, degree) -> bool | int:
    """The switch and its degree -> ParallelConfig's cfg_parallel: off False, degree 2 True
    (as before the degree existed), another degree that int."""
    if not on:
        return False
    degree = 2 if degree is None else int(degree)
    return True if degree == 2 else degree


LOADER_DEFAULTS = dict(device="auto", dtype="auto", world_size="auto", ulysses=1, ring=1,
                       cfg_parallel=False, cfg_degree=2, dp=1, gpus="", split="even", pipefusion=1,
                       warmup_steps=1,
                       pipeline_patches=0, pipefusion_split="balanced", attention="auto",
                       compile=False, weights="auto", text_encoders="auto",
                       shard_weights=False, shard_split="even", memory_plan="auto")


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
    if info.family.capability(families.TwoExperts) is None:
        raise ConfigError(f"low_noise_model: model {name!r} is a {info.family.name} model, "
                          f"which has no experts (only Wan 2.2 A14B's high-noise file takes a "
                          f"low-noise one): set low_noise_model to none")
    path_2 = resolve_model(name_2, [], roots_by_kind)
    from comfyui_xdit.planning.model_info import read_pair
    read_pair(path, path_2, names=("model", "low_noise_model"))  # the pair, in the node's words
    return path_2
