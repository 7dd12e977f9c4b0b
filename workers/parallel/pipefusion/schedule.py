"""PipeFusion's tick table for one job: which micro-batch each pipeline stage computes when,
and which transfers happen between ticks. Every rank builds the same table from the job, so
point-to-point transfers are matched by construction.

A micro-batch is one transformer forward: one guidance branch of one patch (row band) of one
step. Stage `s` computes micro `m` at tick `start[m] + s`, so the stages work on successive
patches at once. The denoising loop's step `i` is the ticks from that step's first micro on
stage 0 up to the next step's (`ticks_of`): its stop decision falls at the same tick on
every rank.

Between ticks, each rank does one grouped exchange (workers/parallel/p2p.py) with its neighbours:
stage s sends the activations of the micro it computed at the previous tick to stage s+1
(which computes that micro now), and the last stage sends the latent rows a micro finished
(its guidance is complete and its Euler step taken) back to stage 0, which needs them for the
same rows of the next step. Sends and receives between two ranks therefore happen at the same
tick on both sides, in one `batch_isend_irecv` each: NCCL's pair ordering cannot deadlock.

Stage 0 may start micro m of step i only once the rows it covers of step i-1 have come back:
`start[m] >= start[d] + stages` for every micro d of step i-1 that finishes rows overlapping
m's. That is the only wait; with `patches >= stages` the pipeline never stalls after warmup.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..sequence_parallel import even_sizes


@dataclass(frozen=True)
class Micro:
    index: int
    step: int
    patch: int
    rows: tuple  # token rows (r0, r1)
    branch: int  # 0 = negative, 1 = positive
    with_text: bool  # the branch's first patch of a step also computes the text tokens
    finishes: bool  # the patch's last branch: after it the patch's rows of the step are final


def patch_rows(rows: int, patches: int) -> list:
    """Token-row bands of near-equal height."""
    out, r = [], 0
    for s in even_sizes(rows, patches):
        out.append((r, r + s))
        r += s
    return out


@dataclass
class Schedule:
    stages: int
    steps: int
    rows: int
    micros: list  # Micro, in stage 0's order
    start: list  # stage-0 tick of each micro

    @property
    def ticks(self) -> int:
        """Ticks of the job: the last micro leaves the last stage, its rows travel once more."""
        return self.start[-1] + self.stages + 1

    def __post_init__(self):
        self._compute = {}
        for m, t in zip(self.micros, self.start):
            for s in range(self.stages):
                self._compute[(s, t + s)] = m
        self._arrive: dict = {}  # tick -> micros whose rows reach stage 0 then
        self._step_done: dict = {}  # tick -> steps whose every row has reached stage 0
        last_arrival = {}
        for m, t in zip(self.micros, self.start):
            if m.finishes:
                self._arrive.setdefault(t + self.stages, []).append(m)
                last_arrival[m.step] = t + self.stages
        for step, t in last_arrival.items():
            self._step_done.setdefault(t, []).append(step)
        self._step_start = {}
        for m, t in zip(self.micros, self.start):
            self._step_start.setdefault(m.step, t)

    def ticks_of(self, step: int) -> range:
        """The loop's step `step`: from its first micro on stage 0 to the next step's (the
        last step runs to the end, draining the pipeline)."""
        stop = self._step_start.get(step + 1, self.ticks)
        return range(self._step_start[step], stop)

    def compute_at(self, stage: int, tick: int) -> Optional[Micro]:
        return self._compute.get((stage, tick))

    def arrivals(self, tick: int) -> list:
        """Micros whose finished rows the last stage sends to stage 0 at this tick."""
        return self._arrive.get(tick, [])

    def steps_done(self, tick: int) -> list:
        """Steps whose output rows are all on stage 0 after this tick's exchange."""
        return self._step_done.get(tick, [])


def whole_steps(steps: int, warmup: int, restarts=()) -> set:
    """Steps that run the whole image as one patch: the first `warmup`, and `warmup` from
    each step in `restarts` (where another expert takes over: its K/V caches hold nothing
    yet, so it warms up as the first one did)."""
    return {i for s in (0, *restarts) for i in range(s, min(s + warmup, steps))}


def build_schedule(steps: int, stages: int, rows: int, branches: list, warmup: int,
                   patches: int, restarts=()) -> Schedule:
    """`branches`: the guidance branches this pipeline computes, in order ([1] without CFG
    or for the positive cfg rank, [0] for the negative one, [0, 1] for both).
    Warmup steps (`whole_steps`) run the whole image as one patch; the others run `patches`
    row bands."""
    whole = whole_steps(steps, warmup, restarts)
    micros, start = [], []
    finished_at: list = []  # (rows, tick its rows are back on stage 0) of the previous step
    tick = -1
    for i in range(steps):
        bands = patch_rows(rows, 1 if i in whole else min(patches, rows))
        now = []
        for p, band in enumerate(bands):
            for j, b in enumerate(branches):
                ready = max([t for (r0, r1), t in finished_at if r0 < band[1] and band[0] < r1],
                            default=0)
                tick = max(tick + 1, ready)
                m = Micro(len(micros), i, p, band, b, p == 0, j == len(branches) - 1)
                micros.append(m)
                start.append(tick)
                if m.finishes:
                    now.append((band, tick + stages))
        finished_at = now
    return Schedule(stages=stages, steps=steps, rows=rows, micros=micros, start=start)
