"""LoRA files the host writes from ComfyUI's LoRA loaders' patches (the xDiT MODEL,
comfyui_xdit/nodes/comfy_loras.py), read into the peft state dict the pool loads.

Such a file names each layer as ComfyUI's model does (its state-dict key without the
`diffusion_model.` prefix and `.weight`): `<key>.lora_up.weight` [rows of the whole
weight, rank] and `<key>.lora_down.weight` [rank, in], with ComfyUI's alpha / rank scale
already in `lora_up` (a patch on part of a fused weight fills only its rows), and its
metadata says so. A layer of that name in the transformer (a diffusers folder's names) is
taken as it is; any other goes through the family's own single-file conversion
(`bfl_to_diffusers`), run on row-index tensors: the converters only split, chunk and
concatenate along rows (workers/loading/single_file.row_map relies on the same), so each
diffusers layer learns which rows of which ComfyUI weight it is, and takes those rows of
`lora_up` with the whole `lora_down` (a fused qkv's LoRA: `up` split like the weight's
rows, `down` repeated).
"""
from __future__ import annotations

import os

import torch

FORMAT_KEY = "format"
FORMAT = "comfyui-lora-patches"
_UP, _DOWN = ".lora_up.weight", ".lora_down.weight"


def weight_shapes(path) -> dict:
    """{name: shape} of the 2-D weights of a model's transformer, named as the model names
    them (a single file: its own names, ComfyUI's or BFL's, without a checkpoint's prefix; a
    diffusers folder: diffusers' names, from transformer/'s headers), without `.weight`:
    what ComfyUI's LoRA loaders map a LoRA file's keys to on the xDiT MODEL. Headers only."""
    from .header import read_safetensors_header
    from .transformer_file import single_file_config
    path = str(path)
    if os.path.isfile(path):
        prefix = single_file_config(path)["prefix"]
        header = read_safetensors_header(path)
    else:
        folder = os.path.join(path, "transformer")
        prefix, header = "", {}
        for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if f.endswith(".safetensors"):
                header.update(read_safetensors_header(os.path.join(folder, f)))
    return {k[len(prefix):-len(".weight")]: list(v["shape"]) for k, v in header.items()
            if k.startswith(prefix) and k.endswith(".weight") and len(v.get("shape", ())) == 2}


def file_shapes(path) -> dict:
    """{name: shape} of every tensor of a single-file model's transformer (its own names,
    without a checkpoint's prefix); {} for a folder. Headers only: what ComfyUI's model
    detection reads, for the config its LoRA key map needs."""
    from .header import read_safetensors_header
    from .transformer_file import single_file_config
    path = str(path)
    if not os.path.isfile(path):
        return {}
    prefix = single_file_config(path)["prefix"]
    return {k[len(prefix):]: list(v.get("shape", ())) for k, v in
            read_safetensors_header(path).items() if k.startswith(prefix)}


def is_patches_file(path: str) -> bool:
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get(FORMAT_KEY) == FORMAT
    except Exception:  # noqa: BLE001  (not a safetensors file: the usual checks say why)
        return False


def _pairs(sd: dict) -> dict:
    """{layer: (up, down)} of a patches file."""
    out = {}
    for k, up in sd.items():
        if k.endswith(_UP):
            name = k[: -len(_UP)]
            down = sd.get(name + _DOWN)
            if down is None:
                raise ValueError(f"{name}: lora_up without lora_down")
            out[name] = (up.float(), down.float())
    return out


def _rows(adapter, config: dict, shapes: dict) -> dict:
    """{diffusers layer: (ComfyUI layer, row indices)} by the family's conversion."""
    big = 1 << 40
    names = sorted(shapes)
    fake = {f"{n}.weight": torch.arange(shapes[n], dtype=torch.int64) + i * big
            for i, n in enumerate(names)}
    out = {}
    for dname, idx in adapter.bfl_to_diffusers(fake, config).items():
        if not dname.endswith(".weight"):
            continue
        src = torch.div(idx.reshape(-1), big, rounding_mode="floor")
        if int(src.min()) != int(src.max()):  # made of several ComfyUI weights
            raise ValueError(f"{dname} is made of several ComfyUI weights")
        out[dname[: -len(".weight")]] = (names[int(src[0])], idx.reshape(-1) - src * big)
    return out


class _Header:
    """A single file's names and shapes, as single_file.row_map reads a checkpoint."""

    def __init__(self, path: str):
        from .header import read_safetensors_header
        self._h = read_safetensors_header(path)

    def keys(self):
        return list(self._h)

    def shape(self, name):
        return list(self._h[name].get("shape", ()))


def _file_rows(model_path: str, wanted: set, cache: dict) -> dict:
    """{diffusers layer: (ComfyUI layer, row indices)} of a single-file model, by the very
    row map its load used (the whole file's conversion, so a family whose converter needs
    every tensor, SD3's, works too); `cache` keeps the map per file. Headers only."""
    from .single_file import row_map
    from .transformer_file import single_file_config
    if model_path not in cache:
        sf = single_file_config(model_path)
        cache[model_path] = (sf["prefix"], row_map(_Header(model_path), sf))
    prefix, rows = cache[model_path]
    out = {}
    for dname, (_, segs, _) in rows.items():
        srcs = {t for t, _, _ in segs}
        if not dname.endswith(".weight") or len(srcs) != 1:
            continue
        src = srcs.pop()
        layer = src[len(prefix):-len(".weight")] if src.endswith(".weight") else None
        if layer in wanted:
            out[dname[: -len(".weight")]] = (layer, torch.cat(
                [torch.arange(a, b) for _, a, b in segs]))
    missing = sorted(set(wanted) - {s for s, _ in out.values()})
    if missing:
        raise ValueError(f"ComfyUI's layer {missing[0]} is not a weight of this model's file")
    return out


def patches_to_peft(path: str, transformer, adapter, model_path: str = None,
                    cache: dict = None) -> dict:
    """A patches file -> {"transformer.<layer>.lora_A.weight" / "lora_B.weight": tensor} in
    diffusers names (alpha == rank: scale 1, ComfyUI's scale is in lora_B). Raises
    ValueError naming a layer the family's conversion has no rule for. `model_path`: the
    pool's model; a single file's layers are found by its own row map (`cache`d)."""
    from safetensors.torch import load_file

    pairs = _pairs(load_file(path))
    modules = dict(transformer.named_modules())
    out = {}

    def put(name, up, down):
        keep = up.abs().amax(dim=0) > 0  # ranks of other rows' patches (a fused weight's)
        if not bool(keep.any()):
            return
        out[f"transformer.{name}.lora_A.weight"] = down[keep].contiguous()
        out[f"transformer.{name}.lora_B.weight"] = up[:, keep].contiguous()

    other = {}
    for name, (up, down) in pairs.items():
        if isinstance(modules.get(name), torch.nn.Linear) or \
                isinstance(getattr(modules.get(name), "base_layer", None), torch.nn.Linear):
            put(name, up, down)
        else:
            other[name] = (up, down)
    if other:
        config = dict(getattr(transformer, "config", {}) or {})
        try:
            if model_path and os.path.isfile(model_path):  # a single file: its own row map
                rows = _file_rows(model_path, set(other), {} if cache is None else cache)
            else:
                rows = _rows(adapter, config,
                             {n: int(u.shape[0]) for n, (u, _) in other.items()})
        except Exception as e:  # noqa: BLE001  (the converter's own words name the layer)
            first = sorted(other)[0]
            raise ValueError(f"ComfyUI's layer {first} (of {len(other)}) has no "
                             f"{adapter.arch} conversion to the pool's model: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
        for dname, (src, idx) in rows.items():
            up, down = other[src]
            put(dname, up[idx], down)
    return out
