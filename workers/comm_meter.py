"""Counts the bytes each rank sends through torch.distributed (benchmarks only).

Enabled in a worker by `XDIT_COMM_METER=1`; wraps the collectives this package and yunchang
use, in the worker process only. A rank's count is what leaves it: the part of an
all-to-all it keeps is not counted, an all-gather sends its shard to each peer, a broadcast
counts on its source, a point-to-point message on its sender. Kinds: "all_to_all"
(all_to_all_single and list all_to_all), "p2p" (batch_isend_irecv: Ring attention, the
VAE's halo exchange), "send" (plain isend/send: PipeFusion's activations and latent rows,
dp's results), "all_gather", "broadcast". Receives are not counted (the sender counts them).
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
                ("all_to_all_single", "all_to_all", "batch_isend_irecv", "all_gather",
                 "broadcast", "isend", "send", "P2POp")}

        def all_to_all_single(output, input, *a, group=None, **k):
            n = _size(group)
            self._count("all_to_all", _nbytes(input) * (n - 1) / n)
            return orig["all_to_all_single"](output, input, *a, group=group, **k)

        def all_to_all(output_tensor_list, input_tensor_list, group=None, *a, **k):
            me = dist.get_rank(group)
            self._count("all_to_all", sum(_nbytes(t) for i, t in enumerate(input_tensor_list)
                                          if i != me))
            return orig["all_to_all"](output_tensor_list, input_tensor_list, group, *a, **k)

        def isend(tensor, *a, **k):
            self._count("send", _nbytes(tensor))
            return orig["isend"](tensor, *a, **k)

        def send(tensor, *a, **k):
            self._count("send", _nbytes(tensor))
            return orig["send"](tensor, *a, **k)

        def unwrap(op):
            return orig["isend"] if op is isend else orig["send"] if op is send else op

        class P2POp(orig["P2POp"]):
            """torch checks a P2POp's op by identity with its own isend/irecv (and calls it
            inside batch_isend_irecv): code that passes `dist.isend`, now the wrapper above,
            gets the original, so batched sends are counted once, as "p2p"."""

            def __new__(cls, op, *a, **k):
                return orig["P2POp"].__new__(cls, unwrap(op), *a, **k)

            def __init__(self, op, *a, **k):
                super().__init__(unwrap(op), *a, **k)

        def batch_isend_irecv(ops):
            for op in ops:
                op.op = unwrap(op.op)
            sent = sum(_nbytes(op.tensor) for op in ops if op.op is orig["isend"])
            self._count("p2p", sent)
            return orig["batch_isend_irecv"](ops)

        def all_gather(tensor_list, tensor, group=None, *a, **k):
            self._count("all_gather", _nbytes(tensor) * (_size(group) - 1))
            return orig["all_gather"](tensor_list, tensor, group, *a, **k)

        def broadcast(tensor, src=None, group=None, *a, **k):
            if dist.get_rank() == src:
                self._count("broadcast", _nbytes(tensor) * (_size(group) - 1))
            return orig["broadcast"](tensor, src, group, *a, **k)

        for name, fn in (("all_to_all_single", all_to_all_single), ("all_to_all", all_to_all),
                         ("batch_isend_irecv", batch_isend_irecv), ("all_gather", all_gather),
                         ("broadcast", broadcast), ("isend", isend), ("send", send),
                         ("P2POp", P2POp)):
            setattr(dist, name, fn)


def get_meter():
    """The process's meter when metering is enabled, else None."""
    global _METER
    if not os.environ.get("XDIT_COMM_METER"):
        return None
    if _METER is None:
        _METER = CommMeter()
    return _METER
