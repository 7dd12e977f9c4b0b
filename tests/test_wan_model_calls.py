"""The xDiT MODEL's calls for Wan (comfyui_xdit/nodes/model_calls.py, workers/sampling/model_call.py):
ComfyUI's WAN21 model calls its diffusion model with video latents [N, 16, T, h, w] (T > 1
frames), sigma x 1000 as the timestep (its flow model sampling's multiplier) and the UMT5
states as context, the conditional and unconditional rows side by side. Each call must
return what diffusers' WanTransformer3DModel returns for the same inputs, with the rows over
the CFG ranks and the video tokens over Ulysses; for a Wan 2.2 A14B folder a call names its
expert (the high-noise `transformer` or the low-noise `transformer_2`), both kept loaded by
one pool.

One tiny A14B folder and one 2-rank pool serve every case (the first expert is a Wan 2.1
transformer like any other).
"""
from __future__ import annotations

import uuid

import pytest
import torch

from comfyui_xdit import ParallelConfig
from comfyui_xdit.client.pool import PoolError
from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.nodes.model_calls import PoolDenoiser
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

TOL = 1e-5


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    return ensure_tiny_model("wan", tmp_path_factory.mktemp("wan-calls"), variant="a14b")


@pytest.fixture(scope="module")
def pool(a14b):
    from comfyui_xdit import WorkerPool
    p = WorkerPool(str(a14b), ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1)
    yield p
    p.close()


@pytest.fixture(scope="module")
def experts(a14b):
    from diffusers import WanTransformer3DModel
    return [WanTransformer3DModel.from_pretrained(str(a14b), subfolder=sub,
                                                  torch_dtype=torch.float32).eval()
            for sub in ("transformer", "transformer_2")]


def comfy_call(tr, frames=2, h=6, w=4, tokens=5, seed=0):
    """One batched call as ComfyUI's WAN21 makes it: uncond then cond row, 5-D latents."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, frames, h, w, generator=gen)
    context = torch.randn(2, tokens, tr.config.text_dim, generator=gen)
    timestep = torch.tensor(0.7 * 1000).expand(2)  # ModelSamplingDiscreteFlow: sigma x 1000
    return dict(x=x, timestep=timestep, context=context,
                transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()],
                                     "cond_or_uncond": [1, 0]})


def reference(tr, call):
    with torch.inference_mode():
        return tr(hidden_states=call["x"], timestep=call["timestep"],
                  encoder_hidden_states=call["context"], return_dict=False)[0]


@pytest.mark.parametrize("config", [ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)],
                         ids=["ulysses2", "cfg_parallel"])
def test_video_call_equals_the_transformer_per_expert(pool, experts, config):
    got = {}
    for expert, tr in enumerate(experts):
        den = PoolDenoiser(pool, config.with_world_size(2), "wan")
        den.expert = expert
        call = comfy_call(tr, seed=3)
        want = reference(tr, call)
        out = den(**call)
        assert out.shape == call["x"].shape == (2, 16, 2, 6, 4) and out.dtype == torch.float32
        diff = float((out - want).abs().max())
        assert diff <= TOL, f"{config.describe()} expert {expert}: max abs diff {diff:.3e}"
        got[expert] = out
    # the two experts differ: the call really ran the one it named
    assert float((got[0] - got[1]).abs().max()) > 1e-3


def test_unknown_expert_and_image_latents_are_refused_pool_stays_warm(pool, experts):
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "wan")
    call = comfy_call(experts[0], seed=4)
    den.expert = 2
    with pytest.raises(PoolError, match="expert 3 asked for, but this model has 2"):
        den(**call)
    den.expert = 0
    with pytest.raises(PoolError, match=r"frames, height/8"):  # 4-D: no frame axis
        den(**dict(call, x=call["x"][:, :, 0]))
    out = den(**call)  # still warm and right
    assert float((out - reference(experts[0], call)).abs().max()) <= TOL


def test_step_cache_gates_the_expert_a_call_runs(pool, experts):
    """Step cache (xDiT) on the low-noise expert's MODEL: its first call is computed in full
    (equals transformer_2), the next, with a threshold every change stays under, skips
    its middle blocks: the cache gated the transformer the call ran."""
    from comfyui_xdit.nodes.settings import CacheSettings, cache_request
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "wan")
    den.expert = 1
    den.cache = cache_request(CacheSettings(threshold=100.0, warmup=1, head=1, tail=0,
                                            max_skips=3))
    call = comfy_call(experts[1], seed=5)
    first = den(**call)
    assert float((first - reference(experts[1], call)).abs().max()) <= TOL
    assert den.last_stats["cache"] == {"computed": 2, "skipped": 0}  # rows
    later = dict(call, timestep=torch.tensor(650.0).expand(2))  # the same sampling run
    out = den(**later)
    assert den.last_stats["cache"] == {"computed": 0, "skipped": 2}, den.last_stats
    assert torch.isfinite(out).all()


def test_image_to_video_call_takes_comfyui_concat_channels(tmp_path_factory):
    """Wan 2.2 I2V A14B on the MODEL path: ComfyUI's WAN21 concatenates the start frame's
    channels (mask 4 + latent 16) to x, so a call brings 36 channels and gets the 16-channel
    prediction back, also across CFG ranks (the gather at the output's width)."""
    from diffusers import WanTransformer3DModel

    from comfyui_xdit import WorkerPool
    folder = ensure_tiny_model("wan", tmp_path_factory.mktemp("wan-i2v-calls"),
                               variant="i2v-a14b")
    trs = [WanTransformer3DModel.from_pretrained(str(folder), subfolder=sub,
                                                 torch_dtype=torch.float32).eval()
           for sub in ("transformer", "transformer_2")]
    pool = WorkerPool(str(folder), ParallelConfig(cfg_parallel=True), device="cpu",
                      threads_per_rank=1)
    try:
        den = PoolDenoiser(pool, ParallelConfig(cfg_parallel=True).with_world_size(2), "wan")
        for expert, tr in enumerate(trs):
            den.expert = expert
            call = comfy_call(tr, seed=6 + expert)
            gen = torch.Generator().manual_seed(9)
            call["x"] = torch.cat([call["x"], torch.randn(2, 20, 2, 6, 4, generator=gen)], 1)
            out = den(**call)
            assert out.shape == (2, 16, 2, 6, 4)
            diff = float((out - reference(tr, call)).abs().max())
            assert diff <= TOL, f"expert {expert}: {diff:.3e}"
    finally:
        pool.close()


class _ImageFirst:
    """A Wan 2.1 I2V cross-attention written out: the first `n` context tokens are the
    image's (their own K/V projections and K norm), the rest the text's; plain softmax
    attention over each, summed (ComfyUI's rule for the image tokens' count)."""

    def __init__(self, n):
        self.n = n

    def __call__(self, attn, x, context=None, attention_mask=None, rotary_emb=None):
        def heads(t):
            return t.unflatten(2, (attn.heads, -1))

        def attend(q, k, v):
            w = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
            return torch.einsum("bhqk,bkhd->bqhd", w.softmax(-1), v)
        q = heads(attn.norm_q(attn.to_q(x)))
        image, text = context[:, :self.n], context[:, self.n:]
        out = attend(q, heads(attn.norm_k(attn.to_k(text))), heads(attn.to_v(text)))
        out = out + attend(q, heads(attn.norm_added_k(attn.add_k_proj(image))),
                           heads(attn.add_v_proj(image)))
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


def test_wan21_i2v_call_takes_comfyui_clip_fea(tmp_path_factory):
    """Wan 2.1 I2V on the MODEL path: ComfyUI's WAN21 brings the start frame's 20 channels
    beside x and the CLIP vision states as `clip_fea`; the pool gives them to the transformer
    as encoder_hidden_states_image, and the text as it comes: the cross-attention takes the
    first clip_fea-many context tokens as the image's and the rest as the text, as ComfyUI's
    own model does (diffusers' processor assumes 512 text tokens; equal where the text has
    512, ComfyUI's UMT5 length). Equal to the transformer (for 5 text tokens with its
    cross-attentions replaced by that rule written out here) over Ulysses 2 and CFG
    parallel; the image states and the text length matter; a negative without them, wrong
    widths and a transformer without image K/V are refused and the pool stays warm."""
    from diffusers import WanTransformer3DModel

    from comfyui_xdit import WorkerPool
    folder = ensure_tiny_model("wan", tmp_path_factory.mktemp("wan21-i2v-calls"), variant="i2v")
    tr = WanTransformer3DModel.from_pretrained(str(folder), subfolder="transformer",
                                               torch_dtype=torch.float32).eval()
    pool = WorkerPool(str(folder), ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1)
    try:
        call = comfy_call(tr, seed=11)
        gen = torch.Generator().manual_seed(12)
        call["x"] = torch.cat([call["x"], torch.randn(2, 20, 2, 6, 4, generator=gen)], 1)
        clip = torch.randn(1, 7, tr.config.image_dim, generator=gen).expand(2, -1, -1)
        text = torch.cat([call["context"], call["context"].new_zeros(2, 512 - 5,
                                                                     tr.config.text_dim)], 1)

        def reference(context):
            with torch.inference_mode():
                return tr(hidden_states=call["x"], timestep=call["timestep"],
                          encoder_hidden_states=context, encoder_hidden_states_image=clip,
                          return_dict=False)[0]
        want512 = reference(text)  # diffusers' own processor: 512 text tokens
        stock = {b: b.attn2.processor for b in tr.blocks}
        for b in tr.blocks:
            b.attn2.set_processor(_ImageFirst(clip.shape[1]))
        try:
            want = reference(call["context"])  # the 5 tokens as given
            assert float((reference(text) - want512).abs().max()) <= TOL  # the rule is right
        finally:
            for b, proc in stock.items():
                b.attn2.set_processor(proc)
        assert float((want - want512).abs().max()) > 1e-3  # the text's length matters
        for config in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)):
            den = PoolDenoiser(pool, config.with_world_size(2), "wan")
            out = den(**call, clip_fea=clip)
            assert out.shape == (2, 16, 2, 6, 4)
            diff = float((out - want).abs().max())
            assert diff <= TOL, f"{config.describe()}: {diff:.3e}"
        # the 512-token padded text (ComfyUI's own encoder's length): diffusers' processor
        out = den(**dict(call, context=text), clip_fea=clip)
        assert float((out - want512).abs().max()) <= TOL
        # a conditioning's clip_fea is fixed for its sampling run (ComfyUI's uuids): another
        # run (fresh uuids) with other image states gets another prediction
        def run(c):
            return dict(call, transformer_options=dict(call["transformer_options"],
                                                       uuids=[uuid.uuid4(), uuid.uuid4()]))
        other = den(**run(call), clip_fea=torch.randn(clip.shape, generator=gen))
        assert float((other - want).abs().max()) > 1e-3
        with pytest.raises(ConfigError, match=r"clip_fea\) have shape"):
            den(**run(call), clip_fea=clip[0])
        with pytest.raises(PoolError, match=r"CLIP vision states must be \[1, tokens, 32\]"):
            den(**run(call), clip_fea=clip[:, :, :3])
        out = den(**call, clip_fea=clip)  # still warm and right
        assert float((out - want).abs().max()) <= TOL
    finally:
        pool.close()


def test_clip_fea_refused_without_image_cross_attention(pool, experts):
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "wan")
    call = comfy_call(experts[0], seed=13)
    with pytest.raises(PoolError, match="has no image cross-attention"):
        den(**call, clip_fea=torch.randn(2, 7, 32))
    with pytest.raises(ConfigError, match="not taken by FLUX.1 models"):
        PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "flux")(
            **call, clip_fea=torch.randn(2, 7, 32))
    assert float((den(**call) - reference(experts[0], call)).abs().max()) <= TOL
