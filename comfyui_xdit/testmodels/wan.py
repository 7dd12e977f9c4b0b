"""The tiny Wan diffusers folders, built offline (`tiny-model --arch wan [--variant V]`):

- "t2v" (default): WanPipeline, Wan 2.1 text-to-video: one transformer.
- "a14b": WanPipeline, Wan 2.2 A14B's layout: a high-noise `transformer` and a low-noise
  `transformer_2` (seeded apart), `boundary_ratio` 0.875 in model_index.json.
- "i2v": WanImageToVideoPipeline, Wan 2.1 I2V: in_channels 36 (the noise, the 4-channel
  first-frame mask, the 16-channel image video), the CLIP image states reached through their
  own cross-attention K/V (`image_dim`, `added_kv_proj_dim`), a tiny CLIPVisionModel (2
  layers: the pipeline reads hidden_states[-2]) and its CLIPImageProcessorPil (no
  torchvision).
- "i2v-a14b": WanImageToVideoPipeline, Wan 2.2 I2V A14B: two 36-channel experts, no image
  encoder, `boundary_ratio` 0.9 as the release.

Parts: WanTransformer3DModel (`depth` blocks, `heads` x width/heads, patch (1, 2, 2), ffn
2 x width), UMT5EncoderModel over the shared T5-style unigram tokenizer (text.py), an
AutoencoderKLWan with base_dim 8 and the released latent statistics (4x in time, 8x in space,
as the real one), the released UniPC flow scheduler (workers/families/wan.SCHEDULER).
Weights are seeded per component (seed * 1000 + salt): a rebuild is byte-identical.
"""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _seeded, _t5_tokenizer

_family = bridge.family_module("wan")

VARIANTS: tuple[str, ...] = ("t2v", "a14b", "i2v", "i2v-a14b")
VARIANT_HELP = ("Wan: t2v (default; 2.1 text-to-video), a14b (2.2 text-to-video, two experts), "
                "i2v (2.1 image-to-video, with a CLIP image encoder) or i2v-a14b (2.2 "
                "image-to-video, two experts)")
# the CLIP vision tower: (32 / 8)^2 patches + the class token = 17 image tokens
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
TEXT = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True])


# the family-wide tests' small request (tests/family_requests.py)
TEST_REQUEST = dict(size=(48, 80))
# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_wan.py::test_one_rank_equals_the_pipeline"

def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 2 == 0 and hd >= 6, "an even head dim >= 6 for its 3 RoPE axes")
    parts.refuse_knobs(cfg)


def _transformer(cfg: dict, seed: int, salt: int, in_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    head_dim = cfg["width"] // cfg["heads"]
    return _seeded(seed, salt, WanTransformer3DModel, patch_size=(1, 2, 2),
                   num_attention_heads=cfg["heads"], attention_head_dim=head_dim,
                   in_channels=in_channels, out_channels=16, text_dim=TEXT["d_model"],
                   freq_dim=256, ffn_dim=2 * cfg["width"], num_layers=cfg["depth"],
                   rope_max_seq_len=1024, **extra)


def _text(seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    tok = _t5_tokenizer()
    config = UMT5Config(vocab_size=len(tok), feed_forward_proj="gated-gelu",
                        tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
                        **TEXT)
    return tok, _seeded(seed, 1, UMT5EncoderModel, config).eval()


def _image_encoder(seed: int):
    """A tiny CLIPVisionModel and its image processor (PIL backend: torchvision is absent)."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    size = CLIP_VISION["image_size"]
    processor = CLIPImageProcessorPil(size={"shortest_edge": size},
                                      crop_size={"height": size, "width": size})
    return _seeded(seed, 6, CLIPVisionModel, CLIPVisionConfig(**CLIP_VISION)).eval(), processor


def build_pipeline(cfg: dict):
    """The tiny Wan pipeline in memory for a tiny_model.resolve_config `cfg`."""
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline,
                           WanPipeline)

    seed, variant = cfg["seed"], cfg.get("variant") or VARIANTS[0]
    tokenizer, text_encoder = _text(seed)
    vae = _seeded(seed, 4, AutoencoderKLWan, latents_mean=list(_family.LATENTS_MEAN),
                  latents_std=list(_family.LATENTS_STD), **VAE)
    sched = {k: v for k, v in _family.SCHEDULER.items() if k != "_class_name"}
    scheduler = UniPCMultistepScheduler(**sched)
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler)
    if variant == "i2v":  # Wan 2.1 I2V: CLIP image tokens through their own K/V
        encoder, processor = _image_encoder(seed)
        extra = dict(image_dim=CLIP_VISION["hidden_size"], added_kv_proj_dim=cfg["width"])
        return WanImageToVideoPipeline(**components, image_encoder=encoder, image_processor=processor,
                                       transformer=_transformer(cfg, seed, 3, 36, **extra))
    if variant == "i2v-a14b":  # Wan 2.2 I2V A14B: two 36-channel experts, no image encoder
        return WanImageToVideoPipeline(**components, transformer=_transformer(cfg, seed, 3, 36),
                                       transformer_2=_transformer(cfg, seed, 5, 36),
                                       boundary_ratio=_family.I2V_BOUNDARY_RATIO)
    components["transformer"] = _transformer(cfg, seed, 3)
    if variant == "a14b":
        components.update(transformer_2=_transformer(cfg, seed, 5),
                          boundary_ratio=_family.BOUNDARY_RATIO)
    return WanPipeline(**components)
