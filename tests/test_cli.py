"""The fixed command line: bad input exits 2 with one line before any worker starts;
generate writes a LATENT equal to the pool's result and a PNG; the demo runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig

ROOT = Path(__file__).resolve().parent.parent


# Every Python process started under `cli(..., procs=DIR)` (the CLI and any worker it
# launches: workers are fresh interpreters that keep the caller's PYTHONPATH) writes one
# file into DIR with its command line, from a sitecustomize placed first on PYTHONPATH.
SITECUSTOMIZE = """\
import json, os, sys
_d = os.environ.get("XDIT_TEST_PROCS")
if _d:
    with open(os.path.join(_d, str(os.getpid())), "w") as _f:
        json.dump(sys.orig_argv, _f)
"""


def cli(*args, tmpdir=None, timeout=300, procs=None):
    env = dict(os.environ)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    if procs is not None:
        procs.mkdir(exist_ok=True)
        site = procs.parent / (procs.name + "-site")
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        env["XDIT_TEST_PROCS"] = str(procs)
    return subprocess.run([sys.executable, "-m", "comfyui_xdit", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def started(procs) -> tuple:
    """(the CLI's command lines, every other Python process's) recorded in `procs`."""
    runs = [json.loads(f.read_text()) for f in sorted(procs.iterdir())]
    mine = [a for a in runs if a[1:3] == ["-m", "comfyui_xdit"]]
    return mine, [a for a in runs if a not in mine]


BASE = ["--prompt", "a cat", "--seed", "1", "--steps", "2"]


@pytest.fixture
def other_model(tmp_path):
    d = tmp_path / "unet-model" / "transformer"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    return d.parent


@pytest.mark.parametrize("extra,expect", [
    (["--height", "128", "--width", "128", "--ulysses", "3"], "does not divide the model's 4 attention heads"),
    (["--height", "128", "--width", "128", "--world-size", "4", "--ulysses", "2"], "world size 4 != dp 1 x cfg 1 x pipefusion 1 x ulysses 2 x ring 1 = 2"),
    (["--height", "100", "--width", "128"], "height 100 is not a positive multiple of 16 (try 96)"),
    (["--height", "128", "--width", "128", "--dp", "2"], "batch of 1 prompt(s) is smaller than dp 2"),
    (["--height", "128", "--width", "128", "--cfg-parallel"], "cfg-parallel needs classifier-free guidance"),
    (["--height", "128", "--width", "128", "--cfg", "3", "--cfg-parallel", "4"],
     "cfg-parallel 4 needs 4 guidance passes per step; this run has 2 (uncond, cond): use "
     "cfg-parallel 2 or less"),
    (["--height", "128", "--width", "128", "--cfg-parallel", "two"],
     "--cfg-parallel takes an optional degree, an integer >= 1 (got 'two'); the bare flag is 2"),
    (["--height", "128", "--width", "128", "--ring", "0"], "--ring must be >= 1"),
    (["--height", "128", "--width", "128", "--pipefusion", "2", "--pipefusion-split", "a,b"], "pipefusion_split 'a,b' must be 'balanced', 'compute', 'memory' or 2 positive block counts like 4,4"),
    (["--height", "32", "--width", "32", "--pipefusion", "2", "--ulysses", "4"], "a PipeFusion patch of 1 token rows x 2 cannot be split over ulysses x ring = 4 ranks"),
    (["--height", "128", "--width", "128", "--attention", "flash"], "attention 'flash' is a CUDA kernel and needs device cuda"),
    (["--height", "128", "--width", "128", "--max-sequence-length", "600"], "max_sequence_length must be in 1..512"),
    (["--height", "128", "--width", "128", "--bogus"], "unrecognized arguments: --bogus"),
    (["--height", "128", "--width", "128", "--lora", "missing.safetensors:0.8"], "LoRA file not found: missing.safetensors"),
])
def test_bad_input_exits_2_with_one_line(model_dir, tmp_path, extra, expect):
    out = tmp_path / "x.png"
    procs = tmp_path / "procs"
    r = cli("generate", "--model", model_dir("flux"), *BASE, *extra, "--out", out,
            tmpdir=tmp_path, procs=procs)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and "torchvision" not in l]
    assert len(lines) == 1, r.stderr
    assert expect in lines[0]
    # the CLI was the only Python process: no worker was started (refused before launch)
    mine, others = started(procs)
    assert len(mine) == 1, mine
    assert others == [], f"a pool started: {others}"
    assert not out.exists()


def test_cfg_parallel_takes_an_optional_degree():
    """--cfg-parallel: absent 1, the bare flag 2 (also before another flag), a number that
    degree; the world size counts it."""
    from comfyui_xdit.cli.commands import build_parser, config_from_args

    def degree(*flags):
        args = build_parser().parse_args(["generate", "--model", "m", *BASE, "--height", "16",
                                          "--width", "16", *flags, "--out", "x.png"])
        return config_from_args(args)
    assert degree().cfg == 1 and not degree().cfg_parallel
    assert degree("--cfg-parallel").cfg == 2 and degree("--cfg-parallel").cfg_parallel == 2
    assert degree("--cfg-parallel", "--ulysses", "2").ranks == 4
    assert degree("--cfg-parallel", "4").cfg == 4
    assert degree("--ring", "2", "--cfg-parallel", "3").ranks == 6
    assert degree("--cfg-parallel", "3").describe() == \
        "dp 1 x cfg 3 x pipefusion 1 x ulysses 1 x ring 1"


@pytest.mark.parametrize("kind", ["checkpoint", "garbage"])
def test_bad_lora_file_refused_on_the_host(model_dir, tmp_path, kind):
    """A file that is not a LoRA is refused before any worker starts, in one line naming a
    key the file really holds (or why it is unreadable), and without importing torch: the
    header alone decides, so the refusal takes well under a second."""
    from safetensors.numpy import save_file
    import numpy as np

    lora = tmp_path / f"{kind}.safetensors"
    if kind == "checkpoint":
        save_file({"double_blocks.0.img_mod.lin.weight": np.zeros((4, 4), np.float32)}, lora)
    else:
        lora.write_bytes(b"not a safetensors file")
    procs = tmp_path / "procs"
    r = cli("generate", "--model", model_dir("flux"), *BASE, "--height", "64", "--width", "64",
            "--lora", f"{lora}:0.8", "--out", tmp_path / "x.png", tmpdir=tmp_path, procs=procs)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and "torchvision" not in l]
    assert len(lines) == 1, r.stderr
    expect = {"checkpoint": "holds no LoRA weights", "garbage": "is not a valid .safetensors"}
    assert expect[kind] in lines[0] and str(lora) in lines[0]
    if kind == "checkpoint":
        assert "'double_blocks.0.img_mod.lin.weight'" in lines[0]  # the file's own key
    mine, others = started(procs)
    assert len(mine) == 1 and others == [], others
    code = ("import sys\n"
            "from comfyui_xdit.planning.request import GenerationRequest\n"
            "from comfyui_xdit.planning.model_info import read_model_info\n"
            f"req = GenerationRequest(prompt=['a'], height=64, width=64, loras=[({str(lora)!r}, 1.0)])\n"
            f"problems = req.problems(read_model_info({str(model_dir('flux'))!r}))\n"
            "assert problems and 'torch' not in sys.modules, (problems, 'torch imported')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("which", ["missing", "other", "out"])
def test_bad_model_or_output_exits_2(model_dir, other_model, tmp_path, which):
    model = {"missing": tmp_path / "nope", "other": other_model}.get(which, model_dir("sd3"))
    out = tmp_path / ("x.jpg" if which == "out" else "x.png")
    r = cli("generate", "--model", model, *BASE, "--height", "64", "--width", "64",
            "--out", out, tmpdir=tmp_path)
    assert r.returncode == 2
    msg = r.stderr.strip().splitlines()[-1]
    assert {"missing": "does not exist", "other": "'UNet2DConditionModel' transformer",
            "out": "must be x.safetensors (the LATENT"}[which] in msg
    if which == "out":  # the error lists what --help lists
        from comfyui_xdit.cli.commands import out_forms
        assert msg.endswith(out_forms())
        help_text = " ".join(cli("generate", "--help").stdout.split())
        assert " ".join(out_forms().split()) in help_text


def test_generate_latent_matches_pool_and_png(model_dir, pools, tmp_path):
    """The one-shot CLI launches its own ranks and gives exactly the warm pool's result."""
    from safetensors.torch import load_file

    model = model_dir("flux")
    args = ["generate", "--model", model, "--prompt", "a red cat", "--prompt", "a dog",
            "--seed", "5", "--steps", "2", "--height", "96", "--width", "128",
            "--max-sequence-length", "16", "--ulysses", "2", "--threads-per-rank", "1"]
    procs = tmp_path / "procs"
    r = cli(*args, "--out", tmp_path / "x.safetensors", procs=procs)
    assert r.returncode == 0, r.stderr
    # the process record sees a launch (so its silence in the bad-input tests means none):
    # the CLI and the preloaded launcher's helper, whose forked ranks start no interpreter
    # (with XDIT_LAUNCHER=spawn: one worker process per rank)
    mine, others = started(procs)
    assert len(mine) == 1 and [a[1:3] for a in others] == [["-m", "workers.runtime.preloader"]], \
        (mine, others)
    got = load_file(str(tmp_path / "x.safetensors"))["samples"]
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    want = pool.generate(GenerationRequest(prompt=["a red cat", "a dog"], seed=5, steps=2,
                                           height=96, width=128, max_sequence_length=16)).samples
    assert got.shape == (2, 16, 12, 16) and got.dtype == torch.float32
    assert torch.equal(got, want)

    # PipeFusion with every step in warmup is exact too
    pf = [a if a != "--ulysses" else "--pipefusion" for a in args] + ["--warmup-steps", "2"]
    r = cli(*pf, "--out", tmp_path / "pf.safetensors")
    assert r.returncode == 0, r.stderr
    assert (load_file(str(tmp_path / "pf.safetensors"))["samples"] - want).abs().max() <= 1e-4

    r = cli(*args, "--out", tmp_path / "img.png")
    assert r.returncode == 0, r.stderr
    from PIL import Image
    for name in ("img.png", "img-1.png"):
        with Image.open(tmp_path / name) as im:
            assert im.size == (128, 96) and im.mode == "RGB"
    assert json.loads(r.stdout.strip().splitlines()[-1])["out"][1].endswith("img-1.png")


def test_demo_runs_and_reports(tmp_path):
    env_cache = tmp_path / "cache"
    env = dict(os.environ, XDIT_CACHE=str(env_cache))
    r = subprocess.run([sys.executable, "-m", "comfyui_xdit", "demo", "--out", str(tmp_path / "d")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["max_abs_diff_vs_1_rank"] <= 1e-4
    assert report["config"].endswith("ulysses 2 x ring 1")
    assert len(report["worker_pids"]) == 2
    assert (tmp_path / "d" / "demo.png").stat().st_size > 0
    # one verdict line ends the output, and report.md says the same above a timings table
    verdict = r.stdout.strip().splitlines()[-1]
    assert verdict.startswith("OK: 2 ranks match 1 rank (") and verdict.endswith("<= 1e-4)")
    assert report["verdict"] == verdict
    md = (tmp_path / "d" / "report.md").read_text()
    assert f"**{verdict}**" in md and "| what | seconds |" in md
    assert "| warm job, 2 ranks |" in md


@pytest.mark.parametrize("argv0,usage", [("comfyui-xdit", "usage: comfyui-xdit bench"),
                                         ("__main__.py", "usage: python -m comfyui_xdit bench")])
def test_help_names_the_command_typed_and_the_recipe_page(argv0, usage):
    """bench's usage line names what the user typed (the console script or the module form);
    trained-model's help points at the page that holds its recipe."""
    code = (f"import sys; sys.argv[0] = {argv0!r}\n"
            "from comfyui_xdit.cli.commands import main\n"
            "sys.exit(main(['bench', '--help']))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(usage), r.stdout[:200]
    text = " ".join(cli("trained-model", "--help").stdout.split())
    assert "docs/testing.md#the-trained-test-model" in text
    assert "## The trained test model" in (ROOT / "docs" / "testing.md").read_text()


def test_help_names_the_families_from_the_registry():
    """The top-level description and generate's help list the families the registry holds
    (a new family appears without editing the CLI): all of them for --model, the video
    families for videos and --frames, those with references / image-to-video for --image."""
    import argparse

    from comfyui_xdit.cli.commands import build_parser
    from comfyui_xdit.planning.request import families

    parser = build_parser()
    generate = next(a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    helps = {a.dest: a.help for a in generate._actions}
    every = [f.name for f in families.FAMILIES.values()]
    assert len(every) == len(families.IDS) >= 8
    for name in every:
        assert name in parser.description and name in helps["model"], name
    video = [f for f in families.FAMILIES.values() if f.latent.video]
    still = [f for f in families.FAMILIES.values() if not f.latent.video]
    assert video and still
    for f in video:
        assert f.name in helps["frames"] and f.name in parser.description
    assert not any(f.name in helps["frames"] for f in still)
    for f in families.FAMILIES.values():
        takes = f.capability(families.References) or f.capability(families.ImageToVideo)
        assert (f.name in helps["image"]) == bool(takes), f.name
        assert (f.name in helps["guidance"]) == (f.defaults.guidance is not None), f.name
