"""Z-Image (Tongyi-MAI's Z-Image / Z-Image-Turbo, diffusers ZImagePipeline): one stream of
shared weights, a modulated refiner over the image and an unmodulated one over the text, then
the main blocks on [image, text]; Qwen3 text states (no pooled output); FLUX.1's 16-channel
VAE latents, patchified 2x2 inside the model; the model takes 1 - sigma and returns the
negated velocity; true CFG as pos + g (pos - neg), i.e. ComfyUI's cfg = g + 1."""
from __future__ import annotations

from . import Blocks, Classes, ComfySpec, Defaults, Detection, Family, LatentSpec, Presets, Text
from ..streams import Attention, text_image
from ._shapes import numbered, pick
from .flux import LATENT as FLUX_LATENT
from .flux import VAE_LATENT

# Image and text are each padded to a multiple of this many tokens with the model's learned
# pad tokens (x_pad_token, cap_pad_token), which attend and are attended like real ones
PAD_MULTIPLE = 32

# The released scheduler (Z-Image-Turbo's scheduler_config.json): a plain shift 3, which
# is also ComfyUI's sampling shift for it (supported_models.ZImage); ZImagePipeline's mu
# only matters with use_dynamic_shifting
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# Released transformer settings no file stores (ComfyUI's model_detection for dim 3840)
ROPE_AXES_128 = (32, 48, 48)
ROPE_LENS = (1536, 512, 512)
ROPE_THETA = 256.0

# FLUX.1's VAE and ComfyUI's latent_formats.Flux (supported_models.ZImage.latent_format); the
# transformer patchifies the unpacked latent itself
LATENT = LatentSpec(channels=16, downscale=8, tokens="in_model", norm="scale_shift",
                    comfy_format="Flux", rgb=FLUX_LATENT.rgb, rgb_bias=FLUX_LATENT.rgb_bias,
                    wrong_channels="Z-Image uses 16 (encode with the model's VAE, or start "
                                   "from EmptySD3LatentImage)")


# Z-Image (Turbo, 6B): 30 main blocks and 2 + 2 refiners, 30 heads x 128, Qwen3 states 2560
# wide; text encoder Qwen3-4B (36 layers, hidden 2560, MLP 9728, 32 heads / 8 KV heads of
# 128, vocabulary 151936, tied embeddings); FLUX.1's 16-channel AutoencoderKL. Prompts are
# only their own tokens (padded to 32): 512 is the pipeline's max_sequence_length, an upper
# bound.
PRESETS = {
    "z-image": dict(
        transformer={"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
                     "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30,
                     "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 2560,
                     "rope_theta": ROPE_THETA, "t_scale": 1000.0,
                     "axes_dims": list(ROPE_AXES_128), "axes_lens": list(ROPE_LENS)},
        text_encoders=(("Qwen3Model", {"hidden_size": 2560, "intermediate_size": 9728,
                                       "num_hidden_layers": 36, "num_attention_heads": 32,
                                       "num_key_value_heads": 8, "head_dim": 128,
                                       "vocab_size": 151936, "tie_word_embeddings": True}),),
        vae=("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512],
                               "down_block_types": ["DownEncoderBlock2D"] * 4,
                               "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "latent_channels": 16, "layers_per_block": 2}),
        note="Z-Image-Turbo 6B + Qwen3-4B text encoder"),
}


def padded(n: int) -> int:
    """Tokens of a stream of `n` once padded with learned pad tokens."""
    return -(-int(n) // PAD_MULTIPLE) * PAD_MULTIPLE


def rope_axes(head_dim: int) -> tuple:
    """RoPE axes (text index / frame, row, column): the released (32, 48, 48) for head dim
    128; other head dims (test models) keep its 1/4, 3/8, 3/8 split in even parts."""
    if head_dim == 128:
        return ROPE_AXES_128
    spatial = (head_dim * 3 // 8) // 2 * 2
    return (head_dim - 2 * spatial, spatial, spatial)


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """ComfyUI's files ("bfl": its NextDiT names, fused qkv) and diffusers-named ones."""
    bfl = naming == "bfl"
    if any(k.startswith("siglip_") for k in shapes):
        raise ValueError("a Z-Image Omni file (SigLIP image conditioning), which this pack "
                         "does not run")
    dim, cap = (int(v) for v in shapes["cap_embedder.1.weight"])
    head_dim = int(pick(shapes, bfl, "layers.0.attention.q_norm.weight",
                        "layers.0.attention.norm_q.weight")[0])
    if dim % head_dim or head_dim % 2:
        raise ValueError(f"hidden size {dim} / head dim {head_dim} do not fit Z-Image's "
                         f"RoPE axes")
    patch_in = int(pick(shapes, bfl, "x_embedder.weight", "all_x_embedder.2-1.weight")[1])
    layers = numbered(shapes, "layers.", "main")
    noise = numbered(shapes, "noise_refiner.", "image refiner")
    context = numbered(shapes, "context_refiner.", "text refiner")
    if len(noise) != len(context):
        raise ValueError(f"{len(noise)} image refiner blocks but {len(context)} text refiner "
                         f"blocks (Z-Image has as many of each)")
    heads = dim // head_dim
    return {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": patch_in // 4,
            "dim": dim, "n_layers": len(layers), "n_refiner_layers": len(noise),
            "n_heads": heads, "n_kv_heads": heads, "norm_eps": 1e-5, "qk_norm": True,
            "cap_feat_dim": cap, "rope_theta": ROPE_THETA, "t_scale": 1000.0,
            "axes_dims": list(rope_axes(head_dim)), "axes_lens": list(ROPE_LENS)}


def released(config: dict) -> tuple:
    """The released scheduler (above) and FLUX's VAE statistics (0.3611 / 0.1159)."""
    return dict(SCHEDULER), dict(VAE_LATENT)


def comfy_unet(cfg: dict) -> dict:
    """What ComfyUI 0.8.0's detection finds in a Z-Image file (image_model lumina2, the
    released dim 3840 picks supported_models.ZImage)."""
    cfg = FAMILY.full_config(cfg)
    return {"image_model": "lumina2", "dim": int(cfg["dim"]), "patch_size": 2,
            "in_channels": int(cfg["in_channels"]), "n_layers": int(cfg["n_layers"]),
            "cap_feat_dim": int(cfg["cap_feat_dim"]), "z_image_modulation": True,
            "pad_tokens_multiple": PAD_MULTIPLE}


def pipeline_of(index_class) -> str:
    if index_class in (None, "ZImagePipeline"):
        return "ZImagePipeline"
    raise ValueError(f"names pipeline {index_class!r}; Z-Image folders run with "
                     f"ZImagePipeline (text to image)")


def check_config(cfg: dict) -> None:
    """Only the text-to-image model: one patch size (2, one frame), no SigLIP stream."""
    from . import NotRun
    if cfg.get("siglip_feat_dim") is not None:
        raise NotRun("a Z-Image Omni model (SigLIP image conditioning); this pack runs the "
                     "text-to-image Z-Image models (ZImagePipeline)")
    sizes = (list(cfg.get("all_patch_size") or [2]), list(cfg.get("all_f_patch_size") or [1]))
    if sizes != ([2], [1]):
        raise NotRun(f"a Z-Image model with patch sizes {sizes[0]} x frames {sizes[1]}; this "
                     f"pack runs patch 2, one frame")


FAMILY = Family(
    id="z_image", order=70, name="Z-Image",
    classes=Classes(transformer="ZImageTransformer2DModel", pipelines=("ZImagePipeline",),
                    adapter="ZImageAdapter"),
    # execution order: the image refiner, the text refiner, the main blocks (ComfyUI's files
    # name them as diffusers does)
    blocks=Blocks(lists=("noise_refiner", "context_refiner", "layers"),
                  counts=("n_refiner_layers", "n_refiner_layers", "n_layers")),
    latent=LATENT,
    text=Text(hint="encode with Z-Image's text encoder (Qwen3-4B: CLIPLoader type lumina2) "
                   "or type the prompt into the sampler", pooled=False),
    comfy=ComfySpec(base=lambda unet: "Lumina2", config=lambda unet: "ZImage",
                    unet=comfy_unet, timestep_scale=1000.0, unused_inputs=("num_tokens",)),
    # Turbo (the released model) samples without CFG: ZImagePipeline guidance_scale 0
    defaults=Defaults(cfg=1.0),
    detection=Detection(
        # learned pad tokens and the Z-Image embedder names (Lumina 2 files have neither)
        markers=(("bfl", ("cap_pad_token", "x_embedder.weight",
                          "layers.0.attention.qkv.weight")),
                 ("diffusers", ("cap_pad_token", "all_x_embedder.2-1.weight"))),
        config_from_shapes=config_from_shapes, order=60, released=released,
        pipeline_of=pipeline_of, check_config=check_config,
        config_defaults={"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
                         "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30,
                         "n_kv_heads": 30, "cap_feat_dim": 2560, "siglip_feat_dim": None,
                         "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
                         "axes_lens": [1024, 512, 512]},
        config_names={"heads": "n_heads", "hidden": "dim", "patch": "all_patch_size",
                      "text_width": "cap_feat_dim"}),
    # both streams padded with learned pad tokens; each refined alone, then joint
    tokens=text_image(False, pad_multiple=PAD_MULTIPLE,
                      attentions=(Attention(("image",)), Attention(("text",)),
                                  Attention(("image", "text")))),
    capabilities=(Presets(PRESETS),),
)
