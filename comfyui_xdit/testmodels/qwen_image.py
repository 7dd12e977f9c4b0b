"""The tiny Qwen-Image (and Qwen-Image-Edit) diffusers folder, built offline
(`tiny-model --arch qwen_image`; Edit: `build_pipeline(cfg, edit=True)` or `--variant edit`;
Edit 2509: `--variant edit-plus`, QwenImageEditPlusPipeline over the same components; Edit
2511: `--variant edit-2511`, the same with the transformer's `zero_cond_t`, which adds no
weight: its folder's weights equal edit-plus's).

- transformer: QwenImageTransformer2DModel, `depth` blocks, `heads` x width/heads, RoPE axes
  split like the released (16, 56, 56) (workers/families/qwen_image.rope_axes).
- text_encoder: Qwen2_5_VLForConditionalGeneration, text width 32, 1 layer (the pipelines read
  the last hidden state), a 1-block vision tower (only Edit runs it).
- tokenizer: byte-level BPE in Qwen2's layout where every word of both pipelines' system
  templates is ONE token, so the template prefix is exactly as long as with the real Qwen2.5
  tokenizer (34 tokens for Qwen-Image, 64 for Edit: the pipelines' hard-coded drops). The
  first kept token is the user's first word, so different prompts encode differently at any
  max_sequence_length.
- processor (Edit only): Qwen2VLProcessor without its video processor (transformers 5 builds
  that only with torchvision): `patch_processor_without_video()` runs first, in every process
  that builds or loads an Edit folder.
- vae: AutoencoderKLQwenImage, base_dim 8, 3 temporal-downsample entries (8x spatial), the
  released latents_mean / latents_std (diffusers' defaults, ComfyUI's latent_formats.Wan21).
- scheduler: the released Qwen/Qwen-Image scheduler (workers/families/qwen_image.SCHEDULER).

Weights are seeded per component (seed * 1000 + salt): a rebuild is byte-identical.
"""

from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _bpe, _bytes_to_unicode, _seeded

_family = bridge.family_module("qwen_image")

VARIANTS: tuple[str, ...] = ("t2i", "edit", "edit-plus", "edit-2511")
VARIANT_HELP = ("Qwen-Image: t2i (default; QwenImagePipeline), edit (QwenImageEditPipeline, "
                "one reference image), edit-plus (QwenImageEditPlusPipeline, 2509: several) "
                "or edit-2511 (the same, zero_cond_t: references at timestep 0)")

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
            # multimodal RoPE: sections (t, h, w) sum to the text head_dim / 2 = 8
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [2, 3, 3]})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112,
              fullatt_block_indexes=[0])
VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True])
# The Edit processor resizes the prompt image to at most this many pixels (real: 28*28*1280).
PROCESSOR_MAX_PIXELS = 56 * 56

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")

# Every word of the two system templates (one token each, like the real vocab) ...
TEMPLATE_WORDS = """system user assistant Describe the image by detailing color shape size texture
quantity text spatial relationships of objects and background key features input then explain how
instruction should alter or modify Generate new that meets requirements while maintaining
consistency with original where appropriate""".split()
# ... plus a prompt vocabulary (anything else still tokenizes byte by byte).
PROMPT_WORDS = """a an in on at with of cat dog bird fish horse fox owl man woman robot house tree
forest mountain river lake sea sky cloud sun moon star night day city street car boat castle garden
flower field road red green blue yellow orange purple pink black white gray gold silver big small
old young happy dark bright photo painting drawing sketch oil watercolor detailed cinematic sunset
snow rain fog sitting standing running flying hat glasses""".split()
# (" (" and "'s" are single tokens in Qwen2.5's vocab too)
EXTRA_PIECES = (" (", "'s", "),", ".<")


# the family-wide tests' small request (tests/family_requests.py)
TEST_REQUEST = dict(msl=64, padded=True)  # the template drop needs a longer text
# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_qwen_image.py::test_one_rank_equals_the_pipeline"
# PipeFusion's stale-K/V oracle for the conformance suite (tests/conformance/test_pipefusion.py):
# the test module's factory of the model folder, and the request fields it needs
# (prompts of one token length: the oracle runs no text mask)
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_reference:QwenImageReference",
                         request=dict(prompt=["a red cat", "a blue dog"],
                                      negative_prompt="ugly dark"))
# the LoRA file formats the conformance suite writes for it beside diffusers/PEFT's: ComfyUI's
# `diffusion_model.<layer>.lora_down / lora_up / alpha` under diffusers' layer names
LORA_FORMATS = ("peft", "comfy")

def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 2 == 0 and hd >= 6, "an even head dim >= 6 for its 3 RoPE axes")
    parts.refuse_knobs(cfg)


def _word_bpe():
    """A `tokenizers.Tokenizer`: 256 byte symbols, then merges that make each word (bare and
    with a leading space) a single token, then the Qwen special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(byte.values())}
    ranks: dict[tuple[str, str], int] = {}
    pieces = [w for word in TEMPLATE_WORDS + PROMPT_WORDS for w in (word, " " + word)]
    for piece in dict.fromkeys(pieces + list(EXTRA_PIECES)):  # dedupe, keep order
        # Split with the merges so far, then chain new merges over the pieces. New merges rank
        # after all earlier ones, so they never change how an earlier word is merged.
        split = _bpe([byte[b] for b in piece.encode()], ranks)
        cur = split[0]
        for part in split[1:]:
            ranks.setdefault((cur, part), len(ranks))
            cur += part
            vocab.setdefault(cur, len(vocab))
    merges = sorted(ranks, key=ranks.get)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def _tokenizer():
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast(tokenizer_object=_word_bpe(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, model_max_length=TEXT["max_position_embeddings"])


def patch_processor_without_video() -> None:
    """Make Qwen2VLProcessor a (image_processor, tokenizer) processor. transformers 5 lists
    processor parts from the __init__ signature and would build/load a video processor, which
    needs torchvision. Idempotent; call it in every process that builds or loads an Edit folder."""
    from transformers import Qwen2VLProcessor

    Qwen2VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])


def build_pipeline(cfg: dict, edit: bool = False):
    """The tiny pipeline (QwenImagePipeline, QwenImageEditPipeline or
    QwenImageEditPlusPipeline) in memory, for a tiny_model.resolve_config `cfg` (seed, depth,
    width, heads, variant); `edit` is the edit variant; the Edit pipelines add the
    processor. The default folder's bytes and cache key are those from before variants."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    seed = cfg["seed"]
    variant = cfg.get("variant") or ("edit" if edit else VARIANTS[0])
    extra = {"zero_cond_t": True} if variant == "edit-2511" else {}
    tokenizer = _tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIALS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], **TEXT),
        vision_config=dict(out_hidden_size=TEXT["hidden_size"], **VISION),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    text_encoder = _seeded(seed, 1, Qwen2_5_VLForConditionalGeneration, config).eval()
    head_dim = cfg["width"] // cfg["heads"]
    transformer = _seeded(seed, 3, QwenImageTransformer2DModel, patch_size=2, in_channels=64,
                          out_channels=16, num_layers=cfg["depth"], attention_head_dim=head_dim,
                          num_attention_heads=cfg["heads"], joint_attention_dim=TEXT["hidden_size"],
                          axes_dims_rope=tuple(_family.rope_axes(head_dim)), **extra)
    vae = _seeded(seed, 4, AutoencoderKLQwenImage, **VAE)
    scheduler = FlowMatchEulerDiscreteScheduler(**_family.SCHEDULER)
    components = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer)
    if variant == "t2i":
        return QwenImagePipeline(**components)
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    patch_processor_without_video()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=PROCESSOR_MAX_PIXELS,
                                               patch_size=14, temporal_patch_size=2, merge_size=2)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    pipeline = QwenImageEditPipeline if variant == "edit" else QwenImageEditPlusPipeline
    return pipeline(processor=processor, **components)


def single_file(sd: dict) -> dict:
    """The transformer's state dict as ComfyUI's Qwen-Image files keep it: diffusers' own
    names (split_files/diffusion_models), for the conformance suite's single-file theme."""
    return dict(sd)
