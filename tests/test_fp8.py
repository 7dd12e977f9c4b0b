"""fp8 weights: storage, arithmetic, fp8 / scaled-fp8 single files, LoRA on fp8, and where the
text encoders run.

The references quantize with code written here (not the product's): per tensor for
weights="fp8" (s = max|w| / 448, w8 = fp8(w / s), used as w8 * s), and per fused BFL tensor
for files written by `tiny_model.write_fp8_file` (q, k, v share a scale). A pool computing in
fp32 must equal an in-process diffusers pipeline holding those dequantized weights.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
from comfyui_xdit.model_info import read_model_info
from comfyui_xdit.tiny_model import write_fp8_file
from conftest import comfyui_noise, model_to_latent, pack_flux, unpack_flux
from single_file_util import write_single_file

FP8 = torch.float8_e4m3fn
TOL = 1e-5
PSNR_FLOOR = 60.0  # dB, fp8 vs full precision, tiny model final latent (measured 72.3)
BLOCKS = ("transformer_blocks", "single_transformer_blocks")


def q_tensor(w, scale=None):
    """Reference quantize-dequantize in fp32 (scale None: max|w| / 448)."""
    w = w.float()
    s = (w.abs().max() / 448.0).clamp(min=1e-12) if scale is None else scale
    return (w / s).clamp(-448, 448).to(FP8).float() * s


def block_linears(tr):
    return {n: m for n, m in tr.named_modules()
            if n.startswith(tuple(b + "." for b in BLOCKS)) and isinstance(m, torch.nn.Linear)}


def bfl_groups(names):
    """The diffusers Linears that one BFL tensor holds (FLUX): fused q/k/v (+ mlp in single
    blocks) share one fp8 scale in a file."""
    out, done = [], set()
    for n in sorted(names):
        parts = n.split(".")
        pre = ".".join(parts[:2])
        if parts[0] == "transformer_blocks" and n.endswith(("attn.to_q", "attn.add_q_proj")):
            g = [f"{pre}.attn.to_{x}" for x in "qkv"] if n.endswith("to_q") else \
                [f"{pre}.attn.add_{x}_proj" for x in "qkv"]
        elif parts[0] == "single_transformer_blocks" and n.endswith("attn.to_q"):
            g = [f"{pre}.attn.to_{x}" for x in "qkv"] + [f"{pre}.proj_mlp"]
        else:
            continue
        out.append(g)
        done.update(g)
    return out + [[n] for n in sorted(names) if n not in done]


def quantize_reference(tr, mode):
    """mode "fp8": per tensor; "file-plain": plain cast; "file-scaled": per BFL tensor."""
    lins = block_linears(tr)
    with torch.no_grad():
        if mode == "fp8":
            for m in lins.values():
                m.weight.copy_(q_tensor(m.weight))
            return tr
        for g in bfl_groups(lins):
            ws = [lins[n].weight.float() for n in g]
            if mode == "file-plain":
                new = [w.clamp(-448, 448).to(FP8).float() for w in ws]
            else:
                s = (torch.cat(ws).abs().max() / 448.0).clamp(min=1e-12)
                new = [q_tensor(w, s) for w in ws]
            for n, w in zip(g, new):
                lins[n].weight.copy_(w)
    return tr


def request(**kw):
    base = dict(prompt=["an fp8 cat"], seed=3, steps=2, height=64, width=64,
                max_sequence_length=12, cfg=1.0)
    base.update(kw)
    return GenerationRequest(**base)


def reference(folder, req, mode, cond=None, lora=None):
    """The diffusers FluxPipeline with quantized transformer weights, as a LATENT."""
    import diffusers
    pipe = diffusers.FluxPipeline.from_pretrained(str(folder))
    if mode:
        quantize_reference(pipe.transformer, mode)
    if lora:
        pipe.load_lora_weights(str(lora[0]), adapter_name="a")
        pipe.set_adapters(["a"], [lora[1]])
    h, w = req.height, req.width
    noise = comfyui_noise(req.seed, (1, 16, h // 8, w // 8))
    text = dict(prompt=list(req.prompt)) if cond is None else \
        dict(prompt_embeds=cond["cond"], pooled_prompt_embeds=cond["pooled"])
    out = pipe(**text, guidance_scale=3.5, height=h, width=w, num_inference_steps=req.steps,
               latents=pack_flux(noise), max_sequence_length=req.max_sequence_length,
               output_type="latent")
    return model_to_latent(unpack_flux(out.images, h, w), folder)


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def psnr(x, ref):
    mse = ((x.float() - ref.float()) ** 2).mean().item()
    rng = (ref.max() - ref.min()).item()
    return 10 * torch.log10(torch.tensor(rng * rng / max(mse, 1e-30))).item()


# ---- arithmetic and storage (in process) -----------------------------------------------------
def test_fp8_linear_is_upcast_times_scale():
    from workers.weights import FP8Linear, quantize
    torch.manual_seed(0)
    w, b, x = torch.randn(24, 16) * 0.02, torch.randn(24), torch.randn(5, 16)
    w8, s = quantize(w)
    assert w8.dtype == FP8 and w8.float().abs().max().item() == 448.0  # amax -> fp8 max
    lin = FP8Linear(16, 24)
    lin.weight, lin.bias = torch.nn.Parameter(w8, False), torch.nn.Parameter(b, False)
    lin.scale = s
    assert torch.equal(lin(x), F.linear(x, w8.float() * s, b))
    assert torch.equal(lin(x), F.linear(x, q_tensor(w), b))  # the test's own recipe
    assert maxdiff(lin(x), F.linear(x, w, b)) < 2e-2 * F.linear(x, w, b).abs().max()
    # negative control: the same fp8 weight without its scale is far off
    lin.scale = torch.ones(())
    assert maxdiff(lin(x), F.linear(x, w, b)) > 1.0


def test_fp8_halves_the_block_weights(model_dir):
    """Counted on a loaded tiny model (block Linears exactly half of bf16) and on a dry-run
    load of a FLUX.1-dev-sized transformer onto the meta device (whole model)."""
    import diffusers

    from workers.models import get_adapter
    from workers.weights import FP8Linear, load_tensors, parameter_bytes
    ad = get_adapter("flux")
    full = ad.load(str(model_dir("flux")), torch.device("cpu"), torch.bfloat16, False,
                   weights="full").transformer
    fp8 = ad.load(str(model_dir("flux")), torch.device("cpu"), torch.bfloat16, False,
                  weights="fp8").transformer

    def block_weight_bytes(tr):
        return sum(m.weight.numel() * m.weight.element_size() for m in block_linears(tr).values())
    assert not any(isinstance(m, FP8Linear) for m in full.modules())
    assert all(isinstance(m, FP8Linear) for m in block_linears(fp8).values())
    assert 2 * block_weight_bytes(fp8) == block_weight_bytes(full)
    # FLUX.1-dev's shapes, nothing allocated: the real loader's fp8 plan, counted
    cfg = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
               attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
               pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    sizes = {}
    for mode in ("full", "fp8"):
        with torch.device("meta"):
            tr = diffusers.FluxTransformer2DModel(**cfg)
        src = ((k, torch.empty(v.shape, dtype=torch.bfloat16, device="meta"), None)
               for k, v in tr.state_dict().items())
        rep = load_tensors(tr, ad.block_lists, src, torch.bfloat16, mode)
        sizes[mode] = parameter_bytes(tr)
        assert rep.transformer_bytes == sizes[mode]
    ratio = sizes["fp8"] / sizes["full"]
    print(f"FLUX.1-dev transformer: bf16 {sizes['full'] / 2**30:.2f} GiB, "
          f"fp8 {sizes['fp8'] / 2**30:.2f} GiB ({ratio:.3f})")
    assert 11.9e9 * 2 * 0.99 < sizes["full"] < 11.9e9 * 2 * 1.01
    assert 0.5 <= ratio < 0.52


@pytest.fixture(scope="module")
def fp8_files(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    bfl = write_single_file(model_dir("flux"), "flux", d / "flux1-tiny.safetensors", prefix=True)
    plain = write_fp8_file(bfl, d / "flux1-tiny-fp8.safetensors", scaled=False)
    scaled = write_fp8_file(bfl, d / "flux1-tiny-fp8-scaled.safetensors", scaled=True)
    from safetensors.torch import load_file, save_file
    sd = load_file(str(scaled))  # negative control: a loader that ignored scale_weight
    unscaled = d / "flux1-tiny-fp8-scales-dropped.safetensors"
    save_file({k: v for k, v in sd.items() if not k.endswith((".scale_weight", "scaled_fp8"))},
              str(unscaled))
    return {"bfl": bfl, "plain": plain, "scaled": scaled, "unscaled": unscaled}


def _forward(tr, seed=0):
    torch.manual_seed(seed)
    c = tr.config
    hid = torch.randn(1, 16, c.in_channels)
    enc = torch.randn(1, 6, c.joint_attention_dim)
    with torch.no_grad():
        return tr(hidden_states=hid, encoder_hidden_states=enc,
                  pooled_projections=torch.randn(1, c.pooled_projection_dim),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(6, 3), return_dict=False)[0]


def test_fp8_files_load_with_their_scales(model_dir, fp8_files):
    import diffusers

    from workers.models import get_adapter
    from workers.weights import FP8Linear
    folder = model_dir("flux")
    assert read_model_info(fp8_files["plain"]).storage == "fp8"
    assert read_model_info(fp8_files["scaled"]).storage == "scaled-fp8"
    assert read_model_info(fp8_files["bfl"]).storage == "fp32"
    assert read_model_info(folder).storage == "fp32"
    ad = get_adapter("flux")
    base = diffusers.FluxTransformer2DModel.from_pretrained(str(folder), subfolder="transformer")
    for kind, mode in (("plain", "file-plain"), ("scaled", "file-scaled")):
        want = _forward(quantize_reference(
            diffusers.FluxTransformer2DModel.from_pretrained(str(folder),
                                                             subfolder="transformer"), mode))
        for weights in ("auto", "full"):
            m = ad.load(str(fp8_files[kind]), torch.device("cpu"), torch.float32, False,
                        weights=weights)
            n8 = sum(isinstance(x, FP8Linear) for x in m.transformer.modules())
            assert n8 == (len(block_linears(base)) if weights == "auto" else 0), (kind, weights)
            assert m.load_report["checkpoint_fp8"] and \
                m.load_report["checkpoint_scaled"] == (kind == "scaled")
            got = _forward(m.transformer)
            print(f"{kind} file, weights={weights}: |got - reference| = {maxdiff(got, want):.1e}"
                  f", |got - full precision| = {maxdiff(got, _forward(base)):.1e}")
            assert maxdiff(got, want) <= TOL, (kind, weights)
    # negative control: the scaled file read without its scale_weight tensors is wrong
    want = _forward(quantize_reference(
        diffusers.FluxTransformer2DModel.from_pretrained(str(folder), subfolder="transformer"),
        "file-scaled"))
    m = ad.load(str(fp8_files["unscaled"]), torch.device("cpu"), torch.float32, False)
    assert maxdiff(_forward(m.transformer), want) > 100 * TOL


# ---- pools -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_pool(model_dir):
    pool = WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1, weights="fp8", text_encoders="cpu")
    yield pool
    pool.close()


def test_fp8_pool_equals_quantized_pipeline(model_dir, fp8_pool, oracle):
    folder = model_dir("flux")
    want = reference(folder, request(), "fp8")
    got2 = fp8_pool.generate(request()).samples
    st = fp8_pool.status()
    assert st["weights"] == "fp8" and st["text_encoders"] == "cpu"
    assert all(r["load"]["fp8_layers"] > 0 for r in st["ranks"])
    one = WorkerPool(folder, ParallelConfig(), device="cpu", threads_per_rank=1, weights="fp8",
                     text_encoders="cpu")
    try:
        got1 = one.generate(request()).samples
    finally:
        one.close()
    full = oracle("flux", request())
    p = psnr(got1, full)
    print(f"fp8 pool: 1 rank {maxdiff(got1, want):.1e}, ulysses 2 {maxdiff(got2, want):.1e} "
          f"from the quantized pipeline; vs full precision max {maxdiff(got1, full):.1e}, "
          f"PSNR {p:.1f} dB")
    assert maxdiff(got1, want) <= TOL and maxdiff(got2, want) <= TOL
    assert maxdiff(got1, full) > 10 * TOL  # fp8 really ran (not the full-precision weights)
    assert p > PSNR_FLOOR


def test_lora_on_fp8_pool(model_dir, fp8_pool, tmp_path):
    from test_lora import make_peft_lora
    folder = model_dir("flux")
    lora, _ = make_peft_lora("flux", folder, tmp_path / "lora", seed=7)
    got = fp8_pool.generate(request(loras=[(str(lora), 0.8)])).samples
    want = reference(folder, request(), "fp8", lora=(lora, 0.8))
    base = fp8_pool.generate(request()).samples
    print(f"LoRA on fp8: |pool - reference| = {maxdiff(got, want):.1e}, "
          f"|lora - base| = {maxdiff(got, base):.1e}")
    assert maxdiff(got, want) <= TOL
    assert maxdiff(got, base) > 1e-3  # the LoRA did something


def test_scaled_fp8_file_pool_equals_reference(model_dir, fp8_files):
    from test_conditioning import encode
    folder = model_dir("flux")
    cond = encode("flux", str(folder), "an fp8 cat", 12)
    req = request(prompt=[], positive=cond)
    want = reference(folder, req, "file-scaled", cond=cond)
    pool = WorkerPool(fp8_files["scaled"], ParallelConfig(ulysses=2), device="cpu",
                      threads_per_rank=1)
    try:
        got = pool.generate(req).samples
        st = pool.status()
    finally:
        pool.close()
    print(f"scaled-fp8 file, ulysses 2: |pool - reference| = {maxdiff(got, want):.1e}")
    assert st["weights"] == "fp8" and st["text_encoders"] is None
    assert maxdiff(got, want) <= TOL


# ---- text encoders -------------------------------------------------------------------------
def test_text_encoder_placement_decision():
    from workers.weights import TEXT_ENCODER_MARGIN as M
    from workers.weights import text_encoder_device as place
    gib = 2 ** 30
    cuda = torch.device("cuda", 0)
    assert place("auto", cuda, free_bytes=20 * gib, encoder_bytes=10 * gib) == "cuda:0"
    assert place("auto", cuda, free_bytes=10 * gib + M, encoder_bytes=10 * gib) == "cuda:0"
    assert place("auto", cuda, free_bytes=10 * gib + M - 1, encoder_bytes=10 * gib) == "cpu"
    assert place("auto", cuda, free_bytes=None, encoder_bytes=1) == "cpu"  # unknown: CPU
    assert place("cpu", cuda, free_bytes=80 * gib) == "cpu"
    assert place("gpu", cuda, free_bytes=0, encoder_bytes=10 * gib) == "cuda:0"
    assert place("cuda:1", cuda) == "cuda:1"
    assert place("auto", torch.device("cpu"), free_bytes=80 * gib) == "cpu"
    with pytest.raises(ValueError, match="needs a CUDA pool"):
        place("gpu", torch.device("cpu"))


def test_pipefusion_stages_of_a_scaled_fp8_file(fp8_files):
    """Each stage of a scaled-fp8 file holds its blocks' fp8 weights and scales, exactly as a
    whole load does, and reads fewer bytes than the file."""
    from workers.models import get_adapter
    ad = get_adapter("flux")
    whole = ad.load(str(fp8_files["scaled"]), torch.device("cpu"), torch.float32, False)
    ref = {n: m for n, m in whole.transformer.named_modules()}
    size = fp8_files["scaled"].stat().st_size
    held = set()
    for stage in range(2):
        m = ad.load(str(fp8_files["scaled"]), torch.device("cpu"), torch.float32, False,
                    stage=(stage, 2, "balanced"))
        assert m.load_report["bytes_read"] < 0.9 * size
        for n, mod in m.transformer.named_modules():
            if type(mod).__name__ == "FP8Linear":
                assert mod.weight.dtype == FP8
                assert torch.equal(mod.weight.float(), ref[n].weight.float()), n
                assert torch.equal(mod.scale, ref[n].scale), n
                held.add(n)
    assert held == {n for n, mod in ref.items() if type(mod).__name__ == "FP8Linear"}
