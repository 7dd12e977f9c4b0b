"""Patch-parallel VAE decode, exact against the single-process decode.

The latent is split into row bands over the ranks of a process group (balanced, uneven
bands allowed: band i gets `h // n` rows plus one for the first `h % n` ranks). Every rank
runs the stock diffusers `vae.decode` on its band while the decoder's spatially-mixing
modules are temporarily rewired so that the band computes exactly the rows the full decode
would:

- `nn.Conv2d` with a kernel taller than 1 (3x3 in the AutoencoderKL decoder) gets a halo of
  `(k-1)/2` rows from its neighbour ranks (point-to-point, overlapped with the conv of the
  band's interior). The band is convolved with the conv's own zero padding, then the `p`
  rows at each inner band edge, which saw zeros instead of the neighbour's rows, are
  recomputed from `[halo, edge rows]` and written over. At the image's true top and bottom
  the zero padding is what the full decode uses, so nothing changes there. This keeps peak
  memory at one activation (no padded copy of the band); bands thinner than `2p` rows fall
  back to convolving `cat([halo_top, band, halo_bottom])`.
- `nn.GroupNorm` (statistics over the whole image): each rank computes per-(sample, group)
  mean and variance of its band (`torch.var_mean`, fp32 or better), turns them into sums
  and sums of squares in float64, and one all-reduce per norm gives the global mean and
  variance. The affine transform is folded into one per-channel scale and shift (as
  PyTorch's own CPU kernel does).
- Attention (the mid-block self-attention over all pixels of the lowest resolution): forward
  hooks on `to_k` and `to_v` all-gather their outputs over the group in band order, so each
  rank's queries (its own pixels) attend to every key and value in the same order as the
  single-process decode. Memory: K and V at the latent resolution, scores for local queries.
- Everything else in the AutoencoderKL decoder is per pixel (SiLU, 1x1 convs such as
  `post_quant_conv` and resnet shortcuts, linear projections, residual adds) or per band row
  (nearest-neighbour 2x upsampling doubles every band exactly), so it runs unchanged.

The causal 3-D video VAEs of the Wan design, Wan 2.1's (AutoencoderKLWan, also Wan 2.2 A14B)
and Qwen-Image's (AutoencoderKLQwenImage, a fine-tuned copy: the same module code under other
class names, handled by one code path), decode a latent [B, C, T, h, w] of any number of
frames the same way. The stock decode runs the decoder one latent frame per call, keeping a
feature cache (the last frames of each causal conv's input, here of the rank's own band; the
split is spatial, so time never crosses ranks):

- `WanCausalConv3d` (3x3x3, causal in time): its forward puts the cached frames before its
  input, pads the rest of the causal time window with zeros, W and H with one zero row /
  column each side, and convolves unpadded. Here the same padded stack is built (one copy),
  and the H padding at inner band edges, on every frame of the stack (cached frames
  included), is filled with the neighbours' rows (the same halo exchange). The temporal
  upsampler's (3,1,1) `time_conv` has no H padding (per pixel); 1x1x1 convs are per pixel.
- The RMS norm normalises each pixel over its channels: per pixel, no reduction.
- The resample blocks' nearest-exact 2x upsampling doubles band rows exactly (a whole
  factor: output row r reads row r // 2); their 3x3 `nn.Conv2d` is rewired as above. Wan 2.2
  TI2V-5B's residual up blocks add a `DupUp3D` shortcut (channels repeated into 2x2 pixel
  blocks and frames: per band row too), and its decode unpatchifies 2x2 after the decoder.
- The attention block (one head over each frame's pixels, Q/K/V from one 1x1 conv, so there
  is no `to_k` to hook): its forward is restated with the band's queries attending to K and
  V all-gathered in band order; its norm, QKV conv and output projection are per pixel.
  check_decoder refuses a block whose forward is not the class's stock one.
- `post_quant_conv`, resnet shortcuts (1x1x1), SiLU, the residual adds, the cache
  bookkeeping and the final clamp are per pixel or per frame.

Bands decoded by the other ranks are sent to the group's rank 0, which writes them into the
full image. Modules are rewired for the duration of one call (`forward` overridden on the
instance, hooks registered) and restored afterwards; of diffusers' forward code only the
Wan attention block's dozen lines are restated (with the gather in them). Before
decoding, the decoder's module tree is checked against the module types and settings this
scheme is proven for; anything else (transposed-conv upsamplers, spatial norms, fused QKV in
a 2-D `Attention`, strided convs, ...) raises `NotImplementedError` instead of returning a
silently wrong image. The FLUX and SD3 VAEs (AutoencoderKL), FLUX.2's (AutoencoderKLFlux2:
the same Decoder and post_quant_conv at 32 latent channels; its batch norm acts on the
patchified latent in model space, before any decode), Qwen-Image's and Wan's (2.1, 2.2) pass.

Per-rank activation memory falls roughly as 1/n: the largest tensors are the full-resolution
band activations; only K/V (latent resolution) and, on rank 0, the 3-channel output image are
full size.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .sequence_parallel import all_gather_tokens, gather_tokens
from .topology import all_gather, all_reduce, broadcast

__all__ = ["band_rows", "decode_parallel", "check_decoder", "BandScheme", "FAULTS"]

# Test-only switches that break one part of the scheme (negative controls).
FAULTS = ("no_halo", "local_groupnorm", "local_attention", "no_cache_halo")


def band_rows(height: int, n: int) -> list[int]:
    """Balanced row split: the first `height % n` bands get one extra row."""
    base, extra = divmod(height, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


# ----------------------------------------------------------------------------------------
# What the scheme is proven for


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


def _causal_classes(name: str) -> tuple:
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


# ----------------------------------------------------------------------------------------
# The band context and the rewired modules


@dataclass
class _Bands:
    group: object
    rank: int  # in the group
    size: int
    bands: list  # latent rows per group rank
    fault: str | None = None
    fired: dict = field(default_factory=lambda: {"conv": 0, "norm": 0, "attn_k": 0, "attn_v": 0})
    rewired: dict = field(default_factory=lambda: {"conv": 0, "norm": 0, "attn_k": 0, "attn_v": 0})

    @property
    def rows(self) -> int:
        return self.bands[self.rank]

    def peer(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def scaled(self, local: int) -> list[int]:
        """Every rank's extent along a dim whose local extent is `local`, for a dim that
        scales with the band (rows at any resolution, or tokens = rows * width)."""
        if local % self.rows:
            raise RuntimeError(f"patch-parallel VAE decode: extent {local} is not a multiple "
                               f"of the band's {self.rows} latent rows")
        s = local // self.rows
        return [b * s for b in self.bands]


def _start_halo_exchange(ctx: _Bands, x: torch.Tensor, p: int):
    """Post sends of our top/bottom p rows and receives of the neighbours' rows, grouped
    (workers/parallel/p2p.py: NCCL-safe).
    Returns (top, bottom, wait): top/bottom are None at the image's true edges; they hold
    the neighbours' rows once `wait()` has run (it returns them)."""
    from .p2p import post

    sends, recvs, where = [], [], []
    hd = x.dim() - 2  # rows: [B, C, H, W] or [B, C, T, H, W]
    shape = x.shape[:hd] + (p,) + x.shape[hd + 1:]
    if ctx.fault != "no_halo":
        if ctx.rank > 0:
            up = ctx.peer(ctx.rank - 1)
            sends.append((x.narrow(hd, 0, p), up))
            recvs.append((shape, x.dtype, up))
            where.append("top")
        if ctx.rank < ctx.size - 1:
            down = ctx.peer(ctx.rank + 1)
            sends.append((x.narrow(hd, x.shape[hd] - p, p), down))
            recvs.append((shape, x.dtype, down))
            where.append("bottom")
    transfer = post(sends, recvs, ctx.group, x.device)
    got = dict(zip(where, transfer.bufs))
    box = {}

    def wait():
        box.update(zip(where, transfer.wait()))
        return box.get("top"), box.get("bottom")
    return got.get("top"), got.get("bottom"), wait


def _halo_conv_forward(conv: nn.Conv2d, ctx: _Bands, x: torch.Tensor) -> torch.Tensor:
    ctx.fired["conv"] += 1
    p = conv.padding[0]
    h = x.shape[2]
    if h < p:
        raise RuntimeError(f"patch-parallel VAE decode: band of {h} rows is thinner than the "
                           f"{p}-row halo of a {conv.kernel_size} conv")
    top, bottom, wait = _start_halo_exchange(ctx, x, p)
    edge_pad = (0, conv.padding[1])

    def conv_rows(rows):
        return F.conv2d(rows, conv.weight, conv.bias, conv.stride, edge_pad, conv.dilation,
                        conv.groups)

    if h < 2 * p:  # thin band: convolve the haloed copy (small tensors only)
        top, bottom = wait()
        z = lambda: x.new_zeros(x.shape[0], x.shape[1], p, x.shape[3])
        return conv_rows(torch.cat([top if top is not None else z(), x,
                                    bottom if bottom is not None else z()], dim=2))
    # the band with the conv's own zero padding: right at the image's true edges
    out = F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    top, bottom = wait()
    if top is not None:
        out[:, :, :p] = conv_rows(torch.cat([top, x[:, :, :2 * p]], dim=2))
    if bottom is not None:
        out[:, :, h - p:] = conv_rows(torch.cat([x[:, :, h - 2 * p:], bottom], dim=2))
    return out


def _halo_causal_conv_forward(conv, ctx: _Bands, x: torch.Tensor, cache_x=None) -> torch.Tensor:
    """A Wan-style causal conv (3x3x3) on a band [B, C, t, h, W], `cache_x` the band's own
    cached last frames of this conv's input from the previous decoder call (or None). As the
    stock forward does, the cached frames go before the input and only the rest of the causal
    time padding stays zeros; W is zero padded, H too at the image's true edges. At inner band
    edges the H padding of every frame of that stack, cached ones included, is filled with the
    neighbours' rows (the neighbours hold the same frames of their bands), then the conv runs
    unpadded. One padded copy is built (the stock forward builds a concatenation and a padded
    copy of it)."""
    ctx.fired["conv"] += 1
    pw, _, p, _, pt, _ = conv._padding
    t, h, w = x.shape[2:]
    if h < p:
        raise RuntimeError(f"patch-parallel VAE decode: band of {h} rows is thinner than the "
                           f"{p}-row halo of a {conv.kernel_size} conv")
    parts = [x]
    if cache_x is not None and pt > 0:
        parts = [cache_x.to(x.device), x]
        pt -= cache_x.shape[2]
    frames = sum(q.shape[2] for q in parts)
    xp = x.new_zeros(x.shape[:2] + (pt + frames, h + 2 * p, w + 2 * pw))
    f0 = pt
    for q in parts:
        xp[:, :, f0:f0 + q.shape[2], p:p + h, pw:pw + w] = q
        f0 += q.shape[2]
    # the frames whose H halo is exchanged: the whole stack the conv convolves (the negative
    # control "no_cache_halo" leaves the cached frames' halo rows zero)
    f0 = pt + (frames - t if ctx.fault == "no_cache_halo" else 0)
    top, bottom, wait = _start_halo_exchange(ctx, xp[:, :, f0:, p:p + h, pw:pw + w], p)
    top, bottom = wait()
    if top is not None:
        xp[:, :, f0:, :p, pw:pw + w] = top
    if bottom is not None:
        xp[:, :, f0:, p + h:, pw:pw + w] = bottom
    return nn.Conv3d.forward(conv, xp)  # its own padding is (0, 0, 0)


def _attention_block_forward(blk, ctx: _Bands, x: torch.Tensor) -> torch.Tensor:
    """A Wan-style attention block (one head over the pixels of each frame) on a band: the
    block's steps as diffusers runs them (its norm, 1x1 QKV conv and output projection are
    per pixel), the band's queries attending to every rank's keys and values, all-gathered
    in band order (the single-process key order)."""
    identity = x
    b, c, t, h, w = x.shape
    x = blk.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
    qkv = blk.to_qkv(x).reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
    q, k, v = qkv.chunk(3, dim=-1)
    ctx.fired["attn_k"] += 1
    ctx.fired["attn_v"] += 1
    if ctx.fault != "local_attention":
        counts = ctx.scaled(k.shape[2])
        k = all_gather_tokens(k, 2, counts, ctx.group)
        v = all_gather_tokens(v, 2, counts, ctx.group)
    x = F.scaled_dot_product_attention(q, k, v)
    x = blk.proj(x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
    return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity


def _group_norm_forward(gn: nn.GroupNorm, ctx: _Bands, x: torch.Tensor) -> torch.Tensor:
    ctx.fired["norm"] += 1
    b, c = x.shape[:2]
    g = gn.num_groups
    xg = x.reshape(b, g, -1)
    full = x.dtype in (torch.float32, torch.float64)
    if full:
        var, mean = torch.var_mean(xg, dim=-1, correction=0)
    else:  # half precision: fp32 statistics, one group at a time (no fp32 copy of the band)
        vm = [torch.var_mean(xg[:, i].float(), dim=-1, correction=0) for i in range(g)]
        var, mean = torch.stack([v for v, _ in vm], 1), torch.stack([m for _, m in vm], 1)
    n = xg.shape[-1]
    mean, var = mean.double(), var.double()
    # [sum, sum of squares, count] per (sample, group), reconstructed from the band's
    # accurate moments, summed over the ranks in float64
    stats = torch.stack([mean * n, (var + mean * mean) * n, torch.full_like(mean, n)], dim=-1)
    if ctx.fault != "local_groupnorm":
        all_reduce(stats, group=ctx.group)
    total = stats[..., 2]
    mean = stats[..., 0] / total
    var = (stats[..., 1] / total - mean * mean).clamp_min(0)
    rstd = torch.rsqrt(var + gn.eps)  # [b, g]
    scale = rstd.repeat_interleave(c // g, dim=1)  # [b, c]
    shift = -mean.repeat_interleave(c // g, dim=1) * scale
    if gn.affine:
        w = gn.weight.double()
        scale, shift = scale * w, shift * w + gn.bias.double()
    view = (b, c) + (1,) * (x.dim() - 2)
    if full:
        return torch.addcmul(shift.to(x.dtype).view(view), x, scale.to(x.dtype).view(view))
    # half precision: normalise in fp32 and round once, a group's channels at a time
    out = torch.empty_like(x)
    scale, shift = scale.float().view(view), shift.float().view(view)
    for i in range(0, c, c // g):
        sl = slice(i, i + c // g)
        out[:, sl] = torch.addcmul(shift[:, sl], x[:, sl].float(), scale[:, sl]).to(x.dtype)
    return out


def _gather_tokens_hook(kind: str, ctx: _Bands):
    """Forward hook on to_k / to_v: all-gather [B, tokens, C] over the group in band order."""
    def hook(module, args, out):
        ctx.fired["attn_" + kind] += 1
        if ctx.fault == "local_attention":
            return out
        if out.dim() != 3:
            raise RuntimeError(f"patch-parallel VAE decode: to_{kind} output of shape "
                               f"{tuple(out.shape)}, expected [batch, tokens, channels]")
        counts = ctx.scaled(out.shape[1])
        m = max(counts)
        mine = out if out.shape[1] == m else F.pad(out, (0, 0, 0, m - out.shape[1]))
        parts = [torch.empty_like(mine) for _ in range(ctx.size)]
        all_gather(parts, mine.contiguous(), group=ctx.group)
        return torch.cat([pt[:, :k] for pt, k in zip(parts, counts)], dim=1)
    return hook


@contextlib.contextmanager
def _rewired(vae, ctx: _Bands):
    """Rewire the decode path's modules for one banded decode; restore everything after."""
    from diffusers.models.attention_processor import Attention

    causal = _causal_classes("CausalConv3d")
    attn_block = _causal_classes("AttentionBlock")
    roots = [vae.decoder]
    if getattr(vae, "post_quant_conv", None) is not None:
        roots.append(vae.post_quant_conv)
    patched, handles = [], []  # (module, its own instance-level forward or None)
    saved_tiling = getattr(vae, "use_tiling", False)
    try:
        vae.use_tiling = False  # tiles would depend on each rank's band size
        for root in roots:
            for m in root.modules():
                if isinstance(m, nn.Conv2d) and m.kernel_size[0] > 1:
                    patched.append((m, m.__dict__.get("forward")))
                    m.forward = types.MethodType(
                        lambda self, x, _c=ctx: _halo_conv_forward(self, _c, x), m)
                    ctx.rewired["conv"] += 1
                elif isinstance(m, causal) and m._padding[2] > 0:
                    patched.append((m, m.__dict__.get("forward")))
                    m.forward = types.MethodType(
                        lambda self, x, cache_x=None, _c=ctx:
                            _halo_causal_conv_forward(self, _c, x, cache_x), m)
                    ctx.rewired["conv"] += 1
                elif isinstance(m, attn_block):
                    patched.append((m, m.__dict__.get("forward")))
                    m.forward = types.MethodType(
                        lambda self, x, _c=ctx: _attention_block_forward(self, _c, x), m)
                    ctx.rewired["attn_k"] += 1
                    ctx.rewired["attn_v"] += 1
                elif isinstance(m, nn.GroupNorm):
                    patched.append((m, m.__dict__.get("forward")))
                    m.forward = types.MethodType(
                        lambda self, x, _c=ctx: _group_norm_forward(self, _c, x), m)
                    ctx.rewired["norm"] += 1
                elif isinstance(m, Attention):
                    handles.append(m.to_k.register_forward_hook(_gather_tokens_hook("k", ctx)))
                    handles.append(m.to_v.register_forward_hook(_gather_tokens_hook("v", ctx)))
                    ctx.rewired["attn_k"] += 1
                    ctx.rewired["attn_v"] += 1
        yield
    finally:
        for m, own in reversed(patched):
            if own is None:
                del m.forward  # back to the class's forward
            else:
                m.forward = own
        for h in handles:
            h.remove()
        vae.use_tiling = saved_tiling


def _max_halo(vae) -> int:
    """Widest conv halo in the decode path, in rows (1 for 3x3 convs). Every band has at
    least as many rows at the latent resolution (and twice as many after each upsample)."""
    roots = [vae.decoder] + ([vae.post_quant_conv] if getattr(vae, "post_quant_conv", None)
                             is not None else [])
    return max([_halo_rows(m) for r in roots for m in r.modules()], default=0)


def _halo_rows(m) -> int:
    """Rows of zero padding along H a spatial conv adds at each side (0: none / not a conv)."""
    if isinstance(m, nn.Conv2d):
        return m.padding[0]
    if isinstance(m, _causal_classes("CausalConv3d")):
        return m._padding[2]
    return 0


# ----------------------------------------------------------------------------------------
# Entry point


def _latent_shape(latents, group, control) -> list[int]:
    """Group rank 0's latent shape ([B, C, h, w] or [B, C, T, h, w]) on every rank of the
    group, through the control plane (a CPU tensor)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    meta = torch.zeros(6, dtype=torch.long)
    if dist.get_rank(group) == 0:
        meta[0] = latents.dim()
        meta[1:1 + latents.dim()] = torch.tensor(latents.shape, dtype=torch.long)
    broadcast(meta, src=src, group=control)
    return [int(s) for s in meta[1:1 + int(meta[0])]]


def _broadcast_latents(latents, shape, group, device, dtype):
    """Group rank 0's latents to every rank of the group (others may pass None), on the
    data plane (device tensor)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank(group) == 0:
        z = latents.to(device, dtype).contiguous()
    else:
        z = torch.empty(shape, device=device, dtype=dtype)
    broadcast(z, src=src, group=group)
    return z


@dataclass(frozen=True)
class BandScheme:
    """How one VAE design decodes in row bands: `check(vae)` raises NotImplementedError for a
    decoder it does not provably handle, `halo(vae)` is its widest conv halo in rows, and
    `rewired(vae, ctx)` a context manager that rewires the decoder for one banded decode
    (its modules counting `ctx.rewired` / `ctx.fired` as this module's do). The default is
    this module's scheme (the AutoencoderKL decoders and the causal VAEs of the Wan design);
    a family adapter passes its own for another design (workers/models/<id>.py)."""
    check: object
    halo: object
    rewired: object


def decode_parallel(vae, latents, group=None, fault: str | None = None, control=None,
                    scheme: BandScheme | None = None):
    """Decode raw-VAE-space `latents` with `vae` split into row bands over the ranks of
    `group` (None: the default group): diffusers AutoencoderKL [B, C, h, w] (AutoencoderKLFlux2
    at C=32), or a causal 3-D VAE, AutoencoderKLQwenImage or AutoencoderKLWan, [B, C, T, h, w]
    (any number of latent frames); `control` is the group's gloo twin (None: `group` itself,
    for a gloo group).
    Bands travel on `group` (halo exchange grouped per conv, the bands gathered by one
    all-gather), shapes on `control`.

    Collective: every rank of the group calls it. Group rank 0 must pass the latents; the
    others may pass None (they receive them by broadcast). Returns `vae.decode(latents).sample`
    ([B, 3, 8h, 8w]; [B, 3, 1 + 4(T-1), 8h, 8w] for Wan 2.1 / 2.2 A14B and Qwen-Image, 16h x
    16w for Wan 2.2 TI2V-5B; the VAE's dtype)
    on group rank 0 and None elsewhere. A latent with fewer rows than ranks (times the widest
    conv halo) is decoded by group rank 0 alone.
    `fault` (tests only, see FAULTS) disables one part of the exact scheme. `scheme`: the
    VAE's own band scheme where it is not this module's (`BandScheme`).
    """
    scheme = scheme or DEFAULT_SCHEME
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    param = next(vae.parameters())
    if n == 1:
        return vae.decode(latents.to(param.device, param.dtype), return_dict=False)[0]
    scheme.check(vae)
    shape = _latent_shape(latents, group, control if control is not None else group)
    hd = len(shape) - 2  # the rows dim
    h = shape[hd]
    if h < n * max(1, scheme.halo(vae)):
        # too few rows for a band (and its halo) each: group rank 0 decodes alone
        if me != 0:
            return None
        return vae.decode(latents.to(param.device, param.dtype), return_dict=False)[0]
    z = _broadcast_latents(latents, shape, group, param.device, param.dtype)

    bands = band_rows(h, n)
    ctx = _Bands(group=group, rank=me, size=n, bands=bands, fault=fault)
    band = z.narrow(hd, sum(bands[:me]), bands[me])
    with scheme.rewired(vae, ctx):
        out = vae.decode(band, return_dict=False)[0]
    # every rewired module runs at least once per decode; if one did not go through its
    # rewired path (a processor bypassing to_k, say), the image cannot be trusted
    if any(ctx.fired[k] < ctx.rewired[k] for k in ctx.rewired):
        raise RuntimeError(f"patch-parallel VAE decode: rewired modules did not all run "
                           f"(ran {ctx.fired}, rewired {ctx.rewired})")
    del z, band

    out_rows = ctx.scaled(out.shape[hd])
    # one gather of the (padded) bands to group rank 0, the only rank that uses the image (a
    # video is hundreds of MB: no copy on the others); a collective, so no receive is posted
    # ahead of the peers, whatever the rank count (NCCL-safe)
    return gather_tokens(out, hd, out_rows, group)


DEFAULT_SCHEME = BandScheme(check=check_decoder, halo=_max_halo, rewired=_rewired)
