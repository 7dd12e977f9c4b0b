"""FLUX.2 ([dev]: Mistral-3 text encoder, embedded guidance; [klein]: Qwen3, no guidance
embedding): 32-channel VAE latents patchified 2x2 into 128 channels and normalised by the
VAE's batch-norm statistics; no pooled text; 4-axis RoPE."""
from __future__ import annotations

from . import (Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets,
               References, Text)
from ._shapes import numbered, pick
from .flux import SCHEDULER_DEV

# RoPE: 4 axes (time, row, column, text index) splitting the head dim evenly, as the
# released models' (32, 32, 32, 32) for head dim 128, with theta 2000; neither is in a file
ROPE_AXES = 4
ROPE_THETA = 2000

RAW_LATENT = ("FLUX.2 LATENTs are ComfyUI's 128-channel [batch, 128, height/16, width/16] "
              "(the VAE latent 2x2-patchified and normalised by the VAE's batch-norm "
              "statistics, as ComfyUI's FLUX.2 VAEEncode, EmptyFlux2LatentImage and this "
              "pack's sampler give it); a raw 32-channel [batch, 32, height/8, width/8] "
              "latent must be patchified and normalised first")

LATENT = LatentSpec(channels=128, downscale=16, tokens="flat", norm="batchnorm",
                    comfy_format="Flux2", wrong_channels=RAW_LATENT)

DEFAULT_PIPELINE = "Flux2KleinPipeline"


def pipeline_of(index_class) -> str:
    """Flux2Pipeline ([dev], Mistral-3) or Flux2KleinPipeline (every [klein] pipeline:
    Qwen3); a folder without model_index.json (or a single file) keeps the klein default."""
    if index_class is None or index_class.startswith("Flux2Klein"):
        return DEFAULT_PIPELINE
    if index_class == "Flux2Pipeline":
        return index_class
    raise ValueError(f"names pipeline {index_class!r}; FLUX.2 folders run with "
                     f"Flux2Pipeline ([dev]) or a Flux2Klein*Pipeline ([klein])")


def reference_size(width: int, height: int) -> tuple:
    """Flux2KleinPipeline's reference resize: shrunk to a 1024^2 area when larger, then
    cropped to whole tokens (16 px)."""
    if width * height > 1024 * 1024:
        import math
        scale = math.sqrt(1024 * 1024 / (width * height))
        width, height = int(width * scale), int(height * scale)
    return width // 16 * 16, height // 16 * 16


def config_from_shapes(shapes: dict, naming: str) -> dict:
    bfl = naming == "bfl"
    hidden, in_ch = pick(shapes, bfl, "img_in.weight", "x_embedder.weight")
    head_dim = int(pick(shapes, bfl, "double_blocks.0.img_attn.norm.query_norm.scale",
                        "transformer_blocks.0.attn.norm_q.weight")[0])
    if hidden % head_dim or head_dim % ROPE_AXES:
        raise ValueError(f"hidden size {hidden} / head dim {head_dim} do not fit FLUX.2's "
                         f"{ROPE_AXES} RoPE axes")
    # SwiGLU: the input projection holds gate and value, 2 x mlp_ratio x hidden rows
    mlp_in = int(pick(shapes, bfl, "double_blocks.0.img_mlp.0.weight",
                      "transformer_blocks.0.ff.linear_in.weight")[0])
    double = numbered(shapes, "double_blocks." if bfl else "transformer_blocks.", "double")
    single = numbered(shapes, "single_blocks." if bfl else "single_transformer_blocks.",
                      "single")
    out = int(pick(shapes, bfl, "final_layer.linear.weight", "proj_out.weight")[0])
    guidance = ("guidance_in.in_layer.weight" if bfl else
                "time_guidance_embed.guidance_embedder.linear_1.weight") in shapes
    return {"patch_size": 1, "in_channels": int(in_ch), "out_channels": out,
            "num_layers": len(double), "num_single_layers": len(single),
            "attention_head_dim": head_dim, "num_attention_heads": int(hidden) // head_dim,
            "joint_attention_dim": int(pick(shapes, bfl, "txt_in.weight",
                                            "context_embedder.weight")[1]),
            "timestep_guidance_channels": int(pick(
                shapes, bfl, "time_in.in_layer.weight",
                "time_guidance_embed.timestep_embedder.linear_1.weight")[1]),
            "mlp_ratio": mlp_in / 2 / int(hidden), "guidance_embeds": bool(guidance),
            "axes_dims_rope": [head_dim // ROPE_AXES] * ROPE_AXES, "rope_theta": ROPE_THETA}


def released(config: dict) -> tuple:
    """The released folders' scheduler is FLUX.1-dev's (the adapter computes FLUX.2's own
    shift). The latent is normalised by the VAE's batch-norm statistics, which a transformer
    file does not hold: `latent_bn` is the identity. The LATENT needs none (ComfyUI's FLUX.2
    LATENT is the normalised latent itself); only a decode to pixels does (a ComfyUI FLUX.2
    VAE has them)."""
    channels = int(config.get("in_channels", 128))
    return dict(SCHEDULER_DEV), {"latent_bn": ([1.0] * channels, [0.0] * channels)}


def comfy_unet(cfg: dict) -> dict:
    cfg = FAMILY.full_config(cfg)
    return {"image_model": "flux2", "guidance_embed": bool(cfg["guidance_embeds"]),
            "in_channels": 128, "out_channels": 128, "patch_size": 1,
            "hidden_size": int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"]),
            "context_in_dim": int(cfg["joint_attention_dim"])}


# Published dimensions of released models, for the memory plan's presets
# (comfyui_xdit/planning/model_facts.py: transformer config, text encoders as
# (transformers class, config kwargs), VAE as (diffusers class, config kwargs)).
PRESETS = {
    # FLUX.2 [dev]: diffusers' Flux2Transformer2DModel defaults are the dev model (8 double +
    # 48 single blocks, 48 heads x 128, joint_attention_dim 15360, mlp_ratio 3); text encoder
    # Mistral-Small-3.1-24B (Mistral3ForConditionalGeneration: 40 layers, hidden 5120, MLP
    # 32768, 32 heads / 8 KV heads x 128, vocabulary 131072, untied LM head; Pixtral vision
    # tower at transformers' defaults, hidden 1024 x 24 layers); VAE AutoencoderKLFlux2.
    "flux2-dev": dict(
        transformer={},
        text_encoders=(("Mistral3ForConditionalGeneration", {
            "text_config": {"model_type": "mistral", "hidden_size": 5120,
                            "intermediate_size": 32768, "num_hidden_layers": 40,
                            "num_attention_heads": 32, "num_key_value_heads": 8,
                            "head_dim": 128, "vocab_size": 131072,
                            "tie_word_embeddings": False},
            "tie_word_embeddings": False}),),
        vae=("AutoencoderKLFlux2", {}),
        note="FLUX.2 [dev] 32B + Mistral-3 24B text encoder"),
}


FAMILY = Family(
    id="flux2", order=20, name="FLUX.2",
    classes=Classes(transformer="Flux2Transformer2DModel",
                    pipelines=(DEFAULT_PIPELINE, "Flux2Pipeline"), adapter="Flux2Adapter",
                    vae=("AutoencoderKLFlux2",)),
    blocks=Blocks(lists=("transformer_blocks", "single_transformer_blocks"),
                  counts=("num_layers", "num_single_layers"),
                  bfl=("double_blocks", "single_blocks")),
    latent=LATENT,
    text=Text(hint="encode with this FLUX.2 model's own text encoder (klein 4B: Qwen3-4B, "
                   "klein 9B: Qwen3-8B, dev: Mistral Small 3.1) or type the prompt into the "
                   "sampler", pooled=False),
    comfy=ComfySpec(base=lambda unet: "Flux2", config=lambda unet: "Flux2",
                    unet=comfy_unet, timestep_scale=1000.0),
    # [dev] embeds guidance (4.0, as Flux2Pipeline); [klein] ignores it. Step-distilled
    # klein and dev run without CFG; klein base models (is_distilled false) at 4.0, as
    # Flux2KleinPipeline
    defaults=Defaults(cfg=1.0, guidance=4.0, undistilled_cfg=4.0),
    detection=Detection(
        # first: its BFL files also have FLUX.1's double_blocks keys; its shared modulations
        # (one per stream kind instead of one per block) mark it in both namings
        markers=(("bfl", "single_stream_modulation.lin.weight"),
                 ("diffusers", "single_stream_modulation.linear.weight")),
        config_from_shapes=config_from_shapes, order=10, released=released,
        pipeline_of=pipeline_of,
        config_defaults={"guidance_embeds": True, "num_attention_heads": 48,
                         "attention_head_dim": 128, "joint_attention_dim": 15360,
                         "patch_size": 1}),
    capabilities=(
        # diffusers' Flux2 layout: time coordinate 10, 20, ...
        References(methods=("index",), image_size=reference_size),
        Presets(PRESETS)),
)
