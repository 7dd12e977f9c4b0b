"""The settings nodes (xDiT/settings): what most users leave automatic, each plugged into an
optional input of its own type (the loader's, the sampler's)."""
from __future__ import annotations

from comfy_api.v0_0_2 import io

from comfyui_xdit.nodes import settings as node_settings
from comfyui_xdit.nodes.loader_nodes import single_file_options as _single_file_options
from comfyui_xdit.nodes.node_io import (XDiTCache, XDiTEngine, XDiTExpertFile, XDiTParallel,
                                        XDiTPipeFusion, XDiTSamplerOptions)
from comfyui_xdit.nodes.settings import SETTINGS_CATEGORY


def _widgets(value_type) -> list:
    """A settings node's widgets: its value's fields, as nodes/settings.py shows them."""
    return [getattr(io, w.kind).Input(w.name, **w.kwargs)
            for w in node_settings.node_inputs(value_type)]


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
                        "and world size = dp x cfg x pipefusion x ulysses x ring (cfg: "
                        "cfg_degree with cfg_parallel on, else 1).",
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
                        "guidance scale, the flow shift, LTX-2's extra guidance passes "
                        "(spatio-temporal, modality) and its guidance rescale.",
            inputs=_widgets(node_settings.SamplerOptions),
            outputs=[XDiTSamplerOptions.Output(display_name="options")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(node_settings.node_value(node_settings.SamplerOptions, inputs))
