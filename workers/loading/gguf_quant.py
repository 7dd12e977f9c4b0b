"""GGUF block dequantisation in plain torch ops, so it runs on the device the bytes are on and
`torch.compile` fuses it into the matmul's prologue.

A quantised GGUF tensor is rows of blocks: each block holds `block` values of one row in
`size` bytes (scales, then packed integers). The functions here take the raw bytes as uint8
[n_blocks, size] and give fp32 [n_blocks, block], in the same arithmetic order as the
`gguf` package's numpy reference (fp16 scales widened to fp32 first), so the values equal it
bit for bit. No tensor is made inside (shifts are Python ints), nothing depends on values,
so the functions trace without graph breaks.
"""
from __future__ import annotations

import torch

# the type table, re-exported for the loaders that take both from here
from .gguf_types import (FLOAT_TYPES, NAME_OF, QK_K, QUANTISED, TYPES,  # noqa: F401
                         row_bytes, tensor_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per block (little-endian fp16) -> fp32 [n, 1]."""
    return b.view(torch.float16).float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Packed 4-bit values, [n, k * run] bytes -> [n, k, 2, run]: each run of `run` bytes
    holds `run` values in its low nibbles, then the next `run` in its high ones."""
    q = qs.reshape(qs.shape[0], -1, run)
    return torch.stack((q & 15, q >> 4), dim=2)


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [n, m] -> their `width`-bit fields, lowest first: [n, 8 // width, m]."""
    mask = (1 << width) - 1
    return torch.stack([(b >> s) & mask for s in range(0, 8, width)], dim=1)


def _high_bit_32(qh: torch.Tensor) -> torch.Tensor:
    """The 5-bit types' 32 high bits (a little-endian uint32 in 4 bytes) -> [n, 32], bit j
    for value j."""
    return _bits(qh, 1).transpose(1, 2).reshape(qh.shape[0], 32)


def _q8_0(b):
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b):
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).view(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b):
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:], 16).reshape(b.shape[0], 32) | (_high_bit_32(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.view(torch.int8) - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16).reshape(b.shape[0], 32) | (_high_bit_32(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple:
    """The 4/5-bit K types' 12 scale bytes -> (8 six-bit scales, 8 six-bit mins) per block:
    bytes 0-3 and 4-7 hold sub-blocks 0-3's scale and min in their low 6 bits and the top 2
    bits of sub-blocks 4-7's; bytes 8-11 hold the low 4 bits of those (scale low, min high)."""
    a, m, lo = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 63, (lo & 15) | ((a >> 6) << 4)), dim=1)
    mn = torch.cat((m & 63, (lo >> 4) | ((m >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    high = _bits(b[:, 16:48], 1)  # [n, 8, 32]: bit i of byte l -> sub-block i, value l
    q = _nibbles(b[:, 48:], 32).reshape(n, 8, 32) | (high << 4)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64).reshape(n, 2, 4, 32)  # half, quarter, value
    high = _bits(b[:, 128:192].reshape(n * 2, 32), 2).reshape(n, 2, 4, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16).float()
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q).reshape(n, QK_K)


_BLOCKS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, qtype: str, shape, dtype=torch.float32) -> torch.Tensor:
    """A GGUF tensor's bytes (uint8, any shape holding whole rows) -> the tensor of `shape`
    in `dtype`, computed in fp32 (what the gguf package's numpy reference computes)."""
    shape = tuple(int(v) for v in shape)
    if qtype in FLOAT_TYPES:
        flt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return raw.reshape(-1).view(flt).reshape(shape).to(dtype)
    fn = _BLOCKS.get(qtype)
    if fn is None:
        raise ValueError(f"GGUF type {qtype} is not supported (supported: "
                         f"{', '.join(TYPES)})")
    _, _, size = TYPES[qtype]
    return fn(raw.reshape(-1, size)).reshape(shape).to(dtype)
