"""Model families, each described once.

A family is two files: its description here (`workers/families/<id>.py`: plain data and a
few pure functions, no torch, cheap to import) and its worker adapter
(`workers/models/<id>.py`: loading, packing, timesteps, encoding, the transformer call).
The description is what the host asks about a family; it lives beside the workers because
they read the same detection and defaults, and the workers never import the host package
(the host loads this package through comfyui_xdit/bridge.py). A `Family` is a small core
that every family has (its classes, block lists, LATENT, text states, ComfyUI model class,
request defaults, detection) and optional capabilities that only some have (`References`,
`ImageToVideo`, `TwoExperts`, `SecondTextEncoder`, `CausalVAE`, `Presets`, `SoundTrack`,
`ExtraGuidance`, `BranchTransformers`), each read by
the module that needs it through `Family.capability`. Every other module asks these two,
never compares family names: tests/test_families.py scans the tree for such a comparison.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..streams import TEXT_IMAGE, TokenLayout


class NotRun(ValueError):
    """A model of a family, recognised (a file's shapes, a folder's config) but of a variant
    the pool does not run; the message says which and what runs."""


@dataclass(frozen=True)
class LatentSpec:
    """ComfyUI's LATENT of the family and how it relates to the transformer's input.

    tokens: how LATENT pixels become transformer tokens ("pack2x2": 2x2 latent pixels per
            token, packed by the host/loop as FLUX does; "in_model": the transformer
            patchifies an unpacked latent itself, as SD3; "flat": the LATENT is patchified
            already, one token per pixel, as FLUX.2's).
    norm:   raw VAE latent <-> model space ("scale_shift": (raw - shift) * scale;
            "mean_std": (raw - mean) / std per channel; "batchnorm": the LATENT is model
            space already, normalised by the VAE's batch-norm statistics, as FLUX.2's).
    frames: the LATENT is 5-D [B, C, T, h, w] (T = 1 for an image).
    video:  T counts video frames: (frames - 1) / time_downscale + 1 of them (Wan); else 1.
    """

    channels: int = 16
    downscale: int = 8  # image pixels per LATENT pixel, each side
    tokens: str = "pack2x2"
    norm: str = "scale_shift"
    frames: bool = False
    video: bool = False
    time_downscale: int = 1  # video frames per latent frame after the first
    comfy_format: str = ""  # ComfyUI's comfy/latent_formats.py class
    # ComfyUI's latent2rgb preview factors for model-space latents (None: no preview)
    rgb: Optional[tuple] = None
    rgb_bias: Optional[tuple] = None
    # what a LATENT of other channels is told (one line)
    wrong_channels: str = ""
    # LATENT pixels per token side where the layout's own count is not it (0: 2 for
    # "pack2x2" / "in_model", 1 for "flat"); HunyuanVideo 1.5's in-model patch is 1
    token_side: int = 0
    # a VAE that encodes time in chunks: (frames a chunk, latent frames a chunk, latent
    # frames of the first `frames a chunk`... less): frames are chunk x n + latents a chunk and
    # give latents x n + first latent frames (MiniMax-H3's (17, 5, 2): 17n + 5 -> 5n + 2);
    # () where frames are time_downscale x k + 1
    frame_chunks: tuple = ()

    @property
    def per_token(self) -> int:
        """LATENT pixels per token side."""
        if self.token_side:
            return self.token_side
        return 2 if self.tokens == "pack2x2" or self.tokens == "in_model" else 1

    @property
    def pixels_per_token(self) -> int:
        """Image pixels per token side (16 for every family so far)."""
        return self.downscale * self.per_token

    def latent_frames(self, frames: int = 1) -> int:
        """LATENT frames of a video of `frames` frames (4k + 1 for Wan); 1 for an image."""
        if not self.video:
            return 1
        if self.frame_chunks:
            chunk, per, first = self.frame_chunks
            return (int(frames) - per) // chunk * per + first
        return (int(frames) - 1) // self.time_downscale + 1

    def video_frames(self, latent_frames: int) -> int:
        """Video frames of a LATENT of `latent_frames` frames (the inverse of latent_frames)."""
        if self.frame_chunks:
            chunk, per, first = self.frame_chunks
            return (int(latent_frames) - first) // per * chunk + per
        return (int(latent_frames) - 1) * self.time_downscale + 1

    def frames_problem(self, frames: int):
        """What is wrong with `frames` for this video latent (None: nothing): frames are
        time_downscale x k + 1, or chunk x n + latents a chunk for a chunked VAE."""
        if self.frame_chunks:
            chunk, per, _ = self.frame_chunks
            if frames < per or (frames - per) % chunk:
                lo = max(per, (frames - per) // chunk * chunk + per)
                return f"is not of the form {chunk}n + {per}", (lo, lo + chunk)
            return None
        k = self.time_downscale
        if (frames - 1) % k:
            lo = (frames - 1) // k * k + 1
            return f"is not of the form {k}k + 1", (lo, lo + k)
        return None

    def shape(self, batch: int, height: int, width: int, frames: int = 1) -> tuple:
        """The LATENT of a batch of `frames`-frame videos (images: frames 1)."""
        d = self.downscale
        hw = (int(height) // d, int(width) // d)
        return (int(batch), self.channels, self.latent_frames(frames)) + hw if self.frames \
            else (int(batch), self.channels) + hw

    def shape_text(self) -> str:
        d = self.downscale
        t = (((f"(frames - {self.frame_chunks[1]})/{self.frame_chunks[0]} x "
               f"{self.frame_chunks[1]} + {self.frame_chunks[2]}, ") if self.frame_chunks
              else f"(frames - 1)/{self.time_downscale} + 1, " if self.video else "1, ")
             if self.frames else "")
        return f"[batch, {self.channels}, {t}height/{d}, width/{d}]"


@dataclass(frozen=True)
class ComfySpec:
    """The ComfyUI model the xDiT MODEL is built as (comfy.model_base / supported_models
    class names, chosen from `unet`, what comfy_unet(config) gave), and how ComfyUI calls
    it."""

    base: Callable  # unet -> comfy.model_base class name
    config: Callable  # unet -> comfy.supported_models class name
    model_type: Callable = lambda unet: None  # unet -> ModelType name (None: the class's)
    unet: Callable = lambda cfg: {}  # the diffusers config -> what ComfyUI's detection finds
    # ComfyUI's timestep -> the transformer's (FLUX-style models take sigma, x 1000 here)
    timestep_scale: float = 1.0
    # unet -> {dotted attribute of ComfyUI's diffusion model: shape} that the model class
    # reads beside the call (Wan's concat_cond: patch_embedding.weight's input channels);
    # the xDiT MODEL gives weightless stand-ins of these shapes
    shapes: Callable = lambda unet: {}
    # model inputs ComfyUI's model class passes beside the call that its diffusion model
    # does not use (Lumina 2 / Z-Image: num_tokens); the xDiT MODEL accepts and drops them
    unused_inputs: tuple = ()
    # the split the MODEL uses when the loader gives no degrees: CFG parallel first where
    # ComfyUI's samplers batch both branches in one call (SD3)
    cfg_first: bool = False
    # the parts of ComfyUI's LATENT for a model whose LATENT is several tensors (a nested
    # LATENT: ComfyUI's `x` is a list of them, its prediction too), in ComfyUI's order;
    # () for one tensor. The parts travel as one (workers/sampling/latent_parts.py)
    latent_parts: tuple = ()
    # ((name, ComfyUI's default), ...): scalar model inputs ComfyUI's model class passes
    # beside the call that the family's forward reads (sent with every call)
    call_inputs: tuple = ()
    # ComfyUI's context holds this many text states side by side on its last axis, each
    # of the transformer's text width (a model with one prompt copy per stream)
    context_streams: int = 1
    # ComfyUI's model inputs (its model class's extra_conds, raw values) -> {name: float}:
    # scalar inputs the family's forward reads that ComfyUI's model class passes inside a
    # structured input (MiniMax-H3's minimax_payload dict); pops that input and raises
    # ValueError for what the pool cannot honour. The xDiT MODEL reads them once per
    # conditioning (no step reads the host); sent with every call
    read_inputs: Optional[Callable] = None
    # ((name, transformer_options key, default), ...): scalar inputs the family's forward
    # reads that a node may set in transformer_options (MiniMax-H3's schedule shifts)
    option_inputs: tuple = ()
    # the text states' length moves every later position and the model has no cross-
    # attention (MiniMax-H3): ComfyUI's plain context keeps conditionings of other lengths
    # in calls of their own (cond and uncond apart), so the xDiT MODEL lets them share one,
    # padded, each row's real length beside (the pool drops the padding)
    ragged_text: bool = False
    # methods ComfyUI's model class calls on its diffusion model beside the call, whose work
    # the pool's forward does itself (MiniMax-H3's text refiner, preprocess_text_embeds):
    # the xDiT MODEL answers them with their first argument unchanged
    passthrough: tuple = ()
    # the config -> the width of text states of a second kind that ComfyUI's model class
    # also takes and runs through modules of its own before the transformer (the modules
    # a single file holds beside it: the adapter's `side_prefixes`, run by its `raw_text`);
    # never the width of the context above, so the width alone says which kind a call
    # carries. None: the family's ComfyUI model takes one kind
    raw_context_width: Optional[Callable] = None
    # () -> {name: float}: model inputs the family's forward reads that are a property of
    # the running ComfyUI's own model class (LTX-2: its blocks' audio-video order), found
    # once in ComfyUI's process when the xDiT MODEL is built and sent with every call;
    # raises ValueError where it cannot tell
    model_inputs: Optional[Callable] = None


@dataclass(frozen=True)
class Classes:
    """The classes a model of the family is made of."""

    transformer: str  # diffusers
    pipelines: tuple  # diffusers pipeline classes that encode its prompts; the first default
    adapter: str  # class name in workers/models/<id>.py
    # the diffusers VAE classes the pool decodes (and encodes references) with
    vae: tuple = ("AutoencoderKL",)


@dataclass(frozen=True)
class Blocks:
    """The transformer's block lists in execution order, the config keys counting each
    list's blocks, and (`bfl`) each list's name in BFL/ComfyUI single files (() where the
    files use diffusers' names)."""

    lists: tuple
    counts: tuple
    bfl: tuple = ()

    def count(self, cfg: dict) -> Optional[int]:
        """Blocks in all lists of a transformer config (None where it does not say)."""
        try:
            return sum(int(cfg.get(k, 0) if i else cfg[k]) for i, k in enumerate(self.counts))
        except (KeyError, TypeError, ValueError):
            return None

    def file_names(self) -> tuple:
        """Every name a block list has in a single file, either naming."""
        return tuple(dict.fromkeys(self.lists + self.bfl))


@dataclass(frozen=True)
class Text:
    """The text states a prompt becomes."""

    hint: str = "encode with this model's text encoders"  # how ComfyUI makes CONDITIONING
    # the CONDITIONING carries a pooled output the transformer needs (ComfyUI's model call
    # gets it as y)
    pooled: bool = True
    extra_tokens: int = 0  # tokens the text encoders join to max_sequence_length's (SD3's CLIP)
    # the unconditional pass reads a negative prompt (False: it runs without text, so a
    # negative prompt or CONDITIONING would change nothing: refused rather than dropped)
    negative: bool = True


@dataclass(frozen=True)
class Defaults:
    """A request's defaults."""

    cfg: float = 1.0  # true CFG / guidance scale
    guidance: Optional[float] = None  # embedded guidance (None: the model has none)
    undistilled_cfg: Optional[float] = None  # the cfg of an undistilled variant (FLUX.2 klein)


@dataclass(frozen=True)
class Detection:
    """How a path holding the family's model is recognised and its transformer config read."""

    # single files: ((naming "bfl" | "diffusers", the key or keys only this family's files
    # have), ...), tried in `order` across families (lower first), and the diffusers config
    # from the weight shapes
    markers: tuple = ()
    config_from_shapes: Optional[Callable] = None
    order: int = 0
    # single files, which carry neither: (scheduler config, VAE latent config) of the
    # released model, from the transformer config
    released: Optional[Callable] = None
    # model_index.json's pipeline class (None: no file) -> the pipeline that encodes the
    # folder's prompts; raises ValueError (one line) for a pipeline of another kind
    pipeline_of: Optional[Callable] = None
    # diffusers class defaults of what a folder's transformer config may omit
    config_defaults: dict = field(default_factory=dict)
    # the transformer config's keys for what shared code reads of it: "heads", "head_dim",
    # "patch", "text_width", "text_2_width", "image_width", "stream_width" (the blocks'
    # activations, where not heads x head width) (CONFIG_NAMES by default); a
    # config that gives its hidden size rather than the head dim names it as "hidden"
    # (Z-Image: n_heads, dim, all_patch_size, cap_feat_dim)
    config_names: dict = field(default_factory=dict)
    # the transformer config (defaults filled in) -> None, or raises NotRun for a variant of
    # the family the pool does not run (Wan 2.2 TI2V-5B)
    check_config: Optional[Callable] = None


# ---- capabilities: what only some families have, each read by the module that needs it ----
@dataclass(frozen=True)
class References:
    """Reference images (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit)."""

    methods: tuple  # ComfyUI's reference methods the family takes (first: default)
    # (width, height) of a reference image in pixels -> its size once the family's pipeline
    # has resized it (what the adapter's encode_reference_images makes; the host counts its
    # tokens for the split check and the memory plan)
    image_size: Optional[Callable] = None


@dataclass(frozen=True)
class ImageToVideo:
    """Video from a start image (Wan I2V, HunyuanVideo 1.5 I2V)."""

    # the transformer config (class defaults filled in) -> (takes a start image's condition,
    # concatenated to the noise along channels; takes the image's CLIP vision states)
    inputs: Callable
    # which states of a CONDITIONING's clip_vision_output the model reads (Wan 2.1 I2V the
    # penultimate hidden states, HunyuanVideo 1.5 the last: its model_base's clip_fea)
    clip_vision_states: str = "penultimate_hidden_states"
    # the start image is optional: the same model makes video from the prompt alone (LTX-2)
    optional: bool = False


@dataclass(frozen=True)
class TwoExperts:
    """A model of two transformers (Wan 2.2 A14B's high- and low-noise experts), each its own
    single file."""

    # the transformer config -> the released boundary ratio (the switch at ratio x 1000
    # timesteps, model_index.json's `boundary_ratio`, which a file lacks), None where no such
    # pair was released for that config
    boundary: Callable


@dataclass(frozen=True)
class SecondTextEncoder:
    """A second text encoder whose states ComfyUI's model takes beside the context
    (HunyuanVideo 1.5's ByT5 glyph states); the xDiT MODEL carries them with their
    conditioning as `context_2`. Their width is the config's `text_2_width` name."""

    comfy_input: str  # the keyword ComfyUI's model passes them under (txt_byt5)
    # the key of ComfyUI's CONDITIONING entry that holds them (conditioning_byt5small), which
    # the xDiT sampler carries
    comfy_conditioning: str


@dataclass(frozen=True)
class CausalVAE:
    """A causal 3-D VAE (Wan's, Qwen-Image's, HunyuanVideo 1.5's, LTX-2's)."""

    # one of the Wan design, which patch-parallel decode rewires
    # (workers/parallel/vae_parallel.py): (diffusers.models.autoencoders module, class prefix)
    patch_parallel: Optional[tuple] = None
    # decodes all frames of a video in one call (HunyuanVideo 1.5's), not a latent frame at a
    # time with a feature cache (Wan's): its largest activation holds every frame
    whole_video: bool = False
    # decodes on the first rank alone, the whole video there (LTX-2's: not patch-parallel):
    # the other ranks hold neither its weights nor its activations
    one_rank: bool = False


@dataclass(frozen=True)
class Presets:
    """Released models' published dimensions, by preset name (the memory plan's `--preset`:
    comfyui_xdit/planning/model_facts.py reads each as transformer config, text encoders as
    (transformers class, config kwargs), VAE as (diffusers class, config kwargs))."""

    named: dict


@dataclass(frozen=True)
class SoundTrack:
    """A sound track denoised with the video (LTX-2): its latent [B, channels, length,
    mel_bins], `latents_per_second` long per second of video at `fps` frames a second (its
    length for a video of `frames` frames: round(frames / fps * latents_per_second)). ComfyUI's
    LATENT nests it after the video latent (an AV LATENT); both are model space there. In the
    workers' model space the two are one token sequence, the video's tokens then the sound's
    (`channels * mel_bins` wide, as wide as a video token): the loop, its scheduler step, the
    guidance and the step cache treat them alike (workers/models/latent_layout.py)."""

    channels: int
    mel_bins: int  # latent mel bins
    latents_per_second: float
    fps: float  # the video frame rate the sound's length is counted at
    sample_rate: int  # the decoded waveform's samples per second
    comfy_format: str = ""  # ComfyUI's comfy/latent_formats.py class of the sound latent

    def length(self, frames: int) -> int:
        """Sound latent frames of a video of `frames` frames."""
        return int(round(int(frames) / self.fps * self.latents_per_second))

    def shape(self, batch: int, frames: int) -> tuple:
        return (int(batch), self.channels, self.length(frames), self.mel_bins)


@dataclass(frozen=True)
class ExtraGuidance:
    """Guidance passes beyond cond / uncond that the family's pipeline runs each step (LTX-2's
    spatio-temporal and modality guidance; workers/sampling/guidance.py): the settings a
    request's `extra_guidance` takes, each name -> (its value when unset, what it is, for
    messages and help), all of them off when unset."""

    settings: dict
    # (settings as given, the request's cfg, the transformer's block count or None) -> what
    # is wrong, one line each
    problems: Callable
    # (settings as given, the request's cfg) -> the names of a step's passes, in the order
    # the loop runs them (its adapter's `guidance_passes` builds them from these)
    passes: Callable


def guidance_pass_names(fam: "Family", given: Optional[dict], cfg) -> tuple:
    """The names of a step's guidance passes for a request (workers/sampling/guidance.py):
    plain CFG's (uncond, cond; cond alone at cfg 1), or the family's own where it declares
    extra guidance. The host counts them for cfg-parallel's degree before a launch."""
    extra = fam.capability(ExtraGuidance)
    if extra is not None:
        return tuple(extra.passes(dict(given or {}), float(cfg)))
    return ("uncond", "cond") if float(cfg) > 1.0 else ("cond",)


@dataclass(frozen=True)
class TokenTimesteps:
    """ComfyUI's model of the family takes a timestep per token: its model class turns a noise
    mask on the LATENT (an image-to-video node's start frame: mask 0, so timestep 0) into one
    timestep per token of each part, and the xDiT MODEL carries them to the pool, sharded
    with the tokens (workers/sampling/model_call.py). A family without this capability
    refuses such a call in one line."""

    # per LATENT part (ComfySpec.latent_parts' order, or the one tensor): the axes of a row's
    # shape ([C, ...], without the batch) that index its tokens, in token order (LTX-2's
    # video (1, 2, 3): frames, rows, columns at patch 1; its sound (1,): latent frames)
    token_axes: tuple
    # the attributes of ComfyUI's diffusion model its model class calls `.patchify(mask x
    # timestep)[0]` on to make a part's timesteps ({name: part index}); the xDiT MODEL answers
    # with the part's token axes flattened, channels last: what a patch-1 patchifier gives
    patchifiers: tuple = ()
    # model inputs ComfyUI's model class passes beside the call that hold the masks the
    # timesteps already carry (the xDiT MODEL takes and drops them)
    mask_inputs: tuple = ()
    # other ways ComfyUI versions' models use the per-token timesteps, which the pool runs
    # where the family's `ComfySpec.model_inputs` detects them: ((a name, {model input:
    # value}), ...); the conformance suite checks each on every layout
    variants: tuple = ()

    def tokens(self, shapes) -> list:
        """Tokens of each part of these per-row shapes."""
        return [math.prod(int(s[a]) for a in axes) for s, axes in zip(shapes, self.token_axes)]


@dataclass(frozen=True)
class BranchTransformers:
    """A transformer per guidance branch (Ideogram 4's conditional `transformer` and its
    `unconditional_transformer`): both resident on a rank that runs both passes; under CFG
    parallel each cfg rank loads only the transformer of the pass it runs."""

    # the folder's subfolder of each branch's transformer, in cfg-rank order (cfg rank k
    # runs pass k of the family's guidance passes)
    subfolders: tuple
    branches: tuple  # the branch names the adapter reads, in the same order


CAPABILITIES = (References, ImageToVideo, TwoExperts, SecondTextEncoder, CausalVAE, Presets,
                SoundTrack, ExtraGuidance, TokenTimesteps, BranchTransformers)


@dataclass(frozen=True)
class Family:
    """What every family has; what only some have is in `capabilities` (`capability`)."""

    id: str
    name: str  # how messages name it
    order: int  # place in lists and messages (lower first; ties by id)
    classes: Classes
    blocks: Blocks
    latent: LatentSpec
    text: Text
    comfy: ComfySpec
    defaults: Defaults
    detection: Detection
    # the token streams (text, image or video, ...): their order in the joint sequence,
    # how each splits over sequence-parallel ranks, their padding, which attends to which
    # (workers/streams.py); the adapter's sequence layout and the memory plan read it
    tokens: TokenLayout = TEXT_IMAGE
    capabilities: tuple = ()  # at most one of each kind in CAPABILITIES

    def __post_init__(self):
        kinds = [type(c) for c in self.capabilities]
        unknown = [k.__name__ for k in kinds if k not in CAPABILITIES]
        if unknown or len(set(kinds)) != len(kinds):
            raise TypeError(f"family {self.id}: capabilities {[k.__name__ for k in kinds]} "
                            f"(one of each of {[k.__name__ for k in CAPABILITIES]})")

    def capability(self, kind):
        """The family's capability of class `kind` (References, TwoExperts, ...), or None."""
        for c in self.capabilities:
            if isinstance(c, kind):
                return c
        return None

    def full_config(self, cfg) -> dict:
        """A transformer config with the class defaults it may omit filled in."""
        return {**self.detection.config_defaults, **dict(cfg)}

    def _config_key(self, what: str) -> str:
        return self.detection.config_names.get(what) or CONFIG_NAMES[what]

    def heads(self, cfg) -> int:
        """Attention heads of a transformer config."""
        return int(cfg[self._config_key("heads")])

    def stream_width(self, cfg) -> int:
        """The width of the blocks' token activations (what PipeFusion's stages pass on):
        heads x head width, or the config's "stream_width" name where the family's differs
        (MiniMax-H3: its hidden width is narrower than its heads)."""
        width = self.config_width("stream_width", cfg)
        return width if width is not None else self.heads(cfg) * self.head_dim(cfg)

    def head_dim(self, cfg) -> int:
        hidden = self.detection.config_names.get("hidden")
        if hidden is not None:
            return int(cfg[hidden]) // self.heads(cfg)
        return int(cfg[self._config_key("head_dim")])

    def patch(self, cfg) -> int:
        """Latent pixels per token side (1 where the config names no patch size)."""
        return spatial_patch(cfg.get(self._config_key("patch"), 1) or 1)

    def config_width(self, what: str, cfg) -> Optional[int]:
        """A width the family's config names under `config_names[what]` ("image_width": the
        image states' width, Wan 2.1 I2V's image_dim by default; "text_2_width": a second text
        encoder's, HunyuanVideo 1.5's text_embed_2_dim); None where the config has none."""
        key = self.detection.config_names.get(what) or CONFIG_NAMES.get(what)
        return None if key is None or cfg.get(key) is None else int(cfg[key])

    def text_width(self, cfg) -> Optional[int]:
        """The width of the text states the transformer takes (its config's
        joint_attention_dim, Wan's text_dim, or the family's "text_width" name: Z-Image's
        cap_feat_dim); None where the config has none."""
        names = self.detection.config_names
        keys = (names["text_width"],) if "text_width" in names \
            else ("joint_attention_dim", "text_dim")
        for key in keys:
            if cfg.get(key) is not None:
                return int(cfg[key])
        return None

    def pipeline_for(self, index_class: Optional[str]) -> str:
        if self.detection.pipeline_of is not None:
            return self.detection.pipeline_of(index_class)
        pipelines = self.classes.pipelines
        return index_class if index_class in pipelines else pipelines[0]

    def adapter_class(self):
        mod = importlib.import_module(f"{__name__.rsplit('.', 1)[0]}.models.{self.id}")
        return getattr(mod, self.classes.adapter)


# what `Detection.config_names` defaults to
CONFIG_NAMES = {"heads": "num_attention_heads", "head_dim": "attention_head_dim",
                "patch": "patch_size", "image_width": "image_dim"}


def _discover() -> dict:
    """Every family module of this package (each defines FAMILY; modules starting with "_"
    are shared helpers), in their declared `order`: adding a family is adding its module."""
    import pkgutil
    found = [importlib.import_module(f"{__name__}.{m.name}").FAMILY
             for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return {f.id: f for f in sorted(found, key=lambda f: (f.order, f.id))}


FAMILIES: dict = _discover()
IDS = tuple(FAMILIES)
BY_CLASS = {f.classes.transformer: f for f in FAMILIES.values()}


def vae_classes() -> tuple:
    """Every VAE class some family decodes with, in family order."""
    return tuple(dict.fromkeys(c for f in FAMILIES.values() for c in f.classes.vae))


def family(fid: str) -> Family:
    try:
        return FAMILIES[fid]
    except KeyError:
        raise ValueError(f"unknown model family {fid!r} (known: {', '.join(IDS)})") from None


def names() -> str:
    """'FLUX.1, FLUX.2, SD3/3.5': every family, for messages."""
    return ", ".join(f.name for f in FAMILIES.values())


def spatial_patch(v) -> int:
    """A transformer config's patch_size as latent pixels per token side (Wan's 3-D
    (1, 2, 2): 2; a list of one, Z-Image's all_patch_size [2]: 2)."""
    return int(v[-1]) if isinstance(v, (list, tuple)) else int(v)


def latent_norm(vae_config: dict) -> tuple:
    """(scale, shift) taking a raw VAE latent to model space, `(raw - shift) * scale`, from a
    VAE config: scaling_factor / shift_factor, or per-channel latents_mean / latents_std
    (lists: scale 1 / std, shift mean)."""
    if vae_config.get("latents_mean") is not None:
        return ([1.0 / float(s) for s in vae_config["latents_std"]],
                [float(m) for m in vae_config["latents_mean"]])
    return (float(vae_config.get("scaling_factor", 1.0)),
            float(vae_config.get("shift_factor", 0.0) or 0.0))


def detect_keys(keys) -> Optional[tuple]:
    """(family, naming) of a single file's tensor names (prefix stripped), or None."""
    keys = set(keys)
    for fam in sorted(FAMILIES.values(), key=lambda f: f.detection.order):
        for naming, marker in fam.detection.markers:
            if all(k in keys for k in ((marker,) if isinstance(marker, str) else marker)):
                return fam, naming
    return None
