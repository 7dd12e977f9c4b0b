"""MiniMax-H3's own oracle: one rank of the pool equals diffusers' modular MiniMaxH3
pipeline at fp32 (max abs <= 1e-4 on the video and the audio latents), and so does the
layout alone (workers/models/minimax_h3_layout.py: the packed sequence, the two schedules
stepped as one Euler step, the prompt encoding) run on the stock transformer. The pipeline
is the builder's own, in memory (its Qwen3-VL processor cannot be saved without
torchvision); the pool reads the same seeded weights from the tiny folder.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit.bridge import worker_module

TOL = 1e-4
FRAMES = 124  # the pipeline's shortest video (5 s at 24 fps; 17 x 7 + 5)
HEIGHT, WIDTH = 96, 64


@pytest.fixture(scope="module")
def pipe():
    from comfyui_xdit.testmodels import minimax_h3 as builder
    from comfyui_xdit.testmodels.tiny_model import resolve_config

    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ModularPipeline

    p = builder.build_pipeline(resolve_config("minimax_h3")).pipe
    assert isinstance(p, MiniMaxH3ModularPipeline)  # diffusers' own, as the release runs it
    p.update_components(processor=builder.processor(p.tokenizer))
    return p


def _noise(lt, lh, lw, n_audio, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 24, lt, lh, lw, generator=g),
            torch.randn(2, 32, n_audio, generator=g))


@torch.inference_mode()
def _loop(pipe, prompt, video, audio, steps, frames=FRAMES):
    """The pack's arithmetic: the packed call and the loop's one Euler step."""
    mm = worker_module("models.minimax_h3_layout")
    fam = worker_module("families.minimax_h3")
    euler_step = worker_module("sampling.flow_step").euler_step  # the loop's own step
    text = mm.encode_prompt(pipe.text_encoder, pipe.tokenizer, prompt, "cpu", torch.float32)
    _, _, lt, lh, lw = video.shape
    layout = mm.packed(text.shape[1], lt, lh, lw, audio.shape[-1])
    sched = mm.Schedules.make(steps)
    x = mm.patchify(video)
    a = mm.audio_rows(audio[None])
    ts, ratio = sched.timesteps(), sched.audio_ratio()
    for i in range(steps):
        v, va = mm.call(pipe.transformer, x, a, text, ts[i], layout)
        x = euler_step(x, -v, sched.video, i)
        a = euler_step(a, -va * ratio[i], sched.video, i)
    assert fam.LATENT.latent_frames(frames) == lt
    return mm.unpatchify(x, lt, lh, lw, 24), mm.audio_latent(a, audio.shape[-1])[0]


@pytest.mark.parametrize("prompt", ["a cat", "a big blue dog sitting on a green field"])
def test_the_layout_equals_the_pipeline(pipe, prompt):
    fam = worker_module("families.minimax_h3")
    lt = fam.LATENT.latent_frames(FRAMES)
    video, audio = _noise(lt, HEIGHT // 16, WIDTH // 16, fam.audio_latents(FRAMES))
    steps = 3
    out = pipe(prompt=prompt, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
               num_inference_steps=steps + 1, latents=video.clone(),
               audio_latents=audio.clone(), output=["latents", "audio_latents"])
    got_v, got_a = _loop(pipe, prompt, video, audio, steps)
    dv = float((got_v - out["latents"]).abs().max())
    da = float((got_a - out["audio_latents"]).abs().max())
    print(f"{prompt!r}: video {dv:.2e}, audio {da:.2e} from the pipeline")
    assert dv <= TOL and da <= TOL, (dv, da)
    # not degenerate: the sample moved from the noise
    assert float((got_v - video).abs().max()) > 1e-2
    assert float((got_a - audio).abs().max()) > 1e-2


def test_one_rank_equals_the_pipeline(pipe, model_dir):
    """The pool at one rank (its packed forward, its noise: the host's video noise, the
    sound's from the seed) against the pipeline given that noise, two prompts of different
    lengths in one batch (each runs alone: its length moves every position)."""
    from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
    from comfyui_xdit.comfy_convert import comfy_noise

    fam = worker_module("families.minimax_h3")
    prompts, seed, steps = ["a cat", "a big blue dog sitting on a green field"], 11, 3
    lt, n = fam.LATENT.latent_frames(FRAMES), fam.audio_latents(FRAMES)
    req = GenerationRequest(prompt=prompts, seed=seed, steps=steps, height=HEIGHT, width=WIDTH,
                            frames=FRAMES, cfg=1.0, output="image")
    with WorkerPool(str(model_dir("minimax_h3")), ParallelConfig(), device="cpu",
                    threads_per_rank=1) as pool:
        got = pool.generate(req)
    video = comfy_noise(seed, (2, 24, lt, HEIGHT // 16, WIDTH // 16))
    audio = torch.randn(2, 2, 32, n, generator=torch.Generator().manual_seed(seed))
    mean, std = (torch.tensor(pipe.vae.config[k]).view(1, -1, 1, 1, 1)
                 for k in ("latents_mean", "latents_std"))
    for j, prompt in enumerate(prompts):
        with torch.inference_mode():
            out = pipe(prompt=prompt, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                       num_inference_steps=steps + 1, latents=video[j:j + 1].clone(),
                       audio_latents=audio[j].clone(), output_type="pt",
                       output=["latents", "audio_latents", "videos", "audio"])
        want_v = out["latents"] * std + mean  # ComfyUI's LATENT: the VAE's own space
        want_a = out["audio_latents"].permute(1, 0, 2)  # [32, 2, N]: ComfyUI's audio part
        dv = float((got.samples[j:j + 1] - want_v).abs().max())
        da = float((got.latents.audio[j] - want_a).abs().max())
        # decoded: the frames (IMAGE rows of this prompt) and the stereo 32 kHz waveform
        frames = got.images[j * FRAMES:(j + 1) * FRAMES]  # [F, H, W, 3]
        want_f = out["videos"][0].permute(0, 2, 3, 1)
        df = float((frames - want_f).abs().max())
        dw = float((got.decoded.audio[j] - out["audio"][0]).abs().max())
        print(f"pool row {j}: video {dv:.2e}, audio {da:.2e}, frames {df:.2e}, waveform "
              f"{dw:.2e} from the pipeline")
        assert dv <= TOL and da <= TOL and df <= TOL and dw <= TOL, (j, dv, da, df, dw)
        assert got.decoded.sample_rate == 32000 and got.decoded.audio.shape[1] == 2


# ---- PipeFusion: against its stale-K/V oracle -----------------------------------------------
# The stale-K/V semantics for MiniMax-H3 (docs/methods.md, PipeFusion): the K/V cache of each
# main block's attention covers the whole packed sequence [text | audio | video]. Steps before
# `warmup` run it in one forward. Later steps cut the video's token rows (a latent frame's
# height/32 rows after another's) into bands, run one after another; band 0's forward also
# computes the whole text (refiner included) and the whole sound. A forward writes its rows'
# fresh K/V into the cache, then its queries attend to the whole cache: the other bands' K/V
# are from this step (the bands before it) or the previous one (after it). Once a band's
# forward is done its video rows take the Euler step, and band 0's sound rows theirs.
PF_STEPS, PF_PATCHES = 3, 2
PF_FRAMES, PF_SIZE = 22, (96, 96)  # 7 latent frames of 3 x 3 tokens: 21 token rows
PF_PROMPT = "a big blue dog sitting on a green field"


def bands(rows: int, patches: int) -> list:
    """Row bands of near-equal height; the first rows % patches bands one row taller."""
    out, r = [], 0
    for i in range(patches):
        n = rows // patches + (1 if i < rows % patches else 0)
        out.append((r, r + n))
        r += n
    return out


class _Rows:
    """One forward's rows: their positions in the packed sequence (handed to the stock
    blocks as their attention mask, which they pass to the processor untouched)."""

    def __init__(self, positions):
        self.positions = positions


class StaleKVProcessor:
    """The stock MiniMax-H3 attention (projections, per-head RMS norms, partial RoPE) whose
    keys and values come from a cache of the layer's whole packed sequence: a forward writes
    its rows' fresh K/V at their positions (unless `write` is off: the negative control),
    then its queries attend to the whole cache."""

    def __init__(self, length: int):
        self.length, self.write, self.caches = length, True, {}

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        import torch.nn.functional as F
        from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

        q, k, v = (f(hidden_states).unflatten(-1, (attn.heads, -1))
                   for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k = _apply_rotary_emb(q, *rotary_emb), _apply_rotary_emb(k, *rotary_emb)
        if id(attn) not in self.caches:
            self.caches[id(attn)] = tuple(t.new_zeros(t.shape[0], self.length, *t.shape[2:])
                                          for t in (k, v))
        ck, cv = self.caches[id(attn)]
        if self.write:
            ck[:, attention_mask.positions], cv[:, attention_mask.positions] = k, v
        out = F.scaled_dot_product_attention(q.transpose(1, 2), ck.transpose(1, 2),
                                             cv.transpose(1, 2))
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class MiniMaxH3Pipelined:
    """PipeFusion's pipelined algorithm for MiniMax-H3 in one process (semantics above),
    from the stock transformer's modules and the packed layout (held to the pipeline by
    test_the_layout_equals_the_pipeline); one prompt at a time (each prompt's length moves
    every position, so rows never share a call)."""

    def __init__(self, pipe):
        self.pipe, self.tr = pipe, pipe.transformer

    def forward(self, proc, x, a, text, t_pair, lay, cols, band, with_text):
        """(video velocity of the band's rows, the sound's velocity or None), data-ward."""
        tr, (r0, r1) = self.tr, band
        v0 = lay.text + lay.audio
        rows = torch.arange(v0 + r0 * cols, v0 + r1 * cols)
        seq = [tr.proj_in(x[:, r0 * cols:r1 * cols])]
        if with_text:
            rows = torch.cat([torch.arange(v0), rows])
            text = tr.token_refiner(tr.context_embedder(text))
            seq = [text, tr.audio_proj_in(a)] + seq
        h = torch.cat(seq, 1)
        steps = lay.timestep_rows("cpu")[rows]
        temb = tr.time_embedder(tr.time_proj(t_pair.float()))
        rotary = tr.rope(lay.positions[rows])
        for block in tr.transformer_blocks:
            h = block(h, temb, steps * 3 + lay.tags[rows], rotary, _Rows(rows))
        h = tr.norm_out(h, temb, steps)
        n = (r1 - r0) * cols
        video = tr.proj_out(h[:, h.shape[1] - n:])
        audio = tr.audio_proj_out(h[:, lay.text:v0]) if with_text else None
        return video.float(), None if audio is None else audio.float()

    @torch.inference_mode()
    def run_prompt(self, prompt, video, audio, steps, warmup, patches, refresh=True):
        """video noise [1, 24, T, h, w], audio noise [2, 32, N] -> (the video latent, the
        sound latent [2, 32, N]), model space."""
        mm = worker_module("models.minimax_h3_layout")
        text = mm.encode_prompt(self.pipe.text_encoder, self.pipe.tokenizer, prompt, "cpu",
                                torch.float32)
        _, _, lt, lh, lw = video.shape
        lay = mm.packed(text.shape[1], lt, lh, lw, audio.shape[-1])
        sched = mm.Schedules.make(steps)
        x, a = mm.patchify(video), mm.audio_rows(audio[None])
        ts, ratio = sched.timesteps(), sched.audio_ratio()
        rows, cols = lt * (lh // 2), lw // 2
        proc = StaleKVProcessor(lay.length)
        attns = [b.attn for b in self.tr.transformer_blocks]
        saved = [m.processor for m in attns]
        for m in attns:
            m.set_processor(proc)
        try:
            for i in range(steps):
                whole = i < warmup
                proc.write = refresh or whole
                ds = sched.video[i + 1] - sched.video[i]
                for j, (r0, r1) in enumerate([(0, rows)] if whole else bands(rows, patches)):
                    v, va = self.forward(proc, x, a, text, ts[i], lay, cols, (r0, r1), j == 0)
                    x[:, r0 * cols:r1 * cols] = x[:, r0 * cols:r1 * cols] + ds * -v
                    if va is not None:
                        a = a + ds * (-va * ratio[i])
        finally:
            for m, p in zip(attns, saved):
                m.set_processor(p)
        return mm.unpatchify(x, lt, lh, lw, 24), mm.audio_latent(a, audio.shape[-1])[0]


    def run(self, req, warmup, patches, refresh=True):
        """A pool request's (video LATENT [B, 24, T, h, w] in the VAE's space, sound
        [B, 32, 2, N]) as the pool returns them, from the pool's noise (`_pf_noise`), each
        prompt alone."""
        mean, std = (torch.tensor(self.pipe.vae.config[k]).view(1, -1, 1, 1, 1)
                     for k in ("latents_mean", "latents_std"))
        video, audio = _pf_noise(req.seed, len(req.prompt), req.frames, req.height, req.width)
        rows = [self.run_prompt(p, video[j:j + 1], audio[j], req.steps, warmup, patches, refresh)
                for j, p in enumerate(req.prompt)]
        return (torch.cat([v for v, _ in rows]) * std + mean,
                torch.stack([a.permute(1, 0, 2) for _, a in rows]))


def pipelined_oracle(folder) -> MiniMaxH3Pipelined:
    """The oracle on a model folder: the conformance suite's PipeFusion theme holds the pool
    to it, video and sound (comfyui_xdit/testmodels/minimax_h3.PIPEFUSION_ORACLE). It reads
    only the parts it runs (the folder's Qwen3-VL processor needs torchvision to load)."""
    import os
    from types import SimpleNamespace

    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Transformer3DModel
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    def part(name):
        return os.path.join(str(folder), name)

    return MiniMaxH3Pipelined(SimpleNamespace(
        transformer=MiniMaxH3Transformer3DModel.from_pretrained(part("transformer")).eval(),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(
            part("text_encoder"), dtype=torch.float32).eval(),
        tokenizer=AutoTokenizer.from_pretrained(part("tokenizer")),
        vae=AutoencoderKLMiniMaxH3.from_pretrained(part("vae"))))


@pytest.fixture(scope="module")
def pipelined(pipe):
    return MiniMaxH3Pipelined(pipe)


def _pf_noise(seed, batch, frames=PF_FRAMES, height=PF_SIZE[0], width=PF_SIZE[1]):
    """The pool's noise for a request: the host's video noise, the sound's from the seed
    (row b the b-th draw)."""
    from comfyui_xdit.comfy_convert import comfy_noise
    fam = worker_module("families.minimax_h3")
    lt, n = fam.LATENT.latent_frames(frames), fam.audio_latents(frames)
    return (comfy_noise(seed, (batch, 24, lt, height // 16, width // 16)),
            torch.randn(batch, 2, 32, n, generator=torch.Generator().manual_seed(seed)))


def _diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_pipelined_oracle_is_the_pipeline_where_nothing_is_stale(pipe, pipelined):
    """The oracle itself: with every step a warmup step it is the layout's plain loop (held
    to the pipeline above), video and sound."""
    video, audio = _pf_noise(3, 1)
    want = _loop(pipe, PF_PROMPT, video, audio[0], PF_STEPS, PF_FRAMES)
    got = pipelined.run_prompt(PF_PROMPT, video, audio[0], PF_STEPS, PF_STEPS, PF_PATCHES)
    d = _diff(got, want)
    print(f"oracle, all warmup: {d:.2e} from the plain loop")
    assert d <= TOL, d


# ---- ComfyUI's single file (`tiny-model --comfy-file`) ----------------------------------------
def test_comfyui_file_is_detected_and_loads_as_the_folder(model_dir, tmp_path):
    """The tiny folder's transformer in ComfyUI 0.33.0's key layout: detected as MiniMax-H3
    in ComfyUI's naming, its config read from the shapes equal to the folder's, and the
    loader's conversion gives back exactly the folder's tensors (the writer and the loader's
    table are written separately)."""
    import json

    from safetensors.torch import load_file

    from comfyui_xdit.testmodels.tiny_model import write_comfy_file
    from workers.loading.single_file import read_transformer_state, to_diffusers_state
    from workers.models.detect import single_file_config

    folder = model_dir("minimax_h3")
    path = write_comfy_file("minimax_h3", folder, tmp_path / "minimax_h3_tiny.safetensors")
    sf = single_file_config(str(path))
    assert (sf["arch"], sf["naming"], sf["prefix"]) == \
        ("minimax_h3", "bfl", "model.diffusion_model.")
    want_cfg = json.loads((folder / "transformer" / "config.json").read_text())
    for k, v in sf["config"].items():
        if k in want_cfg and not k.startswith("_"):
            assert want_cfg[k] == v or list(want_cfg[k]) == list(v), k
    state = read_transformer_state(str(path), sf["prefix"])
    assert "blocks.0.attn.qkv_proj.weight" in state and "rope.inv_freq" in state
    got = to_diffusers_state("minimax_h3", "bfl", state, sf["config"])
    want = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert torch.equal(got[k], w), k


# ---- ComfyUI's MODEL call (ComfyUI 0.33.0's MiniMaxH3 conventions) ---------------------------
def _comfy_reference(tr, video, audio, text, sigma, scale):
    """ComfyUI 0.33.0's MiniMaxH3 diffusion-model call, written here from its conventions on
    the stock transformer: the timestep sigma x 1000 (the video's), the sound's own sigma
    on the audio schedule (shift 12 -> 3), the sampler's carried sound (scale = video shift /
    audio shift) undone before and the carried variable's derivative returned; -v out."""
    mm = worker_module("models.minimax_h3_layout")
    base = sigma / (12.0 + sigma * (1.0 - 12.0))
    sigma_a = 3.0 * base / (1.0 + 2.0 * base)
    carry = sigma_a / sigma if scale != 1.0 else 1.0
    own = audio * carry
    _, _, lt, lh, lw = video.shape
    n = audio.shape[-1]
    layout = mm.packed(text.shape[1], lt, lh, lw, n)
    with torch.inference_mode():
        v, a = mm.call(tr, mm.patchify(video), mm.audio_rows(own.permute(0, 2, 1, 3)), text,
                       torch.tensor([1.0 - sigma, 1.0 - sigma_a]), layout)
    pv = -mm.unpatchify(v, lt, lh, lw, 24)
    pa = -mm.audio_latent(a, n).permute(0, 2, 1, 3)
    if scale != 1.0:
        pa = (1.0 - scale) * own + (1.0 + (scale - 1.0) * sigma_a) * pa
    return [pv, pa]


@pytest.fixture(scope="module")
def comfy_file(model_dir, tmp_path_factory):
    """The tiny transformer as a ComfyUI single file, and the stock transformer it holds."""
    from diffusers import MiniMaxH3Transformer3DModel

    from comfyui_xdit.testmodels.tiny_model import write_comfy_file

    folder = model_dir("minimax_h3")
    path = write_comfy_file("minimax_h3", folder,
                            tmp_path_factory.mktemp("comfy") / "minimax_h3_tiny.safetensors")
    return path, MiniMaxH3Transformer3DModel.from_pretrained(str(folder / "transformer")).eval()


def test_model_call_on_the_comfyui_file_is_comfyui_model(comfy_file, layout_pools):
    """The xDiT MODEL's call (Ulysses 2, then CFG parallel) on the ComfyUI single file, as
    ComfyUI 0.33.0's MiniMaxH3 model class makes it (the nested LATENT's parts, sigma x 1000,
    minimax_payload's audio carry 4 = 12 / 3, each conditioning a call of its own), equals
    that model's conventions on the stock transformer (max abs <= 1e-4, both parts); a
    payload with keyframes is refused in one line."""
    from comfyui_xdit import ParallelConfig
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from comfyui_xdit.planning.config import ConfigError

    path, tr = comfy_file
    g = torch.Generator().manual_seed(3)
    video, audio = torch.randn(1, 24, 7, 4, 6, generator=g), torch.randn(1, 32, 2, 37, generator=g)
    texts = [torch.randn(1, 6, 16, generator=g), torch.randn(1, 9, 16, generator=g)]
    pool = layout_pools.get(path, ParallelConfig(ulysses=2))
    for config in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)):
        den = PoolDenoiser(pool, config.with_world_size(2), "minimax_h3")
        for sigma, scale, text in ((0.7, 4.0, texts[0]), (0.05, 4.0, texts[1]),
                                   (0.4, 1.0, texts[0])):
            got = den([video, audio], torch.tensor([sigma * 1000.0]), context=text,
                      transformer_options={"uuids": [f"u{text.shape[1]}"]},
                      minimax_payload={"audio_scale": scale, "seed": 0})
            want = _comfy_reference(tr, video, audio, text, sigma, scale)
            for part, a, b in zip(("video", "audio"), got, want):
                d = float((a - b).abs().max())
                print(f"{config.describe()} sigma {sigma} carry {scale} {part}: {d:.2e}")
                assert a.shape == b.shape and d <= TOL, (part, d)
    with pytest.raises(ConfigError, match="keyframes"):
        den([video, audio], torch.tensor([700.0]), context=texts[0],
            minimax_payload={"audio_scale": 4.0, "keyframes": [{"resolved_frame_index": 0}]})


def test_model_call_rows_are_each_their_own(comfy_file, layout_pools):
    """One MODEL call of two rows equals each row's call alone (max abs <= 1e-4, both
    parts): rows at different sigmas (ComfyUI may batch rows at different timesteps; each
    row's own sigma, not the first's) and then, as the MODEL's conditionings give them
    (comfyui_xdit/nodes/comfy_model.py), a cond and an uncond of other text lengths in one
    call, the shorter padded with each row's real length beside and the carry read once per
    conditioning (`xdit_inputs`), under Ulysses 2 (both rows on every rank) and CFG
    parallel (a row a rank). Under the step cache (which gates one transformer call) rows
    at different sigmas are refused in one line, and the pool stays warm."""
    from comfyui_xdit import ParallelConfig
    from comfyui_xdit.client.pool import PoolError
    from comfyui_xdit.nodes.model_calls import INPUTS, LENGTHS, PoolDenoiser

    path, _ = comfy_file
    g = torch.Generator().manual_seed(5)
    video, audio = torch.randn(2, 24, 7, 4, 6, generator=g), torch.randn(2, 32, 2, 37, generator=g)
    texts = [torch.randn(1, 9, 16, generator=g), torch.randn(1, 6, 16, generator=g)]
    sigmas = (0.8, 0.3)
    pool = layout_pools.get(path, ParallelConfig(ulysses=2))
    for config in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)):
        den = PoolDenoiser(pool, config.with_world_size(2), "minimax_h3")
        inputs = {INPUTS: {"audio_scale": 4.0}}
        alone = [den([video[i:i + 1], audio[i:i + 1]], torch.tensor([s * 1000.0]),
                     context=texts[i], transformer_options={"uuids": [f"a{i}"]}, **inputs)
                 for i, s in enumerate(sigmas)]
        padded = torch.cat([texts[0], torch.nn.functional.pad(texts[1], (0, 0, 0, 3))])
        calls = {  # the same text, two sigmas; two texts (one padded), two sigmas
            "sigmas": dict(context=texts[0].expand(2, -1, -1), uuids=["a0"]),
            "texts": dict(context=padded, uuids=["a0", "a1"], **{LENGTHS: (9, 6)})}
        for what, kw in calls.items():
            if what == "sigmas":
                want = [den([video[1:], audio[1:]], torch.tensor([sigmas[1] * 1000.0]),
                            context=texts[0], transformer_options={"uuids": ["a0"]},
                            **inputs)]
                want = [alone[0], want[0]]
            else:
                want = alone
            uuids = kw.pop("uuids")
            got = den([video, audio], torch.tensor([s * 1000.0 for s in sigmas]),
                      transformer_options={"uuids": uuids}, **inputs, **kw)
            for part, a, b in zip(("video", "audio"), got, (torch.cat(p) for p in zip(*want))):
                d = float((a - b).abs().max())
                print(f"{config.describe()} {what} {part}: {d:.2e}")
                assert a.shape == b.shape and d <= TOL, (what, part, d)
    den.cache = dict(threshold=0.1, warmup=0, head=1, tail=0, max_skips=0)
    with pytest.raises(PoolError, match="different timesteps"):
        den([video, audio], torch.tensor([s * 1000.0 for s in sigmas]), context=texts[0].expand(
            2, -1, -1), transformer_options={"uuids": ["a0"]}, **inputs)
    pids = pool.worker_pids()
    den([video[:1], audio[:1]], torch.tensor([sigmas[0] * 1000.0]), context=texts[0],
        transformer_options={"uuids": ["a0"]}, **inputs)  # one timestep: cached, served
    assert pool.worker_pids() == pids


def test_audio_sigma_is_the_video_sigma_carried_to_the_audio_schedule():
    """The MODEL's audio sigma (ComfyUI's closed form, `time_shift`) of each video sigma is
    the audio schedule's sigma at the same step (the layout's two grids)."""
    lay = worker_module("models.minimax_h3_layout")
    mhc = worker_module("models.minimax_h3_comfy")
    video, audio = lay.sigmas(21, 12.0), lay.sigmas(21, 3.0)
    assert torch.allclose(mhc.time_shift(video, 12.0, 3.0), audio, atol=1e-6)
    assert torch.allclose(mhc.time_shift(audio, 3.0, 12.0), video, atol=1e-6)


class _Nested:
    """ComfyUI's NestedTensor as the Decode operation reads it (`is_nested`, `unbind`)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def unbind(self):
        return self.tensors


def test_decode_node_gives_the_frames_and_the_sound_of_a_nested_latent():
    """Without ComfyUI: Decode (xDiT)'s operation on the Sampler's LATENT with its sound (the
    "audio" entry, and the two nested as ComfyUI's AV LATENT, which Sampler (xDiT) outputs)
    gives the frames of the video alone and ComfyUI's AUDIO, the 32 kHz stereo waveform of
    the sound latent (800 samples a latent). It failed on the pool before ("'tuple' object
    has no attribute 'float'": the adapter read the pair as one tensor)."""
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, decode, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    import tempfile

    fam = worker_module("families.minimax_h3")
    frames, h, w = 22, 64, 96
    reg = PoolRegistry()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            handle = ModelHandle(path=str(ensure_tiny_model("minimax_h3", tmp)), device="cpu",
                                 dtype="fp32", threads_per_rank=1)
            empty = {"samples": torch.zeros(1, 24, fam.LATENT.latent_frames(frames), h // 16,
                                            w // 16)}
            lat = sample(handle, SampleInputs(latent=empty, prompt="a cat", seed=5, steps=2,
                                              cfg=1.0), registry=reg)
            n = fam.audio_latents(frames)
            assert lat["audio"].shape == (1, 32, 2, n)
            alone, none = decode(handle, {"samples": lat["samples"]}, registry=reg,
                                 with_audio=True)
            assert none is None and alone.shape == (frames, h, w, 3)
            for given in (lat, {"samples": _Nested([lat["samples"], lat["audio"]])}):
                images, audio = decode(handle, given, registry=reg, with_audio=True)
                assert torch.equal(images, alone)
                assert audio["sample_rate"] == 32000
                assert audio["waveform"].shape == (1, 2, n * 800)
                assert float(audio["waveform"].std()) > 0
        finally:
            reg.unload_all()
