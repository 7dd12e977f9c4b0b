"""SD3/3.5: unpacked latents patchified inside the model, image tokens first, classic CFG."""
from __future__ import annotations

import torch

from .. import families
from ..families.sd3 import DYNAMIC_SHIFT_FALLBACK
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from .base import DiTAdapter, text_encoder_device_of
from .flux import dynamic_shift_args


class SD3ShardedAttnProcessor:
    """SD3/3.5 joint attention (image tokens first, then text) and SD3.5's image-only
    second attention (`attn2`, called without encoder states)."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 sp_plan=None, **kwargs):
        plan = need_plan(sp_plan)
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


def _token_counts(transformer, kw):
    p = transformer.config.patch_size
    h, w = kw["hidden_states"].shape[-2:]
    return {"text": kw["encoder_hidden_states"].shape[1], "image": (h // p) * (w // p)}


class SD3Adapter(DiTAdapter):
    family = families.FAMILIES["sd3"]
    bfl_blocks = None  # its single files are read whole, then converted
    # PatchEmbed crops its positional table by the input size, so split after embedding.
    layout = SequenceLayout(
        split_inputs={},
        split_outputs={"pos_embed": ("image", 1), "context_embedder": ("text", 1)},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        streams=families.FAMILIES["sd3"].tokens,
        attention_processor=SD3ShardedAttnProcessor,
        replaces=("JointAttnProcessor2_0", "AttnProcessor2_0"),
    )

    def latent_rows(self, x, r0, r1, cols):  # [B, 16, h, w], 2x2 latent pixels per token
        return x.narrow(2, 2 * r0, 2 * (r1 - r0))

    def timesteps(self, scheduler, steps, latents, device):
        kwargs = {}
        c = scheduler.config
        if c.get("use_dynamic_shifting"):
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift
            p = 2
            h, w = latents.shape[-2:]
            kwargs["mu"] = calculate_shift((h // p) * (w // p), *dynamic_shift_args(c, DYNAMIC_SHIFT_FALLBACK))
        scheduler.set_timesteps(steps, device=device, **kwargs)
        return scheduler.timesteps

    def encode(self, model, texts, max_sequence_length):
        pe, _, pooled, _ = model.encoder.encode_prompt(
            prompt=list(texts), prompt_2=None, prompt_3=None,
            device=text_encoder_device_of(model),
            num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)
        return {"encoder_hidden_states": pe, "pooled_projections": pooled}

    def conditioning(self, cond, pooled):
        # ComfyUI's SD3 CONDITIONING has diffusers' layout: CLIP-L|G padded, then T5
        return {"encoder_hidden_states": cond, "pooled_projections": pooled}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        b = latents.shape[0]
        return model.transformer(hidden_states=latents, timestep=t.expand(b),
                                 encoder_hidden_states=cond["encoder_hidden_states"],
                                 pooled_projections=cond["pooled_projections"],
                                 joint_attention_kwargs=jak, return_dict=False)[0]

    def forward_extra(self, model, height, width):
        return {}

    @staticmethod
    def bfl_to_diffusers(sd, config):
        from ..loading.single_file import convert_sd3_bfl
        return convert_sd3_bfl(sd)
