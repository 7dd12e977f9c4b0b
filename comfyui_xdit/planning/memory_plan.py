"""Will it fit? A per-rank GPU memory plan, computed before any worker starts.

For a model (a diffusers folder, a single .safetensors transformer, or a named preset of
published dimensions), a ParallelConfig, EngineOptions and a job size, each rank's bytes are
added up part by part:

- weights: the transformer's parameters as that rank holds them, counted on the real
  module tree built on the meta device from the model's config (no memory, no download):
  every parameter for Ulysses / Ring / CFG / DP (replicated); the rank's PipeFusion stage
  (the split of workers/loading/stages.py) plus the modules around the blocks; with
  shard_weights, FSDP2's dim-0 shards (padded rows included) of every parameter, plus, during
  a forward, the non-block parameters gathered whole and the two largest consecutive blocks
  gathered (the running block and the prefetched next one: workers/parallel/sharding.py). fp8 (or an
  fp8 checkpoint under weights=auto) stores the Linears inside the blocks in 1 byte
  (workers/loading/weights.py); everything else is in the pool dtype. Persistent buffers (SD3's
  positional table) are whole on every rank.
- activations: one forward's live tensors, a conservative estimate (see `activation_bytes`),
  or the patch-parallel VAE decode's if larger (it runs after the transformer has freed
  its own).
- kv_cache: PipeFusion's per-layer K/V of the full sequence for this rank's heads, for every
  block of the stage and every CFG branch the rank runs.
- text_encoders: on rank 0's GPU, unless placed on the CPU ("auto" mirrors the worker: the
  GPU when they fit beside the rest with 2 GiB to spare, else the CPU) or on the GPU that
  `cuda:N` names: another rank's (counted there) or one no rank uses (checked on its own).
- vae: its weights on every rank (every rank takes part in the patch-parallel decode).
- reserve: a fixed RESERVE_BYTES for the CUDA context, cuBLAS/cuDNN workspaces, NCCL
  buffers of the pool's process groups and allocator fragmentation.

The activation estimate and the reserve have not been measured on a GPU yet, so a misfit is
refused by default (mode "enforce") but the user may overrule it (mode "advise": warn and
launch; see `resolve_mode`). Either way the pool records the prediction beside each rank's
measured CUDA peak after its first job (`measured_line`, WorkerPool.status()), to calibrate.

Not counted: LoRA adapters (small), ComfyUI's own models in the same GPU (offloaded before a
job), attention score matrices (the CUDA kernels the pool uses never materialise them).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

from comfyui_xdit.planning.config import ConfigError, EngineOptions, ParallelConfig
from comfyui_xdit.planning.gpus import text_encoder_gpu
from comfyui_xdit.client.worker_modules import worker_module

_log = logging.getLogger("comfyui_xdit")
GiB = 2 ** 30
RESERVE_BYTES = 2 * GiB  # CUDA context + workspaces + NCCL buffers + fragmentation
TEXT_ENCODER_MARGIN = 2 * GiB  # workers/loading/weights.py: "auto" wants this much spare beside them
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
families = worker_module("families")
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
MODE_ENV = "XDIT_MEMORY_PLAN"
MODES = ("enforce", "advise")  # refuse a predicted misfit | warn and launch anyway
OVERRIDE_HINT = ("To launch anyway (the plan is an estimate), set memory_plan to advise on "
                 "the loader, pass WorkerPool(..., memory_plan=\"advise\") or set "
                 f"{MODE_ENV}=advise.")


# ---- the models ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """Published dimensions of a released model: the transformer's diffusers config, the
    text encoders as (transformers class, config kwargs) and the VAE as (diffusers class,
    config kwargs). Class defaults are noted where they are relied on."""

    arch: str
    transformer: dict
    text_encoders: tuple
    vae: tuple
    text_tokens: int = 512  # the pipeline's default max_sequence_length
    note: str = ""
    experts: int = 1  # transformers of this config the model holds (Wan 2.2 A14B: 2)


_UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
             "feed_forward_proj": "gated-gelu", "vocab_size": 256384,
             "tie_word_embeddings": False}

PRESETS = {
    # FLUX.2 [dev]: diffusers' Flux2Transformer2DModel defaults are the dev model (8 double +
    # 48 single blocks, 48 heads x 128, joint_attention_dim 15360, mlp_ratio 3); text encoder
    # Mistral-Small-3.1-24B (Mistral3ForConditionalGeneration: 40 layers, hidden 5120, MLP
    # 32768, 32 heads / 8 KV heads x 128, vocabulary 131072, untied LM head; Pixtral vision
    # tower at transformers' defaults, hidden 1024 x 24 layers); VAE AutoencoderKLFlux2.
    "flux2-dev": Preset(
        arch="flux2", transformer={},
        text_encoders=(("Mistral3ForConditionalGeneration", {
            "text_config": {"model_type": "mistral", "hidden_size": 5120,
                            "intermediate_size": 32768, "num_hidden_layers": 40,
                            "num_attention_heads": 32, "num_key_value_heads": 8,
                            "head_dim": 128, "vocab_size": 131072,
                            "tie_word_embeddings": False},
            "tie_word_embeddings": False}),),
        vae=("AutoencoderKLFlux2", {}),
        note="FLUX.2 [dev] 32B + Mistral-3 24B text encoder"),
    # FLUX.1 [dev]: 19 double + 38 single blocks, 24 heads x 128, joint_attention_dim 4096,
    # pooled 768, guidance embedding; T5-XXL v1.1 encoder (24 layers, d_model 4096, d_ff
    # 10240, 64 heads x 64, gated GELU) + CLIP ViT-L/14 text model; 16-channel AutoencoderKL.
    "flux1-dev": Preset(
        arch="flux",
        transformer={"num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24,
                     "attention_head_dim": 128, "joint_attention_dim": 4096,
                     "pooled_projection_dim": 768, "in_channels": 64, "guidance_embeds": True},
        text_encoders=(("T5EncoderModel", {"d_model": 4096, "d_ff": 10240, "d_kv": 64,
                                           "num_heads": 64, "num_layers": 24,
                                           "feed_forward_proj": "gated-gelu",
                                           "vocab_size": 32128, "tie_word_embeddings": False}),
                       ("CLIPTextModel", {"hidden_size": 768, "intermediate_size": 3072,
                                          "num_hidden_layers": 12, "num_attention_heads": 12,
                                          "vocab_size": 49408, "max_position_embeddings": 77,
                                          "projection_dim": 768})),
        vae=("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512],
                               "down_block_types": ["DownEncoderBlock2D"] * 4,
                               "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "latent_channels": 16, "layers_per_block": 2}),
        note="FLUX.1 [dev] 12B + T5-XXL + CLIP-L"),
    # Qwen-Image (20B): 60 double-stream blocks, 24 heads x 128, text states 3584 wide;
    # text encoder Qwen2.5-VL-7B-Instruct (Qwen2_5_VLForConditionalGeneration: 28 layers,
    # hidden 3584, MLP 18944, 28 heads / 4 KV heads, vocabulary 152064, the 32-block vision
    # tower the pipelines load with it); VAE AutoencoderKLQwenImage at diffusers' defaults
    # (the release's: base_dim 96, dim_mult 1/2/4/4). Prompts pad only to the longest one:
    # 512 text tokens is the pipeline's max_sequence_length, an upper bound.
    "qwen-image": Preset(
        arch="qwen_image",
        transformer={"num_layers": 60, "num_attention_heads": 24, "attention_head_dim": 128,
                     "joint_attention_dim": 3584, "in_channels": 64, "out_channels": 16,
                     "patch_size": 2, "axes_dims_rope": [16, 56, 56]},
        text_encoders=(("Qwen2_5_VLForConditionalGeneration", {
            "text_config": {"hidden_size": 3584, "intermediate_size": 18944,
                            "num_hidden_layers": 28, "num_attention_heads": 28,
                            "num_key_value_heads": 4, "vocab_size": 152064,
                            "tie_word_embeddings": False},
            "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                              "num_heads": 16, "out_hidden_size": 3584},
            "tie_word_embeddings": False}),),
        vae=("AutoencoderKLQwenImage", {}),
        note="Qwen-Image 20B + Qwen2.5-VL 7B text encoder"),
    # Chroma1-HD (8.9B): FLUX.1's 19 double + 38 single blocks without the guidance and
    # pooled embedders, a 5-layer modulation approximator (diffusers'
    # ChromaTransformer2DModel defaults); T5-XXL only; FLUX's VAE.
    "chroma1-hd": Preset(
        arch="chroma",
        transformer={"num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24,
                     "attention_head_dim": 128, "joint_attention_dim": 4096, "in_channels": 64},
        text_encoders=(("T5EncoderModel", {"d_model": 4096, "d_ff": 10240, "d_kv": 64,
                                           "num_heads": 64, "num_layers": 24,
                                           "feed_forward_proj": "gated-gelu",
                                           "vocab_size": 32128, "tie_word_embeddings": False}),),
        vae=("AutoencoderKL", {"block_out_channels": [128, 256, 512, 512],
                               "down_block_types": ["DownEncoderBlock2D"] * 4,
                               "up_block_types": ["UpDecoderBlock2D"] * 4,
                               "latent_channels": 16, "layers_per_block": 2}),
        note="Chroma1-HD 8.9B + T5-XXL"),
    # Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers): 40 blocks, 40 heads x 128 (5120
    # wide), FFN 13824, text_dim 4096 (diffusers' WanTransformer3DModel defaults); text
    # encoder UMT5-XXL's encoder (UMT5EncoderModel: 24 layers, d_model 4096, d_ff 10240, 64
    # heads x 64, gated GELU, vocabulary 256384); VAE AutoencoderKLWan at diffusers' defaults
    # (base_dim 96, dim_mult 1/2/4/4, the release's). Text: 512 UMT5 tokens, reached by
    # cross-attention only (never in the attention sequence).
    "wan2.1-t2v-14b": Preset(
        arch="wan", transformer={}, text_encoders=(("UMT5EncoderModel", _UMT5_XXL),),
        vae=("AutoencoderKLWan", {}), note="Wan 2.1 T2V 14B + UMT5-XXL"),
    # Wan 2.1 T2V 1.3B: 30 blocks, 12 heads x 128 (1536 wide), FFN 8960
    "wan2.1-t2v-1.3b": Preset(
        arch="wan", transformer={"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
        text_encoders=(("UMT5EncoderModel", _UMT5_XXL),), vae=("AutoencoderKLWan", {}),
        note="Wan 2.1 T2V 1.3B + UMT5-XXL"),
    # Wan 2.2 T2V A14B: two experts of Wan 2.1 14B's dimensions (the high-noise `transformer`
    # and the low-noise `transformer_2`), both resident; one runs at a time
    "wan2.2-t2v-a14b": Preset(
        arch="wan", transformer={}, text_encoders=(("UMT5EncoderModel", _UMT5_XXL),),
        vae=("AutoencoderKLWan", {}), experts=2, note="Wan 2.2 T2V A14B (2 x 14B) + UMT5-XXL"),
}


def vae_channels(config) -> tuple:
    """The VAE decoder's level widths, full resolution first: block_out_channels, or a
    Wan-style 3-D VAE's base_dim x dim_mult (Qwen-Image's)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("block_out_channels") is not None:
        return tuple(get("block_out_channels"))
    if get("base_dim") is not None:
        return tuple(int(get("base_dim")) * int(m) for m in get("dim_mult", (1, 2, 4, 4)))
    return (128, 256, 512, 512)


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs of a model, sizes as parameter (element) counts."""

    name: str
    arch: str
    transformer_class: str
    transformer_config: str  # JSON (hashable: the meta build is cached on it)
    text_encoder_params: int  # 0: none (a single file: ComfyUI encodes)
    vae_params: int  # 0: none
    vae_channels: tuple  # the VAE's block_out_channels (decoder levels, full resolution first)
    fp8_checkpoint: bool = False  # an fp8 file stays fp8 under weights="auto"
    text_tokens: int = 512
    text_encoder_bytes: Optional[int] = None  # measured from a folder's headers in the dtype
    experts: int = 1  # transformers of the same config held at once (Wan 2.2 A14B: 2)


def _meta(build):
    import torch
    with torch.device("meta"):
        return build()


@functools.lru_cache(maxsize=8)
def _preset_counts(name: str) -> tuple:
    """(text encoder parameters, VAE parameters, VAE channels) of a preset, from its classes
    built on the meta device."""
    import diffusers
    import transformers

    preset = PRESETS[name]
    te = 0
    for cls_name, kw in preset.text_encoders:
        cls = getattr(transformers, cls_name)
        config = cls.config_class(**kw)
        model = _meta(lambda: cls(config))
        te += sum(t.numel() for t in model.parameters())  # a tied embedding counts once
    vcls = getattr(diffusers, preset.vae[0])
    vae = _meta(lambda: vcls(**preset.vae[1]))
    return te, sum(t.numel() for t in vae.parameters()), vae_channels(vae.config)


def preset_facts(name: str) -> ModelFacts:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    p = PRESETS[name]
    te, vae, channels = _preset_counts(name)
    return ModelFacts(name=name, arch=p.arch,
                      transformer_class=families.family(p.arch).transformer_class,
                      transformer_config=json.dumps(p.transformer, sort_keys=True),
                      text_encoder_params=te, vae_params=vae, vae_channels=channels,
                      text_tokens=p.text_tokens, experts=p.experts)


def model_facts(path: str, dtype: str = "bf16") -> ModelFacts:
    """A diffusers folder or single file, through the pack's detection (model_info)."""
    from comfyui_xdit.planning.model_info import _describe_model, expert_count

    d = _describe_model(path)
    arch, cfg = d["arch"], dict(d["config"])
    storage = d.get("storage") or {}
    tcls = families.family(arch).transformer_class
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    te_bytes, vae_params, channels = 0, 0, ()
    if d["kind"] == "diffusers":
        import torch
        weights = worker_module("loading.weights")
        folders = [os.path.join(path, n) for n in sorted(os.listdir(path))
                   if n.startswith("text_encoder")]
        te_bytes = weights.folder_tensor_bytes(folders, _torch_dtype(dtype))
        vae_dir = os.path.join(path, "vae")
        if os.path.isdir(vae_dir):
            vae_params = weights.folder_tensor_bytes([vae_dir], torch.float32) // 4
            with open(os.path.join(vae_dir, "config.json")) as f:
                channels = vae_channels(json.load(f))
    return ModelFacts(name=str(path), arch=arch, transformer_class=tcls,
                      transformer_config=json.dumps(cfg, sort_keys=True, default=list),
                      text_encoder_params=0, text_encoder_bytes=te_bytes,
                      vae_params=vae_params, vae_channels=channels,
                      fp8_checkpoint=bool(storage.get("fp8")), experts=expert_count(path))


def _torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True)
class _Transformer:
    """Per-parameter facts of the meta-built transformer, in execution order of the blocks."""

    blocks: tuple  # per block: tuple of (numel, dim0 rows, is fp8-able Linear weight)
    rest: tuple  # the non-block parameters, same triples
    hidden: int
    heads: int
    widest: int  # the widest Linear output inside the blocks (features)
    context_dim: int  # the text embeddings' width entering the transformer
    in_channels: int
    stage_costs: object  # (compute costs, memory costs) for loading.stages.partition
    buffers: int = 0  # persistent buffer elements (SD3's positional table): whole on every rank


@functools.lru_cache(maxsize=8)
def _transformer(class_name: str, config_json: str, arch: str) -> _Transformer:
    import diffusers
    import torch

    stages = worker_module("loading.stages")
    weights = worker_module("loading.weights")
    cls = getattr(diffusers, class_name)
    tr = _meta(lambda: cls.from_config(json.loads(config_json)))
    lists = families.family(arch).block_lists
    fp8_able = {id(m.weight) for m in weights.block_linears(tr, lists).values()}

    def triples(module):
        return tuple((p.numel(), p.shape[0] if p.dim() else 1, id(p) in fp8_able)
                     for p in module.parameters())

    blocks = [m for _, _, m in stages.model_blocks(tr, lists)]
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    rest = tuple((p.numel(), p.shape[0] if p.dim() else 1, False)
                 for p in tr.parameters() if id(p) not in block_ids)
    widest = max(m.out_features for b in blocks for m in b.modules()
                 if isinstance(m, torch.nn.Linear))
    c = tr.config
    heads = int(c.num_attention_heads)
    hidden = heads * int(c.attention_head_dim)
    ctx = int(c.get("joint_attention_dim", 0) or c.get("caption_projection_dim", 0)
              or c.get("text_dim", 0) or hidden)
    costs = ([stages.block_cost(b, "compute") for b in blocks],
             [stages.block_cost(b, "memory") for b in blocks])
    state = set(tr.state_dict())
    buffers = sum(b.numel() for n, b in tr.named_buffers() if n in state)
    return _Transformer(blocks=tuple(triples(b) for b in blocks), rest=rest, hidden=hidden,
                        heads=heads, widest=int(widest), context_dim=ctx,
                        in_channels=int(c.in_channels), stage_costs=costs, buffers=buffers)


def stage_ranges(tr: _Transformer, stages: int, split: str) -> list:
    """The (start, stop) block range of every PipeFusion stage: workers/loading/stages.py's
    split, on the counts of the meta model (the same arithmetic its plan_stages runs)."""
    ps = worker_module("loading.stages")
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


# ---- the plan --------------------------------------------------------------------------------
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


def _bytes(triples, dtype_bytes: int, fp8: bool, shards: int = 1) -> int:
    """Bytes of parameters; with `shards`, one rank's FSDP2 dim-0 chunk (rows padded up to a
    multiple of the world, as FSDP2 pads)."""
    total = 0
    for numel, rows, fp8_able in triples:
        size = 1 if (fp8 and fp8_able) else dtype_bytes
        if shards > 1:
            numel = math.ceil(rows / shards) * (numel // max(rows, 1))
        total += numel * size
    return total


@dataclass(frozen=True)
class ShardFigures:
    """shard_weights over `world` ranks, one rank's bytes (FSDP2's dim-0 chunks, rows padded
    up to a multiple of the world as FSDP2 pads; rank 0 holds the largest chunks)."""

    world: int
    unsharded: int  # a replica's weights: every parameter and buffer
    at_rest: int  # its chunk of every parameter, plus the buffers (FSDP leaves them whole)
    peak: int  # during a forward: + the non-block parameters and two consecutive blocks
    received_per_forward: int  # the other ranks' chunks of every parameter, once a forward


def shard_figures(tr: _Transformer, dtype_bytes: int, fp8: bool, world: int) -> ShardFigures:
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


def activation_bytes(tr: _Transformer, tokens: int, text_tokens: int, full_tokens: int,
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
    """Tokens of one attention sequence: the image's (16 x 16 pixels a token) times the
    latent frames of a video ((frames - 1) / 4 + 1 for Wan: 720p x 81 frames is 21 x 45 x
    80 = 75,600), the references', and the text's where the family joins it to the image
    (joint attention; Wan's text is reached by cross-attention, outside the sequence)."""
    fam = families.family(facts.arch)
    image = fam.latent.latent_frames(job.frames) * math.ceil(
        job.height / (VAE_SCALE * PATCH)) * math.ceil(job.width / (VAE_SCALE * PATCH))
    text = 0
    if fam.text_in_sequence:
        text = (job.text_tokens if job.text_tokens is not None else facts.text_tokens) + \
            fam.text_extra_tokens
    return image + job.reference_tokens + text


_BY_OPTION = -1  # text_encoder_rank: from the option (cuda:N: rank N's GPU, N < world)


def plan(facts: ModelFacts, config: ParallelConfig, engine: EngineOptions,
         job: Optional[JobSize] = JobSize(), gpu_memory=None,
         text_encoder_rank: Optional[int] = _BY_OPTION) -> MemoryPlan:
    """Per-rank memory of `config` + `engine` for `job` (None: without a job's activations
    and K/V cache). `gpu_memory`: bytes per GPU (one number for every rank, or one per
    rank), or None (no verdict). `text_encoder_rank`: for `text_encoders=cuda:N`, the rank
    whose GPU that is (None: a GPU no rank uses); by default rank N's (ranks on the visible
    GPUs in order)."""
    alternatives = ()
    p = _plan(facts, config, engine, job, gpu_memory, text_encoder_rank)
    if p.fits is False:
        alternatives = tuple(_alternatives(facts, config, engine, job, gpu_memory))
    return dataclasses.replace(p, alternatives=alternatives)


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
    fp8 = engine.weights == "fp8" or (engine.weights == "auto" and facts.fp8_checkpoint)
    tr = _transformer(facts.transformer_class, facts.transformer_config, facts.arch)
    n_blocks = len(tr.blocks)
    block_bytes = [_bytes(b, db, fp8) for b in tr.blocks]
    rest_bytes = _bytes(tr.rest, db, fp8)
    buffer_bytes = tr.buffers * db  # never sharded nor staged: FSDP leaves buffers whole

    # tokens a rank holds in one forward (PipeFusion's warmup steps run the whole image);
    # no job (a launch for decoding or host-sampler calls): the fixed parts only
    seq = batch = act = 0
    sp = config.sp
    if job is not None:
        fam = families.family(facts.arch)
        seq = job_tokens(facts, job)
        text = job.text_tokens if job.text_tokens is not None else facts.text_tokens
        text += fam.text_extra_tokens  # SD3: CLIP's beside T5's
        tokens = math.ceil(seq / sp)  # the sequence (both streams if joint) over sp ranks
        branches = 2 if job.cfg else 1
        batch = math.ceil(job.batch / config.dp) * max(1, branches // config.cfg)
        act = activation_bytes(tr, tokens, text, seq, batch, db, sp,
                               cross_text=not fam.text_in_sequence)
        chunk = fam.latent.time_downscale if fam.latent.video else 1
        act = max(act, vae_decode_bytes(facts.vae_channels if facts.vae_params else (),
                                        job.height, job.width, job.batch, db, world,
                                        frames=job.frames,
                                        frames_per_chunk=min(chunk, job.frames)))
    vae = facts.vae_params * db
    te = text_encoder_bytes(facts, engine.dtype)

    ranges = stage_ranges(tr, config.pipefusion, config.pipefusion_split) \
        if config.pipefusion > 1 else [(0, n_blocks)]
    ranks = []
    gather = 0
    experts = max(1, facts.experts)  # every expert resident; one runs at a time
    sharded = engine.shard_weights and world > 1
    if sharded:
        shard = shard_figures(tr, db, fp8, world)
        forwards = 2 if (job is not None and job.cfg and config.cfg == 1) else 1
        gather = shard.received_per_forward * forwards
    for rank in range(world):
        kv = 0
        if sharded:  # the running expert's blocks gathered; the others' chunks at rest
            weights = shard.peak - buffer_bytes + (experts - 1) * (shard.at_rest - buffer_bytes)
            role = f"shard {rank + 1}/{world}"
        elif config.pipefusion > 1:
            stage = worker_module("loading.stages").stage_of_rank(rank, config.pipefusion, sp)
            lo, hi = ranges[stage]
            weights = (sum(block_bytes[lo:hi]) + rest_bytes) * experts
            # the running expert's layers (a switch of expert refills the cache)
            kv = 2 * (hi - lo) * seq * math.ceil(tr.hidden / config.ulysses) * batch * db
            role = f"stage {stage + 1}/{config.pipefusion} (blocks {lo}-{hi - 1})"
        else:
            weights = (sum(block_bytes) + rest_bytes) * experts
            role = "replica"
        ranks.append(RankPlan(rank=rank, role=role, weights=weights + buffer_bytes * experts,
                              activations=act,
                              kv_cache=kv, text_encoders=0, vae=vae, reserve=RESERVE_BYTES,
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
            if (cfg.key(), shard) not in [(c.key(), sh) for _, c, sh in layouts] and \
                    not (shard and cfg.pipefusion > 1):
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


# ---- GPUs ------------------------------------------------------------------------------------
_SMI_SIZES: dict = {}  # nvidia-smi's answer, kept: a GPU's total memory never changes


def _smi_sizes() -> dict:
    """{index or UUID: total bytes} of every GPU nvidia-smi lists ({} when it cannot)."""
    if _SMI_SIZES:
        return _SMI_SIZES
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        text = subprocess.run([exe, "--query-gpu=index,uuid,memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    for line in text.splitlines():
        parts = [v.strip() for v in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            _SMI_SIZES[parts[0]] = _SMI_SIZES[parts[1]] = int(parts[2]) * 2 ** 20  # MiB
    return _SMI_SIZES


def gpu_memory_bytes(gpu_ids: Sequence[str], environ=None) -> list:
    """Total memory of each GPU id (an index or a GPU-/MIG- UUID, as comfyui_xdit/planning/gpus.py
    hands them to the ranks), from nvidia-smi (NVML: no CUDA initialisation in this
    process), or None where it is not known (a MIG slice, no nvidia-smi). nvidia-smi numbers
    GPUs in PCI bus order, CUDA fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`: on a box
    mixing GPU sizes an index is then ambiguous, and the smallest card's size is used (a UUID
    in the loader's GPU list is exact). Replaced in tests."""
    sizes = _smi_sizes()
    env = os.environ if environ is None else environ
    by_index = [v for k, v in sizes.items() if k.isdigit()]
    ambiguous = env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(set(by_index)) > 1
    out = []
    for g in gpu_ids:
        g = str(g).strip()
        out.append(min(by_index) if ambiguous and g in sizes and g.isdigit() else sizes.get(g))
    return out


def resolve_mode(value=None, environ=None) -> str:
    """The memory plan's mode: "enforce" (refuse a predicted misfit) or "advise" (warn and
    launch); None or "auto": $XDIT_MEMORY_PLAN, else "enforce". Anything else is one
    ConfigError listing the allowed values: a typo must neither skip nor silently keep the
    check."""
    if value is None or str(value).strip().lower() in ("", "auto"):
        raw = (os.environ if environ is None else environ).get(MODE_ENV, "")
        v = raw.strip().lower()
        if v in ("", "auto"):
            return "enforce"
        if v in MODES:
            return v
        raise ConfigError(f"{MODE_ENV}={raw!r} is not a memory plan mode; set it to enforce "
                          f"(refuse a layout the plan says will not fit; the default) or "
                          f"advise (warn and launch anyway)")
    v = str(value).strip().lower()
    if v not in MODES:
        raise ConfigError(f"memory_plan must be enforce, advise or auto (${MODE_ENV}, "
                          f"default enforce); got {value!r}")
    return v


def _job_size(request, model_path: str) -> JobSize:
    from comfyui_xdit.planning.model_info import read_model_info

    info = read_model_info(model_path)
    return JobSize(height=int(request.height), width=int(request.width),
                   batch=max(1, int(request.batch)),
                   text_tokens=int(request.max_sequence_length),
                   reference_tokens=int(request.reference_tokens(info)),
                   frames=int(getattr(request, "frames", 1) or 1),
                   # the default cfg may depend on the model (FLUX.2 base vs distilled)
                   cfg=bool(request.uses_cfg(info)))


def plan_launch(model_path: str, config: ParallelConfig, engine: EngineOptions, gpus,
                request=None, model_path_2=None) -> Optional[MemoryPlan]:
    """The plan of a CUDA launch against the GPUs' total memory, with `misfits` filled, and
    no verdict acted on (check_launch does; the pool also re-plans quietly to compare with
    a measured peak). `gpus`: the ranks' GPU ids (gpus.gpus_for_ranks). Without a request (a
    launch to decode, or for host-sampler calls) only the fixed parts are planned: what any
    job adds comes on top. None on CPU, or when no GPU's memory can be read."""
    if engine.device != "cuda" or not gpus:
        return None
    caps = gpu_memory_bytes(list(gpus))
    if all(c is None for c in caps):
        return None
    # ranks sharing a GPU share its memory: give each of them its share
    share = {g: list(gpus).count(g) for g in gpus}
    caps = [None if c is None else c // share[g] for c, g in zip(caps, gpus)]
    try:
        facts = model_facts(model_path, engine.dtype)
        if model_path_2:  # a Wan 2.2 A14B pair of files: two experts of the first's config
            facts = dataclasses.replace(facts, experts=2)
        job = None if request is None else _job_size(request, model_path)
        te_gpu = text_encoder_gpu(engine.text_encoders, list(gpus))
        p = plan(facts, config.with_world_size(None), engine, job, caps,
                 _BY_OPTION if te_gpu is None else te_gpu.rank)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  check_launch decides by the mode
        raise PlanUnavailable(f"{type(e).__name__}: {e}") from e
    misfits = [p.message()] if p.fits is False else []
    if te_gpu is not None and te_gpu.rank is None:  # a GPU of their own: they alone on it
        need = text_encoder_bytes(facts, engine.dtype) + TEXT_ENCODER_MARGIN
        cap = gpu_memory_bytes([te_gpu.gpu])[0]
        if cap is not None and need > cap:
            misfits.append(f"The text encoders need {need / GiB:.1f} GiB with the margin "
                           f"({engine.dtype}); GPU {te_gpu.gpu} (text_encoders="
                           f"{engine.text_encoders}) has {cap / GiB:.1f} GiB: use a larger "
                           f"GPU, or text_encoders=cpu.")
    return dataclasses.replace(p, misfits=tuple(misfits))


class PlanUnavailable(Exception):
    """The memory plan could not be made (an error while planning, not a misfit)."""


@dataclasses.dataclass(frozen=True)
class UnplannedLaunch:
    """What check_launch returns under "advise" when no plan could be made: the launch goes
    ahead and every place that shows the plan says why there is none."""

    error: str
    ranks: tuple = ()
    job: Optional[JobSize] = None

    @property
    def misfits(self) -> tuple:
        return (f"The memory plan could not be made ({self.error}).",)

    fits = None

    def summary(self) -> str:
        return f"memory plan could not be made ({self.error})"


def check_launch(model_path: str, config: ParallelConfig, engine: EngineOptions, gpus,
                 request=None, mode: Optional[str] = None,
                 model_path_2=None):
    """Before a CUDA pool launches: `plan_launch`, and under mode "enforce" (`resolve_mode`;
    None: the environment's) one ConfigError with the numbers and how to overrule it when a
    rank cannot fit, or when no plan could be made (a launch is never made blind). Under
    "advise" the plan comes back with its `misfits` for the caller to warn, or an
    `UnplannedLaunch` saying why there is no plan."""
    mode = resolve_mode(mode)
    try:
        p = plan_launch(model_path, config, engine, gpus, request, model_path_2)
    except PlanUnavailable as e:
        if mode == "enforce":
            raise ConfigError(f"The memory plan for {model_path} could not be made ({e}), so "
                              f"the launch is refused rather than made unchecked. "
                              f"{OVERRIDE_HINT}") from e
        return UnplannedLaunch(str(e))
    if p is not None and p.misfits and mode == "enforce":
        raise ConfigError(" ".join(p.misfits + (OVERRIDE_HINT,)))
    return p


def check_pool(pool, request=None, gpus=None) -> Optional[MemoryPlan]:
    """WorkerPool's hook before a launch (CUDA pools it starts itself; attached pools are
    someone else's): `check_launch` on the pool's model, layout, engine, rank GPUs and mode;
    a misfit it launches anyway is logged as a warning with the prediction."""
    if pool.device != "cuda" or getattr(pool, "_attached", None):
        return None
    if gpus is None:
        from comfyui_xdit.planning.gpus import gpus_for_ranks
        gpus = gpus_for_ranks(pool.config.ranks, pool.gpus)
    mode = getattr(pool, "memory_plan", None)
    p = check_launch(pool.model_path, pool.config, pool.engine, gpus, request, mode,
                     getattr(pool, "model_path_2", None))
    if isinstance(p, UnplannedLaunch):
        _log.warning("xDiT: memory_plan=advise, launching without a memory plan: %s",
                     p.summary())
    elif p is not None and p.misfits:
        _log.warning("xDiT: memory_plan=advise, launching although the memory plan predicts "
                     "it will not fit: %s", " ".join(p.misfits))
    return p


# ---- predicted vs measured -------------------------------------------------------------------
MiB = 2 ** 20


def plan_status(plan: Optional[MemoryPlan], mode: str) -> dict:
    """The plan as WorkerPool.status() shows it (MiB per rank), with room for the measured
    peaks `record_measured` adds after the first job: the numbers to calibrate it with."""
    out = {"mode": mode, "predicted_mb_per_rank": None, "measured_peak_mb": None}
    if plan is None:
        return out
    if isinstance(plan, UnplannedLaunch):
        return dict(out, error=plan.summary(), fits=None)
    out.update(predicted_mb_per_rank=[round(r.total / MiB) for r in plan.ranks],
               gpu_mb_per_rank=[None if r.gpu_memory is None else round(r.gpu_memory / MiB)
                                for r in plan.ranks],
               reserve_mb=round(RESERVE_BYTES / MiB), fits=plan.fits and not plan.misfits,
               job=None if plan.job is None else
               f"{plan.job.height}x{plan.job.width} batch {plan.job.batch}")
    return out


def measured_peaks(stats, world: int) -> Optional[tuple]:
    """A job's per-rank stats (workers/runtime/worker.py: `cuda_peak_mb`, `cuda_reserved_peak_mb`)
    -> (allocated MiB per rank, reserved MiB per rank), None where a rank did not say; None
    when no rank reported a CUDA peak (a CPU pool)."""
    alloc, reserved = [None] * world, [None] * world
    for i, st in enumerate(stats or []):
        r = st.get("rank", i) if isinstance(st, dict) else i
        if isinstance(st, dict) and 0 <= r < world:
            alloc[r] = st.get("cuda_peak_mb")
            reserved[r] = st.get("cuda_reserved_peak_mb")
    if all(a is None for a in alloc):
        return None
    return alloc, reserved


def measured_line(predicted_mb, measured_mb, reserved_mb=None,
                  reserve_mb: float = RESERVE_BYTES / MiB) -> str:
    """One log line: the plan's per-rank prediction beside the measured CUDA peaks. torch's
    allocator sees neither the CUDA context nor NCCL's buffers, which the plan's reserve
    stands for, so the ratio is taken against the prediction without the reserve."""
    def row(values, fmt="{:.0f}"):
        return "/".join("?" if v is None else fmt.format(v) for v in values)
    bare = [p - reserve_mb for p in predicted_mb]
    ratio = [None if m is None or b <= 0 else m / b for m, b in zip(measured_mb, bare)]
    line = (f"xDiT memory plan vs the first job, MiB on ranks "
            f"{row(range(len(predicted_mb)))}: predicted {row(predicted_mb)} ({row(bare)} "
            f"without the {reserve_mb:.0f} MiB CUDA reserve); measured peak allocated "
            f"{row(measured_mb)} ({row(ratio, '{:.2f}')}x the prediction without reserve)")
    if reserved_mb is not None and any(v is not None for v in reserved_mb):
        line += f", reserved {row(reserved_mb)}"
    return line


def record_measured(status: dict, stats, world: int) -> Optional[str]:
    """After a job on a CUDA pool: the first measured peaks into `status` (plan_status's
    dict) and the line to log; None when there is nothing new (already measured, no
    prediction, no CUDA peak in the stats)."""
    if status.get("measured_peak_mb") is not None or not status.get("predicted_mb_per_rank"):
        return None
    peaks = measured_peaks(stats, world)
    if peaks is None:
        return None
    status["measured_peak_mb"] = [None if v is None else round(v) for v in peaks[0]]
    if any(v is not None for v in peaks[1]):
        status["measured_reserved_mb"] = [None if v is None else round(v) for v in peaks[1]]
    return measured_line(status["predicted_mb_per_rank"], peaks[0], peaks[1],
                         status.get("reserve_mb", RESERVE_BYTES / MiB))


# ---- command line ----------------------------------------------------------------------------
def add_cli(sub) -> None:
    p = sub.add_parser("memory-plan", help="per-rank GPU memory of a configuration, before "
                                           "launching (will it fit?)",
                       description="Prints each rank's planned GPU memory (GiB) and whether it "
                                   "fits --gpu-memory. Exit 0: fits (or no GPU size given), "
                                   "1: does not fit, 2: bad input.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="diffusers folder or single .safetensors transformer")
    src.add_argument("--preset", choices=sorted(PRESETS), help="published model dimensions")
    for name, what in (("ulysses", "Ulysses sequence-parallel degree (heads split)"),
                       ("ring", "Ring sequence-parallel degree (keys and values passed round)"),
                       ("pipefusion", "PipeFusion degree (each rank holds 1/N of the blocks)"),
                       ("dp", "data parallel degree (the batch split over replicas)")):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{what}; default 1")
    p.add_argument("--cfg-parallel", action="store_true",
                   help="CFG's two branches on different ranks (degree 2)")
    p.add_argument("--cfg", action="store_true", help="the job uses classifier-free guidance")
    p.add_argument("--pipefusion-split", default="balanced",
                   help="PipeFusion stage split: balanced | compute | memory | block counts "
                        "like 10,9")
    p.add_argument("--shard-weights", action="store_true",
                   help="FSDP2-shard the block weights over every rank")
    p.add_argument("--weights", choices=["auto", "fp8", "full"], default="auto",
                   help="auto: as the checkpoint stores them; fp8: block weights in fp8; "
                        "full: every weight in --dtype")
    p.add_argument("--text-encoders", default="auto",
                   help="where the text encoders sit: auto | cpu | gpu | cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                   help="weights and compute dtype (default bf16)")
    p.add_argument("--height", type=int, required=True,
                   help="image height in pixels, a multiple of 16")
    p.add_argument("--width", type=int, required=True,
                   help="image width in pixels, a multiple of 16")
    p.add_argument("--batch", type=int, default=1, help="images per job (default 1)")
    p.add_argument("--frames", type=int, default=1,
                   help="video models (Wan): frames, 4k + 1 (720p x 81 frames: 75,600 tokens)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="text tokens per prompt (default: the model's, 512)")
    p.add_argument("--gpu-memory", default=None,
                   help="GiB per GPU (with --compare: a comma list, e.g. 24,48,80)")
    p.add_argument("--gpus", default=None,
                   help="number of GPUs, the product of the degrees (with --compare: a comma "
                        "list, e.g. 2,4,8)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="your GPUs' all-gather bandwidth in GB/s, to time shard_weights' "
                        "per-step traffic (default: PCIe 4.0 x16 and NVLink figures)")
    p.add_argument("--compare", action="store_true",
                   help="a markdown table of every method (replicated, PipeFusion, "
                        "shard_weights; text encoders on GPU or CPU; bf16 and, where it "
                        "changes a verdict, fp8) on each GPU count x GPU size")
    p.add_argument("--traffic-table", action="store_true",
                   help="a markdown table of the bytes a rank sends per denoising step under "
                        "each method (Ulysses, Ring, PipeFusion, shard_weights, CFG parallel "
                        "with --cfg) on each --gpus count, timed on the links")
    p.add_argument("--shard-table", action="store_true",
                   help="a markdown table of shard_weights' bytes per rank and all-gather "
                        "traffic per forward on each --gpus count (e.g. 2,4,8)")
    p.set_defaults(func=run_cli)


def _numbers(text, name, kind):
    if text is None:
        return []
    try:
        vals = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be a number or a comma list of numbers (got {text!r})")
    if not vals or min(vals) <= 0:
        raise ConfigError(f"{name} must be > 0 (got {text!r})")
    return vals


def compare_table(facts: ModelFacts, job: JobSize, dtype: str, counts, sizes_gib) -> str:
    """Markdown: rows = method x text-encoder placement (x fp8 where it changes a verdict),
    columns = GPU count x GPU size; a cell is the peak rank's GiB and the verdict."""
    tr = _transformer(facts.transformer_class, facts.transformer_config, facts.arch)

    def seq(n):  # Ulysses where the heads split evenly, else Ring: the same memory
        return ParallelConfig(ulysses=n) if tr.heads % n == 0 else ParallelConfig(ring=n)
    methods = [("Ulysses/Ring {n} (replicated)", seq, False),
               ("PipeFusion {n}", lambda n: ParallelConfig(pipefusion=n), False),
               ("shard_weights, Ulysses/Ring {n}", seq, True)]
    cols = [(n, g) for g in sizes_gib for n in counts]
    head = ["method", "text enc.", "weights"] + [f"{n}x{g:g} GB" for n, g in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, make, shard in methods:
        for te in ("gpu", "cpu"):
            rows = {}
            for weights in ("full", "fp8"):
                cells = []
                for n, g in cols:
                    if make(n).pipefusion > len(tr.blocks):
                        cells.append((None, None))
                        continue
                    e = EngineOptions(device="cuda", dtype=dtype, weights=weights,
                                      text_encoders=te, shard_weights=shard)
                    p = _plan(facts, make(n), e, job, int(g * GiB))
                    cells.append((p.worst.total, p.fits))
                rows[weights] = cells
            for weights in ("full", "fp8"):
                if weights == "fp8" and [f for _, f in rows["fp8"]] == \
                        [f for _, f in rows["full"]]:
                    continue  # fp8 changes no verdict: not shown
                cells = ["-" if t is None else f"{t / GiB:.1f} {'✓' if f else '✗'}"
                         for t, f in rows[weights]]
                lines.append("| " + " | ".join([label.format(n="N"), te,
                                                dtype if weights == "full" else "fp8"]
                                               + cells) + " |")
    return "\n".join(lines)


def shard_table(facts: ModelFacts, dtype: str, weights: str, counts, links=LINKS_GBPS) -> str:
    """Markdown: shard_weights' bytes per rank and all-gather traffic per forward on each GPU
    count (one forward a step; two with CFG in one process), timed on `links`."""
    tr = _transformer(facts.transformer_class, facts.transformer_config, facts.arch)
    fp8 = weights == "fp8" or (weights == "auto" and facts.fp8_checkpoint)
    head = ["ranks", "weights at rest", "peak in a forward", "received per forward"] + \
        [f"{name} ~{bw:g} GB/s" for name, bw in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in counts:
        f = shard_figures(tr, DTYPE_BYTES[dtype], fp8, n)
        lines.append("| " + " | ".join(
            [str(n), gib(f.at_rest), gib(f.peak), gib(f.received_per_forward)] +
            [f"{f.received_per_forward / (bw * 1e9) * 1e3:.0f} ms" for _, bw in links]) + " |")
    return "\n".join(lines)


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
    tr = _transformer(facts.transformer_class, facts.transformer_config, facts.arch)
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


def _ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def traffic_table(facts: ModelFacts, job: JobSize, dtype: str, counts,
                  links=LINKS_GBPS) -> str:
    """Markdown: step_traffic per method and degree, GB (1e9 B) a rank sends per step, and
    that volume's time on `links` (a floor: the schedules overlap some of it with compute)."""
    tr = _transformer(facts.transformer_class, facts.transformer_config, facts.arch)
    head = ["method", "ranks", "sent per rank per step"] + \
        [f"{name} ~{bw:g} GB/s" for name, bw in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    for name in ("Ulysses", "Ring", "PipeFusion", "shard_weights"):
        for n in counts:
            if n < 2 or (name == "Ulysses" and tr.heads % n) or \
                    (name == "PipeFusion" and n > len(tr.blocks)):
                continue
            rows.append((name, n, step_traffic(facts, job, dtype, n)[name]))
    if job.cfg:
        rows.append(("CFG parallel", 2, step_traffic(facts, job, dtype, 2)["CFG parallel"]))
    for name, n, b in rows:
        lines.append("| " + " | ".join([name, str(n), f"{b / 1e9:.3g} GB"] + [
            _ms(b / (bw * 1e9) * 1e3) for _, bw in links]) + " |")
    return "\n".join(lines)


def run_cli(args) -> int:
    counts = _numbers(args.gpus, "--gpus", int)
    sizes = _numbers(args.gpu_memory, "--gpu-memory", float)
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise ConfigError(f"--link-gbps must be > 0 (got {args.link_gbps})")
    if args.shard_table or args.traffic_table:
        if not counts:
            raise ConfigError(f"--{'shard' if args.shard_table else 'traffic'}-table needs "
                              f"--gpus (e.g. 2,4,8)")
    elif args.compare:
        if not counts or not sizes:
            raise ConfigError("--compare needs --gpus (e.g. 2,4,8) and --gpu-memory in GiB "
                              "(e.g. 24,48,80)")
    elif len(counts) > 1 or len(sizes) > 1:
        raise ConfigError(f"--gpus {args.gpus} / --gpu-memory {args.gpu_memory}: give one "
                          f"number each, or add --compare for a table")
    config = ParallelConfig(dp=args.dp, cfg_parallel=args.cfg_parallel,
                            pipefusion=args.pipefusion, ulysses=args.ulysses, ring=args.ring,
                            pipefusion_split=args.pipefusion_split,
                            world_size=None if args.compare or args.shard_table or
                            args.traffic_table or not counts else counts[0])
    out = config.problems()
    engine = EngineOptions(device="cuda", dtype=args.dtype, weights=args.weights,
                           text_encoders=args.text_encoders, shard_weights=args.shard_weights)
    out += engine.problems() + engine.problems_with(config)
    for name in ("height", "width"):
        v = getattr(args, name)
        if v < 16 or v % 16:
            out.append(f"--{name} must be a positive multiple of 16 (got {v}; try "
                       f"{max(16, round(v / 16) * 16)})")
    if args.batch < 1:
        out.append(f"--batch must be >= 1 (got {args.batch})")
    if out:
        raise ConfigError("; ".join(out))
    facts = preset_facts(args.preset) if args.preset else model_facts(args.model, args.dtype)
    from comfyui_xdit.planning.request import frames_problems
    bad = frames_problems(args.frames, facts.arch)
    if bad:
        raise ConfigError("; ".join(bad))
    blocks = len(_transformer(facts.transformer_class, facts.transformer_config,
                              facts.arch).blocks)
    if config.pipefusion > blocks:
        raise ConfigError(f"pipefusion {config.pipefusion} exceeds the model's {blocks} "
                          f"blocks; use pipefusion <= {blocks}")
    job = JobSize(height=args.height, width=args.width, batch=args.batch,
                  text_tokens=args.max_sequence_length, cfg=args.cfg, frames=args.frames)
    if args.traffic_table:
        print(traffic_table(facts, job, args.dtype, counts,
                            LINKS_GBPS if args.link_gbps is None else
                            (("your link", args.link_gbps),)))
        return 0
    if args.shard_table:
        print(shard_table(facts, args.dtype, args.weights, counts,
                          LINKS_GBPS if args.link_gbps is None else
                          (("your link", args.link_gbps),)))
        return 0
    if args.compare:
        print(compare_table(facts, job, args.dtype, counts, sizes))
        return 0
    cap = int(sizes[0] * GiB) if sizes else None
    p = plan(facts, config.with_world_size(None), engine, job, cap)
    print(p.table())
    print(p.message())
    if p.gather_bytes_per_step:
        print(p.traffic((("your link", args.link_gbps),) if args.link_gbps else LINKS_GBPS))
    return 0 if p.fits is not False else 1
