"""Regional `torch.compile` of the transformer blocks (`EngineOptions.compile`, `--compile`).

What is compiled: each block of the adapter's block lists (FLUX `transformer_blocks` and
`single_transformer_blocks`, SD3 `transformer_blocks`), one `Module.compile()` per block.
Blocks of one class share their code objects, and dynamo guards on the parameters as graph
inputs, not on the block's identity, so a model's N identical blocks cost one compile per
block class, not N. Everything outside the blocks (embedders, the sequence-parallel hooks on
the transformer and its non-block submodules, proj_out's gather) stays eager.

Collectives stay out of the graphs: the sharded attention object every parallel attention
processor calls is wrapped in `outside()`, a `torch.compiler.disable` boundary, so a block
compiles into the part before attention (norms, modulation, projections, RoPE) and the part
after it, and the all-to-all / ring exchange runs eagerly between them. That depends only on
"the processor calls the attention object it was built with", not on how attention works.

When: on the first job. The pool learns the sizes only with a job, and a warm-up forward at a
guessed size would compile a static graph the real job misses (then a second, dynamic compile).
While dynamo compiles during a job, rank 0 emits `{"phase": "compiling", ...}` events (the
host shows them; they also keep the host's step timeout alive) and `describe()` reports
`compile.state == "compiling"`.

Shape changes: dynamo's automatic dynamic shapes recompile once with the changed dims made
symbolic, after which other sizes/batches reuse that graph (batch 1 stays a specialised graph,
dynamo's 0/1 rule): a handful of recompiles per block class, never one per size.
`RECOMPILE_LIMIT` bounds them; past it dynamo runs the frame eagerly (correct, slower).
Recompiles are counted in the job stats.

LoRA: peft's layers replace Linear modules inside the blocks and switch adapters through
module attributes; dynamo guards on both, so loading, switching or re-weighting a LoRA after
compile recompiles (or reuses a matching graph) and never runs a stale graph.

PipeFusion is refused (`check`): its per-patch K/V-cache attention and patch sizes would
recompile per patch and have not been validated compiled.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable, Optional

import torch

RECOMPILE_LIMIT = 16  # per code object (dynamo's default is 8; LoRA switching adds entries)

PIPEFUSION_REFUSED = ("compile is not supported with PipeFusion (its per-patch K/V-cache "
                      "attention would recompile per patch); launch the pool without "
                      "compile, or without pipefusion")


def check(compile: bool, pipefusion: int) -> None:
    """Raise the one clear message for a launch compile cannot serve."""
    if compile and pipefusion > 1:
        raise ValueError(PIPEFUSION_REFUSED)


class _Outside:
    """`fn` called outside any compiled region (a graph break around it): used for the
    sharded attention, whose collectives must not be traced. Attribute reads pass through."""

    def __init__(self, fn):
        self.__dict__["_fn"] = fn

    def __call__(self, *args, **kwargs):
        return _call_eager(self._fn, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["_fn"], name)


@torch.compiler.disable(recursive=True)
def _call_eager(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _compile_id(args) -> tuple:
    """(frame, attempt) of dynamo's compile id ('3/1' -> (3, 1)); attempt > 0 is a recompile
    of a frame compiled before."""
    nums = re.findall(r"\d+", str(getattr(args, "compile_id", "") or ""))
    if len(nums) >= 2:
        return int(nums[-2]), int(nums[-1])
    return -1, 0


def _is_dynamo(args) -> bool:
    trigger = getattr(args, "callback_trigger", None)
    return trigger is None or getattr(trigger, "name", "DYNAMO") == "DYNAMO"


class Compiler:
    """One per worker: compiles the blocks once, counts compiles, reports progress."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self.blocks = 0
        self.compiles = 0  # dynamo frame compilations, whole life of the worker
        self.recompiles = 0  # of those, frames compiled again (a guard failed: shape, LoRA...)
        self.seconds = 0.0
        self.jobs = 0
        self.state = "off" if not self.enabled else "not compiled yet"
        self._emit: Optional[Callable[[dict], None]] = None
        self._lock = threading.Lock()
        self._t0 = None

    # -- setup ---------------------------------------------------------------------------------
    def install(self, transformer, block_lists, backend: str = "inductor") -> None:
        """Mark every block for compilation (lazy: nothing compiles until the first job).
        `backend`: tests trace with "eager" to check graph reuse without code generation."""
        if not self.enabled:
            return
        import torch._dynamo
        from torch._dynamo.callback import on_compile_end, on_compile_start

        cfg = torch._dynamo.config
        on_cpu = all(p.device.type == "cpu" for p in transformer.parameters())
        if on_cpu:  # ranks share the cores: no pool of compile subprocesses beside them
            import torch._inductor.config as inductor
            inductor.compile_threads = 1
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
        for lname in block_lists:
            for block in getattr(transformer, lname, None) or []:
                block.compile(backend=backend)
                self.blocks += 1
        on_compile_start(self._started)
        on_compile_end(self._ended)

    def outside(self, attention):
        """The attention object a parallel processor calls, kept out of compiled graphs."""
        return _Outside(attention) if self.enabled else attention

    # -- dynamo callbacks ----------------------------------------------------------------------
    def _started(self, args) -> None:
        if not _is_dynamo(args):  # CUDA-graph recording, lazy backward: not a compile
            return
        with self._lock:
            self._t0 = time.perf_counter()
            frame, attempt = _compile_id(args)
            self.compiles += 1
            if attempt > 0:
                self.recompiles += 1
            self.state = "compiling"
            n = self.compiles
            emit = self._emit
        if emit is not None:
            emit({"phase": "compiling", "compiles": n, "compile_s": self.seconds})

    def _ended(self, args) -> None:
        if not _is_dynamo(args):
            return
        with self._lock:
            if self._t0 is not None:
                self.seconds += time.perf_counter() - self._t0
                self._t0 = None
            self.state = "compiled"

    # -- per job -------------------------------------------------------------------------------
    def job(self, emit=None):
        """Context manager around one job's denoising: `emit` receives the compiling events;
        `.stats` then holds this job's compile figures."""
        return _JobScope(self, emit)

    def describe(self) -> dict:
        return {"enabled": self.enabled, "state": self.state, "blocks": self.blocks,
                "compiles": self.compiles, "recompiles": self.recompiles,
                "compile_s": round(self.seconds, 3), "jobs": self.jobs}


class _JobScope:
    def __init__(self, compiler: Compiler, emit):
        self.c, self.emit = compiler, emit
        self.stats: dict = {}

    def __enter__(self):
        c = self.c
        self.before = (c.compiles, c.recompiles, c.seconds)
        c._emit = self.emit
        return self

    def __exit__(self, *exc):
        c = self.c
        c._emit = None
        if c.enabled:
            c.jobs += 1
            if c.state == "compiling":  # an exception inside a compile
                c.state = "compiled"
        n0, r0, s0 = self.before
        self.stats = {"enabled": c.enabled, "compiles": c.compiles - n0,
                      "recompiles": c.recompiles - r0, "compile_s": c.seconds - s0,
                      "compiles_total": c.compiles, "recompiles_total": c.recompiles}
        return False
