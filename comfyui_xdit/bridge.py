"""The host's one door to workers/: every worker module the host package reads, named once
here with the reason, and handed on as an attribute (`from comfyui_xdit.bridge import
families`, or `bridge.latent_layout.to_model(...)` where the module should load only when
used).

The pack's `workers/` folder is not put on sys.path inside ComfyUI (a top-level name
`workers` could clash with another pack): it is loaded once as the private package
`comfyui_xdit_workers`, whose modules import each other relatively, so they work under that
name. Only cheap modules (no torch.distributed at import) are meant to be loaded this way.
A module loads at its first use, so what needs torch costs nothing until then.
`tests/test_layout.py` checks that the host reaches workers/ through no other door, that
every module listed here is used and that each loads.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# attribute -> (the worker module, why the host reads it)
MODULES = {
    "families": ("families", "the family registry and descriptions (shapes, defaults, formats)"),
    "detect": ("models.detect", "model detection: a folder's or file's family and config"),
    "latent_layout": ("models.latent_layout",
                      "packing latents between ComfyUI's and the model's layout"),
    "comfy_lora": ("loading.comfy_lora",
                   "the weight names ComfyUI's LoRA loaders patch on the xDiT MODEL"),
    "stages": ("loading.stages", "PipeFusion's stage split, for the memory plan"),
    "gguf_types": ("loading.gguf_types", "GGUF types' block sizes, for the memory plan"),
    "weights": ("loading.weights",
                "fp8 storage and block Linears, for the memory plan and fp8 files"),
    "channel": ("runtime.channel", "the host end of the control channel"),
    "protocol": ("runtime.protocol", "the typed host <-> rank 0 messages"),
    "messages": ("messages", "shared message texts and process facts"),
    "degrees": ("parallel.degrees", "a layout's degrees by axis, which jobs and model calls carry"),
    "request": ("runtime.request", "the generation request: its fields, defaults and checks "
                                   "(LoRA files too, before any worker starts), which the "
                                   "host fills and the workers read"),
    "shares": ("parallel.shares", "a split's per-rank weights, parsed and checked on the host"),
    "conditioning": ("runtime.conditioning",
                     "a model call's conditioning, which the xDiT MODEL builds"),
    "latent_parts": ("sampling.latent_parts",
                     "a LATENT of several tensors (ComfyUI's nested one) through a model call"),
    "cache_settings": ("sampling.cache_settings",
                       "the step cache's settings: the request's, the CLI's and the node's"),
}
_PACKAGE = "comfyui_xdit_workers"
_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "workers")


def worker_module(name: str):
    """`worker_module("models.latent_layout")` -> that module of the pack's workers/ (tests
    reach the modules the host does not read through it too)."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _PACKAGE, os.path.join(_FOLDER, "__init__.py"), submodule_search_locations=[_FOLDER])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{_PACKAGE}.{name}")


def family_module(fid: str):
    """A family's description module (workers/families/<id>.py), which its test-model builder
    reads (comfyui_xdit/testmodels/<id>.py): a new family adds no line here."""
    if fid not in __getattr__("families").IDS:
        raise ValueError(f"no family {fid!r}")
    return worker_module(f"families.{fid}")


def __getattr__(name: str):
    """A listed module, loaded at its first use and kept as this module's attribute."""
    if name not in MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mod = worker_module(MODULES[name][0])
    globals()[name] = mod
    return mod
