"""What the host needs to know about a model, read without torch.

The detection itself (diffusers folder or single `.safetensors` transformer file -> the
family and the diffusers transformer config) lives with the workers, which build models from
it: workers/models/detect.py, driven by the family descriptions (workers/families). This
module turns its errors into ConfigError and its result into
a `ModelInfo`; the names below are re-exported so host code and tests keep one import.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from comfyui_xdit.errors import ConfigError
from comfyui_xdit import bridge
from comfyui_xdit.bridge import families

_detect = bridge.detect
_messages = bridge.messages

CHECKPOINT_PREFIX = _detect.CHECKPOINT_PREFIX
SINGLE_FILE_SUFFIXES = _detect.SINGLE_FILE_SUFFIXES
NO_TEXT_ENCODERS = _messages.NO_TEXT_ENCODERS
NO_VAE = _messages.NO_VAE


def _config_errors(fn):
    """`fn` of the detection module, raising ConfigError (same one-line message)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _detect.ModelFileError as e:
            raise ConfigError(str(e)) from None
    return wrapped


read_safetensors_header = _config_errors(_detect.read_safetensors_header)
transformer_keys = _config_errors(_detect.transformer_keys)
single_file_config = _config_errors(_detect.single_file_config)
_describe_model = _config_errors(_detect.describe_model)


@dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str  # the family id (workers/families)
    heads: int
    patch_size: int
    kind: str = "diffusers"  # "diffusers" (folder) | "file" (single .safetensors)
    has_text_encoders: bool = True  # a single file has none: CONDITIONING must be given
    has_vae: bool = True  # the pool decodes images with the folder's VAE only
    blocks: Optional[int] = None  # transformer blocks (FLUX: double + single), for PipeFusion
    # how the checkpoint stores its weights: "bf16" | "fp16" | "fp32" | "fp8" | "scaled-fp8"
    # (an fp8 file stays fp8 on the GPU under weights="auto": EngineOptions)
    storage: Optional[str] = None
    # FLUX.2 [klein] folders: model_index.json's `is_distilled` (absent: False, the
    # pipeline's own default). A step-distilled model runs without CFG by default, a base
    # model with it. None where the model does not say (other pipelines, single files).
    distilled: Optional[bool] = None
    # image-to-video (the family's `image_to_video`, Wan I2V): the model needs a start image;
    # and its CLIP vision states (Wan 2.1 I2V)
    start_image: bool = False
    image_states: bool = False
    # a model of two single files (Wan 2.2 A14B): the low-noise expert's file (`path` is the
    # high-noise one); experts: the transformers it denoises with
    path_2: Optional[str] = None
    experts: int = 1
    # the width a Conditioning's text states must have: the family's declared text width,
    # once per prompt stream its context carries side by side (LTX-2: the video's and the
    # sound's); None where the config does not say
    text_width: Optional[int] = None
    # the width of text states of a second kind the family's ComfyUI model also takes
    # (`ComfySpec.raw_context_width`: LTX-2's before its text connectors, ComfyUI 0.33.0's
    # CONDITIONING), which the pool runs through the model's own text modules first
    raw_text_width: Optional[int] = None

    @property
    def family(self):
        """The family's description (workers/families)."""
        return families.family(self.arch)


def _storage_name(storage) -> Optional[str]:
    if not storage:
        return None
    if storage.get("fp8"):
        return "scaled-fp8" if storage.get("scaled") else "fp8"
    return storage.get("dtype")


def _block_count(arch: str, cfg: dict) -> Optional[int]:
    return families.family(arch).blocks.count(cfg)


def _klein_distilled(folder: Path) -> Optional[bool]:
    """`is_distilled` of a Flux2KleinPipeline folder (False when the key is absent, as the
    pipeline reads it); None for any other pipeline (every other family's folders) or an
    unreadable model_index.json."""
    import json

    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("_class_name") != "Flux2KleinPipeline":
        return None
    value = index.get("is_distilled", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{folder / 'model_index.json'}: is_distilled is {value!r}; "
                          f"expected true or false")
    return value


def is_single_file(path) -> bool:
    return os.path.isfile(str(path))


def read_model_info(path, path_2=None) -> ModelInfo:
    """Detect the family of a diffusers folder or a single .safetensors file; one clear
    ConfigError for anything else (missing, another architecture, corrupt). `path_2`: the
    low-noise expert's file of a two-file model (`path` the high-noise one; `read_pair`)."""
    if path_2 is not None:
        return read_pair(path, path_2)
    path = Path(path)
    d = _describe_model(path)
    arch, cfg = d["arch"], d["config"]
    fam = families.family(arch)
    check = fam.detection.check_config
    if check is not None:  # a variant of the family the pool does not run
        try:
            check(fam.full_config(cfg))
        except families.NotRun as e:
            raise ConfigError(f"{path}: {e}") from None
    if d["kind"] == "file":
        return ModelInfo(path=str(path), arch=arch, heads=fam.heads(cfg),
                         patch_size=fam.patch(cfg), kind="file",
                         has_text_encoders=False, has_vae=False,
                         blocks=_block_count(arch, cfg),
                         storage=_storage_name(d.get("storage")), **_i2v(arch, cfg),
                         text_width=_text_width(arch, cfg),
                         raw_text_width=_raw_text_width(arch, cfg))
    # a folder's config omits what equals the diffusers class default
    cfg = fam.full_config(cfg)
    heads = fam.heads({"num_attention_heads": 24, **cfg})  # diffusers' FLUX default
    return ModelInfo(path=str(path), arch=arch, heads=heads, patch_size=fam.patch(cfg),
                     blocks=_block_count(arch, cfg), storage=_storage_name(d.get("storage")),
                     distilled=_klein_distilled(path), experts=expert_count(path),
                     text_width=_text_width(arch, cfg),
                     raw_text_width=_raw_text_width(arch, cfg), **_i2v(arch, cfg))


def read_pair(path, path_2, names=("model_path", "model_path_2")) -> ModelInfo:
    """A model of two single files, Wan 2.2 A14B's high-noise (`path`) and low-noise
    (`path_2`) expert files: both of a family with experts (`TwoExperts`), the
    same transformer config from their shapes, and a config such a pair was released with.
    Anything else: one ConfigError line. `names`: the two inputs' names, as the messages say
    them (the loader node's model / low_noise_model)."""
    for p, which in ((path, names[0]), (path_2, names[1])):
        if os.path.isdir(str(p)):
            raise ConfigError(f"{which} {str(p)!r} is a folder; a second model path pairs two "
                              f"single files (Wan 2.2 A14B's high- and low-noise expert files: "
                              f"a diffusers folder holds both experts, give it alone)")
    first = read_model_info(path)
    fam = first.family
    experts = fam.capability(families.TwoExperts)
    if experts is None:
        raise ConfigError(f"{path} is a {fam.name} model, which has no second expert: "
                          f"{names[1]} is Wan 2.2 A14B's low-noise expert file")
    second = read_model_info(path_2)
    if second.arch != first.arch:
        raise ConfigError(f"{names[1]} {str(path_2)!r} is a {second.family.name} model, "
                          f"not {fam.name}: give the low-noise expert file of the same model")
    a = dict(single_file_config(path)["config"])
    b = dict(single_file_config(path_2)["config"])
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            raise ConfigError(f"the two expert files differ in {k} ({a.get(k)!r} in {path}, "
                              f"{b.get(k)!r} in {path_2}): give the high- and low-noise files "
                              f"of one Wan 2.2 A14B model")
    if experts.boundary(fam.full_config(a)) is None:
        raise ConfigError(f"{path} and {path_2}: no two-expert {fam.name} model was released "
                          f"with this transformer (Wan 2.1 image-to-video: CLIP image K/V); "
                          f"run one file alone")
    return dataclasses.replace(first, path_2=str(path_2), experts=2)


def _text_width(arch: str, cfg: dict) -> Optional[int]:
    fam = families.family(arch)
    width = fam.text_width(fam.full_config(cfg))
    return None if width is None else width * fam.comfy.context_streams


def _raw_text_width(arch: str, cfg: dict) -> Optional[int]:
    raw = families.family(arch).comfy.raw_context_width
    return None if raw is None else int(raw(families.family(arch).full_config(cfg)))


def _i2v(arch: str, cfg: dict) -> dict:
    """ModelInfo's start_image / image_states from the transformer config."""
    fam = families.family(arch)
    i2v = fam.capability(families.ImageToVideo)
    if i2v is None:
        return {}
    start, states = i2v.inputs(fam.full_config(cfg))
    return {"start_image": bool(start), "image_states": bool(states)}


def comfy_unet_config(path) -> dict:
    """What ComfyUI's model detection would find in this model's transformer, for the xDiT
    MODEL's ComfyUI model config (comfyui_xdit/nodes/comfy_model.py; the family's
    `comfy.unet`), from a folder's config.json or a single file's header."""
    d = _describe_model(Path(path))
    fam = families.family(d["arch"])
    return fam.comfy.unet(fam.full_config(d["config"]))


def expert_count(path) -> int:
    """Transformers a diffusers folder denoises with: 2 where model_index.json names a
    `transformer_2` (Wan 2.2 A14B's high- and low-noise experts), else 1 (a single file: 1)."""
    index = os.path.join(str(path), "model_index.json")
    if not os.path.isfile(index):
        return 1
    try:
        with open(index) as f:
            second = json.load(f).get("transformer_2")
    except (OSError, ValueError):
        return 1
    return 2 if isinstance(second, list) and second and second[0] is not None else 1
