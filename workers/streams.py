"""A family's token streams, declared as data (plain Python, no torch: the host's memory plan
and request checks read it too).

A transformer's sequence is made of named streams: the latent tokens it denoises (an image,
a video, an audio track), the prompt's text, other context (reference images, ...). A
family's `TokenLayout` names them in the order of its joint sequence, says how each is held
across the sequence-parallel ranks, and which attends to which:

- `Stream.split`: "shard" (each rank holds a near-even share of the tokens: the first
  n % sp ranks one more) or "replicate" (every rank holds all of them: a short stream that is
  cheaper to keep whole than to exchange, such as a text reached by cross-attention only);
- `Stream.role`: "latent" (tokens the model denoises: PipeFusion cuts them into patches, the
  step cache measures them, the output gather returns them), "text" (the prompt: rows of a
  batch padded to a common length carry their real lengths and the padded keys are dropped)
  or "context" (anything else the latent attends to);
- `Attention`: one attention's query streams (in the order the processor concatenates its
  local tokens) and key streams. Joint attention: the keys are the queries' own streams;
  cross-attention: other streams (LTX-2's audio->video and video->audio, Wan's video->text).

Shared code (the sequence-parallel hooks, Ulysses, Ring, PipeFusion's K/V cache, the step
cache, padding, the memory plan) works from this declaration and never from a stream's name.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

SPLITS = ("shard", "replicate")
ROLES = ("latent", "text", "context")
POSITIONS = ("ids", "order")


def even_sizes(n: int, parts: int) -> list:
    """`n` tokens over `parts` ranks, near-evenly: the first n % parts take one more."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def padded_to(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-int(n) // multiple) * multiple


@dataclass(frozen=True)
class Stream:
    """One named token stream (module doc). `pad_multiple`: the model pads the stream to a
    multiple of this many tokens (Z-Image's learned pad tokens: 32); lengths of the stream
    count the padded tokens. `positions` (latent streams): "ids" where each token carries its
    own position (RoPE ids, FLUX), so the stream's tokens may be reordered (PipeFusion runs a
    job's reference images first); "order" where positions follow the token order
    (Qwen-Image's img_shapes). `pads_odd_references` (latent streams): reference latents of
    odd height or width are padded circularly to whole tokens, as ComfyUI's model pads them,
    rather than refused. `denoised` (context streams): the model denoises this stream beside
    the latent's (a sound track), so a method that cuts only the latent stream into patches
    across steps (PipeFusion) cannot run the family. `length` (context streams): frames ->
    the stream's tokens in a video of that many frames (a sound track's), what the host's
    memory plan counts it by."""

    name: str
    role: str = "context"
    split: str = "shard"
    pad_multiple: int = 1
    positions: str = "ids"
    pads_odd_references: bool = False
    denoised: bool = False
    length: Optional[Callable] = field(default=None, compare=False)

    @property
    def sharded(self) -> bool:
        return self.split == "shard"


@dataclass(frozen=True)
class Attention:
    """One attention of the model: its `queries` (streams, in the processor's local order)
    attend to `keys` (None: the queries' own streams, joint attention)."""

    queries: tuple
    keys: Optional[tuple] = None

    @property
    def key_streams(self) -> tuple:
        return tuple(self.queries if self.keys is None else self.keys)

    @property
    def joint(self) -> bool:
        return self.keys is None or tuple(self.keys) == tuple(self.queries)


@dataclass(frozen=True)
class TokenLayout:
    """A family's streams, in joint-sequence order, and its attentions (module doc)."""

    streams: tuple
    attentions: tuple = field(default=())

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("token layout: " + "; ".join(problems))

    def problems(self) -> list:
        out = []
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            out.append(f"stream names repeat: {names}")
        for s in self.streams:
            if s.split not in SPLITS:
                out.append(f"stream {s.name!r} splits {s.split!r}; use one of {SPLITS}")
            if s.role not in ROLES:
                out.append(f"stream {s.name!r} has role {s.role!r}; use one of {ROLES}")
            if s.positions not in POSITIONS:
                out.append(f"stream {s.name!r} has positions {s.positions!r}; use one of "
                           f"{POSITIONS}")
            if not isinstance(s.pad_multiple, int) or s.pad_multiple < 1:
                out.append(f"stream {s.name!r} pads to a multiple of {s.pad_multiple!r}; "
                           f"give a whole number >= 1")
        latent = [s for s in self.streams if s.role == "latent"]
        if len(latent) != 1 or not latent[0].sharded:
            out.append(f"one sharded stream must have the role 'latent' (the tokens the "
                       f"model denoises); got {[s.name for s in latent]}")
        if len([s for s in self.streams if s.role == "text"]) > 1:
            out.append("at most one stream has the role 'text'")
        attended = set()
        for a in self.attentions:
            for part, streams in (("queries", a.queries), ("keys", a.key_streams)):
                unknown = [s for s in streams if s not in names]
                if unknown or not streams:
                    out.append(f"an attention's {part} name {list(streams)}, but the layout "
                               f"declares only {names}")
                if len(set(streams)) != len(streams):
                    out.append(f"an attention's {part} repeat a stream: {list(streams)}")
            attended.update(a.queries)
            attended.update(a.key_streams)
        missing = [n for n in names if n not in attended]
        if self.attentions and missing:
            out.append(f"streams {missing} take part in no attention")
        return out

    def stream(self, name: str) -> Stream:
        for s in self.streams:
            if s.name == name:
                return s
        raise KeyError(f"no stream {name!r} in this layout (streams: {self.names})")

    @property
    def names(self) -> tuple:
        return tuple(s.name for s in self.streams)

    @property
    def latent(self) -> Stream:
        return next(s for s in self.streams if s.role == "latent")

    @property
    def text(self) -> Optional[Stream]:
        return next((s for s in self.streams if s.role == "text"), None)

    def attention(self, queries, keys=None) -> Attention:
        """The declared attention of these queries and keys (None: joint), or a ValueError
        that says what the layout declares: a processor attends only as declared."""
        queries = tuple(queries)
        keys = queries if keys is None else tuple(keys)
        for a in self.attentions:
            if tuple(a.queries) == queries and a.key_streams == keys:
                return a
        declared = ", ".join(f"{'+'.join(a.queries)} -> {'+'.join(a.key_streams)}"
                             for a in self.attentions)
        raise ValueError(f"attention of {'+'.join(queries)} over {'+'.join(keys)} is not "
                         f"declared by the layout (declared: {declared})")

    def in_sequence(self, name: str) -> bool:
        """The stream is split with the latent's and attended jointly with it (the memory
        plan counts it in the sequence); False: kept whole and reached by cross-attention."""
        s, latent = self.stream(name), self.latent.name
        return s.sharded and any(a.joint and latent in a.queries and name in a.queries
                                 for a in self.attentions)

    @functools.cached_property
    def all_sharded(self) -> "TokenLayout":
        """This layout with every stream sharded (made once per layout)."""
        if all(s.sharded for s in self.streams):
            return self
        return TokenLayout(tuple(dataclasses.replace(s, split="shard") for s in self.streams),
                           self.attentions)

    def sequence(self) -> tuple:
        """The sharded streams in joint-sequence order (what the ranks split)."""
        return tuple(s.name for s in self.streams if s.sharded)


def text_image(text_first: bool = True, *, text: str = "shard", positions: str = "ids",
               pad_multiple: int = 1, pads_odd_references: bool = False,
               attentions: Optional[tuple] = None) -> TokenLayout:
    """The usual layout: a "text" stream and an "image" latent stream. Joint attention over
    both (text first, FLUX; or after, SD3) by default; `text="replicate"` with
    `attentions` for a text reached by cross-attention only."""
    t = Stream("text", "text", text, pad_multiple)
    i = Stream("image", "latent", "shard", pad_multiple, positions, pads_odd_references)
    order = (t, i) if text_first else (i, t)
    if attentions is None:
        attentions = (Attention(tuple(s.name for s in order)),)
    return TokenLayout(order, tuple(attentions))


# the layout of a family that declares none: FLUX's joint text + image
TEXT_IMAGE = text_image()
