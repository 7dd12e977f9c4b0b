"""GGUF single files (ComfyUI-GGUF's): their Linears kept in GGUF blocks, dequantised per call.

A quantised Linear weight stays as the file's bytes, uint8 [out_features, bytes per row]
(each row is whole blocks), in a `GGUFLinear`; its forward dequantises it into the input's
dtype (workers/loading/gguf_quant.py: plain torch ops, which a compiled region fuses into the
matmul) and multiplies. Everything else (norms, biases, embeddings, convolutions, and the
rare weight whose rows are not whole blocks) is dequantised once at load into the pool's
dtype. Since the bytes are rows, a row range of a weight is a byte range: the conversion of
BFL names to diffusers names (fused qkv split by rows, `single_file.row_map`), PipeFusion's
stages and weight sharding (a rank keeps its own output rows' blocks) all work on the bytes.
`weights="full"` dequantises every tensor at load; `weights="fp8"` dequantises and then
stores the block Linears in fp8 as for any other checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .gguf_quant import dequantize


@dataclass
class QuantWeight:
    """A Linear weight as GGUF blocks: `raw` uint8 [rows, bytes per row], `shape` its
    [out_features, in_features]."""
    raw: torch.Tensor
    qtype: str
    shape: tuple


class GGUFLinear(torch.nn.Linear):
    """A Linear whose weight is GGUF blocks (uint8 [out_features, bytes per row]),
    dequantised into the input's dtype on each call. A Linear subclass, so peft's LoRA wraps
    it like any Linear; `compute_dtype` (the pool's dtype) is what peft reads to keep the
    LoRA matrices in that dtype instead of the weight's uint8."""

    def __init__(self, in_features, out_features, qtype: str, row_bytes: int, bias=True,
                 compute_dtype=torch.float32):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.qtype, self.compute_dtype = qtype, compute_dtype
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, row_bytes, dtype=torch.uint8, device="meta"),
            requires_grad=False)
        self.bias = None if not bias else torch.nn.Parameter(
            torch.empty(out_features, device="meta", dtype=compute_dtype), requires_grad=False)

    def dequantized(self, dtype) -> torch.Tensor:
        # the rows this module holds (all of them, or after weight sharding's all-gather)
        return dequantize(self.weight, self.qtype, (self.weight.shape[0], self.in_features),
                          dtype)

    def forward(self, x):
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self):
        return super().extra_repr() + f", weight=GGUF {self.qtype}"


def _rows(ck, src: str, a: int, b: int, device, shape_of) -> tuple:
    """Rows [a, b) of a file tensor on `device`: (tensor, GGUF type or None). Quantised
    tensors whose rows are not whole blocks are read whole and dequantised to fp32."""
    qtype = ck.qtype(src)
    whole = a == 0 and b == (ck.shape(src) or [1])[0]
    if qtype and ck.dtype(src) == torch.uint8 and len(_byte_shape(ck, src)) != 2:
        t = dequantize(ck.read(src, device), qtype, shape_of(src), torch.float32)
        return (t if whole else t[a:b]), None
    t = ck.read(src, device) if whole else ck.read_rows(src, a, b).to(device)
    return t, qtype


def _byte_shape(ck, src: str) -> list:
    from .checkpoint import gguf_byte_shape
    path, start, e = ck.entries[src]
    a, b = (int(v) for v in e["data_offsets"])
    return gguf_byte_shape(e["dtype"], list(e["shape"]), b - a)


def read_rows(ck, shape, segs, r0=None, r1=None, device="cpu") -> tuple:
    """Rows [r0, r1) (None: all) of a diffusers tensor made of `segs` (single_file.row_map's
    source row ranges) of a GGUF file, on `device`: (tensor of those rows, GGUF type or None).
    Raw blocks, uint8 [rows, bytes per row], where the type is given; else a float tensor
    (as stored, or dequantised to fp32 where the rows are not whole blocks)."""
    whole = r0 is None
    if not whole:
        segs = _slice_segments(segs, r0, r1)
    parts, qtypes = [], set()
    for src, a, b in segs:
        t, q = _rows(ck, src, a, b, device, ck.shape)
        parts.append(t)
        qtypes.add(q)
    if not parts:
        return torch.empty([0] + list(shape[1:]), device=device), None
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if len(qtypes) != 1:
        if any(p.dtype == torch.uint8 for p in parts):
            raise ValueError("a tensor made of GGUF tensors of different types")
        qtypes = {None}
    q = qtypes.pop()
    if q is None:
        n = (shape[0] if whole else r1 - r0) if shape else None
        t = t.reshape([n] + list(shape[1:])) if shape else t.reshape(())
    return t, q


def is_gguf_linear(name: str, shape, qtype, linears, mode: str) -> bool:
    """Whether a tensor stays in GGUF blocks: a quantised 2-D weight of an nn.Linear under
    weights="auto"."""
    return (qtype is not None and mode == "auto" and name.endswith(".weight")
            and name.rpartition(".")[0] in linears and len(shape) == 2)


def gguf_linears(ck, src, transformer, mode: str) -> dict:
    """{weight name: GGUF type} of the Linears a shard loader keeps in blocks (`src`: its
    shards.RowSource over the file's row map)."""
    linears, out = linear_names(transformer), {}
    for name, (shape, segs, _) in src.table.items():
        kinds = {ck.qtype(k) for k, _, _ in segs}
        q = kinds.pop() if len(kinds) == 1 else None
        if q and len(_byte_shape(ck, segs[0][0])) == 2 and \
                is_gguf_linear(name, shape, q, linears, mode):
            out[name] = q
    return out


def linear_names(transformer) -> set:
    return {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}


def gguf_tensors(ck, table: dict, transformer, device, mode: str, keep=lambda name: True):
    """(diffusers name, tensor or QuantWeight, None) of a GGUF single file's transformer, for
    `weights.load_tensors`: a Linear's quantised weight stays a QuantWeight under
    weights="auto"; every other tensor comes dequantised (fp32) or as stored (F16/BF16/F32).
    `table`: the file's `single_file.row_map`; `keep(name)`: read only these (a PipeFusion
    stage's)."""
    linears = linear_names(transformer)
    for dname, (shape, segs, _) in table.items():
        if not keep(dname):
            continue
        t, q = read_rows(ck, shape, segs, device=device)
        if q is None:
            yield dname, t, None
        elif is_gguf_linear(dname, shape, q, linears, mode):
            yield dname, QuantWeight(t, q, tuple(shape)), None
        else:
            yield dname, dequantize(t, q, shape, torch.float32), None


def _slice_segments(segs: list, r0: int, r1: int) -> list:
    """The source row ranges that make up output rows [r0, r1) of a tensor made of `segs`."""
    out, pos = [], 0
    for src, a, b in segs:
        lo, hi = max(r0, pos), min(r1, pos + b - a)
        if lo < hi:
            out.append((src, a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def gguf_layers(transformer, quant: dict, dtype) -> dict:
    """Swap the Linears whose weights are in `quant` ({weight name: QuantWeight, or its
    GGUF type}) for GGUFLinear computing in `dtype`, weight and bias still to be assigned;
    {module name: GGUFLinear}."""
    from .gguf_types import row_bytes
    out = {}
    for name, qw in quant.items():
        mod = name.rpartition(".")[0]
        lin = transformer.get_submodule(mod)
        qtype = qw if isinstance(qw, str) else qw.qtype
        out[mod] = GGUFLinear(lin.in_features, lin.out_features, qtype,
                              row_bytes(qtype, lin.in_features), bias=lin.bias is not None,
                              compute_dtype=dtype)
        parent, _, leaf = mod.rpartition(".")
        setattr(transformer.get_submodule(parent) if parent else transformer, leaf, out[mod])
    return out


def gguf_bytes(transformer) -> int:
    """Bytes of the GGUF blocks the transformer holds."""
    return sum(m.weight.numel() for m in transformer.modules() if isinstance(m, GGUFLinear))
