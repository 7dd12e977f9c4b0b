"""The band context and the rewired modules of one patch-parallel VAE decode (vae_parallel.py):
the halo exchange of a band's edge rows, the convs, causal convs, group norms and attention
that compute exactly the rows the full decode would, and `rewired`, which installs them on a
decoder for one call."""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .sequence_parallel import all_gather_tokens
from .topology import all_gather, all_reduce
from .vae_check import causal_classes



@dataclass
class Bands:
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


def start_halo_exchange(ctx: Bands, x: torch.Tensor, p: int):
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


def _halo_conv_forward(conv: nn.Conv2d, ctx: Bands, x: torch.Tensor) -> torch.Tensor:
    ctx.fired["conv"] += 1
    p = conv.padding[0]
    h = x.shape[2]
    if h < p:
        raise RuntimeError(f"patch-parallel VAE decode: band of {h} rows is thinner than the "
                           f"{p}-row halo of a {conv.kernel_size} conv")
    top, bottom, wait = start_halo_exchange(ctx, x, p)
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


def _halo_causal_conv_forward(conv, ctx: Bands, x: torch.Tensor, cache_x=None) -> torch.Tensor:
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
    top, bottom, wait = start_halo_exchange(ctx, xp[:, :, f0:, p:p + h, pw:pw + w], p)
    top, bottom = wait()
    if top is not None:
        xp[:, :, f0:, :p, pw:pw + w] = top
    if bottom is not None:
        xp[:, :, f0:, p + h:, pw:pw + w] = bottom
    return nn.Conv3d.forward(conv, xp)  # its own padding is (0, 0, 0)


def _attention_block_forward(blk, ctx: Bands, x: torch.Tensor) -> torch.Tensor:
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


def _group_norm_forward(gn: nn.GroupNorm, ctx: Bands, x: torch.Tensor) -> torch.Tensor:
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


def _gather_tokens_hook(kind: str, ctx: Bands):
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
def rewired(vae, ctx: Bands):
    """Rewire the decode path's modules for one banded decode; restore everything after."""
    from diffusers.models.attention_processor import Attention

    causal = causal_classes("CausalConv3d")
    attn_block = causal_classes("AttentionBlock")
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


def max_halo(vae) -> int:
    """Widest conv halo in the decode path, in rows (1 for 3x3 convs). Every band has at
    least as many rows at the latent resolution (and twice as many after each upsample)."""
    roots = [vae.decoder] + ([vae.post_quant_conv] if getattr(vae, "post_quant_conv", None)
                             is not None else [])
    return max([_halo_rows(m) for r in roots for m in r.modules()], default=0)


def _halo_rows(m) -> int:
    """Rows of zero padding along H a spatial conv adds at each side (0: none / not a conv)."""
    if isinstance(m, nn.Conv2d):
        return m.padding[0]
    if isinstance(m, causal_classes("CausalConv3d")):
        return m._padding[2]
    return 0
