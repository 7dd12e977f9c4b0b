"""The NCCL-rules emulation itself (xdit_testhooks/nccl_rules.py), without the pool: 2-3
gloo processes per launch (FileStore rendezvous in tmp_path), the hook installed in each
before `init_process_group`, a schedule run, results reported back as JSON.

* Matched schedules pass under it: a send/recv pair, ping-pong, `batch_isend_irecv` with
  both directions in one batch, a 3-rank ring in one batch each, point-to-point on a
  subgroup (global and group ranks), and the product's Ring attention (yunchang, ring
  degree 3, uneven shards) gives the same numbers as on plain gloo and as full attention.
* Negative controls, each caught within the timeout with a message naming both ranks and the
  operation: (a) the old data-parallel collector (irecv posted at start, broadcasts, then
  the send), (b) the old PipeFusion order on one pair, (c) both ranks receive first.
* The same negative schedules pass on plain gloo: the emulation is what catches them.

Run as a script, this file is one rank: `python test_nccl_rules.py LAUNCH RANK WORLD STORE
OUT HOOK`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 4.0  # XDIT_NCCL_RULES_TIMEOUT inside the ranks (short: each negative costs it)
EXIT_GRACE = 3.0  # once a rank has exited, how long the others get to finish
STALL = 3 * TIMEOUT + 5  # no rank reported anything new for this long: the rest is stuck
LENGTHS = [8, 8, 7]  # Ring attention shards of 23 tokens (uneven: padded and dropped inside)


# ---------------------------------------------------------------------------------------
# the rank program
# ---------------------------------------------------------------------------------------
def _pair_send_recv(rank, env):
    import torch
    import torch.distributed as dist
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.float32), dst=1)
        return None
    if rank == 1:
        buf = torch.zeros(4)
        src = dist.recv(buf, src=0)
        assert src == 0 and buf.tolist() == [0, 1, 2, 3], (src, buf)
    return None


def _ping_pong(rank, env):
    import torch
    import torch.distributed as dist
    if rank > 1:
        return None
    peer = 1 - rank
    x = torch.zeros(3, dtype=torch.int64)
    for i in range(6):
        if (i % 2) == rank:  # my turn to send
            w = dist.isend(x + 1, dst=peer)
            w.wait()
            assert w.is_completed()
        else:
            w = dist.irecv(x, src=peer)
            assert w.wait() is True
            assert x.tolist() == [i + 1] * 3, (i, x)
    return None


def _batch_both_directions(rank, env):
    import torch
    import torch.distributed as dist
    if rank > 1:
        return None
    peer = 1 - rank
    for it in range(3):
        out_a = torch.full((2, 3), 10.0 * rank + it)
        out_b = torch.full((5,), 100 + rank, dtype=torch.int32)
        in_a, in_b = torch.zeros(2, 3), torch.zeros(5, dtype=torch.int32)
        sends = [dist.P2POp(dist.isend, out_a, peer), dist.P2POp(dist.isend, out_b, peer)]
        recvs = [dist.P2POp(dist.irecv, in_a, peer), dist.P2POp(dist.irecv, in_b, peer)]
        ops = sends + recvs if rank == 0 else recvs + sends  # order within a batch is free
        works = dist.batch_isend_irecv(ops)
        assert len(works) == 4
        for w in works:
            w.wait()
        assert in_a.eq(10.0 * peer + it).all() and in_b.eq(100 + peer).all(), (in_a, in_b)
    return None


def _ring3_batches(rank, env):
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    held = torch.tensor([float(rank)])
    for step in range(world):
        got = torch.zeros(1)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, held, nxt),
                                        dist.P2POp(dist.irecv, got, prv)])
        for w in works:
            w.wait()
        assert got.item() == float((rank - step - 1) % world), (step, got)
        held = got
    return None


def _subgroup(rank, env):
    import torch
    import torch.distributed as dist
    g = env["sub12"]  # ranks [1, 2]
    if rank == 0:
        return None
    if rank == 1:  # global ranks
        dist.isend(torch.tensor([7.0, 8.0]), dst=2, group=g).wait()
        back = torch.zeros(2)
        dist.recv(back, src=2, group=g)
        assert back.tolist() == [8.0, 9.0], back
    else:  # group ranks, then a batch on the subgroup
        buf = torch.zeros(2)
        dist.irecv(buf, group=g, group_src=0).wait()
        dist.send(buf + 1, group=g, group_dst=0)
    peer = 3 - rank
    mine, theirs = torch.tensor([float(rank)]), torch.zeros(1)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer, group=g),
                                     dist.P2POp(dist.isend, mine, peer, group=g)]):
        w.wait()
    assert theirs.item() == float(peer), theirs
    return None


def _ring_attention(rank, env):
    """The product's Ring attention (yunchang LongContextAttention around the CPU block
    kernel), ring degree 3 over uneven shards, against full attention."""
    import torch
    import torch.nn.functional as F

    from workers.parallel.sequence_parallel import SequencePlan
    from workers.streams import Attention, Stream, TokenLayout

    topo = env["topo"]
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(1, total, 2, 8, generator=gen) for _ in range(3))
    lo = sum(LENGTHS[:topo.sp_rank])
    hi = lo + LENGTHS[topo.sp_rank]
    one = TokenLayout((Stream("image", "latent"),), (Attention(("image",)),))
    plan = SequencePlan(topo.sp_rank, topo.sp, {"image": total}, layout=one)
    assert plan.sizes("image") == LENGTHS
    out = env["ShardedAttention"](topo, "cpu")(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], plan,
                                               ("image",))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2)).transpose(1, 2)[:, lo:hi]
    return {"diff": float((out - ref).abs().max()), "out": out.flatten().tolist()}


# -- negative controls (schedules gloo forgives and NCCL deadlocks on) -------------------
def _old_dp_collector(rank, env):
    """(a) rank 0 posts its receive when the job starts; the replica sends at the end, after
    every step's broadcasts."""
    import torch
    import torch.distributed as dist
    posted = None  # every rank joins the broadcasts; ranks 0 and 1 do the point-to-point
    if rank == 0:
        buf = torch.zeros(4)
        posted = dist.irecv(buf, src=1)
    for step in range(3):
        t = torch.full((2,), float(step)) if rank == 0 else torch.zeros(2)
        dist.broadcast(t, src=0)
        assert t.tolist() == [float(step)] * 2
    if rank == 1:
        dist.send(torch.full((4,), 5.0), dst=0)
    elif rank == 0:
        posted.wait()
        assert buf.eq(5.0).all()
    return None


def _old_pipefusion_order(rank, env):
    """(b) one stage pair, operations issued one by one: rank 0 sends A0, A1 and then
    receives L0; rank 1 receives A0, sends L0, receives A1."""
    import torch
    import torch.distributed as dist
    if rank > 1:
        return None
    g = env["gb"]
    if rank == 0:
        a0, a1, l0 = torch.full((4,), 1.0), torch.full((4,), 2.0), torch.zeros(4)
        works = [dist.isend(a0, dst=1, group=g), dist.isend(a1, dst=1, group=g),
                 dist.irecv(l0, src=1, group=g)]
    else:
        a0, a1, l0 = torch.zeros(4), torch.zeros(4), torch.full((4,), 3.0)
        works = [dist.irecv(a0, src=0, group=g), dist.isend(l0, dst=0, group=g),
                 dist.irecv(a1, src=0, group=g)]
    for w in works:
        w.wait()
    assert a0.eq(1.0).all() and a1.eq(2.0).all() and l0.eq(3.0).all()
    return None


def _both_receive_first(rank, env):
    """(c) both ranks post their receive, then their send."""
    import torch
    import torch.distributed as dist
    if rank > 1:
        return None
    g, peer = env["gc"], 1 - rank
    got = torch.zeros(3)
    works = [dist.irecv(got, src=peer, group=g),
             dist.isend(torch.full((3,), float(rank)), dst=peer, group=g)]
    for w in works:
        w.wait()
    assert got.eq(float(peer)).all()
    return None


POSITIVE = [("pair", _pair_send_recv), ("ping_pong", _ping_pong),
            ("batch_both_directions", _batch_both_directions), ("ring3", _ring3_batches),
            ("subgroup", _subgroup), ("ring_attention", _ring_attention)]
NEGATIVE = [("old_pipefusion_order", _old_pipefusion_order),
            ("both_receive_first", _both_receive_first),
            ("old_dp_collector", _old_dp_collector)]  # last: it leaves rank 1 in a broadcast
LAUNCHES = {"positive": POSITIVE, "negative": NEGATIVE,
            "plain": [("ring_attention", _ring_attention)] + NEGATIVE}


def _rank_main(launch, rank, world, store_path, out_dir, hook) -> None:
    import datetime

    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist

    from workers.parallel.attention import ShardedAttention  # imported before anyone waits on us
    from workers.parallel.topology import build_topology

    rules = None
    if hook:
        from workers.runtime.hooks import HookContext
        from xdit_testhooks import nccl_rules
        rules = nccl_rules.install(HookContext(rank=rank, world=world, device="cpu"))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    env = {"ShardedAttention": ShardedAttention}
    steps = LAUNCHES[launch]
    names = [n for n, _ in steps]
    if "subgroup" in names:
        env["sub12"] = dist.new_group([1, 2])
    if launch != "positive":
        env["gb"], env["gc"] = dist.new_group([0, 1]), dist.new_group([0, 1])
    if "ring_attention" in names:
        env["topo"] = build_topology(rank, world, dp=1, cfg=1, pipefusion=1, ulysses=1,
                                     ring=world)
    report = {}
    out = Path(out_dir)

    def write():
        tmp = out / f"{rank}.json.tmp"
        tmp.write_text(json.dumps(report))
        os.replace(tmp, out / f"{rank}.json")

    for name, fn in steps:
        dist.barrier()  # every schedule starts together (collectives are not emulated)
        t0 = time.monotonic()
        try:
            data = fn(rank, env)
            report[name] = {"ok": True, "data": data, "elapsed": time.monotonic() - t0}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report[name] = {"ok": False, "error_type": type(exc).__name__,
                            "message": str(exc), "elapsed": time.monotonic() - t0}
        report["_stats"] = rules.job_stats() if rules is not None else None
        write()
    if all(v["ok"] for k, v in report.items() if not k.startswith("_")):
        dist.barrier()  # nobody leaves while a peer still reads what it sent
    os._exit(0)  # skip teardown (a failed schedule leaves the group unusable)


# ---------------------------------------------------------------------------------------
# the test side
# ---------------------------------------------------------------------------------------
def _launch(tmp_path, launch, world, hook, wall=90.0):
    """Run `launch` on `world` ranks; returns ({rank: report}, logs). A rank still running
    EXIT_GRACE seconds after another one exited, or when no rank has reported anything new
    for STALL seconds, is stuck (in a collective its peer left): it is killed."""
    out = tmp_path / f"{launch}-{int(hook)}"
    out.mkdir()
    store = tmp_path / f"{launch}-{int(hook)}.store"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               XDIT_NCCL_RULES_TIMEOUT=str(TIMEOUT),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    logs = [open(out / f"{r}.log", "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), launch, str(r),
                               str(world), str(store), str(out), str(int(hook))],
                              cwd=ROOT, env=env, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(world)]
    start = last_news = time.monotonic()
    first_exit = None
    seen = {}
    try:
        while time.monotonic() - start < wall:
            now = time.monotonic()
            for r in range(world):
                f = out / f"{r}.json"
                stamp = f.stat().st_mtime_ns if f.exists() else None
                if stamp != seen.get(r):
                    seen[r], last_news = stamp, now
            running = [p for p in procs if p.poll() is None]
            if not running:
                break
            if first_exit is None and len(running) < world:
                first_exit = now
            if first_exit is not None and now - first_exit > EXIT_GRACE:
                break
            if any(seen.values()) and now - last_news > STALL:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    reports = {}
    for r in range(world):
        f = out / f"{r}.json"
        if f.exists():
            reports[r] = json.loads(f.read_text())
    text = {}
    for r, fh in enumerate(logs):
        fh.seek(0)
        text[r] = fh.read()
        fh.close()
    return reports, text


def _fixture(launch, world, hook):
    import pytest

    @pytest.fixture(scope="module")
    def run(tmp_path_factory):
        t0 = time.monotonic()
        reports, logs = _launch(tmp_path_factory.mktemp(launch), launch, world, hook)
        return {"reports": reports, "logs": logs, "seconds": time.monotonic() - t0}
    return run


positive = _fixture("positive", 3, hook=True)
negative = _fixture("negative", 2, hook=True)
plain = _fixture("plain", 3, hook=False)


def _outcome(run, rank, name):
    rep = run["reports"].get(rank, {})
    assert name in rep, f"rank {rank} did not report {name!r}; log:\n{run['logs'][rank]}"
    return rep[name]


def test_matched_schedules_pass_under_the_emulation(positive):
    for name, _ in POSITIVE:
        for rank in range(3):
            got = _outcome(positive, rank, name)
            assert got["ok"], f"{name} rank {rank}: {got}\n{positive['logs'][rank]}"
    # the emulation carried them: every rank queued operations on its pairs
    for rank in range(3):
        stats = positive["reports"][rank]["_stats"]
        assert stats["ops"] > 0 and stats["pairs"] >= 2 and stats["timeout_s"] == TIMEOUT


def test_ring_attention_same_under_the_emulation_as_on_plain_gloo(positive, plain):
    for rank in range(3):
        ruled = _outcome(positive, rank, "ring_attention")
        free = _outcome(plain, rank, "ring_attention")
        assert ruled["ok"] and free["ok"], (ruled, free)
        assert ruled["data"]["diff"] < 1e-5, ruled["data"]["diff"]  # exact attention
        assert ruled["data"]["out"] == free["data"]["out"]  # same schedule, same numbers
        assert len(ruled["data"]["out"]) == LENGTHS[rank] * 2 * 8


def test_negative_schedules_pass_on_plain_gloo(plain):
    for name, _ in NEGATIVE:
        for rank in (0, 1):
            got = _outcome(plain, rank, name)
            assert got["ok"], f"plain gloo, {name} rank {rank}: {got}"


def _assert_names_both_ranks(msg, me, peer, op):
    assert "NCCL" in msg and f"rank {me}" in msg and f"rank {peer}" in msg, msg
    assert op in msg, (op, msg)
    assert "ranks [0, 1]" in msg, msg  # the group, by its ranks
    assert "head of rank" in msg.lower(), msg


def test_old_pipefusion_order_is_a_deadlock(negative):
    outcomes = [_outcome(negative, r, "old_pipefusion_order") for r in (0, 1)]
    for got in outcomes:
        assert not got["ok"] and got["error_type"] == "NcclOrderError", got
        assert got["elapsed"] < TIMEOUT + 4, got["elapsed"]
        assert "deadlock" in got["message"]
    m0, m1 = outcomes[0]["message"], outcomes[1]["message"]
    # after A0 matched, both heads are sends: rank 0's A1 (its op #2), rank 1's L0 (#2)
    _assert_names_both_ranks(m0, 0, 1, "send #2 of the pair (the 2nd send to rank 1; "
                                       "tensor (4,) float32")
    _assert_names_both_ranks(m1, 1, 0, "send #2 of the pair (the 1st send to rank 0; "
                                       "tensor (4,) float32")
    assert "Rank 1's side: Head of rank 1's queue for the pair: send #2" in m0, m0


def test_both_receive_first_is_a_deadlock(negative):
    for rank in (0, 1):
        got = _outcome(negative, rank, "both_receive_first")
        assert not got["ok"] and got["error_type"] == "NcclOrderError", got
        assert got["elapsed"] < TIMEOUT + 4, got["elapsed"]
        _assert_names_both_ranks(got["message"], rank, 1 - rank,
                                 f"recv #1 of the pair (the 1st recv from rank {1 - rank}; "
                                 f"tensor (3,) float32")


def test_old_dp_collector_blocks_at_first_contact(negative):
    got = _outcome(negative, 0, "old_dp_collector")
    assert not got["ok"] and got["error_type"] == "NcclOrderError", got
    # rank 0's host is held by the pair's first operation for the timeout, not forever
    assert TIMEOUT - 0.5 < got["elapsed"] < TIMEOUT + 4, got["elapsed"]
    msg = got["message"]
    _assert_names_both_ranks(msg, 0, 1, "recv #1 of the pair (the 1st recv from rank 1; "
                                        "tensor (4,) float32; issued by irecv)")
    assert "first contact" in msg and "the default group" in msg, msg
    assert "NCCL rules violated" in negative["logs"][0]  # also in the rank's log (stderr)
    # rank 1 never completed its schedule: it was stuck in the broadcast (killed, or failed
    # when rank 0 went away)
    assert not negative["reports"].get(1, {}).get("old_dp_collector", {}).get("ok", False)


if __name__ == "__main__":
    launch_, rank_, world_, store_, out_, hook_ = sys.argv[1:7]
    _rank_main(launch_, int(rank_), int(world_), store_, out_, hook_ == "1")
