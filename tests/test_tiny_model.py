"""The tiny random-weight models every other test and the demo stand on: they must load in the
stock diffusers pipelines, run at odd sizes, be reproducible, and be cached safely."""

import argparse
import json
import sys
import threading

import pytest
import torch

from comfyui_xdit.testmodels import tiny_model
from comfyui_xdit.testmodels.tiny_model import add_cli, build_tiny_model, ensure_tiny_model, run_cli


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, root / arch) for arch in ("flux", "sd3")}


def _load(arch, path):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = FluxPipeline if arch == "flux" else StableDiffusion3Pipeline
    pipe = cls.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, height, width, steps=2, **kw):
    seen = []

    def record(_pipe, _i, _t, tensors):
        seen.append(tensors["latents"].clone())
        return {}

    out = pipe(
        "a photo of a red cat",
        num_inference_steps=steps,
        height=height,
        width=width,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=record,
        **kw,
    ).images
    return out, seen


def test_folder_layout(built):
    for arch, path in built.items():
        index = json.loads((path / "model_index.json").read_text())
        expected = {"transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"}
        if arch == "sd3":
            expected |= {"text_encoder_3", "tokenizer_3"}
        assert expected <= set(index)
        for sub in expected - {"tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"}:
            files = list((path / sub).glob("*.safetensors"))
            assert files and all(f.stat().st_size < 4 << 20 for f in files)


def test_flux_pipeline_runs_non_square(built):
    pipe = _load("flux", built["flux"])
    tr, vae, sched = pipe.transformer.config, pipe.vae.config, pipe.scheduler.config
    assert tr.in_channels == 64 and tr.guidance_embeds and tr.num_attention_heads == 4
    assert sum(tr.axes_dims_rope) == tr.attention_head_dim
    assert tr.joint_attention_dim == pipe.text_encoder_2.config.d_model
    assert tr.pooled_projection_dim == pipe.text_encoder.config.hidden_size
    assert vae.latent_channels == 16 and pipe.vae_scale_factor == 8
    assert (vae.scaling_factor, vae.shift_factor) == (0.3611, 0.1159)
    assert sched.use_dynamic_shifting and sched.base_shift == 0.5 and sched.max_shift == 1.15
    assert pipe.tokenizer_2.model_max_length >= 512

    out, seen = _run(pipe, 128, 96, max_sequence_length=512)
    assert out.shape == (1, (128 // 16) * (96 // 16), 64)  # packed 2x2 latent tokens
    assert torch.isfinite(out).all()
    assert len(seen) == 2 and (seen[0] - seen[1]).abs().max() > 1e-3


def test_sd3_pipeline_runs_non_square(built):
    pipe = _load("sd3", built["sd3"])
    tr, vae = pipe.transformer.config, pipe.vae.config
    clip_l, clip_g = pipe.text_encoder.config, pipe.text_encoder_2.config
    assert tr.in_channels == 16 and tr.patch_size == 2 and tr.num_attention_heads == 4
    assert tr.joint_attention_dim == pipe.text_encoder_3.config.d_model >= clip_l.hidden_size + clip_g.hidden_size
    assert tr.pooled_projection_dim == clip_l.projection_dim + clip_g.projection_dim
    assert tr.pos_embed_max_size * 8 * tr.patch_size >= 512
    assert (vae.scaling_factor, vae.shift_factor) == (1.5305, 0.0609)
    assert not pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 3.0

    out, seen = _run(pipe, 96, 128, guidance_scale=3.0)  # CFG on: negative branch too
    assert out.shape == (1, 16, 12, 16)
    assert torch.isfinite(out).all()
    assert len(seen) == 2 and (seen[0] - seen[1]).abs().max() > 1e-3


def test_different_prompts_give_different_embeddings(built):
    flux = _load("flux", built["flux"])
    a = flux.encode_prompt("a photo of a cat", prompt_2=None, max_sequence_length=512)
    b = flux.encode_prompt("a painting of a dog", prompt_2=None, max_sequence_length=512)
    assert a[0].shape == (1, 512, flux.transformer.config.joint_attention_dim)
    assert not torch.allclose(a[0], b[0]) and not torch.allclose(a[1], b[1])

    sd3 = _load("sd3", built["sd3"])
    kw = dict(prompt_2=None, prompt_3=None, do_classifier_free_guidance=False, max_sequence_length=256)
    a = sd3.encode_prompt("a photo of a cat", **kw)
    b = sd3.encode_prompt("a painting of a dog", **kw)
    assert a[0].shape == (1, 77 + 256, sd3.transformer.config.joint_attention_dim)
    assert not torch.allclose(a[0], b[0]) and not torch.allclose(a[2], b[2])


def _weights(path):
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*.safetensors"))}


def test_build_is_deterministic(tmp_path, built):
    rng_before = torch.random.get_rng_state()
    again = build_tiny_model("flux", tmp_path / "again", seed=0)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # caller's RNG untouched
    assert _weights(again) == _weights(built["flux"])
    other = _weights(build_tiny_model("flux", tmp_path / "other", seed=1))
    ref = _weights(built["flux"])
    assert other.keys() == ref.keys()
    assert all(other[k] != ref[k] for k in ref)


def test_ensure_reuses_folder(tmp_path, monkeypatch):
    calls = []
    real_build = tiny_model.build_tiny_model

    def counting_build(*a, **kw):
        calls.append(a)
        return real_build(*a, **kw)

    monkeypatch.setattr(tiny_model, "build_tiny_model", counting_build)
    first = ensure_tiny_model("sd3", tmp_path, seed=3)
    weights = first / "transformer" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns
    # Omitted defaults and explicit ones are the same model, hence the same folder.
    assert ensure_tiny_model("sd3", tmp_path, seed=3, depth=tiny_model.DEFAULT_DEPTH, heads=4) == first
    assert len(calls) == 1 and weights.stat().st_mtime_ns == mtime
    assert ensure_tiny_model("sd3", tmp_path, seed=4) != first
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted(
        [first.name, ensure_tiny_model("sd3", tmp_path, seed=4).name]
    )
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # temp dirs cleaned up


def test_ensure_concurrent_callers_share_one_build(tmp_path, monkeypatch):
    calls = []
    real_build = tiny_model.build_tiny_model
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda *a, **kw: calls.append(a) or real_build(*a, **kw))
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny_model("flux", tmp_path, seed=7))
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(calls) == 1
    assert (results[0] / "model_index.json").is_file()


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.func is run_cli
    return args.func(args)


def test_cli(tmp_path, capsys):
    out = tmp_path / "m"
    assert _cli(["tiny-model", "--arch", "sd3", "--out", str(out), "--depth", "1", "--width", "32", "--heads", "2"]) == 0
    cfg = json.loads((out / "transformer" / "config.json").read_text())
    assert (cfg["num_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"]) == (1, 2, 16)

    assert capsys.readouterr().out.strip() == str(out)
    assert _cli(["tiny-model", "--arch", "flux", "--out", str(tmp_path / "bad"), "--width", "30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "width" in err[0]


def test_rejects_bad_arch(tmp_path):
    with pytest.raises(ValueError, match="flux, flux2, sd3"):
        build_tiny_model("sdxl", tmp_path)


# ---- one builder module per family ----------------------------------------------------------

@pytest.mark.parametrize("arch", tiny_model.ARCHS)
def test_each_family_has_a_builder_module(arch):
    """comfyui_xdit/testmodels/<arch>.py, found by the arch's name, with the builder interface;
    its check sees the generic knobs and refuses another family's (sd35 belongs to one)."""
    mod = tiny_model.builder(arch)
    assert mod.__name__ == f"comfyui_xdit.testmodels.{arch}"
    assert isinstance(mod.VARIANTS, tuple) and callable(mod.check) and callable(mod.build_pipeline)
    cfg = tiny_model.resolve_config(arch)
    assert {k: cfg[k] for k in ("arch", "depth", "width", "heads")} == {
        "arch": arch, "depth": tiny_model.DEFAULT_DEPTH, "width": 4 * tiny_model.DEFAULT_HEAD_DIM, "heads": 4}


def test_sd35_is_one_familys_knob():
    takers = []
    for arch in tiny_model.ARCHS:
        try:
            takers.append(tiny_model.resolve_config(arch, sd35=True)["arch"])
        except ValueError as exc:
            assert "sd35" in str(exc)
    assert takers == ["sd3"]


def test_an_arch_without_a_builder_fails_only_when_built(monkeypatch, tmp_path, capsys):
    """A family registered before its builder is written: importing tiny_model, the CLI and
    the other families work; building it is one clear error."""
    monkeypatch.setitem(sys.modules, "comfyui_xdit.testmodels.qwen_image", None)  # unimportable
    with pytest.raises(ValueError, match=r"no tiny-model builder for arch 'qwen_image' yet: "
                                         r"comfyui_xdit/testmodels/qwen_image.py is missing"):
        build_tiny_model("qwen_image", tmp_path)
    assert tiny_model.resolve_config("flux2", variant="dev")["variant"] == "dev"
    assert _cli(["tiny-model", "--arch", "sd3", "--variant", "dev", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "variant applies to --arch" in err and "flux2" in err and "qwen_image" not in err
    assert not list(tmp_path.iterdir())


def test_key_extras_add_to_the_cache_key():
    """flux's key_extras: FLUX.1's RoPE split at head dim 128 is a key of its own."""
    assert tiny_model.resolve_config("flux", width=256, heads=2)["rope"] == "flux1"
    assert "rope" not in tiny_model.resolve_config("flux")
