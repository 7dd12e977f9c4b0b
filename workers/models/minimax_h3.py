"""MiniMax-H3 (MiniMaxH3Transformer3DModel): video and its stereo sound from one packed
sequence [text | audio | video] (workers/models/minimax_h3_layout.py has the layout and the
two schedules).

The loop's latent is the packed media rows of each prompt, [B, audio rows + video rows, 96]:
the audio rows (left channel then right, 32 channels, zero beyond) then the video's 2 x 2
patches (96 channels), in sequence order, normalised (the pipeline's model space). The
noise: the host's video noise (the LATENT's shape), patchified, and the sound's, drawn on
rank 0 from the request's seed (`job_noise`). `outputs` splits the result into the video
latent and the sound's [B, 32, 2, N] (ComfyUI's MiniMaxH3AV layout of its audio part).

diffusers' forward scatters the three streams into the packed sequence with sequence-wide
indices, which a shard does not have, so it is replaced at load by `packed_forward`, which
runs the transformer's own modules on per-stream inputs: each stream's rows, RoPE positions
and timestep indices are forward inputs the sequence-parallel hooks split alike (the float64
positions and the AdaLN rows travel with their rows), the text after its refiner (which runs
on the whole prompt on every rank, as alone). The blocks run on this rank's [video | audio |
text] (every row carries its position and nothing is masked, so full attention does not
depend on the rows' order; the latent first is where the step cache reads it), the joint
attention over every rank's keys; both output heads' rows are gathered.
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass

from typing import Optional

import torch

from .. import families
from ..families import minimax_h3 as fam
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from . import minimax_h3_comfy as mhc
from . import minimax_h3_layout as lay
from .base import DiTAdapter, text_encoder_device_of

STREAMS = ("video", "audio", "text")  # the blocks' local order (the family's TOKENS)
TAGS = {"text": fam.TEXT_TAG, "audio": fam.AUDIO_TAG, "video": fam.VIDEO_TAG}
# the video's 2 x 2 patches, and a packed row's width (the audio rows' 32 channels first)
PATCH, ROW_WIDTH = mhc.PATCH, mhc.ROW_WIDTH


@dataclass(frozen=True)
class Attend:
    """The forward's sequence plan and the rows' real text lengths (None: every row fills
    the text), handed to the blocks as their attention mask (they pass it to the processor
    untouched); the refiner's attention gets None (runs whole, on one prompt's tokens)."""
    plan: object
    text_lengths: Optional[tuple] = None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The stock partial RoPE (the leading channels of each head rotated, the rest passed)
    with a table per row: x [B, S, H, D], cos / sin [B, S, R]."""
    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    cos, sin = cos.to(x.dtype)[:, :, None, :], sin.to(x.dtype)[:, :, None, :]
    x1, x2 = head.chunk(2, dim=-1)
    return torch.cat((head * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def rope_table(rope, positions: torch.Tensor) -> tuple:
    """The stock RoPE table of float64 (t, h, w) positions [B, S, 3], one per row: each
    axis's angles at the shared frequencies, the three joined, then joined with themselves
    (the rotate-half convention), as cos / sin [B, S, 6F]."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * rope.inv_freq.view(1, 1, 1, -1)
    freqs = torch.cat(freqs.unbind(dim=2), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


class MiniMaxH3ShardedAttnProcessor:
    """The stock attention on the local rows: q/k/v, per-head RMS norms, partial RoPE (a
    table per row), then attention over every rank's [video | audio | text] keys (each row's
    padded text keys dropped), the output projection."""

    def __init__(self, attention):
        from diffusers.models.transformers.transformer_minimax_h3 import \
            MiniMaxH3AttnProcessor
        self.attention = attention
        self.whole = MiniMaxH3AttnProcessor()

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        if not isinstance(attention_mask, Attend):  # the text refiner's: the prompt alone
            return self.whole(attn, hidden_states, rotary_emb, attention_mask)
        plan = need_plan(attention_mask.plan)
        q, k, v = (f(hidden_states).unflatten(-1, (attn.heads, -1))
                   for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = self.attention(q, k, v, plan, STREAMS, attn,
                             text_lengths=attention_mask.text_lengths)
        out = out.flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def packed_forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep,
                   video_positions, audio_positions, text_positions, video_steps,
                   audio_steps, text_steps, attention_kwargs=None, return_dict=False):
    """The MiniMax-H3 transformer on per-stream inputs (module doc), bound as its forward:
    each stream's rows ([B, N, C]), float64 RoPE positions per row [B, N, 3] and timestep
    indices [N] (into `timestep`, the call's (video t, audio t)). Prompts of other lengths
    share the call padded to the longest, their real lengths in `attention_kwargs`'
    `text_lengths`: each is refined alone and its padded keys are dropped. Returns (video
    [B, Nv, 96], audio [B, Na, 32]) velocities, data-ward, in the heads' dtype."""
    from diffusers.models.modeling_utils import get_parameter_dtype

    jak = attention_kwargs or {}
    plan = jak.get("sp_plan")
    b, n_text = encoder_hidden_states.shape[:2]
    real = jak.get("text_lengths")
    real = None if real is None or all(int(n) == n_text for n in real) else \
        tuple(int(n) for n in real)
    video = self.proj_in(hidden_states.to(get_parameter_dtype(self.proj_in)))
    audio = self.audio_proj_in(audio_hidden_states.to(get_parameter_dtype(self.audio_proj_in)))
    text = self.context_embedder(encoder_hidden_states.to(
        get_parameter_dtype(self.context_embedder)))
    if real is None:  # the refiner on each prompt's own tokens (plain attention, no mask)
        text = self.token_refiner(text)
    else:
        text = torch.stack([torch.cat([self.token_refiner(text[i:i + 1, :n])[0],
                                       text.new_zeros(n_text - n, text.shape[-1])])
                            for i, n in enumerate(real)])
    if plan is not None:  # this rank's text rows (the others' were split on the way in)
        text = plan.shard(text, 1, "text")
    # the rows in the blocks' order, [video | audio | text] (STREAMS), each with its own
    # position: full attention without a mask does not depend on the order
    lengths = (video.shape[1], audio.shape[1], text.shape[1])
    x = torch.cat([video.to(text.dtype), audio.to(text.dtype), text], 1)
    positions = torch.cat([video_positions, audio_positions, text_positions], 1)
    steps = torch.cat([video_steps, audio_steps, text_steps])
    tags = torch.cat([torch.full((n,), TAGS[s], dtype=steps.dtype, device=steps.device)
                      for s, n in zip(STREAMS, lengths)])
    rotary = rope_table(self.rope, positions)
    temb = self.time_embedder(self.time_proj(timestep).to(get_parameter_dtype(self.time_embedder)))
    adaln = steps * 3 + tags
    attend = Attend(plan, real)
    for block in self.transformer_blocks:
        x = block(x, temb, adaln, rotary, attend)
    x = self.norm_out(x, temb, steps).to(get_parameter_dtype(self.proj_out))
    a0, t0 = lengths[0], lengths[0] + lengths[1]
    video_out = self.proj_out(x[:, :a0])  # the layout's hooks gather each head's rows
    audio_out = self.audio_proj_out(x[:, a0:t0])
    return video_out, audio_out


def _token_counts(transformer, kw):
    return {"text": int(kw["encoder_hidden_states"].shape[1]),
            "audio": int(kw["audio_hidden_states"].shape[1]),
            "video": int(kw["hidden_states"].shape[1])}


class _Encoder:
    """Rank 0's prompt encoder: the folder's Qwen3-VL and its tokenizer."""

    def __init__(self, text_encoder, tokenizer, device):
        self.text_encoder, self.tokenizer, self.device = text_encoder, tokenizer, device

    def to(self, device):
        self.text_encoder.to(device)
        self.device = torch.device(device)
        return self


def media_counts(rows: int, height: int, width: int) -> tuple:
    """(video frames, audio rows, video rows) of a packed latent of `rows` rows at this
    size: the one 17n + 5 whose audio and video rows add up to it."""
    per = (height // 32) * (width // 32)
    n = 0
    while True:
        frames = 17 * n + 5
        a, v = 2 * fam.audio_latents(frames), fam.LATENT.latent_frames(frames) * per
        if a + v == rows:
            return frames, a, v
        if a + v > rows:
            raise ValueError(f"{rows} latent rows are no MiniMax-H3 video of {height} x "
                             f"{width} with its sound")
        n += 1


def _rows(cond: dict, rows: slice, n: int) -> dict:
    """The conditioning of rows `rows` of a call of `n` rows (a batch-1 text is shared)."""
    out = dict(cond)
    text = cond["encoder_hidden_states"]
    if text.shape[0] == n:
        out["encoder_hidden_states"] = text[rows]
    if cond.get("text_lengths") is not None:
        out["text_lengths"] = tuple(cond["text_lengths"])[rows]
    return out


class MiniMaxH3Adapter(DiTAdapter):
    family = families.FAMILIES["minimax_h3"]
    one_timestep = True  # the AdaLN rows are per sequence row, shared by the batch
    lora_pipeline = "MiniMaxH3ModularPipeline"
    layout = SequenceLayout(
        split_inputs={"hidden_states": ("video", 1), "audio_hidden_states": ("audio", 1),
                      "video_positions": ("video", 1), "audio_positions": ("audio", 1),
                      "text_positions": ("text", 1), "video_steps": ("video", 0),
                      "audio_steps": ("audio", 0), "text_steps": ("text", 0)},
        split_outputs={},  # the text: after its refiner, in packed_forward
        gather_output=("proj_out", 1),
        gather_streams={"audio_proj_out": ("audio", 1)},
        token_counts=_token_counts,
        streams=families.FAMILIES["minimax_h3"].tokens,
        attention_processor=MiniMaxH3ShardedAttnProcessor,
        replaces=("MiniMaxH3AttnProcessor",),
        kwargs_name="attention_kwargs",
    )

    @staticmethod
    def bfl_to_diffusers(sd, config):
        """ComfyUI's MiniMax-H3 names (comfy/ldm/minimax) -> diffusers' (minimax_h3_names)."""
        from .minimax_h3_names import comfy_to_diffusers
        return comfy_to_diffusers(sd)

    @staticmethod
    def computed_buffers(transformer) -> None:
        """RoPE's inverse frequencies (a non-persistent buffer)."""
        rope = transformer.rope
        d = rope.rope_freq_dim
        theta = float(transformer.config.get("rope_theta", 10000.0))
        rope.inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * d, 2, dtype=torch.float32)
                                         / (2 * d)))

    def assemble(self, path, transformer, report, device, dtype, with_text_encoders,
                 text_encoders="auto", stage_info=None):
        """The transformer with `packed_forward`; rank 0's encoder: the folder's Qwen3-VL
        and tokenizer (the modular pipeline has no loader of its own to call)."""
        transformer.forward = types.MethodType(packed_forward, transformer)
        if transformer.rope.inv_freq.device.type == "meta":
            self.computed_buffers(transformer)
        transformer.rope.inv_freq = transformer.rope.inv_freq.to(device)
        model = super().assemble(path, transformer, report, device, dtype, False,
                                 text_encoders, stage_info)
        if with_text_encoders and os.path.isdir(path):
            from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
            te_device = self._text_encoder_device(path, device, dtype, text_encoders)
            enc = Qwen3VLForConditionalGeneration.from_pretrained(
                os.path.join(path, "text_encoder"), dtype=dtype).eval().requires_grad_(False)
            tok = AutoTokenizer.from_pretrained(os.path.join(path, "tokenizer"))
            model.encoder = _Encoder(enc, tok, te_device).to(te_device)
            model.load_report = dict(model.load_report, text_encoders=te_device)
        return model

    def make_scheduler(self, model, shift=None):
        """The loop's FlowMatch Euler: its sigmas are set to MiniMax-H3's video schedule by
        `timesteps` (one Euler step on them is both schedules' step, module doc of
        minimax_h3_layout); `shift`: the video's in place of 12."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        s = FlowMatchEulerDiscreteScheduler(shift=1.0)
        s.video_shift = float(shift) if shift is not None else float(
            model.scheduler_config.get("shift", fam.VIDEO_SHIFT))
        return s

    def timesteps(self, scheduler, steps, latents, device):
        """[steps, 3]: each step's (video t, audio t, audio sigma step / video sigma step);
        the scheduler's sigmas become the video's."""
        sched = lay.Schedules.make(steps, scheduler.video_shift, fam.AUDIO_SHIFT)
        scheduler.sigmas = sched.video.to(device)
        return torch.cat([sched.timesteps(), sched.audio_ratio()[:, None]], 1).to(device)

    # ---- noise and results ------------------------------------------------------------
    def job_noise(self, noise, req: dict):
        """The host's video noise [B, 24, T, h, w] -> the packed rows with the sound's noise
        before them, drawn from the request's seed ([B, 2, 32, N]: row b the b-th draw)."""
        frames = int(req.frames)
        n = fam.audio_latents(frames)
        g = torch.Generator().manual_seed(int(req.seed))
        audio = torch.randn(noise.shape[0], fam.STEREO, fam.AUDIO_CHANNELS, n, generator=g)
        return self.pack_media(lay.patchify(noise.float(), PATCH), lay.audio_rows(audio))

    @staticmethod
    def pack_media(video_rows, audio_rows):
        a = torch.nn.functional.pad(audio_rows, (0, ROW_WIDTH - audio_rows.shape[-1]))
        return torch.cat([a.to(video_rows.dtype), video_rows], 1)

    def outputs(self, samples, req: dict) -> dict:
        """The loop's packed rows -> {"samples": the video latent [B, 24, T, h, w], "audio":
        the sound's [B, 32, 2, N]}, model space."""
        h, w = int(req.height), int(req.width)
        frames, na, _ = media_counts(samples.shape[1], h, w)
        video = lay.unpatchify(samples[:, na:], fam.LATENT.latent_frames(frames), h // 16,
                               w // 16, fam.CHANNELS, PATCH)
        audio = lay.audio_latent(samples[:, :na, :fam.AUDIO_CHANNELS], na // 2)
        return {"samples": video, "audio": audio.permute(0, 2, 1, 3)}

    def token_grid(self, height, width, frames=1):
        return self.family.latent.latent_frames(frames) * (height // 32), width // 32

    def latent_rows(self, x, r0, r1, cols):
        """Token rows r0..r1 of the video's rows [B, video rows, 96] (frame by frame, each
        frame height/32 token rows of width/32)."""
        return x.narrow(1, r0 * cols, (r1 - r0) * cols)

    def denoised_parts(self, x, rows, cols):
        """The packed rows [B, audio + video rows, 96] -> (the video's rows, {"audio": the
        sound's rows}): PipeFusion's patches cut the video, the sound goes with the text."""
        na = x.shape[1] - rows * cols
        return x.narrow(1, na, rows * cols), {"audio": x.narrow(1, 0, na)}

    def context_tokens(self, cond):
        return {"text": int(cond["encoder_hidden_states"].shape[1])}

    # ---- text -------------------------------------------------------------------------
    def encode(self, model, texts, max_sequence_length):
        """Each prompt's Qwen3-VL states (hidden state 50, the prompt verbatim), rows padded
        to the longest with their lengths (`text_mask`)."""
        enc = model.encoder
        dev = text_encoder_device_of(model)
        states = [lay.encode_prompt(enc.text_encoder, enc.tokenizer, t, dev, model.dtype)[0]
                  for t in texts]
        longest = max(s.shape[0] for s in states)
        keep = torch.zeros(len(states), longest, dtype=torch.bool)
        rows = []
        for i, s in enumerate(states):
            keep[i, :s.shape[0]] = True
            rows.append(torch.cat([s, s.new_zeros(longest - s.shape[0], s.shape[1])]))
        return {"encoder_hidden_states": torch.stack(rows), **self.row_text_mask(keep)}

    def conditioning(self, cond, pooled):
        """ComfyUI's CONDITIONING: the Qwen3-VL states; no pooled output."""
        return {"encoder_hidden_states": cond}

    # ---- the call -----------------------------------------------------------------------
    def forward_extra(self, model, height, width):
        return {"size": (int(height), int(width))}

    def job_extra(self, model, req):
        """The size, and a job's position tables per prompt length, made on the device at
        the first call that needs each (then every step reads them: no host copy a step)."""
        return dict(self.forward_extra(model, req.height, req.width), positions={})

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        """One transformer call for every run of rows at one timestep (its AdaLN rows are
        shared by the batch; a MODEL call's rows may be at different timesteps, the host's
        copy of them says where without waiting on the device), in row order."""
        runs = mhc.timestep_runs((extra or {}).get("host_timesteps"), latents.shape[0])
        if len(runs) == 1:
            return self._forward(model, latents, t, cond, extra, jak)
        n = latents.shape[0]
        return torch.cat([self._forward(model, latents[r], t[r], _rows(cond, r, n), extra, jak)
                          for r in runs])

    def _forward(self, model, latents, t, cond, extra=None, jak=None):
        """One call for every row (one timestep): prompts of other lengths padded to the
        longest, each row's positions its own (its text's length moves its sound's and
        video's); the prediction in the loop's convention (-v; the audio rows' scaled to the
        video's sigma step)."""
        h, w = (extra or {})["size"]
        b = latents.shape[0]
        counts = (extra or {}).get("counts")  # a MODEL call's: (latent frames, sound rows)
        if counts is None:
            frames, na, nv = media_counts(latents.shape[1], h, w)
            lt = fam.LATENT.latent_frames(frames)
        else:
            (lt, na), nv = counts, latents.shape[1] - counts[1]
        comfy = (extra or {}).get("comfy")  # ComfyUI's model inputs (minimax_h3_comfy)
        text = cond["encoder_hidden_states"]
        text = text if text.shape[0] == b else text.expand(b, -1, -1)
        longest = text.shape[1]
        lengths = tuple(cond.get("text_lengths") or (longest,) * b)
        dev, dtype = latents.device, model.dtype
        # the call's timesteps (video t, audio t), rows indexing them: two entries even when
        # equal (the same AdaLN rows), so no step waits on the host for torch.unique's size
        if comfy is None:
            ts = t[:2].float()
        else:  # ComfyUI's sigma x 1000: each stream's t, the sound carried to its own
            ts, sigma_a, carry = mhc.comfy_steps(t, comfy)
            own = mhc.carried_in(latents[:, :na, :fam.AUDIO_CHANNELS], carry, comfy)
            latents = torch.cat([torch.nn.functional.pad(own, (0, ROW_WIDTH - own.shape[-1])),
                                 latents[:, na:]], 1)
        per_row = (extra or {}).get("positions")
        per_row = {} if per_row is None else per_row
        for n in set(lengths) - set(per_row):
            p = lay.packed(int(n), lt, h // 16, w // 16, na // 2, PATCH)
            per_row[n] = {s: p.positions[a:a + c].to(dev) for s, (a, c) in p.streams().items()}
        pos = {s: torch.stack([per_row[n][s] if s != "text" else torch.cat(
            [per_row[n][s], per_row[n][s].new_zeros(longest - n, 3)]) for n in lengths])
            for s in STREAMS}
        v, a = model.transformer(
            hidden_states=latents[:, na:].to(dtype),
            audio_hidden_states=latents[:, :na, :fam.AUDIO_CHANNELS].to(dtype),
            encoder_hidden_states=text.to(dtype), timestep=ts.to(dev),
            video_positions=pos["video"], audio_positions=pos["audio"],
            text_positions=pos["text"],
            video_steps=torch.zeros(nv, dtype=torch.long, device=dev),
            audio_steps=torch.ones(na, dtype=torch.long, device=dev),
            text_steps=torch.zeros(longest, dtype=torch.long, device=dev),
            attention_kwargs=self.attention_kwargs(cond, jak) or {}, return_dict=False)
        if comfy is not None:  # ComfyUI's model's prediction: -v, the sound's carried
            return self.pack_media(-v.float(), mhc.carried_out(
                -a.float(), latents[:, :na, :fam.AUDIO_CHANNELS].float(), sigma_a,
                comfy)).to(latents.dtype)
        return self.pack_media(-v.float(), -a.float() * t[2].float()).to(latents.dtype)

    # ---- ComfyUI's MODEL call: its nested LATENT's two parts (minimax_h3_comfy) -------
    def parts_problem(self, model, shapes) -> str:
        return mhc.parts_problem(shapes)

    def pack_parts(self, parts: list):
        return mhc.pack_parts(parts)

    def unpack_parts(self, pred, shapes) -> list:
        return mhc.unpack_parts(pred, shapes)

    def parts_extra(self, model, shapes, inputs: dict) -> dict:
        return mhc.parts_extra(shapes, inputs)

    # ---- decode -------------------------------------------------------------------------
    def to_raw(self, model, latents, height, width):
        """Model space (normalised) -> the VAE's latent: x std + mean per channel."""
        mean, std = (torch.tensor(model.vae_config[k], dtype=torch.float32).view(1, -1, 1, 1, 1)
                     for k in ("latents_mean", "latents_std"))
        return latents.float() * std + mean

    def comfy_to_raw(self, model, samples):
        """ComfyUI's LATENT -> what `decode` takes: the video (raw VAE space already), or
        (video, sound) for a nested LATENT (MiniMaxH3AV's, or Sampler (xDiT)'s with its
        sound), the sound in model space as `decode_audio` takes it."""
        if torch.is_tensor(samples):
            return samples.float()
        video, sound = samples
        return video.float(), None if sound is None else sound.float()

    def decode(self, model, raw, group=None, control=None, weights=()):
        """The video VAE's frames (ImageNet-normalised pixels, as the pipeline undoes them)
        -> IMAGE [B x F, H, W, 3] in 0..1; decoded whole on the first rank of a group.
        (video, sound) (Decode (xDiT) of a LATENT with its sound) -> Decoded's fields: the
        frames, the waveform and its rate."""
        from .base import load_vae
        if group is not None and torch.distributed.get_rank(group) != 0:
            return None
        if isinstance(raw, tuple):
            images = self.decode(model, raw[0])
            if raw[1] is None:
                return images
            wave, rate = self.decode_audio(model, raw[1])
            return {"images": images, "audio": wave, "sample_rate": rate}
        if model.vae is None:
            model.vae = load_vae(model)
        vid = model.vae.decode(raw.to(model.device, model.vae.dtype), return_dict=False)[0]
        mean = torch.tensor((0.485, 0.456, 0.406)).view(1, -1, 1, 1, 1).to(vid.device)
        std = torch.tensor((0.229, 0.224, 0.225)).view(1, -1, 1, 1, 1).to(vid.device)
        vid = (vid.float() * std + mean).clamp(0, 1)
        return vid.permute(0, 2, 3, 4, 1).flatten(0, 1).cpu()

    def decode_audio(self, model, audio):
        """The sound's latent [B, 32, 2, N] (model space) -> (its stereo waveform [B, 2,
        samples] at 32 kHz, the rate), as the pipeline decodes it: de-normalised by the
        audio VAE's statistics, the two channels through the mono VAE as two rows."""
        vae = model.audio_vae
        if vae is None:
            from diffusers import AutoencoderKLMiniMaxH3Audio
            vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(
                model.path, subfolder="audio_vae", torch_dtype=model.dtype)
            model.audio_vae = vae = vae.to(model.device).eval().requires_grad_(False)
        mean, std = (torch.tensor(vae.config[k], dtype=torch.float32).view(1, -1, 1)
                     for k in ("latents_mean", "latents_std"))
        waves = []
        for row in audio.float():  # [32, 2, N] -> the channels as rows [2, 32, N]
            raw = row.permute(1, 0, 2) * std + mean
            wave = vae.decode(raw.to(model.device, vae.dtype), return_dict=False)[0]
            waves.append(wave.float().permute(1, 0, 2)[0].cpu())  # [2, samples]
        return torch.stack(waves), int(vae.config.get("sampling_rate", fam.SAMPLE_RATE))
