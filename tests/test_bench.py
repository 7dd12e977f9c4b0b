"""`python -m comfyui_xdit bench --quick`: runs end to end, writes the JSON/markdown, and the
communication volume it measures matches the theory (deterministic; timing is never asserted)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ)
    env.pop("XDIT_COMM_METER", None)  # the bench must switch the meter on by itself
    proc = subprocess.run(
        # the default model cache: --quick uses the demo's tiny model, built once and reused
        [sys.executable, "-m", "comfyui_xdit", "bench", "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rep = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert md.strip() and md.strip() in proc.stdout  # the markdown is also printed

    for key in ("machine", "model", "job", "theory", "runs", "speedup_vs_1x1", "bytes_checks",
                "other_traffic", "targets", "wall_s"):
        assert key in rep, key
    assert rep["machine"]["cpu_count"] >= 1 and rep["machine"]["torch"]
    model, job = rep["model"], rep["job"]
    assert model["transformer_params"] > 0 and model["attention_layers"] >= 2
    assert job["image_tokens"] == (job["height"] // 16) * (job["width"] // 16)

    runs = rep["runs"]
    for name, ranks in (("1x1", 1), ("ulysses2", 2), ("ring2", 2), ("cfg_parallel", 2),
                        ("dp2", 2)):
        r = runs[name]
        assert r["ranks"] == ranks and r["threads_per_rank"] == 1
        assert r["step_s_median"] > 0 and len(r["step_s_all"]) == job["timed_jobs"]
        assert len(r["comm_bytes_per_step"]) == ranks
    assert set(rep["speedup_vs_1x1"]) >= {"ulysses2", "ring2", "cfg_parallel", "dp2"}
    # the machine's two-core ceiling is sampled next to the jobs (a measurement: presence only)
    ceiling = rep["two_core_ceiling"]["headline"]
    # (--quick samples may all be discarded on a busy machine: only their shape is checked)
    assert isinstance(ceiling["samples"], list) and isinstance(
        runs["ulysses2"]["speedup_paired_all"], list)

    # attention traffic: Ulysses 4(N-1)/N^2 A and Ring 2(N-1)/N A per layer, within 10%
    checks = {c["run"]: c for c in rep["bytes_checks"]}
    assert checks["ulysses2"]["collective"] == "all_to_all"
    assert checks["ring2"]["collective"] == "p2p"
    for c in checks.values():
        assert len(c["ratio"]) == 2
        for ratio in c["ratio"]:
            assert abs(ratio - 1.0) <= 0.10, c
    assert rep["targets"]["bytes_met"] is True
    # Ring sends no all-to-all bytes, Ulysses no point-to-point bytes
    for per_rank in runs["ring2"]["comm_bytes_per_step"]:
        assert per_rank.get("all_to_all", 0) == 0
    for per_rank in runs["ulysses2"]["comm_bytes_per_step"]:
        assert per_rank.get("p2p", 0) == 0
    # the other traffic: proj_out's all-gather per forward, the stop flag on rank 0 only
    for o in rep["other_traffic"]:
        if o["collective"] == "all_gather":
            assert o["measured_bytes_per_step_per_rank"] == [o["expected_bytes_per_step"]] * 2
        else:
            assert o["measured_bytes_per_step_per_rank"] == [4, 0]

    # the pool section: warm pool vs in-process diffusers, the launch breakdown, per-job
    # overhead (measurements: only their presence and signs are checked)
    pool = rep["pool"]
    assert pool["warm"]["pool_median_s"] > 0 and pool["warm"]["diffusers_median_s"] > 0
    launch = pool["launch"]
    assert [r["rank"] for r in launch["ranks"]] == [0, 1]
    assert all(r["load_peak_rss_mb"] > 0 and r["import_s"] > 0 for r in launch["ranks"])
    assert launch["ready_s"] >= launch["spawn_s"] > 0
    assert len(launch["dispatch_ms"]) == 10
    assert "## Pool overheads" in md


def test_bench_pipefusion_quick(tmp_path):
    """`bench --pipefusion --quick`: the PipeFusion section runs end to end on the tiny model
    and its numbers hold together (deterministic facts only; timing is never asserted)."""
    out = tmp_path / "bench-pf"
    env = dict(os.environ)
    env.pop("XDIT_COMM_METER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "comfyui_xdit", "bench", "--pipefusion", "--quick", "--out",
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert md.strip() and md.strip() in proc.stdout
    pf = rep["pipefusion"]
    model = pf["models"]["flux"]
    total = model["transformer_params"]
    nonblock = total - model["block_params"]

    # weights: one row per layout; every block on exactly one stage, the rest on every stage
    rows = {(m["degree"], m["split"]): m for m in pf["memory"]}
    from comfyui_xdit.config import ParallelConfig
    assert set(rows) >= {(1, "-"), (2, ParallelConfig().pipefusion_split)}
    for m in rows.values():
        n = m["degree"]
        assert len(m["ranks"]) == n and m["total_params"] == total
        assert m["sum_params"] == total + (n - 1) * nonblock
        assert abs(max(r["share"] for r in m["ranks"]) - m["max_share"]) < 1e-12
        assert m["met"] == (m["max_share"] <= 1 / n + 0.05 + 1e-12)
        for r in m["ranks"]:
            assert r["load_peak_rss_mb"] > 0 and r["rss_after_job_mb"] > 0
        if n > 1:
            blocks = [tuple(r["blocks"]) for r in sorted(m["ranks"], key=lambda r: r["stage"])]
            assert blocks[0][0] == 0 and blocks[-1][1] == m["ranks"][0]["n_blocks"]
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert rows[(1, "-")]["ranks"][0]["transformer_params"] == total

    # bytes: isend per stage per step equals the formula (B x (image + text) x hidden x 4 +
    # a 4-byte flag forward, B x image x 64 x 4 back)
    job = pf["job"]
    act = (job["image_tokens"] + job["text_tokens"]) * model["width"] * 4
    comm = {c["run"]: c for c in pf["comm"]}
    assert comm["pipefusion2"]["theory_bytes_per_step"] == [act + 4, job["image_tokens"] * 256]
    assert comm["pipefusion1"]["measured_send_bytes_per_step"] == [0.0]
    for ratio in comm["pipefusion2"]["ratio"]:
        assert abs(ratio - 1.0) <= 0.05
    assert pf["targets"]["bytes_met"] is True
    for name in ("pipefusion1", "pipefusion2"):
        assert pf["timing"][name]["step_s_median"] > 0

    # quality: PSNR finite (or identical), all-synchronous warmup is exact up to fp32 rounding
    q = pf["quality"]
    assert {r["warmup_steps"] for r in q} == set(pf["quality_job"]["warmups"])
    for r in q:
        assert r["identical"] or (r["psnr_db"] is not None and math.isfinite(r["psnr_db"]))
    full = [r for r in q if r["warmup_steps"] >= r["steps"]]
    assert full and all(r["identical"] or r["psnr_db"] > 100 for r in full)
    assert all(r["latent_mse"] < 1e-10 for r in full)
    sc = pf["quality_scale"]  # an unrelated seed: far below the all-synchronous control
    assert sc["psnr_db"] is not None and sc["psnr_db"] < min(r["psnr_db"] or 1e9 for r in full)
    assert "## Quality" in md and "## Bytes sent" in md and "## Transformer weights" in md
