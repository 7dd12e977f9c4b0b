"""Weight sharding (`EngineOptions.shard_weights`, `--shard-weights`): torch's FSDP2 over the
pool, so a model larger than one GPU runs exactly with Ulysses, Ring, hybrid, CFG and DP.

What is sharded: every block of the adapter's block lists (FLUX `transformer_blocks` +
`single_transformer_blocks`, SD3 `transformer_blocks`) is its own `fully_shard` unit, and the
transformer itself is the root unit, which shards what is left (embedders, `norm_out`,
`proj_out`). Every parameter is split on dim 0 over the whole world (one 1-D device mesh on a
process group of its own, so FSDP's all-gathers never interleave with the other data-plane
traffic of the world group). Between forwards a rank holds 1/N of every weight (plus FSDP's
dim-0 padding).

What happens in a forward: the root's pre-forward all-gathers the non-block parameters (kept
for the whole forward, freed after it: `reshard_after_forward=True` is set explicitly, which
also overrides FSDP's "root stays unsharded" default) and prefetches block 0; each block's
pre-forward waits for its own all-gather and issues the next block's
(`set_modules_to_forward_prefetch`, a chain in execution order), so the next gather overlaps
this block's compute; its post-forward frees the gathered weights. Peak: 1/N of the weights
+ the non-block weights + two gathered blocks (this one and the prefetched one).

Exactness: an all-gather copies bits, so each block computes with exactly the weights of the
unsharded model; nothing in the arithmetic changes.

The rule that keeps it from deadlocking: FSDP's all-gathers are collectives over the whole
world, so every rank must run every block's forward the same number of times, in the same
order. The denoising loop does (CFG parallel: one branch per rank per step; DP with uneven
batches: every replica steps every tick); host-sampler calls (workers/model_call.py) run a
dummy one-row forward on a replica that got no rows. PipeFusion (each rank runs only its
stage's blocks) is refused, and so is `compile` (not validated with FSDP's hooks).

LoRA: peft wraps a block's Linear in a LoRA layer that keeps the original Linear as
`base_layer`; FSDP keeps managing that Linear's (sharded) weight, so the base weight is
gathered as before, and the small LoRA A/B matrices are ordinary, replicated parameters
beside it. The result equals the unsharded model with the same adapters.

Loading fits the sharding (`ShardSetup`, set up before the load): for a diffusers folder with
safetensors the transformer is built on the meta device, sharded there, materialised as
shards only (`to_empty`), and each rank reads just its rows of each tensor (FSDP2's dim-0
chunks: rows of a row-major tensor are one contiguous byte range, one positioned read), cast
to the pool dtype. No rank ever holds a whole weight, host or device; together the ranks read
each parameter byte once. Buffers (SD3's positional table) are not parameters: FSDP leaves
them whole, so every rank reads and holds them. `weights=fp8` quantizes each rank's rows with
the whole tensor's scale (one all-reduce of the maxima; the fp8 weights' rows are read twice),
exactly as the whole loader does. Single files (ComfyUI/BFL names, FLUX and SD3) load the
same way: `single_file.row_map` runs the whole loader's conversion on index tensors, so each
diffusers tensor is known as row ranges of file tensors (a fused qkv / linear1 part: its row
offset in the fused tensor; FLUX's final modulation: two halves swapped), and a rank reads only
the file rows its chunk maps to. fp8 checkpoints (folders or files, scaled or not): a block
Linear's float8_e4m3fn weight stays fp8 (weights auto/fp8, as the whole loader keeps it), a rank
reads its fp8 rows and the per-tensor scale_weight (a scalar) whole; other fp8 tensors are
dequantized row by row. .bin weights are loaded whole (tensor by tensor, workers/weights.py),
then sharded; `counts()["load"]` says which happened.

Counted for `status` and the job stats (`counts()`): block parameters in total, held by this
rank at rest, and measured during forwards (after a block's reshard, with the next block's
prefetch in flight; and the peak inside a block); all-gather elements and bytes per forward.
"""
from __future__ import annotations

from typing import Optional

import torch

PIPEFUSION_REFUSED = ("shard_weights cannot be combined with PipeFusion: PipeFusion already "
                      "splits the blocks over its stages, and each stage runs only its own "
                      "blocks, so FSDP's all-gathers over every rank would never line up; "
                      "launch the pool without pipefusion (Ulysses, Ring, CFG and DP combine "
                      "with shard_weights), or without shard_weights")
COMPILE_REFUSED = ("shard_weights and compile together are not supported yet (compile has "
                   "not been validated with FSDP's hooks); launch with one of them")


def check(shard_weights: bool, pipefusion: int, compile: bool = False) -> None:
    """Raise the one clear message for a launch sharding cannot serve (worker side)."""
    if not shard_weights:
        return
    if pipefusion > 1:
        raise ValueError(PIPEFUSION_REFUSED)
    if compile:
        raise ValueError(COMPILE_REFUSED)


def is_sharded(module) -> bool:
    """Whether `module` is an FSDP2 unit (its forwards then take part in collectives)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, FSDPModule)


def _groups(module) -> list:
    """The FSDPParamGroups of one fully_shard unit (torch internals, for counting only)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return list(groups)


def _held(tensor) -> int:
    """Elements whose storage is allocated now (FSDP frees by resizing the storage to 0)."""
    try:
        if tensor.untyped_storage().size() == 0:
            return 0
    except Exception:  # noqa: BLE001
        return 0
    return int(tensor.numel())


def _group_elems(group) -> tuple:
    """(local shard elements, gathered elements allocated now) of one FSDPParamGroup."""
    shard, gathered = 0, 0
    for fp in group.fsdp_params:
        shard += int(fp._sharded_param_data.numel())
        for t in getattr(fp, "all_gather_outputs", []) or []:
            gathered += _held(t)
    pending = getattr(group, "_all_gather_result", None)  # a prefetch in flight
    if pending is not None and not gathered:
        # its flat receive buffer (bytes when the dtypes are mixed, e.g. fp8 + bias): count
        # the parameters it will hold, so every figure here is in parameter elements
        out = getattr(pending, "all_gather_output", None)
        if out is not None and _held(out):
            gathered += sum(int(torch.Size(fp._orig_size).numel()) for fp in group.fsdp_params)
    return shard, gathered


class WeightSharding:
    """fully_shard over the blocks and the root of one transformer, with the counters."""

    def __init__(self, transformer, block_lists, group, device):
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.world = dist.get_world_size(group)
        self.group = group
        self.mesh = DeviceMesh.from_group(group, torch.device(device).type)
        self.blocks = [b for name in block_lists for b in getattr(transformer, name)]
        if not self.blocks:
            raise RuntimeError("no transformer blocks to shard")
        self.block_numels = [sum(p.numel() for p in b.parameters()) for b in self.blocks]
        self.block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters())
                            for b in self.blocks]
        block_ids = {id(p) for b in self.blocks for p in b.parameters()}
        rest = [p for p in transformer.parameters() if id(p) not in block_ids]
        self.root_numel = sum(p.numel() for p in rest)
        self.root_bytes = sum(p.numel() * p.element_size() for p in rest)
        for b in self.blocks:
            fully_shard(b, mesh=self.mesh, reshard_after_forward=True)
        fully_shard(transformer, mesh=self.mesh, reshard_after_forward=True)
        self.transformer = transformer
        # explicit prefetch chain, in execution order: root -> block 0 -> block 1 -> ...
        transformer.set_modules_to_forward_prefetch([self.blocks[0]])
        for a, b in zip(self.blocks, self.blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
        self.forwards = 0  # transformer forwards run while sharded
        self.block_forwards = 0
        self.gathered_elems = 0  # elements all-gathered (whole tensors) so far
        self._numel = {id(b): n for b, n in zip(self.blocks, self.block_numels)}
        self.peak_in_block = self.peak_between = None  # measured only on request (tests)
        self._hooks = [b.register_forward_pre_hook(self._count_block) for b in self.blocks]
        self._hooks.append(transformer.register_forward_pre_hook(self._enter))

    # ---- counting ---------------------------------------------------------------------------
    def measure_residency(self) -> None:
        """Track the block weights allocated on this rank inside and between blocks (tests:
        the prefetch is in flight, gathered blocks are freed). Each reading walks every
        block's FSDP groups, so it is never on in production, where it would put
        O(blocks^2) Python into every forward and hold up FSDP2's prefetch."""
        if self.peak_in_block is not None:
            return
        self.peak_in_block = self.peak_between = 0
        for b in self.blocks:
            self._hooks.append(b.register_forward_pre_hook(self._in_block))
            self._hooks.append(b.register_forward_hook(self._after_block))

    def _block_resident(self) -> int:
        total = 0
        for b in self.blocks:
            for g in _groups(b):
                s, u = _group_elems(g)
                total += s + u
        return total

    def _enter(self, module, args):
        self.forwards += 1
        self.gathered_elems += self.root_numel

    def _count_block(self, module, args):
        self.block_forwards += 1
        self.gathered_elems += self._numel[id(module)]

    def _in_block(self, module, args):  # after FSDP's own pre-forward: gathered + prefetch
        self.peak_in_block = max(self.peak_in_block, self._block_resident())

    def _after_block(self, module, args, output):  # after FSDP's post-forward: resharded
        self.peak_between = max(self.peak_between, self._block_resident())

    def local_block_elems(self) -> int:
        """Block parameter elements this rank holds between forwards (its shards)."""
        return sum(_group_elems(g)[0] for b in self.blocks for g in _groups(b))

    def local_root_elems(self) -> int:
        return sum(_group_elems(g)[0] for g in _groups(self.transformer))

    def counts(self) -> dict:
        n = self.world
        total = sum(self.block_numels)
        block_gather = sum(self.block_bytes)
        return {
            "ranks": n,
            "load": getattr(self, "load_mode", None),
            "block_params": total,
            "largest_block_params": max(self.block_numels),
            "block_params_local": self.local_block_elems(),
            "block_params_resident_now": self._block_resident(),  # shards + any gathered
            "nonblock_params": self.root_numel,
            "nonblock_params_local": self.local_root_elems(),
            "peak_block_params_between_blocks": self.peak_between,
            "peak_block_params_in_block": self.peak_in_block,
            # what one forward all-gathers: every sharded weight once; each rank receives
            # (N-1)/N of it from the others
            "gather_bytes_per_forward": block_gather + self.root_bytes,
            "received_bytes_per_forward_per_rank":
                int((block_gather + self.root_bytes) * (n - 1) / n),
            "forwards": self.forwards,
            "block_forwards": self.block_forwards,
            "gathered_params": self.gathered_elems,
        }

    def reset_peaks(self) -> None:
        if self.peak_in_block is not None:
            self.peak_in_block = self.peak_between = 0


def unsharded_counts(transformer, block_lists) -> dict:
    """The same block counts for a pool without sharding (every rank holds every weight);
    the model's own weights only, not LoRA adapters a job added (as the sharded count,
    taken when the blocks were sharded)."""
    numels = [sum(p.numel() for n, p in b.named_parameters() if "lora_" not in n)
              for name in block_lists for b in getattr(transformer, name)]
    return {"ranks": 1, "block_params": sum(numels), "largest_block_params": max(numels),
            "block_params_local": sum(numels)}


def job_counts(worker) -> dict:
    """What a job's stats report about weight residency on this rank."""
    if worker.sharding is not None:
        return worker.sharding.counts()
    return unsharded_counts(worker.model.transformer, worker.adapter.block_lists)


# ---- the memory plan's sharding figures ----------------------------------------------------
def model_sizes(transformer, block_lists) -> dict:
    """Parameter bytes of a transformer (a meta-built one will do: nothing is read) as the
    plan takes them: each block, the rest (non-block parameters), the buffers."""
    def nbytes(ps):
        return sum(p.numel() * p.element_size() for p in ps)
    blocks = [nbytes(b.parameters()) for name in block_lists for b in getattr(transformer, name)]
    ids = {id(p) for name in block_lists for b in getattr(transformer, name)
           for p in b.parameters()}
    return {"block_bytes": blocks,
            "nonblock_bytes": nbytes(p for p in transformer.parameters() if id(p) not in ids),
            "buffer_bytes": nbytes(transformer.buffers())}


def plan(block_bytes, nonblock_bytes: int, world: int, buffer_bytes: int = 0,
         link_gb_s: Optional[float] = None, forwards_per_step: int = 1,
         device_bytes: Optional[int] = None, prefetch: int = 1) -> dict:
    """Weights per rank with and without sharding over `world` ranks, and what sharding
    costs per denoising step on a link of `link_gb_s` GB/s (1e9 B/s, each rank's receive
    bandwidth for an all-gather).

    Sharded, a rank holds 1/N of every parameter (FSDP's dim-0 chunks, rounded up) plus the
    buffers (whole) at rest; during a forward, the non-block parameters (gathered for the
    whole forward) and the running block plus `prefetch` prefetched blocks (the largest ones,
    as an upper bound). Each forward all-gathers every sharded parameter once: a rank receives
    (N-1)/N of all parameter bytes. `forwards_per_step`: 2 with CFG in one process, 1 with CFG
    parallel or without CFG. `device_bytes`: the memory a rank may use for weights; then
    `needs_sharding` says whether the unsharded model overflows it and `fits_sharded` whether
    the sharded peak fits."""
    n = max(1, int(world))
    blocks = sorted((int(b) for b in block_bytes), reverse=True)
    params = sum(blocks) + int(nonblock_bytes)
    unsharded = params + int(buffer_bytes)
    rest = sum(-(-b // n) for b in blocks) + -(-int(nonblock_bytes) // n) + int(buffer_bytes)
    gathered = int(nonblock_bytes) + sum(blocks[:1 + prefetch])
    peak = rest + gathered
    received = params * (n - 1) // n
    out = {"world": n, "unsharded_bytes_per_rank": unsharded, "sharded_bytes_at_rest": rest,
           "sharded_peak_bytes": peak, "largest_block_bytes": blocks[0] if blocks else 0,
           "gather_bytes_per_forward_per_rank": received,
           "gather_bytes_per_step_per_rank": received * forwards_per_step}
    if link_gb_s:
        out["gather_seconds_per_step"] = received * forwards_per_step / (link_gb_s * 1e9)
    if device_bytes is not None:
        out["needs_sharding"] = unsharded > device_bytes
        out["fits_sharded"] = peak <= device_bytes
    return out


# ---- loading only this rank's shards ----------------------------------------------------------
def direct_load_problem(path: str, weights: str) -> str:
    """Why the transformer at `path` cannot be read shard by shard ("" when it can): then it
    is loaded whole (tensor by tensor, workers/weights.py) and sharded after the load.
    Diffusers folders with safetensors and single files (any naming, bf16 or fp8, scaled or
    not) can."""
    import os

    from .weights import has_safetensors
    if os.path.isfile(path):
        return ""
    folder = os.path.join(path, "transformer")
    if not has_safetensors(folder):
        return "the transformer has no safetensors weights (.bin: diffusers' own loader)"
    return ""


class RowSource:
    """Where each diffusers tensor's rows are in a checkpoint: {name: (shape, segments,
    scale name)}, segments [(checkpoint tensor, first row, stop row)] whose rows, in order,
    are the tensor's (a folder: the tensor itself; a single file: `single_file.row_map`)."""

    def __init__(self, ck, table: dict):
        self.ck, self.table = ck, table
        self.scales = {}

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
            self.scales[key] = _read_rows(self.ck, key, 0, 0, whole=True).float().reshape(())
        return self.scales[key]

    def read(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) in the checkpoint's dtype (a 0-dim tensor: whole)."""
        shape, segs, _ = self.table[name]
        if not shape:
            return _read_rows(self.ck, segs[0][0], 0, 0, whole=True)
        parts, pos = [], 0
        for key, a, b in segs:
            lo, hi = max(r0, pos), min(r1, pos + b - a)
            if hi > lo:
                parts.append(_read_rows(self.ck, key, a + lo - pos, a + hi - pos))
            pos += b - a
        if not parts:
            return torch.empty([0] + shape[1:], dtype=self.dtype(name))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def folder_source(ck) -> RowSource:
    return RowSource(ck, {k: (ck.shape(k), [(k, 0, ck.shape(k)[0] if ck.shape(k) else 1)], None)
                          for k in ck.keys()})


def chunk_rows(n: int, world: int, rank: int) -> tuple:
    """FSDP2's dim-0 split (torch.chunk): rows [start, stop) of `rank` out of `n`."""
    per = -(-n // world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def _read_rows(ck, name: str, r0: int, r1: int, whole: bool = False) -> torch.Tensor:
    """Rows [r0, r1) of one checkpoint tensor (the whole tensor for a 0-dim one), in the
    file's dtype, on the CPU: one positioned read of exactly those bytes (a row-major tensor's
    rows are contiguous), into a buffer that lives until the copy to the device."""
    import os

    from .weights import _DTYPES
    path, start, e = ck.entries[name]
    dtype = _DTYPES.get(e["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has dtype {e['dtype']}, not supported")
    a, b = (int(v) for v in e["data_offsets"])
    shape = [int(v) for v in e["shape"]]
    if shape and not whole:
        row = (b - a) // shape[0] if shape[0] else 0
        a, b = a + r0 * row, a + r1 * row
        shape = [r1 - r0] + shape[1:]
    ck.reads += 1
    ck.bytes_read += b - a
    if b == a:
        return torch.empty(shape, dtype=dtype)
    from .weights import pread_bytes
    buf = pread_bytes(ck._handle(path, "fd"), start + a, b - a, path, name)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _fp8_modules(transformer, block_lists, dtype, names=None) -> dict:
    """The block Linears (all, or those whose weight is in `names`) become FP8Linear on the
    meta device (as the whole loader's `load_tensors` makes them), before sharding;
    {weight name: module}."""
    from .weights import FP8Linear, _set_module, block_linears
    out = {}
    for name, lin in block_linears(transformer, block_lists).items():
        if names is not None and name + ".weight" not in names:
            continue
        fp8 = FP8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                        device="meta", compute_dtype=dtype)
        if lin.bias is not None:
            fp8.bias = torch.nn.Parameter(torch.empty(lin.out_features, device="meta",
                                                      dtype=dtype), requires_grad=False)
        _set_module(transformer, name, fp8)
        out[name + ".weight"] = fp8
    return out


def _open_source(path: str, adapter):
    """(Checkpoint, RowSource, meta-built transformer, single-file config or None)."""
    import os

    import diffusers

    from .models.base import meta_transformer
    from .weights import Checkpoint
    if os.path.isfile(path):
        from .models.detect import single_file_config
        from .models.single_file import _skeleton, row_map
        sf = single_file_config(path)
        if sf["arch"] != adapter.arch:
            raise ValueError(f"{path} is a {sf['arch']} file, not {adapter.arch}")
        ck = Checkpoint.open([path])
        return ck, RowSource(ck, row_map(ck, sf)), _skeleton(sf["arch"], sf["config"]), sf
    folder = os.path.join(path, "transformer")
    ck = Checkpoint.folder(folder)
    return (ck, folder_source(ck),
            meta_transformer(getattr(diffusers, adapter.transformer_class), folder), None)


def load_direct(adapter, path: str, device, dtype, group, rank: int, world: int,
                mode: str = "auto", control=None):
    """(transformer, WeightSharding, report, single-file config or None): the transformer
    built on the meta device, sharded there, materialised as shards only, and each rank's
    rows read from the checkpoint (nothing else of the weights is ever read or held on this
    rank). `path`: a diffusers folder or a single file (its fused tensors' parts are row
    ranges of them: `single_file.row_map`).

    Block Linear weights stored in float8_e4m3fn stay fp8 (weights auto or fp8, as the whole
    loader's `prepare`): a rank reads its fp8 rows, and the tensor's scale_weight (a scalar)
    whole; fp8 tensors elsewhere are dequantized with their scale, row by row.
    weights=fp8 on weights that are not fp8 in the checkpoint: each is quantized as the whole
    loader does (workers/weights.py `quantize`: scale = max|w| / 448 of the whole tensor):
    one pass reads this rank's rows for their max, one all-reduce (MAX, over `control`, the
    gloo world group) gives every rank the whole tensors' maxima, a second pass reads the
    rows again and stores them in fp8."""
    from .weights import FP8, FP8_MAX, WEIGHT_MODES, block_linears, dequantize, is_fp8

    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES} (got {mode!r})")
    ck, src, transformer, sf = _open_source(path, adapter)
    with ck:
        transformer.to(dtype).requires_grad_(False).eval()
        cands = {n + ".weight" for n in block_linears(transformer, adapter.block_lists)}
        # a BFL SD3 file is dequantized to the pool dtype before diffusers' converter in the
        # whole loader (single_file.file_tensors): nothing stays fp8 there, so nothing here
        sd3_bfl = sf is not None and sf["arch"] == "sd3" and sf["naming"] != "diffusers"
        keep = set() if mode == "full" or sd3_bfl else {
            n for n in cands if n in src.table and src.dtype(n) == FP8}
        quant = (cands - keep) if mode == "fp8" else set()
        fp8 = _fp8_modules(transformer, adapter.block_lists, dtype, keep | quant)
        persistent = set(transformer.state_dict().keys())
        loose = [n for n, _ in transformer.named_buffers()
                 if n not in persistent and n[:-len(".scale")] + ".weight" not in fp8]
        if loose:
            raise ValueError(f"buffers not stored in the checkpoint: {loose[:3]}")
        want, have = persistent, set(src.keys())
        if want != have:
            raise ValueError(f"checkpoint {path} does not match the model: missing "
                             f"{sorted(want - have)[:3]}, unexpected {sorted(have - want)[:3]}")
        sharding = WeightSharding(transformer, adapter.block_lists, group, device)
        transformer.to_empty(device=device)
        dev = torch.device(device)

        def rows(name, local):
            full = src.shape(name)
            r0, r1 = chunk_rows(full[0], world, rank) if full else (0, 0)
            if full and (local.shape[0] != r1 - r0 or list(local.shape[1:]) != full[1:]):
                raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not rows "
                                   f"{r0}:{r1} of {full} (FSDP's dim-0 split changed?)")
            return r0, r1

        def values(name, r0, r1):  # rows as the whole loader sees them, fp8 dequantized
            t, s = src.read(name, r0, r1), src.scale(name)
            if sd3_bfl and t.is_floating_point():  # cast before converting, as there
                return (dequantize(t, s, torch.float32) if is_fp8(t) else t).to(dtype)
            return dequantize(t, s, torch.float32) if (is_fp8(t) or s is not None) else t

        params = dict(transformer.named_parameters())
        scales = {n: (src.scale(n) if src.scale(n) is not None else
                      torch.ones((), dtype=torch.float32)) for n in keep}
        if quant:  # pass 1: the whole tensors' max |w|, from every rank's rows
            names = sorted(quant)
            amax = torch.zeros(len(names), dtype=torch.float32)
            for i, name in enumerate(names):
                local = params[name].to_local()
                r0, r1 = rows(name, local)
                if r1 > r0:
                    amax[i] = values(name, r0, r1).float().abs().max()
            if world > 1:
                from .topology import all_reduce
                all_reduce(amax, op="max", group=control)
            scales.update({n: (amax[i] / FP8_MAX).clamp(min=1e-12) for i, n in enumerate(names)})
        with torch.no_grad():
            for name, p in params.items():
                local = p.to_local() if hasattr(p, "to_local") else p
                r0, r1 = rows(name, local)
                if not local.numel():
                    continue
                if name in keep:  # fp8 rows as stored
                    local.copy_(src.read(name, r0, r1).to(dev))
                    continue
                t = values(name, r0, r1)
                if name in quant:  # weights.quantize's arithmetic, on this rank's rows
                    t = (t.float() / scales[name]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                    local.copy_(t.to(dev))
                else:
                    local.copy_(t.to(dev, dtype if t.is_floating_point() else None))
            for name, mod in fp8.items():
                mod.scale.copy_(scales[name].reshape(()).to(dev))
            param_bytes = ck.bytes_read
            for name, buf in transformer.named_buffers():  # not sharded: read whole
                if name not in persistent:
                    continue  # FP8Linear scales, set above
                full = src.shape(name)
                t = values(name, 0, full[0] if full else 0)
                buf.copy_(t.to(dev, dtype if t.is_floating_point() else None))
        report = {"weights": "fp8" if fp8 else "full", "fp8_layers": len(fp8),
                  "loaded": "shards only", "tensors_read": ck.reads,
                  "bytes_read": ck.bytes_read, "buffer_bytes_read": ck.bytes_read - param_bytes,
                  "checkpoint_fp8": any(is_fp8(torch.empty(0, dtype=ck.dtype(k)))
                                        for k in ck.keys()),
                  "transformer_bytes": sum(
                      (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                      for p in transformer.parameters())}
    return transformer, sharding, report, sf


class ShardSetup:
    """What `--shard-weights` prepares before the load (the group: a collective, so before
    the ranks may load in turn) and finishes after it."""

    def __init__(self, worker):
        import torch.distributed as dist

        args = worker.args
        check(True, args.pipefusion, getattr(args, "compile", False))
        # a device group of its own for FSDP's all-gathers (NCCL on GPUs, gloo on CPU and in
        # the shared-GPU test mode: the world group's backend)
        self.group = dist.new_group(list(range(worker.world)),
                                    backend=dist.get_backend(worker.planes.data))
        self.fallback = direct_load_problem(args.model, getattr(args, "weights", "auto"))
        if not self.fallback and getattr(args, "weights", "auto") == "fp8" and \
                getattr(args, "load_in_turn", False) and worker.world > 1:
            self.fallback = ("weights=fp8 shares the scales over every rank while loading, "
                             "which ranks loading in turn cannot")
        self.sharding: Optional[WeightSharding] = None
        self.loaded_direct = False

    @property
    def direct(self) -> bool:
        return not self.fallback

    def load(self, worker):
        """This rank's model with the transformer loaded shard-only (`direct` only)."""
        import os

        from .models import LoadedModel
        from .models.base import _read_json

        args, adapter = worker.args, worker.adapter
        transformer, self.sharding, report, sf = load_direct(
            adapter, args.model, worker.device, worker.dtype, self.group, worker.rank,
            worker.world, mode=getattr(args, "weights", "auto"), control=worker.planes.control)
        if sf is not None:  # a single file: no text encoders, the released models' configs
            from .models.single_file import defaults_for
            sched, vae = defaults_for(sf["arch"], sf["config"])
            model = LoadedModel(path=args.model, arch=adapter.arch, transformer=transformer,
                                encoder=None, scheduler_config=sched, vae_config=vae,
                                device=worker.device, dtype=worker.dtype)
            model.load_report = dict(report, text_encoders=None)
            self.loaded_direct = True
            return model
        encoder, te_device = None, None
        if worker.rank == 0:  # as DiTAdapter.load: the text encoders on rank 0
            import diffusers
            te_device = adapter._text_encoder_device(args.model, worker.device, worker.dtype,
                                                     getattr(args, "text_encoders", "auto"))
            encoder = getattr(diffusers, adapter.pipeline_class).from_pretrained(
                args.model, transformer=None, vae=None, torch_dtype=worker.dtype)
            encoder.to(te_device)
        model = LoadedModel(
            path=args.model, arch=adapter.arch, transformer=transformer, encoder=encoder,
            scheduler_config=_read_json(os.path.join(args.model, "scheduler",
                                                     "scheduler_config.json")),
            vae_config=_read_json(os.path.join(args.model, "vae", "config.json")),
            device=worker.device, dtype=worker.dtype)
        model.load_report = dict(report, text_encoders=te_device)
        self.loaded_direct = True
        return model

    def finish(self, worker) -> WeightSharding:
        """After the load: the sharding (a whole-loaded transformer is sharded now)."""
        if not self.loaded_direct:
            self.sharding = WeightSharding(worker.model.transformer, worker.adapter.block_lists,
                                           self.group, worker.device)
            report = getattr(worker.model, "load_report", None)
            if isinstance(report, dict):
                report["loaded"] = f"whole, then sharded ({self.fallback})"
        self.sharding.load_mode = "shards only" if self.loaded_direct else "whole, then sharded"
        if worker.hook_options.get("measure_sharding"):  # xdit_testhooks.probes
            self.sharding.measure_residency()
        return self.sharding


def begin(worker) -> Optional[ShardSetup]:
    """Worker hook before the load (every rank at once): None without `--shard-weights`."""
    if not getattr(worker.args, "shard_weights", False):
        return None
    return ShardSetup(worker)


def shard_after_load(worker) -> Optional[WeightSharding]:
    """Worker hook after the load: the transformer's sharding, or None without
    `--shard-weights` (a pool whose `begin` was not called shards the loaded model here)."""
    setup = getattr(worker, "shard_setup", None)
    if setup is None:
        if not getattr(worker.args, "shard_weights", False):
            return None
        setup = ShardSetup(worker)
        setup.fallback = setup.fallback or "loaded before sharding was set up"
    return setup.finish(worker)
