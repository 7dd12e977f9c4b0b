"""The tiny Z-Image diffusers folder (`tiny-model --arch z_image`): ZImagePipeline with

- transformer: ZImageTransformer2DModel, `depth` main blocks, 2 refiner blocks of each kind
  (as released), `heads` x width/heads, RoPE axes split like the released (32, 48, 48)
  (workers/families/z_image.rope_axes);
- text_encoder: a 2-layer Qwen3Model (the pipeline reads its hidden_states[-2]) with a
  byte-level BPE tokenizer in Qwen2's layout and a ChatML chat template (what the pipeline's
  apply_chat_template call renders for Qwen3 with thinking enabled: no think block);
- vae: FLUX.1's 16-channel 8x AutoencoderKL shape with its latent statistics (parts.kl_vae);
- scheduler: the released FlowMatch Euler config (shift 3, no dynamic shift).

Weights are seeded per component (seed * 1000 + salt): a rebuild is byte-identical.
"""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _WORDS, _byte_level_bpe, _seeded

_family = bridge.family_module("z_image")  # scheduler, RoPE axes

VARIANTS: tuple = ()
# the family-wide tests' small request (tests/family_requests.py): a text length the chat
# template (19 tokens) leaves room in
TEST_REQUEST = dict(msl=64)
# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_z_image.py::test_one_rank_equals_the_pipeline"
# PipeFusion's stale-K/V oracle for the conformance suite (tests/conformance/test_pipefusion.py):
# the test module's factory of the model folder, and the request fields it needs
PIPEFUSION_ORACLE = dict(oracle="test_z_image:pipelined_oracle", request={})
# the LoRA file formats the conformance suite writes for it beside diffusers/PEFT's: ComfyUI's
# `diffusion_model.<layer>.lora_down / lora_up / alpha` under diffusers' layer names
LORA_FORMATS = ("peft", "comfy")

# Qwen3 text encoder (hidden width = the transformer's cap_feat_dim)
QWEN3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=1024)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REFINER_LAYERS = 2  # released: 2 image and 2 text refiner blocks


def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 2 == 0 and hd >= 6,
                           "an even head dim >= 6 for its 3 RoPE axes")
    parts.refuse_knobs(cfg)


def tokenizer():
    """The in-memory Qwen2-layout tokenizer: the words of text._WORDS one token each, the
    ChatML specials, the ChatML template."""
    from transformers import Qwen2TokenizerFast

    out = Qwen2TokenizerFast(tokenizer_object=_byte_level_bpe(_WORDS, SPECIALS),
                             eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                             model_max_length=QWEN3["max_position_embeddings"])
    out.chat_template = CHAT_TEMPLATE
    return out


def build_pipeline(cfg: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    seed, heads = cfg["seed"], cfg["heads"]
    tok = tokenizer()
    text_encoder = _seeded(seed, 1, Qwen3Model, Qwen3Config(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        **QWEN3)).eval()
    transformer = _seeded(
        seed, 3, ZImageTransformer2DModel,
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=cfg["width"],
        n_layers=cfg["depth"], n_refiner_layers=REFINER_LAYERS, n_heads=heads,
        n_kv_heads=heads, cap_feat_dim=QWEN3["hidden_size"], rope_theta=_family.ROPE_THETA,
        axes_dims=list(_family.rope_axes(parts.head_dim(cfg))),
        axes_lens=list(_family.ROPE_LENS))
    _learned_pads(transformer, seed)
    vae = parts.kl_vae("z_image", seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_family.SCHEDULER)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                          tokenizer=tok, transformer=transformer)


def _learned_pads(transformer, seed: int) -> None:
    """The pad tokens start as zeros in diffusers (a trained model's are not): give them
    seeded values of the hidden states' scale, so a split that drops, moves or zeroes them
    changes the result."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + 7)
    with torch.no_grad():
        for p in (transformer.x_pad_token, transformer.cap_pad_token):
            p.copy_(torch.randn(p.shape, generator=gen))


def single_file(sd: dict) -> dict:
    """diffusers' Z-Image state -> ComfyUI's NextDiT names, read off ComfyUI 0.8.0's key map
    (comfy/utils.py z_image_to_diffusers): q, k, v joined as attention.qkv, norm_q/k as
    q_norm/k_norm, to_out.0 as out, the patch-2 embedder and final layer without their
    "2-1" key; for the conformance suite's single-file theme and the live suite."""
    import torch
    out = {}
    for k, v in sd.items():
        if ".attention.to_q." in k:
            base = k.replace(".to_q.", ".qkv.")
            out[base] = torch.cat([v, sd[k.replace("to_q", "to_k")], sd[k.replace("to_q", "to_v")]])
            continue
        if ".attention.to_k." in k or ".attention.to_v." in k:
            continue
        k = (k.replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
             .replace(".to_out.0.", ".out.").replace("all_x_embedder.2-1.", "x_embedder.")
             .replace("all_final_layer.2-1.", "final_layer."))
        out[k] = v
    return out
