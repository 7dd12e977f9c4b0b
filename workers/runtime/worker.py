"""A worker's job execution: the loaded model, its topologies and hooks, and what every rank
does for a job (LoRA switch, the denoising loop, the image decode, stats). The control
channel to the host is workers/runtime/control.py; the process entry point workers/runtime/serve.py.

Control-plane helpers (`_broadcast`, `_gather_all`, `_gather_stats`) take the world's gloo
group: objects never travel on the data plane.
"""
from __future__ import annotations

import logging
import os
import socket
import time

from ..messages import peak_rss_mb, rss_mb


def pil_image(image):
    """[H, W, 3] floats in 0..1 -> an RGB PIL image (8 bits a channel, rounded: an image
    read from an 8-bit file comes back exactly)."""
    import torch
    from PIL import Image
    x = (torch.as_tensor(image).float().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(x.cpu().numpy())


def _import_transformer_class(adapter) -> None:
    """Import the family's diffusers transformer class now (diffusers imports it lazily, with
    the rest of its transformers and peft: about as long as `import diffusers` itself), so
    the launch breakdown counts it as an import, not as weight loading. The load finds it
    imported; a class that fails to import is left for the load to report."""
    import diffusers

    try:
        getattr(diffusers, adapter.transformer_class)
    except Exception:  # noqa: BLE001  (the load raises the same error where it happens)
        pass


class Worker:
    def __init__(self, args, rank, world, import_s=0.0, planes=None, hooks=None,
                 hook_options=None, launch=None):
        """`launch`: (main's perf_counter start, seconds from process creation to it, the
        checkpoint Prefetch) from serve.py, for the launch breakdown in `ranks`."""

        import torch

        from ..loading.lora import LoraManager
        from ..models import get_adapter, read_arch
        from ..parallel.topology import barrier

        self.args = args
        self.rank = rank
        self.world = world
        self.planes = planes  # workers.parallel.topology.World
        self.hooks = hooks or {}
        self.hook_options = hook_options or {}
        self.device = planes.device
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        from ..parallel.attention import check_backend
        self.attention = check_backend(args.attention, self.device.type, self.dtype)
        from .compile import Compiler, check as check_compile
        check_compile(getattr(args, "compile", False), args.pipefusion)
        self.adapter = get_adapter(read_arch(args.model), args.model)
        _import_transformer_class(self.adapter)  # counted in setup_s, not in load_s
        rss_after_import = rss_mb()
        t = time.perf_counter()
        t_main, start_s, prefetch = launch or (t, 0.0, None)
        stage = None
        if args.pipefusion > 1:
            from ..loading.stages import stage_of_rank
            stage = (stage_of_rank(rank, args.pipefusion, args.pipefusion_inner),
                     args.pipefusion, args.pipefusion_split)
        from ..loading.shards import direct_load_problem
        from ..parallel.sharding import begin as begin_sharding
        self.shard_setup = begin_sharding(  # --shard-weights (workers/parallel/sharding.py)
            args, planes, self.adapter.block_lists,
            direct_load_problem(args.model) if getattr(args, "shard_weights", False) else "")
        for turn in (range(world) if args.load_in_turn else [rank]):
            if turn == rank:  # the pool counts these two lines for "loading k/N"
                logging.getLogger("xdit.worker").info("xdit: loading weights")
                direct = self.shard_setup is not None and self.shard_setup.direct
                self.model = self.adapter.load(
                    args.model, self.device, self.dtype, with_text_encoders=(rank == 0),
                    stage=stage, weights=getattr(args, "weights", "auto"),
                    text_encoders=getattr(args, "text_encoders", "auto"),
                    shard=self.shard_setup if direct else None,  # shards only: its rows
                    **({"path_2": args.model_2} if getattr(args, "model_2", None) else {}),
                    **({"branch": args.branch} if getattr(args, "branch", None) else {}))
                logging.getLogger("xdit.worker").info("xdit: weights loaded")
            if args.load_in_turn and world > 1:
                barrier(group=planes.control)
        self.load_seconds = time.perf_counter() - t
        if prefetch is not None:  # the load has read what it needs: no more reading
            prefetch.stop()
        from ..parallel.sharding import shard_after_load
        self.sharding = shard_after_load(self)  # --shard-weights: FSDP2 (workers/parallel/sharding.py)
        from ..loading.weights import set_fp8_compute  # how the fp8 layers multiply, fixed here
        for tr in self.model.transformers():
            self.fp8_compute = set_fp8_compute(tr, getattr(args, "fp8_compute", "auto"),
                                               self.device, self.dtype)
        self.loras = LoraManager(self.adapter, self.model.path)
        self._active_loras = ()  # the adapter list last switched to on every rank
        self.compiler = Compiler(getattr(args, "compile", False))  # workers/runtime/compile.py
        for tr in self.model.transformers():
            self.compiler.install(tr, self.adapter.block_lists)
        from ..sampling.model_call import CondCache
        self.cond_cache = CondCache()  # conditionings of host-side samplers (model calls)
        self.last_cache = None  # step-cache counts of the last job or model call using it
        peak = peak_rss_mb()  # this worker's own (not ru_maxrss: inherited from the host)
        self.topologies = {}
        self.groups = {}  # member ranks -> (device group, gloo twin), shared by every layout
        self.parallel = None  # (config key, SequenceParallel or None)
        st = self.model.stage
        self.ranks = _gather_all(planes.control, {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                                  "device": str(self.device), "rss_mb": rss_mb(),
                                  "gpu_name": _gpu_name(self.device),
                                  "transformer_params": sum(
                                      p.numel() for tr in self.model.transformers()
                                      for p in tr.parameters()),
                                  "stage": None if st is None else
                                  {"index": st.index, "of": st.count, "blocks": list(st.owned),
                                   "n_blocks": st.n_blocks},
                                  "import_s": import_s, "load_s": self.load_seconds,
                                  # the launch breakdown (docs/performance.md): process start
                                  # -> main, main -> load start (imports included), ready
                                  # (process start -> here), what the prefetch read
                                  "start_s": start_s, "setup_s": t - t_main,
                                  "ready_s": start_s + time.perf_counter() - t_main,
                                  "prefetch": None if prefetch is None else prefetch.report(),
                                  "first_job_s": None,
                                  "rss_after_import_mb": rss_after_import,
                                  "load_peak_rss_mb": peak,
                                  "load": getattr(self.model, "load_report", None),
                                  "fp8_compute": self.fp8_compute["text"]})
        self.state = {"state": "idle", "job_id": None, "step": 0, "total": 0}
        self.jobs_run = 0  # Worker.run calls so far (the first is timed for `ranks`)
        if world > 1:  # the patch-parallel VAE's halo links (neighbour ranks, world group)
            from ..parallel.p2p import warm_pairs
            warm_pairs([(r, r + 1) for r in range(world - 1)], rank, planes.data, self.device)

    def describe(self) -> dict:
        """What `status` shows: the model, the ranks, and what rank 0 is doing."""
        t = self.model.transformer.config
        return {"model": self.args.model, "model_2": getattr(self.args, "model_2", None),
                "arch": self.model.arch,
                "kind": "file" if os.path.isfile(self.args.model) else "diffusers",
                "heads": self.adapter.family.heads(t), "patch_size": self.adapter.family.patch(t),
                "blocks": sum(len(getattr(self.model.transformer, n))
                              for n in self.adapter.block_lists),
                "world_size": self.world, "load_seconds": self.load_seconds,
                "latent": dict(zip(("scale", "shift"), self.adapter.scale_shift(self.model))),
                "ranks": self.ranks,
                "config": self.parallel[0].to_wire() if self.parallel else None,
                "weights": (getattr(self.model, "load_report", None) or {}).get("weights"),
                "text_encoders": (getattr(self.model, "load_report", None) or {}).get(
                    "text_encoders"),
                "fp8_compute": self.fp8_compute["text"],
                "compile": self.compiler.describe(),
                "sharding": self.sharding.counts() if self.sharding else None,
                # the step cache of the last job / model call that used it (rank 0's rows)
                "step_cache": self.last_cache,
                "attention": dict(self.attention, current=getattr(
                    self.parallel and self.parallel[1] and self.parallel[1].attention,
                    "kernel_name", None)),
                **self.state}

    def topology(self, key):
        """Process groups and model hooks for a configuration (`Degrees`), built once per key. The
        project's attention processors run at every degree (at sp 1 with the plain
        `LocalAttention`), so the pool's `attention` choice is the kernel that runs."""
        from ..parallel.attention import LocalAttention, ShardedAttention
        from ..parallel.sequence_parallel import SequenceParallel
        from ..parallel.shares import sp_weights
        from ..parallel.topology import build_topology

        groups_key = key.evenly()  # a split reweights the work, not the process groups
        if groups_key not in self.topologies:
            topo = build_topology(self.rank, self.world, **key.axes(),
                                  device=self.device, groups=self.groups)
            _warm_pairs(topo)
            self.topologies[groups_key] = topo
        topo = self.topologies[groups_key]
        if self.parallel is None or self.parallel[0] != key:
            if self.parallel is not None and self.parallel[1] is not None:
                self.parallel[1].remove()
            sp = None
            if topo.degree("pipefusion") > 1:
                from ..parallel.pipefusion.cache import PatchAttention
                sp = SequenceParallel(self.model.transformers(), self.adapter.layout, topo,
                                      PatchAttention(topo, self.args.attention,
                                                     self.device.type, self.dtype))
            elif topo.sp > 1:
                sp = SequenceParallel(self.model.transformers(), self.adapter.layout, topo,
                                      self.compiler.outside(ShardedAttention(
                                          topo, self.device.type,
                                          fault=self.hook_options.get("attention_fault", ""),
                                          backend=self.args.attention, dtype=self.dtype)),
                                      weights=sp_weights(key.split, topo))
            else:
                sp = SequenceParallel(self.model.transformers(), self.adapter.layout, topo,
                                      LocalAttention(self.args.attention, self.device.type,
                                                     self.dtype, self.model.transformer.config
                                                     .get("attention_head_dim")))
            self.parallel = (key, sp)
        return topo

    def prepare(self, msg):
        """Rank 0: the host's `protocol.Job` prepared for every rank, before anything is
        broadcast: prompts encoded once, references made model-space inputs, LoRA files
        checked. Returns the same Job with rank 0's fields filled (the host's reference
        inputs dropped: the broadcast carries what they became)."""
        import dataclasses

        import torch

        from .conditioning import Conditioning

        if msg.cond is not None or msg.uncond is not None or msg.reference_inputs is not None:
            raise ValueError("a job's cond, uncond and reference_inputs are rank 0's to fill")
        req = msg.request
        self._check_stages(msg.config)
        noise = msg.noise  # model space, drawn once by the host (ComfyUI's prepare_noise)
        b = int(noise.shape[0])
        # the negative prompt is encoded where a guidance pass reads it (plain CFG: cfg > 1)
        use_cfg = any(p.negative for p in self.adapter.guidance_passes(self.model, req))

        # image-to-video (Wan I2V): the start frame (an image, or ComfyUI's latent and mask)
        # -> the condition every step joins to the latents, made once here; the request's
        # copies are dropped so the broadcast carries it once
        start_images = None
        if msg.reference_images:
            from ..messages import REFERENCE_IMAGES_NEED_VAE
            if os.path.isfile(self.model.path):
                raise ValueError(REFERENCE_IMAGES_NEED_VAE)
            start_images = [pil_image(im) for im in msg.reference_images]
        with torch.inference_mode():
            start = self.adapter.start_condition(self.model, req, start_images, b)
        req = dataclasses.replace(req, **dict.fromkeys(Conditioning.START_IMAGE))
        references, prompt_images = msg.references, None
        if msg.reference_images and start is None:  # images -> LATENTs (and what the text encoder reads)
            with torch.inference_mode():
                encoded = self._encode_reference_images(msg.reference_images, req)
            references, prompt_images = encoded["latents"], encoded.get("prompt_images")
        text_kw = {"images": prompt_images} if prompt_images else {}

        from ..sampling.model_call import text_kind

        def branch(given, texts):
            if given is not None:  # a Conditioning's text
                extra = {} if given.context_2 is None else \
                    {"context_2": given.context_2}  # a second text encoder's (ByT5)
                context = given.context
                if self.adapter.family.comfy.raw_context_width is not None and \
                        text_kind(self.adapter.family, self.model.transformer.config,
                                  int(context.shape[2]))[0] == "raw":  # before the text modules
                    context = self.adapter.raw_text(self.model, context)
                d = self.adapter.conditioning(context, given.pooled, **extra)
            elif self.model.encoder is None:  # a single file: nothing to encode text with
                from ..messages import NO_TEXT_ENCODERS
                raise ValueError(NO_TEXT_ENCODERS)
            else:
                texts = list(texts) if len(texts) in (1, b) else texts[:1]
                d = self.adapter.encode(self.model, texts, req.max_sequence_length,
                                        **text_kw)
            if start is not None:  # both branches read the start image alike (Wan 2.1's
                d = dict(d, **start.get("cond", {}))  # CLIP image states)
            d = self.adapter.job_cond(d)
            return {k: (v.expand(b, *v.shape[1:]).contiguous()
                        if k in ("encoder_hidden_states", "pooled_projections") and v.shape[0] == 1
                        else v).detach().cpu() for k, v in d.items()}

        with torch.inference_mode():
            cond = branch(req.positive, req.prompt)
            uncond = branch(req.negative, [req.negative_prompt]) if use_cfg else None
        # LoRA files are read and checked here, before anything is broadcast
        adapters = self.loras.resolve(self.model.transformer, req.loras)
        refs = None if start is None else start["references"]
        if references:  # ComfyUI LATENTs -> model-space tokens and ids, once, on rank 0
            with torch.inference_mode():
                refs = self.adapter.reference_inputs(
                    self.model, [torch.as_tensor(r) for r in references],
                    req.reference_method, req.height, req.width)
            if refs["tokens"].shape[0] not in (1, b):
                raise ValueError(f"reference latents have batch {refs['tokens'].shape[0]}; "
                                 f"give 1 (shared) or the batch {b}")
        noise = self.adapter.job_noise(noise, req)
        return dataclasses.replace(msg, request=req, denoise=float(msg.denoise), noise=noise,
                                   options=dict(msg.options or {}), references=None,
                                   reference_images=None, cond=cond, uncond=uncond,
                                   reference_inputs=refs, lora_adapters=adapters)

    def _encode_reference_images(self, images, req) -> dict:
        """Reference images ([H, W, 3] 0..1, from the host) -> the adapter's
        `encode_reference_images` of them as 8-bit RGB PIL images (what the diffusers
        pipelines preprocess), with this folder's own VAE; a single file has none."""
        from ..messages import REFERENCE_IMAGES_NEED_VAE
        if os.path.isfile(self.model.path):
            raise ValueError(REFERENCE_IMAGES_NEED_VAE)
        return self.adapter.encode_reference_images(
            self.model, [pil_image(im) for im in images], req.height, req.width)

    def _check_stages(self, key) -> None:
        """A PipeFusion pool holds one stage per rank: it runs only its launch's layout."""
        pf = key.pipefusion
        want = (pf, key.sp) if pf > 1 else (1,)
        have = (self.args.pipefusion, self.args.pipefusion_inner) \
            if self.args.pipefusion > 1 else (1,)
        if want != have:
            raise RuntimeError(f"this pool was launched for pipefusion {self.args.pipefusion}"
                               f" (x{self.args.pipefusion_inner} sp ranks per stage); a job "
                               f"with pipefusion {pf} x ulysses {key.ulysses} x ring "
                               f"{key.ring} needs a "
                               f"relaunch of the pool")

    def run(self, job, emit=None, should_stop=lambda: False):
        """Every rank: the job. Returns (Latents in model space, Decoded or None: both hold
        their tensors on rank 0 only; every rank's stats, on rank 0)."""
        import torch

        import contextlib

        from ..sampling.denoise import run_job

        from .hooks import job_started
        from .share_meter import ShareMeter

        t_job = time.perf_counter()
        self._apply_loras(job)  # first: a new adapter may re-hook the parallel layout
        topo = self.topology(job.config)
        job_started(self.hooks)
        t = time.perf_counter()
        meter = ShareMeter(self.device)  # `auto` splits: this rank's own speed
        measure = meter.measuring(self.model.transformers(), self.adapter.block_lists) \
            if job.options.get("measure_share") else contextlib.nullcontext()
        with torch.inference_mode(), self.compiler.job(emit) as compiled, measure:
            report = {}
            samples = run_job(job, self.model, self.adapter, topo, self.planes.control, emit,
                              should_stop, step_scope=self.hook_options.get("step_scope"),
                              report=report, sequence=self.parallel and self.parallel[1])
        stats = {"rank": self.rank, "denoise_s": time.perf_counter() - t, "rss_mb": rss_mb(),
                 "lora_loads": self.loras.loads, "compile": compiled.stats, **report}
        if job.options.get("measure_share"):
            stats["share"] = meter.report()
        if "cache" in report:
            self.last_cache = dict(report["cache"], entry="job")
        if self.model.stage is None:  # block weights held here (workers/parallel/sharding.py)
            from ..parallel.sharding import job_counts
            stats["sharding"] = job_counts(self)
        images = None
        # the loop's latents as the job's fields (a family with sound: its audio too)
        latents = {} if samples is None else self.adapter.outputs(samples, job.request)
        samples = latents.get("samples")
        if job.request.output == "image":  # the same decision on every rank
            raw = None if samples is None else self.adapter.job_raw(
                self.model, latents, job.request)
            images = _decode(self, raw, job.config.split)
        # the sound track's waveform beside the frames (rank 0, which holds the latents),
        # where the family's decode does not make it itself
        from .outputs import Decoded, Latents
        if isinstance(images, dict):  # a decode that makes the sound too: Decoded's fields
            images = Decoded(**images)
        elif images is not None:
            sound = None if latents.get("audio") is None else \
                self.adapter.decode_audio(self.model, latents["audio"])
            images = Decoded(images=images, audio=None if sound is None else sound[0],
                             sample_rate=None if sound is None else sound[1])
        if self.device.type == "cuda":  # the process's peaks so far (load and every job):
            # read once, after the decode the plan also counts; the host compares them with
            # the memory plan after the first job (comfyui_xdit/planning/calibration.py)
            stats["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            stats["cuda_reserved_peak_mb"] = torch.cuda.max_memory_reserved() / 2**20
        if self.hooks:
            from .hooks import job_stats
            stats["hooks"] = job_stats(self.hooks)
        if not self.jobs_run:  # the launch breakdown's last figure (ranks' "first_job_s")
            stats["first_job_s"] = time.perf_counter() - t_job
        self.jobs_run += 1
        stats = _gather_stats(self.planes.control, stats)
        if stats and self.rank == 0:
            for r, st in zip(self.ranks, stats):
                r["rss_mb"] = st["rss_mb"]
                if "first_job_s" in st:
                    r["first_job_s"] = st["first_job_s"]
        return (Latents(samples=samples, audio=latents.get("audio")), images,
                stats)

    def prepare_call(self, msg):
        """Rank 0: a host sampler's `protocol.Predict` -> the broadcastable ModelCall, or the
        list of conditioning keys rank 0 lacks (the host resends them). A bad call raises
        before anything is broadcast, so the pool stays consistent."""
        import torch

        from ..sampling.model_call import ModelCall, call_problem

        key = msg.config
        if key.pipefusion > 1:
            raise ValueError("PipeFusion pipelines patches across denoising steps, so it cannot "
                             "serve a sampler that calls the model one step at a time "
                             "(KSampler & co.); use Sampler (xDiT) with this pool, or a pool "
                             "without pipefusion for the xDiT MODEL")
        self._check_stages(key)
        chunks = [(str(k), int(r)) for k, r in msg.chunks]
        conds = msg.conds or {}  # {key: Conditioning}
        missing = [k for k in self.cond_cache.missing(k for k, _ in chunks) if k not in conds]
        if missing:
            return missing
        parts = tuple(tuple(int(d) for d in s) for s in (getattr(msg, "parts", None) or ()))
        problem = call_problem(self.model, self.adapter, msg.x, msg.timestep, msg.guidance,
                               chunks, conds, self.cond_cache, parts)
        expert = int(getattr(msg, "expert", 0) or 0)
        if not problem and expert:
            experts = len(self.model.transformers())
            if not 0 <= expert < experts:
                problem = (f"expert {expert + 1} asked for, but this model has {experts} "
                           f"transformer(s) (two: a folder with a transformer_2, as Wan 2.2 "
                           f"A14B's low-noise expert)")
        cached = getattr(msg, "cache", None) is not None
        if not problem and cached and self.adapter.one_timestep and \
                len(set(msg.timestep.reshape(-1).tolist())) > 1:
            problem = (f"{self.adapter.family.name} runs one timestep a transformer call and "
                       f"this call's rows are at different timesteps (separate transformer "
                       f"calls), which the step cache cannot gate as one; sample without "
                       f"the step cache")
        if problem:
            raise ValueError(problem)
        # LoRA files (ComfyUI's loaders' patches, comfyui_xdit/nodes/comfy_loras.py) are
        # read and checked here, before anything is broadcast, as a job's
        adapters = self.loras.resolve(self.model.transformer, getattr(msg, "loras", None))
        x = msg.x.detach().to("cpu", torch.float32).contiguous()
        return ModelCall(call_id=int(msg.call_id), config=key, x=x,
                         timestep=msg.timestep.detach().float().cpu(),
                         guidance=None if msg.guidance is None else
                         msg.guidance.detach().float().cpu(),
                         chunks=chunks, new_conds={k: conds[k] for k in dict.fromkeys(
                             k for k, _ in chunks) if k in conds}, timed=bool(msg.timed),
                         cache=msg.cache, expert=expert, lora_adapters=adapters, parts=parts,
                         inputs={str(k): float(v) for k, v in (msg.inputs or {}).items()})

    def call(self, call, emit=None):
        """Every rank: one model evaluation (workers/sampling/model_call.py): (the prediction on
        rank 0, None elsewhere; this rank's timings, with the graphs compiled during it).
        `emit` (rank 0) receives the compiling events, as a job's do."""
        import torch

        from ..sampling.model_call import run_call

        # first: a new adapter may re-hook the parallel layout (as a job's)
        self._switch_loras(call.lora_adapters or [])
        topo = self.topology(call.config)
        with torch.inference_mode(), self.compiler.job(emit) as compiled:
            out, times = run_call(call, self.model, self.adapter, topo, self.cond_cache,
                                  self.planes, step_scope=self.hook_options.get("step_scope"),
                                  sequence=self.parallel and self.parallel[1])
        times["compiles"] = compiled.stats["compiles"]
        if self.cond_cache.steps is not None and call.cache is not None:  # the run so far
            self.last_cache = dict(self.cond_cache.steps.stats(), entry="model calls")
        if self.hooks:  # test hooks watching calls: every rank's, on rank 0
            from .hooks import job_stats
            times["hooks"] = _gather_stats(self.planes.control, job_stats(self.hooks))
        return out, times

    def _apply_loras(self, job):
        self._switch_loras(job.lora_adapters or [])

    def _switch_loras(self, resolved):
        """Every rank switches to the job's LoRA list; the ranks then agree on success
        (one small collective, only once LoRA has been used), so a file that fails on any
        rank fails the job on all of them without breaking the pool."""
        from ..loading.lora import LoraError

        if not resolved and not self.loras.used:
            return
        # the same list as the last job or call (every MODEL step of a KSampler run): the
        # adapters are already set, so no module walk and no collective on the step's path;
        # every rank got the same list, so every rank skips alike
        active = tuple(tuple(e) for e in resolved)
        if active == self._active_loras:
            return
        self.loras.used = True
        err = None
        loads = self.loras.loads
        try:
            self.loras.apply(self.adapter.lora_transformers(self.model), resolved)
            if self.loras.loads != loads and self.parallel and self.parallel[1] is not None:
                # peft wrapped layers the sequence-parallel hooks sit on (proj_out's gather,
                # ...): the hooks would see the base output only, so hook the wrappers
                self.parallel[1].remove()
                self.parallel = None
        except Exception as e:  # noqa: BLE001  (reported by every rank below)
            err = f"rank {self.rank}: {e}" if isinstance(e, LoraError) else \
                f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = [x for x in (_gather_all(self.planes.control, err) if self.world > 1 else [err]) if x]
        if errors:
            self._active_loras = None  # unknown until the next switch succeeds
            try:  # leave the model in a known state: no adapter active
                self.loras.apply(self.adapter.lora_transformers(self.model), [])
                self._active_loras = ()
            except Exception:  # noqa: BLE001
                pass
            raise LoraError("; ".join(errors))
        self._active_loras = active


def _warm_pairs(topo):
    """Create every pair communicator a job of this topology will use, now, in one order
    (workers/parallel/p2p.py): PipeFusion's stage links and Ring attention's neighbours."""
    from ..parallel.p2p import warm_pairs

    for axis in ("pipefusion", "ring"):
        if topo.degree(axis) > 1:
            warm_pairs(topo.ring_pairs(axis), topo.rank, topo.group(axis), topo.device)

class DecodeJob:
    """Decode-only job (the xDiT Decode node): every rank joins the patch-parallel VAE decode
    of LATENT samples that only rank 0 holds."""

    def __init__(self, job_id):
        self.job_id = job_id


def _decode_problem(worker, samples):
    """Checked on rank 0 before anything is broadcast, so a bad request leaves the pool fine."""
    import torch

    from ..messages import NO_VAE
    if not os.path.isfile(os.path.join(worker.args.model, "vae", "config.json")):
        return NO_VAE
    # the family's ComfyUI LATENT (FLUX.2's is 2x2-patchified and normalised)
    spec = worker.adapter.family.latent
    if isinstance(samples, (tuple, list)):  # (video, sound): the video is checked here
        samples = samples[0] if samples else None
    if not torch.is_tensor(samples) or samples.dim() != len(spec.shape(1, 16, 16)) \
            or samples.shape[1] != spec.channels or not samples.is_floating_point() \
            or (spec.frames and not spec.video and samples.shape[2] != 1):
        shape = tuple(samples.shape) if torch.is_tensor(samples) else type(samples).__name__
        return (f"decode takes LATENT samples {spec.shape_text()} (got {shape}); connect the "
                f"xDiT sampler's LATENT")
    if min(samples.shape[0], samples.shape[-2], samples.shape[-1]) < 1:
        return f"decode got empty LATENT samples {tuple(samples.shape)}"
    return None


def _gpu_name(device) -> str:
    """The rank's GPU model (what `auto` splits cache speeds by), "cpu" on a CPU rank."""
    import torch
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _decode(worker, samples, weights=()):
    """Every rank: the VAE decode, patch-parallel over the world (the image on rank 0), in
    bands by the split's `weights` (one per rank; () even)."""
    import torch

    if worker.world == 1:
        with torch.inference_mode():
            return worker.adapter.decode(worker.model, samples)
    with torch.inference_mode():  # patch-parallel over the world, both planes
        return worker.adapter.decode(worker.model, samples, group=worker.planes.data,
                                     control=worker.planes.control, weights=weights)


def _gather_all(control, obj):
    """Every rank's object on every rank, over the control plane."""
    import torch.distributed as dist

    from ..parallel.topology import all_gather_object
    out = [None] * dist.get_world_size(control)
    all_gather_object(out, obj, group=control)
    return out


def _gather_stats(control, stats):
    """Every rank's job statistics, on rank 0 (one small collective per job)."""
    import torch.distributed as dist

    from ..parallel.topology import gather_object
    if dist.get_world_size() == 1:
        return [stats]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    gather_object(stats, out, dst=0, group=control)
    return out


def _broadcast(control, obj):
    """Rank 0's object to every rank, over the control plane (where idle ranks wait)."""
    import torch.distributed as dist

    from ..parallel.topology import broadcast_object_list
    box = [obj]
    if dist.get_world_size() > 1:
        broadcast_object_list(box, src=0, group=control)
    return box[0]
