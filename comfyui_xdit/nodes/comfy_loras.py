"""ComfyUI's LoRA loaders on the xDiT MODEL, without importing ComfyUI (tested in CI).

ComfyUI's LoraLoader / LoraLoaderModelOnly map a file's keys to the MODEL's state-dict keys
(`diffusion_model.double_blocks.0.img_attn.qkv.weight`, ...) and call the MODEL patcher's
`add_patches(patches, strength_patch, strength_model)` once per loader, with per key a LoRA
adapter whose `weights` are (up [out, rank], down [rank, in], alpha, mid, dora_scale,
reshape), on the whole weight or on a row range of it (`(key, (0, first row, rows))`: a
diffusers LoRA's to_q on ComfyUI's fused qkv). The MODEL's weights live in the pool, so
the patcher records each call here as one `LoraSource` instead; at sampling time each
source becomes one LoRA file in a private folder, named by its content (written once,
reused by every later call and job) and given to the pool with the loader's strength: the
pool loads it once as a peft adapter and only switches adapters between jobs, never
reloading the base weights (workers/loading/comfy_lora.py reads the file).

ComfyUI's weight is W + strength * (alpha / rank) * up @ down per patch (alpha absent: 1),
summed over the patches of a key: the file holds (alpha / rank) * up, the pool scales it by
the strength (negative too) and sums the adapters, so the pool's model equals ComfyUI's
patched one. What the pool cannot apply is refused in one line naming the patch and key:
model merges (plain weights, `diff` / `set` / `model_as_lora` patches, a strength on the
model's own weights), LoKr / LoHa / GLoRA / OFT adapters, DoRA, LoCon's mid weights and
patches with a weight function.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from comfyui_xdit.planning.config import ConfigError

PREFIX = "diffusion_model."
SUFFIX = ".weight"
# where the MODEL patcher keeps its recorded sources: its model_options' transformer
# options, which ComfyUI copies to each clone and hands to every diffusion-model call
OPTION = "xdit_lora_sources"
EXPERT_NAMES = ("high", "low")  # the pool's names of a two-expert model's transformers


@dataclass
class LoraSource:
    """One loader's patches: {layer (ComfyUI's key without prefix and suffix): [(offset or
    None, up * alpha / rank, down)]} at `strength`."""
    strength: float
    layers: dict = field(default_factory=dict)
    path: Optional[str] = None  # its file, once written

    def __deepcopy__(self, memo):  # ComfyUI deep-copies a clone's options: never changed
        return self


def _refuse(what: str, key) -> ConfigError:
    return ConfigError(f"the xDiT MODEL cannot apply {what} on {key}: its weights live in "
                       f"the worker pool, which takes LoRA patches only; remove that loader "
                       f"or use ComfyUI's own model for this graph")


_NAMES = {"lokr": "LoKr", "loha": "LoHa", "glora": "GLoRA", "oft": "OFT", "boft": "BOFT"}
_MERGES = ("diff", "set", "model_as_lora")


def _kind(patch) -> str:
    """A patch's kind in ComfyUI's words: "lora", or what it is: another adapter (its
    `name`: LoKr, LoHa, ...), a model merge's tuple (diff, set, model_as_lora), weights."""
    name = getattr(patch, "name", None)
    if isinstance(name, str):
        return name if name == "lora" else f"a {_NAMES.get(name, name)} adapter"
    if isinstance(patch, tuple) and patch and isinstance(patch[0], str):
        return f"a {patch[0]} patch" + (" (a model merge)" if patch[0] in _MERGES else "")
    if isinstance(patch, (tuple, list)) and len(patch) == 1:
        return "a diff patch (a model merge)"  # ComfyUI's (weight,) tuple
    return f"a {type(patch).__name__} patch (a model merge)"


def record(patches: dict, strength_patch: float = 1.0, strength_model: float = 1.0) -> LoraSource:
    """`add_patches`'s arguments -> one LoraSource, or a ConfigError naming the first patch
    the pool cannot apply (nothing is recorded then)."""
    source = LoraSource(float(strength_patch))
    for k, patch in patches.items():
        if isinstance(k, str):
            key, offset, function = k, None, None
        else:
            key, offset = k[0], k[1]
            function = k[2] if len(k) > 2 else None
        if float(strength_model) != 1.0:
            raise _refuse(f"a model merge (strength_model {strength_model} on the model's "
                          f"own weights)", key)
        kind = _kind(patch)
        if kind != "lora":
            raise _refuse(kind, key)
        if function is not None:
            raise _refuse("a LoRA with a weight function", key)
        up, down, alpha, mid, dora, reshape = tuple(patch.weights)
        extra = [n for n, v in (("a mid weight (LoCon)", mid), ("DoRA", dora),
                               ("a reshape", reshape)) if v is not None]
        if extra:
            raise _refuse(f"a LoRA with {extra[0]}", key)
        if not (key.startswith(PREFIX) and key.endswith(SUFFIX)) or up.dim() != 2 or \
                down.dim() != 2:
            raise _refuse(f"a LoRA on a weight that is not a Linear layer's "
                          f"(up {tuple(up.shape)}, down {tuple(down.shape)})", key)
        if offset is not None and int(offset[0]) != 0:
            raise _refuse(f"a LoRA on part of a weight along dim {offset[0]}", key)
        scale = 1.0 if alpha is None else float(alpha) / int(down.shape[0])
        layer = key[len(PREFIX):-len(SUFFIX)]
        source.layers.setdefault(layer, []).append(
            (None if offset is None else (int(offset[1]), int(offset[2])),
             up.detach().float().cpu() * scale, down.detach().float().cpu()))
    return source


def _tensors(source: LoraSource, rows: dict) -> dict:
    """The file's tensors: per layer one up [all rows, sum of ranks] (each patch's up in its
    rows) and one down [sum of ranks, in], so up @ down is the sum of the layer's patches."""
    import torch
    out = {}
    for layer, parts in sorted(source.layers.items()):
        total = rows.get(layer) or max((o[0] + o[1]) if o else int(u.shape[0])
                                       for o, u, _ in parts)
        ups, downs = [], []
        for offset, up, down in parts:
            first, n = offset if offset else (0, int(up.shape[0]))
            if int(up.shape[0]) != n or first + n > total:
                raise _refuse(f"a LoRA of {int(up.shape[0])} rows at rows {first}..{first + n}"
                              f" of a {total}-row weight", PREFIX + layer + SUFFIX)
            full = torch.zeros(total, int(up.shape[1]))
            full[first:first + n] = up
            ups.append(full)
            downs.append(down)
        if len({int(d.shape[1]) for d in downs}) != 1:
            raise _refuse("LoRAs of different input widths", PREFIX + layer + SUFFIX)
        out[f"{layer}.lora_up.weight"] = torch.cat(ups, dim=1).contiguous()
        out[f"{layer}.lora_down.weight"] = torch.cat(downs, dim=0).contiguous()
    return out


def _to_pool_names(tensors: dict, parts: dict) -> dict:
    """Layers ComfyUI names otherwise than the pool's model, renamed by `parts` ({layer:
    [(pool layer, first row, rows)]}: ComfyUI's own key map, read backwards): each pool
    layer takes its rows of `up` and the whole `down`. A layer whose patched rows the parts
    do not all cover keeps ComfyUI's name (the workers convert it)."""
    out = dict(tensors)
    for layer, pieces in parts.items():
        up = tensors.get(f"{layer}.lora_up.weight")
        if up is None:
            continue
        covered = up.new_zeros(up.shape[0], dtype=bool)
        for _, first, n in pieces:
            covered[first:first + n] = True
        if bool((up[~covered] != 0).any()):
            continue
        down = out.pop(f"{layer}.lora_down.weight")
        del out[f"{layer}.lora_up.weight"]
        for name, first, n in pieces:
            if f"{name}.lora_up.weight" in out:  # two ComfyUI layers onto one: not a rename
                raise _refuse("LoRAs on two weights the pool's model holds as one",
                              PREFIX + layer + SUFFIX)
            out[f"{name}.lora_up.weight"] = up[first:first + n].contiguous()
            out[f"{name}.lora_down.weight"] = down.clone()
    return out


_FOLDER: Optional[str] = None


def _folder() -> str:
    """This process's private folder of written LoRA files (removed when it exits)."""
    global _FOLDER
    if _FOLDER is None or not os.path.isdir(_FOLDER):
        _FOLDER = tempfile.mkdtemp(prefix="xdit-comfy-loras-")
        atexit.register(shutil.rmtree, _FOLDER, True)
    return _FOLDER


def write(source: LoraSource, rows: Optional[dict] = None,
          folder: Optional[str] = None, parts: Optional[dict] = None) -> str:
    """The source's LoRA file, named by its content: written once, the same path after
    (a source's patches never change: ComfyUI's loaders record new ones on a clone)."""
    from safetensors.torch import save_file
    if source.path and os.path.isfile(source.path) and \
            (folder is None or os.path.dirname(source.path) == folder):
        return source.path
    tensors = _to_pool_names(_tensors(source, rows or {}), parts or {})
    h = hashlib.blake2b(digest_size=16)
    for k, t in tensors.items():
        h.update(f"{k}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    folder = folder or _folder()
    path = os.path.join(folder, f"comfy-lora-{h.hexdigest()}.safetensors")
    if not os.path.isfile(path):
        tmp = f"{path}.{os.getpid()}.part"
        from comfyui_xdit import bridge
        reader = bridge.comfy_lora  # what the workers' reader keys on
        save_file(tensors, tmp, metadata={reader.FORMAT_KEY: reader.FORMAT})
        os.replace(tmp, path)
    source.path = path
    return path


_SOURCE_PREFIXES = ("transformer.", "diffusion_model.", "base_model.model.", "unet.")


def names_from_key_map(mapped: dict, shapes: dict) -> tuple:
    """What the MODEL needs of ComfyUI's LoRA key map of its model (comfy.lora.
    model_lora_keys_unet: {a LoRA file's name: state-dict key, or (key, (0, first row,
    rows))}), given `shapes`, the pool model's own weights ({name: shape}, workers/loading/
    comfy_lora.weight_shapes) -> (weights, rows, parts):
    weights: the pool's weights plus every other weight the map names (so that ComfyUI's
    loaders map LoRA files in those names too, e.g. kohya's BFL names on a diffusers
    folder's FLUX), {name: shape}; rows: {name: rows of the whole weight} where the map
    gives row ranges; parts: {name: [(pool weight, first row, rows)]} for a weight that is
    the pool model's weight(s) under another name (the map's source names a pool weight:
    ComfyUI maps diffusers' to_q / to_k / to_v onto BFL's fused qkv)."""
    weights = {k: list(v) for k, v in shapes.items()}
    rows = {k: int(v[0]) for k, v in shapes.items()}
    ends: dict = {}
    parts: dict = {}
    for src, target in mapped.items():
        key, offset = (target, None) if isinstance(target, str) else (target[0], target[1])
        if not (isinstance(key, str) and key.startswith(PREFIX) and key.endswith(SUFFIX)):
            continue
        name = key[len(PREFIX):-len(SUFFIX)]
        if name in shapes or (offset is not None and int(offset[0]) != 0):
            continue
        first, n = (int(offset[1]), int(offset[2])) if offset is not None else (0, None)
        ends[name] = max(ends.get(name, 0), first + (n or 0))
        own = next((src[len(p):] for p in _SOURCE_PREFIXES
                    if src.startswith(p) and src[len(p):] in shapes), None)
        if own is not None:
            piece = (own, first, n if n is not None else int(shapes[own][0]))
            if piece not in parts.setdefault(name, []):
                parts[name].append(piece)
    for name, end in ends.items():
        weights[name] = [end or 1, 1]  # (its input width is the LoRA's own)
        if end:
            rows[name] = end
    return weights, rows, parts


def add(options: dict, source: LoraSource) -> None:
    """Record one more loader's source in a MODEL's transformer options (a clone's own)."""
    options[OPTION] = tuple(options.get(OPTION, ())) + (source,)


def pool_loras(sources: list, rows: Optional[dict] = None, expert: Optional[str] = None,
               folder: Optional[str] = None, parts: Optional[dict] = None) -> list:
    """The MODEL's recorded sources -> the request's `loras` [(path, strength[, expert])],
    one entry per loader (a file loaded twice is listed twice: the pool adds strengths).
    `rows`: {layer: rows of ComfyUI's whole weight} where a patch covers only part of one;
    `parts`: {layer: [(pool layer, first row, rows)]} where ComfyUI names a weight otherwise
    than the pool's model (a diffusers folder's FLUX: BFL's fused qkv is to_q, to_k, to_v)."""
    out = []
    for s in sources:
        if not s.layers:
            continue
        path = write(s, rows, folder, parts)
        out.append((path, s.strength) if expert is None else (path, s.strength, expert))
    return out
