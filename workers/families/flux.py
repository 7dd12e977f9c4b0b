"""FLUX.1 (dev, schnell, Kontext): 19 double + 38 single blocks, T5 + CLIP pooled text,
2x2-packed 16-channel latents, embedded guidance on dev."""
from __future__ import annotations

from . import (Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets,
               References, Text)
from ._shapes import numbered, pick

# The released VAE's latent statistics (vae/config.json; ComfyUI's latent_formats.Flux):
# raw VAE space -> model space is (raw - shift_factor) * scaling_factor
VAE_LATENT = {"scaling_factor": 0.3611, "shift_factor": 0.1159}

# FLUX.1-dev's scheduler (resolution-dependent "dynamic" shift); schnell's a plain shift 1
DYNAMIC_SHIFT = {"base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                 "max_image_seq_len": 4096}
SCHEDULER_DEV = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                 **DYNAMIC_SHIFT}
SCHEDULER_SCHNELL = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False,
                     **DYNAMIC_SHIFT}

# ComfyUI's latent2rgb factors (latent_formats.Flux)
RGB = ((-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433),
       (-0.0174, 0.0160, 0.0617), (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115),
       (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259), (-0.0245, 0.0250, 0.1180),
       (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
       (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499),
       (-0.1262, -0.0982, -0.0778))
RGB_BIAS = (-0.0329, -0.0718, -0.0851)

LATENT = LatentSpec(channels=16, downscale=8, tokens="pack2x2", norm="scale_shift",
                    comfy_format="Flux", rgb=RGB, rgb_bias=RGB_BIAS,
                    wrong_channels="FLUX.1 uses 16 (encode with the model's VAE, or start "
                                   "from EmptySD3LatentImage)")

ROPE_AXES_128 = (16, 56, 56)  # FLUX.1's RoPE axes for its head dim 128 (not in a file)


def rope_axes(head_dim: int) -> tuple:
    """FLUX's RoPE axes (index, row, column): FLUX.1's (16, 56, 56) for head dim 128; other
    head dims (test models) split into three even axes, the two spatial ones equal."""
    if head_dim == 128:
        return ROPE_AXES_128
    spatial = ((head_dim - 2) // 2) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


def config_from_shapes(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    hidden, in_ch = pick(shapes, bfl, "img_in.weight", "x_embedder.weight")
    head_dim = pick(shapes, bfl, "double_blocks.0.img_attn.norm.query_norm.scale",
                    "transformer_blocks.0.attn.norm_q.weight")[0]
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head dim {head_dim}")
    mlp = pick(shapes, bfl, "double_blocks.0.img_mlp.0.weight",
               "transformer_blocks.0.ff.net.0.proj.weight")[0]
    if mlp != 4 * hidden:
        raise ValueError(f"MLP width {mlp} is not 4 x hidden {hidden} (not FLUX.1)")
    double = numbered(shapes, "double_blocks." if bfl else "transformer_blocks.", "double")
    single = numbered(shapes, "single_blocks." if bfl else "single_transformer_blocks.",
                      "single")
    out = pick(shapes, bfl, "final_layer.linear.weight", "proj_out.weight")[0]
    guidance = ("guidance_in.in_layer.weight" if bfl else
                "time_text_embed.guidance_embedder.linear_1.weight") in shapes
    return {"patch_size": 1, "in_channels": int(in_ch), "out_channels": int(out),
            "num_layers": len(double), "num_single_layers": len(single),
            "attention_head_dim": int(head_dim), "num_attention_heads": int(hidden // head_dim),
            "joint_attention_dim": int(pick(shapes, bfl, "txt_in.weight",
                                            "context_embedder.weight")[1]),
            "pooled_projection_dim": int(pick(shapes, bfl, "vector_in.in_layer.weight",
                                              "time_text_embed.text_embedder.linear_1.weight")[1]),
            "guidance_embeds": bool(guidance), "axes_dims_rope": list(rope_axes(head_dim))}


def released(config: dict) -> tuple:
    """dev (guidance embedding) or schnell's scheduler; the FLUX VAE's statistics."""
    return (dict(SCHEDULER_DEV if config.get("guidance_embeds") else SCHEDULER_SCHNELL),
            dict(VAE_LATENT))


# diffusers' PREFERRED_KONTEXT_RESOLUTIONS (pipeline_flux_kontext.py), (width, height)
KONTEXT_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328),
                       (832, 1248), (880, 1184), (944, 1104), (1024, 1024), (1104, 944),
                       (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720),
                       (1504, 688), (1568, 672))


def kontext_size(width: int, height: int) -> tuple:
    """FluxKontextPipeline's reference resize: the preferred resolution nearest the image's
    aspect ratio, in whole tokens (16 px)."""
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return w // 16 * 16, h // 16 * 16


def comfy_unet(cfg: dict) -> dict:
    return {"image_model": "flux", "guidance_embed": bool(cfg.get("guidance_embeds", False)),
            "in_channels": 16, "out_channels": 16, "patch_size": 2}


# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py: transformer config, text encoders as
# (transformers class, config kwargs), VAE as (diffusers class, config kwargs)).
PRESETS = {
    # FLUX.1 [dev]: 19 double + 38 single blocks, 24 heads x 128, joint_attention_dim 4096,
    # pooled 768, guidance embedding; T5-XXL v1.1 encoder (24 layers, d_model 4096, d_ff
    # 10240, 64 heads x 64, gated GELU) + CLIP ViT-L/14 text model; 16-channel AutoencoderKL.
    "flux1-dev": dict(
        transformer={"num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24,
                     "attention_head_dim": 128, "joint_attention_dim": 4096,
                     "pooled_projection_dim": 768, "in_channels": 64, "guidance_embeds": True},
        text_encoders=(("T5EncoderModel", {"d_model": 4096, "d_ff": 10240, "d_kv": 64,
                                           "num_heads": 64, "num_layers": 24,
                                           "feed_forward_proj": "gated-gelu",
                                           "vocab_size": 32128, "tie_word_embeddings": False}),
                       ("CLIPTextModel", {"hidden_size": 768, "intermediate_size": 3072,
                                          "num_hidden_layers": 12, "num_attention_heads": 12,
                                          "vocab_size": 49408, "max_position_embeddings": 77,
                                          "projection_dim": 768})),
        vae=("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512],
                               "down_block_types": ["DownEncoderBlock2D"] * 4,
                               "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "latent_channels": 16, "layers_per_block": 2}),
        note="FLUX.1 [dev] 12B + T5-XXL + CLIP-L"),
}


FAMILY = Family(
    id="flux", order=10, name="FLUX.1",
    classes=Classes(transformer="FluxTransformer2DModel", pipelines=("FluxPipeline",),
                    adapter="FluxAdapter"),
    blocks=Blocks(lists=("transformer_blocks", "single_transformer_blocks"),
                  counts=("num_layers", "num_single_layers"),
                  bfl=("double_blocks", "single_blocks")),
    latent=LATENT,
    text=Text(hint="encode with FLUX.1's CLIP-L + T5-XXL (DualCLIPLoader type flux)"),
    comfy=ComfySpec(
        base=lambda unet: "Flux",
        config=lambda unet: "Flux" if unet["guidance_embed"] else "FluxSchnell",
        model_type=lambda unet: "FLUX" if unet["guidance_embed"] else "FLOW",
        unet=comfy_unet, timestep_scale=1000.0),
    defaults=Defaults(cfg=1.0, guidance=3.5),
    detection=Detection(
        markers=(("bfl", "double_blocks.0.img_attn.qkv.weight"),
                 ("diffusers", "single_transformer_blocks.0.attn.to_q.weight")),
        config_from_shapes=config_from_shapes, order=20, released=released,
        config_defaults={"guidance_embeds": False, "num_attention_heads": 24,
                         "attention_head_dim": 128, "joint_attention_dim": 4096,
                         "patch_size": 1}),
    capabilities=(
        # ComfyUI's methods (comfy/ldm/flux/model.py): "offset" (index 1, later references
        # beside the earlier ones; one reference = diffusers' FluxKontextPipeline), "index"
        # (index 1, 2, ...), "uxo" (index 0, diagonally past the image)
        References(methods=("offset", "index", "uxo"), image_size=kontext_size),
        Presets(PRESETS)),
)
