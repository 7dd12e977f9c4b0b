"""Which VAE decoders the patch-parallel decode (vae_parallel.py) is proven exact for: the
decoder's module tree checked against the module types and settings of the AutoencoderKL
decoders and the causal 3-D VAEs of the Wan design; anything else raises NotImplementedError
before a band is decoded."""
from __future__ import annotations

import functools
import importlib

from torch import nn



def _allowed_types():
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders.vae import Decoder
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D, UpDecoderBlock2D
    from diffusers.models.upsampling import Upsample2D

    return {
        # per pixel / containers
        nn.SiLU: None, nn.Dropout: None, nn.Identity: None, nn.Linear: None,
        nn.ModuleList: None, nn.Sequential: None,
        # rewired here
        nn.Conv2d: _check_conv, nn.GroupNorm: None, Attention: _check_attention,
        # composites whose own code only adds, scales, activates or upsamples (nearest)
        Decoder: _check_decoder_top, UNetMidBlock2D: None, UpDecoderBlock2D: None,
        ResnetBlock2D: _check_resnet, Upsample2D: _check_upsample,
        **_causal_allowed_types(),
    }


@functools.lru_cache(maxsize=None)
def _causal_families() -> tuple:
    """((module, prefix), ...) of the causal 3-D VAE modules of the Wan design that some
    family declares (its `CausalVAE` capability's `patch_parallel`) and this diffusers has;
    the classes this scheme touches are the same code in each (Qwen-Image's is a fine-tuned
    Wan 2.1 VAE)."""
    from .. import families

    found = []
    specs = (f.capability(families.CausalVAE) for f in families.FAMILIES.values())
    for modname, prefix in dict.fromkeys(s.patch_parallel for s in specs
                                         if s is not None and s.patch_parallel):
        try:
            mod = importlib.import_module(f"diffusers.models.autoencoders.{modname}")
        except ImportError:
            continue
        found.append((mod, prefix))
    return tuple(found)


def causal_classes(name: str) -> tuple:
    """Every family's `<prefix><name>` class (e.g. "CausalConv3d"), for isinstance."""
    return tuple(getattr(mod, prefix + name) for mod, prefix in _causal_families()
                 if hasattr(mod, prefix + name))


def _causal_allowed_types():
    allowed = {}
    for mod, p in _causal_families():
        c = lambda name, _m=mod, _p=p: getattr(_m, _p + name)
        allowed.update({
            # rewired here
            c("CausalConv3d"): _check_causal_conv,
            c("AttentionBlock"): _attention_block_check(c("AttentionBlock")),
            # per pixel: RMS norm over the channels of each pixel
            c("RMS_norm"): _check_rms_norm,
            # per band row: nearest 2x upsampling (then a rewired Conv2d)
            c("Upsample"): _check_nearest_upsample, c("Resample"): _check_resample,
            # composites whose own code only adds, activates and threads the frame cache
            c("Decoder3d"): None, c("MidBlock"): None, c("UpBlock"): None,
            c("ResidualBlock"): None,
        })
    wan = dict((p, m) for m, p in _causal_families()).get("Wan")
    if wan is not None:
        # Wan 2.2 TI2V-5B's decoder (is_residual): up blocks whose shortcut repeats channels
        # into 2x2 pixel blocks (and frames), per band row like nearest upsampling
        allowed.update({wan.WanResidualUpBlock: None, wan.DupUp3D: _check_dup_up})
    return allowed


def _check_causal_conv(m):
    kt, kh, kw = m.kernel_size
    pw, _, ph, ph2, pt, pt2 = m._padding
    if m.stride != (1, 1, 1) or m.dilation != (1, 1, 1) or m.padding_mode != "zeros" \
            or tuple(m.padding) != (0, 0, 0) or ph != ph2 or ph != (kh - 1) // 2 or (kh - 1) % 2 \
            or pt2 != 0 or pt != kt - 1:
        return (f"{type(m).__name__} kernel {m.kernel_size} stride {m.stride} padding "
                f"{m._padding} dilation {m.dilation}: only stride-1, odd-kernel, 'same' "
                f"zero-padded (causal in time) convs are supported")


def _attention_block_check(cls):
    stock = cls.forward

    def check(m):
        if type(m).forward is not stock or "forward" in m.__dict__:
            return "an attention block with its own forward"
        if not isinstance(m.to_qkv, nn.Conv2d) or m.to_qkv.kernel_size != (1, 1):
            return "an attention block whose QKV projection is not a 1x1 conv"
    return check


def _check_rms_norm(m):
    if not m.channel_first:
        return "an RMS norm over the last dimension"


def _check_nearest_upsample(m):
    sf = m.scale_factor if isinstance(m.scale_factor, tuple) else (m.scale_factor,) * 2
    if m.size is not None or m.mode not in ("nearest", "nearest-exact") \
            or any(f != int(f) or f < 1 for f in sf):
        return f"upsampling {m.mode} by {m.scale_factor}: only nearest by whole factors"


def _check_resample(m):
    if m.mode not in ("none", "upsample2d", "upsample3d"):
        return f"resample mode {m.mode!r}"


def _check_dup_up(m):
    if m.factor_s < 1 or m.factor_t < 1 or int(m.factor_s) != m.factor_s:
        return f"DupUp3D by {m.factor_s} in space, {m.factor_t} in time"


def _check_conv(m: nn.Conv2d):
    kh, kw = m.kernel_size
    if m.stride != (1, 1) or m.padding_mode != "zeros" or isinstance(m.padding, str) \
            or m.padding[0] != m.dilation[0] * (kh - 1) // 2 or (kh - 1) % 2:
        return (f"Conv2d kernel {m.kernel_size} stride {m.stride} padding {m.padding} "
                f"({m.padding_mode}) dilation {m.dilation}: only stride-1, odd-kernel, "
                f"'same' zero-padded convs are supported")


def _check_attention(m):
    if getattr(m, "spatial_norm", None) is not None:
        return "Attention with a spatial norm"
    if getattr(m, "fused_projections", False) \
            or not isinstance(getattr(m, "to_k", None), nn.Linear):
        return "Attention with fused QKV projections"
    if getattr(m, "is_cross_attention", False):
        return "cross-attention"


def _check_resnet(m):
    if getattr(m, "up", False) or getattr(m, "down", False):
        return "ResnetBlock2D with internal up/down sampling"
    if getattr(m, "time_emb_proj", None) is not None:
        return "ResnetBlock2D with a time embedding"


def _check_upsample(m):
    if getattr(m, "use_conv_transpose", False) or not getattr(m, "interpolate", True):
        return "Upsample2D without nearest interpolation"


def _check_decoder_top(m):
    if not isinstance(m.conv_norm_out, nn.GroupNorm):
        return "Decoder with a spatial output norm"


def check_decoder(vae) -> None:
    """Raise NotImplementedError if `vae`'s decode path holds anything this scheme does not
    provably handle."""
    allowed = _allowed_types()
    roots = [("decoder", vae.decoder)]
    pqc = getattr(vae, "post_quant_conv", None)
    if pqc is not None:
        roots.append(("post_quant_conv", pqc))
    for root_name, root in roots:
        for name, m in root.named_modules():
            if hasattr(m, "_hf_hook"):
                raise NotImplementedError(
                    f"patch-parallel VAE decode: {root_name}.{name} carries an accelerate hook "
                    f"(sequential offload); decode on one rank instead")
            check = allowed.get(type(m), "missing")
            if check == "missing":
                raise NotImplementedError(
                    f"patch-parallel VAE decode: {root_name}.{name} is a {type(m).__name__}, "
                    f"which it does not support")
            why = check(m) if check is not None else None
            if why:
                raise NotImplementedError(
                    f"patch-parallel VAE decode: {root_name}.{name}: {why}")
