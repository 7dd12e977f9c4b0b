"""Process groups for dp x cfg x pipefusion x ulysses x ring, built in one place.

Rank layout (outermost first): dp, cfg, pipefusion, ring, ulysses. Ulysses is innermost so
its all-to-all stays between neighbouring ranks (same NVLink island on a GPU box), and
within a sequence-parallel group `sp_rank = ring_rank * ulysses + ulysses_rank`, which is the
order yunchang's hybrid attention concatenates shards in.

A Topology is immutable and passed explicitly; workers cache one per configuration (every
rank receives the same jobs in the same order, so `new_group` calls line up).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

AXES = ("dp", "cfg", "pipefusion", "ring", "ulysses")


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    degrees: dict  # axis -> degree
    coords: dict  # axis -> this rank's index along the axis
    groups: dict  # axis name (and "sp") -> ProcessGroup containing this rank
    sp_rank: int

    @property
    def sp(self) -> int:
        return self.degrees["ulysses"] * self.degrees["ring"]

    def degree(self, axis: str) -> int:
        return self.degrees[axis]

    def index(self, axis: str) -> int:
        return self.coords[axis]

    def group(self, axis: str) -> Any:
        return self.groups[axis]

    def global_rank(self, **coords) -> int:
        """Global rank of the rank whose coordinates equal ours except those given."""
        c = dict(self.coords, **coords)
        r = 0
        for axis in AXES:
            r = r * self.degrees[axis] + c[axis]
        return r


def build_topology(rank: int, world_size: int, dp: int, cfg: int, pipefusion: int,
                   ulysses: int, ring: int) -> Topology:
    degrees = {"dp": dp, "cfg": cfg, "pipefusion": pipefusion, "ring": ring, "ulysses": ulysses}
    product = dp * cfg * pipefusion * ring * ulysses
    if product != world_size:
        raise ValueError(f"world size {world_size} != dp {dp} x cfg {cfg} x pipefusion "
                         f"{pipefusion} x ulysses {ulysses} x ring {ring} = {product}")
    sizes = [degrees[a] for a in AXES]
    coords_of = {}
    for r, c in enumerate(itertools.product(*[range(s) for s in sizes])):
        coords_of[r] = dict(zip(AXES, c))
    mine = coords_of[rank]

    def make(varying: tuple) -> Any:
        """Create every group along `varying` axes (collectively); return the one with us."""
        fixed = [a for a in AXES if a not in varying]
        buckets: dict = {}
        for r in range(world_size):
            key = tuple(coords_of[r][a] for a in fixed)
            buckets.setdefault(key, []).append(r)
        found = None
        for key in sorted(buckets):
            members = buckets[key]
            g = dist.new_group(members)
            if rank in members:
                found = g
        return found

    groups = {a: make((a,)) for a in AXES}
    groups["sp"] = make(("ring", "ulysses"))
    groups["stage"] = make(tuple(a for a in AXES if a != "pipefusion"))  # same pipeline stage
    sp_rank = mine["ring"] * ulysses + mine["ulysses"]
    return Topology(rank=rank, world_size=world_size, degrees=degrees, coords=mine,
                    groups=groups, sp_rank=sp_rank)
