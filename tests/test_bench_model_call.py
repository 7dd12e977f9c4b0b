"""`python -m comfyui_xdit bench --model-call --quick` (benchmarks/model_call.py) runs end to
end on 1- and 2-rank CPU pools and writes its JSON / markdown: every layout reports a
per-call overhead beside the transformer's forward, rank 0's breakdown, and the conditioning
crossed the wire once per sampling run (2 keys: cond + uncond), not once per call. Timing
is never asserted (shared CI machines)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_model_call_bench_quick_runs(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "comfyui_xdit", "bench", "--model-call",
                           "--quick", "--out", str(out), "--model-cache", str(tmp_path / "models")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "model_call.json").read_text())
    assert report["x_shape"] == [2, 16, 32, 32] and report["target_ms"] == 2.0
    rows = report["model_call"]
    assert [r["world_size"] for r in rows] == [1, 2, 2]
    for r in rows:
        assert r["calls"] == 3 and r["conds_sent"] == 2, r
        assert r["forward_ms"] > 0 and r["wall_ms"] >= r["forward_ms"], r
        for k in ("overhead_ms", "transport_ms", "rank0_prepare_ms", "rank0_broadcast_ms",
                  "rank0_pre_ms", "rank0_post_ms", "rank0_gather_ms"):
            assert math.isfinite(r[k]), (k, r)
        assert math.isclose(r["overhead_ms"] + r["forward_ms"], r["wall_ms"], rel_tol=0.5)
    # a single replica (1 rank, Ulysses 2) gathers nothing; CFG parallel gathers the rows
    assert rows[0]["rank0_gather_ms"] == 0 and rows[2]["rank0_gather_ms"] == 0
    assert rows[1]["rank0_broadcast_ms"] > 0
    md = (out / "model_call.md").read_text()
    assert "per-call overhead" in md and md.count("| 2 ranks") == 2
