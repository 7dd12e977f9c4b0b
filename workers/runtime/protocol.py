"""Every message between the host and rank 0, typed.

On the wire a message is `(kind, {field: value})`, pickled by the authenticated channel
(workers/runtime/channel.py) after its handshake. No class crosses the wire, neither a
message nor a part of one: the host loads this module under a private package name
(comfyui_xdit/bridge.py), so the two sides' classes differ. A field's value travels as plain
values, tensors and numpy arrays; a typed part (`GenerationRequest`, `Degrees`,
`Conditioning`, `Latents`, `Decoded`) as its `to_wire()` dict, which `from_wire` reads back
through the field's `part` reader. `to_wire` / `from_wire` convert; an unknown kind or field, or a part
that does not read, is a `ProtocolError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional

from ..parallel.degrees import Degrees
from ..sampling.cache_settings import CacheSettings
from .conditioning import Conditioning
from .outputs import Decoded, Latents
from .request import GenerationRequest


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


def part(read, **kw):
    """A field holding a typed part (`Degrees`, `Conditioning`, ...): it travels as the
    part's `to_wire()` (plain values and tensors) and `read` makes the part again."""
    return field(metadata={"read": read}, **kw)


def _plain(v):
    """A field's wire value: parts as their `to_wire()`, inside dicts too."""
    if hasattr(v, "to_wire"):
        return v.to_wire()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# ---- host -> rank 0 ---------------------------------------------------------------------
@_message
class Job(Message):
    """Generate: `request` is the GenerationRequest (workers/runtime/request.py), every
    default resolved, its references and start image moved to the fields below; tensors
    are model space (workers/models/latent_layout.py). The host fills the fields up to
    `reference_images`; rank 0 prepares the job once (workers/runtime/worker.py: prompts
    encoded, references turned into model-space inputs, LoRA files read), fills the fields
    after them, and broadcasts this same Job to every rank, which runs it
    (workers/sampling/denoise.py)."""
    KIND: ClassVar[str] = "job"
    job_id: int
    request: GenerationRequest = part(GenerationRequest.from_wire)
    config: Degrees = part(Degrees.from_wire)
    noise: Any  # [B, ...] model-space noise, drawn once by the host
    init_latent: Any = None  # model space (img2img)
    denoise: float = 1.0
    options: dict = field(default_factory=dict)  # per-job PipeFusion settings
    # reference images: raw-VAE-space [1 or B, C, h, w] each, in order (the workers turn
    # them into model-space tokens); their layout method is request.reference_method
    references: Optional[list] = None
    # reference images [H, W, 3] float 0..1 each, in order (rank 0 encodes them with the
    # folder's VAE as the family's pipeline does; its text encoder may read them too)
    reference_images: Optional[list] = None
    # ---- rank 0's, never the host's: the guidance branches' transformer inputs (the
    # negative None without CFG), and the references' model-space inputs: {"tokens":
    # [1 or B, M, C], plus what the adapter's forward needs of them (FLUX: "ids"; Qwen-Image:
    # "shapes")}, or Wan image-to-video's {"tokens": the start frame's condition [1 or B,
    # 20, T, h, w]}, joined to the latents along channels
    cond: Optional[dict] = None
    uncond: Optional[dict] = None
    reference_inputs: Optional[dict] = None
    lora_adapters: Optional[list] = None  # the request's LoRAs as read (LoraManager.resolve)


@_message
class Decode(Message):
    """Decode the family's ComfyUI LATENT samples with the model's VAE, patch-parallel over
    every rank; the answer is a `Result` whose `decoded` holds the images."""
    KIND: ClassVar[str] = "decode"
    job_id: int
    samples: Any


@_message
class Predict(Message):
    """One denoiser evaluation for a host-side sampler (workers/sampling/model_call.py): latents
    [N, C, h, w] model space ([N, C, T, h, w] for a video family), one timestep
    (sigma * 1000) and FLUX guidance per row, `chunks` [(conditioning key, rows)] in row
    order; `conds` carries the conditionings rank 0 has not seen, {key: Conditioning}
    (workers/runtime/conditioning.py: text states, pooled, second text, CLIP vision states,
    reference latents and their method), which the workers cache by key."""
    KIND: ClassVar[str] = "predict"
    call_id: int
    config: Degrees = part(Degrees.from_wire)
    x: Any
    timestep: Any
    guidance: Any = None
    chunks: list = field(default_factory=list)
    conds: dict = part(Conditioning.map_from_wire, default_factory=dict)
    timed: bool = False  # benchmarks: report the call's phase timings (CUDA events on GPUs)
    cache: Optional[CacheSettings] = part(CacheSettings.from_wire, default=None)  # None: off
    expert: int = 0  # a model of several experts (Wan 2.2 A14B): 0 the first, 1 the second
    loras: list = field(default_factory=list)  # [(path, strength[, expert])], as a job's
    # a LATENT of several parts (workers/sampling/latent_parts.py): their per-row shapes,
    # `x` then [N, total]; () for one tensor
    parts: list = field(default_factory=list)
    inputs: dict = field(default_factory=dict)  # the family's scalar model inputs (ComfySpec)


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
    """A job's or a decode's outcome: its latents (model space; None for a decode) and their
    decode (None unless asked for), typed (workers/runtime/outputs.py); every rank's stats."""
    KIND: ClassVar[str] = "result"
    job_id: int
    latents: Optional[Latents] = part(Latents.from_wire, default=None)
    decoded: Optional[Decoded] = part(Decoded.from_wire, default=None)
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
    return (msg.KIND, {f.name: _plain(getattr(msg, f.name)) for f in fields(msg)})


def from_wire(wire) -> Message:
    try:
        kind, body = wire
        cls = _KINDS[kind]
    except (TypeError, ValueError, KeyError):
        raise ProtocolError(f"not a protocol message: {str(wire)[:80]!r}") from None
    try:
        body = dict(body)
        for f in fields(cls):
            read = f.metadata.get("read")
            if read is not None and body.get(f.name) is not None:
                body[f.name] = read(body[f.name])
        return cls(**body)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad {kind!r} message: {e}") from None
