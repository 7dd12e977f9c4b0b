"""The preloaded rank launcher (comfyui_xdit/client/rank_launcher.py, workers/runtime/
preloader.py): a rank forked from the helper is the rank a plain process would be (same
environment, session, streams, argv, threads, bit-identical images), a bad launcher name is
refused, a helper that cannot serve or dies gives way to plain processes with a logged line,
and the helper's key leaves out only what no worker module reads at import."""
from __future__ import annotations

import ast
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.client import rank_launcher as L
from comfyui_xdit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
HOOK = "xdit_testhooks.probes:process_facts"
REQ = dict(prompt=["a red cube"], seed=5, steps=2, height=64, width=64,
           max_sequence_length=8, cfg=1.0)


def _facts(pool, res) -> dict:
    out = {}
    for st in res.stats:
        f = dict(st["hooks"][HOOK])
        for k in ("stdout", "stderr"):  # the rank's log, in this pool's own folder
            assert f[k] == os.path.realpath(pool._log_path(st["rank"])), f
            f[k] = os.path.basename(f[k])
        f["argv"] = [a if not a.startswith(pool._tmp) else a[len(pool._tmp):]
                     for a in f["argv"]]
        out[st["rank"]] = f
    return out


def test_forked_ranks_are_the_ranks_plain_processes_are(model_dir, monkeypatch):
    """Two 2-rank pools, one per launcher, one job each: the same image bit for bit, and each
    rank the same process from inside (a variable set only for the pools reaches the ranks;
    own session; /dev/null in, its log out; argv; __main__; torch threads); the forked
    ranks' import floor is (near) nothing, the plain ones' is not."""
    monkeypatch.setenv("XDIT_TEST_MARK", "launch-check")
    got = {}
    for launcher in ("spawn", "preload"):
        monkeypatch.setenv(L.ENV, launcher)
        with WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                        threads_per_rank=1, worker_hooks=[HOOK]) as pool:
            res = pool.generate(GenerationRequest(**REQ))
            assert pool.last_launch["launcher"] == launcher
            forked = [isinstance(p, L.ForkedRank) for p in pool._procs]
            assert forked == [launcher == "preload"] * 2
            got[launcher] = (res.samples, _facts(pool, res), pool.last_launch["ranks"])
    assert torch.equal(got["spawn"][0], got["preload"][0])
    assert got["spawn"][1] == got["preload"][1]
    facts = got["preload"][1]
    for rank, f in facts.items():
        assert f["env"]["RANK"] == str(rank) and f["env"]["OMP_NUM_THREADS"] == "1"
        assert f["env"]["XDIT_TEST_MARK"] == "launch-check"
        assert f["own_session"] and f["stdin"] == os.devnull
        assert f["main"] == "workers.runtime.serve" and f["torch_threads"] == 1
    assert max(r["import_s"] for r in got["preload"][2]) < 0.5
    assert min(r["import_s"] for r in got["spawn"][2]) > 0.5


def test_a_wrong_launcher_name_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv(L.ENV, "zygote")
    pool = WorkerPool(model_dir("flux"), ParallelConfig(), device="cpu", threads_per_rank=1)
    with pytest.raises(ConfigError, match="XDIT_LAUNCHER='zygote': expected one of preload, spawn"):
        pool.generate(GenerationRequest(**REQ))
    assert pool.worker_pids() == [] and pool._tmp is None
    pool.close()


def test_a_helper_that_cannot_serve_gives_way_to_plain_processes(model_dir, monkeypatch,
                                                                 caplog):
    """The helper refuses (here: a Python thread runs in it, started by a sitecustomize
    module, so forking from it would not be safe): one warning line naming why, and the
    pool runs on plain processes (where that idle thread does no harm)."""
    monkeypatch.setenv(L.ENV, "preload")
    # (an environment of its own: a fresh helper starts)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "launcher_refuse"))
    caplog.set_level(logging.WARNING, logger="comfyui_xdit")
    with WorkerPool(model_dir("flux"), ParallelConfig(), device="cpu",
                    threads_per_rank=1) as pool:
        res = pool.generate(GenerationRequest(**REQ))
        assert res.samples.shape[0] == 1
        assert pool.last_launch["launcher"] == "spawn"
        assert not isinstance(pool._procs[0], L.ForkedRank)
    lines = [r.getMessage() for r in caplog.records if "preloaded rank launcher" in r.message]
    assert len(lines) == 1 and "2 Python threads run" in lines[0], lines


def test_a_dead_helper_takes_its_ranks_and_the_next_job_relaunches(model_dir, monkeypatch):
    """The helper killed under a warm pool: its ranks leave (their parent watch), the pool
    says a rank is gone, and the next job starts a new helper and succeeds."""
    monkeypatch.setenv(L.ENV, "preload")
    with WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                    threads_per_rank=1) as pool:
        first = pool.generate(GenerationRequest(**REQ))
        helper = pool._procs[0]._helper
        pids = pool.worker_pids()
        os.kill(helper.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in pool._procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pool.is_running()
        assert [p.returncode for p in pool._procs] == [0, 0]  # their parent watch's exit
        again = pool.generate(GenerationRequest(**REQ))
        assert torch.equal(first.samples, again.samples)
        assert pool.last_launch["launcher"] == "preload"
        assert pool._procs[0]._helper is not helper and not set(pids) & set(pool.worker_pids())


def _module_level_environ_reads(path: Path) -> list:
    """`os.environ` / `os.getenv` read while a module is imported (outside any function)."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, top):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top = False
        if top and isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, top)

    visit(tree, True)
    return out


def test_no_worker_module_reads_the_environment_at_import():
    """The helper imports the worker's modules once for every rank it forks, and one helper
    serves pools whose XDIT_* switches differ: so no worker-side module may read the
    environment at import (a forked rank would see the helper's value, not its own)."""
    files = [p for d in ("workers", "xdit_testhooks") for p in (ROOT / d).rglob("*.py")]
    assert [] == [hit for p in files for hit in _module_level_environ_reads(p)]
    # negative control: a module-level read is caught, one inside a function is not
    probe = ROOT / "tests" / "launcher_refuse" / "env_probe_sample.py"
    assert len(_module_level_environ_reads(probe)) == 1


def test_launches_that_differ_only_in_switches_share_a_helper():
    """A helper per pytest test (PYTEST_CURRENT_TEST) or per XDIT_* switch would cost each
    launch the imports the helper saves; a variable read at import (OMP_NUM_THREADS) still
    gets its own helper (negative control)."""
    from comfyui_xdit.client.rank_launcher import helper_key
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert helper_key(base) == helper_key(dict(base, PYTEST_CURRENT_TEST="t.py::a (call)")) \
        == helper_key(dict(base, XDIT_LAUNCHER="preload"))
    assert helper_key(base) != helper_key(dict(base, OMP_NUM_THREADS="2"))
