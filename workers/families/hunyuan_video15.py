"""HunyuanVideo 1.5 (diffusers HunyuanVideo15Pipeline, HunyuanVideo15ImageToVideoPipeline):
dual-stream blocks (image and text weights apart, one joint attention), 3-axis RoPE on the
video tokens only, one token per latent pixel (patch 1 x 1 x 1) of 32-channel latents of its
causal 3-D VAE (16x in space, 4x in time), scaled by the VAE's scaling factor. The text side
is a context of up to three parts: Qwen2.5-VL states (through a 2-block refiner that reads a
masked mean of them), ByT5 states of the prompt's quoted text, and 729 SigLIP image tokens
(image-to-video; masked, and so inert, in text-to-video). The transformer takes 65 channels:
the noise, a start-frame latent and its one-channel mask (zeros in text-to-video). CFG is
the pipeline's guider's: neg + scale (pos - neg)."""
from __future__ import annotations

from . import (Blocks, CausalVAE, Classes, ComfySpec, Defaults, Detection, Family, ImageToVideo,
               LatentSpec, NotRun, Presets, SecondTextEncoder, Text)
from ..streams import text_image
from ._shapes import numbered, pick

# ComfyUI's latent_formats.HunyuanVideo15 and the released VAE config: the raw latent
# [B, 32, (frames - 1) / 4 + 1, H/16, W/16], model space = raw x 1.03682 (no shift)
SCALING_FACTOR = 1.03682
CHANNELS = 32

# ComfyUI's latent2rgb factors (latent_formats.HunyuanVideo15)
RGB = ((0.0568, -0.0521, -0.0131), (0.0014, 0.0735, 0.0326), (0.0186, 0.0531, -0.0138),
       (-0.0031, 0.0051, 0.0288), (0.0110, 0.0556, 0.0432), (-0.0041, -0.0023, -0.0485),
       (0.0530, 0.0413, 0.0253), (0.0283, 0.0251, 0.0339), (0.0277, -0.0372, -0.0093),
       (0.0393, 0.0944, 0.1131), (0.0020, 0.0251, 0.0037), (-0.0017, 0.0012, 0.0234),
       (0.0468, 0.0436, 0.0203), (0.0354, 0.0439, -0.0233), (0.0090, 0.0123, 0.0346),
       (0.0382, 0.0029, 0.0217), (0.0261, -0.0300, 0.0030), (-0.0088, -0.0220, -0.0283),
       (-0.0272, -0.0121, -0.0363), (-0.0664, -0.0622, 0.0144), (0.0414, 0.0479, 0.0529),
       (0.0355, 0.0612, -0.0247), (0.0147, 0.0264, 0.0174), (0.0438, 0.0038, 0.0542),
       (0.0431, -0.0573, -0.0033), (-0.0162, -0.0211, -0.0406), (-0.0487, -0.0295, -0.0393),
       (0.0005, -0.0109, 0.0253), (0.0296, 0.0591, 0.0353), (0.0119, 0.0181, -0.0306),
       (-0.0085, -0.0362, 0.0229), (0.0005, -0.0106, 0.0242))
RGB_BIAS = (0.0456, -0.0202, -0.0644)

LATENT = LatentSpec(channels=CHANNELS, downscale=16, tokens="in_model", token_side=1,
                    norm="scale_shift", frames=True, video=True, time_downscale=4,
                    comfy_format="HunyuanVideo15", rgb=RGB, rgb_bias=RGB_BIAS,
                    wrong_channels="HunyuanVideo 1.5 uses 32, as [batch, 32, (frames - 1) / 4 "
                                   "+ 1, height/16, width/16] (EmptyHunyuanVideo15Latent or "
                                   "HunyuanVideo15ImageToVideo)")

# The pipelines' fixed text settings (diffusers 0.42.1): the Qwen prompt is read after the
# first 108 tokens of the chat template (the system message) and padded / cut to 1000 tokens;
# ByT5 reads the prompt's quoted text, at most 256 tokens; image-to-video adds the SigLIP
# image tokens (729 for the released encoder)
QWEN_TOKENS = 1000
BYT5_TOKENS = 256
IMAGE_TOKENS = 729

# FlowMatch Euler at a plain shift; ComfyUI samples the released files at shift 7.0
# (supported_models.HunyuanVideo15), which a single file's default follows. A folder keeps
# its own scheduler's shift; a request's shift overrides both.
COMFY_SHIFT = 7.0
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
             "shift": COMFY_SHIFT, "use_dynamic_shifting": False}

# The released guider's scale (ClassifierFreeGuidance guidance_scale of the diffusers
# folders); a request's cfg replaces it
CFG = 6.0

# The super-resolution transformer (98 input channels) and the step-distilled image-to-video
# one (MeanFlow: a second timestep per step) are variants the pool does not run
SR_NOT_RUN = ("a HunyuanVideo 1.5 super-resolution transformer (98 input channels), which the "
              "pool does not run; the 480p / 720p text- and image-to-video transformers (65) run")
MEANFLOW_NOT_RUN = ("a HunyuanVideo 1.5 step-distilled (MeanFlow) transformer, which the pool "
                    "does not run yet; the undistilled 480p / 720p transformers run")


def rope_axes(head_dim: int) -> tuple:
    """RoPE axes (frame, row, column): the released (16, 56, 56) for head dim 128; other head
    dims (test models) keep its 1/8 : 7/16 : 7/16 split in even parts."""
    if head_dim == 128:
        return (16, 56, 56)
    spatial = (head_dim * 7 // 16) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """The diffusers config of a HunyuanVideo 1.5 transformer file, ComfyUI's naming ("bfl":
    double_blocks with fused image / text qkv, txt_in, byt5_in, vision_in) or diffusers', from
    its weight shapes."""
    bfl = naming == "bfl"
    pe = pick(shapes, bfl, "img_in.proj.weight", "x_embedder.proj.weight")
    inner, in_ch = int(pe[0]), int(pe[1])
    patch = tuple(int(s) for s in pe[2:])
    if patch != (1, 1, 1):
        raise ValueError(f"patch embedding kernel {patch}; HunyuanVideo 1.5's is (1, 1, 1)")
    head_dim = int(pick(shapes, bfl, "double_blocks.0.img_attn.norm.query_norm.scale",
                        "transformer_blocks.0.attn.norm_q.weight")[0])
    if inner % head_dim:
        raise ValueError(f"hidden size {inner} is not a multiple of the head dim {head_dim}")
    if bfl:
        if any(k.startswith("single_blocks.") for k in shapes):
            raise ValueError("a HunyuanVideo file with single-stream blocks (HunyuanVideo "
                             "1.0), which this pack does not run")
        blocks = numbered(shapes, "double_blocks.", "dual-stream")
        refiner = numbered(shapes, "txt_in.individual_token_refiner.blocks.", "text refiner")
        out = int(shapes["final_layer.linear.weight"][0])
        text = int(shapes["txt_in.input_embedder.weight"][1])
        text_2 = int(shapes["byt5_in.fc1.weight"][1])
        image = int(shapes["vision_in.proj.0.weight"][0])
        meanflow = any(k.startswith("time_r_in.") for k in shapes)
    else:
        blocks = numbered(shapes, "transformer_blocks.", "dual-stream")
        refiner = numbered(shapes, "context_embedder.token_refiner.refiner_blocks.",
                           "text refiner")
        out = int(shapes["proj_out.weight"][0])
        text = int(shapes["context_embedder.proj_in.weight"][1])
        text_2 = int(shapes["context_embedder_2.linear_1.weight"][1])
        image = int(shapes["image_embedder.norm_in.weight"][0])
        meanflow = any(k.startswith("time_embed.timestep_embedder_r.") for k in shapes)
    return {"in_channels": in_ch, "out_channels": out, "num_attention_heads": inner // head_dim,
            "attention_head_dim": head_dim, "num_layers": len(blocks),
            "num_refiner_layers": len(refiner), "mlp_ratio": 4.0, "patch_size": 1,
            "patch_size_t": 1, "qk_norm": "rms_norm", "text_embed_dim": text,
            "text_embed_2_dim": text_2, "image_embed_dim": image, "rope_theta": 256.0,
            "rope_axes_dim": list(rope_axes(head_dim)), "use_meanflow": meanflow,
            # a file does not say which task it was trained for: text-to-video unless
            # ComfyUI gives a start image (its HunyuanVideo15ImageToVideo)
            "task_type": "t2v"}


def check_config(cfg: dict) -> None:
    """Refuse the HunyuanVideo 1.5 transformers the pool does not run, in one line."""
    if int(cfg.get("in_channels", 65)) != 2 * int(cfg.get("out_channels", CHANNELS)) + 1:
        raise NotRun(SR_NOT_RUN)
    if cfg.get("use_meanflow"):
        raise NotRun(MEANFLOW_NOT_RUN)


def released(config: dict) -> tuple:
    """A single file's scheduler (FlowMatch Euler at ComfyUI's shift 7) and VAE scale."""
    return dict(SCHEDULER), {"scaling_factor": SCALING_FACTOR, "latent_channels": CHANNELS}


def comfy_unet(cfg: dict) -> dict:
    """What ComfyUI's detection finds in a HunyuanVideo 1.5 file (comfy/model_detection.py)."""
    inner = int(cfg.get("num_attention_heads", 16)) * int(cfg.get("attention_head_dim", 128))
    return {"image_model": "hunyuan_video", "vision_in_dim": int(cfg.get("image_embed_dim",
                                                                          1152)),
            "in_channels": int(cfg.get("in_channels", 65)), "hidden_size": inner,
            "depth": int(cfg.get("num_layers", 54))}


def image_to_video(cfg: dict) -> tuple:
    """(needs a start image's condition: an image-to-video transformer, config task_type
    "i2v"; a text-to-video one gets zeros in its place, as HunyuanVideo15Pipeline gives them;
    needs the start image's SigLIP states: no, ComfyUI's HunyuanVideo15ImageToVideo runs
    without clip_vision_output, and the pool reads them itself from an image it is given)."""
    return cfg.get("task_type", "i2v") == "i2v", False


def pipeline_of(index_class) -> str:
    if index_class in (None, "HunyuanVideo15Pipeline"):
        return "HunyuanVideo15Pipeline"
    if index_class == "HunyuanVideo15ImageToVideoPipeline":
        return index_class
    raise ValueError(f"names pipeline {index_class!r}; HunyuanVideo 1.5 folders run with "
                     f"HunyuanVideo15Pipeline or HunyuanVideo15ImageToVideoPipeline")


# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py: transformer config, text encoders as
# (transformers class, config kwargs), VAE as (diffusers class, config kwargs)).
# Qwen2.5-VL 7B's language model (the folders' text_encoder: Qwen2_5_VLTextModel, 28 layers
# of 3584, 28 heads with 4 K/V heads, MLP 18944, vocabulary 152064) and the glyph ByT5 encoder
# (T5EncoderModel: ByT5-small's 12 encoder layers of 1472, 6 heads x 64, gated-GELU MLP 3584,
# 384 byte tokens)
QWEN25_VL_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064}
GLYPH_BYT5 = {"d_model": 1472, "d_ff": 3584, "d_kv": 64, "num_heads": 6, "num_layers": 12,
              "vocab_size": 384, "feed_forward_proj": "gated-gelu",
              "tie_word_embeddings": False}
PRESETS = {
    # HunyuanVideo 1.5 720p text-to-video (tencent/HunyuanVideo-1.5, 8.3B): 54 dual-stream
    # blocks, 16 heads x 128 (2048 wide), MLP ratio 4, a 2-block text refiner (diffusers'
    # HunyuanVideo15Transformer3DModel defaults, the release's); VAE AutoencoderKLHunyuanVideo15
    # at diffusers' defaults (the release's: 16x in space, 4x in time, 32 channels). Text: at
    # most 1000 Qwen + 256 ByT5 tokens join the video tokens (the pipeline's caps; padding
    # is dropped). 720p x 121 frames: 31 x 45 x 80 = 111,600 video tokens.
    "hunyuanvideo1.5-720p": dict(
        transformer={}, text_encoders=(("Qwen2_5_VLTextModel", QWEN25_VL_7B),
                                       ("T5EncoderModel", GLYPH_BYT5)),
        vae=("AutoencoderKLHunyuanVideo15", {}), text_tokens=QWEN_TOKENS + BYT5_TOKENS,
        note="HunyuanVideo 1.5 720p (8.3B) + Qwen2.5-VL 7B + glyph ByT5"),
}


FAMILY = Family(
    id="hunyuan_video15", order=70, name="HunyuanVideo 1.5",
    classes=Classes(transformer="HunyuanVideo15Transformer3DModel",
                    pipelines=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
                    adapter="HunyuanVideo15Adapter", vae=("AutoencoderKLHunyuanVideo15",)),
    blocks=Blocks(lists=("transformer_blocks",), counts=("num_layers",), bfl=("double_blocks",)),
    latent=LATENT,
    text=Text(hint="encode with HunyuanVideo 1.5's text encoders (Qwen2.5-VL 7B and ByT5: "
                   "DualCLIPLoader type hunyuan_video_15) or type the prompt into the sampler",
              pooled=False),
    # ComfyUI: model_base.HunyuanVideo15 and supported_models.HunyuanVideo15; its flow model
    # sampling's multiplier is 1000, so the model is called with sigma x 1000 already
    comfy=ComfySpec(base=lambda unet: "HunyuanVideo15", config=lambda unet: "HunyuanVideo15",
                    unet=comfy_unet, timestep_scale=1.0,
                    # concat_cond reads img_in.proj.weight's input channels (65: noise,
                    # start-frame latent, mask; 33 would mean no start-frame channels)
                    shapes=lambda unet: {"img_in.proj.weight": (
                        int(unet["hidden_size"]), int(unet["in_channels"]), 1, 1, 1)}),
    defaults=Defaults(cfg=CFG),
    detection=Detection(
        # ComfyUI's detection keys (HunyuanVideo's text refiner + 1.5's cond-type embedding);
        # diffusers' cond-type embedding + ByT5 projection
        markers=(("bfl", ("txt_in.individual_token_refiner.blocks.0.norm1.weight",
                          "cond_type_embedding.weight")),
                 ("diffusers", ("cond_type_embed.weight", "context_embedder_2.linear_1.weight"))),
        config_from_shapes=config_from_shapes, released=released, pipeline_of=pipeline_of,
        # before FLUX (20), whose marker (double_blocks.0.img_attn.qkv.weight) its files have too
        order=12,
        config_defaults={"in_channels": 65, "out_channels": 32, "num_attention_heads": 16,
                         "attention_head_dim": 128, "num_layers": 54, "num_refiner_layers": 2,
                         "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 3584,
                         "text_embed_2_dim": 1472, "image_embed_dim": 1152,
                         "rope_axes_dim": [16, 56, 56], "use_meanflow": False,
                         "task_type": "i2v"},
        # the config's widths of the Qwen, ByT5 and SigLIP states the transformer takes
        config_names={"text_width": "text_embed_dim", "text_2_width": "text_embed_2_dim",
                      "image_width": "image_embed_dim"},
        check_config=check_config),
    # the video, then the compacted context (image, ByT5 and Qwen tokens), joint
    tokens=text_image(False),
    capabilities=(
        # clip_fea: the SigLIP output's last states
        ImageToVideo(inputs=image_to_video, clip_vision_states="last_hidden_state"),
        # the ByT5 glyph states: the model's txt_byt5, the CONDITIONING's conditioning_byt5small
        SecondTextEncoder(comfy_input="txt_byt5", comfy_conditioning="conditioning_byt5small"),
        CausalVAE(whole_video=True), Presets(PRESETS)),
)
