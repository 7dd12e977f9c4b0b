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
from comfyui_xdit.client.worker_modules import worker_module

families = worker_module("families")


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
    return TransformerFacts(blocks=tuple(triples(b) for b in blocks), rest=rest,
                            hidden=hidden, heads=heads, widest=int(widest), context_dim=ctx,
                            in_channels=int(c.in_channels), stage_costs=costs,
                            buffers=buffers)
