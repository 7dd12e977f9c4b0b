"""The tiny MiniMax-H3 folder, built offline (`tiny-model --arch minimax_h3`): diffusers'
modular MiniMaxH3ModularPipeline (`ModularPipeline.from_pretrained(folder)` then
`.load_components()` reads it back), text-to-video with sound (`t2va`).

Parts: MiniMaxH3Transformer3DModel (`depth` blocks, `heads` x 16 wide heads over a hidden
width of `width` - 16, so heads x head width exceeds the hidden width as in the release;
2 refiner blocks; RoPE over 2 x 3 x 2 of each head's 16 channels, the rest passed through),
a Qwen3-VL conditioner of 51 tiny layers (the pipeline reads hidden state 50) over a
byte-level BPE in Qwen2's layout with the vision tokens its processor needs, an
AutoencoderKLMiniMaxH3 of small widths (16x in space, 17 frames -> 5 latent frames a chunk,
24 channels, as the real one), an AutoencoderKLMiniMaxH3Audio of small widths (32 kHz, 800
samples a latent, 32 channels), the two MiniMaxH3Schedulers (video shift 12, audio 3).
Weights are seeded per component (seed * 1000 + salt): a rebuild is byte-identical.
"""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _WORDS, _byte_level_bpe, _seeded

_family = bridge.family_module("minimax_h3")

VARIANTS: tuple[str, ...] = ()  # text-to-video with sound only (the pipeline's t2va)

# the family-wide tests' small request (tests/family_requests.py): 96 x 96 pixels are 3 x 3
# tokens a latent frame; 22 frames (17 + 5) are 7 latent frames, 63 video tokens, and 37
# audio latents a channel, 74 audio tokens; with the prompts' few text tokens no stream
# splits evenly over both 2 and 4 ranks
TEST_REQUEST = dict(size=(96, 96), frames=22, padded=True)  # rows carry their text lengths
# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_minimax_h3.py::test_one_rank_equals_the_pipeline"

# the single-process oracle of PipeFusion's stale-K/V schedule (its video and its sound) that
# the conformance suite holds pipelined PipeFusion to; it runs no CFG (the model is
# guidance-distilled: its pipeline has none)
PIPEFUSION_ORACLE = dict(oracle="test_minimax_h3:pipelined_oracle", request=dict(cfg=1.0))

HEAD_DIM = 16
ROPE_FREQ_DIM = 2  # 2 x 3 x 2 = 12 of the 16 channels rotate
# Qwen3-VL: the pipeline reads hidden_states[50], so 51 decoder layers (tiny ones)
TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=51, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=16,
              num_position_embeddings=16, deepstack_visual_indexes=[0])
VAE = dict(block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
           decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
           decoder_num_register_tokens=1, decoder_ffn_mult=2)
AUDIO_VAE = dict(encoder_dim=4, latent_dim=32, num_attention_heads=2, decoder_dim=128,
                 decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
                 resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def key_extras(cfg: dict) -> dict:
    """The recipe's version in the cache key (order-one AdaLN biases since version 2)."""
    return {"minimax_recipe": 2}


def check(cfg: dict) -> None:
    parts.require_head_dim(cfg, cfg["width"] > HEAD_DIM,
                           f"a width above {HEAD_DIM} (heads are {HEAD_DIM} wide; the hidden "
                           f"width is width - {HEAD_DIM})")
    parts.refuse_knobs(cfg)


def _tokenizer():
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast(tokenizer_object=_byte_level_bpe(_WORDS, SPECIALS),
                              eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                              model_max_length=TEXT["max_position_embeddings"])


def _text_encoder(seed: int) -> dict:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = _tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    config = Qwen3VLConfig(
        text_config=dict(TEXT, vocab_size=len(tok)), vision_config=VISION,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    encoder = _seeded(seed, 1, Qwen3VLForConditionalGeneration, config).eval()
    return dict(text_encoder=encoder, tokenizer=tok)


def processor(tokenizer):
    """The Qwen3-VL processor the pipeline's text step asks for its token types (all text
    for a prompt alone). Not saved with the folder: its video part needs torchvision, which
    is absent, so the processor can neither be saved nor loaded whole; the oracle gives the
    in-memory pipeline this one (its class check skipped for that one missing part)."""
    from unittest import mock

    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    image = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class",
                           lambda self, name, arg: type(arg)):
        return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer,
                                video_processor=None)


def build_pipeline(cfg: dict):
    """The tiny MiniMax-H3 modular pipeline in memory for a tiny_model.resolve_config `cfg`."""
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio,
                           MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel)
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    seed = cfg["seed"]
    hidden = cfg["width"] - HEAD_DIM
    transformer = _seeded(
        seed, 3, MiniMaxH3Transformer3DModel, num_attention_heads=cfg["heads"],
        attention_head_dim=HEAD_DIM, hidden_size=hidden, num_layers=cfg["depth"],
        num_refiner_layers=2, ffn_dim=2 * hidden, in_channels=_family.CHANNELS,
        audio_in_channels=_family.AUDIO_CHANNELS, patch_size=(1, 2, 2),
        text_dim=TEXT["hidden_size"], freq_dim=32, time_embed_hidden_dim=32,
        time_embed_dim=16, rope_freq_dim=ROPE_FREQ_DIM)
    # per-channel statistics away from (0, 1), so a wrong normalisation shows
    import torch
    g = torch.Generator().manual_seed(seed * 1000 + 7)
    # AdaLN modulation of order one (a trained model's gates are; random init leaves them
    # near zero), so every block moves the result and a skipped block shows
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            bias = block.adaln_proj.linear.bias
            bias.copy_(torch.randn(bias.shape, generator=g))
    mean = [round(float(v), 4) for v in torch.randn(_family.CHANNELS, generator=g) * 0.2]
    std = [round(float(v), 4) for v in torch.rand(_family.CHANNELS, generator=g) + 0.5]
    amean = [round(float(v), 4) for v in torch.randn(_family.AUDIO_CHANNELS, generator=g) * 0.2]
    astd = [round(float(v), 4) for v in torch.rand(_family.AUDIO_CHANNELS, generator=g) + 0.5]
    vae = _seeded(seed, 4, AutoencoderKLMiniMaxH3, latent_channels=_family.CHANNELS,
                  latents_mean=mean, latents_std=std, **VAE)
    audio_vae = _seeded(seed, 5, AutoencoderKLMiniMaxH3Audio,
                        latent_channels=_family.AUDIO_CHANNELS, latents_mean=amean,
                        latents_std=astd, **AUDIO_VAE)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        transformer=transformer, vae=vae, audio_vae=audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=_family.VIDEO_SHIFT),
        audio_scheduler=MiniMaxH3Scheduler(shift=_family.AUDIO_SHIFT), **_text_encoder(seed))
    return ReleaseLayout(pipe)


class ReleaseLayout:
    """The modular pipeline saved as the release lays it out: its components' folders and
    diffusers' modular_model_index.json, plus the model_index.json the release carries
    (naming MiniMaxH3Pipeline, a class diffusers 0.42.1 lacks), which is how a folder of
    this family is found and told apart."""

    def __init__(self, pipe):
        self.pipe = pipe

    @property
    def components(self) -> dict:
        return self.pipe.components

    def save_pretrained(self, out, **kw) -> None:
        import json
        import os

        import diffusers

        self.pipe.save_pretrained(str(out), **kw)
        index = {"_class_name": "MiniMaxH3Pipeline", "_diffusers_version": diffusers.__version__}
        for name, part in sorted(self.pipe.components.items()):
            if part is not None and os.path.isdir(os.path.join(str(out), name)):
                lib = "diffusers" if type(part).__module__.startswith("diffusers") \
                    else "transformers"
                index[name] = [lib, type(part).__name__]
        with open(os.path.join(str(out), "model_index.json"), "w") as f:
            json.dump(index, f, indent=2)


# ---- ComfyUI's single file (`tiny-model --comfy-file`) --------------------------------
# diffusers' MiniMaxH3Transformer3DModel names -> ComfyUI 0.33.0's (comfy/ldm/minimax/model.py
# MiniMaxH3Model, what its detection reads), written from ComfyUI's module layout
_COMFY_TOP = {"proj_in": "video_patch_proj", "audio_proj_in": "audio_patch_proj",
              "context_embedder": "condition_proj",
              "time_embedder.linear_1": "time_embedder.proj_in",
              "time_embedder.linear_2": "time_embedder.proj_out",
              "token_refiner.final_norm": "token_refiner.final_norm",
              "norm_out.norm": "final_layer.norm", "norm_out.linear": "final_layer.adaln_proj.linear",
              "proj_out": "final_layer.video_out", "audio_proj_out": "final_layer.audio_out"}
_COMFY_BLOCK = {"norm1": "norm1", "norm2": "norm2", "attn.norm_q": "attn.q_norm",
                "attn.norm_k": "attn.k_norm", "attn.to_out.0": "attn.out_proj",
                "ff.net.2": "mlp.fc2", "adaln_proj.linear": "adaln_proj.linear"}


def single_file(sd: dict) -> dict:
    """A tiny MiniMax-H3 transformer's diffusers state dict in ComfyUI's names (without the
    `model.diffusion_model.` prefix): q, k, v rows fused into `attn.qkv_proj`; each SwiGLU
    `mlp.fc1` with its gate rows first (ComfyUI gates with the first half, diffusers with the
    second); the RoPE frequencies ComfyUI reads from the file (`rope.inv_freq`, which
    diffusers computes: this builder's ROPE_FREQ_DIM a axis, theta 10000)."""
    import re

    import torch
    out = {}
    blocks: dict = {}
    for name, w in sd.items():
        stem, _, suffix = name.rpartition(".")
        if stem in _COMFY_TOP:
            out[f"{_COMFY_TOP[stem]}.{suffix}"] = w
            continue
        m = re.match(r"^(token_refiner\.refiner_blocks|transformer_blocks)\.(\d+)\.(.+)$", stem)
        assert m, f"no ComfyUI name for {name}"
        kind, i, part = m.groups()
        pre = f"token_refiner.blocks.{i}." if kind.startswith("token") else f"blocks.{i}."
        if part in ("attn.to_q", "attn.to_k", "attn.to_v"):
            blocks.setdefault(f"{pre}attn.qkv_proj.{suffix}", {})[part[-1]] = w
        elif part == "ff.net.0.proj":
            value, gate = w.chunk(2, dim=0)
            out[f"{pre}mlp.fc1.{suffix}"] = torch.cat([gate, value], dim=0)
        else:
            out[f"{pre}{_COMFY_BLOCK[part]}.{suffix}"] = w
    for name, qkv in blocks.items():
        out[name] = torch.cat([qkv["q"], qkv["k"], qkv["v"]], dim=0)
    d, theta = ROPE_FREQ_DIM, 10000.0
    out["rope.inv_freq"] = 1.0 / theta ** (torch.arange(0, 2 * d, 2, dtype=torch.float32)
                                           / (2 * d))
    assert sum(v.numel() for v in out.values()) == \
        sum(v.numel() for v in sd.values()) + d, "a tensor was dropped"
    return {k: v.contiguous() for k, v in out.items()}

