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
from comfyui_xdit.planning.model_info import read_model_info
from comfyui_xdit.testmodels.tiny_model import write_fp8_file
from conftest import comfyui_noise, model_to_latent, pack_flux, unpack_flux
from single_file_util import write_single_file

FP8 = torch.float8_e4m3fn
TOL = 1e-5
PSNR_FLOOR = 60.0  # dB, fp8 vs full precision, tiny model final latent (measured 72.2)
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


def q_channels(w):
    """Reference per-channel quantize-dequantize in fp32: each row by max|row| / 448."""
    w = w.float()
    return q_tensor(w, (w.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12))


def quantize_reference(tr, mode):
    """mode "fp8": per output channel (the pool's own quantisation); "file-plain": plain
    cast; "file-scaled": per BFL tensor (as the file stores it)."""
    lins = block_linears(tr)
    with torch.no_grad():
        if mode == "fp8":
            for m in lins.values():
                m.weight.copy_(q_channels(m.weight))
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
    from workers.loading.weights import FP8Linear, quantize
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
    from workers.loading.weights import FP8Linear, load_tensors, parameter_bytes
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
    from workers.loading.weights import FP8Linear
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


# ---- fp8 compute (torch._scaled_mm) ---------------------------------------------------------
SCALED_MM_HOOK = "xdit_testhooks.probes:count_scaled_mm"
FP8_MATMUL_TEXT = "fp8 weights, fp8 matmul (scaled_mm, per-row activation scales)"
# dB, final latent vs the full-precision pipeline, fp8 weights with fp8 matmul (per-row
# activation scales); the tiny models measured FLUX 70.9, SD3 74.1 (upcast: 72.2, 77.4)
COMPUTE_PSNR_FLOOR = 60.0


def flux_like(tokens, k, n, seed=0):
    """A FLUX-shaped layer's weight / bias and activations whose few outliers (a handful of
    channels in some tokens, 2000-5000 as FLUX's residual stream has) are far beyond fp8's
    448."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    b = torch.randn(n, generator=g) * 0.1
    x = torch.randn(tokens, k, generator=g)
    rows = torch.randperm(tokens, generator=g)[:max(2, tokens // 16)]
    cols = torch.randperm(k, generator=g)[:3]
    for i, r in enumerate(rows.tolist()):
        x[r, cols[i % 3]] = (2000.0 + 3000.0 * torch.rand((), generator=g).item()) * \
            (-1) ** i
    return w, b, x


def ref_fp8_matmul(x, w, b):
    """The same quantisation, written here: weight per tensor (s_w = max|w| / 448),
    activations per row (s_a = max|row| / 448, in x's dtype); both dequantized and
    multiplied in float64."""
    s_w = (w.float().abs().max() / 448.0).clamp(min=1e-12)
    w8 = (w.float() / s_w).clamp(-448, 448).to(FP8)
    s_a = x.abs().amax(dim=-1, keepdim=True) / 448.0
    x8 = (x / s_a).to(FP8)
    y = (x8.double() * s_a.double()) @ (w8.double() * s_w.double()).t()
    return y + b.double(), w8, s_w


def fp8_layer(w, b, dtype, matmul):
    from workers.loading.weights import FP8Linear, quantize, set_fp8_compute
    w8, s = quantize(w)
    lin = FP8Linear(w.shape[1], w.shape[0], compute_dtype=dtype)
    lin.weight = torch.nn.Parameter(w8, requires_grad=False)
    lin.bias = torch.nn.Parameter(b.to(dtype), requires_grad=False)
    lin.scale = s
    info = set_fp8_compute(torch.nn.Sequential(lin), "on" if matmul else "off", "cpu", dtype)
    return lin, info


def test_per_channel_scales_in_both_arithmetics():
    """`weights="fp8"` quantises each output channel by its own range: FP8Linear with those
    [N, 1] scales upcasts to exactly the reference's dequantized weight, its fp8 matmul
    (`scale_b` the scales as a row) equals the float64 product of the same quantisations,
    and on a weight whose rows span 50,000x in range (a few wide channels, a few nearly
    unused ones) its worst channel is several times closer to the exact layer than with
    one scale per tensor, which pushes the narrow rows into fp8's subnormals."""
    from workers.loading.weights import FP8Linear, quantize, quantize_channels, set_fp8_compute
    g = torch.Generator().manual_seed(1)
    n, k = 96, 64
    w = torch.randn(n, k, generator=g) * k ** -0.5
    w[:4] *= 50.0  # a few channels far wider than the rest
    w[4:8] *= 1e-3  # and a few nearly unused ones
    b, x = torch.randn(n, generator=g) * 0.1, torch.randn(3, 10, k, generator=g)
    exact = F.linear(x, w, b)
    errs = {}
    for name, fn in (("channel", quantize_channels), ("tensor", quantize)):
        w8, s = fn(w)
        assert s.shape == ((n, 1) if name == "channel" else ())
        lin = FP8Linear(k, n)
        lin.weight, lin.bias = torch.nn.Parameter(w8, False), torch.nn.Parameter(b, False)
        lin.scale = s
        up = lin(x)
        if name == "channel":
            assert torch.equal(lin.dequantized(torch.float32), q_channels(w))
            set_fp8_compute(torch.nn.Sequential(lin), "on", "cpu", torch.float32)
            assert lin.scale_row.shape == (1, n)
            s_a = x.abs().amax(dim=-1, keepdim=True) / 448.0
            want = ((x / s_a).to(FP8).double() * s_a.double()) @ \
                (w8.double() * s.double()).t() + b.double()
            assert maxdiff(lin(x), want) / want.abs().max().item() < 1e-5
        # each output channel's error relative to that channel's own outputs
        rel = (up - exact).abs().amax(dim=(0, 1)) / (exact - b).abs().amax(dim=(0, 1))
        errs[name] = rel.max().item()
    print(f"upcast layer vs exact, worst channel's relative error: per channel "
          f"{errs['channel']:.3g}, per tensor {errs['tensor']:.3g}")
    assert errs["tensor"] > 3 * errs["channel"]


# (3072, 384): FLUX's width as the reduction length, the one dimension a per-element
# rounding bound depends on; the output count only repeats the same dot product per column
@pytest.mark.parametrize("k,n", [(256, 768), (3072, 384)])
def test_fp8_matmul_is_the_per_row_quantisation(k, n):
    """fp8 compute through _scaled_mm (CPU) = the float64 product of the per-row-quantised
    activations and the per-tensor-quantised weight, to fp32 rounding; with outliers of
    thousands it stays close to the exact product, where the unscaled cast (clamp at 448,
    scale 1: the old XDIT_FP8_MATMUL recipe) is far off."""
    w, b, x = flux_like(128, k, n)
    x = x.reshape(2, 64, k)  # [batch, tokens, features]
    lin, info = fp8_layer(w, b, torch.float32, matmul=True)
    assert info["fp8_matmul_layers"] == 1 and info["text"] == FP8_MATMUL_TEXT
    got = lin(x)
    want, w8, s_w = ref_fp8_matmul(x, w, b)
    assert got.shape == (2, 64, n) and got.dtype == torch.float32
    rel = maxdiff(got, want) / want.abs().max().item()
    assert rel < 1e-5, rel
    exact = x.double() @ (w8.double() * s_w.double()).t() + b.double()  # float activations
    scaled_err = maxdiff(got, exact)
    unscaled = torch._scaled_mm(x.reshape(-1, k).clamp(-448, 448).to(FP8), w8.t(),
                                scale_a=torch.ones(()), scale_b=s_w.reshape(()),
                                bias=b, out_dtype=torch.float32).reshape(2, 64, n)
    unscaled_err = maxdiff(unscaled, exact)
    print(f"{k}->{n}: |fp8 matmul - its quantisation| {rel:.1e} (relative); vs the exact "
          f"product: per-row scales {scaled_err:.3g}, unscaled cast {unscaled_err:.3g} "
          f"({unscaled_err / scaled_err:.0f}x)")
    assert unscaled_err > 10 * scaled_err
    # bf16 activations: the scale is computed and applied in bf16, handed to the matmul as is
    got16 = fp8_layer(w, b, torch.bfloat16, matmul=True)[0](x.bfloat16())
    want16 = ref_fp8_matmul(x.bfloat16(), w, b)[0]
    assert got16.dtype == torch.bfloat16
    assert maxdiff(got16, want16) / want16.abs().max().item() < 1e-2  # bf16 output rounding


def test_fp8_matmul_choice():
    from workers.loading.weights import FP8Linear, fp8_matmul_choice, set_fp8_compute
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert fp8_matmul_choice("auto", "cpu", None, fp32)[0] is False
    assert fp8_matmul_choice("on", "cpu", None, fp32)[0] is True
    assert fp8_matmul_choice("off", "cuda", (9, 0), bf16)[0] is False
    assert fp8_matmul_choice("auto", "cuda", (8, 6), bf16)[0] is False  # Ampere: none
    assert fp8_matmul_choice("on", "cuda", (8, 6), bf16)[0] is True  # probed at load
    for cap, dt in (((8, 9), bf16), ((9, 0), fp16), ((10, 0), bf16)):
        assert fp8_matmul_choice("auto", "cuda", cap, dt)[0] is True
    assert fp8_matmul_choice("auto", "cuda", (9, 0), fp32)[0] is False
    with pytest.raises(ValueError, match="bf16 or fp16 pool"):
        fp8_matmul_choice("on", "cuda", (9, 0), fp32)
    with pytest.raises(ValueError, match="XDIT_FP8_COMPUTE must be one of auto, on, off"):
        fp8_matmul_choice("1", "cpu")
    # per layer: features not multiples of 16 upcast (decided at load, said in the text)
    w, b, x = flux_like(32, 24, 64)
    odd = FP8Linear(24, 64, bias=False)
    odd.weight = torch.nn.Parameter(torch.randn(64, 24).to(FP8), requires_grad=False)
    ok, _ = fp8_layer(torch.randn(64, 64), torch.zeros(64), fp32, matmul=False)
    info = set_fp8_compute(torch.nn.Sequential(odd, ok), "on", "cpu", fp32)
    assert (odd.fp8_matmul, ok.fp8_matmul) == (False, True)
    assert info["text"] == (f"{FP8_MATMUL_TEXT} in 1 of 2 layers, the rest (features not "
                            f"multiples of 16) upcast to fp32 per call")
    assert torch.equal(odd(x), F.linear(x, odd.weight.float()))
    assert set_fp8_compute(torch.nn.Sequential(odd, ok), "auto", "cpu", fp32)["text"] == \
        "fp8 weights, upcast to fp32 per call (no fp8 matmul on cpu by default)"
    assert set_fp8_compute(torch.nn.Linear(4, 4), "on", "cpu", fp32)["text"] is None


def test_fp8_matmul_never_syncs_with_the_host():
    """The fp8 forward, op by op under a dispatch recorder: no scalar read back
    (`_local_scalar_dense` / `item`), no data-dependent shape (`nonzero`), no copy to another
    device. A negative control shows the recorder does see a sync."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.name().split("::")[-1].split(".")[0]
            src = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            dst = kwargs.get("device")
            if name in ("_to_copy", "copy_") and dst is None and len(args) > 1 and \
                    isinstance(args[1], torch.Tensor):
                dst = args[1].device  # copy_(dst, src)
            cross = dst is not None and src is not None and torch.device(dst) != src
            self.ops.append((name, cross))
            return func(*args, **kwargs)

    def syncs(ops):
        return [n for n, cross in ops
                if n in ("_local_scalar_dense", "item", "nonzero") or cross]

    w, b, x = flux_like(64, 256, 768)
    for dtype in (torch.float32, torch.bfloat16):
        lin, _ = fp8_layer(w, b, dtype, matmul=True)
        with Recorder() as rec:
            lin(x.to(dtype).reshape(4, 16, 256))
        names = [n for n, _ in rec.ops]
        assert "_scaled_mm" in names, names
        assert syncs(rec.ops) == [], rec.ops
    with Recorder() as rec:  # negative control
        x.abs().max().item()
    assert "_local_scalar_dense" in syncs(rec.ops)


def _fp8_compute_run(monkeypatch, folder, mode, config, req):
    """One generation on a fresh fp8 pool launched with XDIT_FP8_COMPUTE=mode (the workers
    read their environment at launch): (latent, status, _scaled_mm calls per rank)."""
    monkeypatch.setenv("XDIT_FP8_COMPUTE", mode)
    pool = WorkerPool(folder, config, device="cpu", threads_per_rank=1, weights="fp8",
                      text_encoders="cpu", worker_hooks=[SCALED_MM_HOOK])
    try:
        res = pool.generate(req)
        st = pool.status()
    finally:
        pool.close()
    return res.samples, st, [r["hooks"][SCALED_MM_HOOK]["scaled_mm"] for r in res.stats]


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_fp8_compute_pool_stays_close_to_full_precision(arch, model_dir, oracle, monkeypatch):
    """Pools with fp8 weights forced to multiply in fp8 (XDIT_FP8_COMPUTE=on, as a GPU with
    fp8 tensor cores does by default) stay close to the full-precision pipeline, and
    _scaled_mm really ran on every rank; with off it never ran and the result is the upcast
    one (the quantized weights in fp32)."""
    folder = model_dir(arch)
    req = request(prompt=["an fp8 cat"])
    full = oracle(arch, req)
    on, st_on, calls_on = _fp8_compute_run(monkeypatch, folder, "on",
                                           ParallelConfig(ulysses=2), req)
    off, st_off, calls_off = _fp8_compute_run(monkeypatch, folder, "off", ParallelConfig(),
                                              req)
    p_on, p_off = psnr(on, full), psnr(off, full)
    print(f"{arch}: PSNR vs full precision, fp8 matmul {p_on:.1f} dB, fp8 upcast "
          f"{p_off:.1f} dB; fp8 matmul vs upcast {psnr(on, off):.1f} dB; _scaled_mm calls "
          f"per rank on {calls_on}, off {calls_off}")
    # every fp8 layer, every step (cfg 1: one model call a step), on each rank
    assert calls_on == [r["load"]["fp8_layers"] * req.steps for r in st_on["ranks"]], calls_on
    assert len(calls_on) == 2 and calls_on[0] > 0 and calls_off == [0]
    assert st_on["fp8_compute"] == FP8_MATMUL_TEXT
    assert all(r["fp8_compute"] == FP8_MATMUL_TEXT for r in st_on["ranks"])
    assert st_off["fp8_compute"] == "fp8 weights, upcast to fp32 per call (XDIT_FP8_COMPUTE=off)"
    assert p_on > COMPUTE_PSNR_FLOOR
    assert p_off > PSNR_FLOOR  # upcast: only the weights are quantized
    assert maxdiff(on, off) > 10 * TOL  # the activations really went through fp8


# ---- text encoders -------------------------------------------------------------------------
def test_text_encoder_placement_decision():
    from workers.loading.weights import TEXT_ENCODER_MARGIN as M
    from workers.loading.weights import text_encoder_device as place
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


def test_an_activation_is_quantised_once_for_every_matmul_that_reads_it(model_dir,
                                                                        monkeypatch):
    """fp8 matmul layers of one block that read the same input (q, k, v; a single block's
    attention and MLP input) share its per-row quantisation: one quantize_rows per distinct
    input tensor, fewer than the fp8 matmuls, and the output equals the unshared layers'
    exactly (the same quantisation)."""
    import diffusers

    from workers.loading import weights as W
    tr = diffusers.FluxTransformer2DModel.from_pretrained(
        str(model_dir("flux")), subfolder="transformer").eval()
    lists = ("transformer_blocks", "single_transformer_blocks")
    W.to_fp8(tr, lists)
    info = W.set_fp8_compute(tr, "on", "cpu", torch.float32)
    assert info["fp8_matmul_layers"] == info["fp8_layers"] > 0
    calls, inputs, quantised = [], {}, []
    for name, m in tr.named_modules():
        if isinstance(m, W.FP8Linear):
            block = ".".join(name.split(".")[:2])
            def seen(mod, args, b=block):  # returns None: the call's inputs unchanged
                calls.append(b)
                inputs.setdefault(b, []).append(args[0])
            m.register_forward_pre_hook(seen)
    real = W.quantize_rows
    monkeypatch.setattr(W, "quantize_rows", lambda x2: quantised.append(1) or real(x2))
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 24, 64, generator=g),
              encoder_hidden_states=torch.randn(1, 7, tr.config.joint_attention_dim, generator=g),
              pooled_projections=torch.randn(1, tr.config.pooled_projection_dim, generator=g),
              timestep=torch.tensor([0.7]), guidance=torch.tensor([3.5]),
              txt_ids=torch.zeros(7, 3), img_ids=torch.zeros(24, 3), return_dict=False)
    if not tr.config.guidance_embeds:
        kw.pop("guidance")
    with torch.no_grad():
        shared = tr(**kw)[0]
        distinct = sum(len({id(t) for t in ts}) for ts in inputs.values())
        n_calls, n_quantised = len(calls), len(quantised)
        for m in tr.modules():
            if isinstance(m, W.FP8Linear):
                m.shared = None
        unshared = tr(**kw)[0]
    print(f"fp8 matmuls {n_calls}, distinct inputs {distinct}, quantisations {n_quantised}")
    assert n_quantised == distinct < n_calls
    assert len(quantised) - n_quantised == n_calls  # unshared: one per matmul
    assert torch.equal(shared, unshared)


def test_compiled_quantisation_fuses_into_the_kernel_that_makes_its_input(model_dir):
    """Under `compile` (inductor, here its CPU backend) each activation's per-row
    quantisation is computed inside the kernel that produces the activation (the norm and
    modulation, the GELU, the q/k/v's shared input), not in a pass of its own: a compiled
    FLUX block with fp8 matmuls has as many kernels as the same block without them, but for
    one per double block (the attention output's quantisation: attention is an extern
    kernel, nothing to fuse into). The compiled output equals the eager fp8 block."""
    import re

    import diffusers
    from torch._inductor.utils import run_and_get_code

    from workers.loading import weights as W

    def kernels(fp8: bool) -> dict:
        tr = diffusers.FluxTransformer2DModel.from_pretrained(
            str(model_dir("flux")), subfolder="transformer").eval()
        if fp8:
            W.to_fp8(tr, BLOCKS)
            W.set_fp8_compute(tr, "on", "cpu", torch.float32)
        c = tr.config
        g = torch.Generator().manual_seed(0)
        width, tokens, text = c.num_attention_heads * c.attention_head_dim, 24, 7
        rope = tr.pos_embed(torch.zeros(tokens + text, 3))
        kw = dict(hidden_states=torch.randn(1, tokens, width, generator=g),
                  encoder_hidden_states=torch.randn(1, text, width, generator=g),
                  temb=torch.randn(1, width, generator=g), image_rotary_emb=rope)
        out = {}
        for name in BLOCKS:
            block = getattr(tr, name)[0]
            torch._dynamo.reset()
            with torch.no_grad():
                eager = block(**kw)
                compiled, code = run_and_get_code(torch.compile(block), **kw)
            for a, b in zip(eager, compiled):
                assert (a - b).abs().max() <= 1e-5, name
            src = "\n".join(code)
            out[name] = (len(re.findall(r"^cpp_fused_\w+ = ", src, re.M)),
                         src.count("_scaled_mm("))
        return out

    plain, fp8 = kernels(False), kernels(True)
    print(f"compiled kernels (fused, _scaled_mm) without fp8 {plain}, with fp8 {fp8}")
    assert all(plain[b][1] == 0 and fp8[b][1] > 0 for b in BLOCKS)  # fp8 matmuls ran
    assert fp8["transformer_blocks"][0] == plain["transformer_blocks"][0] + 1
    assert fp8["single_transformer_blocks"][0] == plain["single_transformer_blocks"][0]
