"""HunyuanVideo 1.5's causal 3-D VAE (AutoencoderKLHunyuanVideo15) decoded patch-parallel in
row bands, and its whole-video attention taken a frame at a time (the adapter's decode,
workers/models/hunyuan_video15.py, uses both)."""
from __future__ import annotations

import types
from contextlib import contextmanager

import torch

# The VAE decodes the whole video in one call (no frame cache): causal 3x3x3 convs padded by
# replicating edges (W and H both sides, time before the first frame), per-pixel RMS norms
# over channels, pixel-shuffle up-sampling in space (and time), per-pixel shortcuts, and in
# the mid block one attention over every frame x row x column token of the latent resolution
# with a frame-causal mask. In row bands (workers/parallel/vae_parallel.py decode_parallel,
# this `BANDS` scheme):
# - a causal conv gets its neighbours' rows as H padding at inner band edges (halo exchange,
#   on every frame), then the stock replicate padding everywhere else (W, the image's true top
#   and bottom, the time padding, which replicates the first frame, halo rows included, as
#   the whole image's padding does); then the conv, unpadded;
# - the mid-block attention: each band's queries attend to K and V all-gathered along the
#   rows in band order, so the keys are the whole latent's in the single-process order
#   (frame, row, column), frame-causal as the stock mask makes it (a query of frame f sees
#   the keys of frames <= f), taken one query frame at a time instead of through a mask over
#   every pair of tokens (which one process also uses: `frame_attention`); K and V are at
#   the latent resolution (small);
# - up-sampling rearranges channels into 2x2 pixel blocks (and frames): per band row; norms,
#   activations, 1x1x1 convs and residual adds are per pixel.
def _vae_classes() -> dict:
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as m
    return {name: getattr(m, "HunyuanVideo15" + name) for name in (
        "CausalConv3d", "AttnBlock", "RMS_norm", "Upsample", "ResnetBlock", "MidBlock",
        "UpBlock3D", "Decoder3D")}


def check_vae_decoder(vae) -> None:
    """NotImplementedError unless every module of `vae.decoder` is one this scheme handles
    with the settings it is proven for."""
    from torch import nn
    c = _vae_classes()
    stock_attn = c["AttnBlock"].forward
    inner = {id(m.conv) for m in vae.decoder.modules() if isinstance(m, c["CausalConv3d"])}
    for name, m in vae.decoder.named_modules():
        why = None
        if id(m) in inner:  # a causal conv's own conv: checked with it
            continue
        if isinstance(m, c["CausalConv3d"]):
            conv = m.conv
            kt, kh, kw = conv.kernel_size
            if conv.stride != (1, 1, 1) or conv.dilation != (1, 1, 1) \
                    or tuple(conv.padding) != (0, 0, 0) or kh != kw or kh % 2 == 0 \
                    or m.pad_mode != "replicate" \
                    or tuple(m.time_causal_padding) != (kw // 2, kw // 2, kh // 2, kh // 2,
                                                        kt - 1, 0):
                why = f"a causal conv {conv.kernel_size} padded {m.time_causal_padding}"
        elif isinstance(m, c["AttnBlock"]):
            if type(m).forward is not stock_attn or "forward" in m.__dict__:
                why = "an attention block with its own forward"
        elif isinstance(m, nn.Conv3d):
            if tuple(m.kernel_size) != (1, 1, 1) or tuple(m.stride) != (1, 1, 1):
                why = f"a Conv3d {m.kernel_size} outside a causal conv"
        elif isinstance(m, c["RMS_norm"]):
            if not m.channel_first:
                why = "an RMS norm over the last dimension"
        elif not isinstance(m, (nn.SiLU, nn.ModuleList, c["Upsample"], c["ResnetBlock"],
                                c["MidBlock"], c["UpBlock3D"], c["Decoder3D"])):
            why = f"a {type(m).__name__}, which it does not support"
        if why:
            raise NotImplementedError(f"patch-parallel VAE decode: decoder.{name}: {why}")


def _vae_halo(vae) -> int:
    c = _vae_classes()["CausalConv3d"]
    return max([m.conv.kernel_size[1] // 2 for m in vae.decoder.modules() if isinstance(m, c)],
               default=0)


def _band_causal_conv(m, ctx, x):
    """A causal conv on a band [B, C, T, h, W] (module comment)."""
    from ..parallel.vae_bands import start_halo_exchange
    ctx.fired["conv"] += 1
    kt, kh, kw = m.conv.kernel_size
    p = kh // 2
    if x.shape[3] < p:
        raise RuntimeError(f"patch-parallel VAE decode: band of {x.shape[3]} rows is thinner "
                           f"than the {p}-row halo of a {m.conv.kernel_size} conv")
    top, bottom, wait = start_halo_exchange(ctx, x, p)
    top, bottom = wait()
    xh = torch.cat([t for t in (top, x, bottom) if t is not None], 3) \
        if top is not None or bottom is not None else x
    pad = (kw // 2, kw // 2, 0 if top is not None else p, 0 if bottom is not None else p,
           kt - 1, 0)
    return m.conv(torch.nn.functional.pad(xh, pad, mode=m.pad_mode))


def _band_attention(blk, ctx, x):
    """The mid-block attention on a band (module comment; `ctx` None: the whole latent on
    one rank): the band's queries against the whole latent's keys and values, frame-causal.
    The queries of frame f attend to the keys of frames 0..f, one frame at a time: the
    masked softmax of the stock block over exactly those keys, without its [L, L] mask
    (720p x 121 frames: 111,600 tokens) and with a kernel free to skip the score matrix."""
    from ..parallel.sequence_parallel import all_gather_tokens
    identity = x
    x = blk.norm(x)
    q, k, v = blk.to_q(x), blk.to_k(x), blk.to_v(x)
    b, c, t, h, w = q.shape
    if ctx is not None:
        ctx.fired["attn_k"] += 1
        ctx.fired["attn_v"] += 1
        if ctx.fault != "local_attention":
            rows = ctx.scaled(h)
            k = all_gather_tokens(k, 3, rows, ctx.group)
            v = all_gather_tokens(v, 3, rows, ctx.group)

    def tokens(z):  # [B, C, frames, rows, W] -> [B, 1, frames * rows * W, C]
        return z.flatten(2).transpose(1, 2).unsqueeze(1)

    out = torch.empty_like(q)
    for f in range(t):
        o = torch.nn.functional.scaled_dot_product_attention(
            tokens(q[:, :, f:f + 1]), tokens(k[:, :, :f + 1]), tokens(v[:, :, :f + 1]))
        out[:, :, f] = o.squeeze(1).transpose(1, 2).reshape(b, c, h, w)
    return blk.proj_out(out) + identity


@contextmanager
def frame_attention(vae):
    """The VAE's mid-block attention frame by frame on one rank (`_band_attention`)."""
    c = _vae_classes()["AttnBlock"]
    patched = []
    try:
        for m in vae.decoder.modules():
            if isinstance(m, c):
                patched.append((m, m.__dict__.get("forward")))
                m.forward = types.MethodType(lambda self, x: _band_attention(self, None, x), m)
        yield
    finally:
        for m, own in reversed(patched):
            if own is None:
                del m.forward
            else:
                m.forward = own


@contextmanager
def _vae_bands(vae, ctx):
    """The decoder rewired for one banded decode (module comment); restored after."""
    c = _vae_classes()
    patched = []
    saved_tiling = getattr(vae, "use_tiling", False)
    try:
        vae.use_tiling = False  # tiles would depend on each rank's band size
        for m in vae.decoder.modules():
            if isinstance(m, c["CausalConv3d"]):
                patched.append((m, m.__dict__.get("forward")))
                m.forward = types.MethodType(lambda self, x, _c=ctx: _band_causal_conv(self, _c, x), m)
                ctx.rewired["conv"] += 1
            elif isinstance(m, c["AttnBlock"]):
                patched.append((m, m.__dict__.get("forward")))
                m.forward = types.MethodType(lambda self, x, _c=ctx: _band_attention(self, _c, x), m)
                ctx.rewired["attn_k"] += 1
                ctx.rewired["attn_v"] += 1
        yield
    finally:
        for m, own in reversed(patched):
            if own is None:
                del m.forward
            else:
                m.forward = own
        vae.use_tiling = saved_tiling


def band_scheme():
    from ..parallel.vae_parallel import BandScheme
    return BandScheme(check=check_vae_decoder, halo=_vae_halo, rewired=_vae_bands)
