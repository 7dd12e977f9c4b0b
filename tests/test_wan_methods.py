"""Wan (2.1 T2V and 2.2 A14B's two experts) under weight sharding, PipeFusion and LoRA.

* `shard_weights` (FSDP2, shard-only loading; the RoPE tables are computed, not read): at
  Ulysses 2 and DP 2 the pool equals WanPipeline (<= 1e-4, fp32); for A14B both experts are
  sharded (each rank holds about half of both experts' block weights).
* PipeFusion 2: with warmup >= steps it equals WanPipeline (the patches are contiguous token
  ranges that run across frames: a 5-D latent is worked on token-major); pipelined (warmup 1)
  it runs and stays close; on A14B each stage holds its blocks of both experts and the
  warmup starts again at the expert switch.
* LoRA (on the sharded pools, one launch per variant): a diffusers/PEFT LoRA equals
  WanPipeline with `load_lora_weights`; on A14B a LoRA entry goes into both experts
  (workers/loading/lora.py), as the pipeline loading it into transformer and transformer_2.

The oracle is WanPipeline on the same folder and ComfyUI's noise for the LATENT shape
[B, 16, T, H/8, W/8]; its result is brought to ComfyUI's LATENT (x * std + mean).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

TOL = 1e-4
H, W, FRAMES, STEPS, MSL = 32, 48, 5, 3, 16
PROMPTS = ["a red cat walking", "a dog"]
NEGATIVE = "blurry"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    d = tmp_path_factory.mktemp("wan_methods")
    return {"t2v": ensure_tiny_model("wan", d), "a14b": ensure_tiny_model("wan", d,
                                                                          variant="a14b")}


@pytest.fixture(scope="module")
def pipes(folders):
    from diffusers import WanPipeline
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = WanPipeline.from_pretrained(str(folders[variant])).to(torch.float32)
        return made[variant]
    return get


def request(batch=2, cfg=4.0, cfg_2=None, seed=5, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[:batch], negative_prompt=NEGATIVE, seed=seed,
                             steps=STEPS, height=H, width=W, frames=FRAMES, cfg=cfg,
                             cfg_2=cfg_2, max_sequence_length=MSL, **kw)


def oracle(pipe, req: GenerationRequest, h: int = H) -> torch.Tensor:
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    b = len(req.prompt)
    noise = torch.randn([b, 16, (FRAMES - 1) // 4 + 1, h // 8, W // 8],
                        generator=torch.manual_seed(req.seed))
    kw = {} if req.cfg_2 is None else {"guidance_scale_2": req.cfg_2}
    out = pipe(prompt=list(req.prompt), negative_prompt=req.negative_prompt, height=h,
               width=W, num_frames=FRAMES, num_inference_steps=req.steps, guidance_scale=req.cfg,
               latents=noise, max_sequence_length=MSL, output_type="latent", **kw).frames
    return out * std + mean


LAYOUT_POOLS_KEEP = 1  # pools kept warm at once (conftest's layout_pools)


def diff(a, b) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


# ---- weight sharding ------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["t2v", "a14b"])
def test_sharded_equals_the_pipeline_and_lora(folders, pipes, layout_pools, tmp_path, variant):
    """Sharded at Ulysses 2 and DP 2: WanPipeline; then, on the same pool, a PEFT LoRA (see
    check_lora)."""
    req = request(cfg_2=3.0 if variant == "a14b" else None)
    want = oracle(pipes(variant), req)
    diffs = {}
    for name, config in (("ulysses2", ParallelConfig(ulysses=2)), ("dp2", ParallelConfig(dp=2))):
        pool = layout_pools.get(folders[variant], config, shard_weights=True)
        res = pool.generate(req)
        diffs[name] = diff(res.samples, want)
    counts = [st["sharding"] for st in res.stats]
    print(f"wan {variant} shard_weights vs WanPipeline, max abs diff:", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs
    for c in counts:  # each rank holds about half of every expert's block weights
        assert c["load"] == "shards only"
        assert c["block_params_local"] <= 0.55 * c["block_params"]
        assert c.get("transformers", 1) == (2 if variant == "a14b" else 1)
    if variant == "a14b":  # both experts' blocks are counted
        one = pipes(variant).transformer
        blocks = sum(p.numel() for p in one.blocks.parameters())
        assert counts[0]["block_params"] == 2 * blocks
    check_lora(folders, pool, tmp_path, variant)


# ---- PipeFusion ----------------------------------------------------------------------------
def test_pipefusion_equals_the_pipeline_with_full_warmup(folders, pipes, layout_pools):
    """48 x 48, 5 frames: 2 latent frames of 3 token rows each, 6 token rows in all. With
    warmup >= steps (one whole patch) the result is WanPipeline's; pipelined (warmup 1) with
    2 patches (one frame each) and 4 patches (rows 2-4 cross the frame boundary) it runs and
    stays close (one-step-stale K/V), and differs from the exact run (it did pipeline)."""
    req = dataclasses.replace(request(), height=48)
    want = oracle(pipes("t2v"), req, h=48)
    diffs = {}
    for name, config in (
            ("warmup=steps", ParallelConfig(pipefusion=2, warmup_steps=STEPS)),
            ("warmup=1", ParallelConfig(pipefusion=2, warmup_steps=1)),
            ("warmup=1,4 patches", ParallelConfig(pipefusion=2, warmup_steps=1,
                                                  pipeline_patches=4))):
        pool = layout_pools.get(folders["t2v"], config)
        diffs[name] = diff(pool.generate(req).samples, want)
    print("wan PipeFusion 2 vs WanPipeline, max abs diff:", diffs)
    assert diffs["warmup=steps"] <= TOL
    scale = float(want.abs().max())
    for k in ("warmup=1", "warmup=1,4 patches"):  # stale K/V: close, not exact
        assert 1e-4 < diffs[k] < 0.2 * scale, (k, diffs[k], scale)


def experts_of(pipe, steps: int) -> list:
    """WanPipeline's expert per step: high-noise (0) while t >= boundary_ratio x 1000."""
    pipe.scheduler.set_timesteps(steps)
    bound = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    return [0 if float(t) >= bound else 1 for t in pipe.scheduler.timesteps]


def test_pipefusion_with_two_experts(folders, pipes, layout_pools):
    """Wan 2.2 A14B under PipeFusion: each stage holds its blocks of both experts. Warmup >=
    steps equals WanPipeline. The warmup starts again where the low-noise expert takes over
    (its K/V caches hold nothing yet): with experts 0, 1 and warmup 1 both steps run the
    whole image, so the result is WanPipeline's too (without the restart the second step
    would be pipelined over an empty cache); with experts 0, 0, 1, 1 steps 1 and 3 are
    pipelined, step 2 runs whole (UniPC stepped band by band, each band's history its own)
    and the result stays close."""
    pipe = pipes("a14b")
    assert experts_of(pipe, 2) == [0, 1] and experts_of(pipe, 4) == [0, 0, 1, 1]
    report = {}
    for steps in (STEPS, 2, 4):
        req = dataclasses.replace(request(batch=1), height=48, cfg_2=2.0, steps=steps)
        want = oracle(pipe, req, h=48)
        if steps == STEPS:  # (one pool: the warmup is a per-job setting)
            exact = layout_pools.get(folders["a14b"], ParallelConfig(pipefusion=2,
                                                                     warmup_steps=STEPS))
            report["warmup=steps"] = diff(exact.generate(req).samples, want)
            assert report["warmup=steps"] <= TOL
        piped = layout_pools.get(folders["a14b"], ParallelConfig(pipefusion=2, warmup_steps=1))
        report[f"warmup 1, {steps} steps"] = d = diff(piped.generate(req).samples, want)
        if steps == 2:
            assert d <= TOL, report
        else:
            assert 1e-4 < d < 0.2 * float(want.abs().max()), report
    print("wan A14B PipeFusion 2 vs WanPipeline, max abs diff:", report)


# ---- LoRA ----------------------------------------------------------------------------------
def _peft_lora(folder, path_dir):
    """A random PEFT LoRA (r 4) on the tiny transformer's attention and FFN Linears, saved
    in diffusers' format (`transformer.` keys)."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    t = WanTransformer3DModel.from_pretrained(str(folder), subfolder="transformer")
    cfg = LoraConfig(r=4, lora_alpha=8.0, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                           "ffn.net.0.proj", "ffn.net.2"])
    t.add_adapter(cfg, adapter_name="x")
    g = torch.Generator().manual_seed(3)
    for n, p in t.named_parameters():
        if "lora_" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    WanPipeline.save_lora_weights(path_dir, transformer_lora_layers=get_peft_model_state_dict(
        t, adapter_name="x"), transformer_lora_adapter_metadata=cfg.to_dict())
    return path_dir / "pytorch_lora_weights.safetensors"


def check_lora(folders, pool, tmp_path, variant):
    """The pool's LoRA equals WanPipeline's `load_lora_weights` at strength 0.7; on A14B the
    entry goes into both experts (the pipeline: loaded into transformer and, with
    load_into_transformer_2, into transformer_2)."""
    from diffusers import WanPipeline
    folder = folders[variant]
    path = _peft_lora(folder, tmp_path)
    pipe = WanPipeline.from_pretrained(str(folder)).to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    req = request(batch=1, cfg_2=3.0 if variant == "a14b" else None)
    base = oracle(pipe, req)
    pipe.load_lora_weights(str(path), adapter_name="l")
    names = ["l"]
    if variant == "a14b":
        pipe.load_lora_weights(str(path), adapter_name="l2", load_into_transformer_2=True)
        pipe.transformer_2.set_adapters(["l2"], [0.7])
        pipe.transformer.set_adapters(["l"], [0.7])
    else:
        pipe.set_adapters(names, [0.7])
    want = oracle(pipe, req)
    assert float((want - base).abs().max()) > 1e-2  # the LoRA matters
    pool.reconfigure(ParallelConfig(ulysses=2))
    got = pool.generate(dataclasses.replace(req, loras=[(str(path), 0.7)])).samples
    err = diff(got, want)
    off = diff(pool.generate(req).samples, base)  # no LoRA: the base model again
    print(f"wan {variant} PEFT LoRA (sharded, ulysses 2) vs load_lora_weights: max abs diff {err:.2e}, "
          f"then without: {off:.2e}")
    assert err <= TOL and off <= TOL
