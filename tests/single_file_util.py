"""Test helper: write a tiny diffusers transformer as a BFL / ComfyUI single file.

The reverse of what the loader does, written independently (per key, from the BFL layout),
so a wrong rule on either side shows up as a different latent, not a silent round trip.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "model.diffusion_model."


def _shift_scale(w):
    """diffusers (scale, shift) -> BFL (shift, scale)."""
    scale, shift = w.chunk(2, dim=0)
    return torch.cat([shift, scale], dim=0)


def flux_to_bfl(sd: dict) -> dict:
    out = {}
    g = sd.get
    for p in ("weight", "bias"):
        out[f"img_in.{p}"] = sd[f"x_embedder.{p}"]
        out[f"txt_in.{p}"] = sd[f"context_embedder.{p}"]
        out[f"time_in.in_layer.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_1.{p}"]
        out[f"time_in.out_layer.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_2.{p}"]
        out[f"vector_in.in_layer.{p}"] = sd[f"time_text_embed.text_embedder.linear_1.{p}"]
        out[f"vector_in.out_layer.{p}"] = sd[f"time_text_embed.text_embedder.linear_2.{p}"]
        if g(f"time_text_embed.guidance_embedder.linear_1.{p}") is not None:
            out[f"guidance_in.in_layer.{p}"] = sd[f"time_text_embed.guidance_embedder.linear_1.{p}"]
            out[f"guidance_in.out_layer.{p}"] = sd[f"time_text_embed.guidance_embedder.linear_2.{p}"]
        out[f"final_layer.linear.{p}"] = sd[f"proj_out.{p}"]
        out[f"final_layer.adaLN_modulation.1.{p}"] = _shift_scale(sd[f"norm_out.linear.{p}"])
    n_double = len({k.split(".")[1] for k in sd if k.startswith("transformer_blocks.")})
    n_single = len({k.split(".")[1] for k in sd if k.startswith("single_transformer_blocks.")})
    for i in range(n_double):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for p in ("weight", "bias"):
            out[f"{b}img_mod.lin.{p}"] = sd[f"{d}norm1.linear.{p}"]
            out[f"{b}txt_mod.lin.{p}"] = sd[f"{d}norm1_context.linear.{p}"]
            out[f"{b}img_attn.qkv.{p}"] = torch.cat([sd[f"{d}attn.to_{x}.{p}"] for x in "qkv"])
            out[f"{b}txt_attn.qkv.{p}"] = torch.cat([sd[f"{d}attn.add_{x}_proj.{p}"]
                                                     for x in "qkv"])
            out[f"{b}img_attn.proj.{p}"] = sd[f"{d}attn.to_out.0.{p}"]
            out[f"{b}txt_attn.proj.{p}"] = sd[f"{d}attn.to_add_out.{p}"]
            out[f"{b}img_mlp.0.{p}"] = sd[f"{d}ff.net.0.proj.{p}"]
            out[f"{b}img_mlp.2.{p}"] = sd[f"{d}ff.net.2.{p}"]
            out[f"{b}txt_mlp.0.{p}"] = sd[f"{d}ff_context.net.0.proj.{p}"]
            out[f"{b}txt_mlp.2.{p}"] = sd[f"{d}ff_context.net.2.{p}"]
        out[f"{b}img_attn.norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}img_attn.norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
        out[f"{b}txt_attn.norm.query_norm.scale"] = sd[f"{d}attn.norm_added_q.weight"]
        out[f"{b}txt_attn.norm.key_norm.scale"] = sd[f"{d}attn.norm_added_k.weight"]
    for i in range(n_single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            out[f"{b}modulation.lin.{p}"] = sd[f"{d}norm.linear.{p}"]
            out[f"{b}linear1.{p}"] = torch.cat([sd[f"{d}attn.to_q.{p}"], sd[f"{d}attn.to_k.{p}"],
                                                sd[f"{d}attn.to_v.{p}"], sd[f"{d}proj_mlp.{p}"]])
            out[f"{b}linear2.{p}"] = sd[f"{d}proj_out.{p}"]
        out[f"{b}norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in sd.values())
    return out


def flux2_to_bfl(sd: dict) -> dict:
    """diffusers Flux2Transformer2DModel -> BFL / ComfyUI FLUX.2 names (weights only: FLUX.2
    has no biases). Written per key from the BFL layout."""
    out = {}
    top = {"x_embedder": "img_in", "context_embedder": "txt_in",
           "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
           "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
           "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
           "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
           "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
           "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
           "single_stream_modulation.linear": "single_stream_modulation.lin",
           "proj_out": "final_layer.linear"}
    for d, b in top.items():
        if f"{d}.weight" in sd:
            out[f"{b}.weight"] = sd[f"{d}.weight"]
    out["final_layer.adaLN_modulation.1.weight"] = _shift_scale(sd["norm_out.linear.weight"])
    n_double = len({k.split(".")[1] for k in sd if k.startswith("transformer_blocks.")})
    n_single = len({k.split(".")[1] for k in sd if k.startswith("single_transformer_blocks.")})
    for i in range(n_double):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out[f"{b}img_attn.qkv.weight"] = torch.cat([sd[f"{d}attn.to_{x}.weight"] for x in "qkv"])
        out[f"{b}txt_attn.qkv.weight"] = torch.cat([sd[f"{d}attn.add_{x}_proj.weight"]
                                                    for x in "qkv"])
        out[f"{b}img_attn.proj.weight"] = sd[f"{d}attn.to_out.0.weight"]
        out[f"{b}txt_attn.proj.weight"] = sd[f"{d}attn.to_add_out.weight"]
        out[f"{b}img_attn.norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}img_attn.norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
        out[f"{b}txt_attn.norm.query_norm.scale"] = sd[f"{d}attn.norm_added_q.weight"]
        out[f"{b}txt_attn.norm.key_norm.scale"] = sd[f"{d}attn.norm_added_k.weight"]
        out[f"{b}img_mlp.0.weight"] = sd[f"{d}ff.linear_in.weight"]
        out[f"{b}img_mlp.2.weight"] = sd[f"{d}ff.linear_out.weight"]
        out[f"{b}txt_mlp.0.weight"] = sd[f"{d}ff_context.linear_in.weight"]
        out[f"{b}txt_mlp.2.weight"] = sd[f"{d}ff_context.linear_out.weight"]
    for i in range(n_single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out[f"{b}linear1.weight"] = sd[f"{d}attn.to_qkv_mlp_proj.weight"]
        out[f"{b}linear2.weight"] = sd[f"{d}attn.to_out.weight"]
        out[f"{b}norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in sd.values())
    return out


def sd3_to_bfl(sd: dict) -> dict:
    out = {"pos_embed": sd["pos_embed.pos_embed"]}
    n = len({k.split(".")[1] for k in sd if k.startswith("transformer_blocks.")})
    for p in ("weight", "bias"):
        out[f"x_embedder.proj.{p}"] = sd[f"pos_embed.proj.{p}"]
        out[f"context_embedder.{p}"] = sd[f"context_embedder.{p}"]
        out[f"t_embedder.mlp.0.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_1.{p}"]
        out[f"t_embedder.mlp.2.{p}"] = sd[f"time_text_embed.timestep_embedder.linear_2.{p}"]
        out[f"y_embedder.mlp.0.{p}"] = sd[f"time_text_embed.text_embedder.linear_1.{p}"]
        out[f"y_embedder.mlp.2.{p}"] = sd[f"time_text_embed.text_embedder.linear_2.{p}"]
        out[f"final_layer.linear.{p}"] = sd[f"proj_out.{p}"]
        out[f"final_layer.adaLN_modulation.1.{p}"] = _shift_scale(sd[f"norm_out.linear.{p}"])
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
            # continuous norm (diffusers scale, shift; BFL shift, scale)
            out[f"{b}context_block.adaLN_modulation.1.{p}"] = _shift_scale(ctx_mod) if last \
                else ctx_mod
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
            for x, y in (("q", "q"), ("k", "k")):
                out[f"{b}x_block.attn.ln_{x}.weight"] = sd[f"{d}attn.norm_{y}.weight"]
                out[f"{b}context_block.attn.ln_{x}.weight"] = sd[f"{d}attn.norm_added_{y}.weight"]
                if f"{d}attn2.norm_{y}.weight" in sd:
                    out[f"{b}x_block.attn2.ln_{x}.weight"] = sd[f"{d}attn2.norm_{y}.weight"]
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in sd.values())
    return out


def wan_to_comfy(sd: dict) -> dict:
    """diffusers WanTransformer3DModel -> ComfyUI's / the original Wan names (what
    comfy/ldm/wan/model.py's WanModel holds), written per key from that layout."""
    out = {}
    top = {"patch_embedding": "patch_embedding",
           "condition_embedder.text_embedder.linear_1": "text_embedding.0",
           "condition_embedder.text_embedder.linear_2": "text_embedding.2",
           "condition_embedder.time_embedder.linear_1": "time_embedding.0",
           "condition_embedder.time_embedder.linear_2": "time_embedding.2",
           "condition_embedder.time_proj": "time_projection.1",
           "proj_out": "head.head",
           "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
           "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
           "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
           "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}
    for d, c in top.items():
        for p in ("weight", "bias"):
            if f"{d}.{p}" in sd:
                out[f"{c}.{p}"] = sd[f"{d}.{p}"]
    out["head.modulation"] = sd["scale_shift_table"]  # [1, 2, dim]: shift, scale both
    if "condition_embedder.image_embedder.pos_embed" in sd:
        out["img_emb.emb_pos"] = sd["condition_embedder.image_embedder.pos_embed"]
    n = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(n):
        d, c = f"blocks.{i}.", f"blocks.{i}."
        for attn, src in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            for x in "qkv":
                for p in ("weight", "bias"):
                    out[f"{c}{attn}.{x}.{p}"] = sd[f"{d}{src}.to_{x}.{p}"]
            for p in ("weight", "bias"):
                out[f"{c}{attn}.o.{p}"] = sd[f"{d}{src}.to_out.0.{p}"]
            for x in "qk":
                out[f"{c}{attn}.norm_{x}.weight"] = sd[f"{d}{src}.norm_{x}.weight"]
        if f"{d}attn2.add_k_proj.weight" in sd:  # I2V's image K / V
            for p in ("weight", "bias"):
                out[f"{c}cross_attn.k_img.{p}"] = sd[f"{d}attn2.add_k_proj.{p}"]
                out[f"{c}cross_attn.v_img.{p}"] = sd[f"{d}attn2.add_v_proj.{p}"]
            out[f"{c}cross_attn.norm_k_img.weight"] = sd[f"{d}attn2.norm_added_k.weight"]
        for p in ("weight", "bias"):
            out[f"{c}norm3.{p}"] = sd[f"{d}norm2.{p}"]
            out[f"{c}ffn.0.{p}"] = sd[f"{d}ffn.net.0.proj.{p}"]
            out[f"{c}ffn.2.{p}"] = sd[f"{d}ffn.net.2.{p}"]
        out[f"{c}modulation"] = sd[f"{d}scale_shift_table"]
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in sd.values())
    return out


def write_single_file(model_dir, arch: str, out: Path, prefix: bool = False,
                      naming: str = "bfl", extra: dict | None = None,
                      perturb_block: int | None = None, state: dict | None = None) -> Path:
    """The tiny folder's transformer (or `state`, a diffusers state dict) as one file.
    `prefix`: under model.diffusion_model. (as in a full checkpoint; `extra` adds other parts
    such as fake VAE keys); `perturb_block`: add noise to that block's weights (negative
    control)."""
    sd = dict(state) if state is not None else \
        load_file(str(Path(model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"))
    if perturb_block is not None:
        g = torch.Generator().manual_seed(1)
        key = f"transformer_blocks.{perturb_block}."
        sd = {k: (v + 0.05 * torch.randn(v.shape, generator=g) if k.startswith(key) else v)
              for k, v in sd.items()}
    if naming == "bfl":
        sd = {"flux": flux_to_bfl, "flux2": flux2_to_bfl, "sd3": sd3_to_bfl,
              "wan": wan_to_comfy}[arch](sd)
    if prefix:
        sd = {PREFIX + k: v for k, v in sd.items()}
    sd.update(extra or {})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out))
    return out
