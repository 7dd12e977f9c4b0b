"""A checkpoint's bytes onto a GPU in large chunks, through two reusable pinned buffers.

Reading a tensor into a fresh host buffer and copying that pageable memory to the GPU makes
the driver stage it again, synchronously, tensor by tensor (~1 GB/s for FLUX.1-dev's 24 GB
from a warm page cache). Here a positioned read fills one pinned buffer while the other's
copy to the device runs; each buffer is reused once its last copy is done (a CUDA event),
so host memory stays at two chunks no larger than the checkpoint's largest tensor. The
device tensor gets exactly the file's bytes, reinterpreted as its dtype and shape, as
`Checkpoint.read` always returned (workers/loading/weights.py).
"""
from __future__ import annotations

import os

import torch

CHUNK = 64 * 2 ** 20  # bytes a buffer holds: one positioned read, one copy to the device


def fill(fd: int, view: memoryview, pos: int, path: str, name: str) -> None:
    """`view` filled from the file at `pos` (a short read continues; end of file raises)."""
    while view:
        got = os.preadv(fd, [view], pos)
        if got <= 0:
            raise ValueError(f"{path}: tensor {name!r} is truncated")
        view, pos = view[got:], pos + got


class Staging:
    """Two host buffers (pinned for a CUDA device) a checkpoint reads through onto `device`.
    `chunk`: bytes per buffer (the largest tensor's size bounds it: a small model's load
    pins no more than it needs)."""

    def __init__(self, device, chunk: int = CHUNK):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk = max(1, int(chunk))
        self.bufs = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self.cuda)
                     for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.done = [None, None]  # the event of each buffer's last copy (CUDA)
        self.turn = 0

    def read(self, fd: int, pos: int, n: int, dtype, shape, path: str, name: str):
        """The tensor stored in bytes [pos, pos + n) of the open file, on the device."""
        out = torch.empty(n, dtype=torch.uint8, device=self.device)
        at = 0
        while at < n:
            i, self.turn = self.turn, self.turn ^ 1
            if self.done[i] is not None:  # its previous copy must be out of the buffer
                self.done[i].synchronize()
            m = min(self.chunk, n - at)
            fill(fd, self.views[i][:m], pos + at, path, name)
            out[at:at + m].copy_(self.bufs[i][:m], non_blocking=self.cuda)
            if self.cuda:
                self.done[i] = torch.cuda.Event()
                self.done[i].record()
            at += m
        return out.view(dtype).view(shape)

    def close(self) -> None:
        """Wait for the copies in flight, then let the buffers go."""
        for ev in self.done:
            if ev is not None:
                ev.synchronize()
        self.done = [None, None]
        self.bufs, self.views = [], []
