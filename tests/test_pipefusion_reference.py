"""An independent oracle for PipeFusion's pipelined (stale K/V) mode.

DESIGN.md numerics 4 only says PipeFusion is not exact. What it computes instead is a
definite algorithm, written here once more in a single process from diffusers' FLUX
transformer and test code alone (nothing from the product's `workers/` package):

* Token rows (height // 16) are cut into `patches` bands of near-equal height, the first
  `rows % patches` bands one row taller. Steps before `warmup` run the whole image in one
  forward (exact, as diffusers' pipeline). Later steps run the bands one after another,
  band 0 first.
* A band's forward computes only the band's image tokens (its latent rows and their
  img_ids) plus, for band 0 only, the text tokens; later bands run with zero text tokens.
* Every attention layer holds a K/V cache of the full sequence (text first, then every
  image token, FLUX's order). A forward first writes its fresh K/V into their positions,
  then its queries attend (plain softmax, no mask) to the whole cache: positions not yet
  refreshed in this step still hold what was written last (the previous step, or earlier
  in this step for bands already computed). The warmup forward writes everything.
* After a band's forward, its latent rows take the flow-matching Euler step
  x + (sigma_{i+1} - sigma_i) * v with the scheduler's FLUX sigmas.

The attention is a custom processor on diffusers' `FluxAttention` modules that reuses
diffusers' own projection, QK-norm and RoPE code (`_get_qkv_projections`, the modules'
`norm_*`, `apply_rotary_emb`, `dispatch_attention_fn`); only where K/V come from differs.

The product's pipelined PipeFusion (2 and 4 stages, uneven bands, batch 1 and 2) must match
this reference to fp32 rounding. Negative controls: a reference whose cache is never
refreshed after warmup is far from the correct one (so the comparison would catch a product
that forgets to refresh), and the exact result is far from the pipelined one (so the test is
not comparing two exact runs).
"""
from __future__ import annotations

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


# ---- conventions, written out (DESIGN.md numerics 1 and 5) ---------------------------------
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
    """What the current forward computes, shared by every layer's processor: the positions
    (in the full text + image sequence) of its tokens, in the order the attention sees them,
    and whether the forward writes its K/V into the caches."""

    def __init__(self, full_len: int):
        self.full_len = full_len
        self.positions: torch.Tensor = torch.arange(full_len)
        self.write = True


class StaleKVFluxProcessor:
    """diffusers' FluxAttnProcessor, except that the queries attend to this layer's K/V
    cache of the full sequence after the forward's own K/V were written into it."""

    def __init__(self, state: BandState):
        self.state = state
        self.k = self.v = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
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

        st = self.state
        pos = st.positions
        assert pos.numel() == key.shape[1], (pos.numel(), key.shape)
        if self.k is None:
            shape = (key.shape[0], st.full_len) + tuple(key.shape[2:])
            self.k, self.v = key.new_full(shape, float("nan")), key.new_full(shape, float("nan"))
        if st.write:
            self.k[:, pos] = key
            self.v[:, pos] = value
        assert not torch.isnan(self.k).any(), "attention over a cache position never written"
        out = dispatch_attention_fn(query, self.k, self.v)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text = encoder_hidden_states.shape[1]
            enc_out, out = out[:, :text], out[:, text:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            return out, attn.to_add_out(enc_out.contiguous())
        return out


class Reference:
    """Single-process PipeFusion of one model folder (fp32, CPU)."""

    def __init__(self, path):
        import diffusers

        self.path = str(path)
        self.transformer = diffusers.FluxTransformer2DModel.from_pretrained(
            self.path, subfolder="transformer", dtype=torch.float32).eval()
        self.stock = dict(self.transformer.attn_processors)
        self.pipe = diffusers.FluxPipeline.from_pretrained(
            self.path, transformer=self.transformer, vae=None, dtype=torch.float32)

    @torch.no_grad()
    def exact(self, prompts, seed, steps, height, width, msl, guidance) -> torch.Tensor:
        """diffusers' FluxPipeline (stock attention) from the same noise, LATENT space."""
        b = len(prompts)
        out = self.pipe(prompt=list(prompts), guidance_scale=guidance, height=height,
                        width=width, num_inference_steps=steps, output_type="latent",
                        latents=pack_flux(comfyui_noise(seed, (b, 16, height // 8, width // 8))),
                        max_sequence_length=msl)
        return model_to_latent(unpack_flux(out.images, height, width), self.path)

    def sigmas_timesteps(self, steps: int, image_tokens: int):
        """FLUX's schedule as diffusers' FluxPipeline sets it: linear sigmas 1..1/N, dynamic
        shift mu from the image token count."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        sch = FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")
        c = sch.config
        mu = calculate_shift(image_tokens, c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                             c.get("max_shift", 1.15))
        sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device="cpu", mu=mu)
        return sch.sigmas.to(torch.float32), sch.timesteps

    @torch.no_grad()
    def run(self, prompts, seed, steps, height, width, msl, guidance, warmup, patches,
            refresh=True) -> torch.Tensor:
        """The final latent in ComfyUI LATENT space. `refresh=False`: the negative control,
        the caches are written by the warmup steps only."""
        import diffusers

        tr = self.transformer
        pe, pooled, txt_ids = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device="cpu", num_images_per_prompt=1,
            max_sequence_length=msl)
        b, text_len = pe.shape[0], pe.shape[1]
        rows, cols = height // 16, width // 16
        x = pack_flux(comfyui_noise(seed, (b, 16, height // 8, width // 8)))
        img_ids = diffusers.FluxPipeline._prepare_latent_image_ids(b, rows, cols, "cpu",
                                                                   torch.float32)
        sigmas, timesteps = self.sigmas_timesteps(steps, rows * cols)
        g = torch.full([b], float(guidance), dtype=torch.float32)

        state = BandState(text_len + rows * cols)
        tr.set_attn_processor({name: StaleKVFluxProcessor(state) for name in self.stock})
        try:
            for i in range(steps):
                t = timesteps[i].expand(b).to(x.dtype) / 1000
                dt = sigmas[i + 1] - sigmas[i]
                cut = [(0, rows)] if i < warmup else bands(rows, patches)
                state.write = refresh or i < warmup
                for p, (r0, r1) in enumerate(cut):
                    sl = slice(r0 * cols, r1 * cols)
                    image_pos = text_len + torch.arange(sl.start, sl.stop)
                    if p == 0:  # the step's first forward carries the text tokens
                        enc, tids = pe, txt_ids
                        state.positions = torch.cat([torch.arange(text_len), image_pos])
                    else:  # zero text tokens: the text K/V come from the cache
                        enc, tids = pe[:, :0], txt_ids[:0]
                        state.positions = image_pos
                    v = tr(hidden_states=x[:, sl], timestep=t, guidance=g,
                           pooled_projections=pooled, encoder_hidden_states=enc,
                           txt_ids=tids, img_ids=img_ids[sl], return_dict=False)[0]
                    x[:, sl] = (x[:, sl].float() + dt * v.float()).to(x.dtype)
        finally:
            tr.set_attn_processor(dict(self.stock))  # it consumes the dict
        return model_to_latent(unpack_flux(x, height, width), self.path)


@pytest.fixture(scope="module")
def reference(model_dir):
    made = {}

    def get(path=None) -> Reference:
        path = str(path or model_dir("flux"))
        if path not in made:
            made[path] = Reference(path)
        return made[path]
    return get


def request(height, width, batch, msl) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[:batch], seed=SEED, steps=STEPS, height=height,
                             width=width, max_sequence_length=msl, cfg=1.0, guidance=GUIDANCE)


def ref_of(ref: Reference, req: GenerationRequest, patches, warmup=WARMUP, refresh=True):
    return ref.run(req.prompt, req.seed, req.steps, req.height, req.width,
                   req.max_sequence_length, req.guidance, warmup, patches, refresh=refresh)


def exact_of(ref: Reference, req: GenerationRequest):
    return ref.exact(req.prompt, req.seed, req.steps, req.height, req.width,
                     req.max_sequence_length, req.guidance)


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
    2: [(96, 64, 2, 9, 4), (128, 48, 1, 7, 3), (80, 64, 2, 6, 2)],
    4: [(96, 64, 2, 9, 4), (128, 48, 1, 7, 5)],
}


@pytest.mark.parametrize("stages", [2, 4])
def test_pipelined_pipefusion_matches_reference(stages, model_dir, reference):
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
                d_exact = maxdiff(exact_of(ref, req), got)
                report.append(("never refreshed vs reference", d_frozen))
                report.append(("exact vs pipelined", d_exact))
                assert d_frozen > FAR, d_frozen
                assert maxdiff(frozen, got) > FAR
                assert d_exact > FAR, d_exact
    print(f"\n{stages} stages:", report)
