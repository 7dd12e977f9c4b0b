"""LTX-2's audio-video gates as ComfyUI 0.33.0 times them: each stream's cross-attention
gate by the other stream's largest timestep.

With a timestep per token (a noise mask: a start frame at timestep 0), ComfyUI 0.8.0's LTXAV
modulates and gates each stream's audio-video cross-attention by that stream's own tokens'
timesteps (diffusers' use_cross_timestep=False). 0.33.0's keeps the modulation but gates the
audio-to-video update by the sound's largest timestep and the video-to-audio one by the
video's, one value for every token of the stream (ComfyUI takes it over the call's rows,
which KSampler gives one sigma and one mask; the pool takes it per row). diffusers has no
argument for that mix, so for the duration of one forward the two gate embedders get hooks
that replace their input with the other stream's largest timestep (found by the adapter on
the whole rows, before the sequence-parallel hooks shard the video) times the gate factor,
for as many tokens as the embedder is given (a rank's shard). Nothing outlives the forward.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def gated_by_other_max(transformer, video_t, audio_t):
    """Within: `transformer`'s audio-to-video gate reads the sound's largest timestep per row
    of `audio_t` [B, sound tokens], its video-to-audio gate the video's of `video_t`
    [B, video tokens] (both whole, on the pool's timestep scale)."""
    cfg = transformer.config
    factor = float(cfg.cross_attn_timestep_scale_multiplier) / float(cfg.timestep_scale_multiplier)
    rows = int(video_t.shape[0])
    handles = [transformer.av_cross_attn_video_a2v_gate.register_forward_pre_hook(
                   _replace(audio_t.amax(1) * factor, rows), with_kwargs=True),
               transformer.av_cross_attn_audio_v2a_gate.register_forward_pre_hook(
                   _replace(video_t.amax(1) * factor, rows), with_kwargs=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _replace(per_row, rows: int):
    def hook(module, args, kwargs):
        x = args[0]
        tokens = x.numel() // rows  # the tokens this rank's embedder is given, per row
        gate = per_row.to(x.device, x.dtype).repeat_interleave(tokens)
        return (gate, *args[1:]), kwargs
    return hook
