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

CUDA graphs (on CUDA; `XDIT_CUDA_GRAPHS=0` turns them off): the blocks compile in
`reduce-overhead` mode, so inductor captures each compiled region into a CUDA graph (one
tree per pool: the regions of one forward are recorded in order, in one memory pool) and
replays it: a block's hundreds of kernel launches become one, which is what keeps many
small per-rank shares of a step from being launch-bound. Collectives stay at the regions'
boundaries (the `outside()` attention above), never inside a graph. A forward pre-hook on the
transformer marks each forward as a new step for the graph trees (the last step's outputs
are dead by then). Captures are counted (`graph_records`) and each job's stats say how many
it recorded. Bounded: the static graph of the first size (and batch 1) is captured once;
sizes served by the dynamic recompile run compiled without graphs
(`cudagraph_skip_dynamic_graphs`), rather than capturing a new set of graphs per size.

PipeFusion is refused (`check`): its per-patch K/V-cache attention and patch sizes would
recompile per patch and have not been validated compiled.
"""
from __future__ import annotations

import os
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


def _trigger(args) -> str:
    trigger = getattr(args, "callback_trigger", None)
    return "DYNAMO" if trigger is None else getattr(trigger, "name", "DYNAMO")


def _is_dynamo(args) -> bool:
    return _trigger(args) == "DYNAMO"


def _new_graph_step(module, args):
    """Each transformer forward is a new step for inductor's CUDA graph trees: the graphs
    may reuse the previous forward's output memory (nothing holds it by then)."""
    torch.compiler.cudagraph_mark_step_begin()


def cuda_graphs_wanted(on_cuda: bool) -> bool:
    """CUDA graphs with `compile` on CUDA unless XDIT_CUDA_GRAPHS=0 (read at worker start)."""
    return on_cuda and os.environ.get("XDIT_CUDA_GRAPHS", "1") != "0"


class Compiler:
    """One per worker: compiles the blocks once, counts compiles, reports progress."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self.cuda_graphs = False  # decided at install (the weights' device)
        self.graph_records = 0  # CUDA graph captures, whole life of the worker
        self.blocks = 0
        self.compiles = 0  # dynamo frame compilations, whole life of the worker
        self.recompiles = 0  # of those, frames compiled again (a guard failed: shape, LoRA...)
        self.seconds = 0.0
        self.jobs = 0
        self.state = "off" if not self.enabled else "not compiled yet"
        self._emit: Optional[Callable[[dict], None]] = None
        self._lock = threading.Lock()
        self._t0 = None
        self._hooked = False  # dynamo's compile callbacks registered

    # -- setup ---------------------------------------------------------------------------------
    def install(self, transformer, block_lists, backend: str = "inductor") -> None:
        """Mark every block for compilation (lazy: nothing compiles until the first job).
        `backend`: tests trace with "eager" to check graph reuse without code generation."""
        if not self.enabled:
            return
        import torch._dynamo
        from torch._dynamo.callback import on_compile_end, on_compile_start

        import torch._inductor.config as inductor

        cfg = torch._dynamo.config
        on_cpu = all(p.device.type == "cpu" for p in transformer.parameters())
        if on_cpu:  # ranks share the cores: no pool of compile subprocesses beside them
            inductor.compile_threads = 1
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
        self.cuda_graphs = backend == "inductor" and cuda_graphs_wanted(
            any(p.device.type == "cuda" for p in transformer.parameters()))
        mode = None
        if self.cuda_graphs:
            mode = "reduce-overhead"
            inductor.triton.cudagraph_skip_dynamic_graphs = True  # bounded captures (doc)
            transformer.register_forward_pre_hook(_new_graph_step)
        for lname in block_lists:
            for block in getattr(transformer, lname, None) or []:
                block.compile(backend=backend, mode=mode)
                self.blocks += 1
        if not self._hooked:  # once per worker, however many transformers (Wan's experts)
            self._hooked = True
            on_compile_start(self._started)
            on_compile_end(self._ended)

    def outside(self, attention):
        """The attention object a parallel processor calls, kept out of compiled graphs."""
        return _Outside(attention) if self.enabled else attention

    # -- dynamo callbacks ----------------------------------------------------------------------
    def _started(self, args) -> None:
        if _trigger(args) == "CUDAGRAPH_RECORDING":
            with self._lock:
                self.graph_records += 1
                emit = self._emit
            if emit is not None and self.graph_records % 16 == 1:  # a capture takes ms
                emit({"phase": "compiling", "compiles": self.compiles,
                      "compile_s": self.seconds, "detail": "capturing CUDA graphs"})
            return
        if not _is_dynamo(args):  # lazy backward, autotuning: not a compile
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
                "cuda_graphs": self.cuda_graphs, "graph_records": self.graph_records,
                "compiles": self.compiles, "recompiles": self.recompiles,
                "compile_s": round(self.seconds, 3), "jobs": self.jobs}


class _JobScope:
    def __init__(self, compiler: Compiler, emit):
        self.c, self.emit = compiler, emit
        self.stats: dict = {}

    def __enter__(self):
        c = self.c
        self.before = (c.compiles, c.recompiles, c.seconds, c.graph_records)
        c._emit = self.emit
        return self

    def __exit__(self, *exc):
        c = self.c
        c._emit = None
        if c.enabled:
            c.jobs += 1
            if c.state == "compiling":  # an exception inside a compile
                c.state = "compiled"
        n0, r0, s0, g0 = self.before
        self.stats = {"enabled": c.enabled, "compiles": c.compiles - n0,
                      "cuda_graphs": c.cuda_graphs, "graph_records": c.graph_records - g0,
                      "recompiles": c.recompiles - r0, "compile_s": c.seconds - s0,
                      "compiles_total": c.compiles, "recompiles_total": c.recompiles}
        return False
