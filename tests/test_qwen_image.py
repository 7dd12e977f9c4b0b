"""Qwen-Image through the pool at one rank equals diffusers' QwenImagePipeline
(docs/design.md#numerics-rule-4): true CFG with its norm rescale, batches of one prompt and of
three prompts of different token lengths (the pipeline pads them and masks the padding; the
pool drops the padded keys row by row), at a size whose token grid is odd (5 x 3) and an even
one; PipeFusion on prompts of different lengths; the single-frame decode; the MODEL's calls,
single files and LoRA. That every other method, weight sharding, PipeFusion at full warmup and
the step cache equal one rank is the conformance suite's (tests/conformance/).

The noise is ComfyUI's for the LATENT shape [B, 16, 1, H/8, W/8], packed as the pipeline
packs its latents; the pipeline's result is brought to ComfyUI's LATENT (x * std + mean,
latent_formats.Wan21) to compare with the pool's.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

TOL = 1e-4
ARCH = "qwen_image"
SIZES = {"odd": (80, 48), "even": (128, 96)}  # token grids 5 x 3 and 8 x 6
PROMPTS = ["a red cat", "a big blue dog sitting on a green field", "sky"]  # 3 token lengths
NEGATIVE = "ugly dark"
MSL = 64

def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, 16, 1, h, w] -> [B, h/2 * w/2, 64], as QwenImagePipeline._pack_latents."""
    b, c, _, h, w = x.shape
    return x[:, :, 0].view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5) \
        .reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    b, _, c = x.shape
    h, w = height // 16, width // 16
    return x.view(b, h, w, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5) \
        .reshape(b, c // 4, 1, 2 * h, 2 * w)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import QwenImagePipeline
    return QwenImagePipeline.from_pretrained(str(model_dir(ARCH))).to(torch.float32)


@pytest.fixture(scope="module")
def oracle(pipe):
    """oracle(request[, mask_padding]) -> the pipeline's latent as a ComfyUI LATENT.
    `mask_padding=False` runs the pipeline with every padded text token attended (the
    negative control: what ignoring the padding would give)."""
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)

    def run(req: GenerationRequest, mask_padding: bool = True) -> torch.Tensor:
        b, h, w = len(req.prompt), req.height, req.width
        noise = torch.randn([b, 16, 1, h // 8, w // 8], generator=torch.manual_seed(req.seed))
        kw = dict(prompt=req.prompt, max_sequence_length=req.max_sequence_length)
        if not mask_padding:
            embeds, _ = pipe.encode_prompt(req.prompt, max_sequence_length=MSL)
            kw = dict(prompt_embeds=embeds, prompt_embeds_mask=torch.ones(embeds.shape[:2]))
        if req.cfg and req.cfg > 1:
            kw.update(negative_prompt=req.negative_prompt, true_cfg_scale=req.cfg)
        out = pipe(height=h, width=w, num_inference_steps=req.steps, latents=pack(noise),
                   output_type="latent", **kw).images
        return unpack(out, h, w) * std + mean
    return run



def request(size: str, batch: int, cfg: float = 4.0, seed: int = 11, **kw) -> GenerationRequest:
    h, w = SIZES[size]
    return GenerationRequest(prompt=PROMPTS[:batch], seed=seed, steps=3, height=h, width=w,
                             cfg=cfg, negative_prompt=NEGATIVE, max_sequence_length=MSL, **kw)


def check(got, want, what: str):
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"


def test_one_rank_equals_the_pipeline(model_dir, layout_pools, oracle):
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig())
    for size in SIZES:
        for batch, cfg in ((1, 4.0), (3, 2.5), (1, 1.0)):
            req = request(size, batch, cfg)
            got = pool.generate(req).samples
            assert got.shape == (batch, 16, 1) + tuple(v // 8 for v in SIZES[size])
            check(got, oracle(req), f"1 rank {size} batch {batch} cfg {cfg}")


def test_padded_prompts_need_their_mask(model_dir, layout_pools, oracle):
    """Negative control: attending the padded text tokens (no mask) moves the result well
    beyond the tolerance, so the batch-3 equality above proves the padding is dropped."""
    req = request("odd", 3, 1.0)
    got = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    unmasked = oracle(req, mask_padding=False)
    assert float((got - unmasked).abs().max()) > 1e-3
    assert float((got[0] - unmasked[0]).abs().max()) > 1e-3  # row 0 is the one padded most


def test_pipefusion_runs_prompts_of_different_lengths(model_dir, layout_pools):
    """Each row keeps its own text length in PipeFusion's patch attention too (it used to
    refuse such a batch): with warmup >= steps PipeFusion 2 on prompts of two lengths
    equals the exact run; with warmup 0 (the first step attends to a half-filled cache)
    row 0 still equals its prompt alone."""
    req = request("even", 2, cfg=1.0)
    want = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig(pipefusion=2, warmup_steps=3))
    check(pool.generate(req).samples, want, "pipefusion 2, warmup 3, two prompt lengths")
    pool = layout_pools.get(model_dir(ARCH), ParallelConfig(pipefusion=2, warmup_steps=0))
    both = pool.generate(req).samples
    alone = pool.generate(request("even", 1, cfg=1.0)).samples
    check(both[:1], alone, "pipefusion 2, warmup 0: row 0 of two prompt lengths vs alone")


@pytest.mark.parametrize("config", [ParallelConfig(), ParallelConfig(ulysses=2)],
                         ids=["1rank", "ulysses2"])
def test_decoded_image_equals_the_pipeline(model_dir, layout_pools, pipe, config):
    req = request("even", 1, output="image")
    noise = torch.randn([1, 16, 1, 16, 12], generator=torch.manual_seed(req.seed))
    want = pipe(prompt=req.prompt, negative_prompt=NEGATIVE, true_cfg_scale=4.0, height=128,
                width=96, num_inference_steps=3, latents=pack(noise),
                max_sequence_length=MSL, output_type="pt").images
    got = layout_pools.get(model_dir(ARCH), config).generate(req).images
    assert got.shape == (1, 128, 96, 3) and want.std() > 1e-2
    torch.testing.assert_close(got, want.permute(0, 2, 3, 1).float(), atol=1e-4, rtol=1e-4)


# ---- the xDiT MODEL (stock KSampler): one pool request per ComfyUI model call -------------
def comfy_call(tr, batch: int, h: int, w: int, tokens: int = 7, seed: int = 0) -> dict:
    """ComfyUI's QwenImage diffusion-model call: latents [N, 16, 1, h, w] in model space,
    sigma as the timestep, text states, no pooled output; the unconditional then the
    conditional chunk of `batch` rows each (calc_cond_batch)."""
    import uuid
    gen = torch.Generator().manual_seed(seed)
    n = 2 * batch
    x = torch.randn(n, 16, 1, h, w, generator=gen)
    ctx = torch.randn(2, tokens, tr.config.joint_attention_dim, generator=gen)
    context = torch.cat([ctx[i:i + 1].expand(batch, -1, -1) for i in range(2)])
    options = {"uuids": [uuid.uuid4(), uuid.uuid4()], "cond_or_uncond": [1, 0]}
    return dict(x=x, timestep=torch.tensor(0.7).expand(n), context=context,
                transformer_options=options)


def model_reference(tr, x, timestep, context) -> torch.Tensor:
    n, _, _, h, w = x.shape
    with torch.inference_mode():
        out = tr(hidden_states=pack(x), timestep=timestep, encoder_hidden_states=context,
                 img_shapes=[[(1, h // 2, w // 2)]] * n, return_dict=False)[0]
    return unpack(out, h * 8, w * 8)


MODEL_CASES = [(ParallelConfig(cfg_parallel=True), 1, 10, 6),
               (ParallelConfig(ulysses=2), 3, 10, 6),
               (ParallelConfig(dp=2), 3, 16, 12),
               (ParallelConfig(cfg_parallel=True, ulysses=2), 3, 10, 6),
               (ParallelConfig(dp=2, ring=2), 1, 16, 12)]


@pytest.mark.parametrize("config,batch,h,w", MODEL_CASES,
                         ids=[f"{c.describe().replace(' ', '')}-b{b}-{h}x{w}"
                              for c, b, h, w in MODEL_CASES])
def test_model_calls_equal_the_transformer(model_dir, layout_pools, pipe, config, batch, h, w):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    pool = layout_pools.get(model_dir(ARCH), config)
    den = PoolDenoiser(pool, config, ARCH)
    call = comfy_call(pipe.transformer, batch, h, w)
    want = model_reference(pipe.transformer, call["x"], call["timestep"], call["context"])
    for _ in range(2):  # the second call reuses the pool's conditioning
        got = den(**call)
        assert got.shape == call["x"].shape
        check(got, want, f"MODEL {config.describe()} batch {batch}")


# ---- ComfyUI's single file (diffusion_models/): diffusers' names, optional prefix ----------
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

    state = pipe.transformer.state_dict()
    path = tmp_path / "qwen_image_tiny.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()},
              str(path))
    info = read_model_info(path)
    assert (info.arch, info.kind, info.heads, info.blocks) == (ARCH, "file", 4, 2)
    bf16 = tmp_path / "qwen_image_tiny_bf16.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(bf16))
    fp8 = write_fp8_file(path, tmp_path / "qwen_image_tiny_fp8.safetensors", scaled=True)
    assert read_model_info(fp8).storage == "scaled-fp8"
    with torch.no_grad():
        pos = pipe.encode_prompt(["a red cat"], max_sequence_length=MSL)[0]
        neg = pipe.encode_prompt([NEGATIVE], max_sequence_length=MSL)[0]
    req = GenerationRequest(prompt=[], positive={"cond": pos, "pooled": None},
                            negative={"cond": neg, "pooled": None}, cfg=4.0, seed=3, steps=3,
                            height=80, width=48)
    folder = layout_pools.get(model_dir(ARCH), ParallelConfig()).generate(req).samples
    for name, file, bound in (("bf16", bf16, 0.05), ("fp8", fp8, 0.1)):
        with WorkerPool(str(file), ParallelConfig(), device="cpu", threads_per_rank=1) as pool:
            got = pool.generate(req).samples
        d = float((got - folder).abs().max())
        assert 0 < d < bound * float(folder.abs().max()), f"{name} file vs folder {d}"
