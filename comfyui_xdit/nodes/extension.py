"""The ComfyUI nodes (V3 schema). With model_nodes.py and comfy_model.py the only modules that
import ComfyUI; kept thin: every decision lives in the ComfyUI-free node modules (`handles`,
`operations`, `node_text`, ...) and `comfy_convert`, which CI tests without ComfyUI."""
from __future__ import annotations

import asyncio
import logging

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.v0_0_2 import ComfyExtension, io

from comfyui_xdit.client.exit_cleanup import install_sigterm
from comfyui_xdit.nodes import node_text, operations
from comfyui_xdit.nodes import settings as node_settings
from comfyui_xdit.nodes.discovery import FILE_KINDS, discover_models, discover_single_files
from comfyui_xdit.nodes.handles import loader_handle
from comfyui_xdit.nodes.operations import SampleInputs
from comfyui_xdit.nodes.pool_registry import REGISTRY
from comfyui_xdit.nodes.settings import (DEVICES, DTYPES, LORA_EXPERT_OPTIONS, MAX_SEED,
                                         SETTINGS_CATEGORY, WORLD_SIZES)

log = logging.getLogger("comfyui_xdit")
install_sigterm()  # ComfyUI imports the pack at startup, in its main thread
CATEGORY = "xDiT"
XDiTModel = io.Custom("XDIT_MODEL")
XDiTParallel = io.Custom("XDIT_PARALLEL")
XDiTPipeFusion = io.Custom("XDIT_PIPEFUSION")
XDiTEngine = io.Custom("XDIT_ENGINE")
XDiTCache = io.Custom("XDIT_CACHE")
XDiTSamplerOptions = io.Custom("XDIT_SAMPLER_OPTIONS")
XDiTExpertFile = io.Custom("XDIT_EXPERT_FILE")
PREVIEW_MAX = 512


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


def _single_file_options() -> list:
    return discover_single_files(_file_roots())


def _free_memory(need: int, index: int) -> None:
    """ComfyUI's memory manager asked for `need` bytes on its cuda:`index` (the pool's GPU):
    it unloads ComfyUI's own models there only while that GPU has less free (planning/room.py)."""
    import torch
    comfy.model_management.free_memory(need, torch.device("cuda", index))


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


def _progress_text(text: str, node_id) -> None:
    """Text under the node (ComfyUI's progress_text); never fails the job."""
    if node_id is None:
        return
    try:
        from server import PromptServer
        PromptServer.instance.send_progress_text(text, node_id)
    except Exception as e:
        log.debug("xDiT: no progress text: %s", e)


def _launch_progress(node_id, node: str = "sampler"):
    """Launch progress on the node: the bar (ranks loaded of ranks) and a text ("starting 4
    workers", "loading 3/4"; "starting 0/4" on the narrow Decode: `node`, a
    node_text.NODE_TEXT_PX key); ComfyUI's cancel raises from the bar's hook and stops the
    launch."""
    pbar = comfy.utils.ProgressBar(1, node_id=node_id)
    shown = []

    def on_launch(text: str, done: int, total: int) -> None:
        if not shown or shown[-1] != text:  # repeated every second: said once
            shown.append(text)
            log.info("xDiT: %s", text)
            _progress_text(node_text.launch_text(text, done, total, node), node_id)
        pbar.update_absolute(done, max(1, total))  # its hook raises on ComfyUI's cancel
    return on_launch


def _previews_enabled() -> bool:
    try:
        from comfy.cli_args import args, LatentPreviewMethod
        return args.preview_method != LatentPreviewMethod.NoPreviews
    except Exception:
        return False


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
                                       "models/diffusers/FLUX.1-dev, models/diffusers/"
                                       "FLUX.2-klein-4B, models/diffusers/"
                                       "stable-diffusion-3.5-medium, models/diffusers/"
                                       "Qwen-Image, models/diffusers/Chroma1-HD, "
                                       "models/diffusers/Z-Image-Turbo, "
                                       "models/diffusers/Wan2.1-T2V-1.3B-Diffusers, "
                                       "models/diffusers/Wan2.2-T2V-A14B-Diffusers, "
                                       "models/diffusers/Wan2.2-I2V-A14B-Diffusers, "
                                       "models/diffusers/HunyuanVideo-1.5-Diffusers-720p_t2v "
                                       "or models/diffusers/"
                                       "HunyuanVideo-1.5-Diffusers-720p_i2v (the "
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


class LowNoiseExpert(io.ComfyNode):
    """Wan 2.2 A14B's second file, off the loader (it keeps four widgets)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        files = _single_file_options()
        return io.Schema(
            node_id="xDiT.LowNoiseExpert",
            display_name="Low-noise expert (xDiT)",
            category=SETTINGS_CATEGORY,
            description="Wan 2.2 A14B from its two single files: pick the low-noise expert's "
                        "file here and the high-noise one's in Load model (xDiT)'s model, "
                        "then connect this to the loader's low_noise_model. Sampler (xDiT) "
                        "and MODEL for KSampler (xDiT)'s expert input work on the pair as on "
                        "an A14B folder; any other model refuses a second file.",
            inputs=[io.Combo.Input("low_noise_model",
                                   options=files or ["(no single file found)"],
                                   tooltip="e.g. diffusion_models/wan2.2_t2v_low_noise_14B_"
                                           "fp16.safetensors (beside ..._high_noise_... in "
                                           "the loader). Refresh (R) after adding a file.")],
            outputs=[XDiTExpertFile.Output(display_name="low_noise_model")],
        )

    @classmethod
    def execute(cls, low_noise_model) -> io.NodeOutput:
        return io.NodeOutput(node_settings.ExpertFile(name=str(low_noise_model)))


def _widgets(value_type) -> list:
    """A settings node's widgets: its value's fields, as nodes/settings.py shows them."""
    return [getattr(io, w.kind).Input(w.name, **w.kwargs)
            for w in node_settings.node_inputs(value_type)]


class ParallelSettings(io.ComfyNode):
    """Degrees off the loader: most users keep the automatic split, so they live here."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.ParallelSettings",
            display_name="Parallel settings (xDiT)",
            category=SETTINGS_CATEGORY,
            description="The parallel degrees and GPUs for Load model (xDiT)'s parallel input. "
                        "All degrees 1: the loader's automatic split; otherwise exactly these, "
                        "and world size = dp x cfg x pipefusion x ulysses x ring.",
            inputs=_widgets(node_settings.ParallelSettings),
            outputs=[XDiTParallel.Output(display_name="parallel")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(node_settings.node_value(node_settings.ParallelSettings, inputs))


class PipeFusionSettings(io.ComfyNode):
    """PipeFusion is not exact and needs its own knobs: opt-in, on its own node."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.PipeFusionSettings",
            display_name="PipeFusion settings (xDiT)",
            category=SETTINGS_CATEGORY,
            description="PipeFusion for Load model (xDiT)'s pipefusion input: each rank "
                        "loads only 1/N of the transformer blocks and the image flows through "
                        "them patch by patch (least memory and traffic; not exact after the "
                        "warmup steps).",
            inputs=_widgets(node_settings.PipeFusionSettings),
            outputs=[XDiTPipeFusion.Output(display_name="pipefusion")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(node_settings.node_value(node_settings.PipeFusionSettings, inputs))


class EngineSettings(io.ComfyNode):
    """How each rank runs the model: options for tuning and for models that do not fit."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.EngineSettings",
            display_name="Engine settings (xDiT)",
            category=SETTINGS_CATEGORY,
            description="Engine options for Load model (xDiT)'s engine input; fixed for a "
                        "pool's life (changing one relaunches it).",
            inputs=_widgets(node_settings.EngineSettings),
            outputs=[XDiTEngine.Output(display_name="engine")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(node_settings.node_value(node_settings.EngineSettings, inputs))


class CacheSettings(io.ComfyNode):
    """The step cache is a per-sampling choice: its node plugs into Sampler (xDiT) or MODEL
    for KSampler (xDiT), not into the loader (the pool does not change). It outputs the
    workers' own CacheSettings."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.CacheSettings",
            display_name="Step cache (xDiT)",
            category=SETTINGS_CATEGORY,
            description="Skips most of a step's transformer blocks while their input barely "
                        "changes (First Block Cache), decided alike on every rank: faster, "
                        "slightly different from the uncached image. Connect to Sampler "
                        "(xDiT) or MODEL for KSampler (xDiT). Not with PipeFusion.",
            inputs=_widgets(node_settings.CacheSettings),
            outputs=[XDiTCache.Output(display_name="cache")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(node_settings.node_value(node_settings.CacheSettings, inputs))


class SamplerOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.SamplerOptions",
            display_name="Sampler options (xDiT)",
            category=SETTINGS_CATEGORY,
            description="Options of Sampler (xDiT) that few models use: Wan 2.2's second "
                        "guidance scale, the flow shift.",
            inputs=_widgets(node_settings.SamplerOptions),
            outputs=[XDiTSamplerOptions.Output(display_name="options")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(node_settings.node_value(node_settings.SamplerOptions, inputs))


class Sampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.Sampler",
            display_name="Sampler (xDiT)",
            category=CATEGORY,
            description=f"Samples {node_text.family_list()} on the xDiT worker pool. "
                        "LATENT out is ComfyUI's own for the model (raw VAE space; FLUX.2: "
                        "ComfyUI's 128-channel "
                        "patchified, normalised latent at 1/16): decode it with Decode (xDiT) "
                        "or the stock VAEDecode (FLUX.2: a ComfyUI with FLUX.2 support). "
                        "Wan: a video LATENT [B, 16, T, H/8, W/8] of (T - 1) x 4 + 1 frames; "
                        "Decode (xDiT) gives its frames as an IMAGE batch for the video save "
                        "nodes; previews show the first frame.",
            inputs=[
                XDiTModel.Input("model"),
                io.Latent.Input("latent", tooltip="EmptySD3LatentImage (text-to-image; any "
                                                  "empty latent gives the size) or a VAEEncode "
                                                  "latent (image-to-image with denoise; FLUX.2: "
                                                  "ComfyUI's 128-channel FLUX.2 latent). Wan: "
                                                  "EmptyHunyuanLatentVideo (its length in "
                                                  "frames, 4k + 1)"),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="Used when no positive CONDITIONING is connected "
                                        "(encoded by the pool's own text encoders: diffusers "
                                        "folders only; a single-file model needs CONDITIONING)"),
                io.String.Input("negative_prompt", multiline=True, default="",
                                tooltip="Used with cfg > 1 when no negative CONDITIONING is connected"),
                io.Int.Input("seed", default=0, min=0, max=MAX_SEED, control_after_generate=True,
                             tooltip="Same noise as KSampler for the same seed and latent"),
                io.Int.Input("steps", default=20, min=1, max=10000),
                io.Float.Input("cfg", default=0.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance (true CFG with the "
                                       "negative prompt). 0: the model's default ("
                                       + node_text.cfg_defaults_text() + "); > 1 enables "
                                       "it"),
                io.Float.Input("guidance", default=0.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Embedded guidance. 0: the model's default ("
                                       + node_text.guidance_defaults_text() + "); ignored "
                                       "by models without it (FLUX.2 [klein] and the other "
                                       "families); a FluxGuidance value on the positive "
                                       "CONDITIONING takes precedence"),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="For a non-empty input latent (image-to-image); an empty "
                                       "latent is always sampled from pure noise"),
                io.Int.Input("max_sequence_length", default=512, min=1, max=512, optional=True,
                             tooltip="T5 tokens for the prompt text path"),
                io.Conditioning.Input("positive", optional=True,
                                      tooltip=node_text.conditioning_hint_text()),
                io.Conditioning.Input("negative", optional=True),
                XDiTCache.Input("cache", optional=True,
                                tooltip="Step cache (xDiT): skip blocks of steps that barely "
                                        "change"),
                XDiTSamplerOptions.Input("options", optional=True,
                                         tooltip="Sampler options (xDiT): Wan 2.2 A14B's "
                                                 "second guidance scale"),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, latent, prompt, negative_prompt, seed, steps, cfg, guidance, denoise,
                max_sequence_length=512, positive=None, negative=None,
                cache=None, options=None) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        arch = model.info().arch
        from comfyui_xdit.comfy_convert import families
        # FLUX.2: no RGB factors
        previews = _previews_enabled() and families.family(arch).latent.rgb is not None
        inp = SampleInputs(latent=latent, seed=seed, steps=steps, cfg=cfg, guidance=guidance,
                           denoise=denoise, prompt=prompt, negative_prompt=negative_prompt,
                           positive=positive, negative=negative,
                           max_sequence_length=max_sequence_length,
                           preview_every=1 if previews else 0, cache=cache,
                           cfg_2=0.0 if options is None else options.cfg_2,
                           shift=0.0 if options is None else options.shift)
        pbar = comfy.utils.ProgressBar(steps, node_id=node_id)

        def on_event(ev: dict) -> None:
            text = node_text.compiling_text(ev)
            if text is not None:
                _progress_text(text, node_id)
                return
            if "step" not in ev:
                return
            if ev.get("cache"):
                _progress_text(node_text.step_text(ev["step"], ev["total"], ev["cache"]),
                               node_id)
            preview = None
            if previews and ev.get("preview") is not None:
                try:
                    from PIL import Image

                    from comfyui_xdit.comfy_convert import preview_rgb
                    img = Image.fromarray(preview_rgb(ev["preview"], arch).numpy())
                    preview = ("JPEG", img, PREVIEW_MAX)
                except Exception as e:  # a preview must never fail the job
                    log.debug("xDiT preview failed: %s", e)
            # raises InterruptProcessingException on ComfyUI's cancel: the pool cancels the job
            pbar.update_absolute(ev["step"], ev["total"], preview)

        try:
            out = operations.sample(model, inp, on_event=on_event,
                                    is_interrupted=comfy.model_management.processing_interrupted,
                                    on_launch=_launch_progress(node_id),
                                    free_memory=_free_memory if model.device == "cuda" else None)
        except Exception as e:
            from comfyui_xdit.client.pool import JobCancelled
            if isinstance(e, JobCancelled):
                comfy.model_management.throw_exception_if_processing_interrupted()
            raise
        # the launch's last "loading k/N" is replaced by what ran
        _progress_text(REGISTRY.last_job.get("text", ""), node_id)
        return io.NodeOutput(out)


class LoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.LoRA",
            display_name="LoRA (xDiT)",
            category=CATEGORY,
            description="Adds a LoRA from models/loras to an xDiT model; chain several. "
                        "Changing the list or strengths never reloads the base model.",
            inputs=[XDiTModel.Input("model"),
                    io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras")),
                    io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01),
                    io.Combo.Input("expert", options=list(LORA_EXPERT_OPTIONS), default="both",
                                   optional=True,
                                   tooltip="Wan 2.2 A14B (a folder or its two expert "
                                           "files): both transformers, or only the "
                                           "high-noise (high) or low-noise (low) expert, as "
                                           "its LoRAs ship one file per expert. Other "
                                           "models: both")],
            outputs=[XDiTModel.Output()],
        )

    @classmethod
    def execute(cls, model, lora_name, strength, expert="both") -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise("loras", lora_name)
        return io.NodeOutput(model.with_lora(path, strength, expert))


class Decode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.Decode",
            display_name="Decode (xDiT)",
            category=CATEGORY,
            description="LATENT -> IMAGE. A diffusers-folder model decodes on its warm pool "
                        "with the folder's VAE, patch-parallel over every rank; a single-file "
                        "model has no VAE, so the connected ComfyUI VAE decodes.",
            inputs=[XDiTModel.Input("model"),
                    io.Latent.Input("samples"),
                    io.Vae.Input("vae", optional=True,
                                 tooltip="Used when the model is a single file (no VAE of its "
                                         "own); ignored for diffusers folders")],
            outputs=[io.Image.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, samples, vae=None) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        images = operations.decode(model, samples, vae=vae,
                                   on_launch=_launch_progress(node_id, "decode"),
                                   free_memory=_free_memory if model.device == "cuda" else None)
        _progress_text(REGISTRY.last_decode_text, node_id)  # replaces a launch's "loading k/N"
        return io.NodeOutput(images)


class UnloadPool(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.UnloadPool",
            display_name="Unload pool (xDiT)",
            category=CATEGORY,
            description="Stops every xDiT worker pool and frees its memory (the next sampling "
                        "relaunches). Pass a LATENT through to order it after a sampler.",
            inputs=[io.Latent.Input("latent", optional=True)],
            outputs=[io.Latent.Output()],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # always runs

    @classmethod
    def execute(cls, latent=None) -> io.NodeOutput:
        n = REGISTRY.unload_all()
        log.info("xDiT: unloaded %d pool(s)", n)
        return io.NodeOutput(latent)


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
