"""Counts the bytes each rank sends through torch.distributed on the data plane: a worker
hook for the benchmarks (workers/runtime/hooks.py).

    WorkerPool(..., worker_hooks=["benchmarks.comm_meter:install"])

installs it in every worker before the process group exists; the worker resets it when a job
starts and reports its snapshot in each rank's `stats["hooks"]["benchmarks.comm_meter:install"]`:
`{"bytes": {kind: n}, "calls": {kind: n}, "total_bytes": n}`.

It wraps the collectives this package and yunchang use, in the worker process only, on top
of whatever is installed at install time (another hook's wrappers, such as the NCCL-rules
emulation, stay in the chain, in either order). A rank's count is what leaves it: the part
of an all-to-all it keeps is not counted, an all-gather sends its shard to each peer, a
broadcast counts on its source, a point-to-point message on its sender. Kinds:
"all_to_all" (all_to_all_single and list all_to_all), "p2p" (batch_isend_irecv: PipeFusion's
activations and latent rows, Ring attention, the VAE's halo exchange), "send" (plain
isend/send), "all_gather", "broadcast". Receives are not counted (the sender counts them).
Only the data plane is counted: an operation on a control-plane group (a gloo twin,
`workers.parallel.topology.is_control`: job broadcasts, stop flags, stats) is skipped.
"""
from __future__ import annotations

from collections import defaultdict

from xdit_testhooks.p2p_ops import is_send as p2p_is_send

SPEC = "benchmarks.comm_meter:install"

_METER = None  # one per process: a second install returns it instead of wrapping again


def install(ctx=None):
    """Worker hook: wrap torch.distributed (before init_process_group) and return the meter,
    whose `job_started()` resets the counts and `job_stats()` returns them."""
    global _METER
    if _METER is None:
        _METER = CommMeter()
    return _METER


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _arg(args, kwargs, index, name, default=None):
    """An argument given by position (`index` counts after the first one) or by name."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class CommMeter:
    def __init__(self):
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)
        self._install()

    def reset(self):
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls),
                "total_bytes": sum(self.bytes.values())}

    # the hook protocol (workers/runtime/hooks.py)
    def job_started(self) -> None:
        self.reset()

    def job_stats(self) -> dict:
        return self.snapshot()

    def _count(self, kind, n):
        self.bytes[kind] += int(n)
        self.calls[kind] += 1

    def _install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        from workers.parallel.topology import is_control

        # what is installed now: torch's functions, or another hook's wrappers of them
        orig = {name: getattr(dist, name) for name in
                ("all_to_all_single", "all_to_all", "batch_isend_irecv", "all_gather",
                 "broadcast", "isend", "irecv", "send", "P2POp")}

        def size(group) -> int:
            return dist.get_world_size(group)

        def all_to_all_single(output, input, *a, **k):
            group = _arg(a, k, 2, "group")
            if not is_control(group):
                n = size(group)
                self._count("all_to_all", _nbytes(input) * (n - 1) / n)
            return orig["all_to_all_single"](output, input, *a, **k)

        def all_to_all(output_tensor_list, input_tensor_list, *a, **k):
            group = _arg(a, k, 0, "group")
            if not is_control(group):
                me = dist.get_rank(group)
                self._count("all_to_all", sum(_nbytes(t) for i, t in
                                              enumerate(input_tensor_list) if i != me))
            return orig["all_to_all"](output_tensor_list, input_tensor_list, *a, **k)

        def isend(tensor, *a, **k):
            if not is_control(_arg(a, k, 1, "group")):
                self._count("send", _nbytes(tensor))
            return orig["isend"](tensor, *a, **k)

        def send(tensor, *a, **k):
            if not is_control(_arg(a, k, 1, "group")):
                self._count("send", _nbytes(tensor))
            return orig["send"](tensor, *a, **k)

        isend.__wrapped__, send.__wrapped__ = orig["isend"], orig["send"]
        mine = {isend: orig["isend"], send: orig["send"]}

        def unwrap(op):
            """Our wrappers -> what they wrap (torch's function, or the wrapper under ours):
            a P2POp must carry an op that torch (or the hook under us) recognises, and
            batch_isend_irecv calls `op.op` itself, so a send is never counted twice."""
            return mine.get(op, op)

        sends = {c10d.isend, c10d.send, orig["isend"], orig["send"]}
        recvs = {c10d.irecv, c10d.recv, orig["irecv"]}

        def is_send(op) -> bool:
            return p2p_is_send(op, sends, recvs)

        base = orig["P2POp"]

        class P2POp(base):
            """torch checks a P2POp's op by identity with its own isend/irecv: code that
            passes `dist.isend` (now the wrapper above) gets what it wraps."""

            def __new__(cls, op, *a, **k):
                return base.__new__(cls, unwrap(op), *a, **k)

            def __init__(self, op, *a, **k):
                super().__init__(unwrap(op), *a, **k)

        def batch_isend_irecv(ops):
            for op in ops:
                op.op = unwrap(op.op)
            if ops and not is_control(ops[0].group):  # torch: one group per batch
                self._count("p2p", sum(_nbytes(op.tensor) for op in ops if is_send(op.op)))
            return orig["batch_isend_irecv"](ops)

        def all_gather(tensor_list, tensor, *a, **k):
            group = _arg(a, k, 0, "group")
            if not is_control(group):
                self._count("all_gather", _nbytes(tensor) * (size(group) - 1))
            return orig["all_gather"](tensor_list, tensor, *a, **k)

        def broadcast(tensor, *a, **k):
            group = _arg(a, k, 1, "group")
            if not is_control(group):
                src, group_src = _arg(a, k, 0, "src"), k.get("group_src")
                if (dist.get_rank() == src if src is not None
                        else group_src is not None and dist.get_rank(group) == group_src):
                    self._count("broadcast", _nbytes(tensor) * (size(group) - 1))
            return orig["broadcast"](tensor, *a, **k)

        for name, fn in (("all_to_all_single", all_to_all_single), ("all_to_all", all_to_all),
                         ("batch_isend_irecv", batch_isend_irecv), ("all_gather", all_gather),
                         ("broadcast", broadcast), ("isend", isend), ("send", send),
                         ("P2POp", P2POp)):
            if name != "P2POp":
                fn.__wrapped__ = orig[name]
            setattr(dist, name, fn)
