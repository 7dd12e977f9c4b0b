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
# (context width, pooled width) of the CONDITIONING each model takes
COND_DIMS = {"sd3": (4096, 2048), "flux": (4096, 768), "qwen_image": (3584, None)}


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
    else:
        raise ValueError(arch)
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    del model
    tmp = out.with_name(out.name + ".tmp")
    write_single_file(None, arch, tmp, state=state,
                      naming="diffusers" if arch == "qwen_image" else "bfl")
    tmp.rename(out)
    return out
