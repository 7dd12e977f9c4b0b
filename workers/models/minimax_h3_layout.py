"""MiniMax-H3's packed sequence, its latents as rows and its two schedules (the adapter,
workers/models/minimax_h3.py, runs them).

The sequence of one prompt is [text | audio | video] (text-to-video with sound: no
keyframes), each row with float64 (t, h, w) RoPE coordinates, a modality tag and the index
of its timestep among the call's distinct timesteps; the transformer reads the AdaLN row
`timestep index x 3 + tag`. Positions (workers/families/minimax_h3.py has the constants):

- text row i: (i, 0, 0);
- audio latent j of either channel: (T + j, 0, w_first) for the left channel, (T + j, 0,
  w_last) for the right, T the text's length and w_first / w_last the ends of the video's
  width axis;
- video latent frame f, patch (r, c): (T + time(f), h_r, w_c), time(f) the cumulative 5/3 x
  (1, 4, 4, 4, 4, 1, 4, ...) frame spacing, (h, w) an aspect-normalised grid centred on
  [0, 32).

So the text's length shifts every later position: the rows of a batch with prompts of
different lengths cannot share a call (no mask, no padding in this model); `forward` runs
each prompt's rows alone.

Two schedules step in one call: the video's (shift 12) and the audio's (shift 3), both
rectified flow with t = 1 - sigma and a data-ward velocity v (x0 = x + sigma v). The loop's
one Euler step x + (sigma_next - sigma) pred on the video's sigmas gives both exactly when
pred is -v for the video rows and -v x (audio sigma step / video sigma step) for the audio
rows (`Schedules.audio_ratio`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..families import minimax_h3 as fam

ROPE_SCALE = 32.0  # the spatial grid spans [0, 32) on a square canvas
FRAME_TIME = 5.0 / 3.0  # RoPE time a latent frame step is worth, times the spans below
FRAME_SPANS = (1, 4, 4, 4, 4)  # pixel frames behind each latent frame of a 17-frame chunk


# ---- the packed layout --------------------------------------------------------------------
def _axis(n: int, patch: int, root_area: float) -> torch.Tensor:
    """One spatial RoPE axis: n // patch float64 points, the latent side's share of the
    canvas's root area centred on the unit interval, x 32 (numpy's linspace without the
    end: the released coordinates exactly)."""
    share = n / root_area
    lo = (1.0 - share) / 2.0
    return torch.from_numpy(np.linspace(lo, lo + share, n // patch, endpoint=False)
                            * ROPE_SCALE).to(torch.float64)


def frame_times(latent_frames: int, origin: float) -> torch.Tensor:
    """RoPE time of each latent frame from `origin`: cumulative 5/3 x (1, 4, 4, 4, 4, ...)."""
    steps = torch.tensor([FRAME_TIME * FRAME_SPANS[i % len(FRAME_SPANS)]
                          for i in range(latent_frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), steps[:-1].cumsum(0)])


@dataclass(frozen=True)
class Packed:
    """One prompt's packed sequence: [text | audio | video] row counts, positions [S, 3]
    float64 and modality tags [S]."""

    text: int
    audio: int  # rows: latents a channel x 2 channels
    video: int
    positions: torch.Tensor
    tags: torch.Tensor

    @property
    def length(self) -> int:
        return self.text + self.audio + self.video

    def indices(self, device) -> dict:
        """The transformer's row indices of each stream in the packed sequence."""
        a, v = self.text, self.text + self.audio
        return {"text_indices": torch.arange(0, a, device=device),
                "audio_indices": torch.arange(a, v, device=device),
                "video_indices": torch.arange(v, self.length, device=device)}

    def streams(self) -> dict:
        """Each stream's rows of the packed sequence: {stream: (first, count)}."""
        return {"text": (0, self.text), "audio": (self.text, self.audio),
                "video": (self.text + self.audio, self.video)}

    def timestep_rows(self, device) -> torch.Tensor:
        """Each row's timestep index in (video t, audio t): the text and video rows take the
        video's, the audio rows the audio's."""
        out = torch.zeros(self.length, dtype=torch.long)
        out[self.text:self.text + self.audio] = 1
        return out.to(device)


def packed(text: int, latent_frames: int, lh: int, lw: int, audio_latents: int,
           patch=(1, 2, 2)) -> Packed:
    """The packed layout of one prompt of `text` tokens (module doc)."""
    _, ph, pw = patch
    per_frame = (lh // ph) * (lw // pw)
    n_audio = audio_latents * fam.STEREO
    n_video = latent_frames * per_frame
    pos = torch.zeros(text + n_audio + n_video, 3, dtype=torch.float64)
    pos[:text, 0] = torch.arange(text, dtype=torch.float64)
    root = float(np.sqrt(lh * lw))
    hs, ws = _axis(lh, ph, root), _axis(lw, pw, root)
    a0 = text
    t_audio = float(text) + torch.arange(audio_latents, dtype=torch.float64)
    pos[a0:a0 + n_audio, 0] = t_audio.repeat(fam.STEREO)
    pos[a0:a0 + audio_latents, 2] = float(ws[0])
    pos[a0 + audio_latents:a0 + n_audio, 2] = float(ws[-1])
    v0 = a0 + n_audio
    grid = torch.stack([g.reshape(-1) for g in torch.meshgrid(hs, ws, indexing="ij")], -1)
    video = torch.empty(latent_frames, per_frame, 3, dtype=torch.float64)
    video[:, :, 0] = frame_times(latent_frames, float(text))[:, None]
    video[:, :, 1:] = grid[None]
    pos[v0:] = video.reshape(-1, 3)
    tags = torch.full((pos.shape[0],), fam.VIDEO_TAG, dtype=torch.long)
    tags[:text] = fam.TEXT_TAG
    tags[a0:v0] = fam.AUDIO_TAG
    return Packed(text, n_audio, n_video, pos, tags)


# ---- latents ------------------------------------------------------------------------------
def patchify(x: torch.Tensor, patch=(1, 2, 2)) -> torch.Tensor:
    """[B, C, T, h, w] -> rows [B, T/pt x h/ph x w/pw, C x pt x ph x pw], frame-major."""
    pt, ph, pw = patch
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, -1, c * pt * ph * pw)


def unpatchify(rows: torch.Tensor, t: int, h: int, w: int, channels: int,
               patch=(1, 2, 2)) -> torch.Tensor:
    """The inverse of `patchify` for a [B, C, t, h, w] latent."""
    pt, ph, pw = patch
    b = rows.shape[0]
    x = rows.reshape(b, t // pt, h // ph, w // pw, channels, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, channels, t, h, w)


def audio_rows(audio: torch.Tensor) -> torch.Tensor:
    """The audio latent [B, 2, 32, N] (stereo, channels, latents) -> rows [B, 2N, 32], the
    left channel's latents then the right's."""
    return audio.permute(0, 1, 3, 2).reshape(audio.shape[0], -1, audio.shape[2])


def audio_latent(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `audio_rows`."""
    return rows.reshape(rows.shape[0], fam.STEREO, n, rows.shape[-1]).permute(0, 1, 3, 2)


# ---- the two schedules --------------------------------------------------------------------
def shifted(base, shift: float):
    """A point of the unshifted grid (1 - t) -> its sigma on a schedule of `shift`."""
    return shift * base / (1 + (shift - 1) * base)


def unshifted(sigma, shift: float):
    """The inverse of `shifted`: a sigma of a schedule of `shift` -> its unshifted point."""
    return sigma / (shift + sigma * (1.0 - shift))


def sigmas(points: int, shift: float) -> torch.Tensor:
    """MiniMax-H3's sigma grid of `points` points (the last 0): linspace(1, 0) shifted,
    repeated values collapsed, fp32 (the pipeline's scheduler's)."""
    base = torch.linspace(1.0, 0.0, int(points), dtype=torch.float32)
    return torch.unique_consecutive(shifted(base, shift))


@dataclass(frozen=True)
class Schedules:
    """A run's video and audio sigmas (fp32, the last 0), one model call a step."""

    video: torch.Tensor
    audio: torch.Tensor

    @classmethod
    def make(cls, steps: int, video_shift: float = fam.VIDEO_SHIFT,
             audio_shift: float = fam.AUDIO_SHIFT) -> "Schedules":
        v, a = sigmas(steps + 1, video_shift), sigmas(steps + 1, audio_shift)
        if len(v) != len(a):
            raise ValueError(f"{steps} steps: the video and audio schedules have {len(v) - 1} "
                             f"and {len(a) - 1} distinct steps; use fewer steps")
        return cls(v, a)

    def timesteps(self) -> torch.Tensor:
        """[steps, 2]: each step's (video t, audio t), t = 1 - sigma."""
        return torch.stack([1.0 - self.video[:-1], 1.0 - self.audio[:-1]], 1)

    def audio_ratio(self) -> torch.Tensor:
        """[steps]: the audio's sigma step over the video's (module doc)."""
        return (self.audio[:-1] - self.audio[1:]) / (self.video[:-1] - self.video[1:])


# ---- one call -----------------------------------------------------------------------------
def call(transformer, video, audio, text, t_pair, layout: Packed, attention_kwargs=None):
    """One transformer call for one prompt's rows (a batch of them shares the layout):
    video rows [B, Nv, 96], audio rows [B, Na, 32], text states [B, T, D]; `t_pair` the
    step's (video t, audio t). Returns the data-ward velocities (video, audio), fp32."""
    dev = video.device
    ts, idx = torch.unique(t_pair.float().to(dev), sorted=True, return_inverse=True)
    rows = idx[layout.timestep_rows(dev)]
    v, a = transformer(
        hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text,
        timestep=ts, timestep_indices=rows, token_tags=layout.tags.to(dev),
        position_ids=layout.positions.to(dev), attention_kwargs=attention_kwargs,
        return_dict=False, **layout.indices(dev))
    return v.float(), a.float()


def encode_prompt(text_encoder, tokenizer, prompt: str, device, dtype) -> torch.Tensor:
    """A prompt -> the Qwen3-VL hidden state the transformer reads ([1, T, 5120]): the prompt
    as it is (no template, no special tokens), every token text."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("MiniMax-H3 needs a prompt of at least one token")
    layers = text_encoder.config.text_config.num_hidden_layers
    if layers <= fam.TEXT_LAYER:
        raise ValueError(f"MiniMax-H3 reads hidden state {fam.TEXT_LAYER} of its Qwen3-VL; "
                         f"this text encoder has {layers} layers")
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = text_encoder.model(input_ids=x, attention_mask=torch.ones_like(x),
                             mm_token_type_ids=torch.zeros_like(x), use_cache=False,
                             output_hidden_states=True)
    return out.hidden_states[fam.TEXT_LAYER].to(dtype)

