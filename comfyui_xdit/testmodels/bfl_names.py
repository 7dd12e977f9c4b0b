"""Pieces of the BFL / ComfyUI single-file layout shared by the builders whose transformers
use it: double-stream blocks (`double_blocks.<i>.img_* / txt_*`, q, k, v fused as `qkv`),
single-stream blocks (`single_blocks.<i>.linear1` fusing q, k, v and the MLP input) and the
final modulation's (shift, scale) order. Written per key from that layout, independently of
the loader's rules (workers/loading/), so a wrong rule on either side shows as a different
result, not a silent round trip."""
from __future__ import annotations

PREFIX = "model.diffusion_model."  # a full checkpoint's transformer


def shift_scale(w):
    """diffusers' (scale, shift) halves -> BFL's (shift, scale)."""
    import torch
    scale, shift = w.chunk(2, dim=0)
    return torch.cat([shift, scale], dim=0)


def count(sd: dict, prefix: str) -> int:
    """How many blocks `sd` holds under `prefix` ("transformer_blocks")."""
    return len({k.split(".")[1] for k in sd if k.startswith(prefix + ".")})


def double_blocks(sd: dict, out: dict, modulation: bool = True) -> None:
    """diffusers `transformer_blocks.<i>` (two streams, GELU MLPs) -> `double_blocks.<i>`;
    `modulation`: the blocks carry their own img_mod / txt_mod."""
    import torch
    for i in range(count(sd, "transformer_blocks")):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for p in ("weight", "bias"):
            if modulation:
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


def single_blocks(sd: dict, out: dict, modulation: bool = True) -> None:
    """diffusers `single_transformer_blocks.<i>` -> `single_blocks.<i>`: q, k, v and the MLP
    input fused as linear1."""
    import torch
    for i in range(count(sd, "single_transformer_blocks")):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            if modulation:
                out[f"{b}modulation.lin.{p}"] = sd[f"{d}norm.linear.{p}"]
            out[f"{b}linear1.{p}"] = torch.cat([sd[f"{d}attn.to_q.{p}"], sd[f"{d}attn.to_k.{p}"],
                                                sd[f"{d}attn.to_v.{p}"], sd[f"{d}proj_mlp.{p}"]])
            out[f"{b}linear2.{p}"] = sd[f"{d}proj_out.{p}"]
        out[f"{b}norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]


def same_size(out: dict, sd: dict) -> dict:
    """`out`, checked to hold every parameter of `sd` once (nothing dropped or doubled)."""
    got, want = sum(v.numel() for v in out.values()), sum(v.numel() for v in sd.values())
    assert got == want, f"the single file holds {got} parameters, the transformer {want}"
    return out
