"""Worker entry point: one process per rank, launched by the pool or by torchrun.

Rank 0 owns the control channel: it authenticates the host, receives jobs, encodes the
prompts once, draws the noise once and broadcasts the whole job; every rank then runs the
same denoising loop. Other ranks only ever listen to rank 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time


log = logging.getLogger("xdit.worker")


def _die_with_parent() -> None:
    """Exit when the process that launched us goes away (no orphans). Polls the parent pid:
    Linux's PR_SET_PDEATHSIG fires when the launching *thread* ends, which would kill a pool
    started from a short-lived thread."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:  # said once, quietly: nothing here went wrong
                log.info("host process %d is gone; exiting", parent)
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="xdit-parent-watch").start()


def _process_age_s() -> float:
    """Seconds since this process was created (Linux /proc, clock-tick resolution; 0
    elsewhere): the interpreter's own start, before `main` can time anything."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def _parse(argv):
    p = argparse.ArgumentParser(prog="xdit-worker")
    p.add_argument("--model", required=True)
    p.add_argument("--model-2", default=None, dest="model_2",
                   help="Wan 2.2 A14B from two single files: the low-noise expert's file "
                        "(--model: the high-noise one's)")
    p.add_argument("--branch", default=None,
                   help="a model with a transformer per guidance branch under CFG parallel: "
                        "the branch whose transformer this rank loads (the others are not)")
    p.add_argument("--branch-layout", default=None, dest="branch_layout",
                   help="with --branch: every rank's branch, comma separated (weight "
                        "sharding spreads each branch's transformer over its own ranks)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun)")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE")
    p.add_argument("--store", default=None, help="FileStore path for local rendezvous")
    p.add_argument("--listen", default="127.0.0.1:0", help="rank 0's control address")
    p.add_argument("--address-file", default=None, help="rank 0 writes HOST:PORT here")
    p.add_argument("--secret-file", default=None, help="else $XDIT_POOL_SECRET (hex)")
    p.add_argument("--load-in-turn", action="store_true",
                   help="ranks load one after another (bounds host memory at one copy)")
    p.add_argument("--attention", default="auto",
                   choices=["auto", "cudnn", "flash", "efficient", "torch"],
                   help="attention kernel, chosen once per pool (workers/parallel/attention.py)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks during warm-up")
    p.add_argument("--weights", default="auto", choices=["auto", "fp8", "full"],
                   help="weight storage: as the checkpoint (auto), fp8 e4m3fn blocks, or all "
                        "in --dtype (full)")
    p.add_argument("--fp8-compute", default=os.environ.get("XDIT_FP8_COMPUTE", "auto"),
                   help="how fp8 weights multiply: auto (fp8 matmul on GPUs with fp8 tensor "
                        "cores, else upcast) | on | off; default $XDIT_FP8_COMPUTE, read once "
                        "here (workers/loading/weights.py)")
    p.add_argument("--shard-weights", action="store_true",
                   help="FSDP2-shard the transformer's block weights over every rank")
    p.add_argument("--shard-split", default="even",
                   help="with --shard-weights: each rank's share of the weights, 'even' or "
                        "one weight per rank (e.g. 3,2; workers/parallel/uneven_sharding.py)")
    p.add_argument("--text-encoders", default="auto",
                   help="where rank 0 runs the text encoders: auto | cpu | gpu | cuda:N")
    p.add_argument("--pipefusion", type=int, default=1,
                   help="PipeFusion degree: each rank loads only its stage's blocks")
    p.add_argument("--pipefusion-inner", type=int, default=1,
                   help="ulysses x ring inside each stage (places ranks on stages)")
    p.add_argument("--hook", action="append", default=[],
                   help="module:function run in this worker before the process group "
                        "exists (tests and benchmarks only; see workers/runtime/hooks.py)")
    p.add_argument("--pipefusion-split", default="balanced",
                   help="balanced | compute | memory | block counts per stage, e.g. 3,2")
    return p.parse_args(argv)


def _init_distributed(args, rank, world, backend="", check_planes=False):
    """Both planes (workers/parallel/topology.py): set the GPU first, then the process group."""
    import torch
    import torch.distributed as dist

    from ..parallel.topology import init_world

    if args.device == "cuda":
        # the pool gives each rank one visible GPU; under torchrun LOCAL_RANK picks it
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                              % max(1, torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    store = dist.FileStore(args.store, world) if args.store else None
    return init_world(rank, world, device, store, backend=backend, check_planes=check_planes)


def main(argv=None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{os.environ.get('RANK', args.rank)} %(message)s")
    _die_with_parent()
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    t_main, start_s = time.perf_counter(), _process_age_s()
    # the checkpoint read starts first, beside the imports (workers/loading/prefetch.py)
    from ..loading.prefetch import Prefetch
    prefetch = Prefetch.for_worker(args, rank, world)
    import diffusers  # noqa: F401  (timed: the import floor of every launch)
    import torch
    import yunchang  # noqa: F401
    import_s = time.perf_counter() - t_main
    if args.threads:
        torch.set_num_threads(args.threads)

    # rank 0 binds its control socket before loading so the host can connect early
    listener = None
    if rank == 0:
        if args.secret_file:
            with open(args.secret_file) as f:
                secret = bytes.fromhex(f.read().strip())
        else:
            secret = bytes.fromhex(os.environ.pop("XDIT_POOL_SECRET"))
        from .channel import parse_address
        host, port = parse_address(args.listen)
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                        else socket.AF_INET)
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("control channel listening on %s:%d (beyond loopback)", host,
                        listener.getsockname()[1])

    from .hooks import HookContext, install
    ctx = HookContext(rank=rank, world=world, device=args.device)
    hooks = install(args.hook, ctx)  # before the process group: hooks may wrap it
    planes = _init_distributed(args, rank, world, backend=ctx.options.get("backend", ""),
                               check_planes=bool(ctx.options.get("check_planes")))
    from .control import _Acceptor, _follower_loop, _leader_loop
    from .worker import Worker
    worker = Worker(args, rank, world, import_s, planes=planes, hooks=hooks,
                    hook_options=ctx.options, launch=(t_main, start_s, prefetch))
    log.info("loaded %s in %.2fs", args.model, worker.load_seconds)
    if rank != 0:
        _follower_loop(worker)
    else:
        acceptor = _Acceptor(listener, secret)
        acceptor.start()
        if args.address_file:
            addr = listener.getsockname()
            tmp = args.address_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{addr[0]}:{addr[1]}")
            os.replace(tmp, args.address_file)
        try:
            _leader_loop(worker, acceptor)
        except (BrokenPipeError, ConnectionResetError):
            # the host went away mid-reply (stopped or killed): no traceback, no error; the
            # other ranks leave with their parent watch
            log.info("the host closed the control connection; exiting")
            os._exit(0)
        listener.close()
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
