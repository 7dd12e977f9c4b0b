"""Qwen-Image: 2x2-packed latents with a frame axis (one frame), text first, per-stream RoPE
computed from the image grid and the text length, no pooled text, no guidance embedding,
true CFG whose combination keeps the conditional prediction's norm per token.

Sequence parallelism splits both streams after their input projections, and the RoPE
frequencies with their tokens; the forward derives the text RoPE length from the (split)
text states, so the RoPE module is told the whole text's length. Rows of one call whose prompts have different lengths are padded to the
longest (as QwenImagePipeline pads them); their real lengths travel to the attention as
`text_lengths`, which drops the padded keys (workers/attention.py).
"""
from __future__ import annotations

import torch

from .. import families
from ..processors import QwenImageShardedAttnProcessor
from ..sequence_parallel import SequenceLayout
from . import latent_layout
from .base import DiTAdapter, text_encoder_device_of
from .flux import dynamic_shift_args, shifted_timesteps


def _token_counts(transformer, kw):
    return kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]


class QwenImageAdapter(DiTAdapter):
    family = families.FAMILIES["qwen_image"]
    bfl_blocks = {"transformer_blocks": "transformer_blocks"}  # ComfyUI uses diffusers' names
    cfg_rescale = True  # QwenImagePipeline's true CFG keeps the conditional norm
    layout = SequenceLayout(
        split_inputs={},
        split_outputs={"img_in": ("image", 1), "txt_in": ("text", 1),
                       "pos_embed": (("image", 0), ("text", 0))},
        full_lengths={"pos_embed": {"max_txt_seq_len": "text"}},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        attention_processor=QwenImageShardedAttnProcessor,
        replaces=("QwenDoubleStreamAttnProcessor2_0",),
        kwargs_name="attention_kwargs",
    )

    def pack(self, x):
        return latent_layout.pack(self.arch, x)

    def unpack(self, x, height, width):
        return latent_layout.unpack(self.arch, x, height, width)

    def latent_rows(self, x, r0, r1, cols):  # packed [B, rows*cols, 64]
        return x.narrow(1, r0 * cols, (r1 - r0) * cols)

    def schedule_mu(self, scheduler, image_tokens: int, steps: int) -> float:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
        return calculate_shift(image_tokens, *dynamic_shift_args(scheduler.config))

    def timesteps(self, scheduler, steps, latents, device):
        return shifted_timesteps(scheduler, steps, self.schedule_mu(
            scheduler, latents.shape[1], steps), device)

    def encode(self, model, texts, max_sequence_length):
        pe, mask = model.encoder.encode_prompt(
            prompt=list(texts), device=text_encoder_device_of(model), num_images_per_prompt=1,
            max_sequence_length=max_sequence_length)
        out = {"encoder_hidden_states": pe}
        if mask is not None and not bool(mask.all()):  # prompts of different lengths
            out["text_mask"] = mask.bool()
        return out

    def conditioning(self, cond, pooled):
        # ComfyUI's Qwen-Image CONDITIONING: the text states, unpadded (one prompt)
        return {"encoder_hidden_states": cond}

    @staticmethod
    def slice_cond(cond: dict, sl: slice) -> dict:
        return {k: (v[sl] if k in ("encoder_hidden_states", "text_mask") else v)
                for k, v in cond.items()}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        b = latents.shape[0]
        kwargs = dict(jak or {})
        mask = cond.get("text_mask")
        if mask is not None:  # one host read, only for a batch of different prompt lengths
            kwargs["text_lengths"] = tuple(int(n) for n in mask.sum(1).tolist())
        return model.transformer(
            hidden_states=latents, timestep=t.expand(b).to(latents.dtype) / 1000,
            encoder_hidden_states=cond["encoder_hidden_states"],
            img_shapes=[[extra["img_shape"]]] * b, attention_kwargs=kwargs,
            return_dict=False)[0]

    @staticmethod
    def computed_buffers(transformer) -> None:
        """QwenEmbedRope keeps its frequency tables as plain tensors (complex: diffusers does
        not register them as buffers), so a meta-built model has none: made again here, on
        the CPU as diffusers makes them (each call moves them to the device)."""
        rope = transformer.pos_embed
        if rope.pos_freqs.device.type == "meta":
            with torch.device("cpu"):
                transformer.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim,
                                                   scale_rope=rope.scale_rope)

    def forward_extra(self, model, height, width):
        return {"img_shape": (1, height // 16, width // 16)}

    def decode(self, model, raw, group=None, control=None):
        """The causal 3-D VAE decodes the single frame; under a group its rank 0 decodes the
        whole latent (the row bands of workers/vae_parallel split 2-D decoders only)."""
        from .base import load_vae
        if model.vae is None:
            model.vae = load_vae(model)
        if group is not None:
            from ..vae_parallel import decode_on_first
            img = decode_on_first(model.vae, raw, group)
            if img is None:
                return None
        else:
            img = model.vae.decode(raw.to(model.device, model.vae.dtype), return_dict=False)[0]
        img = img[:, :, 0]  # [B, 3, frames, H, W]: the one frame
        return (img.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()

    @staticmethod
    def bfl_to_diffusers(sd, config):
        return sd  # ComfyUI's Qwen-Image files use diffusers' names
