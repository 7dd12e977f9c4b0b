"""Independent oracles of PipeFusion's pipelined (stale K/V) mode for the video families:
Wan 2.1 text-to-video (below) and HunyuanVideo 1.5 text-to-video (its joint [video,
context] attention: `HunyuanVideo15Reference`'s doc). The algorithm is
tests/test_pipefusion_reference.py's (its BandState, StaleKV caches and band cut), on the
family's diffusers transformer, pipeline and scheduler (nothing from the product's
`workers/` package). Wan:

* The video's tokens run frame by frame, each frame its token rows (latent rows / 2) of
  token columns; the token rows of the whole video (frames x rows) are cut into `patches`
  bands of near-equal height (the first `rows % patches` one row taller), so a band may
  cross a frame boundary. Steps before `warmup` run the whole video in one forward.
* A band's forward computes only its tokens: the whole latent's patch embedding restricted
  to them, their rows of the RoPE table WanRotaryPosEmbed computes for the whole grid, the
  timestep and text embedding as a whole forward's. The self-attention (`attn1`) writes the
  band's fresh K/V into its layer's cache of every video token (one per guidance branch),
  then its queries attend to the whole cache; the cross-attention to the text (`attn2`,
  diffusers' own processor) is whole in every call, since the text is context every band
  reads in full.
* With CFG (uncond + s (cond - uncond)) each branch runs the band with its own text and
  caches. The band's prediction goes to its rows; the step is the pipeline's
  UniPCMultistepScheduler. Its update is per element with scalar coefficients and a band's
  forward reads only its own rows and the caches, so stepping each band's rows with their
  own history once the band is done (PipeFusion's order) equals one step of the whole
  latent once every band of the step is done, which is what this oracle does.

Each oracle is checked against its diffusers pipeline where nothing is stale (every step
warmup, or one band), and a band's forward against the whole forward's slice when the
caches hold the same step's K/V. The product's pipelined PipeFusion is held to its oracle
by the conformance suite (tests/conformance/test_pipefusion.py; the builders'
PIPEFUSION_ORACLE).
"""
from __future__ import annotations

import contextlib

import torch

from test_pipefusion_reference import TOL, BandState, StaleKV, bands, comfyui_noise, maxdiff


class StaleKVWanSelfProcessor(StaleKV):
    """diffusers' WanAttnProcessor on the self-attention (`attn1`: projections, RMS norm
    across the heads, Wan's interleaved RoPE on the band's rows of the table), except that
    the queries attend to this layer's K/V cache of every video token."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        assert encoder_hidden_states is None and attention_mask is None
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        cos, sin = (f[0, :, 0] for f in rotary_emb)  # [1, S, 1, D] -> [S, D]
        assert cos.shape[0] == query.shape[1], (cos.shape, query.shape)
        # cos / sin repeat each frequency for the pair (x_2i, x_2i+1): the interleaved
        # rotation diffusers' apply_rotary_emb does with use_real_unbind_dim=-1
        query = apply_rotary_emb(query, (cos, sin), sequence_dim=1)
        key = apply_rotary_emb(key, (cos, sin), sequence_dim=1)
        out = self.attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class WanReference:
    """Single-process PipeFusion of a Wan 2.1 text-to-video folder (fp32, CPU)."""

    def __init__(self, path):
        import diffusers

        self.path = str(path)
        self.transformer = diffusers.WanTransformer3DModel.from_pretrained(
            self.path, subfolder="transformer", dtype=torch.float32).eval()
        self.pipe = diffusers.WanPipeline.from_pretrained(
            self.path, transformer=self.transformer, dtype=torch.float32)
        assert self.pipe.transformer_2 is None, "the Wan oracle runs one transformer"
        self.pipe.set_progress_bar_config(disable=True)
        self.stock = dict(self.transformer.attn_processors)

    # ---- the family's conventions --------------------------------------------------------
    def latent_shape(self, req) -> tuple:
        """ComfyUI's Wan LATENT: [B, 16, (frames - 1) / 4 + 1, H / 8, W / 8]."""
        return (len(req.prompt), 16, (int(req.frames) - 1) // 4 + 1, req.height // 8,
                req.width // 8)

    def to_latent(self, x) -> torch.Tensor:
        """Model latent -> ComfyUI LATENT: x * std + mean per channel (the VAE's stats)."""
        c = self.pipe.vae.config
        per = (lambda v: torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1, 1))
        return x.float() * per(c.latents_std) + per(c.latents_mean)

    def encode(self, prompts, msl) -> torch.Tensor:
        """UMT5 states, each prompt's real tokens then zeros to max_sequence_length."""
        return self.pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                       max_sequence_length=msl, device="cpu")[0]

    def branches(self, req) -> list:
        """The text of each guidance branch, the negative (0) first where there is CFG."""
        pos = self.encode(req.prompt, req.max_sequence_length)
        if not req.cfg or req.cfg <= 1:
            return [pos]
        return [self.encode([req.negative_prompt] * len(req.prompt), req.max_sequence_length),
                pos]

    @staticmethod
    def combine(preds, req) -> torch.Tensor:
        if len(preds) == 1:
            return preds[0]
        neg, pos = preds
        return neg + req.cfg * (pos - neg)

    def grid(self, x) -> tuple:
        """(token rows of the whole video, token columns) of a latent [B, C, T, h, w]."""
        pt, ph, pw = self.transformer.config.patch_size
        _, _, f, h, w = x.shape
        return (f // pt) * (h // ph), w // pw

    def unpatchify(self, tokens, x) -> torch.Tensor:
        """Tokens [B, N, pt * ph * pw * C] of the whole grid (proj_out's layout: the patch's
        (pt, ph, pw) then the channels) -> a latent shaped as x."""
        pt, ph, pw = self.transformer.config.patch_size
        b, c, f, h, w = x.shape
        t = tokens.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, c)
        return t.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, c, f, h, w)

    def forward(self, text, x, t, sl) -> torch.Tensor:
        """The velocity tokens of the band `sl` (token positions) of the latent x: the
        transformer's own modules on the band's tokens, text whole."""
        tr = self.transformer
        cos, sin = tr.rope(x)  # the whole grid's table, [1, N, 1, D]
        rope = (cos[:, sl], sin[:, sl])
        hs = tr.patch_embedding(x).flatten(2).transpose(1, 2)[:, sl].contiguous()
        temb, proj, context, _ = tr.condition_embedder(t, text, None)
        proj = proj.unflatten(1, (6, -1))
        for block in tr.blocks:
            hs = block(hs, context, proj, rope)
        shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hs = (tr.norm_out(hs.float()) * (1 + scale) + shift).type_as(hs)
        return tr.proj_out(hs)

    @contextlib.contextmanager
    def band_mode(self, state: BandState):
        """The self-attentions read and write the stale caches; the cross-attentions stay
        diffusers' own."""
        tr = self.transformer
        tr.set_attn_processor({name: StaleKVWanSelfProcessor(state) if ".attn1." in name
                               else proc for name, proc in self.stock.items()})
        try:
            yield
        finally:
            tr.set_attn_processor(dict(self.stock))  # it consumes the dict

    # ---- the algorithm -------------------------------------------------------------------
    @torch.no_grad()
    def exact(self, req) -> torch.Tensor:
        """WanPipeline (stock attention) from the same noise, as a ComfyUI LATENT."""
        out = self.pipe(prompt=list(req.prompt), negative_prompt=req.negative_prompt,
                        height=req.height, width=req.width, num_frames=int(req.frames),
                        num_inference_steps=req.steps, guidance_scale=req.cfg,
                        latents=comfyui_noise(req.seed, self.latent_shape(req)),
                        max_sequence_length=req.max_sequence_length, output_type="latent")
        return self.to_latent(out.frames)

    @torch.no_grad()
    def run(self, req, warmup, patches, refresh=True) -> torch.Tensor:
        """The final ComfyUI LATENT. `refresh=False`: the negative control, the caches are
        written by the warmup steps only."""
        import copy

        conds = self.branches(req)
        x = comfyui_noise(req.seed, self.latent_shape(req))
        b = x.shape[0]
        rows, cols = self.grid(x)
        sched = copy.deepcopy(self.pipe.scheduler)
        sched.set_timesteps(req.steps, device="cpu")
        state = BandState(rows * cols)
        with self.band_mode(state):
            for i, t in enumerate(sched.timesteps):
                cut = [(0, rows)] if i < warmup else bands(rows, patches)
                state.write = refresh or i < warmup
                v = []
                for r0, r1 in cut:
                    sl = slice(r0 * cols, r1 * cols)
                    state.positions = torch.arange(sl.start, sl.stop)
                    preds = []
                    for branch, text in enumerate(conds):
                        state.branch = branch
                        preds.append(self.forward(text, x, t.expand(b), sl))
                    v.append(self.combine(preds, req))
                v = self.unpatchify(torch.cat(v, 1), x)
                x = sched.step(v, t, x, return_dict=False)[0]
        return self.to_latent(x)


def wan_oracle(folder) -> WanReference:
    """The conformance suite's PipeFusion theme (comfyui_xdit/testmodels/wan.PIPEFUSION_ORACLE)."""
    return WanReference(folder)


class StaleKVHunyuanVideo15Processor(StaleKV):
    """diffusers' HunyuanVideo15AttnProcessor2_0 on the dual-stream blocks (the video's q/k/v
    with per-head RMS norms and RoPE, the context's own q/k/v and norms, [video, context]),
    except that the queries attend to this layer's K/V cache of the whole [video, context]
    sequence. No mask: the oracle runs each row alone on its valid context tokens."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        assert attention_mask is None and encoder_hidden_states is not None

        def heads(x):
            return x.unflatten(2, (attn.heads, -1))

        q, k, v = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        tq, tk, tv = (heads(f(encoder_hidden_states))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            tq = attn.norm_added_q(tq)
        if attn.norm_added_k is not None:
            tk = attn.norm_added_k(tk)
        video = q.shape[1]
        q, k, v = (torch.cat(p, dim=1) for p in ((q, tq), (k, tk), (v, tv)))
        out = self.attend(q, k, v).flatten(2, 3).to(q.dtype)
        img = attn.to_out[1](attn.to_out[0](out[:, :video].contiguous()))
        return img, attn.to_add_out(out[:, video:].contiguous())


class HunyuanVideo15Reference:
    """Single-process PipeFusion of a HunyuanVideo 1.5 text-to-video folder (fp32, CPU).

    One token per latent pixel (patch 1), frame by frame; the joint attention covers
    [video, context], the context [valid ByT5, valid Qwen] tokens (each with its cond-type
    embedding; text-to-video's zero image states are invalid, so none). diffusers' forward
    masks the invalid context tokens out of every attention (no key for anyone, their own
    queries discarded), so the oracle runs each row of the batch alone on its valid context
    (the Qwen refiner on the valid tokens, mask-free) and needs no mask. The step's first
    band (per row and branch) computes the context beside its video tokens and writes their
    K/V; later bands run with zero context tokens and read the context's K/V from the cache.
    FlowMatch Euler at the folder's shift on sigmas 1 .. 1/steps; CFG uncond + s (cond -
    uncond); LATENT = model latent / scaling_factor."""

    def __init__(self, path):
        import diffusers

        self.path = str(path)
        self.transformer = diffusers.HunyuanVideo15Transformer3DModel.from_pretrained(
            self.path, subfolder="transformer", dtype=torch.float32).eval()
        self.pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(
            self.path, transformer=self.transformer, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.stock = dict(self.transformer.attn_processors)

    def latent_shape(self, req) -> tuple:
        """ComfyUI's LATENT: [B, 32, (frames - 1) / 4 + 1, H / 16, W / 16]."""
        return (len(req.prompt), 32, (int(req.frames) - 1) // 4 + 1, req.height // 16,
                req.width // 16)

    def to_latent(self, x) -> torch.Tensor:
        return x.float() / float(self.pipe.vae.config.scaling_factor)

    def encode(self, prompts) -> list:
        """Each row's valid (Qwen, ByT5) states, [1, n, D] each (n may be 0 for ByT5)."""
        qwen, qmask, byt5, bmask = self.pipe.encode_prompt(prompt=list(prompts), device="cpu",
                                                           batch_size=len(prompts))
        return [(qwen[i:i + 1, qmask[i].bool()], byt5[i:i + 1, bmask[i].bool()])
                for i in range(len(prompts))]

    def branches(self, req) -> list:
        """Per guidance branch (the negative first where there is CFG), each row's text."""
        pos = self.encode(req.prompt)
        if not req.cfg or req.cfg <= 1:
            return [pos]
        return [self.encode([req.negative_prompt] * len(req.prompt)), pos]

    combine = staticmethod(WanReference.combine)

    def context(self, text, t) -> torch.Tensor:
        """A row's context tokens [1, L, D]: its valid ByT5 then Qwen states, embedded."""
        tr = self.transformer
        qwen, byt5 = text
        emb = tr.cond_type_embed.weight
        parts = []
        if byt5.shape[1]:
            parts.append(tr.context_embedder_2(byt5) + emb[1])
        parts.append(tr.context_embedder(qwen, t, None) + emb[0])
        return torch.cat(parts, 1)

    def forward(self, text, x, t, sl, with_text) -> torch.Tensor:
        """The velocity tokens [1, n, 32] of the band `sl` (token positions) of one row's
        model input x [1, 65, T, h, w]; with its context tokens, or with none."""
        tr = self.transformer
        cos, sin = tr.rope(x)  # the whole grid's table, [N, D]
        rope = (cos[sl], sin[sl])
        temb = tr.time_embed(t)
        hs = tr.x_embedder(x)[:, sl]
        ctx = self.context(text, t)
        if not with_text:
            ctx = ctx[:, :0]
        for block in tr.transformer_blocks:
            hs, ctx = block(hs, ctx, temb, None, rope)
        return tr.proj_out(tr.norm_out(hs, temb))

    @contextlib.contextmanager
    def band_mode(self, state: BandState):
        """The dual-stream blocks' joint attention reads and writes the stale caches; the
        text refiner's attention stays diffusers' own."""
        tr = self.transformer
        tr.set_attn_processor({name: StaleKVHunyuanVideo15Processor(state)
                               if name.startswith("transformer_blocks.") else proc
                               for name, proc in self.stock.items()})
        try:
            yield
        finally:
            tr.set_attn_processor(dict(self.stock))

    @torch.no_grad()
    def exact(self, req) -> torch.Tensor:
        """HunyuanVideo15Pipeline (stock attention, its guider at the request's scale) from
        the same noise, as a ComfyUI LATENT."""
        pipe, b = self.pipe, len(req.prompt)
        guider = pipe.guider
        pipe.guider = type(guider)(guidance_scale=req.cfg)
        try:
            out = pipe(prompt=list(req.prompt), negative_prompt=[req.negative_prompt] * b,
                       height=req.height, width=req.width, num_frames=int(req.frames),
                       num_inference_steps=req.steps, output_type="latent",
                       latents=comfyui_noise(req.seed, self.latent_shape(req))).frames
        finally:
            pipe.guider = guider
        return self.to_latent(out)

    @torch.no_grad()
    def run(self, req, warmup, patches, refresh=True) -> torch.Tensor:
        """The final ComfyUI LATENT. `refresh=False`: the negative control, the caches are
        written by the warmup steps only."""
        import copy

        import numpy as np

        conds = self.branches(req)
        x = comfyui_noise(req.seed, self.latent_shape(req))
        b, c, f, h, w = x.shape
        rows, cols, n = f * h, w, f * h * w
        sched = copy.deepcopy(self.pipe.scheduler)
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, req.steps + 1)[:-1], device="cpu")
        state = BandState()
        with self.band_mode(state):
            for i, t in enumerate(sched.timesteps):
                cut = [(0, rows)] if i < warmup else bands(rows, patches)
                state.write = refresh or i < warmup
                v = torch.empty(b, n, c)
                for p, (r0, r1) in enumerate(cut):
                    sl = slice(r0 * cols, r1 * cols)
                    for row in range(b):
                        # text-to-video: the noise joined by a zero start-frame latent and mask
                        xin = torch.cat([x[row:row + 1], x.new_zeros(1, c + 1, f, h, w)], 1)
                        tt = t.expand(1).to(x.dtype)
                        preds = []
                        for branch, texts in enumerate(conds):
                            L = sum(int(s.shape[1]) for s in texts[row])
                            state.branch, state.full_len = (row, branch), n + L
                            video = torch.arange(sl.start, sl.stop)
                            state.positions = torch.cat([video, n + torch.arange(L)]) \
                                if p == 0 else video
                            preds.append(self.forward(texts[row], xin, tt, sl, p == 0))
                        v[row:row + 1, sl] = self.combine(preds, req)
                v = v.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)
                x = sched.step(v, t, x, return_dict=False)[0]
        return self.to_latent(x)


def hunyuan_video15_oracle(folder) -> HunyuanVideo15Reference:
    """The conformance suite's PipeFusion theme
    (comfyui_xdit/testmodels/hunyuan_video15.PIPEFUSION_ORACLE)."""
    return HunyuanVideo15Reference(folder)


# ---- the oracles themselves --------------------------------------------------------------
def _wan_request(batch, cfg, frames=9):
    from comfyui_xdit import GenerationRequest
    return GenerationRequest(prompt=["a red cat", "a big blue dog"][:batch], seed=5, steps=3,
                             height=48, width=80, frames=frames, cfg=cfg,
                             negative_prompt="ugly dark", max_sequence_length=16)


def test_wan_oracle_is_the_pipeline_where_nothing_is_stale(model_dir):
    """Every step warmup, or one band per step: the caches hold the whole step's K/V before
    every attention, so the oracle is WanPipeline (its text, noise, UniPC steps, RoPE, CFG
    and latent conventions are the pipeline's)."""
    ref = WanReference(model_dir("wan"))
    for batch, cfg in ((1, 4.0), (2, 1.0)):
        req = _wan_request(batch, cfg)
        exact = ref.exact(req)
        d_all = maxdiff(ref.run(req, req.steps, 3), exact)
        d_one = maxdiff(ref.run(req, 1, 1), exact)
        print(f"\nwan batch {batch} cfg {cfg}: all-warmup {d_all:.2e}, 1 band {d_one:.2e}")
        assert d_all <= TOL and d_one <= TOL, (d_all, d_one)


def test_wan_band_forward_is_the_full_forward_slice(model_dir):
    """A band's forward (its tokens, their RoPE rows, bands crossing a frame boundary:
    3 latent frames of 3 token rows in 4 bands) against caches a whole forward of the same
    latents and timestep wrote gives that forward's prediction for the band's tokens."""
    ref = WanReference(model_dir("wan"))
    req = _wan_request(2, 4.0)
    text = ref.branches(req)[-1]
    x = comfyui_noise(req.seed, ref.latent_shape(req))
    rows, cols = ref.grid(x)
    assert rows == 9
    t = torch.tensor(700).expand(2)
    state = BandState(rows * cols)
    with torch.no_grad(), ref.band_mode(state):
        for p, (r0, r1) in enumerate([(0, rows)] + bands(rows, 4)):
            sl = slice(r0 * cols, r1 * cols)
            state.positions = torch.arange(sl.start, sl.stop)
            v = ref.forward(text, x, t, sl)
            if p == 0:
                whole = v
            else:
                d = maxdiff(v, whole[:, sl])
                assert d <= TOL, f"wan band {p - 1}: {d:.3g}"
    assert whole.abs().max() > 0.1


def _hv15_request(prompts, cfg):
    from comfyui_xdit import GenerationRequest
    return GenerationRequest(prompt=list(prompts), seed=5, steps=3, height=80, width=48,
                             frames=9, cfg=cfg, negative_prompt="ugly dark")


def test_hunyuan_video15_oracle_is_the_pipeline_where_nothing_is_stale(model_dir):
    """Every step warmup, or one band per step: the oracle (each row alone on its valid
    context) is HunyuanVideo15Pipeline (masked context, batched), prompts of two lengths
    with CFG and one without."""
    ref = HunyuanVideo15Reference(model_dir("hunyuan_video15"))
    for prompts, cfg in ((["a red cat", "a big blue dog on the grass"], 4.0), (["a cat"], 1.0)):
        req = _hv15_request(prompts, cfg)
        exact = ref.exact(req)
        d_all = maxdiff(ref.run(req, req.steps, 3), exact)
        d_one = maxdiff(ref.run(req, 1, 1), exact)
        print(f"\nhunyuan_video15 {len(prompts)} rows cfg {cfg}: all-warmup {d_all:.2e}, "
              f"1 band {d_one:.2e}")
        assert d_all <= TOL and d_one <= TOL, (d_all, d_one)


def test_hunyuan_video15_band_forward_is_the_full_forward_slice(model_dir):
    """A band's forward (its tokens and RoPE rows; zero context tokens after the first band,
    whose K/V come from the cache) against caches a whole forward of the same row, latents
    and timestep wrote gives that forward's prediction for the band's tokens; 3 latent
    frames of 5 token rows in 4 bands, so bands cross frame boundaries."""
    ref = HunyuanVideo15Reference(model_dir("hunyuan_video15"))
    req = _hv15_request(["a big blue dog on the grass"], 4.0)
    text = ref.branches(req)[-1][0]
    x = comfyui_noise(req.seed, ref.latent_shape(req))
    _, c, f, h, w = x.shape
    x = torch.cat([x, x.new_zeros(1, c + 1, f, h, w)], 1)
    rows, cols, n = f * h, w, f * h * w
    assert rows == 15
    t = torch.tensor([700.0])
    L = sum(int(s.shape[1]) for s in text)
    state = BandState(n + L)
    with torch.no_grad(), ref.band_mode(state):
        for p, (r0, r1) in enumerate([(0, rows)] + bands(rows, 4)):
            sl = slice(r0 * cols, r1 * cols)
            video = torch.arange(sl.start, sl.stop)
            with_text = p <= 1  # the whole forward, then the first band
            state.positions = torch.cat([video, n + torch.arange(L)]) if with_text else video
            v = ref.forward(text, x, t, sl, with_text)
            if p == 0:
                whole = v
            else:
                d = maxdiff(v, whole[:, sl])
                assert d <= TOL, f"hunyuan_video15 band {p - 1}: {d:.3g}"
    assert whole.abs().max() > 0.1
