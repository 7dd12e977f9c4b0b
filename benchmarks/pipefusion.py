"""`python -m benchmarks --pipefusion`: what PipeFusion costs and saves on CPU (gloo).

On a FLUX-shaped random-weight model with FLUX's own block counts (19 double + 38 single) and
a small hidden size, so that the blocks hold ~99% of the transformer's weights as in the real
model (plus an SD3-shaped one with 24 joint blocks, memory only), it measures:

* memory: transformer parameters each rank holds (`transformer_params` of the pool status)
  against the whole model, at pipefusion 1/2/4 and for the splits "balanced" (default:
  least compute on the slowest stage within the memory bound), "compute" and "memory";
  the target is <= 1/N + 5% of the whole per rank. Peak RSS while loading
  (`load_peak_rss_mb`), RSS after importing (before loading) and RSS after a job;
* time per step at pipefusion 1 (1 rank) vs pipefusion 2 (2 ranks), same job, warm pools
  timed round-robin (benchmarks/measure.py), and the point-to-point bytes each rank sends
  per step (benchmarks/comm_meter.py: "send" + "p2p", plain and grouped sends, data plane
  only) against the theory: every stage boundary carries each patch's activations once per
  step, i.e. B x (image tokens + text tokens) x hidden x bytes per branch; the last stage
  sends the new latent rows back to stage 0, B x image tokens x 64 x bytes; warmup steps send
  the same volume in one piece (the stop flag travels on the control plane, not counted);
* quality: PSNR of the decoded image (the model's VAE, `output="image"`) of PipeFusion
  against the exact run (pipefusion 1, same seed) for warmup_steps 0/1/2/4 at degree 2 and 4,
  plus warmup = steps (all synchronous: must be exact, a control). Random weights make the
  PSNR only indicative of how much stale K/V moves the result.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest

from .measure import (METER_HOOKS, Ceiling, Contention, Entry, NoCeiling, measure_interleaved,
                      paired, summarize_entry)

BYTES_TOLERANCE = 0.05
# the meter's kinds that carry PipeFusion's point-to-point traffic: grouped exchanges
# (batch_isend_irecv) are "p2p", plain isend/send "send"; both count
P2P_KINDS = ("send", "p2p")
DEFAULT_SPLIT = ParallelConfig().pipefusion_split  # what a user gets without asking
MEMORY_SLACK = 0.05  # target: transformer weights per rank <= 1/N + 5% of the whole

PRESETS = {
    # FLUX's block counts; width 192 (8 heads x 24) keeps a 256x256 step near a second on
    # one core while blocks hold 99% of the weights (real FLUX.1: 99.4%)
    "full": dict(flux=dict(double=19, single=38, heads=8, head_dim=24),
                 sd3=dict(depth=24, heads=8, head_dim=24),
                 degrees=(1, 2, 4), splits=("balanced", "compute", "memory"),
                 time=dict(height=256, width=256, steps=8, warmup=1, repeats=5,
                           max_sequence_length=32, warmup_steps=1, extra_splits=("compute",)),
                 quality=dict(height=256, width=256, steps=12, warmups=(0, 1, 2, 4),
                              degrees=(2, 4), max_sequence_length=32)),
    # the default tiny model (2 double + 2 single blocks): every code path in seconds
    # (one split only: every pool launch costs seconds of imports on a busy 2-core box)
    "quick": dict(flux=dict(double=2, single=2, heads=4, head_dim=16), sd3=None,
                  degrees=(1, 2), splits=(DEFAULT_SPLIT,),
                  time=dict(height=128, width=128, steps=3, warmup=0, repeats=1,
                            max_sequence_length=8, warmup_steps=1),
                  quality=dict(height=128, width=128, steps=3, warmups=(0, 1), degrees=(2,),
                               max_sequence_length=8)),
}

PROMPT = ["a photo of a red cat"]


# ---- models ----------------------------------------------------------------------------------
def flux_model(cache: Path, double: int, single: int, heads: int, head_dim: int) -> Path:
    """A FLUX-shaped diffusers folder with `double` + `single` blocks. The tiny-model builder
    gives both kinds the same count, so this takes its folder (text encoders, VAE, scheduler)
    and writes a transformer with the wanted counts (seeded, built once per cache)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    width = heads * head_dim
    if double == single:
        return ensure_tiny_model("flux", cache, depth=double, width=width, heads=heads)
    base = ensure_tiny_model("flux", cache, width=width, heads=heads)
    final = cache / f"bench-flux-{double}d{single}s-{heads}x{head_dim}-v1"
    if (final / "bench_model.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
    try:
        folder = tmp / "model"
        shutil.copytree(base, folder)
        tdir = folder / "transformer"
        config = json.loads((tdir / "config.json").read_text())
        for f in tdir.iterdir():
            f.unlink()
        kw = {k: v for k, v in config.items() if not k.startswith("_")}
        kw.update(num_layers=double, num_single_layers=single)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            tr = FluxTransformer2DModel(**kw)
        tr.save_pretrained(tdir, safe_serialization=True)
        (folder / "bench_model.json").write_text(json.dumps(
            {"base": base.name, "double": double, "single": single, "heads": heads,
             "head_dim": head_dim}, indent=2) + "\n")
        try:
            os.rename(folder, final)
        except OSError:
            if not (final / "bench_model.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def sd3_model(cache: Path, depth: int, heads: int, head_dim: int) -> Path:
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    return ensure_tiny_model("sd3", cache, depth=depth, width=heads * head_dim, heads=heads)


def model_facts(path: Path) -> dict:
    """Parameters of the transformer (built on the meta device: no weights read), split
    into the blocks and the rest; buffers saved with the weights (SD3's positional table)
    are not parameters and not counted, as in the pool's `transformer_params`."""
    tr, lists = _meta_transformer(path)
    cfg = tr.config
    total = sum(p.numel() for p in tr.parameters())
    blocks = sum(p.numel() for name in lists for p in getattr(tr, name).parameters())
    flux = type(tr).__name__ == "FluxTransformer2DModel"
    heads, hd = int(cfg.num_attention_heads), int(cfg.attention_head_dim)
    return {"path": str(path), "arch": "flux" if flux else "sd3",
            "class": type(tr).__name__, "transformer_params": total,
            "block_params": blocks, "block_fraction": blocks / total,
            "double_blocks": int(cfg.num_layers) if flux else None,
            "single_blocks": int(cfg.num_single_layers) if flux else None,
            "joint_blocks": None if flux else int(cfg.num_layers),
            "heads": heads, "head_dim": hd, "width": heads * hd}


def _meta_transformer(path: Path):
    """The model folder's transformer on the meta device, and its block lists."""
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    tdir = path / "transformer"
    cfg = json.loads((tdir / "config.json").read_text())
    flux = cfg.get("_class_name") == "FluxTransformer2DModel"
    cls = FluxTransformer2DModel if flux else SD3Transformer2DModel
    lists = ("transformer_blocks", "single_transformer_blocks") if flux \
        else ("transformer_blocks",)
    with torch.device("meta"):
        tr = cls.from_config(cls.load_config(str(tdir)))
    return tr, lists


# ---- theory ----------------------------------------------------------------------------------
def theory(model: dict, job: dict, degree: int, batch: int = 1, branches: int = 1,
           bytes_per_element: int = 4) -> list:
    """Point-to-point bytes each stage sends per denoising step, PipeFusion only (no sp/cfg
    inside). Stage s < N-1: every patch's activations once, the text tokens once per
    branch (carried by the step's first patch); the last stage: the new latent rows (FLUX
    packed latents: 64 channels per image token)."""
    act = batch * branches * (job["image_tokens"] + job["text_tokens"]) * model["width"] \
        * bytes_per_element
    latent = batch * job["image_tokens"] * 64 * bytes_per_element
    out = []
    for s in range(degree):
        b = 0
        if s < degree - 1:
            b += act
        if s == degree - 1 and degree > 1:
            b += latent
        out.append(b)
    return out


# ---- measuring -------------------------------------------------------------------------------
def _config(degree: int, split: str = DEFAULT_SPLIT, warmup_steps: int = 1) -> ParallelConfig:
    if degree == 1:
        return ParallelConfig()
    return ParallelConfig(pipefusion=degree, pipefusion_split=split, warmup_steps=warmup_steps)


def _small_job(arch: str, t: dict) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, seed=7, steps=1, height=t["height"], width=t["width"],
                             max_sequence_length=t["max_sequence_length"],
                             cfg=1.0 if arch == "flux" else None)


def memory_record(pool, facts: dict, degree: int, split: str, last_stats=None) -> dict:
    st = pool.status()
    total = facts["transformer_params"]
    ranks = []
    after_job = {s["rank"]: s.get("rss_mb") for s in (last_stats or [])}
    for r in st["ranks"]:
        stage = r.get("stage")
        params = int(r["transformer_params"])
        ranks.append({"rank": r["rank"], "stage": None if stage is None else stage["index"],
                      "blocks": None if stage is None else stage["blocks"],
                      "n_blocks": None if stage is None else stage["n_blocks"],
                      "transformer_params": params, "param_bytes": params * 4,
                      "share": params / total,
                      "rss_after_import_mb": r.get("rss_after_import_mb"),
                      "load_peak_rss_mb": r.get("load_peak_rss_mb"),
                      "rss_after_job_mb": after_job.get(r["rank"], r.get("rss_mb"))})
    launch = pool.last_launch.get("ranks") or []
    for r, l in zip(ranks, launch):  # the launch record has the same numbers; fill gaps
        for k in ("rss_after_import_mb", "load_peak_rss_mb"):
            if r[k] is None:
                r[k] = l.get(k)
    target = 1 / degree + MEMORY_SLACK
    worst = max(r["share"] for r in ranks)
    return {"arch": facts["arch"], "degree": degree, "split": split if degree > 1 else "-",
            "ranks": ranks, "total_params": total, "max_share": worst,
            "sum_params": sum(r["transformer_params"] for r in ranks),
            "target_share": target, "met": worst <= target + 1e-12}


def _psnr(a, b) -> dict:
    import torch

    a, b = a.float(), b.float()
    mse = float(torch.mean((a - b) ** 2))
    return {"psnr_db": None if mse == 0 else 10 * math.log10(1.0 / mse), "mse": mse,
            "max_abs": float((a - b).abs().max()), "identical": mse == 0}


def measure_quality(pool, cfg_kwargs: dict, degree: int, q: dict, reference, log) -> list:
    rows = []
    for w in q["warmups"]:
        pool.reconfigure(_config(degree, warmup_steps=w, **cfg_kwargs))
        res = pool.generate(_quality_request(q))
        m = _psnr(res.images, reference["image"])
        lat = _psnr(res.samples, reference["latent"])
        row = {"degree": degree, "warmup_steps": w, "steps": q["steps"], **m,
               "latent_mse": lat["mse"], "latent_max_abs": lat["max_abs"],
               "denoise_s": max(s["denoise_s"] for s in res.stats)}
        rows.append(row)
        psnr = "identical" if row["psnr_db"] is None else f"{row['psnr_db']:.2f} dB"
        log(f"  quality pipefusion {degree} warmup {w:2d}: PSNR {psnr}, "
            f"max |diff| {row['max_abs']:.4f}")
    return rows


def _quality_request(q: dict, seed: int = 11) -> GenerationRequest:
    return GenerationRequest(prompt=q.get("prompt", PROMPT), seed=seed, steps=q["steps"], height=q["height"],
                             width=q["width"], max_sequence_length=q["max_sequence_length"],
                             cfg=1.0, guidance=3.5, output="image")


def run(args, log, machine: dict) -> dict:
    """The PipeFusion section; returns its report (also used by the tests)."""
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.client.pool import WorkerPool

    t_start = time.perf_counter()
    preset = PRESETS["quick" if args.quick else "full"]
    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    fl = preset["flux"]
    flux = flux_model(cache, fl["double"], fl["single"], fl["heads"], fl["head_dim"])
    facts = {"flux": model_facts(flux)}
    models = {"flux": flux}
    if preset["sd3"]:
        s = preset["sd3"]
        models["sd3"] = sd3_model(cache, s["depth"], s["heads"], s["head_dim"])
        facts["sd3"] = model_facts(models["sd3"])
    tcfg = dict(preset["time"])
    if args.steps is not None:
        tcfg["steps"] = max(1, args.steps)
    if args.repeats is not None:
        tcfg["repeats"] = max(1, args.repeats)
    job = {"height": tcfg["height"], "width": tcfg["width"], "steps": tcfg["steps"],
           "max_sequence_length": tcfg["max_sequence_length"],
           "text_tokens": tcfg["max_sequence_length"],
           "image_tokens": (tcfg["height"] // 16) * (tcfg["width"] // 16), "dtype": "fp32",
           "warmup_jobs": tcfg["warmup"], "timed_jobs": tcfg["repeats"],
           "pipefusion_warmup_steps": tcfg["warmup_steps"], "guidance": 3.5,
           "preset": "quick" if args.quick else "full"}
    q = dict(preset["quality"])
    q["warmups"] = tuple(sorted(set(q["warmups"]) | {q["steps"]}))  # + all-synchronous control
    log(f"pipefusion: FLUX-shaped {facts['flux']['double_blocks']} double + "
        f"{facts['flux']['single_blocks']} single blocks, "
        f"{facts['flux']['transformer_params'] / 1e6:.1f}M params "
        f"({facts['flux']['block_fraction']:.1%} in blocks)")

    quiet = Contention(args.max_foreign_load, 0.0 if args.quick else args.max_wait, log)
    attempts = tcfg["repeats"] if args.quick else tcfg["repeats"] + max(0, args.max_retries)
    memory, quality, timing, samples, scale = [], [], {}, [], {}
    ceiling = None
    pools = []

    def pool_for(model, degree, split):
        p = WorkerPool(model, _config(degree, split, tcfg["warmup_steps"]), device="cpu",
                       threads_per_rank=1, worker_hooks=METER_HOOKS)
        pools.append(p)
        return p

    def close(p):
        p.close()
        pools.remove(p)

    try:
        # --quick: no ceiling helpers (two more torch processes to start)
        ceiling = NoCeiling() if args.quick else Ceiling(1.0)
        # 1. time per step, pipefusion 1 vs 2, side by side (warm pools, round-robin)
        p1 = pool_for(flux, 1, "-")
        p2 = pool_for(flux, 2, DEFAULT_SPLIT)
        entries = [Entry("pipefusion1", p1, _config(1), "base", 1),
                   Entry("pipefusion2", p2, _config(2, DEFAULT_SPLIT,
                                                    tcfg["warmup_steps"]), "base", 1)]
        seen = {("flux", 1, ()), ("flux", 2, _ranges(flux, 2, DEFAULT_SPLIT))}
        for split in tcfg.get("extra_splits", ()):  # the same pipeline on another layout
            if _same_layout(seen, [], "flux", flux, 2, split, record=False):
                continue
            entries.append(Entry(f"pipefusion2_{split}", pool_for(flux, 2, split),
                                  _config(2, split, tcfg["warmup_steps"]), "base", 1))
        log(f"pipefusion: time/step, 1 rank vs pipefusion 2 ({job['width']}x{job['height']}, "
            f"{job['steps']} steps, warmup_steps {tcfg['warmup_steps']})")
        samples = measure_interleaved(entries, job, tcfg["warmup"], tcfg["repeats"],
                                      attempts, quiet, ceiling, log)
        timing = {e.name: summarize_entry(e, job) for e in entries}
        for e in entries:
            timing[e.name]["split"] = e.config.pipefusion_split if e.config.pipefusion > 1 \
                else "-"
        # (RSS after a job: read from /proc by the status, the pools idle after their jobs)
        memory.append(memory_record(p1, facts["flux"], 1, "-"))
        memory.append(memory_record(p2, facts["flux"], 2, DEFAULT_SPLIT))
        for e in entries[2:]:
            memory.append(memory_record(e.pool, facts["flux"], 2, timing[e.name]["split"]))
            close(e.pool)
        # 2. quality: the exact run, then PipeFusion per warmup setting
        exact = p1.generate(_quality_request(q))
        reference = {"image": exact.images, "latent": exact.samples}
        # the scale of the PSNR on this random-weight model: an unrelated image (other seed)
        other = p1.generate(_quality_request(q, seed=12))
        scale = _psnr(other.images, exact.images)
        scale.update(latent_mse=_psnr(other.samples, exact.samples)["mse"],
                     image_std=float(exact.images.float().std()),
                     image_range=[float(exact.images.min()), float(exact.images.max())],
                     latent_var=float(exact.samples.float().var()))
        log(f"pipefusion: quality, {q['width']}x{q['height']}, {q['steps']} steps, warmup "
            f"{list(q['warmups'])}")
        if 2 in q["degrees"]:
            quality += measure_quality(p2, {"split": DEFAULT_SPLIT}, 2, q, reference, log)
        close(p2)
        # 3. the other layouts: memory (and the quality at the other degrees)
        for degree in preset["degrees"]:
            for split in preset["splits"]:
                if degree == 1 or any(m["arch"] == "flux" and m["degree"] == degree
                                      and m["split"] == split for m in memory):
                    continue  # measured with the timing pools
                if _same_layout(seen, memory, "flux", flux, degree, split):
                    continue
                p = pool_for(flux, degree, split)
                res = p.generate(_small_job("flux", tcfg))
                memory.append(memory_record(p, facts["flux"], degree, split, res.stats))
                log(f"  flux pipefusion {degree} {split}: max share "
                    f"{memory[-1]['max_share']:.3f} (target {memory[-1]['target_share']:.3f})")
                if degree in q["degrees"] and split == DEFAULT_SPLIT:
                    quality += measure_quality(p, {"split": split}, degree, q, reference, log)
                close(p)
        close(p1)
        if "sd3" in models:
            for degree in preset["degrees"]:
                for split in (preset["splits"] if degree > 1 else ("-",)):
                    if _same_layout(seen, memory, "sd3", models["sd3"], degree, split):
                        continue
                    p = pool_for(models["sd3"], degree, split)
                    res = p.generate(_small_job("sd3", tcfg))
                    memory.append(memory_record(p, facts["sd3"], degree, split, res.stats))
                    log(f"  sd3 pipefusion {degree} {split}: max share "
                        f"{memory[-1]['max_share']:.3f}")
                    close(p)
    finally:
        for p in list(pools):
            p.close()
        if ceiling is not None:
            ceiling.close()

    th = theory(facts["flux"], job, 2)
    comm = []
    for name, r in timing.items():
        degree = r["ranks"]
        t = theory(facts["flux"], job, degree)
        per_rank = [float(sum(c.get(k, 0.0) for k in P2P_KINDS))
                    for c in timing[name]["comm_bytes_per_step"]]
        other = [{k: v for k, v in c.items() if k not in P2P_KINDS and v}
                 for c in timing[name]["comm_bytes_per_step"]]
        comm.append({"run": name, "degree": degree, "split": r["split"],
                     "theory_bytes_per_step": t, "kinds": list(P2P_KINDS),
                     "measured_bytes_per_step": per_rank, "other_bytes_per_step": other,
                     "ratio": [m / x if x else (1.0 if m == 0 else None)
                               for m, x in zip(per_rank, t)]})
    samples = [x for x in samples if x.get("ratio") is not None]
    clean = [x["ratio"] for x in samples if not x["contended"]] or [x["ratio"] for x in samples]
    base, pf = timing["pipefusion1"], timing["pipefusion2"]
    for r in timing.values():
        if r is not base:
            r["speedup_vs_1"] = base["step_s_median"] / r["step_s_median"]
            pr = paired(base, r, job["steps"])
            r["speedup_paired_median"] = statistics.median(pr) if pr else None
    pairs = paired(base, pf, job["steps"])
    speed = {"step_s": {k: v["step_s_median"] for k, v in timing.items()},
             "speedup": base["step_s_median"] / pf["step_s_median"],
             "speedup_paired_median": statistics.median(pairs) if pairs else None,
             "two_core_ceiling": statistics.median(clean) if clean else None,
             "ceiling_samples": samples,
             "contended": any(v["contended"] for v in timing.values())}
    ratios = [x for c in comm for x in c["ratio"] if x is not None]
    return {"models": facts, "job": job, "quality_job": q, "memory": memory,
            "timing": timing, "speed": speed, "comm": comm, "activation_bytes": th[0],
            "quality": quality, "quality_scale": scale,
            "targets": {"memory_slack": MEMORY_SLACK, "bytes_tolerance": BYTES_TOLERANCE,
                        "bytes_met": all(abs(x - 1) <= BYTES_TOLERANCE for x in ratios),
                        "memory_met": {f"{m['arch']} {m['degree']} {m['split']}": m["met"]
                                       for m in memory}},
            "contention": {"threshold": quiet.threshold, "waited_s": quiet.waited},
            "wall_s": time.perf_counter() - t_start}


def _same_layout(seen: set, memory: list, arch: str, model: Path, degree: int,
                 split: str, record: bool = True) -> bool:
    """A split that gives a layout already measured (same model, degree, block ranges) gets
    a copy of that row instead of another pool launch."""
    ranges = _ranges(model, degree, split) if degree > 1 else ()
    if (arch, degree, ranges) not in seen:
        seen.add((arch, degree, ranges))
        return False
    if not record:
        return True
    prev = next(m for m in memory if m["arch"] == arch and m["degree"] == degree
                and tuple(tuple(r["blocks"]) for r in m["ranks"]
                          if r["blocks"]) == tuple(tuple(x) for x in ranges))
    memory.append(dict(prev, split=split, same_as=prev["split"]))
    return True


def _ranges(model: Path, degree: int, split: str) -> tuple:
    """The stage layout a split gives (computed on the meta device, no weights)."""
    from workers.loading.stages import plan_stages

    tr, lists = _meta_transformer(model)
    return plan_stages(tr, lists, 0, degree, split).ranges


# ---- markdown --------------------------------------------------------------------------------
def _mib(mb) -> str:
    return "n/a" if mb is None else f"{mb:.0f}"


def _model_line(f: dict) -> str:
    shape = (f"{f['double_blocks']} double + {f['single_blocks']} single blocks"
             if f["arch"] == "flux" else f"{f['joint_blocks']} joint blocks")
    return (f"{f['arch'].upper()}-shaped random weights, {shape}, {f['heads']} heads x "
            f"{f['head_dim']} (width {f['width']}), {f['transformer_params']:,} transformer "
            f"parameters, {f['block_fraction']:.1%} of them in the blocks")


def markdown(rep: dict) -> str:
    pf = rep["pipefusion"]
    j, q = pf["job"], pf["quality_job"]
    m = rep["machine"]
    L = ["# comfyui-xdit bench: PipeFusion", "",
         f"- machine: {m['cpu_count']} CPUs ({m['cpu_model'] or 'unknown'}), torch {m['torch']}, "
         f"gloo, every rank 1 thread; load average at start {m['loadavg_start']}, at end "
         f"{m.get('loadavg_end')}"]
    for f in pf["models"].values():
        L.append(f"- model: {_model_line(f)}")
    L += ["", "## Transformer weights and memory per rank", "",
          f"Target: weights per rank <= 1/N + {int(MEMORY_SLACK * 100)}% of the whole "
          "transformer. Params per rank = `transformer_params` of the pool status (fp32: 4 "
          "bytes each). RSS (MiB): after importing torch/diffusers, peak while loading, after "
          "a job; rank 0 also holds the (tiny) text encoders.", "",
          "| model | pipefusion | split | rank: blocks | params per rank | share of whole "
          "(max) | target | met | RSS after import | load peak RSS | RSS after job |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in pf["memory"]:
        blocks = ", ".join(f"{x['rank']}: {x['blocks'][0]}-{x['blocks'][1] - 1}"
                           if x["blocks"] else f"{x['rank']}: all" for x in r["ranks"])
        L.append(f"| {r['arch']} | {r['degree']} | {r['split']}"
                 + (f" (= {r['same_as']})" if r.get("same_as") else "") + f" | {blocks} | "
                 + ", ".join(f"{x['transformer_params'] / 1e6:.2f}M" for x in r["ranks"])
                 + " | " + ", ".join(f"{x['share']:.3f}" for x in r["ranks"])
                 + f" (**{r['max_share']:.3f}**) | {r['target_share']:.3f} | "
                 f"{'yes' if r['met'] else 'NO'} | "
                 + ", ".join(_mib(x["rss_after_import_mb"]) for x in r["ranks"]) + " | "
                 + ", ".join(_mib(x["load_peak_rss_mb"]) for x in r["ranks"]) + " | "
                 + ", ".join(_mib(x["rss_after_job_mb"]) for x in r["ranks"]) + " |")
    s = pf["speed"]
    L += ["", "## Time per step: pipefusion 1 (1 rank) vs pipefusion 2 (2 ranks)", "",
          f"Same job: {j['width']}x{j['height']} = {j['image_tokens']} image + "
          f"{j['text_tokens']} text tokens, {j['steps']} steps, 1 prompt, fp32; PipeFusion "
          f"warmup_steps {j['pipefusion_warmup_steps']}, patches = degree; "
          f"{j['warmup_jobs']} warm-up job then {j['timed_jobs']} timed, round-robin; time/step "
          "= denoising loop (slowest rank) / steps, median.", "",
          "| run | split | ranks x threads | time/step (s) | speed-up | same-round pairs | "
          "timed jobs used |", "|---|---|---|---|---|---|---|"]
    for name, r in pf["timing"].items():
        sp = "1.00 (baseline)" if name == "pipefusion1" else f"{r['speedup_vs_1']:.2f}x"
        pr = "" if name == "pipefusion1" else (
            "n/a" if r["speedup_paired_median"] is None else f"{r['speedup_paired_median']:.2f}x")
        L.append(f"| {name} | {r.get('split', '-')} | {r['ranks']} x 1 | "
                 f"{r['step_s_median']:.3f} | {sp} | {pr} | "
                 f"{r['timed_jobs_used']}/{len(r['jobs'])}"
                 f"{' (all contended)' if r['contended'] else ''} |")
    if s["two_core_ceiling"]:
        L.append("")
        L.append(f"Two-core ceiling sampled in the same rounds (two 1-thread matmul processes "
                 f"vs one): {s['two_core_ceiling']:.2f}x.")
    A = pf["activation_bytes"]
    L += ["", "## Bytes sent per step per rank (point-to-point, counted by the sender)", "",
          "Measured: the meter's `send` + `p2p` bytes (plain and grouped sends), data plane "
          f"only. Theory: stage s < N-1 sends B x (image + text tokens) x hidden x 4 B = "
          f"1 x ({j['image_tokens']} + {j['text_tokens']}) x {pf['models']['flux']['width']} x "
          f"4 = {A:,} B per step (every patch once, the text with the step's first patch); the "
          f"last stage sends B x image tokens x 64 x 4 B = "
          f"{j['image_tokens'] * 256:,} B of new latent rows back to stage 0. Warmup steps send "
          "the same in one piece.", "",
          "| run | rank | theory (B/step) | measured (B/step) | measured / theory | other "
          "traffic (B/step) |", "|---|---|---|---|---|---|"]
    for c in pf["comm"]:
        for i, (t, mm, ratio, o) in enumerate(zip(c["theory_bytes_per_step"],
                                                   c["measured_bytes_per_step"],
                                                   c["ratio"], c["other_bytes_per_step"])):
            L.append(f"| {c['run']} | {i} | {t:,.0f} | {mm:,.0f} | "
                     f"{'n/a' if ratio is None else f'{ratio:.4f}'} | "
                     f"{', '.join(f'{k} {v:,.0f}' for k, v in o.items()) or '-'} |")
    L += ["", f"Within {int(BYTES_TOLERANCE * 100)}% of theory: "
          f"{'yes' if pf['targets']['bytes_met'] else 'NO'}."]
    L += ["", "## Quality: PSNR of the decoded image vs the exact run", "",
          f"{q['width']}x{q['height']}, {q['steps']} steps, seed 11, 1 prompt; exact = "
          "pipefusion 1 with the same seed; decoded by the model's VAE (`output=\"image\"`), "
          "pixels in 0..1. warmup_steps = steps is all synchronous (a control: must be exact). "
          "Random weights: the PSNR only indicates how far stale K/V moves the result; a "
          "trained model's figure will differ.", "",
          "| pipefusion | warmup_steps | PSNR (dB) | max abs pixel diff | latent MSE |",
          "|---|---|---|---|---|"]
    for r in pf["quality"]:
        psnr = "identical" if r["psnr_db"] is None else f"{r['psnr_db']:.2f}"
        L.append(f"| {r['degree']} | {r['warmup_steps']} | {psnr} | "
                 f"{r['max_abs']:.4f} | {r['latent_mse']:.3g} |")
    sc = pf.get("quality_scale") or {}
    if sc:
        L += ["", f"Scale on this model: the exact image of another seed (12) scores "
              f"{sc['psnr_db']:.2f} dB against seed 11 (latent MSE {sc['latent_mse']:.3g}); "
              f"the exact image's pixels span {sc['image_range'][0]:.3f}-"
              f"{sc['image_range'][1]:.3f} (std {sc['image_std']:.4f}), its latent variance is "
              f"{sc['latent_var']:.3g}: PipeFusion's rows sit far above an unrelated image; "
              "compare them with each other and with this scale."]
    L += ["", f"Wall time of the PipeFusion section: {pf['wall_s']:.0f} s (waited "
          f"{pf['contention']['waited_s']:.0f} s for a quiet machine).", ""]
    return "\n".join(L)
