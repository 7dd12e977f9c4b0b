"""Host access to the few worker modules that hold facts both sides need (latent layout,
architecture detection), without putting the pack's `workers/` folder on sys.path inside
ComfyUI (a top-level name `workers` could clash with another pack). The folder is loaded
once as the private package `comfyui_xdit_workers`; its modules import each other
relatively, so they work under that name. Only cheap modules (no torch.distributed at import)
are meant to be loaded this way.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# Every worker module the host package loads, and why: the edges from comfyui_xdit/ to
# workers/ in one place (tests/test_layout.py checks that the host names no other and that
# each loads). "families.<id>" stands for every family's description module, which its
# test-model builder reads (comfyui_xdit/testmodels/<id>.py): a new family adds no line here.
TARGETS = {
    "families": "the family registry and descriptions (shapes, defaults, formats)",
    "families.<id>": "a family's description, for its test-model builder",
    "models.detect": "model detection: a folder's or file's family and config",
    "models.latent_layout": "packing latents between ComfyUI's and the model's layout",
    "loading.lora_file": "a LoRA file checked on the host before any worker starts",
    "loading.comfy_lora": "the weight names ComfyUI's LoRA loaders patch on the xDiT MODEL",
    "loading.stages": "PipeFusion's stage split, for the memory plan",
    "loading.weights": "fp8 storage and block Linears, for the memory plan and fp8 files",
    "runtime.channel": "the host end of the control channel", "runtime.protocol": "the typed messages",
    "runtime.messages": "shared message texts and process facts",
    "sampling.step_cache": "the step cache's settings, validated on the host",
}
_PACKAGE = "comfyui_xdit_workers"
_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "workers")


def worker_module(name: str):
    """`worker_module("models.latent_layout")` -> that module of the pack's workers/."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _PACKAGE, os.path.join(_FOLDER, "__init__.py"), submodule_search_locations=[_FOLDER])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{_PACKAGE}.{name}")
