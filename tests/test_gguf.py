"""GGUF weights (ComfyUI-GGUF's single files): the pool's dequantisation against the gguf
package's numpy reference, the file reader, and GGUF files through the pool."""
from __future__ import annotations

import gguf  # a requirement: its numpy reference and writer are what the tests compare to
import numpy as np
import pytest
import torch

from workers.loading import gguf_quant as gq

_K_SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fp16 scales in a block


def _blocks_for(qtype: str, shape, rng) -> np.ndarray:
    """Test bytes of a tensor: the gguf package's own quantisation where it has one, else
    random blocks whose fp16 scales are finite (every bit pattern of the rest is valid)."""
    T = gguf.GGMLQuantizationType[qtype]
    w = rng.standard_normal(shape).astype(np.float32)
    try:
        return np.ascontiguousarray(gguf.quants.quantize(w, T)).view(np.uint8)
    except NotImplementedError:
        pass
    _, block, size = gq.TYPES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block * size), dtype=np.uint8)
    b = raw.reshape(-1, size)
    for p in _K_SCALE_BYTES[qtype]:
        d = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16)
        b[:, p:p + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", list(gq.TYPES))
def test_dequantize_equals_gguf_numpy(qtype):
    """Every supported type, bit for bit against gguf.quants.dequantize, and its block
    layout (values, bytes) and type id as the gguf package defines them."""
    T = gguf.GGMLQuantizationType[qtype]
    tid, block, size = gq.TYPES[qtype]
    assert (T.value, gguf.GGML_QUANT_SIZES[T]) == (tid, (block, size))
    shape = (6, 512)
    raw = _blocks_for(qtype, shape, np.random.default_rng(tid))
    assert raw.nbytes == gq.tensor_bytes(qtype, shape)
    ref = gguf.quants.dequantize(raw, T).reshape(shape)
    got = gq.dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_dequantize_compiles_without_graph_breaks(qtype):
    """The dequantisation traces into one graph (fullgraph) and gives the same values."""
    shape = (4, 256)
    raw = torch.from_numpy(_blocks_for(qtype, shape, np.random.default_rng(1)))
    eager = gq.dequantize(raw, qtype, shape, torch.bfloat16)
    fn = torch.compile(lambda r: gq.dequantize(r, qtype, shape, torch.bfloat16),
                       fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(raw), eager)


# ---- files -----------------------------------------------------------------------------------
QTYPES = ["Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_K", "Q4_0", "Q4_1", "F16", "BF16"]
TOL = 1e-5


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory):
    """A tiny FLUX (256 wide, so the K types' 256-value rows fit its Linears) as a BFL single
    file, and GGUF copies of it in every type."""
    from comfyui_xdit.testmodels.gguf_file import write_gguf_file
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    from single_file_util import write_single_file
    d = tmp_path_factory.mktemp("gguf")
    folder = ensure_tiny_model("flux", d / "models", width=256)
    bfl = write_single_file(folder, "flux", d / "flux-tiny.safetensors", prefix=True)
    out = {"folder": folder, "bfl": bfl}
    for q in QTYPES:
        out[q] = write_gguf_file(bfl, d / f"flux-tiny-{q}.gguf", q)
    return out


def dequantized_file(path, out):
    """The GGUF file's tensors dequantised by the gguf package (numpy), as a safetensors
    single file under the same names: what the plain single-file loader reads."""
    from safetensors.torch import save_file
    r = gguf.GGUFReader(str(path))
    sd = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        field = r.get_field(f"comfy.gguf.orig_shape.{t.name}")  # a flattened tensor's shape
        shape = [int(field.parts[i][0]) for i in field.data] if field is not None else \
            [int(v) for v in reversed(t.shape.tolist())]
        sd[t.name] = torch.from_numpy(np.ascontiguousarray(w).reshape(shape).astype(np.float32))
    save_file(sd, str(out))
    return out


def _forward(tr, seed=0):
    torch.manual_seed(seed)
    c = tr.config
    with torch.no_grad():
        return tr(hidden_states=torch.randn(1, 16, c.in_channels),
                  encoder_hidden_states=torch.randn(1, 6, c.joint_attention_dim),
                  pooled_projections=torch.randn(1, c.pooled_projection_dim),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(6, 3), return_dict=False)[0]


def test_header_detection_and_original_shapes(flux_files, tmp_path):
    """A GGUF file's header gives the single file's own shapes (GGUF stores them reversed),
    so detection and the config derived from the shapes equal the safetensors file's; the
    architecture is ComfyUI-GGUF's name; a flattened tensor gets its recorded shape back."""
    from workers.loading.header import read_gguf, read_safetensors_header
    from workers.models.detect import single_file_config
    header, meta = read_gguf(flux_files["Q8_0"])
    st = {k[len("model.diffusion_model."):]: v
          for k, v in read_safetensors_header(flux_files["bfl"]).items()}
    assert {k: v["shape"] for k, v in header.items()} == {k: v["shape"] for k, v in st.items()}
    assert meta["general.architecture"] == "flux"
    kinds = {v["dtype"] for v in header.values()}
    assert kinds == {"Q8_0", "F32"}  # 1-D and tiny tensors stay F32, as the converter keeps
    a, b = single_file_config(flux_files["Q8_0"]), single_file_config(flux_files["bfl"])
    assert (a["arch"], a["naming"], a["config"]) == (b["arch"], b["naming"], b["config"])
    assert a["storage"]["dtype"] == "q8_0"
    # a 5-D tensor, flattened with its shape recorded (ComfyUI-GGUF's orig_shape)
    w = gguf.GGUFWriter(str(tmp_path / "nd.gguf"), arch="wan")
    w.add_array("comfy.gguf.orig_shape.patch.weight", [8, 4, 1, 2, 2])
    w.add_tensor("patch.weight", np.arange(128, dtype=np.float32).reshape(32, 4))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert read_gguf(tmp_path / "nd.gguf")[0]["patch.weight"]["shape"] == [8, 4, 1, 2, 2]


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_model_equals_dequantized_file(flux_files, tmp_path, qtype):
    """One process: the GGUF file loaded with its Linears kept in blocks (GGUFLinear,
    dequantised per call) equals the plain single-file loader on the gguf package's own
    dequantisation of the file, and weights="full" (dequantised at load) equals both. The
    blocks held are the file's quantised bytes, no more."""
    from workers.loading.gguf_load import GGUFLinear, gguf_bytes
    from workers.loading.header import read_gguf
    from workers.models import get_adapter
    ad, cpu = get_adapter("flux"), torch.device("cpu")
    path = flux_files[qtype]
    ref = ad.load(str(dequantized_file(path, tmp_path / "deq.safetensors")), cpu,
                  torch.float32, False).transformer
    m = ad.load(str(path), cpu, torch.float32, False)
    full = ad.load(str(path), cpu, torch.float32, False, weights="full").transformer
    layers = [x for x in m.transformer.modules() if isinstance(x, GGUFLinear)]
    header = read_gguf(path)[0]
    quantised = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()
                    if e["dtype"] not in ("F32", "F16", "BF16"))
    if qtype in ("F16", "BF16"):  # stored as floats: cast at load like any checkpoint
        assert not layers and m.load_report["weights"] == "full"
    else:
        assert layers and m.load_report["gguf_layers"] == len(layers)
        assert m.load_report["weights"] == "gguf"
        # every quantised tensor of this file is a Linear weight (whole or a qkv part)
        assert gguf_bytes(m.transformer) == quantised
        assert not any(isinstance(x, GGUFLinear) for x in full.modules())
    got, want = _forward(m.transformer), _forward(ref)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"{qtype}: {len(layers)} GGUF layers, {quantised} quantised bytes, rel L2 vs "
          f"numpy-dequantised file {rel:.1e}")
    assert (got - want).abs().max().item() <= TOL
    assert (_forward(full) - want).abs().max().item() <= TOL
    # negative control: the unquantised model differs (the blocks are really used)
    base = ad.load(str(flux_files["bfl"]), cpu, torch.float32, False).transformer
    if qtype != "F16":
        assert (_forward(base) - want).abs().max().item() > 10 * TOL


def test_gguf_linear_compiles(flux_files):
    """A compiled block of the GGUF model (dequantise + matmul traced together) equals it."""
    from workers.models import get_adapter
    m = get_adapter("flux").load(str(flux_files["Q4_K"]), torch.device("cpu"), torch.float32,
                                 False).transformer
    want = _forward(m)
    blk = m.transformer_blocks[0]
    m.transformer_blocks[0] = torch.compile(blk, backend="aot_eager", fullgraph=True)
    assert (_forward(m) - want).abs().max().item() <= TOL


def test_lora_on_gguf_model(flux_files, tmp_path):
    """LoRA (the pool's manager, peft) on GGUF Linears adds to the dequantised output: equal
    to the same LoRA on the dequantised model."""
    from test_lora import make_peft_lora
    from workers.loading.lora import LoraManager
    from workers.models import get_adapter
    ad, cpu = get_adapter("flux"), torch.device("cpu")
    lora, _ = make_peft_lora("flux", flux_files["folder"], tmp_path / "lora", seed=7)
    outs = {}
    for weights in ("auto", "full"):
        tr = ad.load(str(flux_files["Q8_0"]), cpu, torch.float32, False,
                     weights=weights).transformer
        base = _forward(tr)
        mgr = LoraManager(ad)
        mgr.apply(tr, mgr.resolve(tr, [(str(lora), 0.8)]))
        outs[weights] = _forward(tr)
        assert (outs[weights] - base).abs().max().item() > 100 * TOL  # the LoRA acts
    assert (outs["auto"] - outs["full"]).abs().max().item() <= TOL


def test_tiny_model_cli_writes_gguf(tmp_path):
    import argparse

    from comfyui_xdit.testmodels.tiny_model import run_cli
    from workers.loading.header import read_gguf
    out = tmp_path / "f.gguf"
    args = argparse.Namespace(arch="flux", out=str(out), seed=0, depth=1, width=None, heads=4,
                              sd35=False, variant=None, gguf="q8_0")
    assert run_cli(args) == 0
    header, meta = read_gguf(out)
    assert meta["general.architecture"] == "flux"
    assert "Q8_0" in {e["dtype"] for e in header.values()}
    assert "transformer_blocks.0.attn.to_q.weight" in header  # diffusers names


# ---- pools -----------------------------------------------------------------------------------
def _pool_call(path, config, call, **opts):
    """One host-sampler call (ComfyUI's KSampler path) on a pool of `path`; (result, status)."""
    from comfyui_xdit import ParallelConfig, WorkerPool  # noqa: F401
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    with WorkerPool(str(path), config, device="cpu", threads_per_rank=1, **opts) as pool:
        got = PoolDenoiser(pool, config.with_world_size(config.product), "flux")(**call)
        st = pool.status()
    return got, st


def test_gguf_pools_equal_one_rank_and_the_dequantized_file(flux_files, tmp_path):
    """KSampler's call on the xDiT MODEL of a GGUF file: one rank equals the plain
    single-file pool on the numpy-dequantised file (<= 1e-5); Ulysses 2 and weight sharding
    over 2 ranks equal one rank (<= 1e-4). Under sharding each rank holds
    and reads about half of the GGUF blocks, together all of them once; the whole-load ranks
    hold all."""
    import diffusers

    from comfyui_xdit import ParallelConfig
    from test_model_calls import comfy_call
    path = flux_files["Q8_0"]
    tr = diffusers.FluxTransformer2DModel.from_pretrained(str(flux_files["folder"]),
                                                          subfolder="transformer")
    call = comfy_call("flux", tr, 1, 8, 6, seed=5)
    one, st1 = _pool_call(path, ParallelConfig(), call)
    plain, _ = _pool_call(dequantized_file(path, tmp_path / "deq.safetensors"),
                          ParallelConfig(), call)
    diffs = {"plain file": (one - plain).abs().max().item()}
    assert diffs["plain file"] <= TOL
    whole = st1["ranks"][0]["load"]
    assert whole["weights"] == "gguf" and whole["gguf_layers"] > 0
    runs = {"ulysses 2": (ParallelConfig(ulysses=2), {}),
            "sharded 2": (ParallelConfig(ulysses=2), {"shard_weights": True})}
    status = {}
    for name, (config, opts) in runs.items():
        got, status[name] = _pool_call(path, config, call, **opts)
        diffs[name] = (got - one).abs().max().item()
    print("GGUF Q8_0 pools, max |diff| vs 1 rank:", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert all(v <= 1e-4 for v in diffs.values()), diffs
    ranks = [r["load"] for r in status["sharded 2"]["ranks"]]
    assert all(r["loaded"] == "shards only" and r["gguf_layers"] == whole["gguf_layers"]
               for r in ranks)
    held = [r["transformer_bytes"] for r in ranks]
    reads = [r["bytes_read"] for r in ranks]
    print(f"sharded: held {held} B, read {reads} B; whole load held "
          f"{whole['transformer_bytes']} B, read {whole['bytes_read']} B")
    assert sum(reads) == whole["bytes_read"]  # every byte once
    assert max(held) <= 0.5 * whole["transformer_bytes"] * 1.1
    assert max(reads) <= 0.5 * whole["bytes_read"] * 1.1
    assert all(r["load"]["bytes_read"] == whole["bytes_read"]  # negative control
               for r in status["ulysses 2"]["ranks"])


def test_gguf_pipefusion_stages(flux_files):
    """PipeFusion 2 on a GGUF file (each stage its own blocks' GGUF bytes; every step in
    warmup) equals one rank's sampling."""
    from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool
    from test_conditioning import encode
    common = dict(seed=5, steps=2, height=64, width=96, max_sequence_length=12)
    pos = encode("flux", str(flux_files["folder"]), "a red cube", 12)
    req = GenerationRequest(prompt=[], positive=pos, guidance=4.0, **common)
    out = {}
    for name, config in (("one", ParallelConfig()),
                         ("pipefusion", ParallelConfig(pipefusion=2, warmup_steps=2))):
        with WorkerPool(str(flux_files["Q8_0"]), config, device="cpu",
                        threads_per_rank=1) as pool:
            out[name] = pool.generate(req).samples
            ranks = pool.status()["ranks"]
    layers = [r["load"]["gguf_layers"] for r in ranks]
    print(f"PipeFusion GGUF layers per stage {layers}, max |diff| "
          f"{(out['pipefusion'] - out['one']).abs().max().item():.1e}")
    assert all(n > 0 for n in layers)
    assert (out["pipefusion"] - out["one"]).abs().max().item() <= 1e-4


# ---- host: discovery and the memory plan -----------------------------------------------------
def test_loader_lists_gguf_files_and_the_plan_counts_their_bytes(flux_files, tmp_path):
    """.gguf files in models/unet and models/diffusion_models (ComfyUI's one
    "diffusion_models" kind) are listed and resolved; the model info names the GGUF type and
    the memory plan counts the file's bytes per weight value for its block Linears (Q8_0:
    34 bytes per 32 values, Q4_K: 144 per 256), less than the bf16 file's."""
    import shutil

    from comfyui_xdit import ParallelConfig
    from comfyui_xdit.nodes.discovery import discover_single_files, resolve_model
    from comfyui_xdit.planning import memory_arithmetic as arith
    from comfyui_xdit.planning.config import EngineOptions
    from comfyui_xdit.planning.model_facts import model_facts
    from comfyui_xdit.planning.model_info import read_model_info
    unet, dm = tmp_path / "unet", tmp_path / "diffusion_models"
    for d, q in ((unet, "Q8_0"), (dm, "Q4_K")):
        d.mkdir()
        shutil.copy(flux_files[q], d / f"tiny-{q}.gguf")
    (dm / "notes.txt").write_text("not a model")
    roots = {"diffusion_models": [str(unet), str(dm)]}
    names = discover_single_files(roots)
    assert names == ["diffusion_models/tiny-Q4_K.gguf", "diffusion_models/tiny-Q8_0.gguf"]
    assert resolve_model(names[1], [], roots) == str(unet / "tiny-Q8_0.gguf")
    assert read_model_info(flux_files["Q8_0"]).storage == "q8_0"
    engine = EngineOptions(device="cuda", dtype="bf16", weights="auto")
    weights = {}
    for kind, bpv in (("bfl", 0.0), ("Q8_0", 34 / 32), ("Q4_K", 144 / 256)):
        facts = model_facts(str(flux_files[kind]))
        assert facts.gguf_bytes_per_value == pytest.approx(bpv)
        weights[kind] = arith.plan(facts, ParallelConfig(), engine).ranks[0].weights
    full = arith.plan(model_facts(str(flux_files["Q8_0"])), ParallelConfig(),
                      EngineOptions(device="cuda", dtype="bf16", weights="full"))
    print("planned weight bytes:", weights)
    assert weights["Q4_K"] < weights["Q8_0"] < weights["bfl"] == full.ranks[0].weights


# ---- every family ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["flux2", "sd3", "chroma", "qwen_image", "wan",
                                  "hunyuan_video15", "z_image"])
def test_every_family_loads_its_gguf_file(model_dir, tmp_path, arch):
    """Each family's tiny transformer as a Q8_0 GGUF file (ComfyUI naming where the tests
    have its converter, else diffusers names): loaded with its Linears in GGUF blocks, every
    weight dequantised equals the dequantise-at-load model's (weights="full"), which equals the
    plain loader on the gguf package's dequantisation of the file."""
    from comfyui_xdit.testmodels.gguf_file import write_gguf_file
    from single_file_util import write_single_file
    from workers.loading.gguf_load import GGUFLinear
    from workers.models import get_adapter
    folder = model_dir(arch)
    naming = "bfl" if arch in ("flux2", "sd3", "wan") else "diffusers"
    src = write_single_file(folder, arch, tmp_path / f"{arch}.safetensors", naming=naming)
    path = write_gguf_file(src, tmp_path / f"{arch}-Q8_0.gguf", "Q8_0")
    ad, cpu = get_adapter(arch), torch.device("cpu")
    m = ad.load(str(path), cpu, torch.float32, False).transformer
    full = ad.load(str(path), cpu, torch.float32, False, weights="full").transformer
    plain = ad.load(str(dequantized_file(path, tmp_path / "deq.safetensors")), cpu,
                    torch.float32, False).transformer
    layers = {n: x for n, x in m.named_modules() if isinstance(x, GGUFLinear)}
    assert layers, arch
    got = {k: v for k, v in m.state_dict().items()}
    for n, lin in layers.items():
        got[n + ".weight"] = lin.dequantized(torch.float32)
    want, ref = full.state_dict(), plain.state_dict()
    assert set(got) == set(want) == set(ref)
    bad = [k for k in want if not (torch.equal(got[k], want[k]) and torch.equal(want[k], ref[k]))]
    print(f"{arch} ({naming} names): {len(layers)} GGUF Linears of {len(want)} tensors")
    assert not bad, bad[:3]


def test_weights_fp8_on_a_gguf_file(flux_files):
    """weights="fp8" dequantises a GGUF file and stores its block Linears in fp8 as for any
    checkpoint: no GGUF layer left, fp8 layers as many as the plain file gives, and the
    output close to the dequantised model's (fp8's own rounding)."""
    from workers.loading.gguf_load import GGUFLinear
    from workers.loading.weights import FP8Linear
    from workers.models import get_adapter
    ad, cpu = get_adapter("flux"), torch.device("cpu")
    m = ad.load(str(flux_files["Q8_0"]), cpu, torch.float32, False, weights="fp8")
    plain = ad.load(str(flux_files["bfl"]), cpu, torch.float32, False, weights="fp8")
    full = ad.load(str(flux_files["Q8_0"]), cpu, torch.float32, False, weights="full")
    n8 = sum(isinstance(x, FP8Linear) for x in m.transformer.modules())
    assert not any(isinstance(x, GGUFLinear) for x in m.transformer.modules())
    assert n8 == m.load_report["fp8_layers"] == plain.load_report["fp8_layers"] > 0
    got, want = _forward(m.transformer), _forward(full.transformer)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"GGUF Q8_0 -> fp8: {n8} fp8 layers, rel L2 vs dequantised {rel:.1e}")
    assert rel < 0.05
