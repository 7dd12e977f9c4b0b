"""The step cache's settings (workers/sampling/step_cache.py has the rule), defined once for
the host's request and CLI, the Step cache (xDiT) node and the workers. Cheap to import (no
torch): the host and its nodes read it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheSettings:
    """The defaults are the cache as switched on
    (the node connected, the CLI's bare --cache); a request without settings runs no cache,
    and threshold 0 turns it off (every call computes). 0.08 is First Block Cache's
    suggestion for FLUX.1 (ParaAttention), not a figure measured here."""
    threshold: float = 0.08  # skip when the head residual changed less than this (relative)
    warmup: int = 2  # calls per row that always compute
    head: int = 1  # first blocks that always run (their residual is the measure)
    tail: int = 0  # last blocks that always run
    max_skips: int = 3  # consecutive skipped calls per row; 0: no limit
    taylor: bool = False  # first-order forecast of the skipped residual

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def to_dict(self) -> dict:
        """Every field, by name."""
        return asdict(self)

    def to_wire(self) -> dict:
        """A job's and a model call's settings on the wire (workers/runtime/protocol.py)."""
        return self.to_dict()

    @classmethod
    def from_wire(cls, d) -> "CacheSettings":
        """A wire dict (or settings of either package name) -> CacheSettings."""
        return cls.from_dict(d if isinstance(d, dict) else d.to_dict())

    @classmethod
    def from_dict(cls, d: dict | None) -> "CacheSettings":
        """The request's `cache` dict (fields it leaves out take these defaults)."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown cache setting(s) {', '.join(unknown)}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**d)

    def problems(self) -> list:
        """What is wrong whatever the model, one line each."""
        out = []
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0 <= self.threshold < math.inf:
            out.append(f"cache threshold must be a number >= 0 (0 = off), got "
                       f"{self.threshold!r}")
        for name in ("warmup", "head", "tail", "max_skips"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                out.append(f"cache {name} must be an integer >= 0, got {v!r}")
        if self.head == 0:
            out.append("cache head blocks must be >= 1 (their residual is the measure)")
        if not isinstance(self.taylor, bool):
            out.append(f"cache taylor must be true or false, got {self.taylor!r}")
        return out

    def check(self, blocks: int, first_list: int) -> None:
        """One clear line for settings this transformer cannot take."""
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])
        if not 1 <= self.head <= first_list:
            raise ValueError(f"cache head blocks must be 1..{first_list} (the first block list "
                             f"of this model), got {self.head}")
        if self.head + self.tail >= blocks:
            raise ValueError(f"cache head ({self.head}) + tail ({self.tail}) blocks leave none "
                             f"of the model's {blocks} blocks to skip; use head + tail <= "
                             f"{blocks - 1}")
