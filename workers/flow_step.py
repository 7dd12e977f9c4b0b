"""The arithmetic of one denoising step, shared by the plain loop (workers/denoise.py) and
PipeFusion's last stage (workers/pipefusion/strategy.py), which applies it to a patch's rows:
classifier-free guidance, in one process or across the two cfg ranks, and the flow-matching
Euler update."""
from __future__ import annotations

import torch

from .topology import all_gather


def combine(neg: torch.Tensor, pos: torch.Tensor, scale: float,
            rescale: bool = False) -> torch.Tensor:
    """Classifier-free guidance (SD3's guidance scale, FLUX's true CFG). `rescale`
    (Qwen-Image's true CFG): the result takes the conditional prediction's norm over the
    channels of each token, a per-token operation that shards of tokens compute alike."""
    out = neg + scale * (pos - neg)
    if rescale:
        out = out * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
    return out


def combine_across(pred: torch.Tensor, group, scale: float,
                   rescale: bool = False) -> torch.Tensor:
    """CFG parallel: this rank's branch prediction and the other cfg rank's (one all-gather
    on the data plane; rank 0 of the group holds the negative branch), combined."""
    both = [torch.empty_like(pred) for _ in range(2)]
    all_gather(both, pred.contiguous(), group=group)
    return combine(both[0], both[1], scale, rescale)


def euler_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step without noise: x + (sigma_{i+1} - sigma_i) v,
    in fp32, back to the prediction's dtype (rows or the whole latent alike)."""
    return (x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(v.dtype)
