"""Will it fit? The memory plan's arithmetic: each rank's GPU bytes, computed before any
worker starts, and the bytes a rank sends per denoising step.

For a model's facts (model_facts.py), a ParallelConfig, EngineOptions and a job size, each
rank's bytes are added up part by part:

- weights: the transformer's parameters as that rank holds them, counted on the real
  module tree built on the meta device from the model's config (no memory, no download):
  every parameter for Ulysses / Ring / CFG / DP (replicated); the rank's PipeFusion stage
  (the split of workers/loading/stages.py) plus the modules around the blocks; with
  shard_weights, FSDP2's dim-0 shards (padded rows included) of every parameter, plus, during
  a forward, the non-block parameters gathered whole and the two largest consecutive blocks
  gathered (the running block and the prefetched next one: workers/parallel/sharding.py);
  with an uneven `shard_split`, each rank's own rows of every parameter by its weight, and
  during a forward the non-block parameters whole plus one block's padded receive buffer and
  the block assembled from it (workers/parallel/uneven_sharding.py: no prefetch).
  fp8 (or an fp8 checkpoint under weights=auto) stores the Linears inside the blocks in 1
  byte (workers/loading/weights.py); everything else is in the pool dtype. Persistent
  buffers (SD3's positional table) are whole on every rank.
- activations: one forward's live tensors, a conservative estimate (see `activation_bytes`),
  or the patch-parallel VAE decode's if larger (it runs after the transformer has freed
  its own).
- kv_cache: PipeFusion's per-layer K/V of the full sequence for this rank's heads, for every
  block of the stage and every CFG branch the rank runs.
- text_encoders: on rank 0's GPU, unless placed on the CPU ("auto" mirrors the worker: the
  GPU when they fit beside the rest with 2 GiB to spare, else the CPU) or on the GPU that
  `cuda:N` names: another rank's (counted there) or one no rank uses (checked on its own).
- vae: its weights on every rank (every rank takes part in the patch-parallel decode), or
  on rank 0 alone for a VAE that decodes there whole (its `CausalVAE` capability's
  `one_rank`, LTX-2's), whose decode activations are then rank 0's, unsplit.
- reserve: a fixed RESERVE_BYTES for the CUDA context, cuBLAS/cuDNN workspaces, NCCL
  buffers of the pool's process groups and allocator fragmentation.

The activation estimate and the reserve are not measured on a GPU yet (a predicted misfit:
launch_policy.py; measured peaks: calibration.py). Not counted: LoRA adapters (small),
ComfyUI's own models (offloaded before a job), attention scores (the kernels never hold them).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from comfyui_xdit.errors import ConfigError
from comfyui_xdit.planning.config import EngineOptions, ParallelConfig, pipefusion_refusal
from comfyui_xdit.planning.model_facts import ModelFacts, TransformerFacts, transformer_facts
from comfyui_xdit import bridge
from comfyui_xdit.bridge import families

GiB = 2 ** 30
RESERVE_BYTES = 2 * GiB  # CUDA context + workspaces + NCCL buffers + fragmentation
TEXT_ENCODER_MARGIN = 2 * GiB  # workers/loading/weights.py: "auto" wants this spare beside them
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
VAE_SCALE = 8  # every supported VAE downsamples by 8 ...
PATCH = 2  # ... and the transformers see 2x2 latent patches: one token per 16x16 pixels
# Activation multipliers (per token, in units of the model's hidden size): see activation_bytes
ACT_STREAM = 8
ACT_SP_BUFFERS = 4
VAE_LIVE = 4  # live feature maps of the VAE decoder's largest level (in, norm, conv, residual)
# The one set of link rates every traffic time (CLI, docs) is computed with: all-gather bus
# bandwidth a rank receives at, GB/s (1e9 B/s). Achievable NCCL rates, not the wire's peak:
# PCIe 4.0 x16 is 32 GB/s per direction, ~25 in practice; H100 SXM's NVLink 4 is 450 GB/s
# per direction, ~350 what an NCCL all-gather reaches. Rough by design; `memory-plan
# --link-gbps` takes yours.
LINKS_GBPS = (("PCIe 4.0 x16", 25.0), ("NVLink", 350.0))


def stage_ranges(tr: TransformerFacts, stages: int, split: str) -> list:
    """The (start, stop) block range of every PipeFusion stage: workers/loading/stages.py's
    split, on the counts of the meta model (the same arithmetic its plan_stages runs)."""
    ps = bridge.stages
    compute, memory = tr.stage_costs
    ranges = ps.parse_split(str(split), len(compute), stages)
    if ranges == "balanced":
        total = sum(memory) + sum(n for n, _, _ in tr.rest)
        ranges = ps.partition(compute, stages, memory,
                              cap=(1.0 / stages + ps.WEIGHT_SLACK) * total - sum(
                                  n for n, _, _ in tr.rest))
        if ranges is None:
            ranges = "memory"
    if isinstance(ranges, str):
        ranges = ps.partition(compute if ranges == "compute" else memory, stages)
    return list(ranges)


@dataclass(frozen=True)
class JobSize:
    height: int = 1024
    width: int = 1024
    batch: int = 1
    text_tokens: Optional[int] = None  # None: the model's default (512)
    cfg: bool = False  # classifier-free guidance in use (two branches)
    reference_tokens: int = 0  # reference images' tokens, joined to the image stream
    frames: int = 1  # video frames (4k + 1 for Wan): latent frames x the image's tokens


@dataclass(frozen=True)
class RankPlan:
    rank: int
    role: str
    weights: int
    activations: int
    kv_cache: int
    text_encoders: int
    vae: int
    reserve: int
    gpu_memory: Optional[int]

    PARTS = ("weights", "activations", "kv_cache", "text_encoders", "vae", "reserve")
    LABELS = {"weights": "transformer weights", "activations": "activations",
              "kv_cache": "PipeFusion K/V cache", "text_encoders": "text encoders",
              "vae": "VAE", "reserve": "CUDA reserve"}

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in self.PARTS)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.gpu_memory is None else self.total <= self.gpu_memory

    @property
    def largest(self) -> str:
        return max(self.PARTS, key=lambda p: getattr(self, p))


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    config: ParallelConfig
    engine: EngineOptions
    job: Optional[JobSize]  # None: the fixed parts only (weights, encoders, VAE, reserve)
    ranks: tuple
    text_encoders_on: str  # "gpu (rank 0)" | "cpu" | "none"
    alternatives: tuple = ()  # ((description, worst rank total), ...) that fit
    # shard_weights: bytes each rank receives from the others' shards per denoising step
    # (every sharded parameter gathered once per forward, one forward per branch it runs)
    gather_bytes_per_step: int = 0
    # plan_launch: each reason the launch does not fit, one sentence with its numbers (the
    # plan's message; a text-encoder GPU too small): mode "enforce" raises them, "advise" warns
    misfits: tuple = ()

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.total - (r.gpu_memory or 0), r.total))

    @property
    def fits(self) -> Optional[bool]:
        verdicts = [r.fits for r in self.ranks]
        return None if None in verdicts else all(verdicts)

    def summary(self) -> str:
        """One line: the peak rank's total against its GPU and the verdict."""
        w = self.worst
        cap = f" of {gib(w.gpu_memory)}" if w.gpu_memory is not None else ""
        verdict = {True: "fits", False: "does NOT fit", None: "GPU memory unknown"}[self.fits]
        return (f"memory plan: rank {w.rank} peaks at {gib(w.total)}{cap} ({verdict}); "
                f"largest part {RankPlan.LABELS[w.largest]} {gib(getattr(w, w.largest))}")

    def message(self) -> str:
        """A paragraph: the verdict with the numbers, the largest part, and what would fit."""
        w = self.worst
        parts = ", ".join(f"{RankPlan.LABELS[p]} {gib(getattr(w, p))}" for p in RankPlan.PARTS
                          if getattr(w, p))
        head = (f"{self.model} with {self.config.describe()}"
                f"{' + shard_weights' if self.engine.shard_weights else ''}, "
                f"{self.engine.dtype}, weights={self.engine.weights}, text encoders "
                f"{self.text_encoders_on}, "
                + (f"{self.job.height}x{self.job.width}"
                   + (f" x {self.job.frames} frames" if self.job.frames > 1 else "")
                   + f" batch {self.job.batch}"
                   if self.job is not None else "before any job's activations")
                + f": rank {w.rank} ({w.role}) needs {gib(w.total)}")
        if w.gpu_memory is not None:
            head += f" of its {gib(w.gpu_memory)} GPU"
        head += f" ({parts}); the largest part is {RankPlan.LABELS[w.largest]}."
        if self.fits is False:
            if self.alternatives:
                alts = "; ".join(f"{d} ({gib(t)} per GPU)" for d, t in self.alternatives[:4])
                head += f" It does not fit. On these {len(self.ranks)} GPUs this would: {alts}."
            else:
                head += (f" It does not fit, and no layout on {len(self.ranks)} GPUs of this "
                         f"size does (with pipefusion, shard_weights, fp8 weights or text "
                         f"encoders on the CPU): use more or larger GPUs.")
        return head

    def traffic(self, links=LINKS_GBPS) -> str:
        """shard_weights' cost per step: the all-gather volume and its time on `links`
        ((name, GB/s), ...); empty without sharding."""
        if not self.gather_bytes_per_step:
            return ""
        gb = self.gather_bytes_per_step / 1e9
        times = ", ".join(f"~{gb / bw:.3g} s on {name} ({bw:g} GB/s)" for name, bw in links)
        return (f"shard_weights gathers {gib(self.gather_bytes_per_step)} per rank per step: "
                f"{times}, hidden only where a block's compute takes longer than its gather")

    def table(self) -> str:
        cols = ["rank", "role", "weights", "activ.", "K/V", "text enc.", "VAE", "reserve",
                "total", "GPU", "fits"]
        rows = [[str(r.rank), r.role] + [gib(getattr(r, p), unit=False) for p in r.PARTS] +
                [gib(r.total, unit=False),
                 "?" if r.gpu_memory is None else gib(r.gpu_memory, unit=False),
                 {True: "yes", False: "NO", None: "?"}[r.fits]] for r in self.ranks]
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(cols)) + "   (GiB)"]
        lines += ["  ".join(v.ljust(widths[i]) for i, v in enumerate(row)) for row in rows]
        return "\n".join(lines)


def gib(n: Optional[int], unit: bool = True) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.1f}" + (" GiB" if unit else "")


def _bytes(triples, dtype_bytes: int, fp8, shards: int = 1) -> int:
    """Bytes of parameters; with `shards`, one rank's FSDP2 dim-0 chunk (rows padded up to a
    multiple of the world, as FSDP2 pads). `fp8`: the block Linears' bytes per value when
    they are stored smaller (True: fp8's 1; a GGUF file's, e.g. 34/32 for Q8_0), else 0."""
    total = 0
    for numel, rows, fp8_able in triples:
        size = float(fp8) if (fp8 and fp8_able) else dtype_bytes
        if shards > 1:
            numel = math.ceil(rows / shards) * (numel // max(rows, 1))
        total += numel * size
    return int(total)


def quantised_bytes(facts, weights: str) -> float:
    """The block Linears' bytes per value where they are not in the pool dtype: 1 for fp8
    (asked, or an fp8 checkpoint under auto), a GGUF file's own under auto; else 0."""
    if weights == "fp8" or (weights == "auto" and facts.fp8_checkpoint):
        return 1.0
    return float(getattr(facts, "gguf_bytes_per_value", 0.0)) if weights == "auto" else 0.0


@dataclass(frozen=True)
class ShardFigures:
    """shard_weights over `world` ranks, one rank's bytes (FSDP2's dim-0 chunks, rows padded
    up to a multiple of the world as FSDP2 pads; rank 0 holds the largest chunks)."""

    world: int
    unsharded: int  # a replica's weights: every parameter and buffer
    at_rest: int  # its chunk of every parameter, plus the buffers (FSDP leaves them whole)
    peak: int  # during a forward: + the non-block parameters and two consecutive blocks
    received_per_forward: int  # the other ranks' chunks of every parameter, once a forward


def shard_figures(tr: TransformerFacts, dtype_bytes: int, fp8, world: int) -> ShardFigures:
    """What a rank holds and receives under shard_weights. The non-block parameters are
    gathered for the whole forward; a block's gather is prefetched while the one before it
    runs, so two consecutive blocks are whole at once (workers/parallel/sharding.py)."""
    blocks = [_bytes(b, dtype_bytes, fp8) for b in tr.blocks]
    rest = _bytes(tr.rest, dtype_bytes, fp8)
    buffers = tr.buffers * dtype_bytes
    chunk = sum(_bytes(b, dtype_bytes, fp8, world) for b in tr.blocks) + \
        _bytes(tr.rest, dtype_bytes, fp8, world)
    pair = max(a + b for a, b in zip(blocks, blocks[1:] + [0]))
    return ShardFigures(world=world, unsharded=sum(blocks) + rest + buffers,
                        at_rest=chunk + buffers, peak=chunk + buffers + rest + pair,
                        received_per_forward=(world - 1) * chunk)


def _rank_bytes(triples, dtype_bytes: int, fp8, weights, rank: int) -> int:
    """One rank's rows of every parameter under an uneven shard split (`weights`)."""
    total = 0.0
    for numel, rows, fp8_able in triples:
        size = float(fp8) if (fp8 and fp8_able) else dtype_bytes
        r = max(rows, 1)
        total += bridge.shares.share_sizes(r, weights)[rank] * (numel // r) * size
    return int(total)


def uneven_shard_figures(tr: TransformerFacts, dtype_bytes: int, fp8, weights,
                         rank: int) -> ShardFigures:
    """Rank `rank`'s bytes under an uneven `shard_split` (its rows of every parameter by
    `weights`: workers/parallel/uneven_sharding.py). A unit (a block; the rest) is gathered
    padded to its largest shard: a rank receives (world - 1) x that, and holds the receive
    buffer (world x it) beside the assembled unit; the rest stays whole for the forward. Its
    rows sit in one buffer with room for each unit's window of the largest share."""
    world = len(weights)
    units = [*tr.blocks, tr.rest]

    shares = [[_rank_bytes(u, dtype_bytes, fp8, weights, r) for r in range(world)]
              for u in units]
    whole = [_bytes(u, dtype_bytes, fp8) for u in units]
    buffers = tr.buffers * dtype_bytes
    _, mine = bridge.shares.gather_buffer([sh[rank] for sh in shares],
                                          [max(sh) for sh in shares])
    in_flight = max(world * max(sh) + w for sh, w in zip(shares, whole))
    return ShardFigures(world=world, unsharded=sum(whole) + buffers,
                        at_rest=mine + buffers, peak=mine + buffers + whole[-1] + in_flight,
                        received_per_forward=(world - 1) * sum(max(sh) for sh in shares))


def activation_bytes(tr: TransformerFacts, tokens: int, text_tokens: int, full_tokens: int,
                     batch: int, dtype_bytes: int, sp: int, cross_text: bool = False) -> int:
    """One transformer forward's live activations on a rank, conservatively.

    Per token the rank holds (x hidden size h, and W = the widest Linear output inside the
    blocks, read from the model: the fused QKV+MLP projection of a FLUX.2 single block, the
    MLP's first layer elsewhere): W twice (that projection's output and the activation
    computed from it), ACT_STREAM x h for the residual stream, the modulated norm output,
    Q, K, V, the attention output, the block output and a concatenation copy, and with
    Ulysses/Ring ACT_SP_BUFFERS x h more for the all-to-all / ring send and receive buffers.
    Plus the text embeddings entering the model (text tokens x context width), with
    `cross_text` (text reached by cross-attention, Wan) the whole text's K and V (2 x hidden
    per text token, on every rank), and the RoPE tables (cos and sin, fp32, full sequence x
    head dim). Attention scores are not counted: the kernels the pool uses (flash, cuDNN,
    efficient attention on GPUs; the CPU flash kernel) never materialise them. A kernel that
    did would need heads/ulysses x (sequence / ring)^2 elements per layer: 457 GB in bf16 for
    Wan 14B's 40 heads at 720p x 81 frames (75,600 tokens), on one rank."""
    per_token = 2 * tr.widest + ACT_STREAM * tr.hidden + (ACT_SP_BUFFERS * tr.hidden
                                                         if sp > 1 else 0)
    head_dim = tr.hidden // tr.heads
    text = text_tokens * (tr.context_dim + (2 * tr.hidden if cross_text else 0))
    return batch * dtype_bytes * (tokens * per_token + text) + 2 * full_tokens * head_dim * 4


def vae_largest_map(channels: tuple, height: int, width: int) -> int:
    """Elements of the VAE decoder's largest feature map for one image (vae_decode_bytes)."""
    last = len(channels) - 1
    return max(channels[min(i + 1, last)] * math.ceil(height / 2 ** i) *
               math.ceil(width / 2 ** i) for i in range(len(channels)))


def vae_decode_bytes(channels: tuple, height: int, width: int, batch: int, dtype_bytes: int,
                     ranks: int, frames: int = 1, frames_per_chunk: int = 1) -> int:
    """The patch-parallel VAE decode's live activations on one rank: VAE_LIVE copies of the
    decoder's largest feature map, split over the ranks, plus the fp32 RGB image assembled
    on rank 0. At 1/2^i of the image side the decoder holds block_out_channels[i + 1]
    channels (the deeper level's upsampled output, before its first resnet narrows it; the
    deepest level its own), so FLUX's largest map is 256 channels at full resolution. A
    video's causal 3-D VAE (Wan) decodes one latent frame at a time into `frames_per_chunk`
    frames (its time upsampling, 4): the largest map holds that many frames; the assembled
    output holds all `frames`."""
    if not channels:
        return 0
    largest = vae_largest_map(channels, height, width) * frames_per_chunk
    return batch * (VAE_LIVE * dtype_bytes * math.ceil(largest / ranks) +
                    3 * height * width * 4 * frames)


def job_tokens(facts: ModelFacts, job: JobSize) -> int:
    """Tokens of one attention sequence, from the family's declared streams, each padded
    to its multiple (Z-Image's 32): the image's (the family's `pixels_per_token`) times a
    video's latent frames (Wan 720p x 81 frames: 21 x 45 x 80 = 75,600), every context
    stream's by its declared length (a sound track's), the references'; the text's where
    it is attended jointly with the latent (Wan's is reached by cross-attention)."""
    fam = families.family(facts.arch)
    layout = fam.tokens
    latent, text_stream = layout.latent, layout.text
    side = fam.latent.pixels_per_token  # 16 (VAE_SCALE x PATCH); LTX-2's and MiniMax-H3's 32
    image = fam.latent.latent_frames(job.frames) * math.ceil(
        job.height / side) * math.ceil(job.width / side)
    image = -(-image // latent.pad_multiple) * latent.pad_multiple
    for s in layout.streams:  # split or held whole (LTX-2's sound), counted alike
        if s.role == "context":
            if s.length is None:
                raise ConfigError(f"the memory plan cannot count {fam.name}'s stream "
                                  f"{s.name!r}: its declaration gives no length")
            image += s.length(job.frames)
    text = 0
    if text_stream is not None and layout.in_sequence(text_stream.name):
        text = (job.text_tokens if job.text_tokens is not None else facts.text_tokens) + \
            fam.text.extra_tokens
        text = -(-text // text_stream.pad_multiple) * text_stream.pad_multiple
    return image + job.reference_tokens + text


def text_in_sequence(arch: str) -> bool:
    """The family's text is split and attended jointly with the latent (its declared
    streams); False: reached by cross-attention, its K and V whole on every rank."""
    layout = families.family(arch).tokens
    return layout.text is not None and layout.in_sequence(layout.text.name)


_BY_OPTION = -1  # text_encoder_rank: from the option (cuda:N: rank N's GPU, N < world)


def plan(facts: ModelFacts, config: ParallelConfig, engine: EngineOptions,
         job: Optional[JobSize] = JobSize(), gpu_memory=None,
         text_encoder_rank: Optional[int] = _BY_OPTION, *,
         alternatives: bool = True) -> MemoryPlan:
    """Per-rank memory of `config` + `engine` for `job` (None: without a job's activations
    and K/V cache). `gpu_memory`: bytes per GPU (one number for every rank, or one per
    rank), or None (no verdict). `text_encoder_rank`: for `text_encoders=cuda:N`, the rank
    whose GPU that is (None: a GPU no rank uses); by default rank N's (ranks on the visible
    GPUs in order). `alternatives=False` skips the search for layouts that would fit a
    misfit (a table of many cells needs only the verdicts)."""
    found = ()
    p = _plan(facts, config, engine, job, gpu_memory, text_encoder_rank)
    if p.fits is False and alternatives:
        found = tuple(_alternatives(facts, config, engine, job, gpu_memory))
    return dataclasses.replace(p, alternatives=found)


def text_encoder_bytes(facts: ModelFacts, dtype: str) -> int:
    return (facts.text_encoder_bytes if facts.text_encoder_bytes is not None
            else facts.text_encoder_params * DTYPE_BYTES[dtype])


def _plan(facts, config, engine, job, gpu_memory, te_rank=_BY_OPTION) -> MemoryPlan:
    world = config.ranks
    if isinstance(gpu_memory, (list, tuple)):
        caps = [None if g is None else int(g) for g in gpu_memory]
        if len(caps) != world:
            raise ConfigError(f"gpu_memory lists {len(caps)} GPUs for {world} ranks; give one "
                              f"size or {world}")
    else:
        caps = [None if gpu_memory is None else int(gpu_memory)] * world
    db = DTYPE_BYTES[engine.dtype]
    fp8 = quantised_bytes(facts, engine.weights)
    tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    n_blocks = len(tr.blocks)
    block_bytes = [_bytes(b, db, fp8) for b in tr.blocks]
    rest_bytes = _bytes(tr.rest, db, fp8)
    buffer_bytes = tr.buffers * db  # never sharded nor staged: FSDP leaves buffers whole

    # tokens a rank holds in one forward (PipeFusion's warmup steps run the whole image);
    # no job (a launch for decoding or host-sampler calls): the fixed parts only
    seq = batch = act = act_no_vae = vae_act = 0
    sp = config.sp
    rank_act = None  # rank -> its activations, where an uneven split gives ranks other shares
    vae_3d = families.family(facts.arch).capability(families.CausalVAE)
    one_rank = vae_3d is not None and vae_3d.one_rank  # the decode whole on rank 0 alone

    def decodes(rank):
        return rank == 0 or not one_rank

    if job is not None:
        fam = families.family(facts.arch)
        seq = job_tokens(facts, job)
        text = job.text_tokens if job.text_tokens is not None else facts.text_tokens
        text += fam.text.extra_tokens  # SD3: CLIP's beside T5's
        tokens = math.ceil(seq / sp)  # the sequence (both streams if joint) over sp ranks
        branches = 2 if job.cfg else 1
        batch = math.ceil(job.batch / config.dp) * max(1, branches // config.cfg)
        act = activation_bytes(tr, tokens, text, seq, batch, db, sp,
                               cross_text=not text_in_sequence(facts.arch))
        chunk = fam.latent.time_downscale if fam.latent.video else 1
        if vae_3d is not None and vae_3d.whole_video:  # every frame in one decoder call
            chunk = job.frames
        vae_act = vae_decode_bytes(facts.vae_channels if facts.vae_params else (),
                                   job.height, job.width, job.batch, db,
                                   1 if one_rank else world,
                                   frames=job.frames, frames_per_chunk=min(chunk, job.frames))
        act_no_vae, act = act, max(act, vae_act)
        split_w = config.weights() if config.pipefusion == 1 else ()
        if split_w:  # each rank's tokens and rows by its share (workers/parallel/shares.py)
            sizes_for, per = bridge.shares.sizes_for, world // config.dp

            def rank_act(rank):
                group = rank - rank % sp
                tokens_r = sizes_for(seq, sp, split_w[group:group + sp])[rank % sp]
                dp_w = [sum(split_w[i * per:(i + 1) * per]) for i in range(config.dp)]
                rows = sizes_for(job.batch, config.dp, dp_w)[rank // per]
                a = activation_bytes(tr, tokens_r, text, seq,
                                     rows * max(1, branches // config.cfg), db, sp,
                                     cross_text=not text_in_sequence(facts.arch))
                return max(a, vae_act) if decodes(rank) else a
    vae = facts.vae_params * db
    te = text_encoder_bytes(facts, engine.dtype)

    ranges = stage_ranges(tr, config.pipefusion, config.stage_split(n_blocks)) \
        if config.pipefusion > 1 else [(0, n_blocks)]
    ranks, gather = [], 0
    sharded = engine.shard_weights and world > 1
    branch_of = config.branch_layout(families.family(facts.arch))  # a cfg rank: its branch's
    experts = 1 if branch_of else max(1, facts.experts)  # all resident; one runs at a time
    if sharded:
        memory = str(engine.shard_split).strip().lower() == "memory"
        shard_w = engine.shard_weights_for(world, caps if memory else None)
        parts = [[m for m in range(world) if branch_of[m:m + 1] == branch_of[r:r + 1]]
                 for r in range(world)]  # sharded over the ranks holding it: its branch's
        shards = [uneven_shard_figures(tr, db, fp8, [shard_w[m] for m in p], p.index(r))
                  if shard_w else shard_figures(tr, db, fp8, len(p)) for r, p in enumerate(parts)]
        forwards = 2 if (job is not None and job.cfg and config.cfg == 1) else 1
        gather = shards[0].received_per_forward * forwards
    for rank in range(world):
        kv = 0
        if sharded:  # the running expert's blocks gathered; the others' chunks at rest
            shard, part = shards[rank], parts[rank]
            weights = shard.peak - buffer_bytes + (experts - 1) * (shard.at_rest - buffer_bytes)
            held = f" ({shard_w[rank] / sum(shard_w[m] for m in part):.0%})" if shard_w else ""
            role = f"shard {part.index(rank) + 1}/{len(part)}{held}"
        elif config.pipefusion > 1:
            stage = bridge.stages.stage_of_rank(rank, config.pipefusion, sp)
            lo, hi = ranges[stage]
            weights = (sum(block_bytes[lo:hi]) + rest_bytes) * experts
            # the running expert's layers (a switch of expert refills the cache)
            kv = 2 * (hi - lo) * seq * math.ceil(tr.hidden / config.ulysses) * batch * db
            role = f"stage {stage + 1}/{config.pipefusion} (blocks {lo}-{hi - 1})"
        else:
            weights = (sum(block_bytes) + rest_bytes) * experts
            role = "replica"
        if rank_act is not None:
            rank_act_bytes = rank_act(rank)
        else:
            rank_act_bytes = act if decodes(rank) else act_no_vae
        ranks.append(RankPlan(rank=rank, role=role, weights=weights + buffer_bytes * experts,
                              activations=rank_act_bytes, kv_cache=kv, text_encoders=0,
                              vae=vae if decodes(rank) else 0, reserve=RESERVE_BYTES,
                              gpu_memory=caps[rank]))

    # text encoders: rank 0's GPU, the GPU cuda:N names, or the CPU
    where = "none" if not te else "cpu"
    option = str(engine.text_encoders)
    if te and engine.device == "cuda" and option != "cpu":
        r = 0
        if option.startswith("cuda:"):
            n = int(option[5:])
            r = (n if n < world else None) if te_rank == _BY_OPTION else te_rank
        if r is None:
            where = f"on {option} (a GPU no rank uses; {te / GiB:.1f} GiB there)"
        elif option != "auto" or ranks[r].gpu_memory is None or \
                ranks[r].gpu_memory - ranks[r].total >= te + TEXT_ENCODER_MARGIN:
            ranks[r] = dataclasses.replace(ranks[r], text_encoders=te)
            where = "on rank 0's GPU" if r == 0 else f"on rank {r}'s GPU ({option})"
        else:
            where = "on the CPU (auto: no room on rank 0's GPU)"
    elif te:
        where = "on the CPU"
    return MemoryPlan(model=facts.name, config=config, engine=engine, job=job,
                      ranks=tuple(ranks), text_encoders_on=where,
                      gather_bytes_per_step=gather)


def _alternatives(facts, config, engine, job, gpu_memory):
    """Layouts on the same GPUs that fit, fewest changes first: (description, peak bytes).
    A change that would not change anything (the layout already used, text encoders already
    on the CPU, weights already fp8) is not offered."""
    world = config.ranks
    base = _plan(facts, config, engine, job, gpu_memory)
    layouts = [("", config, engine.shard_weights)]
    if world > 1:
        for name, cfg, shard in ((f"pipefusion {world}", ParallelConfig(pipefusion=world),
                                  False),
                                 ("shard_weights", config, True),
                                 (f"ulysses {world} + shard_weights",
                                  ParallelConfig(ulysses=world), True)):
            refused = cfg.pipefusion > 1 and pipefusion_refusal(families.family(facts.arch))
            if (cfg.degrees(), shard) not in [(c.degrees(), sh) for _, c, sh in layouts] and \
                    not (shard and cfg.pipefusion > 1) and not refused:
                layouts.append((name, cfg, shard))
    te_options = [("", engine.text_encoders)]
    if any(r.text_encoders for r in base.ranks):
        te_options.append(("text_encoders=cpu", "cpu"))
    weight_options = [("", engine.weights)]
    if engine.weights != "fp8" and not (engine.weights == "auto" and facts.fp8_checkpoint):
        weight_options.append(("weights=fp8", "fp8"))
    out, seen = [], set()
    for lname, cfg, shard in layouts:
        for wname, weights in weight_options:
            for tname, te in te_options:
                changes = [c for c in (lname, wname, tname) if c]
                if not changes:
                    continue
                e = dataclasses.replace(engine, weights=weights, text_encoders=te,
                                        shard_weights=shard)
                try:
                    p = _plan(facts, cfg.with_world_size(None), e, job, gpu_memory)
                except (ConfigError, ValueError):
                    continue
                desc = " + ".join(changes)
                if p.fits and desc not in seen:
                    seen.add(desc)
                    out.append((len(changes), p.worst.total, desc))
    return [(d, t) for _, t, d in sorted(out)]


def step_traffic(facts: ModelFacts, job: JobSize, dtype: str, n: int) -> dict:
    """Bytes one rank sends per denoising step under each method at degree `n` (2 for CFG
    parallel), the pool's schedules in theory (benchmarks/bench.py measures them):
    A = one attention layer's full activation (batch x branches run in one process x
    job_tokens x hidden x dtype); L = attention layers (the blocks).

    - Ulysses n: 4 all-to-alls a layer (Q, K, V in, the output back), each sending (n-1)/n
      of the rank's 1/n: 4(n-1)/n^2 x A x L;
    - Ring n: K and V passed n-1 times around the ring: 2(n-1)/n x A x L;
    - CFG parallel: the other branch's prediction gathered once a step (the latent's size);
    - PipeFusion n: each stage passes its patches' activations on once a step: A (one branch
      batch, warm-up steps alike; the stale K/V stay local);
    - shard_weights n: the other ranks' chunks of every parameter, once a forward (one
      expert's: the one running).
    The text reached by cross-attention (Wan) is on every rank and never sent."""
    fam = families.family(facts.arch)
    tr = transformer_facts(facts.transformer_class, facts.transformer_config, facts.arch)
    db = DTYPE_BYTES[dtype]
    branches = 2 if job.cfg else 1
    act = job.batch * job_tokens(facts, job) * tr.hidden * db
    layers = len(tr.blocks)
    latent = math.prod(fam.latent.shape(job.batch, job.height, job.width, job.frames)) * db
    out = {"Ulysses": 4 * (n - 1) / n ** 2 * act * branches * layers,
           "Ring": 2 * (n - 1) / n * act * branches * layers,
           "PipeFusion": act * branches if n > 1 else 0,
           "CFG parallel": latent if job.cfg else 0,
           "shard_weights": shard_figures(tr, db, False, n).received_per_forward * branches}
    return out
