"""Process groups for dp x cfg x pipefusion x ulysses x ring, built in one place, on two
planes.

Rank layout (outermost first): dp, cfg, pipefusion, ring, ulysses. Ulysses is innermost so
its all-to-all stays between neighbouring ranks (same NVLink island on a GPU box), and
within a sequence-parallel group `sp_rank = ring_rank * ulysses + ulysses_rank`, which is the
order yunchang's hybrid attention concatenates shards in.

Two planes (docs/design.md#communication-two-planes): every device group (NCCL on GPUs, gloo on
CPU) has a gloo twin with the same members. Data (activations, K/V, latents, predictions) moves
on the device groups with device tensors only; control (job broadcast, stop flags, shapes,
object gathers, stats) on the gloo twins with CPU tensors or objects. Idle ranks wait on the
control plane, never inside a device collective.

A Topology is immutable and passed explicitly; workers cache one per configuration (every
rank receives the same jobs in the same order, so `new_group` calls line up).

One door: every `torch.distributed` communication in workers/ goes through the functions at
the end of this module (collectives) or workers/parallel/p2p.py (point-to-point), never straight to
torch (tests/test_one_door.py). That is where the plane check lives: in the test modes
(NCCL-rules emulation, shared GPU) each call checks that its tensors suit its group's plane,
so a CPU tensor on a CUDA data plane fails on the first job instead of on a real NCCL box.
"""
from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .degrees import AXES  # the rank layout, outermost first (dp, cfg, pipefusion, ring, ulysses)

_CONTROL_GROUPS: set = set()  # ids of the gloo twins (filled as they are created, never later)


def is_control(group) -> bool:
    """Whether `group` is a control-plane (gloo twin) group: meters count the data plane."""
    return group is not None and id(group) in _CONTROL_GROUPS


def control_group(members):
    """A new gloo (control-plane) group of `members`; every rank calls it at the same
    point (a collective)."""
    g = dist.new_group(members, backend="gloo", timeout=_TIMEOUT)
    _CONTROL_GROUPS.add(id(g))
    return g


# Idle pools wait on rank 0's control broadcast indefinitely; hangs are caught by the host.
_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class World:
    """The whole pool: its rank, size, compute device, and the world group on each plane."""

    rank: int
    size: int
    device: Any  # torch.device of this rank's compute
    data: Any  # world device group (NCCL on CUDA, gloo on CPU)
    control: Any  # world gloo group


def init_world(rank: int, size: int, device: torch.device, store=None,
               backend: str = "", check_planes: bool = False) -> World:
    """`init_process_group` for this rank. On CUDA the device is set first and bound with
    `device_id` (NCCL then creates its communicator eagerly, on the right GPU). `backend`
    "gloo" on CUDA is the shared-GPU test mode (several ranks on one GPU; NCCL refuses).
    `check_planes` (test modes, from a worker hook's `ctx.options["check_planes"]`) turns
    on the plane check for this process's lifetime (`set_plane_check`)."""
    set_plane_check(device.type if check_planes else None)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kw = {"timeout": _TIMEOUT, "rank": rank, "world_size": size}
    if store is not None:
        kw["store"] = store
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if backend == "nccl":
            kw["device_id"] = device
    dist.init_process_group(backend, **kw)
    control = control_group(list(range(size)))
    return World(rank=rank, size=size, device=device, data=dist.group.WORLD, control=control)


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    degrees: dict  # axis -> degree
    coords: dict  # axis -> this rank's index along the axis
    groups: dict  # axis name (and "sp", "stage") -> device-plane ProcessGroup with this rank
    controls: dict  # the same names -> the gloo twin
    sp_rank: int
    device: Any = None

    @property
    def sp(self) -> int:
        return self.degrees["ulysses"] * self.degrees["ring"]

    def degree(self, axis: str) -> int:
        return self.degrees[axis]

    def index(self, axis: str) -> int:
        return self.coords[axis]

    def group(self, axis: str) -> Any:
        """Data plane: device tensors only."""
        return self.groups[axis]

    def control(self, axis: str) -> Any:
        """Control plane (gloo): CPU tensors and objects."""
        return self.controls[axis]

    def ring_pairs(self, axis: str) -> list:
        """Global rank pairs of neighbours along `axis`, closed into a ring (PipeFusion: each
        stage and the next, the last stage and stage 0; Ring attention: K/V neighbours)."""
        n = self.degrees[axis]
        ranks = [self.global_rank(**{axis: i}) for i in range(n)]
        return [(ranks[i], ranks[(i + 1) % n]) for i in range(n)]

    def global_rank(self, **coords) -> int:
        """Global rank of the rank whose coordinates equal ours except those given."""
        c = dict(self.coords, **coords)
        r = 0
        for axis in AXES:
            r = r * self.degrees[axis] + c[axis]
        return r


def build_topology(rank: int, world_size: int, dp: int, cfg: int, pipefusion: int,
                   ulysses: int, ring: int, device=None, groups: dict = None) -> Topology:
    """The process groups of one configuration. `groups` (the caller's, kept across
    configurations): {member ranks: (device group, gloo twin)}, so every set of ranks gets
    one pair of groups for the pool's lifetime, whichever axes and layouts use it. Each gloo
    group runs its own transport thread, so a pool that went through a dozen layouts would
    otherwise keep ~100 threads per rank waking up while idle. Every rank builds the same
    layouts in the same order, so every rank finds the same entries and `new_group` calls
    still line up."""
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
    cache = {} if groups is None else groups

    def make(varying: tuple) -> tuple:
        """Create every group along `varying` axes on both planes (collectively); return
        the pair that holds us."""
        fixed = [a for a in AXES if a not in varying]
        buckets: dict = {}
        for r in range(world_size):
            key = tuple(coords_of[r][a] for a in fixed)
            buckets.setdefault(key, []).append(r)
        found = None
        for key in sorted(buckets):
            members = tuple(buckets[key])
            if members not in cache:
                cache[members] = (dist.new_group(list(members), timeout=_TIMEOUT),
                                  control_group(list(members)))
            if rank in members:
                found = cache[members]
        return found

    names = {a: (a,) for a in AXES}
    names["sp"] = ("ring", "ulysses")
    names["stage"] = tuple(a for a in AXES if a != "pipefusion")  # same pipeline stage
    names["replicas"] = ("dp", "cfg")  # ranks holding distinct rows (model calls' gather)
    made = {n: make(v) for n, v in names.items()}
    sp_rank = mine["ring"] * ulysses + mine["ulysses"]
    return Topology(rank=rank, world_size=world_size, degrees=degrees, coords=mine,
                    groups={n: p[0] for n, p in made.items()},
                    controls={n: p[1] for n, p in made.items()}, sp_rank=sp_rank, device=device)


# -- the one door ---------------------------------------------------------------------------
# Thin wrappers over torch.distributed, called with the group (and plane) explicit. They look
# `dist.<name>` up at call time, so hooks that wrap torch.distributed (NCCL-rules emulation,
# the byte meter, the shared-GPU staging) still see every call, with the same arguments.

_DATA_DEVICE = None  # the data plane's device type while the plane check is on, else None


class PlaneError(RuntimeError):
    """A tensor (or object) on the wrong plane: what NCCL rejects or hangs on in production."""


def device_group(members: list, like) -> Any:
    """A new device-plane group of `members` on `like`'s backend (NCCL on GPUs, gloo on CPU
    and in the shared-GPU test mode): weight sharding's all-gathers get one of their own, so
    they never interleave with the world group's other traffic. Every rank calls it at the
    same point (a collective)."""
    return dist.new_group(members, backend=dist.get_backend(like))


def set_plane_check(data_device) -> None:
    """Check every call's tensors against its plane from now on: `data_device` is the
    pool's compute device type ("cuda" | "cpu"), None turns the check off. Set once per
    process, before any job (init_world), never during a forward."""
    global _DATA_DEVICE
    _DATA_DEVICE = None if data_device is None else torch.device(data_device).type


def plane_check() -> Any:
    """The data plane's device type while the check is on, else None."""
    return _DATA_DEVICE


def check_plane(op: str, group, tensors=(), objects: bool = False) -> None:
    """Raise PlaneError if `tensors` (or, with `objects`, the call itself) do not belong on
    `group`'s plane: control (gloo twins) carries CPU tensors and objects, data carries the
    pool's device tensors only. No-op while the check is off. On a CPU pool both planes
    expect CPU, so only a stray non-CPU tensor or an object collective on the data plane
    can fail there; the CPU-tensor-on-a-CUDA-data-plane case needs a CUDA pool (the
    shared-GPU mode) or a test that sets the check to "cuda"."""
    want = _DATA_DEVICE
    if want is None:
        return
    if is_control(group):
        for t in tensors:
            if t.device.type != "cpu":
                raise PlaneError(f"{op} on the control plane got a {t.device.type} tensor; "
                                 f"the control plane (gloo) carries cpu tensors only")
        return
    if objects:
        raise PlaneError(f"{op} on the data plane; objects travel on the control plane "
                         f"(the gloo twins, Topology.control / World.control) only")
    for t in tensors:
        if t.device.type != want:
            backend = "NCCL" if want == "cuda" else "gloo"
            raise PlaneError(f"{op} on the data plane got a {t.device.type} tensor; the "
                             f"pool's data plane carries {want} tensors only ({backend})")


def all_gather(parts: list, x: torch.Tensor, group) -> None:
    """`dist.all_gather`: every rank's `x` into `parts` (rank order)."""
    if _DATA_DEVICE is not None:
        check_plane("all_gather", group, [x, *parts])
    dist.all_gather(parts, x, group=group)


def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """`dist.all_gather_into_tensor`: every rank's `x` (each the same size) back to back in
    `out`, in rank order: one buffer, no list of parts."""
    if _DATA_DEVICE is not None:
        check_plane("all_gather_into_tensor", group, [x, out])
    dist.all_gather_into_tensor(out, x, group=group)


def gather(x: torch.Tensor, parts: Optional[list], dst: int, group) -> None:
    """`dist.gather`: every rank's `x` into `parts` (rank order) on global rank `dst`; the
    others pass None."""
    if _DATA_DEVICE is not None:
        check_plane("gather", group, [x, *(parts or [])])
    dist.gather(x, parts, dst=dst, group=group)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None,
                      in_splits=None) -> None:
    """`dist.all_to_all_single` along dim 0: even splits, or the given per-rank sizes (an
    uneven split's shards, workers/parallel/uneven.py)."""
    if _DATA_DEVICE is not None:
        check_plane("all_to_all_single", group, [out, inp])
    if out_splits is None and in_splits is None:
        dist.all_to_all_single(out, inp, group=group)
    else:
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)


def all_reduce(t: torch.Tensor, group, op: str = "sum") -> None:
    """`dist.all_reduce` in place; `op` names a `dist.ReduceOp` ("sum", "max", ...)."""
    if _DATA_DEVICE is not None:
        check_plane("all_reduce", group, [t])
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), group=group)


def broadcast(t: torch.Tensor, src: int, group) -> None:
    """`dist.broadcast` in place from global rank `src`."""
    if _DATA_DEVICE is not None:
        check_plane("broadcast", group, [t])
    dist.broadcast(t, src=src, group=group)


def barrier(group) -> None:
    """`dist.barrier` (the control plane: idle ranks never wait inside a device group)."""
    dist.barrier(group=group)


def all_gather_object(out: list, obj, group) -> None:
    """`dist.all_gather_object`: every rank's `obj` into `out` (control plane only)."""
    if _DATA_DEVICE is not None:
        check_plane("all_gather_object", group, objects=True)
    dist.all_gather_object(out, obj, group=group)


def gather_object(obj, out, dst: int, group) -> None:
    """`dist.gather_object` to global rank `dst` (`out` there, None elsewhere)."""
    if _DATA_DEVICE is not None:
        check_plane("gather_object", group, objects=True)
    dist.gather_object(obj, out, dst=dst, group=group)


def broadcast_object_list(objs: list, src: int, group) -> None:
    """`dist.broadcast_object_list` in place from global rank `src`."""
    if _DATA_DEVICE is not None:
        check_plane("broadcast_object_list", group, objects=True)
    dist.broadcast_object_list(objs, src=src, group=group)
