"""A parallel layout's degrees, by axis name: what a job or a model call runs on, and what the
workers key their process groups on. Cheap to import (no torch): the host builds it from its
ParallelConfig and the protocol carries it.

`AXES` is the rank layout's order, outermost first (workers/parallel/topology.py); a
`Degrees` is read and compared by name only, so no caller depends on that order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """The degree on every axis; `cfg` is 1 or 2 (the guidance branches)."""

    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ring: int = 1
    ulysses: int = 1

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"degree {axis} must be an integer >= 1 (got {v!r})")
        if self.cfg > 2:
            raise ValueError(f"degree cfg is 1 or 2 (the guidance branches), got {self.cfg}")

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

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d) -> "Degrees":
        """A wire dict (or a Degrees of either package name) -> Degrees; every axis named."""
        if not isinstance(d, dict):
            d = {a: getattr(d, a, None) for a in AXES}
        if set(d) != set(AXES):
            raise ValueError(f"degrees must name exactly the axes {list(AXES)} (got "
                             f"{sorted(d)})")
        return cls(**d)


AXES = tuple(f.name for f in fields(Degrees))
