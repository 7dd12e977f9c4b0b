"""Qwen-Image: 2x2-packed latents with a frame axis (one frame), text first, per-stream RoPE
computed from the image grid and the text length, no pooled text, no guidance embedding,
true CFG whose combination keeps the conditional prediction's norm per token.

Sequence parallelism splits both streams after their input projections, and the RoPE
frequencies with their tokens; the forward derives the text RoPE length from the (split)
text states, so the RoPE module is told the whole text's length. Rows of one call whose prompts have different lengths are padded to the
longest (as QwenImagePipeline pads them); their real lengths travel to the attention as
`text_lengths`, which drops the padded keys (workers/parallel/attention.py).

Edit 2511's `zero_cond_t` modulates each image token by a per-token index (target: the
step's timestep, references: 0) that diffusers builds over the whole image stream; a hook on
each block cuts it with the same plan as the tokens (`shard_modulation`).
"""
from __future__ import annotations

import torch

from .. import families
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from . import latent_layout
from .base import DiTAdapter, text_encoder_device_of
from .flux import dynamic_shift_args, shifted_timesteps


# QwenImageEditPipeline's text encoder reads the prompt together with the reference image
# (vision tokens in the text states): typed prompts need the image itself, not its latent
class QwenImageShardedAttnProcessor:
    """Qwen-Image's double-stream attention on the local token shard: separate image and
    text projections, per-head QK RMSNorm, RoPE applied per stream (the image and text
    frequency shards arrive split with their tokens), text first, outputs projected per
    stream. Returns (image, text) as the stock processor does.

    Rows of one call whose prompts were padded to a common length carry `text_lengths`
    (their real token counts, through the attention kwargs): their padded text keys are
    dropped as diffusers' text mask drops them. The mask itself is not taken (a per-call
    host read); the model's own `encoder_hidden_states_mask` must be None."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None,
                 sp_plan=None, text_lengths=None):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        plan = need_plan(sp_plan)
        if attention_mask is not None or encoder_hidden_states_mask is not None:
            raise ValueError("Qwen-Image text masks reach the parallel attention as "
                             "text_lengths, not as a mask")

        def heads(x):
            return x.unflatten(-1, (-1, attn.inner_dim // attn.heads))

        iq, ik, iv = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (heads(f(encoder_hidden_states))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            iq, ik = attn.norm_q(iq), attn.norm_k(ik)
        if attn.norm_added_q is not None:
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            iq = apply_rotary_emb_qwen(iq, img_freqs, use_real=False)
            ik = apply_rotary_emb_qwen(ik, img_freqs, use_real=False)
            if tq.shape[1]:  # PipeFusion's later patches carry no text
                tq = apply_rotary_emb_qwen(tq, txt_freqs, use_real=False)
                tk = apply_rotary_emb_qwen(tk, txt_freqs, use_real=False)
        query, key, value = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
        out = self.attention(query, key, value, plan, ("text", "image"), attn,
                             text_lengths=text_lengths)
        out = out.flatten(2, 3).to(query.dtype)
        text = encoder_hidden_states.shape[1]
        txt, img = out[:, :text], out[:, text:]
        img = attn.to_out[0](img.contiguous())
        if len(attn.to_out) > 1:
            img = attn.to_out[1](img)
        return img, attn.to_add_out(txt.contiguous())


EDIT_PROMPTS = ("a Qwen-Image-Edit folder encodes each prompt together with its reference "
                "image: give the image (--image FILE, GenerationRequest.reference_images) "
                "rather than a reference latent, or the prompts as CONDITIONING (ComfyUI's "
                "TextEncodeQwenImageEdit, or positive / negative from "
                "QwenImageEditPipeline.encode_prompt(prompt, image=...))")
EDIT_ONE_IMAGE = ("QwenImageEditPipeline encodes the prompt with one reference image; got "
                  "{n}: give one image")
ZERO_COND_ONLY = ("reference method 'index_timestep_zero' (references at timestep 0) needs a "
                  "Qwen-Image-Edit 2511 transformer (zero_cond_t), which this model is not: "
                  "use 'index'")
EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")


def shard_modulation(block, args, kwargs):
    """Forward pre-hook of each transformer block of a `zero_cond_t` model (Qwen-Image-Edit
    2511): diffusers builds `modulate_index` (0: a target token, modulated at the step's
    timestep; 1: a reference token, at timestep 0) over the whole image stream, while under
    sequence parallelism the block holds this rank's token slice (padded to the longest
    shard). The index is cut with the same plan as the tokens, so each local token keeps its
    own choice whichever ranks the target/reference boundary falls between (padding: 0, a
    token nothing reads). Without a plan (one process) the index is left whole."""
    index = kwargs.get("modulate_index")
    plan = (kwargs.get("joint_attention_kwargs") or {}).get("sp_plan")
    if index is None or plan is None:
        return args, kwargs
    return args, dict(kwargs, modulate_index=plan.shard(index, 1, "image"))


def processor_without_video() -> None:
    """QwenImageEditPipeline's processor (Qwen2VLProcessor) as an image processor and a
    tokenizer: transformers 5 lists a processor's parts from its __init__ signature and would
    build (and load) a video processor too, which needs torchvision (not a dependency of
    this pack; the Edit pipeline gives the processor images only). Idempotent; a worker is
    a process of its own (the tiny Edit folder's builder does the same,
    comfyui_xdit/testmodels/qwen_image.patch_processor_without_video)."""
    from transformers import Qwen2VLProcessor
    Qwen2VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])


def _token_counts(transformer, kw):
    return {"text": kw["encoder_hidden_states"].shape[1], "image": kw["hidden_states"].shape[1]}


class QwenImageAdapter(DiTAdapter):
    family = families.FAMILIES["qwen_image"]
    lora_formats = "diffusers/PEFT, kohya (lora_unet_) or ComfyUI (diffusion_model.)"
    cfg_rescale = True  # QwenImagePipeline's true CFG keeps the conditional norm
    layout = SequenceLayout(
        split_inputs={},
        split_outputs={"img_in": ("image", 1), "txt_in": ("text", 1),
                       "pos_embed": (("image", 0), ("text", 0))},
        full_lengths={"pos_embed": {"max_txt_seq_len": "text"}},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        streams=families.FAMILIES["qwen_image"].tokens,
        attention_processor=QwenImageShardedAttnProcessor,
        replaces=("QwenDoubleStreamAttnProcessor2_0",),
        kwargs_name="attention_kwargs",
    )

    def assemble(self, path, *args, **kwargs):
        if self.pipeline_class in EDIT_PIPELINES:
            processor_without_video()  # before the Edit pipeline loads its processor
        return super().assemble(path, *args, **kwargs)

    @staticmethod
    def _modulation_follows_shards(transformer) -> None:
        """Once per transformer of a `zero_cond_t` model: every block's `modulate_index` is
        cut to the block's own tokens (`shard_modulation`)."""
        if not getattr(transformer.config, "zero_cond_t", False) \
                or getattr(transformer, "_xdit_modulation_hooks", None) is not None:
            return
        transformer._xdit_modulation_hooks = [
            b.register_forward_pre_hook(shard_modulation, with_kwargs=True)
            for b in transformer.transformer_blocks]

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

    @staticmethod
    def _edit(model) -> bool:
        return type(model.encoder).__name__ in EDIT_PIPELINES

    @staticmethod
    def _plus(model) -> bool:
        """QwenImageEditPlusPipeline (Edit 2509 / 2511): several reference images, all of
        them read by the text encoder ("Picture k: <image>" before the prompt)."""
        return type(model.encoder).__name__ == "QwenImageEditPlusPipeline"

    def encode(self, model, texts, max_sequence_length, images=None):
        """`images`: the reference images an Edit folder's text encoder reads with the
        prompt (`encode_reference_images`' prompt_images), as QwenImageEditPipeline passes
        its resized image (QwenImageEditPlusPipeline: every image, as a list) to
        encode_prompt for the prompt and the negative prompt alike."""
        kw = {}
        if self._edit(model):
            if not images:
                raise ValueError(EDIT_PROMPTS)
            kw["image"] = list(images) if self._plus(model) else images[0]
        pe, mask = model.encoder.encode_prompt(
            prompt=list(texts), device=text_encoder_device_of(model), num_images_per_prompt=1,
            max_sequence_length=max_sequence_length, **kw)
        out = {"encoder_hidden_states": pe}
        if mask is not None:  # prompts of different lengths, padded to the longest
            out.update(self.row_text_mask(mask))
        return out

    def conditioning(self, cond, pooled):
        # ComfyUI's Qwen-Image CONDITIONING: the text states, unpadded (one prompt)
        return {"encoder_hidden_states": cond}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        b = latents.shape[0]
        kwargs = dict(self.attention_kwargs(cond, jak) or {})
        hidden, shapes, n = self.with_references(
            latents, extra, getattr(model.transformer.config, "zero_cond_t", False))
        self._modulation_follows_shards(model.transformer)
        out = model.transformer(
            hidden_states=hidden, timestep=t.expand(b).to(latents.dtype) / 1000,
            encoder_hidden_states=cond["encoder_hidden_states"],
            img_shapes=[shapes] * b, attention_kwargs=kwargs, return_dict=False)[0]
        return out if n is None else out[:, :n]

    # ---- reference images (Qwen-Image-Edit) --------------------------------------------
    @staticmethod
    def with_references(latents, extra, zero_cond=True):
        """(the image stream, its img_shapes entries, how many output tokens are the
        latent's prediction (None: all)); `zero_cond`: the transformer gives references
        timestep 0 (False: the MODEL path's `index_timestep_zero` is refused). As QwenImageEditPipeline and ComfyUI's model do,
        each reference's tokens (`extra["ref_tokens"]` [1 or B, M, 64]) follow the latent's
        and its grid (`extra["ref_shapes"]`) follows the latent's in img_shapes: the RoPE
        image table then covers the target and the references in that order, which is the
        order the sequence-parallel split shards them in (image stream, pos_embed's first
        output), so every token keeps its own frequencies on every rank."""
        shapes = [extra["img_shape"]]
        refs = extra.get("ref_tokens")
        if refs is None:
            return latents, shapes, None
        if extra.get("references_first"):
            raise ValueError("PipeFusion does not run Qwen-Image references (its RoPE "
                             "places them after the image); use USP, CFG or data parallel")
        shapes += [tuple(s) for s in extra["ref_shapes"]]
        if extra.get("ref_method") == "index_timestep_zero" and not zero_cond:
            raise ValueError(ZERO_COND_ONLY)
        hidden = torch.cat([latents, refs.expand(latents.shape[0], -1, -1)], 1)
        return hidden, shapes, latents.shape[1]

    def _check_method(self, method, transformer=None) -> None:
        """`index_timestep_zero` (ComfyUI's name for 2511's references at timestep 0) runs
        only where the transformer does that itself (`zero_cond_t`); `index` on such a
        transformer still gives timestep 0 (the request's default resolves to `index`)."""
        if method is not None and method not in self.reference_methods():
            raise ValueError(f"reference method {method!r} is not one of "
                             f"{list(self.reference_methods())} for {self.family.name}")
        if method == "index_timestep_zero" and transformer is not None \
                and not getattr(transformer.config, "zero_cond_t", False):
            raise ValueError(ZERO_COND_ONLY)

    @staticmethod
    def reference_shapes(sizes) -> tuple:
        """img_shapes entries (frame, token rows, token columns) of references of `sizes`
        (latent pixels; odd sizes round up: the latent is padded to whole tokens)."""
        return tuple((1, (h + 1) // 2, (w + 1) // 2) for h, w in sizes)

    def reference_extra(self, extra, sizes, method, height, width, device) -> dict:
        """The MODEL path's forward inputs for references of `sizes` (latent pixels)."""
        self._check_method(method)
        return {"ref_shapes": self.reference_shapes(sizes), "ref_method": method}

    def reference_inputs(self, model, raws, method, height, width) -> dict:
        """References as ComfyUI LATENTs (raw VAE space [1 or B, 16, (1,) h, w]) -> {"tokens":
        [1 or B, M, 64] model space ((raw - mean) / std, packed, as QwenImageEditPipeline
        encodes its image and ComfyUI's process_in does), "shapes": their img_shapes
        entries} (CPU, fp32). An odd h or w (ComfyUI's TextEncodeQwenImageEditPlus sizes its
        VAE image to 8 pixels) is padded circularly to whole tokens, as ComfyUI's model pads
        it (before normalising here: a per-channel affine map commutes with the copy)."""
        import torch.nn.functional as F
        self._check_method(method, model.transformer)
        channels = int(model.transformer.config.in_channels) // 4
        for i, r in enumerate(raws):
            framed = torch.is_tensor(r) and r.dim() == 5 and r.shape[2] == 1
            if not torch.is_tensor(r) or (r.dim() != 4 and not framed) \
                    or r.shape[1] != channels:
                got = tuple(r.shape) if torch.is_tensor(r) else type(r).__name__
                raise ValueError(f"reference latent #{i + 1} must be [1 or batch, {channels}, "
                                 f"(1,) h, w] for this {self.family.name} model (got {got})")

        def whole_tokens(r):
            r = r[:, :, 0] if r.dim() == 5 else r
            ph, pw = r.shape[-2] % 2, r.shape[-1] % 2
            return F.pad(r.float(), (0, pw, 0, ph), mode="circular") if ph or pw else r
        scale, shift = self.scale_shift(model)
        toks = [latent_layout.to_model(self.arch, whole_tokens(r), scale, shift) for r in raws]
        b = max(t.shape[0] for t in toks)
        return {"tokens": torch.cat([t.expand(b, -1, -1) for t in toks], 1).contiguous(),
                "shapes": self.reference_shapes([(int(r.shape[-2]), int(r.shape[-1]))
                                                 for r in raws])}

    def encode_reference_images(self, model, images, height, width) -> dict:
        """As QwenImageEditPipeline prepares its image: resized to a ~1024^2 area of its
        aspect ratio, each side a multiple of 32 (`calculate_dimensions`), preprocessed to
        -1..1, and the one frame VAE-encoded: the raw latent [1, 16, 1, h/8, w/8] (the
        LATENT ComfyUI's reference carries; `reference_inputs` normalises it, (z - mean) /
        std, as the pipeline does). An Edit folder's text encoder reads the resized image
        with the prompt (one image); a plain Qwen-Image folder encodes its text alone.
        QwenImageEditPlusPipeline takes several images: each is VAE-encoded at its own
        ~1024^2 size and read by the text encoder at a ~384^2 one."""
        from diffusers.image_processor import VaeImageProcessor

        from .base import vae_mode, vae_scale_factor
        edit, plus = self._edit(model), self._plus(model)
        if edit and not plus and len(images) != 1:
            raise ValueError(EDIT_ONE_IMAGE.format(n=len(images)))
        if plus:
            from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as mod
            vae_area, prompt_area = mod.VAE_IMAGE_SIZE, mod.CONDITION_IMAGE_SIZE
        else:
            from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as mod
            vae_area = 1024 * 1024
        proc = VaeImageProcessor(vae_scale_factor=vae_scale_factor(model) * 2)
        latents, prompt_images = [], []
        for img in images:
            ratio = img.size[0] / img.size[1]
            cw, ch = mod.calculate_dimensions(vae_area, ratio)[:2]
            if plus:  # the text encoder's copy at its own size; the VAE's from the original
                pw, ph = mod.calculate_dimensions(prompt_area, ratio)[:2]
                prompt_images.append(proc.resize(img, ph, pw))
                pixels = img
            else:  # one resized image for both
                pixels = proc.resize(img, ch, cw)
                prompt_images.append(pixels)
            latents.append(vae_mode(model, proc.preprocess(pixels, ch, cw).unsqueeze(2)))
        return {"latents": latents, "prompt_images": prompt_images if edit else None}

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

    def decode(self, model, raw, group=None, control=None, weights=()):
        """The causal 3-D VAE decodes the single frame [B, 16, 1, h, w]; under a group in row
        bands over its ranks (workers/parallel/vae_parallel.py, collective; the latents are needed on
        group rank 0 only, the image comes back there and None elsewhere; too few latent rows:
        rank 0 decodes alone)."""
        img = self.decode_video(model, raw, group, control, weights)
        if img is None:
            return None
        img = img[:, :, 0]  # [B, 3, frames, H, W]: the one frame
        return (img.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()

    @staticmethod
    def bfl_to_diffusers(sd, config):
        return sd  # ComfyUI's Qwen-Image files use diffusers' names
