"""LTX-2 (LTX2VideoTransformer3DModel): video with its sound track, denoised together.

Model space is one token sequence (workers/models/latent_layout.join_sound): the video
latent's tokens (patch 1: one per latent pixel, frame by frame) then the sound latent's (one
per latent frame, its 8 channels x 16 mel bins), both 128 wide and normalised as the
pipeline normalises them (ComfyUI's LATENT is the same space). The loop steps them alike:
LTX2Pipeline steps both with the same sigmas, and its x0-space CFG delta is cond + (g - 1)
(cond - uncond) in velocity too. The forward splits them again, calls the transformer with
precomputed RoPE coordinates, and joins its two outputs.

Sequence parallelism shards the video (near-evenly, padded to its longest shard by the
hooks): its tokens, its RoPE coordinates and, from a start frame (or ComfyUI's noise mask:
a MODEL call's timestep per token, the sound's too), the per-token timestep; the
sound (short: 25 tokens a second) and the prompt (one copy per stream, the connectors'
output) stay whole on every rank, as the family's token layout declares (the layout may
shard the sound instead: the same hooks split its tokens and coordinates, exact too). Each attention runs through the method's attention as the family's token layout
declares it: video and sound self-attention, each stream over the prompt (no exchange), and
audio-to-video / video-to-audio over the other stream's shards. Both outputs are gathered.
The blocks call their attention modules without keyword arguments, so the plan reaches the
processors by a hook (`SequenceLayout.plan_by_hook`); which attention a module is comes from
its name in the block, tagged once per transformer (`_tag`).
"""
from __future__ import annotations

import contextlib

import torch

from .. import families
from ..families import ltx2 as ltx2_family
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from . import latent_layout
from .base import DiTAdapter, text_encoder_device_of

FAMILY = families.FAMILIES["ltx2"]

# a block's attention module -> (query streams, key streams: None for self-attention)
ROLES = {"attn1": (("video",), None), "audio_attn1": (("audio",), None),
         "attn2": (("video",), ("text",)), "audio_attn2": (("audio",), ("text",)),
         "audio_to_video_attn": (("video",), ("audio",)),
         "video_to_audio_attn": (("audio",), ("video",))}
ROLE = "xdit_streams"  # the attribute a tagged module carries its role under


def _tag(transformer) -> None:
    """Give every attention module of the blocks its role (`ROLES`), once."""
    if getattr(transformer, "_xdit_roles_tagged", False):
        return
    for name, module in transformer.named_modules():
        role = ROLES.get(name.rsplit(".", 1)[-1])
        if role is not None and hasattr(module, "processor"):
            setattr(module, ROLE, role)
    transformer._xdit_roles_tagged = True


def _no_token_ropes(transformer) -> None:
    """Let the RoPE modules take coordinates of no tokens (a PipeFusion patch after a step's
    first holds none of the sound): their tables then have no rows, where the stock modules'
    reshapes cannot infer a width from nothing. Once per transformer."""
    if getattr(transformer, "_xdit_empty_ropes", False):
        return
    for name in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        module = getattr(transformer, name, None)
        if module is None:
            continue

        def forward(coords, *args, _stock=module.forward, **kwargs):
            if coords.shape[2]:  # coordinates [B, axes, tokens, ...]
                return _stock(coords, *args, **kwargs)
            one = coords.new_zeros(coords.shape[:2] + (1,) + coords.shape[3:])
            # the tables' token dim: [B, H, T, R] (split RoPE) or [B, T, D] (interleaved)
            return tuple(t.narrow(2 if t.dim() == 4 else 1, 0, 0)
                         for t in _stock(one, *args, **kwargs))
        module.forward = forward
    transformer._xdit_empty_ropes = True


def _rotate(attn, x, freqs):
    from diffusers.models.transformers.transformer_ltx2 import (apply_interleaved_rotary_emb,
                                                                apply_split_rotary_emb)
    if x.shape[1] == 0:  # no tokens of this stream in the call (a PipeFusion patch)
        return x
    if attn.rope_type == "split":
        return apply_split_rotary_emb(x, freqs)
    return apply_interleaved_rotary_emb(x, freqs)


class LTX2ShardedAttnProcessor:
    """Every LTX-2 attention on the local shards: the stock processors' projections, QK
    norms (across heads), RoPE (on the local tokens' own tables), per-head gates and
    spatio-temporal guidance's perturbation (the value in place of the attention), with the
    attention itself the method's, over the streams the module's role names."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, sp_plan=None,
                 perturbation_mask=None, all_perturbed=None):
        plan = need_plan(sp_plan)
        queries, keys = getattr(attn, ROLE)
        if attention_mask is not None:
            raise ValueError("LTX-2 attention masks are not supported under the pool's "
                             "attention (its prompt mask is all ones and is not passed)")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = None if attn.to_gate_logits is None else attn.to_gate_logits(hidden_states)
        value = attn.to_v(context)
        if all_perturbed is None:
            all_perturbed = perturbation_mask is not None and bool((perturbation_mask == 0).all())
        if all_perturbed:  # spatio-temporal guidance: the values stand for the attention
            out = value
        else:
            query, key = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(context))
            if query_rotary_emb is not None:
                query = _rotate(attn, query, query_rotary_emb)
                key = _rotate(attn, key, key_rotary_emb if key_rotary_emb is not None
                              else query_rotary_emb)
            # heads' width given, not -1: a PipeFusion patch may hold no tokens of a stream
            q, k, v = (t.unflatten(2, (attn.heads, t.shape[-1] // attn.heads))
                       for t in (query, key, value))
            out = self.attention(q, k, v, plan, queries, attn, keys=keys)
            out = out.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)  # [B, S, H]
            out = (out.unflatten(2, (attn.heads, out.shape[-1] // attn.heads))
                   * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def _token_counts(transformer, kw):
    return {"video": kw["hidden_states"].shape[1], "audio": kw["audio_hidden_states"].shape[1],
            "text": kw["encoder_hidden_states"].shape[1]}


class LTX2Adapter(DiTAdapter):
    family = FAMILY
    latents_fp32 = True  # LTX2Pipeline keeps fp32 latents and casts each call's input
    # rank 0's prompt encoder (Gemma 3 and the connectors) holds no VAE or vocoder
    encoder_skips = ("audio_vae", "vocoder")
    block_states = ("hidden_states", "audio_hidden_states")  # what each block returns
    row_conds = ("audio_encoder_hidden_states",)  # the sound's prompt states, one per row
    # ComfyUI's text connectors in its files (0.33.0's LTXAV holds them): `raw_text`'s
    side_prefixes = tuple(f"{name}." for name in ltx2_family.COMFY_CONNECTORS)
    layout = SequenceLayout(
        split_inputs={"hidden_states": ("video", 1), "audio_hidden_states": ("audio", 1),
                      "video_coords": ("video", 2), "audio_coords": ("audio", 2),
                      "timestep": ("video", 1, "per_token"),
                      "audio_timestep": ("audio", 1, "per_token")},
        split_outputs={},
        gather_output=("proj_out", 1),
        gather_streams={"audio_proj_out": ("audio", 1)},
        token_counts=_token_counts,
        streams=FAMILY.tokens,
        attention_processor=LTX2ShardedAttnProcessor,
        replaces=("LTX2AudioVideoAttnProcessor", "LTX2PerturbedAttnProcessor"),
        kwargs_name="attention_kwargs",
        plan_by_hook=True,
    )

    # ---- sizes -----------------------------------------------------------------------------
    def grid(self, model, req: dict) -> tuple:
        """(latent frames, rows, columns, sound latent frames) of a request."""
        spec, sound = self.family.latent, self.family.capability(families.SoundTrack)
        frames = int(req.frames or 1)
        d = spec.downscale
        return (spec.latent_frames(frames), int(req.height) // d, int(req.width) // d,
                sound.length(frames))

    def job_extra(self, model, req):
        """The RoPE coordinates of the request's video and sound (batch 1, on the device), and
        their token counts, as LTX2Pipeline prepares them once per call."""
        t, h, w, length = self.grid(model, req)
        tr, dev = model.transformer, model.device
        fps = self.family.capability(families.SoundTrack).fps
        return {"video_coords": tr.rope.prepare_video_coords(1, t, h, w, dev, fps=fps),
                "audio_coords": tr.audio_rope.prepare_audio_coords(1, length, dev),
                "tokens": (t * h * w, length)}

    # ---- ComfyUI's AV LATENT through the MODEL call (its parts: video, audio) ---------------
    def parts_problem(self, model, shapes) -> str:
        cfg = model.transformer.config
        sound = self.family.capability(families.SoundTrack)
        video, audio = shapes
        want_v, want_a = int(cfg.in_channels), (sound.channels, sound.mel_bins)
        if len(video) != 4 or video[0] != want_v:
            return (f"the video part must be [rows, {want_v}, latent frames, height/32, "
                    f"width/32] (got {[None, *video]})")
        if len(audio) != 3 or (audio[0], audio[2]) != want_a or \
                audio[0] * audio[2] != int(cfg.audio_in_channels):
            return (f"the audio part must be [rows, {want_a[0]}, latent frames, {want_a[1]}] "
                    f"(got {[None, *audio]})")
        return ""

    def pack_parts(self, parts: list):
        return latent_layout.join_sound(*parts)

    def unpack_parts(self, pred, shapes) -> list:
        (c, t, h, w), (ac, length, bins) = shapes
        nv = t * h * w
        video = pred[:, :nv].transpose(1, 2).reshape(pred.shape[0], c, t, h, w)
        audio = pred[:, nv:].reshape(pred.shape[0], length, ac, bins).transpose(1, 2)
        return [video, audio]

    def parts_extra(self, model, shapes, inputs: dict) -> dict:
        """The RoPE coordinates (batch 1, on the device) and token counts of a video and
        sound of these shapes, the video's frames placed at ComfyUI's frame rate."""
        (_, t, h, w), (_, length, _) = shapes
        tr, dev = model.transformer, model.device
        fps = float(inputs.get("frame_rate", self.family.comfy.call_inputs[0][1]))
        return {"video_coords": tr.rope.prepare_video_coords(1, t, h, w, dev, fps=fps),
                "audio_coords": tr.audio_rope.prepare_audio_coords(1, length, dev),
                "tokens": (t * h * w, length),
                # ComfyUI 0.33.0's block order and audio-video gates (the family's
                # ComfySpec.model_inputs)
                "v2a_after_a2v": bool(inputs.get("v2a_after_a2v", 0.0)),
                "cross_gate_other_max": bool(inputs.get("cross_gate_other_max", 0.0))}

    @staticmethod
    def bfl_to_diffusers(sd, config):
        """ComfyUI's (the original LTX-2) names -> LTX2VideoTransformer3DModel's, key by key
        (pure renames; the text connectors a file holds are not the transformer's: the
        loaders leave them to `raw_text`, `side_prefixes`)."""
        from ..families.ltx2 import diffusers_name
        return {diffusers_name(k): v for k, v in sd.items()}

    def forward_extra(self, model, height, width):
        raise NotImplementedError("LTX-2's forward inputs depend on the frames: job_extra")

    def job_timesteps(self, scheduler, steps, latents, device, extra):
        """LTX2Pipeline's schedule: sigmas linspace(1, 1/steps), shifted by mu from the video's
        token count (calculate_shift between the scheduler's base and max)."""
        import numpy as np
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
        c = scheduler.config
        mu = calculate_shift(extra["tokens"][0], c.get("base_image_seq_len", 1024),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.95),
                             c.get("max_shift", 2.05))
        kw = {"mu": mu} if c.get("use_dynamic_shifting") else {}
        scheduler.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), **kw)
        return scheduler.timesteps.to(device)

    # ---- text ------------------------------------------------------------------------------
    def encode(self, model, texts, max_sequence_length):
        """Gemma 3's states of every layer through the pipeline's connectors: one copy for the
        video, one for the sound. Their mask is all ones (the connectors' registers fill the
        padding), so no mask travels."""
        enc = model.encoder
        dev = text_encoder_device_of(model)
        pe, pm, _, _ = enc.encode_prompt(prompt=list(texts), do_classifier_free_guidance=False,
                                         max_sequence_length=max_sequence_length, device=dev)
        side = getattr(enc.tokenizer, "padding_side", "left")
        video, audio, mask = enc.connectors(pe, pm, padding_side=side)
        if not bool(mask.bool().all()):
            raise ValueError("LTX-2's text connectors left padded prompt tokens (a connector "
                             "without learnable registers), which the pool does not run")
        return {"encoder_hidden_states": video, "audio_encoder_hidden_states": audio}

    def conditioning(self, cond, pooled, **_):
        """ComfyUI's LTX-2 context [B, L, 2 x width]: the video's prompt states (its text
        connector's output) then the sound's, side by side."""
        half = int(cond.shape[-1]) // 2
        return {"encoder_hidden_states": cond[..., :half],
                "audio_encoder_hidden_states": cond[..., half:]}

    def raw_text(self, model, context):
        """Text states before LTX-2's text connectors (ComfyUI 0.33.0's CONDITIONING) ->
        ComfyUI's LTX-2 context, through the model's own connectors, as ComfyUI's LTXAV
        runs them (workers/models/ltx2_connectors.py)."""
        from . import ltx2_connectors
        conns = ltx2_connectors.connectors_of(model)
        with torch.inference_mode():
            return ltx2_connectors.run(conns, context.to(model.device, model.dtype))

    @staticmethod
    def slice_cond(cond: dict, sl: slice) -> dict:
        out = DiTAdapter.slice_cond(cond, sl)
        audio = cond.get("audio_encoder_hidden_states")
        if audio is not None and audio.shape[0] > 1:
            out["audio_encoder_hidden_states"] = audio[sl]
        return out

    def context_tokens(self, cond: dict) -> dict:
        return {"text": int(cond["encoder_hidden_states"].shape[1])}

    # ---- PipeFusion ------------------------------------------------------------------------
    def token_grid(self, height, width, frames=1):
        """The video's tokens run frame by frame, each frame height/32 rows of width/32."""
        d = self.family.latent.downscale
        return self.family.latent.latent_frames(frames) * (int(height) // d), int(width) // d

    def latent_rows(self, x, r0, r1, cols):
        """Token rows r0..r1 of the video's tokens [B, video tokens, 128]."""
        return x.narrow(1, r0 * cols, (r1 - r0) * cols)

    def denoised_parts(self, x, rows, cols):
        """The loop's tokens [B, video + sound, 128] -> (the video's, {"audio": the
        sound's}): PipeFusion's patches cut the video, the sound goes with the text."""
        nv = rows * cols
        return x.narrow(1, 0, nv), {"audio": x.narrow(1, nv, x.shape[1] - nv)}

    def stage_states(self, config):
        """The blocks take and return the video and the sound, each its own width."""
        return (("hidden_states", "video", int(config["num_attention_heads"])
                 * int(config["attention_head_dim"])),
                ("audio_hidden_states", "audio", int(config["audio_num_attention_heads"])
                 * int(config["audio_attention_head_dim"])))

    # ---- a start frame (LTX2ImageToVideoPipeline) ------------------------------------------
    def start_condition(self, model, req: dict, images, batch: int):
        """One start image -> {"references": {"tokens": its first latent frame's tokens
        [1, h*w, 128], model space}}: H.264-recompressed at the pipeline's default CRF (33
        with Gemma 3), resized by its VideoProcessor (bilinear), the VAE's mode, normalised. The loop
        then starts from them (`initial_latents`), calls those tokens at timestep 0 and keeps
        them (their velocity is 0). None without one (text-to-video)."""
        if req.concat_latent is not None:
            raise ValueError("LTX-2 takes its start frame as an image (reference_images); "
                             "ComfyUI's concat_latent is WanImageToVideo's")
        if not images:
            return None
        if len(images) != 1:
            raise ValueError(f"LTX-2 image-to-video takes one start image (got {len(images)})")
        import numpy as np
        import PIL.Image
        from diffusers.pipelines.ltx2.utils import (apply_image_conditioning_crf,
                                                    resolve_default_image_crf)
        from diffusers.video_processor import VideoProcessor

        from .base import vae_mode
        image = images[0]
        enc = model.encoder
        crf = resolve_default_image_crf(None if enc is None else enc.text_encoder)
        if crf:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(
                np.array(image.convert("RGB")), crf))
        d = self.family.latent.downscale
        pixels = VideoProcessor(vae_scale_factor=d, resample="bilinear").preprocess(
            image, height=int(req.height), width=int(req.width)).float()
        raw = vae_mode(model, pixels.unsqueeze(2))  # [1, 128, 1, h, w]
        vae = model.vae  # loaded by vae_mode; its statistics are buffers, not config
        mean = vae.latents_mean.float().cpu().view(1, -1, 1, 1, 1)
        std = vae.latents_std.float().cpu().view(1, -1, 1, 1, 1)
        scale = float(vae.config.scaling_factor)
        first = (raw - mean) * scale / std
        return {"references": {"tokens": first.flatten(2).transpose(1, 2).contiguous()},
                "cond": {}}

    def initial_latents(self, latents, extra):
        first = extra.get("ref_tokens")
        if first is None:
            return latents
        out = latents.clone()
        out[:, :first.shape[1]] = first.to(out.dtype).expand(out.shape[0], -1, -1)
        return out

    # ---- the call --------------------------------------------------------------------------
    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        tr = model.transformer
        _tag(tr)
        _no_token_ropes(tr)
        nv, _ = extra["tokens"]
        b = latents.shape[0]
        x = latents.to(model.dtype)
        text = cond["encoder_hidden_states"]
        audio_text = cond["audio_encoder_hidden_states"]
        text, audio_text = text.expand(b, -1, -1), audio_text.expand(b, -1, -1)
        first = extra.get("ref_tokens")  # a start frame: its tokens at timestep 0
        n0 = 0 if first is None else first.shape[1]
        if t.dim() == 2:  # a timestep per token (ComfyUI's noise mask): the video's, the sound's
            timestep, audio_t, sigma = t[:, :nv], t[:, nv:], t.amax(1)
            # ComfyUI's LTXAV modulates each stream's cross-attention with its own tokens'
            # timesteps (diffusers' use_cross_timestep=False; 0.33.0's gates by the other
            # stream's largest: ltx2_cross_gates.py); equal to the pipeline's crossed ones
            # where every token has the row's timestep
            crossed = False
        else:
            timestep = audio_t = sigma = t.expand(b)
            crossed = True  # LTX2Pipeline's default
        if n0:
            timestep = torch.cat([t.new_zeros(b, n0), t.expand(b, nv - n0)], 1)
        ways = contextlib.ExitStack()
        if extra.get("v2a_after_a2v"):  # ComfyUI 0.33.0's LTXAV order (a MODEL call's)
            from .ltx2_block_order import v2a_after_a2v
            ways.enter_context(v2a_after_a2v(tr))
        if extra.get("cross_gate_other_max") and not crossed:  # 0.33.0's gates, per token
            from .ltx2_cross_gates import gated_by_other_max
            ways.enter_context(gated_by_other_max(tr, timestep, audio_t))
        with ways:
            video, audio = tr(
                hidden_states=x[:, :nv], audio_hidden_states=x[:, nv:],
                encoder_hidden_states=text, audio_encoder_hidden_states=audio_text,
                timestep=timestep, audio_timestep=audio_t, sigma=sigma,
                video_coords=extra["video_coords"].expand(b, -1, -1, -1),
                audio_coords=extra["audio_coords"].expand(b, -1, -1, -1),
                use_cross_timestep=crossed,
                # a guidance pass's changes (`guidance_passes`): off by default
                isolate_modalities=bool(extra.get("isolate_modalities", False)),
                spatio_temporal_guidance_blocks=list(extra.get("stg_blocks", ())) or None,
                attention_kwargs=dict(jak or {}), return_dict=False)
        # the start frame stays as it is (the pipeline steps the later frames only); the
        # loop's guidance passes keep its prediction, which the pipeline's rescale reads
        # (`guide` then holds it)
        if n0 and not extra.get("start_prediction"):
            video = torch.cat([video.new_zeros(b, n0, video.shape[2]), video[:, n0:]], 1)
        return torch.cat([video, audio], 1)

    # ---- guidance (LTX2Pipeline's; workers/sampling/guidance.py) --------------------------
    def guidance_passes(self, model, req) -> list:
        """The family's passes by name (workers/families/ltx2.py `guidance_passes`: uncond,
        cond, then STG and modality as their scales turn them on), each with what it
        changes: the STG pass skips the listed blocks' self-attention, the modality pass
        turns the audio-video cross-attention off; both read the positive prompt."""
        from ..sampling.guidance import Pass
        blocks = len(model.transformer.transformer_blocks) \
            if getattr(model, "transformer", None) is not None else None
        given = dict(req.extra_guidance or {})
        bad = self.family.capability(families.ExtraGuidance).problems(given, req.cfg, blocks)
        if bad:
            raise ValueError("; ".join(bad))
        v = _guidance(req)
        keep = (("start_prediction", True),)  # see `forward`
        changes = {"stg": (("stg_blocks", v["stg_blocks"]),),
                   "modality": (("isolate_modalities", True),)}
        return [Pass(n, negative=n == "uncond", changes=keep + changes.get(n, ()))
                for n in families.guidance_pass_names(self.family, given, req.cfg)]

    def guide(self, preds: dict, latents, sigma, scale: float, extra: dict, req):
        """LTX2Pipeline's combination, per stream (the video's tokens, then the sound's):
        in x0 space (x - sigma v), cond + (cfg - 1)(cond - uncond) + stg (cond - stg) +
        (modality - 1)(cond - modality), then rescaled toward the conditional x0's std over
        each stream of each row (rescale_noise_cfg), back to a velocity."""
        v = _guidance(req)
        nv = extra["tokens"][0]
        x = latents.float()
        x0 = {k: x - p.float() * sigma for k, p in preds.items()}
        parts = []
        for sl, pre, g in ((slice(0, nv), "", scale), (slice(nv, None), "audio_",
                                                         v["audio_cfg"])):
            c = x0["cond"][:, sl]
            out = c
            if "uncond" in x0:
                out = out + (g - 1) * (c - x0["uncond"][:, sl])
            if "stg" in x0:
                out = out + v[pre + "stg_scale"] * (c - x0["stg"][:, sl])
            if "modality" in x0:
                out = out + (v[pre + "modality_scale"] - 1) * (c - x0["modality"][:, sl])
            r = v[pre + "guidance_rescale"]
            if r > 0:
                std_c = c.std(dim=list(range(1, c.ndim)), keepdim=True)
                std_g = out.std(dim=list(range(1, out.ndim)), keepdim=True)
                out = r * (out * (std_c / std_g)) + (1 - r) * out
            parts.append(out)
        pred = (x - torch.cat(parts, 1)) / sigma
        first = extra.get("ref_tokens")  # a start frame's tokens stay as they are
        if first is not None:
            pred[:, :first.shape[1]] = 0
        return pred.to(preds["cond"].dtype)

    # ---- VAE space -------------------------------------------------------------------------
    def scale_shift(self, model):
        """ComfyUI's LATENT is model space (its VAEs normalise inside): no conversion."""
        return 1.0, 0.0

    def to_raw(self, model, latents, height, width):
        raise NotImplementedError("LTX-2's latents need the frames to split: job_raw")

    def job_raw(self, model, latents, req):
        """(video, sound) in model space, apart: `decode` takes ComfyUI's AV LATENT's two."""
        return latents["samples"], latents.get("audio")

    def comfy_to_raw(self, model, samples):
        return samples.float() if torch.is_tensor(samples) else \
            tuple(None if t is None else t.float() for t in samples)

    def decode(self, model, raw, group=None, control=None, weights=()):
        """(video, sound) model-space latents (ComfyUI's AV LATENT's) -> the Decoded fields: the frames
        [B * F, H, W, 3] in 0..1 and the waveform [B, channels, samples] with its rate, as
        LTX2Pipeline decodes them (the video VAE at decode timestep 0, without decode noise;
        the audio VAE's mel spectrogram through the vocoder). On the group's first rank (the
        others return None: no collective; the VAEs are not patch-parallel here)."""
        if raw is None:
            return None
        video, audio = raw if isinstance(raw, (tuple, list)) else (raw, None)
        parts = _decoders(model)
        vae = parts["vae"]
        x = video.to(model.device, vae.dtype)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(x)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(x)
        x = x * std / vae.config.scaling_factor + mean
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)
        vid = vae.decode(x, timestep, return_dict=False)[0]
        frames = (vid.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).flatten(0, 1).cpu()
        if audio is None:
            return {"images": frames}
        avae, vocoder = parts["audio_vae"], parts["vocoder"]
        a = audio.to(model.device, avae.dtype)
        tok = a.transpose(1, 2).flatten(2, 3)  # the statistics are per packed channel
        tok = tok * avae.latents_std.to(tok) + avae.latents_mean.to(tok)
        a = tok.unflatten(2, (a.shape[1], a.shape[3])).transpose(1, 2)
        mel = avae.decode(a, return_dict=False)[0]
        wave = vocoder(mel).float().cpu()
        return {"images": frames, "audio": wave,
                "sample_rate": int(vocoder.config.output_sampling_rate)}


def _guidance(req) -> dict:
    from ..families.ltx2 import guidance_values
    return guidance_values(req.extra_guidance or {}, req.cfg)


def _decoders(model) -> dict:
    """The folder's video VAE, audio VAE and vocoder, loaded once on the model's device."""
    parts = getattr(model, "decoders", None)
    if parts is None:
        import diffusers
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

        from .base import load_vae
        if model.vae is None:
            model.vae = load_vae(model)
        audio_vae = diffusers.AutoencoderKLLTX2Audio.from_pretrained(
            model.path, subfolder="audio_vae", torch_dtype=model.dtype)
        vocoder = LTX2Vocoder.from_pretrained(model.path, subfolder="vocoder",
                                              torch_dtype=model.dtype)
        parts = {"vae": model.vae,
                 "audio_vae": audio_vae.to(model.device).eval().requires_grad_(False),
                 "vocoder": vocoder.to(model.device).eval().requires_grad_(False)}
        model.decoders = parts
    return parts
