"""The tiny Ideogram 4 diffusers folder (`tiny-model --arch ideogram4`): Ideogram4Pipeline with

- transformer and unconditional_transformer: two Ideogram4Transformer2DModel of the same
  shape, each seeded on its own (`depth` blocks, `heads` x width/heads, SwiGLU 2 x width,
  MRoPE sections (t, h, w) fitted to the head dim as the released (24, 20, 20) to 256);
- text_encoder: a Qwen3-VL model whose text model has the 36 decoder layers the pipeline
  taps (13 of them, side by side: the transformer's text width is 13 x hidden), 16 wide,
  and a tiny vision tower never run; a byte-level BPE tokenizer in Qwen2's layout with a
  ChatML template that reads the pipeline's list-of-parts message content;
- vae: FLUX.2's 32-channel batch-norm AutoencoderKLFlux2 shape, its running statistics
  seeded (so a channel order mistake in the batch-norm shows);
- scheduler: FlowMatch Euler, shift 1 (the pipeline sets its own sigmas).

Weights are seeded per component (seed * 1000 + salt): a rebuild is byte-identical.
"""
from __future__ import annotations

from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _WORDS, _byte_level_bpe, _seeded

VARIANTS: tuple = ()
# the family-wide tests' small request: 5 x 3 image tokens, a text length the chat template
# (10 tokens around the prompt) leaves room in
TEST_REQUEST = dict(msl=48, padded=True)
# the test (under tests/) that holds one rank of this model to its diffusers pipeline
ORACLE_TEST = "test_ideogram4.py::test_one_rank_equals_the_pipeline"
CONFORMANCE_EXEMPT = {
    "pipefusion": "not yet: a PipeFusion stage would load its blocks of both transformers "
                  "(the conditional and the unconditional one) and the unconditional "
                  "pass's plans carry no text stream; refused before a launch",
    "single_file": "not yet: Ideogram 4 is two transformer files (conditional and "
                   "unconditional) and the loader's single-file path takes one",
    "model_call": "not yet: ComfyUI 0.33.0's Ideogram 4 is one transformer that runs every "
                  "row with its context (image only where the context is None), not the "
                  "pipeline's asymmetric pair, and under CFG parallel a cfg rank here holds "
                  "one branch's transformer only; the MODEL's calls are not wired to either",
}

TEXT_LAYERS = 36  # the pipeline taps layers 0, 3, ..., 33 and 35
TEXT_HIDDEN = 16
TAPPED = 13
QWEN3VL_TEXT = dict(hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=TEXT_LAYERS,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                    max_position_embeddings=1024,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3VL_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                      out_hidden_size=TEXT_HIDDEN, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{{ message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('\\n') }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def mrope_section(head_dim: int) -> list:
    """(t, h, w) frequency counts for a head dim: the released (24, 20, 20) of 128
    frequencies scaled, h and w equal, 3 x max(h, w) within the head's frequencies."""
    freqs = head_dim // 2
    hw = max(1, freqs * 20 // 128)
    return [freqs - 2 * hw, hw, hw]


def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 2 == 0 and hd >= 8,
                           "an even head dim >= 8 for its 3 MRoPE axes")
    parts.refuse_knobs(cfg)


def tokenizer():
    from transformers import Qwen2TokenizerFast

    out = Qwen2TokenizerFast(tokenizer_object=_byte_level_bpe(_WORDS, SPECIALS),
                             eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                             model_max_length=QWEN3VL_TEXT["max_position_embeddings"])
    out.chat_template = CHAT_TEMPLATE
    return out


def transformer(cfg: dict, salt: int):
    from diffusers import Ideogram4Transformer2DModel
    hd = parts.head_dim(cfg)
    return _seeded(cfg["seed"], salt, Ideogram4Transformer2DModel, in_channels=128,
                   num_layers=cfg["depth"], attention_head_dim=hd,
                   num_attention_heads=cfg["heads"], intermediate_size=2 * cfg["width"],
                   adaln_dim=16, llm_features_dim=TAPPED * TEXT_HIDDEN, rope_theta=5000000,
                   mrope_section=tuple(mrope_section(hd)))


def build_pipeline(cfg: dict):
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from transformers import Qwen3VLConfig, Qwen3VLModel

    seed = cfg["seed"]
    tok = tokenizer()
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, **QWEN3VL_TEXT),
        vision_config=QWEN3VL_VISION,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    text_encoder = _seeded(seed, 1, Qwen3VLModel, config).eval()
    vae = _seeded(seed, 4, AutoencoderKLFlux2, in_channels=3, out_channels=3,
                  block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
                  latent_channels=32, sample_size=128)
    gen = torch.Generator().manual_seed(seed * 1000 + 7)
    with torch.no_grad():  # statistics of a trained VAE's scale, each channel its own
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=gen))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=gen))
    return Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=vae,
                             text_encoder=text_encoder, tokenizer=tok,
                             transformer=transformer(cfg, 3),
                             unconditional_transformer=transformer(cfg, 5))
