"""Each rank's own speed, measured during a job: what `auto` weights its split by
(workers/parallel/shares.py).

In a sequence-parallel step every rank waits for the slowest at each attention's exchange,
so a rank's wall time says nothing of its speed. What is its own is the time inside the
transformer blocks outside their attention modules (the per-token layers: norms,
modulation, MLP; the attention's exchange and kernel are left out, its kernel costs every
rank alike under Ulysses). Its work is the rows x tokens those blocks were given. A rank's
speed is work / own seconds; the host turns the ranks' speeds into the next job's weights.

Forward hooks time the blocks and the attention modules; on CUDA each hook synchronizes
the device (only while measuring: a job with `auto` asks for it).
"""
from __future__ import annotations

import contextlib
import time

import torch


def _first_tokens(args, kwargs) -> int:
    """rows x tokens of the block's first [B, S, D] input (its hidden states)."""
    for t in (*args, *kwargs.values()):
        if torch.is_tensor(t) and t.dim() == 3:
            return int(t.shape[0]) * int(t.shape[1])
    return 0


class ShareMeter:
    def __init__(self, device):
        self.sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        self.block_s = self.attention_s = 0.0
        self.work = 0
        self._started: dict = {}

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def _pre(self, kind):
        def hook(module, args, kwargs):
            if kind == "block":
                self.work += _first_tokens(args, kwargs)
            self._started[id(module)] = self._now()
        return hook

    def _post(self, kind):
        def hook(module, args, kwargs, output):
            dt = self._now() - self._started.pop(id(module), self._now())
            if kind == "block":
                self.block_s += dt
            else:
                self.attention_s += dt
        return hook

    @contextlib.contextmanager
    def measuring(self, transformers, block_lists):
        handles = []
        for tr in transformers:
            for name in block_lists:
                for block in getattr(tr, name, ()):
                    handles.append(block.register_forward_pre_hook(self._pre("block"),
                                                                   with_kwargs=True))
                    handles.append(block.register_forward_hook(self._post("block"),
                                                               with_kwargs=True))
                    for m in block.modules():
                        if getattr(m, "processor", None) is not None:
                            handles.append(m.register_forward_pre_hook(
                                self._pre("attention"), with_kwargs=True))
                            handles.append(m.register_forward_hook(
                                self._post("attention"), with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def report(self) -> dict:
        own = max(self.block_s - self.attention_s, 1e-9)
        return {"own_s": round(own, 6), "block_s": round(self.block_s, 6),
                "attention_s": round(self.attention_s, 6), "work": self.work,
                "speed": self.work / own if self.work else None}
