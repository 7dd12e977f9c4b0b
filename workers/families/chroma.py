"""Chroma (lodestones' Chroma1-HD / -Base, diffusers ChromaPipeline): FLUX.1-schnell pruned
and retrained. FLUX.1's double + single blocks and 2x2-packed 16-channel latents, T5 text only
(no pooled CLIP), no guidance embedding, no per-block modulation layers: one MLP (the
"distilled guidance layer", the approximator) makes every block's shift/scale/gate from the
timestep. Real classifier-free guidance with a negative prompt."""
from __future__ import annotations

from . import Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets, Text
from ._shapes import numbered, pick
from .flux import LATENT as FLUX_LATENT
from .flux import SCHEDULER_DEV, VAE_LATENT, rope_axes

# FLUX.1's VAE and ComfyUI's latent_formats.Flux (supported_models.Chroma.latent_format)
LATENT = LatentSpec(channels=16, downscale=8, tokens="pack2x2", norm="scale_shift",
                    comfy_format="Flux", rgb=FLUX_LATENT.rgb, rgb_bias=FLUX_LATENT.rgb_bias,
                    wrong_channels="Chroma uses 16 (encode with the model's VAE, or start "
                                   "from EmptySD3LatentImage)")

# The released folder's scheduler: FLUX.1-dev's (resolution-dependent "dynamic" shift).
# Inferred, not read (offline): ChromaPipeline always passes mu = calculate_shift(image
# tokens, 256, 4096, 0.5, 1.15) (these fallbacks when the config lacks them), which the
# scheduler uses only with use_dynamic_shifting on.
SCHEDULER = dict(SCHEDULER_DEV)

# ChromaPipeline.__call__'s guidance_scale default (diffusers 0.42.1)
CFG = 5.0


def config_from_shapes(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    hidden, in_ch = pick(shapes, bfl, "img_in.weight", "x_embedder.weight")
    head_dim = pick(shapes, bfl, "double_blocks.0.img_attn.norm.query_norm.scale",
                    "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head dim {head_dim}")
    double = numbered(shapes, "double_blocks." if bfl else "transformer_blocks.", "double")
    single = numbered(shapes, "single_blocks." if bfl else "single_transformer_blocks.",
                      "single")
    approx_hidden, approx_in = shapes["distilled_guidance_layer.in_proj.weight"]
    approx = numbered(shapes, "distilled_guidance_layer.layers.", "approximator")
    return {"patch_size": 1, "in_channels": int(in_ch),
            "out_channels": int(pick(shapes, bfl, "final_layer.linear.weight",
                                     "proj_out.weight")[0]),
            "num_layers": len(double), "num_single_layers": len(single),
            "attention_head_dim": int(head_dim), "num_attention_heads": int(hidden // head_dim),
            "joint_attention_dim": int(pick(shapes, bfl, "txt_in.weight",
                                            "context_embedder.weight")[1]),
            "axes_dims_rope": list(rope_axes(head_dim)),
            "approximator_num_channels": int(approx_in),
            "approximator_hidden_dim": int(approx_hidden),
            "approximator_layers": len(approx)}


def comfy_unet(cfg: dict) -> dict:
    """What ComfyUI's detection sets for a Chroma file: FLUX's keys with the release's packed
    64 in / out channels written over them. KSampler reads in_channels / out_channels
    (model_base.Flux.concat_cond, when the model has no img_in to look at)."""
    return {"image_model": "chroma", "in_channels": 64, "out_channels": 64, "patch_size": 2}


def released(config: dict) -> tuple:
    """The released scheduler (above) and FLUX's VAE statistics (0.3611 / 0.1159)."""
    return dict(SCHEDULER), dict(VAE_LATENT)


# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py: transformer config, text encoders as
# (transformers class, config kwargs), VAE as (diffusers class, config kwargs)).
PRESETS = {
    # Chroma1-HD (8.9B): FLUX.1's 19 double + 38 single blocks without the guidance and
    # pooled embedders, a 5-layer modulation approximator (diffusers'
    # ChromaTransformer2DModel defaults); T5-XXL only; FLUX's VAE.
    "chroma1-hd": dict(
        transformer={"num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24,
                     "attention_head_dim": 128, "joint_attention_dim": 4096, "in_channels": 64},
        text_encoders=(("T5EncoderModel", {"d_model": 4096, "d_ff": 10240, "d_kv": 64,
                                           "num_heads": 64, "num_layers": 24,
                                           "feed_forward_proj": "gated-gelu",
                                           "vocab_size": 32128, "tie_word_embeddings": False}),),
        vae=("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512],
                               "down_block_types": ["DownEncoderBlock2D"] * 4,
                               "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "latent_channels": 16, "layers_per_block": 2}),
        note="Chroma1-HD 8.9B + T5-XXL"),
}


FAMILY = Family(
    id="chroma", order=40, name="Chroma",
    classes=Classes(transformer="ChromaTransformer2DModel", pipelines=("ChromaPipeline",),
                    adapter="ChromaAdapter"),
    blocks=Blocks(lists=("transformer_blocks", "single_transformer_blocks"),
                  counts=("num_layers", "num_single_layers"),
                  bfl=("double_blocks", "single_blocks")),
    latent=LATENT,
    text=Text(hint="encode with Chroma's T5-XXL (CLIPLoader type chroma)", pooled=False),
    # ComfyUI: model_base.Chroma (a Flux subclass, model type FLUX, timestep = sigma) and
    # supported_models.Chroma, detected by image_model "chroma"
    comfy=ComfySpec(base=lambda unet: "Chroma", config=lambda unet: "Chroma",
                    unet=comfy_unet, timestep_scale=1000.0),
    defaults=Defaults(cfg=CFG),
    detection=Detection(
        # ComfyUI's detection (comfy/model_detection.py): FLUX's double blocks plus an
        # approximator norm, `distilled_guidance_layer.norms.0.scale` (or the `.0.norms.0`
        # spelling it also accepts). diffusers names the norms' weights `.weight` (in_proj
        # is named alike in both namings, so it cannot tell them apart).
        markers=(("bfl", "distilled_guidance_layer.norms.0.scale"),
                 ("bfl", "distilled_guidance_layer.0.norms.0.scale"),
                 ("diffusers", "distilled_guidance_layer.norms.0.weight")),
        config_from_shapes=config_from_shapes, released=released,
        # before FLUX.1 (20): a Chroma file also has FLUX.1's block keys
        order=15,
        config_defaults={"num_attention_heads": 24, "attention_head_dim": 128,
                         "joint_attention_dim": 4096, "patch_size": 1}),
    capabilities=(Presets(PRESETS),),
)
