"""Shard-only loading: each rank reads just its rows of each transformer tensor (FSDP2's
even chunks, or the uneven split's rows by weight: workers/parallel/uneven_sharding.py; the
sharding says which rows, `row_range`).

The loader beside workers/loading/weights.py's whole-tensor one, for weight sharding
(workers/parallel/sharding.py). The transformer is built on the meta device (models/base.py, as
for a whole load), its fp8 layers made (weights.fp8_layers), sharded there and materialised as
shards only (`to_empty`); then each rank reads its dim-0 chunk of each parameter (rows of a
row-major tensor are one contiguous byte range: `Checkpoint.read_rows`) and stores it through
`weights.prepare`, the whole loader's own per-tensor decision. No rank ever holds a whole
weight; together the ranks read each parameter byte once. Buffers (SD3's positional table)
are not parameters: FSDP leaves them whole, so every rank reads and holds them.

Single files (ComfyUI/BFL names): `single_file.row_map` runs the whole loader's conversion
on index tensors, so each diffusers tensor is known as row ranges of file tensors (a fused
qkv / linear1 part: its row offset in the fused tensor) and a rank reads only the file rows
its chunk maps to.

fp8: a block Linear stored in float8_e4m3fn stays fp8 (weights auto/fp8), its scale_weight (a
scalar) read whole; other fp8 tensors are dequantized. `weights=fp8` on weights stored wider
quantizes each rank's rows per output channel (a row's scale is its own range, so a rank
needs no other rank's rows, and the rows equal the whole loader's), then one all-reduce
(MAX, gloo control plane) gives every rank every channel's scale, which FP8Linear holds
whole.

GGUF files (ComfyUI-GGUF's): a quantised Linear's rows are whole blocks, so a rank reads and
keeps the blocks of its own output rows (workers/loading/gguf_load.py); other quantised
tensors are dequantised, rows only as well.
"""
from __future__ import annotations

import os

import torch


def direct_load_problem(path: str) -> str:
    """Why the transformer at `path` cannot be read shard by shard ("" when it can): then it
    is loaded whole (workers/loading/weights.py) and sharded after the load. Diffusers folders with
    safetensors and single files (any naming, bf16 or fp8, scaled or not) can."""
    from .weights import has_safetensors
    if os.path.isfile(path) or has_safetensors(os.path.join(path, "transformer")):
        return ""
    return "the transformer has no safetensors weights (.bin: diffusers' own loader)"


def chunk_rows(n: int, world: int, rank: int) -> tuple:
    """FSDP2's dim-0 split (torch.chunk): rows [start, stop) of `rank` out of `n`."""
    per = -(-n // world)
    start = min(rank * per, n)
    return start, min(start + per, n)


class RowSource:
    """Where each diffusers tensor's rows are in a checkpoint: {name: (shape, segments,
    scale name)}, segments [(checkpoint tensor, first row, stop row)] whose rows, in order,
    are the tensor's (a folder: the tensor itself; a single file: `single_file.row_map`)."""

    def __init__(self, ck, table: dict):
        self.ck, self.table = ck, table
        self.scales = {}

    @classmethod
    def folder(cls, ck) -> "RowSource":
        return cls(ck, {k: (ck.shape(k), [(k, 0, ck.shape(k)[0] if ck.shape(k) else 1)], None)
                        for k in ck.keys()})

    def keys(self):
        return self.table.keys()

    def shape(self, name: str) -> list:
        return list(self.table[name][0])

    def dtype(self, name: str) -> torch.dtype:
        return self.ck.dtype(self.table[name][1][0][0])

    def scale(self, name: str):
        """The tensor's scale_weight (fp32 scalar, read whole once) or None."""
        key = self.table[name][2]
        if key is None:
            return None
        if key not in self.scales:
            self.scales[key] = self.ck.read_rows(key).float().reshape(())
        return self.scales[key]

    def read(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) in the checkpoint's dtype (a 0-dim tensor: whole)."""
        shape, segs, _ = self.table[name]
        if not shape:
            return self.ck.read_rows(segs[0][0])
        parts, pos = [], 0
        for key, a, b in segs:
            lo, hi = max(r0, pos), min(r1, pos + b - a)
            if hi > lo:
                parts.append(self.ck.read_rows(key, a + lo - pos, a + hi - pos))
            pos += b - a
        if not parts:
            return torch.empty([0] + shape[1:], dtype=self.dtype(name))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def open_source(adapter, path: str, subfolder: str = "transformer"):
    """(Checkpoint, RowSource, meta-built transformer, single-file config or None);
    `subfolder`: a folder's other transformer (Wan 2.2's `transformer_2`)."""
    from .meta import meta_transformer, meta_transformer_of
    from .weights import Checkpoint
    if subfolder != "transformer" and not os.path.isfile(path):
        import diffusers
        folder = os.path.join(path, subfolder)
        transformer = meta_transformer(getattr(diffusers, adapter.transformer_class), folder)
        ck = Checkpoint.folder(folder)
        return ck, RowSource.folder(ck), transformer, None
    transformer, sf = meta_transformer_of(adapter, path)
    if sf is not None:
        from .single_file import row_map
        ck = Checkpoint.open([path])
        return ck, RowSource(ck, row_map(ck, sf)), transformer, sf
    ck = Checkpoint.folder(os.path.join(path, "transformer"))
    return ck, RowSource.folder(ck), transformer, None


def load_shards(adapter, path: str, device, dtype, mode: str, shard,
                subfolder: str = "transformer") -> tuple:
    """(transformer, report dict): the transformer of `path` (a diffusers folder or a single
    file; `subfolder`: another transformer of the folder) holding only this rank's rows of
    every parameter. `shard`: what shards it (sharding.ShardSetup: `wrap(transformer)`,
    `rank`, `world`, `control` the gloo group for the fp8 scales)."""
    from .gguf_load import gguf_layers, gguf_linears
    from .gguf_load import read_rows as gguf_read_rows
    from .gguf_quant import dequantize, row_bytes
    from .weights import FP8, WEIGHT_MODES, block_linears, fp8_layers, is_fp8, prepare

    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES} (got {mode!r})")
    ck, src, transformer, sf = open_source(adapter, path, subfolder)
    with ck:
        transformer.to(dtype).requires_grad_(False).eval()
        lists = adapter.block_lists
        cands = {n + ".weight" for n in block_linears(transformer, lists)}
        # a BFL file whose converter needs the whole state (SD3) is cast to the pool dtype
        # before it in the whole loader (single_file.file_tensors): nothing stays fp8 there,
        # so nothing here
        cast_first = sf is not None and sf["naming"] != "diffusers" and \
            adapter.bfl_blocks is None and not ck.gguf
        # a GGUF file's quantised Linears keep their blocks, each rank its own output rows'
        # (whole blocks: a row is a byte range); gguf_load.py
        gguf_q = gguf_linears(ck, src, transformer, mode) if ck.gguf else {}
        keep = set() if mode == "full" or cast_first else {
            n for n in cands if n in src.table and src.dtype(n) == FP8}
        quant = (cands - keep) if mode == "fp8" else set()
        fp8 = {m + ".weight": lin for m, lin in fp8_layers(
            transformer, lists, {n[:-len(".weight")] for n in keep | quant}, dtype,
            "meta").items()}
        gguf_mods = gguf_layers(transformer, gguf_q, dtype)
        persistent = set(transformer.state_dict().keys())
        # a non-persistent buffer the model computes at construction (the adapter's
        # computed_buffers made it on the CPU, not on the meta device) needs no checkpoint
        loose = [n for n, b in transformer.named_buffers()
                 if n not in persistent and n[:-len(".scale")] + ".weight" not in fp8
                 and b.is_meta]
        if loose:
            raise ValueError(f"buffers not stored in the checkpoint: {loose[:3]}")
        if persistent != set(src.keys()):
            want, have = persistent, set(src.keys())
            raise ValueError(f"checkpoint {path} does not match the model: missing "
                             f"{sorted(want - have)[:3]}, unexpected {sorted(have - want)[:3]}")
        sharding = shard.wrap(transformer)  # FSDP2's even chunks or the uneven split's
        sharding.materialize(device)
        adapter.computed_buffers(transformer)  # to_empty left them uninitialised
        world = shard.world

        def rows(name, local):
            full = src.shape(name)
            r0, r1 = sharding.row_range(name, full[0]) if full else (0, 0)
            cols = [row_bytes(gguf_q[name], full[1])] if name in gguf_q else full[1:]
            if full and (local.shape[0] != r1 - r0 or list(local.shape[1:]) != cols):
                raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not rows "
                                   f"{r0}:{r1} of {full} (the sharding's dim-0 split changed?)")
            return r0, r1

        def read(name, r0, r1):  # (rows, scale) as the whole loader's prepare receives them
            if ck.gguf:  # raw blocks for a GGUF Linear, else dequantised (or as stored)
                shape, segs, _ = src.table[name]
                t, q = gguf_read_rows(ck, shape, segs, r0, r1) if shape else \
                    gguf_read_rows(ck, shape, segs)
                if q is not None and name not in gguf_q:
                    t = dequantize(t, q, [r1 - r0] + list(shape[1:]) if shape else [],
                                   torch.float32)
                return t, None
            t, s = src.read(name, r0, r1), src.scale(name)
            if cast_first and t.is_floating_point():  # cast before converting, as there
                return prepare(t, s, False, "full", dtype)[0], None
            return t, s

        params = sharding.local_params()
        # weights=fp8: each rank quantises its rows, each row by its own range (no other
        # rank's rows needed); FP8Linear holds every channel's scale, so one all-reduce
        # (MAX over zeros elsewhere) fills in the rows the other ranks quantised
        names = sorted(quant)
        counts = [src.shape(n)[0] for n in names]
        offset = dict(zip(names, [sum(counts[:i]) for i in range(len(names))]))
        channel_scales = torch.zeros(sum(counts), dtype=torch.float32)
        dev = torch.device(device)
        with torch.no_grad():
            for name, local in params.items():
                r0, r1 = rows(name, local)
                if local.numel():
                    w, sc = prepare(*read(name, r0, r1), name in fp8, mode, dtype)
                    local.copy_(w.to(dev))
                    if name in offset:
                        at = offset[name]
                        channel_scales[at + r0:at + r1] = sc.reshape(-1).cpu()
            if names and world > 1:
                from ..parallel.topology import all_reduce
                all_reduce(channel_scales, op="max", group=shard.control)
            whole = {n: channel_scales[offset[n]:offset[n] + c].reshape(-1, 1)
                     for n, c in zip(names, counts)}
            for name, mod in fp8.items():  # per channel, or the file's (1: unscaled fp8)
                s = whole[name] if name in whole else src.scale(name)
                mod.scale = (torch.ones(()) if s is None else s.float().reshape(
                    s.shape if name in whole else ())).to(dev)
            param_bytes = ck.bytes_read
            for name, buf in transformer.named_buffers():  # not sharded: read whole
                if name in persistent:
                    full = src.shape(name)
                    w, _ = prepare(*read(name, 0, full[0] if full else 0), False, mode, dtype)
                    buf.copy_(w.to(dev))
        report = {"weights": "fp8" if fp8 else "gguf" if gguf_mods else "full",
                  "fp8_layers": len(fp8), "gguf_layers": len(gguf_mods),
                  "loaded": "shards only", "tensors_read": ck.reads,
                  "bytes_read": ck.bytes_read, "buffer_bytes_read": ck.bytes_read - param_bytes,
                  "checkpoint_fp8": any(is_fp8(torch.empty(0, dtype=ck.dtype(k)))
                                        for k in ck.keys()),
                  "transformer_bytes": sum(t.numel() * t.element_size()
                                           for t in params.values())}
    return transformer, report
