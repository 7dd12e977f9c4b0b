"""A PipeFusion job's activation slots at a stage's boundaries (the strategy fills and empties
them; the stage's boundary hooks, workers/loading/stages.py, read and write them through the
call's PatchPlan)."""
from __future__ import annotations

from typing import Optional

import torch


def carried_context(plan, sp_rank: int) -> int:
    """Tokens of the streams the blocks carry beside the latent's on `sp_rank` (the sharded
    ones: a replicated stream, Wan's text, is each block's input, not its output)."""
    return sum(plan.sizes(s)[sp_rank] for s in plan.context_streams())


def stage_transfers(plan, sp_rank: int, batch: int, width: int, states, dtype) -> list:
    """[(shape, dtype)] of what a stage hands the next for `plan`'s micro on `sp_rank`: one
    tensor per stage state (`states`: ((keyword, stream, width), ...)), or one [context,
    latent] tensor `width` wide; all in the blocks' dtype. The one rule both sides of the
    transfer read (the sender checks its tensors against it, the receiver posts it), so a
    pair's sizes and dtypes agree: under NCCL a mismatch hangs. A state of no tokens (the
    sound off a step's first patch) is listed, and neither sent nor received."""
    if states:
        return [((batch, plan.sizes(s)[sp_rank], w), dtype) for _, s, w in states]
    tokens = carried_context(plan, sp_rank) + plan.sizes(plan.latent_stream)[sp_rank]
    return [((batch, tokens, width), dtype)]


class Activations:
    """One job's activation slots at this stage's boundaries: what the previous stage sent
    for this tick's patch, and what the last block produced for the next stage."""

    def __init__(self, sp_rank: int):
        self.sp_rank = sp_rank
        self.incoming: Optional[torch.Tensor] = None
        self.outgoing: Optional[torch.Tensor] = None

    def receive(self, plan, joined: bool = False):
        """The previous stage's [context, latent] activations (the context: the sharded
        streams the blocks carry beside the latent's, the text): split in two, or as one
        joined tensor for a block that takes the streams joined (FLUX.2's single blocks)."""
        buf, self.incoming = self.incoming, None
        t = carried_context(plan, self.sp_rank)
        want = t + plan.sizes(plan.latent_stream)[self.sp_rank]
        if buf is None or buf.shape[1] != want:
            got = None if buf is None else tuple(buf.shape)
            raise RuntimeError(f"pipeline activations {got} do not fit the patch ({want} tokens)")
        return buf if joined else (buf[:, :t], buf[:, t:])

    def receive_states(self, plan) -> list:
        """The previous stage's states, one tensor each (the plan's `states`), for blocks
        that take several streams by keyword."""
        bufs, self.incoming = self.incoming, None
        want = [plan.sizes(stream)[self.sp_rank] for _, stream in plan.states]
        got = None if not isinstance(bufs, list) else [b.shape[1] for b in bufs]
        if got != want:
            raise RuntimeError(f"pipeline states of {got} tokens do not fit the patch ({want})")
        return bufs

    def send_states(self, outputs) -> None:
        self.outgoing = list(outputs)

    def send(self, encoder_hidden_states, hidden_states) -> None:
        parts = [hidden_states] if encoder_hidden_states is None \
            else [encoder_hidden_states, hidden_states]
        self.outgoing = torch.cat(parts, dim=1)

    def take(self) -> torch.Tensor:
        out, self.outgoing = self.outgoing, None
        if out is None:
            raise RuntimeError("the stage produced no activations for the next stage")
        return out

    def clear(self) -> None:
        self.incoming = self.outgoing = None
