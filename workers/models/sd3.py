"""SD3/3.5: unpacked latents patchified inside the model, image tokens first, classic CFG."""
from __future__ import annotations

from .. import families
from ..families.sd3 import DYNAMIC_SHIFT_FALLBACK
from ..parallel.processors import SD3ShardedAttnProcessor
from ..parallel.sequence_parallel import SequenceLayout
from .base import DiTAdapter, text_encoder_device_of
from .flux import dynamic_shift_args


def _token_counts(transformer, kw):
    p = transformer.config.patch_size
    h, w = kw["hidden_states"].shape[-2:]
    return kw["encoder_hidden_states"].shape[1], (h // p) * (w // p)


class SD3Adapter(DiTAdapter):
    family = families.FAMILIES["sd3"]
    # PatchEmbed crops its positional table by the input size, so split after embedding.
    layout = SequenceLayout(
        split_inputs={},
        split_outputs={"pos_embed": ("image", 1), "context_embedder": ("text", 1)},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        attention_processor=SD3ShardedAttnProcessor,
        replaces=("JointAttnProcessor2_0", "AttnProcessor2_0"),
    )

    def latent_rows(self, x, r0, r1, cols):  # [B, 16, h, w], 2x2 latent pixels per token
        return x.narrow(2, 2 * r0, 2 * (r1 - r0))

    def timesteps(self, scheduler, steps, latents, device):
        kwargs = {}
        c = scheduler.config
        if c.get("use_dynamic_shifting"):
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift
            p = 2
            h, w = latents.shape[-2:]
            kwargs["mu"] = calculate_shift((h // p) * (w // p), *dynamic_shift_args(c, DYNAMIC_SHIFT_FALLBACK))
        scheduler.set_timesteps(steps, device=device, **kwargs)
        return scheduler.timesteps

    def encode(self, model, texts, max_sequence_length):
        pe, _, pooled, _ = model.encoder.encode_prompt(
            prompt=list(texts), prompt_2=None, prompt_3=None,
            device=text_encoder_device_of(model),
            num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)
        return {"encoder_hidden_states": pe, "pooled_projections": pooled}

    def conditioning(self, cond, pooled):
        # ComfyUI's SD3 CONDITIONING has diffusers' layout: CLIP-L|G padded, then T5
        return {"encoder_hidden_states": cond, "pooled_projections": pooled}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        b = latents.shape[0]
        return model.transformer(hidden_states=latents, timestep=t.expand(b),
                                 encoder_hidden_states=cond["encoder_hidden_states"],
                                 pooled_projections=cond["pooled_projections"],
                                 joint_attention_kwargs=jak, return_dict=False)[0]

    def forward_extra(self, model, height, width):
        return {}

    @staticmethod
    def bfl_to_diffusers(sd, config):
        from ..loading.single_file import convert_sd3_bfl
        return convert_sd3_bfl(sd)
