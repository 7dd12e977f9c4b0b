"""What a CUDA launch does with its memory plan, before any worker starts.

`plan_launch` plans the launch against the GPUs' total memory (gpus.gpu_memory_bytes) and
lists each reason it would not fit. The plan's activation estimate and reserve have not been
measured on a GPU yet, so `check_launch` refuses a predicted misfit by default (mode
"enforce") and lets the user overrule it (mode "advise": warn and launch; `resolve_mode`).
A plan that cannot be made at all raises PlanUnavailable: "enforce" refuses such a launch,
"advise" launches with an `UnplannedLaunch` saying why there is no plan.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from comfyui_xdit.errors import ConfigError
from comfyui_xdit.planning import gpus as gpus_mod
from comfyui_xdit.planning.config import EngineOptions, ParallelConfig
from comfyui_xdit.planning.memory_arithmetic import (GiB, TEXT_ENCODER_MARGIN, JobSize,
                                                     MemoryPlan, plan, text_encoder_bytes)
from comfyui_xdit.planning.model_facts import model_facts

_log = logging.getLogger("comfyui_xdit")
MODE_ENV = "XDIT_MEMORY_PLAN"
MODES = ("enforce", "advise")  # refuse a predicted misfit | warn and launch anyway
OVERRIDE_HINT = ("To launch anyway (the plan is an estimate), set memory_plan to advise on "
                 "the loader, pass WorkerPool(..., memory_plan=\"advise\") or set "
                 f"{MODE_ENV}=advise.")


def resolve_mode(value=None, environ=None) -> str:
    """The memory plan's mode: "enforce" (refuse a predicted misfit) or "advise" (warn and
    launch); None or "auto": $XDIT_MEMORY_PLAN, else "enforce". Anything else is one
    ConfigError listing the allowed values: a typo must neither skip nor silently keep the
    check."""
    if value is None or str(value).strip().lower() in ("", "auto"):
        raw = (os.environ if environ is None else environ).get(MODE_ENV, "")
        v = raw.strip().lower()
        if v in ("", "auto"):
            return "enforce"
        if v in MODES:
            return v
        raise ConfigError(f"{MODE_ENV}={raw!r} is not a memory plan mode; set it to enforce "
                          f"(refuse a layout the plan says will not fit; the default) or "
                          f"advise (warn and launch anyway)")
    v = str(value).strip().lower()
    if v not in MODES:
        raise ConfigError(f"memory_plan must be enforce, advise or auto (${MODE_ENV}, "
                          f"default enforce); got {value!r}")
    return v


def _job_size(request, model_path: str) -> JobSize:
    from comfyui_xdit.planning.model_info import read_model_info

    info = read_model_info(model_path)
    return JobSize(height=int(request.height), width=int(request.width),
                   batch=max(1, int(request.batch)),
                   text_tokens=int(request.max_sequence_length),
                   reference_tokens=int(request.reference_tokens(info)),
                   frames=int(getattr(request, "frames", 1) or 1),
                   # the default cfg may depend on the model (FLUX.2 base vs distilled)
                   cfg=bool(request.uses_cfg(info)))


def plan_launch(model_path: str, config: ParallelConfig, engine: EngineOptions, gpus,
                request=None, model_path_2=None) -> Optional[MemoryPlan]:
    """The plan of a CUDA launch against the GPUs' total memory, with `misfits` filled, and
    no verdict acted on (check_launch does; the pool also re-plans quietly to compare with
    a measured peak). `gpus`: the ranks' GPU ids (gpus.gpus_for_ranks). Without a request (a
    launch to decode, or for host-sampler calls) only the fixed parts are planned: what any
    job adds comes on top. None on CPU, or when no GPU's memory can be read."""
    if engine.device != "cuda" or not gpus:
        return None
    caps = gpus_mod.gpu_memory_bytes(list(gpus))
    if all(c is None for c in caps):
        return None
    # ranks sharing a GPU share its memory: give each of them its share
    share = {g: list(gpus).count(g) for g in gpus}
    caps = [None if c is None else c // share[g] for c, g in zip(caps, gpus)]
    try:
        facts = model_facts(model_path, engine.dtype)
        if model_path_2:  # a Wan 2.2 A14B pair of files: two experts of the first's config
            facts = dataclasses.replace(facts, experts=2)
        job = None if request is None else _job_size(request, model_path)
        te_gpu = gpus_mod.text_encoder_gpu(engine.text_encoders, list(gpus))
        te_rank = {} if te_gpu is None else {"text_encoder_rank": te_gpu.rank}
        p = plan(facts, config.with_world_size(None), engine, job, caps, **te_rank)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  check_launch decides by the mode
        raise PlanUnavailable(f"{type(e).__name__}: {e}") from e
    misfits = [p.message()] if p.fits is False else []
    if te_gpu is not None and te_gpu.rank is None:  # a GPU of their own: they alone on it
        need = text_encoder_bytes(facts, engine.dtype) + TEXT_ENCODER_MARGIN
        cap = gpus_mod.gpu_memory_bytes([te_gpu.gpu])[0]
        if cap is not None and need > cap:
            misfits.append(f"The text encoders need {need / GiB:.1f} GiB with the margin "
                           f"({engine.dtype}); GPU {te_gpu.gpu} (text_encoders="
                           f"{engine.text_encoders}) has {cap / GiB:.1f} GiB: use a larger "
                           f"GPU, or text_encoders=cpu.")
    return dataclasses.replace(p, misfits=tuple(misfits))


class PlanUnavailable(Exception):
    """The memory plan could not be made (an error while planning, not a misfit)."""


@dataclasses.dataclass(frozen=True)
class UnplannedLaunch:
    """What check_launch returns under "advise" when no plan could be made: the launch goes
    ahead and every place that shows the plan says why there is none."""

    error: str
    ranks: tuple = ()
    job: Optional[JobSize] = None

    @property
    def misfits(self) -> tuple:
        return (f"The memory plan could not be made ({self.error}).",)

    fits = None

    def summary(self) -> str:
        return f"memory plan could not be made ({self.error})"


def check_launch(model_path: str, config: ParallelConfig, engine: EngineOptions, gpus,
                 request=None, mode: Optional[str] = None,
                 model_path_2=None):
    """Before a CUDA pool launches: `plan_launch`, and under mode "enforce" (`resolve_mode`;
    None: the environment's) one ConfigError with the numbers and how to overrule it when a
    rank cannot fit, or when no plan could be made (a launch is never made blind). Under
    "advise" the plan comes back with its `misfits` for the caller to warn, or an
    `UnplannedLaunch` saying why there is no plan."""
    mode = resolve_mode(mode)
    try:
        p = plan_launch(model_path, config, engine, gpus, request, model_path_2)
    except PlanUnavailable as e:
        if mode == "enforce":
            raise ConfigError(f"The memory plan for {model_path} could not be made ({e}), so "
                              f"the launch is refused rather than made unchecked. "
                              f"{OVERRIDE_HINT}") from e
        return UnplannedLaunch(str(e))
    if p is not None and p.misfits and mode == "enforce":
        raise ConfigError(" ".join(p.misfits + (OVERRIDE_HINT,)))
    return p


def check_pool(pool, request=None, gpus=None) -> Optional[MemoryPlan]:
    """WorkerPool's hook before a launch (CUDA pools it starts itself; attached pools are
    someone else's): `check_launch` on the pool's model, layout, engine, rank GPUs and mode;
    a misfit it launches anyway is logged as a warning with the prediction."""
    if pool.device != "cuda" or getattr(pool, "_attached", None):
        return None
    if gpus is None:
        gpus = gpus_mod.gpus_for_ranks(pool.config.ranks, pool.gpus)
    mode = getattr(pool, "memory_plan", None)
    p = check_launch(pool.model_path, pool.config, pool.engine, gpus, request, mode,
                     getattr(pool, "model_path_2", None))
    if isinstance(p, UnplannedLaunch):
        _log.warning("xDiT: memory_plan=advise, launching without a memory plan: %s",
                     p.summary())
    elif p is not None and p.misfits:
        _log.warning("xDiT: memory_plan=advise, launching although the memory plan predicts "
                     "it will not fit: %s", " ".join(p.misfits))
    return p
