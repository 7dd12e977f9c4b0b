"""A single transformer file read by its header alone (no torch): which family it is, its
naming and checkpoint prefix, the diffusers config its weight shapes give, and how it stores
its weights. The loaders read it to build the model (meta.py, single_file.py, comfy_lora.py);
model detection (workers/models/detect.py) and, through it, the host read it too.
"""
from __future__ import annotations

from pathlib import Path

from .. import families
from .header import ModelFileError, read_safetensors_header

CHECKPOINT_PREFIX = "model.diffusion_model."


# ---- single-file family and config ------------------------------------------------------
def transformer_keys(names) -> tuple[str, str, str]:
    """(family id, naming "bfl" | "diffusers", prefix) from a file's tensor names; raises the
    user-facing error for anything that is not a known transformer."""
    names = list(names)
    for prefix in (CHECKPOINT_PREFIX, ""):
        keys = {k[len(prefix):] for k in names if k.startswith(prefix)}
        found = families.detect_keys(keys) if keys else None
        if found is not None:
            return found[0].id, found[1], prefix
    raise ModelFileError(_not_dit_message(names))


def _not_dit_message(names) -> str:
    s = " ".join(names[:4000])
    looks = "an unknown model"
    if "input_blocks." in s or "down_blocks." in s:
        looks = "an SD1.x/SDXL-style UNet (input_blocks / down_blocks keys)"
    elif "encoder.down." in s or "decoder.up." in s or "decoder.up_blocks" in s:
        looks = "a VAE"
    elif "lora_" in s or ".lora." in s:
        looks = "a LoRA"
    elif "text_model." in s or "encoder.block." in s or "shared.weight" in s:
        looks = "a text encoder"
    elif "blocks." in s:
        looks = "another transformer architecture"
    return (f"this file is not a transformer of {families.names()}: it looks like {looks}. "
            f"Give one of those as a .safetensors transformer (ComfyUI's diffusion_models "
            f"file, optionally under {CHECKPOINT_PREFIX!r}) or a diffusers folder")


def single_file_config(path) -> dict:
    """{"arch", "naming", "prefix", "config"} of a single transformer file: `config` is the
    diffusers transformer config (constructor arguments) derived from the weight shapes."""
    p = Path(path)
    header = read_safetensors_header(p)
    arch, naming, prefix = transformer_keys(header)
    shapes = {k[len(prefix):]: v["shape"] for k, v in header.items() if k.startswith(prefix)}
    fam = families.family(arch)
    try:
        cfg = fam.detection.config_from_shapes(shapes, naming)
    except (KeyError, IndexError, ValueError) as e:
        detail = f"missing tensor {e}" if isinstance(e, KeyError) else str(e)
        raise ModelFileError(f"{str(p)!r} looks like a {fam.name} transformer but is "
                             f"incomplete or inconsistent ({detail}); give a complete "
                             f"{fam.name} transformer file") from None
    return {"arch": arch, "naming": naming, "prefix": prefix, "config": cfg,
            "storage": weight_storage(header, prefix)}


_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_DTYPE_NAMES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64"}


def weight_storage(header: dict, prefix: str = "") -> dict:
    """How a checkpoint stores its weights, from its header: {"dtype": the dtype holding the
    most bytes ("fp8" for float8, "q8_0" ... for a GGUF type), "fp8": any float8 tensor,
    "scaled": ComfyUI scaled-fp8 (per-layer `scale_weight` tensors, usually with a
    `scaled_fp8` marker key)}, plus "gguf_bytes_per_value" for a GGUF file's quantised
    tensors."""
    from .gguf_types import QUANTISED, TYPES
    by_dtype: dict = {}
    fp8 = scaled = False
    q_bytes = q_values = 0  # a GGUF file's quantised tensors
    for k, e in header.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if name == "scaled_fp8" or name.endswith(".scale_weight"):
            scaled = True
            continue
        start, end = (int(v) for v in e["data_offsets"])
        if e["dtype"] in QUANTISED:
            q_bytes += end - start
            q_values += (end - start) // TYPES[e["dtype"]][2] * TYPES[e["dtype"]][1]
        dt = "fp8" if e["dtype"] in _FP8_DTYPES else _DTYPE_NAMES.get(e["dtype"],
                                                                       e["dtype"].lower())
        fp8 = fp8 or dt == "fp8"
        by_dtype[dt] = by_dtype.get(dt, 0) + end - start
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
    out = {"dtype": dtype, "fp8": fp8, "scaled": scaled and fp8}
    if q_values:  # GGUF: bytes per quantised value, what the memory plan counts
        out["gguf_bytes_per_value"] = q_bytes / q_values
    return out


def folder_storage(folder) -> dict:
    """weight_storage of a diffusers component folder (all its safetensors shards)."""
    out = {"dtype": None, "fp8": False, "scaled": False}
    p = Path(folder)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    header: dict = {}
    for i, f in enumerate(files):
        header.update({f"{i}:{k}": v for k, v in read_safetensors_header(f).items()})
    return weight_storage(header) if header else out
