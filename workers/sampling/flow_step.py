"""The arithmetic of one denoising step, shared by the plain loop (workers/sampling/denoise.py) and
PipeFusion's last stage (workers/sampling/patch_pipeline.py), which applies it to a patch's rows:
classifier-free guidance, in one process or across the two cfg ranks, and the flow-matching
Euler update."""
from __future__ import annotations

import torch

from ..parallel.topology import all_gather


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


# ---- the scheduler's step ----------------------------------------------------------------
# The loop asks `Steps.step(x, v, i, key)` for step i's update of the rows `key` (None: the
# whole latent; PipeFusion: a patch, whose multistep history is its own). Everything a step
# multiplies by is computed once from the run's sigmas on the host, so a step is device
# arithmetic only (nothing waits on the host).

class EulerSteps:
    """FlowMatchEulerDiscreteScheduler: x + (sigma_{i+1} - sigma_i) v. Stateless."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas = sigmas  # device, fp32

    def step(self, x: torch.Tensor, v: torch.Tensor, i: int, key=None) -> torch.Tensor:
        return euler_step(x, v, self.sigmas, i)

    def tracked(self) -> tuple:
        """Rows keys with a history: none (the step reads only this step's prediction)."""
        return ()


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    """log(alpha / sigma) of flow sigmas (alpha = 1 - sigma), in fp32 as the scheduler."""
    return torch.log(1 - sigma) - torch.log(sigma)


def _unipc_coefficients(sigmas: torch.Tensor, i: int, later: int, order: int,
                        bh2: bool) -> tuple:
    """UniPC's B(h) update from sigma index `i` to `later` (predictor: i -> i + 1; corrector:
    i - 1 -> i) of `order` with history at indices i - 1, i - 2, ...: (a, b, c, rks, rhos)
    such that the update is a * x - b * m0 - c * sum_k rhos[k] * (m_k - m0) / rks[k], k over
    the history and, for the corrector, finally the new x0 (rk 1). Scalar fp32 arithmetic
    as UniPCMultistepScheduler does it (predict_x0, flow sigmas)."""
    s_t, s_0 = sigmas[later], sigmas[i]
    alpha_t = 1 - s_t
    lam_0 = _lambda(s_0)
    h = _lambda(s_t) - lam_0
    rks = [(_lambda(sigmas[i - k]) - lam_0) / h for k in range(1, order)]
    rks.append(torch.ones(()))
    hh = -h
    h_phi_1 = torch.expm1(hh)
    b_h = torch.expm1(hh) if bh2 else hh
    h_phi_k, fact, rows, b = h_phi_1 / hh - 1, 1, [], []
    for j in range(1, order + 1):
        rows.append(torch.pow(torch.stack(rks), j - 1))
        b.append(h_phi_k * fact / b_h)
        fact *= j + 1
        h_phi_k = h_phi_k / hh - 1 / fact
    R, b = torch.stack(rows), torch.stack(b)
    return (float(s_t / s_0), float(alpha_t * h_phi_1), float(alpha_t * b_h),
            [float(r) for r in rks], R, b)


class UniPCSteps:
    """UniPCMultistepScheduler with flow prediction (Wan): the multistep predictor (UniP) on
    the x0 predictions of the last `solver_order` steps, and from the second step the
    corrector (UniC) of the previous step's predictor with this step's x0, B(h) bh1 / bh2,
    lower orders at the start and (lower_order_final) the end, as the scheduler's `step`
    runs them one after another; the final sigma 0 gives x0 itself. Per-step scalars come
    from the sigmas (`_unipc_coefficients`); each rows `key` keeps its own history."""

    def __init__(self, sigmas_cpu: torch.Tensor, config, first: int = 0):
        """`sigmas_cpu`: the run's sigmas (fp32, CPU), `first`: their index in the
        scheduler's full schedule (the corrector-disabled steps are counted in it)."""
        sig = sigmas_cpu.float().cpu()
        n, order_max = len(sig) - 1, int(config.get("solver_order", 2))
        bh2 = config.get("solver_type", "bh2") == "bh2"
        off = set(int(k) for k in (config.get("disable_corrector") or []))
        lof = config.get("lower_order_final", True)
        self.sigma = [float(s) for s in sig]
        self.orders, self.pred, self.corr = [], [], []
        for i in range(n):
            order = min(order_max, n - i) if lof else order_max
            order = min(order, i + 1)  # warm-up: lower orders while history is short
            self.orders.append(order)
            a, b, c, rks, R, bv = _unipc_coefficients(sig, i, i + 1, order, bh2)
            if order == 1:
                rhos = []
            elif order == 2:
                rhos = [0.5]
            else:
                rhos = [float(r) for r in torch.linalg.solve(R[:-1, :-1], bv[:-1])]
            self.pred.append((a, b, c, rks[:-1], rhos))
            corr = None
            if i > 0 and (first + i - 1) not in off:
                p = self.orders[i - 1]  # the corrector's order: the previous predictor's
                a, b, c, rks, R, bv = _unipc_coefficients(sig, i - 1, i, p, bh2)
                rhos = [0.5] if p == 1 else [float(r) for r in torch.linalg.solve(R, bv)]
                corr = (a, b, c, rks[:-1], rhos)
            self.corr.append(corr)
        self.keep = max(order_max, 1)  # x0 history each rows key keeps
        self.state = {}

    @staticmethod
    def _update(x, m, coef, new=None):
        """a x - b m0 - c (sum_k rho_k (m_k - m0) / rk_k [+ rho_last (new - m0)])."""
        a, b, c, rks, rhos = coef
        m0 = m[-1]
        res = None
        for k, rk in enumerate(rks):  # m_k: the x0 k + 1 steps before m0
            d = rhos[k] * ((m[-(k + 2)] - m0) / rk)
            res = d if res is None else res + d
        if new is not None:
            d = rhos[-1] * (new - m0)
            res = d if res is None else res + d
        out = a * x - b * m0
        return out if res is None else out - c * res

    def tracked(self) -> tuple:
        """Rows keys with a history."""
        return tuple(self.state)

    def derive(self, key, parent, take) -> None:
        """Start `key`'s history as a part of `parent`'s (PipeFusion: after the whole-image
        warmup steps a row band continues from its rows of the whole image's history);
        `take`: a tensor of `parent`'s -> its part (a view, copied here)."""
        st = self.state[parent]
        self.state[key] = {"m": [take(t).clone() for t in st["m"]],
                           "last": None if st["last"] is None else take(st["last"]).clone()}

    def step(self, x: torch.Tensor, v: torch.Tensor, i: int, key=None) -> torch.Tensor:
        st = self.state.setdefault(key, {"m": [], "last": None})
        xs = x.to(torch.float32, copy=True)  # kept as history: the caller writes x over
        x0 = xs - self.sigma[i] * v.float()
        if self.corr[i] is not None and st["last"] is not None:
            xs = self._update(st["last"], st["m"], self.corr[i], new=x0)
        st["m"] = (st["m"] + [x0])[-self.keep:]
        st["last"] = xs
        return self._update(xs, st["m"], self.pred[i]).to(x.dtype)


def step_rows(steps, x: torch.Tensor, v: torch.Tensor, i: int, rows: tuple, take) -> None:
    """Step `x`, the latent rows `rows` = (r0, r1), in place (PipeFusion's last stage), under
    a history kept per row band. `take(t, a, b)`: rows a..b of a tensor of rows relative to
    its first. Rows with their own history continue it; rows inside a tracked band start from
    its part of that history (a patch's first step after the whole-image warmup); rows
    covering tracked bands (a whole-image step after banded ones, PipeFusion's warmup again
    at an expert switch) step each band with its own history, which is the whole step for a
    per-element update."""
    key, tracked = tuple(rows), steps.tracked()
    parts = sorted(k for k in tracked if isinstance(k, tuple) and k != key
                   and key[0] <= k[0] and k[1] <= key[1])
    if parts:
        if [k[0] for k in parts[1:]] != [k[1] for k in parts[:-1]] \
                or (parts[0][0], parts[-1][1]) != key:
            raise RuntimeError(f"rows {key}: tracked bands {parts} do not tile them")
        for a, b in parts:
            xr = take(x, a - key[0], b - key[0])
            xr.copy_(steps.step(xr, take(v, a - key[0], b - key[0]), i, key=(a, b)))
        return
    if tracked and key not in tracked:
        parent = next((k for k in tracked if isinstance(k, tuple)
                       and k[0] <= key[0] and key[1] <= k[1]), None)
        if parent is not None:
            steps.derive(key, parent, lambda t: take(t, key[0] - parent[0], key[1] - parent[0]))
    x.copy_(steps.step(x, v, i, key=key))


def with_shift(name: str, config: dict, shift: float) -> dict:
    """A scheduler config with its flow shift set: sigma -> shift sigma / (1 + (shift - 1)
    sigma), ComfyUI's ModelSamplingSD3 `shift`. UniPC with flow sigmas (Wan) takes it as
    `flow_shift`, FlowMatch Euler (SD3) as `shift`; a schedule shifted by the image size
    (`use_dynamic_shifting`: FLUX, Qwen-Image, Chroma) has no one shift to set."""
    if name == "UniPCMultistepScheduler" and config.get("use_flow_sigmas"):
        return dict(config, flow_shift=shift)
    if name == "FlowMatchEulerDiscreteScheduler" and not config.get("use_dynamic_shifting"):
        return dict(config, shift=shift)
    how = "shifts its schedule by the image size" if config.get("use_dynamic_shifting") \
        else f"runs {name}"
    raise ValueError(f"shift {shift:g}: this model's scheduler {how}, so there is no one flow "
                     f"shift to set; leave shift unset (Wan and SD3 models take it)")


def make_steps(scheduler, sigmas: torch.Tensor, sigmas_cpu: torch.Tensor, first: int = 0):
    """The step of the job's scheduler (`check_scheduler` has accepted it)."""
    if type(scheduler).__name__ == "UniPCMultistepScheduler":
        return UniPCSteps(sigmas_cpu, scheduler.config, first)
    return EulerSteps(sigmas)
