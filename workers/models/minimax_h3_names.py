"""MiniMax-H3 single files in ComfyUI's naming (comfy/ldm/minimax: `video_patch_proj`,
`blocks.N.attn.qkv_proj`, `final_layer.video_out`, ...) -> diffusers' names
(MiniMaxH3Transformer3DModel), key by key so a stage reads only its blocks.

What differs beyond the names: each attention's fused `qkv_proj` is q, k, v stacked along its
rows (diffusers keeps to_q / to_k / to_v); each MLP's `fc1` holds the SwiGLU gate rows first
and the value rows after, diffusers' `ff.net.0.proj` the value rows first (its SwiGLU gates
the second half); ComfyUI's file carries `rope.inv_freq`, which diffusers computes (its
length is the RoPE frequencies per axis, read by the family's config from the shapes). The
AdaLN tables (6 x 3 modality rows a block, shift then scale at the end) are laid out alike.
A key without a rule raises: a silently dropped tensor would load as garbage.
"""
from __future__ import annotations

import re

import torch

_TOP = {
    "video_patch_proj": "proj_in",
    "audio_patch_proj": "audio_proj_in",
    "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1",
    "time_embedder.proj_out": "time_embedder.linear_2",
    "token_refiner.final_norm": "token_refiner.final_norm",
    "final_layer.norm": "norm_out.norm",
    "final_layer.adaln_proj.linear": "norm_out.linear",
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
}
# inside a block (the token refiner's and the main stack's alike)
_BLOCK = {
    "norm1": "norm1", "norm2": "norm2",
    "attn.q_norm": "attn.norm_q", "attn.k_norm": "attn.norm_k",
    "attn.out_proj": "attn.to_out.0",
    "mlp.fc2": "ff.net.2",
    "adaln_proj.linear": "adaln_proj.linear",
}
_BLOCK_RE = re.compile(r"^(token_refiner\.blocks|blocks)\.(\d+)\.(.+)\.(weight|bias)$")
# not a weight: the RoPE frequencies diffusers computes
COMPUTED = ("rope.inv_freq",)
# curve-form checkpoints (a time-embedding table in place of the time embedder): another model
CURVES = "adaln_t_table"


def _block_prefix(kind: str, index: str) -> str:
    return (f"token_refiner.refiner_blocks.{index}." if kind == "token_refiner.blocks"
            else f"transformer_blocks.{index}.")


def comfy_to_diffusers(sd: dict) -> dict:
    """ComfyUI-named tensors (prefix stripped) -> {diffusers name: tensor}; only splits and
    concatenates along dim 0 (workers/loading/single_file.row_map relies on it)."""
    out = {}
    for name, w in sd.items():
        if name in COMPUTED:
            continue
        if name == CURVES:
            raise ValueError("this MiniMax-H3 file is a curve-form checkpoint (adaln_t_table "
                             "in place of the time embedder), which the pool does not run; "
                             "use the release's transformer file")
        stem, _, suffix = name.rpartition(".")
        if stem in _TOP:
            out[f"{_TOP[stem]}.{suffix}"] = w
            continue
        m = _BLOCK_RE.match(name)
        if m is None:
            raise ValueError(f"MiniMax-H3 file: no diffusers name for tensor {name!r}")
        kind, index, part, suffix = m.groups()
        pre = _block_prefix(kind, index)
        if part == "attn.qkv_proj":
            for dst, rows in zip(("to_q", "to_k", "to_v"), w.chunk(3, dim=0)):
                out[f"{pre}attn.{dst}.{suffix}"] = rows
        elif part == "mlp.fc1":
            gate, value = w.chunk(2, dim=0)
            out[f"{pre}ff.net.0.proj.{suffix}"] = torch.cat([value, gate], dim=0)
        elif part in _BLOCK:
            out[f"{pre}{_BLOCK[part]}.{suffix}"] = w
        else:
            raise ValueError(f"MiniMax-H3 file: no diffusers name for tensor {name!r}")
    return out
