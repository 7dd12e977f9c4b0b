"""Pool behaviour beyond the basics: data-parallel images streamed as each replica finishes,
cancel under dp, a hung worker caught by the timeout, loading state and load memory.

Nothing here asserts on wall time or polls for a state that may pass unseen: jobs that are
stopped are far longer than any lag of the host, and the loading state is held open by a
worker hook until the test has seen it."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.client.pool import JobCancelled, PoolError, WorkerPool

REQ3 = GenerationRequest(prompt=["a red cat", "a dog", "blue sky"], seed=11, steps=4,
                         height=80, width=64, max_sequence_length=12)


def test_dp_streams_each_image_and_survives_cancel(pools):
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(dp=2))
    images, steps = {}, []

    def on_event(e):
        if "image_index" in e:
            assert e["image_index"] not in images
            images[e["image_index"]] = e["samples"]
        else:
            steps.append(e["step"])

    result = pool.generate(REQ3, on_event=on_event)
    assert sorted(images) == [0, 1, 2]
    for i, s in images.items():
        assert s.shape == (1, 16, 10, 8) and torch.equal(s[0], result.samples[i])
    assert steps == [1, 2, 3, 4]

    # cancel mid-job under dp, then the next dp job must still be exact: no receive posted
    # for the cancelled job may swallow the next job's images
    # (1000 steps: the workers run ahead of the host, so the job must outlast any lag of
    # the host on a shared machine; cancelled, it ends within a step or two)
    long = GenerationRequest(**{**REQ3.__dict__, "steps": 1000})
    seen = []

    def cancel_at_2(e):
        seen.append(e)
        if e.get("step") == 2:
            pool.cancel()

    with pytest.raises(JobCancelled):
        pool.generate(long, on_event=cancel_at_2)
    assert 2 <= len([e for e in seen if "step" in e]) < long.steps
    again = pool.generate(REQ3)
    assert torch.equal(again.samples, result.samples)


def test_hung_worker_is_caught_by_the_timeout(model_dir):
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1, step_timeout=4.0)
    try:
        pool.generate(GenerationRequest(prompt=["x"], steps=1, height=64, width=64,
                                        max_sequence_length=8))
        pids = pool.worker_pids()
        stopped = threading.Event()

        def freeze(e):
            if e.get("step") == 1 and not stopped.is_set():
                os.kill(pids[1], signal.SIGSTOP)  # alive but never answers
                stopped.set()

        # the error is the step timeout's own (no other path gives this message)
        with pytest.raises(PoolError, match="no answer from the pool"):
            pool.generate(GenerationRequest(prompt=["x"], steps=1000, height=64, width=64,
                                            max_sequence_length=8), on_event=freeze)
        for pid in pids:  # stopped workers are killed too (waits for it; bounds a failure)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().split()[2] == "Z":
                            break
                except (ProcessLookupError, FileNotFoundError):
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"worker {pid} survived")
        r = pool.generate(GenerationRequest(prompt=["x"], steps=1, height=64, width=64,
                                            max_sequence_length=8))
        assert pool.launches == 2 and r.samples.shape == (1, 16, 8, 8)
    finally:
        pool.close()


GATE_ENV = "XDIT_TEST_LAUNCH_GATE"


def wait_for(paths, proc_ok, limit=300.0) -> bool:
    """Wait until every path exists (an event: the limit only bounds a failing test)."""
    deadline = time.monotonic() + limit
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline or not proc_ok():
            return False
        time.sleep(0.05)
    return True


def test_loading_state_load_in_turn_and_memory(model_dir, pools, tmp_path, monkeypatch):
    """status() says "loading" while the workers load: the workers are held in their launch
    (hook) until the test has asked, then the first job runs and the pool is idle."""
    req = GenerationRequest(prompt=["a cat"], seed=3, steps=2, height=64, width=64,
                            max_sequence_length=8)
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))  # inherited by the workers
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1, load_in_turn=True,
                      worker_hooks=["xdit_testhooks.probes:hold_launch"])
    states, errors = [], []

    def first_job():
        try:
            states.append(pool.generate(req))
        except BaseException as e:  # reported below
            errors.append(e)

    th = threading.Thread(target=first_job, daemon=True)
    try:
        assert pool.status()["state"] == "stopped"
        th.start()
        # both workers are inside their launch, held at the gate: the pool is loading
        at_gate = [f"{gate}.rank{r}" for r in range(2)]
        assert wait_for(at_gate, th.is_alive), errors
        st = pool.status()
        assert st["state"] == "loading" and len(st["ranks"]) == 2, st
        pids = {int(open(f).read()) for f in at_gate}
        assert {r["pid"] for r in st["ranks"]} == pids, (st["ranks"], pids)
        gate.touch()
        th.join(600)
        assert not th.is_alive() and not errors, errors
        assert pool.status()["state"] == "idle"
        ranks = pool.last_launch["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["load_peak_rss_mb"] >= r["rss_after_import_mb"] > 50
            assert r["load_s"] > 0
        ref = pools("flux", 2)
        ref.reconfigure(ParallelConfig(ulysses=2))
        assert torch.equal(states[0].samples, ref.generate(req).samples)
    finally:
        gate.touch()
        pool.close()
        if th.ident is not None:
            th.join(60)


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_png_output_decodes_patch_parallel_like_one_rank(pools, arch):
    """output="image" decodes on every rank of the pool (row bands with halos, distributed
    GroupNorm): the image equals the 1-rank pool's decode."""
    req = GenerationRequest(prompt=["a red cat"], seed=4, steps=2, height=208, width=144,
                            max_sequence_length=12, output="image", cfg=1.0)
    one = pools(arch, 1).generate(req)
    pool = pools(arch, 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    two = pool.generate(req)
    assert two.images.shape == (1, 208, 144, 3) and one.images.shape == two.images.shape
    assert (two.images - one.images).abs().max().item() <= 1e-4
    assert two.images.std().item() > 1e-3  # a real image, not a constant
