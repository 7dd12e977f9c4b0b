"""Writing IMAGE tensors to files (the CLI and the demo)."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path


def _to_uint8(images):
    """IMAGE [N,H,W,3] float 0..1 (torch or numpy) -> numpy uint8 [N,H,W,3]."""
    import numpy as np

    arr = images.detach().cpu().float().numpy() if hasattr(images, "detach") \
        else np.asarray(images, dtype=np.float32)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"expected IMAGE frames [N, H, W, 3], got shape {tuple(arr.shape)}")
    return (arr * 255).round().clip(0, 255).astype(np.uint8)


def save_pngs(images, out: Path) -> list:
    """IMAGE [B,H,W,3] -> out.png, out-1.png, ..."""
    from PIL import Image

    paths = []
    for i, img in enumerate(_to_uint8(images)):
        p = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        Image.fromarray(img).save(p)
        paths.append(p)
    return paths


def save_frames(frames, out: Path) -> list:
    """IMAGE [F,H,W,3] (one video) -> one PNG per frame. `out` is a printf-style pattern
    (`frames/%04d.png`: frame i is `out % i`) or a directory (made if missing; frames
    `0000.png`, `0001.png`, ...). Returns the paths written."""
    from PIL import Image

    pattern = str(out) if "%" in str(out) else str(Path(out) / "%04d.png")
    paths = []
    for i, img in enumerate(_to_uint8(frames)):
        p = Path(pattern % i)
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(p)
        paths.append(p)
    return paths


VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi", ".webm")


def video_codec(suffix: str = ".mp4") -> str:
    """The encoder for a container: WebM takes VP9 (`libvpx-vp9`, else VP8 `libvpx`); the
    others H.264 (`libx264`) where this PyAV build can encode it, else MPEG-4 part 2."""
    import av

    if suffix.lower() == ".webm":
        for name in ("libvpx-vp9", "libvpx"):
            if name in av.codecs_available:
                return name
        raise ValueError("this PyAV build has no VP8/VP9 encoder for .webm; write .mp4 or .mkv")
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def save_wav(waveform, sample_rate: int, out: Path) -> list:
    """A waveform [channels, samples] in -1..1 (ComfyUI's AUDIO's, one clip) -> a 16-bit PCM
    .wav at `sample_rate` (the standard library's writer). Returns [out]."""
    import wave

    import numpy as np

    arr = waveform.detach().cpu().float().numpy() if hasattr(waveform, "detach") \
        else np.asarray(waveform, dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"expected a waveform [channels, samples], got {tuple(arr.shape)}")
    pcm = (arr.clip(-1, 1) * 32767).round().astype("<i2").T  # interleaved frames
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(out), "wb") as w:
        w.setnchannels(arr.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.tobytes())
    return [out]


def _sound_stream(container, waveform, sample_rate: int):
    """An AAC stream of `container` for the sound track [channels, samples] (added with the
    video's, before anything is muxed) and the one frame holding it."""
    import av
    import numpy as np

    arr = waveform.detach().cpu().float().numpy() if hasattr(waveform, "detach") \
        else np.asarray(waveform, dtype=np.float32)
    layout = "mono" if arr.shape[0] == 1 else "stereo"
    arr = np.ascontiguousarray(arr[:2].clip(-1, 1), dtype=np.float32)
    stream = container.add_stream("aac", rate=int(sample_rate))
    stream.layout = layout
    frame = av.AudioFrame.from_ndarray(arr, format="fltp", layout=layout)
    frame.sample_rate, frame.pts = int(sample_rate), 0
    frame.time_base = Fraction(1, int(sample_rate))
    return stream, frame


def save_video(frames, out: Path, fps: float = 16, codec: str | None = None,
               audio=None, sample_rate: int | None = None) -> list:
    """IMAGE [F,H,W,3] float 0..1 (one video, Wan's decode: 16 fps) -> `out`.

    `out` ending in a video suffix (VIDEO_SUFFIXES) is encoded with PyAV (`codec`, default
    `video_codec(suffix)`: H.264 `libx264`, crf 18, else `mpeg4`; VP9 crf 18 in .webm) in yuv420p,
    which needs an even width and height: an odd one is padded by repeating the last row /
    column (the video is then one pixel taller / wider than the frames). Any other `out` (a
    `%04d.png` pattern, a directory, a path with no suffix) gets a PNG per frame
    (`save_frames`). `audio` [channels, samples] at `sample_rate` (a video's sound track)
    is muxed into a video file as AAC (PNG frames carry none). Returns the paths written
    ([out] for a video)."""
    import numpy as np

    out = Path(out)
    if "%" in str(out) or out.suffix.lower() not in VIDEO_SUFFIXES:
        return save_frames(frames, out)
    import av

    arr = _to_uint8(frames)
    n, h, w, _ = arr.shape
    if n == 0:
        raise ValueError("save_video: no frames")
    if h % 2 or w % 2:  # yuv420p subsamples chroma 2x2
        arr = np.pad(arr, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    codec = codec or video_codec(out.suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out), mode="w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = arr.shape[2], arr.shape[1]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18"}
        elif codec.startswith("libvpx"):  # constant quality (b:v 0), as crf 18 for H.264
            stream.options = {"crf": "18", "b": "0"}
        else:
            stream.bit_rate = max(2_000_000, stream.width * stream.height * int(fps) // 4)
        sound = None if audio is None else _sound_stream(container, audio, sample_rate)
        for img in arr:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
        if sound is not None:  # PyAV cuts the samples into the encoder's frames
            container.mux(sound[0].encode(sound[1]))
            container.mux(sound[0].encode())
    return [out]
