"""FLUX.2 on every xDiT method (issue #14): a tiny FLUX.2 [klein]-style model run at every
exact configuration on 2 and 4 ranks equals the single-process diffusers
`Flux2KleinPipeline` to 1e-4 (fp32, final latent) from the same ComfyUI-style noise.

* Ulysses 2 / 4, Ring 2 / 4, Ulysses 2 x Ring 2, CFG parallel (alone and x Ulysses 2), CFG
  in-process, DP 2 and DP 2 x Ulysses 2 (batch 3: uneven), PipeFusion 2 / 4 and PipeFusion
  2 x Ulysses 2 with warmup_steps >= steps (every step synchronous: exact), FSDP2 weight
  sharding on 2 ranks.
* Two sizes: 128x96 (8x6 image tokens) and 112x80 (7x5 tokens: no even split over 2 or 4
  ranks, padded); batch 1 and 3.
* Negative control: PipeFusion with warmup 1 reuses stale K/V, so it is NOT exact (> 1e-4
  off) yet stays close; a test that passed it would not be testing the pipeline.

One pool per launch layout serves every request of its configurations (`reconfigure` keeps
the warm workers for a new non-PipeFusion layout of the same world size).
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.tiny_model import build_tiny_model

TOL = 1e-4
MOVED = 1e-2  # the model moved the latent this far from the noise (a no-op run fails)
PROMPTS = ["a photo of a red cat", "a dog on the grass", "blue sky"]
MSL = 16
STEPS = 2
CFG = 2.5
# (height, width, batch): 8x6 tokens, batch 1; 7x5 tokens (odd on 2 and 4 ranks), batch 3
SHAPES = [(128, 96, 1), (112, 80, 3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model("flux2", tmp_path_factory.mktemp("tiny") / "flux2")


_PIPES: dict = {}


def pipeline(path, distilled: bool = True):
    """The stock pipeline; `distilled=False` overrides the folder's is_distilled so the
    pipeline runs classifier-free guidance (the tiny folder says is_distilled: true, and a
    distilled Flux2KleinPipeline ignores guidance_scale)."""
    from diffusers import Flux2KleinPipeline

    key = (str(path), distilled)
    if key not in _PIPES:
        kw = {} if distilled else {"is_distilled": False}
        pipe = Flux2KleinPipeline.from_pretrained(path, **kw)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe
    return _PIPES[key]


def noise_for(batch, height, width, seed):
    """ComfyUI's prepare_noise for a FLUX.2 LATENT [B,32,h/8,w/8]."""
    return torch.randn((batch, 32, height // 8, width // 8), generator=torch.manual_seed(seed),
                       dtype=torch.float32)


_ORACLES: dict = {}


def oracle(path, req: GenerationRequest, output_type="latent"):
    """The pipeline's result for `req` from `noise_for(...)`: the raw 32-channel latent
    (ComfyUI's LATENT space) or, for output_type "pt", the image [B,3,H,W] in 0..1."""
    from diffusers import Flux2KleinPipeline

    cfg = req.cfg if req.cfg is not None else 1.0
    key = (str(path), tuple(req.prompt), req.seed, req.steps, req.height, req.width, cfg,
           output_type)
    if key not in _ORACLES:
        noise = noise_for(len(req.prompt), req.height, req.width, req.seed)
        pipe = pipeline(path, distilled=cfg <= 1.0)
        _ORACLES[key] = pipe(prompt=list(req.prompt), height=req.height, width=req.width,
                             num_inference_steps=req.steps, guidance_scale=cfg,
                             latents=Flux2KleinPipeline._patchify_latents(noise),
                             max_sequence_length=req.max_sequence_length,
                             output_type=output_type).images
    return _ORACLES[key]


def request(height, width, batch, seed=5, steps=STEPS, cfg=None, **kw):
    return GenerationRequest(prompt=PROMPTS[:batch], seed=seed, steps=steps, height=height,
                             width=width, max_sequence_length=MSL, cfg=cfg, **kw)


@pytest.fixture(scope="module")
def pools(folder):
    """pools(config) -> a warm pool running `config`: one pool per launch layout (world
    size and PipeFusion layout), reconfigured between the configurations it serves."""
    made = {}

    def get(config: ParallelConfig, shard: bool = False):
        key = (config.launch_key(), shard)
        if key not in made:
            made[key] = WorkerPool(str(folder), config, device="cpu", threads_per_rank=1,
                                   shard_weights=shard)
        pool = made[key]
        if pool.config != config:
            pool.reconfigure(config)
        return pool
    yield get
    for p in made.values():
        p.close()


def check_exact(pools, folder, config, shapes=SHAPES, cfg=None, shard=False):
    pool = pools(config, shard)
    for h, w, b in shapes:
        req = request(h, w, b, cfg=cfg)
        noise = noise_for(b, h, w, req.seed)
        want = oracle(folder, req)
        got = pool.generate(req, noise=noise).samples
        assert got.shape == want.shape == (b, 32, h // 8, w // 8)
        assert (want - noise).abs().max() > MOVED
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{config.describe()} {h}x{w} batch {b} cfg {cfg}: max diff {err:.2e}"


# ---- 2 ranks -----------------------------------------------------------------------------

TWO = {
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "dp2": ParallelConfig(dp=2),
}


@pytest.mark.parametrize("name", list(TWO))
def test_two_ranks_exact(pools, folder, name):
    shapes = SHAPES if name != "dp2" else [(h, w, 3) for h, w, _ in SHAPES]
    check_exact(pools, folder, TWO[name], shapes)


def test_cfg_parallel_exact(pools, folder):
    """cfg > 1 on a distilled folder runs CFG as asked (ComfyUI's KSampler does); the oracle
    is the same folder's pipeline told it is not distilled."""
    check_exact(pools, folder, ParallelConfig(cfg_parallel=True), cfg=CFG)


def test_cfg_in_process_exact(pools, folder):
    check_exact(pools, folder, ParallelConfig(ulysses=2), cfg=CFG)


def test_pipefusion2_exact_with_full_warmup(pools, folder):
    check_exact(pools, folder, ParallelConfig(pipefusion=2, warmup_steps=STEPS))


def test_pipefusion_stale_kv_is_close_not_exact(pools, folder):
    """Negative control: warmup 1 of 3 steps pipelines two steps on stale K/V."""
    pool = pools(ParallelConfig(pipefusion=2, warmup_steps=1))
    req = request(128, 96, 1, steps=3)
    want = oracle(folder, req)
    got = pool.generate(req, noise=noise_for(1, 128, 96, req.seed)).samples
    err = (got - want).abs().max().item()
    assert err > TOL, f"PipeFusion with stale K/V equals the exact run ({err:.2e})"
    assert err < 0.5 * (want - noise_for(1, 128, 96, req.seed)).abs().max().item()


def test_sharded_weights_exact(pools, folder):
    check_exact(pools, folder, ParallelConfig(ulysses=2), shard=True)
    check_exact(pools, folder, ParallelConfig(ring=2), shapes=SHAPES[1:], shard=True)


# ---- 4 ranks -----------------------------------------------------------------------------

FOUR = {
    "ulysses4": ParallelConfig(ulysses=4),
    "ring4": ParallelConfig(ring=4),
    "ulysses2_ring2": ParallelConfig(ulysses=2, ring=2),
    "dp2_ulysses2": ParallelConfig(dp=2, ulysses=2),
}


@pytest.mark.parametrize("name", list(FOUR))
def test_four_ranks_exact(pools, folder, name):
    shapes = SHAPES if not name.startswith("dp") else [(h, w, 3) for h, w, _ in SHAPES]
    check_exact(pools, folder, FOUR[name], shapes)


def test_cfg_parallel_ulysses2_exact(pools, folder):
    check_exact(pools, folder, ParallelConfig(cfg_parallel=True, ulysses=2), cfg=CFG)


@pytest.mark.parametrize("config", [ParallelConfig(pipefusion=4, warmup_steps=STEPS),
                                    ParallelConfig(pipefusion=2, ulysses=2,
                                                   warmup_steps=STEPS)],
                         ids=["pipefusion4", "pipefusion2_ulysses2"])
def test_four_rank_pipefusion_exact_with_full_warmup(pools, folder, config):
    check_exact(pools, folder, config)


# ---- CFG defaults: base vs step-distilled FLUX.2 [klein] ---------------------------------

def _klein_copy(src, dst, **index_changes):
    """`src` with model_index.json changed (None: key removed); subfolders linked."""
    import json

    dst.mkdir()
    for sub in src.iterdir():
        if sub.is_dir():
            (dst / sub.name).symlink_to(sub.resolve(), target_is_directory=True)
    index = json.loads((src / "model_index.json").read_text())
    for k, v in index_changes.items():
        if v is None:
            index.pop(k, None)
        else:
            index[k] = v
    (dst / "model_index.json").write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def base_folder(folder, tmp_path_factory):
    return _klein_copy(folder, tmp_path_factory.mktemp("base") / "flux2-base", is_distilled=False)


def test_distilled_flag_read_from_model_index(folder, base_folder, tmp_path):
    from comfyui_xdit import ConfigError
    from comfyui_xdit.model_info import read_model_info

    assert read_model_info(folder).distilled is True
    assert read_model_info(base_folder).distilled is False
    # absent: the pipeline's own default (not distilled)
    assert read_model_info(_klein_copy(folder, tmp_path / "absent", is_distilled=None)).distilled is False
    # another FLUX.2 pipeline (FLUX.2-dev) does not say
    dev = _klein_copy(folder, tmp_path / "dev", _class_name="Flux2Pipeline", is_distilled=None)
    assert read_model_info(dev).distilled is None
    with pytest.raises(ConfigError, match="is_distilled is 'yes'; expected true or false"):
        read_model_info(_klein_copy(folder, tmp_path / "bad", is_distilled="yes"))


def test_cfg_default_follows_the_model(folder, base_folder):
    from comfyui_xdit.model_info import read_model_info
    from comfyui_xdit.request import default_cfg

    distilled, base = read_model_info(folder), read_model_info(base_folder)
    req = GenerationRequest(prompt=["x"])
    assert (req.resolved_cfg(distilled), req.uses_cfg(distilled)) == (1.0, False)
    assert (req.resolved_cfg(base), req.uses_cfg(base)) == (4.0, True)
    assert req.resolved(base).cfg == 4.0 and req.resolved(distilled).cfg == 1.0
    # an explicit value is kept either way: cfg > 1 on a distilled model runs CFG
    assert GenerationRequest(prompt=["x"], cfg=2.5).resolved(distilled).cfg == 2.5
    assert GenerationRequest(prompt=["x"], cfg=1.0).resolved(base).cfg == 1.0
    assert (default_cfg("flux"), default_cfg("sd3")) == (1.0, 7.0)
    with pytest.raises(ValueError, match="flux2 model depends on whether it is distilled"):
        req.resolved("flux2")
    # cfg-parallel needs CFG: the base model's default gives it, the distilled one's does not
    ParallelConfig(cfg_parallel=True).validate(base, req)
    from comfyui_xdit import ConfigError
    with pytest.raises(ConfigError, match="cfg-parallel needs classifier-free guidance but cfg is 1.0"):
        ParallelConfig(cfg_parallel=True).validate(distilled, req)


def test_base_model_default_cfg_matches_pipeline_default(base_folder):
    """No cfg given on a base [klein] folder: the pool runs the pipeline's default 4.0 (its
    own default guidance_scale, from the same folder), here split over cfg-parallel."""
    from diffusers import Flux2KleinPipeline

    req = request(128, 96, 1)
    noise = noise_for(1, 128, 96, req.seed)
    pipe = Flux2KleinPipeline.from_pretrained(base_folder)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.is_distilled is False
    want = pipe(prompt=req.prompt, height=128, width=96, num_inference_steps=STEPS,
                latents=Flux2KleinPipeline._patchify_latents(noise), max_sequence_length=MSL,
                output_type="latent").images
    no_cfg = oracle(base_folder, request(128, 96, 1, cfg=1.0))
    assert (want - no_cfg).abs().max() > MOVED  # CFG changes the result
    with WorkerPool(str(base_folder), ParallelConfig(cfg_parallel=True), device="cpu",
                    threads_per_rank=1) as pool:
        got = pool.generate(req, noise=noise).samples
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


# ---- PipeFusion memory at the real FLUX.2-dev dimensions ---------------------------------

def _stage_block_params(split, stages):
    """Per stage: block parameters left on the rank after `keep_stage_blocks` (the loader's
    own step) on a FLUX.2-dev transformer built on the meta device, and all block params."""
    import diffusers

    from comfyui_xdit.worker_modules import worker_module

    ps = worker_module("pipefusion_stages")
    lists = worker_module("models.flux2").Flux2Adapter.block_lists
    held = []
    for stage in range(stages):
        with torch.device("meta"):
            tr = diffusers.Flux2Transformer2DModel()  # defaults: FLUX.2-dev
        if stage == 0:
            blocks = ps.model_blocks(tr, lists)
            total = sum(p.numel() for _, _, m in blocks for p in m.parameters())
            assert (len(tr.transformer_blocks), len(tr.single_transformer_blocks)) == (8, 48)
            assert (tr.config.num_attention_heads, tr.config.attention_head_dim) == (48, 128)
            assert total > 30e9  # ~31.4 B block parameters (the real model, not a tiny one)
        ps.keep_stage_blocks(tr, lists, ps.plan_stages(tr, lists, stage, stages, split))
        held.append(sum(p.numel() for _, _, m in ps.model_blocks(tr, lists)
                        for p in m.parameters()))
    return held, total


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_pipefusion_stage_holds_its_share_of_flux2_dev(stages):
    held, total = _stage_block_params("balanced", stages)
    assert sum(held) == total  # every block on exactly one stage
    worst = max(held) / total
    assert worst <= 1 / stages + 0.05, f"a stage holds {worst:.3f} of the block weights"


def test_compute_split_alone_would_overload_a_stage():
    """Negative control: FLUX.2's double blocks weigh twice a single block for the same
    per-token work, so a compute-only split breaks the bound the balanced split keeps."""
    held, total = _stage_block_params("compute", 4)
    assert max(held) / total > 1 / 4 + 0.05


# ---- patch-parallel VAE decode with the FLUX.2 VAE ---------------------------------------

@pytest.mark.parametrize("config", [ParallelConfig(ulysses=2), ParallelConfig(ring=4)],
                         ids=["2ranks", "4ranks"])
def test_image_output_matches_pipeline_decode(pools, folder, config):
    """output="image": the pool decodes the 32-channel latent patch-parallel over every rank
    with the folder's AutoencoderKLFlux2; equal to the pipeline's output_type="pt". 112x80
    is 14 latent rows: uneven bands on 4 ranks."""
    pool = pools(config)
    for h, w, b in SHAPES:
        req = request(h, w, b, output="image")
        want = oracle(folder, req, output_type="pt")
        got = pool.generate(req, noise=noise_for(b, h, w, req.seed)).images
        assert got.shape == (b, h, w, 3) and want.std() > 1e-2
        err = (got - want.permute(0, 2, 3, 1)).abs().max().item()
        assert err <= TOL, f"{config.describe()} {h}x{w}: image max diff {err:.2e}"


def test_decode_loads_the_folders_vae_class(folder, tmp_path):
    """The pool decodes with the class vae/config.json names (AutoencoderKLFlux2 here, not
    an AutoencoderKL reading the same weights); a VAE class it has not proven is refused."""
    import json

    from comfyui_xdit.worker_modules import worker_module

    base = worker_module("models.base")
    LoadedModel = worker_module("models").LoadedModel

    def model(path):
        cfg = json.loads((path / "vae" / "config.json").read_text())
        return LoadedModel(path=str(path), arch="flux2", transformer=None, encoder=None,
                           scheduler_config={}, vae_config=cfg, device="cpu",
                           dtype=torch.float32)
    vae = base.load_vae(model(folder))
    assert type(vae).__name__ == "AutoencoderKLFlux2" and vae.config.latent_channels == 32
    other = _klein_copy(folder, tmp_path / "other")
    (other / "vae").unlink()
    (other / "vae").mkdir()
    cfg = json.loads((folder / "vae" / "config.json").read_text())
    (other / "vae" / "config.json").write_text(json.dumps(dict(cfg, _class_name="AutoencoderDC")))
    with pytest.raises(ValueError, match="holds a AutoencoderDC; the pool decodes with "
                                         "AutoencoderKL or AutoencoderKLFlux2 only"):
        base.load_vae(model(other))
