"""MiniMax-H3 (diffusers MiniMaxH3Transformer3DModel and its modular pipeline,
`diffusers.modular_pipelines.minimax_h3`): video with its stereo sound track from one packed
sequence. A single stack of blocks runs full self-attention over [text | audio | video]: the
prompt's Qwen3-VL states (hidden state 50, refined alone first by two plain blocks), the
audio latents (32 channels at 40 a second, the left channel's rows then the right's) and the
video latents (24 channels, 2 x 2 patches, frame by frame). No cross-attention, no mask, no
padding. Each row carries float64 (t, h, w) RoPE coordinates (the text's index on the time
axis, so the text's length shifts every later position; RoPE rotates part of each head) and
an AdaLN row (its timestep's index x 3 + its modality). Heads x head width exceed the hidden
width. The released checkpoint is guidance-distilled: the pipeline runs no CFG.

Frames are 17n + 5 (the video VAE encodes 17-frame chunks into 5 latent frames), 5n + 2
latent frames; the audio has round(frames / 24 x 40) latents a channel.

Over sequence-parallel ranks every stream is sharded (the text too: it is a joint-attention
stream like the others); the per-row positions and AdaLN rows split with their rows.
"""
from __future__ import annotations

from . import (Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets,
               Text)
from ..streams import Attention, Stream, TokenLayout
from ._shapes import numbered

CHANNELS = 24  # video latent channels
AUDIO_CHANNELS = 32  # audio latent channels
STEREO = 2  # audio channels, packed channel-major
FPS = 24
AUDIO_LATENTS_PER_SECOND = 40
SAMPLE_RATE = 32000
VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
TEXT_LAYER = 50  # the Qwen3-VL hidden state the transformer reads
# modality tags of the AdaLN table (a checkpoint contract)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2

LATENT = LatentSpec(channels=CHANNELS, downscale=16, tokens="in_model", norm="mean_std",
                    frames=True, video=True, frame_chunks=(17, 5, 2),
                    comfy_format="MiniMaxH3AV",
                    wrong_channels="MiniMax-H3 uses 24 video channels, as [batch, 24, "
                                   "(frames - 5) / 17 x 5 + 2, height/16, width/16]")


def audio_latents(frames: int) -> int:
    """Audio latents a channel for a video of `frames` frames (the pipeline's rounding)."""
    return int(round(int(frames) / FPS * AUDIO_LATENTS_PER_SECOND))


# The streams as the blocks hold them: the video, the sound, the prompt, all sharded alike,
# one joint attention over all three. The model's own packed order is [text | audio |
# video]; each row carries its own RoPE position and there is no mask, so the rows' order is
# immaterial to full attention, and the latent first is where the step cache measures it
TOKENS = TokenLayout(
    streams=(Stream("video", "latent", positions="order"),
             Stream("audio", "context", denoised=True,  # the left channel's, the right's
                    length=lambda frames: STEREO * audio_latents(frames)),
             Stream("text", "text")),
    attentions=(Attention(("video", "audio", "text")),))

SCHEDULER = {"_class_name": "MiniMaxH3Scheduler", "shift": VIDEO_SHIFT}


# ---- ComfyUI's MODEL call (ComfyUI 0.33.0's MiniMaxH3, comfy/ldm/minimax) -------------------
# what its conditioning may hold that the pool does not run (text-to-video with sound only)
_COND_PARTS = (("keyframes", "keyframes (MiniMax H3 Image to Video's first / last frame)"),
               ("refs", "reference images or sound"),
               ("cond_video_latents", "conditioning video latents"),
               ("cond_audio_latents", "conditioning sound latents"))


# ComfyUI's model inputs the pool's forward reads, with ComfyUI's defaults (a LATENT that is
# not nested carries no sound: scale 1)
COMFY_INPUTS = {"audio_scale": 1.0, "sigma_shift_video": VIDEO_SHIFT,
                "sigma_shift_audio": AUDIO_SHIFT}
# the shifts a node may set in transformer_options (minimax_h3_<input>): (input, option
# key, default)
COMFY_OPTIONS = tuple((name, f"minimax_h3_{name}", COMFY_INPUTS[name])
                      for name in ("sigma_shift_video", "sigma_shift_audio"))


def comfy_inputs(conds: dict) -> dict:
    """ComfyUI's MiniMaxH3 conditioning (its model inputs beside the call, once per
    conditioning) -> the scalars the pool's forward reads: the sampler's audio carry
    (`minimax_payload["audio_scale"]`, video shift / audio shift). Pops `minimax_payload`; a
    payload the pool cannot run (keyframes, references, a prompt with images) is refused."""
    payload = conds.pop("minimax_payload", None) or {}
    for key, what in _COND_PARTS:
        if payload.get(key):
            raise ValueError(f"its conditioning holds {what}, which the pool does not run "
                             f"(text-to-video with sound only); use ComfyUI's own model")
    tags = payload.get("text_token_tags")
    if tags is not None and any(int(t) != TEXT_TAG for t in tags.reshape(-1).tolist()):
        raise ValueError("its prompt holds images (vision tokens), which the pool does not "
                         "run (a text prompt only); use ComfyUI's own model")
    return {"audio_scale": float(payload.get("audio_scale", COMFY_INPUTS["audio_scale"]))}


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """The diffusers config of a MiniMax-H3 transformer file from its weight shapes: diffusers
    naming, or ComfyUI's ("bfl" here: comfy/ldm/minimax, whose file carries RoPE's
    frequencies, one a axis; a diffusers file's are computed, the release's 16 a axis)."""
    if naming == "bfl":
        n = {"proj_in": "video_patch_proj", "qk_norm": "blocks.0.attn.q_norm",
             "t1": "time_embedder.proj_in", "t2": "time_embedder.proj_out",
             "audio_in": "audio_patch_proj", "text": "condition_proj",
             "blocks": "blocks.", "refiner": "token_refiner.blocks."}
        inner = int(shapes["blocks.0.attn.qkv_proj.weight"][0]) // 3
        ffn = int(shapes["blocks.0.mlp.fc2.weight"][1])
        rope = int(shapes["rope.inv_freq"][0]) if "rope.inv_freq" in shapes else 16
    else:
        n = {"proj_in": "proj_in", "qk_norm": "transformer_blocks.0.attn.norm_q",
             "t1": "time_embedder.linear_1", "t2": "time_embedder.linear_2",
             "audio_in": "audio_proj_in", "text": "context_embedder",
             "blocks": "transformer_blocks.", "refiner": "token_refiner.refiner_blocks."}
        inner = int(shapes["transformer_blocks.0.attn.to_q.weight"][0])
        ffn = int(shapes["transformer_blocks.0.ff.net.2.weight"][1])
        rope = 16
    hidden, patch_dim = (int(v) for v in shapes[n["proj_in"] + ".weight"])
    head_dim = int(shapes[n["qk_norm"] + ".weight"][0])
    t1, t2 = shapes[n["t1"] + ".weight"], shapes[n["t2"] + ".weight"]
    return {"num_attention_heads": inner // head_dim, "attention_head_dim": head_dim,
            "hidden_size": hidden,
            "num_layers": len(numbered(shapes, n["blocks"], "transformer")),
            "num_refiner_layers": len(numbered(shapes, n["refiner"], "text refiner")),
            "ffn_dim": ffn, "in_channels": patch_dim // 4, "patch_size": [1, 2, 2],
            "audio_in_channels": int(shapes[n["audio_in"] + ".weight"][1]),
            "text_dim": int(shapes[n["text"] + ".weight"][1]), "freq_dim": int(t1[1]),
            "time_embed_hidden_dim": int(t1[0]), "time_embed_dim": int(t2[0]),
            "rope_freq_dim": rope}


def released(config: dict) -> tuple:
    """A single file's scheduler (video shift 12) and VAE (unit statistics: the released
    VAE's own are in its folder)."""
    return dict(SCHEDULER), {"latent_channels": CHANNELS}


def pipeline_of(index_class) -> str:
    if index_class in (None, "MiniMaxH3ModularPipeline", "MiniMaxH3Pipeline"):
        return "MiniMaxH3ModularPipeline"
    raise ValueError(f"names pipeline {index_class!r}; MiniMax-H3 folders run with diffusers' "
                     f"modular MiniMaxH3ModularPipeline")


# Qwen3-VL 32B's language model (the release's conditioner: 64 layers of 5120, 64 heads x 128
# with 8 K/V heads, MLP 25600, vocabulary 151936; the pipeline reads hidden state 50)
QWEN3_VL_32B = {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 151936}
# 768 x 1344 (the release's canvas) x 15 s: 362 frames -> 107 latent frames of 24 x 42 / 4
# = 252 tokens, 26,964 video tokens; 600 x 2 audio tokens
PRESETS = {
    # MiniMax-H3 (MiniMaxAI/MiniMax-H3): 50 blocks, 56 heads x 128 over a 5376-wide stream,
    # FFN 14336 (diffusers' MiniMaxH3Transformer3DModel defaults, the release's): 33.1B
    # parameters, 61.7 GiB in bf16
    "minimax-h3": dict(
        transformer={}, text_encoders=(("Qwen3VLTextModel", QWEN3_VL_32B),),
        vae=("AutoencoderKLMiniMaxH3", {}), text_tokens=512,
        note="MiniMax-H3 (33B) + Qwen3-VL 32B"),
}


FAMILY = Family(
    id="minimax_h3", order=90, name="MiniMax-H3",
    classes=Classes(transformer="MiniMaxH3Transformer3DModel",
                    pipelines=("MiniMaxH3ModularPipeline",), adapter="MiniMaxH3Adapter",
                    vae=("AutoencoderKLMiniMaxH3",)),
    blocks=Blocks(lists=("transformer_blocks",), counts=("num_layers",), bfl=("blocks",)),
    latent=LATENT,
    text=Text(hint="type the prompt into the sampler (MiniMax-H3 encodes it with its own "
                   "Qwen3-VL)", pooled=False),
    # ComfyUI's MiniMaxH3: its LATENT nests the video and the sound, its timestep sigma x
    # 1000 (the video's), its context the raw Qwen3-VL states once its refiner is passed
    # through (the pool refines them), its sound carry in minimax_payload (read once per
    # conditioning), the shifts in transformer_options; cond and uncond of other text
    # lengths share a call (ragged_text)
    comfy=ComfySpec(base=lambda unet: "MiniMaxH3", config=lambda unet: "MiniMaxH3",
                    latent_parts=("video", "audio"), read_inputs=comfy_inputs,
                    option_inputs=COMFY_OPTIONS, ragged_text=True,
                    passthrough=("preprocess_text_embeds",)),
    # guidance-distilled: one forward a step
    defaults=Defaults(cfg=1.0),
    detection=Detection(
        # diffusers' names; ComfyUI's (comfy/ldm/minimax, the keys its detection reads)
        markers=(("diffusers", ("audio_proj_in.weight", "token_refiner.final_norm.weight")),
                 ("bfl", ("video_patch_proj.weight", "audio_patch_proj.weight"))),
        config_from_shapes=config_from_shapes, order=14, released=released,
        pipeline_of=pipeline_of,
        config_defaults={"num_attention_heads": 56, "attention_head_dim": 128,
                         "hidden_size": 5376, "num_layers": 50, "num_refiner_layers": 2,
                         "ffn_dim": 14336, "in_channels": 24, "audio_in_channels": 32,
                         "patch_size": [1, 2, 2], "text_dim": 5120, "rope_freq_dim": 16},
        config_names={"text_width": "text_dim", "stream_width": "hidden_size"}),
    tokens=TOKENS,
    capabilities=(Presets(PRESETS),),
)
