"""Wan 2.1 / 2.2 video (diffusers WanPipeline, WanImageToVideoPipeline): a DiT over a frame x
row x column token sequence (3-D patches (1, 2, 2), 3-axis RoPE), self-attention over the
video tokens, cross-attention to UMT5 text states (no pooled output), 16-channel latents of
the causal 3-D VAE, 4x in time and 8x in space, normalised per channel by its mean and std.
Wan 2.2 A14B is two such transformers, a high-noise expert for the first steps and a
low-noise one for the rest (the folder's `boundary_ratio`); each its own guidance scale."""
from __future__ import annotations

from . import (Blocks, CausalVAE, Classes, ComfySpec, Defaults, Detection, Family, ImageToVideo,
               LatentSpec, NotRun, Presets, Text, TwoExperts)
from ..streams import Attention, text_image
from ._shapes import numbered, pick
from .qwen_image import LATENTS_MEAN, LATENTS_STD, RGB, RGB_BIAS

# ComfyUI's latent_formats.Wan21: the raw VAE latent [B, 16, T, H/8, W/8], T = (frames - 1)
# / 4 + 1; its statistics are the VAE's (the same as Qwen-Image's VAE)
LATENT = LatentSpec(channels=16, downscale=8, tokens="in_model", norm="mean_std", frames=True,
                    video=True, time_downscale=4, comfy_format="Wan21", rgb=RGB,
                    rgb_bias=RGB_BIAS,
                    wrong_channels="Wan 2.1 / 2.2 A14B use 16, as [batch, 16, (frames - 1) / 4 "
                                   "+ 1, height/8, width/8] (EmptyHunyuanLatentVideo or "
                                   "WanImageToVideo)")

# Wan-AI/Wan2.1-T2V-*-Diffusers' scheduler_config.json (the published values; a folder brings
# its own, which the pool follows): UniPC, flow prediction on shifted flow sigmas
SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000,
             "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
             "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
             "lower_order_final": True, "final_sigmas_type": "zero", "disable_corrector": [],
             "timestep_spacing": "linspace", "thresholding": False}

# Wan 2.2 TI2V-5B: 48 latent channels (latent_formats.Wan22, 16x in space), per-token
# timesteps (a folder's expand_timesteps)
TI2V_CHANNELS = 48
TI2V_NOT_RUN = ("a Wan 2.2 TI2V-5B transformer (48 latent channels of the Wan 2.2 VAE, "
                "per-token timesteps), which the pool does not run; Wan 2.1 and Wan 2.2 A14B "
                "(16 channels) run")

# WanPipeline.__call__'s guidance_scale default (diffusers 0.42.1)
CFG = 5.0
# The released 2.2 A14B switch (model_index.json boundary_ratio): t >= 875 -> high-noise expert
BOUNDARY_RATIO = 0.875
# Wan-AI/Wan2.2-I2V-A14B-Diffusers' model_index.json boundary_ratio (t >= 900: high-noise)
I2V_BOUNDARY_RATIO = 0.9


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """The diffusers config of a Wan transformer file (ComfyUI / original naming, "bfl" here,
    or diffusers'), from its weight shapes. Head dim 128 as ComfyUI assumes (num_heads = dim /
    128); the text width from the text embedding."""
    bfl = naming == "bfl"
    pe = shapes["patch_embedding.weight"]  # [inner, in_channels, 1, 2, 2]
    inner, in_ch = int(pe[0]), int(pe[1])
    if tuple(int(s) for s in pe[2:]) != (1, 2, 2):
        raise ValueError(f"patch embedding kernel {tuple(pe[2:])}; Wan's is (1, 2, 2)")
    blocks = numbered(shapes, "blocks.", "transformer")
    if bfl:
        out = int(shapes["head.head.weight"][0]) // 4
        text = int(shapes["text_embedding.0.weight"][1])
        ffn = int(shapes["blocks.0.ffn.0.weight"][0])
        image = shapes.get("img_emb.proj.1.weight")
        added = "blocks.0.cross_attn.k_img.weight" in shapes
        pos = shapes.get("img_emb.emb_pos")
        cross_norm = "blocks.0.norm3.weight" in shapes  # ComfyUI's norm3: diffusers' norm2
        qk_norm = "blocks.0.self_attn.norm_q.weight" in shapes
    else:
        out = int(shapes["proj_out.weight"][0]) // 4
        text = int(shapes["condition_embedder.text_embedder.linear_1.weight"][1])
        ffn = int(shapes["blocks.0.ffn.net.0.proj.weight"][0])
        image = shapes.get("condition_embedder.image_embedder.ff.net.0.proj.weight")
        added = "blocks.0.attn2.add_k_proj.weight" in shapes
        pos = shapes.get("condition_embedder.image_embedder.pos_embed")
        cross_norm = "blocks.0.norm2.weight" in shapes
        qk_norm = "blocks.0.attn1.norm_q.weight" in shapes
    head_dim = 128 if inner % 128 == 0 else inner
    cfg = {"patch_size": [1, 2, 2], "in_channels": in_ch, "out_channels": out,
           "num_layers": len(blocks), "attention_head_dim": head_dim,
           "num_attention_heads": inner // head_dim, "text_dim": text, "ffn_dim": ffn,
           "freq_dim": int(pick(shapes, bfl, "time_embedding.0.weight",
                                "condition_embedder.time_embedder.linear_1.weight")[1]),
           "cross_attn_norm": cross_norm,
           "qk_norm": "rms_norm_across_heads" if qk_norm else None,
           "eps": 1e-6, "rope_max_seq_len": 1024}
    if image is not None:  # Wan 2.1 I2V: CLIP image tokens through their own K/V
        cfg["image_dim"] = int(image[1])
    if added:
        cfg["added_kv_proj_dim"] = inner
    if pos is not None:
        cfg["pos_embed_seq_len"] = int(pos[1])
    return cfg


def check_config(cfg: dict) -> None:
    """Refuse the Wan transformers the pool does not run (TI2V-5B), in one line."""
    if int(cfg.get("out_channels", 16)) == TI2V_CHANNELS:
        raise NotRun(TI2V_NOT_RUN)


# ComfyUI's own model for a Wan file samples at shift 8 (supported_models.WAN21_T2V's
# sampling_settings, inherited by its I2V and Wan 2.2 A14B classes; 0.3.64 and 0.8.0): a
# single file's default is ComfyUI's, so Sampler (xDiT) and KSampler on ComfyUI's model agree
# on a file. A folder keeps its own scheduler's flow_shift; a request's shift overrides both.
COMFY_SHIFT = 8.0


def released(config: dict) -> tuple:
    """A single file's scheduler (SCHEDULER at ComfyUI's shift) and VAE statistics."""
    vae = {"latents_mean": list(LATENTS_MEAN), "latents_std": list(LATENTS_STD), "z_dim": 16}
    return dict(SCHEDULER, flow_shift=COMFY_SHIFT), vae


def expert_boundary(cfg: dict):
    """The released boundary ratio of a Wan 2.2 A14B pair of files with this transformer
    config: T2V's (16 input channels) 0.875, I2V's (36: the noise, the first-frame mask and
    the image video) 0.9; None for Wan 2.1 I2V's config (CLIP image K/V: one transformer)."""
    if cfg.get("image_dim") is not None:
        return None
    return I2V_BOUNDARY_RATIO if int(cfg.get("in_channels", 16)) == 36 else BOUNDARY_RATIO


def comfy_unet(cfg: dict) -> dict:
    """What ComfyUI's detection finds in a Wan file (comfy/model_detection.py)."""
    inner = int(cfg.get("num_attention_heads", 40)) * int(cfg.get("attention_head_dim", 128))
    in_ch = int(cfg.get("in_channels", 16))
    return {"image_model": "wan2.1", "model_type": "i2v" if cfg.get("image_dim") or in_ch == 36
            else "t2v", "dim": inner, "in_dim": in_ch,
            "out_dim": int(cfg.get("out_channels", 16)),
            "num_layers": int(cfg.get("num_layers", 40))}


def image_to_video(cfg: dict) -> tuple:
    """(a start image's condition: the 36-channel I2V transformers take the noise, the
    4-channel first-frame mask and the 16-channel image video; its CLIP image states: Wan
    2.1 I2V's `image_dim`, reached through their own cross-attention K/V)."""
    start = int(cfg.get("in_channels", 16)) > int(cfg.get("out_channels", 16))
    return start, start and cfg.get("image_dim") is not None


def pipeline_of(index_class) -> str:
    if index_class in (None, "WanPipeline"):
        return "WanPipeline"
    if index_class == "WanImageToVideoPipeline":
        return index_class
    raise ValueError(f"names pipeline {index_class!r}; Wan folders run with WanPipeline or "
                     f"WanImageToVideoPipeline")


UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
             "feed_forward_proj": "gated-gelu", "vocab_size": 256384,
             "tie_word_embeddings": False}

# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py: transformer config, text encoders as
# (transformers class, config kwargs), VAE as (diffusers class, config kwargs)).
PRESETS = {
    # Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers): 40 blocks, 40 heads x 128 (5120
    # wide), FFN 13824, text_dim 4096 (diffusers' WanTransformer3DModel defaults); text
    # encoder UMT5-XXL's encoder (UMT5EncoderModel: 24 layers, d_model 4096, d_ff 10240, 64
    # heads x 64, gated GELU, vocabulary 256384); VAE AutoencoderKLWan at diffusers' defaults
    # (base_dim 96, dim_mult 1/2/4/4, the release's). Text: 512 UMT5 tokens, reached by
    # cross-attention only (never in the attention sequence).
    "wan2.1-t2v-14b": dict(
        transformer={}, text_encoders=(("UMT5EncoderModel", UMT5_XXL),),
        vae=("AutoencoderKLWan", {}), note="Wan 2.1 T2V 14B + UMT5-XXL"),
    # Wan 2.1 T2V 1.3B: 30 blocks, 12 heads x 128 (1536 wide), FFN 8960
    "wan2.1-t2v-1.3b": dict(
        transformer={"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
        text_encoders=(("UMT5EncoderModel", UMT5_XXL),), vae=("AutoencoderKLWan", {}),
        note="Wan 2.1 T2V 1.3B + UMT5-XXL"),
    # Wan 2.2 T2V A14B: two experts of Wan 2.1 14B's dimensions (the high-noise `transformer`
    # and the low-noise `transformer_2`), both resident; one runs at a time
    "wan2.2-t2v-a14b": dict(
        transformer={}, text_encoders=(("UMT5EncoderModel", UMT5_XXL),),
        vae=("AutoencoderKLWan", {}), experts=2, note="Wan 2.2 T2V A14B (2 x 14B) + UMT5-XXL"),
}


FAMILY = Family(
    id="wan", order=60, name="Wan",
    classes=Classes(transformer="WanTransformer3DModel",
                    pipelines=("WanPipeline", "WanImageToVideoPipeline"), adapter="WanAdapter",
                    vae=("AutoencoderKLWan",)),
    blocks=Blocks(lists=("blocks",), counts=("num_layers",)),  # the files' name too
    latent=LATENT,
    text=Text(hint="encode with Wan's text encoder (umt5-xxl: CLIPLoader type wan) or type "
                   "the prompt into the sampler", pooled=False),
    # ComfyUI: model_base.WAN21 and supported_models.WAN21_T2V / WAN21_I2V; its flow model
    # sampling's multiplier is 1000, so the model is called with sigma x 1000 already;
    # concat_cond reads patch_embedding.weight's input channels
    comfy=ComfySpec(base=lambda unet: "WAN21",
                    config=lambda unet: "WAN21_I2V" if unet.get("model_type") == "i2v"
                    else "WAN21_T2V",
                    unet=comfy_unet, timestep_scale=1.0,
                    shapes=lambda unet: {"patch_embedding.weight": (
                        int(unet["dim"]), int(unet["in_dim"]), 1, 2, 2)}),
    defaults=Defaults(cfg=CFG),
    detection=Detection(
        # ComfyUI's detection key (original naming); diffusers' scale_shift_table + patch conv
        markers=(("bfl", ("head.modulation", "patch_embedding.weight")),
                 ("diffusers", ("scale_shift_table", "patch_embedding.weight",
                                "condition_embedder.time_proj.weight"))),
        config_from_shapes=config_from_shapes, order=50, released=released,
        pipeline_of=pipeline_of, check_config=check_config,
        config_defaults={"patch_size": [1, 2, 2], "num_attention_heads": 40,
                         "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
                         "text_dim": 4096, "num_layers": 40}),
    # the video's self-attention is split over the ranks; the text is held whole on each
    # and reached by cross-attention only (no exchange)
    tokens=text_image(False, text="replicate",
                      attentions=(Attention(("image",)), Attention(("image",), ("text",)))),
    capabilities=(ImageToVideo(inputs=image_to_video), TwoExperts(boundary=expert_boundary),
                  CausalVAE(patch_parallel=("autoencoder_kl_wan", "Wan")), Presets(PRESETS)),
)
