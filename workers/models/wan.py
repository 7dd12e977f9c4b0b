"""Wan 2.1 / 2.2 (WanTransformer3DModel): video latents [B, 16, T, h, w] the transformer
patchifies itself (3-D patches (1, 2, 2): tokens in frame, row, column order), UMT5 text
states reached by cross-attention only, UniPC flow steps on fp32 latents (as WanPipeline keeps
them), and for Wan 2.2 A14B two experts: the high-noise transformer for timesteps at or above
the folder's boundary (boundary_ratio x 1000), the low-noise `transformer_2` below it, each
with its own guidance scale (`cfg`, `cfg_2`).

Sequence parallelism splits the video tokens: the 3-D patch convolution's output (flattened
to tokens) and the RoPE tables with them; the self-attention runs through the method's
attention, the cross-attention stays local (every rank holds the whole text). Wan's blocks
call their attention without keyword arguments, so the plan reaches the processors by a hook
(`SequenceLayout.plan_by_hook`).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from .. import families
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from .base import DiTAdapter, text_encoder_device_of


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
        plan = need_plan(sp_plan)
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


def _token_counts(transformer, kw):
    _, _, f, h, w = kw["hidden_states"].shape
    pt, ph, pw = transformer.config.patch_size
    return {"image": (f // pt) * (h // ph) * (w // pw),
            "text": kw["encoder_hidden_states"].shape[1]}


def read_index(path: str) -> dict:
    """A folder's model_index.json (a single file: {})."""
    p = os.path.join(path, "model_index.json")
    if not os.path.isfile(p):
        return {}
    with open(p) as f:
        return json.load(f)


# WanImageToVideoPipeline's text length (max_sequence_length 512), which diffusers'
# WanAttnProcessor assumes after the image tokens (Wan 2.1 I2V; the Sampler pads to it)
I2V_TEXT_TOKENS = 512

EXPAND_TIMESTEPS = "this Wan folder sets expand_timesteps: " + families.wan.TI2V_NOT_RUN


class WanAdapter(DiTAdapter):
    family = families.FAMILIES["wan"]
    latents_fp32 = True
    encoder_skips = ("transformer_2",)  # rank 0's prompt (and image) encoder holds no expert
    layout = SequenceLayout(
        split_inputs={},
        split_outputs={"patch_embedding": ("image", 2, "flatten"),
                       "rope": (("image", 1), ("image", 1))},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        streams=families.FAMILIES["wan"].tokens,
        attention_processor=WanShardedAttnProcessor,
        replaces=("WanAttnProcessor",),
        kwargs_name="attention_kwargs",
        plan_by_hook=True,
        context_tokens={"encoder_hidden_states_image": "context_image"},
    )

    def load(self, path, device, dtype, with_text_encoders, stage=None, weights="auto",
             text_encoders="auto", shard=None, path_2=None):
        """`path_2`: Wan 2.2 A14B from two single files, `path` the high-noise expert's file
        and this the low-noise one's (the host checked them: model_info.read_pair)."""
        index = read_index(path) if os.path.isdir(path) else {}
        if index.get("expand_timesteps"):
            raise ValueError(EXPAND_TIMESTEPS)
        model = super().load(path, device, dtype, with_text_encoders, stage=stage,
                             weights=weights, text_encoders=text_encoders, shard=shard)
        model.index = index
        if path_2 is not None:
            model.transformer_2 = self.load_expert_file(model, path_2, device, dtype,
                                                        weights, shard, stage)
            return model
        if index.get("transformer_2") and index["transformer_2"][0] is not None:
            if stage is not None:  # PipeFusion: this stage's blocks of the second expert
                import diffusers

                from ..loading.stages import load_stage_transformer
                tr, _, _ = load_stage_transformer(
                    getattr(diffusers, self.transformer_class),
                    os.path.join(path, "transformer_2"), self.block_lists, *stage,
                    device=device, dtype=dtype, weights=weights)
                tr.rope.to(device)
                model.transformer_2 = tr
            elif shard is not None:  # sharded as the first expert, shard-only reads
                from ..loading.shards import load_shards
                tr, _ = load_shards(self, path, device, dtype, weights, shard,
                                    subfolder="transformer_2")
                tr.rope.to(device)
                model.transformer_2 = tr
            else:
                model.transformer_2 = self.load_expert(path, "transformer_2", device, dtype,
                                                       weights)
        return model

    def load_expert_file(self, model, path_2, device, dtype, weights, shard, stage=None):
        """The low-noise expert from its single file (whole, or this rank's rows under weight
        sharding); a file carries no boundary, so the released one for this transformer
        config is set as the folder's model_index.json would (`experts_per_step` reads it)."""
        ratio = self.family.capability(families.TwoExperts).boundary(dict(model.transformer.config))
        if ratio is None:
            raise ValueError("no two-expert Wan model was released with this transformer "
                             "(Wan 2.1 image-to-video); run one file alone")
        if shard is not None:
            from ..loading.shards import load_shards
            tr, _ = load_shards(self, path_2, device, dtype, weights, shard)
        else:
            from ..loading.single_file import load_single_file
            tr = load_single_file(self, path_2, device, dtype, stage=stage,
                                  weights=weights).transformer  # PipeFusion: its stage
        mine = {k: v for k, v in tr.config.items() if not k.startswith("_")}
        if mine != {k: v for k, v in model.transformer.config.items() if not k.startswith("_")}:
            raise ValueError(f"{path_2}: its transformer config differs from {model.path}'s; "
                             f"give the two expert files of one Wan 2.2 A14B model")
        tr.rope.to(device)
        model.index = {"boundary_ratio": ratio}
        return tr

    def load_expert(self, path, subfolder, device, dtype, weights):
        """Another transformer of the folder (Wan 2.2's low-noise expert), loaded as the
        first one is: from its config on the meta device, tensor by tensor to `device`."""
        import diffusers

        from ..loading.weights import has_safetensors, load_folder
        from ..loading.meta import meta_transformer
        tcls = getattr(diffusers, self.transformer_class)
        folder = os.path.join(path, subfolder)
        if not has_safetensors(folder):
            tr = tcls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
            return tr.to(device).eval().requires_grad_(False)
        tr = meta_transformer(tcls, folder)
        load_folder(tr, self.block_lists, folder, device, dtype, weights)
        tr.rope.to(device)
        return tr

    @staticmethod
    def computed_buffers(transformer) -> None:
        """WanRotaryPosEmbed's cos / sin tables (non-persistent buffers, in no checkpoint):
        a meta-built model's rope module made again on the CPU as __init__ makes it (fp32;
        `assemble` moves it to the device)."""
        rope = transformer.rope
        # always made again: also called after FSDP's `to_empty` (workers/loading/shards.py),
        # which leaves these buffers allocated but uninitialised (not on the meta device)
        with torch.device("cpu"):
            transformer.rope = type(rope)(rope.attention_head_dim, rope.patch_size,
                                          rope.max_seq_len)

    def assemble(self, path, transformer, report, device, dtype, *args, **kw):
        transformer.rope.to(device)  # once, not per forward
        return super().assemble(path, transformer, report, device, dtype, *args, **kw)

    def pack(self, x):
        return x

    def unpack(self, x, height, width):
        return x

    def token_grid(self, height, width, frames=1):
        """Tokens run frame by frame, each frame height/16 rows of width/16: the token rows
        of the whole video are its frames' rows one after the other."""
        return self.family.latent.latent_frames(frames) * (height // 16), width // 16

    def latent_rows(self, x, r0, r1, cols):
        """Token rows r0..r1 of a latent [B, C, T, h, w] (PipeFusion's patches): with frame
        and latent row merged ([B, C, T * h, w], a view of the contiguous latent) token row
        r is merged rows 2r, 2r + 1 whatever its frame, so a band crossing a frame boundary
        is still one view. A tensor of merged rows already ([B, C, rows, w], such a band)
        is narrowed as it is (rows relative to it)."""
        if x.dim() == 5:
            x = x.flatten(2, 3)
        return x.narrow(2, 2 * r0, 2 * (r1 - r0))

    def timesteps(self, scheduler, steps, latents, device):
        # set on the CPU (its timesteps stay there: the expert choice reads them, no device
        # read), then the copy the loop uses goes to the device
        scheduler.set_timesteps(steps)
        return scheduler.timesteps.to(device)

    def experts_per_step(self, model, scheduler, steps):
        if model.transformer_2 is None:
            return [0] * steps
        ratio = (model.index or {}).get("boundary_ratio")
        if ratio is None:
            raise ValueError("this Wan folder has a transformer_2 but no boundary_ratio in "
                             "model_index.json (which step switches experts)")
        boundary = float(ratio) * int(scheduler.config.num_train_timesteps)
        return [0 if float(t) >= boundary else 1 for t in scheduler.timesteps.tolist()]

    def encode(self, model, texts, max_sequence_length):
        pe, _ = model.encoder.encode_prompt(
            prompt=list(texts), do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=max_sequence_length, device=text_encoder_device_of(model))
        return {"encoder_hidden_states": pe}

    def conditioning(self, cond, pooled):
        return {"encoder_hidden_states": cond}

    def forward_extra(self, model, height, width):
        return {}

    def transformer_for(self, model, extra):
        return model.transformer_2 if (extra or {}).get("expert") == 1 else model.transformer

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        tr = self.transformer_for(model, extra)
        b = latents.shape[0]
        x = latents.to(model.dtype)
        # image-to-video: the start frame's condition [1 or B, 20, T, h, w] joins the noise
        # along channels before the patch embedding, so the sequence split splits it with
        # the tokens
        video = (extra or {}).get("ref_tokens")
        if video is not None:
            x = torch.cat([x, video.expand(b, -1, -1, -1, -1)], 1)
        text, image = cond["encoder_hidden_states"], cond.get("image_embeds")
        if image is not None:  # Wan 2.1 I2V: CLIP image states for the image K/V
            image = image.expand(b, -1, -1)
        return tr(hidden_states=x, timestep=t.expand(b), encoder_hidden_states=text,
                  encoder_hidden_states_image=image,
                  attention_kwargs=dict(jak or {}), return_dict=False)[0]

    # ---- image-to-video (WanImageToVideoPipeline; ComfyUI's WanImageToVideo) -----------
    @staticmethod
    def slice_cond(cond: dict, sl: slice) -> dict:
        out = DiTAdapter.slice_cond(cond, sl)
        image = cond.get("image_embeds")  # one per video, or one shared [1, N, D]
        if image is not None and image.shape[0] > 1:
            out["image_embeds"] = image[sl]
        return out

    def job_cond(self, cond: dict) -> dict:
        """A Sampler job's branch: Wan 2.1 I2V's text padded with zeros to the 512 tokens
        WanImageToVideoPipeline always gives (its prompts padded to max_sequence_length 512),
        once per job. The MODEL path takes ComfyUI's text as it comes (the cross-attention
        reads any length after the image tokens)."""
        text = cond.get("encoder_hidden_states")
        if cond.get("image_embeds") is None or text is None or text.shape[1] >= I2V_TEXT_TOKENS:
            return cond
        pad = text.new_zeros(text.shape[0], I2V_TEXT_TOKENS - text.shape[1], text.shape[2])
        return dict(cond, encoder_hidden_states=torch.cat([text, pad], 1))

    def start_condition(self, model, req, images, batch: int):
        """The start frame -> {"references": {"tokens": the condition [1 or B, 20, T, h, w]},
        "cond": {"image_embeds": CLIP states} (Wan 2.1)}: from one image as
        WanImageToVideoPipeline prepares it, or from ComfyUI's concat_latent / concat_mask /
        image_embeds as its WAN21 model builds its inputs (`start_video`)."""
        from .. import messages
        start, states = self.family.capability(families.ImageToVideo).inputs(
            dict(model.transformer.config))
        got = self.start_frame_inputs(req, images, start)
        if got is None:
            return None
        h, w, frames, image = got
        name = self.family.name
        if image is not None:
            raw, mask, image = self.encode_start_image(model, image, h, w, frames, states)
        else:
            raw, mask, image = req.concat_latent, req.concat_mask, req.image_embeds
            if states and image is None:
                raise ValueError(messages.NEEDS_IMAGE_EMBEDS.format(name=name))
        out = {"references": {"tokens": self.start_video(model, raw, mask, h, w, frames)},
               "cond": {}}
        if states:
            out["cond"]["image_embeds"] = torch.as_tensor(image).detach().float().cpu()
        return out

    def encode_start_image(self, model, image, height, width, frames, states) -> tuple:
        """One start image (PIL) -> (the raw VAE latent [1, 16, T, h, w] of the video the
        pipeline encodes: the image resized to height x width by its VideoProcessor, then
        frames - 1 black frames (0 in -1..1); the mask in ComfyUI's convention, 0 on the first
        latent frame; the CLIP image states (the pipeline's encode_image: the image
        encoder's penultimate hidden states) or None)."""
        from diffusers.video_processor import VideoProcessor

        from .base import vae_mode
        spatial = int(model.vae_config.get("scale_factor_spatial", 8))
        temporal = int(model.vae_config.get("scale_factor_temporal", 4))
        pixels = VideoProcessor(vae_scale_factor=spatial).preprocess(
            image, height=height, width=width).float()  # [1, 3, H, W]
        video = torch.cat([pixels.unsqueeze(2),
                           pixels.new_zeros(1, 3, frames - 1, height, width)], 2)
        raw = vae_mode(model, video)
        mask = torch.ones(1, 1, (frames - 1) // temporal + 1, height // spatial,
                          width // spatial)
        mask[:, :, 0] = 0.0
        image_states = None
        if states:
            if model.encoder is None or getattr(model.encoder, "image_encoder", None) is None:
                raise ValueError("this Wan 2.1 image-to-video folder has no image_encoder to "
                                 "read the start image with")
            image_states = model.encoder.encode_image(
                image, text_encoder_device_of(model)).float().cpu()
        return raw, mask, image_states

    def start_video(self, model, raw, mask, height, width, frames):
        """ComfyUI's start-frame values -> the 20 channels the I2V transformer takes after the
        noise's, as ComfyUI's WAN21.concat_cond builds them (and WanImageToVideoPipeline's
        prepare_latents for one start image): cat([mask, image], channels), image = the raw
        latent normalised per channel ((raw - mean) / std), mask = 1 - concat_mask (its mean
        over channels unless it has 4; frames after its own padded with 0; 1 channel repeated
        to 4; none: all 0). fp32 CPU, batch 1 or B."""
        t = (frames - 1) // int(model.vae_config.get("scale_factor_temporal", 4)) + 1
        spatial = int(model.vae_config.get("scale_factor_spatial", 8))
        h, w = height // spatial, width // spatial
        raw = torch.as_tensor(raw).detach().float().cpu()
        channels = int(model.transformer.config.in_channels) - \
            int(model.transformer.config.out_channels) - 4
        if raw.dim() != 5 or tuple(raw.shape[1:]) != (channels, t, h, w):
            raise ValueError(f"concat_latent must be [1 or batch, {channels}, {t}, {h}, {w}] "
                             f"(got {tuple(raw.shape)})")
        scale, shift = self.scale_shift(model)
        per = (lambda v: torch.as_tensor(v, dtype=torch.float32).view(1, -1, 1, 1, 1))
        image = (raw - per(shift)) * per(scale)
        if mask is None:
            m = torch.zeros(1, 4, t, h, w)
        else:
            m = torch.as_tensor(mask).detach().float().cpu()
            if m.dim() != 5 or m.shape[1] not in (1, 4) or m.shape[2] > t \
                    or tuple(m.shape[3:]) != (h, w):
                raise ValueError(f"concat_mask must be [1 or batch, 1 or 4, <= {t}, {h}, {w}] "
                                 f"(got {tuple(m.shape)})")
            m = 1.0 - m
            m = torch.nn.functional.pad(m, (0, 0, 0, 0, 0, t - m.shape[2]))
            m = m.expand(-1, 4, -1, -1, -1)
        b = max(image.shape[0], m.shape[0])
        return torch.cat([m.expand(b, -1, -1, -1, -1), image.expand(b, -1, -1, -1, -1)],
                         1).contiguous()

    @staticmethod
    def bfl_to_diffusers(sd, config):
        """ComfyUI's / the original Wan names -> WanTransformer3DModel's, key by key (so a
        PipeFusion stage reads only its blocks). Pure renames: the per-block `modulation`
        [1, 6, dim] and the head's [1, 2, dim] are diffusers' scale_shift_tables in the same
        order (shift, scale, gate, ...; the head's shift, scale); ComfyUI's `norm3` (the
        cross-attention norm, with weights) is diffusers' `norm2`. A key without a rule
        raises (a silently dropped tensor would load as garbage)."""
        return convert_wan_original(sd)


# ---- ComfyUI's / the original Wan naming -> diffusers' --------------------------------------
_WAN_TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    # Wan 2.1 I2V / FLF2V: the CLIP image tokens' projection
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
    "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed",
}
_WAN_BLOCK = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm3": "norm2",  # the cross-attention's (affine) norm
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
    "modulation": "scale_shift_table",
}


def _wan_rename(name: str, table: dict):
    for src, dst in table.items():
        if name == src:
            return dst
        if name.startswith(src + ".") and name[len(src) + 1:] in ("weight", "bias"):
            return dst + name[len(src):]
    return None


def convert_wan_original(sd: dict) -> dict:
    """A Wan transformer's tensors in ComfyUI / original naming -> diffusers names."""
    out, unknown = {}, []
    for name, w in sd.items():
        parts = name.split(".", 2)
        if parts[0] == "blocks" and len(parts) == 3:
            new = _wan_rename(parts[2], _WAN_BLOCK)
            new = None if new is None else f"blocks.{parts[1]}.{new}"
        else:
            new = _wan_rename(name, _WAN_TOP)
        if new is None:
            unknown.append(name)
        else:
            out[new] = w
    if unknown:
        raise ValueError(f"{len(unknown)} tensor(s) with no Wan rule, e.g. {unknown[:3]}")
    return out
