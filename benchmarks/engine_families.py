"""`bench --engine --families all|ID,ID,...`: one denoising step of every family at its released
attention width, the pool (1 rank, eager and `--compile`) against the family's own diffusers
pipeline in the same process.

    python -m comfyui_xdit bench --engine --families all --device cuda --compile [--budget 240]
    python -m comfyui_xdit bench --engine --families all --plan   # what would run, nothing built
    python -m comfyui_xdit bench --engine --families all --quick  # tiny widths, CPU, seconds

Families come from the registry (`workers/families`): a new one joins by existing. A family's
released dimensions are its description's first memory-plan preset (`Presets`) over
the diffusers class defaults; a family without a preset is listed as not run. The model is its
test-model builder's (comfyui_xdit/testmodels/<id>.py: tiny text encoders, VAE, tokenizers)
at the released heads x head_dim, with `--depth` blocks per block list (default 2), and every
transformer config entry that follows the width in the builder (found by comparing two small
builds: an FFN width, RoPE axes) set to the released value; entries the builder keeps small
(text and pooled widths: the encoders' side) are listed in the report. A builder that cannot
make the width is listed with its reason. Weights are random, saved in `--dtype`.

Job: 1024x1024 for images, 832x480 x `--frames` (default 33) for video, one prompt, no CFG
(the pool's request has cfg 1; diffusers gets guidance_scale 1 unless the family embeds
guidance, and a guider component is set to 1); each diffusers transformer call's batch rows
are counted, so a pipeline that still ran CFG shows 2 rows per step. Time per step is
engine.py's (long job - short job) / step difference, median of repeats; per block is that
divided by the blocks built (embedders and the final layer included, so an upper bound).

Order, to fit a GPU slot: every model built, then diffusers eager family by family, then all
eager pools launched at once (their imports and loads overlap; each is timed alone while the
others idle), then, with `--compile`, all compiled pools the same way (their first jobs
compile side by side), then diffusers' `compile_repeated_blocks` family by family. With
`--budget` seconds, a stage that would not fit what is left is listed as not run (time
budget); bench.md / bench.json are rewritten after every stage, so a run cut short keeps
what it measured. Exit status 1 when a run failed (not for one that was not run).
"""
from __future__ import annotations

import inspect
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.request import GenerationRequest

from .engine import TORCH_DTYPES, _step_estimates

PROMPT = "a photo of a red cat"
TEXT_TOKENS = 512  # max_sequence_length of both sides (the pipelines' usual default)
FULL = dict(depth=2, image=(1024, 1024), video=(480, 832), frames=33, steps=(2, 7),
            repeats=2, dtype="bf16")
# --quick: tiny widths (every builder takes 2 heads x 16), one block per list, seconds on CPU
QUICK = dict(heads=2, head_dim=16, depth=1, image=(64, 64), video=(64, 64), frames=5,
             steps=(2, 4), repeats=1, dtype="fp32")
# two small geometries whose builds tell which config entries follow heads / width
PROBES = (dict(heads=4, width=64), dict(heads=2, width=96))
# seconds a stage needs before it starts under --budget: (fixed, per family)
NEEDS = {"build": (0, 20), "diffusers": (0, 20), "pool_eager": (30, 8),
         "pool_compiled": (60, 15), "diffusers_compiled": (0, 60)}
RUNS = ("diffusers", "pool_eager", "pool_compiled", "diffusers_compiled")


def _families():
    from comfyui_xdit import bridge
    return bridge.families


def family_ids(spec: str) -> list:
    """`all` or a comma-separated list of registry ids (unknown ones refused, naming all)."""
    from comfyui_xdit.errors import ConfigError

    ids = list(_families().IDS)
    if spec.strip() == "all":
        return ids
    want = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in want if s not in ids]
    if bad or not want:
        raise ConfigError(f"--families: unknown {', '.join(bad) or '(none given)'}; known: "
                          f"all, {', '.join(ids)}")
    return want


# ---- what each family's model is ------------------------------------------------------------
def release(fid: str) -> dict | None:
    """The family's first memory-plan preset over its transformer class's defaults: name,
    note, config, heads, head_dim, blocks. None where the description has no preset."""
    import diffusers

    fam = _families().family(fid)
    presets = fam.capability(_families().Presets)
    if presets is None or not presets.named:
        return None
    name, spec = next(iter(presets.named.items()))
    params = inspect.signature(getattr(diffusers, fam.classes.transformer).__init__).parameters
    cfg = {k: p.default for k, p in params.items()
           if k != "self" and p.default is not inspect.Parameter.empty}
    cfg = json.loads(json.dumps(dict(cfg, **spec["transformer"]), default=str))
    return dict(preset=name, note=spec.get("note", ""), config=cfg, heads=fam.heads(cfg),
                head_dim=fam.head_dim(cfg), blocks=fam.blocks.count(cfg))


def geometry_keys(fid: str, cache: Path) -> set:
    """Transformer config entries the family's builder derives from heads / width: those that
    differ between two small builds of other geometry (block counts aside)."""
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    a, b = (json.loads((ensure_tiny_model(fid, cache, **g) / "transformer" / "config.json")
                       .read_text()) for g in PROBES)
    counts = set(_families().family(fid).blocks.counts)
    return {k for k in set(a) | set(b) if not k.startswith("_") and k not in counts
            and a.get(k) != b.get(k)}


def plan(fid: str, cache: Path, quick: bool, depth: int) -> dict:
    """A family's row before anything runs: its release, the builder knobs and transformer
    entries, the built transformer's size (on the meta device), or why it cannot run."""
    from comfyui_xdit.testmodels.tiny_model import planned_transformer

    fam = _families().family(fid)
    row = dict(family=fid, name=fam.name, video=fam.latent.video, runs={}, status="planned")
    try:
        rel = release(fid)
    except Exception as e:  # a class diffusers lacks, a config the family cannot read
        rel, row["release_error"] = None, _line(e)
    row["release"] = rel
    if quick:
        heads, head_dim = QUICK["heads"], QUICK["head_dim"]
        overrides = {}
    elif rel is None:
        row["status"] = "not run"
        row["reason"] = row.get("release_error") or (
            f"no memory-plan preset in its description (workers/families/{fid}.py): its "
            "released dimensions are unknown")
        return row
    else:
        heads, head_dim = rel["heads"], rel["head_dim"]
        try:
            keys = geometry_keys(fid, cache)
        except Exception as e:
            row["status"], row["reason"] = "not run", f"the builder's probes failed: {_line(e)}"
            return row
        overrides = {k: rel["config"][k] for k in sorted(keys) if k in rel["config"]}
    knobs = dict(heads=heads, width=heads * head_dim, depth=depth)
    row.update(heads=heads, head_dim=head_dim, width=heads * head_dim, depth=depth,
               overrides=overrides)
    try:
        cfg, params = planned_transformer(fid, transformer=overrides or None, **knobs)
    except ValueError as e:  # the builder's own refusal: a width it cannot make
        row["status"], row["reason"] = "not run", f"the builder refuses: {_line(e)}"
        return row
    except Exception as e:
        row["status"], row["reason"] = "failed", f"planning failed: {_line(e)}"
        return row
    row.update(blocks=fam.blocks.count(cfg), transformer_params=params)
    if rel is not None and not quick:
        counts = set(fam.blocks.counts)
        row["kept_small"] = {k: [cfg.get(k), v] for k, v in sorted(rel["config"].items())
                             if k in cfg and k not in counts and cfg.get(k) != v}
    return row


def tokens(row: dict, job: dict) -> int:
    """Image / video tokens of the job for the family's latent layout."""
    lat = _families().family(row["family"]).latent
    h, w, frames = _size(row, job)
    side = lat.pixels_per_token
    return lat.latent_frames(frames) * (h // side) * (w // side)


def _size(row: dict, job: dict) -> tuple:
    if row["video"]:
        return job["video"][0], job["video"][1], job["frames"]
    return job["image"][0], job["image"][1], 1


def _knobs(row: dict, dtype: str) -> dict:
    return dict(heads=row["heads"], width=row["width"], depth=row["depth"],
                transformer=row["overrides"] or None, dtype=None if dtype == "fp32" else dtype)


def build(row: dict, cache: Path, dtype: str) -> Path:
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    return ensure_tiny_model(row["family"], cache, **_knobs(row, dtype))


def built(row: dict, cache: Path, dtype: str) -> bool:
    """The row's model is in the cache already (built by an earlier --build-only)."""
    from comfyui_xdit.testmodels.parts import cache_name, is_complete
    from comfyui_xdit.testmodels.tiny_model import resolve_config

    cfg = resolve_config(row["family"], **_knobs(row, dtype))
    return is_complete(Path(cache) / cache_name(row["family"], cfg))


# ---- measuring ----------------------------------------------------------------------------
def _request(row: dict, job: dict, steps: int) -> GenerationRequest:
    h, w, frames = _size(row, job)
    return GenerationRequest(prompt=[PROMPT], seed=1, steps=steps, height=h, width=w,
                             frames=frames, cfg=1.0, max_sequence_length=TEXT_TOKENS)


def _summary(est: list, **extra) -> dict:
    return dict(status="ran", step_s_median=statistics.median(est), step_s_all=est, **extra)


class NotAvailable(Exception):
    """A run the pipeline cannot do (listed as not run, not as a failure)."""


def measure_diffusers(row: dict, job: dict, device: str, dtype: str, compile: bool) -> dict:
    """The family's pipeline from the folder, in this process: a warm-up job (compiling
    first with `compile`), then (long - short) / steps; batch rows per transformer call
    counted by a forward pre-hook."""
    import diffusers
    import torch
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    fam = _families().family(row["family"])
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as one pool rank
    pipe = None
    try:
        pipe = diffusers.DiffusionPipeline.from_pretrained(
            row["model"], torch_dtype=getattr(torch, TORCH_DTYPES[dtype])).to(device)
        pipe.set_progress_bar_config(disable=True)
        rows = [0]

        def count(_module, args, kwargs):
            # the first input: a batch tensor, or a list of one tensor per row (Z-Image's)
            x = args[0] if args else next((v for v in kwargs.values()
                                           if isinstance(v, (torch.Tensor, list, tuple))), ())
            rows[0] += int(x.shape[0]) if isinstance(x, torch.Tensor) else len(x)
        hooked = [m for m in pipe.components.values()
                  if type(m).__name__ == fam.classes.transformer]
        for m in hooked:
            m.register_forward_pre_hook(count, with_kwargs=True)
        if getattr(getattr(pipe, "guider", None), "guidance_scale", None) is not None:
            pipe.guider = pipe.guider.new(guidance_scale=1.0)  # no CFG, as the pool's job
        h, w, frames = _size(row, job)
        params = inspect.signature(pipe.__call__).parameters
        kw = dict(prompt=[PROMPT], height=h, width=w, output_type="latent")
        optional = dict(num_frames=frames if row["video"] else None,
                        max_sequence_length=TEXT_TOKENS)
        kw.update({k: v for k, v in optional.items() if k in params and v is not None})
        # the guidance value that runs no CFG: the family's embedded guidance, else 1 (w in
        # pos + w (pos - neg) terms: 0), whichever makes one row per step in the warm-up
        scales = [None] if "guidance_scale" not in params else \
            [fam.defaults.guidance] if fam.defaults.guidance is not None else [1.0, 0.0]
        compile_s = 0.0
        if compile:
            t = time.perf_counter()
            for m in hooked:
                if not getattr(m, "_repeated_blocks", None):
                    raise NotAvailable(f"{type(m).__name__} names no _repeated_blocks for "
                                       "compile_repeated_blocks")
                m.compile_repeated_blocks()
            compile_s = time.perf_counter() - t

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        def run(steps):
            sync()
            t = time.perf_counter()
            with torch.inference_mode():
                pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(1),
                     **kw)
            sync()
            return time.perf_counter() - t

        t = time.perf_counter()
        for g in scales:
            if g is not None:
                kw["guidance_scale"] = g
            rows[0] = 0
            run(job["steps"][0])
            if rows[0] <= job["steps"][0]:
                break
        first_s = time.perf_counter() - t
        rows[0] = 0
        est = _step_estimates(run, job)
        calls = job["repeats"] * (job["steps"][0] + job["steps"][1])
        return _summary(est, first_job_s=first_s + compile_s, rows_per_step=rows[0] / calls,
                        guidance_scale=kw.get("guidance_scale"))
    finally:
        del pipe
        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.empty_cache()


def measure_pools(rows: list, job: dict, device: str, dtype: str, compile: bool, log) -> None:
    """One 1-rank pool per row, launched together (their first jobs run side by side: imports,
    loads and compiles overlap), then each timed alone while the others idle; all closed."""
    from comfyui_xdit.client.exit_cleanup import install_sigterm
    from comfyui_xdit.client.pool import WorkerPool

    install_sigterm()  # the launches happen in threads: SIGTERM (a timeout) still closes them
    name = "pool_compiled" if compile else "pool_eager"
    threads = 1 if device == "cpu" else None
    pools = {r["family"]: WorkerPool(r["model"], ParallelConfig(), device=device, dtype=dtype,
                                     threads_per_rank=threads, compile=compile,
                                     memory_plan="advise") for r in rows}
    try:
        def first(r):
            t = time.perf_counter()
            res = pools[r["family"]].generate(_request(r, job, job["steps"][0]))
            comp = [s.get("compile") or {} for s in res.stats]
            return dict(first_job_s=time.perf_counter() - t,
                        compile_s=max((c.get("compile_s", 0.0) for c in comp), default=0.0),
                        compiles_first_job=max((c.get("compiles", 0) for c in comp), default=0))
        with ThreadPoolExecutor(max_workers=len(rows)) as ex:
            started = {r["family"]: ex.submit(first, r) for r in rows}
        for r in rows:
            fid = r["family"]
            try:
                warm = started[fid].result()
                pool, after = pools[fid], []

                def job_s(steps):
                    res = pool.generate(_request(r, job, steps))
                    comp = [s.get("compile") or {} for s in res.stats]
                    after.append((max(c.get("compiles", 0) for c in comp),
                                  max(c.get("graph_records", 0) for c in comp)))
                    return max(s["denoise_s"] for s in res.stats)
                est = _step_estimates(job_s, job)
                # compiles or CUDA graph captures inside a timed job would be in its time
                r["runs"][name] = _summary(est, launch_ready_s=pool.last_launch.get("ready_s"),
                                           compiles_while_timed=sum(a for a, _ in after),
                                           graph_records_while_timed=sum(b for _, b in after),
                                           **warm)
                log(f"  {fid} {name}: {r['runs'][name]['step_s_median'] * 1000:.1f} ms/step")
            except Exception as e:
                r["runs"][name] = _failed(e)
                log(f"  {fid} {name}: {r['runs'][name]['status']}: {_line(e)}")
    finally:
        for p in pools.values():
            p.close()


def _failed(e: BaseException) -> dict:
    """A run that raised: failed, or not run where the product refuses it (ConfigError: a
    launch or option it does not take, said in one line)."""
    from comfyui_xdit.errors import ConfigError

    if isinstance(e, (ConfigError, NotAvailable)):
        return dict(status="not run", reason=str(e).strip().splitlines()[-1][:300])
    return dict(status="failed", reason=_line(e))


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]


# ---- the sweep ------------------------------------------------------------------------------
class Budget:
    """Seconds left of `--budget` (None: no limit); `fits(stage, n)` says whether a stage for
    n families fits (NEEDS) and returns the reason when not."""

    def __init__(self, seconds):
        self.end = None if seconds is None else time.monotonic() + float(seconds)

    def short(self, stage: str, n: int = 1):
        if self.end is None:
            return None
        fixed, each = NEEDS[stage]
        need, left = fixed + each * n, self.end - time.monotonic()
        return None if left >= need else f"time budget ({left:.0f} s left, ~{need} s needed)"


def run(args, log, write=None) -> dict:
    """The sweep; `write(report)` after every stage. Returns the report."""
    from comfyui_xdit.cli.demo import default_cache
    from comfyui_xdit.errors import ConfigError

    quick = bool(args.quick)
    job = dict(QUICK if quick else FULL)
    device = args.device or "cpu"
    dtype = args.dtype or job["dtype"]
    depth = args.depth or job["depth"]
    if args.frames:
        job["frames"] = args.frames
    if args.steps is not None:
        job["steps"] = (job["steps"][0], max(job["steps"][0] + 1, args.steps))
    if args.repeats is not None:
        job["repeats"] = max(1, args.repeats)
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device")
    elif not (quick or args.plan or args.build_only):
        raise ConfigError("the family sweep at released widths needs --device cuda (or "
                          "--quick for tiny widths on CPU, --plan to list what would run, "
                          "--build-only to build the models)")
    cache = Path(args.model_cache) if args.model_cache else default_cache() / "models"
    budget = Budget(args.budget)
    report = dict(device=device, dtype=dtype, quick=quick, compile=bool(args.compile),
                  job=dict(job, depth=depth, text_tokens=TEXT_TOKENS), rows=[])
    write = write or (lambda rep: None)
    rows = report["rows"]
    for fid in family_ids(args.families):
        row = plan(fid, cache, quick, depth)
        if row["status"] == "planned":
            row["tokens"] = tokens(row, job)
        rows.append(row)
        log(f"bench --engine --families: {fid}: " + (
            f"{row['heads']} x {row['head_dim']}, {row['blocks']} blocks, "
            f"{_params(row['transformer_params'])} parameters, {row['tokens']} tokens"
            if row["status"] == "planned" else f"{row['status']}: {row['reason']}"))
    wanted = ["diffusers", "pool_eager"] + (["pool_compiled", "diffusers_compiled"]
                                            if args.compile else [])
    live = [r for r in rows if r["status"] == "planned"]
    if args.plan:
        for r in live:
            r["status"] = "planned only (--plan)"
        write(report)
        return report

    def skip(rs, stage, reason):
        for r in rs:
            r["runs"].setdefault(stage, dict(status="not run", reason=reason))

    for r in live:  # build
        why = None if built(r, cache, dtype) else budget.short("build")
        if why:
            r["status"], r["reason"] = "not run", f"not built: {why}"
            continue
        t = time.perf_counter()
        try:
            r["model"] = str(build(r, cache, dtype))
            r["build_s"] = time.perf_counter() - t
            log(f"  {r['family']}: model ready ({r['build_s']:.1f} s)")
        except ValueError as e:
            r["status"], r["reason"] = "not run", f"the builder refuses: {_line(e)}"
        except Exception as e:
            r["status"], r["reason"] = "failed", f"build failed: {_line(e)}"
    live = [r for r in live if "model" in r]
    if args.build_only:
        for r in live:
            r["status"] = "built only (--build-only)"
        write(report)
        return report
    write(report)

    def serial(stage, compile):
        for r in live:
            why = budget.short(stage)
            if why:
                skip([r], stage, why)
                continue
            try:
                r["runs"][stage] = measure_diffusers(r, job, device, dtype, compile)
                log(f"  {r['family']} {stage}: "
                    f"{r['runs'][stage]['step_s_median'] * 1000:.1f} ms/step")
            except Exception as e:
                r["runs"][stage] = _failed(e)
                log(f"  {r['family']} {stage}: {r['runs'][stage]['status']}: {_line(e)}")
            write(report)

    def wave(stage, compile):
        # as many families as the budget holds, in registry order; the rest not run
        n = len(live)
        while n and budget.short(stage, n):
            n -= 1
        skip(live[n:], stage, budget.short(stage, n + 1) or "")
        if n:
            try:
                measure_pools(live[:n], job, device, dtype, compile, log)
            except Exception as e:
                for r in live[:n]:
                    r["runs"].setdefault(stage, _failed(e))
        write(report)

    serial("diffusers", False)
    wave("pool_eager", False)
    if args.compile:
        wave("pool_compiled", True)
        serial("diffusers_compiled", True)
    for r in live:
        r["status"] = "ran" if any(x.get("status") == "ran" for x in r["runs"].values()) \
            else "not run"
    for r in rows:
        for stage in RUNS:
            if stage not in wanted:
                r["runs"].setdefault(stage, dict(status="not asked", reason="no --compile"))
            elif r["status"] in ("not run", "failed") and stage not in r["runs"]:
                r["runs"][stage] = dict(status="not run", reason=r.get("reason", ""))
        _ratios(r)
    write(report)
    return report


def _ratios(r: dict) -> None:
    runs = r["runs"]
    for pool, ref in (("pool_eager", "diffusers"), ("pool_compiled", "diffusers_compiled"),
                      ("pool_compiled", "pool_eager")):
        a, b = runs.get(pool, {}), runs.get(ref, {})
        if a.get("status") == "ran" and b.get("status") == "ran":
            a[f"vs_{ref}"] = a["step_s_median"] / b["step_s_median"]


def failed(report: dict) -> list:
    """(family, what) of every failure in the report."""
    out = []
    for r in report["rows"]:
        if r["status"] == "failed":
            out.append((r["family"], r.get("reason", "")))
        out += [(r["family"], f"{k}: {v.get('reason', '')}") for k, v in r["runs"].items()
                if v.get("status") == "failed"]
    return out


# ---- the table ----------------------------------------------------------------------------
def _ms(run: dict, blocks=None) -> str:
    if run.get("status") != "ran":
        return "-"
    ms = run["step_s_median"] * 1000
    return f"{ms:.1f}" + (f" ({ms / blocks:.2f})" if blocks else "")


def _x(run: dict, key: str) -> str:
    return f"{run[key]:.2f}x" if key in run else "-"


def markdown(report: dict) -> str:
    j = report["job"]
    mode = "tiny widths (--quick)" if report["quick"] else "released widths"
    L = ["## Engine per family: pool vs the family's diffusers pipeline, one step", "",
         f"- {mode}, {j['depth']} block(s) per block list; {report['device']} "
         f"{report['dtype']}; images {j['image'][1]}x{j['image'][0]}, video "
         f"{j['video'][1]}x{j['video'][0]} x {j['frames']} frames; one prompt, "
         f"{j['text_tokens']} text tokens at most, no CFG",
         f"- time/step = (job of {j['steps'][1]} steps - job of {j['steps'][0]}) / "
         f"{j['steps'][1] - j['steps'][0]}, median of {j['repeats']}, after a warm-up job; "
         "(per block) = time/step / blocks built, embedders included; pools: 1 rank",
         "",
         "| family | release (preset) | heads x dim | blocks built / released | tokens | "
         "diffusers ms/step | pool eager ms/step (per block) | pool / diffusers | "
         "diffusers compiled | pool compiled (per block) | pool / diffusers compiled | "
         "diffusers rows/step |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        rel, runs = r.get("release"), r["runs"]
        blocks = r.get("blocks")
        d = runs.get("diffusers", {})
        L.append(" | ".join([
            f"| {r['name']} (`{r['family']}`)",
            f"{rel['preset']}" if rel else "none",
            f"{r['heads']} x {r['head_dim']}" if "heads" in r else "-",
            f"{blocks} / {rel['blocks'] if rel else '-'}" if blocks else "-",
            str(r.get("tokens", "-")),
            _ms(d), _ms(runs.get("pool_eager", {}), blocks),
            _x(runs.get("pool_eager", {}), "vs_diffusers"),
            _ms(runs.get("diffusers_compiled", {})),
            _ms(runs.get("pool_compiled", {}), blocks),
            _x(runs.get("pool_compiled", {}), "vs_diffusers_compiled"),
            f"{d['rows_per_step']:g}" if "rows_per_step" in d else "-"]) + " |")
    L += ["", "What ran, per family:", ""]
    for r in report["rows"]:
        ran = [k for k in RUNS if r["runs"].get(k, {}).get("status") == "ran"]
        other = [f"{k} {v['status']} ({v.get('reason', '')})" for k, v in r["runs"].items()
                 if v.get("status") != "ran"]
        head = f"- `{r['family']}`: " + (f"ran {', '.join(ran)}" if ran else "nothing ran")
        if r["status"] in ("not run", "failed") and not r["runs"]:
            other = [f"{r['status']}: {r.get('reason', '')}"]
        elif r["status"].startswith(("planned", "built")):
            other = [r["status"]]
        timed = [f"{k}: {v.get('compiles_while_timed', 0)} compiles and "
                 f"{v.get('graph_records_while_timed', 0)} CUDA graph captures while timed"
                 for k, v in r["runs"].items() if v.get("compiles_while_timed")
                 or v.get("graph_records_while_timed")]
        if "transformer_params" in r:
            head += f" ({_params(r['transformer_params'])} transformer parameters)"
        L.append(head + ("; " + "; ".join(other + timed) if other or timed else ""))
        if r.get("overrides"):
            L.append(f"  - released entries set: {_kv(r['overrides'])}")
        if r.get("kept_small"):
            L.append("  - kept from the test model (built vs released): " + ", ".join(
                f"{k} {a} vs {b}" for k, (a, b) in r["kept_small"].items()))
    L.append("")
    return "\n".join(L)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _kv(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def main_section(args) -> int:
    """Writes bench.json / bench.md under --out after every stage; prints the markdown."""
    from .measure import loadavg, machine_facts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    machine = machine_facts(args.device or "cpu")
    t = time.perf_counter()

    def write(rep):
        full = {"machine": dict(machine, loadavg_end=loadavg()), "engine_families": rep,
                "wall_s": time.perf_counter() - t}
        (out / "bench.json").write_text(json.dumps(full, indent=2, default=str) + "\n")
        (out / "bench.md").write_text(markdown(rep))
    report = run(args, log, write)
    print(markdown(report))
    bad = failed(report)
    for fid, what in bad:
        print(f"error: {fid}: {what}", file=sys.stderr)
    return 1 if bad else 0
