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
from comfyui_xdit.testmodels import bfl_names, parts
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
# PipeFusion's stale-K/V oracle (the conformance suite's PipeFusion theme)
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_video_reference:wan_oracle", request={})
# the test model a ComfyUI single file describes (the conformance suite's single-file
# theme): Wan's files store no head count (head dim 128, as released)
SINGLE_FILE_MODEL = dict(width=256, heads=2)

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


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in ComfyUI's / the original Wan names (what
    ComfyUI's WanModel holds), for the conformance suite's single-file theme."""
    out = {}
    top = {"patch_embedding": "patch_embedding",
           "condition_embedder.text_embedder.linear_1": "text_embedding.0",
           "condition_embedder.text_embedder.linear_2": "text_embedding.2",
           "condition_embedder.time_embedder.linear_1": "time_embedding.0",
           "condition_embedder.time_embedder.linear_2": "time_embedding.2",
           "condition_embedder.time_proj": "time_projection.1",
           "proj_out": "head.head",
           "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
           "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
           "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
           "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}
    for d, c in top.items():
        for p in ("weight", "bias"):
            if f"{d}.{p}" in sd:
                out[f"{c}.{p}"] = sd[f"{d}.{p}"]
    out["head.modulation"] = sd["scale_shift_table"]  # [1, 2, dim]: shift, scale both
    if "condition_embedder.image_embedder.pos_embed" in sd:
        out["img_emb.emb_pos"] = sd["condition_embedder.image_embedder.pos_embed"]
    for i in range(bfl_names.count(sd, "blocks")):
        b = f"blocks.{i}."
        for attn, src in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            for p in ("weight", "bias"):
                for x in "qkv":
                    out[f"{b}{attn}.{x}.{p}"] = sd[f"{b}{src}.to_{x}.{p}"]
                out[f"{b}{attn}.o.{p}"] = sd[f"{b}{src}.to_out.0.{p}"]
            for x in "qk":
                out[f"{b}{attn}.norm_{x}.weight"] = sd[f"{b}{src}.norm_{x}.weight"]
        if f"{b}attn2.add_k_proj.weight" in sd:  # I2V's image K / V
            for p in ("weight", "bias"):
                out[f"{b}cross_attn.k_img.{p}"] = sd[f"{b}attn2.add_k_proj.{p}"]
                out[f"{b}cross_attn.v_img.{p}"] = sd[f"{b}attn2.add_v_proj.{p}"]
            out[f"{b}cross_attn.norm_k_img.weight"] = sd[f"{b}attn2.norm_added_k.weight"]
        for p in ("weight", "bias"):
            out[f"{b}norm3.{p}"] = sd[f"{b}norm2.{p}"]
            out[f"{b}ffn.0.{p}"] = sd[f"{b}ffn.net.0.proj.{p}"]
            out[f"{b}ffn.2.{p}"] = sd[f"{b}ffn.net.2.{p}"]
        out[f"{b}modulation"] = sd[f"{b}scale_shift_table"]
    return bfl_names.same_size(out, sd)
