"""What the pack's ComfyUI nodes share: their category, the socket types that carry the pack's
own values between them, and the text under a node."""
from __future__ import annotations

import logging

from comfy_api.v0_0_2 import io

log = logging.getLogger("comfyui_xdit")
CATEGORY = "xDiT"
XDiTModel = io.Custom("XDIT_MODEL")
XDiTParallel = io.Custom("XDIT_PARALLEL")
XDiTPipeFusion = io.Custom("XDIT_PIPEFUSION")
XDiTEngine = io.Custom("XDIT_ENGINE")
XDiTCache = io.Custom("XDIT_CACHE")
XDiTSamplerOptions = io.Custom("XDIT_SAMPLER_OPTIONS")
XDiTExpertFile = io.Custom("XDIT_EXPERT_FILE")


def progress_text(text: str, node_id) -> None:
    """Text under the node (ComfyUI's progress_text); never fails the job."""
    if node_id is None:
        return
    try:
        from server import PromptServer
        PromptServer.instance.send_progress_text(text, node_id)
    except Exception as e:
        log.debug("xDiT: no progress text: %s", e)
