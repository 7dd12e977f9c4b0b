"""The benchmarks (benchmarks/, outside the product package): `python -m comfyui_xdit bench
--quick` and `python -m benchmarks --pipefusion --quick` run end to end, write the
JSON/markdown, and the communication volume they measure (benchmarks/comm_meter.py, a worker
hook) matches the theory (deterministic; timing is never asserted). Plus: the product package
does not import the benchmarks, and the meter counts the data plane only, stacked with another
hook that wraps the same torch.distributed functions, in either order."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METER = "benchmarks.comm_meter:install"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_product_package_does_not_import_benchmarks():
    code = ("import sys; import comfyui_xdit, comfyui_xdit.cli.commands, comfyui_xdit.client.pool, "
            "comfyui_xdit.cli.demo, workers.runtime.serve\n"
            "bad = sorted(m for m in sys.modules if m == 'benchmarks' or "
            "m.startswith('benchmarks.'))\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("bench.py", "bench_pipefusion.py", "bench_pool.py"):
        assert not (ROOT / "comfyui_xdit" / name).exists(), name
    assert not (ROOT / "workers" / "comm_meter.py").exists()


_METER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def other_hook(ctx):
        # stands in for another hook wrapping the same functions (the NCCL-rules emulation):
        # plain wrappers (no __wrapped__), a P2POp that unwraps them, a batch_isend_irecv
        orig = {n: getattr(dist, n) for n in ("isend", "irecv", "P2POp", "batch_isend_irecv")}
        def isend(*a, **k):
            return orig["isend"](*a, **k)
        def irecv(*a, **k):
            return orig["irecv"](*a, **k)
        mine = {isend: orig["isend"], irecv: orig["irecv"]}
        base = orig["P2POp"]
        class P2POp(base):
            def __new__(cls, op, *a, **k):
                return base.__new__(cls, mine.get(op, op), *a, **k)
            def __init__(self, op, *a, **k):
                super().__init__(mine.get(op, op), *a, **k)
        def batch_isend_irecv(ops):
            for op in ops:
                op.op = mine.get(op.op, op.op)
            return orig["batch_isend_irecv"](ops)
        dist.isend, dist.irecv, dist.P2POp = isend, irecv, P2POp
        dist.batch_isend_irecv = batch_isend_irecv

    def rank_main(rank, specs, port, q):
        import __main__
        __main__.other_hook = other_hook
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from workers.runtime.hooks import HookContext, install, job_started, job_stats
        from workers.parallel.p2p import exchange
        from workers.parallel.topology import init_world
        hooks = install(specs, HookContext(rank=rank, world=2, device="cpu"))
        w = init_world(rank, 2, torch.device("cpu"))
        cpu, peer = torch.device("cpu"), 1 - rank
        exchange([(torch.zeros(7), peer)], [((7,), torch.float32, peer)], w.data, cpu)
        job_started(hooks)  # resets: the exchange above is not counted
        exchange([(torch.zeros(10), peer)], [((10,), torch.float32, peer)], w.data, cpu)
        if rank == 0:  # sends only, on one side
            exchange([(torch.zeros(3), 1)], [], w.data, cpu)
            dist.isend(torch.zeros(5), 1).wait()
        else:
            exchange([], [((3,), torch.float32, 0)], w.data, cpu)
            dist.irecv(torch.zeros(5), 0).wait()
        dist.broadcast(torch.zeros(2), src=0, group=w.control)  # control plane: skipped
        dist.all_gather([torch.zeros(4) for _ in range(2)], torch.zeros(4), group=w.control)
        dist.broadcast(torch.zeros(6), src=0)
        dist.all_gather([torch.zeros(4) for _ in range(2)], torch.zeros(4))
        dist.all_to_all_single(torch.zeros(8), torch.zeros(8))
        q.put((rank, job_stats(hooks)["%(meter)s"]["bytes"]))
        dist.destroy_process_group()

    if __name__ == "__main__":
        import socket
        ctx = mp.get_context("spawn")
        out = {}
        for name, specs in (("meter_last", ["__main__:other_hook", "%(meter)s"]),
                            ("meter_first", ["%(meter)s", "__main__:other_hook"])):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            q = ctx.Queue()
            ps = [ctx.Process(target=rank_main, args=(r, specs, port, q)) for r in range(2)]
            for p in ps:
                p.start()
            got = dict(q.get(timeout=120) for _ in ps)
            for p in ps:
                p.join(60)
            out[name] = [got[0], got[1]]
        print(json.dumps(out))
""") % {"meter": METER}


def test_comm_meter_hook_counts_data_plane_under_another_hook(tmp_path):
    script = tmp_path / "meter_check.py"
    script.write_text(_METER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # fp32: p2p = the grouped sends (10, +3 on rank 0), send = plain isend (5), broadcast on
    # its source only (6), all_gather one shard to the peer (4), all_to_all half of 8;
    # nothing on the control plane, nothing received
    want = [{"p2p": 52, "send": 20, "broadcast": 24, "all_gather": 16, "all_to_all": 16},
            {"p2p": 40, "all_gather": 16, "all_to_all": 16}]
    assert got == {"meter_last": want, "meter_first": want}


def test_bench_quick(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        # the default model cache: --quick uses the demo's tiny model, built once and reused;
        # through the product CLI's thin entry (it imports benchmarks only for `bench`)
        [sys.executable, "-m", "comfyui_xdit", "bench", "--quick", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
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
        # the meter's numbers arrive through the worker hook's stats, one per rank
        assert all(set(c) >= {"bytes", "calls", "total_bytes"} for c in r["jobs"][-1]["comm"])
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
    # the other traffic: proj_out's all-gather per forward; no broadcast on the data plane
    # (the stop flag goes over the control plane, which the meter skips)
    kinds = set()
    for o in rep["other_traffic"]:
        kinds.add(o["collective"])
        if o["collective"] == "all_gather":
            assert o["expected_bytes_per_step"] > 0
            assert o["measured_bytes_per_step_per_rank"] == [o["expected_bytes_per_step"]] * 2
        else:
            assert o["expected_bytes_per_step"] == 0
            assert o["measured_bytes_per_step_per_rank"] == [0, 0]
    assert kinds == {"all_gather", "broadcast"}
    for r in runs.values():  # a 1-rank pool sends nothing
        if r["ranks"] == 1:
            assert r["comm_bytes_per_step"] == [{}]

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
    """`python -m benchmarks --pipefusion --quick`: the PipeFusion section runs end to end on
    the tiny model and its numbers hold together (deterministic facts only; timing is never
    asserted)."""
    out = tmp_path / "bench-pf"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--pipefusion", "--quick", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
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
    from comfyui_xdit.planning.config import ParallelConfig
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

    # bytes: point-to-point ("send" + "p2p") per stage per step equals the formula
    # (B x (image + text) x hidden x 4 forward, B x image x 64 x 4 back); nothing else
    job = pf["job"]
    act = (job["image_tokens"] + job["text_tokens"]) * model["width"] * 4
    comm = {c["run"]: c for c in pf["comm"]}
    assert comm["pipefusion2"]["theory_bytes_per_step"] == [act, job["image_tokens"] * 256]
    assert sorted(comm["pipefusion2"]["kinds"]) == ["p2p", "send"]
    assert comm["pipefusion1"]["measured_bytes_per_step"] == [0.0]
    assert comm["pipefusion2"]["other_bytes_per_step"] == [{}, {}]
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


def test_flux_dev_preset_has_flux1_dev_dimensions():
    """The GPU preset is FLUX.1-dev's transformer (19 double + 38 single blocks, 24 heads x
    128, 11.9B parameters), counted on the meta device: nothing is allocated."""
    from benchmarks.engine import PRESETS, meta_params

    p = PRESETS["flux-dev"]
    assert (p["double"], p["single"], p["heads"], p["head_dim"]) == (19, 38, 24, 128)
    assert (p["height"], p["width"], p["text"], p["dtype"]) == (1024, 1024, 512, "bf16")
    n = meta_params({k: p[k] for k in ("heads", "head_dim", "double", "single", "text_dim",
                                       "pooled_dim")})
    assert 11.85e9 < n < 11.95e9, n


def test_bench_engine_quick_compile(tmp_path):
    """`bench --engine --quick --compile --ranks 1`: in-process diffusers (eager and
    compile_repeated_blocks) and a 1-rank pool eager and compiled, on a tiny model made by the
    same meta-device builder as the flux-dev preset; the report has every run, the compiled
    pool compiled during its warm-up job (and said so) and never while timed."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "comfyui_xdit", "bench", "--engine", "--quick", "--compile",
         "--ranks", "1", "--out", str(out), "--model-cache", str(tmp_path / "cache")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())["engine"]
    runs = {r["name"]: r for r in rep["runs"]}
    assert sorted(runs) == ["diffusers", "diffusers_compiled", "pool1_compiled", "pool1_eager"]
    for r in runs.values():
        assert all(math.isfinite(x) for x in r["step_s_all"]), r
        assert math.isfinite(r["vs_diffusers"])
    assert runs["diffusers"]["vs_diffusers"] == 1.0
    comp, eager = runs["pool1_compiled"], runs["pool1_eager"]
    assert comp["compiles_first_job"] > 0 and comp["compile_s"] > 0
    assert comp["compiling_events"] > 0 and comp["compiles_while_timed"] == 0
    assert eager["compiles_first_job"] == 0 and eager["compiling_events"] == 0
    m = rep["model"]
    assert (m["double_blocks"], m["single_blocks"], m["heads"], m["head_dim"]) == (1, 1, 2, 16)
    # the builder wrote the real widths into the configs it saved
    folder = Path(m["path"])
    tcfg = json.loads((folder / "transformer" / "config.json").read_text())
    assert (tcfg["joint_attention_dim"], tcfg["pooled_projection_dim"]) == (64, 32)
    assert json.loads((folder / "text_encoder_2" / "config.json").read_text())["d_model"] == 64
    assert "pool1_compiled" in (out / "bench.md").read_text()


def test_bench_engine_refuses_flux_dev_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--engine", "--preset", "flux-dev",
         "--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs --device cuda" in proc.stderr.strip().splitlines()[-1]


def test_bench_cache_quick(tmp_path):
    """`bench --cache --quick`: the step-cache section end to end on the tiny model (one
    threshold, 1 rank), its report and table; cache-dit's rows when it is installed."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "comfyui_xdit", "bench", "--cache", "--quick", "--out", str(out),
         "--model-cache", str(tmp_path / "cache")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())["step_cache"]
    ours = [r for r in rep["rows"] if r["impl"] == "ours"]
    assert [(r["ranks"], r["threshold"]) for r in ours] == [(1, 0.5)]
    assert ours[0]["time_s"] > 0 and 0 <= ours[0]["skipped"] <= rep["job"]["steps"]
    assert ("cache-dit" in {r["impl"] for r in rep["rows"]}) == rep["cache_dit"]
    assert "| ours | 1 | 0.5 |" in (out / "bench.md").read_text()


def test_bench_video_quick(tmp_path):
    """`bench --video --quick`: the video section end to end on the default tiny Wan (64x64
    x 5 frames = 32 video tokens); the bytes each rank sends per step equal the memory plan's
    step_traffic for Ulysses 2, Ring 2 and CFG parallel (deterministic; timing never asserted)."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "comfyui_xdit", "bench", "--video", "--quick", "--out", str(out),
         "--model-cache", str(tmp_path / "models")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((out / "bench.json").read_text())["video"]
    assert rep["job"]["video_tokens"] == 2 * 4 * 4  # (5 - 1) / 4 + 1 latent frames x 4 x 4
    assert {c["run"] for c in rep["checks"]} == {"ulysses2", "ring2", "cfg_parallel"}
    for c in rep["checks"]:
        assert all(abs(x - 1.0) < 1e-9 for x in c["ratio"]), c  # exact: no tolerance needed
    assert "Within 10% of theory: yes" in (out / "bench.md").read_text()
