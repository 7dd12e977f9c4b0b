"""Shared-GPU test mode: several CUDA ranks on one GPU over gloo (NCCL refuses two ranks on
one device). gloo takes CUDA tensors in broadcast / all_reduce / all_gather /
all_to_all_single but not in send/recv (nor batch_isend_irecv), so this hook stages every
point-to-point CUDA tensor through host memory, for the project's transfers and yunchang's
Ring alike. gloo would carry a CPU tensor on the data plane where NCCL refuses it, so the
hook turns on the plane check (workers/parallel/topology.py): such a tensor, in a collective or a
point-to-point call, fails here as it would on NCCL instead of passing through.

The staging copies exist only in this mode (NCCL sends device memory directly), so they run
outside any dispatch mode: the host-sync counter (host_syncs.py) sees the project's own
operations, not this hook's."""
from __future__ import annotations

from torch.utils._python_dispatch import _disable_current_modes as _unseen


def install(ctx):
    ctx.options["backend"] = "gloo"
    ctx.options["check_planes"] = True
    _stage_point_to_point()


class _Staged:
    """A receive into a host buffer, copied to the CUDA tensor when waited on."""

    def __init__(self, work, host, dest):
        self.work, self.host, self.dest = work, host, dest

    def wait(self, *a, **k):
        out = self.work.wait(*a, **k)
        if self.dest is not None:
            with _unseen():
                self.dest.copy_(self.host)
            self.dest = None
        return out

    def is_completed(self):
        return self.work.is_completed()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _plane_check():
    """workers.parallel.topology.check_plane (a no-op outside the repository): what the one door
    checks, applied here to point-to-point calls that bypass it (yunchang's Ring)."""
    try:
        from workers.parallel.topology import check_plane
    except ImportError:
        def check_plane(op, group, tensors=(), objects=False):
            pass
    return check_plane


def _group(a, k):
    """The `group` argument of isend / irecv / send / recv (after the tensor)."""
    return k["group"] if "group" in k else (a[1] if len(a) > 1 else None)


def _stage_point_to_point():
    import torch.distributed as dist

    check = _plane_check()
    orig = {n: getattr(dist, n) for n in ("isend", "irecv", "send", "recv",
                                          "batch_isend_irecv", "P2POp")}

    def isend(tensor, *a, **k):
        check("isend", _group(a, k), [tensor])
        with _unseen():
            return orig["isend"](tensor.cpu() if tensor.is_cuda else tensor, *a, **k)

    def send(tensor, *a, **k):
        check("send", _group(a, k), [tensor])
        with _unseen():
            return orig["send"](tensor.cpu() if tensor.is_cuda else tensor, *a, **k)

    def irecv(tensor, *a, **k):
        check("irecv", _group(a, k), [tensor])
        if not tensor.is_cuda:
            return orig["irecv"](tensor, *a, **k)
        with _unseen():
            host = tensor.new_empty(tensor.shape, device="cpu")
        return _Staged(orig["irecv"](host, *a, **k), host, tensor)

    def recv(tensor, *a, **k):
        check("recv", _group(a, k), [tensor])
        if not tensor.is_cuda:
            return orig["recv"](tensor, *a, **k)
        with _unseen():
            host = tensor.new_empty(tensor.shape, device="cpu")
            src = orig["recv"](host, *a, **k)
            tensor.copy_(host)
        return src

    def batch_isend_irecv(ops):
        staged, copies = [], []
        for op in ops:
            t = op.tensor
            check("batch_isend_irecv", op.group, [t])
            if t.is_cuda:
                with _unseen():
                    host = (t.detach().cpu() if _sends(op)
                            else t.new_empty(t.shape, device="cpu"))
                if not _sends(op):
                    copies.append((host, t))
                op = orig["P2POp"](_unwrap(op.op), host, op.peer, op.group, op.tag)
            staged.append(op)
        works = orig["batch_isend_irecv"](staged)
        if copies:  # the copies happen when the last work is waited on
            last = works[-1]
            works[-1] = _Many(last, copies)
        return works

    def _unwrap(fn):
        return {isend: orig["isend"], irecv: orig["irecv"]}.get(fn, fn)

    def _sends(op):
        return _unwrap(op.op) in (orig["isend"], dist.distributed_c10d.isend)

    class P2POp(orig["P2POp"]):
        def __new__(cls, op, *a, **k):
            return orig["P2POp"].__new__(cls, _unwrap(op), *a, **k)

        def __init__(self, op, *a, **k):
            super().__init__(_unwrap(op), *a, **k)

    class _Many:
        def __init__(self, work, copies):
            self.work, self.copies = work, copies

        def wait(self, *a, **k):
            out = self.work.wait(*a, **k)
            with _unseen():
                for host, dest in self.copies:
                    dest.copy_(host)
            self.copies = []
            return out

        def __getattr__(self, name):
            return getattr(self.work, name)

    for name, fn in (("isend", isend), ("irecv", irecv), ("send", send), ("recv", recv),
                     ("batch_isend_irecv", batch_isend_irecv), ("P2POp", P2POp)):
        setattr(dist, name, fn)
