"""Every text a node shows, without ComfyUI: the descriptions and tooltips drawn from the
family registry (a new family appears without editing a node), and the one-line status under a
node while and after it runs (`NODE_TEXT_PX`, `fit_text`), with the longer sentence for the
log."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from comfyui_xdit.planning.config import ParallelConfig
from comfyui_xdit.planning.memory_arithmetic import gib
from comfyui_xdit.planning.request import families


def family_list() -> str:
    """Every family the pack runs, for node descriptions (from the family registry, so a
    new family appears without editing a node)."""
    return families.names()


# the pack's example workflows (the custom-node folder's example_workflows/, which ComfyUI's
# Templates browser lists)
EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"


def example_models(folder: Path = EXAMPLES) -> list:
    """The diffusers folders the example workflows load (Load model (xDiT)'s `model` in each
    API-format example), in family order (an example is xdit_<family id>_<what>), each once;
    [] where the folder is missing (an install without the examples)."""
    import json

    order = {fid: i for i, fid in enumerate(families.IDS)}
    found = {}
    for path in sorted(Path(folder).glob("*_api.json")):
        fid = max((f for f in families.IDS if path.name.startswith(f"xdit_{f}_")), key=len,
                  default=None)
        for node in json.loads(path.read_text()).values():
            if node.get("class_type") == "xDiT.LoadModel":
                found.setdefault(node["inputs"]["model"], order.get(fid, len(order)))
    return sorted(found, key=lambda name: (found[name], name))


def example_models_text(folder: Path = EXAMPLES) -> str:
    """"models/diffusers/A, models/diffusers/B or models/diffusers/C": the examples'
    folders, for the loader's tooltip ("" without examples)."""
    names = [f"models/diffusers/{m}" for m in example_models(folder)]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def cfg_defaults_text() -> str:
    """Each family's default classifier-free guidance scale, for the cfg tooltip."""
    parts = []
    for f in families.FAMILIES.values():
        d = f.defaults
        text = f"{f.name} {d.cfg:g}" + (" (off)" if d.cfg <= 1 else "")
        if d.undistilled_cfg is not None:
            text += f", base models {d.undistilled_cfg:g}"
        parts.append(text)
    return "; ".join(parts)


def guidance_defaults_text() -> str:
    """The families with embedded guidance and their defaults, for the guidance tooltip."""
    return ", ".join(f"{f.name} {f.defaults.guidance:g}" for f in families.FAMILIES.values()
                     if f.defaults.guidance is not None)


def conditioning_hint_text() -> str:
    """How each family's CONDITIONING is made, for the positive input's tooltip."""
    return "; ".join(f"{f.name}: {f.text.hint}" for f in families.FAMILIES.values())


def cache_text(counts: Optional[dict], short: bool = False) -> str:
    """The step cache's counts for the node texts: "9 of 16 calls computed in full", short
    "9/16 calls in full" ("" without the cache)."""
    if not counts:
        return ""
    total = counts["computed"] + counts["skipped"]
    if short:
        return f"{counts['computed']}/{total} calls in full"
    return f"{counts['computed']} of {total} calls computed in full"


# ---- the node texts: ComfyUI's progress text under a node ---------------------------------
# ComfyUI's frontends (1.27, 1.35) show it in a text widget added below the node's widgets,
# 58 px tall: one 16 px line of 12 px text (a second line is cut; a long line wraps and is
# cut). So each text is one line that fits the node as the example workflows lay it out and
# as a freshly added node is sized: the node's width less the widget's margins (2 x 10 px)
# and the text's padding (2 x 16 px). The full sentence goes to ComfyUI's log.
NODE_TEXT_PX = {
    "loader": 218,  # Load model (xDiT): 270 wide in the examples, 274-278 fresh
    "sampler": 348,  # Sampler (xDiT): 400
    "decode": 88,  # Decode (xDiT): 140 fresh, 220 in the examples
    "comfy_sampler": 150,  # ComfyUI's samplers on the xDiT MODEL: SamplerCustomAdvanced 202
}                          # fresh (KSampler 270)
# Glyph widths in px, rounded up to 0.5: the larger of the two frontends' text fonts (Inter
# 12 px on 1.35, Arial 12 px on 1.27), measured in headless Chromium; others count 12.5.
_GLYPH_PX = {3.0: "ijl", 3.5: " !,.:I", 4.0: "';`t|", 4.5: "()/[\\]fr", 5.5: "-{}",
             6.0: '"*^', 6.5: "s", 7.0: "17?JL_acekvxyz", 7.5: "235689FZbdghnopqu",
             8.0: "#$&+04<=>BEPST~", 8.5: "AKVXY", 9.0: "CDHNRU", 9.5: "GOQ", 10.0: "w",
             10.5: "m", 11.0: "M", 12.0: "%W"}
_PX = {c: w for w, chars in _GLYPH_PX.items() for c in chars}


def text_px(text: str) -> float:
    """The width of `text` in a node's text widget, estimated from above (px)."""
    return sum(_PX.get(c, 12.5) for c in text)


def fit_text(candidates, node: Optional[str]) -> str:
    """The first of `candidates` (most detailed first) whose one line fits `node`'s text
    widget (NODE_TEXT_PX), else the last; node None: the first (the log's sentence)."""
    candidates = [c for c in candidates if c]
    if node is None:
        return candidates[0]
    return next((c for c in candidates if text_px(c) <= NODE_TEXT_PX[node]), candidates[-1])


def duration_text(seconds: float) -> str:
    """"0.4 s", "9.9 s", then whole seconds: "12 s", "1234 s"."""
    s = max(0.0, float(seconds or 0.0))
    return f"{s:.1f} s" if s < 9.95 else f"{s:.0f} s"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def compiling_text(event: dict) -> Optional[str]:
    """The text under a node for a compiling event (workers/runtime/compile.py: `compile` pools, while
    dynamo compiles during the first steps or calls); None for any other event. The same on
    Sampler (xDiT) and on ComfyUI's samplers (the narrower), so it fits both."""
    if event.get("phase") != "compiling":
        return None
    t = duration_text(event.get("compile_s"))
    return fit_text([f"compiling: {_count(int(event.get('compiles', 0)), 'graph')}, {t}",
                     f"compiling, {t}"], "comfy_sampler")


def model_cache_text(counts: Optional[dict], node: Optional[str] = "comfy_sampler") -> str:
    """A sampling run's step-cache counts under ComfyUI's sampler node running the xDiT MODEL
    ("xDiT: 9/16 calls in full"; node None: "xDiT step cache, 9 of 16 calls computed in
    full", for the log); "" without the cache."""
    if not counts:
        return ""
    return fit_text([f"xDiT step cache, {cache_text(counts)}",
                     f"xDiT: {cache_text(counts, short=True)}",
                     cache_text(counts, short=True)], node)


def step_text(step: int, total: int, counts: Optional[dict]) -> str:
    """Sampler (xDiT) while a cached job runs: "step 3/28, 2 of 3 calls computed in full"."""
    return fit_text([f"step {step}/{total}, {cache_text(counts)}",
                     f"step {step}/{total}, {cache_text(counts, short=True)}",
                     f"step {step}/{total}"], "sampler")


def launch_text(text: str, done: int, total: int, node: Optional[str] = "sampler") -> str:
    """The pool's launch progress ("starting 4 workers", "loading 3/4") as a node's text:
    "starting 0/4" where the node is narrow (Decode)."""
    short = f"loading {done}/{total}" if text.startswith("loading") else \
        f"starting {done}/{total}"
    return fit_text([text, short], node)


def memory_text(plan) -> str:
    """The loader's memory-plan clause: "30.1 of 79.1 GiB" (the peak rank against its GPU),
    "90.2 of 79.1 GiB: too big", "30.1 GiB peak" (GPU size unknown), "no memory plan"."""
    worst = getattr(plan, "worst", None)
    if worst is None:  # launch_policy.UnplannedLaunch
        return "no memory plan"
    peak = gib(worst.total, unit=False)
    if worst.gpu_memory is None:
        return f"{peak} GiB peak"
    text = f"{peak} of {gib(worst.gpu_memory)}"
    return text + (": too big" if plan.fits is False else "")


def loader_text(device: str, dtype: str, ranks: int, plan=None,
                node: Optional[str] = "loader") -> str:
    """What Load model (xDiT) says runs (auto resolved): "runs on cpu, fp32, 2 ranks", with
    the memory plan on CUDA: "cuda, bf16, 8 ranks, 30.1 of 79.1 GiB"."""
    head = f"{device}, {dtype}, {_count(ranks, 'rank')}"
    if plan is None:
        return fit_text([f"runs on {head}", head], node)
    mem = memory_text(plan)
    return fit_text([f"{head}, {mem}", f"{_count(ranks, 'rank')}, {mem}", mem], node)


def layout_text(config: ParallelConfig) -> str:
    """The degrees above 1, in the node's words: "Ulysses 2", "CFG parallel x Ring 2" (cfg
    degree 2 unnumbered, as before; "CFG parallel 4" above it); "" for one rank."""
    cfg = "CFG parallel" + (f" {config.cfg}" if config.cfg > 2 else "")
    parts = [(config.dp > 1, f"DP {config.dp}"), (config.cfg > 1, cfg),
             (config.pipefusion > 1, f"PipeFusion {config.pipefusion}"),
             (config.ulysses > 1, f"Ulysses {config.ulysses}"),
             (config.ring > 1, f"Ring {config.ring}")]
    return " x ".join(text for on, text in parts if on)


def job_text(steps: int, config: ParallelConfig, job_s: float, launch_s: float = 0.0,
             cache: Optional[dict] = None, node: Optional[str] = "sampler") -> str:
    """What the Sampler node says when its job is done, replacing the launch's "loading
    k/N": "12 steps, 2 ranks (Ulysses 2), 3.1 s", plus the launch when this job paid it and
    the step cache's counts; where that is too long for the node, the counts get shorter,
    then the layout goes, then the launch (node None: everything, for the log)."""
    ranks = f"{_count(steps, 'step')}, {_count(config.ranks, 'rank')}"
    layout = layout_text(config)
    head = ranks + (f" ({layout})" if layout else "")
    t = f", {duration_text(job_s)}"
    launch = f" + {duration_text(launch_s)} launch" if launch_s else ""
    full, short = (f", {cache_text(cache)}", f", {cache_text(cache, short=True)}") if cache \
        else ("", "")
    return fit_text([head + t + launch + full, head + t + launch + short,
                     ranks + t + launch + short, ranks + t + short,
                     f"{_count(steps, 'step')}{t}"], node)


def decode_text(images, ranks: int, seconds: float, launched: bool,
                node: Optional[str] = "decode") -> str:
    """What the Decode node says when done, replacing the launch's "loading k/N" when the
    decode started the pool: "2 ranks, 0.8 s" (on the pool) or "VAE, 0.8 s" (the VAE
    input); node None: "decoded 2 images 1024x1024 on 2 ranks, 0.8 s (incl. launch)", for
    the log."""
    n, h, w = int(images.shape[0]), int(images.shape[1]), int(images.shape[2])
    t = duration_text(seconds)
    where = f"on {_count(ranks, 'rank')}" if ranks else "with the VAE input"
    full = (f"decoded {_count(n, 'image')} {w}x{h} {where}, {t}"
            + (" (incl. launch)" if launched else ""))
    if node is None:
        return full
    return fit_text([f"{_count(ranks, 'rank')}, {t}" if ranks else f"VAE, {t}", t], node)


def error_text(e: BaseException) -> str:
    """The line the panel shows: the exception's type and its one-line message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
