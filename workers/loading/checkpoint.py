"""Reading checkpoints tensor by tensor: safetensors files and folders (by positioned reads of
each tensor's byte range, found through its header) and GGUF files (their raw blocks, read
the same way; workers/loading/header.py reads their headers)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

# safetensors dtype names -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


# ---- reading -------------------------------------------------------------------------------
def pread_bytes(fd: int, pos: int, n: int, path: str, name: str) -> bytearray:
    """n bytes at `pos` of an open file, read in place into one buffer (a tensor's bytes
    straight from its byte range: no mapping, no second copy)."""
    from .staging import fill
    buf = bytearray(n)
    fill(fd, memoryview(buf), pos, path, name)
    return buf


@dataclass
class Checkpoint:
    """The tensors of one safetensors file or a sharded diffusers folder, read one at a time.

    Onto the CPU through safetensors' `safe_open` (a lazy memory map: a tensor already in the
    wanted dtype is used in place, as diffusers does). Onto a GPU by positioned reads of the
    tensor's bytes in large chunks through two reusable pinned buffers, each chunk's copy to
    the device overlapping the next read (workers/loading/staging.py); onto any other device
    into a host buffer that lives only for the copy. Either way a GPU rank holds at most a
    tensor's worth on the host and maps nothing (a map's touched pages would count in every
    rank's RSS until the file is closed: 24 GB for FLUX.1-dev). Each file is opened once per
    load; use as a context manager (or call close())."""

    entries: dict = field(default_factory=dict)  # name -> (path, data start, header entry)
    reads: int = 0  # tensors read so far
    bytes_read: int = 0
    _handles: dict = field(default_factory=dict)  # (path, "mmap" | "fd") -> open handle
    _staging: object = None  # the GPU reads' pinned buffers (staging.Staging), made once
    gguf: bool = False  # a GGUF file: its quantised tensors read as their raw bytes

    @classmethod
    def open(cls, paths) -> "Checkpoint":
        from .header import read_safetensors_header
        from .header import gguf_header, is_gguf
        ck = cls()
        for path in paths:
            if is_gguf(path):  # offsets from the file's start; data read the same way
                ck.gguf = True
                for name, e in gguf_header(path).items():
                    ck.entries[name] = (str(path), 0, e)
                continue
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
            for name, e in read_safetensors_header(path).items():
                ck.entries[name] = (str(path), 8 + n, e)
        return ck

    @classmethod
    def folder(cls, folder: str) -> "Checkpoint":
        return cls.open(sorted(set(checkpoint_files(folder).values())))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for (path, kind), h in self._handles.items():
            if kind == "fd":
                os.close(h)
            else:
                h.__exit__(None, None, None)
        self._handles.clear()

    def keys(self):
        return self.entries.keys()

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype as read: uint8 (its raw blocks) for a GGUF quantised one."""
        return _DTYPES.get(self.entries[name][2]["dtype"], torch.uint8)

    def qtype(self, name: str):
        """A GGUF quantised tensor's type name ("Q8_0", ...), else None."""
        from .gguf_types import QUANTISED
        t = self.entries[name][2]["dtype"]
        return t if self.gguf and t in QUANTISED else None

    def shape(self, name: str) -> list:
        return list(self.entries[name][2]["shape"])

    def _handle(self, path: str, kind: str):
        h = self._handles.get((path, kind))
        if h is None:
            if kind == "fd":
                h = os.open(path, os.O_RDONLY)
            else:
                from safetensors import safe_open
                h = safe_open(path, framework="pt", device="cpu").__enter__()
            self._handles[(path, kind)] = h
        return h

    def _span(self, name: str, r0=None, r1=None) -> tuple:
        """(path, file position, bytes, dtype, shape) of a tensor, or of its rows [r0, r1)
        (a row-major tensor's rows are one contiguous byte range); counted as one read."""
        path, start, e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        a, b = (int(v) for v in e["data_offsets"])
        shape = [int(v) for v in e["shape"]]
        if dtype is None and self.qtype(name):  # raw blocks: [rows, bytes per row]
            dtype = torch.uint8
            shape = gguf_byte_shape(e["dtype"], shape, b - a)
            if r0 is not None and len(shape) != 2:
                raise ValueError(f"{path}: {name!r} ({e['dtype']}) has rows that are not "
                                 f"whole blocks; it can only be read whole")
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {e['dtype']}, not supported")
        if r0 is not None and shape:
            row = (b - a) // shape[0] if shape[0] else 0
            a, b = a + r0 * row, a + r1 * row
            shape = [r1 - r0] + shape[1:]
        self.reads += 1
        self.bytes_read += b - a
        return path, start + a, b - a, dtype, shape

    def _pread(self, path, pos, n, dtype, shape, name) -> torch.Tensor:
        """Bytes into a host buffer that lives until the caller's copy (frombuffer shares
        it): no mapping, no second copy."""
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        buf = pread_bytes(self._handle(path, "fd"), pos, n, path, name)
        return torch.frombuffer(buf, dtype=dtype).view(shape)

    def read(self, name: str, device="cpu") -> torch.Tensor:
        """One tensor on `device`, in the file's dtype."""
        path, pos, n, dtype, shape = self._span(name)
        kind = torch.device(device).type
        if kind == "cpu" and not self.gguf:
            return self._handle(path, "mmap").get_tensor(name)
        if kind == "cuda":
            return self.staging(device).read(self._handle(path, "fd"), pos, n, dtype, shape,
                                             path, name)
        return self._pread(path, pos, n, dtype, shape, name).to(device)

    def staging(self, device):
        """The pinned buffers onto `device`, each the size of the largest tensor here up to
        staging.CHUNK."""
        if self._staging is not None and self._staging.device != torch.device(device):
            self._staging.close()
            self._staging = None
        if self._staging is None:
            from .staging import CHUNK, Staging
            largest = max((int(e["data_offsets"][1]) - int(e["data_offsets"][0])
                           for _, _, e in self.entries.values()), default=1)
            self._staging = Staging(device, min(CHUNK, largest))
        return self._staging

    def read_rows(self, name: str, r0=None, r1=None) -> torch.Tensor:
        """Rows [r0, r1) of a tensor (None, or a 0-dim tensor: whole) on the CPU in the
        file's dtype, by one positioned read of exactly those bytes and no mapping (weight
        sharding: a rank reads its rows only)."""
        return self._pread(*self._span(name, r0, r1), name)


def gguf_byte_shape(qtype: str, shape: list, nbytes: int) -> list:
    """The raw bytes of a quantised tensor as [rows, bytes per row] where each row along
    dim 0 is whole blocks (what row reads, row splits and weight sharding need), else flat."""
    from .gguf_types import TYPES
    _, block, size = TYPES[qtype]
    rows, numel = (shape[0] if shape else 1), 1
    for v in shape:
        numel *= int(v)
    if len(shape) >= 2 and rows and (numel // rows) % block == 0:
        return [rows, numel // rows // block * size]
    return [nbytes]


def checkpoint_files(folder: str) -> dict:
    """tensor name -> file, for a diffusers component folder (single or sharded)."""
    names = sorted(os.listdir(folder))
    index = [n for n in names if n.endswith(".safetensors.index.json")]
    if index:
        with open(os.path.join(folder, index[0])) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    files = [n for n in names if n.endswith(".safetensors")]
    if len(files) != 1:
        raise FileNotFoundError(f"{folder} has no safetensors weights (or several without an "
                                f"index)")
    from .header import read_safetensors_header
    path = os.path.join(folder, files[0])
    return {k: path for k in read_safetensors_header(path)}


def has_safetensors(folder: str) -> bool:
    try:
        checkpoint_files(folder)
        return True
    except (FileNotFoundError, OSError):
        return False


def device_name(device) -> str:
    """'cuda:0' for torch.device('cuda') (safetensors and mem_get_info want an index)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(d)
