"""Sharded attention processors, one per attention kind of the families (FLUX / FLUX.2 /
Chroma, SD3, Qwen-Image).

Each computes exactly what the stock diffusers processor computes (projections, QK norms,
RoPE for FLUX, output projections) on the local token shard; only the attention kernel is
replaced by the attention the parallel method installs: `ShardedAttention` (USP: every
rank's keys) or PipeFusion's `PatchAttention` (a patch's queries against the K/V cache). The per-forward
`SequencePlan` arrives as the `sp_plan` keyword through `joint_attention_kwargs`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb  # once, not per attention call

from .sequence_parallel import SequencePlan


def _need_plan(sp_plan):
    if not isinstance(sp_plan, SequencePlan):
        raise RuntimeError("sharded attention called without a sequence plan "
                           "(the transformer was called outside its parallel hooks)")
    return sp_plan


def _flux_joint_qkv(attn, query, key, value, encoder_hidden_states, rotary):
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


class FluxShardedAttnProcessor:
    """FLUX double blocks (text + image streams, text first) and single blocks (one
    concatenated stream); both attend over all text and image tokens. Rows padded to a
    common text length (Chroma's prompts of one batch) carry `text_lengths`, as
    Qwen-Image's do: each row's padded text keys are dropped."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, sp_plan=None, text_lengths=None):
        plan = _need_plan(sp_plan)
        if attention_mask is not None:
            raise ValueError("attention masks are not supported under sequence parallelism")

        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = _flux_joint_qkv(attn, query, key, value, encoder_hidden_states,
                                            image_rotary_emb)

        out = self.attention(query, key, value, plan, ("text", "image"), attn,
                             text_lengths=text_lengths)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_out, out = out[:, :text], out[:, text:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            encoder_out = attn.to_add_out(encoder_out.contiguous())
            return out, encoder_out
        return out


class SD3ShardedAttnProcessor:
    """SD3/3.5 joint attention (image tokens first, then text) and SD3.5's image-only
    second attention (`attn2`, called without encoder states)."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 sp_plan=None, **kwargs):
        plan = _need_plan(sp_plan)
        if attention_mask is not None:
            raise ValueError("attention masks are not supported under sequence parallelism")
        b = hidden_states.shape[0]
        image_tokens = hidden_states.shape[1]
        head_dim = attn.to_k.out_features // attn.heads

        def heads(x):
            return x.view(b, -1, attn.heads, head_dim)

        query = heads(attn.to_q(hidden_states))
        key = heads(attn.to_k(hidden_states))
        value = heads(attn.to_v(hidden_states))
        # diffusers' norms act on the last dim, so the [B,S,H,D] layout gives the same result
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        streams = ("image",)
        if encoder_hidden_states is not None:
            eq = heads(attn.add_q_proj(encoder_hidden_states))
            ek = heads(attn.add_k_proj(encoder_hidden_states))
            ev = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query = torch.cat([query, eq], dim=1)
            key = torch.cat([key, ek], dim=1)
            value = torch.cat([value, ev], dim=1)
            streams = ("image", "text")

        out = self.attention(query, key, value, plan, streams, attn)
        out = out.reshape(b, -1, attn.heads * head_dim).to(query.dtype)

        if encoder_hidden_states is not None:
            out, encoder_out = out[:, :image_tokens], out[:, image_tokens:]
            if not attn.context_pre_only:
                encoder_out = attn.to_add_out(encoder_out)
        out = attn.to_out[1](attn.to_out[0](out))
        if encoder_hidden_states is not None:
            return out, encoder_out
        return out


class Flux2ShardedAttnProcessor:
    """FLUX.2 attention on the local token shard, for both of its attention modules (one
    processor instance serves every module, so it tells them apart by their layers):

    - `Flux2Attention` (double blocks): separate image and text projections, text first;
      called as (attn, hidden_states, encoder_hidden_states, attention_mask, rotary).
    - `Flux2ParallelSelfAttention` (single blocks): one fused projection producing q, k, v
      and the SwiGLU MLP input, one fused output projection over [attention, MLP];
      called as (attn, hidden_states, attention_mask, rotary).
    """

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, *args, sp_plan=None, **kwargs):
        plan = _need_plan(sp_plan)
        single = hasattr(attn, "to_qkv_mlp_proj")
        args = args + (None,) * (3 - len(args))
        if single:
            encoder_hidden_states, (attention_mask, rotary) = None, args[:2]
        else:
            encoder_hidden_states, attention_mask, rotary = args[:3]
        attention_mask = kwargs.get("attention_mask", attention_mask)
        rotary = kwargs.get("image_rotary_emb", rotary)
        encoder_hidden_states = kwargs.get("encoder_hidden_states", encoder_hidden_states)
        if attention_mask is not None:
            raise ValueError("attention masks are not supported under sequence parallelism")

        mlp = None
        if single:
            fused = attn.to_qkv_mlp_proj(hidden_states)
            qkv_width = 3 * attn.inner_dim
            qkv, mlp = fused[..., :qkv_width], fused[..., qkv_width:]
            query, key, value = qkv.chunk(3, dim=-1)
        elif getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = _flux_joint_qkv(attn, query, key, value, encoder_hidden_states, rotary)

        out = self.attention(query, key, value, plan, ("text", "image"), attn)
        out = out.flatten(2, 3).to(query.dtype)

        if single:
            return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_out, out = out[:, :text], out[:, text:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            encoder_out = attn.to_add_out(encoder_out.contiguous())
            return out, encoder_out
        return attn.to_out[1](attn.to_out[0](out))


class QwenImageShardedAttnProcessor:
    """Qwen-Image's double-stream attention on the local token shard: separate image and
    text projections, per-head QK RMSNorm, RoPE applied per stream (the image and text
    frequency shards arrive split with their tokens), text first, outputs projected per
    stream. Returns (image, text) as the stock processor does.

    Rows of one call whose prompts were padded to a common length carry `text_lengths`
    (their real token counts, through the attention kwargs): their padded text keys are
    dropped as diffusers' text mask drops them. The mask itself is not taken (a per-call
    host read); the model's own `encoder_hidden_states_mask` must be None."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None,
                 sp_plan=None, text_lengths=None):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        plan = _need_plan(sp_plan)
        if attention_mask is not None or encoder_hidden_states_mask is not None:
            raise ValueError("Qwen-Image text masks reach the parallel attention as "
                             "text_lengths, not as a mask")

        def heads(x):
            return x.unflatten(-1, (-1, attn.inner_dim // attn.heads))

        iq, ik, iv = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (heads(f(encoder_hidden_states))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            iq, ik = attn.norm_q(iq), attn.norm_k(ik)
        if attn.norm_added_q is not None:
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            iq = apply_rotary_emb_qwen(iq, img_freqs, use_real=False)
            ik = apply_rotary_emb_qwen(ik, img_freqs, use_real=False)
            if tq.shape[1]:  # PipeFusion's later patches carry no text
                tq = apply_rotary_emb_qwen(tq, txt_freqs, use_real=False)
                tk = apply_rotary_emb_qwen(tk, txt_freqs, use_real=False)
        query, key, value = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
        out = self.attention(query, key, value, plan, ("text", "image"), attn,
                             text_lengths=text_lengths)
        out = out.flatten(2, 3).to(query.dtype)
        text = encoder_hidden_states.shape[1]
        txt, img = out[:, :text], out[:, text:]
        img = attn.to_out[0](img.contiguous())
        if len(attn.to_out) > 1:
            img = attn.to_out[1](img)
        return img, attn.to_add_out(txt.contiguous())


def _wan_cross_with_image(attn, x, context, n_image: int):
    """Wan 2.1 I2V's cross-attention: the queries attend to the text (context after the
    first `n_image` tokens) and, through their own K/V projections, to the image tokens (the
    first `n_image`); the two results are summed before the output projection."""
    def heads(t):  # [B, S, H*D] -> [B, H, S, D]
        return t.unflatten(2, (attn.heads, -1)).transpose(1, 2)

    image, text = context[:, :n_image], context[:, n_image:]
    q = heads(attn.norm_q(attn.to_q(x)))
    out = F.scaled_dot_product_attention(q, heads(attn.norm_k(attn.to_k(text))),
                                         heads(attn.to_v(text)))
    out = out + F.scaled_dot_product_attention(
        q, heads(attn.norm_added_k(attn.add_k_proj(image))), heads(attn.add_v_proj(image)))
    out = out.transpose(1, 2).flatten(2, 3).type_as(q)
    return attn.to_out[1](attn.to_out[0](out))


def _wan_rotary(x, freqs_cos, freqs_sin):
    """Wan's RoPE on interleaved pairs (as WanAttnProcessor applies it), [B, S, H, D]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanShardedAttnProcessor:
    """Wan: the self-attention (`attn1`, over the video tokens, with RoPE) on the local token
    shard through the method's attention; the cross-attention (`attn2`, to the text and, for
    2.1 I2V, the CLIP image tokens) is this rank's queries against every key, which no rank
    splits, so it needs no collective: the stock processor's, except with image tokens,
    whose count comes from the call (`context_image`, SequenceLayout.context_tokens) where
    the stock one assumes 512 text tokens after them (ComfyUI's model reads any text
    length; for 512 the two are the same)."""

    def __init__(self, attention):
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor
        self.attention = attention
        self.cross = WanAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, sp_plan=None, context_image=None):
        if encoder_hidden_states is not None:
            if attn.add_k_proj is not None and context_image is not None:
                return _wan_cross_with_image(attn, hidden_states, encoder_hidden_states,
                                             context_image)
            return self.cross(attn, hidden_states, encoder_hidden_states, attention_mask,
                              rotary_emb)
        plan = _need_plan(sp_plan)
        if attention_mask is not None:
            raise ValueError("attention masks are not supported under sequence parallelism")
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query = attn.to_q(hidden_states)
            key, value = attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)  # RMS norm across the heads
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _wan_rotary(query, *rotary_emb), _wan_rotary(key, *rotary_emb)
        out = self.attention(query, key, value, plan, ("image",), attn)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
