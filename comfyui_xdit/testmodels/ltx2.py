"""The tiny LTX-2 diffusers folders, built offline (`tiny-model --arch ltx2 [--variant V]`):

- "t2v" (default): LTX2Pipeline, text-to-video with its sound track.
- "i2v": the same parts, saved for LTX2ImageToVideoPipeline (a start frame).

Parts, each small and seeded (seed * 1000 + salt: a rebuild is byte-identical):
LTX2VideoTransformer3DModel (`depth` blocks; video `heads` x width/heads, audio `heads` x
half that, as the release's 32 x 128 / 32 x 64; 128 input channels for the video and the
audio alike, as released: 8 audio channels x 16 latent mel bins), a Gemma 3
(`Gemma3ForConditionalGeneration`: a 2-layer text model and a 1-layer SigLIP tower) over a
byte-level BPE made in memory (left padding, as the pipeline asks of Gemma's),
LTX2TextConnectors (2 learnable registers), AutoencoderKLLTX2Video (32x in space, 8x in
time, 128 latent channels, as the real one, at small widths), AutoencoderKLLTX2Audio (8
channels, 64 mel bins / 4 = 16 latent bins, 4x in time), LTX2Vocoder (small widths, 24
kHz), FlowMatch Euler with the release's dynamic shift.
"""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import parts
from comfyui_xdit.testmodels.text import _WORDS, _byte_level_bpe, _seeded

_family = bridge.family_module("ltx2")

VARIANTS: tuple[str, ...] = ("t2v", "i2v")
VARIANT_HELP = "LTX-2: t2v (default; text-to-video with sound) or i2v (image-to-video with sound)"

# the family-wide tests' small request (tests/family_requests.py): 64 x 96 pixels is 2 x 3
# latent pixels a frame, 9 frames 2 latent frames: 12 video tokens; 9 frames at 24 fps are
# round(9 / 24 * 25) = 9 audio tokens: neither splits evenly over 2 or 4 ranks
TEST_REQUEST = dict(size=(64, 96), frames=9, msl=16)
# the conformance suite's extra guidance (tests/conformance/test_extra_guidance.py): every
# pass on (STG on the tiny transformer's second block), and CFG with STG alone (three
# passes, which two cfg ranks split unevenly)
EXTRA_GUIDANCE = ({"stg_scale": 1.0, "stg_blocks": [1], "modality_scale": 3.0,
                   "guidance_rescale": 0.7, "audio_cfg": 4.0},
                  {"stg_scale": 1.0, "stg_blocks": [1]})
# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_ltx2.py::test_one_rank_equals_the_pipeline"
# the single-process oracle of PipeFusion's stale-K/V schedule (its video and its sound) that
# the conformance suite holds pipelined PipeFusion to; it takes the suite's request as is
PIPEFUSION_ORACLE = dict(oracle="test_ltx2:pipelined_oracle", request={})

GEMMA_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  max_position_embeddings=512, sliding_window=64,
                  rope_parameters={"full_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0}})
GEMMA_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, image_size=16, patch_size=8)
VIDEO_VAE = dict(block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(16, 32, 64),
                 layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                 spatio_temporal_scaling=(True, True, True, True),
                 decoder_spatio_temporal_scaling=(True, True, True),
                 decoder_inject_noise=(False, False, False, False),
                 upsample_residual=(True, True, True), upsample_factor=(2, 2, 2),
                 spatial_compression_ratio=32, temporal_compression_ratio=8)
AUDIO_VAE = dict(base_channels=128, ch_mult=(1, 1, 1), num_res_blocks=1, resolution=64,
                 mel_bins=64, sample_rate=16000, mel_hop_length=160)
VOCODER = dict(hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
               resnet_kernel_sizes=[3], resnet_dilations=[[1]], output_sampling_rate=24000)
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def check(cfg: dict) -> None:
    hd = parts.head_dim(cfg)
    parts.require_head_dim(cfg, hd % 4 == 0 and hd >= 8,
                           "a head dim >= 8, a multiple of 4 (the audio heads are half as wide)")
    parts.refuse_knobs(cfg)


def _tokenizer():
    """A byte-level BPE whose every prompt word is one token, left-padded as Gemma's. Saved
    as a PreTrainedTokenizerFast: transformers' GemmaTokenizer rebuilds its own model from
    the vocabulary when loaded (SentencePiece-style pieces), which a byte-level BPE is not."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(_byte_level_bpe(list(_WORDS), ()).to_str())
    vocab = spec["model"]["vocab"]
    for s in SPECIALS:
        vocab.setdefault(s, len(vocab))
    spec["model"]["unk_token"] = "<unk>"
    bpe = Tokenizer.from_str(json.dumps(spec))
    bpe.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe,
                             pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                             unk_token="<unk>", padding_side="left",
                             model_max_length=GEMMA_TEXT["max_position_embeddings"])
    return tok


def _text_encoder(seed: int, tok):
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)

    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    text = Gemma3TextConfig(vocab_size=len(tok), pad_token_id=ids["<pad>"],
                            eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"], **GEMMA_TEXT)
    config = Gemma3Config(text_config=text.to_dict(),
                          vision_config=SiglipVisionConfig(**GEMMA_VISION).to_dict(),
                          mm_tokens_per_image=4, image_token_index=ids["<unk>"])
    return _seeded(seed, 1, Gemma3ForConditionalGeneration, config).eval()


def transformer_kwargs(cfg: dict) -> dict:
    heads, width = cfg["heads"], cfg["width"]
    return dict(in_channels=_family.CHANNELS, out_channels=_family.CHANNELS,
                num_attention_heads=heads, attention_head_dim=width // heads,
                cross_attention_dim=width, audio_in_channels=_family.CHANNELS,
                audio_out_channels=_family.CHANNELS, audio_num_attention_heads=heads,
                audio_attention_head_dim=width // heads // 2,
                audio_cross_attention_dim=width // 2, num_layers=cfg["depth"],
                caption_channels=GEMMA_TEXT["hidden_size"],
                audio_sampling_rate=AUDIO_VAE["sample_rate"],
                audio_hop_length=AUDIO_VAE["mel_hop_length"], rope_type="split",
                use_prompt_adaln_single=False)


def _statistics(vae, seed: int, salt: int) -> None:
    """Per-channel latent statistics of a VAE (its latents_mean / latents_std buffers), away
    from 0 and 1 so that a missed normalisation shows."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + salt)
    n = vae.latents_mean.numel()
    vae.latents_mean.copy_(0.2 * torch.randn(n, generator=gen))
    vae.latents_std.copy_(0.5 + torch.rand(n, generator=gen))


def build_pipeline(cfg: dict):
    """The tiny LTX-2 pipeline in memory for a tiny_model.resolve_config `cfg`."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                           FlowMatchEulerDiscreteScheduler, LTX2ImageToVideoPipeline,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    seed, variant = cfg["seed"], cfg.get("variant") or VARIANTS[0]
    tok = _tokenizer()
    layers = GEMMA_TEXT["num_hidden_layers"] + 1  # the embeddings and every layer's states
    connectors = _seeded(
        seed, 2, LTX2TextConnectors, caption_channels=GEMMA_TEXT["hidden_size"],
        text_proj_in_factor=layers, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=GEMMA_TEXT["hidden_size"] // 2,
        video_connector_num_layers=1, video_connector_num_learnable_registers=2,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=GEMMA_TEXT["hidden_size"] // 2,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=2,
        rope_type="split")
    transformer = _seeded(seed, 3, LTX2VideoTransformer3DModel, **transformer_kwargs(cfg))
    vae = _seeded(seed, 4, AutoencoderKLLTX2Video, latent_channels=_family.CHANNELS,
                  **VIDEO_VAE)
    audio_vae = _seeded(seed, 5, AutoencoderKLLTX2Audio,
                        latent_channels=_family.AUDIO_CHANNELS, **AUDIO_VAE)
    _statistics(audio_vae, seed, 7)  # its packed tokens' (8 x 16) statistics, not 0 and 1
    _statistics(vae, seed, 8)
    vocoder = _seeded(seed, 6, LTX2Vocoder, in_channels=2 * AUDIO_VAE["mel_bins"], **VOCODER)
    sched = {k: v for k, v in _family.SCHEDULER.items() if k != "_class_name"}
    cls = LTX2ImageToVideoPipeline if variant == "i2v" else LTX2Pipeline
    return cls(scheduler=FlowMatchEulerDiscreteScheduler(**sched), vae=vae,
               audio_vae=audio_vae, text_encoder=_text_encoder(seed, tok), tokenizer=tok,
               connectors=connectors, transformer=transformer, vocoder=vocoder)


# ---- ComfyUI's single file ----------------------------------------------------------------
# The test model a ComfyUI single file describes: the release's head widths (video 128,
# audio 64), which the loader reads a file's head counts by (its tensors give heads x width)
SINGLE_FILE_MODEL = dict(width=256, heads=2)
# diffusers' top-level modules -> the original / ComfyUI names (LTXAVModel's)
_TOP = {"proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj",
        "time_embed": "adaln_single", "audio_time_embed": "audio_adaln_single",
        "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
        "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
        "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
        "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single"}
# inside a block
_BLOCK = {"norm_q": "q_norm", "norm_k": "k_norm",
          "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
          "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio"}


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in ComfyUI's (the original LTX-2) names, what
    ComfyUI's LTXAVModel holds (without the `model.diffusion_model.` prefix)."""
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        parts[0] = _TOP.get(parts[0], parts[0])
        parts = [_BLOCK.get(p, p) for p in parts]
        out[".".join(parts)] = t
    if len(out) != len(sd):
        raise ValueError("two LTX-2 weights map to one ComfyUI name")
    return out


def single_file_metadata(config: dict, folder=None) -> dict:
    """The safetensors metadata of a ComfyUI LTX-2 file for a diffusers transformer config:
    the released files' "config" entry, whose "transformer" part ComfyUI's detection reads
    over its own guesses (it assumes 32 heads), in LTXAVModel's argument names."""
    import json
    c = config
    transformer = {
        "num_attention_heads": c["num_attention_heads"],
        "attention_head_dim": c["attention_head_dim"],
        "cross_attention_dim": c["cross_attention_dim"],
        "audio_num_attention_heads": c["audio_num_attention_heads"],
        "audio_attention_head_dim": c["audio_attention_head_dim"],
        "audio_cross_attention_dim": c["audio_cross_attention_dim"],
        "caption_channels": c["caption_channels"], "num_layers": c["num_layers"],
        "in_channels": c["in_channels"], "audio_in_channels": c["audio_in_channels"],
        "positional_embedding_theta": c.get("rope_theta", 10000.0),
        "rope_type": c.get("rope_type", "interleaved"),
        "frequencies_precision": "float64" if c.get("rope_double_precision", True)
        else "float32",
        # diffusers' coordinates: each token at the middle of its span, the first latent
        # frame causal (one pixel frame)
        "use_middle_indices_grid": True,
        "causal_temporal_positioning": int(c.get("causal_offset", 1)) == 1,
        "timestep_scale_multiplier": c.get("timestep_scale_multiplier", 1000),
        "av_ca_timestep_scale_multiplier": c.get("cross_attn_timestep_scale_multiplier",
                                                 1000)}
    connectors = _connectors_config(folder)
    if connectors is not None:  # the text connectors' sizes (ComfyUI 0.33.0's LTXAV reads)
        transformer.update(connectors)
    return {"config": json.dumps({"transformer": transformer})}


def _connectors_config(folder):
    """LTXAVModel's connector arguments for the folder's connectors, or None (no folder)."""
    import json
    import pathlib
    path = None if folder is None else pathlib.Path(folder) / "connectors" / "config.json"
    if path is None or not path.exists():
        return None
    c = json.loads(path.read_text())
    return {"connector_num_attention_heads": c["video_connector_num_attention_heads"],
            "connector_attention_head_dim": c["video_connector_attention_head_dim"],
            "connector_num_layers": c["video_connector_num_layers"],
            "audio_connector_num_attention_heads": c["audio_connector_num_attention_heads"],
            "audio_connector_attention_head_dim": c["audio_connector_attention_head_dim"]}


def single_file_extra(folder) -> dict:
    """The folder's text connectors in ComfyUI's names (0.33.0's LTXAVModel holds them
    beside the transformer, `video_embeddings_connector.` / `audio_embeddings_connector.`),
    their learnable registers tiled to the 128 rows ComfyUI's connector always has (the
    same register at every position: 128 is a multiple of the folder's count). Gemma's
    feature projection (text_proj_in) is ComfyUI's text encoder's, not written."""
    import pathlib

    from safetensors.torch import load_file
    sd = load_file(str(pathlib.Path(folder) / "connectors" / "diffusion_pytorch_model.safetensors"))
    to_comfy = {v: k for k, v in _family.COMFY_CONNECTORS.items()}
    inside = {v: k for k, v in _family.COMFY_CONNECTOR.items()}
    out = {}
    for name, t in sd.items():
        first, _, rest = name.partition(".")
        if first not in to_comfy:
            continue
        if rest == "learnable_registers":
            rows = _family.COMFY_CONNECTOR_REGISTERS
            if rows % t.shape[0]:
                raise ValueError(f"{t.shape[0]} registers do not tile ComfyUI's {rows}")
            t = t.repeat(rows // t.shape[0], 1)
        out[".".join([to_comfy[first]] + [inside.get(p, p) for p in rest.split(".")])] = t
    for name in out:  # the inverse is the loader's
        assert _family.connector_name(name) is not None, name
    return out
