"""Test helper: a Wan 2.1 VAE that both ComfyUI's VAELoader and the pool load
(tests/test_comfyui_live_wan.py), so the image-to-video example runs with ComfyUI's own
WanImageToVideo and the two decoders can be compared.

ComfyUI 0.3.64 takes a Wan 2.1 VAE only at the released structure (it detects the file by
`decoder.middle.0.residual.0.gamma` and builds dim 96, z_dim 16, dim_mult 1,2,4,4, two
residual blocks, whatever the weights say) and only in the original Wan repository's tensor
names. So the VAE here is diffusers' AutoencoderKLWan at its default (released) config with
seeded random weights (~127M parameters): `wan_vae_folder` puts it into a copy of a tiny Wan
folder (the pool decodes with the folder's VAE), `comfy_vae_file` writes the same tensors
under the original names (the rules below, written from the two module trees).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

# The original (ComfyUI) tree, per the two modules' layouts:
# * a residual block is `residual` = [norm, SiLU, conv, norm, SiLU, dropout, conv] plus
#   `shortcut`; diffusers names the parts norm1/conv1/norm2/conv2/conv_shortcut;
# * a mid block is `middle` = [residual, attention, residual]; diffusers keeps resnets and
#   attentions in two lists;
# * the encoder's down path is already one flat list in both (`downsamples` / `down_blocks`);
# * the decoder's up path is one flat list `upsamples` of (num_res_blocks + 1) residual
#   blocks then a resample per stage; diffusers nests it as up_blocks.i.resnets.j /
#   up_blocks.i.upsamplers.0;
# * the head is `head` = [norm, SiLU, conv] (diffusers: norm_out, conv_out); the two 1x1
#   convs around the latent are conv1 / conv2 (diffusers: quant_conv / post_quant_conv).
_RES = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.",
        "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}
_PER_UP_STAGE = 2 + 1 + 1  # released num_res_blocks 2: three residual blocks and a resample


def _residual_part(rest: str) -> str:
    for old, new in _RES.items():
        if rest.startswith(old):
            return new + rest[len(old):]
    raise KeyError(rest)


def original_name(key: str) -> str:
    """One diffusers AutoencoderKLWan (Wan 2.1) tensor name in the original Wan naming
    (KeyError: a name these rules do not know, e.g. a Wan 2.2 VAE's)."""
    fixed = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2."}
    for old, new in fixed.items():
        if key.startswith(old):
            return new + key[len(old):]
    m = re.match(r"^(encoder|decoder)\.(.*)$", key)
    if not m:
        raise KeyError(key)
    side, rest = m.groups()
    if rest.startswith("conv_in."):
        return f"{side}.conv1.{rest[len('conv_in.'):]}"
    if rest.startswith("norm_out."):
        return f"{side}.head.0.{rest[len('norm_out.'):]}"
    if rest.startswith("conv_out."):
        return f"{side}.head.2.{rest[len('conv_out.'):]}"
    m = re.match(r"^mid_block\.(resnets|attentions)\.(\d)\.(.*)$", rest)
    if m:
        kind, i, tail = m.group(1), int(m.group(2)), m.group(3)
        if kind == "attentions":  # norm / to_qkv / proj: the same names
            return f"{side}.middle.1.{tail}"
        return f"{side}.middle.{2 * i}.{_residual_part(tail)}"
    m = re.match(r"^down_blocks\.(\d+)\.(.*)$", rest)
    if m and side == "encoder":
        i, tail = m.groups()
        if tail.startswith(("resample.", "time_conv.")):
            return f"encoder.downsamples.{i}.{tail}"
        return f"encoder.downsamples.{i}.{_residual_part(tail)}"
    m = re.match(r"^up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.*)$", rest)
    if m and side == "decoder":
        stage, j, tail = int(m.group(1)), m.group(3), m.group(4)
        if j is None:  # the stage's resample: resample.1 / time_conv as they are
            return f"decoder.upsamples.{stage * _PER_UP_STAGE + 3}.{tail}"
        return f"decoder.upsamples.{stage * _PER_UP_STAGE + int(j)}.{_residual_part(tail)}"
    raise KeyError(key)


def to_original(state_dict: dict) -> dict:
    out = {original_name(k): v.contiguous() for k, v in state_dict.items()}
    assert len(out) == len(state_dict), "two tensors mapped to one name"
    return out


def released_wan21_vae(seed: int = 0):
    """diffusers' AutoencoderKLWan at its default config (the released Wan 2.1 VAE's
    structure and latent statistics), seeded random weights; the RMS-norm scales are
    perturbed around 1 so that a norm mapped to the wrong place shows."""
    import torch
    from diffusers import AutoencoderKLWan
    torch.manual_seed(seed)
    vae = AutoencoderKLWan()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return vae.eval()


def wan_vae_folder(tiny: Path, out: Path, seed: int = 0) -> Path:
    """A copy of the tiny Wan folder `tiny` whose vae/ is `released_wan21_vae(seed)` (fp32)."""
    if (out / "model_index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(tiny, tmp, ignore=shutil.ignore_patterns("vae"))
    released_wan21_vae(seed).save_pretrained(str(tmp / "vae"), safe_serialization=True)
    tmp.rename(out)
    return out


def comfy_vae_file(vae_folder: Path, out: Path) -> Path:
    """The diffusers VAE in `vae_folder` as one file in the original Wan names at `out`,
    which ComfyUI's VAELoader loads as its Wan 2.1 VAE."""
    from wan_comfy import renamed_file
    return renamed_file(vae_folder, out, to_original)


# Run in ComfyUI's venv (COMFYUI_PYTHON) from its checkout: builds ComfyUI's own WanVAE the
# way comfy/sd.py does for a Wan 2.1 file, loads the file strictly, and writes its decode of
# the given latent and its encode (the mean) of the given video.
COMFY_SIDE = r"""
import sys, torch
from safetensors.torch import load_file, save_file
vae_file, inputs, out = sys.argv[1:4]
sys.argv[1:] = ["--cpu"]  # comfy's model management reads its flags on import
import comfy.options
comfy.options.enable_args_parsing()
from comfy.ldm.wan.vae import WanVAE
model = WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], dropout=0.0)
missing, unexpected = model.load_state_dict(load_file(vae_file), strict=False)
assert not missing and not unexpected, (missing[:5], unexpected[:5])
x = load_file(inputs)
with torch.no_grad():
    save_file({"decoded": model.decode(x["latent"]).contiguous(),
               "encoded": model.encode(x["video"]).contiguous()}, out)
"""
