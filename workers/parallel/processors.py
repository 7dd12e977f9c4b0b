"""What every family's sharded attention processor shares. The processors themselves live
with their family (`workers/models/<id>.py`).

Each computes exactly what the stock diffusers processor computes (projections, QK norms,
RoPE for FLUX, output projections) on the local token shard; only the attention kernel is
replaced by the attention the parallel method installs: `ShardedAttention` (USP: every
rank's keys) or PipeFusion's `PatchAttention` (a patch's queries against the K/V cache). The per-forward
`SequencePlan` arrives as the `sp_plan` keyword through `joint_attention_kwargs`.
"""
from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb  # once, not per attention call

from .sequence_parallel import SequencePlan


def need_plan(sp_plan):
    if not isinstance(sp_plan, SequencePlan):
        raise RuntimeError("sharded attention called without a sequence plan "
                           "(the transformer was called outside its parallel hooks)")
    return sp_plan


def joint_text_image_qkv(attn, query, key, value, encoder_hidden_states, rotary):
    """FLUX / FLUX.2 after the image projections: heads, QK norms, the text stream's own
    projections joined in front (double blocks), RoPE; [B, S, H, D] each."""
    def heads(x):
        return x.unflatten(-1, (-1, attn.head_dim))

    query, key, value = heads(query), heads(key), heads(value)
    query, key = attn.norm_q(query), attn.norm_k(key)
    if encoder_hidden_states is not None and getattr(attn, "added_kv_proj_dim", None) is not None:
        if getattr(attn, "fused_projections", False):
            eq, ek, ev = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
        else:
            eq = attn.add_q_proj(encoder_hidden_states)
            ek = attn.add_k_proj(encoder_hidden_states)
            ev = attn.add_v_proj(encoder_hidden_states)
        eq, ek, ev = heads(eq), heads(ek), heads(ev)
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        query = torch.cat([eq, query], dim=1)
        key = torch.cat([ek, key], dim=1)
        value = torch.cat([ev, value], dim=1)
    if rotary is not None:
        query = apply_rotary_emb(query, rotary, sequence_dim=1)
        key = apply_rotary_emb(key, rotary, sequence_dim=1)
    return query, key, value
