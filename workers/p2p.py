"""Point-to-point on the data plane, written to NCCL's rules (DESIGN.md, "Communication").

* A transfer is one `exchange`: every send and receive a rank has at that moment, with any
  peers, goes out in one `batch_isend_irecv`, which NCCL keeps in flight together. Callers
  build their schedules so that both sides of a pair call `exchange` at the same point
  (workers/schedule.py: the same tick), so per-pair issue order always matches.
* Pair communicators are created eagerly (`warm_pairs`), in one global order, when a
  topology that uses point-to-point is built: NCCL's first send/recv between two ranks
  blocks both hosts until each has made it, so letting a job create them mid-schedule
  invites a deadlock.
* Device tensors only. Where the data plane is gloo on CUDA tensors (the shared-GPU test
  mode), point-to-point is staged through host memory: gloo's send/recv refuse CUDA
  tensors, its collectives do not.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def staged(group, device) -> bool:
    """gloo moving CUDA tensors: stage point-to-point through the host."""
    return device.type == "cuda" and dist.get_backend(group) == "gloo"


class Transfer:
    """Posted point-to-point operations; `wait()` returns the received tensors."""

    def __init__(self, works, bufs, device, host):
        self.works, self.bufs, self.device, self.host = works, bufs, device, host

    def wait(self) -> list:
        for work in self.works:
            work.wait()
        self.works = []
        return [b.to(self.device) for b in self.bufs] if self.host else self.bufs


def post(sends: list, recvs: list, group, device) -> Transfer:
    """`sends`: [(tensor, global peer)]; `recvs`: [(shape, dtype, global peer)]. Posts all
    in one `batch_isend_irecv`; the caller waits (and may compute meanwhile)."""
    host = staged(group, device)
    ops, bufs = [], []
    for t, peer in sends:
        t = t.detach().contiguous()
        ops.append(dist.P2POp(dist.isend, t.cpu() if host else t, peer, group))
    for shape, dtype, peer in recvs:
        buf = torch.empty(shape, dtype=dtype, device="cpu" if host else device)
        bufs.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, peer, group))
    works = dist.batch_isend_irecv(ops) if ops else []
    return Transfer(works, bufs, device, host)


def exchange(sends: list, recvs: list, group, device) -> list:
    """`post` and wait: the received tensors (on `device`) in `recvs` order."""
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
