"""Small random-weight diffusers model folders, built offline.

Every test and the demo need a FLUX- or SD3-shaped model without any hub download, so this
module writes complete diffusers folders (transformer, VAE, text encoders, tokenizers,
scheduler) from nothing. The shapes keep the real models' structure (16 latent channels, 8x
VAE downsampling, FLUX's 2x2 packing and RoPE axes, SD3's CLIP-L + CLIP-G + T5 conditioning
with zero padding) so the parallel code paths are exercised, while the sizes keep a 4-step
128x128 run well under a second on one CPU thread.

Heavy imports (torch, diffusers, transformers) happen inside the functions: the CLI and the
ComfyUI entry import this module cheaply.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import uuid

from comfyui_xdit.client.worker_modules import worker_module
from comfyui_xdit.testmodels.text import (CLIP_MAX_LENGTH, _WORDS, _bytes_to_unicode, _bpe,
                                          _clip_tokenizer, _seeded, _t5_tokenizer)

families = worker_module("families")  # VAE factors, scheduler configs, RoPE axes
_flux = worker_module("families.flux")
_sd3 = worker_module("families.sd3")
_chroma = worker_module("families.chroma")
ARCHS = families.IDS
FLUX2_VARIANTS = ("klein", "dev")  # tiny-model --arch flux2 --variant
# tiny-model --variant per arch (the first: the default, kept out of the cache key)
VARIANTS = {"flux2": FLUX2_VARIANTS, "wan": ("t2v", "a14b", "i2v", "i2v-a14b")}

# Bump when the folder layout or any config below changes: it is part of the cache key, so
# ensure_tiny_model never serves a folder built by an older recipe.
BUILDER_VERSION = 1

DEFAULT_DEPTH = 2  # FLUX: 2 double + 2 single blocks; SD3: 2 joint blocks
DEFAULT_HEAD_DIM = 16  # width defaults to heads * 16

# Text encoders are shared by both archs (sizes only; weights are seeded per component).
CLIP_L = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
# CLIP-G differs from CLIP-L in width so mix-ups of the two change shapes, like the real pair.
CLIP_G = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, projection_dim=48)
# T5 d_model (96) > CLIP-L + CLIP-G hidden (80): SD3's zero padding of the CLIP states is real.
T5 = dict(d_model=96, d_kv=16, d_ff=192, num_layers=2, num_heads=4)

# The VAEs carry the released VAEs' latent statistics (their family's `released`),
# so raw-VAE-space LATENT conversion is meaningful; the schedulers are the released configs.

SD3_SAMPLE_SIZE = 16  # pipeline default 128x128
SD3_POS_EMBED_MAX = 64  # latent grid up to 128 -> images up to 1024x1024

def _clip_text_model(cls, cfg: dict, tokenizer, seed: int, salt: int):
    from transformers import CLIPTextConfig

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **cfg,
    )
    return _seeded(seed, salt, cls, config)


def _t5_model(tokenizer, seed: int, salt: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        feed_forward_proj="gated-gelu",  # T5 v1.1, as in FLUX's and SD3's T5-XXL
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **T5,
    )
    return _seeded(seed, salt, T5EncoderModel, config)


def _vae(arch: str, seed: int, salt: int):
    from diffusers import AutoencoderKL

    return _seeded(
        seed,
        salt,
        AutoencoderKL,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,  # 4 levels -> 8x, like the real VAEs
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=16,
        sample_size=128,
        **families.family(arch).released({})[1],  # scaling_factor, shift_factor
        use_quant_conv=False,  # FLUX and SD3 VAEs have no quant convs
        use_post_quant_conv=False,
    )


def resolve_config(arch: str, *, seed: int = 0, depth: int | None = None, width: int | None = None,
                   heads: int = 4, sd35: bool = False, variant: str | None = None) -> dict:
    """Validate the knobs and fill in defaults; the result is what the cache key hashes, so
    equivalent calls (explicit default vs omitted) share one folder."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    depth = DEFAULT_DEPTH if depth is None else depth
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be an integer >= 1, got {heads!r}")
    width = heads * DEFAULT_HEAD_DIM if width is None else width
    if not isinstance(width, int) or width < 1 or width % heads:
        raise ValueError(f"width must be a positive multiple of heads ({heads}), got {width!r}")
    head_dim = width // heads
    if arch in ("flux", "chroma") and (head_dim % 2 or head_dim < 6):
        raise ValueError(
            f"{arch} needs an even head dim >= 6 for its 3 RoPE axes; width {width} / heads {heads} = {head_dim}"
        )
    if arch == "flux2" and (head_dim % 8 or head_dim < 8):
        raise ValueError(
            f"flux2 needs a head dim that is a multiple of 8 for its 4 RoPE axes; width {width} / heads {heads} = {head_dim}"
        )
    if arch == "sd3" and head_dim < 2:
        raise ValueError(f"sd3 needs a head dim >= 2; width {width} / heads {heads} = {head_dim}")
    if arch == "qwen_image" and (head_dim % 2 or head_dim < 6):
        raise ValueError(f"qwen_image needs an even head dim >= 6 for its 3 RoPE axes; width "
                         f"{width} / heads {heads} = {head_dim}")
    if sd35 and arch != "sd3":
        raise ValueError("sd35 (QK RMS norm, dual-attention blocks) applies to --arch sd3 only")
    if arch == "wan" and (head_dim % 2 or head_dim < 6):
        raise ValueError(f"wan needs an even head dim >= 6 for its 3 RoPE axes; width "
                         f"{width} / heads {heads} = {head_dim}")
    if variant is not None and arch not in VARIANTS:
        raise ValueError(f"variant applies to --arch {' or '.join(VARIANTS)} only (got arch "
                         f"{arch!r})")
    if variant is not None and variant not in VARIANTS[arch]:
        raise ValueError(f"unknown {arch} variant {variant!r}: expected one of "
                         f"{', '.join(VARIANTS[arch])}")
    out = {"arch": arch, "seed": seed, "depth": depth, "width": width, "heads": heads,
           "builder_version": BUILDER_VERSION}
    if sd35:  # only when set, so the cache keys of the other models stay as they were
        out["sd35"] = True
    if variant is not None and variant != VARIANTS[arch][0]:  # the default keeps its key
        out["variant"] = variant
    if arch in ("flux", "chroma") and head_dim == 128:
        # FLUX.1's RoPE axes (16, 56, 56), as a single file of it is read (the old recipe
        # split 128 as (4, 62, 62)): a new key for this recipe, the others' keys unchanged
        out["rope"] = "flux1"
    return out


def _build_flux(cfg: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    seed, heads, head_dim = cfg["seed"], cfg["heads"], cfg["width"] // cfg["heads"]
    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    text_encoder = _clip_text_model(CLIPTextModel, CLIP_L, tokenizer, seed, 1)
    text_encoder_2 = _t5_model(tokenizer_2, seed, 2)
    transformer = _seeded(
        seed,
        3,
        FluxTransformer2DModel,
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=cfg["depth"],
        num_single_layers=cfg["depth"],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=T5["d_model"],
        pooled_projection_dim=CLIP_L["hidden_size"],
        guidance_embeds=True,  # FLUX.1-dev style embedded guidance
        axes_dims_rope=_flux.rope_axes(head_dim),
    )
    vae = _vae("flux", seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_flux.SCHEDULER_DEV)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


# Chroma's approximator (the MLP making every block's modulation from the timestep): its
# input stays the released 64 channels (16 timestep + 16 guidance + 32 modulation index),
# the only width ComfyUI's comfy/ldm/chroma accepts; hidden width and depth are small.
CHROMA_APPROXIMATOR = dict(approximator_num_channels=64, approximator_hidden_dim=32,
                           approximator_layers=2)


def _build_chroma(cfg: dict):
    """ChromaPipeline: FLUX.1's T5 (same salt, so the same weights as the FLUX test model's
    T5 of the seed) and VAE, a Chroma transformer of its own salt, the released scheduler."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    seed, heads, head_dim = cfg["seed"], cfg["heads"], cfg["width"] // cfg["heads"]
    tokenizer = _t5_tokenizer()
    text_encoder = _t5_model(tokenizer, seed, 2)
    transformer = _seeded(
        seed,
        6,
        ChromaTransformer2DModel,
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=cfg["depth"],
        num_single_layers=cfg["depth"],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=T5["d_model"],
        axes_dims_rope=_flux.rope_axes(head_dim),
        **CHROMA_APPROXIMATOR,
    )
    vae = _vae("chroma", seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_chroma.SCHEDULER)
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)


def _build_sd3(cfg: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    seed, heads, width = cfg["seed"], cfg["heads"], cfg["width"]
    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    text_encoder = _clip_text_model(CLIPTextModelWithProjection, CLIP_L, tokenizer, seed, 1)
    text_encoder_2 = _clip_text_model(CLIPTextModelWithProjection, CLIP_G, tokenizer_2, seed, 5)
    text_encoder_3 = _t5_model(tokenizer_3, seed, 2)
    transformer = _seeded(
        seed,
        3,
        SD3Transformer2DModel,
        sample_size=SD3_SAMPLE_SIZE,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=cfg["depth"],
        attention_head_dim=width // heads,
        num_attention_heads=heads,
        joint_attention_dim=T5["d_model"],
        caption_projection_dim=width,
        pooled_projection_dim=CLIP_L["projection_dim"] + CLIP_G["projection_dim"],
        pos_embed_max_size=SD3_POS_EMBED_MAX,
        # SD3.5: RMS-normed q/k and a second, image-only attention in every block
        **(dict(qk_norm="rms_norm", dual_attention_layers=tuple(range(cfg["depth"])))
           if cfg.get("sd35") else {}),
    )
    vae = _vae("sd3", seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_sd3.SCHEDULER)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


# FLUX.2 [klein]: a Qwen3 causal LM whose hidden states 9, 18 and 27 (of 28 layers) are
# concatenated into the transformer's text input, so joint_attention_dim = 3 x hidden.
QWEN3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=28, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=1024)
QWEN3_LAYERS = (9, 18, 27)
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_bpe(words, specials):
    """A byte-level BPE `tokenizers.Tokenizer` (GPT-2 / Qwen / Tekken style): the 256 byte
    symbols, merges that make each of `words` (with its leading-space marker) one token, then
    `specials`. Any text tokenizes; the listed words cost one token each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    space = _bytes_to_unicode()[ord(" ")]
    for word in words:
        pieces = _bpe(list(space + word), ranks)
        cur = pieces[0]
        for piece in pieces[1:]:
            if (cur, piece) not in ranks:
                ranks[(cur, piece)] = len(merges)
                merges.append((cur, piece))
            cur += piece
            vocab.setdefault(cur, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return tok


def _qwen_tokenizer():
    """A byte-level BPE tokenizer in Qwen2's layout: the words of _WORDS one token each, then
    the ChatML specials, with a ChatML chat template."""
    from transformers import Qwen2TokenizerFast

    tok = _byte_level_bpe(_WORDS, QWEN3_SPECIALS)
    out = Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             unk_token=None, model_max_length=QWEN3["max_position_embeddings"])
    out.chat_template = QWEN3_CHAT_TEMPLATE
    return out


def _flux2_parts(cfg: dict, text_dim: int, guidance_embeds: bool):
    """What every FLUX.2 variant shares: the transformer (taking `text_dim`-wide text
    states), the 32-channel batch-norm VAE and the scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    seed, heads, head_dim = cfg["seed"], cfg["heads"], cfg["width"] // cfg["heads"]
    transformer = _seeded(
        seed,
        3,
        Flux2Transformer2DModel,
        patch_size=1,
        in_channels=128,  # 32 latent channels packed 2x2
        num_layers=cfg["depth"],
        num_single_layers=cfg["depth"],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        timestep_guidance_channels=32,
        axes_dims_rope=(head_dim // 4,) * 4,
        guidance_embeds=guidance_embeds,
    )
    vae = _seeded(
        seed,
        4,
        AutoencoderKLFlux2,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=32,
        sample_size=128,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**_flux.SCHEDULER_DEV)
    return transformer, vae, scheduler


def _build_flux2(cfg: dict):
    if cfg.get("variant") == "dev":
        return _build_flux2_dev(cfg)
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen_tokenizer()
    text_encoder = _seeded(cfg["seed"], 1, Qwen3ForCausalLM, Qwen3Config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True, **QWEN3))
    text_encoder.eval()
    # klein: no embedded guidance
    transformer, vae, scheduler = _flux2_parts(cfg, len(QWEN3_LAYERS) * QWEN3["hidden_size"], False)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=True)


# FLUX.2 [dev]: a Mistral-3 (Mistral Small 3.1 style) vision-language model as text encoder;
# Flux2Pipeline.encode_prompt reads its hidden states 10, 20 and 30 (its default
# text_encoder_out_layers), so the text model needs 30 layers and joint_attention_dim is
# 3 x hidden. Mistral3ForConditionalGeneration always builds a Pixtral vision tower: a tiny
# one, never run (prompts are text only).
MISTRAL3_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=30, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=1024)
MISTRAL3_LAYERS = (10, 20, 30)
PIXTRAL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      head_dim=8, patch_size=4, image_size=32)
MISTRAL3_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                     "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# The words of Flux2Pipeline's system message, one token each, so the system turn costs ~30
# tokens and short max_sequence_length values still leave room for the prompt.
MISTRAL3_EXTRA_WORDS = """you are ai that reasons about image descriptions give structured responses
focusing object relationships attribution actions without speculation""".split()
# Mistral's instruct layout. Flux2Pipeline sends each message's content as a list of
# {"type": "text", "text": ...} parts; plain-string content is accepted too.
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def _mistral_tokenizer():
    """Byte-level BPE with Mistral's special tokens and instruct chat template.

    The released FLUX.2 [dev] folder ships a PixtralProcessor here; transformers 5 makes that
    class require torchvision (which this project must not depend on), and Flux2Pipeline's
    text path only calls `apply_chat_template`, which a tokenizer answers alike."""
    from transformers import PreTrainedTokenizerFast

    tok = _byte_level_bpe(_WORDS + MISTRAL3_EXTRA_WORDS, MISTRAL3_SPECIALS)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>",
                                  model_max_length=MISTRAL3_TEXT["max_position_embeddings"])
    out.chat_template = MISTRAL3_CHAT_TEMPLATE
    return out


def _build_flux2_dev(cfg: dict):
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    tokenizer = _mistral_tokenizer()
    text_config = MistralConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, **MISTRAL3_TEXT)
    config = Mistral3Config(text_config=text_config, vision_config=PixtralVisionConfig(**PIXTRAL_VISION),
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
    text_encoder = _seeded(cfg["seed"], 1, Mistral3ForConditionalGeneration, config)
    text_encoder.eval()
    transformer, vae, scheduler = _flux2_parts(
        cfg, len(MISTRAL3_LAYERS) * MISTRAL3_TEXT["hidden_size"], True)  # dev: embedded guidance
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)


def _build_qwen_image(cfg: dict):
    from comfyui_xdit.testmodels.tiny_qwen_image import build_pipeline
    return build_pipeline(cfg)


def _build_wan(cfg: dict):
    from comfyui_xdit.testmodels.tiny_wan import build_pipeline
    return build_pipeline(cfg)


def build_tiny_model(arch: str, out_dir: str | os.PathLike, *, seed: int = 0, depth: int | None = None,
                     width: int | None = None, heads: int = 4, sd35: bool = False,
                     variant: str | None = None) -> pathlib.Path:
    """Writes a complete diffusers folder (model_index.json, transformer/, vae/, text_encoder*/,
    tokenizer*/, scheduler/) and returns its path.

    depth: FLUX double and single block count (each), or SD3 joint block count (default 2).
    width: transformer hidden size = heads * head_dim (default heads * 16).
    heads: attention heads (default 4, so Ulysses degrees 2 and 4 divide it).
    sd35: SD3.5-style blocks (QK RMS norm, dual attention); arch sd3 only.
    variant: flux2: "klein" (default; Flux2KleinPipeline, Qwen3, no guidance embedding)
    or "dev" (Flux2Pipeline, Mistral-3 text encoder, embedded guidance); wan: "t2v" (default,
    Wan 2.1), "a14b" (Wan 2.2's two experts), "i2v" (Wan 2.1 image-to-video, CLIP image
    encoder) or "i2v-a14b" (Wan 2.2 I2V A14B), comfyui_xdit/testmodels/tiny_wan.py.
    Same arguments -> byte-identical safetensors.
    """
    cfg = resolve_config(arch, seed=seed, depth=depth, width=width, heads=heads, sd35=sd35,
                         variant=variant)
    import torch

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Build on the default RNG but leave the caller's RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        pipe = {"flux": _build_flux, "sd3": _build_sd3, "flux2": _build_flux2,
                "chroma": _build_chroma, "qwen_image": _build_qwen_image,
                "wan": _build_wan}[arch](cfg)
    with _quiet_transformers():
        pipe.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _normalize_modes(out)
    return out


def _current_umask() -> int:
    """Read the umask without os.umask's set-and-restore, which would briefly change it for
    every other thread of the host process (ComfyUI)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _normalize_modes(out: pathlib.Path) -> None:
    """safetensors files come out 0600 and ensure_tiny_model's temp dir 0700; give the model
    ordinary umask-based modes so a shared cache is readable like any other model folder."""
    umask = _current_umask()
    index = json.loads((out / "model_index.json").read_text())
    os.chmod(out, 0o777 & ~umask)
    for name in [k for k in index if not k.startswith("_")]:
        sub = out / name
        if not sub.is_dir():
            continue
        os.chmod(sub, 0o777 & ~umask)
        for f in sub.iterdir():
            if f.is_file():
                os.chmod(f, 0o666 & ~umask)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers draws a "Writing model shards" bar per text encoder; the CLI and test
    output should carry only what matters. The global setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_name(prefix: str, cfg: dict) -> str:
    """A cache folder name: the prefix and a hash of everything the build depends on."""
    blob = json.dumps(cfg, sort_keys=True).encode()
    return f"{prefix}-{hashlib.sha256(blob).hexdigest()[:12]}"


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """Advisory inter-process lock, so concurrent callers wait instead of all building the
    same model on the same cores. Correctness does not depend on it (the final rename is
    atomic); where flock is unavailable it is a no-op."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(path: pathlib.Path) -> bool:
    return (path / "model_index.json").is_file() and (path / "tiny_model.json").is_file()


def ensure_tiny_model(arch: str, cache_dir: str | os.PathLike, **kw) -> pathlib.Path:
    """Builds into cache_dir/<arch>-<hash of the kwargs> once, then reuses it."""
    cfg = resolve_config(arch, **kw)
    return cached_build(cache_dir, cache_name(cfg["arch"], cfg), lambda tmp: build_tiny_model(
        arch, tmp, **{k: cfg[k] for k in ("seed", "depth", "width", "heads")},
        sd35=bool(cfg.get("sd35")), variant=cfg.get("variant")))


def cached_build(cache_dir: str | os.PathLike, name: str, build) -> pathlib.Path:
    """cache_dir/name, made by `build(tmp_folder)` once and then reused.

    The build happens in a temporary sibling directory that is renamed into place, so a
    reader never sees a half-written folder, and several processes may call this at once:
    a file lock serialises the builders and a lost rename race just adopts the winner's
    folder.
    """
    cache = pathlib.Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / name
    if _is_complete(final):
        return final
    with _file_lock(cache / f".{final.name}.lock"):
        if _is_complete(final):
            return final
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
        try:
            build(tmp)
            if final.exists():  # left incomplete by something else: move it aside first
                trash = cache / f".{final.name}.trash-{uuid.uuid4().hex}"
                with contextlib.suppress(OSError):
                    os.rename(final, trash)
                    shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# Block prefixes of both namings: the Linears inside them are what fp8 files store in fp8.
_BLOCK_PREFIXES = ("double_blocks.", "single_blocks.", "joint_blocks.", "transformer_blocks.",
                   "single_transformer_blocks.", "blocks.")  # blocks.: Wan


def write_fp8_file(src: str | os.PathLike, dst: str | os.PathLike, scaled: bool) -> pathlib.Path:
    """An fp8 copy of a single-file transformer (any naming, optionally under
    model.diffusion_model.), as ComfyUI's fp8 files store one: every 2-D weight inside the
    transformer blocks in float8_e4m3fn, everything else as it was.

    scaled=False: ComfyUI's plain `flux1-dev-fp8` style, the weight cast (saturated at +-448).
    scaled=True: ComfyUI's scaled-fp8 style, `w / s` in fp8 with `<layer>.scale_weight` = s
    (fp32 scalar, s = max|w| / 448) beside it and a `scaled_fp8` marker key. A fused tensor
    (BFL qkv, linear1) gets one scale. For tests and experiments with the fp8 loaders."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = worker_module("loading.weights")
    sd = load_file(str(src))
    prefix = "model.diffusion_model." if any(k.startswith("model.diffusion_model.")
                                             for k in sd) else ""
    out = {}
    for k, w in sd.items():
        name = k[len(prefix):] if k.startswith(prefix) else None
        if name is None or not (name.startswith(_BLOCK_PREFIXES) and name.endswith(".weight")
                                and w.dim() == 2 and w.is_floating_point()):
            out[k] = w
            continue
        if scaled:  # the loaders' own quantization (workers/loading/weights.py)
            out[k], out[k[: -len(".weight")] + ".scale_weight"] = weights.quantize(w)
        else:
            out[k] = w.float().clamp(-weights.FP8_MAX, weights.FP8_MAX).to(weights.FP8)
    if scaled:
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst))
    return dst


def add_cli(subparsers) -> None:
    """Adds the `tiny-model` subcommand to the package CLI."""
    p = subparsers.add_parser(
        "tiny-model",
        help="write a small random-weight diffusers model folder (offline)",
        description="Write a small random-weight FLUX.1, FLUX.2, SD3, Chroma, Qwen-Image or Wan diffusers folder; "
                    "nothing "
                    "is downloaded.",
    )
    p.add_argument("--arch", required=True, choices=ARCHS, help="model family")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--depth", type=int, default=None, help=f"transformer blocks (default {DEFAULT_DEPTH})")
    p.add_argument("--width", type=int, default=None,
                   help=f"transformer hidden size, a multiple of --heads (default heads*{DEFAULT_HEAD_DIM})")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--sd35", action="store_true",
                   help="SD3.5-style blocks: QK RMS norm and dual attention (arch sd3)")
    p.add_argument("--variant", choices=sorted({v for vs in VARIANTS.values() for v in vs}),
                   default=None,
                   help="FLUX.2: klein (default; Qwen3 text encoder, no guidance embedding) "
                        "or dev (Mistral-3 text encoder, embedded guidance); Wan: t2v "
                        "(default; 2.1 text-to-video), a14b (2.2 text-to-video, two experts), "
                        "i2v (2.1 image-to-video, with a CLIP image encoder) or i2v-a14b (2.2 "
                        "image-to-video, two experts)")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Runs `tiny-model`; bad knobs exit 2 with one line on stderr."""
    try:
        path = build_tiny_model(args.arch, args.out, seed=args.seed, depth=args.depth, width=args.width,
                                heads=args.heads, sd35=args.sd35, variant=args.variant)
    except ValueError as exc:
        print(f"tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover - convenience entry
    _parser = argparse.ArgumentParser(prog="tiny_model")
    add_cli(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
