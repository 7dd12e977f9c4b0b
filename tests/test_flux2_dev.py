"""FLUX.2 [dev]: `tiny-model --arch flux2 --variant dev` writes a folder the stock
diffusers `Flux2Pipeline` loads and runs offline (Mistral-3 text encoder, embedded guidance),
and the pool reproduces that pipeline to 1e-4 (fp32, final latent) from the same ComfyUI
noise (on its 128-channel FLUX.2 LATENT) on 1 rank, Ulysses 2, Ring 2 and PipeFusion 2
(warmup >= steps), batch 1 and 3, at the default guidance (4.0) and an explicit one; the
Sampler node's default guidance (0) resolves to that 4.0 (FLUX.1: 3.5).

Negative controls: the two guidance values give different latents (guidance reaches the
transformer), another prompt gives another latent, and [klein]'s transformer, which has no
guidance embedding, ignores guidance (as FLUX.1 schnell does) while [dev]'s does not.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.testmodels.flux2 import MISTRAL3_LAYERS
from comfyui_xdit.testmodels.tiny_model import add_cli, build_tiny_model, ensure_tiny_model, resolve_config

TOL = 1e-4
MOVED = 1e-2  # the model moved the latent at least this far from the noise
PROMPTS = ["a photo of a red cat", "a dog on the grass", "blue sky"]
MSL = 64  # the system turn takes ~50 tokens of it: the prompt must still fit
STEPS = 2
GUIDANCES = (None, 1.5)  # None: the request default, 4.0 (Flux2Pipeline's default too)
# (height, width, batch): 8x6 image tokens; 7x5 (no even split over 2 ranks: padded), uneven
SHAPES = [(128, 96, 1), (112, 80, 3)]


def _cli(argv):
    parser = argparse.ArgumentParser(prog="comfyui_xdit")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Built through the CLI entry (`tiny-model --arch flux2 --variant dev`)."""
    out = tmp_path_factory.mktemp("tiny") / "flux2-dev"
    assert _cli(["tiny-model", "--arch", "flux2", "--variant", "dev", "--out", str(out)]) == 0
    return out


_PIPE: dict = {}


def pipeline(path):
    from diffusers import Flux2Pipeline

    if str(path) not in _PIPE:
        pipe = Flux2Pipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPE[str(path)] = pipe
    return _PIPE[str(path)]


def noise_for(batch, height, width, seed):
    """ComfyUI's prepare_noise for a FLUX.2 LATENT [B,128,h/16,w/16]."""
    return torch.randn((batch, 128, height // 16, width // 16),
                       generator=torch.manual_seed(seed), dtype=torch.float32)


def to_comfy(packed, noise):
    """Flux2Pipeline's output_type="latent" is packed, normalised model space [B,tokens,128]
    (unlike Flux2KleinPipeline's): ComfyUI's FLUX.2 LATENT is that, unpacked with the
    pipeline's own ids (no batch norm)."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._unpack_latents_with_ids(packed, Flux2Pipeline._prepare_latent_ids(noise))


_ORACLES: dict = {}


def oracle(path, req: GenerationRequest):
    """The single-process Flux2Pipeline from `noise_for(...)` (its latents as drawn), as
    ComfyUI's FLUX.2 LATENT. guidance None: the pipeline's own default guidance_scale."""
    key = (str(path), tuple(req.prompt), req.seed, req.steps, req.height, req.width, req.guidance)
    if key not in _ORACLES:
        pipe = pipeline(path)
        noise = noise_for(len(req.prompt), req.height, req.width, req.seed)
        kw = {} if req.guidance is None else {"guidance_scale": req.guidance}
        packed = pipe(prompt=list(req.prompt), height=req.height, width=req.width,
                      num_inference_steps=req.steps, latents=noise,
                      max_sequence_length=req.max_sequence_length, output_type="latent",
                      **kw).images
        _ORACLES[key] = to_comfy(packed, noise)
    return _ORACLES[key]


def request(height, width, batch, guidance=None, seed=5, prompts=PROMPTS):
    return GenerationRequest(prompt=prompts[:batch], seed=seed, steps=STEPS, height=height,
                             width=width, max_sequence_length=MSL, guidance=guidance)


# ---- the folder ------------------------------------------------------------------------

def test_dev_folder_loads_in_flux2_pipeline_and_generates(folder):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline"
    assert index["text_encoder"] == ["transformers", "Mistral3ForConditionalGeneration"]
    assert {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"} <= set(index)
    pipe = pipeline(folder)
    tr = pipe.transformer.config
    assert tr.guidance_embeds is True and tr.in_channels == 128
    assert tr.num_attention_heads % 2 == 0 and tr.num_attention_heads % 4 == 0
    text = pipe.text_encoder.config.text_config
    assert text.num_hidden_layers >= max(MISTRAL3_LAYERS)
    assert tr.joint_attention_dim == len(MISTRAL3_LAYERS) * text.hidden_size
    assert pipe.vae.config.latent_channels == 32

    def run(prompt, guidance):
        return pipe(prompt=prompt, height=128, width=96, num_inference_steps=2,
                    guidance_scale=guidance, output_type="latent", max_sequence_length=MSL,
                    generator=torch.Generator().manual_seed(0)).images

    out = run("a photo of a red cat", 4.0)
    assert out.shape == (1, 8 * 6, 128) and torch.isfinite(out).all()
    # the prompt and the guidance both reach the latent (same noise)
    assert (run("a blue dog", 4.0) - out).abs().max() > 10 * TOL
    assert (run("a photo of a red cat", 1.5) - out).abs().max() > 10 * TOL


def test_dev_chat_template_keeps_the_prompt_within_max_sequence_length(folder):
    """Flux2Pipeline prepends its system message and truncates at max_sequence_length: the
    tiny vocabulary keeps the system turn short enough that the prompt survives at MSL."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    pipe = pipeline(folder)
    messages = format_input(["a photo of a red cat"], system_message=pipe.system_message)
    text = pipe.tokenizer.apply_chat_template(messages, tokenize=False)[0]
    assert text.startswith("<s>[SYSTEM_PROMPT]" + pipe.system_message + "[/SYSTEM_PROMPT]")
    assert text.endswith("[INST]a photo of a red cat[/INST]")
    enc = pipe.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_tensors="pt", padding="max_length",
                                             truncation=True, max_length=MSL)
    used = int(enc["attention_mask"].sum())
    assert used < MSL  # nothing truncated
    assert pipe.tokenizer.decode(enc["input_ids"][0, :used]) == text


def test_dev_build_is_reproducible_cached_and_keyed_apart_from_klein(folder, tmp_path):
    again = ensure_tiny_model("flux2", tmp_path, variant="dev")
    assert ensure_tiny_model("flux2", tmp_path, variant="dev") == again
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        files = sorted((folder / sub).iterdir())
        assert files
        for f in files:
            assert (again / sub / f.name).read_bytes() == f.read_bytes(), f
    assert resolve_config("flux2", variant="klein") == resolve_config("flux2")
    assert resolve_config("flux2", variant="dev") != resolve_config("flux2")


def test_variant_knob_validated(capsys):
    with pytest.raises(ValueError, match=r"variant applies to --arch .*flux2.* only"):
        resolve_config("flux", variant="dev")
    with pytest.raises(ValueError, match="unknown flux2 variant"):
        resolve_config("flux2", variant="pro")
    assert _cli(["tiny-model", "--arch", "sd3", "--variant", "dev", "--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "variant applies to --arch" in err[0] and "flux2" in err[0]


def test_request_default_guidance_is_flux2_devs(folder):
    from comfyui_xdit.planning.model_info import read_model_info

    info = read_model_info(folder)
    assert info.arch == "flux2" and info.heads == 4
    resolved = request(128, 96, 1).resolved(info)
    assert resolved.guidance == 4.0 and resolved.cfg == 1.0
    assert request(128, 96, 1, guidance=1.5).resolved(info).guidance == 1.5
    # the Sampler node: its default guidance 0 is the model's default, an explicit value wins
    from comfyui_xdit.nodes.operations import SampleInputs, build_job
    empty = {"samples": torch.zeros(1, 128, 8, 6)}
    node = build_job(SampleInputs(latent=empty, prompt="a cat"), "flux2", model=info)[0]
    assert SampleInputs(latent=empty).guidance == 0.0 and node.resolved(info).guidance == 4.0
    node = build_job(SampleInputs(latent=empty, prompt="a cat", guidance=2.5), "flux2",
                     model=info)[0]
    assert node.resolved(info).guidance == 2.5
    flux1 = build_job(SampleInputs(latent={"samples": torch.zeros(1, 16, 16, 12)},
                                   prompt="a cat"), "flux")[0]
    assert flux1.resolved("flux").guidance == 3.5


# ---- the engine --------------------------------------------------------------------------

def test_pipeline_class_follows_model_index(folder, tmp_path):
    from workers.models import get_adapter
    from workers.families import family
    from workers.models.detect import pipeline_class

    def flux2_pipeline_class(path):
        return pipeline_class(family("flux2"), path)

    assert get_adapter("flux2", str(folder)).pipeline_class == "Flux2Pipeline"
    for name, want in [("Flux2KleinPipeline", "Flux2KleinPipeline"),
                       ("Flux2KleinKVPipeline", "Flux2KleinPipeline")]:
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": name}))
        assert flux2_pipeline_class(str(tmp_path)) == want
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="'FluxPipeline'.*Flux2Pipeline"):
        flux2_pipeline_class(str(tmp_path))
    # the host refuses such a folder before any worker starts
    from comfyui_xdit.errors import ConfigError
    from comfyui_xdit.planning.model_info import read_model_info
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(
        (folder / "transformer" / "config.json").read_text())
    with pytest.raises(ConfigError, match="'FluxPipeline'.*Flux2Pipeline"):
        read_model_info(tmp_path)


def test_adapter_encodes_with_the_folders_pipeline(folder):
    """The adapter's prompt path is Flux2Pipeline.encode_prompt (Mistral-3 layers 10/20/30)."""
    from workers.models import get_adapter

    ad = get_adapter("flux2", str(folder))
    model = ad.load(str(folder), torch.device("cpu"), torch.float32, True)
    assert type(model.encoder).__name__ == "Flux2Pipeline"
    got = ad.encode(model, PROMPTS[:2], MSL)
    want, ids = pipeline(folder).encode_prompt(PROMPTS[:2], max_sequence_length=MSL)
    torch.testing.assert_close(got["encoder_hidden_states"], want, atol=0, rtol=0)
    torch.testing.assert_close(got["txt_ids"], ids[0], atol=0, rtol=0)


def test_guidance_ignored_by_klein_used_by_dev(folder, tmp_path):
    """One transformer call through the adapter at guidance 1 and 7: [klein]'s transformer
    has no guidance embedding, so the value cannot change anything (FLUX.1 schnell's rule);
    [dev]'s output must change (or the guidance never reached it)."""
    from workers.models import get_adapter

    klein = build_tiny_model("flux2", tmp_path / "klein")
    torch.manual_seed(0)
    latents = torch.randn(1, 8 * 6, 128)
    for path, embeds in ((klein, False), (folder, True)):
        ad = get_adapter("flux2", str(path))
        model = ad.load(str(path), torch.device("cpu"), torch.float32, False)
        assert model.transformer.config.guidance_embeds is embeds
        width = model.transformer.config.joint_attention_dim
        cond = ad.conditioning(torch.randn(1, 12, width), None)
        extra = ad.forward_extra(model, 128, 96)
        t = torch.tensor(500.0)
        with torch.no_grad():
            a, b = (ad.forward(model, latents, t, cond, g, extra) for g in (1.0, 7.0))
        if embeds:
            assert (a - b).abs().max() > 1e-3
        else:
            assert torch.equal(a, b)


# ---- the pool equals Flux2Pipeline ----------------------------------------------------

@pytest.fixture(scope="module")
def pools(folder):
    """pools(config) -> a warm pool: one per launch layout, reconfigured between the
    configurations it serves."""
    from conftest import LayoutPools
    cache = LayoutPools()
    yield lambda config: cache.get(folder, config)
    cache.close()


CONFIGS = {
    "1rank": ParallelConfig(),
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "pipefusion2": ParallelConfig(pipefusion=2, warmup_steps=STEPS),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pool_equals_flux2_pipeline(pools, folder, name):
    pool = pools(CONFIGS[name])
    for h, w, b in SHAPES:
        got = {}
        for g in GUIDANCES:
            req = request(h, w, b, guidance=g)
            noise = noise_for(b, h, w, req.seed)
            want = oracle(folder, req)
            got[g] = pool.generate(req, noise=noise).samples
            assert got[g].shape == want.shape == (b, 128, h // 16, w // 16)
            assert (want - noise).abs().max() > MOVED
            err = (got[g] - want).abs().max().item()
            assert err <= TOL, f"{name} {h}x{w} batch {b} guidance {g}: max diff {err:.2e}"
        # negative control: the guidance value changes the result
        assert (got[GUIDANCES[0]] - got[GUIDANCES[1]]).abs().max() > 10 * TOL
