"""A pool started by torchrun (`python -m comfyui_xdit serve`) and attached to by address and
secret gives the local pool's result; `status` and `generate --attach` work against it."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig
from comfyui_xdit.client.pool import PoolError, WorkerPool

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def torchrun_pool(model_dir, tmp_path_factory):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    tmp = tmp_path_factory.mktemp("torchrun")
    secret = secrets.token_hex(32)
    (tmp / "secret").write_text(secret)
    addr = tmp / "address"
    proc = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "comfyui_xdit", "serve",
         "--model", str(model_dir("flux")), "--device", "cpu", "--dtype", "fp32",
         "--threads-per-rank", "1", "--secret-file", str(tmp / "secret"),
         "--address-file", str(addr)],
        cwd=ROOT, stdout=open(tmp / "log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    deadline = time.monotonic() + 180
    while not addr.exists():
        assert proc.poll() is None, (tmp / "log").read_text()[-3000:]
        assert time.monotonic() < deadline, "torchrun pool did not start"
        time.sleep(0.2)
    yield addr.read_text().strip(), secret, tmp / "secret"
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def test_attached_pool_matches_local(torchrun_pool, pools):
    address, secret, _ = torchrun_pool
    req = GenerationRequest(prompt=["a red cat", "a dog"], seed=9, steps=2, height=96,
                            width=80, max_sequence_length=16)
    local = pools("flux", 2)
    attached = WorkerPool.attach(address, secret, ParallelConfig(ulysses=2))
    try:
        for config in (ParallelConfig(ulysses=2), ParallelConfig(ring=2)):
            local.reconfigure(config)
            attached.reconfigure(config)
            want = local.generate(req).samples
            got = attached.generate(req).samples
            assert (got - want).abs().max().item() <= 1e-6
        status = attached.status()
        assert status["state"] == "idle" and status["world_size"] == 2
        assert [r["rank"] for r in status["ranks"]] == [0, 1]
        assert len(set(attached.worker_pids())) == 2
        # one host at a time: a second one is told the pool is in use, not left hanging
        with pytest.raises(PoolError, match="in use"):
            WorkerPool.attach(address, secret, ParallelConfig(ulysses=2)).model_info
    finally:
        attached.close()
    # a configuration of the wrong size is refused with the pool's real size
    with pytest.raises(ConfigError, match="has 2 ranks"):
        WorkerPool.attach(address, secret, ParallelConfig(ulysses=4)).model_info
    # closing an attached client leaves the external pool serving
    again = WorkerPool.attach(address, secret, ParallelConfig(ulysses=2))
    try:
        assert again.generate(req).samples.shape == (2, 16, 12, 10)
    finally:
        again.close()


def test_status_and_generate_cli_attach(torchrun_pool, model_dir, tmp_path):
    address, _, secret_file = torchrun_pool
    run = lambda *a: subprocess.run([sys.executable, "-m", "comfyui_xdit", *map(str, a)],
                                    cwd=ROOT, capture_output=True, text=True, timeout=120)
    r = run("status", "--attach", address, "--secret-file", secret_file)
    assert r.returncode == 0, r.stderr
    assert "world size: 2" in r.stdout and "state: idle" in r.stdout
    r = run("generate", "--attach", address, "--secret-file", secret_file, "--model",
            model_dir("flux"), "--prompt", "a cat", "--seed", "1", "--steps", "2",
            "--height", "64", "--width", "64", "--ulysses", "2",
            "--out", tmp_path / "x.safetensors")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["config"].endswith("ulysses 2 x ring 1")
    bad = tmp_path / "bad"
    bad.write_text(secrets.token_hex(32))
    r = run("status", "--attach", address, "--secret-file", bad)
    assert r.returncode != 0 and "secret" in r.stderr.strip().splitlines()[-1]
