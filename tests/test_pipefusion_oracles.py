"""PipeFusion's stale-K/V oracle (tests/test_pipefusion_reference.py's `Reference` loop) for
SD3 and FLUX.2, from diffusers' transformers and pipelines alone.

The loop is the reference's: token rows cut into bands, warmup steps whole, later steps band
after band, every attention layer a K/V cache of the full sequence per guidance branch that a
forward writes its own tokens' fresh K/V into before its queries attend to all of it; band 0
carries the text tokens, later bands zero text tokens. What a family gives:

* SD3: the latent stays [B, 16, H/8, W/8] for the transformer (the loop keeps it as 2x2
  tokens with diffusers' FLUX packing, so a band is whole token rows); its positional
  embedding is taken per band: the band's rows of the whole grid's crop of `pos_embed`
  (SD3 centres the crop on the grid, so a band alone would get other rows); its joint
  attention puts the image first and the text after (order does not change plain softmax
  attention; the cache keeps text first); its last joint block keeps no text output
  (`context_pre_only`); the schedule is the scheduler's own (static shift), the timestep
  on the 0..1000 scale; real CFG neg + s (pos - neg) with each branch's pooled CLIP text.
* FLUX.2 [klein]: noise on ComfyUI's 128-channel LATENT packed as Flux2KleinPipeline packs
  it; a band takes its rows of the 4-axis image ids (t, h, w, l), so RoPE is per band, and
  band 0 the text ids; the double blocks' attention is per stream, text first, the single
  blocks' one fused projection over [text | image] (with the SwiGLU MLP input beside q, k,
  v); the shared modulations come from the timestep alone (a band modulates as the whole);
  the pipeline's empirical-mu schedule; real CFG (neg + s (pos - neg)) where cfg > 1 (the
  product's; the step-distilled pipeline itself runs without).

Each family's oracle equals its diffusers pipeline when nothing is stale (all steps warmup,
or one band), checked here; the product's pipelined PipeFusion is held to it in the
conformance suite (tests/conformance/test_pipefusion.py; the builder's PIPEFUSION_ORACLE).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest
from test_pipefusion_reference import (TOL, BandState, ChromaReference, Reference, StaleKV,
                                       bands, comfyui_noise, maxdiff, model_to_latent,
                                       pack_flux, unpack_flux)


def _heads(x, heads):
    return x.unflatten(-1, (heads, -1))


class StaleKVJointProcessor(StaleKV):
    """diffusers' JointAttnProcessor2_0 (SD3's joint attention: per-stream projections,
    optional per-head QK norm), except that the queries attend to this layer's K/V cache of
    the full sequence after the forward's own K/V were written into it. The last block's
    text output is dropped (`context_pre_only`), as diffusers' does."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 **kwargs):
        assert attention_mask is None and not kwargs
        assert encoder_hidden_states is not None, \
            "an image-only attention (SD3.5's dual attention) is not part of this oracle"
        h = attn.heads
        iq, ik, iv = (_heads(f(hidden_states), h) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (_heads(f(encoder_hidden_states), h)
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            iq, ik = attn.norm_q(iq), attn.norm_k(ik)
        if attn.norm_added_q is not None:
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
        query, key, value = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))

        out = self.attend(query, key, value).flatten(2, 3).to(query.dtype)

        text = encoder_hidden_states.shape[1]
        txt, img = out[:, :text], out[:, text:]
        img = attn.to_out[1](attn.to_out[0](img.contiguous()))
        if attn.context_pre_only:
            return img, txt
        return img, attn.to_add_out(txt.contiguous())


class StaleKVFlux2Processor(StaleKV):
    """diffusers' Flux2AttnProcessor (double blocks: per-stream projections and per-head QK
    norms, text first) and Flux2ParallelSelfAttnProcessor (single blocks: one fused
    projection of q, k, v and the SwiGLU MLP input over [text | image], one output
    projection over [attention | MLP]), both with RoPE on q and k, except that the queries
    attend to this layer's K/V cache of the full sequence after the forward's own K/V were
    written into it."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        from diffusers.models.embeddings import apply_rotary_emb

        single = hasattr(attn, "to_qkv_mlp_proj")
        args = ((None,) if single else ()) + args  # single blocks pass no text
        encoder_hidden_states, attention_mask, rotary = (args + (None,) * 3)[:3]
        assert attention_mask is None and not kwargs, kwargs
        d = attn.head_dim
        mlp = None
        if single:
            fused = attn.to_qkv_mlp_proj(hidden_states)
            qkv, mlp = fused.split([3 * attn.inner_dim, fused.shape[-1] - 3 * attn.inner_dim],
                                   dim=-1)
            q, k, v = (x.unflatten(-1, (-1, d)) for x in qkv.chunk(3, dim=-1))
        else:
            q, k, v = (f(hidden_states).unflatten(-1, (-1, d))
                       for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:  # double block: text stream first
            tq, tk, tv = (f(encoder_hidden_states).unflatten(-1, (-1, d))
                          for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            q, k, v = torch.cat([tq, q], dim=1), torch.cat([tk, k], dim=1), \
                torch.cat([tv, v], dim=1)
        q = apply_rotary_emb(q, rotary, sequence_dim=1)
        k = apply_rotary_emb(k, rotary, sequence_dim=1)

        out = self.attend(q, k, v).flatten(2, 3).to(q.dtype)

        if single:
            return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
        text = encoder_hidden_states.shape[1]
        txt, img = out[:, :text], out[:, text:]
        return attn.to_out[1](attn.to_out[0](img.contiguous())), \
            attn.to_add_out(txt.contiguous())


class SD3Reference(Reference):
    """SD3: StableDiffusion3Pipeline's text (CLIP-L, CLIP-G, T5; pooled CLIP), noise in
    [B, 16, H/8, W/8], schedule and CFG; the band's rows of the whole grid's positional
    embedding."""

    family = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    processor = StaleKVJointProcessor

    def __init__(self, path):
        super().__init__(path)
        self.grid = (0, 0)  # the whole image's token rows and columns, for the band's crop

    def encode(self, prompts, msl) -> dict:
        pe, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device="cpu",
            num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=msl)
        return {"pe": pe, "pooled": pooled}

    def branches(self, req) -> list:
        pos = self.encode(req.prompt, req.max_sequence_length)
        if not req.cfg or req.cfg <= 1:
            return [pos]
        neg = self.encode([req.negative_prompt] * len(req.prompt), req.max_sequence_length)
        return [neg, pos]

    def sigmas_timesteps(self, steps: int, image_tokens: int):
        """StableDiffusion3Pipeline's schedule: the scheduler's own timesteps for `steps`
        (its static shift; the dynamic shift where the folder's config asks for it)."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import \
            calculate_shift

        sch = FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")
        c, kw = sch.config, {}
        if c.get("use_dynamic_shifting"):
            kw["mu"] = calculate_shift(image_tokens, c.get("base_image_seq_len", 256),
                                       c.get("max_image_seq_len", 4096),
                                       c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        sch.set_timesteps(steps, device="cpu", **kw)
        return sch.sigmas.to(torch.float32), sch.timesteps

    def forward(self, cond, x, t, sl, with_text, rows, cols, req) -> torch.Tensor:
        """The band's latent rows through the transformer, its velocity as 2x2 tokens."""
        band_rows = (sl.stop - sl.start) // cols
        self.grid = (rows, cols)
        enc = cond["pe"] if with_text else cond["pe"][:, :0]
        image = unpack_flux(x[:, sl], band_rows * 16, cols * 16)
        v = self.transformer(hidden_states=image, timestep=t * 1000, encoder_hidden_states=enc,
                             pooled_projections=cond["pooled"], return_dict=False)[0]
        return pack_flux(v)

    def pipeline_kwargs(self, req) -> dict:
        return dict(guidance_scale=req.cfg, negative_prompt=[req.negative_prompt]
                    * len(req.prompt))

    @torch.no_grad()
    def exact(self, req) -> torch.Tensor:
        b = len(req.prompt)
        noise = comfyui_noise(req.seed, (b, 16, req.height // 8, req.width // 8))
        out = self.pipe(prompt=list(req.prompt), height=req.height, width=req.width,
                        num_inference_steps=req.steps, output_type="latent", latents=noise,
                        max_sequence_length=req.max_sequence_length,
                        **self.pipeline_kwargs(req))
        return model_to_latent(out.images, self.path)

    @contextlib.contextmanager
    def band_mode(self, state: BandState):
        """The patch embedding's crop of `pos_embed` for the whole grid, the band's rows of
        it (state.image: the band's tokens)."""
        pe = self.transformer.pos_embed
        whole = pe.cropped_pos_embed
        p = pe.patch_size

        def band_crop(height, width):
            rows, cols = self.grid
            assert width == cols * p and height * cols == (state.image.stop
                                                           - state.image.start) * p
            return whole(rows * p, cols * p)[:, state.image]

        pe.cropped_pos_embed = band_crop
        try:
            with super().band_mode(state):
                yield
        finally:
            del pe.cropped_pos_embed  # back to the class's method


class Flux2Reference(Reference):
    """FLUX.2 [klein]: Flux2KleinPipeline's Qwen3 text (no pooled text, no guidance input),
    noise drawn on ComfyUI's 128-channel LATENT [B, 128, H/16, W/16] and packed as the
    pipeline packs it (token (r, c) = latent pixel (r, c)), 4-axis ids (t, h, w, l) whose
    band rows the band takes, the empirical-mu schedule, real CFG (neg + s (pos - neg));
    its double and single blocks' modulations come from the timestep alone, so a band
    forward modulates as the whole one. LATENT = the normalised 128-channel latent."""

    family = "flux2"
    pipeline_class = "Flux2KleinPipeline"
    transformer_class = "Flux2Transformer2DModel"
    processor = StaleKVFlux2Processor

    def __init__(self, path):
        from diffusers import AutoencoderKLFlux2

        super().__init__(path)
        assert not self.transformer.config.guidance_embeds, "the oracle runs FLUX.2 [klein]"
        # the exact run's pipeline un-normalises its result with the VAE's batch norm
        self.pipe.vae = AutoencoderKLFlux2.from_pretrained(self.path, subfolder="vae")

    def noise(self, seed, b, height, width) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline
        return Flux2KleinPipeline._pack_latents(
            comfyui_noise(seed, (b, 128, height // 16, width // 16)))

    def to_latent(self, x, height, width) -> torch.Tensor:
        return x.permute(0, 2, 1).reshape(x.shape[0], x.shape[2], height // 16, width // 16)

    def encode(self, prompts, msl) -> dict:
        pe, ids = self.pipe.encode_prompt(prompt=list(prompts), device="cpu",
                                          num_images_per_prompt=1, max_sequence_length=msl)
        return {"pe": pe, "txt_ids": ids}

    branches = ChromaReference.branches

    def sigmas_timesteps(self, steps: int, image_tokens: int):
        """Flux2KleinPipeline's: linear sigmas 1..1/N, mu from the token count and steps."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        sch = FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")
        sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device="cpu",
                          mu=compute_empirical_mu(image_tokens, steps))
        return sch.sigmas.to(torch.float32), sch.timesteps

    def image_ids(self, b, rows, cols):
        from diffusers import Flux2KleinPipeline
        return Flux2KleinPipeline._prepare_latent_ids(torch.zeros(b, 1, rows, cols))[0]

    def forward(self, cond, x, t, sl, with_text, rows, cols, req) -> torch.Tensor:
        b = x.shape[0]
        enc, tids = (cond["pe"], cond["txt_ids"]) if with_text else \
            (cond["pe"][:, :0], cond["txt_ids"][:, :0])
        return self.transformer(hidden_states=x[:, sl], timestep=t, guidance=None,
                                encoder_hidden_states=enc, txt_ids=tids,
                                img_ids=self.image_ids(b, rows, cols)[sl],
                                return_dict=False)[0]

    def pipeline_kwargs(self, req) -> dict:
        return dict(guidance_scale=req.cfg or 1.0)

    @torch.no_grad()
    def exact(self, req) -> torch.Tensor:
        """Flux2KleinPipeline (its raw 32-channel result patchified and normalised by the
        VAE's batch norm back into LATENT space)."""
        from diffusers import Flux2KleinPipeline

        assert not req.cfg or req.cfg <= 1, "the pipeline's CFG has an empty negative prompt"
        b = len(req.prompt)
        raw = self.pipe(prompt=list(req.prompt), height=req.height, width=req.width,
                        num_inference_steps=req.steps, output_type="latent",
                        latents=comfyui_noise(req.seed, (b, 128, req.height // 16,
                                                         req.width // 16)),
                        max_sequence_length=req.max_sequence_length,
                        **self.pipeline_kwargs(req)).images
        bn = self.pipe.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.pipe.vae.config.batch_norm_eps)
        return (Flux2KleinPipeline._patchify_latents(raw.float()) - mean) / std


ORACLES = {"sd3": SD3Reference, "flux2": Flux2Reference}


# FLUX.2 [klein]'s pipeline (a step-distilled model) runs no CFG
CFG = {"sd3": 3.0, "flux2": 1.0}


def small_request(family, steps, batch=2) -> GenerationRequest:
    return GenerationRequest(prompt=["a red cat", "a big blue dog"][:batch], seed=11,
                             steps=steps, height=80, width=48, max_sequence_length=8,
                             cfg=CFG[family], negative_prompt="ugly dark")


@pytest.mark.parametrize("family", list(ORACLES))
def test_oracle_is_exact_when_nothing_is_stale(family, model_dir):
    """All steps warmup, or one band: every cache is refreshed before each attention, so the
    oracle is the family's diffusers pipeline (its text, noise, schedule, positional
    embedding, CFG and LATENT conventions), which moved the latent away from its noise; and
    pipelined it is not the pipeline (the staleness is real)."""
    ref = ORACLES[family](model_dir(family))
    req = small_request(family, 3)
    exact = ref.exact(req)
    d_all = maxdiff(ref.run(req, 3, 2), exact)
    d_one = maxdiff(ref.run(req, 1, 1), exact)
    d_stale = maxdiff(ref.run(req, 1, 2), exact)
    noise = ref.noise(req.seed, len(req.prompt), req.height, req.width)
    moved = maxdiff(ref.to_latent(noise, req.height, req.width), exact)
    print(f"\n{family}: all-warmup {d_all:.2e}, 1 band {d_one:.2e}, pipelined {d_stale:.2e}, "
          f"exact moved {moved:.2e} from its noise")
    assert moved > 1e-2, moved  # (not a comparison of two untouched noises)
    assert d_all <= TOL and d_one <= TOL, (d_all, d_one)
    assert d_stale > 2 * TOL, d_stale  # (SD3's tiny model: 5e-4)


@pytest.mark.parametrize("family", list(ORACLES))
def test_band_forward_is_the_whole_forward_slice(family, model_dir):
    """A band's forward (its latent rows with their positional embedding rows or RoPE ids;
    zero text tokens after band 0) against caches a whole forward of the same latents and
    timestep wrote gives that forward's prediction for the band's tokens: the band call is
    the restriction of the whole call (a band given its own crop of SD3's pos_embed, or ids
    counted from its first row, would not be), so staleness is all the oracle adds."""
    ref = ORACLES[family](model_dir(family))
    req = small_request(family, 3)
    rows, cols = req.height // 16, req.width // 16
    cond = ref.branches(req)[-1]
    x = ref.noise(req.seed, 2, req.height, req.width)
    t = ref.sigmas_timesteps(req.steps, rows * cols)[1][1].expand(2) / 1000
    text_len = cond["pe"].shape[1]
    state = BandState(text_len + rows * cols)
    state.text_len = text_len
    with torch.no_grad(), ref.band_mode(state):
        for p, (r0, r1) in enumerate([(0, rows)] + bands(rows, 3)):
            sl = slice(r0 * cols, r1 * cols)
            state.image = sl
            image_pos = text_len + torch.arange(sl.start, sl.stop)
            with_text = p <= 1  # the whole forward, then band 0
            state.positions = torch.cat([torch.arange(text_len), image_pos]) if with_text \
                else image_pos
            v = ref.forward(cond, x, t, sl, with_text, rows, cols, req)
            if p == 0:
                whole = v
            else:
                d = maxdiff(v, whole[:, sl])
                assert d <= TOL, f"{family} band {p - 1}: {d:.3g}"
    assert whole.abs().max() > 0.1
