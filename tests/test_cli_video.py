"""`generate` for video (Wan): --frames (4k + 1, refused otherwise with exit 2 and one line
before any worker starts), --cfg-2 (Wan 2.2's low-noise expert), and --out as the 5-D LATENT,
a video file or one PNG per frame; image models refuse video outputs."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from test_cli import cli, started

JOB = ["--prompt", "a cat", "--seed", "3", "--steps", "2", "--height", "32", "--width", "48",
       "--max-sequence-length", "8"]


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    return ensure_tiny_model("wan", tmp_path_factory.mktemp("wan"), variant="a14b")


@pytest.mark.parametrize("arch,extra,out,expect", [
    ("wan", ["--frames", "4"], "x.mp4", "frames 4 is not of the form 4k + 1 (Wan video: try 1 or 5)"),
    ("wan", ["--frames", "0"], "x.mp4", "--frames must be >= 1"),
    ("flux", ["--frames", "5"], "x.png", "frames 5: FLUX.1 makes images (frames 1)"),
    ("flux", [], "x.mp4", "is a video, but FLUX.1 makes images"),
    ("flux", [], "f_%04d.png", "is a video, but FLUX.1 makes images"),
    ("wan", ["--frames", "5"], "x.png", "is one PNG, but Wan makes 5 frames"),
    ("wan", ["--cfg-2", "3"], "x.mp4", "--cfg-2 is the second expert's guidance scale"),
    ("wan", ["--frames", "5"], "x.gif", "must be x.safetensors (the LATENT; 5-D for video), x.png (images), or for video"),
    ("wan", ["--frames", "5"], "f_%04d.jpg", "a frame pattern must end in .png"),
    ("wan", ["--frames", "5", "--fps", "0"], "x.mp4", "--fps must be > 0"),
    ("wan", ["--frames", "5", "--shift", "0"], "x.mp4", "shift must be a number > 0"),
])
def test_video_bad_input_exits_2_with_one_line(model_dir, tmp_path, arch, extra, out, expect):
    procs = tmp_path / "procs"
    r = cli("generate", "--model", model_dir(arch), *JOB, *extra, "--out", tmp_path / out,
            tmpdir=tmp_path, procs=procs)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and "torchvision" not in l]
    assert len(lines) == 1 and expect in lines[0], r.stderr
    mine, others = started(procs)
    assert len(mine) == 1 and others == [], others  # refused before any worker
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("procs")] == []


def test_wan_latent_equals_the_pool_and_video_reads_back(a14b, tmp_path):
    """Wan 2.2 A14B, Ulysses 2, both experts with their own guidance, flow shift 2: the CLI's
    5-D LATENT is the warm pool's; --out x.mp4 decodes it to a 5-frame video per prompt."""
    av = pytest.importorskip("av")
    from safetensors.torch import load_file

    args = ["generate", "--model", a14b, *JOB, "--frames", "5", "--cfg", "2", "--cfg-2", "1.5",
            "--shift", "2", "--ulysses", "2", "--threads-per-rank", "1"]
    r = cli(*args, "--out", tmp_path / "x.safetensors")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "x.safetensors"))["samples"]
    assert got.shape == (1, 16, 2, 4, 6) and got.dtype == torch.float32
    from comfyui_xdit import WorkerPool
    with WorkerPool(a14b, ParallelConfig(ulysses=2), device="cpu", threads_per_rank=1) as pool:
        want = pool.generate(GenerationRequest(
            prompt=["a cat"], seed=3, steps=2, height=32, width=48, max_sequence_length=8,
            frames=5, cfg=2.0, cfg_2=1.5, shift=2.0)).samples
        other = pool.generate(GenerationRequest(
            prompt=["a cat"], seed=3, steps=2, height=32, width=48, max_sequence_length=8,
            frames=5, cfg=2.0, cfg_2=4.0, shift=2.0)).samples
    assert torch.equal(got, want)
    assert not torch.equal(other, want)  # --cfg-2 reached the low-noise expert

    r = cli(*[a if a != "a cat" else "a dog" for a in args], "--prompt", "a bird",
            "--fps", "8", "--out", tmp_path / "clip.mp4")
    assert r.returncode == 0, r.stderr
    outs = json.loads(r.stdout.strip().splitlines()[-1])["out"]
    assert [Path(p).name for p in outs] == ["clip.mp4", "clip-1.mp4"]
    for p in outs:
        with av.open(p) as c:
            s = c.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(s)]
            assert s.average_rate == 8
        assert len(frames) == 5 and frames[0].shape == (32, 48, 3)


@pytest.mark.parametrize("out,names", [
    ("seq/f_%03d.png", ["seq/f_000.png", "seq/f_001.png", "seq/f_000-1.png", "seq/f_001-1.png"]),
    ("frames", ["frames/0000.png", "frames/0001.png", "frames-1/0000.png",
                "frames-1/0001.png"]),
    ("clip.webm", ["clip.webm", "clip-1.webm"]),
])
def test_write_output_splits_the_batch_into_videos(tmp_path, out, names):
    """The pool's IMAGE batch of 2 videos x 2 frames, written as --out asks (no pool)."""
    from comfyui_xdit.cli.commands import output_kind, write_output
    if out.endswith(".webm"):
        pytest.importorskip("av")
    (tmp_path / "seq").mkdir()
    frames = torch.rand(4, 16, 32, 3)
    result = SimpleNamespace(images=frames, samples=None)
    target = tmp_path / out
    written = write_output(result, target, output_kind(str(target)), batch=2, fps=16)
    assert [str(p.relative_to(tmp_path)) for p in written] == names
    assert all(p.is_file() for p in written)


def test_output_kinds():
    from comfyui_xdit.cli.commands import output_kind
    assert [output_kind(o) for o in ("x.safetensors", "x.png", "x.mp4", "x.MKV", "y.webm",
                                     "f%04d.png", "dir/", "dir")] == \
        ["latent", "png", "video", "video", "video", "frames", "frames", "frames"]
