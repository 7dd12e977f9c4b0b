"""PipeFusion (workers/parallel/pipefusion/).

With `warmup_steps >= steps` every step is a full synchronous pass through the stages, so the
result must equal the single-process diffusers pipeline (docs/design.md#numerics-rule-4). With fewer
warmup steps the patch pipeline reuses one-step-stale K/V: the result must differ from the
exact one (negative control: proves the pipelined path ran) but stay close. A stage's sp
ranks (ulysses/ring) and cfg-parallel pipelines compute the same stale-K/V algorithm, so
they must reproduce the plain pipelined result. Each rank must hold only its stage's blocks.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
from workers.parallel.pipefusion.schedule import build_schedule, patch_rows, whole_steps
from workers.loading.stages import parse_split, partition

TOL = 1e-4
PROMPTS = ["a photo of a red cat", "a dog on the grass", "blue sky"]


def request(arch, height=128, width=96, batch=2, msl=16, steps=3, seed=5, **kw):
    return GenerationRequest(prompt=PROMPTS[:batch], seed=seed, steps=steps, height=height,
                             width=width, max_sequence_length=msl,
                             cfg=kw.pop("cfg", 3.0 if arch == "sd3" else 1.0),
                             negative_prompt="ugly", **kw)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Tiny models with 4 blocks per list: enough blocks for 4 stages."""
    root = tmp_path_factory.mktemp("deep")
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = ensure_tiny_model(arch, root / arch, depth=4)
        return made[arch]
    return get


@pytest.fixture(scope="module")
def pf_pools():
    """Warm PipeFusion pools by (model, launch layout); at most two alive (memory)."""
    from conftest import LayoutPools
    cache = LayoutPools(keep=2)
    yield cache.get
    cache.close()


# ---- the stage split -----------------------------------------------------------------
def test_partition_is_contiguous_and_minimises_the_largest_stage():
    costs = [5, 1, 1, 1, 1, 1, 5, 1]
    parts = partition(costs, 3)
    assert parts[0][0] == 0 and parts[-1][1] == len(costs)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(parts, parts[1:]))
    worst = max(sum(costs[a:b]) for a, b in parts)
    # brute force over every contiguous 3-way split
    best = min(max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
               for i in range(1, 7) for j in range(i + 1, 8))
    assert worst == best == 6
    with pytest.raises(ValueError, match="pipefusion <= 8"):
        partition(costs, 9)


REAL_FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))


@pytest.mark.parametrize("stages", [2, 4])
def test_real_flux_split_meets_the_memory_bound(stages):
    """On FLUX.1's real dimensions (built on the meta device: no weights), the default
    "balanced" split keeps every stage's weights <= 1/N + 5% of the transformer; "compute"
    balances the work but overloads stage 0 (double blocks weigh ~2.4x a single block)."""
    import diffusers

    from workers.loading.stages import block_cost, model_blocks, plan_stages
    with torch.device("meta"):
        tr = diffusers.FluxTransformer2DModel(**REAL_FLUX)
    lists = ("transformer_blocks", "single_transformer_blocks")
    blocks = model_blocks(tr, lists)
    total = sum(p.numel() for p in tr.parameters())
    shared = total - sum(block_cost(b, "memory") for _, _, b in blocks)

    def shares(split, kind):
        ranges = plan_stages(tr, lists, 0, stages, split).ranges
        cost = [block_cost(b, kind) for _, _, b in blocks]
        whole = (total if kind == "memory" else sum(cost))
        return [((shared if kind == "memory" else 0) + sum(cost[a:b])) / whole
                for a, b in ranges]

    assert max(shares("balanced", "memory")) <= 1 / stages + 0.05
    assert max(shares("compute", "memory")) > 1 / stages + 0.05
    assert max(shares("compute", "compute")) < 1 / stages + 0.02
    assert max(shares("memory", "memory")) <= max(shares("balanced", "memory"))


def test_explicit_split_and_its_errors():
    assert parse_split("3,1", 4, 2) == [(0, 3), (3, 4)]
    assert parse_split("memory", 4, 2) == "memory"
    assert parse_split("balanced", 4, 2) == "balanced"
    for bad in ("3,2", "4,0", "x,y", "1,1,2"):
        with pytest.raises(ValueError, match="pipefusion split"):
            parse_split(bad, 4, 2)


def test_patch_rows_cover_the_image_once():
    for rows, n in ((8, 2), (9, 4), (5, 5)):
        bands = patch_rows(rows, n)
        assert bands[0][0] == 0 and bands[-1][1] == rows and len(bands) == n
        assert all(a[1] == b[0] for a, b in zip(bands, bands[1:]))


def test_warmup_restarts_where_another_expert_takes_over():
    """Wan 2.2: the low-noise expert's K/V caches are empty at the switch, so its first
    warmup steps run the whole image again; every micro still starts only once the rows it
    needs from the previous step are back on stage 0."""
    assert whole_steps(6, 1) == {0}
    assert whole_steps(6, 1, [3]) == {0, 3}
    assert whole_steps(6, 2, [3]) == {0, 1, 3, 4}
    assert whole_steps(6, 2, [5]) == {0, 1, 5}
    assert whole_steps(6, 0, [3]) == set()
    sched = build_schedule(6, 2, 6, [0, 1], warmup=1, patches=3, restarts=[3])
    per_step = {}
    for m in sched.micros:
        per_step.setdefault(m.step, set()).add(m.rows)
    assert per_step[0] == per_step[3] == {(0, 6)}
    assert per_step[1] == per_step[2] == per_step[4] == {(0, 2), (2, 4), (4, 6)}
    back = {}
    for m, t in zip(sched.micros, sched.start):
        if m.step > 0:
            prev = [back[k] for k in back if k[0] == m.step - 1
                    and k[1][0] < m.rows[1] and m.rows[0] < k[1][1]]
            assert t >= max(prev), m
        if m.finishes:
            back[(m.step, m.rows)] = t + sched.stages


def test_config_validation_names_the_problem():
    with pytest.raises(ConfigError, match="pipefusion_split 'a,b'"):
        ParallelConfig(pipefusion=2, pipefusion_split="a,b").validate()
    with pytest.raises(ConfigError, match="pipeline_patches must be"):
        ParallelConfig(pipefusion=2, pipeline_patches=0).validate()
    with pytest.raises(ConfigError, match="warmup_steps must be"):
        ParallelConfig(pipefusion=2, warmup_steps=-1).validate()
    # 2 token rows of 2 tokens per patch cannot feed ulysses 4
    with pytest.raises(ConfigError, match="PipeFusion patch of 1 token rows x 2"):
        ParallelConfig(pipefusion=2, ulysses=4).validate(
            None, GenerationRequest(prompt=["x"], height=32, width=32))
    assert ParallelConfig(pipefusion=2).launch_key() != ParallelConfig(pipefusion=2, ulysses=2,
                                                                      world_size=4).launch_key()


# ---- exactness with full warmup, staleness without --------------------------------------
@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_pipefusion2_exact_with_full_warmup_and_close_without(arch, model_dir, oracle,
                                                              pf_pools):
    path = model_dir(arch)
    pool = pf_pools(path, ParallelConfig(pipefusion=2, warmup_steps=3))
    for h, w, batch, msl in ((128, 96, 2, 16), (144, 112, 1, 11), (112, 144, 3, 7)):
        req = request(arch, h, w, batch, msl)
        ref = oracle(arch, req)
        got = pool.generate(req).samples
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= TOL, (h, w, batch)
    pids = pool.worker_pids()
    # the patch pipeline (1 warmup step of 3): stale K/V, so not exact, but close
    req = request(arch, 128, 96, 2, 16)
    ref = oracle(arch, req)
    for warmup, patches in ((1, None), (0, 3)):
        pool.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=warmup,
                                        pipeline_patches=patches))
        got = pool.generate(req).samples
        diff = (got - ref).abs().max().item()
        assert 1e-4 < diff < 0.5 * ref.abs().max().item(), (warmup, diff)
        assert torch.isfinite(got).all()
    assert pool.worker_pids() == pids  # warmup/patches are per job: no relaunch


def test_stages_hold_only_their_blocks(model_dir, pf_pools):
    """Each rank's transformer has exactly its stage's block weights plus the shared
    embedders/final layers; the stages' blocks add up to the whole model."""
    import diffusers
    path = model_dir("flux")
    full = diffusers.FluxTransformer2DModel.from_pretrained(path, subfolder="transformer")
    blocks = list(full.transformer_blocks) + list(full.single_transformer_blocks)
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum(p.numel() for p in full.parameters())
    shared = total - sum(block_params)
    pool = pf_pools(path, ParallelConfig(pipefusion=2, warmup_steps=3))
    pool.generate(request("flux", batch=1))
    ranks = pool.status()["ranks"]
    spans = [tuple(r["stage"]["blocks"]) for r in ranks]
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == len(blocks)
    for r, (a, b) in zip(ranks, spans):
        assert r["transformer_params"] == shared + sum(block_params[a:b])
        assert r["transformer_params"] < total


def test_back_to_back_jobs_with_other_shapes(model_dir, pf_pools):
    """K/V caches and pipeline buffers follow each job's shapes (text length, size, batch)."""
    pool = pf_pools(model_dir("flux"), ParallelConfig(pipefusion=2, warmup_steps=1))
    pool.generate(request("flux", steps=1))
    pids = pool.worker_pids()
    for h, w, batch, msl in ((64, 64, 1, 8), (96, 128, 2, 16), (64, 64, 1, 12),
                             (160, 48, 3, 5)):
        out = pool.generate(request("flux", h, w, batch, msl, steps=2)).samples
        assert out.shape == (batch, 16, h // 8, w // 8)
        assert torch.isfinite(out).all()
    assert pool.worker_pids() == pids


def test_cancel_mid_job_keeps_the_pool(model_dir, pf_pools):
    from comfyui_xdit.client.pool import JobCancelled
    pool = pf_pools(model_dir("flux"), ParallelConfig(pipefusion=2, warmup_steps=1))
    pool.generate(request("flux", steps=1))
    pids = pool.worker_pids()
    seen = []

    def on_event(ev):
        if "step" in ev:
            seen.append(ev["step"])
            if ev["step"] == 2:
                pool.cancel()
    # 100 steps: the workers run ahead of the host, so the job must outlast the host's lag on
    # a loaded machine (8 steps finished before the cancel landed once, in CI)
    with pytest.raises(JobCancelled):
        pool.generate(request("flux", steps=100), on_event=on_event)
    assert seen and 2 <= max(seen) < 100
    out = pool.generate(request("flux", steps=2)).samples
    assert torch.isfinite(out).all() and pool.worker_pids() == pids


# ---- 4 ranks: degree 4 and the mixed layouts ------------------------------------------------
@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_pipefusion4_exact_with_full_warmup(arch, deep_model, oracle, pf_pools):
    path = deep_model(arch)
    pool = pf_pools(path, ParallelConfig(pipefusion=4, warmup_steps=3))
    for h, w, batch, msl in ((128, 96, 2, 16), (144, 112, 1, 11)):
        req = request(arch, h, w, batch, msl)
        got = pool.generate(req).samples
        assert (got - oracle(arch, req, path)).abs().max().item() <= TOL, (h, w)
    assert sorted(r["stage"]["index"] for r in pool.status()["ranks"]) == [0, 1, 2, 3]
    req = request(arch, 128, 96, 2, 16)
    pool.reconfigure(ParallelConfig(pipefusion=4, warmup_steps=1))
    diff = (pool.generate(req).samples - oracle(arch, req, path)).abs().max().item()
    assert diff > 1e-4


@pytest.mark.parametrize("arch,inner", [("flux", dict(ulysses=2)), ("flux", dict(ring=2)),
                                        ("sd3", dict(cfg_parallel=True)), ("flux", dict(dp=2))])
def test_mixed_layouts_match_plain_pipefusion(arch, inner, model_dir, oracle, pf_pools):
    """pipefusion 2 x (ulysses 2 | ring 2 | cfg 2 | dp 2): exact with full warmup, and the
    pipelined result equals pipefusion 2 alone (the same stale-K/V algorithm)."""
    path = model_dir(arch)
    req = request(arch, 144, 112, 2, 11)
    pool = pf_pools(path, ParallelConfig(pipefusion=2, warmup_steps=3, **inner))
    got = pool.generate(req).samples
    assert len(got) == 2
    assert (got - oracle(arch, req)).abs().max().item() <= TOL
    pool.reconfigure(ParallelConfig(pipefusion=2, warmup_steps=1, **inner))
    mixed = pool.generate(req).samples
    plain_pool = pf_pools(path, ParallelConfig(pipefusion=2, warmup_steps=1))
    plain = plain_pool.generate(req).samples
    assert (mixed - plain).abs().max().item() <= 1e-5
    assert (mixed - oracle(arch, req)).abs().max().item() > 1e-4


def test_sd35_blocks_ulysses_and_pipefusion_exact(tmp_path_factory, oracle, pf_pools):
    """SD3.5's QK RMS norm and image-only second attention (its own K/V cache under
    PipeFusion) through both parallel paths."""
    path = ensure_tiny_model("sd3", tmp_path_factory.mktemp("sd35"), sd35=True)
    req = request("sd3", 144, 112, 2, 11)
    ref = oracle("sd3", req, path)
    for config in (ParallelConfig(ulysses=2), ParallelConfig(pipefusion=2, warmup_steps=3)):
        got = pf_pools(path, config).generate(req).samples
        assert (got - ref).abs().max().item() <= TOL, config.describe()


def test_degree_and_split_are_checked_against_the_model(model_dir):
    from comfyui_xdit.planning.model_info import read_model_info
    info = read_model_info(model_dir("flux"))
    assert info.blocks == 4  # 2 double + 2 single
    with pytest.raises(ConfigError, match="pipefusion 5 exceeds the model's 4 transformer blocks"):
        ParallelConfig(pipefusion=5).validate(info)
    with pytest.raises(ConfigError, match="covers 6 blocks but the model has 4"):
        ParallelConfig(pipefusion=2, pipefusion_split="3,3").validate(info)
    ParallelConfig(pipefusion=2, pipefusion_split="3,1").validate(info)
