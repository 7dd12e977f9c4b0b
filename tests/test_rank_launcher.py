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
    """The helper killed under a warm pool: its ranks leave (their parent watch), each a
    failure naming the helper's end, the pool says a rank is gone, and the next job starts
    a new helper and succeeds. While they ran, ps showed them as ranks."""
    monkeypatch.setenv(L.ENV, "preload")
    with WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                    threads_per_rank=1) as pool:
        first = pool.generate(GenerationRequest(**REQ))
        helper = pool._procs[0]._helper
        pids = pool.worker_pids()
        for rank, pid in enumerate(pids):  # ps says a rank, not the helper's command
            assert Path(f"/proc/{pid}/comm").read_text().strip() == f"xdit-rank{rank}"
            assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(
                f"xdit rank {rank} (".encode())
        os.kill(helper.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in pool._procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pool.is_running()
        # a failure with its reason, not the parent watch's exit 0
        assert [p.returncode for p in pool._procs] == [L.HELPER_GONE] * 2
        assert all("preloaded launcher" in p.failure and "killed by SIGKILL" in p.failure
                   for p in pool._procs)
        assert "preloaded launcher" in pool._dead()
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


def test_a_helper_rejects_a_message_it_cannot_act_on_and_serves_on(tmp_path):
    """A start without its log file, a message that is not JSON, an unknown op: each gets
    one rejected line, and the helper then starts a rank as usual."""
    import json

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK="0")
    helper = L.Helper(L._helper_env(env), str(ROOT))
    try:
        start = {"op": "start", "argv": ["--help"], "env": env, "cwd": str(ROOT)}
        for raw, why in ((json.dumps(start).encode(), "carries 0 file descriptors"),
                         (b"{not json", "not JSON"),
                         (b'{"op": "fork"}', "unknown message 'fork'")):
            helper._sock.send(raw)
            reply = helper._recv(60.0)
            assert reply["op"] == "rejected" and why in reply["why"], reply
            assert "\n" not in reply["why"]
        log = tmp_path / "rank.log"
        rank = helper.start(["--help"], env, str(log))
        assert rank.wait(timeout=120) == 0 and rank.failure is None
        assert "usage:" in log.read_text()
    finally:
        helper.close()


class _FakeHelper:
    """Stands in for a helper's process: refuses while `broken`, or waits for `release`."""
    broken, starts = True, []
    release: dict = {}

    def __init__(self, env, cwd):
        type(self).starts.append(env["MARK"])
        gate = self.release.get(env["MARK"])
        if gate is not None:
            assert gate.wait(60), "a start was never released"
        if self.broken:
            raise L.Unavailable("2 Python threads run")
        self.gone = False

    def idle(self):
        return False

    def close(self):
        self.gone = True


@pytest.fixture
def fake_helpers(monkeypatch):
    monkeypatch.setattr(L, "Helper", _FakeHelper)
    for name in ("_helpers", "_refused", "_starting"):
        monkeypatch.setattr(L, name, {})
    monkeypatch.setattr(_FakeHelper, "starts", [])
    monkeypatch.setattr(_FakeHelper, "release", {})
    return _FakeHelper


def test_a_refused_environment_tries_a_helper_again_later(fake_helpers, monkeypatch):
    """A refusal holds for RETRY_S (launches meanwhile go straight to plain processes),
    then a launch tries again and, the cause gone, gets a helper."""
    now = [100.0]
    monkeypatch.setattr(L, "_clock", lambda: now[0])
    env = {"MARK": "a", "PATH": "/usr/bin"}
    for _ in range(2):
        with pytest.raises(L.Unavailable, match="2 Python threads run"):
            L._helper_for(env)
    assert fake_helpers.starts == ["a"]  # the second launch did not try
    monkeypatch.setattr(fake_helpers, "broken", False)
    now[0] += L.RETRY_S - 1
    with pytest.raises(L.Unavailable):
        L._helper_for(env)
    now[0] += 1
    helper = L._helper_for(env)
    assert isinstance(helper, fake_helpers) and fake_helpers.starts == ["a", "a"]
    assert L._helper_for(env) is helper and "a" not in str(L._refused)


def test_a_slow_helper_start_holds_up_only_its_own_environment(fake_helpers, monkeypatch):
    """Environment a's helper is still starting: a launch of environment b gets its own
    helper meanwhile; a second launch of a waits for a's start and shares its helper."""
    import threading

    monkeypatch.setattr(fake_helpers, "broken", False)
    slow = threading.Event()
    fake_helpers.release["a"] = slow
    got = {}

    def launch(name, mark):
        got[name] = L._helper_for({"MARK": mark})

    first_a = threading.Thread(target=launch, args=("a1", "a"), daemon=True)
    first_a.start()
    deadline = time.monotonic() + 60
    while fake_helpers.starts != ["a"] and time.monotonic() < deadline:
        time.sleep(0.01)  # until a's start has begun (it then waits for `slow`)
    b = threading.Thread(target=launch, args=("b", "b"), daemon=True)
    b.start()
    b.join(60)
    assert "b" in got and "a1" not in got, "b waited for a's helper to start"
    second_a = threading.Thread(target=launch, args=("a2", "a"), daemon=True)
    second_a.start()
    slow.set()
    first_a.join(60)
    second_a.join(60)
    assert got["a1"] is got["a2"] and fake_helpers.starts == ["a", "b"]
