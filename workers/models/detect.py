"""Which model a path holds, read without torch: the architecture (FLUX.1, FLUX.2 or SD3/3.5) and the
diffusers transformer config, for the workers (which build the transformer from it) and the
host (which validates a model before any worker starts: its model_info module wraps this
one and turns ModelFileError into its ConfigError).

Two kinds of model:

- a diffusers folder (model_index.json, transformer/config.json, vae/, text encoders): read
  from its JSON;
- a single `.safetensors` file holding a FLUX.1 or SD3/3.5 transformer, as ComfyUI users keep
  them in `models/diffusion_models` (legacy `unet`) or, inside a full checkpoint, in
  `models/checkpoints`. Only the file's JSON header is read (8-byte little-endian length, then
  a JSON table of tensor names, dtypes, shapes and byte ranges): the architecture and the
  diffusers config are derived from the key names and weight shapes (`single_file_config`).

Key namings accepted in a file: BFL / ComfyUI (FLUX `double_blocks.N.*`, `single_blocks.N.*`,
`img_in`, ...; FLUX.2 the same plus `double_stream_modulation_img`, `single_stream_modulation`;
SD3 `joint_blocks.N.*`, `x_embedder`, `pos_embed`, ...), optionally under
`model.diffusion_model.` (full checkpoints add the VAE and text encoders under other
prefixes, which are ignored), and diffusers naming (`transformer_blocks.N.*`, ...).
Every error is one user-facing line.
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

from .facts import ARCH_BY_CLASS, flux_rope_axes

CHECKPOINT_PREFIX = "model.diffusion_model."
# SD3 has no stored head dim without qk-norm; every SD3/3.5 release uses 64 (hidden = 64 x depth)
SD3_HEAD_DIM = 64
SINGLE_FILE_SUFFIXES = (".safetensors", ".sft")


class ModelFileError(ValueError):
    """A path that is not a usable FLUX / SD3 model; the message is one user-facing line."""


def describe_model(path) -> dict:
    """{"arch": "flux" | "flux2" | "sd3", "kind": "file" | "diffusers", "config": the diffusers
    transformer config, "storage": weight_storage} of a diffusers folder or a single
    .safetensors file."""
    p = Path(path)
    if p.is_file():
        sf = single_file_config(p)
        return {"arch": sf["arch"], "kind": "file", "config": sf["config"],
                "storage": sf["storage"]}
    cfg_file = p / "transformer" / "config.json"
    if not p.exists():
        raise ModelFileError(f"model {str(p)!r} does not exist; give a FLUX.1/FLUX.2/SD3 "
                             f"diffusers folder or a single .safetensors transformer file")
    if not p.is_dir():
        raise ModelFileError(f"model {str(p)!r} is neither a directory nor a file; give a "
                             f"diffusers model folder or a .safetensors file")
    if not cfg_file.is_file():
        raise ModelFileError(f"model folder {str(p)!r} has no transformer/config.json; "
                             f"give a FLUX.1, FLUX.2 or SD3 diffusers folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {cfg_file}: {e}") from None
    cls = cfg.get("_class_name") if isinstance(cfg, dict) else None
    arch = ARCH_BY_CLASS.get(cls)
    if arch is None:
        raise ModelFileError(f"model {str(p)!r} has a {cls!r} transformer; supported: "
                             f"{', '.join(sorted(ARCH_BY_CLASS))} (FLUX.1, FLUX.2, SD3/3.5)")
    if arch == "flux2":  # a wrong pipeline is refused here, not ~16 s later in the workers
        flux2_pipeline_class(p)
    return {"arch": arch, "kind": "diffusers", "config": cfg,
            "storage": folder_storage(p / "transformer")}


FLUX2_DEFAULT_PIPELINE = "Flux2KleinPipeline"


def flux2_pipeline_class(path) -> str:
    """The diffusers pipeline that encodes a FLUX.2 folder's prompts, from model_index.json:
    Flux2Pipeline ([dev], Mistral-3) or Flux2KleinPipeline (every [klein] pipeline: Qwen3).
    A folder without model_index.json (or a single file) keeps the klein default."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return FLUX2_DEFAULT_PIPELINE
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelFileError(f"cannot read the pipeline class from {index}: {e}") from None
    if name == "Flux2Pipeline":
        return name
    if isinstance(name, str) and name.startswith("Flux2Klein"):
        return FLUX2_DEFAULT_PIPELINE
    raise ModelFileError(f"{index} names pipeline {name!r}; FLUX.2 folders run with "
                         f"Flux2Pipeline ([dev]) or a Flux2Klein*Pipeline ([klein])")


def read_arch(path) -> str:
    """flux | flux2 | sd3 of a diffusers folder or a single .safetensors file."""
    return describe_model(path)["arch"]


# ---- safetensors header -----------------------------------------------------------------
_MAX_HEADER = 100 * 2 ** 20  # the format's own limit


def read_safetensors_header(path) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} of a .safetensors file (metadata under
    "__metadata__" dropped). A file that is not safetensors, or is truncated, raises one
    ModelFileError naming the file."""
    p = Path(path)
    bad = f"{str(p)!r} is not a valid .safetensors file"
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{bad} (only {size} bytes); re-download or re-save it")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > _MAX_HEADER or 8 + n > size:
                raise ModelFileError(f"{bad} (header length {n} does not fit the {size}-byte "
                                     f"file: corrupt or truncated); re-download or re-save it")
            raw = f.read(n)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {str(p)!r}: {e.strerror or e}") \
            from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(f"{bad} (header unreadable: {e}); re-download or re-save it") \
            from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, t in header.items():
        try:
            start, end = (int(v) for v in t["data_offsets"])
            [int(v) for v in t["shape"]]  # well-formed entries only
            str(t["dtype"])
        except (TypeError, KeyError, ValueError):
            raise ModelFileError(f"{bad} (entry {name!r} malformed); re-download or re-save it") \
                from None
        if end > data or start > end:
            raise ModelFileError(f"{bad}: tensor {name!r} ends at byte {end} but the file has "
                                 f"{data} data bytes (truncated download?); re-download it")
    if not header:
        raise ModelFileError(f"{str(p)!r} holds no tensors; give a FLUX.1/FLUX.2/SD3 "
                             f"transformer file")
    return header


# ---- single-file architecture and config --------------------------------------------------
# FLUX.2 first: its BFL files also have FLUX.1's double_blocks keys; its shared
# modulations (one per stream kind instead of one per block) mark it in both namings
_FLUX2_BFL = "single_stream_modulation.lin.weight"
_FLUX2_DIFFUSERS = "single_stream_modulation.linear.weight"
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
        if _FLUX2_BFL in keys:
            return "flux2", "bfl", prefix
        if _FLUX2_DIFFUSERS in keys:
            return "flux2", "diffusers", prefix
        if _FLUX_BFL in keys:
            return "flux", "bfl", prefix
        if _SD3_BFL in keys:
            return "sd3", "bfl", prefix
        if _FLUX_DIFFUSERS in keys:
            return "flux", "diffusers", prefix
        if _SD3_DIFFUSERS in keys and "transformer_blocks.0.attn.to_q.weight" in keys:
            return "sd3", "diffusers", prefix
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
    return (f"this file is not a FLUX.1, FLUX.2 or SD3/3.5 transformer: it looks like {looks}. "
            f"Give a FLUX.1/FLUX.2/SD3 .safetensors (double_blocks/single_blocks or "
            f"joint_blocks keys, optionally under {CHECKPOINT_PREFIX!r}) or a diffusers folder")


def _indices(keys, prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in keys for m in [pat.match(k)] if m})


def single_file_config(path) -> dict:
    """{"arch", "naming", "prefix", "config"} of a single transformer file: `config` is the
    diffusers transformer config (constructor arguments) derived from the weight shapes."""
    p = Path(path)
    header = read_safetensors_header(p)
    arch, naming, prefix = transformer_keys(header)
    shapes = {k[len(prefix):]: v["shape"] for k, v in header.items() if k.startswith(prefix)}
    try:
        cfg = {"flux": _flux_config, "flux2": _flux2_config, "sd3": _sd3_config}[arch](
            shapes, naming)
    except (KeyError, IndexError, ValueError) as e:
        detail = f"missing tensor {e}" if isinstance(e, KeyError) else str(e)
        raise ModelFileError(f"{str(p)!r} looks like a {arch.upper()} transformer but is "
                             f"incomplete or inconsistent ({detail}); give a complete FLUX/SD3 "
                             f"transformer file") from None
    return {"arch": arch, "naming": naming, "prefix": prefix, "config": cfg,
            "storage": weight_storage(header, prefix)}


_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_DTYPE_NAMES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64"}


def weight_storage(header: dict, prefix: str = "") -> dict:
    """How a checkpoint stores its weights, from its header: {"dtype": the dtype holding the
    most bytes ("fp8" for float8), "fp8": any float8 tensor, "scaled": ComfyUI scaled-fp8
    (per-layer `scale_weight` tensors, usually with a `scaled_fp8` marker key)}."""
    by_dtype: dict = {}
    fp8 = scaled = False
    for k, e in header.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if name == "scaled_fp8" or name.endswith(".scale_weight"):
            scaled = True
            continue
        start, end = (int(v) for v in e["data_offsets"])
        dt = "fp8" if e["dtype"] in _FP8_DTYPES else _DTYPE_NAMES.get(e["dtype"],
                                                                       e["dtype"].lower())
        fp8 = fp8 or dt == "fp8"
        by_dtype[dt] = by_dtype.get(dt, 0) + end - start
    dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
    return {"dtype": dtype, "fp8": fp8, "scaled": scaled and fp8}


def folder_storage(folder) -> dict:
    """weight_storage of a diffusers component folder (all its safetensors shards)."""
    out = {"dtype": None, "fp8": False, "scaled": False}
    p = Path(folder)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    header: dict = {}
    for i, f in enumerate(files):
        header.update({f"{i}:{k}": v for k, v in read_safetensors_header(f).items()})
    return weight_storage(header) if header else out


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


# FLUX.2's RoPE: 4 axes (time, row, column, text index) splitting the head dim evenly, as
# the released models' (32, 32, 32, 32) for head dim 128, with theta 2000; neither is
# stored in a file
FLUX2_ROPE_AXES = 4
FLUX2_ROPE_THETA = 2000


def _flux2_config(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    hidden, in_ch = _pick(shapes, bfl, "img_in.weight", "x_embedder.weight")
    head_dim = int(_pick(shapes, bfl, "double_blocks.0.img_attn.norm.query_norm.scale",
                         "transformer_blocks.0.attn.norm_q.weight")[0])
    if hidden % head_dim or head_dim % FLUX2_ROPE_AXES:
        raise ValueError(f"hidden size {hidden} / head dim {head_dim} do not fit FLUX.2's "
                         f"{FLUX2_ROPE_AXES} RoPE axes")
    # SwiGLU: the input projection holds gate and value, 2 x mlp_ratio x hidden rows
    mlp_in = int(_pick(shapes, bfl, "double_blocks.0.img_mlp.0.weight",
                       "transformer_blocks.0.ff.linear_in.weight")[0])
    double = _indices(shapes, "double_blocks." if bfl else "transformer_blocks.")
    single = _indices(shapes, "single_blocks." if bfl else "single_transformer_blocks.")
    for name, idx in (("double", double), ("single", single)):
        if idx != list(range(len(idx))) or not idx:
            raise ValueError(f"{name} blocks are not numbered 0..n-1 (found {idx[:8]}...)")
    out = int(_pick(shapes, bfl, "final_layer.linear.weight", "proj_out.weight")[0])
    guidance = ("guidance_in.in_layer.weight" if bfl else
                "time_guidance_embed.guidance_embedder.linear_1.weight") in shapes
    return {"patch_size": 1, "in_channels": int(in_ch), "out_channels": out,
            "num_layers": len(double), "num_single_layers": len(single),
            "attention_head_dim": head_dim, "num_attention_heads": int(hidden) // head_dim,
            "joint_attention_dim": int(_pick(shapes, bfl, "txt_in.weight",
                                             "context_embedder.weight")[1]),
            "timestep_guidance_channels": int(_pick(
                shapes, bfl, "time_in.in_layer.weight",
                "time_guidance_embed.timestep_embedder.linear_1.weight")[1]),
            "mlp_ratio": mlp_in / 2 / int(hidden), "guidance_embeds": bool(guidance),
            "axes_dims_rope": [head_dim // FLUX2_ROPE_AXES] * FLUX2_ROPE_AXES,
            "rope_theta": FLUX2_ROPE_THETA}


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
