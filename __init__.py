"""ComfyUI entry point of comfyui-xdit.

Cheap to import: no torch.distributed, no model loading. The pack folder may have any name
(ComfyUI imports it under a path-derived module name), so the host package is registered as
`comfyui_xdit` explicitly instead of putting this folder (and its `workers/`) on sys.path.
"""
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
WEB_DIRECTORY = "./web"

if "comfyui_xdit" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "comfyui_xdit", os.path.join(_HERE, "comfyui_xdit", "__init__.py"),
        submodule_search_locations=[os.path.join(_HERE, "comfyui_xdit")])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["comfyui_xdit"] = _mod
    _spec.loader.exec_module(_mod)


async def comfy_entrypoint():
    """ComfyUI V3 entry: the nodes are imported here, not at pack import time."""
    from comfyui_xdit.nodes.extension import XDiTExtension
    return XDiTExtension()
