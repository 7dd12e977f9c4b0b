"""The pack's ComfyUI extension (V3 schema): its node list and the panel's status routes. With
the node modules it lists (loader_nodes, settings_nodes, sampler_nodes, model_nodes; their
shared sockets in node_io) and comfy_model.py, the only modules that import ComfyUI; kept
thin: every decision lives in the ComfyUI-free node modules (`handles`, `operations`,
`node_text`, ...) and `comfy_convert`, which CI tests without ComfyUI."""
from __future__ import annotations

import asyncio
import logging

from comfy_api.v0_0_2 import ComfyExtension

from comfyui_xdit.client.exit_cleanup import install_sigterm
from comfyui_xdit.nodes.loader_nodes import LoadModel
from comfyui_xdit.nodes.pool_registry import REGISTRY
from comfyui_xdit.nodes.sampler_nodes import Decode, LoRA, Sampler, UnloadPool
from comfyui_xdit.nodes.settings_nodes import (CacheSettings, EngineSettings, LowNoiseExpert,
                                               ParallelSettings, PipeFusionSettings,
                                               SamplerOptions)

log = logging.getLogger("comfyui_xdit")
install_sigterm()  # ComfyUI imports the pack at startup, in its main thread


class XDiTExtension(ComfyExtension):
    async def on_load(self) -> None:
        _register_routes()

    async def get_node_list(self) -> list:
        _register_routes()  # on_load is not called by every ComfyUI release
        from comfyui_xdit.nodes.model_nodes import ToModel  # the xDiT MODEL for ComfyUI's own samplers
        return [LoadModel, LowNoiseExpert, ParallelSettings, PipeFusionSettings,
                EngineSettings, CacheSettings,
                SamplerOptions, LoRA, Sampler, Decode, UnloadPool, ToModel]


_ROUTES_DONE = False


def _register_routes() -> None:
    global _ROUTES_DONE
    if _ROUTES_DONE:
        return
    try:
        from aiohttp import web
        from server import PromptServer
        routes = PromptServer.instance.routes
    except Exception as e:  # no server (e.g. a script importing the nodes)
        log.debug("xDiT: no PromptServer, status routes not registered: %s", e)
        return

    async def run(fn):
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    @routes.get("/xdit/status")
    async def xdit_status(request):
        return web.json_response(await run(REGISTRY.status))

    @routes.post("/xdit/unload")
    async def xdit_unload(request):
        n = await run(REGISTRY.unload_all)
        return web.json_response({"unloaded": n})

    @routes.post("/xdit/restart")
    async def xdit_restart(request):
        n = await run(REGISTRY.restart_all)
        return web.json_response({"restarted": n})

    _ROUTES_DONE = True


async def comfy_entrypoint() -> XDiTExtension:
    return XDiTExtension()
