"""The node that turns an xDiT model handle into a ComfyUI MODEL (V3 schema); imports ComfyUI,
so only the node module imports it."""
from __future__ import annotations

from comfy_api.v0_0_2 import io

from comfyui_xdit.planning.config import ConfigError, auto_config
from comfyui_xdit.planning.model_info import comfy_unet_config
from comfyui_xdit.nodes.settings import EXPERTS, cache_request

CATEGORY = "xDiT"
XDiTModel = io.Custom("XDIT_MODEL")
XDiTCache = io.Custom("XDIT_CACHE")


def model_config_for(handle, info):
    """The parallel layout of the MODEL's calls: the loader's degrees when given; otherwise
    CFG parallel for SD3 (its samplers batch the two branches in every call) and the
    sequence split for FLUX (guidance-distilled, usually one branch)."""
    if handle.degrees_given:
        return handle.explicit_config()
    world = handle.world()
    return auto_config(world, info.heads, info.family.comfy.cfg_first, 1).with_world_size(world)


class ToModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.ToModel",
            display_name="MODEL for KSampler (xDiT)",
            category=CATEGORY,
            description="A ComfyUI MODEL whose every model call runs on the warm xDiT pool: "
                        "connect it to KSampler, KSamplerAdvanced or SamplerCustomAdvanced "
                        "and use any sampler, scheduler or guider. CFG rows split over the "
                        "cfg ranks, the batch over dp, the tokens over Ulysses/Ring. "
                        "ComfyUI's LoRA loaders apply as pool adapters; PipeFusion, "
                        "ControlNet, attention patches, model merges and LoKr / LoHa are "
                        "refused with a message (use Sampler (xDiT) for those).",
            inputs=[XDiTModel.Input("model"),
                    io.Combo.Input("expert", options=list(EXPERTS), default=EXPERTS[0],
                                   optional=True,
                                   tooltip="Models of two experts (Wan 2.2 A14B: a folder "
                                           "or the loader's two files): which one this "
                                           "MODEL runs, high_noise (the folder's "
                                           "transformer, the model file) or low_noise "
                                           "(transformer_2, the low_noise_model file). "
                                           "Two of these nodes, one per "
                                           "expert, feed ComfyUI's two KSamplerAdvanced "
                                           "graph; the pool keeps both experts loaded"),
                    XDiTCache.Input("cache", optional=True,
                                    tooltip="Step cache (xDiT): each sampling run gets a "
                                            "fresh cache; every model call counts")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, expert=None, cache=None) -> io.NodeOutput:
        from comfyui_xdit.nodes.pool_registry import REGISTRY
        from comfyui_xdit.nodes.comfy_model import build_model

        info = model.info()
        index = EXPERTS.index(expert or EXPERTS[0])
        if index >= info.experts:
            raise ConfigError(f"expert {expert}: {model.path!r} has one transformer; the "
                              f"low-noise expert is the transformer_2 of a folder of two "
                              f"or the loader's low_noise_model file (Wan 2.2 A14B). "
                              f"Choose {EXPERTS[0]}")
        model.validate()  # a PipeFusion layout is refused by PoolDenoiser, in build_model
        config = model_config_for(model, info).validate(info)

        def current_pool():  # the registry may have replaced the pool since
            return REGISTRY.get(model, config)

        return io.NodeOutput(build_model(current_pool, config, info.arch,
                                         comfy_unet_config(model.path),
                                         cache=None if cache is None else cache_request(cache),
                                         expert=index, path=model.path,
                                         experts=info.experts))
