"""`python -m comfyui_xdit bench --quick`: runs end to end, writes the JSON/markdown, and the
communication volume it measures matches the theory (deterministic; timing is never asserted)."""
from __future__ import annotations

import json
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
