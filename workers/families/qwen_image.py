"""Qwen-Image (and Qwen-Image-Edit): a 60-block double-stream MMDiT, Qwen2.5-VL text states
(no pooled output), 2x2-packed 16-channel latents of the causal 3-D (Wan-style) VAE with a
frame axis, normalised per channel by the VAE's mean and std; true CFG with a norm rescale."""
from __future__ import annotations

from . import (Blocks, CausalVAE, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec,
               Presets, References, Text)
from ..streams import text_image
from ._shapes import numbered

# The released VAE's per-channel latent statistics (vae/config.json latents_mean / std;
# also diffusers' AutoencoderKLQwenImage defaults and ComfyUI's latent_formats.Wan21)
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

# Qwen/Qwen-Image's scheduler_config.json: the exponential dynamic shift by image tokens
# (mu from 0.5 at 256 tokens to 0.9 at 8192) and a terminal sigma of 0.02. (The pipeline's
# calculate_shift fallbacks, 4096 / 1.15, are FLUX's and apply only to a config lacking
# these keys.) ComfyUI samples with a fixed shift 1.15 instead: Sampler (xDiT) follows the
# folder's scheduler, KSampler ComfyUI's.
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
             "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
             "max_image_seq_len": 8192, "time_shift_type": "exponential",
             "shift_terminal": 0.02}

# ComfyUI's latent2rgb factors (latent_formats.Wan21)
RGB = ((-0.1299, -0.1692, 0.2932), (0.0671, 0.0406, 0.0442), (0.3568, 0.2548, 0.1747),
       (0.0372, 0.2344, 0.1420), (0.0313, 0.0189, -0.0328), (0.0296, -0.0956, -0.0665),
       (-0.3477, -0.4059, -0.2925), (0.0166, 0.1902, 0.1975), (-0.0412, 0.0267, -0.1364),
       (-0.1293, 0.0740, 0.1636), (0.0680, 0.3019, 0.1128), (0.0032, 0.0581, 0.0639),
       (-0.1251, 0.0927, 0.1699), (0.0060, -0.0633, 0.0005), (0.3477, 0.2275, 0.2950),
       (0.1984, 0.0913, 0.1861))
RGB_BIAS = (-0.1835, -0.0868, -0.3360)

LATENT = LatentSpec(channels=16, downscale=8, tokens="pack2x2", norm="mean_std", frames=True,
                    comfy_format="Wan21", rgb=RGB, rgb_bias=RGB_BIAS,
                    wrong_channels="Qwen-Image uses 16, as [batch, 16, 1, height/8, width/8] "
                                   "(encode with the model's VAE, or start from "
                                   "EmptySD3LatentImage)")


def rope_axes(head_dim: int) -> tuple:
    """The released (16, 56, 56) for head dim 128 (not in a file); other head dims (test
    models) split into a frame axis and two equal even spatial ones."""
    if head_dim == 128:
        return (16, 56, 56)
    spatial = ((head_dim - 2) // 2) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


# ComfyUI's Edit-2511 files carry this empty tensor (comfy/model_detection.py reads it as
# default_ref_method "index_timestep_zero"); diffusers' name for the flag is zero_cond_t
ZERO_COND_MARKER = "__index_timestep_zero__"


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """ComfyUI's Qwen-Image files use diffusers' names (only a checkpoint prefix differs)."""
    inner, in_ch = (int(v) for v in shapes["img_in.weight"])
    head_dim = int(shapes["transformer_blocks.0.attn.norm_q.weight"][0])
    if inner % head_dim:
        raise ValueError(f"hidden size {inner} is not a multiple of the head dim {head_dim}")
    if "txt_in.text_norm.weight" in shapes or "time_text_embed.addition_t_embedding" in \
            " ".join(shapes):
        raise ValueError("a Qwen-Image variant with extra text/time layers, which this pack "
                         "does not run")
    blocks = numbered(shapes, "transformer_blocks.", "transformer")
    out = int(shapes["proj_out.weight"][0])
    patch = 2
    cfg = {"patch_size": patch, "in_channels": in_ch, "out_channels": out // (patch * patch),
           "num_layers": len(blocks), "attention_head_dim": head_dim,
           "num_attention_heads": inner // head_dim,
           "joint_attention_dim": int(shapes["txt_in.weight"][1]),
           "axes_dims_rope": list(rope_axes(head_dim))}
    if ZERO_COND_MARKER in shapes:  # Qwen-Image-Edit 2511 (reference tokens at timestep 0)
        cfg["zero_cond_t"] = True
    return cfg


def released(config: dict) -> tuple:
    return dict(SCHEDULER), {"latents_mean": list(LATENTS_MEAN), "latents_std": list(LATENTS_STD)}


def comfy_unet(cfg: dict) -> dict:
    unet = {"image_model": "qwen_image", "in_channels": int(cfg.get("in_channels", 64)),
            "num_layers": int(cfg.get("num_layers", 60))}
    if cfg.get("zero_cond_t"):  # 2511: ComfyUI's model gives references timestep 0 alike
        unet["default_ref_method"] = "index_timestep_zero"
    return unet


def edit_size(width: int, height: int) -> tuple:
    """QwenImageEditPipeline's reference resize (`calculate_dimensions`): a 1024^2 area of
    the image's aspect ratio, each side rounded to a multiple of 32."""
    import math
    ratio = width / height
    w = math.sqrt(1024 * 1024 * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def pipeline_of(index_class) -> str:
    """Qwen-Image folders encode with QwenImagePipeline, Edit folders with
    QwenImageEditPipeline (its text encoder also sees the reference image), Edit 2509 / 2511
    folders with QwenImageEditPlusPipeline (several images, all seen by the text encoder)."""
    if index_class == "QwenImageEditPlusPipeline":
        return index_class
    if index_class is not None and index_class.startswith("QwenImageEdit"):
        return "QwenImageEditPipeline"
    if index_class in (None, "QwenImagePipeline", "QwenImageImg2ImgPipeline"):
        return "QwenImagePipeline"
    raise ValueError(f"names pipeline {index_class!r}; Qwen-Image folders run with "
                     f"QwenImagePipeline, QwenImageEditPipeline or QwenImageEditPlusPipeline")


# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py: transformer config, text encoders as
# (transformers class, config kwargs), VAE as (diffusers class, config kwargs)).
PRESETS = {
    # Qwen-Image (20B): 60 double-stream blocks, 24 heads x 128, text states 3584 wide;
    # text encoder Qwen2.5-VL-7B-Instruct (Qwen2_5_VLForConditionalGeneration: 28 layers,
    # hidden 3584, MLP 18944, 28 heads / 4 KV heads, vocabulary 152064, the 32-block vision
    # tower the pipelines load with it); VAE AutoencoderKLQwenImage at diffusers' defaults
    # (the release's: base_dim 96, dim_mult 1/2/4/4). Prompts pad only to the longest one:
    # 512 text tokens is the pipeline's max_sequence_length, an upper bound.
    "qwen-image": dict(
        transformer={"num_layers": 60, "num_attention_heads": 24, "attention_head_dim": 128,
                     "joint_attention_dim": 3584, "in_channels": 64, "out_channels": 16,
                     "patch_size": 2, "axes_dims_rope": [16, 56, 56]},
        text_encoders=(("Qwen2_5_VLForConditionalGeneration", {
            "text_config": {"hidden_size": 3584, "intermediate_size": 18944,
                            "num_hidden_layers": 28, "num_attention_heads": 28,
                            "num_key_value_heads": 4, "vocab_size": 152064,
                            "tie_word_embeddings": False},
            "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                              "num_heads": 16, "out_hidden_size": 3584},
            "tie_word_embeddings": False}),),
        vae=("AutoencoderKLQwenImage", {}),
        note="Qwen-Image 20B + Qwen2.5-VL 7B text encoder"),
}


FAMILY = Family(
    id="qwen_image", order=50, name="Qwen-Image",
    classes=Classes(transformer="QwenImageTransformer2DModel",
                    pipelines=("QwenImagePipeline", "QwenImageEditPipeline",
                               "QwenImageEditPlusPipeline"),
                    adapter="QwenImageAdapter", vae=("AutoencoderKLQwenImage",)),
    # ComfyUI's files name the blocks as diffusers does
    blocks=Blocks(lists=("transformer_blocks",), counts=("num_layers",)),
    latent=LATENT,
    text=Text(hint="encode with Qwen-Image's text encoder (Qwen2.5-VL 7B: CLIPLoader type "
                   "qwen_image) or type the prompt into the sampler", pooled=False),
    comfy=ComfySpec(base=lambda unet: "QwenImage", config=lambda unet: "QwenImage",
                    unet=comfy_unet, timestep_scale=1000.0),
    defaults=Defaults(cfg=4.0),  # QwenImagePipeline's true_cfg_scale default
    detection=Detection(
        # ComfyUI's detection key (comfy/model_detection.py); the names are diffusers'
        markers=(("diffusers", ("txt_norm.weight", "img_in.weight")),),
        config_from_shapes=config_from_shapes, order=40, released=released,
        pipeline_of=pipeline_of,
        config_defaults={"patch_size": 2, "num_attention_heads": 24,
                         "attention_head_dim": 128, "joint_attention_dim": 3584,
                         "num_layers": 60, "in_channels": 64}),
    # text first, joint; the image's positions follow its token order (img_shapes: the
    # target's tokens first, then each reference's), so PipeFusion cannot run references
    # first; odd reference latents are padded circularly, as ComfyUI's model pads them
    tokens=text_image(positions="order", pads_odd_references=True),
    capabilities=(
        # reference images (QwenImageEditPipeline / QwenImageEditPlusPipeline; ComfyUI's
        # ReferenceLatent / TextEncodeQwenImageEdit(Plus)): each reference's tokens follow
        # the target's, at frame k of RoPE's first axis, rows and columns centred on the
        # reference's own size (2511's zero_cond_t: modulated at timestep 0, the target at
        # the step's; ComfyUI's method name for that, index_timestep_zero, is taken where the
        # transformer has it)
        References(methods=("index", "index_timestep_zero"), image_size=edit_size),
        CausalVAE(patch_parallel=("autoencoder_kl_qwenimage", "QwenImage")),  # a Wan 2.1 VAE
        Presets(PRESETS)),
)
