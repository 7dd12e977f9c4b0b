"""Test helper: random-weight single files that ComfyUI's own loaders (UNETLoader) load as
the same network the pool builds from them (for native-vs-pool comparisons).

ComfyUI 0.3.64 detects a model's config from its weight shapes with some widths hard-coded
(comfy/model_detection.py):
* SD3 (MMDiT): hidden = 64 x depth, heads = depth (head dim 64), depth = the number of joint
  blocks; context / pooled widths and the pos-embed grid from the shapes. So a 2-block SD3
  with 2 heads of 64 loads as is (tiny).
* FLUX: hidden 3072, 24 heads of 128, context 4096, pooled 768, MLP ratio 4, RoPE axes
  (16, 56, 56); only the depth is read. The smallest such file is FLUX.1-wide with 1 double +
  1 single block (~0.55 B parameters), stored in bf16 (~1.1 GB): ComfyUI (CPU: fp32 unet) and
  the pool (dtype fp32) then both compute in fp32 from the same bf16 weights.
* Qwen-Image: only in_channels and the block count are read; width 3072 (24 heads of 128),
  text width 3584 and RoPE axes (16, 56, 56) are the class defaults. The smallest such file
  is the released width with 1 transformer block (~0.36 B parameters), stored in bf16
  (~0.7 GB) under diffusers' names (ComfyUI's Qwen-Image files use them too).

* FLUX.2 (ComfyUI 0.8.0; 0.3.64 has none): detected by `double_stream_modulation_img.lin.weight`
  beside FLUX's keys; fixed there: 48 heads, RoPE axes (32, 32, 32, 32) (so head dim 128, and
  6144 = 48 x 128 is the only hidden size whose model builds), theta 2000, MLP ratio 3, 128
  output channels, no biases, global modulations, 256-wide time (and guidance) inputs.
  Read from the keys: hidden size and in_channels (img_in), text width (txt_in), the guidance
  embedding (`guidance_in.in_layer.weight` present or not) and the block counts. So [dev]
  and [klein] differ there only by the guidance embedding and the text width: [dev] embeds
  guidance and takes Mistral-3 states (3 x 5120 = 15360); [klein] has no guidance embedding
  and takes Qwen3-4B states (3 x 2560 = 7680). The released klein models are narrower than
  48 heads, which 0.8.0's detection cannot build: the klein-shaped file is klein's keys and
  text width at 0.8.0's width. 1 double + 1 single block at that width is ~2.3 B parameters
  (9 GB in fp32), too much for ComfyUI's copy plus two fp32 ranks on a 24 GB machine, so the
  file stores every weight in float8_e4m3fn (unscaled, ~2.3 GB): ComfyUI's UNETLoader with
  weight_dtype fp8_e4m3fn keeps them in fp8 and computes in fp32 on the CPU (manual cast),
  the pool (dtype fp32, weights auto) keeps the block Linears in fp8 and upcasts them per
  call, the rest to fp32; an fp8 -> fp32 cast is exact, so both compute in fp32 from the
  same values. The tensors are drawn one at a time (never the fp32 model).

The weights are diffusers models built from a config with seeded random init, written in the
BFL / SAI key layout by tests/single_file_util.write_single_file.
"""
from __future__ import annotations

from pathlib import Path

SD3_CONFIG = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                  attention_head_dim=64, num_attention_heads=2, joint_attention_dim=4096,
                  caption_projection_dim=128, pooled_projection_dim=2048, pos_embed_max_size=16)
FLUX_CONFIG = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
QWEN_IMAGE_CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=1,
                         attention_head_dim=128, num_attention_heads=24,
                         joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
# ComfyUI 0.8.0's FLUX.2 widths (comfy/model_detection.py), 1 double + 1 single block; the
# variants differ as 0.8.0 tells them apart (text width, guidance embedding)
FLUX2_CONFIG = dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1,
                    attention_head_dim=128, num_attention_heads=48,
                    timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32,) * 4,
                    rope_theta=2000)
FLUX2_VARIANTS = {"flux2-dev": dict(joint_attention_dim=15360, guidance_embeds=True),
                  "flux2-klein": dict(joint_attention_dim=7680, guidance_embeds=False)}
# (context width, pooled width) of the CONDITIONING each model takes
COND_DIMS = {"sd3": (4096, 2048), "flux": (4096, 768), "qwen_image": (3584, None),
             "flux2-dev": (15360, None), "flux2-klein": (7680, None)}


def _flux2_fp8_state(variant: str, seed: int) -> dict:
    """A random FLUX.2 diffusers state dict in float8_e4m3fn, one tensor at a time (the
    fp32 model would be 9 GB): Linear weights uniform in +-1/sqrt(fan_in) (torch's default
    Linear init), norm scales 1."""
    import torch
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**FLUX2_CONFIG, **FLUX2_VARIANTS[variant])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    del model
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:  # the RMSNorm scales (FLUX.2 has no biases)
            t = torch.ones(shape)
        else:
            bound = shape[1] ** -0.5
            t = torch.rand(shape, generator=g).mul_(2 * bound).sub_(bound)
        state[name] = t.to(torch.float8_e4m3fn)
        del t
    return state


def native_single_file(arch: str, out: Path, seed: int = 0) -> Path:
    """Write (once) a random `arch` transformer ComfyUI's UNETLoader detects correctly."""
    import torch
    from single_file_util import write_single_file

    out = Path(out)
    if out.exists():
        return out
    torch.manual_seed(seed)
    if arch == "sd3":
        from diffusers import SD3Transformer2DModel
        model = SD3Transformer2DModel(**SD3_CONFIG)
        dtype = torch.float32
    elif arch == "flux":
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel(**FLUX_CONFIG)
        dtype = torch.bfloat16
    elif arch == "qwen_image":
        from diffusers import QwenImageTransformer2DModel
        model = QwenImageTransformer2DModel(**QWEN_IMAGE_CONFIG)
        dtype = torch.bfloat16
    elif arch in FLUX2_VARIANTS:
        state = _flux2_fp8_state(arch, seed)
        tmp = out.with_name(out.name + ".tmp")
        write_single_file(None, "flux2", tmp, state=state, naming="bfl")
        del state
        tmp.rename(out)
        return out
    else:
        raise ValueError(arch)
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    del model
    tmp = out.with_name(out.name + ".tmp")
    write_single_file(None, arch, tmp, state=state,
                      naming="diffusers" if arch == "qwen_image" else "bfl")
    tmp.rename(out)
    return out
