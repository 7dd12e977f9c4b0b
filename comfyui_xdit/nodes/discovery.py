"""Which models the loader lists and where a listed name lives, without ComfyUI: diffusers
folders (model_index.json + transformer/config.json) and single .safetensors or
ComfyUI-GGUF .gguf files (diffusion_models, which holds models/unet too, and checkpoints; a checkpoint is listed only when its header holds a known
family's transformer, a verdict cached per file)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

from comfyui_xdit.planning.config import ConfigError


def is_diffusers_folder(path) -> bool:
    p = Path(path)
    return (p / "model_index.json").is_file() and (p / "transformer" / "config.json").is_file()


def discover_models(folders, max_depth: int = 3) -> list[str]:
    """Diffusers model folders under `folders`, as '/'-separated names relative to their
    root (sorted, unique)."""
    found = set()
    for root in folders or []:
        root = Path(root)
        if not root.is_dir():
            continue
        for dirpath, dirnames, _ in os.walk(root, followlinks=True):
            d = Path(dirpath)
            rel = d.relative_to(root)
            if d != root and is_diffusers_folder(d):
                found.add(rel.as_posix())
                dirnames[:] = []  # a model's subfolders are its components
                continue
            if len(rel.parts) >= max_depth:
                dirnames[:] = []
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
    return sorted(found)


# Single files: ComfyUI folder kinds, each listed as "<kind>/<file>" so a name says where it
# is (and never collides with a diffusers folder's name). A checkpoints folder mixes model
# families, so only files holding a transformer of a known family are listed from it.
FILE_KINDS = ("diffusion_models", "checkpoints")
HEADER_CACHE_SIZE = 64  # checkpoint files whose verdict is remembered (least recently used go)


def _is_dit_file(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return _holds_dit(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=HEADER_CACHE_SIZE)
def _holds_dit(path: str, mtime_ns: int, size: int) -> bool:
    """Whether the file holds a known family's transformer, from its header; keyed on the file's
    (path, mtime, size) so a replaced file is read again."""
    from comfyui_xdit.planning.model_info import read_safetensors_header, transformer_keys
    try:
        transformer_keys(read_safetensors_header(path))
        return True
    except ConfigError:
        return False


def discover_single_files(roots_by_kind: dict, max_depth: int = 3) -> list[str]:
    """`{"diffusion_models": [dirs], "checkpoints": [dirs]}` -> sorted "<kind>/<rel path>"
    names of .safetensors / .gguf files (every file of diffusion_models, known families'
    ones of checkpoints)."""
    from comfyui_xdit.planning.model_info import SINGLE_FILE_SUFFIXES
    found = set()
    for kind in FILE_KINDS:
        for root in roots_by_kind.get(kind) or []:
            root = Path(root)
            if not root.is_dir():
                continue
            for dirpath, dirnames, files in os.walk(root, followlinks=True):
                d = Path(dirpath)
                rel = d.relative_to(root)
                if len(rel.parts) >= max_depth:
                    dirnames[:] = []
                dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
                for f in files:
                    if not f.lower().endswith(SINGLE_FILE_SUFFIXES) or f.startswith("."):
                        continue
                    if kind == "checkpoints" and not _is_dit_file(d / f):
                        continue
                    found.add(f"{kind}/{(rel / f).as_posix()}")
    return sorted(found)


def resolve_model(name: str, folders, roots_by_kind: Optional[dict] = None) -> str:
    """A name from `discover_models` / `discover_single_files` (or an absolute path) ->
    the model's path. A missing file or folder gives one error naming where it looked."""
    if os.path.isabs(name) and (is_diffusers_folder(name) or os.path.isfile(name)):
        return name
    kind, _, rest = name.partition("/")
    if kind in FILE_KINDS and rest:
        roots = list((roots_by_kind or {}).get(kind) or [])
        for root in roots:
            p = Path(root) / rest
            if p.is_file():
                return str(p)
        raise ConfigError(f"model file {rest!r} not found in {kind} "
                          f"({', '.join(map(str, roots)) or 'no folder configured'}); pick a "
                          f"file from the list (refresh it after adding models)")
    for root in folders or []:
        p = Path(root) / name
        if is_diffusers_folder(p):
            return str(p)
    raise ConfigError(missing_model_message(name, folders, roots_by_kind))


def missing_model_message(name: str, folders, roots_by_kind: Optional[dict] = None) -> str:
    """One line: the name, where it was looked for, what was found there, and where the
    folder goes (the examples name FLUX.1-dev and stable-diffusion-3.5-medium)."""
    found = discover_models(folders) + discover_single_files(roots_by_kind or {})
    where = ", ".join(map(str, folders or [])) or "no models/diffusers folder configured"
    listed = ", ".join(found[:12]) + (f" (+{len(found) - 12} more)" if len(found) > 12 else "")
    present = [str(Path(r) / name) for r in folders or [] if (Path(r) / name).exists()]
    if present:  # there, but not a model folder
        return (f"model {name!r} at {present[0]} is not a diffusers folder (it needs "
                f"model_index.json and transformer/config.json, as a Hugging Face snapshot "
                f"of the repository has); found {listed or 'no FLUX.1/FLUX.2/SD3 model'}")
    return (f"model {name!r} not found: looked for a diffusers folder {name!r} (with "
            f"model_index.json and transformer/config.json) in {where}, and for single "
            f"files in models/diffusion_models and models/checkpoints; found "
            f"{listed or 'no FLUX.1/FLUX.2/SD3 model'}. Put the model folder at "
            f"models/diffusers/{name} (e.g. a Hugging Face snapshot of the repository), "
            f"then refresh the node list")
