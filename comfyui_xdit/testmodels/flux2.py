"""The tiny FLUX.2 diffusers folders (`tiny-model --arch flux2 [--variant V]`):

- "klein" (default): Flux2KleinPipeline with a Qwen3 causal LM as text encoder, no guidance
  embedding (is_distilled).
- "dev": Flux2Pipeline with a Mistral-3 vision-language model as text encoder and embedded
  guidance.

Both share the transformer (4 RoPE axes of head_dim / 4), the 32-channel batch-norm VAE and
the released FLUX.1 [dev] scheduler config.
"""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import bfl_names, parts
from comfyui_xdit.testmodels.text import _WORDS, _byte_level_bpe, _seeded

_flux = bridge.family_module("flux")  # scheduler

VARIANTS: tuple[str, ...] = ("klein", "dev")

# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_flux2.py::test_flux2_pool_matches_pipeline"
# its oracle of PipeFusion's stale-K/V schedule (the conformance suite's pipefusion theme;
# [klein], the default variant)
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_oracles:Flux2Reference", request={})
VARIANT_HELP = ("FLUX.2: klein (default; Qwen3 text encoder, no guidance embedding) or dev "
                "(Mistral-3 text encoder, embedded guidance)")

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


def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 8 == 0 and hd >= 8,
                           "a head dim that is a multiple of 8 for its 4 RoPE axes")
    parts.refuse_knobs(cfg)


def _qwen_tokenizer():
    """A byte-level BPE tokenizer in Qwen2's layout: the words of _WORDS one token each, then
    the ChatML specials, with a ChatML chat template."""
    from transformers import Qwen2TokenizerFast

    tok = _byte_level_bpe(_WORDS, QWEN3_SPECIALS)
    out = Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             unk_token=None, model_max_length=QWEN3["max_position_embeddings"])
    out.chat_template = QWEN3_CHAT_TEMPLATE
    return out


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


def _shared_parts(cfg: dict, text_dim: int, guidance_embeds: bool):
    """What every FLUX.2 variant shares: the transformer (taking `text_dim`-wide text
    states), the 32-channel batch-norm VAE and the scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    seed, heads, head_dim = cfg["seed"], cfg["heads"], parts.head_dim(cfg)
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


def _klein(cfg: dict):
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen_tokenizer()
    text_encoder = _seeded(cfg["seed"], 1, Qwen3ForCausalLM, Qwen3Config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True, **QWEN3))
    text_encoder.eval()
    # klein: no embedded guidance
    transformer, vae, scheduler = _shared_parts(cfg, len(QWEN3_LAYERS) * QWEN3["hidden_size"], False)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=True)


def _dev(cfg: dict):
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
    transformer, vae, scheduler = _shared_parts(
        cfg, len(MISTRAL3_LAYERS) * MISTRAL3_TEXT["hidden_size"], True)  # dev: embedded guidance
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)


def build_pipeline(cfg: dict):
    return _dev(cfg) if cfg.get("variant") == "dev" else _klein(cfg)


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in BFL / ComfyUI FLUX.2 names (weights only:
    FLUX.2 has no biases; modulation shared by all blocks of a kind), for the conformance
    suite's single-file theme."""
    import torch
    out = {}
    top = {"x_embedder": "img_in", "context_embedder": "txt_in",
           "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
           "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
           "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
           "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
           "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
           "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
           "single_stream_modulation.linear": "single_stream_modulation.lin",
           "proj_out": "final_layer.linear"}
    for d, b in top.items():
        if f"{d}.weight" in sd:
            out[f"{b}.weight"] = sd[f"{d}.weight"]
    out["final_layer.adaLN_modulation.1.weight"] = bfl_names.shift_scale(sd["norm_out.linear.weight"])
    for i in range(bfl_names.count(sd, "transformer_blocks")):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out[f"{b}img_attn.qkv.weight"] = torch.cat([sd[f"{d}attn.to_{x}.weight"] for x in "qkv"])
        out[f"{b}txt_attn.qkv.weight"] = torch.cat([sd[f"{d}attn.add_{x}_proj.weight"]
                                                    for x in "qkv"])
        out[f"{b}img_attn.proj.weight"] = sd[f"{d}attn.to_out.0.weight"]
        out[f"{b}txt_attn.proj.weight"] = sd[f"{d}attn.to_add_out.weight"]
        out[f"{b}img_attn.norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}img_attn.norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
        out[f"{b}txt_attn.norm.query_norm.scale"] = sd[f"{d}attn.norm_added_q.weight"]
        out[f"{b}txt_attn.norm.key_norm.scale"] = sd[f"{d}attn.norm_added_k.weight"]
        out[f"{b}img_mlp.0.weight"] = sd[f"{d}ff.linear_in.weight"]
        out[f"{b}img_mlp.2.weight"] = sd[f"{d}ff.linear_out.weight"]
        out[f"{b}txt_mlp.0.weight"] = sd[f"{d}ff_context.linear_in.weight"]
        out[f"{b}txt_mlp.2.weight"] = sd[f"{d}ff_context.linear_out.weight"]
    for i in range(bfl_names.count(sd, "single_transformer_blocks")):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out[f"{b}linear1.weight"] = sd[f"{d}attn.to_qkv_mlp_proj.weight"]
        out[f"{b}linear2.weight"] = sd[f"{d}attn.to_out.weight"]
        out[f"{b}norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
    return bfl_names.same_size(out, sd)
