"""A step's guidance passes: the forward passes the loop runs per step and combines.

Every family runs the conditional pass and, with CFG, the unconditional one. A family's
pipeline may run more (a family declares them: its adapter's `guidance_passes`), each a
forward of the same latents with something changed: some blocks' self-attention skipped, a
cross-attention turned off. Each `Pass` names what it changes as forward inputs (`changes`,
added to the step's `extra` for that call), so a pass is one ordinary call of the adapter's
forward, with nothing in the process altered while it runs. The adapter's `guide` combines
the passes' predictions (its pipeline's guidance formula).

CFG parallel spreads the passes over the cfg ranks in turn: pass p runs on cfg rank
p % degree (the unconditional pass first, so on cfg 2 the negative prompt stays on cfg rank
0 and the positive on cfg rank 1; at a degree equal to the pass count each pass has its own
ranks), and one all-gather per step brings every rank every pass's prediction. Each rank's
combination is then the same arithmetic on the same tensors as one rank running the passes
in turn. Where the passes do not split evenly (three on two ranks, four on three), a rank
with fewer stacks a zero slot in the gather; under weight sharding (whose all-gathers need
every rank to run every block equally often) it runs its last pass once more instead, its
result unread. A degree above the pass count is refused (`check_degree`): a rank with no
pass would only wait.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..messages import cfg_degree_refusal
from ..parallel.topology import all_gather


@dataclass(frozen=True)
class Pass:
    """One forward pass of a step."""

    name: str  # "uncond", "cond", or a family's own ("stg", "modality")
    negative: bool = False  # reads the negative prompt's states (else the positive's)
    changes: tuple = ()  # (input, value) pairs the adapter's forward reads from `extra`

    def extra(self, extra: dict) -> dict:
        """The step's forward inputs for this pass."""
        return dict(extra, **dict(self.changes)) if self.changes else extra


UNCOND = Pass("uncond", negative=True)
COND = Pass("cond")


def check_degree(passes, degree: int) -> None:
    """Refuse a cfg degree above the step's pass count, in one line naming both."""
    refusal = cfg_degree_refusal(degree, [p.name for p in passes])
    if refusal:
        raise ValueError(refusal)


def assigned(n: int, degree: int, index: int) -> list:
    """The passes (indices) cfg rank `index` of `degree` runs: in turn, p % degree."""
    return list(range(index, n, degree))


def forwards_per_rank(n: int, degree: int) -> int:
    return -(-n // degree)


def gather_passes(mine: list, n: int, degree: int, group) -> list:
    """Every pass's prediction from this rank's (`mine`: its assigned passes' in order, padded
    to forwards_per_rank by the caller or here with zeros), in one all-gather over the cfg
    group."""
    k = forwards_per_rank(n, degree)
    slots = list(mine) + [torch.zeros_like(mine[0])] * (k - len(mine))
    stack = torch.stack(slots[:k]).contiguous()
    parts = [torch.empty_like(stack) for _ in range(degree)]
    all_gather(parts, stack, group=group)
    return [parts[p % degree][p // degree] for p in range(n)]
