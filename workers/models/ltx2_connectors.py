"""LTX-2's text connectors on the pool, for text states that have not been through them.

ComfyUI 0.33.0's LTX-2 text encoder stops before the connectors (its CONDITIONING is Gemma's
projected features, caption_channels wide) and its LTXAV model runs the connectors its
diffusion-model file holds (`video_embeddings_connector`, `audio_embeddings_connector`).
The pool does the same with diffusers' LTX2ConnectorTransformer1d, built and loaded once
per model on first use: a single file's connectors (ComfyUI's names, its "config"
metadata's head counts, ComfyUI's defaults where it has none), or a diffusers folder's
`connectors` (LTX-2.0's: no per-stream projections).

ComfyUI's connectors take the prompt's tokens unpadded and append the learnable registers
(tiled, by absolute position) up to max(1024, tokens) rounded up to whole register blocks;
diffusers' take a padded sequence and a mask and put the registers in the same place. So
the tokens are padded to that length, masked as prompt then padding, and each connector's
output (every token: the registers' too) is the stream's prompt states, as ComfyUI's.
"""
from __future__ import annotations

import json
import math
import os

import torch

from ..families import ltx2 as family

PARTS = ("video_connector", "audio_connector")


def run(connectors: dict, context):
    """Text states [B, tokens, width] -> ComfyUI's LTX-2 context [B, padded tokens,
    2 x width]: the video connector's output, then the audio connector's."""
    out = []
    for part in PARTS:
        conn = connectors[part]
        b, n, width = context.shape
        if width != conn.inner_dim:
            raise ValueError(f"LTX-2's {part} takes text states {conn.inner_dim} wide (got "
                             f"{width})")
        regs = conn.num_learnable_registers
        total = n if not regs else \
            regs * math.ceil(max(family.COMFY_CONNECTOR_MIN_TOKENS, n) / regs)
        x = torch.cat([context, context.new_zeros(b, total - n, width)], 1)
        keep = torch.arange(total, device=context.device) < n
        # diffusers' additive mask: 0 on the prompt, very negative on the padding
        mask = ((keep.to(x.dtype) - 1) * torch.finfo(x.dtype).max).view(1, 1, 1, total)
        out.append(conn(x, mask.expand(b, -1, -1, -1))[0])
    return torch.cat(out, -1)


def connectors_of(model) -> dict:
    """The model's connectors {part: module} on its device and dtype, loaded on first use."""
    loaded = getattr(model, "text_connectors", None)
    if loaded is None:
        loaded = _load(model.path)
        for m in loaded.values():
            m.to(model.device, model.dtype).eval().requires_grad_(False)
        model.text_connectors = loaded
    return loaded


def _load(path: str) -> dict:
    if os.path.isdir(path):
        return _from_folder(path)
    return _from_file(path)


def _from_folder(path: str) -> dict:
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    if not os.path.isdir(os.path.join(path, "connectors")):
        raise ValueError(f"{path} has no connectors/ folder: its LTX-2 transformer takes "
                         f"text states after the text connectors only")
    conn = LTX2TextConnectors.from_pretrained(path, subfolder="connectors")
    if conn.config.get("per_modality_projections"):
        raise ValueError("this LTX-2 folder's connectors project each stream's text "
                         "(LTX-2.3); the pool runs LTX-2.0's")
    return {p: getattr(conn, p) for p in PARTS}


def _from_file(path: str) -> dict:
    """A ComfyUI single file's connectors (`model.diffusion_model.` names)."""
    from ..loading.transformer_file import single_file_config
    from ..loading.weights import Checkpoint
    prefix = single_file_config(path)["prefix"]
    states = {p: {} for p in PARTS}
    with Checkpoint.open([path]) as ck:
        for key in ck.keys():
            named = key.startswith(prefix) and family.connector_name(key[len(prefix):])
            if named:
                states[named[0]][named[1]] = ck.read(key).float()
    if not all(states.values()):
        raise ValueError(f"{os.path.basename(path)} holds no LTX-2 text connectors "
                         f"(video_embeddings_connector, audio_embeddings_connector): it "
                         f"takes text states after them only (ComfyUI 0.8.0's LTX-2 text "
                         f"encoder gives those)")
    settings = dict(family.COMFY_CONNECTOR_DEFAULTS, **_file_settings(path))
    return {p: _connector(p, states[p], settings) for p in PARTS}


def _file_settings(path: str) -> dict:
    """The "transformer" part of a safetensors file's "config" metadata ({} without)."""
    try:
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        return dict(json.loads(meta.get("config", "{}")).get("transformer", {}))
    except Exception:  # noqa: BLE001  (a GGUF file, or no readable metadata: the defaults)
        return {}


def _connector(part: str, state: dict, settings: dict):
    """One LTX2ConnectorTransformer1d holding `state`, shaped as ComfyUI builds it."""
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d
    pre = "audio_" if part == "audio_connector" else ""

    def setting(name):
        return settings.get(pre + name, settings[name])
    heads, head_dim = int(setting("connector_num_attention_heads")), \
        int(setting("connector_attention_head_dim"))
    registers = state.get("learnable_registers")
    width = int(state["transformer_blocks.0.attn1.to_q.weight"].shape[0])
    if heads * head_dim != width:
        raise ValueError(f"LTX-2's {part}: {heads} heads of {head_dim} (the file's config) "
                         f"do not make its width {width}")
    layers = len({k.split(".")[1] for k in state if k.startswith("transformer_blocks.")})
    conn = LTX2ConnectorTransformer1d(
        num_attention_heads=heads, attention_head_dim=head_dim, num_layers=layers,
        num_learnable_registers=None if registers is None else int(registers.shape[0]),
        rope_type=settings["rope_type"],
        gated_attention=bool(settings.get("connector_apply_gated_attention", False)))
    conn.load_state_dict(state, strict=True)
    return conn
