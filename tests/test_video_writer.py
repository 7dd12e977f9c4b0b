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


def test_a_video_carries_its_sound_and_a_wav_holds_it():
    """A video's sound track [2, samples] (LTX-2's decode) is muxed into the .mp4 as an AAC
    stream at its sample rate, about as long as the samples; save_wav writes the same samples
    as 16-bit PCM that read back within one quantum."""
    import wave

    import numpy as np

    from comfyui_xdit.cli.images import save_video, save_wav

    rate, n = 24000, 24000  # one second
    t = torch.arange(n) / rate
    sound = torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * t),
                         0.25 * torch.sin(2 * torch.pi * 220 * t)])
    import tempfile
    from pathlib import Path
    d = Path(tempfile.mkdtemp())
    out = save_video(_frames(24), d / "v.mp4", fps=24, audio=sound, sample_rate=rate)[0]
    with av.open(str(out)) as c:
        assert len(c.streams.video) == 1 and len(c.streams.audio) == 1
        a = c.streams.audio[0]
        assert a.rate == rate and a.channels == 2
        got = np.concatenate([f.to_ndarray() for f in c.decode(a)], axis=-1)
    assert abs(got.shape[-1] - n) <= 2048  # the encoder's priming and last frame
    wav = save_wav(sound, rate, d / "s.wav")[0]
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, rate, n)
        pcm = np.frombuffer(w.readframes(n), dtype="<i2").reshape(n, 2).T / 32767
    assert float(np.abs(pcm - sound.numpy()).max()) <= 1 / 32767
