"""Parallel configuration and the one place every degree is validated.

Validation runs on the host before any worker starts, so a bad configuration costs
nothing: the CLI exits 2 and a node shows one line naming every degree involved.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from comfyui_xdit.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover  (type names only: neither imports this module)
    from comfyui_xdit.planning.model_info import ModelInfo
    from comfyui_xdit.planning.request import GenerationRequest

__all__ = ["ConfigError", "EngineOptions", "ParallelConfig", "auto_config"]


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the xDiT methods. `world_size == dp * cfg * pipefusion * ulysses * ring`.

    `cfg_parallel` spreads a step's guidance passes over that many ranks: True is degree 2
    (the conditional and unconditional branch on different ranks), an int the degree (3 or
    4: a family's extra passes each on ranks of their own), False (0, 1) off.
    `world_size=None` means "the product of the degrees". `split`: how work is
    shared over ranks of different speed or memory: "even" (every rank alike), "auto"
    (measured per rank) or one weight per rank ("3,2"); every split is exact
    (workers/parallel/shares.py).
    """

    dp: int = 1
    cfg_parallel: bool | int = False  # True: degree 2; an int: the degree
    pipefusion: int = 1
    ulysses: int = 1
    ring: int = 1
    warmup_steps: int = 1
    pipeline_patches: Optional[int] = None  # PipeFusion patches per step (default: degree)
    pipefusion_split: str = "balanced"  # | "compute" | "memory" | block counts "10,9"
    world_size: Optional[int] = None
    split: object = "even"  # "even" | "auto" | "3,2" (or a tuple of weights)

    @property
    def cfg(self) -> int:
        """The cfg degree: True 2, False (or 0) 1, another int itself (`problems` checks it)."""
        c = self.cfg_parallel
        if isinstance(c, bool):
            return 2 if c else 1
        return c if isinstance(c, int) and c >= 1 else 1

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def product(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ulysses * self.ring

    @property
    def ranks(self) -> int:
        return self.world_size if self.world_size is not None else self.product

    def describe(self) -> str:
        return (f"dp {self.dp} x cfg {self.cfg} x pipefusion {self.pipefusion} x "
                f"ulysses {self.ulysses} x ring {self.ring}")

    def weights(self, measured=()) -> tuple:
        """The split's per-rank weights: () for even; `measured` (the pool's, per rank) for
        auto, even until something is measured."""
        from comfyui_xdit import bridge
        w = bridge.shares.parse_split(self.split, self.product)
        if w == "auto":
            w = tuple(measured or ())
            return w if len(w) == self.product else ()
        return w

    def branch_layout(self, family) -> tuple:
        """Each rank's guidance branch, the one transformer it loads, where the model has a
        transformer per branch (its family's BranchTransformers) and CFG parallel puts the
        branches on different ranks; () where every rank loads them all (no CFG parallel,
        PipeFusion, or a model of one transformer). Part of what the loaded weights depend
        on (`launch_key`)."""
        from comfyui_xdit import bridge
        spec = None if family is None else \
            family.capability(bridge.families.BranchTransformers)
        if spec is None or self.cfg < 2 or self.pipefusion > 1:
            return ()
        d = self.degrees()
        return tuple(spec.branches[d.coordinate(r, "cfg")] for r in range(self.ranks))

    def degrees(self, measured=()):
        """The layout the workers build their process groups on, by axis name (a
        workers/parallel/degrees.py `Degrees`; jobs and model calls carry it), with the
        split's weights (`measured`: auto's, per rank)."""
        from comfyui_xdit import bridge
        return bridge.degrees.Degrees(
            dp=self.dp, cfg=self.cfg, pipefusion=self.pipefusion, ulysses=self.ulysses,
            ring=self.ring, split=self.weights(measured))

    def launch_key(self, model=None) -> tuple:
        """What the workers' loaded weights depend on: under PipeFusion each rank holds one
        stage, so another pipeline layout needs a relaunch (other changes do not); for
        `model` (its ModelInfo) with a transformer per guidance branch, which branch each
        rank holds (`branch_layout`)."""
        branches = self.branch_layout(model.family) if model is not None else ()
        if branches:
            return (self.ranks, 1, branches)
        if self.pipefusion == 1:
            return (self.ranks, 1)
        return (self.ranks, self.pipefusion, self.sp, str(self.pipefusion_split),
                self.weights() if self.pipefusion_split == "balanced" else ())

    def stage_split(self, blocks: int, measured=()) -> str:
        """PipeFusion's `pipefusion_split` as the workers get it: where the split gives the
        stages uneven weights (each stage the sum of its ranks') and the stages are left
        "balanced", block counts by those weights ("12,7"); else as given. `auto` takes
        `measured`, the ranks' speeds known at launch (the pool's cache for these GPUs at
        this size), and keeps the balanced split while nothing is measured."""
        from comfyui_xdit import bridge
        if self.pipefusion == 1 or self.pipefusion_split != "balanced":
            return str(self.pipefusion_split)
        w = self.weights(measured)
        if not w:
            return "balanced"
        inner = self.sp
        stage_w = [sum(x for r, x in enumerate(w) if (r // inner) % self.pipefusion == s)
                   for s in range(self.pipefusion)]
        if bridge.shares.is_even(stage_w):
            return "balanced"
        return ",".join(str(n) for n in bridge.shares.sizes_for(blocks, self.pipefusion,
                                                                 tuple(stage_w)))

    def options(self) -> dict:
        """Per-job settings that are not process-group layout."""
        return {"warmup_steps": self.warmup_steps, "pipeline_patches": self.pipeline_patches}

    def with_world_size(self, n: Optional[int]) -> "ParallelConfig":
        return replace(self, world_size=n)

    def problems(self) -> list[str]:
        """Model-independent problems, each a phrase saying what is wrong and what would be right."""
        out = []
        for name in ("dp", "pipefusion", "ulysses", "ring"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{name} must be an integer >= 1 (got {v!r})")
        c = self.cfg_parallel
        if not isinstance(c, bool) and (not isinstance(c, int) or c < 0):
            out.append(f"cfg_parallel must be true, false or a degree >= 1 (got {c!r}); "
                       f"true is degree 2, one rank per guidance branch")
        if out:
            return out
        if self.cfg > 2 and self.pipefusion > 1:
            out.append(f"cfg-parallel {self.cfg} with pipefusion {self.pipefusion}: PipeFusion "
                       f"runs the cond and uncond passes only, so its cfg-parallel degree is "
                       f"2; use cfg-parallel 2")
        if self.world_size is not None and self.world_size != self.product:
            out.append(f"world size {self.world_size} != {self.describe()} = {self.product}; "
                       f"make the product of the degrees equal the world size")
        try:
            from comfyui_xdit import bridge
            bridge.shares.parse_split(self.split, self.product)
        except ValueError as e:
            out.append(str(e))
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            out.append(f"warmup_steps must be an integer >= 0 (got {self.warmup_steps!r})")
        if self.pipeline_patches is not None and (not isinstance(self.pipeline_patches, int)
                                                  or self.pipeline_patches < 1):
            out.append(f"pipeline_patches must be an integer >= 1 or unset "
                       f"(got {self.pipeline_patches!r})")
        split = str(self.pipefusion_split)
        if split not in ("balanced", "compute", "memory"):
            try:
                counts = [int(x) for x in split.split(",")]
            except ValueError:
                counts = []
            if len(counts) != self.pipefusion or min(counts or [0]) < 1:
                out.append(f"pipefusion_split {split!r} must be 'balanced', 'compute', 'memory' or "
                           f"{self.pipefusion} positive block counts like "
                           f"{','.join(['4'] * self.pipefusion)}")
        return out

    def validate(self, model: "ModelInfo | None" = None,
                 request: "GenerationRequest | None" = None) -> "ParallelConfig":
        """Raise one ConfigError listing every problem; return self when runnable."""
        out = self.problems()
        degrees_ok = not out
        blocks = getattr(model, "blocks", None)
        if blocks is not None and degrees_ok and self.pipefusion > blocks:
            out.append(f"pipefusion {self.pipefusion} exceeds the model's {blocks} transformer "
                       f"blocks; use pipefusion <= {blocks}")
        split = str(self.pipefusion_split)
        if blocks is not None and degrees_ok and self.pipefusion > 1 and "," in split:
            try:
                total = sum(int(x) for x in split.split(","))
            except ValueError:
                total = None
            if total is not None and total != blocks:
                out.append(f"pipefusion_split {split!r} covers {total} blocks but the model "
                           f"has {blocks}; give counts summing to {blocks}")
        if model is not None and degrees_ok and model.heads % self.ulysses:
            divisors = [d for d in range(1, model.heads + 1) if model.heads % d == 0]
            out.append(f"ulysses {self.ulysses} does not divide the model's {model.heads} "
                       f"attention heads (use one of {divisors})")
        if request is not None:
            req_problems = request.problems(model)
            out.extend(req_problems)
            n = request.batch
            if degrees_ok and n < self.dp:
                out.append(f"batch of {n} prompt(s) is smaller than dp {self.dp}; "
                           f"give at least {self.dp} prompts or lower dp")
            if degrees_ok and self.cfg > 1 and model is not None:
                passes = None if req_problems else guidance_passes(model, request)
                if passes is None and not request.uses_cfg(model) or \
                        passes is not None and len(passes) < 2:
                    out.append(f"cfg-parallel needs classifier-free guidance but cfg is "
                               f"{request.resolved_cfg(model)} for {model.arch}; "
                               f"set cfg > 1 or drop cfg-parallel")
                elif passes is not None:
                    from comfyui_xdit import bridge
                    refusal = bridge.messages.cfg_degree_refusal(self.cfg, passes)
                    out.extend([refusal] if refusal else [])
            if degrees_ok and not req_problems and self.sp > 1:
                # the image stream holds the latent's tokens (every frame's) and the
                # references'
                from comfyui_xdit.planning.request import families
                arch = getattr(model, "arch", None)
                frames = 1 if arch is None else \
                    families.family(arch).latent.latent_frames(request.frames)
                side = 16 if arch is None else families.family(arch).latent.pixels_per_token
                tokens = frames * (request.height // side) * (request.width // side) \
                    + request.reference_tokens(model)
                if tokens < self.sp:
                    out.append(f"{tokens} image tokens cannot be split over ulysses x ring = "
                               f"{self.sp} ranks; use a larger image or fewer ranks")
            from comfyui_xdit.planning.request import cache_problems, resolved_cache
            if self.pipefusion > 1 and not cache_problems(request.cache) \
                    and resolved_cache(request.cache) is not None:
                from comfyui_xdit import bridge
                out.append(bridge.messages.CACHE_WITH_PIPEFUSION)
            arch = getattr(model, "arch", None)
            if self.pipefusion > 1 and arch is not None:
                from comfyui_xdit.planning.request import families
                refusal = pipefusion_refusal(families.family(arch))
                if refusal:
                    out.append(refusal)
            if self.pipefusion > 1 and (request.reference_latents or request.reference_images) \
                    and arch is not None:
                from comfyui_xdit.planning.request import families
                fam = families.family(arch)
                # PipeFusion runs the references first: only where positions come from ids
                if fam.capability(families.References) and fam.tokens.latent.positions != "ids":
                    out.append(f"PipeFusion does not run {fam.name} reference images (its "
                               f"RoPE places them after the image); use ulysses, ring, "
                               f"cfg-parallel or dp")
            if degrees_ok and not req_problems and self.pipefusion > 1:
                rows, cols = request.height // 16, request.width // 16
                patches = min(self.pipeline_patches or self.pipefusion, rows)
                if (rows // patches) * cols < self.sp:
                    out.append(f"a PipeFusion patch of {rows // patches} token rows x {cols} "
                               f"cannot be split over ulysses x ring = {self.sp} ranks; use "
                               f"fewer pipeline_patches or a larger image")
        if out:
            raise ConfigError("invalid configuration: " + "; ".join(out))
        return self


def guidance_passes(model, request) -> tuple:
    """The names of the step's guidance passes `request` runs on `model` (its family's), which
    cfg-parallel's degree may not exceed."""
    from comfyui_xdit.planning.request import families
    return families.guidance_pass_names(families.family(model.arch), request.extra_guidance,
                                        request.resolved_cfg(model))


def pipefusion_refusal(fam) -> Optional[str]:
    """Why PipeFusion does not run a family (its `families.Family`); None where it runs: a
    model with a transformer per guidance branch is not staged yet. The memory plan offers
    PipeFusion only where this is None."""
    from comfyui_xdit import bridge
    if fam.capability(bridge.families.BranchTransformers) is not None:
        return (f"PipeFusion does not run {fam.name} yet: each stage would hold its blocks "
                f"of every guidance branch's transformer; use ulysses, ring, cfg-parallel "
                f"or dp")
    return None


def auto_config(world_size: int, heads: int, uses_cfg: bool, batch: int) -> ParallelConfig:
    """A good split for `world_size` ranks: cfg first (no communication inside a step),
    then Ulysses up to the largest degree dividing the heads, then Ring for the rest."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1 (got {world_size})")
    rest = world_size
    cfg = uses_cfg and rest % 2 == 0
    if cfg:
        rest //= 2
    ulysses = max(d for d in range(1, rest + 1) if rest % d == 0 and heads % d == 0)
    ring = rest // ulysses
    return ParallelConfig(cfg_parallel=cfg, ulysses=ulysses, ring=ring)


ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "torch")
WEIGHTS = ("auto", "fp8", "full")
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class EngineOptions:
    """How each rank runs the model, fixed for the life of a pool (a change relaunches it).

    attention:     the attention kernel, chosen once per pool (workers/parallel/attention.py): "auto"
                   picks the fastest this device has; "cudnn", "flash" (flash-attn) and
                   "efficient" force one on CUDA; "torch" means torch's SDPA choice.
    compile:       torch.compile of the transformer blocks (regional), during warm-up.
    weights:       "auto" keeps the checkpoint's storage (an fp8 file stays fp8 on the GPU,
                   anything else is cast to `dtype`); "fp8" stores the block weights in fp8
                   e4m3fn (half of bf16's memory) and computes in `dtype`; "full" casts every
                   weight to `dtype`, fp8 files included.
    text_encoders: where rank 0 runs T5/CLIP: "auto" (rank 0's GPU when they fit beside the
                   transformer, else the CPU), "cpu", "gpu" (rank 0's GPU) or "cuda:N".
    shard_weights: FSDP2-shard the transformer's block weights over every rank (each block
                   gathered just before it runs); exact, for models larger than one GPU.
    shard_split:   each rank's share of the sharded weights: "even" (FSDP2's equal chunks),
                   "memory" (in proportion to each rank's GPU memory: 24 GB beside 16 GB
                   hold 3:2) or one weight per rank, "3,2" (workers/parallel/uneven_sharding.py;
                   exact either way). Fixed at launch: another split relaunches.
    """

    device: str = "cpu"
    dtype: str = "fp32"
    attention: str = "auto"
    compile: bool = False
    weights: str = "auto"
    text_encoders: str = "auto"
    shard_weights: bool = False
    shard_split: object = "even"  # "even" | "memory" | "3,2" (or a tuple of weights)

    def problems(self) -> list[str]:
        out = []
        split = self.shard_split
        if isinstance(split, str) and split.strip().lower() == "memory" and \
                self.shard_weights and self.device != "cuda":
            out.append(f"shard_split 'memory' reads each GPU's memory and needs device cuda "
                       f"(got {self.device}); give one weight per rank, e.g. 3,2")
        if isinstance(split, str) and split.strip().lower() in ("auto",):
            out.append("shard_split must be 'even', 'memory' or one weight per rank like "
                       "3,2 (the weights are placed at launch, before anything is measured)")
        elif not (isinstance(split, str) and split.strip().lower() in ("even", "memory", "")):
            try:
                from comfyui_xdit import bridge
                w = bridge.shares.parse_split(split, len(str(split).split(","))
                                              if isinstance(split, str) else len(split))
            except ValueError:
                out.append(f"shard_split {split!r} must be 'even', 'memory' or one positive "
                           f"weight per rank like 3,2")
            else:
                if w and not self.shard_weights:
                    out.append(f"shard_split {split!r} needs shard_weights on (it sizes "
                               f"each rank's shard of the weights)")
        if self.device not in ("cpu", "cuda"):
            out.append(f"device must be cpu or cuda (got {self.device!r})")
        if self.dtype not in DTYPES:
            out.append(f"dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.attention not in ATTENTION_BACKENDS:
            out.append(f"attention must be one of {', '.join(ATTENTION_BACKENDS)} "
                       f"(got {self.attention!r})")
        elif self.attention in ("cudnn", "flash", "efficient") and self.device != "cuda":
            out.append(f"attention {self.attention!r} is a CUDA kernel and needs device cuda; "
                       f"use 'auto' or 'torch' on {self.device}")
        if not isinstance(self.shard_weights, bool):
            out.append(f"shard_weights must be true or false (got {self.shard_weights!r})")
        if not isinstance(self.compile, bool):
            out.append(f"compile must be true or false (got {self.compile!r})")
        if self.weights not in WEIGHTS:
            out.append(f"weights must be one of {', '.join(WEIGHTS)} (got {self.weights!r})")
        te = str(self.text_encoders)
        if not (te in ("auto", "cpu", "gpu") or (te.startswith("cuda:") and te[5:].isdigit())):
            out.append(f"text_encoders must be auto, cpu, gpu or cuda:N (got {te!r})")
        elif te != "auto" and te != "cpu" and self.device != "cuda":
            out.append(f"text_encoders {te!r} needs device cuda; use 'auto' or 'cpu'")
        if self.compile is True and self.shard_weights is True:
            out.append("compile and shard_weights together are not supported yet (compile is "
                       "not validated with FSDP's per-block hooks); choose one")
        return out

    def problems_with(self, config: "ParallelConfig") -> list[str]:
        """What these options cannot run together with a parallel layout (checked on the host
        before any launch; the workers refuse the same combinations as a second line)."""
        out = []
        split = self.shard_split
        if not (isinstance(split, str) and split.strip().lower() in ("even", "memory", "",
                                                                      "auto")):
            n = len(str(split).split(",")) if isinstance(split, str) else len(split)
            if n != config.ranks:
                out.append(f"shard_split {split!r} gives {n} weights for {config.ranks} "
                           f"ranks; give one weight per rank (e.g. "
                           f"{','.join(['1'] * config.ranks)}) or 'memory'")
        if self.shard_weights and config.pipefusion > 1:
            out.append(f"shard_weights cannot be combined with pipefusion {config.pipefusion}: "
                       f"PipeFusion already splits the blocks over its stages, so the sharded "
                       f"blocks' all-gathers over every rank would never line up; use "
                       f"ulysses/ring/cfg/dp with shard_weights, or a pool without "
                       f"shard_weights for PipeFusion")
        if self.compile and config.pipefusion > 1:
            out.append("compile is not supported with PipeFusion (its per-patch K/V-cache "
                       "attention would recompile per patch); drop compile or pipefusion")
        return out

    def shard_weights_for(self, ranks: int, gpu_memory=None) -> tuple:
        """The shard split's per-rank weights for a launch of `ranks` ranks: () for even
        (or without sharding); "memory" takes `gpu_memory`, one size per rank (bytes or GiB;
        a ConfigError where a size is unknown)."""
        from comfyui_xdit import bridge
        if not self.shard_weights or ranks < 2:
            return ()
        split = self.shard_split
        if isinstance(split, str) and split.strip().lower() == "memory":
            sizes = list(gpu_memory or [])
            if len(sizes) != ranks or any(s is None or s <= 0 for s in sizes):
                raise ConfigError(f"shard_split 'memory' needs each of the {ranks} GPUs' "
                                  f"memory (got {sizes or 'none'}: nvidia-smi did not say, or "
                                  f"the device is not cuda); give the weights, e.g. "
                                  f"shard_split='3,2'")
            return bridge.shares.parse_split(tuple(float(s) for s in sizes), ranks)
        try:
            w = bridge.shares.parse_split(split, ranks)
        except ValueError as e:
            raise ConfigError(f"shard_split: {e}") from None
        return () if w == "auto" else w

    def validate(self) -> "EngineOptions":
        out = self.problems()
        if out:
            raise ConfigError("invalid engine options: " + "; ".join(out))
        return self

    def worker_argv(self) -> list[str]:
        """The matching `workers.runtime.serve` flags."""
        argv = ["--device", self.device, "--dtype", self.dtype, "--attention", self.attention,
                "--weights", self.weights, "--text-encoders", str(self.text_encoders)]
        if self.compile:
            argv.append("--compile")
        if self.shard_weights:
            argv.append("--shard-weights")
        return argv
