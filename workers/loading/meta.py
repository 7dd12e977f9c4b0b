"""A transformer built on the meta device (no memory, no random init), its weights to be
assigned by a loader: from a diffusers folder's config, or from a single file's weight
shapes (its config read by models/detect.py), with the buffers its class computes at init
made again by the family's adapter."""
from __future__ import annotations

import os

import torch

from .. import families


def skeleton(arch: str, config: dict):
    """The transformer for `config` on the meta device (no memory, no random init)."""
    import diffusers

    cls = getattr(diffusers, families.family(arch).classes.transformer)
    kw = dict(config)
    for k in ("axes_dims_rope", "dual_attention_layers"):
        if k in kw:
            kw[k] = tuple(kw[k])
    with torch.device("meta"):
        model = cls(**kw)
    return with_computed_buffers(model)


def meta_transformer(tcls, folder: str):
    """The transformer of a diffusers folder, built from its config on the meta device (no
    memory, no random init), its weights to be assigned."""
    with torch.device("meta"):
        transformer = tcls.from_config(tcls.load_config(folder))
    return with_computed_buffers(transformer)


def with_computed_buffers(transformer):
    """A meta-built transformer with the buffers its class computes at init (never in a
    checkpoint) made again by its family's adapter (`computed_buffers`)."""
    fam = families.BY_CLASS.get(type(transformer).__name__)
    if fam is not None:
        fam.adapter_class().computed_buffers(transformer)
    return transformer


def meta_transformer_of(adapter, path: str) -> tuple:
    """(the transformer of `path` built on the meta device, the single-file config or None):
    a diffusers folder's from its config, a single file's from its weight shapes."""
    if os.path.isfile(path):
        from .transformer_file import single_file_config
        sf = single_file_config(path)
        if sf["arch"] != adapter.arch:
            raise ValueError(f"{path} is a {sf['arch']} file, not {adapter.arch}")
        return skeleton(sf["arch"], sf["config"]), sf
    import diffusers
    return meta_transformer(getattr(diffusers, adapter.transformer_class),
                            os.path.join(path, "transformer")), None
