"""What the host needs to know about a model, read without torch.

The detection itself (diffusers folder or single `.safetensors` transformer file -> FLUX.1 /
SD3 and the diffusers transformer config) lives with the workers, which build models from
it: workers/models/detect.py, with the model facts (class <-> architecture, RoPE axes) in
workers/models/facts.py. This module turns its errors into ConfigError and its result into
a `ModelInfo`; the names below are re-exported so host code and tests keep one import.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from comfyui_xdit.errors import ConfigError
from comfyui_xdit.client.worker_modules import worker_module

_detect = worker_module("models.detect")
_facts = worker_module("models.facts")
_messages = worker_module("messages")

ARCH_BY_CLASS = _facts.ARCH_BY_CLASS
CLASS_BY_ARCH = _facts.CLASS_BY_ARCH
FLUX_ROPE_AXES_128 = _facts.FLUX_ROPE_AXES_128
flux_rope_axes = _facts.flux_rope_axes
CHECKPOINT_PREFIX = _detect.CHECKPOINT_PREFIX
SD3_HEAD_DIM = _detect.SD3_HEAD_DIM
SINGLE_FILE_SUFFIXES = _detect.SINGLE_FILE_SUFFIXES
NO_TEXT_ENCODERS = _messages.NO_TEXT_ENCODERS
NO_VAE = _messages.NO_VAE


def _config_errors(fn):
    """`fn` of the detection module, raising ConfigError (same one-line message)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _detect.ModelFileError as e:
            raise ConfigError(str(e)) from None
    return wrapped


read_safetensors_header = _config_errors(_detect.read_safetensors_header)
transformer_keys = _config_errors(_detect.transformer_keys)
single_file_config = _config_errors(_detect.single_file_config)
_describe_model = _config_errors(_detect.describe_model)


@dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str  # "flux" | "sd3" | "flux2"
    heads: int
    patch_size: int
    kind: str = "diffusers"  # "diffusers" (folder) | "file" (single .safetensors)
    has_text_encoders: bool = True  # a single file has none: CONDITIONING must be given
    has_vae: bool = True  # the pool decodes images with the folder's VAE only
    blocks: Optional[int] = None  # transformer blocks (FLUX: double + single), for PipeFusion
    # how the checkpoint stores its weights: "bf16" | "fp16" | "fp32" | "fp8" | "scaled-fp8"
    # (an fp8 file stays fp8 on the GPU under weights="auto": EngineOptions)
    storage: Optional[str] = None
    # FLUX.2 [klein] folders: model_index.json's `is_distilled` (absent: False, the
    # pipeline's own default). A step-distilled model runs without CFG by default, a base
    # model with it. None where the model does not say (other pipelines, single files).
    distilled: Optional[bool] = None


def _storage_name(storage) -> Optional[str]:
    if not storage:
        return None
    if storage.get("fp8"):
        return "scaled-fp8" if storage.get("scaled") else "fp8"
    return storage.get("dtype")


def _block_count(arch: str, cfg: dict) -> Optional[int]:
    try:
        n = int(cfg["num_layers"])
        return n + int(cfg.get("num_single_layers", 0)) if arch in ("flux", "flux2") else n
    except (KeyError, TypeError, ValueError):
        return None


def _klein_distilled(folder: Path) -> Optional[bool]:
    """`is_distilled` of a Flux2KleinPipeline folder (False when the key is absent, as the
    pipeline reads it); None for any other pipeline or an unreadable model_index.json."""
    import json

    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("_class_name") != "Flux2KleinPipeline":
        return None
    value = index.get("is_distilled", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{folder / 'model_index.json'}: is_distilled is {value!r}; "
                          f"expected true or false")
    return value


def is_single_file(path) -> bool:
    return os.path.isfile(str(path))


def read_model_info(path) -> ModelInfo:
    """Detect FLUX vs SD3 from a diffusers folder or a single .safetensors file; one clear
    ConfigError for anything else (missing, another architecture, corrupt)."""
    path = Path(path)
    d = _describe_model(path)
    arch, cfg = d["arch"], d["config"]
    if d["kind"] == "file":
        return ModelInfo(path=str(path), arch=arch, heads=int(cfg["num_attention_heads"]),
                         patch_size=int(cfg["patch_size"]), kind="file",
                         has_text_encoders=False, has_vae=False,
                         blocks=_block_count(arch, cfg),
                         storage=_storage_name(d.get("storage")))
    # a folder's config omits what equals the diffusers class default
    return ModelInfo(path=str(path), arch=arch, heads=int(cfg.get("num_attention_heads", 24)),
                     patch_size=int(cfg.get("patch_size", 2 if arch == "sd3" else 1)),
                     blocks=_block_count(arch, cfg), storage=_storage_name(d.get("storage")),
                     distilled=_klein_distilled(path) if arch == "flux2" else None)


# diffusers' class defaults for what a folder's config.json may omit (tests check them)
FLUX_CONFIG_DEFAULTS = {
    "flux": {"guidance_embeds": False, "num_attention_heads": 24, "attention_head_dim": 128,
             "joint_attention_dim": 4096},
    "flux2": {"guidance_embeds": True, "num_attention_heads": 48, "attention_head_dim": 128,
              "joint_attention_dim": 15360},
}


def comfy_unet_config(path) -> dict:
    """What ComfyUI's model detection would find in this model's transformer, for the xDiT
    MODEL's ComfyUI model config (comfyui_xdit/nodes/comfy_model.py): FLUX.1 dev vs schnell
    (`guidance_embed`), and for FLUX.2 the 128-channel patch-1 layout and the hidden size its
    config class needs. From a folder's config.json or a single file's header."""
    d = _describe_model(Path(path))
    arch, cfg = d["arch"], dict(d["config"])
    if arch == "sd3":
        return {"image_model": "sd3"}
    cfg = {**FLUX_CONFIG_DEFAULTS[arch], **cfg}
    out = {"image_model": arch, "guidance_embed": bool(cfg["guidance_embeds"])}
    if arch == "flux":
        return dict(out, in_channels=16, out_channels=16, patch_size=2)
    return dict(out, in_channels=128, out_channels=128, patch_size=1,
                hidden_size=int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"]),
                context_in_dim=int(cfg["joint_attention_dim"]))
