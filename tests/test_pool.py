"""The persistent pool (docs/design.md#the-pool): one launch serves many jobs with results equal
to fresh runs; per-step events stream before `generate` returns; cancel and ComfyUI's
interrupt stop a job part-way and keep the workers warm; a killed worker fails the job (seen
by the pool's death watch, not by a timeout), leaves no process behind and the next job
relaunches; bad requests are refused before anything is sent; `close()` leaves nothing
behind; two pools run side by side.

No assertion here is on wall time (the machine is shared): jobs that must be stopped are
far longer than any lag of the host, and the checks count events, pids and launches.

Every pool here is a dedicated 2-rank CPU pool (never the shared `pools` fixture, since these
tests kill and disturb workers). Launches cost ~20 s each on a 2-core machine, so the file
keeps them few: the module-scoped `warm_pool` and `kill_pool` serve several tests, and the
`reference` fixture collects the first job of every freshly launched pool in this file as the
"fresh one-shot run" that later results are compared with (it launches a one-shot pool only
for a request nobody has run fresh yet, e.g. when a test is run alone).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from comfyui_xdit import ConfigError, GenerationRequest, ParallelConfig
from comfyui_xdit.client.pool import JobCancelled, PoolError, WorkerPool

# Three different jobs: batch 1 / batch 2 on a non-square odd token grid (15 tokens over
# ulysses 2, so padding is used) / FLUX true-CFG with a negative prompt.
R1 = GenerationRequest(prompt=["a red cat"], seed=1, steps=2, height=64, width=64,
                       max_sequence_length=8)
R2 = GenerationRequest(prompt=["a dog on the grass", "blue sky"], seed=2, steps=3, height=48,
                       width=80, max_sequence_length=8)
R3 = GenerationRequest(prompt=["a house by the lake"], seed=3, steps=2, height=80, width=48,
                       max_sequence_length=8, cfg=2.0, negative_prompt="ugly")
# A job we stop part-way: ~35 ms/step on an idle machine, so ~35 s if nothing stopped it.
# The workers run ahead of the host's event loop, so it must outlast any lag of the host
# (a loaded shared machine) for "fewer step events than steps" to be a fair check; when the
# stop works it ends within a step or two, so the length costs nothing.
LONG = GenerationRequest(prompt=["a long job"], seed=9, steps=1000, height=64, width=64,
                         max_sequence_length=8)
# A job that keeps the workers busy for ~1.5 s (more on a loaded machine).
BUSY = GenerationRequest(prompt=["a busy job"], seed=8, steps=40, height=64, width=64,
                         max_sequence_length=8)


def new_pool(model_dir) -> WorkerPool:
    # short timeouts: a job here takes seconds, so a lost message fails the test in a minute
    # instead of hanging it for the default 10 minutes
    return WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1, start_timeout=300, step_timeout=60)


def _key(req: GenerationRequest) -> str:
    return repr(dataclasses.asdict(req))


class Reference:
    """The result of each request as the first job of a freshly launched pool."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.cache: dict = {}

    def check_or_record(self, req, result) -> None:
        """`result` is a fresh pool's first job: equal to what we have, or the reference."""
        assert result.timings["launch_s"] > 0, "not the first job of a fresh launch"
        want = self.cache.setdefault(_key(req), result.samples)
        assert torch.equal(result.samples, want), \
            f"two fresh runs differ by {(result.samples - want).abs().max().item():.3e}"

    def __call__(self, req) -> torch.Tensor:
        if _key(req) not in self.cache:
            pool = new_pool(self.model_dir)
            try:
                self.check_or_record(req, pool.generate(req))
            finally:
                pool.close()
        return self.cache[_key(req)]


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir)


@pytest.fixture(scope="module")
def warm_pool(model_dir):
    """Not launched yet: the first test to use it (three jobs) launches it."""
    pool = new_pool(model_dir)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def kill_pool(model_dir):
    pool = new_pool(model_dir)
    try:
        yield pool
    finally:
        pool.close()


# ---- process helpers ------------------------------------------------------------------

def family(pids) -> set:
    """The pids and all their descendants."""
    out = set(pids)
    for pid in pids:
        try:
            out |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return out


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_alive(pids, within: float = 30.0) -> list:
    """The pids still alive after waiting up to `within` seconds for them to go (returns as
    soon as none is left: the limit only bounds a failing test)."""
    deadline = time.monotonic() + within
    while True:
        alive = sorted(p for p in pids if is_alive(p))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def my_children() -> set:
    return {c.pid for c in psutil.Process().children(recursive=True) if is_alive(c.pid)}


def assert_cleaned_up(pool: WorkerPool, pids, tmp: str) -> None:
    assert pool.worker_pids() == [] and not pool.is_running()
    assert still_alive(pids) == [], "pool processes outlived close()"
    assert not (set(pids) & my_children()), "pool workers are still children of the test"
    assert not os.path.exists(tmp), f"close() left {tmp}"


def address_of(pool: WorkerPool) -> tuple:
    with open(os.path.join(pool._tmp, "address")) as f:
        host, _, port = f.read().strip().rpartition(":")
    return host, int(port)


# ---- two pools at once, close() ------------------------------------------------------------

class WorkersDiedWithThread(AssertionError):
    """The workers of a pool died when the thread that launched the pool ended."""


def test_two_pools_at_once_and_close_cleans_up(model_dir, reference, unmoved_latent):
    """Two pools launched at the same moment from two threads: different ports and temp
    dirs, disjoint workers, equal results (each pool's first job is the other's second).
    close() leaves no process and removes the temp dir. Last, one launching thread ends and
    its pool must stay warm: a whole job runs on it afterwards with the same workers (raises
    WorkersDiedWithThread otherwise)."""
    pools = [new_pool(model_dir), new_pool(model_dir)]
    orders = [(R2, R3), (R3, R2)]
    results: list = [None, None]
    infos: list = [None, None]
    errors: list = []
    ready = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]
    start = threading.Barrier(2, timeout=60)

    def run(i):
        try:
            start.wait()
            t0 = time.monotonic()
            results[i] = [pools[i].generate(r) for r in orders[i]]
            infos[i] = {"span": (t0, time.monotonic()), "tmp": pools[i]._tmp,
                        "address": address_of(pools[i]), "pids": pools[i].worker_pids(),
                        "launches": pools[i].launches}
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            ready[i].set()
        release[i].wait(600)  # the pool's launching thread lives until we say so

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for e in ready:
            assert e.wait(600)
        assert not errors, errors
        a, b = infos
        assert a["span"][0] < b["span"][1] and b["span"][0] < a["span"][1], "not concurrent"
        assert a["launches"] == b["launches"] == 1
        assert a["address"][0] == b["address"][0] == "127.0.0.1"
        assert a["address"][1] != b["address"][1]
        assert a["tmp"] != b["tmp"]
        assert len(a["pids"]) == len(b["pids"]) == 2 and not set(a["pids"]) & set(b["pids"])
        # same request, same result, whichever pool and whether fresh or warm
        assert torch.equal(results[0][0].samples, results[1][1].samples)  # R2
        assert torch.equal(results[0][1].samples, results[1][0].samples)  # R3
        assert results[0][0].samples.shape == (2, 16, 6, 10)
        # it moved away from its initial noise (both in LATENT space: a zero velocity would
        # leave the distance at exactly 0)
        assert (results[0][0].samples - unmoved_latent("flux", R2)).abs().max() > 1e-2
        reference.check_or_record(R2, results[0][0])
        reference.check_or_record(R3, results[1][0])

        # close() from the main thread: nothing left of pool 0, pool 1 unaffected
        fam0 = family(a["pids"])
        assert set(a["pids"]) <= my_children()
        pools[0].close()
        assert_cleaned_up(pools[0], fam0, a["tmp"])
        pools[0].close()  # idempotent
        assert pools[1].is_running() and pools[1].worker_pids() == b["pids"]

        # the thread that launched pool 1 ends; the pool must stay warm: a whole job (long
        # enough for a parent watch to notice, were it tied to the thread) then runs on the
        # same workers, and a second one gives the same result as before
        fam1 = family(b["pids"])
        release[1].set()
        threads[1].join(30)
        assert not threads[1].is_alive()
        died = ""
        try:
            busy = []
            pools[1].generate(BUSY, on_event=busy.append)
            again = pools[1].generate(R2)
        except PoolError as e:
            died = f"a job failed: {e}"
        else:
            if pools[1].launches != 1 or pools[1].worker_pids() != b["pids"]:
                died = f"the pool relaunched (pids {pools[1].worker_pids()})"
            elif [p for p in b["pids"] if not is_alive(p)]:
                died = f"exit codes {[p.poll() for p in pools[1]._procs]}"
            else:
                assert [e["step"] for e in busy] == list(range(1, BUSY.steps + 1))
                assert torch.equal(again.samples, results[0][0].samples)
        survived = not died
        pools[1].close()
        assert_cleaned_up(pools[1], fam1, b["tmp"])
        if not survived:
            raise WorkersDiedWithThread(
                f"pool 1's workers {b['pids']} died after its launching thread ended ({died})")
    finally:
        for e in release:
            e.set()
        for p in pools:
            p.close()
        for t in threads:
            t.join(30)


# ---- a worker killed mid-job -------------------------------------------------------------

class RankNotNamed(AssertionError):
    """The PoolError after a kill does not name the rank that died."""


@pytest.mark.parametrize("rank", [
    1,
    0,
])
def test_killed_worker_fails_fast_and_next_job_relaunches(kill_pool, reference, rank):
    pool = kill_pool
    before = pool.generate(R1)
    if before.timings["launch_s"] > 0:
        reference.check_or_record(R1, before)
    else:
        assert torch.equal(before.samples, reference(R1))
    launches, pids, tmp = pool.launches, pool.worker_pids(), pool._tmp
    procs = family(pids)
    assert len(pids) == 2 and all(is_alive(p) for p in procs)

    killed: list = []
    events: list = []

    def on_event(event):
        events.append(event)
        if not killed:
            os.kill(pids[rank], signal.SIGKILL)
            killed.append(len(events))

    with pytest.raises(PoolError) as info:
        pool.generate(LONG, on_event=on_event)
    assert killed == [1]
    assert not isinstance(info.value, JobCancelled)
    # failed because the death was seen, not because the pool's step timeout ran out
    assert "no answer from the pool" not in str(info.value), str(info.value)[:300]
    assert len(events) < LONG.steps
    assert still_alive(procs) == [], "processes of the old pool are still alive"
    assert not (procs & my_children())
    assert not os.path.exists(tmp), "the dead pool's temp dir was left behind"
    assert not pool.is_running()

    after = pool.generate(R1)
    assert pool.launches == launches + 1
    new = pool.worker_pids()
    assert len(new) == 2 and not set(new) & set(pids)
    assert after.timings["launch_s"] > 0
    assert torch.equal(after.samples, before.samples)
    reference.check_or_record(R1, after)
    # last, so that the checks above run (and can fail) even while the bug stands
    message = str(info.value)
    if f"rank {rank}" not in message:
        raise RankNotNamed(f"killed rank {rank}, got: {message[:300]}")


# ---- one warm pool, many jobs -----------------------------------------------------------

def test_three_jobs_reuse_one_launch(warm_pool, reference, unmoved_latent):
    pool = warm_pool
    assert pool.launches == 0 and pool.worker_pids() == [], "must be the pool's first use"
    results, pids = [], None
    for i, req in enumerate((R1, R2, R3)):
        res = pool.generate(req)
        if i == 0:
            pids = pool.worker_pids()
            assert len(pids) == 2
            assert res.timings["launch_s"] > 0
        else:
            assert res.timings["launch_s"] == 0
        assert pool.worker_pids() == pids and pool.is_running()
        assert pool.launches == 1
        results.append(res)
    assert all(is_alive(p) for p in pids)
    assert [r.samples.shape for r in results] == [(1, 16, 8, 8), (2, 16, 6, 10), (1, 16, 10, 6)]
    reference.check_or_record(R1, results[0])
    for req, res in zip((R2, R3), results[1:]):
        want = reference(req)
        assert torch.equal(res.samples, want), \
            f"warm result differs from a fresh run by {(res.samples - want).abs().max():.3e}"
    for req, res in zip((R1, R2, R3), results):
        assert torch.isfinite(res.samples).all()
        # moved away from the initial noise, both in LATENT space (0 for a zero velocity)
        assert (res.samples - unmoved_latent("flux", req)).abs().max() > 1e-2


def test_events_stream_in_order_before_return(warm_pool):
    pool = warm_pool
    req = GenerationRequest(prompt=["a red cat", "a dog"], seed=4, steps=5, height=64,
                            width=96, max_sequence_length=8, preview_every=1)
    events, threads, returned = [], set(), []

    def on_event(event):
        events.append((bool(returned), event))
        threads.add(threading.get_ident())

    res = pool.generate(req, on_event=on_event)
    returned.append(True)
    assert [e["step"] for _, e in events] == [1, 2, 3, 4, 5]
    assert all(e["total"] == 5 for _, e in events)
    elapsed = [e["elapsed"] for _, e in events]
    assert all(x < y for x, y in zip(elapsed, elapsed[1:])), elapsed
    assert not any(late for late, _ in events), "an event arrived after generate returned"
    assert threads == {threading.get_ident()}, "events must be delivered in the caller's thread"
    # a preview is copied without waiting and travels with the next step's event (the last
    # step's with its own): step k's event shows step k - 1, the last shows the last
    assert [e.get("preview_step") for _, e in events] == [None, 1, 2, 3, 5]
    for _, e in events[1:]:
        p = e["preview"]
        assert isinstance(p, torch.Tensor) and tuple(p.shape) == (1, 16, 8, 12)
        assert torch.isfinite(p.float()).all()
    previews = [e["preview"].float() for _, e in events[1:]]
    # the last x0 estimate is the final latent of the first image; earlier ones are not
    assert torch.allclose(previews[-1], res.samples[:1], atol=2e-2, rtol=1e-2)
    assert (previews[0] - res.samples[:1]).abs().max() > 0.1

    # previews only when asked for, and only every k steps (steps 2, 4 and the last)
    every2 = []
    pool.generate(dataclasses.replace(req, preview_every=2), on_event=every2.append)
    shown = [(e["step"], e.get("preview_step")) for e in every2 if e.get("preview") is not None]
    assert [e["step"] for e in every2] == [1, 2, 3, 4, 5]
    assert shown == [(3, 2), (5, 5)]  # step 4's, not yet sent at step 5, gives way to the last
    none = []
    pool.generate(dataclasses.replace(req, preview_every=0, steps=2), on_event=none.append)
    assert [e["step"] for e in none] == [1, 2] and all(e["total"] == 2 for e in none)
    assert not any(e.get("preview") is not None for e in none)


def test_cancel_from_another_thread_stops_the_job(warm_pool, reference):
    """cancel() from another thread while the job runs (the host holds at step 1 until the
    cancel is sent): the job raises JobCancelled with fewer step events than steps, in
    order; the next job runs on the same workers with its own events only."""
    pool = warm_pool
    pool.generate(R1)  # launched (when run alone) before the pids are taken
    pids, launches = pool.worker_pids(), pool.launches
    first, sent, events = threading.Event(), threading.Event(), []

    def on_event(event):
        events.append(event)
        first.set()
        if len(events) == 1:
            assert sent.wait(120), "the canceller thread never ran"

    def canceller():
        if first.wait(120):
            pool.cancel()
            sent.set()

    t = threading.Thread(target=canceller, daemon=True)
    t.start()
    try:
        with pytest.raises(JobCancelled):
            pool.generate(LONG, on_event=on_event)
    finally:
        first.set()
        t.join(10)
    assert sent.is_set(), "no event arrived"
    assert 1 <= len(events) < LONG.steps
    assert [e["step"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["total"] == LONG.steps for e in events)

    pool.cancel()  # nothing running: a no-op that must not touch the next job
    after = []
    res = pool.generate(R1, on_event=after.append)
    assert [e["step"] for e in after] == [1, 2] and all(e["total"] == 2 for e in after)
    assert torch.equal(res.samples, reference(R1))
    assert pool.worker_pids() == pids and pool.launches == launches
    assert res.timings["launch_s"] == 0


class Interrupted(Exception):
    """Like ComfyUI's InterruptProcessingException, raised from the progress callback."""


@pytest.mark.parametrize("exc_type", [Interrupted, KeyboardInterrupt])
def test_on_event_exception_propagates_and_pool_stays_warm(warm_pool, reference, exc_type):
    pool = warm_pool
    pool.generate(R1)
    pids, launches = pool.worker_pids(), pool.launches
    calls = []
    boom = exc_type("interrupted by the user")

    def on_event(event):
        calls.append(event)
        raise boom

    with pytest.raises(exc_type) as info:
        pool.generate(LONG, on_event=on_event)
    assert info.value is boom
    assert len(calls) == 1, "on_event was called again after it raised"

    # the next job sees only its own events (nothing left over from the interrupted one)
    after = []
    res = pool.generate(R1, on_event=after.append)
    assert [e["step"] for e in after] == [1, 2] and all(e["total"] == 2 for e in after)
    assert torch.equal(res.samples, reference(R1))
    assert pool.worker_pids() == pids and pool.launches == launches


def test_bad_request_refused_before_anything_is_sent(warm_pool, reference):
    pool = warm_pool
    pool.generate(R1)
    pids, launches, job_id = pool.worker_pids(), pool.launches, pool._job_id
    sent = []
    chan = pool._chan
    real_send = chan.send

    def spy(obj):
        sent.append(obj)
        return real_send(obj)

    chan.send = spy
    try:
        with pytest.raises(ConfigError) as info:
            pool.generate(dataclasses.replace(R1, height=100))
        assert "height 100" in str(info.value)
        with pytest.raises(ConfigError):
            pool.reconfigure(ParallelConfig(ulysses=3))  # 3 does not divide 4 heads
        good = torch.zeros(R1.batch, 16, R1.height // 8, R1.width // 8)
        for kw, words in [({"init_latent": good, "denoise": 0.0}, "denoise"),
                          ({"init_latent": good, "denoise": 1.5}, "denoise"),
                          ({"init_latent": good[:, :, :-1]}, "init_latent"),
                          ({"noise": torch.zeros(R1.batch + 1, 16, 2, 2)}, "noise")]:
            with pytest.raises(ConfigError) as info:
                pool.generate(R1, **kw)
            assert words in str(info.value)
    finally:
        del chan.send
    assert sent == [], f"sent to the pool: {sent}"
    assert pool._job_id == job_id
    assert pool.config == ParallelConfig(ulysses=2)
    assert pool.worker_pids() == pids and pool.is_running()

    res = pool.generate(R1)
    assert torch.equal(res.samples, reference(R1))
    assert pool.worker_pids() == pids and pool.launches == launches
