"""The memory plan (comfyui_xdit/planning/: model_facts, memory_arithmetic, launch_policy,
calibration; the memory-plan command): weights per rank checked against the real meta-built
modules each method leaves on a rank, fp8, monotonicity, the refusal with its numbers, the
CLI, and the pool / loader refusing before any worker starts."""
from __future__ import annotations

import dataclasses
import math
import subprocess

import pytest
import torch

from comfyui_xdit import ParallelConfig
from comfyui_xdit.planning import calibration, gpus, launch_policy
from comfyui_xdit.planning import memory_arithmetic as arith
from comfyui_xdit.planning.model_facts import model_facts, preset_facts, transformer_facts
from comfyui_xdit.cli.commands import main as cli_main
from comfyui_xdit.planning.config import ConfigError, EngineOptions
from comfyui_xdit.bridge import worker_module

GiB = 2 ** 30
LISTS = ("transformer_blocks", "single_transformer_blocks")
BF16 = EngineOptions(device="cuda", dtype="bf16", weights="full", text_encoders="cpu")


@pytest.fixture(scope="module")
def flux2():
    """FLUX.2 [dev] on the meta device, as the loader would build it, and the preset."""
    from diffusers import Flux2Transformer2DModel
    with torch.device("meta"):
        tr = Flux2Transformer2DModel()
    return tr, preset_facts("flux2-dev")


def nbytes(params, fp8_ids=frozenset()) -> int:
    return sum(p.numel() * (1 if id(p) in fp8_ids else 2) for p in params)


def test_replicated_weights_are_every_parameter(flux2):
    tr, facts = flux2
    plan = arith.plan(facts, ParallelConfig(ulysses=2), BF16)
    assert [r.weights for r in plan.ranks] == [nbytes(tr.parameters())] * 2
    assert plan.ranks[0].kv_cache == 0 and plan.ranks[0].text_encoders == 0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pipefusion_stage_weights_are_the_stage_modules(flux2, n):
    """Each rank's weights = the parameters the stage loader keeps (its blocks and the
    modules around them), and no stage holds more than 1/N + 5% of the block weights."""
    tr, facts = flux2
    ps = worker_module("loading.stages")
    plan = arith.plan(facts, ParallelConfig(pipefusion=n), BF16, gpu_memory=80 * GiB)
    blocks_total = sum(p.numel() for _, _, b in ps.model_blocks(tr, LISTS)
                       for p in b.parameters()) * 2
    for rank in range(n):
        info = ps.plan_stages(tr, LISTS, rank, n, "balanced")
        dropped = ps.stage_block_names(tr, LISTS, info)
        kept = [p for name, p in tr.named_parameters()
                if not any(name.startswith(d + ".") for d in dropped)]
        assert plan.ranks[rank].weights == nbytes(kept)
        lo, hi = info.owned
        stage_blocks = sum(p.numel() for _, _, b in ps.model_blocks(tr, LISTS)[lo:hi]
                           for p in b.parameters()) * 2
        assert stage_blocks <= (1 / n + 0.05) * blocks_total
        # K/V: 2 x blocks held x full sequence (4096 image + 512 text tokens) x 6144 x bf16
        assert plan.ranks[rank].kv_cache == 2 * (hi - lo) * (4096 + 512) * 6144 * 2


def test_shard_weights_are_fsdp_chunks_plus_gathered(flux2):
    tr, facts = flux2
    n = 4
    plan = arith.plan(facts, ParallelConfig(ulysses=n), EngineOptions(
        device="cuda", dtype="bf16", weights="full", text_encoders="cpu", shard_weights=True))
    chunks = sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * 2
                 for p in tr.parameters())
    blocks = [b for name in LISTS for b in getattr(tr, name)]
    block_bytes = [nbytes(b.parameters()) for b in blocks]
    ids = {id(p) for b in blocks for p in b.parameters()}
    root = nbytes(p for p in tr.parameters() if id(p) not in ids)
    pair = max(a + b for a, b in zip(block_bytes, block_bytes[1:]))
    assert {r.weights for r in plan.ranks} == {chunks + root + pair}


def test_shard_weights_by_memory_count_each_ranks_own_rows(flux2):
    """`shard_split='memory'` on a 24 GB and a 16 GB GPU: each rank holds its rows of every
    parameter at 3:2 (workers/parallel/uneven_sharding.py, counted on the meta module's own
    rows, in one buffer with room for each unit's all-gather window of its largest share),
    so the 16 GB rank holds less than the even split's half; each rank receives the other's
    padded shard (the largest) per unit once per forward. Negative control: the
    even split gives both ranks the same bytes."""
    from workers.parallel.shares import share_sizes
    tr, facts = flux2
    engine = EngineOptions(device="cuda", dtype="bf16", weights="full", text_encoders="cpu",
                           shard_weights=True, shard_split="memory")
    caps = [24 * GiB, 16 * GiB]
    plan = arith.plan(facts, ParallelConfig(ulysses=2), engine, None, gpu_memory=caps)
    blocks = [b for name in LISTS for b in getattr(tr, name)]
    ids = {id(p) for b in blocks for p in b.parameters()}
    rest = [p for p in tr.parameters() if id(p) not in ids]

    def rows(params, rank):
        return sum(share_sizes(p.shape[0], (24, 16))[rank] * (p.numel() // p.shape[0]) * 2
                   for p in params)
    mine = [rows(tr.parameters(), r) for r in range(2)]
    assert abs(mine[0] / sum(mine) - 0.6) < 1e-3
    units = [list(b.parameters()) for b in blocks] + [rest]
    flight = max(2 * max(rows(u, 0), rows(u, 1)) + nbytes(u) for u in units)

    def buffer(rank):  # its rows back to back, with room for each unit's largest-share window
        at = end = 0
        for u in units:
            end, at = max(end, at + max(rows(u, 0), rows(u, 1))), at + rows(u, rank)
        return max(end, at)
    held = [buffer(r) for r in range(2)]
    assert held[0] == mine[0] and mine[1] < held[1] < mine[1] + max(rows(u, 0) for u in units)
    assert [r.weights for r in plan.ranks] == [h + nbytes(rest) + flight for h in held]
    assert plan.gather_bytes_per_step == sum(max(rows(u, 0), rows(u, 1)) for u in units)
    assert plan.ranks[1].role == "shard 2/2 (40%)"
    even = arith.plan(facts, ParallelConfig(ulysses=2), dataclasses.replace(
        engine, shard_split="even"), None, gpu_memory=caps)
    assert even.ranks[0].weights == even.ranks[1].weights > plan.ranks[1].weights
    with pytest.raises(ConfigError, match="shard_split 'memory' needs each"):
        arith.plan(facts, ParallelConfig(ulysses=2), engine, None)
    assert engine.shard_weights_for(2, [24, 16]) == (24.0, 16.0)
    assert EngineOptions(shard_weights=True, shard_split="3,2").problems_with(
        ParallelConfig(ulysses=4))[0].startswith("shard_split '3,2' gives 2 weights for 4")
    # refused before a launch, one line each: no GPU sizes on the CPU, a bad weight
    assert "needs device cuda" in EngineOptions(shard_weights=True,
                                                shard_split="memory").problems()[0]
    assert EngineOptions(shard_weights=True, shard_split="3,x").problems() == [
        "shard_split '3,x' must be 'even', 'memory' or one positive weight per rank like 3,2"]


def test_shard_weights_traffic_per_step(flux2):
    """Each rank receives the other N-1 ranks' chunks of every parameter once per forward
    (twice per step with in-process CFG, once with cfg parallel); no sharding, no traffic."""
    tr, facts = flux2
    n = 4
    engine = EngineOptions(device="cuda", dtype="bf16", weights="full", text_encoders="cpu",
                           shard_weights=True)
    chunks = sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * 2
                 for p in tr.parameters())
    one = arith.plan(facts, ParallelConfig(ulysses=n), engine)
    assert one.gather_bytes_per_step == (n - 1) * chunks
    cfg = arith.plan(facts, ParallelConfig(ulysses=n), engine, arith.JobSize(cfg=True))
    assert cfg.gather_bytes_per_step == 2 * one.gather_bytes_per_step
    split = arith.plan(facts, ParallelConfig(ulysses=2, cfg_parallel=True), engine,
                       arith.JobSize(cfg=True))
    assert split.gather_bytes_per_step == one.gather_bytes_per_step
    assert arith.plan(facts, ParallelConfig(ulysses=n), BF16).gather_bytes_per_step == 0
    assert arith.plan(facts, ParallelConfig(ulysses=n), BF16).traffic() == ""
    text = one.traffic((("test link", 100.0),))
    assert f"{one.gather_bytes_per_step / 1e9 / 100:.3g} s on test link" in text


def test_fp8_halves_the_block_linear_weights(flux2):
    tr, facts = flux2
    linears = worker_module("loading.weights").block_linears(tr, LISTS)
    lin_bytes = sum(m.weight.numel() * 2 for m in linears.values())
    full = arith.plan(facts, ParallelConfig(), BF16).ranks[0].weights
    fp8 = arith.plan(facts, ParallelConfig(), EngineOptions(
        device="cuda", dtype="bf16", weights="fp8", text_encoders="cpu")).ranks[0].weights
    assert full - fp8 == lin_bytes // 2
    assert lin_bytes > 0.9 * full  # the block Linears are nearly all of FLUX.2's weights


def test_more_ranks_less_per_rank(flux2):
    _, facts = flux2
    shard = EngineOptions(device="cuda", dtype="bf16", weights="full", text_encoders="cpu",
                          shard_weights=True)
    pf = [max(r.total for r in arith.plan(facts, ParallelConfig(pipefusion=n), BF16).ranks)
          for n in (1, 2, 4, 8)]
    sh = [max(r.total for r in arith.plan(facts, ParallelConfig(ulysses=n), shard).ranks)
          for n in (2, 4, 8)]
    assert pf == sorted(pf, reverse=True) and len(set(pf)) == 4
    assert sh == sorted(sh, reverse=True) and len(set(sh)) == 3
    # bigger images and batches only add
    small = arith.plan(facts, ParallelConfig(ulysses=2), BF16, arith.JobSize(512, 512)).ranks[0]
    big = arith.plan(facts, ParallelConfig(ulysses=2), BF16, arith.JobSize(2048, 2048, 2)).ranks[0]
    assert small.weights == big.weights and small.activations < big.activations


def test_text_encoders_on_rank0_only_and_auto_falls_back_to_cpu(flux2):
    _, facts = flux2
    assert 23.9e9 < facts.text_encoder_params < 24.1e9  # Mistral-Small-3.1: 24B
    gpu = arith.plan(facts, ParallelConfig(pipefusion=2), EngineOptions(
        device="cuda", dtype="bf16", text_encoders="gpu"), gpu_memory=80 * GiB)
    assert gpu.ranks[0].text_encoders == facts.text_encoder_params * 2
    assert gpu.ranks[1].text_encoders == 0
    auto = arith.plan(facts, ParallelConfig(pipefusion=2), EngineOptions(
        device="cuda", dtype="bf16", text_encoders="auto"), gpu_memory=80 * GiB)
    assert auto.ranks[0].text_encoders == 0 and "CPU" in auto.text_encoders_on


def test_refused_with_numbers_and_what_would_fit(flux2):
    _, facts = flux2
    plan = arith.plan(facts, ParallelConfig(ulysses=2), BF16, gpu_memory=24 * GiB)
    assert plan.fits is False
    msg = plan.message()
    worst = plan.worst
    assert f"{worst.total / GiB:.1f} GiB of its 24.0 GiB" in msg
    assert "largest part is transformer weights" in msg
    assert plan.alternatives and all(t <= 24 * GiB for _, t in plan.alternatives)
    for desc, _ in plan.alternatives:  # each offered change really fits when applied
        assert any(k in desc for k in ("pipefusion", "shard_weights", "fp8"))
    assert arith.plan(facts, ParallelConfig(ulysses=2), BF16, gpu_memory=80 * GiB).fits


def test_flux1_preset(flux2):
    facts = preset_facts("flux1-dev")
    plan = arith.plan(facts, ParallelConfig(), BF16)
    assert 11.8e9 < plan.ranks[0].weights / 2 < 12.0e9  # FLUX.1 [dev]: 11.9B parameters
    assert 4.8e9 < facts.text_encoder_params < 5.0e9  # T5-XXL encoder + CLIP-L


@pytest.mark.parametrize("name,transformer,text", [
    ("qwen-image", (20.2e9, 20.6e9), (8.2e9, 8.4e9)),  # Qwen-Image 20B, Qwen2.5-VL 7B (8.3B)
    ("chroma1-hd", (8.7e9, 9.0e9), (4.7e9, 4.8e9)),  # Chroma1-HD 8.9B, T5-XXL encoder
])
def test_family_presets_have_the_published_sizes(name, transformer, text):
    facts = preset_facts(name)
    plan = arith.plan(facts, ParallelConfig(), BF16)
    assert transformer[0] < plan.ranks[0].weights / 2 < transformer[1]
    assert text[0] < facts.text_encoder_params < text[1]
    assert facts.vae_params > 0 and len(facts.vae_channels) == 4


def test_model_folder_counts_its_real_modules(model_dir):
    from diffusers import FluxTransformer2DModel
    path = model_dir("flux")
    facts = model_facts(str(path), "bf16")
    with torch.device("meta"):
        tr = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(
            str(path / "transformer")))
    plan = arith.plan(facts, ParallelConfig(ulysses=2), BF16)
    assert plan.ranks[0].weights == nbytes(tr.parameters())
    assert facts.text_encoder_bytes > 0 and facts.vae_params > 0


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_single_file_counts_the_folder_modules(model_dir, tmp_path, arch):
    """A single BFL-named file: the same transformer as its folder, no text encoders or VAE
    (ComfyUI encodes and decodes). SD3's positional table is a buffer, whole on every rank."""
    import diffusers
    from single_file_util import write_single_file
    folder = model_dir(arch)
    f = write_single_file(folder, arch, tmp_path / f"{arch}.safetensors")
    facts = model_facts(str(f), "bf16")
    cls = getattr(diffusers, facts.transformer_class)
    with torch.device("meta"):
        tr = cls.from_config(cls.load_config(str(folder / "transformer")))
    buffers = sum(b.numel() for n, b in tr.named_buffers() if n in tr.state_dict()) * 2
    assert (arch == "sd3") == (buffers > 0)
    plan = arith.plan(facts, ParallelConfig(pipefusion=2), BF16)
    whole = arith.plan(facts, ParallelConfig(), BF16).ranks[0]
    assert whole.weights == nbytes(tr.parameters()) + buffers
    assert whole.text_encoders == 0 and whole.vae == 0
    assert all(r.weights < whole.weights for r in plan.ranks)


def test_cli_table_and_bad_input(capsys):
    rc = cli_main(["memory-plan", "--preset", "flux2-dev", "--pipefusion", "4", "--gpus", "4",
                   "--height", "1024", "--width", "1024", "--gpu-memory", "24",
                   "--text-encoders", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and "stage 4/4" in out and "fits" in out
    rc = cli_main(["memory-plan", "--preset", "flux2-dev", "--ulysses", "2", "--gpus", "2",
                   "--height", "1024", "--width", "1024", "--gpu-memory", "24"])
    assert rc == 1 and "does not fit" in capsys.readouterr().out.lower()
    rc = cli_main(["memory-plan", "--preset", "flux2-dev", "--ulysses", "2", "--gpus", "3",
                   "--height", "1024", "--width", "1024"])
    err = capsys.readouterr().err
    assert rc == 2 and "world size 3" in err
    rc = cli_main(["memory-plan", "--preset", "flux2-dev", "--compare", "--gpus", "2,8",
                   "--gpu-memory", "24,80", "--height", "1024", "--width", "1024"])
    table = capsys.readouterr().out
    assert rc == 0 and "| PipeFusion N | cpu | bf16 |" in table and "8x80 GB" in table


def test_cli_counts_the_cfg_degree(capsys):
    """--cfg-parallel N: N cfg ranks in the rank count (one GPU size per rank), the bare
    flag 2; a bad degree is one line, exit 2."""
    base = ["memory-plan", "--preset", "ltx2", "--cfg", "--height", "512", "--width", "768",
            "--frames", "97", "--text-encoders", "cpu"]
    rc = cli_main(base + ["--cfg-parallel", "4", "--gpus", "4", "--gpu-memory", "80,80,80,48"])
    out = capsys.readouterr().out
    assert rc == 0 and "cfg 4" in out and [l.split()[0] for l in out.splitlines()[1:5]] == \
        ["0", "1", "2", "3"], out
    rc = cli_main(base + ["--cfg-parallel", "--gpus", "2"])
    assert rc == 0 and "cfg 2" in capsys.readouterr().out
    rc = cli_main(base + ["--cfg-parallel", "3", "--gpus", "4"])
    assert rc == 2 and "world size 4 != dp 1 x cfg 3" in capsys.readouterr().err
    rc = cli_main(base + ["--cfg-parallel", "0", "--gpus", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--cfg-parallel degree must be >= 1 (got 0)" in err


def _no_spawn(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a worker was started")
    monkeypatch.setenv("XDIT_LAUNCHER", "spawn")  # each rank a Popen (not forked by the helper)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_pool_refuses_before_any_worker(model_dir, monkeypatch):
    from comfyui_xdit import GenerationRequest, WorkerPool
    _no_spawn(monkeypatch)
    seen = []

    def memory(ids):
        seen.append(list(ids))
        return [64 * 2 ** 20] * len(ids)  # 64 MiB GPUs: below the 2 GiB reserve
    monkeypatch.setattr(gpus, "gpu_memory_bytes", memory)
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      dtype="bf16", gpus=["GPU-a", "GPU-b"])
    with pytest.raises(ConfigError) as e:
        pool.generate(GenerationRequest(prompt=["x"], steps=1, height=64, width=64))
    assert "of its 0.1 GiB GPU" in str(e.value) and "CUDA reserve 2.0 GiB" in str(e.value)
    assert str(e.value).endswith(launch_policy.OVERRIDE_HINT)
    assert "XDIT_MEMORY_PLAN=advise" in str(e.value)
    assert seen == [["GPU-a", "GPU-b"]] and pool.worker_pids() == []
    with pytest.raises(ConfigError, match="before any job's activations"):
        pool.decode(torch.zeros(1, 16, 8, 8))  # the launch path of decode / model calls
    pool.close()


def test_loader_shows_and_refuses(model_dir, monkeypatch):
    from comfyui_xdit.nodes.handles import make_handle
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [64 * 2 ** 20] * len(ids))
    h = make_handle(str(model_dir("flux")), "cuda", "bf16", ulysses=2, gpus="GPU-a,GPU-b",
                    has_cuda=True)
    assert any("of its 0.1 GiB GPU" in p for p in h.problems())
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [80 * GiB] * len(ids))
    assert h.problems() == [] and "fits" in h.memory_summary()
    cpu = make_handle(str(model_dir("flux")), "cpu", "fp32", ulysses=2, has_cuda=False)
    assert cpu.problems() == [] and cpu.memory_summary() == ""


def test_vae_largest_map_is_the_decoders(model_dir):
    """The decode estimate's largest feature map equals the largest module output of the
    real decoder (the tiny FLUX VAE, run on CPU)."""
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(str(model_dir("flux")), subfolder="vae").eval()
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(
        out.numel() if torch.is_tensor(out) else 0)) for m in vae.decoder.modules()]
    h, w = 64, 96
    with torch.no_grad():
        vae.decode(torch.zeros(1, vae.config.latent_channels, h // 8, w // 8))
    for hk in hooks:
        hk.remove()
    channels = tuple(vae.config.block_out_channels)
    assert len(channels) == 4  # three 2x upsamplers: 8x, as VAE_SCALE says
    assert max(seen) == arith.vae_largest_map(channels, h, w)


class _LiveBytes:
    """A dispatch mode measuring the peak bytes of tensor storages created by the ops run
    inside it and still referenced (views share their storage: counted once)."""

    def __new__(cls):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.refs, self.size, self.now, self.peak = {}, {}, 0, 0

            def _drop(self, key):
                self.refs[key] -= 1
                if not self.refs[key]:
                    self.now -= self.size.pop(key)
                    del self.refs[key]

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if torch.is_tensor(t) and t.untyped_storage().nbytes():
                        key = t.untyped_storage().data_ptr()
                        if key not in self.refs:
                            self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                            self.now += self.size[key]
                        self.refs[key] += 1
                        weakref.finalize(t, self._drop, key)
                self.peak = max(self.peak, self.now)
                return out
        return Mode()


@pytest.mark.parametrize("arch", ["flux2", "flux"])
def test_activation_estimate_bounds_a_real_forward(model_dir, arch):
    """A tiny model's forward on CPU (fp32): the live activations it creates peak below the
    plan's estimate for the same tokens, and not far below (the estimate is not loose)."""
    import diffusers
    path = model_dir(arch)
    facts = model_facts(str(path), "fp32")
    tr = getattr(diffusers, facts.transformer_class).from_pretrained(
        str(path), subfolder="transformer").eval()
    c = tr.config
    text, image = 32, (384 // 16) * (256 // 16)
    kw = dict(hidden_states=torch.randn(1, image, c.in_channels),
              encoder_hidden_states=torch.randn(1, text, c.joint_attention_dim),
              timestep=torch.tensor([0.5]), img_ids=torch.zeros(image, 4 if arch == "flux2"
                                                                   else 3),
              txt_ids=torch.zeros(text, 4 if arch == "flux2" else 3),
              guidance=torch.tensor([3.5]) if c.guidance_embeds else None)
    if arch == "flux":
        kw["pooled_projections"] = torch.randn(1, c.pooled_projection_dim)
    with torch.no_grad(), _LiveBytes() as live:
        tr(**kw)
    t = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    estimate = arith.activation_bytes(t, image + text, text, image + text, 1, 4, 1)
    assert 0.5 * estimate < live.peak <= estimate, (live.peak, estimate)


def test_text_encoders_on_a_named_gpu(flux2, monkeypatch):
    """text_encoders=cuda:N: counted on the rank whose GPU that is, on none for a spare GPU;
    the launch check then weighs the spare GPU alone and refuses one they cannot fit."""
    from comfyui_xdit.planning import gpus
    _, facts = flux2
    te = facts.text_encoder_params * 2
    engine = EngineOptions(device="cuda", dtype="bf16", text_encoders="cuda:1")
    other = arith.plan(facts, ParallelConfig(pipefusion=2), engine, gpu_memory=80 * GiB)
    assert [r.text_encoders for r in other.ranks] == [0, te]
    assert "rank 1's GPU" in other.text_encoders_on
    spare = arith.plan(facts, ParallelConfig(pipefusion=2),
                       dataclasses.replace(engine, text_encoders="cuda:2"), gpu_memory=80 * GiB)
    assert [r.text_encoders for r in spare.ranks] == [0, 0]
    assert "no rank uses" in spare.text_encoders_on

    monkeypatch.setattr(gpus, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setattr(launch_policy, "model_facts", lambda path, dtype: facts)
    sizes = {"0": 80 * GiB, "1": 80 * GiB, "2": 24 * GiB}
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [sizes[i] for i in ids])
    spare_engine = dataclasses.replace(engine, text_encoders="cuda:2")
    with pytest.raises(ConfigError) as e:
        launch_policy.check_launch("unused", ParallelConfig(pipefusion=2), spare_engine,
                                   ["0", "1"])
    assert "GPU 2 (text_encoders=cuda:2) has 24.0 GiB" in str(e.value)
    sizes["2"] = 80 * GiB
    p = launch_policy.check_launch("unused", ParallelConfig(pipefusion=2), spare_engine,
                                   ["0", "1"])
    assert p.fits and [r.text_encoders for r in p.ranks] == [0, 0]
    # the GPU list decides whose GPU cuda:N is: ranks on GPUs 2 and 0, cuda:0 is rank 1's
    p = launch_policy.check_launch("unused", ParallelConfig(pipefusion=2),
                                   dataclasses.replace(engine, text_encoders="cuda:0"),
                                   ["2", "0"])
    assert [r.text_encoders for r in p.ranks] == [0, te]


def test_gpu_sizes_by_index_on_a_mixed_box(monkeypatch):
    """nvidia-smi numbers GPUs in PCI order, CUDA fastest first: on a box mixing sizes an index
    is planned with the smallest card unless CUDA_DEVICE_ORDER=PCI_BUS_ID; UUIDs are exact."""
    small, big = 24 * GiB, 80 * GiB
    monkeypatch.setattr(gpus, "_smi_sizes", lambda: {"0": small, "1": big, "GPU-a": small,
                                                     "GPU-b": big})
    assert gpus.gpu_memory_bytes(["1", "0", "GPU-b", "7"], environ={}) == [small, small, big, None]
    assert gpus.gpu_memory_bytes(["1", "0"], environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == \
        [big, small]
    monkeypatch.setattr(gpus, "_smi_sizes", lambda: {"0": big, "1": big, "GPU-a": big})
    assert gpus.gpu_memory_bytes(["1", "GPU-a"], environ={}) == [big, big]  # uniform: exact


def test_nvidia_smi_is_asked_once_per_visible_gpu_set(monkeypatch):
    """A launch reads the GPUs' sizes (the memory plan, shard_split memory) and names
    (split=auto): nvidia-smi answers once per process for each CUDA_VISIBLE_DEVICES value,
    sizes and names from one call, an empty answer kept too; a new value asks again."""
    import subprocess
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        out = "0, GPU-a, 81559, NVIDIA H100 80GB HBM3\n1, GPU-b, 24564, NVIDIA L4, rev 2\n"
        return subprocess.CompletedProcess(cmd, 0, out if len(calls) < 3 else "", "")

    monkeypatch.setattr(gpus, "_SMI", {})
    monkeypatch.setattr(gpus.shutil, "which", lambda exe: "/usr/bin/" + exe)
    monkeypatch.setattr(gpus.subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # indices as nvidia-smi's
    for _ in range(3):
        assert gpus.gpu_memory_bytes(["GPU-b", "0"]) == [24564 * 2 ** 20, 81559 * 2 ** 20]
        assert gpus.gpu_names(["1", "GPU-a", "7"]) == ["NVIDIA L4, rev 2",
                                                       "NVIDIA H100 80GB HBM3", None]
    assert len(calls) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # another set: asked again
    assert gpus.gpu_names(["0"]) == ["NVIDIA H100 80GB HBM3"] and len(calls) == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing listed this time: kept as such
    assert gpus.gpu_memory_bytes(["0"]) == [None] and gpus.gpu_names(["0"]) == [None]
    assert gpus.gpu_memory_bytes(["0"]) == [None] and len(calls) == 3


# ---- enforce | advise ------------------------------------------------------------------------
TINY_GPUS = 64 * 2 ** 20  # below the 2 GiB reserve alone: every plan misfits


class Launched(Exception):
    """Raised by the stand-in Popen: the pool went past its memory check to start workers."""


def _launch_stops_at_popen(monkeypatch):
    def launched(*a, **k):
        raise Launched()
    monkeypatch.setenv("XDIT_LAUNCHER", "spawn")  # each rank a Popen (not forked by the helper)
    monkeypatch.setattr(subprocess, "Popen", launched)


def test_mode_from_argument_env_and_one_error_for_a_bad_value():
    assert launch_policy.resolve_mode(None, environ={}) == "enforce"
    assert launch_policy.resolve_mode("auto", environ={"XDIT_MEMORY_PLAN": "Advise "}) == "advise"
    assert launch_policy.resolve_mode("enforce",
                                      environ={"XDIT_MEMORY_PLAN": "advise"}) == "enforce"
    with pytest.raises(ConfigError) as e:
        launch_policy.resolve_mode("warn", environ={})
    assert str(e.value) == ("memory_plan must be enforce, advise or auto ($XDIT_MEMORY_PLAN, "
                            "default enforce); got 'warn'")
    with pytest.raises(ConfigError, match="XDIT_MEMORY_PLAN='off' is not a memory plan mode; "
                                          "set it to enforce .* or advise"):
        launch_policy.resolve_mode(None, environ={"XDIT_MEMORY_PLAN": "off"})


@pytest.mark.parametrize("how", ["argument", "env"])
def test_advise_launches_anyway_and_warns_with_the_numbers(model_dir, monkeypatch, caplog,
                                                          how):
    from comfyui_xdit import GenerationRequest, WorkerPool
    _launch_stops_at_popen(monkeypatch)
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [TINY_GPUS] * len(ids))
    kw = {"memory_plan": "advise"} if how == "argument" else {}
    if how == "env":
        monkeypatch.setenv("XDIT_MEMORY_PLAN", "advise")
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      dtype="bf16", gpus=["GPU-a", "GPU-b"], **kw)
    assert pool.memory_plan == "advise"
    with caplog.at_level("WARNING", logger="comfyui_xdit"), pytest.raises(Launched):
        pool.generate(GenerationRequest(prompt=["x"], steps=1, height=64, width=64))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings  # generate's check, not repeated by the launch
    assert "memory_plan=advise, launching although" in warnings[0]
    assert "of its 0.1 GiB GPU" in warnings[0] and "CUDA reserve 2.0 GiB" in warnings[0]
    st = pool.status()["memory_plan"]
    assert st["mode"] == "advise" and st["fits"] is False and st["job"] == "64x64 batch 1"
    assert st["gpu_mb_per_rank"] == [64, 64] and st["measured_peak_mb"] is None
    assert min(st["predicted_mb_per_rank"]) > 2048  # the reserve alone
    pool.close()


def test_pool_mode_is_checked_and_can_change_before_a_launch(model_dir, monkeypatch):
    from comfyui_xdit import GenerationRequest, WorkerPool
    with pytest.raises(ConfigError, match="memory_plan must be enforce, advise or auto"):
        WorkerPool(model_dir("flux"), device="cuda", memory_plan="maybe")
    _launch_stops_at_popen(monkeypatch)
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [TINY_GPUS] * len(ids))
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      dtype="bf16", gpus=["GPU-a", "GPU-b"], memory_plan="enforce")
    req = GenerationRequest(prompt=["x"], steps=1, height=64, width=64)
    with pytest.raises(ConfigError, match="does not fit"):
        pool.generate(req)
    pool.memory_plan = "advise"
    with pytest.raises(Launched):
        pool.generate(req)
    with pytest.raises(Launched):  # decode's launch: the fixed parts, overruled alike
        pool.decode(torch.zeros(1, 16, 8, 8))


def test_loader_option_advises(model_dir, monkeypatch):
    from comfyui_xdit.nodes.handles import loader_handle, make_handle
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [TINY_GPUS] * len(ids))
    path = str(model_dir("flux"))
    enforce = make_handle(path, "cuda", "bf16", ulysses=2, gpus="GPU-a,GPU-b", has_cuda=True)
    assert any("XDIT_MEMORY_PLAN=advise" in p for p in enforce.problems())
    h = loader_handle(dict(model=path, device="cuda", ulysses=2, gpus="GPU-a,GPU-b",
                           memory_plan="advise"), [], has_cuda=True)  # validated: no raise
    assert h.memory_plan == "advise"
    assert "does NOT fit" in h.memory_summary() and "launches anyway" in h.memory_summary()
    monkeypatch.setenv("XDIT_MEMORY_PLAN", "advise")  # auto follows the environment
    assert enforce.problems() == [] and "launches anyway" in enforce.memory_summary()
    bad = make_handle(path, "cuda", "bf16", ulysses=2, gpus="GPU-a,GPU-b",
                      memory_plan="sometimes", has_cuda=True)
    assert [p for p in bad.problems() if "memory_plan" in p] == [
        "memory_plan must be enforce, advise or auto ($XDIT_MEMORY_PLAN, default enforce); "
        "got 'sometimes'"]


def test_registry_hands_the_mode_to_the_pool(model_dir):
    import dataclasses as dc

    from comfyui_xdit.nodes.handles import make_handle
    from comfyui_xdit.nodes.pool_registry import PoolRegistry
    made = []

    class FakePool:
        memory_plan = "enforce"

        def __init__(self, path, config, **kw):
            self.config = config
            self.memory_plan = kw.get("memory_plan", "enforce")
            made.append(kw)

        def close(self):
            pass
    reg = PoolRegistry(pool_factory=FakePool)
    h = make_handle(str(model_dir("flux")), "cpu", "fp32", "2", has_cuda=False)
    p = reg.get(dc.replace(h, memory_plan="advise"), h.config_for())
    assert made[-1]["memory_plan"] == "advise" and p.memory_plan == "advise"
    # not a new pool: the mode acts at the pool's next launch
    assert reg.get(dc.replace(h, memory_plan="enforce"), h.config_for()) is p
    assert p.memory_plan == "enforce" and len(made) == 1


# ---- predicted vs measured -------------------------------------------------------------------
def test_measured_line_from_given_numbers():
    line = calibration.measured_line([21504, 12288], [17000.4, 9000], [17800, None],
                                     reserve_mb=2048)
    assert line == ("xDiT memory plan vs the first job, MiB on ranks 0/1: predicted "
                    "21504/12288 (19456/10240 without the 2048 MiB CUDA reserve); measured "
                    "peak allocated 17000/9000 (0.87/0.88x the prediction without reserve), "
                    "reserved 17800/?")
    assert "reserved" not in calibration.measured_line([4096], [None], [None])
    assert "measured peak allocated ? (?x" in calibration.measured_line([4096], [None], [None])


def test_first_job_peaks_recorded_once(flux2):
    _, facts = flux2
    plan = arith.plan(facts, ParallelConfig(pipefusion=2), BF16, arith.JobSize(), 24 * GiB)
    status = calibration.plan_status(plan, "advise")
    assert status["predicted_mb_per_rank"] == [round(r.total / 2 ** 20) for r in plan.ranks]
    assert status["job"] == "1024x1024 batch 1" and status["reserve_mb"] == 2048
    # stats as workers/runtime/worker.py gathers them (rank order not relied on), CPU: none
    assert calibration.record_measured(status, [{"rank": 0, "rss_mb": 1.0}], 2) is None
    stats = [{"rank": 1, "cuda_peak_mb": 15000.0, "cuda_reserved_peak_mb": 15500.0},
             {"rank": 0, "cuda_peak_mb": 16000.0, "cuda_reserved_peak_mb": 16600.0}]
    line = calibration.record_measured(status, stats, 2)
    assert line == calibration.measured_line(status["predicted_mb_per_rank"],
                                             [16000.0, 15000.0], [16600.0, 15500.0])
    assert status["measured_peak_mb"] == [16000, 15000]
    assert status["measured_reserved_mb"] == [16600, 15500]
    assert calibration.record_measured(status, stats, 2) is None  # the first job only
    assert calibration.record_measured(calibration.plan_status(None, "enforce"), stats, 2) is None


def test_pool_logs_the_comparison_after_its_first_job(model_dir, monkeypatch, caplog):
    """The pool's glue, without workers: a launch plan made without a job (decode) is
    re-planned for the first job, then logged once beside the measured peaks and kept in
    status()."""
    from comfyui_xdit import GenerationRequest, WorkerPool
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [80 * GiB] * len(ids))
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      dtype="bf16", gpus=["GPU-a", "GPU-b"])
    fixed = launch_policy.check_pool(pool, None)
    assert fixed.job is None
    pool._memory = calibration.plan_status(fixed, pool.memory_plan)
    pool._launched_gpus = ["GPU-a", "GPU-b"]
    req = GenerationRequest(prompt=["x"], steps=1, height=64, width=64)
    stats = [{"rank": r, "cuda_peak_mb": 3000.0 + r} for r in range(2)]
    with caplog.at_level("INFO", logger="comfyui_xdit"):
        pool._note_measured(req, stats)
        pool._note_measured(req, stats)
    lines = [r.getMessage() for r in caplog.records if "memory plan vs" in r.getMessage()]
    assert len(lines) == 1 and "measured peak allocated 3000/3001" in lines[0]
    st = pool.status()["memory_plan"]
    assert st["job"] == "64x64 batch 1" and st["measured_peak_mb"] == [3000, 3001]
    assert st["mode"] == "enforce" and st["fits"] is True
    assert f"predicted {st['predicted_mb_per_rank'][0]}/" in lines[0]
    cpu = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2))
    assert "memory_plan" not in cpu.status()


def test_docs_tables_are_what_the_plan_prints(capsys):
    """Every table docs/memory.md says a `memory-plan` command generated is that command's
    output to the character: the docs quote the one memory model (and its one set of link
    rates, LINKS_GBPS), never a copy that can drift."""
    import pathlib
    import re
    import shlex

    root = pathlib.Path(__file__).resolve().parents[1]
    text = "\n".join((root / f).read_text() for f in ("docs/memory.md", "docs/methods.md",
                                                       "README.md"))
    found = re.findall(r"`python -m comfyui_xdit (memory-plan [^`]+)`:\n\n((?:\|.*\n?)+)", text)
    assert len(found) == 7, ("the FLUX.2-dev fit table and the FLUX.1-dev sharding table "
                             "(docs/memory.md), Wan's per-step traffic (docs/methods.md), the "
                             "Qwen-Image and Wan 2.2 A14B fit tables and the MiniMax-H3 and "
                             "LTX-2 ones (docs/memory.md)")
    for cmd, table in found:
        assert cli_main(shlex.split(cmd)) == 0, cmd
        assert capsys.readouterr().out.strip() == table.strip(), cmd
    # a refusal quoted whole: the command exits 1 and prints exactly the quoted lines
    refused = re.findall(r"`python -m comfyui_xdit (memory-plan [^`]+)` refuses it \(exit 1\):"
                         r"\n\n```\n(.*?)```", text, re.S)
    assert len(refused) == 1, "LTX-2's refused layout (docs/memory.md)"
    for cmd, out in refused:
        assert cli_main(shlex.split(cmd)) == 1, cmd
        assert capsys.readouterr().out.strip() == out.strip(), cmd
    for name, rate in arith.LINKS_GBPS:
        assert f"{name} ~{rate:g} GB/s" in text


# ---- video (Wan) -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,transformer,experts", [
    ("wan2.1-t2v-14b", (14.2e9, 14.4e9), 1),  # Wan 2.1 14B: 14.3B parameters
    ("wan2.1-t2v-1.3b", (1.40e9, 1.45e9), 1),  # Wan 2.1 1.3B: 1.42B
    ("wan2.2-t2v-a14b", (28.4e9, 28.8e9), 2),  # two 14B experts, both resident
])
def test_wan_presets_have_the_published_sizes(name, transformer, experts):
    facts = preset_facts(name)
    plan = arith.plan(facts, ParallelConfig(), BF16)
    assert facts.experts == experts
    assert transformer[0] < plan.ranks[0].weights / 2 < transformer[1]
    assert 5.6e9 < facts.text_encoder_params < 5.8e9  # UMT5-XXL's encoder: 5.7B
    assert 120e6 < facts.vae_params < 135e6  # Wan 2.1 VAE: 127M
    assert facts.vae_channels == (96, 192, 384, 384)


def test_minimax_h3_preset_has_the_published_size_and_32_pixel_tokens():
    """MiniMax-H3: about 62 GiB of bf16 transformer weights (33.1B parameters); a token is
    2 x 2 latent pixels of its 16x VAE, 32 pixels a side: 768x1344 x 124 frames is 37 latent
    frames x 24 x 42 video tokens, plus its sound's (round(124 / 24 x 40) = 207 latents for
    each of its two channels) and the prompt's (joint attention)."""
    facts = preset_facts("minimax-h3")
    plan = arith.plan(facts, ParallelConfig(), BF16)
    assert 32.5e9 < plan.ranks[0].weights / 2 < 33.5e9
    job = arith.JobSize(768, 1344, frames=124, text_tokens=100)
    assert arith.job_tokens(facts, job) == 37 * 24 * 42 + 2 * 207 + 100


def test_ltx2_decode_is_rank_0s_whole_with_the_decoders_widths():
    """LTX-2 decodes on rank 0 alone, every frame in one call, with a decoder whose widths
    are not the encoder's (128 channels at 1/4 of the side, where its 4-pixel patches are
    unpatchified): 512x768 x 121 frames holds 8 x 121 x 512 x 768 elements at its largest,
    ~3.4 GiB with the output on rank 0, none on the others. Read as the encoder's widths
    split over 2 ranks (the patch-parallel decode it does not run) it came to ~91 GiB."""
    facts = preset_facts("ltx2")
    assert facts.vae_channels == (3, 3, 3, 128, 256, 512, 1024)
    assert arith.vae_largest_map(facts.vae_channels, 512, 768) == 8 * 512 * 768
    job = arith.JobSize(512, 768, frames=121)
    assert arith.job_tokens(facts, job) == 16 * 16 * 24 + 126  # the video's + the sound's
    whole = arith.vae_decode_bytes(facts.vae_channels, 512, 768, 1, 2, 1, frames=121,
                                   frames_per_chunk=121)
    assert 3.3 * GiB < whole < 3.5 * GiB
    p = arith.plan(facts, ParallelConfig(ulysses=2), BF16, job)
    zero, one = p.ranks
    assert zero.activations == whole and zero.vae == facts.vae_params * 2
    assert one.vae == 0 and one.activations < GiB  # the transformer's half of the tokens
    assert p.worst.rank == 0 and zero.total < 45 * GiB
    # shard_weights and an uneven split give every rank its own activations; rank 0's still
    # holds the whole decode
    for config, engine in ((ParallelConfig(ulysses=2, split="3,1"), BF16),
                           (ParallelConfig(ulysses=2), dataclasses.replace(
                               BF16, shard_weights=True))):
        zero, one = arith.plan(facts, config, engine, job).ranks
        assert zero.activations == whole and one.activations < GiB and one.vae == 0


def test_ltx2_vae_largest_map_is_the_decoders():
    """The widths read from an LTX-style config give the largest module output of the real
    decoder (a small one, run on CPU): its last upsampler's convolution, one frame more than
    the video before the causal trim, so between F and F + 1 frames of the plan's map."""
    from diffusers import AutoencoderKLLTX2Video

    from comfyui_xdit.planning.model_facts import vae_channels
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(block_out_channels=(8, 8, 8, 8),
                                 layers_per_block=(1, 1, 1, 1, 1),
                                 decoder_block_out_channels=(128, 256, 512),
                                 decoder_layers_per_block=(1, 1, 1, 1)).eval()
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(
        out.numel() if torch.is_tensor(out) else 0)) for m in vae.decoder.modules()]
    h, w, frames = 64, 96, 9
    with torch.no_grad():
        out = vae.decode(torch.zeros(1, 128, (frames - 1) // 8 + 1, h // 32, w // 32),
                         return_dict=False)[0]
    for hk in hooks:
        hk.remove()
    assert tuple(out.shape) == (1, 3, frames, h, w)
    largest = arith.vae_largest_map(vae_channels(vae.config), h, w)
    assert largest * frames <= max(seen) <= largest * (frames + 1)
    # a decoder of its own widths that upsamples as the others do (FLUX.2's option)
    assert vae_channels({"block_out_channels": (1, 2), "decoder_block_out_channels": (3, 4)}) \
        == (3, 4)


def test_wan_tokens_are_frames_times_the_grid_and_text_stays_out():
    """720p x 81 frames: 21 latent frames x 45 x 80 = 75,600 tokens; Wan's UMT5 text is
    cross-attended, so it neither joins the sequence nor its all-to-alls; FLUX's does."""
    wan = preset_facts("wan2.1-t2v-14b")
    job = arith.JobSize(720, 1280, frames=81, text_tokens=512)
    assert arith.job_tokens(wan, job) == 21 * 45 * 80 == 75_600
    assert arith.job_tokens(wan, arith.JobSize(720, 1280, frames=1)) == 45 * 80
    flux = preset_facts("flux1-dev")
    assert arith.job_tokens(flux, arith.JobSize(1024, 1024, text_tokens=512)) == 4096 + 512
    # activations grow with the frames; Ulysses 8 holds 1/8 of the tokens
    one = arith.plan(wan, ParallelConfig(), BF16, arith.JobSize(720, 1280, frames=1)).ranks[0]
    vid = arith.plan(wan, ParallelConfig(), BF16, job).ranks[0]
    u8 = arith.plan(wan, ParallelConfig(ulysses=8), BF16, job).ranks[0]
    assert vid.activations > 5 * one.activations  # one frame: the VAE decode's is larger
    assert 5 * u8.activations < vid.activations < 8 * u8.activations


def test_two_experts_double_the_resident_weights():
    one = preset_facts("wan2.1-t2v-14b")
    two = preset_facts("wan2.2-t2v-a14b")
    shard = dataclasses.replace(BF16, shard_weights=True)
    for config, engine in ((ParallelConfig(ulysses=2), BF16),
                           (ParallelConfig(pipefusion=2), BF16)):
        a, b = arith.plan(one, config, engine).ranks[0], arith.plan(two, config, engine).ranks[0]
        assert b.weights == 2 * a.weights and b.activations == a.activations
    tr = transformer_facts(one.transformer_class, one.transformer_config, one.arch)
    f = arith.shard_figures(tr, 2, False, 4)
    a = arith.plan(one, ParallelConfig(ulysses=4), shard).ranks[0].weights
    b = arith.plan(two, ParallelConfig(ulysses=4), shard).ranks[0].weights
    assert b - a == f.at_rest  # the idle expert's chunks; one expert gathered at a time
    # a misfit of two experts is offered sharding (both experts sharded)
    p = arith.plan(two, ParallelConfig(ulysses=4), BF16, arith.JobSize(720, 1280, frames=81),
                   gpu_memory=48 * GiB)
    assert any("shard" in d for d, _ in p.alternatives), p.alternatives


def test_folder_experts_from_model_index(tmp_path):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    one = model_facts(str(ensure_tiny_model("wan", tmp_path)), "bf16")
    two = model_facts(str(ensure_tiny_model("wan", tmp_path, variant="a14b")), "bf16")
    assert (one.experts, two.experts) == (1, 2)
    assert arith.plan(two, ParallelConfig(), BF16).ranks[0].weights == \
        2 * arith.plan(one, ParallelConfig(), BF16).ranks[0].weights


def test_step_traffic_formulas():
    """Per rank per step at 720p x 81 frames, CFG in one process (2 branches): A = 2 x 75,600
    tokens x 5120 x 2 B, 40 attention layers."""
    wan = preset_facts("wan2.2-t2v-a14b")
    job = arith.JobSize(720, 1280, frames=81, cfg=True)
    a = 2 * 75_600 * 5120 * 2
    t = arith.step_traffic(wan, job, "bf16", 4)
    assert t["Ulysses"] == 4 * 3 / 16 * a * 40
    assert t["Ring"] == 2 * 3 / 4 * a * 40
    assert t["PipeFusion"] == a
    assert t["CFG parallel"] == 16 * 21 * 90 * 160 * 2  # one prediction, the LATENT's size
    assert arith.step_traffic(wan, dataclasses.replace(job, cfg=False), "bf16", 4)["Ulysses"] \
        == t["Ulysses"] / 2


def test_memory_plan_cli_frames(capsys):
    rc = cli_main(["memory-plan", "--preset", "wan2.1-t2v-1.3b", "--height", "480",
                   "--width", "832", "--frames", "80"])
    assert rc == 2 and "frames 80 is not of the form 4k + 1" in capsys.readouterr().err
    rc = cli_main(["memory-plan", "--preset", "flux1-dev", "--height", "512", "--width", "512",
                   "--frames", "5"])
    assert rc == 2 and "makes images" in capsys.readouterr().err
    rc = cli_main(["memory-plan", "--preset", "wan2.1-t2v-1.3b", "--height", "480",
                   "--width", "832", "--frames", "81", "--traffic-table", "--gpus", "2,4"])
    out = capsys.readouterr().out
    assert rc == 0 and "| Ulysses | 2 |" in out and "| Ring | 4 |" in out


# ---- a plan that cannot be made --------------------------------------------------------------
def _planner_raises(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("config.json unreadable")
    monkeypatch.setattr(launch_policy, "model_facts", broken)
    monkeypatch.setattr(gpus, "gpu_memory_bytes", lambda ids: [80 * 2 ** 30] * len(ids))


def test_enforce_refuses_a_launch_it_cannot_plan(model_dir, monkeypatch):
    """It used to fail open: any error while planning let the launch go ahead (a log line
    only), even under enforce."""
    from comfyui_xdit import GenerationRequest, WorkerPool
    _launch_stops_at_popen(monkeypatch)
    _planner_raises(monkeypatch)
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      dtype="bf16", gpus=["GPU-a", "GPU-b"], memory_plan="enforce")
    with pytest.raises(ConfigError) as e:
        pool.generate(GenerationRequest(prompt=["x"], steps=1, height=64, width=64))
    msg = str(e.value)
    assert "could not be made (RuntimeError: config.json unreadable)" in msg
    assert "memory_plan to advise" in msg and "\n" not in msg
    assert pool.worker_pids() == []  # nothing started, nothing left behind
    pool.close()


def test_advise_says_the_plan_could_not_be_made(model_dir, monkeypatch, caplog):
    from comfyui_xdit import GenerationRequest, WorkerPool
    from comfyui_xdit.nodes.handles import ModelHandle
    _launch_stops_at_popen(monkeypatch)
    _planner_raises(monkeypatch)
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cuda",
                      dtype="bf16", gpus=["GPU-a", "GPU-b"], memory_plan="advise")
    with caplog.at_level("WARNING", logger="comfyui_xdit"), pytest.raises(Launched):
        pool.generate(GenerationRequest(prompt=["x"], steps=1, height=64, width=64))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("launching without a memory plan" in w and "config.json unreadable" in w
               for w in warnings), warnings
    st = pool.status()["memory_plan"]
    assert st["mode"] == "advise" and "could not be made" in st["error"]
    pool.close()
    # the loader node's text (node logic, as the loader shows it); under enforce, its error
    handle = ModelHandle(path=str(model_dir("flux")), device="cuda", dtype="bf16",
                         world_size=2, memory_plan="advise")
    monkeypatch.setattr("comfyui_xdit.nodes.handles.gpus_for_ranks", lambda n, g: ["0"] * n)
    assert handle.problems() == []
    assert handle.memory_summary() == ("memory plan could not be made (RuntimeError: "
                                       "config.json unreadable); memory_plan=advise: the "
                                       "pool launches anyway")
    enforced = ModelHandle(path=handle.path, device="cuda", dtype="bf16", world_size=2,
                           memory_plan="enforce")
    problems = enforced.problems()
    assert len(problems) == 1 and "could not be made" in problems[0], problems
