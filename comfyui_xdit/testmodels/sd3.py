"""The tiny SD3 diffusers folder (`tiny-model --arch sd3 [--sd35]`): StableDiffusion3Pipeline
with CLIP-L, CLIP-G and T5 (parts.py; T5 wider than the two CLIPs together, so the zero
padding of the CLIP states is real), an SD3Transformer2DModel (with `sd35`: SD3.5's RMS-normed
q/k and dual attention), the 16-channel VAE and the released scheduler."""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _clip_tokenizer, _seeded, _t5_tokenizer

_sd3 = bridge.family_module("sd3")  # scheduler

VARIANTS: tuple[str, ...] = ()

# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_flux_sd3_one_rank_oracle.py::test_one_rank_matches_diffusers"

SD3_SAMPLE_SIZE = 16  # pipeline default 128x128
SD3_POS_EMBED_MAX = 64  # latent grid up to 128 -> images up to 1024x1024


def check(cfg: dict) -> None:
    parts.require_head_dim(cfg, parts.head_dim(cfg) >= 2, "a head dim >= 2")
    parts.refuse_knobs(cfg, "sd35")


def build_pipeline(cfg: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    seed, heads, width = cfg["seed"], cfg["heads"], cfg["width"]
    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    text_encoder = parts.clip_text_model(CLIPTextModelWithProjection, parts.CLIP_L, tokenizer, seed, 1)
    text_encoder_2 = parts.clip_text_model(CLIPTextModelWithProjection, parts.CLIP_G, tokenizer_2, seed, 5)
    text_encoder_3 = parts.t5_model(tokenizer_3, seed, 2)
    transformer = _seeded(
        seed,
        3,
        SD3Transformer2DModel,
        sample_size=SD3_SAMPLE_SIZE,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=cfg["depth"],
        attention_head_dim=width // heads,
        num_attention_heads=heads,
        joint_attention_dim=parts.T5["d_model"],
        caption_projection_dim=width,
        pooled_projection_dim=parts.CLIP_L["projection_dim"] + parts.CLIP_G["projection_dim"],
        pos_embed_max_size=SD3_POS_EMBED_MAX,
        # SD3.5: RMS-normed q/k and a second, image-only attention in every block
        **(dict(qk_norm="rms_norm", dual_attention_layers=tuple(range(cfg["depth"])))
           if cfg.get("sd35") else {}),
    )
    vae = parts.kl_vae(cfg["arch"], seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_sd3.SCHEDULER)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
