"""Every message between the host and rank 0, typed.

On the wire a message is `(kind, {field: value})` of plain values and tensors, pickled by the
authenticated channel (workers/runtime/channel.py): no class of this module crosses the wire, so the
host (which loads this module under a private package name inside ComfyUI) and the workers
need not agree on import paths, and nothing but builtins and tensors is ever unpickled.
`to_wire` / `from_wire` convert; an unknown kind or field is a `ProtocolError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional


class ProtocolError(ValueError):
    pass


@dataclass
class Message:
    KIND: ClassVar[str] = ""


_KINDS: dict = {}


def _message(cls):
    cls = dataclass(cls)
    _KINDS[cls.KIND] = cls
    return cls


# ---- host -> rank 0 ---------------------------------------------------------------------
@_message
class Job(Message):
    """Generate: `request` is GenerationRequest's fields (defaults resolved); tensors are
    model space (workers/models/latent_layout.py)."""
    KIND: ClassVar[str] = "job"
    job_id: int
    request: dict
    config: tuple  # ParallelConfig.key()
    noise: Any  # [B, ...] model-space noise, drawn once by the host
    init_latent: Any = None  # model space (img2img)
    denoise: float = 1.0
    options: dict = field(default_factory=dict)  # per-job PipeFusion settings
    # reference images: raw-VAE-space [1 or B, C, h, w] each, in order (the workers turn
    # them into model-space tokens); their layout method is request["reference_method"]
    references: Optional[list] = None
    # reference images [H, W, 3] float 0..1 each, in order (rank 0 encodes them with the
    # folder's VAE as the family's pipeline does; its text encoder may read them too)
    reference_images: Optional[list] = None


@_message
class Decode(Message):
    """Decode raw-VAE-space latents [B,16,h,w] with the model's VAE, patch-parallel."""
    KIND: ClassVar[str] = "decode"
    job_id: int
    samples: Any


@_message
class Predict(Message):
    """One denoiser evaluation for a host-side sampler (workers/sampling/model_call.py): latents
    [N, C, h, w] model space, one timestep (sigma * 1000) and FLUX guidance per row,
    `chunks` [(conditioning key, rows)] in row order; `conds` carries the conditionings rank 0
    has not seen ({key: {"context", "pooled"}}, ComfyUI's CONDITIONING tensors, plus
    optionally "ref_latents" [[rows, C, h, w] model space, ...] and "ref_method": the
    reference latents ComfyUI's FLUX model receives, cached with their conditioning; and
    "image_embeds" [rows, tokens, D]: Wan 2.1 I2V's CLIP vision states, ComfyUI's clip_fea)."""
    KIND: ClassVar[str] = "predict"
    call_id: int
    config: tuple  # ParallelConfig.key()
    x: Any
    timestep: Any
    guidance: Any = None
    chunks: list = field(default_factory=list)
    conds: dict = field(default_factory=dict)
    timed: bool = False  # benchmarks: report the call's phase timings (CUDA events on GPUs)
    cache: Optional[dict] = None  # step cache settings, every field (None: off)
    expert: int = 0  # a model of several experts (Wan 2.2 A14B): 0 the first, 1 the second
    loras: list = field(default_factory=list)  # [(path, strength[, expert])], as a job's


@_message
class Cancel(Message):
    KIND: ClassVar[str] = "cancel"
    job_id: Optional[int] = None  # None: whatever runs


@_message
class StatusQuery(Message):
    KIND: ClassVar[str] = "status?"


@_message
class Ping(Message):
    KIND: ClassVar[str] = "ping"


@_message
class Shutdown(Message):
    KIND: ClassVar[str] = "shutdown"


# ---- rank 0 -> host ---------------------------------------------------------------------
@_message
class Ready(Message):
    """First message on a connection: what the pool holds (Worker.describe())."""
    KIND: ClassVar[str] = "ready"
    info: dict


@_message
class Status(Message):
    KIND: ClassVar[str] = "status"
    info: dict


@_message
class Pong(Message):
    KIND: ClassVar[str] = "pong"


@_message
class Busy(Message):
    """Another host is connected; this connection is closed."""
    KIND: ClassVar[str] = "busy"
    reason: str


@_message
class Event(Message):
    """Progress of a job: {"step", "total", "elapsed", "preview"?} or, for data parallel,
    {"image_index", "samples"} (tensors model space)."""
    KIND: ClassVar[str] = "event"
    job_id: int
    event: dict


@_message
class Result(Message):
    KIND: ClassVar[str] = "result"
    job_id: int
    samples: Any  # model space (None for a decode)
    images: Any  # IMAGE [B,H,W,3] or None
    stats: list = field(default_factory=list)


@_message
class Prediction(Message):
    """The answer to `Predict`: the model's output [N, C, h, w] (model space, fp32), or,
    when rank 0 lacks some conditionings (`missing` keys), nothing: the host resends them."""
    KIND: ClassVar[str] = "prediction"
    call_id: int
    out: Any = None
    missing: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)


@_message
class Cancelled(Message):
    KIND: ClassVar[str] = "cancelled"
    job_id: int
    reason: str


@_message
class Error(Message):
    """A job failed. `fatal`: the ranks may be out of step (a collective failed): the pool
    must be restarted; otherwise the pool is fine and the next job may run."""
    KIND: ClassVar[str] = "error"
    job_id: Optional[int]
    message: str
    fatal: bool = False


@_message
class Bye(Message):
    KIND: ClassVar[str] = "bye"


def to_wire(msg: Message) -> tuple:
    return (msg.KIND, {f.name: getattr(msg, f.name) for f in fields(msg)})


def from_wire(wire) -> Message:
    try:
        kind, body = wire
        cls = _KINDS[kind]
    except (TypeError, ValueError, KeyError):
        raise ProtocolError(f"not a protocol message: {str(wire)[:80]!r}") from None
    try:
        return cls(**body)
    except TypeError as e:
        raise ProtocolError(f"bad {kind!r} message: {e}") from None
