"""Weight sharding (`shard_weights=True`, workers/parallel/sharding.py): FSDP2 over the transformer's
blocks on CPU/gloo.

* With sharding on, the exact configurations on 2 and 4 ranks (Ulysses, Ring, hybrid, CFG
  parallel, DP with an uneven batch) still reproduce the single-process diffusers pipeline
  (<= 1e-4, fp32), for FLUX and SD3.
* Residency is counted on every rank (the job stats): the block weights a rank holds at rest
  are <= 1/N + 5% of all block weights; during a forward the measured peak is its shards plus
  at most the running block and the prefetched next one; after the job every gathered block
  is freed again. Negative control: the same count on an unsharded pool is every block weight.
* Every rank ran the same number of block forwards (FSDP's all-gathers line up).
* The 4-rank FLUX pool runs under the NCCL point-to-point rules emulation
  (xdit_testhooks/nccl_rules.py): Ring's and Ulysses' traffic beside FSDP's all-gathers.
* A host-sampler call whose rows leave a dp replica empty (that replica runs a dummy forward)
  equals the diffusers transformer; LoRA on the sharded model equals the merged weights.
* PipeFusion + shard_weights is refused with one clear error, before anything launches.

Pools are shared per (arch, world) and switched with `reconfigure`.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig, WorkerPool

TOL = 1e-4
RULES = "xdit_testhooks.nccl_rules:install"
MEASURE = "xdit_testhooks.probes:measure_sharding"  # residency peaks (off in production)
PROMPTS = ["a photo of a red cat", "a dog on the grass", "blue sky"]
MOVED = 1e-2  # see tests/test_flux_sd3_one_rank_oracle.py


@pytest.fixture(scope="module")
def shard_pools(model_dir):
    made = {}

    def get(arch, world, hooks=()):
        key = (arch, world, tuple(hooks))
        if key not in made:
            made[key] = WorkerPool(model_dir(arch), ParallelConfig(ulysses=world),
                                   device="cpu", threads_per_rank=1, shard_weights=True,
                                   worker_hooks=[MEASURE, *hooks])
        return made[key]
    yield get
    for p in made.values():
        p.close()


@pytest.fixture(scope="module", autouse=True)
def short_deadlock_timeout():
    import os
    old = os.environ.get("XDIT_NCCL_RULES_TIMEOUT")
    os.environ["XDIT_NCCL_RULES_TIMEOUT"] = "20"
    yield
    if old is None:
        os.environ.pop("XDIT_NCCL_RULES_TIMEOUT", None)
    else:
        os.environ["XDIT_NCCL_RULES_TIMEOUT"] = old


def make_request(batch=1, cfg=1.0, odd=False, **kw):
    h, w, msl = (144, 112, 11) if odd else (64, 96, 8)
    return GenerationRequest(prompt=PROMPTS[:batch], seed=7, steps=2, height=h, width=w,
                             max_sequence_length=msl, cfg=cfg, negative_prompt="ugly", **kw)


def check_residency(stats, world):
    """Every rank's counted block weights (see the module doc); returns rank 0's counts."""
    counts = [st["sharding"] for st in stats]
    assert len(counts) == world
    for r, c in enumerate(counts):
        total, big, local = c["block_params"], c["largest_block_params"], c["block_params_local"]
        assert c["ranks"] == world
        assert local <= total / world + 0.05 * total, f"rank {r}: holds {local} of {total}"
        assert local >= total / world  # every weight is held somewhere (dim-0 chunks)
        assert c["block_params_resident_now"] == local, f"rank {r}: gathered blocks not freed"
        assert 0 < c["peak_block_params_between_blocks"] <= local + big, (r, c)
        assert local + big <= c["peak_block_params_in_block"] <= local + 2 * big, (r, c)
        # more than one block gathered inside a block: the next block's prefetch is in flight
        # (the largest block alone cannot account for it)
        assert c["peak_block_params_in_block"] > local + big, (r, c)
    forwards = {(c["forwards"], c["block_forwards"]) for c in counts}
    assert len(forwards) == 1, f"ranks ran different forward counts: {forwards}"
    return counts[0]


def run_exact(pool, oracle, unmoved_latent, arch, world, config, req):
    pool.reconfigure(config)
    res = pool.generate(req)
    want = oracle(arch, req)
    diff = (res.samples - want).abs().max().item()
    print(f"{arch} {config.describe()} sharded: max abs diff {diff:.2e}")
    assert diff <= TOL, f"{config.describe()} sharded: max abs diff {diff:.3e} > {TOL}"
    start = unmoved_latent(arch, req)
    assert (res.samples - start).abs().max().item() > MOVED  # not the initial noise
    return check_residency(res.stats, world)


CASES_2 = [
    ("ulysses2-odd", ParallelConfig(ulysses=2), dict(odd=True)),
    ("ring2", ParallelConfig(ring=2), {}),
    ("cfg2", ParallelConfig(cfg_parallel=True), dict(cfg=2.5)),
    ("dp2-uneven", ParallelConfig(dp=2), dict(batch=3)),
]
CASES_4 = {
    "flux": [
        ("ulysses2xring2-odd", ParallelConfig(ulysses=2, ring=2), dict(odd=True)),
        ("cfg2xring2", ParallelConfig(cfg_parallel=True, ring=2), dict(cfg=2.5)),
        ("dp2xulysses2-uneven", ParallelConfig(dp=2, ulysses=2), dict(batch=3)),
    ],
    "sd3": [
        ("ring4", ParallelConfig(ring=4), dict(cfg=2.0)),
        ("cfg2xulysses2", ParallelConfig(cfg_parallel=True, ulysses=2), dict(cfg=2.5)),
        ("dp2xring2-uneven", ParallelConfig(dp=2, ring=2), dict(batch=3, cfg=2.0)),
    ],
}


def test_one_rank_sharded_matches_diffusers(model_dir, oracle, unmoved_latent):
    """shard_weights on a 1-rank pool (one GPU with the option on) equals the pipeline: its
    one rank holds every row; FSDP2 over a group of one rank failed under inference mode
    ("Inference tensors do not track version counter")."""
    req = make_request()
    with WorkerPool(model_dir("flux"), ParallelConfig(), device="cpu", threads_per_rank=1,
                    shard_weights=True) as pool:
        res = pool.generate(req)
    diff = (res.samples - oracle("flux", req)).abs().max().item()
    print(f"flux 1 rank sharded: max abs diff {diff:.2e}")
    assert diff <= TOL
    assert (res.samples - unmoved_latent("flux", req)).abs().max().item() > MOVED


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_two_ranks_sharded_match_diffusers(shard_pools, oracle, unmoved_latent, arch):
    pool = shard_pools(arch, 2)
    for name, config, kw in CASES_2:
        c = run_exact(pool, oracle, unmoved_latent, arch, 2, config, make_request(**kw))
        print(f"  {name}: {c}")
    # status (rank 0's describe) shows the sharding too
    s = pool.status()["sharding"]
    assert s["ranks"] == 2 and s["block_params_local"] < s["block_params"]


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_four_ranks_sharded_match_diffusers(shard_pools, oracle, unmoved_latent, arch):
    # FLUX's 4-rank pool runs under the NCCL point-to-point rules (Ring's K/V ring, the
    # dp gather) beside FSDP's all-gathers: a schedule NCCL would deadlock on fails here
    pool = shard_pools(arch, 4, hooks=(RULES,) if arch == "flux" else ())
    for name, config, kw in CASES_4[arch]:
        c = run_exact(pool, oracle, unmoved_latent, arch, 4, config, make_request(**kw))
        print(f"  {name}: {c}")
    if arch == "flux":  # the emulation really carried this pool's point-to-point traffic
        pool.reconfigure(ParallelConfig(ring=4))
        res = pool.generate(make_request(odd=True))
        check_residency(res.stats, 4)
        hooks = [st.get("hooks") for st in res.stats]
        assert all(hooks), hooks
        print("  nccl rules stats:", hooks[0])


def test_unsharded_pool_holds_every_block_weight(pools, shard_pools):
    """Negative control: the count the residency checks read is the whole model on an
    unsharded pool, so `block_params_local <= 1/N + 5%` can fail."""
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    res = pool.generate(make_request())
    for st in res.stats:
        c = st["sharding"]
        assert c["block_params_local"] == c["block_params"]
        assert c["block_params_local"] > c["block_params"] / 2 + 0.05 * c["block_params"]
    sharded = shard_pools("flux", 2)
    sharded.reconfigure(ParallelConfig(ulysses=2))
    s = sharded.generate(make_request()).stats[0]["sharding"]
    assert s["block_params"] == res.stats[0]["sharding"]["block_params"]


def test_model_call_with_an_empty_replica(shard_pools):
    """A host sampler's single-row call on dp 2: replica 1 gets no rows and runs a dummy
    forward (else rank 0 would wait forever in FSDP's all-gather); the prediction equals the
    diffusers transformer's."""
    import diffusers

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from test_model_calls import comfy_call, reference

    arch = "flux"
    pool = shard_pools(arch, 2)
    tr = diffusers.FluxTransformer2DModel.from_pretrained(
        str(pool.model_path), subfolder="transformer", torch_dtype=torch.float32).eval()
    call = comfy_call(arch, tr, 1, 8, 6, seed=3)
    one = {k: (v[1:] if torch.is_tensor(v) else v) for k, v in call.items()}  # the cond row
    one["transformer_options"] = {"uuids": [uuid.uuid4()], "cond_or_uncond": [0]}
    den = PoolDenoiser(pool, ParallelConfig(dp=2).with_world_size(2), arch)
    got = den(**one)
    want = reference(arch, tr, one["x"], one["timestep"], one["context"], one["y"],
                     one["guidance"])
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff:.3e}"
    # the pool is still in step: a full job runs after it
    pool.reconfigure(ParallelConfig(ulysses=2))
    check_residency(pool.generate(make_request()).stats, 2)


def test_lora_on_sharded_model_equals_merged_weights(shard_pools, oracle, model_dir, tmp_path):
    from test_lora import make_peft_lora, merged_folder

    arch = "flux"
    d = tmp_path / "lora"
    d.mkdir()
    path, pairs = make_peft_lora(arch, model_dir(arch), d, seed=21)
    merged = merged_folder(model_dir(arch), tmp_path / "merged", [(pairs, 0.8)])
    pool = shard_pools(arch, 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    base = pool.generate(make_request()).samples
    got = pool.generate(make_request(loras=[(str(path), 0.8)]))
    want = oracle(arch, make_request(), path=merged)
    diff = (got.samples - want).abs().max().item()
    print(f"sharded LoRA vs merged: {diff:.2e}; vs base {(got.samples - base).abs().max():.2e}")
    assert (got.samples - base).abs().max().item() > 1e-3  # the LoRA does something
    assert diff <= TOL
    check_residency(got.stats, 2)
    # removing it restores the base output
    assert torch.equal(pool.generate(make_request()).samples, base)


def test_pipefusion_is_refused_with_shard_weights(model_dir):
    from workers.parallel.sharding import PIPEFUSION_REFUSED, check

    pool = WorkerPool(model_dir("flux"), ParallelConfig(pipefusion=2), device="cpu",
                      shard_weights=True)
    try:
        with pytest.raises(ConfigError, match="shard_weights cannot be combined with pipefusion"):
            pool.generate(make_request())
        assert not pool.is_running()  # refused before anything launched
        pool.config = ParallelConfig(ulysses=2)
        with pytest.raises(ConfigError, match="pipefusion 2"):
            pool.reconfigure(ParallelConfig(pipefusion=2))
        with pytest.raises(ConfigError, match="pipefusion"):
            pool.model_call(ParallelConfig(pipefusion=2), None, None, None, [], {}, set())
    finally:
        pool.close()
    # the same launch without sharding is accepted by the same check
    WorkerPool(model_dir("flux"), ParallelConfig(pipefusion=2), device="cpu").reconfigure(
        ParallelConfig(pipefusion=2))
    with pytest.raises(ValueError, match="PipeFusion"):
        check(True, 2)
    check(False, 2)
    check(True, 1)
    assert "pipefusion" in PIPEFUSION_REFUSED


def _transformer_bytes(folder) -> int:
    """Bytes of every tensor in the transformer's safetensors (what a whole load reads)."""
    from workers.loading.weights import Checkpoint
    with Checkpoint.folder(str(folder / "transformer")) as ck:
        return sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0])
                   for _, _, e in ck.entries.values())


@pytest.mark.parametrize("arch,world", [("flux", 2), ("sd3", 4)])
def test_each_rank_reads_only_its_shards(shard_pools, pools, model_dir, arch, world):
    """Loading fits the sharding: each rank reads only its rows of each tensor from the
    checkpoint (FSDP's dim-0 chunks), so the ranks together read the checkpoint exactly once
    and none reads more than 1/N of it + 5%. Negative control: every rank of an unsharded
    pool reads all of it."""
    total = _transformer_bytes(model_dir(arch))
    pool = shard_pools(arch, world)
    pool.reconfigure(ParallelConfig(ulysses=world))
    pool.generate(make_request(cfg=2.0))  # launched (if not yet) and in use
    ranks = pool.status()["ranks"]
    reads = [r["load"]["bytes_read"] for r in ranks]
    # buffers (SD3's positional table) are not parameters: FSDP leaves them whole on every
    # rank, so every rank reads them
    buffers = {r["load"]["buffer_bytes_read"] for r in ranks}
    assert len(buffers) == 1
    buf = buffers.pop()
    print(f"{arch} x{world}: checkpoint {total} B ({buf} B of buffers), read per rank {reads}")
    assert all(r["load"]["loaded"] == "shards only" for r in ranks)
    assert sum(reads) == total + (world - 1) * buf  # every parameter byte read exactly once
    assert max(reads) - buf <= (total - buf) / world + 0.05 * (total - buf)
    plain = pools(arch, 2).status()["ranks"]
    assert all(r["load"]["bytes_read"] == total for r in plain)


def test_bf16_and_fp8_sharded_equal_unsharded(model_dir):
    """bf16 and fp8 storage (each rank quantizes its rows with the whole tensor's scale), both
    read shard by shard: the sharded pool's result equals the unsharded pool's with the same
    engine options."""
    req = make_request(batch=3)
    for opts, load in ((dict(dtype="bf16"), "shards only"),
                       (dict(dtype="bf16", weights="fp8"), "shards only")):
        out = {}
        for shard in (True, False):
            with WorkerPool(model_dir("flux"), ParallelConfig(ring=2), device="cpu",
                            threads_per_rank=1, shard_weights=shard, worker_hooks=[MEASURE],
                            **opts) as pool:
                res = pool.generate(req)
                out[shard] = res.samples
                if shard:
                    c = check_residency(res.stats, 2)
                    assert c["load"] == load, c
                    print(f"{opts}: {c}")
        diff = (out[True] - out[False]).abs().max().item()
        print(f"{opts}: sharded vs unsharded max abs diff {diff:.2e}")
        assert diff <= TOL


def test_memory_plan_matches_the_counts_and_flux1_dev(shard_pools):
    """The memory plan's sharding figures (planning/memory_arithmetic.py, the one memory model)
    equal what the 2-rank pool holds and receives (fp32 tiny FLUX, read from FSDP's buffers
    by xdit_testhooks/sharding_probe.py), and for FLUX.1-dev's dimensions (11.9B parameters,
    bf16) sharding is what makes it fit a 16 GB card (docs/memory.md's table)."""
    from comfyui_xdit.planning.memory_arithmetic import shard_figures
    from comfyui_xdit.planning.model_facts import model_facts, preset_facts, transformer_facts

    def figures(facts, dtype_bytes, n):
        tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
        return shard_figures(tr, dtype_bytes, False, n)

    pool = shard_pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    c = pool.generate(make_request()).stats[0]["sharding"]
    p = figures(model_facts(str(pool.model_path), "fp32"), 4, 2)
    assert p.at_rest == 4 * (c["block_params_local"] + c["nonblock_params_local"])
    assert p.received_per_forward == c["received_bytes_per_forward_per_rank"]
    assert p.peak >= 4 * c["peak_block_params_in_block"]
    assert p.unsharded == 4 * (c["block_params"] + c["nonblock_params"])
    gb = 1e9
    dev = preset_facts("flux1-dev")
    one = figures(dev, 2, 1)
    assert 23.7 * gb < one.unsharded < 23.9 * gb  # 11.9B x 2 B
    for n in (2, 4, 8):
        q = figures(dev, 2, n)
        print(f"FLUX.1-dev bf16 x{n}: rest {q.at_rest / gb:.2f} GB, peak {q.peak / gb:.2f} GB, "
              f"received/forward/rank {q.received_per_forward / gb:.2f} GB")
        assert q.unsharded > 16 * gb >= q.peak  # a 16 GB card: needs sharding, fits sharded
        assert q.received_per_forward == one.unsharded * (n - 1) // n
    # negative control: the tiny model needs no sharding on that card
    assert p.unsharded <= 16 * gb


def test_single_file_loads_shard_only(model_dir, tmp_path):
    """A ComfyUI/BFL single file is read shard by shard too (each diffusers tensor's rows are
    row ranges of the file's tensors, fused qkv split by offset: tests/test_sharding_load.py):
    a host-sampler call on it equals the diffusers transformer of the same weights."""
    import diffusers

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from single_file_util import write_single_file
    from test_model_calls import comfy_call, reference

    path = write_single_file(model_dir("flux"), "flux", tmp_path / "flux1-tiny.safetensors")
    tr = diffusers.FluxTransformer2DModel.from_pretrained(
        str(model_dir("flux")), subfolder="transformer", torch_dtype=torch.float32).eval()
    call = comfy_call("flux", tr, 1, 8, 6, seed=5)
    want = reference("flux", tr, call["x"], call["timestep"], call["context"], call["y"],
                     call["guidance"])
    with WorkerPool(path, ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1,
                    shard_weights=True) as pool:
        got = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "flux")(**call)
        s = pool.status()["sharding"]
    assert s["load"] == "shards only" and s["block_params_local"] < s["block_params"]
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff:.3e}"
