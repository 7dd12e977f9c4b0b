"""MiniMax-H3 through ComfyUI's MODEL call: ComfyUI 0.33.0's MiniMaxH3 model (comfy/ldm/minimax)
is called with its nested LATENT's two parts, the video [N, 24, T, h, w] and the sound
[N, 32, 2, L] (32 channels, the stereo pair, L latents), one timestep sigma x 1000 (the
video's sigma), and returns the two parts' predictions -v (the negated data-ward velocity).

Around its network ComfyUI's model does two things the xDiT MODEL does here, on the ranks:

- the audio's own timestep: the video's sigma carried to the audio's schedule (shift 12 ->
  shift 3, `time_shift`), t = 1 - sigma for each stream;
- the sampler carries the sound scaled onto the video's schedule (ComfyUI's model sampling,
  `audio_scale` = video shift / audio shift, 1 where the LATENT is not nested): the model
  sees the sound's own latent, x_carried x sigma_a / sigma_v, and hands back the derivative
  of the carried variable, (1 - scale) x own + (1 + (scale - 1) sigma_a) x (-v_audio).

The two parts travel packed as the loop's rows ([audio | video], minimax_h3.py), so the
adapter's one forward serves both paths.
"""
from __future__ import annotations

import torch

from ..families import minimax_h3 as fam
from . import minimax_h3_layout as lay

PATCH = (1, 2, 2)
ROW_WIDTH = fam.CHANNELS * 4  # a video row's width; the audio rows are padded to it


def time_shift(sigma, from_shift: float, to_shift: float):
    """A sigma on one shifted schedule -> the same base point on another's."""
    return lay.shifted(lay.unshifted(sigma, from_shift), to_shift)


def timestep_runs(host_t, rows: int) -> list:
    """The rows as runs of one timestep each (slices, in row order), read from the host's
    copy of the call's per-row timesteps (CPU: no wait on the device); one run where the
    call does not give them."""
    if host_t is None or rows < 2:
        return [slice(0, rows)]
    values = host_t.reshape(-1).tolist()
    starts = [0] + [i for i in range(1, rows) if values[i] != values[i - 1]]
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [rows])]


def parts_problem(shapes) -> str:
    """What is wrong with a call's parts' per-row shapes, or ""."""
    want = (f"[rows, {fam.CHANNELS}, latent frames, h, w] and the sound [rows, "
            f"{fam.AUDIO_CHANNELS}, {fam.STEREO}, latents]")
    if len(shapes) != 2 or len(shapes[0]) != 4 or len(shapes[1]) != 3:
        return f"MiniMax-H3 takes the video {want} (got {[list(s) for s in shapes]})"
    (c, _, h, w), (ac, st, _) = shapes
    if c != fam.CHANNELS or ac != fam.AUDIO_CHANNELS or st != fam.STEREO:
        return f"MiniMax-H3 takes the video {want} (got {[list(s) for s in shapes]})"
    if h % 2 or w % 2:
        return f"MiniMax-H3's latent height and width must be even (got {h} x {w})"
    return ""


def pack_parts(parts: list) -> torch.Tensor:
    """[video, sound] -> the loop's packed rows [N, sound rows + video rows, 96]."""
    video, audio = parts
    rows = lay.audio_rows(audio.permute(0, 2, 1, 3))  # [N, 2, 32, L]: the channels' rows
    a = torch.nn.functional.pad(rows, (0, ROW_WIDTH - rows.shape[-1]))
    return torch.cat([a.to(video.dtype), lay.patchify(video, PATCH)], 1)


def unpack_parts(pred: torch.Tensor, shapes) -> list:
    """The packed prediction -> [video, sound] of the call's shapes."""
    (c, t, h, w), (ac, st, n) = shapes
    na = st * n
    video = lay.unpatchify(pred[:, na:], t, h, w, c, PATCH)
    audio = lay.audio_latent(pred[:, :na, :ac], n).permute(0, 2, 1, 3)
    return [video, audio]


def parts_extra(shapes, inputs: dict) -> dict:
    """A call's forward inputs: the size, the streams' counts, ComfyUI's model inputs and
    the position tables' per prompt length store."""
    (_, t, h, w), (_, st, n) = shapes
    comfy = {k: float(inputs.get(k, v)) for k, v in fam.COMFY_INPUTS.items()}
    return {"size": (int(h) * 16, int(w) * 16), "counts": (int(t), st * n),
            "comfy": comfy, "positions": {}}


def comfy_steps(t: torch.Tensor, comfy: dict):
    """ComfyUI's per-row timesteps (sigma x 1000; the rows of one forward share it,
    `timestep_runs`) -> ((video t, audio t), the audio's sigma and the carry sigma_a /
    sigma_v per row [rows, 1, 1]), on t's device, fp32."""
    sigma_v = (t.reshape(-1).float() / 1000.0).clamp(min=1e-6)
    sigma_a = time_shift(sigma_v, comfy["sigma_shift_video"], comfy["sigma_shift_audio"])
    ts = torch.cat([1.0 - sigma_v[:1], 1.0 - sigma_a[:1]])
    return ts, sigma_a[:, None, None], (sigma_a / sigma_v)[:, None, None]


def carried_in(audio_rows: torch.Tensor, carry, comfy: dict) -> torch.Tensor:
    """The sampler's carried sound rows -> the sound's own."""
    return audio_rows if comfy["audio_scale"] == 1.0 else audio_rows * carry.to(audio_rows.dtype)


def carried_out(pred_audio, own_audio, sigma_a, comfy: dict):
    """The sound's own prediction (-v) -> the carried variable's, as ComfyUI's model
    returns it (`own_audio`: the sound's own latent rows the network saw)."""
    scale = comfy["audio_scale"]
    if scale == 1.0:
        return pred_audio
    return (1.0 - scale) * own_audio + (1.0 + (scale - 1.0) * sigma_a) * pred_audio
