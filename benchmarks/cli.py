"""The benchmarks' command line: `python -m benchmarks ...`, also reached as
`python -m comfyui_xdit bench ...` (comfyui_xdit/cli/commands.py imports this module only then)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import bench


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench.md")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 128x128, 2 steps, no 1x2-thread reference: checks the "
                        "bench itself in seconds")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per job")
    p.add_argument("--repeats", type=int, default=None, help="timed jobs per configuration")
    p.add_argument("--model-cache", default=None,
                   help="model cache folder (default: the demo's cache/models)")
    p.add_argument("--max-foreign-load", type=float, default=0.25,
                   help="cores other processes may use during a timed job before it is "
                        "re-run (default 0.25)")
    p.add_argument("--max-retries", type=int, default=4,
                   help="extra timed jobs per configuration to replace contended ones")
    p.add_argument("--max-wait", type=float, default=150.0,
                   help="total seconds to wait for a quiet machine (default 150; --quick: 0); "
                        "once spent, contended jobs are kept (and flagged)")
    p.add_argument("--no-extras", action="store_true",
                   help="skip the 1x2-thread reference, the cfg/dp comparison and the pool "
                        "overheads")
    p.add_argument("--pipefusion", action="store_true",
                   help="run the PipeFusion section instead: weights and memory per rank at "
                        "pipefusion 1/2/4 (compute and memory splits), time/step and bytes "
                        "at pipefusion 1 vs 2, PSNR vs the exact run per warmup_steps "
                        "(see benchmarks/pipefusion.py)")
    p.add_argument("--video", action="store_true",
                   help="run the video section instead: a Wan-shaped job (256x256 x 33 "
                        "frames = 2,304 video tokens) at 1 rank vs Ulysses 2 / Ring 2 / CFG "
                        "parallel, time/step and bytes/step against the memory plan's "
                        "per-step traffic (see benchmarks/video.py)")
    p.add_argument("--engine", action="store_true",
                   help="run the engine section instead: time/step of in-process diffusers vs "
                        "a 1-rank pool, eager vs compiled, and 1 vs N ranks, on --device "
                        "(see benchmarks/engine.py)")
    p.add_argument("--preset", choices=["quick", "cpu", "flux-dev"], default=None,
                   help="--engine model and job: quick (tiny), cpu (the bench's CPU model, "
                        "512x512; default), flux-dev (FLUX.1-dev's transformer dimensions, "
                        "random weights, 1024x1024; needs --device cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="--engine: where the pools and diffusers run (default cpu)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="--engine: compute dtype (default: the preset's, fp32 or bf16)")
    p.add_argument("--compile", action="store_true",
                   help="--engine: also measure torch.compile (the pools' compile option and "
                        "diffusers' compile_repeated_blocks)")
    p.add_argument("--weights", choices=["auto", "fp8"], default="auto",
                   help="--engine: the pools' weights (fp8: stored in fp8; they multiply in "
                        "fp8 on sm89+ GPUs unless XDIT_FP8_COMPUTE=off)")
    p.add_argument("--build-only", action="store_true",
                   help="--engine: build (or find) the preset's model in the cache, print its "
                        "folder and stop (splits the first flux-dev run: ~24 GB written once); "
                        "with --families: every family's model, and the table of what was built")
    p.add_argument("--families", default=None, metavar="all|ID,ID",
                   help="--engine: the family sweep instead of one FLUX-shaped model: each "
                        "registry family at its released attention width (heads x head_dim, "
                        "FFN), --depth blocks per block list, pool (1 rank, eager; compiled "
                        "with --compile) vs the family's diffusers pipeline, one table (see "
                        "benchmarks/engine_families.py)")
    p.add_argument("--depth", type=int, default=None,
                   help="--families: blocks per block list (default 2; --quick 1)")
    p.add_argument("--frames", type=int, default=None,
                   help="--families: frames of the video families' job (default 33, 832x480)")
    p.add_argument("--budget", type=float, default=None,
                   help="--families: seconds the sweep may take; a stage that would not fit "
                        "what is left is listed as not run (default: no limit)")
    p.add_argument("--plan", action="store_true",
                   help="--families: list each family's dimensions and what would run; "
                        "nothing is built or timed")
    p.add_argument("--ranks", default=None,
                   help="--engine, --split: comma-separated pool sizes, e.g. 1,2,4,8 "
                        "(--engine default: 1 and every Ulysses degree the GPUs / cores "
                        "allow; --split: 2,4)")
    p.add_argument("--trained", action="store_true",
                   help="with --pipefusion: only its quality table, on the trained shapes "
                        "model (benchmarks/pipefusion_trained.py)")
    p.add_argument("--cache", action="store_true",
                   help="run the step cache section instead: speed-up and PSNR against the "
                        "uncached image per threshold, ours (1 rank, Ulysses 2) beside "
                        "cache-dit, on the trained shapes model (see benchmarks/step_cache.py)")
    p.add_argument("--fp8", action="store_true",
                   help="run the fp8 section instead: PSNR of fp8 weights (fp8 matmul and "
                        "upcast) against full precision on the trained shapes model, and "
                        "their time per job (see benchmarks/fp8_quality.py)")
    p.add_argument("--split", action="store_true",
                   help="run the uneven-split section instead: one rank made 1.5x / 3x "
                        "slower, time/step with the even split and with auto beside the "
                        "ideal, 2 and 4 ranks, Ulysses / Ring / DP (see benchmarks/split.py)")
    p.add_argument("--slowdowns", default=None, metavar="K,K",
                   help="--split: the slow rank's factors (default 1.5,3)")
    p.add_argument("--launch", action="store_true",
                   help="run the launch section instead: a tiny 2-rank pool's ready time and "
                        "CPU per launch, plain processes vs the preloaded launcher, side by "
                        "side (see benchmarks/launch.py)")
    p.add_argument("--model-call", action="store_true",
                   help="run the xDiT MODEL section instead: per-call overhead of a "
                        "KSampler-style model call beyond the transformer, 1 and 2 ranks, "
                        "1024x1024 (see benchmarks/model_call.py)")


def parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=bench.__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def run(args) -> int:
    if args.pipefusion:
        return run_section(args, "pipefusion_trained" if args.trained else "pipefusion")
    if args.cache:
        return run_section(args, "step_cache")
    if args.fp8:
        return run_section(args, "fp8_quality")
    if args.video:
        return run_section(args, "video")
    if args.split:
        return run_section(args, "split")
    if args.launch:
        return run_section(args, "launch")
    if args.model_call:
        from . import model_call
        return model_call.run(args)
    if args.engine and args.families:
        from . import engine_families
        return engine_families.main_section(args)
    if args.engine:
        from . import engine
        return engine.main_section(args)
    return bench.run(args)


def run_section(args, name: str) -> int:
    """A section module with `run(args, log, machine)` -> its part of the report and
    `markdown(report)`: bench.json and bench.md in --out."""
    import importlib

    from .measure import loadavg, machine_facts
    section = importlib.import_module(f"benchmarks.{name}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    machine = machine_facts()
    t = time.perf_counter()
    rep = section.run(args, log, machine)
    machine["loadavg_end"] = loadavg()
    report = {"machine": machine, name: rep, "wall_s": time.perf_counter() - t}
    md = section.markdown(report)
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "bench.md").write_text(md)
    print(md)
    return 0


def main(argv=None, prog: str = "python -m benchmarks") -> int:
    args = parser(prog).parse_args(argv)
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a pool failure: one line, the details are in the message
        from comfyui_xdit.errors import ConfigError
        from comfyui_xdit.client.pool import PoolError
        if isinstance(e, ConfigError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, PoolError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise
