"""Step cache: a transformer call skips its middle blocks when the output residual of its
first blocks barely changed since the row's last fully computed call.

The rule is First Block Cache's (ParaAttention), generalised as cache-dit's DBCache: the first
`head` blocks always run; their residual r (output - input, image stream) is compared with the
r of the row's last full call, `rel = sum|r - r_prev| / sum|r_prev|`; below `threshold` the
middle blocks are not run and their cached residual (optionally forecast to first order,
TaylorSeer-style) is added instead; the last `tail` blocks always run. `warmup` calls always
compute, and at most `max_skips` calls in a row skip.

What makes it safe across ranks:
- Decisions are per row (one image's conditional or unconditional branch), so splitting rows
  over CFG / DP ranks or batching them together gives the same decisions, and so the same
  latent, at any rank count.
- Under Ulysses / Ring each rank holds a shard of a row's tokens: the two sums are reduced
  over the sequence-parallel group on the device (one [rows, 2] all-reduce), and read once per
  call, so every shard of a row reaches the same decision from the same number. A rank that
  skipped while its peer computed would deadlock in the next collective.
- A call skips its middle blocks only when all its rows skip; rows that would skip inside a
  computed call take their cached residual, so the numbers do not depend on the batching.
  Where ranks must run the same blocks whatever their rows decide (a group that gathers
  weights per block), `agree` makes the run/skip choice unanimous over it.

Residuals are cached per segment: a maximal run of middle blocks inside one block list, so
whatever the transformer does between its lists (FLUX.2 joins its two streams) is done by the
transformer itself on the cached-and-added states.

The blocks are reached without touching the model's structure for good: for one call,
`gated(...)` puts a view of each block list in place whose iteration hands the transformer
gates instead of blocks (the same modules, names and hooks; a skipped block is never called,
so per-block hooks such as a weight gather do not run for it) and puts the lists back after.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field

import torch

from .cache_settings import CacheSettings


@dataclass
class RowCache:
    """One row's state across the calls of a sampling run."""
    calls: int = 0
    skips: int = 0  # consecutive
    head: torch.Tensor | None = None  # head residual of the last full call
    # segment -> [(call index, residual per stream)], the last two full calls
    history: dict = field(default_factory=dict)


class RunCache:
    """The cache of one sampling run on one rank (a Sampler job, or one ComfyUI sampling
    run of the MODEL): its rows' states and what was skipped."""

    def __init__(self, settings: CacheSettings):
        self.settings = settings
        self.rows: dict = {}
        self.computed = 0  # row-calls computed in full
        self.skipped = 0  # row-calls that took the cached residual
        self.formats: dict = {}  # block position -> output format, learnt on full calls
        self.layout = None  # (transformer, block lists) -> (block count, segments), once

    def segments(self, transformer, block_lists) -> tuple:
        """(block count, {position: (segment id, first, last)}) of the middle blocks: a
        segment is a run of them inside one block list. Checked and made once per run."""
        key = (id(transformer), tuple(block_lists))
        if self.layout is None or self.layout[0] != key:
            s = self.settings
            sizes = [len(getattr(transformer, name)) for name in block_lists]
            n = sum(sizes)
            s.check(n, sizes[0])
            segments, start = {}, 0
            for size in sizes:
                lo, hi = max(start, s.head), min(start + size, n - s.tail)
                for p in range(lo, hi):
                    segments[p] = (lo, p == lo, p == hi - 1)
                start += size
            self.layout = (key, (n, segments))
        return self.layout[1]

    def call(self, transformer, block_lists, keys, reduce=None, agree=None,
             plan=None, block_states=None) -> "CallCache":
        """The cache of one transformer call over rows `keys` (hashable, one per row).
        `reduce(t)`: sums a device tensor over the ranks holding the other token shards of
        the same rows, in place (None: this rank holds whole rows). `agree(flag) -> bool`:
        True if any rank of a group that must run the same blocks needs them run."""
        return CallCache(self, transformer, block_lists, keys, reduce, agree, plan,
                         block_states)

    def stats(self) -> dict:
        return {"computed": self.computed, "skipped": self.skipped}


class CallCache:
    """One transformer call: where each block sits, this call's decisions, the segments'
    inputs. Created per call, so nothing here outlives it except through `RunCache`."""

    def __init__(self, run: RunCache, transformer, block_lists, keys, reduce, agree,
                 plan=None, block_states=None):
        self.run, self.transformer, self.block_lists = run, transformer, tuple(block_lists)
        self.keys, self.reduce, self.agree = list(keys), reduce, agree
        self.plan = plan  # () -> the forward's SequencePlan, for blocks not given it
        # how this transformer's blocks take and return their streams (below)
        self.io = JointBlocks() if block_states is None else NamedBlocks(tuple(block_states))
        self.n, self.segments = run.segments(transformer, self.block_lists)
        # key None: a follower row (weight sharding's dummy row on a replica with none),
        # whose output is discarded: it skips whenever the others do and keeps no state
        self.rows = [None if k is None else run.rows.setdefault(k, RowCache())
                     for k in self.keys]
        self.head_in = None
        self.skip = None  # per row, decided after the head
        self.skip_all = False
        self.mixed = False  # the call computes, but some rows take their cached residual
        self.seg_in: dict = {}

    # -- the gates -----------------------------------------------------------------------
    def run_block(self, p: int, block, args, kwargs):
        if args:  # positional arguments (Wan's, Z-Image's blocks) by their names
            kwargs = dict(zip(_parameter_names(block), args), **kwargs)
        hidden = self.io.hidden_name(block, kwargs)
        if p == 0:
            self.head_in = kwargs[hidden]
        if p < self.run.settings.head:
            out = block(**kwargs)
            self.run.formats[p] = _format(out)
            if p == self.run.settings.head - 1:
                r = self.io.hidden_out(out) - self.head_in
                self._decide(r.narrow(1, 0, _real_image_tokens(kwargs, r.shape[1],
                                                               self.plan)))
            return out
        seg = self.segments.get(p)
        if seg is None:  # tail
            return block(**kwargs)
        sid, first, last = seg
        if first:
            self.seg_in[sid] = self._streams(kwargs, hidden)
        if self.skip_all:
            if not last:
                return self._pack(p, self._streams(kwargs, hidden))
            return self._pack(p, self._with_cached(sid, self.seg_in[sid]))
        out = block(**kwargs)
        self.run.formats[p] = _format(out)
        if not last:
            return out
        states = self.io.states_out(out)
        residual = tuple(None if o is None else o - i for o, i in zip(states, self.seg_in[sid]))
        if self.mixed:  # some rows skip: they take their cached residual
            states = self._with_cached(sid, self.seg_in[sid], states)
        for i, row in enumerate(self.rows):
            if row is not None and not self.skip[i]:
                hist = row.history.setdefault(sid, [])
                hist.append((row.calls - 1, tuple(None if r is None else r[i] for r in residual)))
                del hist[:-2]
        return self._pack(p, states)

    def _streams(self, kwargs, hidden) -> tuple:
        return self.io.states_in(kwargs, hidden)

    def _pack(self, p: int, states: tuple):
        return self.io.pack(self.run.formats[p], states)

    # -- the decision --------------------------------------------------------------------
    def _decide(self, r: torch.Tensor) -> None:
        """Per row: rel = sum|r - prev| / sum|prev| (reduced over the token shards), one read."""
        s = self.run.settings
        b = r.shape[0]
        prev = [None if row is None else row.head for row in self.rows]
        eligible = [row is not None and row.head is not None and row.calls >= s.warmup
                    and (s.max_skips == 0 or row.skips < s.max_skips) for row in self.rows]
        rel = [math.inf] * b
        if s.enabled and any(eligible):
            ref = torch.stack([p if p is not None else torch.zeros_like(r[0]) for p in prev])
            sums = torch.stack([(r - ref).abs().flatten(1).sum(1, dtype=torch.float32),
                                ref.abs().flatten(1).sum(1, dtype=torch.float32)], 1)
            if self.reduce is not None:
                self.reduce(sums)
            pair = sums.tolist()  # the one read of the call
            rel = [n / d if d > 0 else math.inf for n, d in pair]
        self.skip = [row is None or (e and v < s.threshold)
                     for row, e, v in zip(self.rows, eligible, rel)]
        need = not all(self.skip)
        if self.agree is not None:
            need = self.agree(need)
        self.skip_all = not need
        self.mixed = need and any(s and row is not None for s, row in zip(self.skip, self.rows))
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            if self.skip[i]:
                row.skips += 1
                self.run.skipped += 1
            else:
                row.skips = 0
                row.head = r[i]
                self.run.computed += 1
            row.calls += 1

    def _cached(self, sid, i) -> tuple:
        """Row i's cached residual of segment `sid` per stream, forecast to this call when
        `taylor` is on and two full calls are known."""
        row = self.rows[i]
        hist = row.history[sid]
        c1, r1 = hist[-1]
        if self.run.settings.taylor and len(hist) == 2:
            c0, r0 = hist[0]
            k = (row.calls - 1 - c1) / (c1 - c0)  # calls already counts this one
            r1 = tuple(None if a is None else a + (a - z) * k for a, z in zip(r1, r0))
        return r1

    def _with_cached(self, sid, inputs: tuple, computed: tuple | None = None) -> tuple:
        """The segment's output states, row by row: its input plus the cached residual for
        a row that skips, the computed output for the others (`computed`; None: every row
        skips). A follower row passes its input (or output) through. Rows are picked by
        Python index, so nothing is built from host data on the device."""
        cached = {i: self._cached(sid, i) for i, row in enumerate(self.rows)
                  if row is not None and self.skip[i]}
        out = []
        for j, x in enumerate(inputs):
            if x is None or (computed is not None and computed[j] is None):
                out.append(None)  # a stream the segment does not return (SD3's last block)
                continue
            rows = []
            for i in range(len(self.rows)):
                if i in cached and cached[i][j] is not None:
                    rows.append(x[i] + cached[i][j])
                elif i in cached or computed is None:
                    rows.append(x[i])
                else:
                    rows.append(computed[j][i])
            out.append(torch.stack(rows))
        return tuple(out)


# -- block input / output formats ----------------------------------------------------------
# A block is called with hidden_states (or, Z-Image, its first parameter) and (maybe)
# encoder_hidden_states and returns either
# (encoder_hidden_states, hidden_states) (FLUX, SD3 and Qwen-Image joint blocks; SD3's last joint block
# gives None for the text) or hidden_states alone (FLUX.2's single blocks): `JointBlocks`.
# Blocks that return several named streams (a model's `block_states`) are `NamedBlocks`.

def _format(out) -> str:
    if isinstance(out, tuple):
        return "tuple" if out[0] is not None else "tuple-no-text"
    return "tensor"


def _parameter_names(block) -> tuple:
    """The names of a block's forward parameters, in order (once per class)."""
    cls = type(block)
    names = _PARAMS.get(cls)
    if names is None:
        names = _PARAMS[cls] = tuple(inspect.signature(block.forward).parameters)
    return names


_PARAMS: dict = {}


def _real_image_tokens(kwargs, local: int, plan_of=None) -> int:
    """This rank's real tokens of the latent stream (the family's declared one: the
    measured residual's) among its `local` ones: a sequence-parallel shard is
    padded to the longest (workers/parallel/sequence_parallel.py), and the padding's residual must not
    weigh in the decision, or the ranks would decide otherwise than one process. The plan
    comes with the block's keywords, or (blocks not given it: Wan) from `plan_of()`."""
    plan = (kwargs.get("joint_attention_kwargs") or {}).get("sp_plan")
    if plan is None and plan_of is not None:
        plan = plan_of()
    if plan is None or not getattr(plan, "padded", False):
        return local
    return min(local, plan.sizes(plan.latent_stream)[plan.sp_rank])


def _hidden_name(block, kwargs) -> str:
    """The keyword of a block's hidden states: hidden_states, else its first parameter
    (Z-Image's blocks name it x)."""
    return "hidden_states" if "hidden_states" in kwargs else _parameter_names(block)[0]


class JointBlocks:
    """The usual blocks: called with the hidden states (by keyword, or Z-Image's first
    parameter) and maybe encoder_hidden_states; they return (encoder, hidden) or hidden
    alone (`_format` records which, per block). States are (hidden, encoder) here."""

    def hidden_name(self, block, kwargs) -> str:
        return _hidden_name(block, kwargs)

    def hidden_out(self, out):
        return out[1] if isinstance(out, tuple) else out

    def states_in(self, kwargs, hidden: str) -> tuple:
        return (kwargs[hidden], kwargs.get("encoder_hidden_states"))

    def states_out(self, out) -> tuple:
        return (out[1], out[0]) if isinstance(out, tuple) else (out, None)

    def pack(self, fmt: str, states: tuple):
        hidden, text = states
        if fmt == "tensor":
            return hidden
        return (None if fmt == "tuple-no-text" else text, hidden)


class NamedBlocks:
    """Blocks that take several streams by keyword and return them all, in the order the
    family's model declares (its `block_states`, e.g. video then sound); the first is the
    one the cache measures."""

    def __init__(self, names: tuple):
        self.names = names

    def hidden_name(self, block, kwargs) -> str:
        return self.names[0]

    def hidden_out(self, out):
        return out[0]

    def states_in(self, kwargs, hidden: str) -> tuple:
        return tuple(kwargs[n] for n in self.names)

    def states_out(self, out) -> tuple:
        return tuple(out)

    def pack(self, fmt: str, states: tuple):
        return tuple(states)


# -- putting the gates in place for one call ----------------------------------------------

class _GatedList(torch.nn.ModuleList):
    """A block list's view for one call: the same child modules; iterating it yields gates
    that route each block's call through the call's cache."""

    def __init__(self, blocks: torch.nn.ModuleList, call: CallCache, offset: int):
        super().__init__()
        self._modules = blocks._modules  # shared, not re-registered
        self._call, self._offset = call, offset

    def __iter__(self):
        for i, block in enumerate(self._modules.values()):
            yield _Gate(self._call, self._offset + i, block)


class _Gate:
    __slots__ = ("call", "p", "block")

    def __init__(self, call, p, block):
        self.call, self.p, self.block = call, p, block

    def __call__(self, *args, **kwargs):
        return self.call.run_block(self.p, self.block, args, kwargs)


@contextlib.contextmanager
def gated(call: CallCache | None):
    """Within this block, the transformer's block lists route through `call` (None: nothing
    changes)."""
    if call is None:
        yield
        return
    tr = call.transformer
    saved = {name: tr._modules[name] for name in call.block_lists}
    offset = 0
    try:
        for name in call.block_lists:
            tr._modules[name] = _GatedList(saved[name], call, offset)
            offset += len(saved[name])
        yield
    finally:
        tr._modules.update(saved)


def call_on_ranks(run: RunCache | None, model, adapter, keys, topo, control, sharded: bool,
                  transformer=None, plan=None):
    """The call cache of one transformer call on this rank, wired to the pool's groups: the
    sums reduced over the sequence-parallel group (the other shards of these rows), and,
    under weight sharding (every rank gathers every block it runs), the run/skip choice made
    unanimous over the world's control plane. None when the cache is off."""
    if run is None:
        return None
    from ..parallel.topology import all_reduce

    reduce = None
    if topo.sp > 1:
        group = topo.group("sp")

        def reduce(t):
            all_reduce(t, group)
    agree = None
    if sharded and topo.world_size > 1:
        def agree(need: bool) -> bool:
            flag = torch.tensor([int(need)], dtype=torch.int32)
            all_reduce(flag, control, op="max")
            return bool(flag.item())
    return run.call(transformer if transformer is not None else model.transformer,
                    adapter.block_lists, keys, reduce=reduce, agree=agree, plan=plan,
                    block_states=adapter.block_states)
