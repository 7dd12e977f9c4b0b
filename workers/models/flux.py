"""FLUX.1: packed 2x2 latents, text tokens first, RoPE ids, embedded guidance, true CFG."""
from __future__ import annotations

import numpy as np
import torch

from .. import families
from ..families.flux import DYNAMIC_SHIFT
from ..parallel.processors import joint_text_image_qkv, need_plan
from ..parallel.sequence_parallel import SequenceLayout
from . import latent_layout
from .base import DiTAdapter, text_encoder_device_of


class FluxShardedAttnProcessor:
    """FLUX double blocks (text + image streams, text first) and single blocks (one
    concatenated stream); both attend over all text and image tokens. Rows padded to a
    common text length (Chroma's prompts of one batch) carry `text_lengths`, as
    Qwen-Image's do: each row's padded text keys are dropped."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, sp_plan=None, text_lengths=None):
        plan = need_plan(sp_plan)
        if attention_mask is not None:
            raise ValueError("attention masks are not supported under sequence parallelism")

        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key, value = joint_text_image_qkv(attn, query, key, value, encoder_hidden_states,
                                            image_rotary_emb)

        out = self.attention(query, key, value, plan, ("text", "image"), attn,
                             text_lengths=text_lengths)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            encoder_out, out = out[:, :text], out[:, text:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            encoder_out = attn.to_add_out(encoder_out.contiguous())
            return out, encoder_out
        return out


def dynamic_shift_args(config, fallback=DYNAMIC_SHIFT) -> tuple:
    """(base_image_seq_len, max_image_seq_len, base_shift, max_shift) of a scheduler config,
    with the pipeline's fallbacks: the last four arguments of diffusers' calculate_shift."""
    return tuple(config.get(k, fallback[k]) for k in ("base_image_seq_len", "max_image_seq_len",
                                                       "base_shift", "max_shift"))


def _token_counts(transformer, kw):
    return {"text": kw["encoder_hidden_states"].shape[1], "image": kw["hidden_states"].shape[1]}


def shifted_timesteps(scheduler, steps: int, mu: float, device):
    """Linear sigmas 1 .. 1/steps shifted by `mu` (the packed-latent pipelines' rule: FLUX,
    Chroma, Qwen-Image), through the scheduler's own shift and terminal stretch."""
    sigmas = np.linspace(1.0, 1 / steps, steps)
    if scheduler.config.get("use_flow_sigmas"):
        scheduler.set_timesteps(steps, device=device, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    scheduler.set_begin_index(0)
    return scheduler.timesteps


class FluxAdapter(DiTAdapter):
    family = families.FAMILIES["flux"]
    lora_alphas = True
    lora_formats = "diffusers/PEFT or kohya/ComfyUI"
    layout = SequenceLayout(
        split_inputs={"hidden_states": ("image", 1), "img_ids": ("image", 0),
                      "encoder_hidden_states": ("text", 1), "txt_ids": ("text", 0)},
        split_outputs={},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        streams=families.FAMILIES["flux"].tokens,
        attention_processor=FluxShardedAttnProcessor,
        replaces=("FluxAttnProcessor", "FluxAttnProcessor2_0"),
    )

    def pack(self, x):
        return latent_layout.pack(self.arch, x)

    def unpack(self, x, height, width):
        return latent_layout.unpack(self.arch, x, height, width)

    def latent_rows(self, x, r0, r1, cols):  # packed [B, rows*cols, 4 * channels]
        return x.narrow(1, r0 * cols, (r1 - r0) * cols)

    @classmethod
    def image_ids(cls, height, width, device, dtype):
        """RoPE ids of the image tokens: row and column on axes 1 and 2, the other axes 0."""
        h, w = height // 16, width // 16
        ids = torch.zeros(h, w, cls.id_axes)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        return ids.reshape(h * w, cls.id_axes).to(device=device, dtype=dtype)

    def schedule_mu(self, scheduler, image_tokens: int, steps: int) -> float:
        """FLUX.1's shift of the schedule: the dynamic shift by the image token count."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        return calculate_shift(image_tokens, *dynamic_shift_args(scheduler.config))

    def timesteps(self, scheduler, steps, latents, device):
        return shifted_timesteps(scheduler, steps, self.schedule_mu(
            scheduler, latents.shape[1], steps), device)

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
        g = self.guidance_rows(guidance, b, latents.device) if tr.config.guidance_embeds \
            else None
        hidden, ids, keep = self.with_references(latents, extra)
        out = tr(hidden_states=hidden, timestep=t.expand(b).to(latents.dtype) / 1000,
                 guidance=g, pooled_projections=cond["pooled_projections"],
                 encoder_hidden_states=cond["encoder_hidden_states"],
                 txt_ids=cond["txt_ids"], img_ids=ids, joint_attention_kwargs=jak,
                 return_dict=False)[0]
        return out if keep is None else out[:, keep]

    # ---- reference images (FLUX.1 Kontext, FLUX.2) -------------------------------------
    id_axes = 3  # RoPE id axes: (index, row, column)
    reference_index_step = 1  # FLUX.2: 10 (its time coordinate per reference)

    @staticmethod
    def with_references(latents, extra):
        """The image stream the transformer takes: the latent's tokens joined with the
        references' (`extra["ref_tokens"]` [1 or B, M, C], ids `extra["ref_ids"]`), and which
        output tokens are the latent's prediction (None: all of them).

        The references follow the latent, as in the diffusers pipelines and ComfyUI, unless
        the caller puts them first (`extra["references_first"]`): every per-token layer and
        the attention are indifferent to token order (positions come from the ids), so both
        orders compute the same result."""
        ids = extra["img_ids"]
        refs = extra.get("ref_tokens")
        if refs is None:
            return latents, ids, None
        refs = refs.expand(latents.shape[0], -1, -1)
        ref_ids, n, m = extra["ref_ids"], latents.shape[1], refs.shape[1]
        if extra.get("references_first"):
            return (torch.cat([refs, latents], 1), torch.cat([ref_ids, ids]), slice(m, m + n))
        return torch.cat([latents, refs], 1), torch.cat([ids, ref_ids]), slice(0, n)

    def reference_positions(self, sizes, method: str, height: int, width: int) -> list:
        """(index, first row, first column) in token units of each reference in RoPE id
        space; `sizes` [(h, w)] in latent pixels. ComfyUI's FLUX methods: "index" numbers the
        references 1, 2, ...; "offset" gives them all index 1 and puts each next to the
        ones before it (below or to the right, whichever keeps the canvas squarer); "uxo"
        gives index 0 and places them diagonally beyond the image. Odd sizes round up (the
        latent is padded to whole tokens)."""
        method = method or self.reference_methods()[0]
        if method not in self.reference_methods():
            raise ValueError(f"reference method {method!r} is not one of "
                             f"{list(self.reference_methods())} for {self.family.name}")
        rows, cols = height // 16, width // 16
        used_h = used_w = index = 0
        out = []
        for h, w in sizes:
            dh = dw = 0
            if method == "index":
                index += 1
            elif method == "uxo":
                index, dh, dw = 0, 2 * rows + used_h, 2 * cols + used_w
                used_h, used_w = used_h + h, used_w + w
            else:  # offset
                index = 1
                if h + used_h > w + used_w:
                    dw = used_w
                else:
                    dh = used_h
                used_h, used_w = max(used_h, h + dh), max(used_w, w + dw)
            out.append((index * self.reference_index_step, (dh + 1) // 2, (dw + 1) // 2))
        return out

    def reference_ids(self, sizes, method, height, width, device, dtype):
        """RoPE ids [M, axes] of the references' tokens (row-major per reference, in order)."""
        parts = []
        for (h, w), (index, r0, c0) in zip(sizes, self.reference_positions(sizes, method,
                                                                           height, width)):
            th, tw = (h + 1) // 2, (w + 1) // 2
            ids = torch.zeros(th, tw, self.id_axes)
            ids[..., 0] = index
            ids[..., 1] += torch.arange(r0, r0 + th)[:, None]
            ids[..., 2] += torch.arange(c0, c0 + tw)[None, :]
            parts.append(ids.reshape(th * tw, self.id_axes))
        return torch.cat(parts).to(device=device, dtype=dtype)

    def reference_extra(self, extra, sizes, method, height, width, device) -> dict:
        """The forward inputs of references of `sizes` (latent pixels) placed by `method`
        beside a height x width image (the MODEL path's; `extra`: the image's own)."""
        return {"ref_ids": self.reference_ids(sizes, method, height, width, device,
                                              extra["img_ids"].dtype)}

    def reference_inputs(self, model, raws, method, height, width) -> dict:
        """References as ComfyUI LATENTs (a job's; FLUX.1: raw VAE space at 1/8, FLUX.2:
        patchified and normalised at 1/16) -> {"tokens": [1 or B, M, C] model space, "ids":
        [M, axes]} (CPU, fp32), exactly as the pipelines encode theirs."""
        # FLUX.2's LATENT holds one token per pixel (in_channels); FLUX.1's 2x2 pixels
        per_token = self.family.latent.per_token
        channels = int(model.transformer.config.in_channels) // per_token ** 2
        for i, r in enumerate(raws):
            if not torch.is_tensor(r) or r.dim() != 4 or r.shape[1] != channels \
                    or r.shape[-2] % per_token or r.shape[-1] % per_token:
                got = tuple(r.shape) if torch.is_tensor(r) else type(r).__name__
                even = " with h and w even" if per_token == 2 else ""
                raise ValueError(f"reference latent #{i + 1} must be [1 or batch, {channels}, "
                                 f"h, w]{even} for this {self.family.name} model (got {got})")
        scale, shift = self.scale_shift(model)
        toks = [latent_layout.to_model(self.arch, r, scale, shift) for r in raws]
        b = max(t.shape[0] for t in toks)
        # sizes in 1/8-scale latent pixels, as reference_positions counts them
        sizes = [(int(r.shape[-2]) * (2 // per_token), int(r.shape[-1]) * (2 // per_token))
                 for r in raws]
        return {"tokens": torch.cat([t.expand(b, -1, -1) for t in toks], 1).contiguous(),
                "ids": self.reference_ids(sizes, method, height, width, "cpu", torch.float32)}

    def encode_reference_images(self, model, images, height, width) -> dict:
        """FLUX.1 Kontext: as FluxKontextPipeline prepares its image (its default
        `_auto_resize`): resized to the preferred Kontext resolution nearest its aspect ratio,
        to whole tokens, preprocessed to -1..1, and its raw VAE latent (the LATENT a
        ComfyUI reference carries, [1, 16, h/8, w/8]). Several images: each so, each its own
        reference (ComfyUI's FluxKontextImageScale + ReferenceLatent per image)."""
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        from .base import vae_mode, vae_scale_factor
        multiple_of = vae_scale_factor(model) * 2
        proc = VaeImageProcessor(vae_scale_factor=multiple_of)
        out = []
        for img in images:
            ih, iw = proc.get_default_height_width(img)
            _, iw, ih = min((abs(iw / ih - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
            iw, ih = iw // multiple_of * multiple_of, ih // multiple_of * multiple_of
            pixels = proc.preprocess(proc.resize(img, ih, iw), ih, iw)
            out.append(vae_mode(model, pixels))
        return {"latents": out, "prompt_images": None}

    def forward_extra(self, model, height, width):
        return {"img_ids": self.image_ids(height, width, model.device, model.dtype)}

    @staticmethod
    def bfl_to_diffusers(sd, config):
        from ..loading.single_file import convert_flux_bfl
        return convert_flux_bfl(sd, config["num_attention_heads"] * config["attention_head_dim"])
