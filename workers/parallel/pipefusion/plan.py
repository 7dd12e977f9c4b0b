"""A patch forward's SequencePlan: which tokens one PipeFusion call computes.

A patch covers the latent stream's tokens `image_range` and, for a guidance branch's first
patch of a step only, every other stream's (the text, and whatever context the layout
declares: `with_text`); the sp ranks split those near-evenly, as for a whole forward. The
plan reaches every hook and attention call of the forward (through
`joint_attention_kwargs["sp_plan"]`, workers/parallel/sequence_parallel.py), so it also carries
the job's per-call state: the K/V cache the attention reads and refreshes, and the activation
slots the stage boundary hooks read and fill. Nothing comes from a global.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sequence_parallel import SequencePlan


@dataclass(frozen=True)
class PatchPlan(SequencePlan):
    image_range: tuple = (0, 0)  # (start, stop) of the image tokens computed
    with_text: bool = True
    branch: int = 1  # 0 = negative, 1 = positive (separate K/V caches)
    # ((block keyword, stream), ...): the states a stage passes on, where the blocks take
    # several by keyword (the adapter's `stage_states`); () for one state
    states: tuple = ()
    cache: Any = field(default=None, compare=False, repr=False)  # cache.KVCache of the job
    activations: Any = field(default=None, compare=False, repr=False)  # stages.Activations

    def selected(self, stream: str) -> tuple:
        if stream == self.latent_stream:
            return self.image_range[0], self.image_range[1] - self.image_range[0]
        return 0, (self.full_len(stream) if self.with_text else 0)

    __hash__ = SequencePlan.__hash__  # the counts' items, not the dict

    def key(self, streams) -> tuple:
        """What the token positions of an attention call over `streams` depend on."""
        return (self.counts(), self.image_range, self.with_text, tuple(streams),
                tuple(self.sharded(s) for s in streams))
