"""HunyuanVideo 1.5 through the pool equals diffusers' HunyuanVideo15Pipeline
(docs/design.md#numerics-rule-4): one rank with and without CFG (the pipeline's guider at the
request's cfg), batches whose prompts differ in length and in quoted (ByT5) text; Ulysses, Ring,
CFG and data parallel under the NCCL-rules emulation, each row equal to its prompt alone
(numerics 6); image-to-video equals HunyuanVideo15ImageToVideoPipeline.

The noise is ComfyUI's for the LATENT [B, 32, (frames - 1) / 4 + 1, H/16, W/16], which the
pipeline takes as its latents (model space: the LATENT times the VAE's scaling factor, but
noise is noise); its result is brought to ComfyUI's LATENT (/ 1.03682,
latent_formats.HunyuanVideo15) to compare with the pool's.
"""
from __future__ import annotations

import os

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.testmodels.hunyuan_video15 import single_file
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

TOL = 1e-4
SIZE = (32, 48, 5)  # (h, w, frames): 2 latent frames x 2 x 3 tokens
A = "a red cat"
B = 'a big blue dog sitting on a green field with a sign "HELLO"'
NEGATIVE = "ugly dark old photo"
STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hunyuan_video15")
    return {v: ensure_tiny_model("hunyuan_video15", cache, variant=v) for v in ("t2v", "i2v")}


@pytest.fixture(scope="module")
def pipes(folders):
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
    return {"t2v": HunyuanVideo15Pipeline.from_pretrained(str(folders["t2v"])),
            "i2v": HunyuanVideo15ImageToVideoPipeline.from_pretrained(str(folders["i2v"]))}


def start_image(seed: int = 0):
    """A 40 x 60 RGB start image (the pipeline sizes its video from the aspect ratio)."""
    import numpy as np
    from PIL import Image
    rgb = np.random.RandomState(seed).rand(40, 60, 3)
    return Image.fromarray((rgb * 255).astype("uint8"))


@pytest.fixture(scope="module")
def oracle(pipes):
    """oracle(request) -> HunyuanVideo15Pipeline's latent as a ComfyUI LATENT; CFG's scale
    is its guider's (cfg 1 turns the guider off, as the pool's cfg 1 does)."""
    cache = {}

    def run(req: GenerationRequest, image=None, tag: str = "") -> torch.Tensor:
        """`image`: image-to-video from it (the request's size must be the pipeline's);
        `tag`: what else the caller changed in the pipeline (its cache key)."""
        key = (tuple(req.prompt), req.negative_prompt, req.seed, req.steps, req.cfg,
               req.height, req.width, req.frames, None if image is None else image.tobytes(),
               tag)
        if key in cache:
            return cache[key]
        pipe = pipes["t2v" if image is None else "i2v"]
        kw = {"height": req.height, "width": req.width} if image is None else {"image": image}
        b, h, w, f = len(req.prompt), req.height, req.width, req.frames
        noise = torch.randn([b, 32, (f - 1) // 4 + 1, h // 16, w // 16],
                            generator=torch.manual_seed(req.seed))
        guider = pipe.guider
        pipe.guider = type(guider)(guidance_scale=req.cfg)
        try:
            out = pipe(prompt=list(req.prompt), negative_prompt=[req.negative_prompt] * b,
                       num_frames=f, num_inference_steps=req.steps, latents=noise,
                       output_type="latent", **kw).frames
        finally:
            pipe.guider = guider
        cache[key] = out / pipe.vae.config.scaling_factor
        return cache[key]
    return run



def request(prompts, cfg: float = 4.0, seed: int = 5, **kw) -> GenerationRequest:
    h, w, f = SIZE
    base = dict(prompt=list(prompts), seed=seed, height=h, width=w, frames=f, cfg=cfg,
                negative_prompt=NEGATIVE, steps=STEPS)
    return GenerationRequest(**dict(base, **kw))


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    print(f"{what}: max abs diff {diff:.2e}")
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    return diff


def test_the_tiny_tokenizer_reads_the_prompt_after_108_template_tokens(pipes):
    """The pipeline drops the first 108 tokens of its chat template: the tiny tokenizer puts
    the prompt exactly there, so different prompts encode differently (a tokenizer that did
    not would make every prompt alike, silently)."""
    pipe = pipes["t2v"]
    with torch.no_grad():
        qwen, mask, byt5, mask2 = pipe.encode_prompt([A, B], device="cpu", batch_size=2)
    first = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer.apply_chat_template(
        [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": A}],
        tokenize=True, return_dict=True)["input_ids"])[pipe.prompt_template_encode_start_idx]
    assert first == "a"
    n = mask.sum(1).tolist()
    assert n[0] < n[1] and float((qwen[0, 0] - qwen[1, 0]).abs().max()) == 0  # both "a"
    assert float((qwen[0, 1] - qwen[1, 1]).abs().max()) > 1e-3  # "red" / "big"
    assert mask2.sum(1).tolist()[0] == 0 and mask2.sum(1).tolist()[1] > 0  # quoted text: B


def test_one_rank_equals_the_pipeline(folders, layout_pools, oracle):
    """Batch 1 with CFG; a batch of prompts of different lengths, one with quoted text,
    without and with CFG (the negative prompt's length a third one)."""
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    h, w, f = SIZE
    for prompts, cfg in (([A], 4.0), ([A, B], 1.0), ([A, B], 3.0)):
        req = request(prompts, cfg)
        got = pool.generate(req).samples
        assert got.shape == (len(prompts), 32, (f - 1) // 4 + 1, h // 16, w // 16)
        check(got, oracle(req), f"1 rank batch {len(prompts)} cfg {cfg}")


# ---- sequence parallelism, CFG parallel, batch independence ---------------------------------
NCCL_RULES = "xdit_testhooks.nccl_rules:install"
HOST_SYNCS = "xdit_testhooks.host_syncs:install"
METHODS = {"ulysses2": ParallelConfig(ulysses=2), "ring2": ParallelConfig(ring=2),
           "cfg2": ParallelConfig(cfg_parallel=True), "dp2": ParallelConfig(dp=2)}


def _late_syncs(res) -> list:
    """Every rank's host waits in steps after the first (step 0 builds the per-shape index
    lists once)."""
    out = []
    for st in res.stats:
        counts = st["hooks"][HOST_SYNCS]["counts"]
        steps = sorted(int(k.split(":")[1]) for k in counts
                       if k.startswith("job:") and k.split(":")[1] != "None")
        assert steps == list(range(STEPS)), list(counts)
        out += [(k, v, st["hooks"][HOST_SYNCS]["where"]) for k, v in counts.items()
                if k.startswith("job:") and k.split(":")[1] not in ("None", "0") and v]
    return out


def test_methods_equal_the_pipeline_and_rows_their_prompts_alone(folders, layout_pools, oracle):
    """On 2 ranks under the NCCL-rules emulation, one pool reconfigured: Ulysses 2, Ring 2
    (the context's and the video's shards uneven: 12 video tokens, contexts of three
    lengths), CFG parallel and data parallel equal the pipeline for [A, B] (A short and
    unquoted, B long with quoted text, the negative prompt a third length), and row 0 of
    [A, B] equals [A] alone (docs/design.md#numerics-rule-6: the rows' padded context keys are
    dropped); at 1 rank too. No step after the first waits on the host."""
    both, alone = request([A, B], 3.0), request([A], 3.0)
    one = layout_pools.get(folders["t2v"], ParallelConfig())
    base = one.generate(alone).samples
    row = one.generate(both).samples
    assert float((row[1] - row[0]).abs().max()) > 1e-3  # B's row is not A's
    check(row[:1], base, "1 rank: row 0 of [A, B] vs [A] alone")
    for name, config in METHODS.items():
        pool = layout_pools.get(folders["t2v"], config, worker_hooks=[NCCL_RULES, HOST_SYNCS])
        res = pool.generate(both)
        check(res.samples, oracle(both), f"{name} [A, B]")
        assert not _late_syncs(res), (name, _late_syncs(res))
        if config.dp == 1:
            check(res.samples[:1], pool.generate(alone).samples, f"{name}: row 0 vs [A] alone")
    assert torch.isfinite(row).all()


def test_negative_control_a_row_that_sees_its_mates_padding(folders):
    """With the sharded attention keeping padded keys (the `keep_padding` fault), A's row
    attends to the zero context tokens B's length gave it, and moves."""
    from comfyui_xdit import WorkerPool
    with WorkerPool(str(folders["t2v"]), ParallelConfig(ulysses=2), device="cpu",
                    threads_per_rank=1,
                    worker_hooks=["xdit_testhooks.faults:keep_padding"]) as pool:
        alone = pool.generate(request([A], 3.0)).samples
        both = pool.generate(request([A, B], 3.0)).samples
    err = float((both[:1] - alone).abs().max())
    print(f"ulysses2, padded keys kept: row 0 vs alone {err:.2e}")
    assert err > 10 * TOL


# ---- image-to-video ------------------------------------------------------------------------
def test_image_to_video_equals_the_pipeline(folders, pipes, layout_pools, oracle):
    """One start image (the request at the size the pipeline picks for it): its latent as
    the first frame's condition and its SigLIP tokens in the context, at 1 rank and on 2
    ranks (Ulysses 2, Ring 2, CFG parallel), a batch of two prompts with CFG; another image
    moves the result (the condition is read)."""
    pipe = pipes["i2v"]
    image = start_image()
    h, w = pipe.video_processor.calculate_default_height_width(
        height=image.size[1], width=image.size[0], target_size=pipe.target_size)
    assert (h, w) != (image.size[1], image.size[0])  # the crop and resize are exercised
    req = request([A, B], 3.0, height=h, width=w, reference_images=[image])
    want = oracle(req, image)
    got = layout_pools.get(folders["i2v"], ParallelConfig()).generate(req).samples
    check(got, want, "i2v 1 rank")
    # ComfyUI's values instead of the image (HunyuanVideo15ImageToVideo: the start frame's
    # raw latent first, zeros after; its mask 0 there; the SigLIP states), made as the
    # pipeline makes them from the image
    resized = pipe.video_processor.resize(image, height=h, width=w, resize_mode="crop")
    with torch.no_grad():
        first = pipe._get_image_latents(pipe.vae, pipe.video_processor, resized, h, w, "cpu")
        states = pipe.encode_image(resized, 1, "cpu", torch.float32)
    t = (SIZE[2] - 1) // 4 + 1
    raw = torch.zeros(1, 32, t, h // 16, w // 16)
    raw[:, :, :1] = first / pipe.vae.config.scaling_factor
    mask = torch.ones(1, 1, t, h // 16, w // 16)
    mask[:, :, 0] = 0.0
    given = request([A, B], 3.0, height=h, width=w, concat_latent=raw, concat_mask=mask,
                    image_embeds=states)
    check(layout_pools.get(folders["i2v"], ParallelConfig()).generate(given).samples, want,
          "i2v from ComfyUI's values, 1 rank")
    other = start_image(1)
    moved = layout_pools.get(folders["i2v"], ParallelConfig()).generate(
        request([A, B], 3.0, height=h, width=w, reference_images=[other])).samples
    assert float((moved - got).abs().max()) > 1e-3
    for name, config in (("ulysses2", ParallelConfig(ulysses=2)),
                         ("ring2", ParallelConfig(ring=2)),
                         ("cfg2", ParallelConfig(cfg_parallel=True))):
        pool = layout_pools.get(folders["i2v"], config)
        check(pool.generate(req).samples, want, f"i2v {name}")


def test_start_images_where_they_belong(folders, layout_pools):
    """A text-to-video folder takes no start image; an image-to-video one needs one."""
    h, w, _ = SIZE
    t2v = layout_pools.get(folders["t2v"], ParallelConfig())
    with pytest.raises(Exception, match="text-to-video and takes no start image"):
        t2v.generate(request([A], reference_images=[start_image()]))
    i2v = layout_pools.get(folders["i2v"], ParallelConfig())
    with pytest.raises(Exception, match="image-to-video and needs a start image"):
        i2v.generate(request([A]))


# ---- patch-parallel decode of the causal 3-D VAE ---------------------------------------------
def test_pool_decode_equals_the_vae(folders, layout_pools, pipes):
    """The pool's decode of a batch of multi-frame LATENTs (3 latent frames: 9 video frames,
    5 latent rows: uneven bands) on 2 ranks under the NCCL-rules emulation equals the VAE in
    one process decoding each video (diffusers' mid-block attention cannot take a batch of
    several), as an IMAGE batch of the frames in order."""
    vae = pipes["t2v"].vae
    lat = torch.randn(2, 32, 3, 5, 4, generator=torch.manual_seed(0))
    with torch.no_grad():
        want = torch.cat([vae.decode(lat[i:i + 1], return_dict=False)[0] for i in range(2)])
    want = (want / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).flatten(0, 1)
    pool = layout_pools.get(folders["t2v"], ParallelConfig(ulysses=2),
                            worker_hooks=[NCCL_RULES, HOST_SYNCS])
    got = pool.decode(lat)
    assert got.shape == (18, 80, 64, 3) and want.std() > 1e-2
    check(got, want, "pool decode, 2 ranks")


def _bands_rank(rank, world, store, folder, results):
    """One rank of `test_band_decode_is_exact_and_needs_every_part`."""
    import torch.distributed as dist
    from diffusers import AutoencoderKLHunyuanVideo15

    from workers.models.hunyuan_video15_vae import band_scheme
    from workers.parallel.vae_parallel import decode_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(folder, subfolder="vae").eval()
    out = {}
    with torch.no_grad():
        for frames, rows in ((1, 5), (3, 7)):
            lat = torch.randn(1, 32, frames, rows, 3, generator=torch.manual_seed(rows))
            want = vae.decode(lat, return_dict=False)[0] if rank == 0 else None
            for fault in (None, "no_halo", "local_attention"):
                got = decode_parallel(vae, lat if rank == 0 else None, fault=fault,
                                      scheme=band_scheme())
                if rank == 0:
                    out[f"{frames}x{rows} {fault}"] = float((got - want).abs().max())
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_band_decode_is_exact_and_needs_every_part(folders, tmp_path, world):
    """decode_parallel with this VAE's band scheme (workers/models/hunyuan_video15_vae.py) on 2
    and 3 gloo ranks equals one process bit for bit (one and three latent frames, bands of
    unequal rows); without the halo rows (replicate padding at inner band edges instead) or
    without the K/V gather of the mid-block attention it is far off."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_bands_rank, args=(r, world, store, str(folders["t2v"]),
                                                   results)) for r in range(world)]
    for p in procs:
        p.start()
    got = results.get(timeout=300)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    print(world, got)
    for case, diff in got.items():
        if case.endswith("None"):
            assert diff <= 1e-5, (case, diff)
        else:
            assert diff > 1e-2, (case, diff)


# ---- the memory plan ------------------------------------------------------------------------
def test_memory_preset_has_the_published_sizes():
    """Preset hunyuanvideo1.5-720p: the 8.3B transformer, Qwen2.5-VL 7B's language model and
    the glyph ByT5 encoder (7.29B), the 1.26B VAE; 720p x 121 frames is 31 x 45 x 80 =
    111,600 video tokens plus the text caps (1000 Qwen + 256 ByT5) in the joint sequence; the
    VAE decodes every frame in one call, so its decode needs far more than a Wan-style decode
    of 4 frames at a time would, and Ulysses 8's bands share it."""
    from comfyui_xdit.planning import memory_arithmetic as arith
    from comfyui_xdit.planning.config import EngineOptions
    from comfyui_xdit.planning.model_facts import preset_facts
    facts = preset_facts("hunyuanvideo1.5-720p")
    bf16 = EngineOptions(device="cuda", dtype="bf16", weights="full", text_encoders="cpu")
    plan = arith.plan(facts, ParallelConfig(), bf16)
    assert 8.30e9 < plan.ranks[0].weights / 2 < 8.35e9
    assert 7.2e9 < facts.text_encoder_params < 7.35e9
    assert 1.2e9 < facts.vae_params < 1.3e9 and facts.vae_channels[0] == 128
    job = arith.JobSize(720, 1280, frames=121)
    assert arith.job_tokens(facts, job) == 31 * 45 * 80 + 1256
    whole = arith.vae_decode_bytes(facts.vae_channels, 720, 1280, 1, 2, 1, frames=121,
                                   frames_per_chunk=121)
    chunked = arith.vae_decode_bytes(facts.vae_channels, 720, 1280, 1, 2, 1, frames=121,
                                     frames_per_chunk=4)
    assert whole > 20 * chunked
    one = arith.plan(facts, ParallelConfig(), bf16, job).ranks[0]
    u8 = arith.plan(facts, ParallelConfig(ulysses=8), bf16, job).ranks[0]
    assert one.activations >= whole and 5 * u8.activations < one.activations


# ---- the xDiT MODEL (ComfyUI's samplers call the pool one step at a time) ------------------
def comfy_call(tr, i2v: bool, byt5: bool, seed: int = 0, tokens: int = 7):
    """One batched call as ComfyUI's HunyuanVideo15 model makes it: the uncond and cond rows,
    x = [noise, concat_cond] (65 channels: the start frame's latent in model space and
    1 - its mask, or zeros), sigma x 1000, the Qwen states as context, the ByT5 states as
    txt_byt5 where the prompt quotes text, the SigLIP states as clip_fea (image-to-video)."""
    import uuid
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(2, 32, 2, 3, 4, generator=gen)
    if i2v:
        cond = torch.zeros(2, 33, 2, 3, 4)
        cond[:, :32, 0] = torch.randn(1, 32, 3, 4, generator=gen)
        cond[:, 32, 0] = 1.0
    else:
        cond = torch.zeros(2, 33, 2, 3, 4)
    call = dict(x=torch.cat([noise, cond], 1), timestep=torch.tensor(0.7 * 1000).expand(2),
                context=torch.randn(2, tokens, tr.config.text_embed_dim, generator=gen),
                guidance=torch.tensor([6.0]),  # ComfyUI always passes it; the model has none
                transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()],
                                     "cond_or_uncond": [1, 0]})
    if byt5:
        call["txt_byt5"] = torch.randn(2, 5, tr.config.text_embed_2_dim, generator=gen)
    if i2v:
        # ComfyUI's CONDRegular gives every row its copy
        call["clip_fea"] = torch.randn(1, 36, tr.config.image_embed_dim,
                                       generator=gen).expand(2, -1, -1)
    return call


def stock_transformer_output(tr, call):
    """diffusers' own forward (its masks: every given token valid; no ByT5 / text-to-video:
    zero states fully masked, as the pipelines give them)."""
    b, ctx = call["x"].shape[0], call["context"]
    byt5 = call.get("txt_byt5")
    image = call.get("clip_fea")
    kw = dict(encoder_attention_mask=torch.ones(b, ctx.shape[1]))
    if byt5 is None:
        kw.update(encoder_hidden_states_2=torch.zeros(b, 3, tr.config.text_embed_2_dim),
                  encoder_attention_mask_2=torch.zeros(b, 3))
    else:
        kw.update(encoder_hidden_states_2=byt5, encoder_attention_mask_2=torch.ones(b, 5))
    kw["image_embeds"] = torch.zeros(b, 9, tr.config.image_embed_dim) if image is None \
        else image.expand(b, -1, -1)
    with torch.inference_mode():
        return tr(hidden_states=call["x"], timestep=call["timestep"], encoder_hidden_states=ctx,
                  return_dict=False, **kw)[0]


def test_model_calls_equal_the_transformer(folders, layout_pools):
    """The xDiT MODEL's calls (comfyui_xdit/nodes/model_calls.PoolDenoiser) with ComfyUI's
    inputs equal diffusers' HunyuanVideo15Transformer3DModel on the same inputs, with and
    without ByT5 states, text- and image-to-video, at Ulysses 2 and CFG parallel; the ByT5
    and SigLIP states are read (dropping either moves the result)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    tr = HunyuanVideo15Transformer3DModel.from_pretrained(str(folders["i2v"]),
                                                          subfolder="transformer").eval()
    pool = layout_pools.get(folders["i2v"], ParallelConfig(ulysses=2))
    for config in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)):
        den = PoolDenoiser(pool, config.with_world_size(2), "hunyuan_video15")
        for i2v, byt5 in ((False, False), (False, True), (True, True)):
            call = comfy_call(tr, i2v, byt5, seed=3)
            out = den(**call)
            assert out.shape == (2, 32, 2, 3, 4) and out.dtype == torch.float32
            check(out, stock_transformer_output(tr, call),
                  f"model call {config.describe()} i2v {i2v} byt5 {byt5}")
    call = comfy_call(tr, True, True, seed=3)
    full = den(**call)
    for drop in ("txt_byt5", "clip_fea"):  # another conditioning: a sampling run of its own
        other = comfy_call(tr, True, True, seed=3)
        del other[drop]
        assert float((den(**other) - full).abs().max()) > 1e-3, drop


# ---- ComfyUI's single files (names: comfyui_xdit/testmodels/hunyuan_video15.single_file) ---

# the widths ComfyUI 0.8.0's HunyuanVideo 1.5 takes from a file: heads of 128 (hidden / 128),
# RoPE axes (16, 56, 56), ByT5 in 1472, two refiner blocks, SigLIP 1152 (its model class
# matches on it); the text width is read
COMFY_SHAPED = dict(in_channels=65, out_channels=32, num_attention_heads=2,
                    attention_head_dim=128, num_layers=1, num_refiner_layers=2,
                    text_embed_dim=32, text_embed_2_dim=1472, image_embed_dim=1152,
                    rope_axes_dim=(16, 56, 56), task_type="i2v")


@pytest.fixture(scope="module")
def comfy_file(tmp_path_factory):
    """(a ComfyUI-named HunyuanVideo 1.5 file of COMFY_SHAPED, random seeded weights, under
    ComfyUI's checkpoint prefix; the same transformer in diffusers)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from safetensors.torch import save_file
    torch.manual_seed(15)
    tr = HunyuanVideo15Transformer3DModel(**COMFY_SHAPED).eval()
    path = tmp_path_factory.mktemp("hv15-file") / "hunyuanvideo1.5_tiny.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in
               single_file(tr.state_dict()).items()}, str(path))
    return path, tr


def test_comfyui_file_is_detected_and_runs_as_the_transformer(comfy_file, layout_pools):
    """A ComfyUI-named file: detected by its keys (naming "bfl"), its config read from the
    shapes (a file does not say its task: text-to-video), its tensors converted key by key;
    the xDiT MODEL's calls on it equal diffusers' transformer with the same weights, at
    Ulysses 2 and CFG parallel."""
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from workers.models.detect import single_file_config
    path, tr = comfy_file
    sf = single_file_config(str(path))
    assert (sf["arch"], sf["naming"]) == ("hunyuan_video15", "bfl")
    want = {k: v for k, v in COMFY_SHAPED.items() if k not in ("task_type", "rope_axes_dim")}
    assert {k: sf["config"][k] for k in want} == want
    assert list(sf["config"]["rope_axes_dim"]) == [16, 56, 56]
    pool = layout_pools.get(path, ParallelConfig(ulysses=2))
    for config in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)):
        den = PoolDenoiser(pool, config.with_world_size(2), "hunyuan_video15")
        call = comfy_call(tr, True, True, seed=5)
        check(den(**call), stock_transformer_output(tr, call),
              f"ComfyUI file, model call {config.describe()}")


_COMFY_SCRIPT = r'''
import sys
import torch
comfy_path, path, inputs, output = sys.argv[1:5]
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.sd
import comfy.utils
patcher = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(path))
model = patcher.model
call = torch.load(inputs)
with torch.no_grad():
    out = model.diffusion_model(call["x"].to(model.get_dtype()), call["timestep"],
                                call["context"], txt_byt5=call.get("txt_byt5"),
                                clip_fea=call.get("clip_fea"), transformer_options={})
torch.save({"out": out.float(), "model": type(model).__name__,
            "config": type(patcher.model.model_config).__name__,
            "shift": float(model.model_sampling.shift),
            "latent": type(model.latent_format).__name__}, output)
'''


@pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"),
                    reason="COMFYUI_PATH not set (ComfyUI's own model, in its own Python)")
def test_comfyui_own_model_from_the_file_equals_the_pool(comfy_file, layout_pools, tmp_path):
    """ComfyUI's own HunyuanVideo 1.5 (its loader and model classes, run in ComfyUI's Python:
    COMFYUI_PATH, COMFYUI_PYTHON) on the ComfyUI-named file equals the xDiT MODEL's call on
    the same file for the same inputs (what KSampler hands either), text- and image-to-video
    with ByT5; ComfyUI loads it as supported_models.HunyuanVideo15 (shift 7, latent format
    HunyuanVideo15)."""
    import subprocess
    import sys as _sys

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    path, tr = comfy_file
    pool = layout_pools.get(path, ParallelConfig(ulysses=2))
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "hunyuan_video15")
    script = tmp_path / "comfy_call.py"
    script.write_text(_COMFY_SCRIPT)
    for i2v in (False, True):
        call = comfy_call(tr, i2v, True, seed=7)
        torch.save({k: v for k, v in call.items() if torch.is_tensor(v)}, tmp_path / "in.pt")
        subprocess.run([os.environ.get("COMFYUI_PYTHON", _sys.executable), str(script),
                        os.environ["COMFYUI_PATH"], str(path), str(tmp_path / "in.pt"),
                        str(tmp_path / "out.pt")], check=True, timeout=600,
                       stdout=subprocess.DEVNULL)
        theirs = torch.load(tmp_path / "out.pt")
        assert (theirs["model"], theirs["config"], theirs["shift"], theirs["latent"]) == (
            "HunyuanVideo15", "HunyuanVideo15", 7.0, "HunyuanVideo15")
        check(den(**call), theirs["out"], f"ComfyUI's own model vs the pool, i2v {i2v}")


# ---- the step cache and PipeFusion ------------------------------------------------------------
# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input_is_refused_in_one_line(folders, layout_pools):
    """Frames not 4k + 1, a size off the 16-pixel token grid, a prompt the pipeline would cut
    (it fills all 1000 Qwen tokens): each refused in one line; the pool stays warm."""
    from comfyui_xdit.planning.config import ConfigError
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    with pytest.raises((ConfigError, ValueError), match=r"4k \+ 1"):
        pool.generate(request([A], frames=6))
    with pytest.raises((ConfigError, ValueError), match="16"):
        pool.generate(request([A], height=40))
    with pytest.raises(Exception, match="fills all 1000 Qwen tokens") as err:
        pool.generate(request([" ".join(["cat"] * 1200)]))
    assert "\n" not in str(err.value).strip()
    assert pool.generate(request([A], cfg=1.0, steps=1)).samples.shape[1] == 32


# ---- ComfyUI's CONDITIONING into the xDiT sampler ---------------------------------------------
def test_comfyui_conditioning_equals_the_pipeline_given_those_states(folders, pipes,
                                                                     layout_pools):
    """Sampler (xDiT) with ComfyUI CONDITIONING (comfy_convert.conditioning_to_request): the
    Qwen states, the ByT5 states ComfyUI's text encoder adds as conditioning_byt5small
    (positive only: a negative without quoted text has none) and, image-to-video, the SigLIP
    clip_vision_output's last hidden states; equal to the pipelines given the same states
    as prompt embeddings (every token valid), at Ulysses 2; ComfyUI's image-to-video values
    become the request's fields (the SigLIP output's last hidden states, as ComfyUI's
    HunyuanVideo15 model reads them)."""
    from comfyui_xdit.comfy_convert import conditioning_to_request, start_image_fields
    gen = torch.Generator().manual_seed(21)
    qwen = torch.randn(1, 6, 32, generator=gen)
    byt5 = torch.randn(1, 4, 32, generator=gen)
    neg = torch.randn(1, 3, 32, generator=gen)
    positive, _ = conditioning_to_request([[qwen, {"conditioning_byt5small": byt5}]],
                                          "positive", "hunyuan_video15")
    negative, _ = conditioning_to_request([[neg, {}]], "negative", "hunyuan_video15")
    assert positive.context_2 is not None and negative.context_2 is None
    req = request([], 3.0, positive=positive, negative=negative, batch_size=1)
    pipe = pipes["t2v"]
    h, w, f = SIZE
    noise = torch.randn([1, 32, (f - 1) // 4 + 1, h // 16, w // 16],
                        generator=torch.manual_seed(req.seed))
    saved = pipe.guider
    pipe.guider = type(saved)(guidance_scale=3.0)
    try:
        want = pipe(prompt_embeds=qwen, prompt_embeds_mask=torch.ones(1, 6),
                    prompt_embeds_2=byt5, prompt_embeds_mask_2=torch.ones(1, 4),
                    negative_prompt_embeds=neg, negative_prompt_embeds_mask=torch.ones(1, 3),
                    negative_prompt_embeds_2=torch.zeros(1, 2, 32),
                    negative_prompt_embeds_mask_2=torch.zeros(1, 2), height=h, width=w,
                    num_frames=f, num_inference_steps=STEPS, latents=noise,
                    output_type="latent").frames / pipe.vae.config.scaling_factor
    finally:
        pipe.guider = saved
    pool = layout_pools.get(folders["t2v"], ParallelConfig(ulysses=2))
    check(pool.generate(req).samples, want, "ComfyUI CONDITIONING, ulysses 2")
    # image-to-video: ComfyUI's HunyuanVideo15ImageToVideo values (the start frame's raw
    # latent, its mask, the SigLIP output) -> the request's fields
    siglip = type("Output", (), {"last_hidden_state": torch.randn(1, 36, 32, generator=gen),
                                 "penultimate_hidden_states": torch.zeros(1, 36, 32)})()
    extra = {"concat_latent_image": torch.zeros(1, 32, 2, 2, 3),
             "concat_mask": torch.ones(1, 1, 2, 2, 3), "clip_vision_output": siglip}
    got, _ = conditioning_to_request([[qwen, extra]], "positive", "hunyuan_video15")
    assert torch.equal(start_image_fields(got)["image_embeds"], siglip.last_hidden_state)
