"""`python -m comfyui_xdit memory-plan`: one layout's per-rank GPU memory and verdict, or a
table comparing layouts (planning/plan_tables.py), from a model folder, file or preset;
arithmetic only, no GPU needed.
"""
from __future__ import annotations

import dataclasses

from comfyui_xdit import bridge
from comfyui_xdit.cli.cfg_flag import add_cfg_parallel
from comfyui_xdit.errors import ConfigError
from comfyui_xdit.planning.config import EngineOptions, ParallelConfig
from comfyui_xdit.planning.memory_arithmetic import DTYPE_BYTES, GiB, LINKS_GBPS, JobSize, plan
from comfyui_xdit.planning.model_facts import (PRESETS, model_facts, preset_facts,
                                               transformer_facts)
from comfyui_xdit.planning.plan_tables import compare_table, shard_table, traffic_table


def add_cli(sub) -> None:
    p = sub.add_parser("memory-plan", help="per-rank GPU memory of a configuration, before "
                                           "launching (will it fit?)",
                       description="Prints each rank's planned GPU memory (GiB) and whether it "
                                   "fits --gpu-memory. Exit 0: fits (or no GPU size given), "
                                   "1: does not fit, 2: bad input.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="diffusers folder or single .safetensors transformer")
    src.add_argument("--preset", choices=sorted(PRESETS), help="published model dimensions")
    for name, what in (("ulysses", "Ulysses sequence-parallel degree (heads split)"),
                       ("ring", "Ring sequence-parallel degree (keys and values passed round)"),
                       ("pipefusion", "PipeFusion degree (each rank holds 1/N of the blocks)"),
                       ("dp", "data parallel degree (the batch split over replicas)")):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{what}; default 1")
    add_cfg_parallel(p)
    p.add_argument("--cfg", action="store_true", help="the job uses classifier-free guidance")
    p.add_argument("--pipefusion-split", default="balanced",
                   help="PipeFusion stage split: balanced | compute | memory | block counts "
                        "like 10,9")
    p.add_argument("--shard-weights", action="store_true",
                   help="FSDP2-shard the block weights over every rank")
    p.add_argument("--shard-split", default="even",
                   help="with --shard-weights, each rank's share of the weights: even, "
                        "memory (by --gpu-memory: 24,16 holds 3:2) or one weight per rank")
    p.add_argument("--weights", choices=["auto", "fp8", "full"], default="auto",
                   help="auto: as the checkpoint stores them; fp8: block weights in fp8; "
                        "full: every weight in --dtype")
    p.add_argument("--text-encoders", default="auto",
                   help="where the text encoders sit: auto | cpu | gpu | cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                   help="weights and compute dtype (default bf16)")
    p.add_argument("--height", type=int, required=True,
                   help="image height in pixels, a multiple of 16")
    p.add_argument("--width", type=int, required=True,
                   help="image width in pixels, a multiple of 16")
    p.add_argument("--batch", type=int, default=1, help="images per job (default 1)")
    p.add_argument("--frames", type=int, default=1,
                   help="video models (Wan): frames, 4k + 1 (720p x 81 frames: 75,600 tokens)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="text tokens per prompt (default: the model's, 512)")
    p.add_argument("--gpu-memory", default=None,
                   help="GiB per GPU, or one per rank for GPUs of different sizes (24,16); "
                        "with --compare: a comma list of sizes, e.g. 24,48,80")
    p.add_argument("--split", default="even",
                   help="work per rank: even, or one weight per rank (3,2): each rank's "
                        "activations by its share")
    p.add_argument("--gpus", default=None,
                   help="number of GPUs, the product of the degrees (with --compare: a comma "
                        "list, e.g. 2,4,8)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="your GPUs' all-gather bandwidth in GB/s, to time shard_weights' "
                        "per-step traffic (default: PCIe 4.0 x16 and NVLink figures)")
    p.add_argument("--compare", action="store_true",
                   help="a markdown table of every method (replicated, PipeFusion, "
                        "shard_weights; text encoders on GPU or CPU; bf16 and, where it "
                        "changes a verdict, fp8) on each GPU count x GPU size")
    p.add_argument("--traffic-table", action="store_true",
                   help="a markdown table of the bytes a rank sends per denoising step under "
                        "each method (Ulysses, Ring, PipeFusion, shard_weights, CFG parallel "
                        "with --cfg) on each --gpus count, timed on the links")
    p.add_argument("--shard-table", action="store_true",
                   help="a markdown table of shard_weights' bytes per rank and all-gather "
                        "traffic per forward on each --gpus count (e.g. 2,4,8)")
    p.add_argument("--gguf", default=None, metavar="TYPES",
                   help="plan a GGUF file of the model in this type (Q8_0, Q4_K, ...: its "
                        "Linears kept in GGUF blocks under --weights auto); with --compare a "
                        "comma list, one row each")
    p.set_defaults(func=run_cli)


def _numbers(text, name, kind):
    if text is None:
        return []
    try:
        vals = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{name} must be a number or a comma list of numbers (got {text!r})")
    if not vals or min(vals) <= 0:
        raise ConfigError(f"{name} must be > 0 (got {text!r})")
    return vals



def gguf_bytes_per_value(text) -> list:
    """'Q8_0,Q4_K' -> [(type, bytes per weight value)] from the types' block sizes."""
    if not text:
        return []
    types = bridge.gguf_types.TYPES
    out = []
    for name in str(text).upper().split(","):
        name = name.strip()
        if name not in types:
            raise ConfigError(f"--gguf: unknown GGUF type {name!r}; known: {', '.join(types)}")
        _, block, size = types[name]
        out.append((name, size / block))
    return out


def run_cli(args) -> int:
    counts = _numbers(args.gpus, "--gpus", int)
    sizes = _numbers(args.gpu_memory, "--gpu-memory", float)
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise ConfigError(f"--link-gbps must be > 0 (got {args.link_gbps})")
    if args.shard_table or args.traffic_table:
        if not counts:
            raise ConfigError(f"--{'shard' if args.shard_table else 'traffic'}-table needs "
                              f"--gpus (e.g. 2,4,8)")
    elif args.compare:
        if not counts or not sizes:
            raise ConfigError("--compare needs --gpus (e.g. 2,4,8) and --gpu-memory in GiB "
                              "(e.g. 24,48,80)")
    elif len(counts) > 1 or (len(sizes) > 1 and len(sizes) != args.ulysses * args.ring * args.dp
                             * args.pipefusion * int(args.cfg_parallel or 1)):
        raise ConfigError(f"--gpus {args.gpus} / --gpu-memory {args.gpu_memory}: give one "
                          f"number each, or add --compare for a table")
    config = ParallelConfig(dp=args.dp, cfg_parallel=args.cfg_parallel,
                            pipefusion=args.pipefusion, ulysses=args.ulysses, ring=args.ring,
                            pipefusion_split=args.pipefusion_split, split=args.split,
                            world_size=None if args.compare or args.shard_table or
                            args.traffic_table or not counts else counts[0])
    out = config.problems()
    engine = EngineOptions(device="cuda", dtype=args.dtype, weights=args.weights,
                           text_encoders=args.text_encoders, shard_weights=args.shard_weights,
                           shard_split=args.shard_split)
    out += engine.problems() + engine.problems_with(config)
    for name in ("height", "width"):
        v = getattr(args, name)
        if v < 16 or v % 16:
            out.append(f"--{name} must be a positive multiple of 16 (got {v}; try "
                       f"{max(16, round(v / 16) * 16)})")
    if args.batch < 1:
        out.append(f"--batch must be >= 1 (got {args.batch})")
    if out:
        raise ConfigError("; ".join(out))
    facts = preset_facts(args.preset) if args.preset else model_facts(args.model, args.dtype)
    gguf = gguf_bytes_per_value(args.gguf)
    if len(gguf) > 1 and not args.compare:
        raise ConfigError(f"--gguf {args.gguf}: give one type, or add --compare for a table")
    if gguf and not args.compare:
        facts = dataclasses.replace(facts, gguf_bytes_per_value=gguf[0][1])
    from comfyui_xdit.planning.request import frames_problems
    bad = frames_problems(args.frames, facts.arch)
    if bad:
        raise ConfigError("; ".join(bad))
    blocks = len(transformer_facts(facts.transformer_class, facts.transformer_config,
                                   facts.arch).blocks)
    if config.pipefusion > blocks:
        raise ConfigError(f"pipefusion {config.pipefusion} exceeds the model's {blocks} "
                          f"blocks; use pipefusion <= {blocks}")
    job = JobSize(height=args.height, width=args.width, batch=args.batch,
                  text_tokens=args.max_sequence_length, cfg=args.cfg, frames=args.frames)
    if args.traffic_table:
        print(traffic_table(facts, job, args.dtype, counts,
                            LINKS_GBPS if args.link_gbps is None else
                            (("your link", args.link_gbps),)))
        return 0
    if args.shard_table:
        print(shard_table(facts, args.dtype, args.weights, counts,
                          LINKS_GBPS if args.link_gbps is None else
                          (("your link", args.link_gbps),)))
        return 0
    if args.compare:
        print(compare_table(facts, job, args.dtype, counts, sizes, gguf))
        return 0
    cap = [int(x * GiB) for x in sizes] if len(sizes) > 1 else \
        (int(sizes[0] * GiB) if sizes else None)  # one size, or each GPU's own
    p = plan(facts, config.with_world_size(None), engine, job, cap)
    print(p.table())
    print(p.message())
    if p.gather_bytes_per_step:
        print(p.traffic((("your link", args.link_gbps),) if args.link_gbps else LINKS_GBPS))
    return 0 if p.fits is not False else 1
