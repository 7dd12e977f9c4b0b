"""The settings nodes (xDiT/settings): what most users leave automatic, each plugged into an
optional input of its own type (the loader's, the sampler's)."""
from __future__ import annotations

from comfy_api.v0_0_2 import io

from comfyui_xdit.nodes import settings as node_settings
from comfyui_xdit.nodes.loader_nodes import single_file_options as _single_file_options
from comfyui_xdit.nodes.node_io import (XDiTCache, XDiTEngine, XDiTExpertFile, XDiTParallel,
                                        XDiTPipeFusion, XDiTSamplerOptions)
from comfyui_xdit.nodes.settings import (ATTENTION, MEMORY_PLAN_OPTIONS, SETTINGS_CATEGORY,
                                         SPLITS, WEIGHT_OPTIONS)


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
            inputs=[
                io.Int.Input("ulysses", default=1, min=1, max=64,
                             tooltip="Ulysses degree (splits attention heads; must divide them)"),
                io.Int.Input("ring", default=1, min=1, max=64,
                             tooltip="Ring attention degree (K/V passed around a ring)"),
                io.Boolean.Input("cfg_parallel", default=False,
                                 tooltip="Positive and negative branch on different ranks "
                                         "(needs cfg > 1)"),
                io.Int.Input("dp", default=1, min=1, max=64,
                             tooltip="Data parallel: the latent batch split over ranks"),
                io.String.Input("gpus", default="",
                                tooltip="Comma-separated GPU ids for the ranks, as this "
                                        "ComfyUI numbers them (empty: all visible)"),
            ],
            outputs=[XDiTParallel.Output(display_name="parallel")],
        )

    @classmethod
    def execute(cls, ulysses, ring, cfg_parallel, dp, gpus="") -> io.NodeOutput:
        return io.NodeOutput(node_settings.ParallelSettings(
            ulysses=int(ulysses), ring=int(ring), cfg_parallel=bool(cfg_parallel), dp=int(dp),
            gpus=str(gpus or "")))


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
            inputs=[
                io.Int.Input("pipefusion", default=2, min=1, max=64,
                             tooltip="PipeFusion degree: pipeline stages (1: off)"),
                io.Int.Input("warmup_steps", default=1, min=0, max=1000,
                             tooltip="Full synchronous steps first (exact); >= steps makes "
                                     "the whole run exact"),
                io.Int.Input("pipeline_patches", default=0, min=0, max=64,
                             tooltip="Patches per step (0: the PipeFusion degree)"),
                io.Combo.Input("pipefusion_split", options=list(SPLITS), default="balanced",
                               tooltip="Stages: balanced (least work on the slowest stage, "
                                       "each <= 1/N + 5% of the weights), compute, or memory"),
            ],
            outputs=[XDiTPipeFusion.Output(display_name="pipefusion")],
        )

    @classmethod
    def execute(cls, pipefusion, warmup_steps, pipeline_patches,
                pipefusion_split) -> io.NodeOutput:
        return io.NodeOutput(node_settings.PipeFusionSettings(
            pipefusion=int(pipefusion), warmup_steps=int(warmup_steps),
            pipeline_patches=int(pipeline_patches), pipefusion_split=str(pipefusion_split)))


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
            inputs=[
                io.Combo.Input("attention", options=list(ATTENTION), default="auto",
                               tooltip="Attention kernel, chosen once per pool. auto: the "
                                       "fastest this device has; cudnn, flash (flash-attn) "
                                       "and efficient force one (CUDA only); torch: torch's "
                                       "own SDPA choice"),
                io.Boolean.Input("compile", default=False,
                                 tooltip="torch.compile of the transformer blocks during "
                                         "warm-up: faster steps, a much slower first job"),
                io.Combo.Input("weights", options=list(WEIGHT_OPTIONS), default="auto",
                               tooltip="auto: as the checkpoint stores them (an fp8 file "
                                       "stays fp8 on the GPU, others in dtype); fp8: block "
                                       "weights stored in fp8 e4m3fn (half of bf16's "
                                       "memory), computed in dtype; full: every weight in "
                                       "dtype, fp8 files included"),
                io.Combo.Input("text_encoders", options=node_settings.text_encoder_options(),
                               default="auto",
                               tooltip="Where rank 0 runs the text encoders for prompt text: "
                                       "auto (rank 0's GPU when they fit beside the "
                                       "transformer, else CPU), cpu, gpu (rank 0's GPU), or "
                                       "cuda:N (that GPU: a spare one, or another rank's)"),
                io.Boolean.Input("shard_weights", default=False,
                                 tooltip="Keep 1/N of the transformer's weights on each GPU "
                                         "(torch FSDP2; each block gathered just before it "
                                         "runs): exact, for models larger than one GPU; "
                                         "costs one all-weight gather per step (fast on "
                                         "NVLink, slow on PCIe). Not with PipeFusion or "
                                         "compile"),
                io.Combo.Input("memory_plan", options=list(MEMORY_PLAN_OPTIONS), default="auto",
                               tooltip="The per-GPU memory plan made before a CUDA pool "
                                       "launches (an estimate): enforce refuses a layout it "
                                       "predicts will not fit, advise warns and launches "
                                       "anyway; auto: the XDIT_MEMORY_PLAN environment "
                                       "variable, else enforce"),
            ],
            outputs=[XDiTEngine.Output(display_name="engine")],
        )

    @classmethod
    def execute(cls, attention, compile, weights, text_encoders, shard_weights,
                memory_plan) -> io.NodeOutput:
        return io.NodeOutput(node_settings.EngineSettings(
            attention=str(attention), compile=bool(compile), weights=str(weights),
            text_encoders=str(text_encoders), shard_weights=bool(shard_weights),
            memory_plan=str(memory_plan).strip().lower() or "auto"))


class CacheSettings(io.ComfyNode):
    """The step cache is a per-sampling choice: its node plugs into Sampler (xDiT) or MODEL
    for KSampler (xDiT), not into the loader (the pool does not change)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        d = node_settings.CacheSettings()
        return io.Schema(
            node_id="xDiT.CacheSettings",
            display_name="Step cache (xDiT)",
            category=SETTINGS_CATEGORY,
            description="Skips most of a step's transformer blocks while their input barely "
                        "changes (First Block Cache), decided alike on every rank: faster, "
                        "slightly different from the uncached image. Connect to Sampler "
                        "(xDiT) or MODEL for KSampler (xDiT). Not with PipeFusion.",
            inputs=[
                io.Float.Input("threshold", default=d.threshold, min=0.0, max=10.0, step=0.01,
                               round=0.001,
                               tooltip="Skip when the first blocks' output changed less than "
                                       "this (relative); higher: faster, further from the "
                                       "uncached image; 0: off"),
                io.Int.Input("warmup", default=d.warmup, min=0, max=1000,
                             tooltip="Model calls that always compute first"),
                io.Int.Input("head_blocks", default=d.head, min=1, max=100,
                             tooltip="First blocks that always run (their change is measured)"),
                io.Int.Input("tail_blocks", default=d.tail, min=0, max=100,
                             tooltip="Last blocks that always run"),
                io.Int.Input("max_skips", default=d.max_skips, min=0, max=1000,
                             tooltip="Most skipped calls in a row (0: no limit)"),
                io.Boolean.Input("taylor", default=d.taylor,
                                 tooltip="Forecast the skipped blocks' output to first order "
                                         "(TaylorSeer) instead of reusing it"),
            ],
            outputs=[XDiTCache.Output(display_name="cache")],
        )

    @classmethod
    def execute(cls, threshold, warmup, head_blocks, tail_blocks, max_skips,
                taylor) -> io.NodeOutput:
        return io.NodeOutput(node_settings.CacheSettings(
            threshold=float(threshold), warmup=int(warmup), head=int(head_blocks),
            tail=int(tail_blocks), max_skips=int(max_skips), taylor=bool(taylor)))


class SamplerOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="xDiT.SamplerOptions",
            display_name="Sampler options (xDiT)",
            category=SETTINGS_CATEGORY,
            description="Options of Sampler (xDiT) that few models use: Wan 2.2's second "
                        "guidance scale, the flow shift.",
            inputs=[io.Float.Input("cfg_2", default=0.0, min=0.0, max=100.0, step=0.1,
                                   round=0.01,
                                   tooltip="Wan 2.2 A14B: the low-noise expert's guidance "
                                           "scale (the released pipeline's guidance_scale_2). "
                                           "0: the sampler's cfg for both experts"),
                    io.Float.Input("shift", default=0.0, min=0.0, max=100.0, step=0.01,
                                   round=0.01, optional=True,
                                   tooltip="The scheduler's flow shift, as ModelSamplingSD3's "
                                           "shift on a MODEL (Wan, SD3; e.g. 12 for Wan 2.2 "
                                           "T2V A14B as its original code samples). 0: the "
                                           "model's own")],
            outputs=[XDiTSamplerOptions.Output(display_name="options")],
        )

    @classmethod
    def execute(cls, cfg_2, shift=0.0) -> io.NodeOutput:
        return io.NodeOutput(node_settings.SamplerOptions(cfg_2=float(cfg_2), shift=float(shift)))
