"""Which model a path holds, read without torch: its family (workers/families) and the
diffusers transformer config, for the workers (which build the transformer from it) and the
host (which validates a model before any worker starts: its model_info module wraps this
one and turns ModelFileError into its ConfigError).

Two kinds of model:

- a diffusers folder (model_index.json, transformer/config.json, vae/, text encoders): read
  from its JSON;
- a single `.safetensors` file holding a transformer, as ComfyUI users keep them in
  `models/diffusion_models` (legacy `unet`) or, inside a full checkpoint, in
  `models/checkpoints`. Only the file's JSON header is read (8-byte little-endian length, then
  a JSON table of tensor names, dtypes, shapes and byte ranges): the family comes from its
  key names (each family's `markers`), the diffusers config from the weight shapes (its
  `config_from_shapes`), in BFL/ComfyUI or diffusers naming, optionally under
  `model.diffusion_model.` (full checkpoints add the VAE and text encoders under other
  prefixes, which are ignored).
Every error is one user-facing line.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import families
# a file's header and a single file's reading are the loaders' (they build the model from
# them); detection's face names them too, for the host (comfyui_xdit/planning/model_info.py)
from ..loading.header import ModelFileError, read_safetensors_header  # noqa: F401
from ..loading.transformer_file import (CHECKPOINT_PREFIX, folder_storage,  # noqa: F401
                                        single_file_config, transformer_keys, weight_storage)

SINGLE_FILE_SUFFIXES = (".safetensors", ".sft", ".gguf")


def describe_model(path) -> dict:
    """{"arch": the family id, "kind": "file" | "diffusers", "config": the diffusers
    transformer config, "storage": weight_storage, "pipeline": the diffusers pipeline that
    encodes a folder's prompts (None for a file)} of a diffusers folder or a single
    .safetensors file."""
    p = Path(path)
    if p.is_file():
        sf = single_file_config(p)
        return {"arch": sf["arch"], "kind": "file", "config": sf["config"],
                "storage": sf["storage"], "pipeline": None}
    cfg_file = p / "transformer" / "config.json"
    if not p.exists():
        raise ModelFileError(f"model {str(p)!r} does not exist; give a diffusers folder "
                             f"({families.names()}) or a single .safetensors transformer file")
    if not p.is_dir():
        raise ModelFileError(f"model {str(p)!r} is neither a directory nor a file; give a "
                             f"diffusers model folder or a .safetensors file")
    if not cfg_file.is_file():
        raise ModelFileError(f"model folder {str(p)!r} has no transformer/config.json; "
                             f"give a diffusers folder of {families.names()}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {cfg_file}: {e}") from None
    cls = cfg.get("_class_name") if isinstance(cfg, dict) else None
    fam = families.BY_CLASS.get(cls)
    if fam is None:
        raise ModelFileError(f"model {str(p)!r} has a {cls!r} transformer; supported: "
                             f"{', '.join(sorted(families.BY_CLASS))} ({families.names()})")
    # a wrong pipeline is refused here, not ~16 s later in the workers
    return {"arch": fam.id, "kind": "diffusers", "config": cfg,
            "storage": folder_storage(p / "transformer"), "pipeline": pipeline_class(fam, p)}


def pipeline_class(fam, path) -> str:
    """The diffusers pipeline that encodes a folder's prompts, from its model_index.json
    (the family decides; a folder without one gets the family's default)."""
    index = Path(path) / "model_index.json"
    name = None
    if index.is_file():
        try:
            name = json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelFileError(f"cannot read the pipeline class from {index}: {e}") from None
    try:
        return fam.pipeline_for(name)
    except ValueError as e:
        raise ModelFileError(f"{index} {e}") from None


def read_arch(path) -> str:
    """The family id of a diffusers folder or a single .safetensors file."""
    return describe_model(path)["arch"]
