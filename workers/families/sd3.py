"""SD3 / 3.5: MMDiT joint blocks, CLIP-L + CLIP-G + T5 text with pooled CLIP, unpacked
16-channel latents the transformer patchifies itself, classic CFG."""
from __future__ import annotations

import math

from . import Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets, Text
from ..streams import Attention, text_image
from ._shapes import indices, numbered, pick

VAE_LATENT = {"scaling_factor": 1.5305, "shift_factor": 0.0609}
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
# SD3's pipeline falls back to max_shift 1.16 for a dynamic-shift key its config lacks
DYNAMIC_SHIFT_FALLBACK = {"base_shift": 0.5, "max_shift": 1.16, "base_image_seq_len": 256,
                          "max_image_seq_len": 4096}
# no stored head dim without qk-norm; every SD3/3.5 release uses 64 (hidden = 64 x depth)
HEAD_DIM = 64
CLIP_TOKENS = 77  # the CLIP states joined in front of T5's

RGB = ((-0.0922, -0.0175, 0.0749), (0.0311, 0.0633, 0.0954), (0.1994, 0.0927, 0.0458),
       (0.0856, 0.0339, 0.0902), (0.0587, 0.0272, -0.0496), (-0.0006, 0.1104, 0.0309),
       (0.0978, 0.0306, 0.0427), (-0.0042, 0.1038, 0.1358), (-0.0194, 0.0020, 0.0669),
       (-0.0488, 0.0130, -0.0268), (0.0922, 0.0988, 0.0951), (-0.0278, 0.0524, -0.0542),
       (0.0332, 0.0456, 0.0895), (-0.0069, -0.0030, -0.0810), (-0.0596, -0.0465, -0.0293),
       (-0.1448, -0.1463, -0.1189))
RGB_BIAS = (0.2394, 0.2135, 0.1925)

LATENT = LatentSpec(channels=16, downscale=8, tokens="in_model", norm="scale_shift",
                    comfy_format="SD3", rgb=RGB, rgb_bias=RGB_BIAS,
                    wrong_channels="SD3 uses 16 (encode with the model's VAE, or start from "
                                   "EmptySD3LatentImage)")


def config_from_shapes(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    proj = pick(shapes, bfl, "x_embedder.proj.weight", "pos_embed.proj.weight")
    hidden, in_ch, patch = int(proj[0]), int(proj[1]), int(proj[2])
    blocks = numbered(shapes, "joint_blocks." if bfl else "transformer_blocks.", "joint")
    ln_q = ("joint_blocks.0.x_block.attn.ln_q.weight" if bfl
            else "transformer_blocks.0.attn.norm_q.weight")
    head_dim = int(shapes[ln_q][0]) if ln_q in shapes else HEAD_DIM
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of SD3's head dim {head_dim}")
    pos = pick(shapes, bfl, "pos_embed", "pos_embed.pos_embed")
    side = math.isqrt(int(pos[-2]))
    if side * side != int(pos[-2]):
        raise ValueError(f"positional table of {pos[-2]} entries is not square")
    ctx = shapes["context_embedder.weight"]
    attn2 = indices([k for k in shapes if (".x_block.attn2." if bfl else ".attn2.") in k],
                    "joint_blocks." if bfl else "transformer_blocks.")
    out = pick(shapes, bfl, "final_layer.linear.weight", "proj_out.weight")[0]
    # sample_size only sets PatchEmbed's default grid (cropped per input): SD3's 128, capped
    # by the positional table of small test models
    return {"sample_size": min(128, side * patch), "patch_size": patch, "in_channels": in_ch,
            "out_channels": int(out) // (patch * patch), "num_layers": len(blocks),
            "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
            "joint_attention_dim": int(ctx[1]), "caption_projection_dim": int(ctx[0]),
            "pooled_projection_dim": int(pick(shapes, bfl, "y_embedder.mlp.0.weight",
                                              "time_text_embed.text_embedder.linear_1.weight")[1]),
            "pos_embed_max_size": side, "dual_attention_layers": attn2,
            "qk_norm": "rms_norm" if ln_q in shapes else None}


def released(config: dict) -> tuple:
    return dict(SCHEDULER), dict(VAE_LATENT)


# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py). SD3.5 Large (8.1B): 38 joint blocks, 38 heads x 64
# (2432 wide), QK RMS norm, T5 states 4096 wide, pooled CLIP-L + CLIP-G 2048, position table
# 192 patches a side; text encoders CLIP ViT-L/14 and OpenCLIP bigG/14 text towers (with
# projection) and T5-XXL v1.1's encoder; 16-channel AutoencoderKL. 256 T5 tokens (the
# pipeline's default) beside the 77 CLIP tokens.
PRESETS = {
    "sd3.5-large": dict(
        transformer={"num_layers": 38, "num_attention_heads": 38, "attention_head_dim": 64,
                     "joint_attention_dim": 4096, "caption_projection_dim": 2432,
                     "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
                     "qk_norm": "rms_norm", "in_channels": 16, "out_channels": 16,
                     "patch_size": 2, "sample_size": 128},
        text_encoders=(("CLIPTextModelWithProjection", {
                            "hidden_size": 768, "intermediate_size": 3072,
                            "num_hidden_layers": 12, "num_attention_heads": 12,
                            "vocab_size": 49408, "max_position_embeddings": 77,
                            "projection_dim": 768}),
                       ("CLIPTextModelWithProjection", {
                            "hidden_size": 1280, "intermediate_size": 5120,
                            "num_hidden_layers": 32, "num_attention_heads": 20,
                            "vocab_size": 49408, "max_position_embeddings": 77,
                            "projection_dim": 1280, "hidden_act": "gelu"}),
                       ("T5EncoderModel", {"d_model": 4096, "d_ff": 10240, "d_kv": 64,
                                           "num_heads": 64, "num_layers": 24,
                                           "feed_forward_proj": "gated-gelu",
                                           "vocab_size": 32128, "tie_word_embeddings": False})),
        vae=("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512],
                               "down_block_types": ["DownEncoderBlock2D"] * 4,
                               "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "latent_channels": 16, "layers_per_block": 2}),
        text_tokens=256, note="SD3.5 Large 8.1B + CLIP-L + CLIP-G + T5-XXL"),
}


FAMILY = Family(
    id="sd3", order=30, name="SD3/3.5",
    classes=Classes(transformer="SD3Transformer2DModel", pipelines=("StableDiffusion3Pipeline",),
                    adapter="SD3Adapter"),
    blocks=Blocks(lists=("transformer_blocks",), counts=("num_layers",), bfl=("joint_blocks",)),
    latent=LATENT,
    text=Text(hint="encode with SD3's CLIP-L + CLIP-G + T5-XXL (TripleCLIPLoader)",
              extra_tokens=CLIP_TOKENS),
    comfy=ComfySpec(base=lambda unet: "SD3", config=lambda unet: "SD3",
                    unet=lambda cfg: {"image_model": "sd3", "out_channels": 16},
                    cfg_first=True),
    defaults=Defaults(cfg=7.0),
    detection=Detection(
        markers=(("bfl", "joint_blocks.0.x_block.attn.qkv.weight"),
                 ("diffusers", ("pos_embed.proj.weight",
                                "transformer_blocks.0.attn.to_q.weight"))),
        config_from_shapes=config_from_shapes, order=30, released=released,
        config_defaults={"patch_size": 2}),
    # image then text, joint; SD3.5's second attention of a block over the image alone
    tokens=text_image(False, attentions=(Attention(("image", "text")), Attention(("image",)))),
    capabilities=(Presets(PRESETS),),
)
