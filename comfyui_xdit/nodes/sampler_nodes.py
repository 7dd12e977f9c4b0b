"""The nodes that run work on a pool: Sampler, LoRA, Decode and Unload pools (xDiT), with the
launch progress and previews they show on the node."""
from __future__ import annotations

import logging

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.v0_0_2 import io

from comfyui_xdit.nodes import node_text, operations
from comfyui_xdit.nodes.node_io import CATEGORY, XDiTCache, XDiTModel, XDiTSamplerOptions
from comfyui_xdit.nodes.node_io import progress_text as _progress_text
from comfyui_xdit.nodes.operations import SampleInputs
from comfyui_xdit.nodes.pool_registry import REGISTRY
from comfyui_xdit.nodes.settings import LORA_EXPERT_OPTIONS, MAX_SEED

log = logging.getLogger("comfyui_xdit")
PREVIEW_MAX = 512


def _free_memory(need: int, index: int) -> None:
    """ComfyUI's memory manager asked for `need` bytes on its cuda:`index` (the pool's GPU):
    it unloads ComfyUI's own models there only while that GPU has less free (planning/room.py)."""
    import torch
    comfy.model_management.free_memory(need, torch.device("cuda", index))


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
        pbar.update_absolute(done, max(1, total))
        # asked here, every call (about once a second): the bar's hook raises on the cancel
        # too, but ComfyUI 0.33.0's bar calls it only when the value moves enough, and a
        # launch stays at "loading 0/N" for most of its time
        comfy.model_management.throw_exception_if_processing_interrupted()
    return on_launch


def _previews_enabled() -> bool:
    try:
        from comfy.cli_args import args, LatentPreviewMethod
        return args.preview_method != LatentPreviewMethod.NoPreviews
    except Exception:
        return False


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
                                                 "second guidance scale, the flow shift, "
                                                 "LTX-2's extra guidance passes"),
                io.Image.Input("image", optional=True,
                               tooltip="A start image the pool encodes with the folder's own "
                                       "VAE as the diffusers pipeline does: LTX-2's start "
                                       "frame (image-to-video with its sound), a Wan I2V "
                                       "folder's; or reference / edit images (FLUX.1 "
                                       "Kontext, FLUX.2, Qwen-Image-Edit), one per batch "
                                       "entry of the IMAGE. A diffusers folder is needed"),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, latent, prompt, negative_prompt, seed, steps, cfg, guidance, denoise,
                max_sequence_length=512, positive=None, negative=None,
                cache=None, options=None, image=None) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        arch = model.info().arch
        _check_av_latent(arch)
        from comfyui_xdit.comfy_convert import families
        # FLUX.2: no RGB factors
        previews = _previews_enabled() and families.family(arch).latent.rgb is not None
        inp = SampleInputs(latent=latent, seed=seed, steps=steps, cfg=cfg, guidance=guidance,
                           denoise=denoise, prompt=prompt, negative_prompt=negative_prompt,
                           positive=positive, negative=negative,
                           max_sequence_length=max_sequence_length,
                           preview_every=1 if previews else 0, cache=cache,
                           cfg_2=0.0 if options is None else options.cfg_2,
                           shift=0.0 if options is None else options.shift,
                           extra_guidance=None if options is None
                           else options.extra_guidance(),
                           images=None if image is None else list(image))
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
        return io.NodeOutput(_av_latent(out))


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


def _check_av_latent(arch: str) -> None:
    """A family with sound outputs ComfyUI's AV LATENT, a NestedTensor (ComfyUI 0.8.0 and
    later): refused in one line before anything runs where this ComfyUI has none."""
    from comfyui_xdit.comfy_convert import families
    if not any(s.denoised for s in families.family(arch).tokens.streams):  # no sound
        return
    try:
        import comfy.nested_tensor  # noqa: F401
    except ImportError:
        from comfyui_xdit.comfy_convert import family_name
        from comfyui_xdit.planning.config import ConfigError
        raise ConfigError(f"{family_name(arch)} gives a video with its sound as ComfyUI's AV "
                          "LATENT (comfy.nested_tensor), which this ComfyUI lacks; update "
                          "ComfyUI to 0.8.0 or later") from None


def _av_latent(out: dict) -> dict:
    """A video with its sound ({"samples": video, "audio": sound}) as ComfyUI's AV LATENT:
    the two nested in one NestedTensor (what LTXVSeparateAVLatent and ComfyUI's LTX-2 model
    take); any other LATENT as it is."""
    if out.get("audio") is None:
        return out
    from comfy.nested_tensor import NestedTensor
    rest = {k: v for k, v in out.items() if k not in ("samples", "audio")}
    return dict(rest, samples=NestedTensor([out["samples"], out["audio"]]))


class Decode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.Decode",
            display_name="Decode (xDiT)",
            category=CATEGORY,
            description="LATENT -> IMAGE (and AUDIO: a video's sound track, LTX-2's AV "
                        "LATENT; none for other models). A diffusers-folder model decodes on "
                        "its warm pool with the folder's VAE, patch-parallel over every rank; "
                        "a single-file model has no VAE, so the connected ComfyUI VAE decodes.",
            inputs=[XDiTModel.Input("model"),
                    io.Latent.Input("samples"),
                    io.Vae.Input("vae", optional=True,
                                 tooltip="Used when the model is a single file (no VAE of its "
                                         "own); ignored for diffusers folders")],
            outputs=[io.Image.Output(), io.Audio.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, samples, vae=None) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        images, audio = operations.decode(
            model, samples, vae=vae, on_launch=_launch_progress(node_id, "decode"),
            free_memory=_free_memory if model.device == "cuda" else None, with_audio=True)
        _progress_text(REGISTRY.last_decode_text, node_id)  # replaces a launch's "loading k/N"
        return io.NodeOutput(images, audio)


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
