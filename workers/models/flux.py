"""FLUX.1: packed 2x2 latents, text tokens first, RoPE ids, embedded guidance, true CFG."""
from __future__ import annotations

import numpy as np
import torch

from ..processors import FluxShardedAttnProcessor
from ..sequence_parallel import SequenceLayout
from . import latent_layout
from .base import DiTAdapter, text_encoder_device_of
from .facts import CLASS_BY_ARCH, dynamic_shift_args


def _token_counts(transformer, kw):
    return kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]


class FluxAdapter(DiTAdapter):
    arch = "flux"
    transformer_class = CLASS_BY_ARCH["flux"]
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    pipeline_class = "FluxPipeline"
    layout = SequenceLayout(
        split_inputs={"hidden_states": ("image", 1), "img_ids": ("image", 0),
                      "encoder_hidden_states": ("text", 1), "txt_ids": ("text", 0)},
        split_outputs={},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        attention_processor=FluxShardedAttnProcessor,
        replaces=("FluxAttnProcessor", "FluxAttnProcessor2_0"),
    )

    def pack(self, x):
        return latent_layout.pack(self.arch, x)

    def unpack(self, x, height, width):
        return latent_layout.unpack(self.arch, x, height, width)

    def latent_rows(self, x, r0, r1, cols):  # packed [B, rows*cols, 4 * channels]
        return x.narrow(1, r0 * cols, (r1 - r0) * cols)

    @staticmethod
    def image_ids(height, width, device, dtype):
        h, w = height // 16, width // 16
        ids = torch.zeros(h, w, 3)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        return ids.reshape(h * w, 3).to(device=device, dtype=dtype)

    def timesteps(self, scheduler, steps, latents, device):
        # FLUX's schedule: linear sigmas, shifted by the image token count (dynamic shift)
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        c = scheduler.config
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if c.get("use_flow_sigmas"):
            sigmas = None
        mu = calculate_shift(latents.shape[1], *dynamic_shift_args("flux", c))
        if sigmas is None:
            scheduler.set_timesteps(steps, device=device, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler.timesteps

    def encode(self, model, texts, max_sequence_length):
        pe, pooled, ids = model.encoder.encode_prompt(
            prompt=list(texts), prompt_2=None, device=text_encoder_device_of(model),
            num_images_per_prompt=1, max_sequence_length=max_sequence_length)
        return {"encoder_hidden_states": pe, "pooled_projections": pooled, "txt_ids": ids}

    def conditioning(self, cond, pooled):
        # ComfyUI's FLUX CONDITIONING: T5 states and CLIP pooled; text ids are all zero
        ids = torch.zeros(cond.shape[1], 3, dtype=cond.dtype)
        return {"encoder_hidden_states": cond, "pooled_projections": pooled, "txt_ids": ids}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        tr = model.transformer
        b = latents.shape[0]
        g = None
        if tr.config.guidance_embeds:  # one value for the batch, or one per row
            g = (guidance if torch.is_tensor(guidance) else torch.tensor(float(guidance)))
            g = g.to(latents.device, torch.float32).expand(b)
        ids = extra["img_ids"]
        return tr(hidden_states=latents, timestep=t.expand(b).to(latents.dtype) / 1000,
                  guidance=g, pooled_projections=cond["pooled_projections"],
                  encoder_hidden_states=cond["encoder_hidden_states"],
                  txt_ids=cond["txt_ids"], img_ids=ids, joint_attention_kwargs=jak,
                  return_dict=False)[0]

    def forward_extra(self, model, height, width):
        return {"img_ids": self.image_ids(height, width, model.device, model.dtype)}
