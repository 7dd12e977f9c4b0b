"""Counts the bytes each rank sends through torch.distributed (benchmarks only).

Enabled in a worker by `XDIT_COMM_METER=1`; wraps the collectives this package and yunchang
use, in the worker process only. A rank's count is what leaves it: the part of an
all-to-all it keeps is not counted, an all-gather sends its shard to each peer, a broadcast
counts on its source.
"""
from __future__ import annotations

import os
from collections import defaultdict

import torch.distributed as dist

_METER = None


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


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

    def _count(self, kind, n):
        self.bytes[kind] += int(n)
        self.calls[kind] += 1

    def _install(self):
        orig = {name: getattr(dist, name) for name in
                ("all_to_all_single", "batch_isend_irecv", "all_gather", "broadcast")}
        # isend/send themselves are left alone: P2POp only accepts the original functions

        def all_to_all_single(output, input, *a, group=None, **k):
            n = _size(group)
            self._count("all_to_all", _nbytes(input) * (n - 1) / n)
            return orig["all_to_all_single"](output, input, *a, group=group, **k)

        def batch_isend_irecv(ops):
            sent = sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)
            self._count("p2p", sent)
            return orig["batch_isend_irecv"](ops)

        def all_gather(tensor_list, tensor, group=None, *a, **k):
            self._count("all_gather", _nbytes(tensor) * (_size(group) - 1))
            return orig["all_gather"](tensor_list, tensor, group, *a, **k)

        def broadcast(tensor, src=None, group=None, *a, **k):
            if dist.get_rank() == src:
                self._count("broadcast", _nbytes(tensor) * (_size(group) - 1))
            return orig["broadcast"](tensor, src, group, *a, **k)

        for name, fn in (("all_to_all_single", all_to_all_single),
                         ("batch_isend_irecv", batch_isend_irecv), ("all_gather", all_gather),
                         ("broadcast", broadcast)):
            setattr(dist, name, fn)


def get_meter():
    """The process's meter when metering is enabled, else None."""
    global _METER
    if not os.environ.get("XDIT_COMM_METER"):
        return None
    if _METER is None:
        _METER = CommMeter()
    return _METER
