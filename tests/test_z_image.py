"""Z-Image through the pool at one rank equals diffusers' ZImagePipeline
(docs/design.md#numerics-rule-4); the decode, the MODEL's calls, single files, LoRA, the memory
plan and PipeFusion's stale-K/V oracle (which the conformance suite holds the pipelined pool
to: PIPEFUSION_ORACLE in its builder) are checked here too. That every other method,
weight sharding, the step cache and batch independence equal one rank is the conformance
suite's (tests/conformance/).

The tiny model (comfyui_xdit/testmodels/z_image.py) has learned pad tokens of its own, so a
split that drops, zeroes or misplaces them fails. At 80 x 48 the image has 15 tokens (padded
to 32) and the prompts have 22, 37 and 22 tokens (padded to 32, 64, 32) and the negative 26
(32): every stream needs its learned pads, the rows of a batch differ in padded text length
(so the text refiner's and the main blocks' keys are masked per row, and the image's RoPE
offset differs per row and between the positive and negative branch).

The 2-rank checks run under the NCCL-rules emulation on one shared launch.
ComfyUI's cfg c is ZImagePipeline's guidance_scale c - 1 (CFG off for c <= 1).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

TOL = 1e-4
ARCH = "z_image"
H, W = 80, 48  # latent 10 x 6: 15 image tokens
A = "a red cat"  # 22 tokens with the chat template
B = "a big blue dog sitting on a green field with many flowers and trees near a river"  # 37
C = "sky"  # 22
NEGATIVE = "ugly dark old photo"  # 26
MSL = 64
NCCL = ["xdit_testhooks.nccl_rules:install"]

TWO_RANKS = {"ulysses2": ParallelConfig(ulysses=2), "ring2": ParallelConfig(ring=2),
             "cfg2": ParallelConfig(cfg_parallel=True), "dp2": ParallelConfig(dp=2)}


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import ZImagePipeline
    p = ZImagePipeline.from_pretrained(str(model_dir(ARCH))).to(torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def run_pipeline(pipe, req: GenerationRequest, output_type: str = "latent") -> torch.Tensor:
    """ZImagePipeline from ComfyUI's noise for the request (LATENT [B, 16, H/8, W/8]), the
    result as a ComfyUI LATENT (raw VAE space: / scaling_factor + shift_factor)."""
    b = len(req.prompt)
    noise = torch.randn([b, 16, req.height // 8, req.width // 8],
                        generator=torch.manual_seed(req.seed))
    cfg = float(req.cfg)
    kw = dict(negative_prompt=[req.negative_prompt] * b, guidance_scale=cfg - 1) \
        if cfg > 1 else dict(guidance_scale=0.0)
    out = pipe(prompt=list(req.prompt), height=req.height, width=req.width,
               num_inference_steps=req.steps, latents=noise,
               max_sequence_length=req.max_sequence_length, output_type=output_type,
               **kw).images
    if output_type != "latent":
        return out
    vae = pipe.vae.config
    return out / vae.scaling_factor + vae.shift_factor


@pytest.fixture(scope="module")
def oracle(pipe):
    cache = {}

    def run(req: GenerationRequest) -> torch.Tensor:
        key = (tuple(req.prompt), req.seed, req.steps, req.cfg, req.negative_prompt)
        if key not in cache:
            cache[key] = run_pipeline(pipe, req)
        return cache[key]
    return run



def request(prompts, cfg: float = 3.0, **kw) -> GenerationRequest:
    return GenerationRequest(**dict(dict(prompt=list(prompts), seed=11, steps=3, height=H,
                                         width=W, cfg=cfg, negative_prompt=NEGATIVE,
                                         max_sequence_length=MSL), **kw))


def check(got, want, what: str):
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    print(f"{what}: max abs diff {diff:.2e}")
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"


def test_token_counts_need_padding(pipe):
    """What the module doc says the prompts are: none a multiple of 32, two padded
    lengths among them."""
    tok = pipe.tokenizer

    def count(p):
        return len(tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                               tokenize=False, add_generation_prompt=True))
                   .input_ids)
    assert [count(p) for p in (A, B, C, NEGATIVE)] == [22, 37, 22, 26]
    assert GenerationRequest(prompt=["x"]).resolved(ARCH).cfg == 1.0  # Turbo: no CFG


def test_one_rank_equals_the_pipeline(model_dir, layout_pools, oracle):
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig())
    for prompts, cfg in (([A], 1.0), ([A, B], 3.0), ([A, B, C], 1.0), ([B], 2.5)):
        req = request(prompts, cfg)
        got = pool.generate(req).samples
        assert got.shape == (len(prompts), 16, H // 8, W // 8)
        check(got, oracle(req), f"1 rank, {len(prompts)} prompt(s), cfg {cfg}")


def test_learned_pads_and_positions_move_the_result(model_dir, layout_pools, pipe, oracle):
    """Negative controls for the equality above: the pipeline with either learned pad token
    zeroed, or with the text's RoPE ids shifted by one, is far from the pool's result, so
    the pool uses both pads and the pipeline's positions."""
    req = request([A, B], 3.0)
    got = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    tr = pipe.transformer
    for name in ("x_pad_token", "cap_pad_token"):
        saved = getattr(tr, name).data.clone()
        getattr(tr, name).data.zero_()
        try:
            moved = run_pipeline(pipe, req)
        finally:
            getattr(tr, name).data.copy_(saved)
        d = float((moved - got).abs().max())
        print(f"{name} zeroed: {d:.2e}")
        assert d > 1e-2, name
    rope, call = tr.rope_embedder, type(tr.rope_embedder).__call__
    type(rope).__call__ = lambda self, ids: call(self, ids + (ids > 0).int())
    try:
        moved = run_pipeline(pipe, req)
    finally:
        type(rope).__call__ = call
    d = float((moved - got).abs().max())
    print(f"positions shifted: {d:.2e}")
    assert d > 1e-2


def test_decoded_image_equals_the_pipeline(model_dir, layout_pools, pipe):
    """The decode (FLUX.1's VAE, row bands over the 2 ranks) from the pool's latent."""
    req = request([A], output="image")
    want = run_pipeline(pipe, req, output_type="pt")
    got = layout_pools.get(model_dir(ARCH), ParallelConfig(ulysses=2), tag="nccl",
                           worker_hooks=NCCL).generate(req).images
    assert got.shape == (1, H, W, 3) and want.std() > 1e-2
    torch.testing.assert_close(got, want.permute(0, 2, 3, 1).float(), atol=1e-4, rtol=1e-4)


# ---- the xDiT MODEL (stock KSampler): one pool request per ComfyUI model call -------------
def comfy_call(tr, batch: int, h: int, w: int, tokens: int = 7, seed: int = 0) -> dict:
    """ComfyUI 0.8.0's Lumina2 / Z-Image diffusion-model call (model_base.Lumina2): latents
    [N, 16, h, w] in model space, sigma as the timestep, one conditioning's text states per
    call (its CONDRegular context concatenates only equal lengths), `num_tokens`; the rows
    of `batch` images of one branch."""
    import uuid
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, h, w, generator=gen)
    ctx = torch.randn(1, tokens, tr.config.cap_feat_dim, generator=gen).expand(batch, -1, -1)
    options = {"uuids": [uuid.uuid4()], "cond_or_uncond": [0]}
    return dict(x=x, timestep=torch.full((batch,), 0.7), context=ctx.contiguous(),
                num_tokens=tokens, transformer_options=options)


def model_reference(tr, x, timestep, context) -> torch.Tensor:
    """What ComfyUI's model returns for the call: the transformer's output negated, the
    timestep given as 1 - sigma (comfy/ldm/lumina NextDiT), from diffusers' own forward."""
    with torch.inference_mode():
        out = tr(list(x.unsqueeze(2)), 1 - timestep, list(context), return_dict=False)[0]
    return -torch.stack(out)[:, :, 0]


MODEL_CASES = [("cfg2", 1), ("ulysses2", 2), ("ring2", 1), ("dp2", 2)]


@pytest.mark.parametrize("name,batch", MODEL_CASES, ids=[f"{n}-b{b}" for n, b in MODEL_CASES])
def test_model_calls_equal_the_transformer(model_dir, layout_pools, pipe, name, batch):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    config = TWO_RANKS[name]
    pool = layout_pools.get(model_dir(ARCH), config, tag="nccl", worker_hooks=NCCL)
    den = PoolDenoiser(pool, config, ARCH)
    call = comfy_call(pipe.transformer, batch, 10, 6)
    want = model_reference(pipe.transformer, call["x"], call["timestep"], call["context"])
    for _ in range(2):  # the second call reuses the pool's conditioning
        got = den(**call)
        assert got.shape == call["x"].shape
        check(got, want, f"MODEL {name} batch {batch}")


# ---- ComfyUI's single files (diffusion_models/): its NextDiT names, fused q/k/v -----------
from comfyui_xdit.testmodels.z_image import single_file as comfy_names  # noqa: E402


def test_bf16_and_fp8_files_are_close_to_the_folder(model_dir, layout_pools, pipe, tmp_path):
    """The transformer as ComfyUI keeps it (a checkpoint: `model.diffusion_model.`) is
    detected; its bf16 file and ComfyUI's scaled-fp8 file of it (block weights in fp8 with
    scale_weight beside) give a latent close to the folder's, not equal (their weights are
    rounded). That the fp32 file equals its folder is the conformance suite's single-file
    theme (tests/conformance/test_single_file.py)."""
    from safetensors.torch import save_file

    from comfyui_xdit import WorkerPool
    from comfyui_xdit.planning.model_info import read_model_info
    from comfyui_xdit.testmodels.tiny_model import write_fp8_file

    state = comfy_names(pipe.transformer.state_dict())
    path = tmp_path / "z_image_tiny.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()},
              str(path))
    info = read_model_info(path)
    assert (info.arch, info.kind, info.heads, info.blocks, info.patch_size) == \
        (ARCH, "file", 4, 6, 2)
    bf16 = tmp_path / "z_image_tiny_bf16.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(bf16))
    fp8 = write_fp8_file(path, tmp_path / "z_image_tiny_fp8.safetensors", scaled=True)
    assert read_model_info(fp8).storage == "scaled-fp8"
    with torch.no_grad():
        pos = pipe.encode_prompt([A], do_classifier_free_guidance=False,
                                 max_sequence_length=MSL)[0][0][None]
        neg = pipe.encode_prompt([NEGATIVE], do_classifier_free_guidance=False,
                                 max_sequence_length=MSL)[0][0][None]
    req = GenerationRequest(prompt=[], positive={"cond": pos, "pooled": None},
                            negative={"cond": neg, "pooled": None}, cfg=3.0, seed=3, steps=3,
                            height=H, width=W)
    folder = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    check(folder, run_pipeline(pipe, request([A], seed=3)), "CONDITIONING vs prompt")
    for name, file, bound in (("bf16", bf16, 0.05), ("fp8", fp8, 0.1)):
        with WorkerPool(str(file), ParallelConfig(), device="cpu", threads_per_rank=1) as pool:
            got = pool.generate(req).samples
        d = float((got - folder).abs().max())
        assert 0 < d < bound * float(folder.abs().max()), f"{name} file vs folder {d}"


# ---- the memory plan: preset `z-image` and a folder, padded sequences ----------------------
def test_memory_plan_reads_z_image(model_dir):
    """The preset's transformer is Z-Image-Turbo's ~6.15 B parameters (30 heads x 128, Qwen3
    states 2560 wide), its text encoder Qwen3-4B's ~4.0 B; a folder's facts come from its
    config's own names (n_heads, dim, cap_feat_dim); each stream counts padded to 32."""
    from comfyui_xdit.planning import memory_arithmetic as ma
    from comfyui_xdit.planning import model_facts as mf

    facts = mf.preset_facts("z-image")
    tr = mf.transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    params = sum(n for b in tr.blocks for n, _, _ in b) + sum(n for n, _, _ in tr.rest)
    assert 6.1e9 < params < 6.2e9, params
    assert 3.9e9 < facts.text_encoder_params < 4.1e9, facts.text_encoder_params
    assert (tr.heads, tr.hidden, tr.context_dim, len(tr.blocks)) == (30, 3840, 2560, 34)
    folder = mf.model_facts(str(model_dir(ARCH)), "fp32")
    tiny = mf.transformer_facts(folder.transformer_class, folder.transformer_config, ARCH)
    assert (tiny.heads, tiny.hidden, tiny.context_dim, len(tiny.blocks)) == (4, 64, 32, 6)
    assert ma.job_tokens(folder, ma.JobSize(height=H, width=W, text_tokens=22)) == 32 + 32
    assert ma.job_tokens(facts, ma.JobSize()) == 4096 + 512


# ---- PipeFusion: exact with full warmup, and against its stale-K/V oracle ------------------
# The tiny model has 2 + 2 refiner blocks and 2 main blocks: the refiners and one main block
# on stage 0 (Z-Image's refiners take the image and the text apart; the adapter refuses a
# split that cuts them), the other main block on stage 1.
PF_SPLIT = "5,1"
PF_STEPS = 4


def bands(rows: int, patches: int) -> list:
    """Row bands of near-equal height; the first rows % patches bands one row taller."""
    out, r = [], 0
    for i in range(patches):
        n = rows // patches + (1 if i < rows % patches else 0)
        out.append((r, r + n))
        r += n
    return out


class _Band:
    """One attention call's part of the band forward (passed to the stock blocks as their
    attention mask, which they hand to the processor): the cache it reads (`kind`), the cache
    positions of its tokens, and per row the cache positions it may attend to."""

    def __init__(self, kind, positions, keep):
        self.kind, self.positions, self.keep = kind, positions, keep


class StaleKVProcessor:
    """Z-Image's attention (the stock processor's projections, norms and RoPE, written with
    diffusers' apply_rotary_emb) whose keys and values come from a cache of the layer's full
    sequence per guidance branch: a forward writes its fresh K/V into their positions, then
    its queries attend to the cache (each row to its own keys). `refresh=False`: after the
    first (warmup) forward nothing is written (the negative control)."""

    def __init__(self, oracle):
        self.oracle = oracle
        self.caches = {}

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 freqs_cis=None):
        import torch.nn.functional as F
        from diffusers.models.embeddings import apply_rotary_emb

        band, o = attention_mask, self.oracle
        q, k, v = (f(hidden_states).unflatten(-1, (attn.heads, -1))
                   for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        q = apply_rotary_emb(q, freqs_cis, use_real=False)
        k = apply_rotary_emb(k, freqs_cis, use_real=False)
        key = (id(attn), o.branch)
        full = band.keep.shape[1]
        if key not in self.caches:
            self.caches[key] = (k.new_zeros(k.shape[0], full, *k.shape[2:]),
                                v.new_zeros(v.shape[0], full, *v.shape[2:]))
        ck, cv = self.caches[key]
        if o.write:
            ck[:, band.positions], cv[:, band.positions] = k, v
        out = F.scaled_dot_product_attention(q.transpose(1, 2), ck.transpose(1, 2),
                                             cv.transpose(1, 2),
                                             attn_mask=band.keep[:, None, None, :])
        out = attn.to_out[0](out.transpose(1, 2).flatten(2, 3))
        return out


class ZImagePipelined:
    """PipeFusion's pipelined algorithm for Z-Image, in one process from diffusers' modules
    alone (nothing from workers/): steps before `warmup` run the whole image in one forward;
    later steps run the row bands one after another, band 0 first. A band's forward computes
    its image tokens, and for band 0 also the image's learned pad tokens and the whole text
    (text refiner included); every attention layer (image refiner: [image, image pads]; text
    refiner: the text; main blocks: [image, image pads, text]) reads a K/V cache of its full
    sequence per guidance branch, refreshed by each forward's own tokens. Positions as the
    pipeline's (text 1..P, image P + 1, pads 0); CFG as ZImagePipeline (pos + g (pos - neg),
    negated); each band's rows take the Euler step once its branches are done."""

    def __init__(self, pipe):
        self.pipe, self.tr = pipe, pipe.transformer
        self.branch, self.write = 1, True
        self.proc = StaleKVProcessor(self)

    def _cond(self, prompts, msl):
        with torch.no_grad():
            return self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                           max_sequence_length=msl)[0]

    def forward(self, x, t, caps, band, with_text):
        """The prediction of latent rows band (token rows r0..r1) of x [B, 16, h, w]."""
        tr, (r0, r1) = self.tr, band
        b, _, h, w = x.shape
        rows, cols = h // 2, w // 2
        n, pad = rows * cols, (-(rows * cols)) % 32
        p_text = [len(c) + (-len(c)) % 32 for c in caps]
        text = max(p_text)
        adaln = tr.t_embedder(t * tr.t_scale).type_as(x)
        tokens = torch.stack([tr._patchify_image(xi[:, None, 2 * r0:2 * r1], 2, 1)[0]
                              for xi in x])
        img = tr.all_x_embedder["2-1"](tokens)
        ids = [tr.create_coordinate_grid((1, r1 - r0, cols), (p + 1, r0, 0)).flatten(0, 2)
               for p in p_text]
        pos_img = torch.arange(r0 * cols, r1 * cols)
        if with_text:  # band 0 carries the image's pad tokens
            img = torch.cat([img, tr.x_pad_token.expand(b, pad, -1)], 1)
            ids = [torch.cat([i, torch.zeros(pad, 3, dtype=i.dtype)]) for i in ids]
            pos_img = torch.cat([pos_img, torch.arange(n, n + pad)])
        img_freqs = torch.stack([tr.rope_embedder(i) for i in ids])
        keep_img = torch.ones(b, n + pad, dtype=torch.bool)
        keep_txt = torch.stack([torch.arange(text) < p for p in p_text])
        for layer in tr.noise_refiner:
            img = layer(img, _Band("image", pos_img, keep_img), img_freqs, adaln)
        seq, freqs, pos = img, img_freqs, pos_img
        if with_text:
            cap = torch.stack([torch.cat([tr.cap_embedder(c), tr.cap_pad_token.expand(
                p - len(c), -1), torch.zeros(text - p, tr.config.dim)])
                for c, p in zip(caps, p_text)])
            txt_ids = tr.create_coordinate_grid((text, 1, 1), (1, 0, 0)).flatten(0, 2)
            cap_freqs = tr.rope_embedder(txt_ids)[None].expand(b, -1, -1)
            for layer in tr.context_refiner:
                cap = layer(cap, _Band("text", torch.arange(text), keep_txt), cap_freqs)
            seq = torch.cat([img, cap], 1)
            freqs = torch.cat([img_freqs, cap_freqs], 1)
            pos = torch.cat([pos_img, n + pad + torch.arange(text)])
        keep = torch.cat([keep_img, keep_txt], 1)
        for layer in tr.layers:
            seq = layer(seq, _Band("joint", pos, keep), freqs, adaln)
        out = tr.all_final_layer["2-1"](seq[:, :(r1 - r0) * cols], c=adaln)
        return out.view(b, r1 - r0, cols, 2, 2, -1).permute(0, 5, 1, 3, 2, 4).reshape(
            b, -1, 2 * (r1 - r0), w)

    def run(self, req, warmup, patches, refresh=True) -> torch.Tensor:
        pipe, tr = self.pipe, self.tr
        b = len(req.prompt)
        x = torch.randn([b, 16, req.height // 8, req.width // 8],
                        generator=torch.manual_seed(req.seed))
        pos = self._cond(req.prompt, req.max_sequence_length)
        branches = {1: pos}
        g = float(req.cfg) - 1
        if g > 0:
            branches[0] = self._cond([req.negative_prompt] * b, req.max_sequence_length)
        sched = pipe.scheduler
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / req.steps, req.steps).tolist())
        sigmas, timesteps = sched.sigmas, sched.timesteps
        attns = [m for m in tr.modules() if hasattr(m, "set_processor")]
        saved = [m.processor for m in attns]
        for m in attns:
            m.set_processor(self.proc)
        self.proc.caches = {}
        try:
            with torch.no_grad():
                for i in range(req.steps):
                    t = ((1000 - timesteps[i].expand(b)) / 1000)
                    whole = i < warmup
                    self.write = refresh or whole
                    for j, band in enumerate([(0, req.height // 16)] if whole else
                                             bands(req.height // 16, patches)):
                        outs = {}
                        for br, caps in sorted(branches.items()):
                            self.branch = br
                            outs[br] = self.forward(x, t, caps, band, j == 0)
                        o = outs[1] if g <= 0 else outs[1] + g * (outs[1] - outs[0])
                        r0, r1 = band
                        x[:, :, 2 * r0:2 * r1] += (sigmas[i + 1] - sigmas[i]) * -o
        finally:
            for m, proc in zip(attns, saved):
                m.set_processor(proc)
        vae = pipe.vae.config
        return x / vae.scaling_factor + vae.shift_factor


def pipelined_oracle(folder) -> ZImagePipelined:
    """The oracle on a model folder: the conformance suite's PipeFusion theme calls it
    (comfyui_xdit/testmodels/z_image.PIPEFUSION_ORACLE)."""
    from diffusers import ZImagePipeline
    p = ZImagePipeline.from_pretrained(str(folder)).to(torch.float32)
    p.set_progress_bar_config(disable=True)
    return ZImagePipelined(p)


@pytest.fixture(scope="module")
def pipelined(pipe):
    return ZImagePipelined(pipe)


def test_pipelined_oracle_is_the_pipeline_where_nothing_is_stale(pipelined, oracle):
    """The oracle itself: with every step a warmup step (or one band) it is the pipeline."""
    for prompts, cfg in (([A, B], 3.0), ([C], 1.0)):
        req = request(prompts, cfg, steps=PF_STEPS)
        check(pipelined.run(req, PF_STEPS, 2), oracle(req), f"oracle, all warmup, {prompts}")
        check(pipelined.run(req, 0, 1), oracle(req), f"oracle, one band, {prompts}")


def test_pipefusion_with_full_warmup_is_exact(model_dir, layout_pools, oracle):
    for config in (ParallelConfig(pipefusion=2, warmup_steps=3, pipefusion_split=PF_SPLIT),
                   ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3,
                                  pipefusion_split=PF_SPLIT)):
        pool = layout_pools.get(model_dir(ARCH), config)
        req = request([A, B])
        check(pool.generate(req).samples, oracle(req), f"{config.describe()}, warmup 3 of 3")


def test_pipefusion_refuses_a_split_through_the_refiners():
    """The refiners and one main block must sit on stage 0 (checked as a stage is
    assembled, before any job)."""
    from comfyui_xdit.bridge import worker_module
    stages, z = worker_module("loading.stages"), worker_module("models.z_image")
    cfg = {"n_refiner_layers": 2}
    for ranges in (((0, 3), (3, 6)), ((0, 4), (4, 6))):
        with pytest.raises(ValueError, match="refiner blocks"):
            z.check_stages(cfg, stages.StageInfo(1, 2, ranges, 6, "balanced"))
    z.check_stages(cfg, stages.StageInfo(0, 2, ((0, 5), (5, 6)), 6, PF_SPLIT))
    z.check_stages(cfg, None)


# ---- ComfyUI 0.8.0's own Z-Image (comfy/ldm/lumina NextDiT) on the same file ---------------
COMFY_NEXTDIT = r'''
import sys, torch
sys.path.insert(0, ".")
files, sys.argv = sys.argv[1:], ["main.py", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.ops
from comfy.ldm.lumina.model import NextDiT
from safetensors.torch import load_file
cfg = dict(%(cfg)s)
m = NextDiT(patch_size=2, in_channels=16, n_kv_heads=cfg["n_heads"], multiple_of=1,
            ffn_dim_multiplier=8.0 / 3.0, qk_norm=True, z_image_modulation=True,
            time_scale=1000.0, pad_tokens_multiple=32, operations=comfy.ops.disable_weight_init,
            **cfg)
m.load_state_dict(load_file(files[0]), strict=True)
io = torch.load(files[1])
with torch.no_grad():
    out = m(io["x"], io["sigma"], io["ctx"], num_tokens=io["ctx"].shape[1])
torch.save(out, files[2])
'''


@pytest.mark.skipif(not (os.environ.get("COMFYUI_PATH") and os.environ.get("COMFYUI_PYTHON")),
                    reason="COMFYUI_PATH / COMFYUI_PYTHON not set (a ComfyUI 0.8.0 checkout)")
def test_model_call_equals_comfyui_own_z_image(tmp_path):
    """The xDiT MODEL's call (Ulysses 2) on a ComfyUI-named single file equals ComfyUI's own
    Z-Image model (comfy/ldm/lumina NextDiT with Z-Image's modulation and pad tokens, built
    with that file's widths and strictly loaded from it) on the same call: 1 - sigma inside,
    the negated output, text first, its own RoPE. Width 1024 (ComfyUI's time embedder is
    1024 wide whatever the model's width; its detection builds only the released 3840, so
    this builds NextDiT directly rather than through UNETLoader); 1 main and 2 + 2 refiner
    blocks, 13 text tokens."""
    import subprocess
    import uuid

    from diffusers import ZImageTransformer2DModel
    from safetensors.torch import save_file

    from comfyui_xdit import WorkerPool
    from comfyui_xdit.nodes.model_calls import PoolDenoiser

    cfg = dict(dim=1024, n_layers=1, n_refiner_layers=2, n_heads=8, cap_feat_dim=64,
               axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0)
    torch.manual_seed(5)
    tr = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16,
                                  n_kv_heads=8, **cfg).eval()
    with torch.no_grad():
        for p in (tr.x_pad_token, tr.cap_pad_token):
            p.normal_()
    path = tmp_path / "z_image_1024.safetensors"
    save_file({k: v.contiguous() for k, v in comfy_names(tr.state_dict()).items()}, str(path))
    g = torch.Generator().manual_seed(1)
    io = {"x": torch.randn(2, 16, 8, 8, generator=g), "sigma": torch.tensor([0.7, 0.7]),
          "ctx": torch.randn(1, 13, 64, generator=g).expand(2, -1, -1).contiguous()}
    torch.save(io, tmp_path / "io.pt")
    config = ParallelConfig(ulysses=2)
    with WorkerPool(str(path), config, device="cpu", threads_per_rank=1) as pool:
        got = PoolDenoiser(pool, config, ARCH)(
            x=io["x"], timestep=io["sigma"], context=io["ctx"], num_tokens=13,
            transformer_options={"uuids": [uuid.uuid4()], "cond_or_uncond": [0]})
    script = tmp_path / "nextdit.py"
    script.write_text(COMFY_NEXTDIT % {"cfg": ", ".join(f"{k}={v!r}" for k, v in cfg.items())})
    subprocess.run([os.environ["COMFYUI_PYTHON"], str(script), str(path), str(tmp_path / "io.pt"),
                    str(tmp_path / "out.pt")], cwd=os.environ["COMFYUI_PATH"], check=True,
                   timeout=600)
    want = torch.load(tmp_path / "out.pt")
    check(got, want, "xDiT MODEL vs ComfyUI 0.8.0's NextDiT")


def test_a_text_past_the_rope_table_is_refused_and_the_pool_stays(model_dir, layout_pools):
    """1600 text tokens (padded 1600) need RoPE positions past the tiny model's 1536-row
    text axis: one line, and the next job runs."""
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig(ulysses=2), tag="nccl",
                            worker_hooks=NCCL)
    long = {"cond": torch.randn(1, 1600, 32), "pooled": None}
    with pytest.raises(Exception, match="RoPE reaches 1534 text tokens"):
        pool.generate(GenerationRequest(prompt=[], positive=long, cfg=1.0, seed=1, steps=1,
                                        height=H, width=W))
    assert pool.generate(request([A], steps=1)).samples.shape == (1, 16, H // 8, W // 8)
