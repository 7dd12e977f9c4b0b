"""GGUF tensor types: their ids, block sizes and byte counts. No torch here: the header reader
and the host's memory plan read these without importing it (workers/loading/gguf_quant.py
holds the dequantisation)."""
from __future__ import annotations

QK_K = 256

# name -> (GGML type id, values per block, bytes per block)
TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "Q4_K": (12, QK_K, 144), "Q5_K": (13, QK_K, 176),
    "Q6_K": (14, QK_K, 210),
}
NAME_OF = {tid: name for name, (tid, _, _) in TYPES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")  # stored as plain floats, not blocks
QUANTISED = tuple(n for n in TYPES if n not in FLOAT_TYPES)


def row_bytes(qtype: str, n: int) -> int:
    """Bytes of one row of `n` values."""
    _, block, size = TYPES[qtype]
    if n % block:
        raise ValueError(f"a {qtype} row holds whole blocks of {block} values (got {n})")
    return n // block * size


def tensor_bytes(qtype: str, shape) -> int:
    shape = [int(v) for v in shape] or [1]
    rows = 1
    for v in shape[:-1]:
        rows *= v
    return rows * row_bytes(qtype, shape[-1])
