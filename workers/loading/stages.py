"""PipeFusion's stages: which transformer blocks a rank holds, and loading only those.

The blocks of a model (FLUX: 19 double then 38 single; SD3: its joint blocks) are cut into
`pipefusion` contiguous stages. A rank builds the transformer on the meta device, replaces
every block outside its stage by a weightless `RemoteBlock`, and reads only its own tensors
from the checkpoint, so no rank ever holds the whole transformer. The modules around the
blocks (embedders, final norm and projection: <1% of FLUX's weights) are on every stage.

Two hooks move activations between stages: the first block of a stage replaces its inputs
by the previous stage's output, the last block of a stage puts its output in the slot for
the next one (`Activations`; the strategy, workers/sampling/patch_pipeline.py, does the
transfers). The slots arrive with the call (its PatchPlan), never from a global.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SPLITS = ("balanced", "compute", "memory")
WEIGHT_SLACK = 0.05  # "balanced": a stage may hold up to 1/N + 5% of the weights


class RemoteBlock(torch.nn.Module):
    """Stands in for a block another stage holds: passes its inputs through unchanged."""

    context_pre_only = False

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.current = None  # the stage's _CurrentPlan (install_stage_hooks)

    def forward(self, *args, **kwargs):
        # FLUX.2's single blocks take and return one joined [text, image] stream
        # (encoder_hidden_states=None); the two-stream blocks return (text, image); blocks
        # called positionally take and return one stream (Wan: the image, its text reached
        # by cross-attention; MiniMax-H3: the joint sequence), as the stage's receive hook
        # assumes
        if "hidden_states" not in kwargs:
            return args[0]
        plan = None if self.current is None else self.current.plan
        if plan is not None and getattr(plan, "states", ()):  # several streams (LTX-2)
            return tuple(kwargs[k] for k, _ in plan.states)
        hidden_states = kwargs["hidden_states"]
        encoder_hidden_states = kwargs.get("encoder_hidden_states")
        if encoder_hidden_states is None or (plan is not None and not plan.context_streams()):
            return hidden_states
        return encoder_hidden_states, hidden_states


class _CurrentPlan:
    """The PatchPlan of the stage's forward in progress, for block hooks of models whose
    blocks are called without the attention kwargs (Wan: positional arguments)."""

    def __init__(self):
        self.plan = None


def model_blocks(transformer, lists) -> list:
    """[(list attribute, index in it, module)] in execution order."""
    return [(name, i, m) for name in lists for i, m in enumerate(getattr(transformer, name))]


def block_cost(block, split: str) -> float:
    """Relative cost of a block. "memory": its parameters. "compute": matmul work per token:
    the parameters outside its adaLN modulation (those act once per sample, not per token),
    halved for a two-stream block (FLUX double / SD3 joint), which applies each stream's
    weights to that stream's tokens only. Every block runs one attention over all tokens."""
    if split == "memory":
        return float(sum(p.numel() for p in block.parameters()))
    per_token = sum(p.numel() for n, p in block.named_parameters() if "norm" not in n)
    return per_token / 2.0 if hasattr(block, "ff_context") else float(per_token)


def partition(costs: list, stages: int, weights: list = None, cap: float = None) -> list:
    """Contiguous split of `costs` into `stages` non-empty runs minimising the largest run
    (exact dynamic programme; n <= a few hundred). With `weights` and `cap`, only runs whose
    weight is <= cap are allowed (None if no split fits). Returns [(start, stop)] per stage."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} pipeline stages; use "
                         f"pipefusion <= {n}")
    prefix, wprefix = [0.0], [0.0]
    for i, c in enumerate(costs):
        prefix.append(prefix[-1] + c)
        wprefix.append(wprefix[-1] + (weights[i] if weights else 0.0))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][i]: first i blocks, s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if cap is not None and wprefix[i] - wprefix[j] > cap:
                    continue
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i] - 1e-9 * abs(v):
                    best[s][i], cut[s][i] = v, j
    if best[stages][n] == inf:
        return None
    bounds, i = [], n
    for s in range(stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def parse_split(split: str, n_blocks: int, stages: int):
    """"balanced" | "compute" | "memory" | block counts "10,9,9" (summing to the blocks)."""
    if split in SPLITS:
        return split
    try:
        counts = [int(x) for x in str(split).split(",")]
    except ValueError:
        raise ValueError(f"pipefusion split {split!r} is not one of {SPLITS} or a list of "
                         f"block counts like '10,9'") from None
    if len(counts) != stages or sum(counts) != n_blocks or min(counts) < 1:
        raise ValueError(f"pipefusion split {split!r} must give {stages} positive block counts "
                         f"summing to the model's {n_blocks} blocks")
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


@dataclass(frozen=True)
class StageInfo:
    index: int
    count: int
    ranges: tuple  # ((start, stop), ...) of every stage, over the execution-order blocks
    n_blocks: int
    split: str

    @property
    def owned(self) -> tuple:
        return self.ranges[self.index]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def plan_stages(transformer, lists, stage: int, stages: int, split: str) -> StageInfo:
    """"balanced" (default): the least compute on the slowest stage such that no stage holds
    more than 1/N + 5% of the transformer's weights (FLUX's double blocks weigh ~2.4x a
    single block for the same work, so pure compute balance would overload stage 0's memory);
    "compute" / "memory": balance only that; or explicit block counts."""
    blocks = model_blocks(transformer, lists)
    ranges = parse_split(split, len(blocks), stages)
    if ranges == "balanced":
        weights = [block_cost(m, "memory") for _, _, m in blocks]
        total = sum(p.numel() for p in transformer.parameters())
        shared = total - sum(weights)
        ranges = partition([block_cost(m, "compute") for _, _, m in blocks], stages, weights,
                           cap=(1.0 / stages + WEIGHT_SLACK) * total - shared)
        if ranges is None:  # no split meets the memory bound: balance memory
            ranges = "memory"
    if isinstance(ranges, str):
        ranges = partition([block_cost(m, ranges) for _, _, m in blocks], stages)
    return StageInfo(index=stage, count=stages, ranges=tuple(ranges), n_blocks=len(blocks),
                     split=str(split))


def load_stage_transformer(transformer_class, folder: str, lists, stage: int, stages: int,
                           split: str, device, dtype, weights: str = "auto"):
    """Build the transformer with only stage `stage`'s blocks, reading only their tensors,
    each straight to `device` (weights.py). -> (transformer, StageInfo, LoadReport)"""
    from .meta import meta_transformer
    from .weights import load_folder

    tr = meta_transformer(transformer_class, folder)
    info = plan_stages(tr, lists, stage, stages, split)
    keep_stage_blocks(tr, lists, info)
    report = load_folder(tr, lists, folder, device, dtype, weights, names=list(tr.state_dict()))
    finish_stage(tr, lists, info)
    return tr, info, report


def keep_stage_blocks(transformer, lists, info: StageInfo) -> None:
    """Replace every block outside the stage by a weightless RemoteBlock."""
    lo, hi = info.owned
    for j, (name, i, _) in enumerate(model_blocks(transformer, lists)):
        if not lo <= j < hi:
            getattr(transformer, name)[i] = RemoteBlock(j)


def stage_block_names(transformer, lists, info: StageInfo) -> set:
    """Module names ("transformer_blocks.3") of the blocks this stage does NOT hold."""
    lo, hi = info.owned
    return {f"{name}.{i}" for j, (name, i, _) in enumerate(model_blocks(transformer, lists))
            if not lo <= j < hi}


def finish_stage(transformer, lists, info: StageInfo) -> None:
    """After the stage's tensors are assigned (workers/loading/weights.load_tensors, strict): check
    nothing is left on the meta device, then hook the stage boundaries."""
    leftover = [n for n, b in transformer.named_buffers() if b.is_meta]
    if leftover:
        raise RuntimeError(f"buffers {leftover} are not in the checkpoint; PipeFusion cannot "
                           f"build this transformer stage")
    transformer.eval().requires_grad_(False)
    install_stage_hooks(transformer, lists, info)


def install_stage_hooks(transformer, lists, info: StageInfo) -> None:
    # here, not at the top: the host's memory plan reads this module's split functions
    # without the worker's process-group modules
    from ..parallel.pipefusion.plan import PatchPlan

    current = _CurrentPlan()

    def _plan_of(kwargs):
        return ((kwargs.get("joint_attention_kwargs") or kwargs.get("attention_kwargs")
                 or {}).get("sp_plan"))

    def enter(module, args, kwargs):  # before the sequence-parallel hooks: the caller's plan
        current.plan = _plan_of(kwargs)

    def leave(module, args, output):
        current.plan = None
    transformer.register_forward_pre_hook(enter, with_kwargs=True)
    transformer.register_forward_hook(leave, always_call=True)

    def _patch_plan(kwargs):
        plan = _plan_of(kwargs) or current.plan
        if not isinstance(plan, PatchPlan):
            raise RuntimeError("a PipeFusion stage was called without a patch plan (this "
                               "pool holds one stage of the model; run it through PipeFusion)")
        return plan

    blocks = model_blocks(transformer, lists)
    for _, _, b in blocks:
        if isinstance(b, RemoteBlock):
            b.current = current
    lo, hi = info.owned
    if not info.first:
        def receive(module, args, kwargs):
            plan = _patch_plan(kwargs)
            if plan.states:  # several streams by keyword, each its own tensor (LTX-2)
                bufs = plan.activations.receive_states(plan)
                return args, dict(kwargs, **{k: b for (k, _), b in zip(plan.states, bufs)})
            if "hidden_states" not in kwargs:  # called positionally (Wan): the image alone
                return (plan.activations.receive(plan, True),) + tuple(args[1:]), kwargs
            if kwargs.get("encoder_hidden_states") is None or not plan.context_streams():
                # one joined stream (FLUX.2), or no text in the joint sequence
                return args, dict(kwargs, hidden_states=plan.activations.receive(plan, True))
            enc, hid = plan.activations.receive(plan)
            return args, dict(kwargs, hidden_states=hid, encoder_hidden_states=enc)
        blocks[lo][2].register_forward_pre_hook(receive, with_kwargs=True)
    if not info.last:
        def send(module, args, kwargs, output):
            plan = _patch_plan(kwargs)
            if plan.states:
                plan.activations.send_states(output)
            elif torch.is_tensor(output):  # one joined [text, image] stream (FLUX.2)
                plan.activations.send(None, output)
            else:
                plan.activations.send(output[0], output[1])
        blocks[hi - 1][2].register_forward_hook(send, with_kwargs=True)


def stage_of_rank(rank: int, pipefusion: int, inner: int) -> int:
    """Pipeline stage of a global rank (axes dp, cfg, pipefusion, ring, ulysses; `inner` =
    ring x ulysses), matching workers/parallel/topology.py."""
    return (rank // inner) % pipefusion
