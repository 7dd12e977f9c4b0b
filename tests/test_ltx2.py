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
from comfyui_xdit.bridge import worker_module
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


def _comfy_conditioning(pipe, prompt: str) -> list:
    """ComfyUI 0.8.0's LTX-2 CONDITIONING of `prompt` from the folder's own Gemma 3 and text
    connectors: the video's and the sound's prompt states side by side on the last axis."""
    with torch.inference_mode():
        pe, pm, _, _ = pipe.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False,
                                          max_sequence_length=MSL, device="cpu")
        video, audio, _ = pipe.connectors(pe, pm, padding_side=pipe.tokenizer.padding_side)
    return [[torch.cat([video, audio], -1).float(), {}]]


def test_sampler_takes_ltx2_conditioning_as_the_prompt_text(folders, pipes):
    """Sampler (xDiT) with positive and negative CONDITIONING made by the folder's own
    encoder and connectors equals the Sampler with the prompt texts, video and sound (the
    context split in two: the video's states, the sound's); a context of the caption width
    alone (one stream's) is refused in one line naming the width it needs, unless the model
    takes states before its text connectors at that width (ComfyUI 0.33.0's, flagged)."""
    from comfyui_xdit.errors import ConfigError
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, build_job, model_text_width, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry

    h, w, f = SIZE
    empty = {"samples": torch.zeros(1, 128, (f - 1) // 8 + 1, h // 32, w // 32)}
    pos, neg = (_comfy_conditioning(pipes["t2v"], p) for p in (A, NEGATIVE))
    width = pos[0][0].shape[-1]
    assert model_text_width(str(folders["t2v"])) == width
    reg = PoolRegistry()
    try:
        handle = ModelHandle(path=str(folders["t2v"]), device="cpu", dtype="fp32",
                             threads_per_rank=1)
        run = dict(latent=empty, seed=5, steps=STEPS, cfg=3.0, max_sequence_length=MSL)
        text = sample(handle, SampleInputs(prompt=A, negative_prompt=NEGATIVE, **run),
                      registry=reg)
        cond = sample(handle, SampleInputs(positive=pos, negative=neg, **run), registry=reg)
        # negative control: the halves swapped (the sound's states read as the video's)
        ctx = pos[0][0]
        swapped = [[torch.cat([ctx[..., width // 2:], ctx[..., :width // 2]], -1), {}]]
        wrong = sample(handle, SampleInputs(positive=swapped, negative=neg, **run),
                       registry=reg)
    finally:
        reg.unload_all()
    check(cond["samples"], text["samples"], "sampler CONDITIONING vs prompt text, video")
    check(cond["audio"], text["audio"], "sampler CONDITIONING vs prompt text, sound")
    for part in ("samples", "audio"):
        d = float((wrong[part] - text[part]).abs().max())
        print(f"halves swapped, {part}: {d:.2e} from the prompt text's")
        assert d > 10 * TOL, (part, d)
    one_stream = [[pos[0][0][..., :width // 2], {}]]
    with pytest.raises(ConfigError) as e:
        build_job(SampleInputs(positive=one_stream, negative=neg, **run), "ltx2", width)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and f"width {width // 2}" in msg and f"takes {width}" in msg, msg
    # ComfyUI 0.33.0's LTX-2 text encoder leaves the connectors to the diffusion model and
    # marks its states so: taken at the model's width before its connectors (which the pool
    # runs: tests/test_ltx2_comfy_text.py), still refused at any other
    from types import SimpleNamespace
    info = SimpleNamespace(raw_text_width=width // 2)
    early = [[pos[0][0][..., :width // 2], {"unprocessed_ltxav_embeds": True}]]
    req, _ = build_job(SampleInputs(positive=early, negative=neg, **run), "ltx2", width, info)
    assert tuple(req.positive.context.shape)[-1] == width // 2
    odd = [[pos[0][0][..., :width // 4], {"unprocessed_ltxav_embeds": True}]]
    with pytest.raises(ConfigError, match=f"takes {width} .*, or {width // 2} "):
        build_job(SampleInputs(positive=odd, negative=neg, **run), "ltx2", width, info)


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


# ---- PipeFusion: against its stale-K/V oracle -----------------------------------------------
# The stale-K/V semantics for LTX-2 (docs/methods.md, PipeFusion): the video's token rows (a
# latent frame's height/32 rows after another's) are cut into bands, run one after another
# (steps before `warmup`: one band of all). Band 0's forward also computes the whole sound;
# the prompt is whole in every forward. Each attention keeps, per guidance branch, a K/V cache
# of its key stream: a forward writes the K/V of the tokens it computes (the band's video; the
# sound in band 0) and its queries attend to the whole cache, so the video's self-attention
# and the sound's video-to-audio keys are the other bands' of this step (before it) or the
# previous one (after it), and a later band's audio-to-video keys are band 0's sound of this
# step. The text needs no cache (the same keys every call). Once a band's branches are done
# its video rows take the Euler step, band 0's sound rows theirs.
PF_PATCHES = 2
# the attention modules of a block -> their key stream (None: the text, whole every call)
PF_KEYS = {"attn1": "video", "audio_attn1": "audio", "attn2": None, "audio_attn2": None,
           "audio_to_video_attn": "audio", "video_to_audio_attn": "video"}


def bands(rows: int, patches: int) -> list:
    """Row bands of near-equal height; the first rows % patches bands one row taller."""
    out, r = [], 0
    for i in range(patches):
        n = rows // patches + (1 if i < rows % patches else 0)
        out.append((r, r + n))
        r += n
    return out


class StaleKVProcessor:
    """The stock LTX-2 attention (projections, QK norms, RoPE, per-head gates) whose keys
    and values, where they are video or sound tokens, come from a cache of the whole stream
    per guidance branch: the forward's own tokens of the key stream are written at their
    positions first (`band.writes`; none while `write` is off: the negative control)."""

    def __init__(self, oracle, key_stream):
        self.oracle, self.key_stream = oracle, key_stream

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, perturbation_mask=None,
                 all_perturbed=None):
        import torch.nn.functional as F
        from diffusers.models.transformers.transformer_ltx2 import (
            apply_interleaved_rotary_emb, apply_split_rotary_emb)

        o = self.oracle
        assert attention_mask is None and perturbation_mask is None and not all_perturbed
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        rotate = apply_split_rotary_emb if attn.rope_type == "split" \
            else apply_interleaved_rotary_emb
        q, k = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(context))
        v = attn.to_v(context)
        if query_rotary_emb is not None:
            q = rotate(q, query_rotary_emb)
            k = rotate(k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if self.key_stream is not None:
            cache = o.caches.setdefault((id(attn), o.branch), {})
            full = o.lengths[self.key_stream]
            if not cache:
                cache["k"] = k.new_zeros(k.shape[0], full, *k.shape[2:])
                cache["v"] = v.new_zeros(v.shape[0], full, *v.shape[2:])
            pos = o.writes.get(self.key_stream)
            if o.write and pos is not None:
                cache["k"][:, pos], cache["v"][:, pos] = k, v
            k, v = cache["k"], cache["v"]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2)).transpose(1, 2)
        if attn.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))).unsqueeze(-1)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(q.dtype)))


class LTX2Pipelined:
    """PipeFusion's pipelined algorithm for LTX-2 in one process (semantics above), from the
    stock transformer called on a band's video tokens and coordinates. A later band's call
    carries the sound too (the stock forward takes no empty stream): its sound is neither
    written to a cache nor kept, so only band 0's sound of the step is ever read."""

    def __init__(self, pipe):
        self.pipe, self.tr = pipe, pipe.transformer
        self.branch, self.write, self.writes, self.caches, self.lengths = 1, True, {}, {}, {}

    def _encode(self, prompts, msl):
        pipe = self.pipe
        pe, pm, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                          max_sequence_length=msl, device="cpu")
        video, audio, _ = pipe.connectors(pe, pm, padding_side=pipe.tokenizer.padding_side)
        return video, audio

    def _start_tokens(self, req):
        """A start image's clean first latent frame [1, h*w, 128] as
        LTX2ImageToVideoPipeline makes it (recompressed at its default CRF, resized,
        encoded, normalised: its `prepare_latents`' conditioned frame)."""
        import numpy as np
        import PIL.Image
        from diffusers import LTX2ImageToVideoPipeline
        from diffusers.pipelines.ltx2.utils import (apply_image_conditioning_crf,
                                                    resolve_default_image_crf)
        pipe = LTX2ImageToVideoPipeline(**self.pipe.components)
        image = req.reference_images[0]
        crf = resolve_default_image_crf(pipe.text_encoder)
        if crf:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(
                np.array(image.convert("RGB")), crf))
        pixels = pipe.video_processor.preprocess(image, height=req.height, width=req.width)
        latents, mask = pipe.prepare_latents(pixels.float(), 1, 128, req.height, req.width,
                                             req.frames, dtype=torch.float32, device="cpu",
                                             generator=torch.manual_seed(0))
        return latents[:, :int(mask[0].sum())]

    @torch.inference_mode()
    def run(self, req, warmup, patches, refresh=True):
        """-> (video LATENT, sound LATENT), model space, as the pool returns them. A start
        image (`req.reference_images`, image-to-video): its frame replaces the first latent
        frame's noise, is called at timestep 0 and kept (its velocity zeroed), as
        LTX2ImageToVideoPipeline keeps it."""
        import numpy as np
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        tr, b = self.tr, len(req.prompt)
        fam = worker_module("families.ltx2")
        video, audio = job_noise("ltx2", req.seed, b, req.height, req.width, req.frames)
        _, _, t, h, w = video.shape
        nv, na = t * h * w, audio.shape[2]
        x = torch.cat([video.flatten(2).transpose(1, 2), audio.transpose(1, 2).flatten(2, 3)], 1)
        n0 = 0
        if req.reference_images:
            first = self._start_tokens(req)
            n0 = first.shape[1]
            x[:, :n0] = first.to(x.dtype)
        clean = (torch.arange(nv) < n0).float()  # the start frame's tokens
        branches = {1: self._encode(req.prompt, req.max_sequence_length)}
        if req.cfg > 1:
            branches[0] = self._encode([req.negative_prompt] * b, req.max_sequence_length)
        sched = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        c = sched.config
        mu = calculate_shift(nv, c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.95), c.get("max_shift", 2.05))
        kw = {"mu": mu} if c.get("use_dynamic_shifting") else {}
        sched.set_timesteps(req.steps, sigmas=np.linspace(1.0, 1 / req.steps, req.steps), **kw)
        fps = fam.FAMILY.capability(worker_module("families").SoundTrack).fps
        vc = tr.rope.prepare_video_coords(1, t, h, w, "cpu", fps=fps).expand(b, -1, -1, -1)
        ac = tr.audio_rope.prepare_audio_coords(1, na, "cpu").expand(b, -1, -1, -1)
        self.lengths, self.caches = {"video": nv, "audio": na}, {}
        saved = {}
        for name, m in tr.named_modules():
            key = name.rsplit(".", 1)[-1]
            if key in PF_KEYS and hasattr(m, "processor") and ".transformer_blocks." in f".{name}":
                saved[m] = m.processor
                m.set_processor(StaleKVProcessor(self, PF_KEYS[key]))
        assert saved, "no LTX-2 attention found"
        rows, cols = t * h, w
        try:
            for i in range(req.steps):
                ts = sched.timesteps[i]
                whole = i < warmup
                self.write = refresh or whole
                for j, (r0, r1) in enumerate([(0, rows)] if whole else bands(rows, patches)):
                    sl = slice(r0 * cols, r1 * cols)
                    self.writes = {"video": torch.arange(sl.start, sl.stop)}
                    if j == 0:
                        self.writes["audio"] = torch.arange(na)
                    preds = {}
                    for br, (text, audio_text) in sorted(branches.items()):
                        self.branch = br
                        pv, pa = tr(hidden_states=x[:, sl], audio_hidden_states=x[:, nv:],
                                    encoder_hidden_states=text,
                                    audio_encoder_hidden_states=audio_text,
                                    timestep=(ts * (1 - clean[sl])).expand(b, -1)
                                    if n0 else ts.expand(b),
                                    audio_timestep=ts.expand(b),
                                    sigma=ts.expand(b), video_coords=vc[:, :, sl],
                                    audio_coords=ac, use_cross_timestep=True,
                                    return_dict=False)
                        preds[br] = (pv.float() * (1 - clean[sl]).view(1, -1, 1), pa.float())
                    if 0 in preds:
                        preds[1] = tuple(n + req.cfg * (p - n) for n, p in zip(preds[0], preds[1]))
                    pv, pa = preds[1]
                    ds = sched.sigmas[i + 1] - sched.sigmas[i]
                    x[:, sl] = (x[:, sl].float() + ds * pv).to(x.dtype)
                    if j == 0:
                        x[:, nv:] = (x[:, nv:].float() + ds * pa).to(x.dtype)
        finally:
            for m, p in saved.items():
                m.set_processor(p)
        v = x[:, :nv].transpose(1, 2).reshape(b, -1, t, h, w)
        a = x[:, nv:].reshape(b, na, audio.shape[1], audio.shape[3]).transpose(1, 2)
        return v, a


def pipelined_oracle(folder) -> LTX2Pipelined:
    """The oracle on a model folder: the conformance suite's PipeFusion theme holds the pool
    to it, video and sound (comfyui_xdit/testmodels/ltx2.PIPEFUSION_ORACLE)."""
    from diffusers import LTX2Pipeline
    return LTX2Pipelined(LTX2Pipeline.from_pretrained(str(folder)))


@pytest.fixture(scope="module")
def pipelined(pipes):
    return LTX2Pipelined(pipes["t2v"])


def test_pipelined_oracle_is_the_pipeline_where_nothing_is_stale(pipelined, oracle):
    """The oracle itself: with every step a warmup step it is LTX2Pipeline, with CFG."""
    req = request([A, B], 3.0)
    for got, want, what in zip(pipelined.run(req, STEPS, PF_PATCHES), oracle(req),
                               ("video", "sound")):
        check(got, want, f"oracle, all warmup, {what}")


def test_model_call_is_the_transformer_in_comfyuis_conventions(folders, pipes, layout_pools):
    """The xDiT MODEL's call at one rank (ComfyUI's LTXAV conventions: x the AV LATENT's
    [video, audio], a timestep per part as sigma, the context the video's then the sound's
    prompt states side by side, the conditioning's frame rate) is the diffusers transformer
    called on the joined tokens at sigma * 1000, the RoPE coordinates at that frame rate;
    its prediction comes back as the two parts. Negative control: another frame rate moves
    the prediction (it is read)."""
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from family_requests import model_call_inputs

    call = model_call_inputs("ltx2", folders["t2v"])
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    got = PoolDenoiser(pool, ParallelConfig(), "ltx2")(**dict(call, frame_rate=24.0))
    video, audio = call["x"]
    assert [tuple(p.shape) for p in got] == [tuple(video.shape), tuple(audio.shape)]
    tr = pipes["t2v"].transformer
    b, c, t, h, w = video.shape
    length = audio.shape[2]
    half = call["context"].shape[2] // 2
    sigma = call["timestep"][0] * 1000
    with torch.no_grad():
        v, a = tr(hidden_states=video.flatten(2).transpose(1, 2),
                  audio_hidden_states=audio.transpose(1, 2).flatten(2, 3),
                  encoder_hidden_states=call["context"][..., :half],
                  audio_encoder_hidden_states=call["context"][..., half:],
                  timestep=sigma, audio_timestep=sigma, sigma=sigma,
                  video_coords=tr.rope.prepare_video_coords(b, t, h, w, "cpu", fps=24.0),
                  audio_coords=tr.audio_rope.prepare_audio_coords(b, length, "cpu"),
                  use_cross_timestep=True, return_dict=False)
    check(got[0], v.transpose(1, 2).reshape(video.shape), "MODEL call video")
    check(got[1], a.reshape(b, length, 8, 16).transpose(1, 2), "MODEL call sound")
    other = PoolDenoiser(pool, ParallelConfig(), "ltx2")(**dict(call, frame_rate=25.0))
    assert float((other[0] - got[0]).abs().max()) > 1e-4, "the frame rate is not read"


def test_model_call_takes_a_timestep_per_token(folders, pipes, layout_pools):
    """A noise mask on the AV LATENT (the start frame's tokens at timestep 0, as ComfyUI's
    LTXAV makes a timestep per token of each part from it: tests/family_requests.masked_call)
    through the xDiT MODEL at one rank is the diffusers transformer called with those
    per-token timesteps (the video's and the sound's, sigma * 1000) and each stream's
    cross-attention modulated by its own tokens' timesteps (ComfyUI's LTXAV: diffusers'
    use_cross_timestep=False). Negative controls: the mask ignored, and the pipeline's
    crossed modulation, each move the prediction."""
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from family_requests import masked_call

    call = masked_call("ltx2", folders["t2v"])
    pool = layout_pools.get(folders["t2v"], ParallelConfig())
    got = PoolDenoiser(pool, ParallelConfig(), "ltx2")(**call)
    video, audio = call["x"]
    b, c, t, h, w = video.shape
    length = audio.shape[2]
    v_t, a_t = (s.reshape(b, -1) * 1000 for s in call["timestep"])
    assert bool((v_t[:, :h * w] == 0).all()) and bool((v_t[:, h * w:] == 700).all())
    tr = pipes["t2v"].transformer
    half = call["context"].shape[2] // 2

    def transformer(timestep, audio_timestep, crossed):
        with torch.no_grad():
            v, a = tr(hidden_states=video.flatten(2).transpose(1, 2),
                      audio_hidden_states=audio.transpose(1, 2).flatten(2, 3),
                      encoder_hidden_states=call["context"][..., :half],
                      audio_encoder_hidden_states=call["context"][..., half:],
                      timestep=timestep, audio_timestep=audio_timestep,
                      sigma=torch.full((b,), 700.0),
                      video_coords=tr.rope.prepare_video_coords(b, t, h, w, "cpu", fps=25.0),
                      audio_coords=tr.audio_rope.prepare_audio_coords(b, length, "cpu"),
                      use_cross_timestep=crossed, return_dict=False)
        return [v.transpose(1, 2).reshape(video.shape),
                a.reshape(b, length, 8, 16).transpose(1, 2)]

    want = transformer(v_t, a_t, False)
    check(got[0], want[0], "MODEL call per token video")
    check(got[1], want[1], "MODEL call per token sound")
    plain = PoolDenoiser(pool, ParallelConfig(), "ltx2")(
        **dict(call, timestep=(torch.full((b,), 0.7),) * 2))
    assert float((plain[0] - got[0]).abs().max()) > 1e-3, "the mask is not read"
    crossed = transformer(v_t, a_t, True)
    assert float((crossed[0] - got[0]).abs().max()) > 1e-3, \
        "the cross-attention modulation does not tell ComfyUI's from the pipeline's"


def test_model_call_refuses_what_it_cannot_run_in_one_line():
    """Timesteps that are neither one per row nor one per token of a part (a video part's
    12 tokens given 11), or a LATENT without its sound, are one clear error before anything
    reaches a pool."""
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from comfyui_xdit.planning.config import ConfigError

    video, audio = torch.zeros(2, 128, 2, 2, 3), torch.zeros(2, 8, 9, 16)
    model = PoolDenoiser(None, ParallelConfig(), "ltx2")
    context = torch.zeros(2, 7, 64)
    with pytest.raises(ConfigError, match=r"one timestep per latent row \(2\) or per token "
                                          r"\(2 x 12\); got 22"):
        model([video, audio], (torch.full((2, 11, 1), 0.5), torch.full((2,), 0.7)),
              context=context)
    with pytest.raises(ConfigError, match="nested LATENT of 2 parts"):
        model(video, torch.full((2,), 0.5), context=context)


def test_comfyui_single_file_is_read_as_the_folder(tmp_path_factory, layout_pools):
    """`tiny-model --comfy-file` writes LTX-2's transformer in ComfyUI's names under
    model.diffusion_model. (with the metadata ComfyUI's detection reads); the loader detects
    it with the folder's config, and the xDiT MODEL's call on it equals the folder's (both
    parts). Negative control: a perturbed block differs."""
    from safetensors.torch import load_file, save_file

    from comfyui_xdit.bridge import worker_module
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from comfyui_xdit.testmodels import ltx2
    from comfyui_xdit.testmodels.tiny_model import write_comfy_file
    from family_requests import model_call_inputs

    cache = tmp_path_factory.mktemp("ltx2-file")
    folder = ensure_tiny_model("ltx2", cache, **ltx2.SINGLE_FILE_MODEL)
    path = write_comfy_file("ltx2", folder, cache / "ltx2-comfy.safetensors")
    sf = worker_module("loading.transformer_file").single_file_config(path)
    import json
    want = json.loads((folder / "transformer" / "config.json").read_text())
    assert (sf["arch"], sf["naming"], sf["prefix"]) == ("ltx2", "bfl", "model.diffusion_model.")
    assert {k: v for k, v in sf["config"].items() if want.get(k) != v} == {}
    assert "audio_patchify_proj.weight" in {k.split("model.diffusion_model.")[-1]
                                            for k in load_file(str(path))}
    call = model_call_inputs("ltx2", folder)
    ref = PoolDenoiser(layout_pools.get(folder, ParallelConfig()), ParallelConfig(), "ltx2")(**call)
    got = PoolDenoiser(layout_pools.get(path, ParallelConfig()), ParallelConfig(), "ltx2")(**call)
    for name, a, b in zip(("video", "sound"), got, ref):
        check(a, b, f"single file {name}")
    sd = load_file(str(path))
    key = "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    sd[key] = sd[key] + 0.05
    bad = save_file(sd, str(cache / "bad.safetensors"), metadata={}) or cache / "bad.safetensors"
    other = PoolDenoiser(layout_pools.get(bad, ParallelConfig()), ParallelConfig(), "ltx2")(**call)
    assert float((other[0] - ref[0]).abs().max()) > 1e-3


def test_an_api_conditioning_of_another_width_is_refused_before_workers_start(folders):
    """The Python API's Conditioning (its context the video's and the sound's prompt states
    side by side, as ComfyUI's, or the states before the text connectors, ComfyUI 0.33.0's)
    is width-checked on the host against the family's declared widths: a context of another
    width is refused in one line naming both, and no worker starts."""
    import json

    from comfyui_xdit import ConfigError, WorkerPool
    from comfyui_xdit.planning.model_info import read_model_info

    info = read_model_info(folders["t2v"])
    config = json.loads((folders["t2v"] / "transformer" / "config.json").read_text())
    width = 2 * int(config["caption_channels"])
    assert info.text_width == width
    h, w, f = SIZE
    pool = WorkerPool(str(folders["t2v"]), ParallelConfig(), device="cpu", threads_per_rank=1)
    try:
        raw = int(config["caption_channels"])  # before the connectors: accepted (0.33.0's)
        assert info.raw_text_width == raw
        bad = {"cond": torch.zeros(1, 8, raw + 8)}
        with pytest.raises(ConfigError) as e:
            pool.generate(GenerationRequest(prompt=[], positive=bad, height=h, width=w,
                                            frames=f, steps=1, cfg=1.0))
        msg = str(e.value)
        print(msg)
        assert "\n" not in msg and f"width {raw + 8}" in msg and f"takes {width}" in msg
        assert "2 prompt states of" in msg and f"or {raw}" in msg and pool.worker_pids() == []
    finally:
        pool.close()
