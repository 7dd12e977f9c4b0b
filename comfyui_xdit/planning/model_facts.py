"""A model's sizes as the memory plan counts them: the parameter counts of its transformer,
text encoders and VAE, from a diffusers folder, a single .safetensors transformer, or a named
preset of a released model's published dimensions.

Nothing is downloaded or allocated: each module is built on the meta device from its config
(model_info.py's detection says which family and config a folder or file holds), and what
the plan's arithmetic reads of the transformer is kept per parameter (`transformer_facts`).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Optional

from comfyui_xdit.errors import ConfigError
from comfyui_xdit import bridge
from comfyui_xdit.bridge import families


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


# Every family's presets (its description's `Presets` capability), by name
PRESETS = {name: Preset(arch=f.id, **spec) for f in families.FAMILIES.values()
           for name, spec in getattr(f.capability(families.Presets), "named", {}).items()}


def vae_channels(config) -> tuple:
    """The VAE decoder's level widths, full resolution first, as the plan reads them (entry
    i + 1 is the width the decoder holds at 1/2^i of the image side:
    memory_arithmetic.vae_largest_map): block_out_channels, a Wan-style 3-D VAE's base_dim x
    dim_mult (Qwen-Image's), or a decoder's widths of its own where the encoder's differ
    (decoder_block_out_channels; upsampling by moving channels into space where upsample
    factors are given: LTX-2's)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if get("decoder_block_out_channels") is not None:
        if get("upsample_factor") is not None:
            return _depth_to_space_widths(get)
        return tuple(get("decoder_block_out_channels"))
    if get("block_out_channels") is not None:
        return tuple(get("block_out_channels"))
    if get("base_dim") is not None:
        return tuple(int(get("base_dim")) * int(m) for m in get("dim_mult", (1, 2, 4, 4)))
    return (128, 256, 512, 512)


def _depth_to_space_widths(get) -> tuple:
    """An LTX-style decoder: its levels work on `patch_size`-pixel patches (the output
    unpatchified at the end), and each upsampler widens its input by a convolution, then
    moves channels into space (2x, and 2x in time): level k (1/(patch x 2^k) of the side)
    holds decoder_block_out_channels[k] / upsample_factor[k] channels, the deepest level
    the last width (its mid block), and the finer levels only the output's channels."""
    widths = [int(c) for c in get("decoder_block_out_channels")]
    factors = [int(f) for f in get("upsample_factor")]
    patch, out = int(get("patch_size", 1)), int(get("out_channels", 3))
    fine = max(0, patch.bit_length() - 1)  # levels finer than a patch: log2(patch_size)
    held = [c // f for c, f in zip(widths, factors)] + [widths[-1]]
    return (out,) * (fine + 1) + tuple(held)


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
    # a GGUF file's quantised Linears under weights=auto: bytes per weight value (Q8_0
    # 34/32, Q4_K 144/256, ...); 0: not GGUF
    gguf_bytes_per_value: float = 0.0


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
                      transformer_class=families.family(p.arch).classes.transformer,
                      transformer_config=json.dumps(p.transformer, sort_keys=True),
                      text_encoder_params=te, vae_params=vae, vae_channels=channels,
                      text_tokens=p.text_tokens, experts=p.experts)


def _transformer_count(arch: str, kind: str, path) -> int:
    """Transformers of one config a model holds: a folder's experts (Wan 2.2 A14B), or one
    per guidance branch (the family's BranchTransformers)."""
    from comfyui_xdit.planning.model_info import expert_count
    branches = families.family(arch).capability(families.BranchTransformers)
    if branches is not None and kind == "diffusers":
        return len(branches.subfolders)
    return expert_count(path)


def model_facts(path: str, dtype: str = "bf16") -> ModelFacts:
    """A diffusers folder or single file, through the pack's detection (model_info)."""
    from comfyui_xdit.planning.model_info import _describe_model, expert_count

    d = _describe_model(path)
    arch, cfg = d["arch"], dict(d["config"])
    storage = d.get("storage") or {}
    tcls = families.family(arch).classes.transformer
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    te_bytes, vae_params, channels = 0, 0, ()
    if d["kind"] == "diffusers":
        import torch
        weights = bridge.weights
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
                      fp8_checkpoint=bool(storage.get("fp8")),
                      experts=_transformer_count(arch, d["kind"], path),
                      gguf_bytes_per_value=float(storage.get("gguf_bytes_per_value", 0.0)))


def _torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True)
class TransformerFacts:
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
def transformer_facts(class_name: str, config_json: str, arch: str) -> TransformerFacts:
    """The transformer of a ModelFacts (its class, config JSON and family), built once on
    the meta device and cached: every plan, table and alternative reads the same counts."""
    import diffusers
    import torch

    stages = bridge.stages
    weights = bridge.weights
    cls = getattr(diffusers, class_name)
    tr = _meta(lambda: cls.from_config(json.loads(config_json)))
    lists = families.family(arch).blocks.lists
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
    c, fam = tr.config, families.family(arch)
    heads = fam.heads(c)
    hidden = heads * fam.head_dim(c)
    ctx = int(fam.text_width(c) or c.get("caption_projection_dim", 0) or hidden)
    costs = ([stages.block_cost(b, "compute") for b in blocks],
             [stages.block_cost(b, "memory") for b in blocks])
    state = set(tr.state_dict())
    buffers = sum(b.numel() for n, b in tr.named_buffers() if n in state)
    return TransformerFacts(blocks=tuple(triples(b) for b in blocks), rest=rest,
                            hidden=hidden, heads=heads, widest=int(widest), context_dim=ctx,
                            in_channels=int(c.in_channels), stage_costs=costs,
                            buffers=buffers)
