"""A timestep per token through the xDiT MODEL (a family's `TokenTimesteps`), without ComfyUI.

ComfyUI samples a LATENT with a noise mask (an image-to-video node's start frame: mask 0 there)
by calling its model with a timestep per token: the model class multiplies the mask by the
row's timestep and flattens it to the tokens with the diffusion model's own patchifier. The
xDiT MODEL answers those patchifier calls (`TokenPatchifier`: the part's token axes
flattened, channels last, as a patch-1 patchifier orders the tokens) and turns the result,
per LATENT part, into what the pool takes: one timestep per row [N] where every token of a
row has the same (the plain call), else one per token [N, tokens], the parts' tokens end to
end (their order in the joined sequence the pool runs). The pool shards it with the tokens.

A family without the capability refuses a timestep per token in one line, naming the
families that take one.
"""
from __future__ import annotations

from comfyui_xdit.bridge import families
from comfyui_xdit.planning.config import ConfigError


class TokenPatchifier:
    """Stands for a patchifier of ComfyUI's diffusion model that its model class calls on a
    mask times the timestep: [B, C, ...] -> ([B, tokens, the rest], None), the tokens the
    row's `axes` (of its [C, ...] shape) flattened in order; no coordinates (the class reads
    only the tokens)."""

    def __init__(self, axes: tuple):
        self.axes = tuple(int(a) for a in axes)

    def patchify(self, x, *args, **kwargs):
        axes = [a + 1 for a in self.axes]  # the batch comes first
        rest = [d for d in range(1, x.dim()) if d not in axes]
        b = int(x.shape[0])
        tokens = x.permute(0, *axes, *rest)
        n = 1
        for a in axes:
            n *= int(x.shape[a])
        return tokens.reshape(b, n, -1), None


def install(diffusion_model, family) -> None:
    """Give ComfyUI's model class the patchifiers it turns a noise mask with (the family's
    `TokenTimesteps.patchifiers`); nothing for a family without them."""
    spec = family.capability(families.TokenTimesteps)
    for name, part in (spec.patchifiers if spec is not None else ()):
        setattr(diffusion_model, name, TokenPatchifier(spec.token_axes[part]))


def mask_inputs(family) -> tuple:
    """The model inputs holding masks that the timesteps already carry (taken and dropped)."""
    spec = family.capability(families.TokenTimesteps)
    return () if spec is None else tuple(spec.mask_inputs)


def refusal(family, detail: str) -> ConfigError:
    takers = [f.name for f in families.FAMILIES.values()
              if f.capability(families.TokenTimesteps) is not None]
    which = f" (the xDiT MODEL takes one for {', '.join(takers)})" if takers else ""
    return ConfigError(f"the {family.name} xDiT MODEL takes one timestep per latent row; "
                       f"this call has {detail}: a noise mask on the LATENT (an "
                       f"image-to-video node's start frame, SetLatentNoiseMask), which "
                       f"{family.name} on the xDiT MODEL does not take{which}; remove the "
                       f"mask or use ComfyUI's own model")


def pool_timesteps(family, steps, n: int, shapes, scale: float):
    """ComfyUI's timesteps of one call -> the pool's, times `scale` (its timestep scale).
    `steps`: one per LATENT part (or one for all of them), each a number, one per row [n]
    or one per token (what `TokenPatchifier` gave: [n, tokens, 1]); `shapes`: the parts'
    per-row shapes ([C, ...] each)."""
    import torch
    steps = list(steps) if isinstance(steps, (list, tuple)) else [steps]
    if len(steps) == 1:
        steps = steps * len(shapes)
    if len(steps) != len(shapes):
        raise ConfigError(f"the {family.name} xDiT MODEL takes a timestep per LATENT part "
                          f"({len(shapes)}); got {len(steps)}")
    spec = family.capability(families.TokenTimesteps)
    tokens = spec.tokens(shapes) if spec is not None else [None] * len(shapes)
    parts = []
    for s, k in zip(steps, tokens):
        s = s.detach().reshape(-1).float().cpu()
        if s.numel() in (1, n):
            parts.append(s.expand(n).reshape(n, 1))
        elif k is not None and s.numel() == n * k:
            parts.append(s.reshape(n, k))
        elif spec is None:
            raise refusal(family, f"{s.numel()} timesteps for {n} rows (a timestep per token)")
        else:
            raise ConfigError(f"the {family.name} xDiT MODEL takes one timestep per latent row "
                              f"({n}) or per token ({n} x {k}); got {s.numel()} for a part")
    first = parts[0][:, :1]
    if all(bool((p == first).all()) for p in parts):  # every token its row's: the plain call
        return first.reshape(n) * scale
    if spec is None:
        raise refusal(family, "a timestep per LATENT part that differ")
    return torch.cat([p.expand(n, k) for p, k in zip(parts, tokens)], 1).contiguous() * scale
