"""Ideogram 4 through the pool at one rank equals diffusers' Ideogram4Pipeline
(docs/design.md#numerics-rule-4), with its unconditional branch on its own transformer; that
every other method equals one rank is the conformance suite's (tests/conformance/).

The tiny model (comfyui_xdit/testmodels/ideogram4.py) has two transformers of different
weights, so a pool that ran the unconditional pass on the conditional transformer (or gave
it the prompt) fails. At 80 x 48 the image is 5 x 3 tokens; the prompts have different
lengths, so a batch's rows carry their own text lengths.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

TOL = 1e-4
ARCH = "ideogram4"
H, W = 80, 48  # 5 x 3 tokens
A = "a red cat"
B = "a big blue dog sitting on a green field with many flowers and trees near a river"
C = "sky"
MSL = 48


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import Ideogram4Pipeline
    p = Ideogram4Pipeline.from_pretrained(str(model_dir(ARCH))).to(torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def to_pipeline_tokens(latent: torch.Tensor) -> torch.Tensor:
    """ComfyUI's FLUX.2 LATENT [B, 128, h, w] (channel, row, column in patch) -> the
    pipeline's tokens [B, h * w, 128] (row, column in patch, channel), as ComfyUI's own
    Ideogram 4 reorders them."""
    b, c, h, w = latent.shape
    return latent.view(b, c // 4, 2, 2, h, w).permute(0, 4, 5, 2, 3, 1).reshape(b, h * w, c)


def from_pipeline_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, n, c = tokens.shape
    return tokens.view(b, h, w, 2, 2, c // 4).permute(0, 5, 3, 4, 1, 2).reshape(b, c, h, w)


def run_pipeline(pipe, req: GenerationRequest) -> torch.Tensor:
    """Ideogram4Pipeline from ComfyUI's noise for the request (a FLUX.2 LATENT), a constant
    guidance scale of the request's cfg; the result as a FLUX.2 LATENT."""
    b = len(req.prompt)
    h, w = req.height // 16, req.width // 16
    noise = torch.randn([b, 128, h, w], generator=torch.manual_seed(req.seed))
    out = pipe(prompt=list(req.prompt), height=req.height, width=req.width,
               num_inference_steps=req.steps, latents=to_pipeline_tokens(noise),
               guidance_scale=float(req.cfg), guidance_schedule=None,
               max_sequence_length=req.max_sequence_length, output_type="latent").images
    return from_pipeline_tokens(out, h, w)


def request(prompts, cfg: float = 3.0, **kw) -> GenerationRequest:
    return GenerationRequest(**dict(dict(prompt=list(prompts), seed=11, steps=3, height=H,
                                         width=W, cfg=cfg, max_sequence_length=MSL), **kw))


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    print(f"{what}: max abs diff {diff:.2e}")
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    return diff


def test_one_rank_equals_the_pipeline(model_dir, layout_pools, pipe):
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig())
    for prompts, cfg in (([A], 3.0), ([A, B, C], 4.0), ([B], 1.0)):
        req = request(prompts, cfg)
        got = pool.generate(req).samples
        assert got.shape == (len(prompts), 128, H // 16, W // 16)
        check(got, run_pipeline(pipe, req), f"1 rank, {len(prompts)} prompt(s), cfg {cfg}")


def test_the_unconditional_transformer_is_used(model_dir, layout_pools, pipe):
    """Negative control: the pipeline with its unconditional transformer swapped for the
    conditional one is far from the pool's result, so the pool runs the second one."""
    req = request([A], 3.0)
    got = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    saved = pipe.unconditional_transformer
    pipe.unconditional_transformer = pipe.transformer
    try:
        moved = run_pipeline(pipe, req)
    finally:
        pipe.unconditional_transformer = saved
    d = float((moved - got).abs().max())
    print(f"unconditional branch on the conditional transformer: {d:.2e}")
    assert d > 1e-2


# ---- CFG parallel: each cfg rank holds only its branch's transformer ----------------------
def _transformer_params(folder, sub: str) -> int:
    from safetensors import safe_open
    n = 0
    for f in sorted((folder / sub).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                count = 1
                for s in shape:
                    count *= s
                n += count
    return n


def test_cfg_ranks_hold_only_their_branch(model_dir, layout_pools):
    """Under CFG parallel cfg rank 0 (the unconditional pass) loads only the
    unconditional_transformer and cfg rank 1 only the transformer: each rank's parameters
    are one transformer's, and the result equals one rank (which holds both, as does every
    rank of a layout without CFG parallel)."""
    folder = model_dir(ARCH)
    one = _transformer_params(folder, "transformer")
    assert one == _transformer_params(folder, "unconditional_transformer")
    req = request([A, B], 3.0)
    want = layout_pools.get(folder, ParallelConfig()).generate(req).samples
    for config, branches in ((ParallelConfig(cfg_parallel=True), ("uncond", "cond")),
                             (ParallelConfig(cfg_parallel=True, ulysses=2),
                              ("uncond", "uncond", "cond", "cond"))):
        pool = layout_pools.get(folder, config)
        got = pool.generate(req).samples
        ranks = pool.status()["ranks"]
        held = [r["transformer_params"] for r in ranks]
        print(f"{config.describe()}: parameters per rank {held} (one transformer {one}), "
              f"branches {[r['load'].get('branch') for r in ranks]}")
        assert held == [one] * len(branches)
        assert tuple(r["load"].get("branch") for r in ranks) == branches
        check(got, want, f"{config.describe()} with one transformer per rank")
    both = layout_pools.get(folder, ParallelConfig(ulysses=2))
    both.generate(req)
    assert [r["transformer_params"] for r in both.status()["ranks"]] == [2 * one] * 2


def test_shard_weights_at_cfg_parallel_equals_one_rank(model_dir, layout_pools):
    """shard_weights under CFG parallel: each cfg rank runs its own branch's transformer, so
    each is sharded over the ranks of its branch alone (a gather over every rank would pair
    one transformer's blocks with the other's, silently). At CFG 2, launched so and after a
    reconfigure from Ulysses 2 on the same pool (a relaunch: the branch layout is part of
    what the weights depend on), the result equals one rank, and each rank holds its
    branch's transformer only."""
    from comfyui_xdit import WorkerPool
    folder = model_dir(ARCH)
    one = _transformer_params(folder, "transformer")
    req = request([A, B], 3.0)
    want = layout_pools.get(folder, ParallelConfig()).generate(req).samples
    cfg2 = ParallelConfig(cfg_parallel=True)
    with WorkerPool(str(folder), cfg2, device="cpu", threads_per_rank=1,
                    shard_weights=True) as pool:
        check(pool.generate(req).samples, want, "shard_weights at cfg 2")
        ranks = pool.status()["ranks"]
        assert tuple(r["load"].get("branch") for r in ranks) == ("uncond", "cond")
        assert [r["transformer_params"] for r in ranks] == [one] * 2
    # each branch's transformer sharded over its two ranks (FSDP over the branch's group)
    with WorkerPool(str(folder), ParallelConfig(cfg_parallel=True, ulysses=2), device="cpu",
                    threads_per_rank=1, shard_weights=True) as pool:
        check(pool.generate(req).samples, want, "shard_weights at cfg 2 x ulysses 2")
        ranks = pool.status()["ranks"]
        assert tuple(r["load"].get("branch") for r in ranks) == ("uncond",) * 2 + ("cond",) * 2
    with WorkerPool(str(folder), ParallelConfig(ulysses=2), device="cpu",
                    threads_per_rank=1, shard_weights=True) as pool:
        check(pool.generate(req).samples, want, "shard_weights at ulysses 2")
        pool.reconfigure(cfg2)
        check(pool.generate(req).samples, want, "shard_weights, ulysses 2 -> cfg 2")
        pool.reconfigure(ParallelConfig(ulysses=2))
        check(pool.generate(req).samples, want, "shard_weights, cfg 2 -> ulysses 2")


def test_cfg_rank_refuses_a_pass_of_the_other_branch(model_dir):
    """A rank holding one branch cannot run the other's pass: one clear line, not the wrong
    transformer."""
    import types

    from comfyui_xdit.bridge import worker_module
    adapter = worker_module("families").family(ARCH).adapter_class()()
    adapter.branch = "uncond"
    model = types.SimpleNamespace(transformer="uncond weights", transformer_2=None)
    assert adapter.transformer_for(model, {"branch": "uncond"}) == "uncond weights"
    with pytest.raises(ValueError, match="holds only the uncond branch's transformer"):
        adapter.transformer_for(model, {})


def test_memory_plan_counts_one_transformer_per_cfg_rank(model_dir):
    """The plan's weights per rank: two transformers without CFG parallel, one with it (each
    cfg rank its branch's), for the tiny folder and the released preset."""
    from comfyui_xdit.planning import memory_arithmetic as ma
    from comfyui_xdit.planning import model_facts as mf
    from comfyui_xdit.planning.config import EngineOptions

    for facts in (mf.model_facts(str(model_dir(ARCH)), "fp32"), mf.preset_facts("ideogram4")):
        assert facts.experts == 2
        job = ma.JobSize(height=1024, width=1024, cfg=True)
        both = ma.plan(facts, ParallelConfig(ulysses=2), EngineOptions(), job,
                       alternatives=False)
        split = ma.plan(facts, ParallelConfig(cfg_parallel=True), EngineOptions(), job,
                        alternatives=False)
        w2 = [r.weights for r in both.ranks]
        w1 = [r.weights for r in split.ranks]
        print(f"{facts.name}: weights per rank {w2} (ulysses 2) vs {w1} (cfg parallel)")
        assert len(set(w1)) == 1 and len(set(w2)) == 1
        assert w2[0] == 2 * w1[0]


def test_memory_plan_cli_shows_one_transformer_per_cfg_rank(capsys):
    """`python -m comfyui_xdit memory-plan --preset ideogram4`: the per-rank weights halve
    under --cfg-parallel."""
    from comfyui_xdit.cli.commands import main

    import re

    def weights(*extra) -> float:
        main(["memory-plan", "--preset", "ideogram4", "--height", "1024", "--width", "1024",
              "--cfg", *extra])
        out = capsys.readouterr().out
        return float(re.search(r"transformer weights ([\d.]+) GiB", out).group(1))

    plain, cfg = weights("--ulysses", "2"), weights("--cfg-parallel")
    print(f"transformer weights per rank: {plain} GiB at ulysses 2, {cfg} GiB at cfg parallel")
    assert abs(plain - 2 * cfg) <= 0.1 and 17 < cfg < 18, (plain, cfg)  # 9.3 B params, bf16


def test_decode_follows_comfyuis_flux2_latent(model_dir, layout_pools, pipe):
    """The pool's decode reads the LATENT as ComfyUI's FLUX.2 one: the VAE's batch-norm
    statistics per LATENT channel (channel, row, column in patch), then unpatchified. It
    equals that decode done by hand with the folder's VAE (<= 1e-4). Ideogram4Pipeline's own
    decode indexes the statistics in its token order (row, column, channel), so on a VAE whose
    statistics differ per channel it gives another image: the two conventions disagree, and
    the pack follows ComfyUI's (docs/models.md#ideogram-4)."""
    req = request([A], 3.0, output="image")
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig())
    got = pool.generate(req).images.permute(0, 3, 1, 2)
    latent = pool.generate(request([A], 3.0)).samples
    vae = pipe.vae
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
    raw = latent * std + vae.bn.running_mean.view(1, -1, 1, 1)
    b, c, h, w = raw.shape
    raw = raw.view(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, 2 * h, 2 * w)
    with torch.no_grad():
        want = (vae.decode(raw, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
    check(got, want, "decode vs FLUX.2's convention by hand")
    noise = torch.randn([1, 128, h, w], generator=torch.manual_seed(req.seed))
    theirs = pipe(prompt=[A], height=H, width=W, num_inference_steps=req.steps,
                  latents=to_pipeline_tokens(noise), guidance_scale=3.0, guidance_schedule=None,
                  max_sequence_length=MSL, output_type="pt").images
    d = float((theirs - got).abs().max())
    print(f"Ideogram4Pipeline's own decode of the same latents: {d:.2e} away")
    assert d > 1e-2


def test_pipefusion_is_refused_before_a_launch(model_dir):
    """PipeFusion is not staged for a model of two branch transformers yet: the request's
    check says so in one line, before any worker starts."""
    from comfyui_xdit.errors import ConfigError
    from comfyui_xdit.planning.model_info import read_model_info
    info = read_model_info(str(model_dir(ARCH)))
    config = ParallelConfig(pipefusion=2, pipefusion_split="1,1")
    with pytest.raises(ConfigError, match="PipeFusion does not run Ideogram 4 yet"):
        config.validate(info, request([A], 3.0))


def test_a_negative_prompt_is_refused_not_dropped(model_dir):
    """The unconditional pass runs without text, so a negative prompt (or negative
    CONDITIONING) would change nothing: one line before any launch, not a silent drop."""
    from comfyui_xdit.errors import ConfigError
    from comfyui_xdit.planning.model_info import read_model_info
    info = read_model_info(str(model_dir(ARCH)))
    req = request([A], 3.0, negative_prompt="blurry")
    with pytest.raises(ConfigError, match="negative prompt would change nothing"):
        ParallelConfig().validate(info, req)
    ParallelConfig().validate(info, request([A], 3.0))  # without one: fine
