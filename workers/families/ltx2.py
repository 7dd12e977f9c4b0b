"""LTX-2 (diffusers LTX2Pipeline, LTX2ImageToVideoPipeline): video with its sound track. One
transformer runs two token streams side by side, the video's (one token per latent pixel of
its 128-channel causal VAE, 32x in space, 8x in time) and the sound's (one token per latent
frame of its audio VAE: 8 channels x 16 mel bins, 25 a second). In each block each stream
attends to itself, to the prompt (Gemma 3 states through the pipeline's text connectors, one
copy per stream) and to the other stream (audio-to-video and video-to-audio, both at the
audio's head count and width, both reading the states from before that step). Both streams
are denoised with the same sigmas (FlowMatch Euler, shift from the video's token count).
CFG is the pipeline's x0-space delta, the same as cond + (g - 1)(cond - uncond) in velocity:
ComfyUI's cfg g."""
from __future__ import annotations

from . import (Blocks, CausalVAE, Classes, ComfySpec, Defaults, Detection, ExtraGuidance,
               Family, ImageToVideo, LatentSpec, Presets, SoundTrack, Text, TokenTimesteps)
from ..streams import Attention, Stream, TokenLayout
from ._shapes import numbered

CHANNELS = 128  # the video latent's (and one sound token's: 8 x 16)
AUDIO_CHANNELS = 8
AUDIO_MEL_BINS = 16  # latent mel bins (64 mel bins / 4)

# ComfyUI's LTXV latent: the VAE normalises inside its encode / decode, so the LATENT is
# model space already [B, 128, (frames - 1) / 8 + 1, H/32, W/32]
LATENT = LatentSpec(channels=CHANNELS, downscale=32, tokens="in_model", token_side=1,
                    norm="scale_shift", frames=True, video=True, time_downscale=8,
                    comfy_format="LTXV",
                    wrong_channels="LTX-2 uses 128, as [batch, 128, (frames - 1) / 8 + 1, "
                                   "height/32, width/32] (EmptyLTXVLatentVideo)")

# 16 kHz mel frames, hop 160, 4x in time: 25 latent frames a second; the vocoder's 24 kHz
SOUND = SoundTrack(channels=AUDIO_CHANNELS, mel_bins=AUDIO_MEL_BINS, latents_per_second=25.0,
                   fps=24.0, sample_rate=24000, comfy_format="LTXAV")

# FlowMatch Euler with the resolution-dependent shift LTX2Pipeline computes from the video's
# token count (mu between base_shift at 1024 tokens and max_shift at 4096)
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
             "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.95,
             "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096,
             "time_shift_type": "exponential"}

# LTX2Pipeline's guidance_scale default (diffusers 0.42.1)
CFG = 3.0

# LTX2Pipeline's extra guidance, each step (workers/models/ltx2.py runs it): spatio-temporal
# guidance (STG: a pass whose listed blocks skip their video and audio self-attention, the
# values standing for it) and modality guidance (a pass with the audio-to-video and
# video-to-audio cross-attention off), both with the positive prompt, combined with CFG in
# x0 space per stream, then rescaled toward the conditional x0's spread. Unset: off (what
# ComfyUI's cfg-only samplers run); LTX2Pipeline's own defaults are stg 1 on [29] (LTX-2.0),
# modality 3, rescale 0.7, audio cfg 7. The audio settings unset take the video's.
GUIDANCE = {
    "stg_scale": (0.0, "spatio-temporal guidance scale (0: off; needs stg_blocks)"),
    "stg_blocks": ((), "the blocks whose self-attention the STG pass skips ([29] for LTX-2.0)"),
    "modality_scale": (1.0, "modality guidance scale (1: off): a pass with the audio-video "
                            "cross-attention off"),
    "guidance_rescale": (0.0, "guided x0 rescaled toward the conditional x0's std, 0..1 "
                              "(0: off)"),
    "audio_cfg": (None, "the sound's CFG scale (unset: cfg)"),
    "audio_stg_scale": (None, "the sound's STG scale (unset: stg_scale)"),
    "audio_modality_scale": (None, "the sound's modality scale (unset: modality_scale)"),
    "audio_guidance_rescale": (None, "the sound's rescale (unset: guidance_rescale)"),
}


def guidance_values(given: dict, cfg: float) -> dict:
    """Every extra-guidance setting made concrete (the audio ones from the video's)."""
    v = {k: d for k, (d, _) in GUIDANCE.items()}
    v.update({k: x for k, x in (given or {}).items() if x is not None})
    v["audio_cfg"] = float(cfg) if v["audio_cfg"] is None else v["audio_cfg"]
    for name in ("stg_scale", "modality_scale", "guidance_rescale"):
        if v["audio_" + name] is None:
            v["audio_" + name] = v[name]
    v["stg_blocks"] = tuple(int(b) for b in v["stg_blocks"])
    return v


def guidance_passes(given: dict, cfg: float) -> tuple:
    """The step's passes as LTX2Pipeline runs them: uncond (CFG on either stream), cond, then
    STG and modality as their scales turn them on."""
    v = guidance_values(given, cfg)
    return tuple(n for n, on in (("uncond", max(float(cfg), v["audio_cfg"]) > 1.0),
                                 ("cond", True),
                                 ("stg", v["stg_scale"] > 0 or v["audio_stg_scale"] > 0),
                                 ("modality", v["modality_scale"] > 1
                                  or v["audio_modality_scale"] > 1)) if on)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def guidance_problems(given: dict, cfg, blocks) -> list:
    """One line per bad extra-guidance setting (`blocks`: the transformer's block count, or
    None where unknown)."""
    out = []
    bounds = {"stg_scale": (0.0, None), "audio_stg_scale": (0.0, None),
              "modality_scale": (1.0, None), "audio_modality_scale": (1.0, None),
              "audio_cfg": (1.0, None), "guidance_rescale": (0.0, 1.0),
              "audio_guidance_rescale": (0.0, 1.0)}
    for name, (lo, hi) in bounds.items():
        x = given.get(name)
        if x is None:
            continue
        if not _number(x) or x < lo or (hi is not None and x > hi):
            want = f"in {lo:g}..{hi:g}" if hi is not None else f">= {lo:g}"
            out.append(f"extra_guidance {name} must be a number {want} (got {x!r})")
    blk = given.get("stg_blocks")
    if blk is not None:
        if isinstance(blk, (str, bytes)) or not hasattr(blk, "__iter__") or \
                not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blk):
            out.append(f"extra_guidance stg_blocks must be a list of block indices >= 0 "
                       f"(got {blk!r})")
        elif blocks is not None and any(b >= blocks for b in blk):
            out.append(f"extra_guidance stg_blocks {list(blk)}: this transformer has blocks "
                       f"0..{blocks - 1}")
    if not out:
        v = guidance_values(given, cfg or 1.0)
        if (v["stg_scale"] > 0 or v["audio_stg_scale"] > 0) and not v["stg_blocks"]:
            out.append("extra_guidance stg_scale > 0 needs stg_blocks (the blocks the STG "
                       "pass skips, e.g. [29] for LTX-2.0)")
    return out

TOKENS = TokenLayout(
    streams=(Stream("video", "latent"),            # sharded over the sp ranks
             # whole on every rank: measured, it moves less than sharding it (its
             # self-attention and audio-to-video need no exchange; docs/models.md#ltx-2-video-with-its-sound)
             Stream("audio", "context", "replicate", denoised=True, length=SOUND.length),
             Stream("text", "text", "replicate")),  # whole on every rank: cross-attention only
    attentions=(Attention(("video",)), Attention(("audio",)),
                Attention(("video",), ("text",)), Attention(("audio",), ("text",)),
                Attention(("video",), ("audio",)), Attention(("audio",), ("video",))))


# a row's video [128, frames, h, w] has a token per latent pixel (frame by frame), its sound
# [8, latent frames, 16] one per latent frame
TOKEN_TIMESTEPS = TokenTimesteps(token_axes=((1, 2, 3), (1,)),
                                 patchifiers=(("patchifier", 0), ("a_patchifier", 1)),
                                 mask_inputs=("denoise_mask", "audio_denoise_mask"),
                                 # ComfyUI 0.33.0's LTXAV (comfy_model_inputs)
                                 variants=(("comfyui-0.33", {"v2a_after_a2v": 1.0,
                                                             "cross_gate_other_max": 1.0}),))


# ComfyUI's (the original LTX-2) top-level names -> diffusers'; in the blocks, COMFY_BLOCK's
COMFY_TOP = {"patchify_proj": "proj_in", "audio_patchify_proj": "audio_proj_in",
             "adaln_single": "time_embed", "audio_adaln_single": "audio_time_embed",
             "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
             "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
             "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
             "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate"}
COMFY_BLOCK = {"q_norm": "norm_q", "k_norm": "norm_k",
               "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
               "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table"}


def diffusers_name(name: str) -> str:
    """A tensor's name in ComfyUI's LTX-2 files -> diffusers' (pure renames)."""
    parts = name.split(".")
    parts[0] = COMFY_TOP.get(parts[0], parts[0])
    return ".".join(COMFY_BLOCK.get(p, p) for p in parts)


# ComfyUI's (the original LTX-2) text connectors, which its LTXAV holds in the diffusion
# model from 0.33.0 on (0.8.0's text encoder holds them) -> diffusers' LTX2TextConnectors
# parts; inside them, COMFY_CONNECTOR's renames. Gemma's feature projection before them
# (text_proj_in) is the text encoder's in ComfyUI
COMFY_CONNECTORS = {"video_embeddings_connector": "video_connector",
                    "audio_embeddings_connector": "audio_connector"}
COMFY_CONNECTOR = {"transformer_1d_blocks": "transformer_blocks", "q_norm": "norm_q",
                   "k_norm": "norm_k"}
# what ComfyUI's connectors take when its file's "config" metadata does not say (LTXAVModel's
# defaults: the release's), and the register count its Embeddings1DConnector always builds
COMFY_CONNECTOR_DEFAULTS = {"connector_num_attention_heads": 30,
                            "connector_attention_head_dim": 128, "rope_type": "split"}
COMFY_CONNECTOR_REGISTERS = 128
# ComfyUI pads a prompt to at least this many tokens with the connectors' registers
COMFY_CONNECTOR_MIN_TOKENS = 1024


def connector_name(name: str):
    """A tensor's name in ComfyUI's LTX-2 files -> ("video_connector" | "audio_connector",
    its name inside diffusers' LTX2ConnectorTransformer1d), or None: not a connector's."""
    first, _, rest = name.partition(".")
    part = COMFY_CONNECTORS.get(first)
    if part is None:
        return None
    return part, ".".join(COMFY_CONNECTOR.get(p, p) for p in rest.split("."))


def comfy_block_order() -> dict:
    """{"v2a_after_a2v": 1.0 or 0.0}: whether the running ComfyUI's LTXAV blocks feed their
    video-to-audio attention the video after the audio-to-video update (0.33.0) or, as
    diffusers' and Lightricks' own (and 0.8.0's), from before it. Found by running one
    tiny block of ComfyUI's (random weights) twice, the second time with its audio-to-video
    output projection zeroed: the sound's output moves only in the former order. In
    ComfyUI's process only (imports ComfyUI)."""
    import torch
    import comfy.ops
    from comfy.ldm.lightricks.av_model import BasicAVTransformerBlock

    d, gen = 8, torch.Generator().manual_seed(0)
    try:
        block = BasicAVTransformerBlock(v_dim=d, a_dim=d, v_heads=1, a_heads=1, vd_head=d,
                                        ad_head=d, v_context_dim=d, a_context_dim=d,
                                        operations=comfy.ops.disable_weight_init)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))

        def sound():  # the same inputs each time
            inputs = torch.Generator().manual_seed(1)

            def r(*shape):
                return torch.randn(*shape, generator=inputs)
            with torch.no_grad():
                return block((r(1, 3, d), r(1, 2, d)), v_context=r(1, 2, d),
                             a_context=r(1, 2, d), v_timestep=r(1, 1, 6 * d),
                             a_timestep=r(1, 1, 6 * d),
                             v_cross_scale_shift_timestep=r(1, 1, 4 * d),
                             a_cross_scale_shift_timestep=r(1, 1, 4 * d),
                             v_cross_gate_timestep=r(1, 1, d),
                             a_cross_gate_timestep=r(1, 1, d), transformer_options={})[1]
        before = sound()
        with torch.no_grad():
            out = block.audio_to_video_attn.to_out[0]
            out.weight.zero_()
            out.bias.zero_()
        moved = float((sound() - before).abs().max())
    except Exception as e:  # noqa: BLE001  (another ComfyUI's block signature)
        raise ValueError(f"cannot tell this ComfyUI's LTX-2 block order ({e})") from None
    return {"v2a_after_a2v": 1.0 if moved > 1e-6 else 0.0}


def comfy_cross_gates() -> dict:
    """{"cross_gate_other_max": 1.0 or 0.0}: whether the running ComfyUI's LTXAV gates each
    stream's audio-video cross-attention by the other stream's largest timestep (0.33.0)
    or, as 0.8.0's, by the stream's own tokens' timesteps. Equal where every token has its
    row's timestep; they part with a timestep per token (a noise mask). Found by running
    ComfyUI's own timestep preparation with recording stand-ins for its embedders on one
    row of three video and two sound timesteps, and reading what the gate embedders got.
    In ComfyUI's process only (imports ComfyUI)."""
    import types
    import torch
    from comfy.ldm.lightricks.av_model import LTXAVModel

    seen: dict = {}

    def recorder(name):
        def embed(x, *args, **kwargs):
            seen[name] = x.detach().float().reshape(-1).clone()
            y = x.detach().float().reshape(-1, 1)
            return y, y
        return embed
    names = ("adaln_single", "audio_adaln_single", "av_ca_audio_scale_shift_adaln_single",
             "av_ca_video_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single",
             "av_ca_v2a_gate_adaln_single")
    stand_in = types.SimpleNamespace(timestep_scale_multiplier=1000.0,
                                     av_ca_timestep_scale_multiplier=1.0,
                                     prompt_adaln_single=None, audio_prompt_adaln_single=None,
                                     **{n: recorder(n) for n in names})
    video, audio = torch.tensor([[0.0, 0.6, 0.6]]), torch.tensor([[0.3, 0.4]])
    try:
        LTXAVModel._prepare_timestep(stand_in, video, 1, torch.float32, a_timestep=audio)
        a2v, v2a = seen["av_ca_a2v_gate_adaln_single"], seen["av_ca_v2a_gate_adaln_single"]
    except Exception as e:  # noqa: BLE001  (another ComfyUI's timestep preparation)
        raise ValueError(f"cannot tell how this ComfyUI's LTX-2 gates its audio-video "
                         f"attention ({e})") from None
    if torch.allclose(a2v, video[0]) and torch.allclose(v2a, audio[0]):
        return {"cross_gate_other_max": 0.0}
    if torch.allclose(a2v, audio.max().expand(3)) and torch.allclose(v2a, video.max().expand(2)):
        return {"cross_gate_other_max": 1.0}
    raise ValueError(f"this ComfyUI's LTX-2 gates its audio-video attention by timesteps the "
                     f"xDiT MODEL does not know (video {a2v.tolist()}, sound {v2a.tolist()} "
                     f"for video {video[0].tolist()}, sound {audio[0].tolist()})")


def comfy_model_inputs() -> dict:
    """The running ComfyUI's LTXAV's own ways (`ComfySpec.model_inputs`): its blocks' order
    and its audio-video gates' timesteps."""
    return {**comfy_block_order(), **comfy_cross_gates()}


def config_from_shapes(shapes: dict, naming: str) -> dict:
    """The diffusers config of an LTX-2 (2.0) transformer file, diffusers' naming or
    ComfyUI's ("bfl" here), from its weight shapes; the head widths are the release's (video
    128, audio 64): a file's shapes give only heads x width. The text widths come from the
    cross-attention keys, RoPE is the release's (split halves, double precision)."""
    if naming != "diffusers":
        shapes = {diffusers_name(k): v for k, v in shapes.items()}
    inner, in_ch = (int(n) for n in shapes["proj_in.weight"])
    audio_inner, audio_in = (int(n) for n in shapes["audio_proj_in.weight"])
    blocks = numbered(shapes, "transformer_blocks.", "transformer")
    return {"in_channels": in_ch, "out_channels": int(shapes["proj_out.weight"][0]),
            "num_attention_heads": inner // 128, "attention_head_dim": 128,
            "cross_attention_dim": int(shapes["transformer_blocks.0.attn2.to_k.weight"][1]),
            "audio_in_channels": audio_in,
            "audio_out_channels": int(shapes["audio_proj_out.weight"][0]),
            "audio_num_attention_heads": audio_inner // 64, "audio_attention_head_dim": 64,
            "audio_cross_attention_dim":
                int(shapes["transformer_blocks.0.audio_attn2.to_k.weight"][1]),
            "num_layers": len(blocks), "rope_type": "split",
            "use_prompt_adaln_single": "prompt_adaln.linear.weight" in shapes,
            "caption_channels": int(shapes["caption_projection.linear_1.weight"][1])}


def image_to_video(cfg: dict) -> tuple:
    """(a start frame: yes, optional: every LTX-2 transformer takes one, as the clean first
    latent frame at timestep 0, or none; CLIP vision states: none)."""
    return True, False


def released(config: dict) -> tuple:
    """A single file's scheduler and VAE latent config: the LATENT is model space."""
    return dict(SCHEDULER), {"scaling_factor": 1.0, "latent_channels": CHANNELS}


# Published dimensions (diffusers' LTX2VideoTransformer3DModel defaults are the release's:
# 48 blocks, video 32 x 128, audio 32 x 64, 19B with its Gemma 3 12B)
GEMMA3_12B = {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
              "vocab_size": 262208}
PRESETS = {
    "ltx2": dict(transformer={}, text_encoders=(("Gemma3TextModel", GEMMA3_12B),),
                 vae=("AutoencoderKLLTX2Video", {}), text_tokens=1024,
                 note="LTX-2 (19B audio-video) + Gemma 3 12B"),
}


FAMILY = Family(
    id="ltx2", order=80, name="LTX-2",
    classes=Classes(transformer="LTX2VideoTransformer3DModel",
                    pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
                    adapter="LTX2Adapter", vae=("AutoencoderKLLTX2Video",)),
    blocks=Blocks(lists=("transformer_blocks",), counts=("num_layers",)),
    latent=LATENT,
    text=Text(hint="encode with LTX-2's Gemma 3 text encoder or type the prompt into the "
                   "sampler", pooled=False),
    # ComfyUI's LTXAV: its LATENT nests the video and the sound (x is [video, audio]),
    # its context is the video's and the sound's prompt states side by side, its
    # timestep sigma, and its conditioning's frame rate (LTXVConditioning; 25 without)
    # places the video's frames in time against the sound's. Its text states come in two
    # kinds, told apart by their width: after the text connectors (two x caption_channels:
    # 0.8.0's text encoder runs them), or before them (caption_channels: 0.33.0's text
    # encoder leaves them to the LTXAV model, which runs the file's own connectors; so does
    # the pool, workers/models/ltx2_connectors.py)
    comfy=ComfySpec(base=lambda unet: "LTXAV", config=lambda unet: "LTXAV",
                    timestep_scale=1000.0, latent_parts=("video", "audio"),
                    call_inputs=(("frame_rate", 25.0),), context_streams=2,
                    raw_context_width=lambda cfg: int(cfg["caption_channels"]),
                    # ComfyUI 0.33.0 reordered its blocks' audio-video attentions and gates
                    # them by the other stream's largest timestep; the pool runs the ways of
                    # the ComfyUI it serves (workers/models/ltx2_block_order.py,
                    # ltx2_cross_gates.py)
                    model_inputs=comfy_model_inputs),
    defaults=Defaults(cfg=CFG),
    detection=Detection(markers=(("diffusers", ("audio_proj_in.weight",
                                                "av_cross_attn_video_scale_shift.linear.weight")),
                                 ("bfl", ("audio_patchify_proj.weight",
                                          "av_ca_a2v_gate_adaln_single.linear.weight"))),
                        config_from_shapes=config_from_shapes, released=released, order=60,
                        config_names={"text_width": "caption_channels"}),
    tokens=TOKENS,
    capabilities=(SOUND, ImageToVideo(inputs=image_to_video, optional=True),
                  # ComfyUI's LTXAV: a noise mask on the AV LATENT (LTXVImgToVideo's start
                  # frame) becomes a timestep per video token and per sound token (its
                  # process_timestep, through the video's and the sound's patchifiers)
                  TOKEN_TIMESTEPS,
                  ExtraGuidance(settings=GUIDANCE, problems=guidance_problems,
                                passes=guidance_passes),
                  CausalVAE(whole_video=True, one_rank=True),
                  Presets(PRESETS)),
)
