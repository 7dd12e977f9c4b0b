"""The safetensors header reader: a file's tensor names, dtypes, shapes and byte ranges,
with one clear error for a file that is not safetensors or is cut short. Every loader and the
host's model detection read headers through it."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from .. import families


class ModelFileError(ValueError):
    """A path that is not a usable model; the message is one user-facing line."""


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
        raise ModelFileError(f"{str(p)!r} holds no tensors; give a transformer file "
                             f"({families.names()})")
    return header
