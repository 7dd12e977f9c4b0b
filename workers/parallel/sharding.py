"""Weight sharding (`EngineOptions.shard_weights`, `--shard-weights`): torch's FSDP2 over the
pool, so a model larger than one GPU runs exactly with Ulysses, Ring, hybrid, CFG and DP.
An uneven `--shard-split` (GPUs of different memory) shards the same units with each rank's
rows by its weight instead (workers/parallel/uneven_sharding.py; FSDP2 splits evenly only);
`ShardSetup.wrap` picks which, and everything else here serves both.

What is sharded: every block of the adapter's block lists (FLUX `transformer_blocks` +
`single_transformer_blocks`, SD3 `transformer_blocks`) is its own `fully_shard` unit, and the
transformer itself is the root unit, which shards what is left (embedders, `norm_out`,
`proj_out`). Every parameter is split on dim 0 over the whole world (one 1-D device mesh on a
process group of its own, so FSDP's all-gathers never interleave with the other data-plane
traffic of the world group); a model with a transformer per guidance branch under CFG
parallel (`--branch-layout`) shards each branch's over that branch's ranks only, the ranks
that run it (a branch on one rank keeps it whole, through the uneven split). Between forwards a rank holds 1/N of every weight (plus FSDP's
dim-0 padding).

What happens in a forward: the root's pre-forward all-gathers the non-block parameters (kept
for the whole forward, freed after it: `reshard_after_forward=True` is set explicitly, which
also overrides FSDP's "root stays unsharded" default) and prefetches block 0; each block's
pre-forward waits for its own all-gather and issues the next block's
(`set_modules_to_forward_prefetch`, a chain in execution order), so the next gather overlaps
this block's compute; its post-forward frees the gathered weights. Peak: 1/N of the weights
+ the non-block weights + two gathered blocks (this one and the prefetched one).

Exactness: an all-gather copies bits, so each block computes with exactly the weights of the
unsharded model; nothing in the arithmetic changes.

The rule that keeps it from deadlocking: FSDP's all-gathers are collectives over the whole
world, so every rank must run every block's forward the same number of times, in the same
order. The denoising loop does (CFG parallel: one branch per rank per step; DP with uneven
batches: every replica steps every tick); host-sampler calls (workers/sampling/model_call.py) run a
dummy one-row forward on a replica that got no rows. PipeFusion (each rank runs only its
stage's blocks) is refused, and so is `compile` (not validated with FSDP's hooks).

LoRA: peft wraps a block's Linear in a LoRA layer that keeps the original Linear as
`base_layer`; FSDP keeps managing that Linear's (sharded) weight, so the base weight is
gathered as before, and the small LoRA A/B matrices are ordinary, replicated parameters
beside it. The result equals the unsharded model with the same adapters.

Loading fits the sharding (`ShardSetup`, made before the load): a diffusers folder with
safetensors or a single file is read shard-only (workers/loading/shards.py: the transformer is
sharded while still on the meta device, each rank reads its rows); .bin weights load whole
(workers/loading/weights.py), then shard. `counts()["load"]` says which happened.

What a rank holds (`counts()`, in `status` and every job's stats) is read from FSDP's
buffers once per call. Per-forward counting and residency peaks are test instrumentation
(xdit_testhooks/sharding_probe.py), attached through the `sharding_probe` hook option; the
memory and traffic figures are the host's memory plan
(comfyui_xdit/planning/memory_arithmetic.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .shard_counts import sharding_counts

PIPEFUSION_REFUSED = ("shard_weights cannot be combined with PipeFusion: PipeFusion already "
                      "splits the blocks over its stages, and each stage runs only its own "
                      "blocks, so FSDP's all-gathers over every rank would never line up; "
                      "launch the pool without pipefusion (Ulysses, Ring, CFG and DP combine "
                      "with shard_weights), or without shard_weights")
COMPILE_REFUSED = ("shard_weights and compile together are not supported yet (compile has "
                   "not been validated with FSDP's hooks); launch with one of them")


def check(shard_weights: bool, pipefusion: int, compile: bool = False) -> None:
    """Raise the one clear message for a launch sharding cannot serve (worker side)."""
    if not shard_weights:
        return
    if pipefusion > 1:
        raise ValueError(PIPEFUSION_REFUSED)
    if compile:
        raise ValueError(COMPILE_REFUSED)


def is_sharded(module) -> bool:
    """Whether `module` is a sharded unit, FSDP2's or the uneven split's (its forwards then
    take part in collectives)."""
    if getattr(module, "_xdit_sharded", False):  # workers/parallel/uneven_sharding.py
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, FSDPModule)


def param_groups(module) -> list:
    """The FSDPParamGroups of one fully_shard unit (torch internals, for counting only)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return list(groups)


def _held(tensor) -> int:
    """Elements whose storage is allocated now (FSDP frees by resizing the storage to 0)."""
    try:
        if tensor.untyped_storage().size() == 0:
            return 0
    except Exception:  # noqa: BLE001
        return 0
    return int(tensor.numel())


def group_elems(group) -> tuple:
    """(local shard elements, gathered elements allocated now) of one FSDPParamGroup."""
    shard, gathered = 0, 0
    for fp in group.fsdp_params:
        shard += int(fp._sharded_param_data.numel())
        for t in getattr(fp, "all_gather_outputs", []) or []:
            gathered += _held(t)
    pending = getattr(group, "_all_gather_result", None)  # a prefetch in flight
    if pending is not None and not gathered:
        # its flat receive buffer (bytes when the dtypes are mixed, e.g. fp8 + bias): count
        # the parameters it will hold, so every figure here is in parameter elements
        out = getattr(pending, "all_gather_output", None)
        if out is not None and _held(out):
            gathered += sum(int(torch.Size(fp._orig_size).numel()) for fp in group.fsdp_params)
    return shard, gathered


class WeightSharding:
    """fully_shard over the blocks and the root of one transformer, and what a rank holds."""

    def __init__(self, transformer, block_lists, group, device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.mesh = DeviceMesh.from_group(group, torch.device(device).type)
        self.world = self.mesh.size()
        self.blocks = [b for name in block_lists for b in getattr(transformer, name)]
        if not self.blocks:
            raise RuntimeError("no transformer blocks to shard")
        self.block_numels = [sum(p.numel() for p in b.parameters()) for b in self.blocks]
        block_ids = {id(p) for b in self.blocks for p in b.parameters()}
        self.root_numel = sum(p.numel() for p in transformer.parameters()
                              if id(p) not in block_ids)
        for b in self.blocks:
            fully_shard(b, mesh=self.mesh, reshard_after_forward=True)
        fully_shard(transformer, mesh=self.mesh, reshard_after_forward=True)
        self.transformer = transformer
        # explicit prefetch chain, in execution order: root -> block 0 -> block 1 -> ...
        transformer.set_modules_to_forward_prefetch([self.blocks[0]])
        for a, b in zip(self.blocks, self.blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
        self.load_mode = None  # "shards only" | "whole, then sharded" (ShardSetup.finish)
        self.probe = None  # test instrumentation (the `sharding_probe` hook option)
        # the model's other transformers, each sharded as this one (Wan 2.2's second
        # expert): counted with it
        self.others: list = []

    def block_resident(self) -> int:
        """Block parameter elements allocated on this rank now (shards + any gathered)."""
        return sum(sum(group_elems(g)) for b in self.blocks for g in param_groups(b))

    # what the shard-only loader calls (workers/loading/shards.py), as on the uneven split's
    def materialize(self, device) -> None:
        self.transformer.to_empty(device=device)

    def local_params(self) -> dict:
        return {n: (p.to_local() if hasattr(p, "to_local") else p)
                for n, p in self.transformer.named_parameters()}

    def row_range(self, name: str, rows: int) -> tuple:
        """FSDP2's dim-0 split (torch.chunk): rows [start, stop) of this rank."""
        per = -(-rows // self.world)
        start = min(self.mesh.get_local_rank() * per, rows)
        return start, min(start + per, rows)

    def shard_bytes(self) -> int:
        """Bytes of this rank's padded shards (an all-gather's input)."""
        return sum(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size()
                   for m in [self.transformer, *self.blocks]
                   for g in param_groups(m) for fp in g.fsdp_params)

    def received_per_forward(self) -> int:
        return (self.world - 1) * self.shard_bytes()

    def counts(self) -> dict:
        """What this rank holds, in parameter elements (plus the probe's readings)."""
        return sharding_counts(
            self, sum(group_elems(g)[0] for b in self.blocks for g in param_groups(b)),
            sum(group_elems(g)[0] for g in param_groups(self.transformer)))


def unsharded_counts(transformer, block_lists) -> dict:
    """The same block counts for a pool without sharding (every rank holds every weight);
    the model's own weights only, not LoRA adapters a job added (as the sharded count,
    taken when the blocks were sharded)."""
    numels = [sum(p.numel() for n, p in b.named_parameters() if "lora_" not in n)
              for name in block_lists for b in getattr(transformer, name)]
    return {"ranks": 1, "block_params": sum(numels), "largest_block_params": max(numels),
            "block_params_local": sum(numels)}


def job_counts(worker) -> dict:
    """What a job's stats report about weight residency on this rank."""
    if worker.sharding is not None:
        return worker.sharding.counts()
    return unsharded_counts(worker.model.transformer, worker.adapter.block_lists)


class ShardSetup:
    """What `--shard-weights` prepares before the load (the group: a collective, so before
    the ranks may load in turn) and finishes after it. It is also what the shard-only loader
    shards with (`wrap`, `rank`, `world`, `control`). `planes`: the pool's world
    (topology.World); `load_problem`: why the transformer cannot be read shard by shard ("" when
    it can: workers/loading/shards.py `direct_load_problem`)."""

    def __init__(self, args, planes, block_lists, load_problem: str):
        from .topology import control_group, device_group

        check(True, args.pipefusion, getattr(args, "compile", False))
        self.device, self.block_lists = planes.device, block_lists
        # the ranks this rank's transformer is sharded over: every rank, or, where each cfg
        # rank holds only its guidance branch's transformer (`--branch-layout`), the ranks
        # of its branch, which alone run that transformer (a gather over every rank would
        # pair this transformer's blocks with the other branch's)
        parts = branch_parts(getattr(args, "branch_layout", None), planes.size)
        members = next(p for p in parts if planes.rank in p)
        self.rank, self.world = members.index(planes.rank), len(members)
        self.alone = len(members) == 1  # one rank holds it: a branch alone, or a 1-rank pool
        # a device group of its own for FSDP's all-gathers (NCCL on GPUs, gloo on CPU and in
        # the shared-GPU test mode: the world group's backend), so they never interleave
        # with the world group's other data-plane traffic; its control twin (fp8 scales).
        # Every rank creates every part's groups in the same order (a collective).
        self.control = planes.control
        for part in parts:
            group = device_group(part, like=planes.data)
            control = planes.control if len(parts) == 1 else control_group(part)
            if part is members:
                self.group, self.control = group, control
        # per-rank weights for the shards' sizes (`--shard-split`, GPUs of different
        # memory); () even: FSDP2, else workers/parallel/uneven_sharding.py
        from .shares import parse_split
        w = parse_split(getattr(args, "shard_split", "") or "even", planes.size)
        if w == "auto":
            raise ValueError("shard_split is fixed at launch: give 'even', weights like 3,2, "
                             "or let the host turn 'memory' into weights")
        self.weights = tuple(w[r] for r in members) if w else w
        self.fallback = load_problem
        if not self.fallback and getattr(args, "weights", "auto") == "fp8" and \
                getattr(args, "load_in_turn", False) and planes.size > 1:
            self.fallback = ("weights=fp8 shares the scales over every rank while loading, "
                             "which ranks loading in turn cannot")
        self.sharding: Optional[WeightSharding] = None

    @property
    def direct(self) -> bool:
        return not self.fallback

    def wrap(self, transformer) -> WeightSharding:
        """Shard `transformer` (on the meta device while loading shard-only). A model's
        second transformer (Wan 2.2's low-noise expert) is sharded the same way and counted
        with the first (`WeightSharding.others`): every rank runs the same expert each step,
        so its all-gathers line up as the first one's do."""
        if self.weights or self.alone:
            # (FSDP2 over a branch's group of one rank fails under inference mode; the
            # uneven split holds the whole transformer there, its gathers its own rows)
            from .uneven_sharding import UnevenWeightSharding
            made = UnevenWeightSharding(transformer, self.block_lists, self.group,
                                        self.device, self.weights or (1.0,), self.rank)
        else:
            made = WeightSharding(transformer, self.block_lists, self.group, self.device)
        if self.sharding is None:
            self.sharding = made
        else:
            self.sharding.others.append(made)
        return made

    def finish(self, worker) -> WeightSharding:
        """After the load: the sharding (a whole-loaded transformer is sharded now)."""
        if self.sharding is None:
            for tr in worker.model.transformers():
                self.wrap(tr)
            report = getattr(worker.model, "load_report", None)
            if isinstance(report, dict):
                report["loaded"] = f"whole, then sharded ({self.fallback})"
            self.sharding.load_mode = "whole, then sharded"
        else:
            self.sharding.load_mode = "shards only"
        for o in self.sharding.others:
            o.load_mode = self.sharding.load_mode
        probe = worker.hook_options.get("sharding_probe")  # xdit_testhooks.probes
        if probe is not None:
            self.sharding.probe = probe(self.sharding)
        return self.sharding


def branch_parts(layout, size: int) -> list:
    """The sets of ranks weight sharding spreads a transformer over: `layout` ("uncond,cond",
    one guidance branch per rank: `--branch-layout`) gives the ranks of each branch, in order
    of their first rank; None or "" (every rank holds every transformer) the whole world."""
    if not layout:
        return [list(range(size))]
    branches = layout.split(",")
    if len(branches) != size:
        raise ValueError(f"--branch-layout {layout!r} names {len(branches)} ranks; the pool "
                         f"has {size}")
    order = list(dict.fromkeys(branches))
    return [[r for r, b in enumerate(branches) if b == name] for name in order]


def begin(args, planes, block_lists, load_problem: str) -> Optional[ShardSetup]:
    """Worker hook before the load (every rank at once): None without `--shard-weights`."""
    if not getattr(args, "shard_weights", False):
        return None
    return ShardSetup(args, planes, block_lists, load_problem)


def shard_after_load(worker) -> Optional[WeightSharding]:
    """Worker hook after the load: the transformer's sharding, or None without
    `--shard-weights` (a pool whose `begin` was not called shards the loaded model here)."""
    setup = getattr(worker, "shard_setup", None)
    if setup is None:
        if not getattr(worker.args, "shard_weights", False):
            return None
        setup = ShardSetup(worker.args, worker.planes, worker.adapter.block_lists,
                           "loaded before sharding was set up")
    return setup.finish(worker)
