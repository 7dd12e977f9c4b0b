"""FLUX.2 on the xDiT methods beyond the conformance suite (tests/conformance/, which holds
every exact method, weight sharding and PipeFusion 2 to one rank): a tiny FLUX.2
[klein]-style model equals the single-process diffusers `Flux2KleinPipeline` to 1e-4 (fp32,
final latent) from the same ComfyUI noise (drawn on ComfyUI's FLUX.2 LATENT
[B,128,H/16,W/16], given to the pipeline as its `latents`; its raw 32-channel result
patchified and BN-normalised into that LATENT's space) with CFG in process on a distilled
folder, under FSDP2 weight sharding (each rank holding half the block weights), and under
PipeFusion 4 and PipeFusion 2 x Ulysses 2 with warmup_steps >= steps; at 128x96 (8x6 image
tokens) and 112x80 (7x5 tokens: padded), batch 1 and 3.

Also: the default cfg follows model_index.json's is_distilled (4.0 base, 1.0 distilled);
output="image" and `decode_parallel` on AutoencoderKLFlux2 equal the pipeline's decode on 2
and 4 ranks; LoRA files in the diffusers/PEFT, BFL/ComfyUI and kohya formats equal
`pipe.load_lora_weights` on 1 rank, Ulysses 2 and PipeFusion 2, and LoRAs for other models
are refused; PipeFusion stages of the real FLUX.2-dev (meta device) hold <= 1/N + 5% of the
block weights at N = 2, 4, 8.

One pool per launch layout serves every request of its configurations (`reconfigure` keeps
the warm workers for a new non-PipeFusion layout of the same world size). `-s` prints the
max differences.
"""
from __future__ import annotations

import re

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.testmodels.tiny_model import build_tiny_model

from conftest import flux2_comfy_from_raw, flux2_noise

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
    """ComfyUI's prepare_noise for a FLUX.2 LATENT [B,128,h/16,w/16]."""
    return flux2_noise(seed, batch, height, width)


_ORACLES: dict = {}


def oracle(path, req: GenerationRequest, output_type="latent"):
    """The pipeline's result for `req` from `noise_for(...)`: ComfyUI's FLUX.2 LATENT
    [B,128,h/16,w/16] or, for output_type "pt", the image [B,3,H,W] in 0..1."""
    cfg = req.cfg if req.cfg is not None else 1.0
    key = (str(path), tuple(req.prompt), req.seed, req.steps, req.height, req.width, cfg,
           output_type)
    if key not in _ORACLES:
        noise = noise_for(len(req.prompt), req.height, req.width, req.seed)
        pipe = pipeline(path, distilled=cfg <= 1.0)
        out = pipe(prompt=list(req.prompt), height=req.height, width=req.width,
                   num_inference_steps=req.steps, guidance_scale=cfg, latents=noise,
                   max_sequence_length=req.max_sequence_length, output_type=output_type).images
        _ORACLES[key] = flux2_comfy_from_raw(out, path) if output_type == "latent" else out
    return _ORACLES[key]


def request(height, width, batch, seed=5, steps=STEPS, cfg=None, **kw):
    return GenerationRequest(prompt=PROMPTS[:batch], seed=seed, steps=steps, height=height,
                             width=width, max_sequence_length=MSL, cfg=cfg, **kw)


@pytest.fixture(scope="module")
def pools(folder):
    """pools(config) -> a warm pool running `config`: one pool per launch layout (world
    size and PipeFusion layout), reconfigured between the configurations it serves; the
    three most recently used stay warm (a shared 2-core CI machine: ~10 processes at most)."""
    from conftest import LayoutPools
    cache = LayoutPools(keep=3)
    yield lambda config, shard=False: cache.get(folder, config, shard_weights=shard)
    cache.close()


def check_exact(pools, folder, config, shapes=SHAPES, cfg=None, shard=False):
    """Every shape equals the pipeline; returns the last result (its per-rank stats)."""
    pool = pools(config, shard)
    for h, w, b in shapes:
        req = request(h, w, b, cfg=cfg)
        noise = noise_for(b, h, w, req.seed)
        want = oracle(folder, req)
        res = pool.generate(req, noise=noise)
        got = res.samples
        assert got.shape == want.shape == (b, 128, h // 16, w // 16)
        assert (want - noise).abs().max() > MOVED
        err = (got - want).abs().max().item()
        print(f"{config.describe()}{' sharded' if shard else ''} {h}x{w} batch {b} "
              f"cfg {cfg}: max abs diff {err:.2e}")
        assert err <= TOL, f"{config.describe()} {h}x{w} batch {b} cfg {cfg}: max diff {err:.2e}"
    return res


# ---- 2 ranks -----------------------------------------------------------------------------

def test_cfg_in_process_exact(pools, folder):
    check_exact(pools, folder, ParallelConfig(ulysses=2), cfg=CFG)


def test_sharded_weights_exact(pools, folder):
    """FSDP2 over FLUX.2's blocks: exact, and each rank really holds only its half of the
    block weights at rest (the job stats' counts, workers/parallel/sharding.py)."""
    check_exact(pools, folder, ParallelConfig(ulysses=2), shard=True)
    res = check_exact(pools, folder, ParallelConfig(ring=2), shapes=SHAPES[1:], shard=True)
    counts = [st["sharding"] for st in res.stats]
    assert len(counts) == 2
    for c in counts:
        total, local = c["block_params"], c["block_params_local"]
        assert total / 2 <= local <= (0.5 + 0.05) * total, c
        assert c["block_params_resident_now"] == local, c  # gathered blocks freed again


# ---- 4 ranks -----------------------------------------------------------------------------

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
    from comfyui_xdit.planning.model_info import read_model_info

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
    from comfyui_xdit.planning.model_info import read_model_info
    from comfyui_xdit.planning.request import default_cfg

    distilled, base = read_model_info(folder), read_model_info(base_folder)
    req = GenerationRequest(prompt=["x"])
    assert (req.resolved_cfg(distilled), req.uses_cfg(distilled)) == (1.0, False)
    assert (req.resolved_cfg(base), req.uses_cfg(base)) == (4.0, True)
    assert req.resolved(base).cfg == 4.0 and req.resolved(distilled).cfg == 1.0
    # an explicit value is kept either way: cfg > 1 on a distilled model runs CFG
    assert GenerationRequest(prompt=["x"], cfg=2.5).resolved(distilled).cfg == 2.5
    assert GenerationRequest(prompt=["x"], cfg=1.0).resolved(base).cfg == 1.0
    assert (default_cfg("flux"), default_cfg("sd3")) == (1.0, 7.0)
    with pytest.raises(ValueError, match="FLUX.2 model depends on whether it is distilled"):
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
    want = flux2_comfy_from_raw(
        pipe(prompt=req.prompt, height=128, width=96, num_inference_steps=STEPS, latents=noise,
             max_sequence_length=MSL, output_type="latent").images, base_folder)
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

    from comfyui_xdit.bridge import worker_module

    ps = worker_module("loading.stages")
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
    """output="image": the pool decodes the raw 32-channel latent patch-parallel over every rank
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

    from comfyui_xdit.bridge import worker_module

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
    known = worker_module("families").vae_classes()  # what the families declare
    assert {"AutoencoderKL", "AutoencoderKLFlux2", "AutoencoderKLQwenImage",
            "AutoencoderKLWan"} <= set(known)
    want = f"holds a AutoencoderDC; the pool decodes with {', '.join(known[:-1])} or {known[-1]} only"
    with pytest.raises(ValueError, match=re.escape(want)):
        base.load_vae(model(other))


# ---- LoRA ----------------------------------------------------------------------------------

R = 4


def _linears(folder):
    import diffusers

    t = diffusers.Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    return {n: (m.in_features, m.out_features) for n, m in t.named_modules()
            if isinstance(m, torch.nn.Linear)}


def _ab(g, fan_in, fan_out, rank=R):
    return (torch.randn(rank, fan_in, generator=g) * 0.1,
            torch.randn(fan_out, rank, generator=g) * 0.1)


def make_flux2_loras(folder, root):
    """Random LoRAs for the tiny FLUX.2 transformer in every format diffusers'
    Flux2 loader reads: {"peft": diffusers keys with alpha metadata (alpha/r = 2), "bfl":
    ComfyUI / ai-toolkit keys (diffusion_model.double_blocks.0.img_attn.qkv.lora_A ...),
    "kohya": lora_unet_... with lora_down/up and alpha}; every block layer, double and
    single, plus the input and output projections."""
    import json

    from safetensors.torch import save_file

    lin = _linears(folder)
    n_double = sum(1 for n in lin if n.endswith(".attn.to_q"))
    n_single = sum(1 for n in lin if n.endswith(".attn.to_qkv_mlp_proj"))
    out = {}

    g = torch.Generator().manual_seed(21)
    targets = [n for n in lin if "blocks." in n] + ["x_embedder", "proj_out"]
    sd = {}
    for n in targets:
        a, b = _ab(g, *lin[n])
        sd[f"transformer.{n}.lora_A.weight"], sd[f"transformer.{n}.lora_B.weight"] = a, b
    meta = {"r": R, "lora_alpha": 2 * R, "target_modules": targets}
    out["peft"] = root / "peft.safetensors"
    save_file(sd, str(out["peft"]),
              metadata={"lora_adapter_metadata": json.dumps(
                  {f"transformer.{k}": v for k, v in meta.items()}), "format": "pt"})

    g = torch.Generator().manual_seed(22)
    sd = {}
    d = "diffusion_model."
    for i in range(n_double):
        tb = f"transformer_blocks.{i}."
        names = {"img_attn.qkv": (lin[tb + "attn.to_q"][0], 3 * lin[tb + "attn.to_q"][1]),
                 "txt_attn.qkv": (lin[tb + "attn.add_q_proj"][0], 3 * lin[tb + "attn.add_q_proj"][1]),
                 "img_attn.proj": lin[tb + "attn.to_out.0"], "txt_attn.proj": lin[tb + "attn.to_add_out"],
                 "img_mlp.0": lin[tb + "ff.linear_in"], "img_mlp.2": lin[tb + "ff.linear_out"],
                 "txt_mlp.0": lin[tb + "ff_context.linear_in"],
                 "txt_mlp.2": lin[tb + "ff_context.linear_out"]}
        for name, dims in names.items():
            a, b = _ab(g, *dims)
            sd[f"{d}double_blocks.{i}.{name}.lora_A.weight"] = a
            sd[f"{d}double_blocks.{i}.{name}.lora_B.weight"] = b
    for i in range(n_single):
        sb = f"single_transformer_blocks.{i}.attn."
        for name, mod in (("linear1", "to_qkv_mlp_proj"), ("linear2", "to_out")):
            a, b = _ab(g, *lin[sb + mod])
            sd[f"{d}single_blocks.{i}.{name}.lora_A.weight"] = a
            sd[f"{d}single_blocks.{i}.{name}.lora_B.weight"] = b
    for name, mod in (("img_in", "x_embedder"), ("final_layer.linear", "proj_out")):
        a, b = _ab(g, *lin[mod])
        sd[f"{d}{name}.lora_A.weight"], sd[f"{d}{name}.lora_B.weight"] = a, b
    out["bfl"] = root / "bfl.safetensors"
    save_file(sd, str(out["bfl"]))

    # kohya: the BFL layers again, lora_down/up with alpha 8 (alpha/r = 2)
    g = torch.Generator().manual_seed(23)
    sd = {}
    for k, v in list(_bfl_modules(out["bfl"]).items()):
        kk = "lora_unet_" + k.replace(".", "_")
        a, b = _ab(g, v[0], v[1])
        sd[kk + ".lora_down.weight"], sd[kk + ".lora_up.weight"] = a, b
        sd[kk + ".alpha"] = torch.tensor(2.0 * R)
    out["kohya"] = root / "kohya.safetensors"
    save_file(sd, str(out["kohya"]))
    return out


def _bfl_modules(path):
    """{BFL module name: (in, out)} of a BFL-format LoRA file."""
    from safetensors.torch import load_file

    sd = load_file(str(path))
    return {k[len("diffusion_model."):-len(".lora_A.weight")]:
            (v.shape[1], sd[k.replace("lora_A", "lora_B")].shape[0])
            for k, v in sd.items() if k.endswith(".lora_A.weight")}


@pytest.fixture(scope="module")
def flux2_loras(folder, tmp_path_factory):
    return make_flux2_loras(folder, tmp_path_factory.mktemp("loras"))


def lora_oracle(folder, req, loras):
    """The pipeline with `pipe.load_lora_weights` of every (file, strength)."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
        names.append(f"l{i}")
    pipe.set_adapters(names, [s for _, s in loras])
    noise = noise_for(len(req.prompt), req.height, req.width, req.seed)
    return flux2_comfy_from_raw(
        pipe(prompt=list(req.prompt), height=req.height, width=req.width,
             num_inference_steps=req.steps, latents=noise,
             max_sequence_length=req.max_sequence_length, output_type="latent").images, folder)


# (diffusers/PEFT's format alone, LoRA against merged weights and switched per job, is the
# conformance suite's)
LORA_CASES = {  # name: ([(format, strength)], configurations)
    "bfl": ([("bfl", 1.0)], [ParallelConfig(ulysses=2),
                             ParallelConfig(pipefusion=2, warmup_steps=STEPS)]),
    "kohya+peft": ([("kohya", 0.7), ("peft", -0.5)], [ParallelConfig(ulysses=2)]),
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_matches_pipeline(pools, folder, flux2_loras, case):
    specs, configs = LORA_CASES[case]
    loras = [(str(flux2_loras[f]), s) for f, s in specs]
    req = request(128, 96, 1, loras=loras)
    want = lora_oracle(folder, req, loras)
    plain = oracle(folder, request(128, 96, 1))
    assert (want - plain).abs().max() > MOVED  # the LoRA changes the result
    noise = noise_for(1, 128, 96, req.seed)
    for config in configs:
        pool = pools(config)
        # a job without LoRA first: the parallel layout is hooked before the adapter wraps
        # its layers (proj_out's gather must then move to the wrapper)
        for loras_on in (False, True, False):
            got = pool.generate(req if loras_on else request(128, 96, 1), noise=noise).samples
            err = (got - (want if loras_on else plain)).abs().max().item()
            assert err <= TOL, f"{case} {loras_on} on {config.describe()}: max diff {err:.2e}"


def test_lora_for_another_model_is_refused(pools, folder, tmp_path):
    """Keys that do not fit FLUX.2 fail the job with one line naming the problem; nothing
    stays active (the next plain job is the base model)."""
    from safetensors.torch import save_file

    from comfyui_xdit import PoolError

    a, b = torch.ones(R, 64) * 0.1, torch.ones(64, R) * 0.1
    files = {
        # FLUX.1 kohya modulation layers (FLUX.2 has none per block): diffusers' converter
        # would drop them with a log warning only
        "kohya_flux1": ({"lora_unet_double_blocks_0_img_mod_lin.lora_down.weight": a,
                         "lora_unet_double_blocks_0_img_mod_lin.lora_up.weight": b},
                        "kohya modules are not FLUX.2 layers, e.g. "
                        "'lora_unet_double_blocks_0_img_mod_lin'"),
        # FLUX.1 diffusers layers (beside one that fits)
        "peft_flux1": ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a,
                        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b,
                        "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": a,
                        "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight": b},
                       "LoRA keys do not fit this flux2 model, e.g. "
                       "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight "
                       r"\(no such layer\)"),
        # right layer, another model's width
        "peft_width": ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(R, 3072),
                        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(3072, R)},
                       r"does not fit transformer_blocks.0.attn.to_q: 64->64"),
        # text-encoder keys only
        "te_only": ({"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": a,
                     "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": b},
                    "has no key that matches this flux2 model"),
        # BFL names of a FLUX.1 modulation layer
        "bfl_flux1": ({"diffusion_model.double_blocks.0.img_mod.lin.lora_A.weight": a,
                       "diffusion_model.double_blocks.0.img_mod.lin.lora_B.weight": b},
                      "could not be read as a flux2 LoRA"),
    }
    pool = pools(ParallelConfig(ulysses=2))
    noise = noise_for(1, 128, 96, 5)
    plain = oracle(folder, request(128, 96, 1))
    for name, (sd, msg) in files.items():
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.clone() for k, v in sd.items()}, str(path))
        with pytest.raises(PoolError, match=msg) as e:
            pool.generate(request(128, 96, 1, loras=[(str(path), 1.0)]), noise=noise)
        assert len(str(e.value).splitlines()) == 1, str(e.value)
        got = pool.generate(request(128, 96, 1), noise=noise).samples
        assert (got - plain).abs().max().item() <= TOL


_DECODE_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import AutoencoderKLFlux2
sys.path.insert(0, sys.argv[1])
from workers.parallel.vae_parallel import decode_parallel

CASES = [(14, 10, 1), (16, 12, 2), (5, 6, 1)]  # uneven bands; 5 rows on 4: a one-row band
FAULTS = (None, "no_halo", "local_groupnorm", "local_attention")


def rank_main(rank, world, store, folder, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    vae = AutoencoderKLFlux2.from_pretrained(folder, subfolder="vae").eval()
    rows = []
    vae.decoder.register_forward_pre_hook(lambda m, a: rows.append(int(a[0].shape[2])))
    report = {}
    with torch.inference_mode():
        for h, w, b in CASES:
            z = torch.randn(b, 32, h, w, generator=torch.Generator().manual_seed(h * 100 + w))
            for fault in FAULTS if (h, w, b) == CASES[0] else (None,):
                rows.clear()
                got = decode_parallel(vae, z if rank == 0 else None, fault=fault)
                seen = [None] * world
                dist.all_gather_object(seen, list(rows))
                if rank == 0:
                    want = vae.decode(z).sample
                    report[f"{h}x{w}x{b}:{fault}"] = {
                        "diff": (got - want).abs().max().item(), "rows": seen}
    if rank == 0:
        open(out, "w").write(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    root, folder, tmp = sys.argv[1:4]
    for world in (2, 4):
        mp.start_processes(rank_main, args=(world, f"{tmp}/store{world}", folder,
                                            f"{tmp}/report{world}.json"),
                           nprocs=world, start_method="fork")
'''


def test_patch_parallel_decode_of_the_flux2_vae(folder, tmp_path):
    """workers/parallel/vae_parallel.decode_parallel on AutoencoderKLFlux2 (32 latent channels)
    directly, 2 and 4 ranks: equal to its single decode, every rank decoding only its band;
    switching off the halo, the GroupNorm all-reduce or the attention K/V gather (negative
    controls) is far off."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "decode.py"
    script.write_text(_DECODE_SCRIPT)
    subprocess.run([sys.executable, str(script), str(root), str(folder), str(tmp_path)],
                   check=True, timeout=300, cwd=str(tmp_path))
    bands = {(14, 2): [7, 7], (14, 4): [4, 4, 3, 3], (16, 2): [8, 8], (16, 4): [4, 4, 4, 4],
             (5, 2): [3, 2], (5, 4): [2, 1, 1, 1]}
    for world in (2, 4):
        report = json.loads((tmp_path / f"report{world}.json").read_text())
        for key, r in report.items():
            shape, fault = key.split(":")
            h = int(shape.split("x")[0])
            if fault == "None":
                assert r["diff"] <= TOL, (world, key, r)
                assert [x[0] for x in r["rows"]] == bands[(h, world)], (world, key, r["rows"])
            else:
                assert r["diff"] > 1e-2, (world, key, r)
