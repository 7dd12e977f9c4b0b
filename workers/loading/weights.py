"""Weight loading straight to the device, and fp8 weight storage.

Loading: the transformer is built on the meta device from its config and every tensor is
read from the checkpoint on its own (a positioned read of its byte range, found through the
safetensors header), moved to this rank's device, cast, and assigned. No rank holds a host
copy of the model: host memory stays at the largest single tensor (FLUX.1: ~150 MB), and the
ranks can load at the same time. Plain reads rather than a memory map, so the file's pages
stay in the shared page cache and are not counted (or pinned) in each rank's RSS.

fp8: `FP8Linear` stores a Linear's weight as float8_e4m3fn plus an fp32 scale: one per output
channel where the pool quantises (`weights="fp8"` on a wider checkpoint: each row by its
own range, so a layer's few wide channels do not push its narrow ones into fp8's
subnormals; +3.6 dB on the trained test model, docs/performance.md#fp8), one per tensor as
fp8 files store it. Only
the Linears inside the transformer blocks are stored in fp8 (>98% of FLUX's weights);
embedders, norms and the final projection stay in the pool dtype. Each layer multiplies one
of two ways, chosen once at load (`set_fp8_compute`), never per call:
- fp8 matmul: `torch._scaled_mm` on e4m3fn activations quantized per token (row) with a
  dynamic scale amax(|row|) / 448, so FLUX's activation outliers (thousands) are not clipped;
  the weight's scale (per channel, or per tensor expanded) goes in as scale_b. Default on
  CUDA GPUs with fp8 tensor cores (compute capability >= 8.9) in bf16/fp16 pools.
- upcast: `w.to(x.dtype) * scale` per call, then an ordinary matmul (ComfyUI's scaled-fp8
  arithmetic without fp8 matmul): saves memory, not time. Everywhere else, and for layers
  whose in/out features are not multiples of 16 (what the CUDA kernels need).
`XDIT_FP8_COMPUTE=on|off|auto` (read once at worker start) overrides: `on` takes the fp8
matmul wherever the shapes allow, the CPU included (tests), `off` always upcasts.
"""
from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checkpoint import (  # noqa: F401 (imported from here by the loaders and tests)
    _DTYPES, Checkpoint, checkpoint_files, device_name, has_safetensors, pread_bytes)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
WEIGHT_MODES = ("auto", "fp8", "full")
FP8_COMPUTE = ("auto", "on", "off")  # XDIT_FP8_COMPUTE
FP8_MATMUL_TEXT = "fp8 matmul (scaled_mm, per-row activation scales)"


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


# ---- fp8 Linear ----------------------------------------------------------------------------
class FP8Linear(torch.nn.Linear):
    """A Linear whose weight is stored in float8_e4m3fn with its scale (per channel or per
    tensor, see the module docstring). By default it computes in the input's dtype,
    y = x @ (w.to(x.dtype) * scale).T + b; after
    `use_fp8_matmul()` it multiplies in fp8 instead (`fp8_linear`). A Linear subclass, so
    peft's LoRA wraps it like any Linear; `compute_dtype` (the pool dtype) is what peft reads
    to keep the LoRA matrices in that dtype instead of the weight's fp8."""

    def __init__(self, in_features, out_features, bias=True, device=None,
                 compute_dtype=torch.float32):
        torch.nn.Module.__init__(self)
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8, device="meta"), requires_grad=False)
        self.bias = None if not bias else torch.nn.Parameter(
            torch.empty(out_features, device="meta", dtype=compute_dtype), requires_grad=False)
        # not in the state dict: set by the loader (1.0 for unscaled fp8 files); a scalar
        # (a file's per-tensor scale) or [out_features, 1] (the pool's per-channel scales)
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device),
                             persistent=False)
        # set once at load (use_fp8_matmul), read per call as a plain bool: no per-call
        # decision on tensor values, no process-wide switch
        self.fp8_matmul = False
        self.register_buffer("scale_row", None, persistent=False)
        self.shared = None  # the block's SharedQuant (set_fp8_compute), or None

    def use_fp8_matmul(self, on: bool = True) -> None:
        """Multiply in fp8 from now on (or not). The weight scale is expanded here, once, to
        the [1, out_features] contiguous fp32 row that `_scaled_mm`'s row-wise mode takes
        for scale_b (it refuses a scalar or an expanded view there: a per-tensor scale is
        repeated, per-channel scales are that row already); call again if `scale` is
        replaced."""
        self.fp8_matmul = bool(on)
        self.scale_row = (self.scale.float().reshape(1, -1).expand(1, self.out_features)
                          .contiguous() if on else None)

    def dequantized(self, dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.scale.to(dtype)

    def forward(self, x):
        if self.fp8_matmul and x.dtype == self.compute_dtype:
            q = None
            if self.shared is not None and not torch.compiler.is_compiling():
                q = self.shared.get(x)  # compiled: inductor merges the identical passes
            return fp8_linear(x, self.weight, self.scale_row, self.bias, q)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self):
        return (super().extra_repr() + ", weight=float8_e4m3fn"
                + (", fp8 matmul" if self.fp8_matmul else ""))


def quantize_rows(x2: torch.Tensor) -> tuple:
    """[M, K] activations -> (e4m3fn [M, K], fp32 scale [M, 1]) with each row's absolute max
    mapped to fp8's max: a per-token scale, since one outlier token (FLUX has activations in
    the thousands, fp8 stops at 448) would otherwise be clipped or would flush every other
    token into fp8's subnormals. The scale is computed and applied in x's dtype (the
    division then writes a bf16 tensor, not an fp32 one: half the traffic of this pass) and
    handed to the matmul exactly as applied, so x8 * scale is x to fp8 rounding. All on the
    device: no host sync."""
    amax = torch.linalg.vector_norm(x2, float("inf"), dim=-1, keepdim=True)  # one pass
    s = (amax / FP8_MAX).clamp_min(torch.finfo(x2.dtype).tiny)  # all-zero rows: no 0/0
    return (x2 / s).to(FP8), s.float()


class SharedQuant:
    """One block's quantised activations, shared by its fp8 Linears: the Linears that read
    the same input tensor (q, k and v; a single block's attention and MLP input) quantise it
    once. Entries name their input by a weak reference (never keeping it alive) and are
    dropped when the block's forward ends (`set_fp8_compute` hooks it), so at most one
    block's quantised inputs are held at a time."""

    def __init__(self):
        self.entries: list = []  # (weakref to the input, its data pointer, (x8, scale))

    def get(self, x: torch.Tensor) -> tuple:
        for ref, ptr, q in self.entries:
            if ref() is x and x.data_ptr() == ptr:
                return q
        q = quantize_rows(x.reshape(-1, x.shape[-1]))
        self.entries.append((weakref.ref(x), x.data_ptr(), q))
        return q

    def clear(self, *_) -> None:
        self.entries.clear()


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale_row: torch.Tensor, bias=None,
               quantized=None):
    """x @ (w8 * scale).T + bias multiplied in fp8 by `torch._scaled_mm`: activations
    quantized per row (`quantize_rows`, scale_a [M, 1]; `quantized`: x's, already made for
    another Linear reading the same x), the weight's scales as scale_b [1, N]
    (row-wise mode takes both or neither as vectors); out in x's dtype, which the CUDA
    kernels also want for the bias."""
    shape = x.shape
    x8, sa = quantized if quantized is not None else quantize_rows(x.reshape(-1, shape[-1]))
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    out = torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=w_scale_row, bias=bias,
                           out_dtype=x.dtype)
    return out.reshape(*shape[:-1], w8.shape[0])


def fp8_matmul_choice(choice: str, device_type: str, capability=None, dtype=None) -> tuple:
    """(fp8 matmul or not, why) for a pool, from static facts. `choice` is XDIT_FP8_COMPUTE:
    "auto" multiplies in fp8 on CUDA GPUs with fp8 tensor cores (compute capability >= 8.9:
    Ada, Hopper, Blackwell) in a bf16/fp16 pool (the kernels' bias and output dtypes), where
    it beats upcasting the weight on the large layers; "on" wherever torch runs it (CPU
    included: tests), "off" never."""
    if choice not in FP8_COMPUTE:
        raise ValueError(f"XDIT_FP8_COMPUTE must be one of {', '.join(FP8_COMPUTE)} "
                         f"(got {choice!r})")
    if choice == "off":
        return False, "XDIT_FP8_COMPUTE=off"
    if device_type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        if choice == "on":
            raise ValueError("XDIT_FP8_COMPUTE=on needs a bf16 or fp16 pool on CUDA "
                             f"(got {dtype}); use auto or off")
        return False, "fp8 matmul needs a bf16 or fp16 pool"
    if choice == "on":
        return True, "XDIT_FP8_COMPUTE=on"
    if device_type != "cuda":
        return False, f"no fp8 matmul on {device_type} by default"
    if tuple(capability or (0, 0)) < (8, 9):
        return False, "this GPU has no fp8 tensor cores (compute capability < 8.9)"
    return True, "fp8 tensor cores"


def fp8_matmul_shape_ok(lin) -> bool:
    """The CUDA kernels need K and N to be multiples of 16 (the CPU does not; the same rule
    everywhere, so CPU tests take the branches a GPU would)."""
    return lin.in_features % 16 == 0 and lin.out_features % 16 == 0


@functools.lru_cache(maxsize=None)
def _row_wise_scaled_mm_runs(device: str, dtype) -> bool:
    """Whether this torch build runs row-wise `_scaled_mm` on `device` with this output and
    bias dtype: one 16x16 product, once per process, at load (torch's support differs by
    version and GPU generation; a failure here is a fallback, not a crash mid-job)."""
    try:
        a = torch.ones(16, 16, device=device).to(FP8)
        out = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                               scale_b=torch.ones(1, 16, device=device),
                               bias=torch.zeros(16, device=device, dtype=dtype), out_dtype=dtype)
        return bool((out.float() == 16).all())
    except (RuntimeError, ValueError, NotImplementedError, TypeError):
        return False


def set_fp8_compute(transformer, choice: str, device, dtype) -> dict:
    """Choose, once at load, how each FP8Linear of `transformer` multiplies (see the module
    docstring) and say so: {"fp8_layers", "fp8_matmul_layers", "text"}; text is what the
    pool's status shows (None when no layer is fp8)."""
    d = torch.device(device)
    cap = torch.cuda.get_device_capability(d) if d.type == "cuda" else None
    on, why = fp8_matmul_choice(choice, d.type, cap, dtype)
    if on and not _row_wise_scaled_mm_runs(device_name(d), dtype):
        if choice == "on":
            raise RuntimeError(f"XDIT_FP8_COMPUTE=on: torch {torch.__version__} does not run "
                               f"row-wise torch._scaled_mm on {device_name(d)}; use auto or off")
        on, why = False, f"torch {torch.__version__} has no row-wise scaled_mm here"
    layers = [m for m in transformer.modules() if isinstance(m, FP8Linear)]
    n_mm = 0
    for lin in layers:
        lin.use_fp8_matmul(on and fp8_matmul_shape_ok(lin))
        n_mm += lin.fp8_matmul
    if n_mm:
        share_quantization(transformer)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype))
    if not layers:
        text = None
    elif n_mm == len(layers):
        text = f"fp8 weights, {FP8_MATMUL_TEXT}"
    elif n_mm:
        text = (f"fp8 weights, {FP8_MATMUL_TEXT} in {n_mm} of {len(layers)} layers, the rest "
                f"(features not multiples of 16) upcast to {name} per call")
    else:
        text = f"fp8 weights, upcast to {name} per call ({why})"
    return {"fp8_layers": len(layers), "fp8_matmul_layers": n_mm, "text": text}


def share_quantization(transformer) -> int:
    """One SharedQuant per block (the modules "<list>.<index>" holding fp8-matmul Linears),
    emptied by a hook when the block's forward ends; returns the number of blocks."""
    groups: dict = {}
    for name, m in transformer.named_modules():
        if isinstance(m, FP8Linear) and m.fp8_matmul:
            parts = name.split(".")
            block = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else name
            groups.setdefault(block, []).append(m)
    for block, lins in groups.items():
        shared = SharedQuant()
        for lin in lins:
            lin.shared = shared
        transformer.get_submodule(block).register_forward_hook(shared.clear)
    return len(groups)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps a weight's (or a channel's) absolute max to fp8's max (the
    scaled-fp8 recipe: most of a weight would otherwise fall into fp8's subnormals)."""
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


def quantize(w: torch.Tensor) -> tuple:
    """(fp8 weight, fp32 scalar scale): one scale for the tensor, as scaled-fp8 files store
    it (`testmodels/fp8_file.py` writes such files)."""
    w32 = w.float()
    scale = fp8_scale(w32.abs().max())
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


def quantize_channels(w: torch.Tensor) -> tuple:
    """(fp8 weight, fp32 scales [rows, 1]): each output channel (row) mapped by its own
    absolute max, what the pool stores for `weights="fp8"`. A row's scale depends on that
    row alone, so rows quantised apart (the shard loader's) equal the whole tensor's."""
    w32 = w.float()
    scale = fp8_scale(w32.abs().amax(dim=-1, keepdim=True))
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(-1, 1)


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


def fp8_layers(transformer, lists, names, dtype, device) -> dict:
    """Swap the block Linears named in `names` (module names) for FP8Linear computing in
    `dtype`, weight and bias still to be assigned (their scale buffer on `device`);
    {module name: FP8Linear}. Every loader makes its fp8 layers here."""
    out = {}
    for name, lin in block_linears(transformer, lists).items():
        if name in names:
            out[name] = FP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  device=device, compute_dtype=dtype)
            _set_module(transformer, name, out[name])
    return out


# ---- assembling a model --------------------------------------------------------------------
@dataclass
class LoadReport:
    weights: str  # "fp8" (block Linears in fp8) | "gguf" (Linears in GGUF blocks) | "full"
    checkpoint_fp8: bool = False  # the checkpoint stores (some) weights in fp8
    checkpoint_scaled: bool = False  # ... with per-tensor scale_weight tensors
    fp8_layers: int = 0
    gguf_layers: int = 0
    transformer_bytes: int = 0
    tensors_read: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def unscaled(t: torch.Tensor, scale) -> torch.Tensor:
    """A checkpoint tensor as `quantize_channels` takes it: an fp8 one dequantized to fp32."""
    return dequantize(t, scale, torch.float32) if is_fp8(t) else t


def prepare(t: torch.Tensor, scale, fp8_ok: bool, mode: str, dtype) -> tuple:
    """One checkpoint tensor (on the device) -> (stored tensor, scale or None).

    A block Linear's weight (`fp8_ok`) stays fp8 when the checkpoint has it in e4m3fn
    ("auto", "fp8") and is quantized per channel when "fp8" asks for it; everything else is
    cast to `dtype`,
    fp8 tensors dequantized with their scale ("full" dequantizes every one)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES} (got {mode!r})")
    if scale is not None:
        scale = scale.to(device=t.device, dtype=torch.float32).reshape(())
    if fp8_ok and mode != "full":
        if t.dtype == FP8:
            return t, scale
        if mode == "fp8":
            return quantize_channels(unscaled(t, scale))
    if is_fp8(t) or scale is not None:
        return dequantize(t, scale, torch.float32).to(dtype), None
    return (t.to(dtype) if t.is_floating_point() else t), None


def load_tensors(transformer, lists, source, dtype, mode: str) -> LoadReport:
    """Fill a meta-built transformer (in place) from `source`: (diffusers name, tensor
    already on the device in the checkpoint's dtype, its scale_weight or None), consumed one
    at a time, so only the finished weights accumulate. Linears inside the block lists that
    end up with fp8 weights become FP8Linear; a QuantWeight (a GGUF file's Linear weight,
    workers/loading/gguf_load.py) makes its Linear a GGUFLinear holding the blocks. Strict: a missing, extra or misshapen tensor
    raises. Loading onto device "meta" is a dry run (the host cost of loading, measured by
    tests: the same as onto a GPU)."""
    from .gguf_load import QuantWeight, gguf_layers
    cands = block_linears(transformer, lists)
    state, scales, quant = {}, {}, {}
    for name, t, scale in source:
        mod = name.rpartition(".")[0]
        if isinstance(t, QuantWeight):  # a Linear kept in GGUF blocks (gguf_load.py)
            state[name], quant[name] = t.raw, t
            continue
        w, s = prepare(t, scale, name.endswith(".weight") and mod in cands, mode, dtype)
        del t
        state[name] = w
        if w.dtype == FP8:
            scales[mod] = s
    device = next(iter(state.values())).device if state else "meta"
    for mod, fp8 in fp8_layers(transformer, lists, scales, dtype, device).items():
        if scales[mod] is not None:
            fp8.scale = scales[mod]
    gguf_layers(transformer, quant, dtype)
    transformer.requires_grad_(False)
    dry = bool(state) and all(t.is_meta for t in state.values())  # a dry run onto "meta"
    want = set(transformer.state_dict())
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:  # one line (load_state_dict's own error spans several)
        what = [f"lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}"] \
            if missing else []
        what += [f"has {len(extra)} tensor(s) it has no place for, e.g. {extra[:3]}"] \
            if extra else []
        raise ValueError(f"the checkpoint {' and '.join(what)}: an incomplete or other "
                         f"model's file; give a complete {type(transformer).__name__}")
    transformer.load_state_dict(state, strict=True, assign=True)
    del state
    left = [n for n, t in list(transformer.named_parameters()) +
            list(transformer.named_buffers()) if t.device.type == "meta"]
    if left and not dry:
        raise ValueError(f"tensors not in the checkpoint: {left[:3]}")
    transformer.eval().requires_grad_(False)
    return LoadReport(weights="fp8" if scales else "gguf" if quant else "full",
                      fp8_layers=len(scales), gguf_layers=len(quant),
                      transformer_bytes=parameter_bytes(transformer))


def to_fp8(transformer, lists) -> int:
    """Quantize a loaded transformer's block Linears in place (checkpoints that are not
    safetensors, loaded the old way). Returns the number of layers."""
    linears = block_linears(transformer, lists)
    if not linears:
        return 0
    first = next(iter(linears.values())).weight
    for name, fp8 in fp8_layers(transformer, lists, linears, first.dtype, first.device).items():
        lin = linears[name]
        w, fp8.scale = quantize_channels(lin.weight.data)
        fp8.weight = torch.nn.Parameter(w, requires_grad=False)
        if lin.bias is not None:
            fp8.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
    return len(linears)


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

    from .header import read_safetensors_header
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
