"""The header reader: a file's tensor names, dtypes, shapes and byte ranges, with one clear
error for a file that is not safetensors (or GGUF) or is cut short. Every loader and the
host's model detection read headers through it.

GGUF files as ComfyUI-GGUF writes them (a diffusion transformer's tensors under their
original single-file names, some quantised in blocks: workers/loading/gguf_quant.py) are
read with the `gguf` package into the same entries, so family detection, config derivation
and the loaders treat both alike. Differences: "dtype" is the GGUF type name ("Q8_0", "F16",
...), "shape" is the tensor's own shape (GGUF stores dimensions innermost first, and
ComfyUI-GGUF records the shape of a tensor it flattened as `comfy.gguf.orig_shape.<name>`),
and "data_offsets" count from the start of the file. The data is read by positioned reads
(workers/loading/checkpoint.py), never through the package's memory map."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from .. import families
from .gguf_types import NAME_OF, tensor_bytes


class ModelFileError(ValueError):
    """A path that is not a usable model; the message is one user-facing line."""


_MAX_HEADER = 100 * 2 ** 20  # the format's own limit


def read_safetensors_header(path) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} of a .safetensors file (metadata under
    "__metadata__" dropped), or of a GGUF file. A file that is not safetensors, or is truncated, raises one
    ModelFileError naming the file."""
    p = Path(path)
    if is_gguf(p):  # ComfyUI-GGUF's files: the same entries
        return gguf_header(p)
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


# ---- GGUF ------------------------------------------------------------------------------------
MAGIC = b"GGUF"
ORIG_SHAPE = "comfy.gguf.orig_shape."


def is_gguf(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _field_value(field):
    """A reader field's value: a string, a number or a list of either."""
    import gguf
    vals = [field.parts[i] for i in field.data]
    if field.types and field.types[-1] == gguf.GGUFValueType.STRING:
        vals = [bytes(v).decode("utf-8") for v in vals]
    else:
        vals = [v.tolist()[0] if len(v) == 1 else v.tolist() for v in vals]
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        return vals
    return vals[0] if vals else None


def read_gguf(path) -> tuple:
    """(header, metadata) of a GGUF file: the header as described above, the metadata
    {key: value} (strings and numbers; e.g. "general.architecture")."""
    p = Path(path)
    try:
        import gguf
        reader = gguf.GGUFReader(str(p), "r")
    except ImportError:
        raise ModelFileError(f"{str(p)!r} is a GGUF file: install the gguf package "
                             f"(pip install gguf) to load it") from None
    except (ValueError, OSError, IndexError) as e:
        raise ModelFileError(f"{str(p)!r} is not a valid GGUF file ({e}); re-download it") \
            from None
    meta = {k: _field_value(f) for k, f in reader.fields.items()
            if not k.startswith("GGUF.")}
    size = p.stat().st_size
    header = {}
    for t in reader.tensors:
        qtype = NAME_OF.get(int(t.tensor_type))
        if qtype is None:
            raise ModelFileError(f"{str(p)!r}: tensor {t.name!r} is stored as GGUF type "
                                 f"{getattr(t.tensor_type, 'name', t.tensor_type)}, which "
                                 f"this loader does not read (it reads "
                                 f"{', '.join(sorted(set(NAME_OF.values())))})")
        shape = meta.get(ORIG_SHAPE + t.name)
        shape = [int(v) for v in (shape if shape is not None else reversed(t.shape.tolist()))]
        start = int(t.data_offset)
        end = start + int(t.n_bytes)
        if end > size or int(t.n_bytes) != tensor_bytes(qtype, shape):
            raise ModelFileError(f"{str(p)!r}: tensor {t.name!r} does not fit the file "
                                 f"(truncated download?); re-download it")
        header[t.name] = {"dtype": qtype, "shape": shape, "data_offsets": [start, end]}
    if not header:
        raise ModelFileError(f"{str(p)!r} holds no tensors")
    return header, meta


def gguf_header(path) -> dict:
    return read_gguf(path)[0]
