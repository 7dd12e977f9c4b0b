"""A host stopped with SIGTERM (how services and containers stop ComfyUI) or ending normally
leaves nothing behind: no `xdit-pool-*` folder with its secret, no worker process, no
traceback. It used to leave the folder (SIGTERM skips atexit) and a BrokenPipe traceback
in rank 0's log.

The host is a fresh Python process with its own TMPDIR, so its pool folder is visible here;
it keeps its pool's rank logs there too, which the test reads when the folder survives."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HOST = textwrap.dedent("""
    import os, sys, time
    from comfyui_xdit import WorkerPool, ParallelConfig, GenerationRequest
    pool = WorkerPool(sys.argv[1], ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1)
    pool.generate(GenerationRequest(prompt=["a cat"], steps=1, height=64, width=64,
                                    max_sequence_length=8, cfg=1.0))
    from comfyui_xdit.client import rank_launcher
    print("HELPERS", *[h.proc.pid for h in rank_launcher._helpers.values()], flush=True)
    print("PIDS", *pool.worker_pids(), flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _run_host(model_dir, tmp_path, how: str):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(model_dir("flux")),
                             "wait" if how == "sigterm" else "exit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True, cwd=str(tmp_path))
    pids, helpers = [], []
    for line in proc.stdout:
        if line.startswith("HELPERS"):
            helpers = [int(p) for p in line.split()[1:]]
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
            break
    assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "no pids"
    assert len(helpers) == 1  # the preloaded launcher's helper (the default) goes too
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the host did not exit within 60 s of SIGTERM")
    return proc.returncode, err, pids + helpers, tmp


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_host_leaves_no_folder_process_or_traceback(model_dir, tmp_path, how):
    code, err, pids, tmp = _run_host(model_dir, tmp_path, how)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith("xdit-pool-"))
    logs = "".join(f.read_text(errors="replace") for d in tmp.glob("xdit-pool-*")
                   for f in d.glob("rank*.log"))
    assert not [p for p in pids if _alive(p)], "workers or the launcher's helper outlived their host"
    assert left == [], f"pool folders left behind: {left}\n{logs[-2000:]}"
    assert "Traceback" not in err, err
    if how == "sigterm":  # the signal still ends the host as it did (killed by SIGTERM)
        assert code == -signal.SIGTERM, (code, err)
    else:
        assert code == 0, err


def test_a_killed_hosts_folder_is_removed_by_the_next_launch(model_dir, tmp_path):
    """SIGKILL leaves the pool folder with its secret (nothing runs in the host); the next
    launch under the same temp dir removes it, and never a live host's folder."""
    from comfyui_xdit.client.pool_folders import make_pool_folder, remove_stale

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(model_dir("flux")), "wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True, cwd=str(tmp_path))
    pids = []
    for line in proc.stdout:
        if line.startswith(("HELPERS", "PIDS")):
            pids += [int(p) for p in line.split()[1:]]
        if line.startswith("PIDS"):
            break
    killed = sorted(p.name for p in tmp.iterdir() if p.name.startswith("xdit-pool-"))
    proc.kill()
    proc.communicate(timeout=60)
    assert len(killed) == 1 and (tmp / killed[0] / "secret").exists()
    deadline = time.monotonic() + 30  # the helper and the workers leave on their own
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids) == 3 and not [p for p in pids if _alive(p)], "outlived a killed host"
    # a live host's folder (this test process's), made the same way, must survive the sweep
    os.environ["TMPDIR"], old = str(tmp), os.environ.get("TMPDIR")
    import tempfile
    tempfile.tempdir = None
    try:
        live = make_pool_folder()
        assert not (tmp / killed[0]).exists(), "the killed host's folder was not removed"
        assert remove_stale(str(tmp)) == [] and os.path.isdir(live)
    finally:
        if old is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None
        import shutil
        shutil.rmtree(live, ignore_errors=True)


def test_a_reused_pid_is_not_taken_for_the_host(tmp_path):
    """A folder whose recorded pid now belongs to another process (a different start time)
    is stale; one without a record is not the pack's and stays."""
    import json
    from comfyui_xdit.client.pool_folders import remove_stale

    reused, foreign = tmp_path / "xdit-pool-reused", tmp_path / "xdit-pool-foreign"
    reused.mkdir()
    foreign.mkdir()
    (reused / "host.json").write_text(json.dumps({"pid": os.getpid(), "started": -1}))
    assert remove_stale(str(tmp_path)) == [str(reused)]
    assert not reused.exists() and foreign.exists()


BALLAST_HOST = textwrap.dedent("""
    import sys, torch
    from comfyui_xdit import WorkerPool, ParallelConfig, GenerationRequest
    ballast = torch.ones(2 ** 29)  # 2 GiB, every page touched: the host's peak
    pool = WorkerPool(sys.argv[1], ParallelConfig(), device="cpu", threads_per_rank=1)
    pool.generate(GenerationRequest(prompt=["a cat"], steps=1, height=64, width=64,
                                    max_sequence_length=8, cfg=1.0))
    print("PEAK", pool.last_launch["ranks"][0]["load_peak_rss_mb"], flush=True)
    pool.close()
""")


def test_worker_peak_is_its_own_not_the_hosts(model_dir, tmp_path):
    """A worker's load_peak_rss_mb is its own (VmHWM after exec): it was getrusage's
    ru_maxrss, which Linux carries across fork and exec, so a tiny pool launched by a host
    that once held 10 GB reported 10.5 GB."""
    out = subprocess.run([sys.executable, "-c", BALLAST_HOST, str(model_dir("flux"))],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    peak = float(next(line.split()[1] for line in out.stdout.splitlines()
                      if line.startswith("PEAK")))
    assert 50 < peak < 1500, peak  # a tiny model's worker, not the 2 GiB host
