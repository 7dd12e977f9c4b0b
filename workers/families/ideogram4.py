"""Ideogram 4 (diffusers Ideogram4Pipeline): one packed stream of [text, image] tokens through
single-stream blocks with 3-axis interleaved MRoPE; the text is concatenated Qwen3-VL hidden
states of 13 decoder layers; FLUX.2's 32-channel batch-norm VAE, the latent patchified 2x2
into 128 channels (ComfyUI's LATENT is FLUX.2's); the model takes 1 - sigma and returns the
velocity towards the data (the pool negates it). Guidance is asymmetric: the unconditional
branch is a second transformer (the folder's `unconditional_transformer`) run on the image
tokens alone, no text; the two predictions mix as g * cond + (1 - g) * uncond, which is
ComfyUI's cfg g."""
from __future__ import annotations

from . import BranchTransformers, Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets, Text
from ..streams import Attention, text_image
from ._shapes import numbered
from .flux2 import LATENT as FLUX2_LATENT

# the released model's text states: these Qwen3-VL decoder layers' outputs, side by side
TEXT_LAYERS = 13
# image RoPE ids start here on every axis (text ids are 0 .. n - 1)
IMAGE_POSITION_OFFSET = 65536
# the logit-normal schedule of Ideogram4Pipeline (mu shifted by 0.5 log(pixels / 512^2))
SCHEDULE = {"mu": 0.0, "std": 1.5, "base_pixels": 512 * 512}
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}

LATENT = FLUX2_LATENT

# Ideogram 4: 34 blocks of 18 heads x 256 (hidden 4608), SwiGLU 12288, AdaLN 512; text 13 x
# 4096 (Qwen3-VL-8B's text model: 36 layers, hidden 4096, MLP 12288, 32 heads / 8 KV heads of
# 128, vocabulary 151936); FLUX.2's VAE. Two transformers of this size: the conditional one
# and the unconditional one.
TRANSFORMER = {"in_channels": 128, "num_layers": 34, "attention_head_dim": 256,
               "num_attention_heads": 18, "intermediate_size": 12288, "adaln_dim": 512,
               "llm_features_dim": 53248, "rope_theta": 5000000, "mrope_section": [24, 20, 20],
               "norm_eps": 1e-5}
PRESETS = {
    "ideogram4": dict(
        transformer=TRANSFORMER,
        text_encoders=(("Qwen3Model", {"hidden_size": 4096, "intermediate_size": 12288,
                                       "num_hidden_layers": 36, "num_attention_heads": 32,
                                       "num_key_value_heads": 8, "head_dim": 128,
                                       "vocab_size": 151936}),),
        vae=("AutoencoderKLFlux2", {"block_out_channels": [128, 256, 512, 512],
                                    "latent_channels": 32, "layers_per_block": 2}),
        text_tokens=2048, experts=2,
        note="Ideogram 4 (2 x 9.3B: conditional + unconditional transformer) + Qwen3-VL-8B"),
}


def pipeline_of(index_class) -> str:
    if index_class in (None, "Ideogram4Pipeline"):
        return "Ideogram4Pipeline"
    raise ValueError(f"names pipeline {index_class!r}; Ideogram 4 folders run with "
                     f"Ideogram4Pipeline (text to image)")


def released(config: dict) -> tuple:
    """The released scheduler (plain FlowMatch Euler; the pipeline sets its own sigmas) and
    FLUX.2's VAE (batch-norm statistics live in the VAE's weights)."""
    return dict(SCHEDULER), {"_class_name": "AutoencoderKLFlux2", "batch_norm_eps": 1e-4}


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """The transformer config from a file's weight shapes (ComfyUI's names and diffusers'
    share every tensor this reads); the RoPE settings are the released ones."""
    hidden, in_ch = (int(v) for v in shapes["input_proj.weight"])
    llm = int(shapes["llm_cond_proj.weight"][1])
    adaln = int(shapes["adaln_proj.weight"][0])
    head_dim = int(shapes["layers.0.attention.norm_q.weight"][0])
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head dim {head_dim}")
    mlp = int(shapes["layers.0.feed_forward.w1.weight"][0])
    return dict(TRANSFORMER, in_channels=in_ch, intermediate_size=mlp, num_layers=len(numbered(shapes, "layers.", "")),
                attention_head_dim=head_dim, num_attention_heads=hidden // head_dim,
                adaln_dim=adaln, llm_features_dim=llm)


def comfy_unet(cfg: dict) -> dict:
    """What ComfyUI 0.33.0's detection finds in an Ideogram 4 file (image_model ideogram4)."""
    cfg = FAMILY.full_config(cfg)
    return {"image_model": "ideogram4", "in_channels": int(cfg["in_channels"]),
            "num_layers": int(cfg["num_layers"])}


FAMILY = Family(
    id="ideogram4", order=75, name="Ideogram 4",
    classes=Classes(transformer="Ideogram4Transformer2DModel", pipelines=("Ideogram4Pipeline",),
                    adapter="Ideogram4Adapter", vae=("AutoencoderKLFlux2",)),
    blocks=Blocks(lists=("layers",), counts=("num_layers",)),
    latent=LATENT,
    text=Text(hint="encode with Ideogram 4's text encoder (Qwen3-VL) or type the prompt into "
                   "the sampler", pooled=False, negative=False),
    # ComfyUI's model takes sigma (FLOW, multiplier 1); the adapter's t is sigma x 1000
    comfy=ComfySpec(base=lambda unet: "Ideogram4", config=lambda unet: "Ideogram4",
                    unet=comfy_unet, timestep_scale=1000.0),
    # Ideogram4Pipeline's recommended schedule is 7 for all but the last 3 steps (then 3)
    defaults=Defaults(cfg=7.0),
    detection=Detection(
        markers=(("diffusers", ("llm_cond_proj.weight", "embed_image_indicator.weight")),),
        config_from_shapes=config_from_shapes, order=60, released=released, pipeline_of=pipeline_of,
        config_defaults=dict(TRANSFORMER),
        config_names={"text_width": "llm_features_dim"}),
    # one joint attention over image and text (the pipeline packs [text, image]; attention
    # and RoPE ids do not depend on the order, and the step cache measures the latent
    # stream's tokens first); the unconditional pass has no text: the image over itself
    tokens=text_image(False, attentions=(Attention(("image", "text")), Attention(("image",)))),
    # the unconditional pass runs first (cfg rank 0), the conditional one second
    capabilities=(Presets(PRESETS),
                  BranchTransformers(subfolders=("unconditional_transformer", "transformer"),
                                     branches=("uncond", "cond"))),
)
