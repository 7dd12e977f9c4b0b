"""Weight sharding with shard sizes by weight (`shard_split`, GPUs of different memory).

FSDP2 (workers/parallel/sharding.py, the even split) splits every parameter into equal dim-0
chunks and cannot do otherwise, so a 16 GB card holds as much of the weights as a 24 GB one.
Where the shard split is uneven, this module shards instead, on the same units and the same
rules:

- Units: every block of the adapter's block lists is one unit, and the transformer itself is
  the root unit, holding what is left (embedders, norms, projections out).
- Each parameter is split on dim 0 by the weights (workers/parallel/shares.py: exact
  fractions, largest remainder; a 0-dim parameter is one row, held by one rank). A rank keeps
  its rows of every parameter of a unit in one flat byte buffer, so one all-gather moves a
  whole unit whatever its dtypes (fp8 weights beside bf16 biases, GGUF blocks as bytes).
- Between forwards a parameter keeps its full shape with no storage (what a module reads
  outside a forward is its shape, dtype and device); a unit's forward pre-hook all-gathers
  the unit's buffers and assembles each parameter from the ranks' rows, in rank order; its
  post-forward hook drops them again. The root unit is whole for the transformer's whole
  forward, a block for its own forward.
- A rank's rows of all its units sit back to back in one byte buffer, sized once so that
  each unit's window of the unit's largest share fits from where its rows start
  (workers/parallel/shares.py `gather_buffer`): the unit's all-gather
  (`all_gather_into_tensor`, equal sizes as NCCL takes them) sends that window as it is, no
  padded copy, and each rank trims what ran past a shorter share. Each rank receives
  (world - 1) x the largest share per unit, not the others' exact shares. Peak inside a
  block: the gather's receive buffer (world x the largest share) and the assembled block,
  briefly both. The gather is not prefetched: it does not overlap the previous block's
  compute as FSDP2's does. A parameter may have no rows on a rank (fewer rows than ranks),
  or none at all.

Exactness: an all-gather copies bytes, and each parameter is reassembled from its rows in
order, so every block computes with the unsharded model's bits. The deadlock rule is FSDP's:
every rank runs every unit's forward the same number of times in the same order (the
denoising loop does; host-sampler calls run a dummy row on an empty replica; the step cache
makes its skip unanimous; `is_sharded` tells them).

The shard-only loader (workers/loading/shards.py) reads each rank's own rows through
`materialize`, `local_params` and `row_range`, the same three calls it makes on FSDP2's
sharding.
"""
from __future__ import annotations

import torch

from .shard_counts import sharding_counts
from .shares import gather_buffer, share_sizes

ALIGN = 16  # bytes: every parameter's rows start aligned in a unit's buffer (dtype views)


def _freed(shape, dtype, device) -> torch.Tensor:
    """A tensor of `shape` whose storage holds nothing (its shape, dtype and device stay)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Param:
    """One parameter of a unit: where it lives, its full shape and every rank's rows."""

    def __init__(self, name, module, attr, p, weights):
        self.name, self.module, self.attr = name, module, attr
        self.shape, self.dtype = tuple(p.shape), p.dtype
        rows = self.shape[0] if self.shape else 1
        self.row_numel = (p.numel() // rows) if rows else 0
        self.row_bytes = self.row_numel * p.element_size()
        self.rows = share_sizes(rows, weights)  # per rank
        self.starts = [sum(self.rows[:r]) for r in range(len(self.rows))]

    @property
    def param(self):
        return self.module._parameters[self.attr]


class _Unit:
    """A module's parameters held as this rank's rows in one byte buffer."""

    def __init__(self, module, entries, world):
        self.module, self.params = module, entries
        self.offsets = []  # per rank: [byte offset of each parameter's rows]
        self.sizes = []  # per rank: bytes of its buffer
        for r in range(world):
            at, offs = 0, []
            for e in entries:
                offs.append(at)
                at += _up(e.rows[r] * e.row_bytes)
            self.offsets.append(offs)
            self.sizes.append(at)
        self.largest = max(self.sizes)
        self.buffer = None  # this rank's rows (uint8), a view of the sharding's one buffer
        self.window = None  # what this rank sends in the unit's all-gather: `largest` bytes
        self.gathered = False

    def local(self, i: int, rank: int) -> torch.Tensor:
        e = self.params[i]
        at = self.offsets[rank][i]
        flat = self.buffer[at:at + e.rows[rank] * e.row_bytes]
        return flat.view(e.dtype).view((e.rows[rank],) + (e.shape[1:] if e.shape else ()))

    def numel(self) -> int:
        return sum(int(torch.Size(e.shape).numel()) for e in self.params)


class UnevenWeightSharding:
    """One transformer's blocks and root sharded by `weights`, one per rank of `group`."""

    def __init__(self, transformer, block_lists, group, device, weights, rank):
        self.world, self.rank, self.group = len(weights), rank, group
        self.weights = tuple(weights)
        self.device = torch.device(device)
        self.transformer = transformer
        self.blocks = [b for name in block_lists for b in getattr(transformer, name)]
        if not self.blocks:
            raise RuntimeError("no transformer blocks to shard")
        self.block_numels = [sum(p.numel() for p in b.parameters()) for b in self.blocks]
        names = {id(p): n for n, p in transformer.named_parameters()}
        taken: set = set()
        self.units = []
        for module in [*self.blocks, transformer]:  # blocks first: the root takes the rest
            entries = []
            for mname, sub in module.named_modules():
                for attr, p in sub._parameters.items():
                    if p is None or id(p) in taken:
                        continue
                    taken.add(id(p))
                    entries.append(_Param(names[id(p)], sub, attr, p, self.weights))
            self.units.append(_Unit(module, entries, self.world))
        self.root_numel = self.units[-1].numel()
        self.by_name = {e.name: (u, i) for u in self.units for i, e in enumerate(u.params)}
        for u in self.units:
            u.module._xdit_sharded = True  # is_sharded (workers/parallel/sharding.py)
            u.module.register_forward_pre_hook(lambda m, a, u=u: self.gather(u))
            u.module.register_forward_hook(lambda m, a, o, u=u: self.release(u))
        self.buffer = None  # this rank's rows of every unit (`_allocate`)
        if not any(p.is_meta for p in transformer.parameters()):
            self._shard_loaded()
        self.load_mode = None
        self.probe = None
        self.others: list = []

    # -- placing the rows --------------------------------------------------------------

    def _allocate(self) -> None:
        starts, length = gather_buffer([u.sizes[self.rank] for u in self.units],
                                       [u.largest for u in self.units])
        self.buffer = torch.zeros(length, dtype=torch.uint8, device=self.device)
        for u, at in zip(self.units, starts):
            u.buffer = self.buffer[at:at + u.sizes[self.rank]]
            u.window = self.buffer[at:at + u.largest]

    def _empty_params(self) -> None:
        for u in self.units:
            for e in u.params:
                # made once: a release swaps it back in rather than allocating the whole
                # parameter each forward only to free it
                e.empty = _freed(e.shape, e.dtype, self.device)
                e.module._parameters[e.attr] = torch.nn.Parameter(e.empty, requires_grad=False)

    def _shard_loaded(self) -> None:
        """A whole-loaded transformer: keep this rank's rows, drop the rest."""
        self._allocate()
        with torch.no_grad():
            for u in self.units:
                for i, e in enumerate(u.params):
                    r0 = e.starts[self.rank]
                    whole = e.param.detach().reshape((-1,) + (e.shape[1:] if e.shape else ()))
                    u.local(i, self.rank).copy_(whole[r0:r0 + e.rows[self.rank]])
        self._empty_params()

    def materialize(self, device) -> None:
        """A meta-built transformer onto `device` holding only this rank's rows (left to the
        loader to fill: `local_params`); its buffers uninitialised, as `to_empty` leaves them."""
        self.device = torch.device(device)
        self._allocate()
        self._empty_params()
        for o in self.transformer.modules():
            for k, b in o._buffers.items():
                if b is not None:
                    o._buffers[k] = torch.empty_like(b, device=self.device)

    def local_params(self) -> dict:
        """{parameter name: this rank's rows} (views the loader copies into)."""
        return {e.name: u.local(i, self.rank) for u in self.units
                for i, e in enumerate(u.params)}

    def row_range(self, name: str, rows: int) -> tuple:
        """Rows [start, stop) of parameter `name` on this rank."""
        u, i = self.by_name[name]
        e = u.params[i]
        start = e.starts[self.rank]
        return start, start + e.rows[self.rank]

    # -- a forward ---------------------------------------------------------------------

    def gather(self, u: _Unit) -> None:
        """Every rank's rows of unit `u`, each parameter whole again."""
        from .topology import all_gather_into_tensor
        out = torch.empty(self.world, u.largest, dtype=torch.uint8, device=self.device)
        if u.largest:  # the same sizes on every rank: a unit of no bytes is skipped by all
            all_gather_into_tensor(out.view(-1), u.window, self.group)
        for i, e in enumerate(u.params):
            pieces = [out[r, u.offsets[r][i]:u.offsets[r][i] + e.rows[r] * e.row_bytes]
                      for r in range(self.world) if e.rows[r]]
            # rows on one rank only (a 0-dim parameter), or on none (a parameter of 0 rows)
            whole = torch.cat(pieces) if len(pieces) > 1 else \
                pieces[0].clone() if pieces else out.new_empty(0)
            e.param.data = whole.view(e.dtype).view(e.shape)
        u.gathered = True

    def release(self, u: _Unit) -> None:
        for e in u.params:
            e.param.data = e.empty
        u.gathered = False

    # -- what a rank holds ---------------------------------------------------------------

    def shard_bytes(self) -> int:
        """Bytes of this rank's buffer (its rows, and the last windows' room)."""
        return 0 if self.buffer is None else int(self.buffer.numel())

    def received_per_forward(self) -> int:
        """Bytes each rank receives per forward (padded to the largest shard of each unit)."""
        return (self.world - 1) * sum(u.largest for u in self.units)

    def _local_numel(self, units) -> int:
        return sum(e.rows[self.rank] * e.row_numel for u in units for e in u.params)

    def block_resident(self) -> int:
        """Block parameter elements allocated on this rank now (rows + any gathered)."""
        blocks = self.units[:-1]
        return self._local_numel(blocks) + sum(u.numel() for u in blocks if u.gathered)

    def counts(self) -> dict:
        return sharding_counts(self, self._local_numel(self.units[:-1]),
                               self._local_numel(self.units[-1:]),
                               shard_split=list(self.weights),
                               weight_bytes_local=self.shard_bytes())
