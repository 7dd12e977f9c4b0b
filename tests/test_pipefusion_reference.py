"""An independent oracle for PipeFusion's pipelined (stale K/V) mode, for FLUX, Chroma and
Qwen-Image.

docs/design.md#numerics-rule-4 only says PipeFusion is not exact. What it computes instead is a
definite algorithm, written here once more in a single process from diffusers' transformer,
pipeline and test code alone (nothing from the product's `workers/` package):

* Token rows (height // 16) are cut into `patches` bands of near-equal height, the first
  `rows % patches` bands one row taller. Steps before `warmup` run the whole image in one
  forward (exact, as diffusers' pipeline). Later steps run the bands one after another,
  band 0 first.
* A band's forward computes only the band's image tokens (its latent rows with their
  img_ids, or for Qwen-Image their rows of the RoPE table `pos_embed` computes for the whole
  grid) plus, for band 0 only, the text tokens (Qwen-Image: with the whole text's RoPE
  frequencies); later bands run with zero text tokens.
* Every attention layer holds a K/V cache of the full sequence (text first, then every
  image token, the order of all three families) per guidance branch. A forward first writes
  its fresh K/V into their positions, then its queries attend (plain softmax, no mask) to
  the whole cache: positions not yet refreshed in this step still hold what was written last
  (the previous step, or earlier in this step for bands already computed). The warmup
  forward writes everything.
* With CFG (Chroma: neg + s (pos - neg); Qwen-Image: the same, rescaled per token to the
  conditional prediction's norm) each branch runs the band with its own text and caches.
* After a band's forward(s), its latent rows take the flow-matching Euler step
  x + (sigma_{i+1} - sigma_i) * v with the scheduler's sigmas (linear 1..1/N, dynamic shift).

The attention is a custom processor on diffusers' attention modules that reuses diffusers'
own projection, QK-norm and RoPE code (FLUX/Chroma: `_get_qkv_projections`, `norm_*`,
`apply_rotary_emb`; Qwen-Image: the modules' projections and norms, `apply_rotary_emb_qwen`;
both `dispatch_attention_fn`); only where K/V come from differs. The reference is checked
against the families' diffusers pipelines where nothing is stale (all steps warmup, or one
patch), and a band's forward against the whole forward's slice when the caches hold the same
step's K/V (so the band call, RoPE rows and zero text included, is right).

The product's pipelined PipeFusion must match this reference to fp32 rounding: at 2 stages
for every family with an oracle in the conformance suite (tests/conformance/
test_pipefusion.py; the family's builder names its oracle class here as
PIPEFUSION_ORACLE), and here FLUX at 4 stages (uneven bands, batch 1 and 2). Negative
controls: a reference whose cache is never refreshed after warmup is far from the correct one (so the comparison would catch a product that forgets to refresh), and
the exact result is far from the pipelined one (so the test is not comparing two exact runs).
The pipelined latent is also close to the exact one (relative L2 error, PSNR printed with -s).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool

TOL = 1e-4
FAR = 1e-3  # "far more than TOL" (10x): the negative controls must differ by at least this
GUIDANCE = 3.5  # FLUX's embedded guidance, written out and passed in every request
STEPS = 4
WARMUP = 1
SEED = 11
PROMPTS = ["a photo of a red cat", "a dog on the grass"]


# ---- conventions, written out (docs/design.md#numerics-rule-1, #numerics-rule-5) ------
def comfyui_noise(seed: int, shape) -> torch.Tensor:
    """ComfyUI's prepare_noise: one fp32 CPU draw of the whole latent."""
    return torch.randn(tuple(shape), generator=torch.manual_seed(seed), dtype=torch.float32)


def pack_flux(x: torch.Tensor) -> torch.Tensor:
    import diffusers
    return diffusers.FluxPipeline._pack_latents(x, *x.shape)


def unpack_flux(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    import diffusers
    return diffusers.FluxPipeline._unpack_latents(x, height, width, 8)


def model_to_latent(x: torch.Tensor, path) -> torch.Tensor:
    """Unpacked model latent -> ComfyUI LATENT (raw VAE space), from vae/config.json."""
    import json
    import os
    with open(os.path.join(str(path), "vae", "config.json")) as f:
        c = json.load(f)
    return x.float() / float(c["scaling_factor"]) + float(c.get("shift_factor") or 0.0)


# ---- the reference ---------------------------------------------------------------------
def bands(rows: int, patches: int) -> list:
    """Row bands of near-equal height; the first rows % patches bands one row taller."""
    out, r = [], 0
    for i in range(patches):
        h = rows // patches + (1 if i < rows % patches else 0)
        out.append((r, r + h))
        r += h
    assert r == rows
    return out


class BandState:
    """What the current forward computes, shared by every layer's processor: the guidance
    branch (each has caches of its own), the length of that branch's full text + image
    sequence, the positions in it of the forward's tokens (in the order the attention sees
    them), whether the forward writes its K/V into the caches, and (for a model whose RoPE
    table is computed for the whole grid, Qwen-Image) the band's image tokens and the full
    text length."""

    def __init__(self, full_len: int = 0):
        self.branch = 1
        self.full_len = full_len
        self.positions: torch.Tensor = torch.arange(full_len)
        self.write = True
        self.text_len = 0
        self.image = slice(0, 0)


class StaleKV:
    """The stale K/V attention of one layer: a cache of the full sequence per guidance
    branch; a forward writes its fresh K/V into their positions, then its queries attend
    (plain softmax, no mask) to the whole cache."""

    def __init__(self, state: BandState):
        self.state = state
        self.caches: dict = {}  # branch -> (k, v) [B, full_len, H, D]

    def attend(self, query, key, value):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        st = self.state
        pos = st.positions
        assert pos.numel() == key.shape[1], (pos.numel(), key.shape)
        if st.branch not in self.caches:
            shape = (key.shape[0], st.full_len) + tuple(key.shape[2:])
            self.caches[st.branch] = (key.new_full(shape, float("nan")),
                                      key.new_full(shape, float("nan")))
        k, v = self.caches[st.branch]
        assert k.shape[1] == st.full_len, (k.shape, st.full_len)
        if st.write:
            k[:, pos] = key
            v[:, pos] = value
        assert not torch.isnan(k).any(), "attention over a cache position never written"
        return dispatch_attention_fn(query, k, v)


class StaleKVFluxProcessor(StaleKV):
    """diffusers' FluxAttnProcessor (FLUX and Chroma), except that the queries attend to this
    layer's K/V cache of the full sequence after the forward's own K/V were written into it."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        assert attention_mask is None
        query, key, value, eq, ek, ev = _get_qkv_projections(attn, hidden_states,
                                                             encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:  # double block: text stream first
            eq = attn.norm_added_q(eq.unflatten(-1, (-1, attn.head_dim)))
            ek = attn.norm_added_k(ek.unflatten(-1, (-1, attn.head_dim)))
            ev = ev.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([eq, query], dim=1)
            key = torch.cat([ek, key], dim=1)
            value = torch.cat([ev, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        out = self.attend(query, key, value)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            enc_out, out = out[:, :text], out[:, text:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            return out, attn.to_add_out(enc_out.contiguous())
        return out


class StaleKVQwenProcessor(StaleKV):
    """diffusers' QwenDoubleStreamAttnProcessor2_0 (per-stream projections, per-head QK
    RMSNorm, RoPE per stream with the image and the text frequencies, text first), except
    for where K/V come from. No text mask: the prompts of one call have one length."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        assert attention_mask is None and encoder_hidden_states_mask is None
        text = encoder_hidden_states.shape[1]
        head_dim = attn.inner_dim // attn.heads

        def heads(x):
            return x.unflatten(-1, (-1, head_dim))

        iq, ik, iv = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        tq, tk, tv = (heads(f(encoder_hidden_states))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            iq = attn.norm_q(iq)
        if attn.norm_k is not None:
            ik = attn.norm_k(ik)
        if attn.norm_added_q is not None:
            tq = attn.norm_added_q(tq)
        if attn.norm_added_k is not None:
            tk = attn.norm_added_k(tk)
        img_freqs, txt_freqs = image_rotary_emb
        assert img_freqs.shape[0] == iq.shape[1] and txt_freqs.shape[0] == text
        iq = apply_rotary_emb_qwen(iq, img_freqs, use_real=False)
        ik = apply_rotary_emb_qwen(ik, img_freqs, use_real=False)
        if text:  # (diffusers' complex view cannot take an empty tensor; nothing to rotate)
            tq = apply_rotary_emb_qwen(tq, txt_freqs, use_real=False)
            tk = apply_rotary_emb_qwen(tk, txt_freqs, use_real=False)
        query, key, value = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))

        out = self.attend(query, key, value).flatten(2, 3).to(query.dtype)

        txt, img = out[:, :text], out[:, text:]
        img = attn.to_out[0](img.contiguous())
        if len(attn.to_out) > 1:
            img = attn.to_out[1](img)
        return img, attn.to_add_out(txt.contiguous())


class BandRope(torch.nn.Module):
    """Qwen-Image's `pos_embed` during a band forward: diffusers' QwenEmbedRope computes the
    image frequencies of the whole grid and the text frequencies of the whole text; the band
    takes its image tokens' rows of the first and (band 0) the text's or (later bands) none of
    the second. The transformer asks for the text length it was given (0 for later bands)."""

    def __init__(self, rope, state: BandState):
        super().__init__()
        self.rope, self.state = rope, state

    def forward(self, video_fhw, device=None, max_txt_seq_len=None):
        st = self.state
        img, txt = self.rope(video_fhw, device=device, max_txt_seq_len=st.text_len)
        assert txt.shape[0] == st.text_len and int(max_txt_seq_len) in (0, st.text_len)
        return img[st.image], txt[:int(max_txt_seq_len)]


class Reference:
    """Single-process PipeFusion of one model folder (fp32, CPU): the loop, written once; a
    family gives its pipeline, text, noise, schedule, transformer call and guidance."""

    family = "flux"
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    processor = StaleKVFluxProcessor

    def __init__(self, path):
        import diffusers

        self.path = str(path)
        self.transformer = getattr(diffusers, self.transformer_class).from_pretrained(
            self.path, subfolder="transformer", dtype=torch.float32).eval()
        self.stock = dict(self.transformer.attn_processors)
        self.pipe = getattr(diffusers, self.pipeline_class).from_pretrained(
            self.path, transformer=self.transformer, vae=None, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)

    # ---- family conventions (FLUX) ------------------------------------------------------
    def noise(self, seed, b, height, width) -> torch.Tensor:
        return pack_flux(comfyui_noise(seed, (b, 16, height // 8, width // 8)))

    def to_latent(self, x, height, width) -> torch.Tensor:
        return model_to_latent(unpack_flux(x, height, width), self.path)

    def encode(self, prompts, msl) -> dict:
        pe, pooled, txt_ids = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device="cpu", num_images_per_prompt=1,
            max_sequence_length=msl)
        return {"pe": pe, "pooled": pooled, "txt_ids": txt_ids}

    def branches(self, req) -> list:
        """The text of each guidance branch, negative (0) first where there is CFG."""
        assert not req.cfg or req.cfg <= 1, "the FLUX reference runs embedded guidance only"
        return [self.encode(req.prompt, req.max_sequence_length)]

    def sigmas_timesteps(self, steps: int, image_tokens: int):
        """FLUX's schedule as diffusers' FluxPipeline sets it (Chroma's and Qwen-Image's
        pipelines the same): linear sigmas 1..1/N, dynamic shift mu from the image token
        count."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        sch = FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")
        c = sch.config
        mu = calculate_shift(image_tokens, c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                             c.get("max_shift", 1.15))
        sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device="cpu", mu=mu)
        return sch.sigmas.to(torch.float32), sch.timesteps

    def image_ids(self, b, rows, cols):
        import diffusers
        return diffusers.FluxPipeline._prepare_latent_image_ids(b, rows, cols, "cpu",
                                                                torch.float32)

    def forward(self, cond, x, t, sl, with_text, rows, cols, req) -> torch.Tensor:
        """The velocity of the band `sl` (image tokens) of latents x; with the text tokens
        or with zero text tokens."""
        b = x.shape[0]
        enc, tids = (cond["pe"], cond["txt_ids"]) if with_text else \
            (cond["pe"][:, :0], cond["txt_ids"][:0])
        g = torch.full([b], float(req.guidance), dtype=torch.float32)
        return self.transformer(hidden_states=x[:, sl], timestep=t, guidance=g,
                                pooled_projections=cond["pooled"], encoder_hidden_states=enc,
                                txt_ids=tids, img_ids=self.image_ids(b, rows, cols)[sl],
                                return_dict=False)[0]

    def combine(self, preds, req) -> torch.Tensor:
        if len(preds) == 1:
            return preds[0]
        neg, pos = preds
        return neg + req.cfg * (pos - neg)

    def pipeline_kwargs(self, req) -> dict:
        return dict(guidance_scale=req.guidance)

    @contextlib.contextmanager
    def band_mode(self, state: BandState):
        tr = self.transformer
        tr.set_attn_processor({name: self.processor(state) for name in self.stock})
        try:
            yield
        finally:
            tr.set_attn_processor(dict(self.stock))  # it consumes the dict

    # ---- the algorithm --------------------------------------------------------------------
    @torch.no_grad()
    def exact(self, req) -> torch.Tensor:
        """The family's diffusers pipeline (stock attention) from the same noise, LATENT
        space."""
        out = self.pipe(prompt=list(req.prompt), height=req.height, width=req.width,
                        num_inference_steps=req.steps, output_type="latent",
                        latents=self.noise(req.seed, len(req.prompt), req.height, req.width),
                        max_sequence_length=req.max_sequence_length,
                        **self.pipeline_kwargs(req))
        return self.to_latent(out.images, req.height, req.width)

    @torch.no_grad()
    def run(self, req, warmup, patches, refresh=True) -> torch.Tensor:
        """The final latent in ComfyUI LATENT space. `refresh=False`: the negative control,
        the caches are written by the warmup steps only."""
        conds = self.branches(req)
        b = len(req.prompt)
        rows, cols = req.height // 16, req.width // 16
        x = self.noise(req.seed, b, req.height, req.width)
        sigmas, timesteps = self.sigmas_timesteps(req.steps, rows * cols)
        state = BandState()
        with self.band_mode(state):
            for i in range(req.steps):
                t = timesteps[i].expand(b).to(x.dtype) / 1000
                dt = sigmas[i + 1] - sigmas[i]
                cut = [(0, rows)] if i < warmup else bands(rows, patches)
                state.write = refresh or i < warmup
                for p, (r0, r1) in enumerate(cut):
                    sl = slice(r0 * cols, r1 * cols)
                    preds = []
                    for branch, cond in enumerate(conds):
                        text_len = cond["pe"].shape[1]
                        image_pos = text_len + torch.arange(sl.start, sl.stop)
                        state.branch = branch
                        state.full_len = text_len + rows * cols
                        state.text_len, state.image = text_len, sl
                        # the step's first forward carries the text tokens; later ones
                        # have zero text tokens, whose K/V come from the cache
                        state.positions = torch.cat([torch.arange(text_len), image_pos]) \
                            if p == 0 else image_pos
                        preds.append(self.forward(cond, x, t, sl, p == 0, rows, cols, req))
                    v = self.combine(preds, req)
                    x[:, sl] = (x[:, sl].float() + dt * v.float()).to(x.dtype)
        return self.to_latent(x, req.height, req.width)


class ChromaReference(Reference):
    """Chroma: FLUX's attention modules, ids and schedule; T5 text only (no pooled text, no
    guidance input), trimmed to the intended mask (the longest prompt's real tokens + EOS +
    one pad: the mask ChromaPipeline means to apply, see workers/models/chroma.py's doc for
    the diffusers bug that keeps it from applying it); real CFG (neg + s (pos - neg))."""

    family = "chroma"
    pipeline_class = "ChromaPipeline"
    transformer_class = "ChromaTransformer2DModel"

    def encode(self, prompts, msl) -> dict:
        pe, ids, mask = self.pipe.encode_prompt(
            prompt=list(prompts), device="cpu", num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=msl)[:3]
        keep = int(mask.sum(dim=1).max())
        return {"pe": pe[:, :keep], "txt_ids": ids[:keep]}

    def branches(self, req) -> list:
        pos = self.encode(req.prompt, req.max_sequence_length)
        if not req.cfg or req.cfg <= 1:
            return [pos]
        neg = self.encode([req.negative_prompt] * len(req.prompt), req.max_sequence_length)
        return [neg, pos]

    def forward(self, cond, x, t, sl, with_text, rows, cols, req) -> torch.Tensor:
        b = x.shape[0]
        enc, tids = (cond["pe"], cond["txt_ids"]) if with_text else \
            (cond["pe"][:, :0], cond["txt_ids"][:0])
        return self.transformer(hidden_states=x[:, sl], timestep=t, encoder_hidden_states=enc,
                                txt_ids=tids, img_ids=self.image_ids(b, rows, cols)[sl],
                                return_dict=False)[0]

    def pipeline_kwargs(self, req) -> dict:
        return dict(guidance_scale=req.cfg, negative_prompt=[req.negative_prompt]
                    * len(req.prompt))


class QwenImageReference(Reference):
    """Qwen-Image: latents [B, 16, 1, H/8, W/8] packed 2x2 (diffusers' own packing), no
    pooled text, no guidance input, RoPE per stream from `pos_embed` (BandRope gives a band
    its rows of the whole grid's table), true CFG with the norm rescale
    comb * ||pos|| / ||comb|| per token; LATENT = model latent * std + mean."""

    family = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    processor = StaleKVQwenProcessor

    def noise(self, seed, b, height, width) -> torch.Tensor:
        import diffusers
        x = comfyui_noise(seed, (b, 16, 1, height // 8, width // 8))
        return diffusers.QwenImagePipeline._pack_latents(x, b, 16, height // 8, width // 8)

    def to_latent(self, x, height, width) -> torch.Tensor:
        import json
        import os

        import diffusers
        with open(os.path.join(self.path, "vae", "config.json")) as f:
            c = json.load(f)
        mean = torch.tensor(c["latents_mean"]).view(1, -1, 1, 1, 1)
        std = torch.tensor(c["latents_std"]).view(1, -1, 1, 1, 1)
        x = diffusers.QwenImagePipeline._unpack_latents(x, height, width, 8)
        return x.float() * std + mean

    def encode(self, prompts, msl) -> dict:
        pe, mask = self.pipe.encode_prompt(list(prompts), device="cpu",
                                           max_sequence_length=msl)
        assert mask is None or bool(mask.all()), "the reference runs prompts of one length"
        return {"pe": pe}

    branches = ChromaReference.branches

    def forward(self, cond, x, t, sl, with_text, rows, cols, req) -> torch.Tensor:
        b = x.shape[0]
        enc = cond["pe"] if with_text else cond["pe"][:, :0]
        return self.transformer(hidden_states=x[:, sl], timestep=t, encoder_hidden_states=enc,
                                img_shapes=[[(1, rows, cols)]] * b, return_dict=False)[0]

    def combine(self, preds, req) -> torch.Tensor:
        if len(preds) == 1:
            return preds[0]
        neg, pos = preds
        comb = neg + req.cfg * (pos - neg)
        return comb * (torch.norm(pos, dim=-1, keepdim=True)
                       / torch.norm(comb, dim=-1, keepdim=True))

    def pipeline_kwargs(self, req) -> dict:
        if not req.cfg or req.cfg <= 1:
            return dict(true_cfg_scale=1.0)
        return dict(true_cfg_scale=req.cfg, negative_prompt=[req.negative_prompt]
                    * len(req.prompt))

    @contextlib.contextmanager
    def band_mode(self, state: BandState):
        tr = self.transformer
        rope = tr.pos_embed
        tr.pos_embed = BandRope(rope, state)
        try:
            with super().band_mode(state):
                yield
        finally:
            tr.pos_embed = rope


REFERENCES = {r.family: r for r in (Reference, ChromaReference, QwenImageReference)}


@pytest.fixture(scope="module")
def reference(model_dir):
    made = {}

    def get(path=None, family="flux") -> Reference:
        path = str(path or model_dir(family))
        if path not in made:
            made[path] = REFERENCES[family](path)
        return made[path]
    return get


def request(height, width, batch, msl) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[:batch], seed=SEED, steps=STEPS, height=height,
                             width=width, max_sequence_length=msl, cfg=1.0, guidance=GUIDANCE)


def ref_of(ref: Reference, req: GenerationRequest, patches, warmup=WARMUP, refresh=True):
    return ref.run(req, warmup, patches, refresh=refresh)


def exact_of(ref: Reference, req: GenerationRequest):
    return ref.exact(req)


def maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---- the reference itself ----------------------------------------------------------------
def test_zero_text_tokens_forward_is_the_band_slice(reference):
    """diffusers' FLUX transformer accepts zero text tokens (empty encoder_hidden_states and
    txt_ids): every text-stream op maps an empty tensor to an empty tensor, so the reference
    can call it for bands > 0 exactly as the product's hooks do (they narrow the text to 0
    tokens before the transformer runs)."""
    ref = reference()
    tr = ref.transformer
    torch.manual_seed(0)
    b, n = 2, 6
    hs = torch.randn(b, n, tr.config.in_channels)
    ids = torch.zeros(n, 3)
    ids[:, 2] = torch.arange(n)
    kw = dict(timestep=torch.full([b], 0.5), guidance=torch.full([b], GUIDANCE),
              pooled_projections=torch.randn(b, tr.config.pooled_projection_dim),
              img_ids=ids, return_dict=False)
    with torch.no_grad():
        out = tr(hidden_states=hs, encoder_hidden_states=torch.zeros(
            b, 0, tr.config.joint_attention_dim), txt_ids=torch.zeros(0, 3), **kw)[0]
    assert out.shape == (b, n, tr.config.in_channels) and torch.isfinite(out).all()


def test_reference_is_exact_when_nothing_is_stale(reference):
    """All steps warmup, or one patch per step: the cache is fully refreshed before every
    attention, so the reference is diffusers' FluxPipeline."""
    ref = reference()
    req = request(96, 64, 2, 9)
    exact = exact_of(ref, req)
    assert maxdiff(ref_of(ref, req, 4, warmup=STEPS), exact) <= TOL
    assert maxdiff(ref_of(ref, req, 1), exact) <= TOL


# ---- the product against it ----------------------------------------------------------------
# (height, width, batch, max_sequence_length, patches): rows 6 in 4 bands (2,2,1,1), rows 8
# in 3 bands (3,3,2), rows 5 in 2 bands (3,2)
CASES = {
    4: [(96, 64, 2, 9, 4), (128, 48, 1, 7, 5)],
}


@pytest.mark.parametrize("stages", [4])
def test_pipelined_pipefusion_matches_reference(stages, model_dir, reference):
    """4 stages (2 stages, every family: the conformance suite's PipeFusion theme), several
    sizes, batches and band counts; negative controls on the first case."""
    path = model_dir("flux")
    ref = reference(path)
    report = []
    with WorkerPool(path, ParallelConfig(pipefusion=stages, warmup_steps=WARMUP,
                                         pipeline_patches=CASES[stages][0][4]),
                    device="cpu", threads_per_rank=1) as pool:
        pool.generate(request(64, 64, 1, 4))  # launch the workers
        held = sorted(r["stage"]["index"] for r in pool.status()["ranks"])
        assert held == list(range(stages)), held
        for n, (h, w, batch, msl, patches) in enumerate(CASES[stages]):
            pool.reconfigure(ParallelConfig(pipefusion=stages, warmup_steps=WARMUP,
                                            pipeline_patches=patches))
            req = request(h, w, batch, msl)
            got = pool.generate(req).samples
            want = ref_of(ref, req, patches)
            d = maxdiff(got, want)
            report.append(((h, w, batch, patches), d))
            assert d <= TOL, f"{stages} stages, {h}x{w} batch {batch} patches {patches}: " \
                             f"product vs reference {d:.3g}"
            if n == 0:  # negative controls on the first (uneven-band) case
                frozen = ref_of(ref, req, patches, refresh=False)
                d_frozen = maxdiff(frozen, want)
                exact = exact_of(ref, req)
                d_exact = maxdiff(exact, got)
                rel, psnr = closeness(got, exact)
                report.append(("never refreshed vs reference", d_frozen))
                report.append(("exact vs pipelined", d_exact))
                report.append(("pipelined vs exact: rel L2, PSNR dB", round(rel, 4),
                               round(psnr, 1)))
                assert rel <= CLOSE, report[-1]
                assert d_frozen > FAR, d_frozen
                assert maxdiff(frozen, got) > FAR
                assert d_exact > FAR, d_exact
    print(f"\n{stages} stages:", report)


# ---- Qwen-Image and Chroma ---------------------------------------------------------------
# Prompts of one token length per batch (PipeFusion runs one text length per branch); for
# Chroma every prompt and the negative have max_sequence_length - 1 real tokens, so that
# ChromaPipeline (the exact run) computes the intended mask (tests/test_chroma.py's doc).
FAMILIES = {
    "qwen_image": dict(prompts=["a red cat", "a blue dog"], negative="ugly dark", msl=64),
    "chroma": dict(prompts=["a red cat", "a blue dog"], negative="dark old photo", msl=5),
}
CLOSE = 0.02  # pipelined vs exact: relative L2 error of the latent at most this


def family_request(family, height, width, batch, cfg) -> GenerationRequest:
    f = FAMILIES[family]
    return GenerationRequest(prompt=f["prompts"][:batch], seed=SEED, steps=STEPS,
                             height=height, width=width, max_sequence_length=f["msl"],
                             cfg=cfg, negative_prompt=f["negative"])


def closeness(got, exact) -> tuple:
    """(relative L2 error, PSNR in dB over the exact latent's range) of `got`."""
    err = (got - exact).float()
    rel = (err.norm() / exact.float().norm()).item()
    rng = (exact.max() - exact.min()).item()
    psnr = float(20 * np.log10(rng / err.pow(2).mean().sqrt().item()))
    return rel, psnr


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_reference_is_exact_when_nothing_is_stale(family, reference):
    """All steps warmup, or one patch per step: the reference is the family's diffusers
    pipeline (its text, noise, schedule, RoPE, CFG and latent conventions are the
    pipeline's), with and without CFG, batch 1 and 2."""
    ref = reference(family=family)
    for batch, cfg in ((1, 4.0), (2, 1.0)):
        req = family_request(family, 96, 64, batch, cfg)
        exact = exact_of(ref, req)
        d_all = maxdiff(ref_of(ref, req, 4, warmup=STEPS), exact)
        d_one = maxdiff(ref_of(ref, req, 1), exact)
        print(f"\n{family} batch {batch} cfg {cfg}: all-warmup {d_all:.2e}, 1 patch {d_one:.2e}")
        assert d_all <= TOL and d_one <= TOL, (d_all, d_one)


@pytest.mark.parametrize("family", ["flux"] + list(FAMILIES))
def test_band_forward_is_the_full_forward_slice(family, reference):
    """A band's forward (its image tokens with their ids or RoPE rows; zero text tokens after
    band 0) against caches written by a whole forward of the same latents and timestep gives
    that forward's prediction for the band's tokens: the band call is the restriction of the
    whole call, and staleness is all that makes PipeFusion differ."""
    ref = reference(family=family)
    req = family_request(family, 96, 64, 2, 4.0) if family in FAMILIES \
        else request(96, 64, 2, 9)
    rows, cols = req.height // 16, req.width // 16
    cond = ref.branches(req)[-1]
    x = ref.noise(req.seed, 2, req.height, req.width)
    t = ref.sigmas_timesteps(req.steps, rows * cols)[1][1].expand(2) / 1000
    state = BandState()
    text_len = cond["pe"].shape[1]
    state.full_len = state.text_len = text_len
    state.full_len += rows * cols
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
