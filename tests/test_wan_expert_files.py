"""Wan 2.2 A14B from two single files (`WorkerPool(high, ..., model_path_2=low)`) and LoRA per
expert.

The tiny A14B folder's `transformer` and `transformer_2` (head dim 128, as a file's shapes
give) are written as two ComfyUI-named files (comfyui_xdit/testmodels/wan.single_file). Single
files carry no text encoders, so the prompts go in as conditioning (the folder's UMT5 states);
the pair through the pool equals the folder through the pool with the same conditioning
(<= 1e-5): 1 rank loading whole files, and Ulysses 2 loading shard by shard (weight sharding,
each rank reads only its rows of both files). The boundary is the released one (T2V 0.875;
a 36-channel I2V pair 0.9), set by the adapter since a file carries none.

LoRA: an entry naming its expert ("high" | "low") goes into that transformer only; against
WanPipeline with one LoRA loaded into `transformer` and another into `transformer_2`
(`load_into_transformer_2`). Host checks: mismatched, folder and non-expert second paths
are refused in one line, as are expert LoRA entries on a one-transformer model.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.errors import ConfigError
from single_file_util import write_single_file

TOL = 1e-5
WIDE = dict(width=256, heads=2)  # head dim 128: what a file's shapes give
H, W, FRAMES, STEPS, CFG, CFG_2, MSL = 32, 48, 5, 3, 4.0, 2.0, 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    return ensure_tiny_model("wan", tmp_path_factory.mktemp("wan_pair"), variant="a14b", **WIDE)


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import WanPipeline
    p = WanPipeline.from_pretrained(str(folder)).to(torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _state(folder, sub):
    from safetensors.torch import load_file
    return load_file(str(folder / sub / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    d = tmp_path_factory.mktemp("wan_pair_files")
    return {"high": write_single_file(None, "wan", d / "high.safetensors",
                                      state=_state(folder, "transformer"), prefix=True),
            "low": write_single_file(None, "wan", d / "low.safetensors",
                                     state=_state(folder, "transformer_2"))}


@pytest.fixture(scope="module")
def conds(pipe):
    with torch.no_grad():
        enc = [pipe.encode_prompt([t], do_classifier_free_guidance=False,
                                  max_sequence_length=MSL)[0]
               for t in ("a red cat walking", "blurry")]
    return enc


def _request(conds, **kw):
    pos, neg = conds
    return GenerationRequest(prompt=[], positive={"cond": pos, "pooled": None},
                             negative={"cond": neg, "pooled": None}, cfg=CFG, cfg_2=CFG_2,
                             seed=3, steps=STEPS, height=H, width=W, frames=FRAMES,
                             **dict({"shift": 3.0}, **kw))  # the folder's (a file's: 8)


def _diff(a, b) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def test_both_experts_run(pipe):
    """The request's steps reach both experts (else the test would prove little)."""
    s = pipe.scheduler
    s.set_timesteps(STEPS)
    boundary = 0.875 * s.config.num_train_timesteps
    used = {0 if float(t) >= boundary else 1 for t in s.timesteps}
    assert used == {0, 1}, s.timesteps


def test_pair_equals_the_folder(folder, files, conds):
    req = _request(conds)
    t0 = time.perf_counter()
    with WorkerPool(str(folder), ParallelConfig(), device="cpu", threads_per_rank=1) as pool:
        want = pool.generate(req).samples
    got = {}
    for name, config, shard in (("1 rank", ParallelConfig(), False),
                                ("ulysses 2, sharded", ParallelConfig(ulysses=2), True),
                                ("pipefusion 2", ParallelConfig(pipefusion=2,
                                                                warmup_steps=STEPS), False)):
        with WorkerPool(str(files["high"]), config, device="cpu", threads_per_rank=1,
                        model_path_2=str(files["low"]), shard_weights=shard) as pool:
            assert pool.model_info.experts == 2 and pool.model_info.kind == "file"
            got[name] = _diff(pool.generate(req).samples, want)
            if shard:
                loads = [r["load"] for r in pool.status()["ranks"]]
                assert all(x["loaded"] == "shards only" for x in loads), loads
    print(f"wan A14B two files vs the folder (pool, same conditioning), max abs diff: {got} "
          f"({time.perf_counter() - t0:.1f}s)")
    assert all(v <= TOL for v in got.values()), got


def test_boundary_per_model_type():
    from comfyui_xdit import bridge
    families = bridge.families
    boundary = families.family("wan").capability(families.TwoExperts).boundary
    assert boundary({"in_channels": 16}) == 0.875
    assert boundary({"in_channels": 36}) == 0.9  # Wan 2.2 I2V A14B
    assert boundary({"in_channels": 36, "image_dim": 1280}) is None  # 2.1 I2V
    assert families.family("flux").capability(families.TwoExperts) is None


def test_i2v_pair_gets_its_boundary(tmp_path):
    """In process, the worker's loader: a 36-channel pair switches at 0.9."""
    from diffusers import WanTransformer3DModel

    from workers.models import get_adapter
    torch.manual_seed(0)
    paths = []
    for i in range(2):
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=1,
                                  attention_head_dim=128, in_channels=36, out_channels=16,
                                  text_dim=32, ffn_dim=64, num_layers=1)
        paths.append(str(write_single_file(None, "wan", tmp_path / f"e{i}.safetensors",
                                           state=m.state_dict())))
    model = get_adapter("wan").load(paths[0], torch.device("cpu"), torch.float32, False,
                                    path_2=paths[1])
    assert model.transformer_2 is not None and model.index == {"boundary_ratio": 0.9}


def test_bad_pairs_are_refused(folder, files, tmp_path):
    from diffusers import WanTransformer3DModel

    from comfyui_xdit.planning.model_info import read_model_info
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                              attention_head_dim=128, in_channels=16, out_channels=16,
                              text_dim=32, ffn_dim=512, num_layers=3)
    other = write_single_file(None, "wan", tmp_path / "other.safetensors", state=m.state_dict())
    flux = ensure_tiny_model("flux", tmp_path / "flux")
    flux_file = write_single_file(flux, "flux", tmp_path / "flux.safetensors")
    cases = {"num_layers": (files["high"], other), "is a folder": (files["high"], folder),
             "no second expert": (flux_file, files["low"]),
             "is a FLUX": (files["high"], flux_file)}
    for want, (a, b) in cases.items():
        with pytest.raises(ConfigError) as e:
            WorkerPool(str(a), model_path_2=str(b))
        msg = str(e.value)
        assert want in msg and "\n" not in msg, (want, msg)
    info = read_model_info(files["high"], files["low"])
    assert (info.experts, info.path_2) == (2, str(files["low"]))


# ---- LoRA per expert ---------------------------------------------------------------------
def _peft_lora(folder, out_dir, seed):
    """A random PEFT LoRA (r 4) on the attention and FFN Linears, in diffusers' format."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    t = WanTransformer3DModel.from_pretrained(str(folder), subfolder="transformer")
    cfg = LoraConfig(r=4, lora_alpha=8.0, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                           "ffn.net.0.proj", "ffn.net.2"])
    t.add_adapter(cfg, adapter_name="x")
    g = torch.Generator().manual_seed(seed)
    for n, p in t.named_parameters():
        if "lora_" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    out_dir.mkdir(parents=True, exist_ok=True)
    WanPipeline.save_lora_weights(out_dir, transformer_lora_layers=get_peft_model_state_dict(
        t, adapter_name="x"), transformer_lora_adapter_metadata=cfg.to_dict())
    return out_dir / "pytorch_lora_weights.safetensors"


def _oracle(pipe, conds):
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    noise = torch.randn([1, 16, (FRAMES - 1) // 4 + 1, H // 8, W // 8],
                        generator=torch.manual_seed(3))
    out = pipe(prompt_embeds=conds[0], negative_prompt_embeds=conds[1], guidance_scale=CFG,
               guidance_scale_2=CFG_2, height=H, width=W, num_frames=FRAMES,
               num_inference_steps=STEPS, latents=noise, output_type="latent").frames
    return out * std + mean


def test_lora_per_expert(folder, files, pipe, conds, tmp_path):
    """(A, 0.7, "high") and {B, 0.5, "low"} on the pair pool equal WanPipeline with A in
    `transformer` and B in `transformer_2`; the same entries without experts (both in both)
    differ; no LoRA gives the base model back."""
    a, b = _peft_lora(folder, tmp_path / "a", 3), _peft_lora(folder, tmp_path / "b", 4)
    base = _oracle(pipe, conds)
    pipe.load_lora_weights(str(a), adapter_name="a")
    pipe.load_lora_weights(str(b), adapter_name="b", load_into_transformer_2=True)
    pipe.transformer.set_adapters(["a"], [0.7])
    pipe.transformer_2.set_adapters(["b"], [0.5])
    want = _oracle(pipe, conds)
    pipe.unload_lora_weights()
    assert _diff(want, base) > 1e-2
    req = _request(conds)
    with WorkerPool(str(files["high"]), ParallelConfig(), device="cpu", threads_per_rank=1,
                    model_path_2=str(files["low"])) as pool:
        got = pool.generate(dataclasses.replace(req, loras=[
            (str(a), 0.7, "high"), {"path": str(b), "strength": 0.5, "expert": "low"}])).samples
        both = pool.generate(dataclasses.replace(req, loras=[(str(a), 0.7),
                                                             (str(b), 0.5)])).samples
        off = pool.generate(req).samples
    err, plain = _diff(got, want), _diff(off, base)
    print(f"wan A14B LoRA per expert vs WanPipeline (transformer / transformer_2): {err:.2e}; "
          f"without LoRA vs the base pipeline: {plain:.2e}; both-expert entries differ by "
          f"{_diff(both, want):.2e}")
    assert err <= TOL and plain <= TOL and _diff(both, want) > 1e-3


def test_lora_expert_problems(files, tmp_path):
    from comfyui_xdit.planning.model_info import read_model_info
    from safetensors.torch import save_file
    lora = tmp_path / "l.safetensors"  # a LoRA file as the host's check reads it (its header)
    save_file({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 4),
               "blocks.0.attn1.to_q.lora_B.weight": torch.zeros(4, 2)}, str(lora))
    one = read_model_info(files["high"])
    two = read_model_info(files["high"], files["low"])
    ok = GenerationRequest(prompt=["x"], loras=[(str(lora), 1.0, "low")])
    assert not [p for p in ok.problems(two) if "LoRA" in p]
    assert any("has one" in p for p in ok.problems(one))
    bad = GenerationRequest(prompt=["x"], loras=[(str(lora), 1.0, "mid"),
                                                 {"path": str(lora), "weight": 1}])
    probs = [p for p in bad.problems(two) if "LoRA" in p]
    assert len(probs) == 2 and "'high' or 'low'" in probs[0] and "keys" in probs[1], probs
    from comfyui_xdit.cli.commands import _lora
    assert _lora("a.safetensors:0.5:high") == ("a.safetensors", 0.5, "high")
    assert _lora("a.safetensors:0.5") == ("a.safetensors", 0.5)
    assert _lora("a.safetensors") == ("a.safetensors", 1.0)
