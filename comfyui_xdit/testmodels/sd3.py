"""The tiny SD3 diffusers folder (`tiny-model --arch sd3 [--sd35]`): StableDiffusion3Pipeline
with CLIP-L, CLIP-G and T5 (parts.py; T5 wider than the two CLIPs together, so the zero
padding of the CLIP states is real), an SD3Transformer2DModel (with `sd35`: SD3.5's RMS-normed
q/k and dual attention), the 16-channel VAE and the released scheduler."""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import bfl_names, parts
from comfyui_xdit.testmodels.text import _clip_tokenizer, _seeded, _t5_tokenizer

_sd3 = bridge.family_module("sd3")  # scheduler

VARIANTS: tuple[str, ...] = ()

# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_flux_sd3_one_rank_oracle.py::test_one_rank_matches_diffusers"
# its oracle of PipeFusion's stale-K/V schedule (the conformance suite's pipefusion theme)
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_oracles:SD3Reference", request={})
# the test model a ComfyUI single file describes (the conformance suite's single-file
# theme): SD3's files store no head count without qk-norm (head dim 64, as released)
SINGLE_FILE_MODEL = dict(width=256, heads=4)

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


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in ComfyUI's MMDiT names (SD3 / SD3.5 files of
    models/checkpoints), for the conformance suite's single-file theme and the fp8 / GGUF
    tests."""
    import torch
    out = {"pos_embed": sd["pos_embed.pos_embed"]}
    n = bfl_names.count(sd, "transformer_blocks")
    for p in ("weight", "bias"):
        out[f"x_embedder.proj.{p}"] = sd[f"pos_embed.proj.{p}"]
        out[f"context_embedder.{p}"] = sd[f"context_embedder.{p}"]
        out[f"t_embedder.mlp.0.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_1.{p}"]
        out[f"t_embedder.mlp.2.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_2.{p}"]
        out[f"y_embedder.mlp.0.{p}"] = sd[f"time_text_embed.text_embedder.linear_1.{p}"]
        out[f"y_embedder.mlp.2.{p}"] = sd[f"time_text_embed.text_embedder.linear_2.{p}"]
        out[f"final_layer.linear.{p}"] = sd[f"proj_out.{p}"]
        out[f"final_layer.adaLN_modulation.1.{p}"] = bfl_names.shift_scale(sd[f"norm_out.linear.{p}"])
    for i in range(n):
        d, b = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        last = i == n - 1
        for p in ("weight", "bias"):
            out[f"{b}x_block.attn.qkv.{p}"] = torch.cat([sd[f"{d}attn.to_{x}.{p}"] for x in "qkv"])
            out[f"{b}context_block.attn.qkv.{p}"] = torch.cat([sd[f"{d}attn.add_{x}_proj.{p}"]
                                                               for x in "qkv"])
            out[f"{b}x_block.attn.proj.{p}"] = sd[f"{d}attn.to_out.0.{p}"]
            out[f"{b}x_block.adaLN_modulation.1.{p}"] = sd[f"{d}norm1.linear.{p}"]
            ctx_mod = sd[f"{d}norm1_context.linear.{p}"]
            # the last block's context stream only feeds attention: its modulation is a
            # continuous norm (diffusers scale, shift; ComfyUI shift, scale)
            out[f"{b}context_block.adaLN_modulation.1.{p}"] = \
                bfl_names.shift_scale(ctx_mod) if last else ctx_mod
            out[f"{b}x_block.mlp.fc1.{p}"] = sd[f"{d}ff.net.0.proj.{p}"]
            out[f"{b}x_block.mlp.fc2.{p}"] = sd[f"{d}ff.net.2.{p}"]
            if not last:
                out[f"{b}context_block.attn.proj.{p}"] = sd[f"{d}attn.to_add_out.{p}"]
                out[f"{b}context_block.mlp.fc1.{p}"] = sd[f"{d}ff_context.net.0.proj.{p}"]
                out[f"{b}context_block.mlp.fc2.{p}"] = sd[f"{d}ff_context.net.2.{p}"]
            if f"{d}attn2.to_q.{p}" in sd:  # SD3.5 dual attention (image stream only)
                out[f"{b}x_block.attn2.qkv.{p}"] = torch.cat([sd[f"{d}attn2.to_{x}.{p}"]
                                                              for x in "qkv"])
                out[f"{b}x_block.attn2.proj.{p}"] = sd[f"{d}attn2.to_out.0.{p}"]
        if f"{d}attn.norm_q.weight" in sd:  # SD3.5 qk-norm (RMS, weight only)
            for x in "qk":
                out[f"{b}x_block.attn.ln_{x}.weight"] = sd[f"{d}attn.norm_{x}.weight"]
                out[f"{b}context_block.attn.ln_{x}.weight"] = sd[f"{d}attn.norm_added_{x}.weight"]
                if f"{d}attn2.norm_{x}.weight" in sd:
                    out[f"{b}x_block.attn2.ln_{x}.weight"] = sd[f"{d}attn2.norm_{x}.weight"]
    return bfl_names.same_size(out, sd)
