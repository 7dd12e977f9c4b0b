"""The tiny FLUX.1 diffusers folder (`tiny-model --arch flux`): FluxPipeline with a CLIP-L and
a T5 text encoder (parts.py), a FluxTransformer2DModel with embedded guidance (FLUX.1 [dev]
style) and FLUX.1's RoPE axes, the 16-channel VAE and the released [dev] scheduler."""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import bfl_names, parts
from comfyui_xdit.testmodels.text import _clip_tokenizer, _seeded, _t5_tokenizer

_flux = bridge.family_module("flux")  # RoPE axes, scheduler

VARIANTS: tuple[str, ...] = ()

# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_flux_sd3_one_rank_oracle.py::test_one_rank_matches_diffusers"
# PipeFusion's stale-K/V oracle for the conformance suite (tests/conformance/test_pipefusion.py):
# the test module's factory of the model folder, and the request fields it needs
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_reference:Reference",
                         request=dict(cfg=1.0, guidance=3.5))  # it runs embedded guidance


def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 2 == 0 and hd >= 6, "an even head dim >= 6 for its 3 RoPE axes")
    parts.refuse_knobs(cfg)


def key_extras(cfg: dict) -> dict:
    if parts.head_dim(cfg) == 128:
        # FLUX.1's RoPE axes (16, 56, 56), as a single file of it is read (the old recipe
        # split 128 as (4, 62, 62)): a new key for this recipe, the others' keys unchanged
        return {"rope": "flux1"}
    return {}


def build_pipeline(cfg: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    seed, heads, head_dim = cfg["seed"], cfg["heads"], parts.head_dim(cfg)
    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    text_encoder = parts.clip_text_model(CLIPTextModel, parts.CLIP_L, tokenizer, seed, 1)
    text_encoder_2 = parts.t5_model(tokenizer_2, seed, 2)
    transformer = _seeded(
        seed,
        3,
        FluxTransformer2DModel,
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=cfg["depth"],
        num_single_layers=cfg["depth"],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=parts.T5["d_model"],
        pooled_projection_dim=parts.CLIP_L["hidden_size"],
        guidance_embeds=True,  # FLUX.1-dev style embedded guidance
        axes_dims_rope=_flux.rope_axes(head_dim),
    )
    vae = parts.kl_vae(cfg["arch"], seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_flux.SCHEDULER_DEV)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in BFL / ComfyUI names (a FLUX.1 file of
    models/diffusion_models), for the conformance suite's single-file theme."""
    out = {}
    pairs = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
             "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer"}
    for d, b in pairs.items():
        for p in ("weight", "bias"):
            if f"{d}.{p}" in sd:  # no guidance embedder: schnell
                out[f"{b}.{p}"] = sd[f"{d}.{p}"]
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = bfl_names.shift_scale(sd[f"norm_out.linear.{p}"])
    bfl_names.double_blocks(sd, out)
    bfl_names.single_blocks(sd, out)
    return bfl_names.same_size(out, sd)
