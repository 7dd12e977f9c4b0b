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

import pytest

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
    for r in launch["ranks"]:  # the pool status's launch breakdown, first job included
        assert r["import_s"] <= r["setup_s"] and r["setup_s"] + r["load_s"] <= r["ready_s"]
        assert r["first_job_s"] > 0 and r["prefetch"]["state"]
    assert md.count("first job / peak RSS while loading") == 2
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


# ---- the family sweep (benchmarks/engine_families.py) ------------------------------------------
def _sweep_args(tmp_path, *extra):
    from benchmarks.cli import parser
    return parser().parse_args(["--engine", "--out", str(tmp_path / "out"),
                                "--model-cache", str(tmp_path / "cache"), *extra])


def _by_kind():
    """(an image family, a video family, another family) of the registry, in its order."""
    from benchmarks.engine_families import _families
    fams = _families()
    image = next(f for f in fams.IDS if not fams.family(f).latent.video)
    video = next(f for f in fams.IDS if fams.family(f).latent.video)
    other = next(f for f in fams.IDS if f not in (image, video))
    return fams, image, video, other


def test_engine_families_quick_has_a_row_per_family(tmp_path, monkeypatch):
    """`bench --engine --families A,B,C --quick --compile --budget ...` in this process: an
    image and a video family at tiny widths run diffusers and the eager pool (one row per
    step on both sides: no CFG); a third whose builder refuses the width is listed with the
    reason, not dropped; the compiled stages, given no time, are listed as not run (time
    budget); exit 0 (nothing failed); bench.md has a row for each of the three."""
    import benchmarks.engine_families as ef

    fams, image, video, refused = _by_kind()
    real_build = ef.build

    def build(row, cache, dtype):
        if row["family"] == refused:
            raise ValueError("cannot make this width (test)")
        return real_build(row, cache, dtype)
    monkeypatch.setattr(ef, "build", build)
    monkeypatch.setitem(ef.NEEDS, "pool_compiled", (10 ** 9, 0))
    monkeypatch.setitem(ef.NEEDS, "diffusers_compiled", (10 ** 9, 0))
    args = _sweep_args(tmp_path, "--quick", "--compile", "--budget", "1e6", "--families",
                       f"{image},{video},{refused}")
    assert ef.main_section(args) == 0
    out = tmp_path / "out"
    rep = json.loads((out / "bench.json").read_text())["engine_families"]
    rows = {r["family"]: r for r in rep["rows"]}
    assert list(rows) == [image, video, refused]
    j = rep["job"]
    for fid in (image, video):
        r = rows[fid]
        lat = fams.family(fid).latent
        h, w = j["video"] if lat.video else j["image"]
        side = lat.pixels_per_token
        assert r["tokens"] == lat.latent_frames(j["frames"]) * (h // side) * (w // side)
        assert r["status"] == "ran" and (r["heads"], r["head_dim"]) == (2, 16)
        for stage in ("diffusers", "pool_eager"):
            run = r["runs"][stage]
            assert run["status"] == "ran", (fid, stage, run)
            assert all(math.isfinite(x) for x in run["step_s_all"])
        assert r["runs"]["diffusers"]["rows_per_step"] == 1.0, r["runs"]["diffusers"]
        assert r["runs"]["pool_eager"]["compiles_first_job"] == 0
        assert math.isfinite(r["runs"]["pool_eager"]["vs_diffusers"])
        for stage in ("pool_compiled", "diffusers_compiled"):
            assert r["runs"][stage]["status"] == "not run"
            assert r["runs"][stage]["reason"].startswith("time budget")
    r = rows[refused]
    assert r["status"] == "not run" and "cannot make this width (test)" in r["reason"]
    assert {v["status"] for v in r["runs"].values()} == {"not run"}
    md = (out / "bench.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")][1:]
    assert [line.split("(`")[1].split("`)")[0] for line in table] == [image, video, refused]
    assert "cannot make this width (test)" in md and "time budget" in md


def test_engine_families_plan_lists_every_family(tmp_path, monkeypatch):
    """`--families all --plan`: a row per registry family, nothing built. A family with a
    preset gets its released heads x head_dim, the builder's width-following entries set to
    the released values (never listed as kept small) and its transformer sized on the meta
    device; one without a preset is listed as not run, saying so."""
    import benchmarks.engine_families as ef

    fams, _, _, no_preset = _by_kind()
    real = ef.release
    monkeypatch.setattr(ef, "release", lambda fid: None if fid == no_preset else real(fid))
    rep = ef.run(_sweep_args(tmp_path, "--families", "all", "--plan"), log=lambda m: None)
    rows = {r["family"]: r for r in rep["rows"]}
    assert list(rows) == list(fams.IDS)
    r = rows[no_preset]
    assert r["status"] == "not run" and "no memory-plan preset" in r["reason"]
    planned = [r for r in rows.values() if r["status"] == "planned only (--plan)"]
    assert planned
    for r in planned:
        rel = r["release"]
        assert (r["heads"], r["head_dim"]) == (rel["heads"], rel["head_dim"]), r["family"]
        assert r["width"] == r["heads"] * r["head_dim"] and r["transformer_params"] > 0
        assert r["blocks"] < rel["blocks"] and "model" not in r
        assert all(rel["config"][k] == v for k, v in r["overrides"].items())
        assert not set(r["overrides"]) & set(r["kept_small"])
    # only the small probe builds were written (no model at a released width)
    assert all(f.stat().st_size < 200e6
               for f in (tmp_path / "cache").glob("*/transformer/*.safetensors"))
    md = ef.markdown(rep)
    assert all(f"(`{fid}`)" in md for fid in fams.IDS)


def test_engine_families_failures_exit_1(tmp_path, monkeypatch, capsys):
    """A run that failed makes the sweep exit 1 and is named (stderr and bench.md); one that
    was not run does not."""
    import benchmarks.engine_families as ef

    fams, image, video, _ = _by_kind()
    rep = dict(device="cpu", dtype="fp32", quick=True, compile=False,
               job=dict(ef.QUICK, depth=1, text_tokens=ef.TEXT_TOKENS), rows=[
                   dict(family=image, name=image, video=False, status="ran", runs={
                       "diffusers": dict(status="failed", reason="RuntimeError: boom")}),
                   dict(family=video, name=video, video=True, status="not run",
                        reason="no preset", runs={})])
    monkeypatch.setattr(ef, "run", lambda args, log, write=None: rep)
    assert ef.main_section(_sweep_args(tmp_path, "--families", "all")) == 1
    assert f"error: {image}: diffusers: RuntimeError: boom" in capsys.readouterr().err
    assert ef.failed(rep) == [(image, "diffusers: RuntimeError: boom")]
    rep["rows"] = rep["rows"][1:]
    assert ef.main_section(_sweep_args(tmp_path, "--families", "all")) == 0


def test_engine_families_refuses_unknown_families_and_cpu_at_released_widths(tmp_path):
    from benchmarks.engine_families import family_ids, run
    from comfyui_xdit.errors import ConfigError

    with pytest.raises(ConfigError, match="known: all, "):
        family_ids("no_such_family")
    with pytest.raises(ConfigError, match="needs --device cuda"):
        run(_sweep_args(tmp_path, "--families", "all"), log=lambda m: None)


def test_tiny_model_transformer_entries_and_dtype(tmp_path):
    """The builders' generic knobs the sweep uses: `transformer` entries reach the family's
    transformer class only (text._seeded), enter the cache key only when given, and the
    folder records them; `dtype` saves the weights in that dtype; planned_transformer's meta
    build is the config a real build writes."""
    import torch
    from safetensors import safe_open

    from benchmarks.engine_families import geometry_keys
    from comfyui_xdit.testmodels import text, tiny_model

    arch = tiny_model.ARCHS[0]
    knobs = dict(heads=2, width=32, depth=1)
    plain = tiny_model.resolve_config(arch, **knobs)
    assert "transformer" not in plain and "dtype" not in plain
    assert plain == tiny_model.resolve_config(arch, transformer={}, dtype="fp32", **knobs)
    base = tiny_model.ensure_tiny_model(arch, tmp_path, **knobs)
    cfg = json.loads((base / "transformer" / "config.json").read_text())
    planned, params = tiny_model.planned_transformer(arch, **knobs)
    assert {k: v for k, v in cfg.items() if not k.startswith("_")} == \
        {k: v for k, v in planned.items() if not k.startswith("_")} and params > 0
    keys = geometry_keys(arch, tmp_path)
    assert keys  # some entries follow the width (the heads and head dim at least)
    entries = {k: cfg[k] for k in sorted(keys)}
    made = tiny_model.ensure_tiny_model(arch, tmp_path, transformer=entries, dtype="bf16",
                                        **knobs)
    assert made != base
    info = json.loads((made / "tiny_model.json").read_text())
    assert info["transformer"] == entries and info["dtype"] == "bf16"
    for f in (made / "transformer").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
    old = dict(text.CONFIG_OVERRIDES)
    try:
        text.CONFIG_OVERRIDES["Linear"] = {"bias": False}
        assert text._seeded(0, 1, torch.nn.Linear, 4, 3).bias is None
        assert text._seeded(0, 1, torch.nn.Embedding, 4, 3).weight.shape == (4, 3)
    finally:
        text.CONFIG_OVERRIDES.clear()
        text.CONFIG_OVERRIDES.update(old)


def test_gpu_suite_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_suite.sh")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
