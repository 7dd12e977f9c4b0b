"""HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel): video latents [B, 32, T, h, w], one
token per latent pixel (frame, row, column order), the noise joined by a start-frame latent
and its mask along channels (65 input channels; zeros in text-to-video), dual-stream blocks
whose joint attention covers [video, context].

The context. diffusers' forward builds, per row, [valid image tokens, valid ByT5 tokens,
valid Qwen tokens, then the invalid ones], with a symmetric mask: an invalid token is no key
for anyone and its own query sees no key, so the invalid tokens change no valid one and can
be dropped, which the pool does before anything runs (text-to-video's 729 zero image slots
are invalid: dropped too). What remains is exact for every valid token: the Qwen refiner on
each row's valid tokens alone (its masked mean is their mean; its masked attention, theirs),
the ByT5 projection and the image projection per token, each part plus its cond-type
embedding. Rows of one call whose contexts differ in length are padded to the longest with
zeros, their real lengths travelling as `text_lengths` (host numbers, as Qwen-Image's): the
attention drops each row's padded keys, and a padded query row (whose own output is thrown
away) still attends to real keys, so no row is ever all-masked and no NaN can arise.

diffusers' forward reads the masks on the host (boolean indexing per row, a test of the image
states for zeros), so it is replaced by `split_forward`, which runs the transformer's own
modules on the compacted context (installed as the transformer's forward at load, so the
sequence-parallel hooks, the step cache's gates, weight sharding, LoRA and compile see the
usual module tree; its blocks return (context, video) as the pack's other joint blocks do:
`text_first_outputs`). Under sequence parallelism both streams are split once, after the
context is built: the video tokens and their RoPE table (image stream), the context (text
stream); the blocks run on the shards, the joint attention over every rank's keys (its result
does not depend on the order of the keys), the output projection's tokens are gathered.
"""
from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from typing import Optional

import torch

from .. import families
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from .base import DiTAdapter, text_encoder_device_of
from .hunyuan_video15_vae import band_scheme, frame_attention

# the cond's keys: Qwen states and ByT5 states ([B or 1, L, D], each row's valid tokens
# first), the rows' valid counts (masks [B, L] made by `encode`, host tuples once sliced),
# the image-to-video SigLIP states ([1 or B, N, D], all valid)
QWEN, QWEN_MASK, QWEN_LENGTHS = "encoder_hidden_states", "text_mask", "text_lengths"
BYT5, BYT5_MASK, BYT5_LENGTHS = "encoder_hidden_states_2", "text_mask_2", "text_lengths_2"
IMAGE = "image_embeds"
_MASKS = {QWEN_MASK: QWEN_LENGTHS, BYT5_MASK: BYT5_LENGTHS}

TOO_LONG = ("the prompt fills all {n} {what} tokens {pipe} reads, so the pipeline would cut "
            "it: shorten it")


@dataclass(frozen=True)
class Attend:
    """What a dual-stream block's attention covers, handed to the blocks as their attention
    mask (the stock blocks pass it on to the processor untouched): the forward's sequence
    plan and each row's real context length (None: every row fills the context)."""
    plan: object
    text_lengths: Optional[tuple] = None


class HunyuanVideo15ShardedAttnProcessor:
    """The dual-stream joint attention on the local shards: the video tokens' q/k/v (per-head
    RMS norms, RoPE), the context's own q/k/v (its norms, no RoPE), attention over every
    rank's video and context keys through the method's attention, each stream's output
    projection. The text refiner's self-attention (the same processor slot of its blocks,
    called without a context) runs whole on every rank, as the stock processor does."""

    def __init__(self, attention):
        from diffusers.models.attention_processor import AttnProcessor2_0
        self.attention = attention
        self.refiner = AttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if not isinstance(attention_mask, Attend):
            if encoder_hidden_states is None:  # the text refiner's, on one row's tokens
                return self.refiner(attn, hidden_states, None, attention_mask)
            raise RuntimeError("HunyuanVideo 1.5's sharded attention needs the pool's forward "
                               "(workers/models/hunyuan_video15.split_forward)")
        plan = need_plan(attention_mask.plan)

        def heads(x):
            return x.unflatten(2, (attn.heads, -1))

        q, k, v = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        tq, tk, tv = (heads(f(encoder_hidden_states))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            tq = attn.norm_added_q(tq)
        if attn.norm_added_k is not None:
            tk = attn.norm_added_k(tk)
        local = q.shape[1]
        q, k, v = (torch.cat(p, dim=1) for p in ((q, tq), (k, tk), (v, tv)))
        out = self.attention(q, k, v, plan, ("image", "text"), attn,
                             text_lengths=attention_mask.text_lengths)
        out = out.flatten(2, 3).to(q.dtype)
        img = attn.to_out[1](attn.to_out[0](out[:, :local].contiguous()))
        return img, attn.to_add_out(out[:, local:].contiguous())


def _rows(lengths, b: int, full: int) -> tuple:
    """Each of `b` rows' valid count: `lengths` (one per row, or one for all), else `full`."""
    if lengths is None:
        return (int(full),) * b
    lengths = tuple(int(n) for n in lengths)
    return lengths * b if len(lengths) == 1 else lengths


def context_lengths(b: int, kw: dict) -> tuple:
    """Each row's context: its valid image, ByT5 and Qwen tokens (forward keywords)."""
    image = kw.get(IMAGE)
    n_image = 0 if image is None else int(image.shape[1])
    byt5 = kw.get(BYT5)
    n_byt5 = _rows(kw.get(BYT5_LENGTHS), b, 0 if byt5 is None else byt5.shape[1])
    n_qwen = _rows(kw.get(QWEN_LENGTHS), b, kw[QWEN].shape[1])
    return tuple(n_image + a + c for a, c in zip(n_byt5, n_qwen))


def _rowwise(x, b: int):
    """A [1 or b, ...] tensor as b rows."""
    return x if x.shape[0] == b else x.expand(b, *x.shape[1:])


def split_forward(self, hidden_states, timestep, encoder_hidden_states, text_lengths=None,
                  encoder_hidden_states_2=None, text_lengths_2=None, image_embeds=None,
                  attention_kwargs=None, return_dict=False):
    """The HunyuanVideo 1.5 transformer on the compacted context (module doc), bound as the
    transformer's forward. hidden_states [B, 65, T, h, w]; timestep [B]; Qwen states
    [B or 1, Lq, D] with each row's valid count (`text_lengths`, host numbers; None: all
    valid); ByT5 states [B or 1, Lb, D2] likewise (None or Lb 0: no quoted text); SigLIP
    states [1 or B, N, D3] (image-to-video; None: text-to-video). Returns ([B, 32, T, h, w],)."""
    plan = (attention_kwargs or {}).get("sp_plan")
    b, _, frames, h, w = hidden_states.shape
    dtype = hidden_states.dtype
    emb = self.cond_type_embed.weight  # cond types: 0 Qwen, 1 ByT5, 2 image
    temb = self.time_embed(timestep)
    rope = self.rope(hidden_states)
    x = self.x_embedder(hidden_states)

    # the context, valid tokens only: [image, ByT5, Qwen] per row, rows padded to the longest
    qwen = _rowwise(encoder_hidden_states, b)
    n_qwen = _rows(text_lengths, b, qwen.shape[1])
    if len(set(n_qwen)) == 1:  # the refiner on the rows' valid tokens (mask-free)
        qwen = self.context_embedder(qwen[:, :n_qwen[0]], timestep, None)
        qwen = [qwen[i] for i in range(b)]
    else:
        qwen = [self.context_embedder(qwen[i:i + 1, :n], timestep[i:i + 1], None)[0]
                for i, n in enumerate(n_qwen)]
    parts = [[] for _ in range(b)]
    if image_embeds is not None:
        image = self.image_embedder(_rowwise(image_embeds, b)) + emb[2]
        for i in range(b):
            parts[i].append(image[i])
    if encoder_hidden_states_2 is not None and encoder_hidden_states_2.shape[1]:
        byt5 = _rowwise(encoder_hidden_states_2, b)
        n_byt5 = _rows(text_lengths_2, b, byt5.shape[1])
        byt5 = self.context_embedder_2(byt5[:, :max(n_byt5)]) + emb[1]
        for i, n in enumerate(n_byt5):
            parts[i].append(byt5[i, :n])
    for i in range(b):
        parts[i].append(qwen[i] + emb[0])
    rows = [torch.cat(p) for p in parts]
    lengths = tuple(r.shape[0] for r in rows)
    longest = max(lengths)
    context = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])])
                           if r.shape[0] < longest else r for r in rows]).to(dtype)
    real = None if len(set(lengths)) == 1 else lengths

    if plan is not None:  # this rank's tokens of each stream
        x, context = plan.shard(x, 1, "image"), plan.shard(context, 1, "text")
        rope = tuple(plan.shard(f, 0, "image") for f in rope)
    attend = Attend(plan, real)
    for block in self.transformer_blocks:  # (context, video) out: `text_first_outputs`
        context, x = block(hidden_states=x, encoder_hidden_states=context, temb=temb,
                           attention_mask=attend, freqs_cis=rope)
    x = self.proj_out(self.norm_out(x, temb))  # gathered by the layout's hook
    out = x.reshape(b, frames, h, w, -1).permute(0, 4, 1, 2, 3)
    return (out,)


def _text_first_forward(self, hidden_states, encoder_hidden_states, temb,
                        attention_mask=None, freqs_cis=None):
    """A dual-stream block's stock forward, its outputs as (context, video): the order every
    other joint block of the pack returns (FLUX's, SD3's, Qwen-Image's), which the step
    cache's segments read (workers/sampling/step_cache.py)."""
    hidden, context = type(self).forward(self, hidden_states, encoder_hidden_states, temb,
                                         attention_mask, freqs_cis)
    return context, hidden


def text_first_outputs(transformer) -> None:
    """Every dual-stream block of `transformer` returns (context, video) (its instance's
    forward: `_text_first_forward`); idempotent."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import \
        HunyuanVideo15TransformerBlock
    for block in transformer.transformer_blocks:  # not PipeFusion's stand-ins for others'
        if isinstance(block, HunyuanVideo15TransformerBlock) and "forward" not in block.__dict__:
            block.forward = types.MethodType(_text_first_forward, block)


def _token_counts(transformer, kw):
    """The context's tokens (the longest row's valid context) and the video's of a call."""
    hs = kw["hidden_states"]
    return {"text": max(context_lengths(hs.shape[0], kw)),
            "image": hs.shape[2] * hs.shape[3] * hs.shape[4]}


def _encoder_vae(path: str):
    """The folder's VAE built on the meta device (no weights read): what the pipeline's
    constructor reads of it (its compression ratios and latent channels) to make the
    prompt-encoding pipeline without loading the VAE itself."""
    import diffusers

    with open(os.path.join(path, "vae", "config.json")) as f:
        config = json.load(f)
    with torch.device("meta"):
        return getattr(diffusers, config["_class_name"]).from_config(config)


class HunyuanVideo15Adapter(DiTAdapter):
    family = families.FAMILIES["hunyuan_video15"]
    # ComfyUI's name of each diffusers block list (its files convert key by key)
    # diffusers gives HunyuanVideo 1.5's pipelines no LoRA loader; HunyuanVideo's reads
    # diffusers / PEFT files as they are and loads them into any PEFT-ready transformer
    lora_pipeline = "HunyuanVideoPipeline"
    layout = SequenceLayout(
        split_inputs={},  # split_forward shards both streams itself, once compacted
        split_outputs={},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        streams=families.FAMILIES["hunyuan_video15"].tokens,
        attention_processor=HunyuanVideo15ShardedAttnProcessor,
        replaces=("HunyuanVideo15AttnProcessor2_0", "AttnProcessor2_0"),
        kwargs_name="attention_kwargs",
    )

    def assemble(self, path, transformer, report, device, dtype, with_text_encoders,
                 text_encoders="auto", stage_info=None):
        """The transformer with `split_forward`; rank 0's prompt encoder is the folder's
        pipeline without its transformer and with a weightless VAE (the constructor reads
        the VAE's ratios; the VAE itself is loaded only to decode or encode a start image)."""
        import diffusers

        family = self.family
        family.detection.check_config(family.full_config(transformer.config))
        transformer.forward = types.MethodType(split_forward, transformer)
        text_first_outputs(transformer)
        model = super().assemble(path, transformer, report, device, dtype, False,
                                 text_encoders, stage_info)
        if with_text_encoders and os.path.isdir(path):
            te_device = self._text_encoder_device(path, device, dtype, text_encoders)
            encoder = getattr(diffusers, self.pipeline_class).from_pretrained(
                path, torch_dtype=dtype, transformer=None, vae=_encoder_vae(path))
            encoder.vae = None
            model.encoder = encoder.to(te_device)
            model.load_report = dict(model.load_report, text_encoders=te_device)
        return model

    def latent_rows(self, x, r0, r1, cols):
        """Token rows r0..r1 of a latent [B, C, T, h, w] (one token per latent pixel): with
        frame and row merged, token row r is merged row r."""
        if x.dim() == 5:
            x = x.flatten(2, 3)
        return x.narrow(2, r0, r1 - r0)

    def token_grid(self, height, width, frames=1):
        """Tokens run frame by frame, each frame height/16 rows of width/16."""
        return self.family.latent.latent_frames(frames) * (height // 16), width // 16

    def context_tokens(self, cond):
        b = cond[QWEN].shape[0]
        return {"text": max(context_lengths(b, {k: v for k, v in cond.items()}))}

    def timesteps(self, scheduler, steps, latents, device):
        """HunyuanVideo15Pipeline's: sigmas 1 .. 1/steps (linspace(1, 0, steps + 1) but the
        last) through the scheduler's shift."""
        import numpy as np
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=device)
        scheduler.set_begin_index(0)
        return scheduler.timesteps

    # ---- text -------------------------------------------------------------------------
    def encode(self, model, texts, max_sequence_length):
        """The pipeline's prompt states (Qwen2.5-VL's, after its 108 template tokens; ByT5's
        of the quoted text), each cut to the batch's longest valid row, with the rows' masks.
        The pipeline pads and cuts Qwen at 1000 tokens and ByT5 at 256 whatever
        `max_sequence_length` says; a prompt that fills them would be cut: refused."""
        pipe = model.encoder
        qwen, qmask, byt5, bmask = pipe.encode_prompt(
            prompt=list(texts), device=text_encoder_device_of(model), batch_size=len(texts))
        qmask, bmask = qmask.bool().cpu(), bmask.bool().cpu()
        name = type(pipe).__name__
        if bool(qmask.all(1).any()):
            raise ValueError(TOO_LONG.format(n=qmask.shape[1], what="Qwen", pipe=name))
        if bool(bmask.all(1).any()):
            raise ValueError(TOO_LONG.format(n=bmask.shape[1], what="ByT5 (quoted text)",
                                             pipe=name))
        nq, nb = int(qmask.sum(1).max()), int(bmask.sum(1).max())
        return {QWEN: qwen[:, :nq], QWEN_MASK: qmask[:, :nq],
                BYT5: byt5[:, :nb], BYT5_MASK: bmask[:, :nb]}

    def conditioning(self, cond, pooled, context_2=None):
        """ComfyUI's CONDITIONING: the Qwen states (its own template cut, unpadded) and, where
        the prompt quotes text, the ByT5 states (`txt_byt5`); no pooled output is read."""
        out = {QWEN: cond}
        if context_2 is not None:
            out[BYT5] = context_2
        return out

    @staticmethod
    def slice_cond(cond: dict, sl: slice) -> dict:
        """A batch slice: states and masks of B rows sliced (one row stays, shared); the
        masks become the rows' valid counts, host numbers read once per job."""
        out = {}
        for k, v in cond.items():
            if not torch.is_tensor(v):
                out[k] = v
                continue
            if v.shape[0] > 1:
                v = v[sl]
            if k in _MASKS:
                out[_MASKS[k]] = tuple(int(n) for n in v.sum(1).tolist())
            else:
                out[k] = v
        return out

    def forward_extra(self, model, height, width):
        return {}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        """The noise joined by the start frame's latent and mask ([1 or B, 33, T, h, w],
        image-to-video) or by zeros (text-to-video), as the pipelines join them."""
        b = latents.shape[0]
        x = latents.to(model.dtype)
        start = (extra or {}).get("ref_tokens")
        if x.shape[1] == int(model.transformer.config.in_channels):
            pass  # ComfyUI's model call: its concat_cond channels joined already
        elif start is None:
            x = torch.cat([x, x.new_zeros(b, x.shape[1] + 1, *x.shape[2:])], 1)
        else:
            x = torch.cat([x, start.to(x.dtype).expand(b, -1, -1, -1, -1)], 1)
        return model.transformer(
            hidden_states=x, timestep=t.expand(b).to(x.dtype),
            encoder_hidden_states=cond[QWEN], text_lengths=cond.get(QWEN_LENGTHS),
            encoder_hidden_states_2=cond.get(BYT5), text_lengths_2=cond.get(BYT5_LENGTHS),
            image_embeds=cond.get(IMAGE), attention_kwargs=dict(jak or {}),
            return_dict=False)[0]

    # ---- image-to-video (HunyuanVideo15ImageToVideoPipeline; ComfyUI's
    # HunyuanVideo15ImageToVideo) ------------------------------------------------------------
    def start_condition(self, model, req, images, batch: int):
        """The start frame -> {"references": {"tokens": [1 or B, 33, T, h, w]: the start-frame
        latent (model space) then its mask, which every step joins to the noise}, "cond":
        {"image_embeds": SigLIP states} where there are any}: from one image as
        HunyuanVideo15ImageToVideoPipeline prepares it, or from ComfyUI's concat_latent /
        concat_mask / image_embeds as its HunyuanVideo15 model builds them (`start_video`)."""
        family = self.family
        start, _ = family.capability(families.ImageToVideo).inputs(
            family.full_config(model.transformer.config))
        got = self.start_frame_inputs(req, images, start)
        if got is None:
            return None
        h, w, frames, image = got
        if image is not None:
            raw, mask, states = self.encode_start_image(model, image, h, w, frames)
        else:
            raw, mask, states = req.concat_latent, req.concat_mask, req.image_embeds
        out = {"references": {"tokens": self.start_video(model, raw, mask, h, w, frames)},
               "cond": {}}
        if states is not None:
            out["cond"][IMAGE] = torch.as_tensor(states).detach().float().cpu()
        return out

    def encode_start_image(self, model, image, height, width, frames) -> tuple:
        """One start image (PIL) -> (the raw VAE latent of the video the pipeline conditions
        on [1, 32, T, h, w]: the image cropped to height x width and encoded (the
        distribution's mode) as its first latent frame, zeros after; the mask in ComfyUI's
        convention, 0 on that frame; the SigLIP states of the cropped image), as
        HunyuanVideo15ImageToVideoPipeline makes them for a video of that size (the pipeline
        picks the size from the image's aspect ratio and its target_size; the pool takes the
        request's)."""
        from .base import vae_mode
        pipe = model.encoder
        if pipe is None or getattr(pipe, "image_encoder", None) is None:
            raise ValueError("this HunyuanVideo 1.5 folder has no image_encoder to read the "
                             "start image with (an image-to-video folder has one)")
        proc = pipe.video_processor
        image = proc.resize(image, height=height, width=width, resize_mode="crop")
        first = vae_mode(model, proc.preprocess(image, height=height, width=width).unsqueeze(2))
        t = self.family.latent.latent_frames(frames)
        raw = torch.cat([first, first.new_zeros(1, first.shape[1], t - 1, *first.shape[3:])], 2)
        mask = torch.ones(1, 1, t, *first.shape[3:])
        mask[:, :, 0] = 0.0
        states = pipe.encode_image(image=image, batch_size=1,
                                   device=text_encoder_device_of(model),
                                   dtype=pipe.image_encoder.dtype)
        return raw, mask, states.float().cpu()

    def start_video(self, model, raw, mask, height, width, frames):
        """ComfyUI's start-frame values -> the 33 channels the transformer takes after the
        noise's, as ComfyUI's HunyuanVideo15.concat_cond builds them (and the pipeline's
        prepare_cond_latents_and_mask for one start image): cat([latent, mask], channels),
        latent = the raw latent in model space (x scaling factor), mask = 1 - concat_mask
        (frames after its own padded with 0; none: all 0). fp32 CPU, batch 1 or B."""
        spec = self.family.latent
        t = spec.latent_frames(frames)
        h, w = height // spec.downscale, width // spec.downscale
        raw = torch.as_tensor(raw).detach().float().cpu()
        if raw.dim() != 5 or tuple(raw.shape[1:]) != (spec.channels, t, h, w):
            raise ValueError(f"concat_latent must be [1 or batch, {spec.channels}, {t}, {h}, "
                             f"{w}] (got {tuple(raw.shape)})")
        scale, shift = self.scale_shift(model)
        latent = (raw - float(shift)) * float(scale)
        if mask is None:
            m = torch.zeros(1, 1, t, h, w)
        else:
            m = torch.as_tensor(mask).detach().float().cpu()
            if m.dim() != 5 or m.shape[1] != 1 or m.shape[2] > t or tuple(m.shape[3:]) != (h, w):
                raise ValueError(f"concat_mask must be [1 or batch, 1, <= {t}, {h}, {w}] "
                                 f"(got {tuple(m.shape)})")
            m = torch.nn.functional.pad(1.0 - m, (0, 0, 0, 0, 0, t - m.shape[2]))
        b = max(latent.shape[0], m.shape[0])
        return torch.cat([latent.expand(b, -1, -1, -1, -1), m.expand(b, -1, -1, -1, -1)],
                         1).contiguous()

    # ---- decoding ---------------------------------------------------------------------
    def decode_video(self, model, raw, group=None, control=None, weights=()):
        """The VAE's decode of raw latents [B, 32, T, h, w] -> [B, 3, frames, H, W] in -1..1;
        under a group in row bands over its ranks (`band_scheme`, hunyuan_video15_vae.py; collective:
        the latents are needed on group rank 0 only, the frames come back there and None
        elsewhere)."""
        from .base import load_vae
        if model.vae is None:
            model.vae = load_vae(model)
            # one video per decoder call (the stock mid-block attention broadcasts its mask
            # wrongly for a batch of several, diffusers 0.42.1; here it is replaced, but a
            # video at a time also bounds the decode's memory)
            model.vae.use_slicing = True
        x = None if raw is None else raw.to(model.device, model.vae.dtype)
        if group is None:
            with frame_attention(model.vae):
                return model.vae.decode(x, return_dict=False)[0]
        from ..parallel.vae_parallel import decode_parallel
        return decode_parallel(model.vae, x, group, control=control, scheme=band_scheme(),
                               weights=weights)

    @staticmethod
    def bfl_to_diffusers(sd, config):
        """ComfyUI's HunyuanVideo 1.5 names (comfy/ldm/hunyuan_video) -> diffusers', key by
        key (so a PipeFusion stage reads only its blocks): renames, each fused qkv split in
        three along its rows (dual-stream blocks: the video's to_q/k/v, the context's
        add_q/k/v_proj; the text refiner's to_q/k/v), the final modulation's halves swapped
        (ComfyUI's LastLayer chunks (shift, scale), diffusers' AdaLayerNormContinuous (scale,
        shift)). A key without a rule raises (a silently dropped tensor would load as
        garbage)."""
        return convert_comfy_names(sd)


# ---- ComfyUI's naming -> diffusers' ---------------------------------------------------------
_TOP = {
    "img_in.proj": "x_embedder.proj",
    "time_in.in_layer": "time_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_embed.timestep_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.in_layer": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.out_layer": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.in_layer": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.out_layer": "context_embedder.time_text_embed.text_embedder.linear_2",
    "byt5_in.layernorm": "context_embedder_2.norm",
    "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2",
    "byt5_in.fc3": "context_embedder_2.linear_3",
    "vision_in.proj.0": "image_embedder.norm_in",
    "vision_in.proj.1": "image_embedder.linear_1",
    "vision_in.proj.3": "image_embedder.linear_2",
    "vision_in.proj.4": "image_embedder.norm_out",
    "cond_type_embedding": "cond_type_embed",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",  # halves swapped
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
}
_REFINER = {
    "adaLN_modulation.1": "norm_out.linear", "norm1": "norm1", "norm2": "norm2",
    "self_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "self_attn.proj": "attn.to_out.0", "mlp.0": "ff.net.0.proj", "mlp.2": "ff.net.2",
}
_REFINER_PREFIX = "txt_in.individual_token_refiner.blocks."
_SWAPPED = "final_layer.adaLN_modulation.1"  # (shift, scale) -> (scale, shift)


def _renamed(name: str, table: dict):
    """(the rule's target, the parameter suffix) of `name` under `table`, or None."""
    for src, dst in table.items():
        if name == src:  # a rule naming a whole parameter (norm scales)
            return dst, ""
        if name.startswith(src + ".") and name[len(src) + 1:] in ("weight", "bias"):
            return dst, name[len(src):]
    return None


def convert_comfy_names(sd: dict) -> dict:
    """A HunyuanVideo 1.5 transformer's tensors in ComfyUI's naming -> diffusers names."""
    out, unknown = {}, []
    for name, w in sd.items():
        prefix = ""
        if name.startswith("double_blocks."):
            block, rest = name[len("double_blocks."):].split(".", 1)
            prefix, hit = f"transformer_blocks.{block}.", _renamed(rest, _DOUBLE)
        elif name.startswith(_REFINER_PREFIX):
            block, rest = name[len(_REFINER_PREFIX):].split(".", 1)
            prefix = f"context_embedder.token_refiner.refiner_blocks.{block}."
            hit = _renamed(rest, _REFINER)
        else:
            hit = _renamed(name, _TOP)
        if hit is None:
            unknown.append(name)
            continue
        dst, suffix = hit
        if isinstance(dst, tuple):  # a fused qkv: three equal row blocks
            for part, t in zip(dst, w.chunk(3, dim=0)):
                out[prefix + part + suffix] = t
        elif name.startswith(_SWAPPED + "."):
            shift, scale = w.chunk(2, dim=0)
            out[dst + suffix] = torch.cat([scale, shift], dim=0)
        else:
            out[prefix + dst + suffix] = w
    if unknown:
        raise ValueError(f"{len(unknown)} tensor(s) with no HunyuanVideo 1.5 rule, e.g. "
                         f"{unknown[:3]}")
    return out
