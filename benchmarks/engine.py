"""`bench --engine`: one denoising step of the engine against in-process diffusers, eager vs
`torch.compile`, and 1 vs N ranks, on CPU or CUDA (`--device`, `--dtype`, `--compile`).

    python -m comfyui_xdit bench --engine --preset flux-dev --device cuda --build-only
    python -m comfyui_xdit bench --engine --preset flux-dev --device cuda --dtype bf16 --compile

(The first call writes the ~24 GB model once, so the measuring call fits a 10-minute slot:
expected ~1 min loading diffusers, ~1-2 min per compile, ~30 s per pool launch.)

Presets (`--preset`):
* `flux-dev`: FLUX.1-dev's transformer dimensions (19 double + 38 single blocks, 24 heads x
  128, T5 width 4096, CLIP pooled width 768; ~11.9B parameters) with random weights, 1024x1024,
  512 text tokens. Built without any download: the transformer is created on the meta device
  from its config, materialised on `--device`, initialised and saved once (bf16 ~24 GB) under
  the cache folder; text encoders are 1-layer models with the real output widths (prompt
  encoding is not what is measured), VAE/tokenizers/scheduler come from the tiny model.
* `cpu`: the bench's default CPU model (12 heads x 48, 2 double + 2 single blocks), 512x512.
* `quick`: a tiny model built by the same meta-device builder (tests: every code path in
  seconds).

Time per step = (denoising time of a long job - that of a short job) / (step difference), median
over `repeats` pairs: prompt encoding, launch, compile and the job's fixed costs cancel. Pool
jobs use the slowest rank's `denoise_s` (the loop ends with a device-to-host copy, so GPU work
is included); diffusers jobs are timed around `FluxPipeline.__call__` with a CUDA synchronize.
Runs (each after one warm-up job, one after the other, pools closed in between so one GPU
holds one model at a time):
* `diffusers` in-process `FluxPipeline` (and `diffusers_compiled`: `compile_repeated_blocks`
  when `--compile`);
* `pool1_eager`, `pool1_compiled` (`--compile`): a 1-rank WorkerPool;
* `poolN_*` for each N of `--ranks` above 1: Ulysses N (on CUDA one GPU per rank).
Ratios: every run against `diffusers` and against the 1-rank pool of the same mode.

`--families` runs every family at its released width instead (benchmarks/engine_families.py,
which reuses this module's step timing).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest

BUILDER_VERSION = 1

PRESETS = {
    "quick": dict(builder="shaped", heads=2, head_dim=16, double=1, single=1, text_dim=64,
                  pooled_dim=32, height=64, width=64, text=8, steps=(1, 2), repeats=1,
                  dtype="fp32"),
    "cpu": dict(builder="tiny", heads=12, head_dim=48, depth=2, height=512, width=512, text=32,
                steps=(1, 3), repeats=2, dtype="fp32"),
    "flux-dev": dict(builder="shaped", heads=24, head_dim=128, double=19, single=38,
                     text_dim=4096, pooled_dim=768, height=1024, width=1024, text=512,
                     steps=(3, 13), repeats=2, dtype="bf16"),
}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---- the model ----------------------------------------------------------------------------------
def shaped_key(dims: dict, dtype: str) -> str:
    blob = json.dumps({"v": BUILDER_VERSION, "dtype": dtype, **dims}, sort_keys=True)
    return "flux-shaped-" + hashlib.sha1(blob.encode()).hexdigest()[:12]


def ensure_flux_shaped(cache: Path, *, heads: int, head_dim: int, double: int, single: int,
                       text_dim: int, pooled_dim: int, dtype: str = "bf16",
                       device: str = "cpu", seed: int = 0, log=print) -> Path:
    """A FLUX diffusers folder with the given transformer dimensions and random weights, built
    once into `cache` (reused when complete). `device` only says where the weights are drawn
    (a GPU draws 12B numbers in a second); the folder is the same either way."""
    import torch

    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    dims = dict(heads=heads, head_dim=head_dim, double=double, single=single,
                text_dim=text_dim, pooled_dim=pooled_dim, seed=seed)
    cache = Path(cache)
    final = cache / shaped_key(dims, dtype)
    if (final / "flux_shaped.json").is_file():
        return final
    base = ensure_tiny_model("flux", cache)  # tokenizers, VAE, scheduler, model_index.json
    tmp = cache / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.perf_counter()
    try:
        for part in ("scheduler", "tokenizer", "tokenizer_2", "vae"):
            shutil.copytree(base / part, tmp / part)
        shutil.copy(base / "model_index.json", tmp / "model_index.json")
        _text_encoders(base, tmp, text_dim, pooled_dim, seed)
        tr = _random_transformer(dims, TORCH_DTYPES[dtype], device, seed)
        tr.save_pretrained(tmp / "transformer", safe_serialization=True, max_shard_size="10GB")
        del tr
        (tmp / "flux_shaped.json").write_text(json.dumps(dict(dims, dtype=dtype), indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
    log(f"bench: built {final} in {time.perf_counter() - t:.1f} s")
    return final


def _text_encoders(base: Path, out: Path, text_dim: int, pooled_dim: int, seed: int) -> None:
    """1-layer CLIP-L / T5 with the real output widths: what the transformer sees has the
    right shape; their own cost is not part of a denoising step."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    c = CLIPTextConfig.from_pretrained(base / "text_encoder")
    c.hidden_size = c.projection_dim = pooled_dim
    c.num_hidden_layers, c.intermediate_size = 1, 64
    c.num_attention_heads = max(1, pooled_dim // 64) if pooled_dim % 64 == 0 else 1
    torch.manual_seed(seed + 1)
    CLIPTextModel(c).save_pretrained(out / "text_encoder", safe_serialization=True)
    c5 = T5Config.from_pretrained(base / "text_encoder_2")
    c5.d_model, c5.num_layers, c5.num_heads, c5.d_kv, c5.d_ff = text_dim, 1, 1, 64, 64
    torch.manual_seed(seed + 2)
    T5EncoderModel(c5).save_pretrained(out / "text_encoder_2", safe_serialization=True)


def _random_transformer(dims: dict, torch_dtype: str, device: str, seed: int):
    """Created on the meta device (no memory), materialised on `device` in the target dtype,
    then initialised: matrices ~ N(0, 1/fan_in) / 2 (activations stay finite through 57
    blocks), norm scales 1, biases 0."""
    import torch

    tr = _meta_transformer(dims)
    dev = torch.device(device if device != "cuda" else "cuda:0")
    tr = tr.to(getattr(torch, torch_dtype)).to_empty(device=dev)  # dtype first: no fp32 copy
    gen = torch.Generator(dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 / math.sqrt(p.shape[1]), generator=gen)
            elif name.endswith("weight"):  # RMSNorm / LayerNorm scales
                p.fill_(1.0)
            else:
                p.zero_()
    return tr.eval().requires_grad_(False)


def meta_params(dims: dict) -> int:
    """Transformer parameters of `dims`, counted on the meta device (nothing allocated)."""
    return sum(p.numel() for p in _meta_transformer(dims).parameters())


def _meta_transformer(dims: dict):
    """FLUX.1's transformer class at `dims`, on the meta device: shapes, no memory."""
    import torch
    from diffusers import FluxTransformer2DModel

    from workers.families.flux import rope_axes as flux_rope_axes

    with torch.device("meta"):
        tr = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=dims["double"],
            num_single_layers=dims["single"], attention_head_dim=dims["head_dim"],
            num_attention_heads=dims["heads"], joint_attention_dim=dims["text_dim"],
            pooled_projection_dim=dims["pooled_dim"], guidance_embeds=True,
            axes_dims_rope=flux_rope_axes(dims["head_dim"]))
    return tr


def build_model(preset: dict, cache: Path, dtype: str, device: str, log) -> Path:
    if preset["builder"] == "tiny":
        from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
        return ensure_tiny_model("flux", cache, depth=preset["depth"],
                                 width=preset["heads"] * preset["head_dim"], heads=preset["heads"])
    return ensure_flux_shaped(cache, heads=preset["heads"], head_dim=preset["head_dim"],
                              double=preset["double"], single=preset["single"],
                              text_dim=preset["text_dim"], pooled_dim=preset["pooled_dim"],
                              dtype=dtype, device=device, log=log)


# ---- measuring ----------------------------------------------------------------------------------
def _request(p: dict, steps: int) -> GenerationRequest:
    return GenerationRequest(prompt=["a photo of a red cat"], seed=1, steps=steps,
                             height=p["height"], width=p["width"], cfg=1.0, guidance=3.5,
                             max_sequence_length=p["text"])


def _step_estimates(job, p: dict) -> list:
    """(long - short) / step difference, `repeats` times; `job(steps)` -> seconds."""
    short, long_ = p["steps"]
    out = []
    for _ in range(p["repeats"]):
        a = job(long_)
        b = job(short)
        out.append((a - b) / (long_ - short))
    return out


def _summary(name: str, est: list, **extra) -> dict:
    return dict(name=name, step_s_median=statistics.median(est), step_s_all=est, **extra)


def measure_pool(name, model, config: ParallelConfig, p: dict, device: str, dtype: str,
                 compile: bool, log, weights: str = "auto") -> dict:
    from comfyui_xdit.client.pool import WorkerPool

    threads = 1 if device == "cpu" else None
    with WorkerPool(model, config, device=device, dtype=dtype, threads_per_rank=threads,
                    compile=compile, weights=weights) as pool:
        t = time.perf_counter()
        phases = []
        first = pool.generate(_request(p, p["steps"][0]),
                              on_event=lambda e: phases.append(e) if "phase" in e else None)
        first_s = time.perf_counter() - t
        warm = [s.get("compile") or {} for s in first.stats]
        after = []

        def job(steps):
            r = pool.generate(_request(p, steps))
            after.append(max((s.get("compile") or {}).get("compiles", 0) for s in r.stats))
            return max(s["denoise_s"] for s in r.stats)
        est = _step_estimates(job, p)
        launch = dict(pool.last_launch)
        fp8 = pool.status().get("fp8_compute") if weights != "auto" else None
    res = _summary(name, est, ranks=config.ranks, config=config.describe(), compile=compile,
                   first_job_s=first_s, launch_ready_s=launch.get("ready_s"),
                   compile_s=max((w.get("compile_s", 0.0) for w in warm), default=0.0),
                   compiles_first_job=max((w.get("compiles", 0) for w in warm), default=0),
                   compiling_events=len(phases), compiles_while_timed=sum(after),
                   weights=weights, fp8_compute=fp8,
                   graph_records=max((w.get("graph_records", 0) for w in warm), default=0))
    log(f"  {name}: {res['step_s_median'] * 1000:.1f} ms/step (first job {first_s:.1f} s"
        + (f", compile {res['compile_s']:.1f} s" if compile else "") + ")")
    return res


def measure_diffusers(model, p: dict, device: str, dtype: str, compile: bool, log) -> list:
    import diffusers
    import torch

    from comfyui_xdit.comfy_convert import comfy_noise, noise_to_model

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as one pool rank
    out = []
    try:
        pipe = diffusers.FluxPipeline.from_pretrained(
            str(model), torch_dtype=getattr(torch, TORCH_DTYPES[dtype])).to(device)
        pipe.set_progress_bar_config(disable=True)
        noise = noise_to_model("flux", comfy_noise(1, (1, 16, p["height"] // 8, p["width"] // 8)))

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        def job(steps):
            sync()
            t = time.perf_counter()
            with torch.inference_mode():
                pipe(prompt=["a photo of a red cat"], guidance_scale=3.5, height=p["height"],
                     width=p["width"], num_inference_steps=steps, latents=noise.to(device),
                     max_sequence_length=p["text"], output_type="latent")
            sync()
            return time.perf_counter() - t
        for name, comp in (("diffusers", False), ("diffusers_compiled", True)):
            if comp and not compile:
                continue
            if comp:
                pipe.transformer.compile_repeated_blocks()
            first_s = job(p["steps"][0])
            res = _summary(name, _step_estimates(job, p), ranks=1, config="in-process",
                           compile=comp, first_job_s=first_s)
            log(f"  {name}: {res['step_s_median'] * 1000:.1f} ms/step (first job "
                f"{first_s:.1f} s)")
            out.append(res)
        del pipe
    finally:
        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def default_ranks(device: str, heads: int) -> list:
    import torch

    if device == "cuda":
        n = torch.cuda.device_count()
        return [r for r in (1, 2, 4, 8) if r <= n and heads % r == 0]
    return [1, 2] if (os.cpu_count() or 1) >= 2 else [1]


def run(args, log) -> dict:
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.errors import ConfigError

    name = args.preset or ("quick" if args.quick else "cpu")
    p = dict(PRESETS[name])
    device = args.device or "cpu"
    dtype = args.dtype or p["dtype"]
    if args.steps is not None:  # the long job's steps
        p["steps"] = (p["steps"][0], max(p["steps"][0] + 1, args.steps))
    if args.repeats is not None:
        p["repeats"] = max(1, args.repeats)
    if name == "flux-dev" and device != "cuda":
        raise ConfigError("preset flux-dev (11.9B parameters at 1024x1024) needs --device cuda")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device")
    ranks = [int(x) for x in args.ranks.split(",")] if args.ranks else \
        default_ranks(device, p["heads"])
    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    t = time.perf_counter()
    model = build_model(p, cache, dtype, device, log)
    built_s = time.perf_counter() - t
    if getattr(args, "build_only", False):
        log(f"bench --engine: model ready at {model} ({built_s:.1f} s)")
        return {"preset": name, "model_path": str(model), "build_or_reuse_s": built_s}
    from .bench import model_facts
    facts = model_facts(Path(model))
    log(f"bench --engine: preset {name}, {_params(facts)} transformer parameters, {p['width']}x{p['height']}, {p['text']} text tokens, {device} {dtype}, "
        f"steps {p['steps'][1]} - {p['steps'][0]}, ranks {ranks}, compile {args.compile}")
    weights = getattr(args, "weights", "auto")
    runs = measure_diffusers(model, p, device, dtype, args.compile, log)
    modes = [False, True] if args.compile else [False]
    for n in ranks:
        for comp in modes:
            cfg = ParallelConfig(ulysses=n) if n > 1 else ParallelConfig()
            tag = "" if weights == "auto" else f"_{weights}"
            runs.append(measure_pool(f"pool{n}_{'compiled' if comp else 'eager'}{tag}", model,
                                     cfg, p, device, dtype, comp, log, weights=weights))
    by = {r["name"]: r for r in runs}
    base = by["diffusers"]["step_s_median"]
    for r in runs:
        r["vs_diffusers"] = r["step_s_median"] / base
        tag = "" if weights == "auto" else f"_{weights}"
        one = by.get(f"pool1_{'compiled' if r['compile'] else 'eager'}{tag}")
        if r["name"].startswith("pool") and one is not None:
            r["speedup_vs_1_rank"] = one["step_s_median"] / r["step_s_median"]
    return {"preset": name, "device": device, "dtype": dtype, "ranks": ranks,
            "job": {k: p[k] for k in ("height", "width", "text", "steps", "repeats")},
            "model": dict(facts, build_or_reuse_s=built_s), "runs": runs}


def _params(facts: dict) -> str:
    n = facts["transformer_params"]
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def markdown(sec: dict) -> str:
    m, j = sec["model"], sec["job"]
    L = ["## Engine: pool vs in-process diffusers, eager vs compiled, 1 vs N ranks", "",
         f"- preset {sec['preset']}: {_params(m)} transformer parameters, "
         f"{m['double_blocks']} double + {m['single_blocks']} single blocks, {m['heads']} heads x "
         f"{m['head_dim']}; {j['width']}x{j['height']}, {j['text']} text tokens; "
         f"{sec['device']} {sec['dtype']}",
         f"- time/step = (job of {j['steps'][1]} steps - job of {j['steps'][0]} steps) / "
         f"{j['steps'][1] - j['steps'][0]}, median of {j['repeats']}; after one warm-up job "
         "(launch and compile are in `first job`)", "",
         "| run | ranks | compile | time/step (ms) | vs diffusers eager | speed-up vs 1 rank "
         "(same mode) | first job (s) | compile (s) | compiles while timed |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in sec["runs"]:
        sp = r.get("speedup_vs_1_rank")
        L.append(f"| {r['name']} | {r['ranks']} | {'yes' if r['compile'] else 'no'} | "
                 f"{r['step_s_median'] * 1000:.1f} | {r['vs_diffusers']:.3f} | "
                 f"{'' if sp is None else f'{sp:.2f}x'} | {r['first_job_s']:.1f} | "
                 f"{r.get('compile_s', 0.0):.1f} | {r.get('compiles_while_timed', '')} |")
    L.append("")
    return "\n".join(L)


def main_section(args) -> int:
    """Runs the section, writes bench.json / bench.md under --out, prints the markdown."""
    from .measure import loadavg, machine_facts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    machine = machine_facts(args.device or "cpu")
    t = time.perf_counter()
    section = run(args, log)
    if "runs" not in section:  # --build-only
        print(section["model_path"])
        return 0
    machine["loadavg_end"] = loadavg()
    report = {"machine": machine, "engine": section, "wall_s": time.perf_counter() - t}
    md = markdown(section)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(md)
    print(md)
    return 0
