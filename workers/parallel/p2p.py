"""Point-to-point on the data plane, written to NCCL's rules
(docs/design.md#communication-two-planes).

* A transfer is one `exchange`: every send and receive a rank has at that moment, with any
  peers, goes out in one `batch_isend_irecv`, which NCCL keeps in flight together. Callers
  build their schedules so that both sides of a pair call `exchange` at the same point
  (workers/parallel/pipefusion/schedule.py: the same tick), so per-pair issue order always matches.
* Pair communicators are created eagerly (`warm_pairs`), in one global order, when a
  topology that uses point-to-point is built: NCCL's first send/recv between two ranks
  blocks both hosts until each has made it, so letting a job create them mid-schedule
  invites a deadlock.
* Device tensors only (the shared-GPU test mode, gloo on CUDA tensors, stages them through
  the host in its hook, xdit_testhooks/shared_gpu.py); in the test modes `post` checks
  this (workers/parallel/topology.check_plane).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import topology


class Transfer:
    """Posted point-to-point operations; `wait()` returns the received tensors."""

    def __init__(self, works, bufs):
        self.works, self.bufs = works, bufs

    def wait(self) -> list:
        for work in self.works:
            work.wait()
        self.works = []
        return self.bufs


def post(sends: list, recvs: list, group, device) -> Transfer:
    """`sends`: [(tensor, global peer)]; `recvs`: [(shape, dtype, global peer)]. Posts all
    in one `batch_isend_irecv`; the caller waits (and may compute meanwhile)."""
    ops, bufs = [], []
    for t, peer in sends:
        ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), peer, group))
    for shape, dtype, peer in recvs:
        buf = torch.empty(shape, dtype=dtype, device=device)
        bufs.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, peer, group))
    if topology.plane_check() is not None:
        topology.check_plane("batch_isend_irecv", group, [op.tensor for op in ops])
    works = dist.batch_isend_irecv(ops) if ops else []
    return Transfer(works, bufs)


def exchange(sends: list, recvs: list, group, device) -> list:
    """`post` and wait: the received tensors in `recvs` order (nothing to do: no call)."""
    if not sends and not recvs:
        return []
    return post(sends, recvs, group, device).wait()


def warm_pairs(pairs, me: int, group, device) -> None:
    """Create the pair communicators of `pairs` (global ranks, the same list on every rank
    of `group`) by a one-element exchange per pair, in sorted order: the globally smallest
    pending pair is always the next one for both its ranks, so this cannot deadlock."""
    for a, b in sorted({(min(p), max(p)) for p in pairs if p[0] != p[1]}):
        if me not in (a, b):
            continue
        peer = b if me == a else a
        exchange([(torch.zeros(1, device=device), peer)], [((1,), torch.float32, peer)],
                 group, device)
