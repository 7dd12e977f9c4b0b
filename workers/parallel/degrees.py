"""A parallel layout's degrees, by axis name: what a job or a model call runs on, and what the
workers key their process groups on. Cheap to import (no torch): the host builds it from its
ParallelConfig and the protocol carries it.

`AXES` is the rank layout's order, outermost first (workers/parallel/topology.py); a
`Degrees` is read and compared by name only, so no caller depends on that order.

`split`: per-rank weights for GPUs of different speed or memory (workers/parallel/shares.py),
one per world rank; empty (the default) is the even split. It is not an axis: process groups
are keyed on `axes()` alone, and the wire leaves it out when even.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .shares import check_weights, is_even


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """The degree on every axis; `cfg`: the ranks a step's guidance passes are spread over
    (workers/sampling/guidance.py)."""

    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ring: int = 1
    ulysses: int = 1
    split: tuple = ()  # per-rank weights (module doc); () even

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"degree {axis} must be an integer >= 1 (got {v!r})")
        w = tuple(self.split or ())
        problems = check_weights(w, self.world)
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "split", () if is_even(w) else w)

    @property
    def sp(self) -> int:
        """Ranks one sequence is split over (Ulysses x Ring)."""
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ring * self.ulysses

    def describe(self) -> str:
        return " x ".join(f"{a} {getattr(self, a)}" for a in ("dp", "cfg", "pipefusion",
                                                               "ulysses", "ring"))

    def axes(self) -> dict:
        """The degree per axis: what process groups are built on."""
        return {a: getattr(self, a) for a in AXES}

    def coordinate(self, rank: int, axis: str) -> int:
        """A rank's index along `axis` in the rank layout (AXES, outermost first), as the
        topology numbers its groups."""
        index = int(rank)
        for a in reversed(AXES[AXES.index(axis) + 1:]):
            index //= getattr(self, a)
        return index % getattr(self, axis)

    def evenly(self) -> "Degrees":
        """The same layout split evenly (the key of its process groups)."""
        return replace(self, split=()) if self.split else self

    def to_wire(self) -> dict:
        d = self.axes()
        if self.split:
            d["split"] = list(self.split)
        return d

    @classmethod
    def from_wire(cls, d) -> "Degrees":
        """A wire dict (or a Degrees of either package name) -> Degrees; every axis named."""
        if not isinstance(d, dict):
            d = {a: getattr(d, a, None) for a in AXES} | {"split": getattr(d, "split", ())}
        if set(d) - {"split"} != set(AXES):
            raise ValueError(f"degrees must name exactly the axes {list(AXES)} (got "
                             f"{sorted(d)})")
        return cls(**dict(d, split=tuple(d.get("split") or ())))


AXES = ("dp", "cfg", "pipefusion", "ring", "ulysses")  # outermost first
