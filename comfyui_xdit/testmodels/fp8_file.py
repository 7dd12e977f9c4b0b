"""fp8 copies of single-file transformers, as ComfyUI's fp8 files store them: for the tests and
experiments with the fp8 loaders (re-exported as tiny_model.write_fp8_file)."""
from __future__ import annotations

import os
import pathlib

from comfyui_xdit import bridge


def block_prefixes() -> tuple:
    """Every family's block lists in both namings ("double_blocks.", "transformer_blocks.",
    ...), from the registry: the Linears inside them are what fp8 files store in fp8."""
    fams = bridge.families.FAMILIES.values()
    return tuple(dict.fromkeys(f"{name}." for f in fams for name in f.blocks.file_names()))


def write_fp8_file(src: str | os.PathLike, dst: str | os.PathLike, scaled: bool) -> pathlib.Path:
    """An fp8 copy of a single-file transformer (any naming, optionally under
    model.diffusion_model.), as ComfyUI's fp8 files store one: every 2-D weight inside the
    transformer blocks in float8_e4m3fn, everything else as it was.

    scaled=False: ComfyUI's plain `flux1-dev-fp8` style, the weight cast (saturated at +-448).
    scaled=True: ComfyUI's scaled-fp8 style, `w / s` in fp8 with `<layer>.scale_weight` = s
    (fp32 scalar, s = max|w| / 448) beside it and a `scaled_fp8` marker key. A fused tensor
    (BFL qkv, linear1) gets one scale. For tests and experiments with the fp8 loaders."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = bridge.weights
    sd = load_file(str(src))
    prefix = "model.diffusion_model." if any(k.startswith("model.diffusion_model.")
                                             for k in sd) else ""
    out, blocks = {}, block_prefixes()
    for k, w in sd.items():
        name = k[len(prefix):] if k.startswith(prefix) else None
        if name is None or not (name.startswith(blocks) and name.endswith(".weight")
                                and w.dim() == 2 and w.is_floating_point()):
            out[k] = w
            continue
        if scaled:  # the loaders' own quantization (workers/loading/weights.py)
            out[k], out[k[: -len(".weight")] + ".scale_weight"] = weights.quantize(w)
        else:
            out[k] = w.float().clamp(-weights.FP8_MAX, weights.FP8_MAX).to(weights.FP8)
    if scaled:
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst))
    return dst
