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

Here: the split, the decode and the gather of the bands (`decode_parallel`). The checks live
in vae_check.py, the band context and the rewired modules in vae_bands.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sequence_parallel import gather_tokens
from .shares import sizes_for
from .topology import broadcast
from .vae_bands import Bands, max_halo, rewired
from .vae_check import check_decoder

__all__ = ["band_rows", "decode_parallel", "check_decoder", "BandScheme", "FAULTS"]

# Test-only switches that break one part of the scheme (negative controls).
FAULTS = ("no_halo", "local_groupnorm", "local_attention", "no_cache_halo")


def band_rows(height: int, n: int, weights=()) -> list[int]:
    """Balanced row split: the first `height % n` bands get one extra row; with uneven
    `weights` (workers/parallel/shares.py), rows in proportion to them."""
    return sizes_for(height, n, weights)


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
                    scheme: BandScheme | None = None, weights=()):
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
    VAE's own band scheme where it is not this module's (`BandScheme`). `weights`: one per
    group rank, bands by weight (a band narrower than the halo: the balanced split).
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

    bands = band_rows(h, n, weights)
    if min(bands) < max(1, scheme.halo(vae)):  # every band must hold its neighbours' halo
        bands = band_rows(h, n)
    ctx = Bands(group=group, rank=me, size=n, bands=bands, fault=fault)
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


DEFAULT_SCHEME = BandScheme(check=check_decoder, halo=max_halo, rewired=rewired)
