"""One denoiser evaluation for a sampler that runs on the host (ComfyUI's KSampler & co.).

The host sends a batch of latent rows in model space (unpacked, [N, C, h, w]), one timestep
per row (the diffusers pipelines' scale: sigma * 1000) and, per chunk of rows, a key naming
its conditioning. A conditioning crosses the wire once: rank 0 broadcasts it with the first
call that uses it and every rank keeps it (on its device) in a small cache with the same
eviction order everywhere, so later calls carry only latents, timesteps and keys.

Rows are independent, so the xDiT split is exact: the rows are divided near-evenly over the
dp x cfg replicas (ComfyUI's batched call puts the conditional and unconditional rows side by
side, so CFG parallel falls out of the row split), and each replica runs its rows through the
transformer with Ulysses/Ring inside (the usual sequence-parallel hooks). One all-gather on
the data plane brings every replica's rows to rank 0, which returns the prediction.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from .. import families
from ..parallel.degrees import Degrees
from ..parallel.sequence_parallel import even_sizes
from ..parallel.sharding import is_sharded
from ..parallel.topology import all_gather, all_reduce
from . import latent_parts
from .cache_settings import CacheSettings
from .step_cache import call_on_ranks, gated
from .step_scope import no_step_scope

COND_CACHE = 16  # conditionings kept per rank (a sampling run uses 1-3)


@dataclass
class ModelCall:
    """What rank 0 broadcasts for one call (control plane; small apart from `x`)."""

    call_id: int
    config: Degrees  # the layout, by axis (workers/parallel/degrees.py)
    x: torch.Tensor  # [N, C, h, w] model space, fp32, CPU ([N, C, T, h, w]: video families)
    # [N], sigma * 1000; [N, tokens] a timestep per token (a family's TokenTimesteps: the
    # parts' tokens end to end), split by rows as x, by tokens in the family's forward
    timestep: torch.Tensor
    guidance: Optional[torch.Tensor]  # [N] FLUX embedded guidance, else None
    chunks: list  # [(key, rows)], rows summing to N, in row order
    # key -> Conditioning (workers/runtime/conditioning.py), CPU: those rank 0 had not seen
    new_conds: dict = field(default_factory=dict)
    timed: bool = False  # a benchmark asks for the phases' timings (workers: `_Clock`)
    cache: Optional[CacheSettings] = None  # the step cache's settings (None: off)
    expert: int = 0  # which transformer runs (a model of several experts: Wan 2.2 A14B)
    lora_adapters: list = field(default_factory=list)  # LoraManager.resolve's, as a job's
    # a LATENT of several parts (workers/sampling/latent_parts.py): their per-row shapes,
    # `x` then [N, total] and the prediction too; () for one tensor
    parts: tuple = ()
    inputs: dict = field(default_factory=dict)  # the family's scalar model inputs (ComfySpec)


class CondCache:
    """Per-rank LRU of conditionings on the device; every rank applies the same sequence of
    puts and touches, so every rank holds the same keys."""

    def __init__(self, capacity: int = COND_CACHE):
        self.capacity = capacity
        self.items: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self.puts = 0
        self.calls = 0  # model calls run on this rank
        self.by_size: dict = {}  # per latent size: forward inputs made once on the device
        # the step cache of host-side sampling runs: one RunCache per settings, its rows
        # keyed (conditioning key, row): a new sampling run (new keys) starts fresh
        self.steps = None
        self._steps_key = None

    def step_cache(self, settings: Optional[CacheSettings]):
        """The RunCache for `settings` (None: the cache is off)."""
        if settings is None:
            return None
        if settings != self._steps_key:
            from .step_cache import RunCache
            self.steps, self._steps_key = RunCache(settings), settings
        return self.steps

    def sized(self, key, make) -> dict:
        if key not in self.by_size:
            if len(self.by_size) >= self.capacity:
                self.by_size.pop(next(iter(self.by_size)))
            self.by_size[key] = make()
        return self.by_size[key]

    def missing(self, keys) -> list:
        return [k for k in dict.fromkeys(keys) if k not in self.items]

    def put(self, key: str, value: dict) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        self.puts += 1

    def get(self, key: str) -> dict:
        self.items.move_to_end(key)
        return self.items[key]

    def trim(self, keep=()) -> None:
        keep = set(keep)
        for k in list(self.items):
            if len(self.items) <= self.capacity:
                break
            if k not in keep:
                del self.items[k]
        if self.steps is not None:  # rows of evicted conditionings go with them
            self.steps.rows = {k: v for k, v in self.steps.rows.items() if k[0] in self.items}


def call_problem(model, adapter, x, timestep, guidance, chunks, new_conds, cache,
                 parts=()) -> str:
    """Rank 0, before anything is broadcast: what is wrong with a call, or "". `parts`: the
    per-row shapes of a LATENT of several parts (`x` then [N, total])."""
    cfg = model.transformer.config
    names = adapter.family.comfy.latent_parts
    if parts or names:
        problem = latent_parts.problem(x, parts, names) or adapter.parts_problem(model, parts)
        if problem:
            return problem
        return _rows_problem(adapter, cfg, int(x.shape[0]), timestep, guidance, chunks,
                             new_conds, cache, shapes=parts)
    # packing families take 2x2 latent pixels per token; the call's x is unpacked
    channels = int(cfg.in_channels) // (1 if adapter.family.latent.tokens == "in_model" else 4)
    # a video family's calls keep the frame axis: [N, C, T, h, w] (an image family's one frame
    # is dropped by the host)
    video = adapter.family.latent.video
    if not torch.is_tensor(x) or x.dim() != (5 if video else 4) or x.shape[1] != channels:
        got = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        frames = "frames, " if video else ""
        return (f"the model takes latents [batch, {channels}, {frames}height/8, width/8] "
                f"(got {got})")
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    side = adapter.family.latent.per_token  # latent pixels per token side
    if h % side or w % side or min(n, h, w, *x.shape[2:]) < 1:
        even = "even and " if side == 2 else ""
        return f"latent height and width must be {even}non-zero (got {h}x{w})"
    return _rows_problem(adapter, cfg, n, timestep, guidance, chunks, new_conds, cache,
                         int(x.shape[1]), shapes=(tuple(int(d) for d in x.shape[1:]),))


def timestep_problem(family, timestep, n: int, shapes) -> str:
    """A call's timesteps: one per row [n], or, for a family whose ComfyUI model takes a
    timestep per token (its TokenTimesteps), one per token of the row's parts of these
    per-row shapes, laid end to end as the parts' tokens [n, tokens]."""
    if torch.is_tensor(timestep) and tuple(timestep.shape) == (n,):
        return ""
    per_token = family.capability(families.TokenTimesteps)
    if per_token is None:
        return f"one timestep per latent row expected ({n})"
    tokens = sum(per_token.tokens(shapes))
    if not torch.is_tensor(timestep) or tuple(timestep.shape) != (n, tokens):
        got = tuple(timestep.shape) if torch.is_tensor(timestep) else type(timestep).__name__
        return (f"timesteps must be one per latent row [{n}] or one per token [{n}, {tokens}] "
                f"(got {got})")
    return ""


def _rows_problem(adapter, cfg, n, timestep, guidance, chunks, new_conds, cache,
                  channels=None, shapes=()) -> str:
    """The per-row inputs (timesteps, guidance) and the conditionings of a call of `n` rows
    (`channels`: the latent's, which references must have; None: a LATENT of parts, of the
    per-row `shapes`)."""
    problem = timestep_problem(adapter.family, timestep, n, shapes)
    if problem:
        return problem
    if guidance is not None and (not torch.is_tensor(guidance) or tuple(guidance.shape) != (n,)):
        return f"one guidance value per latent row expected ({n})"
    if sum(int(r) for _, r in chunks) != n or any(int(r) < 1 for _, r in chunks):
        return f"conditioning chunks cover {[r for _, r in chunks]} rows, the batch has {n}"
    lengths, references, images, texts_2 = set(), set(), set(), set()
    for key, rows in chunks:
        c = new_conds.get(key)
        if c is None:  # cached: checked when it arrived
            cached = cache.items.get(key)
            if cached is not None:
                lengths.add(cached.get(GIVEN_TEXT) or
                            ("", int(cached["encoder_hidden_states"].shape[1])))
                references.add(cached.get("ref_layout"))
                image = cached.get("image_embeds")
                images.add(None if image is None else tuple(image.shape[1:]))
                text_2 = cached.get("encoder_hidden_states_2")
                texts_2.add(None if text_2 is None else int(text_2.shape[1]))
            continue
        shapes = c.call_problems(rows)  # the shape rules every conditioning follows
        if shapes:
            return f"conditioning {key}: {shapes[0]}"
        problem = _image_states_problem(adapter.family, cfg, key, rows, c.image_embeds)
        if problem:
            return problem
        text_2 = as_tensor(c.context_2)
        if text_2 is not None:
            width_2 = adapter.family.config_width("text_2_width", cfg)
            if width_2 is None or text_2.shape[2] != width_2:
                return (f"conditioning {key}: second text states must be [{rows}, tokens, "
                        f"{width_2}] (got {tuple(text_2.shape)})")
        texts_2.add(None if text_2 is None else int(text_2.shape[1]))
        image = c.image_embeds
        images.add(None if image is None else tuple(image.shape[1:]))
        problem = _reference_problem(adapter, key, rows, channels, c)
        if problem:
            return problem
        references.add(reference_layout(adapter, c))
        ctx, pooled = as_tensor(c.context), as_tensor(c.pooled)
        kind, problem = text_kind(adapter.family, cfg, int(ctx.shape[2]))
        if problem:
            return f"conditioning {key}: {problem} (got {tuple(ctx.shape)})"
        # a family without a pooled projection (FLUX.2) needs no pooled output (nor uses it)
        if adapter.family.text.pooled and (
                pooled is None or pooled.shape[1] != int(cfg.pooled_projection_dim)):
            return (f"conditioning {key}: pooled output must be [{rows}, "
                    f"{int(cfg.pooled_projection_dim)}] (got "
                    f"{None if pooled is None else tuple(pooled.shape)})")
        lengths.add((kind, int(ctx.shape[1])))
    if len({k for k, _ in lengths}) > 1:
        return ("the conditionings of one call hold text states of both kinds (before and "
                "after the model's own text modules); give them all of one kind")
    if len(lengths) > 1 and not adapter.family.comfy.ragged_text:  # (else padded, `_texts`)
        return (f"the conditionings of one call have different token counts "
                f"{sorted(n for _, n in lengths)}")
    if len(references) > 1:
        return ("the conditionings of one call have different reference latents (sizes or "
                "method); one call runs one image stream layout")
    if len(texts_2) > 1:
        return ("the conditionings of one call differ in their second text states (present "
                "in some, or of other lengths)")
    if len(images) > 1:
        return ("the conditionings of one call differ in their CLIP vision states (clip_fea: "
                "present in some, or of other sizes); give the positive and the negative the "
                "same clip_vision_output (WanImageToVideo does)")
    return ""


# a cached conditioning's text states as they were given: (kind, tokens)
GIVEN_TEXT = "given_text"


def text_kind(family, cfg, width: int) -> tuple:
    """("" | "raw", problem or ""): which kind of text states a context of `width` holds.
    ComfyUI's context: the text states of every stream that has its own, side by side; or,
    where the family's ComfyUI model also takes them (`ComfySpec.raw_context_width`), the
    states its own text modules still have to turn into those. Told apart by the width,
    which the family declares distinct; any other width is one error naming both."""
    want = family.text_width(cfg) * family.comfy.context_streams
    if width == want:
        return "", ""
    raw = family.comfy.raw_context_width
    raw = None if raw is None else int(raw(cfg))
    if raw is not None and raw != want and width == raw:
        return "raw", ""
    return "", (f"text states must be [rows, tokens, {want}]" if raw is None else
                f"text states must be [rows, tokens, {want}] (the transformer's) or "
                f"[rows, tokens, {raw}] (before the model's own text modules)")


def _image_states_problem(family, cfg, key: str, rows: int, image) -> str:
    """CLIP vision states (`image_embeds` of a conditioning: Wan 2.1 I2V's, HunyuanVideo
    1.5's SigLIP tokens): only for a transformer that takes image states (its config's
    "image_width", Wan's `image_dim`), [rows, tokens, that width]."""
    if image is None:
        return ""
    width = family.config_width("image_width", cfg)
    if width is None:
        return (f"conditioning {key}: CLIP vision states (clip_fea) given, but this "
                f"transformer has no image cross-attention (Wan 2.1 I2V has): remove the "
                f"clip_vision_output from WanImageToVideo")
    image = as_tensor(image)
    if image.shape[2] != int(width):
        return (f"conditioning {key}: CLIP vision states must be [{rows}, tokens, "
                f"{int(width)}] (got {tuple(image.shape)})")
    return ""


def reference_layout(adapter, c):
    """What must agree across a call's rows (`c`: a Conditioning): the references' sizes and
    method (None: no references)."""
    refs = c.ref_latents
    if not refs:
        return None
    method = c.ref_method or adapter.reference_methods()[0]
    return (tuple((int(r.shape[-2]), int(r.shape[-1])) for r in refs), method)


def _reference_problem(adapter, key, rows, channels, c) -> str:
    """The references against the model (their shapes are `Conditioning.problems`')."""
    refs = c.ref_latents
    if refs is None:
        return ""
    if not adapter.reference_methods() or channels is None:
        return (f"conditioning {key}: reference latents are not supported by {adapter.arch} "
                f"models (FLUX.1 Kontext, FLUX.2 or Qwen-Image-Edit only); remove the "
                f"ReferenceLatent node")
    methods = adapter.reference_methods()
    if c.ref_method is not None and c.ref_method not in methods:
        return (f"conditioning {key}: reference method {c.ref_method!r} is not one of "
                f"{list(methods)}")
    for i, r in enumerate(refs):
        if int(r.shape[1]) != channels:
            return (f"conditioning {key}: reference latent #{i + 1} must be [{rows}, "
                    f"{channels}, h, w] like the call's latents (got {tuple(r.shape)})")
    return ""


def _cached(cache: CondCache, key: str, value, model, adapter) -> None:
    """Convert a Conditioning to the transformer's inputs on this rank's device."""
    dev, dtype = model.device, model.dtype
    extra = {} if value.context_2 is None else \
        {"context_2": as_tensor(value.context_2)}  # a second text encoder's states
    ctx = as_tensor(value.context)
    kind, _ = text_kind(adapter.family, model.transformer.config, int(ctx.shape[2]))
    given = (kind, int(ctx.shape[1]))
    if kind == "raw":  # through the model's own text modules first (checked: `_rows_problem`)
        ctx = adapter.raw_text(model, ctx)
    d = adapter.conditioning(ctx, as_tensor(value.pooled), **extra)
    d = {k: v.to(dev, dtype if v.is_floating_point() else None) for k, v in d.items()}
    d[GIVEN_TEXT] = given
    if value.image_embeds is not None:  # Wan 2.1 I2V: the CLIP vision states
        d["image_embeds"] = as_tensor(value.image_embeds).to(dev, dtype)
    if value.ref_latents:  # packed once per sampling run, like the text
        refs = [as_tensor(r).to(dev, dtype) for r in value.ref_latents]
        d["ref_tokens"] = adapter.pack_references(refs)
        d["ref_layout"] = reference_layout(adapter, value)
    cache.put(key, d)


def replica_rows(n: int, topo) -> tuple:
    """(row counts of every dp x cfg replica, this rank's replica index)."""
    replicas = topo.degree("dp") * topo.degree("cfg")
    me = topo.index("dp") * topo.degree("cfg") + topo.index("cfg")
    return even_sizes(n, replicas), me


def as_tensor(v):
    """A wire value (numpy array: pickles ~30x faster than a tensor) as a tensor."""
    if v is None or torch.is_tensor(v):
        return v
    return torch.from_numpy(v)


def for_wire(call: ModelCall) -> ModelCall:
    """The copy of `call` rank 0 broadcasts: its arrays as numpy (cheap to pickle)."""
    def np_(v):
        return v.detach().cpu().numpy() if torch.is_tensor(v) else v
    return replace(call, x=np_(call.x), timestep=np_(call.timestep), guidance=np_(call.guidance))


def run_call(call: ModelCall, model, adapter, topo, cache: CondCache, planes,
             step_scope=None, sequence=None):
    """Every rank: this rank's replica's rows, then (with several replicas) one all-gather
    among the replicas' leaders. Returns (the prediction [N, C, h, w] fp32 CPU on rank 0,
    None elsewhere; this rank's timings, when `call.timed`).

    The call's own inputs come from the host and its prediction goes back to it; between
    those (`step_scope`, xdit_testhooks/host_syncs.py) nothing waits on the host: per-size
    inputs are cached on the device, and timings, asked for by benchmarks only, are CUDA
    events read once the prediction is home."""
    clock = _Clock(model.device, call.timed)
    dev, dtype = model.device, model.dtype
    for key, value in call.new_conds.items():
        _cached(cache, key, value, model, adapter)
    conds = [cache.get(k) for k, _ in call.chunks]
    cache.trim(keep=[k for k, _ in call.chunks])
    x_all, t_all, g_all = as_tensor(call.x), as_tensor(call.timestep), as_tensor(call.guidance)
    n, c, h, w = x_all.shape[0], x_all.shape[1], x_all.shape[-2], x_all.shape[-1]
    framed = x_all.dim() == 5  # a video family's frame axis stays (Wan)
    shapes = tuple(tuple(int(d) for d in s) for s in call.parts)  # a LATENT of parts
    sizes, me = replica_rows(n, topo)
    start = sum(sizes[:me])
    mine = slice(start, start + sizes[me])
    # weight sharding (workers/parallel/sharding.py): every rank must run every block's forward, so a
    # replica with no rows runs one dummy row (the first) and discards it
    dummy = not sizes[me] and is_sharded(model.transformer)
    if dummy:
        mine = slice(0, 1)
    pred = None
    scope = step_scope or no_step_scope
    run = cache.step_cache(call.cache)
    before = (0, 0) if run is None else (run.computed, run.skipped)
    if sizes[me] or dummy:
        cond = {}
        for k in conds[0]:
            if k == "encoder_hidden_states":  # texts of other lengths: padded, lengths beside
                cond.update(_texts(conds, call.chunks, mine))
            elif k in ("pooled_projections", "ref_tokens", "image_embeds",
                       "encoder_hidden_states_2") or k in adapter.row_conds:
                cond[k] = conds[0][k] if len(conds) == 1 else torch.cat([cd[k] for cd in conds])
                cond[k] = cond[k][mine]
            elif k not in ("ref_layout", GIVEN_TEXT):
                cond[k] = conds[0][k]  # per-token ids, shared by the batch
        x = x_all[mine].to(dev, dtype)  # the call's inputs: the one upload per call
        t = t_all[mine].to(dev, torch.float32)
        g = None if g_all is None else g_all[mine].to(dev, torch.float32)
        layout = conds[0].get("ref_layout")
        if shapes:  # the parts' sizes and the call's inputs give the forward's inputs
            inputs = dict(call.inputs)
            extra = dict(cache.sized(("parts", shapes, tuple(sorted(inputs.items()))),
                                     lambda: adapter.parts_extra(model, shapes, inputs)))
        else:
            extra = dict(cache.sized((h, w, layout),
                                     lambda: _extra(model, adapter, h, w, layout)))
        # the rows' timesteps as the host sent them (CPU: a forward that groups rows by
        # timestep, the adapter's `one_timestep`, reads them without waiting on the device)
        extra["host_timesteps"] = t_all[mine]
        if call.expert:  # the model's other transformer (Wan 2.2 A14B's low-noise expert)
            extra["expert"] = int(call.expert)
        if "ref_tokens" in cond:  # ComfyUI's FLUX: the references join the image stream
            extra["ref_tokens"] = cond.pop("ref_tokens")
        step = None
        if run is not None:  # rows: (conditioning key, row); a dummy row follows the others
            keys = [None] if dummy else \
                [(k, j) for k, rows in call.chunks for j in range(rows)][mine]
            if call.expert:  # each expert its own residuals
                keys = [k if k is None else k + (call.expert,) for k in keys]
            # the transformer this call runs (its expert), and the installed sequence plan
            # for blocks not given it (`sequence`: the worker's SequenceParallel or None)
            step = call_on_ranks(run, model, adapter, keys, topo, planes.control,
                                 is_sharded(model.transformer),
                                 adapter.transformer_for(model, extra),
                                 None if sequence is None else (lambda: sequence.plan))
        with scope("call", cache.calls), gated(step):
            packed = adapter.pack_parts(latent_parts.unflatten(x, shapes)) if shapes \
                else adapter.pack(x)
            clock.mark("forward")
            pred = adapter.forward(model, packed, t, cond, g, extra)
            clock.mark("post")
            if dummy:
                pred = None
            elif shapes:  # the prediction's parts, flattened as the call's
                pred = torch.cat([p.reshape(p.shape[0], -1)
                                  for p in adapter.unpack_parts(pred, shapes)], 1)
            else:
                pred = adapter.unpack(pred, h * 8, w * 8)
                if pred.dim() == 5 and not framed:  # one frame: [N,C,h,w]
                    pred = pred[:, :, 0]
    cache.calls += 1
    leader = all(topo.index(a) == 0 for a in ("pipefusion", "ring", "ulysses"))
    done = {} if run is None else {  # this rank's rows: computed in full / cached
        "cache": {"computed": run.computed - before[0], "skipped": run.skipped - before[1]}}
    if len(sizes) == 1 or not leader:
        # one replica: every rank computed the same rows (sequence parallel inside) and rank
        # 0 has the answer; a replica's other ranks hold copies of their leader's rows
        result = pred.float().cpu() if topo.rank == 0 else None
        return result, dict(clock.read(planes.control), **done)
    # several replicas: their leaders gather the rows (padded to the longest replica)
    longest = max(sizes)
    # the prediction's channels: the transformer's output (an image-to-video model takes
    # its start frame's channels beside the latent: in 36, out 16)
    out_c = int(getattr(model.transformer.config, "out_channels", None) or c) \
        if adapter.family.latent.tokens == "in_model" else c
    row = tuple(x_all.shape[1:]) if shapes else (out_c, *x_all.shape[2:])
    out = torch.zeros(longest, *row, device=dev, dtype=torch.float32)
    if pred is not None:
        out[: sizes[me]].copy_(pred)
    clock.mark("gather")
    parts = [torch.empty_like(out) for _ in sizes]
    all_gather(parts, out, group=topo.group("replicas"))
    clock.mark("end")
    result = None
    if topo.rank == 0:
        result = torch.cat([p[:size] for p, size in zip(parts, sizes)]).cpu()
    return result, dict(clock.read(planes.control), **done)


def _texts(conds: list, chunks: list, rows: slice) -> dict:
    """The call's text states for rows `rows`: the chunks' conditionings joined, zero-padded
    to the longest of these rows where their lengths differ (a family whose MODEL lets
    texts of other lengths share a call), with each row's real length as `text_lengths`
    (host ints: the attention drops each row's padded keys)."""
    texts = [cd["encoder_hidden_states"] for cd in conds]
    if len(texts) == 1 or len({int(t.shape[1]) for t in texts}) == 1:
        return {"encoder_hidden_states": (texts[0] if len(texts) == 1 else
                                          torch.cat(texts))[rows]}
    lengths = [int(t.shape[1]) for t, (_, n) in zip(texts, chunks) for _ in range(n)][rows]
    longest = max(lengths)
    out = torch.cat([torch.nn.functional.pad(t[:, :longest], (0, 0, 0, longest - min(
        longest, t.shape[1]))) for t in texts])[rows]
    if len(set(lengths)) == 1:  # these rows' texts are alike: no padding
        return {"encoder_hidden_states": out}
    return {"encoder_hidden_states": out, "text_lengths": tuple(lengths)}


def _extra(model, adapter, h, w, layout) -> dict:
    """A latent size's forward inputs (image ids, references' ids) on the device."""
    extra = adapter.forward_extra(model, h * 8, w * 8)
    if layout is not None:
        ref_sizes, ref_method = layout
        extra.update(adapter.reference_extra(extra, ref_sizes, ref_method, h * 8, w * 8,
                                             model.device))
    return extra


class _Clock:
    """A call's phases, timed only when a benchmark asks (`ModelCall.timed`): CUDA events on a
    GPU (host clocks would time kernel launches, not the work), read once at the end; the
    slowest rank's forward comes from one small control-plane all-reduce."""

    def __init__(self, device, on: bool):
        self.on, self.cuda = on, on and torch.device(device).type == "cuda"
        self.marks = {}
        if on:
            self.mark("start")

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def _span(self, a: str, b: str) -> float:
        if a not in self.marks or b not in self.marks:
            return 0.0
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b]) / 1000
        return self.marks[b] - self.marks[a]

    def read(self, control) -> dict:
        if not self.on:
            return {}
        self.mark("done")
        if self.cuda:
            self.marks["done"].synchronize()
        after = "gather" if "gather" in self.marks else "done"
        times = {"pre_s": self._span("start", "forward"),
                 "forward_s": self._span("forward", "post"),
                 "post_s": self._span("post", after),
                 "gather_s": self._span("gather", "end"),
                 "run_s": self._span("start", "done")}
        slowest = torch.tensor([times["forward_s"]], dtype=torch.float64)
        if dist.get_world_size(control) > 1:
            all_reduce(slowest, group=control, op="max")
        times["forward_max_s"] = float(slowest[0])
        return times
