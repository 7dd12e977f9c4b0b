"""Sequence parallelism (USP: Ulysses, Ring, hybrid), written once for every model.

A model adapter declares a `SequenceLayout`: its family's token streams (a `TokenLayout`,
workers/streams.py: their names, order, split and which attends to which), which
tensors split on which dim and to which stream they belong, and where the latent stream's
output is gathered. Installing it adds forward hooks to the transformer and swaps in the
model's sharded attention processors; the model code itself is untouched.

Each sharded stream is split near-evenly over the sp ranks (the first `n % sp` ranks take one
more token), or, where the plan has uneven `weights` (GPUs of different speed or memory,
workers/parallel/shares.py), in proportion to them; a replicated stream stays whole on every
rank. A stream is whatever the adapter
passes as its tokens: FLUX's image stream is the latent's tokens joined by reference images'
when a job has them (workers/models/flux.py `with_references`), so those split with it. The
per-forward `SequencePlan` (the call's token count per stream) travels to the attention
processors explicitly through `joint_attention_kwargs`.

Near-even shards are padded once per forward: the input hooks pad each stream's local shard to
that stream's longest (`SequencePlan.padded`), so every layer's q/k/v have the same length
on every rank and the collectives need no per-layer padding; the attention drops the padded
keys (workers/parallel/attention.py) and the output gather drops the padded tokens. Padded tokens
only ever meet per-token layers and the attention, so they change no real token. A plan with
uneven weights is not padded (a fast rank would compute the slow rank's length): its shards
keep their own lengths and the attention exchanges them as they are
(workers/parallel/uneven.py).

A caller may pass its own plan (`joint_attention_kwargs={"sp_plan": plan}`), a SequencePlan
subclass whose `selected` covers part of the tokens (PipeFusion's patches,
workers/parallel/pipefusion/plan.py): the forward then computes only those, unpadded, and the output
gather places them in a full-size output.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..streams import TEXT_IMAGE, TokenLayout, even_sizes  # noqa: F401  (re-exported)
from .shares import is_even, sizes_for
from .topology import Topology, all_gather, gather


@dataclass(frozen=True)
class SequencePlan:
    """Which tokens one forward call computes (every token of every stream; a subclass may
    select fewer) and which of them this sp rank holds: each sharded stream's selected
    tokens split near-evenly over the sp ranks, each replicated stream's held whole by every
    rank. `tokens`: the call's full token count per stream, one for each stream `layout`
    declares (workers/streams.py)."""

    sp_rank: int
    sp_size: int
    tokens: dict  # stream name -> tokens of the full sequence
    padded: bool = False  # local shards padded to each stream's longest (see module doc)
    layout: TokenLayout = TEXT_IMAGE
    weights: tuple = ()  # per sp rank (workers/parallel/shares.py); () near-even

    def __post_init__(self):
        declared, given = self.layout.names, tuple(self.tokens)
        if set(given) != set(declared):
            raise ValueError(f"the plan gives token counts for {list(given)}, the layout "
                             f"declares the streams {list(declared)}")
        bad = {k: v for k, v in self.tokens.items() if not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"token counts must be whole numbers >= 0, got {bad}")
        if self.weights and len(self.weights) != self.sp_size:
            raise ValueError(f"the plan has {len(self.weights)} weights for {self.sp_size} "
                             f"sp ranks")

    def __hash__(self):  # the dict of counts as its items
        return hash((type(self), self.sp_rank, self.sp_size,
                     tuple(sorted(self.tokens.items())), self.padded, self.layout,
                     tuple(self.weights)))

    @property
    def uneven(self) -> bool:
        """Shards sized by uneven weights (not padded; workers/parallel/uneven.py)."""
        return not is_even(self.weights)

    @property
    def text_stream(self) -> Optional[str]:
        """The name of the layout's text stream (None: it has none)."""
        t = self.layout.text
        return None if t is None else t.name

    @property
    def latent_stream(self) -> str:
        return self.layout.latent.name

    def context_streams(self) -> tuple:
        """The sharded streams beside the latent's, in layout order: what the blocks carry
        as their context (a replicated stream, Wan's text, is an input of each block)."""
        latent = self.latent_stream
        return tuple(s for s in self.layout.sequence() if s != latent)

    def counts(self) -> tuple:
        """The full token counts in layout order (what shapes depend on)."""
        return tuple(self.tokens[n] for n in self.layout.names)

    def full_len(self, stream: str) -> int:
        try:
            return self.tokens[stream]
        except KeyError:
            raise KeyError(f"no stream {stream!r} in this plan (streams: "
                           f"{list(self.tokens)})") from None

    def selected(self, stream: str) -> tuple:
        """(first token, count) of the stream's tokens this forward computes."""
        return 0, self.full_len(stream)

    def sharded(self, stream: str) -> bool:
        return self.layout.stream(stream).sharded

    def sizes(self, stream: str) -> list:
        """Tokens of `stream` each sp rank holds (a replicated stream: all, on each)."""
        n = self.selected(stream)[1]
        if not self.sharded(stream):
            return [n] * self.sp_size
        return sizes_for(n, self.sp_size, self.weights)

    def local_slice(self, stream: str, sp_rank: Optional[int] = None) -> slice:
        r = self.sp_rank if sp_rank is None else sp_rank
        sizes = self.sizes(stream)
        start = self.selected(stream)[0] + (sum(sizes[:r]) if self.sharded(stream) else 0)
        return slice(start, start + sizes[r])

    def lengths(self, streams=None) -> list:
        """Local token count of every sp rank for attention over `streams` (None: every
        stream, in layout order)."""
        per = [self.sizes(s) for s in (self.layout.names if streams is None else streams)]
        return [sum(p[r] for p in per) for r in range(self.sp_size)]

    def positions(self, streams, sp_rank: Optional[int] = None) -> torch.Tensor:
        """Where the local tokens of `sp_rank` (in the order the processors concatenate
        `streams`) sit in the full sequence of `streams`."""
        out, offset = [], 0
        for s in streams:
            sl = self.local_slice(s, sp_rank)
            out.append(torch.arange(sl.start, sl.stop) + offset)
            offset += self.full_len(s)
        return torch.cat(out)

    def local_len(self, stream: str) -> int:
        """Tokens of `stream` in this rank's local tensors (padding included)."""
        sizes = self.sizes(stream)
        return max(sizes) if self.padded else sizes[self.sp_rank]

    def shard(self, x: torch.Tensor, dim: int, stream: str) -> torch.Tensor:
        """This rank's tokens of a whole stream (a replicated stream: the selected tokens,
        all of them)."""
        full = self.full_len(stream)
        if x.shape[dim] != full:
            raise RuntimeError(f"{stream} tensor has {x.shape[dim]} tokens on dim {dim}, "
                               f"plan says {full}")
        sl = self.local_slice(stream)
        if sl.start == 0 and sl.stop == full:
            return x
        x = x.narrow(dim, sl.start, sl.stop - sl.start)
        # padded plan, shorter shard: zero tokens at the end of this stream
        return pad_tokens(x, dim, self.local_len(stream))

    def all_sharded(self) -> "SequencePlan":
        """The same tokens with every stream sharded: how the attention holds a replicated
        stream while it exchanges the others (workers/parallel/attention.py)."""
        layout = self.layout.all_sharded
        return self if layout is self.layout else dataclasses.replace(self, layout=layout)


@dataclass(frozen=True)
class SequenceLayout:
    """Declarative split/gather plan of one transformer class (cf. diffusers' `_cp_plan`).

    streams:       the family's token streams (streams.TokenLayout); every `stream` below
                   names one of them.
    split_inputs:  forward kwarg -> (stream, dim), split before the transformer runs;
                   (stream, dim, "per_token"): split where the call gives it per token (it
                   has that dim), left whole where it gives one per row (LTX-2's timestep:
                   [B] in text-to-video, [B, video tokens] from a start frame).
    split_outputs: submodule name -> (stream, dim), its output is split; a tuple output
                   takes one (stream, dim) per element (None: left whole). (stream, dim,
                   "flatten"): the output's dims from `dim` on are the tokens, flattened
                   before the split (Wan's 3-D patch convolution: [B, C, F, H, W] ->
                   [B, C, local tokens], which the model's own flatten leaves as it is).
    full_lengths:  submodule name -> {kwarg: stream}: that keyword of the module's call is
                   set to the stream's full length (a model that derives a length from a
                   tensor the hooks have split, as Qwen-Image's text RoPE does, is told the
                   whole sequence's).
    gather_output: (submodule name, dim), its output (the latent stream's tokens) is
                   all-gathered.
    gather_streams: submodule name -> (stream, dim): the output of another sharded stream
                   the transformer returns (a sound track denoised with the video, where the
                   family shards it), gathered alike.
    token_counts:  (transformer, forward kwargs) -> {stream: tokens} of the call, every
                   declared stream.
    kwargs_name:   the forward kwarg whose dict reaches the attention processors.
    plan_by_hook:  the model calls its attention modules without that dict (Wan): a hook
                   on each of them passes the forward's plan as their `sp_plan` keyword.
    context_tokens: forward kwarg -> processor keyword: that input's token count reaches
                   the processors (with plan_by_hook) under that keyword, None when the call
                   has no such input (Wan 2.1 I2V: the CLIP image tokens that come first in
                   the cross-attention context, whatever the text's length).
    """

    split_inputs: dict
    split_outputs: dict
    gather_output: tuple
    token_counts: Callable
    attention_processor: Callable  # (ShardedAttention) -> processor instance
    replaces: tuple  # class names of the stock processors the sharded one replaces
    streams: TokenLayout = TEXT_IMAGE
    full_lengths: dict = field(default_factory=dict)
    kwargs_name: str = "joint_attention_kwargs"
    plan_by_hook: bool = False
    context_tokens: dict = field(default_factory=dict)
    gather_streams: dict = field(default_factory=dict)

    def __post_init__(self):
        names = self.streams.names
        specs = list(self.split_inputs.values()) + list(self.gather_streams.values())
        for spec in self.split_outputs.values():
            specs.extend([spec] if isinstance(spec[0], str) else [s for s in spec if s])
        specs += [(stream,) for m in self.full_lengths.values() for stream in m.values()]
        unknown = sorted({s[0] for s in specs} - set(names))
        if unknown:
            raise ValueError(f"the sequence layout splits streams {unknown}, which its token "
                             f"layout does not declare (streams: {list(names)})")


def pad_tokens(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`x` with zero tokens appended along `dim` up to `length` (as it is if that long)."""
    if x.shape[dim] >= length:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def all_gather_tokens(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Gather shards of uneven length along `dim` (padded to the longest for the collective)."""
    x = pad_tokens(x, dim, max(sizes))
    parts = [torch.empty_like(x) for _ in sizes]
    all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def gather_tokens(x: torch.Tensor, dim: int, sizes: list[int], group) -> Optional[torch.Tensor]:
    """`all_gather_tokens` to group rank 0 only (`group` None: the default group): the
    joined tensor there, None on the other ranks, which hold no copy."""
    x = pad_tokens(x, dim, max(sizes))
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(x) for _ in sizes] if first else None
    gather(x.contiguous(), parts, 0 if group is None else dist.get_global_rank(group, 0),
           group)
    if not first:
        return None
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def gather_stream(x: torch.Tensor, dim: int, plan: SequencePlan, stream: str, group):
    """A stream's whole output from this rank's shard (padding dropped): all-gathered over
    the sp group for a sharded stream, as it is for a replicated one; where the plan selects
    part of the tokens (PipeFusion), placed in a full-size output (zeros elsewhere)."""
    if plan.sp_size > 1 and plan.sharded(stream):
        x = all_gather_tokens(x, dim, plan.sizes(stream), group)
    start, count = plan.selected(stream)
    full_len = plan.full_len(stream)
    if count != full_len:
        full = list(x.shape)
        full[dim] = full_len
        out = x.new_zeros(full)
        out.narrow(dim, start, count).copy_(x)
        x = out
    return x


class SequenceParallel:
    """Hooks one transformer for sequence parallelism over `topo`'s sp group; a forward
    called with its own plan computes that plan's tokens (module doc)."""

    def __init__(self, transformer, layout: SequenceLayout, topo: Topology, attention,
                 weights: tuple = ()):
        """`transformer`: one, or a tuple of transformers of one class (a model's experts,
        one forward at a time). `weights`: the sp ranks' shares (workers/parallel/shares.py;
        () near-even)."""
        self.layout = layout
        self.topo = topo
        self.weights = tuple(weights)
        self.plan: Optional[SequencePlan] = None  # set for the duration of one forward
        self.context: dict = {}  # likewise: the layout's context_tokens of the forward
        self.attention = attention  # its `kernel_name` is what `status` shows
        self.handles = []
        processor = layout.attention_processor(attention)
        self.originals = {}  # module -> stock processor, restored by remove()
        for tr in (transformer if isinstance(transformer, (tuple, list)) else (transformer,)):
            self._install(tr, processor)

    def _install(self, transformer, processor):
        layout = self.layout
        for name, module in transformer.named_modules():
            proc = getattr(module, "processor", None)
            if proc is None:
                continue
            if type(proc).__name__ not in layout.replaces:
                raise RuntimeError(f"{name} uses attention processor {type(proc).__name__}, "
                                   f"which sequence parallelism does not support")
            self.originals[module] = proc
            module.set_processor(processor)
            if layout.plan_by_hook:
                self.handles.append(module.register_forward_pre_hook(self._give_plan,
                                                                     with_kwargs=True))
        if not any(m in self.originals for m in transformer.modules()):
            raise RuntimeError("no attention module found to parallelise")
        self.handles.append(transformer.register_forward_pre_hook(self._enter, with_kwargs=True))
        self.handles.append(transformer.register_forward_hook(self._exit, always_call=True))
        for name, spec in layout.split_outputs.items():
            mod = transformer.get_submodule(name)
            self.handles.append(mod.register_forward_hook(self._splitter(spec)))
        for name, specs in layout.full_lengths.items():
            mod = transformer.get_submodule(name)
            self.handles.append(mod.register_forward_pre_hook(self._full_length(specs),
                                                              with_kwargs=True))
        gname, gdim = layout.gather_output
        self.handles.append(transformer.get_submodule(gname).register_forward_hook(
            self._gatherer(gdim)))
        for name, (stream, dim) in layout.gather_streams.items():
            self.handles.append(transformer.get_submodule(name).register_forward_hook(
                self._gatherer(dim, stream)))

    def _enter(self, module, args, kwargs):
        if args:
            raise TypeError("call the parallel transformer with keyword arguments only")
        tokens = dict(self.layout.token_counts(module, kwargs))
        name = self.layout.kwargs_name
        jak = dict(kwargs.get(name) or {})
        plan = jak.get("sp_plan")  # the caller's own plan (module doc)
        if plan is None:
            uneven = not is_even(self.weights)
            plan = SequencePlan(self.topo.sp_rank, self.topo.sp, tokens, padded=not uneven,
                                layout=self.layout.streams,
                                weights=self.weights if uneven else ())
        elif plan.tokens != tokens:
            raise RuntimeError(f"the call's plan is for {plan.tokens} tokens, the call has "
                               f"{tokens}")
        self.plan = plan
        self.context = {kw: (None if kwargs.get(arg) is None else int(kwargs[arg].shape[1]))
                        for arg, kw in self.layout.context_tokens.items()}
        kwargs = dict(kwargs)
        for key, (stream, dim, *how) in self.layout.split_inputs.items():
            x = kwargs.get(key)
            if x is not None and not (how == ["per_token"] and x.dim() <= dim):
                kwargs[key] = plan.shard(x, dim, stream)
        jak["sp_plan"] = plan
        kwargs[name] = jak
        return args, kwargs

    def _exit(self, module, args, output):
        self.plan, self.context = None, {}

    def _give_plan(self, module, args, kwargs):
        return args, dict(kwargs, sp_plan=self.plan, **self.context)

    def _splitter(self, spec):
        def hook(module, args, output):
            if isinstance(spec[0], str):
                if len(spec) > 2 and spec[2] == "flatten":
                    output = output.flatten(spec[1])
                return self.plan.shard(output, spec[1], spec[0])
            return type(output)(o if s is None else self.plan.shard(o, s[1], s[0])
                                for o, s in zip(output, spec))
        return hook

    def _full_length(self, specs: dict):
        def hook(module, args, kwargs):
            return args, dict(kwargs, **{key: self.plan.full_len(stream)
                                         for key, stream in specs.items()})
        return hook

    def _gatherer(self, dim: int, stream: Optional[str] = None):
        def hook(module, args, output):
            plan = self.plan
            return gather_stream(output, dim, plan, stream or plan.latent_stream,
                                 self.topo.group("sp"))
        return hook

    def remove(self):
        """Undo everything: hooks off, stock processors back."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for module, proc in self.originals.items():
            module.set_processor(proc)
        self.originals = {}
