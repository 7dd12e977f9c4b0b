"""Which GPUs the pool may use: the one place GPU visibility is decided and a world size
checked against it, on the host, before any worker process starts.

- `visible_gpus()`: the GPUs of this process, as ids a child can be given in its
  `CUDA_VISIBLE_DEVICES`. `CUDA_VISIBLE_DEVICES` unset: every GPU torch reports (`"0"`..);
  set but empty (or starting with a negative index, CUDA's "none"): no GPU; a comma list:
  its entries as given (indices, `GPU-<uuid>`, `MIG-<uuid>`), up to the first negative index
  (CUDA ignores what follows one).
- `gpus_for_ranks(world, explicit)`: one GPU id per rank, from the loader's GPU list when
  given, else the visible GPUs in order; a world size they cannot hold raises one
  ConfigError naming both, e.g. `4 ranks need 4 GPUs; 2 are visible (CUDA_VISIBLE_DEVICES=0,1)`.
- `text_encoder_gpu(option, gpus)`: where `text_encoders=cuda:N` puts rank 0's text encoders
  (the N-th visible GPU: rank 0's own, another rank's, or a spare one) and what rank 0 is
  then given: that GPU too in its `CUDA_VISIBLE_DEVICES`, as its `cuda:1`.
- `gpu_memory_bytes(ids)`: each GPU's total memory, from nvidia-smi, for the memory plan.

The loader's list is in this process's numbering (what ComfyUI calls `cuda:N`): an index N
names the N-th visible GPU, so under `CUDA_VISIBLE_DEVICES=2,3` the list "1" is physical GPU
3. UUID / MIG entries are passed through as given. An entry may repeat (ranks sharing a GPU,
which only gloo allows; see tests/test_gpu_shared.py).

Counting GPUs never initialises CUDA in this process: with `CUDA_VISIBLE_DEVICES` set the
list is read from it alone, and otherwise `torch.cuda.device_count()` asks NVML (which does
not poison later forks) and only falls back to the CUDA runtime where NVML is missing. The
count is `device_count` of this module, and the sizes `gpu_memory_bytes`, both replaced in
tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from comfyui_xdit.errors import ConfigError

ENV = "CUDA_VISIBLE_DEVICES"


def device_count() -> int:
    """GPUs torch reports for this process (NVML-based where available: no CUDA init)."""
    try:
        import torch
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def _env(environ) -> Optional[str]:
    return (os.environ if environ is None else environ).get(ENV)


def parse_visible(value: str) -> list[str]:
    """A `CUDA_VISIBLE_DEVICES` value -> its GPU ids, as CUDA reads it: entries stripped,
    blanks dropped, the list ends at the first negative index ("-1": no GPU)."""
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            if int(entry) < 0:
                break
        except ValueError:
            pass  # GPU-<uuid>, MIG-<uuid>, ...
        out.append(entry)
    return out


def visible_gpus(environ=None, count: Optional[Callable[[], int]] = None) -> list[str]:
    """The GPUs this process sees, as ids for a child's `CUDA_VISIBLE_DEVICES`."""
    value = _env(environ)
    if value is not None:
        return parse_visible(value)
    n = (count or device_count)()
    return [str(i) for i in range(max(0, int(n)))]


def describe_visible(environ=None) -> str:
    """Where the visible set comes from, for messages: "(CUDA_VISIBLE_DEVICES=0,1)"."""
    value = _env(environ)
    if value is None:
        return "(CUDA_VISIBLE_DEVICES unset: every GPU torch reports)"
    if not value.strip():
        return "(CUDA_VISIBLE_DEVICES is empty)"
    return f"({ENV}={value})"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def gpus_for_ranks(world: int, explicit: Optional[Sequence] = None, environ=None,
                   count: Optional[Callable[[], int]] = None) -> list[str]:
    """One GPU id per rank (for each rank's own `CUDA_VISIBLE_DEVICES`), or one ConfigError
    line naming the world size and the GPUs there are."""
    need = f"{_plural(world, 'rank needs', 'ranks need')} {_plural(world, 'GPU', 'GPUs')}"
    if isinstance(explicit, str):
        explicit = explicit.split(",")
    if explicit:
        given = [str(g).strip() for g in explicit if str(g).strip()]
        listed = ",".join(given)
        if len(given) < world:
            raise ConfigError(f"{need}; the GPU list has {len(given)} (gpus={listed}): list "
                              f"{world} GPU ids or lower the world size to {len(given)}")
        given = given[:world]
        if not any(g.lstrip("-").isdigit() for g in given):
            return given
        visible = visible_gpus(environ, count)
        out = []
        for g in given:
            if not g.lstrip("-").isdigit():
                out.append(g)  # a UUID / MIG id names its GPU itself
                continue
            i = int(g)
            if not 0 <= i < len(visible):
                right = (f"use indices 0..{len(visible) - 1}" if visible else
                         "make GPUs visible or use device cpu")
                raise ConfigError(f"GPU {g} of the GPU list (gpus={listed}) is not visible: "
                                  f"{_visible_phrase(visible)} {describe_visible(environ)}; "
                                  f"{right}")
            out.append(visible[i])
        return out
    visible = visible_gpus(environ, count)
    if len(visible) < world:
        hint = (f"lower the world size to {len(visible)} or make more GPUs visible" if visible
                else "make GPUs visible or use device cpu")
        raise ConfigError(f"{need}; {_visible_phrase(visible)} {describe_visible(environ)}: "
                          f"{hint}")
    return visible[:world]


def _visible_phrase(visible: list) -> str:
    if not visible:
        return "no GPU is visible"
    return f"{len(visible)} {'is' if len(visible) == 1 else 'are'} visible"


@dataclass(frozen=True)
class TextEncoderGPU:
    """Where `text_encoders=cuda:N` runs rank 0's text encoders. `gpu`: the GPU's id;
    `rank`: the rank whose GPU it is (None: a GPU no rank uses); `rank0_visible`: rank 0's
    `CUDA_VISIBLE_DEVICES`; `worker_option`: rank 0's `--text-encoders` (its own GPU:
    "gpu"; another one: "cuda:1", the second GPU it sees)."""
    gpu: str
    rank: Optional[int]
    rank0_visible: str
    worker_option: str


def text_encoder_gpu(option: str, gpus: Sequence[str], environ=None,
                     count: Optional[Callable[[], int]] = None) -> Optional[TextEncoderGPU]:
    """The placement of `text_encoders=cuda:N` for ranks on `gpus` (gpus_for_ranks), N in
    this process's numbering like the GPU list; None for any other option. A GPU that is not
    visible raises one ConfigError. (Each worker sees only its own GPU, so rank 0 is given
    the text encoders' GPU as a second one.)"""
    option = str(option)
    if not option.startswith("cuda:") or not gpus:
        return None
    n = int(option[5:])
    visible = visible_gpus(environ, count)
    if not 0 <= n < len(visible):
        right = f"cuda:0..cuda:{len(visible) - 1}, " if visible else ""
        raise ConfigError(f"text_encoders {option}: {_visible_phrase(visible)} "
                          f"{describe_visible(environ)}; use {right}gpu, auto or cpu")
    gpu = visible[n]
    rank = list(gpus).index(gpu) if gpu in gpus else None
    if gpu == gpus[0]:
        return TextEncoderGPU(gpu, 0, gpus[0], "gpu")
    return TextEncoderGPU(gpu, rank, f"{gpus[0]},{gpu}", "cuda:1")


_SMI: dict = {}  # value of CUDA_VISIBLE_DEVICES -> nvidia-smi's answer (`_smi`)


def _smi(environ=None) -> dict:
    """{index or UUID: (total bytes, model name)} of every GPU nvidia-smi lists ({} when it
    cannot answer). Asked once per process for each value of CUDA_VISIBLE_DEVICES, the
    answer (an empty one too) kept: a GPU's size and name do not change while the process
    runs, and a changed value is the sign that its GPUs did (nvidia-smi itself lists every
    GPU of the box whatever the variable says), so a new value asks again."""
    env = os.environ if environ is None else environ
    key = env.get(ENV)
    if key not in _SMI:
        _SMI[key] = _query_smi()
    return _SMI[key]


def _query_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        text = subprocess.run([exe, "--query-gpu=index,uuid,memory.total,name",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in text.splitlines():
        parts = [v.strip() for v in line.split(",", 3)]
        if len(parts) == 4 and parts[2].isdigit():
            out[parts[0]] = out[parts[1]] = (int(parts[2]) * 2 ** 20, parts[3])  # MiB
    return out


def _smi_sizes() -> dict:
    """{index or UUID: total bytes} of every GPU nvidia-smi lists ({} when it cannot)."""
    return {k: size for k, (size, _) in _smi().items()}


def gpu_memory_bytes(gpu_ids: Sequence[str], environ=None) -> list:
    """Total memory of each GPU id (an index or a GPU-/MIG- UUID, as `gpus_for_ranks` hands
    them to the ranks), from nvidia-smi (NVML: no CUDA initialisation in this
    process), or None where it is not known (a MIG slice, no nvidia-smi). nvidia-smi numbers
    GPUs in PCI bus order, CUDA fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`: on a box
    mixing GPU sizes an index is then ambiguous, and the smallest card's size is used (a UUID
    in the loader's GPU list is exact). Replaced in tests."""
    sizes = _smi_sizes()
    env = os.environ if environ is None else environ
    by_index = [v for k, v in sizes.items() if k.isdigit()]
    ambiguous = env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(set(by_index)) > 1
    out = []
    for g in gpu_ids:
        g = str(g).strip()
        out.append(min(by_index) if ambiguous and g in sizes and g.isdigit() else sizes.get(g))
    return out


def gpu_names(gpu_ids: Sequence[str]) -> list:
    """Each GPU id's model name from nvidia-smi ("NVIDIA H100 80GB HBM3"), as the workers
    report it once running; None where it is not known. `split=auto` reads its cache by
    these names before a launch (PipeFusion's stages are chosen then)."""
    if not gpu_ids:
        return []
    names = _smi()
    return [names[str(g).strip()][1] if str(g).strip() in names else None for g in gpu_ids]
