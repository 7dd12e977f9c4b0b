"""Worker entry point: one process per rank, launched by the pool or by torchrun.

Rank 0 owns the control channel: it authenticates the host, receives jobs, encodes the
prompts once, draws the noise once and broadcasts the whole job; every rank then runs the
same denoising loop. Other ranks only ever listen to rank 0.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import logging
import os
import queue
import socket
import sys
import threading
import time

from comfyui_xdit.pool import rss_mb

log = logging.getLogger("xdit.worker")


def _die_with_parent() -> None:
    """Exit when the process that launched us goes away (no orphans). Polls the parent pid:
    Linux's PR_SET_PDEATHSIG fires when the launching *thread* ends, which would kill a pool
    started from a short-lived thread."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                log.error("parent process %d is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="xdit-parent-watch").start()


def _parse(argv):
    p = argparse.ArgumentParser(prog="xdit-worker")
    p.add_argument("--model", required=True)
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
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "torch"],
                   help="attention kernel on CUDA: flash-attn when present (auto), required "
                        "(flash), or torch's efficient/SDPA kernels (torch)")
    p.add_argument("--pipefusion", type=int, default=1,
                   help="PipeFusion degree: each rank loads only its stage's blocks")
    p.add_argument("--pipefusion-inner", type=int, default=1,
                   help="ulysses x ring inside each stage (places ranks on stages)")
    p.add_argument("--hook", action="append", default=[],
                   help="module:function run in this worker before the process group "
                        "exists (tests and benchmarks only; see workers/hooks.py)")
    p.add_argument("--pipefusion-split", default="balanced",
                   help="balanced | compute | memory | block counts per stage, e.g. 3,2")
    return p.parse_args(argv)


def _init_distributed(args, rank, world, backend=""):
    """Both planes (workers/topology.py): set the GPU first, then the process group."""
    import torch
    import torch.distributed as dist

    from .topology import init_world

    if args.device == "cuda":
        # the pool gives each rank one visible GPU; under torchrun LOCAL_RANK picks it
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                              % max(1, torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    store = dist.FileStore(args.store, world) if args.store else None
    return init_world(rank, world, device, store, backend=backend)


class Worker:
    def __init__(self, args, rank, world, import_s=0.0, planes=None, hooks=None,
                 hook_options=None):
        import resource

        import torch
        import torch.distributed as dist

        from .lora import LoraManager
        from .models import get_adapter, read_arch

        self.args = args
        self.rank = rank
        self.world = world
        self.planes = planes  # workers.topology.World
        self.hooks = hooks or {}
        self.hook_options = hook_options or {}
        self.device = planes.device
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        from .attention import check_backend
        check_backend(args.attention, self.device.type, self.dtype)
        self.adapter = get_adapter(read_arch(args.model))
        rss_after_import = rss_mb()
        t = time.perf_counter()
        stage = None
        if args.pipefusion > 1:
            from .pipefusion_stages import stage_of_rank
            stage = (stage_of_rank(rank, args.pipefusion, args.pipefusion_inner),
                     args.pipefusion, args.pipefusion_split)
        for turn in (range(world) if args.load_in_turn else [rank]):
            if turn == rank:
                self.model = self.adapter.load(args.model, self.device, self.dtype,
                                               with_text_encoders=(rank == 0), stage=stage)
            if args.load_in_turn and world > 1:
                dist.barrier(group=planes.control)
        self.load_seconds = time.perf_counter() - t
        self.base_loads = 1  # the base model is loaded once; LoRA never reloads it
        self.loras = LoraManager(self.adapter)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.topologies = {}
        self.parallel = None  # (config key, SequenceParallel or None)
        st = self.model.stage
        self.ranks = _gather_all(planes.control, {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                                  "device": str(self.device), "rss_mb": rss_mb(),
                                  "transformer_params": sum(
                                      p.numel() for p in self.model.transformer.parameters()),
                                  "stage": None if st is None else
                                  {"index": st.index, "of": st.count, "blocks": list(st.owned),
                                   "n_blocks": st.n_blocks},
                                  "import_s": import_s, "load_s": self.load_seconds,
                                  "rss_after_import_mb": rss_after_import,
                                  "load_peak_rss_mb": peak})
        self.state = {"state": "idle", "job_id": None, "step": 0, "total": 0}
        if world > 1:  # the patch-parallel VAE's halo links (neighbour ranks, world group)
            from .p2p import warm_pairs
            warm_pairs([(r, r + 1) for r in range(world - 1)], rank, planes.data, self.device)

    def describe(self) -> dict:
        """What `status` shows: the model, the ranks, and what rank 0 is doing."""
        t = self.model.transformer.config
        return {"model": self.args.model, "arch": self.model.arch,
                "kind": "file" if os.path.isfile(self.args.model) else "diffusers",
                "heads": int(t.num_attention_heads), "patch_size": int(t.get("patch_size", 1) or 1),
                "blocks": sum(len(getattr(self.model.transformer, n))
                              for n in self.adapter.block_lists),
                "world_size": self.world, "load_seconds": self.load_seconds,
                "latent": dict(zip(("scale", "shift"), self.adapter.scale_shift(self.model))),
                "ranks": self.ranks, "config": self.parallel[0] if self.parallel else None,
                **self.state}

    def topology(self, key):
        """Process groups and model hooks for a configuration, built once per key."""
        from .attention import ShardedAttention
        from .sequence_parallel import SequenceParallel
        from .topology import build_topology

        if key not in self.topologies:
            dp, cfg, pf, uly, ring = key
            topo = build_topology(self.rank, self.world, dp, cfg, pf, uly, ring,
                                  device=self.device)
            _warm_pairs(topo)
            self.topologies[key] = topo
        topo = self.topologies[key]
        if self.parallel is None or self.parallel[0] != key:
            if self.parallel is not None and self.parallel[1] is not None:
                self.parallel[1].remove()
            sp = None
            if topo.degree("pipefusion") > 1:
                from .pipefusion import PatchAttention
                sp = SequenceParallel(self.model.transformer, self.adapter.layout, topo,
                                      PatchAttention(topo, self.args.attention))
            elif topo.sp > 1:
                sp = SequenceParallel(self.model.transformer, self.adapter.layout, topo,
                                      ShardedAttention(topo, self.device.type,
                                                       fault=self.hook_options.get("attention_fault", ""),
                                                       backend=self.args.attention))
            self.parallel = (key, sp)
        return topo

    def prepare(self, msg) -> "Job":
        """Rank 0: turn a host request into the broadcastable Job (encode once, noise once)."""
        import torch

        from .denoise import Job

        req = msg["request"]
        self._check_stages(tuple(msg["config"]))
        noise = msg["noise"]  # model space, drawn once by the host (ComfyUI's prepare_noise)
        b = int(noise.shape[0])
        use_cfg = float(req["cfg"]) > 1.0

        def branch(given, texts):
            if given is not None:
                d = self.adapter.conditioning(given["cond"], given["pooled"])
            elif self.model.encoder is None:  # a single file: nothing to encode text with
                from comfyui_xdit.model_info import NO_TEXT_ENCODERS
                raise ValueError(NO_TEXT_ENCODERS)
            else:
                texts = list(texts) if len(texts) in (1, b) else texts[:1]
                d = self.adapter.encode(self.model, texts, req["max_sequence_length"])
            return {k: (v.expand(b, *v.shape[1:]).contiguous()
                        if k in ("encoder_hidden_states", "pooled_projections") and v.shape[0] == 1
                        else v).detach().cpu() for k, v in d.items()}

        with torch.inference_mode():
            cond = branch(req["positive"], req["prompt"])
            uncond = branch(req["negative"], [req["negative_prompt"]]) if use_cfg else None
        # LoRA files are read and checked here, before anything is broadcast
        req["lora_adapters"] = self.loras.resolve(self.model.transformer, req.get("loras"))
        return Job(job_id=msg["job_id"], request=req, config=tuple(msg["config"]), noise=noise,
                   cond=cond, uncond=uncond, init_latent=msg.get("init_latent"),
                   denoise=float(msg.get("denoise", 1.0)), options=msg.get("options"))

    def _check_stages(self, key) -> None:
        """A PipeFusion pool holds one stage per rank: it runs only its launch's layout."""
        dp, cfg, pf, uly, ring = key
        want = (pf, uly * ring) if pf > 1 else (1,)
        have = (self.args.pipefusion, self.args.pipefusion_inner) \
            if self.args.pipefusion > 1 else (1,)
        if want != have:
            raise RuntimeError(f"this pool was launched for pipefusion {self.args.pipefusion}"
                               f" (x{self.args.pipefusion_inner} sp ranks per stage); a job "
                               f"with pipefusion {pf} x ulysses {uly} x ring {ring} needs a "
                               f"relaunch of the pool")

    def run(self, job, emit=None, should_stop=lambda: False):
        import torch

        from .denoise import run_job

        from .hooks import job_started

        topo = self.topology(job.config)
        self._apply_loras(job)
        job_started(self.hooks)
        t = time.perf_counter()
        with torch.inference_mode():
            samples = run_job(job, self.model, self.adapter, topo, self.planes.control, emit,
                              should_stop)
        stats = {"rank": self.rank, "denoise_s": time.perf_counter() - t, "rss_mb": rss_mb(),
                 "lora_loads": self.loras.loads, "base_loads": self.base_loads}
        if self.device.type == "cuda":
            stats["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        images = None
        if job.request.get("output") == "image":  # the same decision on every rank
            raw = None if samples is None else self.adapter.to_raw(
                self.model, samples, job.request["height"], job.request["width"])
            images = _decode(self, raw)
        if self.hooks:
            from .hooks import job_stats
            stats["hooks"] = job_stats(self.hooks)
        stats = _gather_stats(self.planes.control, stats)
        if stats and self.rank == 0:
            for r, st in zip(self.ranks, stats):
                r["rss_mb"] = st["rss_mb"]
        return samples, images, stats

    def _apply_loras(self, job):
        """Every rank switches to the job's LoRA list; the ranks then agree on success
        (one small collective, only once LoRA has been used), so a file that fails on any
        rank fails the job on all of them without breaking the pool."""
        from .lora import LoraError

        resolved = job.request.get("lora_adapters") or []
        if not resolved and not self.loras.used:
            return
        self.loras.used = True
        err = None
        try:
            self.loras.apply(self.model.transformer, resolved)
        except Exception as e:  # noqa: BLE001  (reported by every rank below)
            err = f"rank {self.rank}: {e}" if isinstance(e, LoraError) else \
                f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = [x for x in (_gather_all(self.planes.control, err) if self.world > 1 else [err]) if x]
        if errors:
            try:  # leave the model in a known state: no adapter active
                self.loras.apply(self.model.transformer, [])
            except Exception:  # noqa: BLE001
                pass
            raise LoraError("; ".join(errors))


def _warm_pairs(topo):
    """Create every pair communicator a job of this topology will use, now, in one order
    (workers/p2p.py): PipeFusion's stage links and Ring attention's neighbours."""
    from .p2p import warm_pairs

    if topo.degree("pipefusion") > 1:
        from .pipefusion import pipeline_pairs
        warm_pairs(pipeline_pairs(topo), topo.rank, topo.group("pipefusion"), topo.device)
    r = topo.degree("ring")
    if r > 1:
        ranks = [topo.global_rank(ring=i) for i in range(r)]
        warm_pairs([(ranks[i], ranks[(i + 1) % r]) for i in range(r)], topo.rank,
                   topo.group("ring"), topo.device)


class DecodeJob:
    """Decode-only job (the xDiT Decode node): every rank joins the patch-parallel VAE decode
    of LATENT samples that only rank 0 holds."""

    def __init__(self, job_id):
        self.job_id = job_id


def _decode_problem(worker, samples):
    """Checked on rank 0 before anything is broadcast, so a bad request leaves the pool fine."""
    import torch

    from comfyui_xdit.model_info import NO_VAE
    if not os.path.isfile(os.path.join(worker.args.model, "vae", "config.json")):
        return NO_VAE
    if not torch.is_tensor(samples) or samples.dim() != 4 or samples.shape[1] != 16 \
            or not samples.is_floating_point():
        shape = tuple(samples.shape) if torch.is_tensor(samples) else type(samples).__name__
        return (f"decode takes LATENT samples [batch, 16, height/8, width/8] (got {shape}); "
                f"connect the xDiT sampler's LATENT")
    if min(samples.shape[0], samples.shape[2], samples.shape[3]) < 1:
        return f"decode got empty LATENT samples {tuple(samples.shape)}"
    return None


def _decode(worker, samples):
    """Every rank: the VAE decode, patch-parallel over the world (the image on rank 0)."""
    import torch

    if worker.world == 1:
        with torch.inference_mode():
            return worker.adapter.decode(worker.model, samples)
    with torch.inference_mode():  # patch-parallel over the world, both planes
        return worker.adapter.decode(worker.model, samples, group=worker.planes.data,
                                     control=worker.planes.control)


def _leader_decode(worker, chan, body):
    job_id = body.get("job_id")
    samples = body.get("samples")
    problem = _decode_problem(worker, samples)
    if problem:
        chan.send(("error", job_id, f"ValueError: {problem}", False))
        return
    _broadcast(worker.planes.control, DecodeJob(job_id))
    worker.state.update(state="running", job_id=job_id, step=0, total=0)
    t = time.perf_counter()
    try:
        images = _decode(worker, samples.float())
    except Exception as e:
        # the other ranks may be inside the decode's collectives: the pool cannot continue
        chan.send(("error", job_id, f"rank 0: {type(e).__name__}: {e}", True))
        raise
    finally:
        worker.state.update(state="idle", job_id=None)
    chan.send(("result", job_id, {"samples": None, "images": images,
                                  "stats": [{"rank": 0, "decode_s": time.perf_counter() - t}]}))


def _gather_all(control, obj):
    """Every rank's object on every rank, over the control plane."""
    import torch.distributed as dist
    out = [None] * dist.get_world_size(control)
    dist.all_gather_object(out, obj, group=control)
    return out


def _gather_stats(control, stats):
    """Every rank's job statistics, on rank 0 (one small collective per job)."""
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return [stats]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(stats, out, dst=0, group=control)
    return out


def _broadcast(control, obj):
    """Rank 0's object to every rank, over the control plane (where idle ranks wait)."""
    import torch.distributed as dist
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def _follower_loop(worker):
    from .denoise import Cancelled
    from .lora import LoraError
    while True:
        job = _broadcast(worker.planes.control, None)
        if job == "shutdown":
            return
        if isinstance(job, DecodeJob):
            _decode(worker, None)
            continue
        try:
            worker.run(job)
        except (Cancelled, LoraError):  # LoraError: every rank refused the job together
            pass


class _Acceptor(threading.Thread):
    """Accepts and authenticates control connections; bad ones are logged and dropped."""

    def __init__(self, sock, secret):
        super().__init__(daemon=True, name="xdit-acceptor")
        self.sock = sock
        self.secret = secret
        self.channels = queue.Queue()
        self.busy = threading.Event()  # a host is connected: others are told so and dropped
        self.lock = threading.Lock()

    def run(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            # each handshake in its own thread: a silent client cannot hold up the next one
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True,
                             name="xdit-handshake").start()

    def _handshake(self, conn, peer):
        from comfyui_xdit.channel import AuthError, server_handshake
        try:
            chan = server_handshake(conn, self.secret)
        except AuthError as e:
            log.warning("refused control connection from %s: %s", peer, e)
            conn.close()
            return
        for _ in range(20):  # a host that just left may not be noticed yet
            if not self.busy.is_set():
                break
            time.sleep(0.1)
        with self.lock:
            if self.busy.is_set():
                log.info("control connection from %s refused: another host is connected", peer)
                try:
                    chan.send(("busy", "another host is connected to this pool"))
                finally:
                    chan.close()
                return
            self.busy.set()
        self.channels.put(chan)
        log.info("control connection from %s authenticated", peer)


def _leader_loop(worker, acceptor):
    from .denoise import Cancelled
    from .lora import LoraError

    chan = None
    later = collections.deque()  # messages that arrived during a job, handled after it
    while True:
        if chan is None:
            later.clear()
            chan = acceptor.channels.get()
            chan.send(("ready", worker.describe()))
        try:
            msg = later.popleft() if later else chan.recv()
        except (ConnectionError, OSError, EOFError):
            log.info("host disconnected")
            chan = None
            acceptor.busy.clear()
            continue
        kind = msg[0]
        if kind == "shutdown":
            _broadcast(worker.planes.control, "shutdown")
            chan.send(("bye",))
            return
        if kind == "ping":
            chan.send(("pong",))
            continue
        if kind == "status":
            chan.send(("status", worker.describe()))
            continue
        if kind == "cancel":  # arrived after its job ended: nothing to stop
            continue
        if kind == "decode":
            _leader_decode(worker, chan, msg[1])
            continue
        if kind != "job":
            chan.send(("error", None, f"unknown message {kind!r}", False))
            continue
        body = msg[1]
        try:
            job = worker.prepare(body)
        except Exception as e:  # nothing was broadcast: the pool is still consistent
            chan.send(("error", body["job_id"], f"{type(e).__name__}: {e}", False))
            continue
        _broadcast(worker.planes.control, job)
        cancelled = []

        def should_stop():
            while chan.poll(0):
                m = chan.recv()
                if m[0] == "cancel" and m[1] in (None, job.job_id):
                    cancelled.append(m)
                elif m[0] == "status":
                    chan.send(("status", worker.describe()))
                elif m[0] != "cancel":
                    later.append(m)
            return bool(cancelled)

        def emit(event):
            if "step" in event:
                worker.state.update(step=event["step"], total=event["total"])
            chan.send(("event", job.job_id, event))

        worker.state.update(state="running", job_id=job.job_id, step=0,
                            total=job.request["steps"])
        try:
            try:
                samples, images, stats = worker.run(job, emit, should_stop)
            finally:
                worker.state.update(state="idle", job_id=None)
        except Cancelled as e:
            chan.send(("cancelled", job.job_id, str(e)))
            continue
        except LoraError as e:  # every rank refused the job together: the pool is fine
            chan.send(("error", job.job_id, f"LoraError: {e}", False))
            continue
        except Exception as e:
            # other ranks may be inside a collective: the pool cannot continue
            chan.send(("error", job.job_id, f"rank 0: {type(e).__name__}: {e}", True))
            raise
        chan.send(("result", job.job_id, {"samples": samples, "images": images,
                                          "stats": stats}))


def main(argv=None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{os.environ.get('RANK', args.rank)} %(message)s")
    _die_with_parent()
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    t_import = time.perf_counter()
    import diffusers  # noqa: F401  (timed: the import floor of every launch)
    import torch
    import yunchang  # noqa: F401
    import_s = time.perf_counter() - t_import
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
        from comfyui_xdit.channel import parse_address
        host, port = parse_address(args.listen)
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                        else socket.AF_INET)
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("control channel listening on %s:%d (beyond loopback)", host,
                        listener.getsockname()[1])

    from .hooks import HookContext, install
    ctx = HookContext(rank=rank, world=world, device=args.device)
    hooks = install(args.hook, ctx)  # before the process group: hooks may wrap it
    planes = _init_distributed(args, rank, world, backend=ctx.options.get("backend", ""))
    worker = Worker(args, rank, world, import_s, planes=planes, hooks=hooks,
                    hook_options=ctx.options)
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
        _leader_loop(worker, acceptor)
        listener.close()
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
