"""FLUX.2 diffusers folders, [klein] (Flux2KleinPipeline: Qwen3 text encoder, no guidance
embedding) and [dev] (Flux2Pipeline: Mistral-3 text encoder, embedded guidance): 32-channel
VAE latents patchified 2x2 into 128 channels and normalised per channel by the VAE's
batch-norm statistics, no pooled text output, 4-axis RoPE ids (t, h, w, l) for text and
image, text first."""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from .. import families
from ..parallel.processors import joint_text_image_qkv, need_plan
from .base import text_encoder_device_of
from .flux import FluxAdapter

# The kohya FLUX.2 modules diffusers' converter maps; it drops any other lora_unet_ module
# with only a log warning (a FLUX.1 LoRA's img_mod / modulation layers, say), which would
# run part of the LoRA silently, so they are refused.
class Flux2ShardedAttnProcessor:
    """FLUX.2 attention on the local token shard, for both of its attention modules (one
    processor instance serves every module, so it tells them apart by their layers):

    - `Flux2Attention` (double blocks): separate image and text projections, text first;
      called as (attn, hidden_states, encoder_hidden_states, attention_mask, rotary).
    - `Flux2ParallelSelfAttention` (single blocks): one fused projection producing q, k, v
      and the SwiGLU MLP input, one fused output projection over [attention, MLP];
      called as (attn, hidden_states, attention_mask, rotary).
    """

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, *args, sp_plan=None, **kwargs):
        plan = need_plan(sp_plan)
        single = hasattr(attn, "to_qkv_mlp_proj")
        args = args + (None,) * (3 - len(args))
        if single:
            encoder_hidden_states, (attention_mask, rotary) = None, args[:2]
        else:
            encoder_hidden_states, attention_mask, rotary = args[:3]
        attention_mask = kwargs.get("attention_mask", attention_mask)
        rotary = kwargs.get("image_rotary_emb", rotary)
        encoder_hidden_states = kwargs.get("encoder_hidden_states", encoder_hidden_states)
        if attention_mask is not None:
            raise ValueError("attention masks are not supported under sequence parallelism")

        mlp = None
        if single:
            fused = attn.to_qkv_mlp_proj(hidden_states)
            qkv_width = 3 * attn.inner_dim
            qkv, mlp = fused[..., :qkv_width], fused[..., qkv_width:]
            query, key, value = qkv.chunk(3, dim=-1)
        elif getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = joint_text_image_qkv(attn, query, key, value, encoder_hidden_states, rotary)

        out = self.attention(query, key, value, plan, ("text", "image"), attn)
        out = out.flatten(2, 3).to(query.dtype)

        if single:
            return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_out, out = out[:, :text], out[:, text:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            encoder_out = attn.to_add_out(encoder_out.contiguous())
            return out, encoder_out
        return attn.to_out[1](attn.to_out[0](out))


_KOHYA = re.compile(r"lora_unet_(double_blocks_\d+_(img|txt)_(attn_qkv|attn_proj|mlp_0|mlp_2)"
                    r"|single_blocks_\d+_linear[12]|img_in|txt_in|time_in_in_layer"
                    r"|time_in_out_layer|final_layer_linear)")


def empirical_mu(image_tokens: int, steps: int) -> float:
    """FLUX.2's schedule shift: a line in the step count through fits at 10 and 200 steps,
    each linear in the image token count (above 4300 tokens the 200-step fit alone)."""
    slope_200, icpt_200 = 0.00016927, 0.45666666
    slope_10, icpt_10 = 8.73809524e-05, 1.89833333
    at_200 = slope_200 * image_tokens + icpt_200
    if image_tokens > 4300:
        return float(at_200)
    at_10 = slope_10 * image_tokens + icpt_10
    per_step = (at_200 - at_10) / 190.0
    return float(at_200 + (steps - 200) * per_step)


class Flux2Adapter(FluxAdapter):
    """FLUX.1's token layout, packing and patch rows (inherited); its own processors,
    schedule, text encoder, ids and latent space. `path` (a diffusers folder) picks the
    pipeline class whose encode_prompt turns prompts into text states: the text encoders
    of [dev] and [klein] differ, their transformers only in the guidance embedding."""
    family = families.FAMILIES["flux2"]
    lora_alphas = False
    lora_formats = "diffusers/PEFT, kohya (lora_unet_) or BFL/ComfyUI (diffusion_model.)"
    layout = dataclasses.replace(
        FluxAdapter.layout, attention_processor=Flux2ShardedAttnProcessor,
        replaces=("Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"))

    def check_lora_keys(self, path, keys):
        from ..loading.lora import LoraError
        unknown = sorted({k.split(".")[0] for k in keys if k.startswith("lora_unet_")
                          and not _KOHYA.fullmatch(k.split(".")[0])})
        if unknown:
            raise LoraError(f"LoRA file {path}: {len(unknown)} kohya modules are not FLUX.2 "
                            f"layers, e.g. {unknown[0]!r}; is it a LoRA for another model "
                            f"(FLUX.1)? Give a LoRA trained for this FLUX.2 model")

    @staticmethod
    def bfl_to_diffusers(sd, config):
        from ..loading.single_file import convert_flux2_bfl
        return convert_flux2_bfl(sd)

    def scale_shift(self, model) -> tuple:
        """Per packed channel: (1 / sqrt(running_var + eps), running_mean) of the VAE's
        batch norm, as lists of 128 floats (read once from the VAE's weights)."""
        # a single file has no VAE: its loader gives the statistics in vae_config
        cached = getattr(model, "_flux2_bn", None) or model.vae_config.get("latent_bn")
        if cached is None:
            from safetensors import safe_open
            folder = os.path.join(model.path, "vae")
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            mean = var = None
            for name in files:
                with safe_open(os.path.join(folder, name), "pt") as f:
                    keys = set(f.keys())
                    if "bn.running_mean" in keys:
                        mean = f.get_tensor("bn.running_mean").double()
                        var = f.get_tensor("bn.running_var").double()
            if mean is None:
                raise ValueError(f"{folder} has no bn.running_mean: not a FLUX.2 VAE")
            eps = float(model.vae_config.get("batch_norm_eps", 1e-4))
            std = torch.sqrt(var + eps)
            cached = ((1.0 / std).float().tolist(), mean.float().tolist())
            model._flux2_bn = cached
        return cached

    def schedule_mu(self, scheduler, image_tokens: int, steps: int) -> float:
        return empirical_mu(image_tokens, steps)

    def encode(self, model, texts, max_sequence_length):
        pe, ids = model.encoder.encode_prompt(
            prompt=list(texts), device=text_encoder_device_of(model), num_images_per_prompt=1,
            max_sequence_length=max_sequence_length)
        return {"encoder_hidden_states": pe, "txt_ids": ids[0]}

    def conditioning(self, cond, pooled):
        ids = torch.zeros(cond.shape[1], 4, dtype=cond.dtype)
        ids[:, 3] = torch.arange(cond.shape[1], dtype=cond.dtype)
        return {"encoder_hidden_states": cond, "txt_ids": ids}

    # references: 4-axis ids (t, h, w, l), t = 10, 20, ... (diffusers' Flux2 pipelines)
    id_axes = 4
    reference_index_step = 10

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        tr = model.transformer
        b = latents.shape[0]
        g = self.guidance_rows(guidance, b, latents.device) if tr.config.guidance_embeds \
            else None
        hidden, ids, keep = self.with_references(latents, extra)
        out = tr(hidden_states=hidden, timestep=t.expand(b).to(latents.dtype) / 1000,
                 guidance=g, encoder_hidden_states=cond["encoder_hidden_states"],
                 txt_ids=cond["txt_ids"], img_ids=ids,
                 joint_attention_kwargs=jak, return_dict=False)[0]
        return out if keep is None else out[:, keep]

    def encode_reference_images(self, model, images, height, width) -> dict:
        """As Flux2KleinPipeline prepares each of its images: checked (>= 64 px a side,
        aspect <= 8), shrunk to a 1024^2 area when larger, cropped to whole tokens,
        preprocessed to -1..1, VAE-encoded, patchified and normalised by the VAE's batch
        norm: ComfyUI's 128-channel FLUX.2 LATENT [1, 128, h/16, w/16]."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
        from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

        from .base import vae_mode, vae_scale_factor
        multiple_of = vae_scale_factor(model) * 2
        proc = Flux2ImageProcessor(vae_scale_factor=multiple_of)
        out = []
        for i, img in enumerate(images):
            try:
                proc.check_image_input(img)
            except ValueError as e:
                raise ValueError(f"reference image #{i + 1}: {e}") from None
            iw, ih = img.size
            if iw * ih > 1024 * 1024:
                img = proc._resize_to_target_area(img, 1024 * 1024)
                iw, ih = img.size
            iw, ih = iw // multiple_of * multiple_of, ih // multiple_of * multiple_of
            pixels = proc.preprocess(img, height=ih, width=iw, resize_mode="crop")
            lat = Flux2KleinPipeline._patchify_latents(vae_mode(model, pixels))
            bn = model.vae.bn
            mean = bn.running_mean.view(1, -1, 1, 1).float().cpu()
            std = torch.sqrt(bn.running_var.view(1, -1, 1, 1)
                             + model.vae.config.batch_norm_eps).float().cpu()
            out.append((lat - mean) / std)
        return {"latents": out, "prompt_images": None}

    def forward_extra(self, model, height, width):
        return {"img_ids": self.image_ids(height, width, model.device, model.dtype)}
