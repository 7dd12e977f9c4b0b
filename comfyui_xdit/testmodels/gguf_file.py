"""GGUF copies of single-file transformers, laid out as ComfyUI-GGUF's converter lays them out:
for the tests and experiments with the GGUF loader (re-exported as tiny_model.write_gguf_file).

The tensors keep the source file's names (its model.diffusion_model. prefix dropped); tensors
of one dimension or at most 1024 values stay F32; tensors of more than four dimensions are
stored flattened to two, with their shape in `comfy.gguf.orig_shape.<name>`. Tensors stored
with two dimensions are in the asked type, or in F16 where a row is not whole blocks of it;
the others (an SD3 pos_embed Parameter, a conv kernel) in F16, as llama.cpp's quantiser
(which makes ComfyUI-GGUF's quantised files from its converter's F16 ones) leaves them:
ComfyUI-GGUF loads a quantised tensor only into a layer that dequantises it. The gguf
package quantises the types it can (Q8_0, Q5_0/1, Q4_0/1, BF16); the K types it only reads,
so `quantize_k` below writes them (a plain min/max fit per sub-block: a valid file, not
llama.cpp's error-minimising search).
"""
from __future__ import annotations

import os
import pathlib

import numpy as np

SMALL = 1024  # at most this many values: kept F32, as the converter keeps them
QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the K types' 12 bytes (see gguf_quant)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """Q4_K / Q5_K / Q6_K bytes of a float array whose rows are whole 256-value blocks."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, QK_K)
    n = x.shape[0]
    if qtype == "Q6_K":
        sub = x.reshape(n, 16, 16)
        amax = np.abs(sub).max(axis=2)
        s = np.where(amax > 0, amax / 31.0, 0.0)  # q in [-32, 31]
        d = np.abs(s).max(axis=1) / 127.0
        d16 = d.astype(np.float16).astype(np.float32)
        isc = np.clip(np.round(np.divide(s, d16[:, None], out=np.zeros_like(s),
                                         where=d16[:, None] > 0)), -128, 127)
        eff = (d16[:, None] * isc)[:, :, None]
        q = np.clip(np.round(np.divide(sub, eff, out=np.zeros_like(sub), where=eff > 0)),
                    -32, 31).astype(np.int32) + 32
        q = q.reshape(n, 2, 4, 32)  # half, quarter, value
        ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # [n, 2, 2, 32]
        qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4))  # [n, 2, 32]
        return np.concatenate([ql.reshape(n, 128).astype(np.uint8),
                               qh.reshape(n, 64).astype(np.uint8),
                               isc.astype(np.int8).view(np.uint8), _f16_bytes(d16)],
                              axis=1).reshape(rows, -1)
    bits = {"Q4_K": 4, "Q5_K": 5}[qtype]
    top = (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(axis=2), 0), sub.max(axis=2)
    scale, mins = (hi - lo) / top, -lo
    d = scale.max(axis=1) / 63.0
    dmin = mins.max(axis=1) / 63.0
    d16 = d.astype(np.float16).astype(np.float32)
    m16 = dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d16[:, None], out=np.zeros_like(scale),
                                    where=d16[:, None] > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(mins, m16[:, None], out=np.zeros_like(mins),
                                    where=m16[:, None] > 0)), 0, 63)
    es, em = (d16[:, None] * sc)[:, :, None], (m16[:, None] * mn)[:, :, None]
    q = np.clip(np.round(np.divide(sub + em, es, out=np.zeros_like(sub), where=es > 0)),
                0, top).astype(np.uint8).reshape(n, 4, 2, 32)  # pair, half, value
    qs = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(n, 128)
    parts = [_f16_bytes(d16), _f16_bytes(m16), _pack_k_scales(sc, mn)]
    if bits == 5:
        high = (q.reshape(n, 8, 32) >> 4) & 1
        parts.append(sum(high[:, i] << i for i in range(8)).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=1).reshape(rows, -1)


def quantize(w: np.ndarray, qtype: str) -> tuple:
    """(bytes or array, the type written): `qtype`, or F16 where the rows are not whole
    blocks of it."""
    import gguf
    T = gguf.GGMLQuantizationType
    block = gguf.GGML_QUANT_SIZES[T[qtype]][0]
    if w.shape[-1] % block:
        return gguf.quants.quantize(w, T.F16), "F16"
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(w.reshape(-1, w.shape[-1]), qtype).reshape(
            *w.shape[:-1], -1), qtype
    return gguf.quants.quantize(w, T[qtype]), qtype


def write_gguf_file(src: str | os.PathLike, dst: str | os.PathLike, qtype: str = "Q8_0",
                    arch: str | None = None) -> pathlib.Path:
    """A GGUF copy of a single-file transformer (`src`, .safetensors, any naming) with its
    weights in `qtype` (Q8_0, Q6_K, Q5_K, Q5_0, Q5_1, Q4_K, Q4_0, Q4_1, F16, BF16, as the
    module docstring says). `arch`: the family id, else detected from the keys."""
    import gguf
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(src))
    prefix = "model.diffusion_model."
    if any(k.startswith(prefix) for k in sd):
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if arch is None:
        from comfyui_xdit import bridge
        arch = bridge.detect.transformer_keys(sd)[0]
    if qtype not in gguf.GGMLQuantizationType.__members__:
        raise ValueError(f"unknown GGUF type {qtype!r}")
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # `general.architecture`: the family id (ComfyUI-GGUF's own names coincide for flux,
    # sd3, wan and qwen_image; the loader detects the family from the tensor names anyway)
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    T = gguf.GGMLQuantizationType
    for name, t in sd.items():
        w = t.to(torch.float32).numpy()
        if w.ndim > 4:  # GGUF holds at most four dimensions
            writer.add_array(f"comfy.gguf.orig_shape.{name}", [int(v) for v in w.shape])
            w = w.reshape(-1, w.shape[-1])
        if w.ndim <= 1 or w.size <= SMALL or not t.is_floating_point():
            data, kind = w.astype(np.float32), "F32"
        elif w.ndim != 2:
            data, kind = w.astype(np.float16), "F16"
        else:
            data, kind = quantize(w, qtype)
        writer.add_tensor(name, data, raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
