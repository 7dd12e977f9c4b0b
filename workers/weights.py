"""Weight loading straight to the device, and fp8 weight storage.

Loading: the transformer is built on the meta device from its config and every tensor is
read from the checkpoint on its own (a positioned read of its byte range, found through the
safetensors header), moved to this rank's device, cast, and assigned. No rank holds a host
copy of the model: host memory stays at the largest single tensor (FLUX.1: ~150 MB), and the
ranks can load at the same time. Plain reads rather than a memory map, so the file's pages
stay in the shared page cache and are not counted (or pinned) in each rank's RSS.

fp8: `FP8Linear` stores a Linear's weight as float8_e4m3fn plus a per-tensor fp32 scale and
computes in the activations' dtype by upcasting per call (`w.to(x.dtype) * scale`), the same
arithmetic as ComfyUI's scaled-fp8 layers without fp8 matmul. Only the Linears inside the
transformer blocks are stored in fp8 (>98% of FLUX's weights); embedders, norms and the final
projection stay in the pool dtype.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
WEIGHT_MODES = ("auto", "fp8", "full")

# safetensors dtype names -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


# ---- reading -------------------------------------------------------------------------------
def pread_bytes(fd: int, pos: int, n: int, path: str, name: str) -> bytearray:
    """n bytes at `pos` of an open file, read in place into one buffer (a tensor's bytes
    straight from its byte range: no mapping, no second copy)."""
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = os.preadv(fd, [view], pos)
        if got <= 0:
            raise ValueError(f"{path}: tensor {name!r} is truncated")
        view, pos = view[got:], pos + got
    return buf


@dataclass
class Checkpoint:
    """The tensors of one safetensors file or a sharded diffusers folder, read one at a time.

    Onto the CPU through safetensors' `safe_open` (a lazy memory map: a tensor already in the
    wanted dtype is used in place, as diffusers does). Onto any other device by a positioned
    read of the tensor's bytes into a host buffer that lives only for the copy, so a GPU rank
    holds at most one tensor on the host and maps nothing (a map's touched pages would count
    in every rank's RSS until the file is closed: 24 GB for FLUX.1-dev). Each file is opened
    once per load; use as a context manager (or call close())."""

    entries: dict = field(default_factory=dict)  # name -> (path, data start, header entry)
    reads: int = 0  # tensors read so far
    bytes_read: int = 0
    _handles: dict = field(default_factory=dict)  # (path, "mmap" | "fd") -> open handle

    @classmethod
    def open(cls, paths) -> "Checkpoint":
        from .models.detect import read_safetensors_header
        ck = cls()
        for path in paths:
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
        for (path, kind), h in self._handles.items():
            if kind == "fd":
                os.close(h)
            else:
                h.__exit__(None, None, None)
        self._handles.clear()

    def keys(self):
        return self.entries.keys()

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name][2]["dtype"]]

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

    def read(self, name: str, device="cpu") -> torch.Tensor:
        """One tensor on `device`, in the file's dtype."""
        path, start, e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {e['dtype']}, not supported")
        a, b = (int(v) for v in e["data_offsets"])
        shape = [int(v) for v in e["shape"]]
        self.reads += 1
        self.bytes_read += b - a
        if torch.device(device).type == "cpu":
            return self._handle(path, "mmap").get_tensor(name)
        if b == a:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = pread_bytes(self._handle(path, "fd"), start + a, b - a, path, name)
        # frombuffer shares `buf`; the copy to the device is its only use
        return torch.frombuffer(buf, dtype=dtype).view(shape).to(device)


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
    from .models.detect import read_safetensors_header
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


# ---- fp8 Linear ----------------------------------------------------------------------------
class FP8Linear(torch.nn.Linear):
    """A Linear whose weight is stored in float8_e4m3fn with a per-tensor scale; computes in
    the input's dtype: y = x @ (w.to(x.dtype) * scale).T + b. A Linear subclass, so peft's
    LoRA wraps it like any Linear; `compute_dtype` (the pool dtype) is what peft reads to
    keep the LoRA matrices in that dtype instead of the weight's fp8."""

    def __init__(self, in_features, out_features, bias=True, device=None,
                 compute_dtype=torch.float32):
        torch.nn.Module.__init__(self)
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8, device="meta"), requires_grad=False)
        self.bias = None if not bias else torch.nn.Parameter(
            torch.empty(out_features, device="meta"), requires_grad=False)
        # not in the state dict: set by the loader (1.0 for unscaled fp8 files)
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device),
                             persistent=False)

    def dequantized(self, dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.scale.to(dtype)

    def forward(self, x):
        if FP8_MATMUL and _scaled_mm_ok(x, self):
            return _scaled_mm_linear(x, self)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self):
        return super().extra_repr() + ", weight=float8_e4m3fn"


# Opt-in (XDIT_FP8_MATMUL=1): fp8 x fp8 matmuls through torch._scaled_mm on GPUs that have
# them (sm89+), activations cast to e4m3fn unscaled as ComfyUI's fp8 matmul does. NOT tested
# here (no GPU in CI); off by default, where weights are upcast per call.
FP8_MATMUL = os.environ.get("XDIT_FP8_MATMUL", "") == "1"


def _scaled_mm_ok(x, lin) -> bool:
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return lin.in_features % 16 == 0 and lin.out_features % 16 == 0


def _scaled_mm_linear(x, lin):
    shape = x.shape
    x8 = x.reshape(-1, shape[-1]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    one = torch.ones((), device=x.device, dtype=torch.float32)
    bias = None if lin.bias is None else lin.bias.to(x.dtype)
    out = torch._scaled_mm(x8, lin.weight.t(), scale_a=one, scale_b=lin.scale.float(),
                           bias=bias, out_dtype=x.dtype)
    return out.reshape(*shape[:-1], lin.out_features)


def quantize(w: torch.Tensor) -> tuple:
    """(fp8 weight, fp32 scale) with the tensor's absolute max mapped to fp8's max (the
    scaled-fp8 recipe: most of a weight would otherwise fall into fp8's subnormals)."""
    w32 = w.float()
    amax = w32.abs().max()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


def dequantize(w: torch.Tensor, scale, dtype) -> torch.Tensor:
    """An fp8 tensor (with its scale, or None) in `dtype`, in FP8Linear's arithmetic."""
    out = w.to(dtype)
    return out if scale is None else out * scale.to(device=out.device, dtype=dtype)


def block_linears(transformer, lists) -> dict:
    """{module name: Linear} of the Linears inside the block lists (what fp8 may store)."""
    out = {}
    for lst in lists:
        for name, mod in transformer.named_modules():
            if name.startswith(lst + ".") and type(mod) is torch.nn.Linear:
                out[name] = mod
    return out


def _set_module(root, name: str, mod) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, mod)


# ---- assembling a model --------------------------------------------------------------------
@dataclass
class LoadReport:
    weights: str  # "fp8" (block Linears in fp8) | "full" (everything in the pool dtype)
    checkpoint_fp8: bool = False  # the checkpoint stores (some) weights in fp8
    checkpoint_scaled: bool = False  # ... with per-tensor scale_weight tensors
    fp8_layers: int = 0
    transformer_bytes: int = 0
    tensors_read: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def prepare(t: torch.Tensor, scale, fp8_ok: bool, mode: str, dtype) -> tuple:
    """One checkpoint tensor (on the device) -> (stored tensor, scale or None).

    A block Linear's weight (`fp8_ok`) stays fp8 when the checkpoint has it in e4m3fn
    ("auto", "fp8") and is quantized when "fp8" asks for it; everything else is cast to
    `dtype`, fp8 tensors dequantized with their scale ("full" dequantizes every one)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES} (got {mode!r})")
    if scale is not None:
        scale = scale.to(device=t.device, dtype=torch.float32).reshape(())
    if fp8_ok and mode != "full":
        if t.dtype == FP8:
            return t, scale
        if mode == "fp8":
            return quantize(dequantize(t, scale, torch.float32) if is_fp8(t) else t)
    if is_fp8(t) or scale is not None:
        return dequantize(t, scale, torch.float32).to(dtype), None
    return (t.to(dtype) if t.is_floating_point() else t), None


def load_tensors(transformer, lists, source, dtype, mode: str) -> LoadReport:
    """Fill a meta-built transformer (in place) from `source`: (diffusers name, tensor
    already on the device in the checkpoint's dtype, its scale_weight or None), consumed one
    at a time, so only the finished weights accumulate. Linears inside the block lists that
    end up with fp8 weights become FP8Linear. Strict: a missing, extra or misshapen tensor
    raises. Loading onto device "meta" is a dry run (the host cost of loading, measured by
    tests: the same as onto a GPU)."""
    cands = block_linears(transformer, lists)
    state, scales = {}, {}
    for name, t, scale in source:
        mod = name.rpartition(".")[0]
        w, s = prepare(t, scale, name.endswith(".weight") and mod in cands, mode, dtype)
        del t
        state[name] = w
        if w.dtype == FP8:
            scales[mod] = s
    for mod, s in scales.items():
        lin = cands[mod]
        fp8 = FP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                        device=state[mod + ".weight"].device, compute_dtype=dtype)
        if s is not None:
            fp8.scale = s
        _set_module(transformer, mod, fp8)
    transformer.requires_grad_(False)
    dry = bool(state) and all(t.is_meta for t in state.values())  # a dry run onto "meta"
    transformer.load_state_dict(state, strict=True, assign=True)
    del state
    left = [n for n, t in list(transformer.named_parameters()) +
            list(transformer.named_buffers()) if t.device.type == "meta"]
    if left and not dry:
        raise ValueError(f"tensors not in the checkpoint: {left[:3]}")
    transformer.eval().requires_grad_(False)
    return LoadReport(weights="fp8" if scales else "full", fp8_layers=len(scales),
                      transformer_bytes=parameter_bytes(transformer))


def to_fp8(transformer, lists) -> int:
    """Quantize a loaded transformer's block Linears in place (checkpoints that are not
    safetensors, loaded the old way). Returns the number of layers."""
    n = 0
    for name, lin in block_linears(transformer, lists).items():
        w, s = quantize(lin.weight.data)
        fp8 = FP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                        device=w.device, compute_dtype=lin.weight.dtype)
        fp8.weight = torch.nn.Parameter(w, requires_grad=False)
        if lin.bias is not None:
            fp8.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
        fp8.scale = s
        _set_module(transformer, name, fp8)
        n += 1
    return n


def load_folder(transformer, lists, folder: str, device, dtype, mode: str,
                names=None) -> LoadReport:
    """A meta-built diffusers transformer from its folder's safetensors (one file or shards),
    tensor by tensor to `device`. `names`: read only these (a PipeFusion stage's)."""
    dev = device_name(device)
    with Checkpoint.folder(folder) as ck:
        keys = list(ck.keys()) if names is None else list(names)
        missing = [k for k in keys if k not in ck.entries]
        if missing:
            raise KeyError(f"checkpoint {folder} lacks {len(missing)} tensors, e.g. "
                           f"{missing[:3]}")
        report = load_tensors(transformer, lists, ((k, ck.read(k, dev), None) for k in keys),
                              dtype, mode)
    report.checkpoint_fp8 = any(ck.dtype(k) in (torch.float8_e4m3fn, torch.float8_e5m2)
                                for k in ck.keys())
    report.tensors_read, report.bytes_read = ck.reads, ck.bytes_read
    return report


def parameter_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ---- where the text encoders run -----------------------------------------------------------
TEXT_ENCODER_MARGIN = 2 * 2 ** 30


def text_encoder_device(option: str, device, free_bytes=None, encoder_bytes=0,
                        margin: int = TEXT_ENCODER_MARGIN) -> str:
    """Rank 0's text-encoder device. "cpu" / "gpu" (rank 0's GPU) / "cuda:N" are taken as
    given (on a CPU pool only "cpu" and "auto" are valid); "auto" is rank 0's GPU when its
    free memory after the transformer load holds the encoders plus `margin`, else the CPU."""
    d = torch.device(device)
    option = str(option or "auto")
    if d.type != "cuda":
        if option not in ("auto", "cpu"):
            raise ValueError(f"text_encoders {option!r} needs a CUDA pool; use auto or cpu")
        return "cpu"
    if option == "cpu":
        return "cpu"
    if option == "gpu":
        return device_name(d)
    if option.startswith("cuda:"):
        return option
    if option != "auto":
        raise ValueError(f"text_encoders must be auto, cpu, gpu or cuda:N (got {option!r})")
    if free_bytes is not None and free_bytes >= encoder_bytes + margin:
        return device_name(d)
    return "cpu"


def folder_tensor_bytes(folders, dtype) -> int:
    """Bytes the floating tensors of these diffusers component folders take in `dtype`
    (from the safetensors headers; nothing is read)."""
    import math

    from .models.detect import read_safetensors_header
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for folder in folders:
        if not os.path.isdir(folder):
            continue
        for fn in os.listdir(folder):
            if fn.endswith(".safetensors"):
                for e in read_safetensors_header(os.path.join(folder, fn)).values():
                    n = math.prod(int(v) for v in e["shape"])
                    total += n * (size if e["dtype"].startswith(("F", "BF")) else
                                  _DTYPES.get(e["dtype"], torch.uint8).itemsize)
    return total
