"""Wan single files (ComfyUI's models/diffusion_models): the original / ComfyUI naming
(`patch_embedding`, `blocks.N.self_attn.q`, `head.modulation`, ...; often under
`model.diffusion_model.`) and diffusers' naming, in fp32, bf16 and scaled fp8.

The tiny Wan folder's transformer (head dim 128, as ComfyUI's detection assumes: the file
stores no head count) is written out by an independent reverse mapping
(comfyui_xdit/testmodels/wan.single_file): detected with the folder's config, converted back
tensor for tensor, sampled at ComfyUI's default shift; bf16 and fp8 files are close; a file
missing a tensor is refused in one line. That the file's pool equals its folder's is the
conformance suite's single-file theme (tests/conformance/test_single_file.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from single_file_util import write_single_file

# the numerics contract's bound (docs/design.md#numerics-rule-4); measured 1.1e-5 on one
# 2-core CPU and under 1e-5 on another: fp32 rounding of the CPU's own kernels
TOL = 1e-4
ARCH = "wan"
WIDE = dict(width=256, heads=2)  # head dim 128: what a file's shapes give (dim / 128 heads)
H, W, FRAMES, STEPS, CFG, MSL = 32, 48, 5, 2, 4.0, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    return ensure_tiny_model(ARCH, tmp_path_factory.mktemp("wan_models"), **WIDE)


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import WanPipeline
    return WanPipeline.from_pretrained(str(folder)).to(torch.float32)


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import write_fp8_file
    d = tmp_path_factory.mktemp("wan_files")
    fake_vae = {"vae.decoder.conv1.weight": torch.zeros(4, 16, 3, 3, 3)}
    out = {"comfy_ckpt": write_single_file(folder, ARCH, d / "wan-ckpt.safetensors",
                                           prefix=True, extra=fake_vae),
           "comfy": write_single_file(folder, ARCH, d / "wan.safetensors"),
           "diffusers": write_single_file(folder, ARCH, d / "wan-diffusers.safetensors",
                                          naming="diffusers")}
    from safetensors.torch import load_file, save_file
    sd = load_file(str(out["comfy"]))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()},
              str(d / "wan-bf16.safetensors"))
    out["bf16"] = d / "wan-bf16.safetensors"
    out["fp8"] = write_fp8_file(out["comfy"], d / "wan-fp8-scaled.safetensors", scaled=True)
    sd.pop("blocks.1.cross_attn.o.weight")
    save_file(sd, str(d / "wan-missing.safetensors"))
    out["missing"] = d / "wan-missing.safetensors"
    return out


def _embeds(pipe, text):
    with torch.no_grad():
        return pipe.encode_prompt([text], do_classifier_free_guidance=False,
                                  max_sequence_length=MSL)[0]


def _request(pos, neg, seed=3, shift=3.0):
    """`shift`: the tiny folder's flow_shift (the pipeline's); a file's own default is
    ComfyUI's 8 (test_file_default_shift_is_comfyuis)."""
    return GenerationRequest(prompt=[], positive={"cond": pos, "pooled": None},
                             negative={"cond": neg, "pooled": None}, cfg=CFG, seed=seed,
                             steps=STEPS, height=H, width=W, frames=FRAMES, shift=shift)


@pytest.mark.parametrize("name,naming", [("comfy_ckpt", "bfl"), ("comfy", "bfl"),
                                         ("diffusers", "diffusers"), ("fp8", "bfl")])
def test_detected_with_the_folders_config(folder, files, name, naming):
    from comfyui_xdit.bridge import worker_module
    from comfyui_xdit.planning.model_info import read_model_info
    sf = worker_module("models.detect").single_file_config(files[name])
    assert (sf["arch"], sf["naming"]) == (ARCH, naming)
    want = json.loads((folder / "transformer" / "config.json").read_text())
    for k, v in sf["config"].items():
        assert want[k] == (list(v) if isinstance(v, tuple) else v), k
    info = read_model_info(files[name])
    assert (info.arch, info.kind, info.heads, info.blocks) == (ARCH, "file", 2, 2)
    if name == "fp8":
        assert info.storage == "scaled-fp8"
    sched, vae = worker_module("families").family(ARCH).detection.released(sf["config"])
    folder_sched = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert all(sched[k] == v for k, v in folder_sched.items() if k in sched and
               k != "flow_shift")
    # ComfyUI's shift for its Wan models (supported_models.WAN21_T2V.sampling_settings);
    # the folder keeps its own
    assert sched["_class_name"] == "UniPCMultistepScheduler" and sched["flow_shift"] == 8.0
    assert folder_sched["flow_shift"] == 3.0
    fv = json.loads((folder / "vae" / "config.json").read_text())
    assert vae["latents_mean"] == fv["latents_mean"] and vae["latents_std"] == fv["latents_std"]


def test_converter_round_trips_every_variant(tmp_path):
    """In process: T2V and I2V-shaped (image K/V, CLIP projection, FLF position table)
    transformers through the ComfyUI file and back hold the same tensors and config."""
    from diffusers import WanTransformer3DModel

    from workers.models import get_adapter
    from workers.models.detect import single_file_config
    from workers.loading.single_file import load_single_file
    torch.manual_seed(0)
    for extra in ({}, dict(image_dim=24, added_kv_proj_dim=256, pos_embed_seq_len=6,
                           in_channels=36)):
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                  attention_head_dim=128, out_channels=16, text_dim=32,
                                  ffn_dim=96, num_layers=2, **{"in_channels": 16, **extra})
        f = write_single_file(None, ARCH, tmp_path / "rt.safetensors", state=m.state_dict(),
                              prefix=True)
        cfg = single_file_config(f)["config"]
        for k, v in cfg.items():
            want = m.config[k]
            assert (list(v) if isinstance(v, (list, tuple)) else v) == \
                (list(want) if isinstance(want, (list, tuple)) else want), k
        got = load_single_file(get_adapter(ARCH), str(f), torch.device("cpu"),
                               torch.float32).transformer.state_dict()
        ref = m.state_dict()
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_file_default_shift_is_comfyuis(pipe, files):
    """A Wan file samples at ComfyUI's shift 8 unless a request says otherwise (it used to
    sample at the diffusers folder's 3, so Sampler (xDiT) and KSampler on ComfyUI's model
    disagreed on the same file); the request's shift still overrides."""
    pos, neg = _embeds(pipe, "a red cat walking"), _embeds(pipe, "blurry")
    with WorkerPool(str(files["comfy"]), ParallelConfig(), device="cpu",
                    threads_per_rank=1) as pool:
        default = pool.generate(_request(pos, neg, shift=None)).samples
        eight = pool.generate(_request(pos, neg, shift=8.0)).samples
        three = pool.generate(_request(pos, neg, shift=3.0)).samples
    assert float((default - eight).abs().max()) == 0.0
    assert float((default - three).abs().max()) > 1e-3


def test_file_schedule_is_comfyuis_simple_schedule_at_shift_8():
    """The sigmas a Wan file samples with equal ComfyUI's for its own Wan model (model
    sampling shift 8, ModelSamplingDiscreteFlow over 1000 steps, the "simple" scheduler;
    written out here from ComfyUI's definitions) to 5e-3 (diffusers' flow sigmas start
    from linspace(1, 1/1000) where ComfyUI's start from i/1000), and not shift 3's."""
    from diffusers import UniPCMultistepScheduler

    from comfyui_xdit import bridge
    sched = bridge.families.family(ARCH).detection.released({})[0]

    def comfy_simple(shift: float, steps: int):
        t = torch.arange(1, 1001, dtype=torch.float64) / 1000
        ms = shift * t / (1 + (shift - 1) * t)
        return torch.tensor([float(ms[-(1 + int(x * 1000 / steps))]) for x in range(steps)]
                            + [0.0])
    for steps in (4, 6, 20):
        s = UniPCMultistepScheduler.from_config(sched)
        s.set_timesteps(steps)
        ours = s.sigmas.double()
        assert float((ours - comfy_simple(8.0, steps)).abs().max()) <= 5e-3, steps
        assert float((ours - comfy_simple(3.0, steps)).abs().max()) > 0.05, steps


def _forward(tr, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 2, 4, 6, generator=g)
    ctx = torch.randn(1, 7, 32, generator=g)
    with torch.no_grad():
        return tr(hidden_states=x, timestep=torch.tensor([700.0]), encoder_hidden_states=ctx,
                  return_dict=False)[0].float()


def test_bf16_and_fp8_files_are_close(pipe, files):
    """In process, the loaders the workers run: the diffusers-named file is exact, the bf16
    and scaled-fp8 files close (their weights are rounded), the missing tensor refused."""
    from workers.models import get_adapter
    from workers.loading.single_file import load_single_file
    ref = _forward(pipe.transformer)
    scale = float(ref.abs().max())
    diffs = {}
    for name, dtype in (("diffusers", torch.float32), ("bf16", torch.float32),
                        ("fp8", torch.float32)):
        tr = load_single_file(get_adapter(ARCH), str(files[name]), torch.device("cpu"),
                              dtype).transformer
        diffs[name] = float((_forward(tr) - ref).abs().max())
    print("wan single files vs folder transformer, max abs diff:", diffs)
    assert diffs["diffusers"] <= 1e-6
    assert 0 < diffs["bf16"] < 0.05 * scale and 0 < diffs["fp8"] < 0.1 * scale
    with pytest.raises(ValueError) as e:
        load_single_file(get_adapter(ARCH), str(files["missing"]), torch.device("cpu"),
                         torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and "lacks 1 tensor(s)" in msg and "blocks.1.attn2.to_out.0" in msg


def test_ti2v_5b_is_refused_in_one_line(tmp_path):
    """A Wan 2.2 TI2V-5B transformer (48 latent channels, per-token timesteps) is recognised
    as Wan and refused before anything launches, as a file (ComfyUI and diffusers naming)
    and as a folder, saying what runs instead; a 16-channel transformer of the same shapes
    otherwise is accepted."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from comfyui_xdit.errors import ConfigError
    from comfyui_xdit.planning.model_info import read_model_info
    from comfyui_xdit.testmodels.wan import single_file as wan_to_comfy

    def tiny(channels):
        torch.manual_seed(0)
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                     attention_head_dim=128, in_channels=channels,
                                     out_channels=channels, text_dim=32, freq_dim=32,
                                     ffn_dim=64, num_layers=1, cross_attn_norm=True,
                                     qk_norm="rms_norm_across_heads", eps=1e-6)

    want = r"TI2V-5B transformer \(48 latent channels.*does not run; Wan 2.1 and Wan 2.2 A14B"
    for channels in (48, 16):
        tr = tiny(channels)
        sd = {k: v.contiguous() for k, v in tr.state_dict().items()}
        paths = {"diffusers file": tmp_path / f"d{channels}.safetensors",
                 "comfy file": tmp_path / f"c{channels}.safetensors",
                 "folder": tmp_path / f"folder{channels}"}
        save_file(sd, str(paths["diffusers file"]))
        save_file(wan_to_comfy(sd), str(paths["comfy file"]))
        tr.save_pretrained(str(paths["folder"] / "transformer"))
        for kind, p in paths.items():
            if channels == 48:
                with pytest.raises(ConfigError, match=want) as e:
                    read_model_info(p)
                assert "\n" not in str(e.value) and str(p) in str(e.value), kind
            elif kind != "folder":  # (a folder without model_index.json: not a model)
                assert read_model_info(p).arch == ARCH, kind
