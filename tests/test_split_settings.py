"""Where the user sets and sees an uneven split: ParallelConfig's `split`, the CLI's
`--split`, the Parallel settings node's `split` input, the memory plan's per-rank activations
by share, `auto`'s measured speeds (comfyui_xdit/client/split_auto.py), and a live 2-rank
pool with one rank made 4x slower (xdit_testhooks/slow_ranks.py), where `auto` gives the
fast rank the larger share and the result still equals the even split's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_a_split_travels_as_weights_and_a_bad_one_is_one_error():
    assert ParallelConfig(ulysses=2).degrees().to_wire().get("split") is None
    assert ParallelConfig(ulysses=2, split="3,1").degrees().split == (3.0, 1.0)
    assert ParallelConfig(ring=2, split="auto").degrees().split == ()  # nothing measured
    assert ParallelConfig(ring=2, split="auto").degrees((2.0, 1.0)).split == (2.0, 1.0)
    for bad, says in (("fast", "must be 'even', 'auto' or 2 positive weights like 1,1"),
                      ("3,2,1", "3 weights for 2 ranks"), ("1,0", "positive numbers")):
        with pytest.raises(ConfigError, match="invalid configuration") as e:
            ParallelConfig(ulysses=2, split=bad).validate()
        assert says in str(e.value)


def test_the_cli_refuses_a_bad_split_in_one_line(model_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "comfyui_xdit", "generate", "--model",
                        str(model_dir("flux")), "--prompt", "a", "--seed", "1", "--steps", "1",
                        "--height", "64", "--width", "64", "--ulysses", "2", "--split", "3,2,1",
                        "--out", str(tmp_path / "x.png")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip() and "torchvision" not in x]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "split '3,2,1'" in lines[0] and "3 weights for 2 ranks" in lines[0]


def test_the_parallel_settings_node_has_a_split_input(model_dir):
    from comfyui_xdit.nodes import settings
    from comfyui_xdit.nodes.handles import loader_keywords, make_handle
    inputs = {i.name: i for i in settings.node_inputs(settings.ParallelSettings)}
    assert inputs["split"].kind == "String" and inputs["split"].kwargs["default"] == "even"
    value = settings.node_value(settings.ParallelSettings, {"ulysses": 2, "split": " 3,1 "})
    assert value.split == "3,1"
    kw = loader_keywords({"model": "x", "parallel": value}) if "parallel" in \
        loader_keywords.__code__.co_varnames else {"ulysses": 2, "split": "3,1"}
    h = make_handle(str(model_dir("flux")), "cpu", "fp32", ulysses=kw.get("ulysses", 2),
                    split=kw.get("split", "3,1"))
    assert h.config_for().degrees().split == (3.0, 1.0)


def test_the_memory_plan_gives_each_rank_its_share_of_activations():
    from comfyui_xdit.planning import memory_arithmetic as m
    from comfyui_xdit.planning.config import EngineOptions
    from comfyui_xdit.planning.model_facts import preset_facts
    facts = preset_facts("wan2.1-t2v-14b")
    job = m.JobSize(height=720, width=1280, frames=81)
    eng = EngineOptions(device="cuda", dtype="bf16")
    even = m.plan(facts, ParallelConfig(ulysses=2), eng, job, [24 << 30, 16 << 30])
    split = m.plan(facts, ParallelConfig(ulysses=2, split="3,1"), eng, job, [24 << 30, 16 << 30])
    a, b = (r.activations for r in split.ranks)
    assert a > even.ranks[0].activations > b  # the larger share holds more tokens
    assert abs((a - b) / (even.ranks[0].activations) - 1.0) < 0.25  # 3:1 of one rank's 2


def test_auto_speeds_are_refined_cached_and_shown(tmp_path, monkeypatch):
    from comfyui_xdit.client import split_auto
    monkeypatch.setenv("XDIT_SPLIT_CACHE", str(tmp_path / "speeds.json"))
    s = split_auto.Speeds(["cpu/rank0", "cpu/rank1"])
    assert s.weights("flux/64x64x1") == ()
    stats = [{"rank": 0, "share": {"speed": 100.0, "own_s": 1.0}},
             {"rank": 1, "share": {"speed": 25.0, "own_s": 2.0}}]
    s.update("flux/64x64x1", stats)
    assert s.weights("flux/64x64x1") == (100.0, 25.0)
    s.update("flux/64x64x1", [dict(x, share={"speed": x["share"]["speed"] * 2, "own_s": 1})
                              for x in stats])
    assert s.weights("flux/64x64x1") == (150.0, 37.5)  # half way to the new measurement
    again = split_auto.Speeds(["cpu/rank0", "cpu/rank1"])  # a new pool: read from the cache
    assert again.weights("flux/64x64x1") == (150.0, 37.5)
    shown = s.status((150.0, 37.5))
    assert [r["share"] for r in shown["ranks"]] == [0.8, 0.2]
    assert "rank 1 (cpu/rank1)" in shown["holds_back"] and "leaving it out" in shown["holds_back"]
    assert json.loads((tmp_path / "speeds.json").read_text())["cpu/rank1"]["flux/64x64x1"] == 37.5


def test_auto_gives_the_slow_rank_less_and_stays_exact(model_dir, tmp_path, monkeypatch):
    from comfyui_xdit import WorkerPool
    monkeypatch.setenv("XDIT_SPLIT_CACHE", str(tmp_path / "speeds.json"))
    monkeypatch.setenv("XDIT_SLOW_RANKS", "1:4,base=1e-3")  # a simulated device
    req = GenerationRequest(prompt=["a red cube"], seed=3, steps=2, height=128, width=128)
    with WorkerPool(str(model_dir("flux")), ParallelConfig(ulysses=2, split="auto"),
                    device="cpu", threads_per_rank=1,
                    worker_hooks=["xdit_testhooks.slow_ranks:install"]) as pool:
        got = pool.generate(req)
        split = pool.status()["split"]
        pool.reconfigure(ParallelConfig(ulysses=2))
        even = pool.generate(req)
    shares = [r["share"] for r in split["ranks"]]
    print("auto shares", shares, split)
    assert split["mode"] == "auto" and shares[0] > shares[1], split
    assert all("speed" in r and "own_s" in r for r in split["ranks"])
    assert got.stats[0].get("share") is not None and even.stats[0].get("share") is None
    assert float((got.samples - even.samples).abs().max()) <= 1e-4


def test_pipefusion_stages_take_blocks_by_share():
    """PipeFusion's "balanced" stages become block counts by the stages' weights (each the
    sum of its ranks'); `auto` and an even split keep the balanced split."""
    c = ParallelConfig(pipefusion=2, split="3,1")
    assert c.stage_split(20) == "15,5"
    assert ParallelConfig(pipefusion=2, ulysses=2, split="1,2,3,2").stage_split(19) == "7,12"
    assert ParallelConfig(pipefusion=2, split="1,1").stage_split(20) == "balanced"
    assert ParallelConfig(pipefusion=2, split="auto").stage_split(20) == "balanced"
    assert ParallelConfig(pipefusion=2, split="3,1", pipefusion_split="10,10").stage_split(20) \
        == "10,10"
    assert c.launch_key() != ParallelConfig(pipefusion=2).launch_key()  # other stages: relaunch


def test_pipefusion_by_share_equals_the_balanced_stages(model_dir):
    """A patch meets the same K/V (this step's for the patches before it, the last step's
    for those after) whichever stage holds a block, so stages by share give the balanced
    stages' result."""
    from comfyui_xdit import WorkerPool
    req = GenerationRequest(prompt=["a red cube"], seed=3, steps=3, height=128, width=128)
    out = {}
    for split in ("even", "3,1"):
        with WorkerPool(str(model_dir("flux")), ParallelConfig(pipefusion=2, split=split,
                                                                 warmup_steps=1),
                        device="cpu", threads_per_rank=1) as pool:
            out[split] = pool.generate(req).samples
            if split != "even":
                stages = [r["stage"]["blocks"] for r in pool.status()["ranks"]]  # [lo, hi)
                assert stages[0][1] - stages[0][0] > stages[1][1] - stages[1][0], stages
    assert float((out["3,1"] - out["even"]).abs().max()) <= 1e-4


def test_pipefusion_auto_chooses_stages_by_measured_speed_and_stays_exact(model_dir, tmp_path,
                                                                          monkeypatch):
    """`split=auto` under PipeFusion: the first job on unmeasured GPUs probes one step on
    the balanced stages, then relaunches with blocks per stage by the measured speeds (the
    slow rank's stage gets fewer); a later pool on the same GPUs reads the cache and
    launches with them at once. At full warmup (every step synchronous) the result equals
    one rank's. Negative control: `auto`'s stages for the same pool with no speeds known
    are the balanced ones."""
    from comfyui_xdit import WorkerPool
    monkeypatch.setenv("XDIT_SPLIT_CACHE", str(tmp_path / "speeds.json"))
    monkeypatch.setenv("XDIT_SLOW_RANKS", "1:4,base=1e-3")  # rank 1: a 4x slower device
    req = GenerationRequest(prompt=["a red cube"], seed=3, steps=2, height=128, width=128)
    config = ParallelConfig(pipefusion=2, split="auto", warmup_steps=2)
    assert config.stage_split(19) == "balanced"
    hooks = ["xdit_testhooks.slow_ranks:install"]
    with WorkerPool(str(model_dir("flux")), ParallelConfig(), device="cpu",
                    threads_per_rank=1) as one:
        want = one.generate(req).samples
    stages = []
    for _ in range(2):
        with WorkerPool(str(model_dir("flux")), config, device="cpu", threads_per_rank=1,
                        worker_hooks=hooks) as pool:
            got = pool.generate(req).samples
            blocks = [r["stage"]["blocks"] for r in pool.status()["ranks"]]  # [lo, hi)
            stages.append(([hi - lo for lo, hi in blocks], pool.launches))
            d = float((got - want).abs().max())
            print("auto stages", blocks, "launches", pool.launches, "max abs vs 1 rank", d)
            assert d <= 1e-4
    (first, launches1), (second, launches2) = stages
    assert first[0] > first[1] and launches1 == 2, stages  # probe, then the relaunch
    assert second[0] > second[1] and launches2 == 1, stages  # from the cache: one launch


def test_the_status_command_shows_each_ranks_share_and_the_rank_holding_back():
    from comfyui_xdit.cli.commands import format_status
    info = {"model": "m", "arch": "flux", "world_size": 2, "state": "idle",
            "ranks": [{"rank": r, "pid": 10 + r, "host": "h", "device": "cpu", "rss_mb": 1.0}
                      for r in range(2)],
            "split": {"mode": "auto", "holds_back": "rank 1 (cpu/rank1) runs at 30% of ...",
                      "ranks": [{"rank": 0, "share": 0.77, "own_s": 1.5},
                                {"rank": 1, "share": 0.23, "own_s": 1.4}]}}
    text = format_status(info)
    assert "share" in text and "0.77" in text and "0.23" in text and "1.4" in text
    assert text.splitlines()[-1].startswith("rank 1 (cpu/rank1) runs at 30%")


def test_the_slow_ranks_hook_reads_factors_and_a_base_delay():
    from xdit_testhooks.slow_ranks import factors
    assert factors("1:2") == {"base": 0.0, 1: 2.0}
    assert factors("1:4, 3:1.5,base=2e-4") == {"base": 2e-4, 1: 4.0, 3: 1.5}
    assert factors("") == {"base": 0.0}


def test_memory_plan_command_plans_each_gpu_with_its_own_memory_and_share():
    r = subprocess.run([sys.executable, "-m", "comfyui_xdit", "memory-plan", "--preset",
                        "wan2.1-t2v-14b", "--ulysses", "2", "--height", "720", "--width", "1280",
                        "--frames", "81", "--gpu-memory", "24,16", "--split", "3,1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    rows = [line.split() for line in r.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [row[-2] for row in rows] == ["24.0", "16.0"], r.stdout + r.stderr
    assert float(rows[0][3]) > float(rows[1][3])  # activations by share: 3:1
    assert "rank 1 (replica) needs" in r.stdout and "of its 16.0 GiB GPU" in r.stdout


def test_the_panel_shows_each_ranks_share_step_time_and_the_slow_rank():
    """The sidebar panel (web/xdit.js) reads /xdit/status: each rank's row carries its share
    of the work, its measured block time and its share of the sharded weights, and the rank
    holding the pool back is named with the suggestion. Negative control: an even pool with
    nothing measured shows none of them."""
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    class FakePool:
        def __init__(self, status):
            self._status, self.model_path, self.launches = status, "/m/flux", 1
            self.config, self.device, self.dtype = ParallelConfig(ulysses=2), "cpu", "fp32"

        def status(self):
            return self._status

    rows = [{"rank": r, "pid": 10 + r, "device": "cpu", "rss_mb": 1.0} for r in range(2)]
    measured = {"state": "idle", "ranks": rows, "sharding": {"shard_split": [3.0, 2.0]},
                "split": {"mode": "auto", "holds_back": "rank 1 (cpu/rank1) runs at 30% of "
                          "the fastest rank's speed: ... leaving it out of the pool may be "
                          "faster still",
                          "ranks": [{"rank": 0, "share": 0.77, "speed": 90.0, "own_s": 1.5},
                                    {"rank": 1, "share": 0.23, "speed": 27.0, "own_s": 1.4}]}}
    reg = PoolRegistry()
    reg._pools = {"a": FakePool(measured),
                  "b": FakePool({"state": "idle", "ranks": rows, "split": {"mode": "even"}})}
    shown, plain = reg.status()["pools"]
    assert [(r["share"], r["step_s"], r["weight_share"]) for r in shown["ranks"]] == \
        [(0.77, 1.5, 0.6), (0.23, 1.4, 0.4)]
    assert shown["slow_rank"].startswith("rank 1 (cpu/rank1)") and \
        "leaving it out" in shown["slow_rank"] and shown["split_mode"] == "auto"
    assert not any(k in r for r in plain["ranks"] for k in ("share", "step_s", "weight_share"))
    assert "slow_rank" not in plain
    js = (ROOT / "web" / "xdit.js").read_text()
    for field in ("r.share", "r.step_s", "r.weight_share", "p.slow_rank"):
        assert field in js, f"the panel does not show {field}"
