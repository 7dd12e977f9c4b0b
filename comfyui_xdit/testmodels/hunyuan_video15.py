"""The tiny HunyuanVideo 1.5 diffusers folders, built offline (`tiny-model --arch
hunyuan_video15 [--variant V]`):

- "t2v" (default): HunyuanVideo15Pipeline, text-to-video (transformer task_type "t2v").
- "i2v": HunyuanVideo15ImageToVideoPipeline, image-to-video (task_type "i2v"), with a tiny
  SigLIP vision tower and its image processor (PIL backend: torchvision is absent). Its
  target_size (the pipeline sizes the video from the image's aspect ratio) is 64 pixels.

Parts: HunyuanVideo15Transformer3DModel (`depth` dual-stream blocks, `heads` x width/heads,
patch 1, 65 input channels, RoPE axes split like the released (16, 56, 56):
workers/families/hunyuan_video15.rope_axes), a Qwen2_5_VLTextModel (3 layers: the pipeline
reads hidden_states[-3]) over a byte-level BPE in Qwen2's layout whose chat template encodes
the pipeline's system prompt to exactly the 108 tokens it drops (every piece of the template,
as Qwen2's pre-tokenizer splits it, is one token: the real tokenizer's count too), a ByT5
glyph encoder (ByT5Tokenizer, a small T5EncoderModel), an AutoencoderKLHunyuanVideo15 with 5
levels of small widths (16x in space, 4x in time, 32 latent channels, as the real one) and
the released scaling factor, FlowMatch Euler at shift 7, ClassifierFreeGuidance at 6.
Weights are seeded per component (seed * 1000 + salt): a rebuild is byte-identical.
"""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _WORDS, _bpe, _bytes_to_unicode, _seeded

_family = bridge.family_module("hunyuan_video15")

VARIANTS: tuple[str, ...] = ("t2v", "i2v")

# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_hunyuan_video15.py::test_one_rank_equals_the_pipeline"
# PipeFusion's stale-K/V oracle (the conformance suite's PipeFusion theme)
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_video_reference:hunyuan_video15_oracle",
                         request={})
# layers outside the blocks the conformance suite's LoRA reaches too: the text refiner's
LORA_LAYERS = ("context_embedder.token_refiner.",)
VARIANT_HELP = ("HunyuanVideo 1.5: t2v (default; text-to-video) or i2v (image-to-video, with a "
                "SigLIP image encoder)")

# the pipelines' Qwen prompt: 108 template tokens dropped, then 1000 prompt tokens
TEMPLATE_TOKENS = 108
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
            # multimodal RoPE: sections (t, h, w) sum to the text head_dim / 2 = 8
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [2, 3, 3]})
BYT5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
# (24 / 4)^2 = 36 image tokens (the released SigLIP gives 729)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=24, patch_size=4)
VAE = dict(block_out_channels=(16, 16, 32, 64, 64), layers_per_block=1,
           spatial_compression_ratio=16, temporal_compression_ratio=4)
I2V_TARGET_SIZE = 64

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace (the real tokenizer's split, so the template counts
# as many pieces as there)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 2 == 0 and hd >= 8, "an even head dim >= 8 for its 3 RoPE axes")
    parts.refuse_knobs(cfg)


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _system() -> str:
    """The pipelines' system message (their prompt encoder's default)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline
    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters[
        "system_message"].default


def _template_text() -> str:
    """The chat template's text before the user's prompt, as the pipeline fills it."""
    return f"system\n{_system()}<|im_end|>\n<|im_start|>user\n"


def _word_bpe():
    """A `tokenizers.Tokenizer`: 256 byte symbols, merges making each pre-token piece of the
    template and each prompt word (bare and after a space) one token, the special tokens."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    ranks: dict[tuple[str, str], int] = {}
    pre = _pre_tokenizer()
    texts = _template_text().replace("<|im_start|>", "<|im_end|>").split("<|im_end|>")
    texts += ["assistant\n"] + [w for word in _WORDS for w in (word, " " + word)]
    pieces = [p for text in texts for p, _ in pre.pre_tokenize_str(text)]
    for piece in dict.fromkeys(pieces):  # dedupe, keep order
        # merge the first two symbols BPE leaves until one is left; each new merge ranks
        # after every earlier one, so no earlier piece splits differently
        split = _bpe(list(piece), ranks)
        while len(split) > 1:
            ranks[(split[0], split[1])] = len(ranks)
            vocab.setdefault(split[0] + split[1], len(vocab))
            split = _bpe(list(piece), ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=sorted(ranks, key=ranks.get)))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def _tokenizer():
    from transformers import Qwen2TokenizerFast

    tok = Qwen2TokenizerFast(tokenizer_object=_word_bpe(), eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", unk_token=None,
                             model_max_length=TEXT["max_position_embeddings"])
    tok.chat_template = CHAT_TEMPLATE
    prefix = tok.apply_chat_template(
        [{"role": "system", "content": _system()},
         {"role": "user", "content": "cat"}], tokenize=True, return_dict=True)["input_ids"]
    cat = tok.convert_tokens_to_ids("cat")
    if prefix.index(cat) != TEMPLATE_TOKENS:  # the pipeline would read the wrong tokens
        raise RuntimeError(f"the tiny Qwen tokenizer puts the prompt at token "
                           f"{prefix.index(cat)}, not {TEMPLATE_TOKENS}")
    return tok


def _text_encoders(seed: int) -> dict:
    from transformers import (ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel,
                              T5Config, T5EncoderModel)

    tok = _tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    qwen = _seeded(seed, 1, Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig(
        vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], **TEXT)).eval()
    byt5_tok = ByT5Tokenizer()
    byt5 = _seeded(seed, 2, T5EncoderModel, T5Config(
        vocab_size=len(byt5_tok), feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        pad_token_id=byt5_tok.pad_token_id, eos_token_id=byt5_tok.eos_token_id,
        decoder_start_token_id=byt5_tok.pad_token_id, **BYT5)).eval()
    return dict(tokenizer=tok, text_encoder=qwen, tokenizer_2=byt5_tok, text_encoder_2=byt5)


def _image_encoder(seed: int) -> dict:
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    size = SIGLIP["image_size"]
    processor = SiglipImageProcessorPil(size={"height": size, "width": size})
    encoder = _seeded(seed, 6, SiglipVisionModel, SiglipVisionConfig(**SIGLIP)).eval()
    return dict(image_encoder=encoder, feature_extractor=processor)


def build_pipeline(cfg: dict):
    """The tiny HunyuanVideo 1.5 pipeline in memory for a tiny_model.resolve_config `cfg`."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance,
                           FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)

    seed, variant = cfg["seed"], cfg.get("variant") or VARIANTS[0]
    head_dim = cfg["width"] // cfg["heads"]
    i2v = variant == "i2v"
    transformer = _seeded(
        seed, 3, HunyuanVideo15Transformer3DModel, in_channels=2 * _family.CHANNELS + 1,
        out_channels=_family.CHANNELS, num_attention_heads=cfg["heads"],
        attention_head_dim=head_dim, num_layers=cfg["depth"], num_refiner_layers=2,
        text_embed_dim=TEXT["hidden_size"], text_embed_2_dim=BYT5["d_model"],
        image_embed_dim=SIGLIP["hidden_size"], rope_axes_dim=tuple(_family.rope_axes(head_dim)),
        target_size=I2V_TARGET_SIZE, task_type="i2v" if i2v else "t2v")
    vae = _seeded(seed, 4, AutoencoderKLHunyuanVideo15, latent_channels=_family.CHANNELS,
                  scaling_factor=_family.SCALING_FACTOR, **VAE)
    sched = {k: v for k, v in _family.SCHEDULER.items() if k != "_class_name"}
    components = dict(transformer=transformer, vae=vae,
                      scheduler=FlowMatchEulerDiscreteScheduler(**sched),
                      guider=ClassifierFreeGuidance(guidance_scale=_family.CFG),
                      **_text_encoders(seed))
    if i2v:
        return HunyuanVideo15ImageToVideoPipeline(**components, **_image_encoder(seed))
    return HunyuanVideo15Pipeline(**components)


# ---- ComfyUI's single files ------------------------------------------------------------------
# diffusers' HunyuanVideo15Transformer3DModel names -> ComfyUI's (comfy/ldm/hunyuan_video),
# written out here (not the loader's table), in order; "qkv" targets fuse three tensors
_TO_COMFY = [
    (r"^x_embedder\.proj\.", "img_in.proj."),
    (r"^time_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"^time_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"^context_embedder\.proj_in\.", "txt_in.input_embedder."),
    (r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_1\.",
     "txt_in.t_embedder.in_layer."),
    (r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_2\.",
     "txt_in.t_embedder.out_layer."),
    (r"^context_embedder\.time_text_embed\.text_embedder\.linear_1\.",
     "txt_in.c_embedder.in_layer."),
    (r"^context_embedder\.time_text_embed\.text_embedder\.linear_2\.",
     "txt_in.c_embedder.out_layer."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.norm_out\.linear\.",
     r"txt_in.individual_token_refiner.blocks.\1.adaLN_modulation.1."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.norm(1|2)\.",
     r"txt_in.individual_token_refiner.blocks.\1.norm\2."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.attn\.to_(q|k|v)\.",
     r"txt_in.individual_token_refiner.blocks.\1.self_attn.qkv.\2."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.attn\.to_out\.0\.",
     r"txt_in.individual_token_refiner.blocks.\1.self_attn.proj."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.ff\.net\.0\.proj\.",
     r"txt_in.individual_token_refiner.blocks.\1.mlp.0."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.ff\.net\.2\.",
     r"txt_in.individual_token_refiner.blocks.\1.mlp.2."),
    (r"^context_embedder_2\.norm\.", "byt5_in.layernorm."),
    (r"^context_embedder_2\.linear_(\d)\.", r"byt5_in.fc\1."),
    (r"^image_embedder\.norm_in\.", "vision_in.proj.0."),
    (r"^image_embedder\.linear_1\.", "vision_in.proj.1."),
    (r"^image_embedder\.linear_2\.", "vision_in.proj.3."),
    (r"^image_embedder\.norm_out\.", "vision_in.proj.4."),
    (r"^cond_type_embed\.", "cond_type_embedding."),
    (r"^transformer_blocks\.(\d+)\.norm1\.linear\.", r"double_blocks.\1.img_mod.lin."),
    (r"^transformer_blocks\.(\d+)\.norm1_context\.linear\.", r"double_blocks.\1.txt_mod.lin."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_(q|k|v)\.", r"double_blocks.\1.img_attn.qkv.\2."),
    (r"^transformer_blocks\.(\d+)\.attn\.add_(q|k|v)_proj\.",
     r"double_blocks.\1.txt_attn.qkv.\2."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_q\.weight$",
     r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_k\.weight$",
     r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight$",
     r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight$",
     r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"double_blocks.\1.img_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"double_blocks.\1.img_mlp.2."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj\.", r"double_blocks.\1.txt_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.2\.", r"double_blocks.\1.txt_mlp.2."),
    (r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."),  # (scale, shift) swapped
    (r"^proj_out\.", "final_layer.linear."),
]


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in ComfyUI's names (the conformance suite's
    single-file theme, and this family's own file tests): q, k, v rows fused in that order, the
    final modulation's (scale, shift) halves as ComfyUI's (shift, scale)."""
    import re

    import torch
    out, fused = {}, {}
    for name, w in sd.items():
        for pat, rep in _TO_COMFY:
            if re.match(pat, name):
                new = re.sub(pat, rep, name)
                break
        else:
            raise AssertionError(f"no ComfyUI name for {name}")
        m = re.match(r"^(.*\.qkv)\.(q|k|v)\.(weight|bias)$", new)
        if m:
            fused.setdefault(f"{m.group(1)}.{m.group(3)}", {})[m.group(2)] = w
            continue
        if name.startswith("norm_out.linear."):
            scale, shift = w.chunk(2, dim=0)
            w = torch.cat([shift, scale], dim=0)
        out[new] = w.contiguous()
    for name, qkv in fused.items():
        out[name] = torch.cat([qkv["q"], qkv["k"], qkv["v"]], 0).contiguous()
    return out
