"""What a GPU step does, checked on CPU pools.

No step waits on the host: over steps 2..N of a job (and every model call after a run's
first), no rank runs an operation that would stall a GPU stream or copy host data in
(xdit_testhooks/host_syncs.py: `.item()` / `float()` / `bool()` of a tensor, `nonzero`,
tensors built from Python data, copies across devices), for every exact method, weight
sharding and the xDiT MODEL's calls. PipeFusion with warmup 0 is allowed its stated count
in the first step only (the partly filled K/V cache's index, once per attention call).

On CPU pools a host copy is invisible (host and device are one), so this test sees the
syncs and the tensors made from Python data; on a GPU the same hook also sees the copies.
Negative control: the old per-forward guidance tensor is caught.

The loader's `attention` choice is the kernel that runs at every degree: a spy on the
kernels each rank called (xdit_testhooks/probes.py) at 1 rank, CFG-only and DP-only, where
no sequence parallelism is involved, as under Ulysses and Ring.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.nodes.model_calls import PoolDenoiser

HOOK = "xdit_testhooks.host_syncs:install"
SPY = "xdit_testhooks.probes:attention_calls"
CONTROL = "xdit_testhooks.host_syncs:install_with_host_guidance"


@pytest.fixture(scope="module")
def sync_pools(model_dir):
    made = {}

    def get(arch, world, hook=HOOK, **options):
        key = (arch, world, hook, tuple(sorted(options.items())))
        if key not in made:
            made[key] = WorkerPool(model_dir(arch), ParallelConfig(ulysses=world), device="cpu",
                                   threads_per_rank=1, worker_hooks=[hook, SPY], **options)
        return made[key]
    yield get
    for p in made.values():
        p.close()


def _req(**kw):
    # 80x48: 15 image tokens and 7 text tokens, neither divides 2 or 4 (padded shards)
    base = dict(prompt=["a red fox", "a blue bird", "a cat"], seed=3, steps=3, height=80,
                width=48, max_sequence_length=7, cfg=2.0, negative_prompt="blurry")
    base.update(kw)
    return GenerationRequest(**base)


def _per_rank(stats, hook=HOOK) -> list:
    return [st["hooks"][hook]["counts"] for st in stats]


def _after_first(counts: dict, kind: str, first: int = 1) -> dict:
    """{"job:2": {...}} -> the flagged ops of steps (calls) >= first, merged."""
    out = {}
    for key, ops in counts.items():
        k, _, index = key.partition(":")
        if k == kind and index != "None" and int(index) >= first:
            for op, n in ops.items():
                out[op] = out.get(op, 0) + n
    return out


def _where(stats, hook=HOOK) -> list:
    return [st["hooks"][hook]["where"] for st in stats]


METHODS = {
    "ulysses4": ParallelConfig(ulysses=4),
    "ring4": ParallelConfig(ring=4),
    "ulysses2xring2": ParallelConfig(ulysses=2, ring=2),
    "cfg2xring2": ParallelConfig(cfg_parallel=True, ring=2),
    "dp2xulysses2": ParallelConfig(dp=2, ulysses=2),
    "dp2xcfg2": ParallelConfig(dp=2, cfg_parallel=True),
}


def test_no_host_waits_in_the_steps_of_any_exact_method(sync_pools):
    pool = sync_pools("flux", 4)
    for name, config in METHODS.items():
        pool.reconfigure(config)
        res = pool.generate(_req())
        counts = _per_rank(res.stats)
        assert len(counts) == 4
        for rank, c in enumerate(counts):
            steps = sorted(int(k.split(":")[1]) for k in c if k.split(":")[1] != "None")
            assert steps == [0, 1, 2], (name, rank, list(c))  # the scope saw every step
            assert _after_first(c, "job") == {}, (name, rank, c, _where(res.stats)[rank])


def test_no_host_waits_in_model_calls(sync_pools, model_dir):
    import json
    pool = sync_pools("flux", 4)
    cfg = json.loads((model_dir("flux") / "transformer" / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 10, 6, generator=g)
    ctx = torch.randn(3, 7, cfg["joint_attention_dim"], generator=g)
    y = torch.randn(3, cfg["pooled_projection_dim"], generator=g)
    for config in (ParallelConfig(ulysses=4), ParallelConfig(cfg_parallel=True, ring=2),
                   ParallelConfig(dp=2, ulysses=2)):
        den = PoolDenoiser(pool, config.with_world_size(4), "flux")
        opts = {"uuids": [uuid.uuid4() for _ in range(3)]}
        for i in range(3):
            den(x * (1 - 0.2 * i), torch.full((1,), 0.9 - 0.2 * i), context=ctx, y=y,
                guidance=torch.full((3,), 3.5), transformer_options=opts)
            if i == 0:
                continue
            for rank, h in enumerate(den.last_stats["hooks"]):
                calls = h[HOOK]["counts"]
                assert calls, (config.describe(), rank)  # the scope ran
                flagged = {k: v for k, v in calls.items() if v}
                assert flagged == {}, (config.describe(), rank, flagged, h[HOOK]["where"])


def test_no_host_waits_under_weight_sharding(sync_pools):
    pool = sync_pools("sd3", 2, shard_weights=True)
    for config in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True),
                   ParallelConfig(dp=2)):
        pool.reconfigure(config)
        res = pool.generate(_req(cfg=4.0))
        for rank, c in enumerate(_per_rank(res.stats)):
            assert _after_first(c, "job") == {}, (config.describe(), rank, c)


def test_pipefusion_waits_only_while_its_cache_fills(sync_pools):
    """Warmup 1 (the default): nothing after the first step. Warmup 0: the first step's
    patches attend to a partly filled cache, whose index is made on the host, once per
    attention call of that step; nothing after it."""
    pool = sync_pools("flux", 2, hook=HOOK)
    pool.reconfigure(ParallelConfig(pipefusion=2))
    res = pool.generate(_req())
    for rank, c in enumerate(_per_rank(res.stats)):
        assert _after_first(c, "job", first=0) == {}, (rank, c)
    pool.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=0))
    res = pool.generate(_req())
    for rank, c in enumerate(_per_rank(res.stats)):
        assert _after_first(c, "job") == {}, (rank, c)
        first = c.get("job:0", {})
        assert set(first) == {"aten.lift_fresh"}, (rank, c)  # the cache index, nothing else
        assert 0 < first["aten.lift_fresh"] <= 8, (rank, c)  # a few attention calls at most


def test_negative_control_catches_a_host_guidance_tensor(sync_pools):
    pool = sync_pools("flux", 2, hook=CONTROL)
    res = pool.generate(_req(cfg=1.0))
    for rank, c in enumerate(_per_rank(res.stats, CONTROL)):
        flagged = _after_first(c, "job")
        # per forward: float() of the device scalar and a tensor from the Python value
        assert flagged.get("aten.lift_fresh", 0) >= 2 and flagged.get("aten.item", 0) >= 2, \
            (rank, c)


def _attention_sites(path) -> int:
    import json
    cfg = json.loads((path / "transformer" / "config.json").read_text())
    return int(cfg["num_layers"]) + int(cfg.get("num_single_layers", 0))


@pytest.mark.parametrize("world,config", [
    (1, ParallelConfig()),
    (4, ParallelConfig(cfg_parallel=True, dp=2)),
    (4, ParallelConfig(dp=4)),
    (4, ParallelConfig(ulysses=2, ring=2)),
], ids=["1rank", "cfg2xdp2", "dp4", "ulysses2xring2"])
def test_the_chosen_kernel_runs_at_every_degree(sync_pools, model_dir, world, config):
    """Every attention call of every forward goes through the pool's kernel (CPU: SDPA
    without Ring, aten's CPU flash kernel with its LSE under Ring), not diffusers' stock
    processor; `status` names it."""
    pool = sync_pools("flux", world)
    pool.reconfigure(config)
    steps = 2
    res = pool.generate(_req(prompt=["a", "b", "c", "d"], steps=steps))
    want = "cpu-flash-lse" if config.ring > 1 else "sdpa"
    sites = _attention_sites(model_dir("flux"))
    for rank, st in enumerate(res.stats):
        calls = st["hooks"][SPY]
        # CFG in one process runs two forwards a step; under cfg parallel each rank one
        branches = 1 if config.cfg_parallel else 2
        # Ring runs the block kernel once per ring step (each K/V block)
        assert calls == {want: sites * steps * branches * config.ring}, (rank, calls)
    att = pool.status()["attention"]
    assert att["current"] == want, att
