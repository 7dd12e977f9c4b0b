"""LTX-2 through the pool equals diffusers' LTX2Pipeline (docs/design.md#numerics-rule-4): one
rank with and without CFG, the video latent and the sound latent each, for a batch of prompts
of different lengths.

The noise is ComfyUI's for the AV LATENT (the video's [B, 128, (frames - 1) / 8 + 1, H/32,
W/32], then the sound's [B, 8, round(frames / 24 * 25), 16], drawn one after the other from
one generator). ComfyUI's LATENT is model space (its VAEs normalise inside), so the pipeline
takes the video noise packed (its packed latents are not normalised again) and the sound
noise brought to raw space (it normalises the sound latents it is given); its raw results are
normalised back to compare. The pipeline's extra guidance passes (spatio-temporal and
modality guidance) and its guidance rescale are off, its audio guidance scale the video's:
the request's cfg, as ComfyUI's.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.comfy_convert import job_noise
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

TOL = 1e-4
SIZE = (64, 96, 9)  # (h, w, frames): 2 latent frames x 2 x 3 = 12 video tokens, 9 sound
A = "a red cat"
B = "a big blue dog sitting on a green field under the sky"
NEGATIVE = "ugly dark old photo"
STEPS = 3
MSL = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = tmp_path_factory.mktemp("ltx2")
    return {v: ensure_tiny_model("ltx2", cache, variant=v) for v in ("t2v",)}


@pytest.fixture(scope="module")
def pipes(folders):
    """The folder as text-to-video and, the same parts, as image-to-video (one LTX-2
    transformer makes both)."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
    t2v = LTX2Pipeline.from_pretrained(str(folders["t2v"]))
    return {"t2v": t2v, "i2v": LTX2ImageToVideoPipeline(**t2v.components)}


def start_image(seed: int = 0):
    """An RGB start image of another size than the video's (the pipeline resizes it)."""
    import numpy as np
    from PIL import Image
    rgb = np.random.RandomState(seed).rand(50, 70, 3)
    return Image.fromarray((rgb * 255).astype("uint8"))


def request(prompts, cfg: float = 3.0, seed: int = 5, **kw) -> GenerationRequest:
    h, w, f = SIZE
    base = dict(prompt=list(prompts), seed=seed, height=h, width=w, frames=f, cfg=cfg,
                negative_prompt=NEGATIVE, steps=STEPS, max_sequence_length=MSL)
    return GenerationRequest(**dict(base, **kw))


def _stats(vae):
    return vae.latents_mean.float(), vae.latents_std.float()


@pytest.fixture(scope="module")
def oracle(pipes):
    """oracle(request) -> (video LATENT, sound LATENT) of LTX2Pipeline, model space."""
    cache = {}

    def run(req: GenerationRequest, image=None):
        """`image`: image-to-video from it; the pipeline then draws its own noise from the
        seed, video then sound, as ComfyUI's nested noise does (its start frame replaces
        the first latent frame's)."""
        key = (tuple(req.prompt), req.seed, req.cfg, req.steps,
               None if image is None else image.tobytes())
        if key in cache:
            return cache[key]
        pipe = pipes["t2v" if image is None else "i2v"]
        b = len(req.prompt)
        vmean, vstd = _stats(pipe.vae)
        amean, astd = _stats(pipe.audio_vae)
        if image is None:
            video, audio = job_noise("ltx2", req.seed, b, req.height, req.width, req.frames)
            packed_audio = audio.transpose(1, 2).flatten(2, 3) * astd + amean
            kw = dict(latents=video.flatten(2).transpose(1, 2), audio_latents=packed_audio)
        else:
            kw = dict(image=image, generator=torch.manual_seed(req.seed))
        v, a = pipe(prompt=list(req.prompt), negative_prompt=[req.negative_prompt] * b,
                    height=req.height, width=req.width, num_frames=req.frames,
                    num_inference_steps=req.steps, guidance_scale=req.cfg,
                    audio_guidance_scale=req.cfg, guidance_rescale=0.0,
                    audio_guidance_rescale=0.0, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0,
                    spatio_temporal_guidance_blocks=None,
                    max_sequence_length=req.max_sequence_length, output_type="latent",
                    return_dict=False, **kw)
        sf = pipe.vae.config.scaling_factor
        v = (v.float() - vmean.view(1, -1, 1, 1, 1)) * sf / vstd.view(1, -1, 1, 1, 1)
        tok = a.float().transpose(1, 2).flatten(2, 3)  # the sound's packed statistics
        a = ((tok - amean) / astd).unflatten(2, (a.shape[1], a.shape[3])).transpose(1, 2)
        cache[key] = (v, a)
        return cache[key]
    return run


def check(got, want, what: str) -> float:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = float((got - want).abs().max())
    print(f"{what}: max abs diff {diff:.2e}")
    assert diff <= TOL, f"{what}: max abs diff {diff:.3e}"
    return diff


def test_one_rank_equals_the_pipeline(folders, layout_pools, oracle):
    """Batch 1 with CFG; a batch of prompts of different lengths without and with CFG: the
    video latent and the sound latent each equal the pipeline's."""
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    h, w, f = SIZE
    for prompts, cfg in (([A], 3.0), ([A, B], 1.0), ([A, B], 4.0)):
        req = request(prompts, cfg)
        got = pool.generate(req).latents
        video, audio = oracle(req)
        assert got.samples.shape == (len(prompts), 128, (f - 1) // 8 + 1, h // 32, w // 32)
        assert got.audio.shape == (len(prompts), 8, round(f / 24 * 25), 16)
        check(got.samples, video, f"1 rank video, batch {len(prompts)} cfg {cfg}")
        check(got.audio, audio, f"1 rank sound, batch {len(prompts)} cfg {cfg}")


def test_image_to_video_equals_the_pipeline(folders, pipes, layout_pools, oracle):
    """One start image (recompressed, resized and encoded as the pipeline does) as the clean
    first latent frame at timestep 0, kept through the steps: the video and the sound equal
    LTX2ImageToVideoPipeline's at 1 rank and on 2 ranks (Ulysses 2, Ring 2: the per-token
    timestep split with the video), a batch of two prompts with CFG; another image moves the
    result (the start frame is read)."""
    image = start_image()
    req = request([A, B], 3.0, reference_images=[image])
    video, audio = oracle(req, image)
    got = layout_pools.get(folders["t2v"], ParallelConfig()).generate(req).latents
    check(got.samples, video, "i2v 1 rank video")
    check(got.audio, audio, "i2v 1 rank sound")
    moved = layout_pools.get(folders["t2v"], ParallelConfig()).generate(
        request([A, B], 3.0, reference_images=[start_image(1)])).latents
    assert float((moved.samples - got.samples).abs().max()) > 1e-3
    for name, config in (("ulysses2", ParallelConfig(ulysses=2)),
                         ("ring2", ParallelConfig(ring=2))):
        res = layout_pools.get(folders["t2v"], config).generate(req).latents
        check(res.samples, video, f"i2v {name} video")
        check(res.audio, audio, f"i2v {name} sound")


def test_sampler_node_takes_the_start_image(folders, oracle):
    """Sampler (xDiT)'s `image` input (ComfyUI's IMAGE, as LoadImage gives it) is LTX-2's
    start frame: the Sampler's operation on EmptyLTXVLatentVideo's LATENT with it equals
    LTX2ImageToVideoPipeline's video and sound (the image-to-video example workflow)."""
    import numpy as np

    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    image = start_image()
    pixels = torch.from_numpy(np.array(image)).float()[None] / 255  # IMAGE [1, H, W, 3]
    h, w, f = SIZE
    reg = PoolRegistry()
    try:
        handle = ModelHandle(path=str(folders["t2v"]), device="cpu", dtype="fp32",
                             threads_per_rank=1)
        empty = {"samples": torch.zeros(1, 128, (f - 1) // 8 + 1, h // 32, w // 32)}
        lat = sample(handle, SampleInputs(latent=empty, prompt=A, negative_prompt=NEGATIVE,
                                          seed=5, steps=STEPS, cfg=3.0,
                                          max_sequence_length=MSL, images=list(pixels)),
                     registry=reg)
    finally:
        reg.unload_all()
    video, audio = oracle(request([A], 3.0, reference_images=[image]), image)
    check(lat["samples"], video, "sampler node i2v video")
    check(lat["audio"], audio, "sampler node i2v sound")


def test_decode_gives_the_frames_and_the_sound_of_the_pipeline(folders, pipes, layout_pools):
    """output="image": the frames (the video VAE) and the waveform (the audio VAE's mel
    spectrogram through the vocoder, with its sample rate) equal LTX2Pipeline's decode of
    the same run; 2 ranks decode alike (rank 0 decodes)."""
    pipe = pipes["t2v"]
    req = request([A], 3.0, output="image")
    h, w, f = SIZE
    video, audio = job_noise("ltx2", req.seed, 1, h, w, f)
    amean, astd = _stats(pipe.audio_vae)
    frames, wave = pipe(prompt=[A], negative_prompt=[NEGATIVE], height=h, width=w,
                        num_frames=f, num_inference_steps=STEPS, guidance_scale=3.0,
                        audio_guidance_scale=3.0, guidance_rescale=0.0,
                        audio_guidance_rescale=0.0, stg_scale=0.0, audio_stg_scale=0.0,
                        modality_scale=1.0, audio_modality_scale=1.0,
                        spatio_temporal_guidance_blocks=None, max_sequence_length=MSL,
                        latents=video.flatten(2).transpose(1, 2),
                        audio_latents=audio.transpose(1, 2).flatten(2, 3) * astd + amean,
                        output_type="pt", return_dict=False)
    want = frames[0].permute(0, 2, 3, 1)  # [F, H, W, 3] in 0..1
    for config in (ParallelConfig(), ParallelConfig(ulysses=2)):
        got = layout_pools.get(folders["t2v"], config).generate(req).decoded
        assert got.images.shape == (f, h, w, 3)
        check(got.images, want, f"decoded frames {config.ulysses}")
        assert got.sample_rate == pipe.vocoder.config.output_sampling_rate
        check(got.audio, wave.float(), f"decoded waveform {config.ulysses}")


def test_cli_writes_the_video_with_its_sound_and_a_wav(folders, layout_pools, tmp_path):
    """`generate --out x.mp4 --wav x.wav`: the .mp4 holds the 9 frames at LTX-2's 24 fps
    and an AAC sound track at the vocoder's rate; the .wav holds the pool's decoded waveform
    (16-bit)."""
    import wave

    import numpy as np
    av = pytest.importorskip("av")
    from test_cli import cli

    h, w, f = SIZE
    r = cli("generate", "--model", folders["t2v"], "--prompt", A, "--seed", "5", "--steps",
            str(STEPS), "--height", str(h), "--width", str(w), "--frames", str(f),
            "--max-sequence-length", str(MSL), "--negative-prompt", NEGATIVE,
            "--threads-per-rank", "1", "--out", tmp_path / "x.mp4", "--wav", tmp_path / "x.wav")
    assert r.returncode == 0, r.stderr
    want = layout_pools.get(folders["t2v"], ParallelConfig()).generate(
        request([A], output="image")).decoded
    with av.open(str(tmp_path / "x.mp4")) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert v.average_rate == 24 and len(list(c.decode(v))) == f
        assert a.rate == want.sample_rate
    with wave.open(str(tmp_path / "x.wav")) as wf:
        n = wf.getnframes()
        pcm = np.frombuffer(wf.readframes(n), dtype="<i2").reshape(n, -1).T / 32767
    assert pcm.shape == tuple(want.audio[0].shape)
    assert float(np.abs(pcm - want.audio[0].clamp(-1, 1).numpy()).max()) <= 1 / 32767


class _Nested:
    """Stands for ComfyUI's NestedTensor (comfy.nested_tensor) in an AV LATENT: what the
    pack reads of it (`is_nested`, `unbind`)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def unbind(self):
        return self.tensors


def test_sampler_and_decode_nodes_give_the_latent_the_frames_and_the_audio(folders,
                                                                           layout_pools):
    """Without ComfyUI: the Sampler's operation on EmptyLTXVLatentVideo's LATENT gives the
    video latent and its sound latent (the pool's); Decode gives the IMAGE frames and
    ComfyUI's AUDIO {"waveform", "sample_rate"}, from the sampler's LATENT and from an AV
    LATENT (the two nested, as LTXVConcatAVLatent makes it) alike, equal to the pool's own
    decode; another family's Decode gives no AUDIO."""
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, decode, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    h, w, f = SIZE
    reg = PoolRegistry()
    try:
        handle = ModelHandle(path=str(folders["t2v"]), device="cpu", dtype="fp32",
                             threads_per_rank=1)
        empty = {"samples": torch.zeros(1, 128, (f - 1) // 8 + 1, h // 32, w // 32)}
        lat = sample(handle, SampleInputs(latent=empty, prompt=A, negative_prompt=NEGATIVE,
                                          seed=5, steps=STEPS, cfg=3.0,
                                          max_sequence_length=MSL), registry=reg)
        want = layout_pools.get(folders["t2v"], ParallelConfig()).generate(
            request([A], output="image"))
        check(lat["samples"], want.latents.samples, "sampler node video latent")
        check(lat["audio"], want.latents.audio, "sampler node sound latent")
        for given in (lat, {"samples": _Nested([lat["samples"], lat["audio"]])}):
            images, audio = decode(handle, given, registry=reg, with_audio=True)
            check(images, want.decoded.images, "decode node frames")
            check(audio["waveform"], want.decoded.audio, "decode node waveform")
            assert audio["sample_rate"] == want.decoded.sample_rate
        images, audio = decode(handle, {"samples": lat["samples"]}, registry=reg,
                               with_audio=True)  # the video alone: no sound to decode
        assert audio is None and images.shape == (f, h, w, 3)
    finally:
        reg.unload_all()


def test_a_size_off_the_32_pixel_grid_is_refused_in_one_line():
    """LTX-2's tokens are 32 x 32 pixels: a height or width that is a multiple of 16 only
    is refused before anything runs, with the size to try."""
    req = request([A], height=80, width=96)
    assert req.problems("ltx2") == ["height 80 is not a positive multiple of 32 (try 64)"]
    assert not request([A]).problems("ltx2")
    assert not GenerationRequest(prompt=[A], height=80, width=48).problems("flux")
