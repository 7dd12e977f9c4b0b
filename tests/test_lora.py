"""LoRA in the pool: a LoRA at strength s is the manually merged `W + s * (alpha/r) * B A`;
switching LoRA lists and strengths between jobs never reloads the base model, and removing
them restores the base output exactly; bad files fail one job with one clear error.

LoRA files are made here: a peft adapter on the tiny transformer with random non-zero B,
saved with the pipeline's `save_lora_weights` (diffusers format), plus a kohya-style FLUX
file with double-block keys only (diffusers' converter hard-codes FLUX.1's sizes for single
blocks)."""
from __future__ import annotations

import os
import shutil

import diffusers
import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig, PoolError, WorkerPool

R, ALPHA = 4, 8.0  # scale alpha/r = 2
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# by name: this module is also imported inside workers (the hook below), which need neither
PIPE = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline"}
TRANSFORMER = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel"}
READS_HOOK = "xdit_testhooks.probes:count_safetensors_reads"


def request(**kw):
    base = dict(prompt=["a lora cat"], seed=5, steps=2, height=64, width=64,
                max_sequence_length=8, cfg=1.0)
    base.update(kw)
    return GenerationRequest(**base)


def make_peft_lora(arch, model, out_dir, seed, targets=TARGETS):
    """-> (file, {module name: (A, B)}) for a diffusers-format LoRA with alpha/r = 2."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    t = getattr(diffusers, TRANSFORMER[arch]).from_pretrained(model, subfolder="transformer")
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets)
    t.add_adapter(cfg, adapter_name="x")
    g = torch.Generator().manual_seed(seed)
    for n, p in t.named_parameters():
        if "lora_" in n:  # B is zero-initialised: make both random
            p.data = torch.randn(p.shape, generator=g) * 0.1
    sd = get_peft_model_state_dict(t, adapter_name="x")
    meta = {k: v for k, v in cfg.to_dict().items()}
    getattr(diffusers, PIPE[arch]).save_lora_weights(out_dir, transformer_lora_layers=sd,
                                                     transformer_lora_adapter_metadata=meta)
    pairs = {}
    for k, v in sd.items():
        if ".lora_A." in k:
            pairs[k.split(".lora_A.")[0]] = (v.clone(), sd[k.replace(".lora_A.", ".lora_B.")].clone())
    return out_dir / "pytorch_lora_weights.safetensors", pairs


def make_kohya_flux(path, seed):
    """kohya FLUX keys for double block 0's image attention qkv (dim 64)."""
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(R, 64, generator=g) * 0.1
    up = torch.randn(3 * 64, R, generator=g) * 0.1
    key = "lora_unet_double_blocks_0_img_attn_qkv"
    save_file({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
               f"{key}.alpha": torch.tensor(ALPHA)}, str(path))
    q, k, v = up.chunk(3, dim=0)
    return path, {f"transformer_blocks.0.attn.to_{n}": (down, u) for n, u in zip("qkv", (q, k, v))}


def merged_folder(model, dest, loras):
    """A copy of the model whose transformer weights are W + sum s * (alpha/r) * B @ A."""
    shutil.copytree(model, dest)
    f = dest / "transformer" / "diffusion_pytorch_model.safetensors"
    w = load_file(str(f))
    for pairs, s in loras:
        for name, (a, b) in pairs.items():
            w[f"{name}.weight"] = w[f"{name}.weight"] + s * (ALPHA / R) * (b @ a)
    save_file(w, str(f))
    return dest


@pytest.fixture(scope="module")
def loras(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for arch in ("flux", "sd3"):
        for i in (1, 2):
            d = root / f"{arch}{i}"
            d.mkdir()
            out[f"{arch}{i}"] = make_peft_lora(arch, model_dir(arch), d, seed=10 * i)
    out["kohya"] = make_kohya_flux(root / "kohya.safetensors", seed=3)
    bad = root / "corrupt.safetensors"
    bad.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                                  dtype=torch.uint8).numpy().tobytes())
    out["corrupt"] = (bad, None)
    nomatch = root / "nomatch.safetensors"
    save_file({"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.ones(R, 8),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.ones(8, R)},
              str(nomatch))
    out["nomatch"] = (nomatch, None)
    return out


def maxdiff(a, b):
    return (a - b).abs().max().item()


# one diffusers LoRA against its merged weights is the conformance suite's, for every family;
# here several at once, a negative strength and kohya's names
@pytest.mark.parametrize("arch,names,strengths", [
    ("flux", ["flux1", "flux2", "kohya"], [0.6, -0.5, 1.3]),
])
def test_lora_equals_manual_merge(pools, model_dir, loras, tmp_path, arch, names, strengths):
    pool = pools(arch, 1)
    pool.reconfigure(ParallelConfig())
    base = pool.generate(request()).samples
    got = pool.generate(request(loras=[(str(loras[n][0]), s)
                                       for n, s in zip(names, strengths)])).samples
    merged = merged_folder(model_dir(arch), tmp_path / "merged",
                           [(loras[n][1], s) for n, s in zip(names, strengths)])
    with WorkerPool(merged, ParallelConfig(), device="cpu", threads_per_rank=1) as oracle:
        want = oracle.generate(request()).samples
    print(f"{arch} {names} {strengths}: |lora - merged| = {maxdiff(got, want):.2e}, "
          f"|lora - base| = {maxdiff(got, base):.2e}")
    assert maxdiff(got, base) > 1e-3  # the LoRA does something
    assert maxdiff(got, want) <= 1e-4


@pytest.fixture(scope="module")
def counted_pool(model_dir):
    """A 2-rank FLUX pool whose workers count the safetensors files they open."""
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1, worker_hooks=[READS_HOOK])
    try:
        yield pool
    finally:
        pool.close()


def test_switching_never_reloads_and_removal_is_exact(counted_pool, model_dir, loras):
    """The base weights are read from disk once per rank, at launch: the worker hook sees
    the transformer's weight file(s) opened then and never again while LoRA lists and
    strengths switch (it does see each LoRA file being read, so it is watching)."""
    pool = counted_pool
    first = pool.generate(request())
    pids = pool.worker_pids()
    weights = os.path.realpath(os.path.join(model_dir("flux"), "transformer"))

    def reads(result):
        """Per rank: ({base weight file: opens}, {other file: opens})."""
        out = []
        for st in result.stats:
            got = st["hooks"][READS_HOOK]
            out.append(({f: n for f, n in got.items() if f.startswith(weights + os.sep)},
                        {f: n for f, n in got.items() if not f.startswith(weights + os.sep)}))
        return out

    at_launch = reads(first)
    assert len(at_launch) == 2
    for base_files, _ in at_launch:  # the hook saw the launch's load: one open per file
        assert base_files and set(base_files.values()) == {1}, base_files
    base, loads0 = first.samples, first.stats[0]["lora_loads"]
    a, b = str(loras["flux1"][0]), str(loras["flux2"][0])
    outs = {}
    for lst in ([(a, 1.0)], [(a, 0.5)], [(b, 1.0)], [(a, 0.5), (b, 1.0)], [], [(a, 1.0)]):
        r = pool.generate(request(loras=lst))
        outs.setdefault(tuple(lst), []).append(r.samples)
        for rank, ((base_files, others), (launch_files, _)) in enumerate(zip(reads(r),
                                                                              at_launch)):
            assert base_files == launch_files, \
                f"rank {rank} read the base weights again with LoRAs {lst}: {base_files}"
            for path, _ in lst:  # every LoRA file in use has been read on this rank
                assert others.get(os.path.realpath(path), 0) >= 1, (rank, path, others)
        for st in r.stats:
            assert st["lora_loads"] - loads0 <= 2
        assert pool.worker_pids() == pids and pool.launches == 1
    assert all(st["lora_loads"] - loads0 == 2 for st in r.stats)  # each file loaded once
    assert torch.equal(outs[()][0], base), maxdiff(outs[()][0], base)  # removed: exactly base
    assert torch.equal(outs[((a, 1.0),)][0], outs[((a, 1.0),)][1])  # re-activated: same
    assert maxdiff(outs[((a, 1.0),)][0], outs[((a, 0.5),)][0]) > 1e-4  # strength matters
    assert torch.equal(pool.generate(request()).samples, base)


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_lora_ulysses_equals_one_rank(pools, loras, arch):
    lst = [(str(loras[f"{arch}1"][0]), 0.7), (str(loras[f"{arch}2"][0]), 0.4)]
    one = pools(arch, 1)
    one.reconfigure(ParallelConfig())
    want = one.generate(request(loras=lst)).samples
    two = pools(arch, 2)
    two.reconfigure(ParallelConfig(ulysses=2))
    got = two.generate(request(loras=lst)).samples
    print(f"{arch}: |ulysses2 - 1 rank| with LoRA = {maxdiff(got, want):.2e}")
    assert maxdiff(got, want) <= 1e-4


def test_lora_on_hooked_layers_under_ulysses(pools, model_dir, tmp_path):
    """A LoRA on the layers the sequence-parallel hooks sit on (proj_out's gather, the input
    embedders), loaded into a pool whose Ulysses layout is already hooked, equals 1 rank: the
    hooks move to peft's wrappers (else the LoRA branch sees the local shard only)."""
    path, _ = make_peft_lora("flux", model_dir("flux"), tmp_path, seed=7,
                             targets=["proj_out", "x_embedder", "context_embedder"] + TARGETS)
    lst = [(str(path), 0.9)]
    one = pools("flux", 1)
    one.reconfigure(ParallelConfig())
    want = one.generate(request(loras=lst)).samples
    two = pools("flux", 2)
    two.reconfigure(ParallelConfig(ulysses=2))
    base = two.generate(request()).samples  # hooked before the adapter exists
    got = two.generate(request(loras=lst)).samples
    assert maxdiff(got, base) > 1e-3
    assert maxdiff(got, want) <= 1e-4
    assert torch.equal(two.generate(request()).samples, base)


def test_bad_lora_files_fail_one_job_and_leave_the_pool_usable(pools, loras, tmp_path):
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    pids = pool.worker_pids()
    base = pool.generate(request()).samples
    with pytest.raises(ConfigError, match="LoRA file not found: .*missing.safetensors"):
        pool.generate(request(loras=[(str(tmp_path / "missing.safetensors"), 1.0)]))
    with pytest.raises(ConfigError, match="strength must be a finite number"):
        pool.generate(request(loras=[(str(loras["flux1"][0]), "strong")]))
    # a file that is not safetensors is refused on the host, before the job reaches a rank
    with pytest.raises(ConfigError, match="corrupt.safetensors.* is not a valid .safetensors"):
        pool.generate(request(loras=[(str(loras["flux1"][0]), 1.0),
                                     (str(loras["corrupt"][0]), 1.0)]))
    for name, msg in [("nomatch", "nomatch.safetensors has no key that matches this flux model")]:
        # together with a good LoRA: the job fails as a whole and nothing stays active
        with pytest.raises(PoolError, match=msg) as e:
            pool.generate(request(loras=[(str(loras["flux1"][0]), 1.0),
                                         (str(loras[name][0]), 1.0)]))
        assert len(str(e.value).splitlines()) == 1
        assert pool.worker_pids() == pids
        assert torch.equal(pool.generate(request()).samples, base)
    # a FLUX file on SD3 names layers SD3 does not have (single blocks)
    sd3 = pools("sd3", 1)
    with pytest.raises(PoolError, match="LoRA keys do not fit this sd3 model"):
        sd3.generate(request(loras=[(str(loras["flux1"][0]), 1.0)]))
    assert sd3.generate(request()).samples.shape == (1, 16, 8, 8)


def test_lora_node_chain_matches_pool(pools, model_dir, loras, tmp_path):
    """The LoRA node's chained handle gives exactly the pool job with the same LoRA list."""
    from comfyui_xdit.planning.config import ConfigError
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    path = str(loras["flux1"][0])
    handle = ModelHandle(path=str(model_dir("flux")), device="cpu", dtype="fp32",
                         world_size=2, ulysses=2, threads_per_rank=1)
    chained = handle.with_lora(path, 0.8).with_lora(str(loras["flux2"][0]), -0.3)
    assert chained.loras == ((path, 0.8), (str(loras["flux2"][0]), -0.3)) and handle.loras == ()
    registry = PoolRegistry()
    try:
        got = sample(chained, SampleInputs(latent={"samples": torch.zeros(1, 16, 8, 8)},
                                           prompt="a lora cat", seed=5, steps=2, cfg=1.0,
                                           max_sequence_length=8), registry=registry)["samples"]
    finally:
        registry.unload_all()
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    want = pool.generate(request(loras=[(path, 0.8), (str(loras["flux2"][0]), -0.3)])).samples
    base = pool.generate(request()).samples
    assert maxdiff(got, want) <= 1e-6 and maxdiff(got, base) > 1e-3
    with pytest.raises(ConfigError, match="LoRA file not found"):
        handle.with_lora(str(tmp_path / "missing.safetensors"), 1.0)


def test_lora_under_pipefusion_equals_exact(pools, model_dir, loras):
    """Under PipeFusion each stage loads only its own blocks' LoRA layers; the kohya file
    touches double block 0 only, so stage 1 holds none of it. With warmup >= steps the
    result equals the exact configuration's."""
    exact = pools("flux", 2)
    exact.reconfigure(ParallelConfig(ulysses=2))
    pf = WorkerPool(model_dir("flux"), ParallelConfig(pipefusion=2, warmup_steps=2),
                    device="cpu", threads_per_rank=1)
    a, k = str(loras["flux1"][0]), str(loras["kohya"][0])
    try:
        base = pf.generate(request()).samples
        for lst in ([(a, 1.0)], [(k, 0.8)], [(a, 0.5), (k, 1.0)], []):
            got = pf.generate(request(loras=lst)).samples
            want = exact.generate(request(loras=lst)).samples
            assert maxdiff(got, want) <= 1e-4, lst
            assert (maxdiff(got, base) > 1e-4) == bool(lst), lst
        with pytest.raises(PoolError, match="no key that matches"):
            pf.generate(request(loras=[(str(loras["nomatch"][0]), 1.0)]))
        assert torch.equal(pf.generate(request()).samples, base)
    finally:
        pf.close()
