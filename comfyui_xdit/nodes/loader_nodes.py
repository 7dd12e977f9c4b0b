"""The loader node, Load model (xDiT): the models ComfyUI's folders hold, and a handle that
describes one and the ranks that run it (nothing starts here)."""
from __future__ import annotations

import logging

import comfy.model_management
import folder_paths
from comfy_api.v0_0_2 import io

from comfyui_xdit.nodes import node_text
from comfyui_xdit.nodes.discovery import FILE_KINDS, discover_models, discover_single_files
from comfyui_xdit.nodes.handles import loader_handle
from comfyui_xdit.nodes.node_io import (CATEGORY, XDiTEngine, XDiTExpertFile, XDiTModel,
                                        XDiTParallel, XDiTPipeFusion)
from comfyui_xdit.nodes.node_io import progress_text as _progress_text
from comfyui_xdit.nodes.settings import DEVICES, DTYPES, WORLD_SIZES

log = logging.getLogger("comfyui_xdit")


def _model_folders() -> list:
    return folder_paths.get_folder_paths("diffusers")


def _file_roots() -> dict:
    """models/diffusion_models (+ legacy unet) and models/checkpoints, as ComfyUI knows them."""
    out = {}
    for kind in FILE_KINDS:
        try:
            out[kind] = folder_paths.get_folder_paths(kind)
        except Exception:  # a ComfyUI without this folder kind
            out[kind] = []
    return out


def _model_options() -> list:
    return discover_models(_model_folders()) + discover_single_files(_file_roots())


def single_file_options() -> list:
    return discover_single_files(_file_roots())


def _cuda_here() -> tuple:
    """(usable, why not): CUDA counts only when torch has it and ComfyUI was not started
    with --cpu (the user's word that this ComfyUI runs on the CPU)."""
    try:
        if comfy.model_management.cpu_state == comfy.model_management.CPUState.CPU:
            return False, "ComfyUI runs with --cpu"
    except Exception:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            return True, ""
    except Exception:
        pass
    return False, "this ComfyUI has no CUDA GPU (torch.cuda.is_available() is False)"


class LoadModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        models = _model_options()
        return io.Schema(
            node_id="xDiT.LoadModel",
            display_name="Load model (xDiT)",
            category=CATEGORY,
            description=f"Describes a model ({node_text.family_list()}) and "
                        "how many ranks run it; "
                        "the split is chosen for you unless a settings node is connected. "
                        "Nothing starts here: the pool launches at the first sampling and stays warm.",
            inputs=[
                io.Combo.Input("model", options=models or ["(no model found)"],
                               tooltip="A diffusers folder in ComfyUI/models/diffusers, e.g. "
                                       + node_text.example_models_text() + " (the "
                                       "names the example "
                                       "workflows use; a Hugging Face snapshot of the repo, "
                                       "text encoders and VAE included), or a single "
                                       "transformer .safetensors ("
                                       + node_text.family_list() + ") from "
                                       "models/diffusion_models (or unet) "
                                       "or models/checkpoints (listed as diffusion_models/... "
                                       "and checkpoints/...): transformer only, so connect "
                                       "CONDITIONING and decode with a ComfyUI VAE. Refresh "
                                       "(R) after adding a model."),
                io.Combo.Input("device", options=list(DEVICES), default="auto",
                               tooltip="auto: cuda when this ComfyUI has CUDA (and was not "
                                       "started with --cpu), else cpu. cuda: one GPU per rank "
                                       "(refused where there is no CUDA); cpu: one process "
                                       "per rank (gloo)"),
                io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                               tooltip="Weights and compute dtype on the workers. auto: bf16 "
                                       "on cuda, fp32 on cpu (the CPU workers run fp32 only; "
                                       "bf16/fp16 there are refused)"),
                io.Combo.Input("world_size", options=list(WORLD_SIZES), default="auto",
                               tooltip="Ranks. auto: every visible GPU (or every GPU of "
                                       "Parallel settings' list; 2 processes on CPU), split "
                                       "automatically (CFG parallel first, then Ulysses, then "
                                       "Ring). With degrees set by the settings nodes, auto "
                                       "means their product and a number must equal it."),
                XDiTExpertFile.Input("low_noise_model", optional=True,
                                     tooltip="Low-noise expert (xDiT): Wan 2.2 A14B from "
                                             "its two single files, the high-noise one "
                                             "in model"),
                XDiTParallel.Input("parallel", optional=True,
                                   tooltip="Parallel settings (xDiT): Ulysses, Ring, CFG "
                                           "parallel, DP degrees and the GPU list"),
                XDiTPipeFusion.Input("pipefusion", optional=True,
                                     tooltip="PipeFusion settings (xDiT): degree, warmup "
                                             "steps, patches, stage split"),
                XDiTEngine.Input("engine", optional=True,
                                 tooltip="Engine settings (xDiT): attention kernel, compile, "
                                         "weights, text encoders, weight sharding, memory plan"),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def _handle(cls, **inputs):
        has_cuda, why = _cuda_here()
        return loader_handle(inputs, _model_folders(), _file_roots(), has_cuda=has_cuda,
                             cuda_refusal=why)

    @classmethod
    def validate_inputs(cls, **inputs):
        # Raised, not returned: ComfyUI attaches a returned message to every input it
        # passed (one copy per input); a raised one is reported once for the node.
        cls._handle(**inputs)
        return True

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        handle = cls._handle(**inputs)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        # what will run, on the node (auto resolved): "runs on cpu, fp32, 2 ranks", on CUDA
        # with the memory plan's peak; the plan's summary in the log
        log.info("xDiT: Load model: %s", handle.node_text(node=None))
        _progress_text(handle.node_text(), node_id)
        return io.NodeOutput(handle)
