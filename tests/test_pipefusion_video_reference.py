"""Independent oracles of PipeFusion's pipelined (stale K/V) mode for the video families:
Wan 2.1 text-to-video. The algorithm is tests/test_pipefusion_reference.py's (its BandState,
StaleKV caches and band cut), on the family's diffusers transformer, pipeline and
scheduler (nothing from the product's `workers/` package):

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

The oracle is checked against WanPipeline where nothing is stale (every step warmup, or
one band), and a band's forward against the whole forward's slice when the caches hold the
same step's K/V. The product's pipelined PipeFusion is held to it by the conformance suite
(tests/conformance/test_pipefusion.py; comfyui_xdit/testmodels/wan.PIPEFUSION_ORACLE).
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
