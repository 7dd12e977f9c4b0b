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

Each family's oracle equals its diffusers pipeline when nothing is stale (all steps warmup,
or one band), checked here; the product's pipelined PipeFusion is held to it in the
conformance suite (tests/conformance/test_pipefusion.py; the builder's PIPEFUSION_ORACLE).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from comfyui_xdit import GenerationRequest
from test_pipefusion_reference import (TOL, BandState, Reference, StaleKV, comfyui_noise,
                                       maxdiff, model_to_latent, pack_flux, unpack_flux)


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


ORACLES = {"sd3": SD3Reference}


def small_request(family, steps, batch=2, cfg=3.0) -> GenerationRequest:
    return GenerationRequest(prompt=["a red cat", "a big blue dog"][:batch], seed=11,
                             steps=steps, height=80, width=48, max_sequence_length=8,
                             cfg=cfg, negative_prompt="ugly dark")


@pytest.mark.parametrize("family", list(ORACLES))
def test_oracle_is_exact_when_nothing_is_stale(family, model_dir):
    """All steps warmup, or one band: every cache is refreshed before each attention, so the
    oracle is the family's diffusers pipeline (its text, noise, schedule, positional
    embedding, CFG and LATENT conventions); and pipelined it is not (the staleness is real)."""
    ref = ORACLES[family](model_dir(family))
    req = small_request(family, 3)
    exact = ref.exact(req)
    d_all = maxdiff(ref.run(req, 3, 2), exact)
    d_one = maxdiff(ref.run(req, 1, 1), exact)
    d_stale = maxdiff(ref.run(req, 1, 2), exact)
    print(f"\n{family}: all-warmup {d_all:.2e}, 1 band {d_one:.2e}, pipelined {d_stale:.2e}")
    assert d_all <= TOL and d_one <= TOL, (d_all, d_one)
    assert d_stale > 2 * TOL, d_stale  # (SD3's tiny model: 5e-4)
