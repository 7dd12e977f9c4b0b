"""LTX-2's blocks in ComfyUI 0.33.0's order: the video-to-audio attention reads the video
after that block's audio-to-video update.

diffusers' LTX2VideoTransformerBlock (as Lightricks' own and ComfyUI 0.8.0's) feeds both
audio-video attentions the states from before them. ComfyUI 0.33.0's LTXAV adds the
audio-to-video result to the video first and normalises that for the video-to-audio keys.
The xDiT MODEL takes that order where ComfyUI's own model class runs it (the family's
`ComfySpec.model_inputs`), so for the duration of one forward each block gets hooks that
keep the video states at the audio-video step, the audio-to-video output and the block's
cross-attention modulation inputs, and hand the video-to-audio attention the video after the
update, modulated as the block modulates it (its own `get_mod_params` and norm). The hooks
are the call's own (removed when it returns); nothing outlives the forward.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def v2a_after_a2v(transformer):
    """Within: every block of `transformer` runs its video-to-audio attention on the video
    after its audio-to-video update."""
    handles = []
    try:
        for block in transformer.transformer_blocks:
            handles += _hook(block)
        yield
    finally:
        for h in handles:
            h.remove()


def _hook(block) -> list:
    kept: dict = {}

    def block_inputs(module, args, kwargs):
        kept.clear()
        if args or "temb_ca_gate" not in kwargs:
            raise ValueError("LTX-2 blocks in ComfyUI 0.33.0's order need their inputs by "
                             "name (the transformer's inference call)")
        kept.update(scale_shift=kwargs["temb_ca_scale_shift"], gate=kwargs["temb_ca_gate"],
                    batch=int(kwargs["hidden_states"].shape[0]))

    def video_before(module, args, output):
        kept.setdefault("video", args[0])  # the block's own call comes first

    def a2v_output(module, args, output):
        kept["a2v"] = output

    def v2a_inputs(module, args, kwargs):
        a2v = kept.pop("a2v", None)
        if a2v is None:  # no audio-to-video this pass (isolate_modalities): nothing moved
            return None
        table = block.video_a2v_cross_attn_scale_shift_table
        _, _, scale, shift = block.get_mod_params(table[:4, :], kept["scale_shift"],
                                                  kept["batch"])
        gate = block.get_mod_params(table[4:, :], kept["gate"], kept["batch"])[0].squeeze(2)
        video = kept["video"] + gate * a2v
        keys = block.audio_to_video_norm(video) * (1 + scale.squeeze(2)) + shift.squeeze(2)
        return args, dict(kwargs, encoder_hidden_states=keys)

    return [block.register_forward_pre_hook(block_inputs, with_kwargs=True),
            block.audio_to_video_norm.register_forward_hook(video_before),
            block.audio_to_video_attn.register_forward_hook(a2v_output),
            block.video_to_audio_attn.register_forward_pre_hook(v2a_inputs, with_kwargs=True)]
