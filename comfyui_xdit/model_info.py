"""What the host needs to know about a model, read without torch.

Two kinds of model:

- a diffusers folder (model_index.json, transformer/config.json, vae/, text encoders): read
  from its JSON;
- a single `.safetensors` file holding a FLUX.1 or SD3/3.5 transformer, as ComfyUI users keep
  them in `models/diffusion_models` (legacy `unet`) or, inside a full checkpoint, in
  `models/checkpoints`. Only the file's JSON header is read (8-byte little-endian length, then
  a JSON table of tensor names, dtypes, shapes and byte ranges): the architecture and the
  diffusers config are derived from the key names and weight shapes (`single_file_config`,
  which the workers reuse to build the transformer).

Key namings accepted in a file: BFL / ComfyUI (FLUX `double_blocks.N.*`, `single_blocks.N.*`,
`img_in`, ...; SD3 `joint_blocks.N.*`, `x_embedder`, `pos_embed`, ...), optionally under
`model.diffusion_model.` (full checkpoints add the VAE and text encoders under other
prefixes, which are ignored), and diffusers naming (`transformer_blocks.N.*`, ...).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .config import ConfigError

# diffusers transformer class -> architecture (the one place this map is written)
ARCH_BY_CLASS = {
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
}
CLASS_BY_ARCH = {v: k for k, v in ARCH_BY_CLASS.items()}
_ARCH_BY_CLASS = ARCH_BY_CLASS  # old name

CHECKPOINT_PREFIX = "model.diffusion_model."
# SD3 has no stored head dim without qk-norm; every SD3/3.5 release uses 64 (hidden = 64 x depth)
SD3_HEAD_DIM = 64
# FLUX.1's RoPE axes (not stored in the file) for its head dim of 128
FLUX_ROPE_AXES_128 = (16, 56, 56)
SINGLE_FILE_SUFFIXES = (".safetensors", ".sft")
from .worker_modules import worker_module  # noqa: E402

NO_TEXT_ENCODERS = worker_module("messages").NO_TEXT_ENCODERS
NO_VAE = worker_module("messages").NO_VAE


@dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str  # "flux" | "sd3"
    heads: int
    patch_size: int
    kind: str = "diffusers"  # "diffusers" (folder) | "file" (single .safetensors)
    has_text_encoders: bool = True  # a single file has none: CONDITIONING must be given
    has_vae: bool = True  # the pool decodes images with the folder's VAE only
    blocks: Optional[int] = None  # transformer blocks (FLUX: double + single), for PipeFusion


def _block_count(arch: str, cfg: dict) -> Optional[int]:
    try:
        n = int(cfg["num_layers"])
        return n + int(cfg.get("num_single_layers", 0)) if arch == "flux" else n
    except (KeyError, TypeError, ValueError):
        return None


def is_single_file(path) -> bool:
    return os.path.isfile(str(path))


def read_model_info(path) -> ModelInfo:
    """Detect FLUX vs SD3 from a diffusers folder or a single .safetensors file; one clear
    ConfigError for anything else (missing, another architecture, corrupt)."""
    p = Path(path)
    if p.is_file():
        sf = single_file_config(p)
        cfg = sf["config"]
        return ModelInfo(path=str(p), arch=sf["arch"], heads=int(cfg["num_attention_heads"]),
                         patch_size=int(cfg["patch_size"]), kind="file",
                         has_text_encoders=False, has_vae=False,
                         blocks=_block_count(sf["arch"], cfg))
    cfg_file = p / "transformer" / "config.json"
    if not p.exists():
        raise ConfigError(f"model {str(p)!r} does not exist; give a FLUX/SD3 diffusers folder "
                          f"or a single .safetensors transformer file")
    if not p.is_dir():
        raise ConfigError(f"model {str(p)!r} is neither a directory nor a file; give a "
                          f"diffusers model folder or a .safetensors file")
    if not cfg_file.is_file():
        raise ConfigError(f"model folder {str(p)!r} has no transformer/config.json; "
                          f"give a FLUX or SD3 diffusers folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {cfg_file}: {e}") from None
    cls = cfg.get("_class_name")
    arch = ARCH_BY_CLASS.get(cls)
    if arch is None:
        raise ConfigError(f"model {str(p)!r} has a {cls!r} transformer; supported: "
                          f"{', '.join(sorted(ARCH_BY_CLASS))} (FLUX.1, SD3/3.5)")
    return ModelInfo(path=str(p), arch=arch, heads=int(cfg.get("num_attention_heads", 24)),
                     patch_size=int(cfg.get("patch_size", 2 if arch == "sd3" else 1)),
                     blocks=_block_count(arch, cfg))


# ---- safetensors header -----------------------------------------------------------------
_MAX_HEADER = 100 * 2 ** 20  # the format's own limit


def read_safetensors_header(path) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} of a .safetensors file (metadata under
    "__metadata__" dropped). A file that is not safetensors, or is truncated, raises one
    ConfigError naming the file."""
    p = Path(path)
    bad = f"{str(p)!r} is not a valid .safetensors file"
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{bad} (only {size} bytes); re-download or re-save it")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > _MAX_HEADER or 8 + n > size:
                raise ConfigError(f"{bad} (header length {n} does not fit the {size}-byte "
                                  f"file: corrupt or truncated); re-download or re-save it")
            raw = f.read(n)
    except OSError as e:
        raise ConfigError(f"cannot read model file {str(p)!r}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{bad} (header unreadable: {e}); re-download or re-save it") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, t in header.items():
        try:
            start, end = (int(v) for v in t["data_offsets"])
            [int(v) for v in t["shape"]]  # well-formed entries only
            str(t["dtype"])
        except (TypeError, KeyError, ValueError):
            raise ConfigError(f"{bad} (entry {name!r} malformed); re-download or re-save it") \
                from None
        if end > data or start > end:
            raise ConfigError(f"{bad}: tensor {name!r} ends at byte {end} but the file has "
                              f"{data} data bytes (truncated download?); re-download it")
    if not header:
        raise ConfigError(f"{str(p)!r} holds no tensors; give a FLUX/SD3 transformer file")
    return header


# ---- single-file architecture and config --------------------------------------------------
_FLUX_BFL = "double_blocks.0.img_attn.qkv.weight"
_SD3_BFL = "joint_blocks.0.x_block.attn.qkv.weight"
_FLUX_DIFFUSERS = "single_transformer_blocks.0.attn.to_q.weight"
_SD3_DIFFUSERS = "pos_embed.proj.weight"


def transformer_keys(names) -> tuple[str, str, str]:
    """(arch, naming "bfl" | "diffusers", prefix) from a file's tensor names; raises the
    user-facing error for anything that is not a FLUX / SD3 transformer."""
    names = list(names)
    for prefix in (CHECKPOINT_PREFIX, ""):
        keys = {k[len(prefix):] for k in names if k.startswith(prefix)}
        if not keys:
            continue
        if _FLUX_BFL in keys:
            return "flux", "bfl", prefix
        if _SD3_BFL in keys:
            return "sd3", "bfl", prefix
        if _FLUX_DIFFUSERS in keys:
            return "flux", "diffusers", prefix
        if _SD3_DIFFUSERS in keys and "transformer_blocks.0.attn.to_q.weight" in keys:
            return "sd3", "diffusers", prefix
    raise ConfigError(_not_dit_message(names))


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
    return (f"this file is not a FLUX.1 or SD3/3.5 transformer: it looks like {looks}. "
            f"Give a FLUX/SD3 .safetensors (double_blocks/single_blocks or joint_blocks keys, "
            f"optionally under {CHECKPOINT_PREFIX!r}) or a diffusers folder")


def _indices(keys, prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in keys for m in [pat.match(k)] if m})


def flux_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """FLUX's RoPE axes (index, row, column) are not stored in a file: FLUX.1's (16, 56, 56)
    for head dim 128; other head dims (test models) split like the tiny-model builder."""
    if head_dim == 128:
        return FLUX_ROPE_AXES_128
    spatial = ((head_dim - 2) // 2) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


def single_file_config(path) -> dict:
    """{"arch", "naming", "prefix", "config"} of a single transformer file: `config` is the
    diffusers transformer config (constructor arguments) derived from the weight shapes."""
    p = Path(path)
    header = read_safetensors_header(p)
    arch, naming, prefix = transformer_keys(header)
    shapes = {k[len(prefix):]: v["shape"] for k, v in header.items() if k.startswith(prefix)}
    scaled = [k for k in shapes if k.endswith((".scale_weight", ".scale_input"))]
    if scaled:
        raise ConfigError(f"{str(p)!r} is a scaled-fp8 {arch.upper()} file ({scaled[0]!r}), "
                          f"which the pool cannot load; use an fp16/bf16 (or plain fp8) file "
                          f"or a diffusers folder")
    try:
        cfg = (_flux_config if arch == "flux" else _sd3_config)(shapes, naming)
    except (KeyError, IndexError, ValueError) as e:
        detail = f"missing tensor {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{str(p)!r} looks like a {arch.upper()} transformer but is "
                          f"incomplete or inconsistent ({detail}); give a complete FLUX/SD3 "
                          f"transformer file") from None
    return {"arch": arch, "naming": naming, "prefix": prefix, "config": cfg}


def _pick(shapes, bfl: bool, a: str, b: str):
    return shapes[a if bfl else b]


def _flux_config(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    hidden, in_ch = _pick(shapes, bfl, "img_in.weight", "x_embedder.weight")
    head_dim = _pick(shapes, bfl, "double_blocks.0.img_attn.norm.query_norm.scale",
                     "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head dim {head_dim}")
    mlp = _pick(shapes, bfl, "double_blocks.0.img_mlp.0.weight",
                "transformer_blocks.0.ff.net.0.proj.weight")[0]
    if mlp != 4 * hidden:
        raise ValueError(f"MLP width {mlp} is not 4 x hidden {hidden} (not FLUX.1)")
    double = _indices(shapes, "double_blocks." if bfl else "transformer_blocks.")
    single = _indices(shapes, "single_blocks." if bfl else "single_transformer_blocks.")
    for name, idx in (("double", double), ("single", single)):
        if idx != list(range(len(idx))) or not idx:
            raise ValueError(f"{name} blocks are not numbered 0..n-1 (found {idx[:8]}...)")
    out = _pick(shapes, bfl, "final_layer.linear.weight", "proj_out.weight")[0]
    guidance = ("guidance_in.in_layer.weight" if bfl else
                "time_text_embed.guidance_embedder.linear_1.weight") in shapes
    return {"patch_size": 1, "in_channels": int(in_ch), "out_channels": int(out),
            "num_layers": len(double), "num_single_layers": len(single),
            "attention_head_dim": int(head_dim), "num_attention_heads": int(hidden // head_dim),
            "joint_attention_dim": int(_pick(shapes, bfl, "txt_in.weight",
                                             "context_embedder.weight")[1]),
            "pooled_projection_dim": int(_pick(shapes, bfl, "vector_in.in_layer.weight",
                                               "time_text_embed.text_embedder.linear_1.weight")[1]),
            "guidance_embeds": bool(guidance), "axes_dims_rope": list(flux_rope_axes(head_dim))}


def _sd3_config(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    proj = _pick(shapes, bfl, "x_embedder.proj.weight", "pos_embed.proj.weight")
    hidden, in_ch, patch = int(proj[0]), int(proj[1]), int(proj[2])
    blocks = _indices(shapes, "joint_blocks." if bfl else "transformer_blocks.")
    if not blocks or blocks != list(range(len(blocks))):
        raise ValueError(f"joint blocks are not numbered 0..n-1 (found {blocks[:8]}...)")
    ln_q = ("joint_blocks.0.x_block.attn.ln_q.weight" if bfl
            else "transformer_blocks.0.attn.norm_q.weight")
    head_dim = int(shapes[ln_q][0]) if ln_q in shapes else SD3_HEAD_DIM
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of SD3's head dim {head_dim}")
    pos = _pick(shapes, bfl, "pos_embed", "pos_embed.pos_embed")
    side = math.isqrt(int(pos[-2]))
    if side * side != int(pos[-2]):
        raise ValueError(f"positional table of {pos[-2]} entries is not square")
    ctx = shapes["context_embedder.weight"]
    attn2 = _indices([k for k in shapes if (".x_block.attn2." if bfl else ".attn2.") in k],
                     "joint_blocks." if bfl else "transformer_blocks.")
    out = _pick(shapes, bfl, "final_layer.linear.weight", "proj_out.weight")[0]
    # sample_size only sets PatchEmbed's default grid (cropped per input): SD3's 128, capped
    # by the positional table of small test models
    return {"sample_size": min(128, side * patch), "patch_size": patch, "in_channels": in_ch,
            "out_channels": int(out) // (patch * patch), "num_layers": len(blocks),
            "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
            "joint_attention_dim": int(ctx[1]), "caption_projection_dim": int(ctx[0]),
            "pooled_projection_dim": int(_pick(shapes, bfl, "y_embedder.mlp.0.weight",
                                               "time_text_embed.text_embedder.linear_1.weight")[1]),
            "pos_embed_max_size": side, "dual_attention_layers": attn2,
            "qk_norm": "rms_norm" if ln_q in shapes else None}
