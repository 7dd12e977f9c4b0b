"""The CLI's video writer (comfyui_xdit/cli/images.py): an IMAGE batch of frames [F, H, W, 3]
becomes an .mp4 (PyAV, H.264 where the build has libx264, else MPEG-4) that reads back with the
same frame count, size and, roughly, content; odd sizes are padded to even; a `%04d.png`
pattern or a directory gets one PNG per frame."""
from __future__ import annotations

import pytest
import torch

av = pytest.importorskip("av")


def _frames(n=5, h=48, w=64):
    """Smooth moving gradients (lossy codecs keep them close)."""
    y = torch.linspace(0, 1, h).view(1, h, 1)
    x = torch.linspace(0, 1, w).view(1, 1, w)
    t = torch.arange(n, dtype=torch.float32).view(n, 1, 1) / n
    return torch.stack([((x + t) % 1).expand(n, h, w), y.expand(n, h, w),
                        (0.5 + 0.5 * x * y).expand(n, h, w)],
                       dim=-1)


def _read(path):
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        return stream, frames


@pytest.mark.parametrize("codec", [None, "mpeg4"])
def test_mp4_reads_back(tmp_path, codec):
    from comfyui_xdit.cli.images import save_video, video_codec
    frames = _frames()
    out = tmp_path / "clip.mp4"
    assert save_video(frames, out, fps=16, codec=codec) == [out]
    stream, got = _read(out)
    assert stream.codec_context.name == ("h264" if (codec or video_codec()) == "libx264"
                                         else "mpeg4")
    assert len(got) == 5
    assert got[0].shape == (48, 64, 3)
    assert stream.average_rate == 16
    # lossy, but the picture is the one written (mean abs error well under 5 of 255)
    want = (frames * 255).round().numpy()
    err = sum(abs(g.astype(float) - w).mean() for g, w in zip(got, want)) / 5
    assert err < 5, err


def test_odd_size_padded_to_even(tmp_path):
    from comfyui_xdit.cli.images import save_video
    out = tmp_path / "odd.mp4"
    save_video(_frames(3, 33, 47), out, fps=16)
    _, got = _read(out)
    assert len(got) == 3 and got[0].shape == (34, 48, 3)


def test_png_sequences(tmp_path):
    from PIL import Image

    from comfyui_xdit.cli.images import save_video
    paths = save_video(_frames(), tmp_path / "seq" / "f%04d.png")
    assert [p.name for p in paths] == [f"f{i:04d}.png" for i in range(5)]
    paths = save_video(_frames(), tmp_path / "dir")
    assert [p.name for p in paths] == [f"{i:04d}.png" for i in range(5)]
    assert Image.open(paths[-1]).size == (64, 48)
