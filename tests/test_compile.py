"""`compile=True` (workers/runtime/compile.py): regional torch.compile of the transformer blocks.

A compiled pool gives the diffusers oracle's latents (fp32 on CPU, <= 1e-4) for FLUX on 2
Ulysses ranks (the sharded attention and its all-to-all run between compiled regions) and SD3
on 1 rank; it reports compiling while it compiles; other sizes and batches recompile a bounded
number of times and then reuse the dynamic graphs; LoRA loaded, re-weighted or removed after
compile gives the merged-weights oracle's result (no stale graph). PipeFusion is refused at
pool start with one message. Inductor compiles on the CPU here (gcc), as in CI.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, PoolError, WorkerPool

TOL = 1e-4


def request(h=128, w=96, msl=16, batch=1, seed=7, **kw):
    prompts = ["a photo of a red cat", "a dog on the grass", "blue sky"][:batch]
    return GenerationRequest(prompt=prompts, seed=seed, steps=2, height=h, width=w,
                             max_sequence_length=msl, cfg=kw.pop("cfg", 1.0), **kw)


def maxdiff(a, b):
    return (a - b).abs().max().item()


def compile_stats(result):
    return [s["compile"] for s in result.stats]


# ---- no pool -----------------------------------------------------------------------------------
def test_outside_runs_eagerly_between_compiled_regions():
    """What `outside` wraps is never traced: it runs eagerly on every call of the compiled
    function (traced, it would see `is_compiling()` True)."""
    from workers.runtime.compile import Compiler

    calls = []

    def collective(x):  # stands in for the all-to-all
        calls.append(torch.compiler.is_compiling())
        return x * 2

    collective.kernel_name = "k"
    wrapped = Compiler(True).outside(collective)
    assert wrapped.kernel_name == "k"  # attribute reads pass through to the wrapped object

    @torch.compile(backend="eager")
    def region(x):
        return wrapped(x + 1) - 1

    for i in range(3):
        assert torch.equal(region(torch.full((2,), float(i))), torch.full((2,), 2.0 * i + 1))
    assert calls == [False] * 3
    assert Compiler(False).outside(collective) is collective  # no wrapper without compile


def test_compile_ids_count_recompiles():
    from workers.runtime.compile import Compiler, _compile_id

    class Args:
        def __init__(self, cid):
            self.compile_id = cid
    assert _compile_id(Args("3/1")) == (3, 1)
    assert _compile_id(Args("[0/0]")) == (0, 0)
    c = Compiler(True)
    with c.job() as scope:
        for cid in ("0/0", "1/0", "0/1"):
            c._started(Args(cid))
            c._ended(Args(cid))
    assert (scope.stats["compiles"], scope.stats["recompiles"]) == (3, 1)
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger
    events = []
    with c.job(events.append) as scope:
        c._started(CallbackArgs(CallbackTrigger.CUDAGRAPH_RECORDING, "0/2"))  # not a compile
    assert (c.compiles, c.recompiles) == (3, 1)
    assert c.describe()["state"] == "compiled"
    # a CUDA graph capture is counted as such, per job, and said while it happens
    assert (scope.stats["graph_records"], c.describe()["graph_records"]) == (1, 1)
    assert events and events[0]["detail"] == "capturing CUDA graphs"


def test_cuda_graphs_only_on_cuda_and_switchable(monkeypatch):
    """`compile` captures CUDA graphs on CUDA (reduce-overhead regions) unless
    XDIT_CUDA_GRAPHS=0; a CPU pool compiles without them and adds no per-forward hook."""
    from workers.runtime.compile import Compiler, cuda_graphs_wanted

    assert cuda_graphs_wanted(True) and not cuda_graphs_wanted(False)
    monkeypatch.setenv("XDIT_CUDA_GRAPHS", "0")
    assert not cuda_graphs_wanted(True)
    monkeypatch.delenv("XDIT_CUDA_GRAPHS")
    modes = []

    class Block(torch.nn.Linear):
        def compile(self, **kw):
            modes.append(kw.get("mode"))

    class Tr(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList([Block(2, 2), Block(2, 2)])
    tr = Tr()
    c = Compiler(True)
    c.install(tr, ("transformer_blocks",))
    assert modes == [None, None] and not c.cuda_graphs
    assert not tr._forward_pre_hooks


def test_identical_blocks_compile_once():
    """Regional compile reuses one block's graphs for every identical block: a FLUX
    transformer with 4 double + 4 single blocks compiles as many frames as one with 2 + 2.
    (Not 1 + 1: the first single block gets a contiguous input, the others a strided one, so
    single blocks compile twice whatever their number.)"""
    import diffusers
    import torch._dynamo

    from workers.runtime.compile import Compiler

    def compiles(depth):
        torch._dynamo.reset()
        torch.manual_seed(0)
        tr = diffusers.FluxTransformer2DModel(
            num_layers=depth, num_single_layers=depth, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6)).eval()
        c = Compiler(True)
        c.install(tr, ("transformer_blocks", "single_transformer_blocks"), backend="eager")
        with torch.inference_mode(), c.job() as scope:
            tr(hidden_states=torch.randn(1, 16, 64), encoder_hidden_states=torch.randn(1, 4, 32),
               pooled_projections=torch.randn(1, 16), timestep=torch.ones(1),
               img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3))
        assert c.blocks == 2 * depth
        return scope.stats["compiles"]

    two, four = compiles(2), compiles(4)
    torch._dynamo.reset()
    assert two > 0 and four == two, (two, four)


def test_pipefusion_with_compile_is_refused_before_launch(model_dir):
    """One ConfigError on the host, nothing launched; the workers' own check (a pool
    started elsewhere, under torchrun) says the same."""
    from comfyui_xdit.planning.config import ConfigError
    from workers.runtime.compile import PIPEFUSION_REFUSED, check

    with WorkerPool(model_dir("flux"), ParallelConfig(pipefusion=2), device="cpu",
                    threads_per_rank=1, compile=True) as pool:
        with pytest.raises(ConfigError, match="compile is not supported with PipeFusion"):
            pool.generate(request(h=64, w=64, msl=8))
        assert not pool.is_running()
    with pytest.raises(ValueError) as e:
        check(True, 2)
    assert PIPEFUSION_REFUSED in str(e.value)
    check(True, 1)
    check(False, 2)


# ---- compiled pools ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_pool(model_dir):
    with WorkerPool(model_dir("flux"), ParallelConfig(ulysses=2), device="cpu",
                    threads_per_rank=1, compile=True) as pool:
        yield pool


def test_flux_ulysses2_compiled_matches_diffusers_and_reuses_graphs(flux_pool, oracle):
    pool = flux_pool
    events = []
    req = request()
    first = pool.generate(req, on_event=events.append)
    assert maxdiff(first.samples, oracle("flux", req)) <= TOL
    st = compile_stats(first)
    assert all(s["enabled"] and s["compiles"] > 0 for s in st), st
    compiling = [e for e in events if e.get("phase") == "compiling"]
    assert compiling and events.index(compiling[0]) < min(
        i for i, e in enumerate(events) if "step" in e), "compiling is reported before step 1"
    status = pool.status()
    assert status["compile"]["enabled"] and status["compile"]["state"] == "compiled"
    assert status["compile"]["blocks"] == 4  # 2 double + 2 single blocks of the tiny FLUX

    # another size, batch and text length: a bounded recompile, still exact
    req_b = request(h=144, w=112, msl=11, batch=3)
    second = pool.generate(req_b)
    assert maxdiff(second.samples, oracle("flux", req_b)) <= TOL
    rec = [s["recompiles"] for s in compile_stats(second)]
    first_compiles = [s["compiles"] for s in st]
    assert all(r <= c for r, c in zip(rec, first_compiles)), (rec, first_compiles)

    # a third size and batch > 1 runs on the dynamic graphs: nothing compiles
    req_c = request(h=96, w=160, msl=13, batch=2)
    third = pool.generate(req_c)
    assert [s["compiles"] for s in compile_stats(third)] == [0, 0], compile_stats(third)
    assert maxdiff(third.samples, oracle("flux", req_c)) <= TOL

    # the first job again: the cached graphs, the same latent
    again = pool.generate(req)
    assert [s["compiles"] for s in compile_stats(again)] == [0, 0]
    assert maxdiff(again.samples, first.samples) <= 1e-6


def test_lora_after_compile(flux_pool, oracle, model_dir, tmp_path):
    """LoRA loaded into compiled blocks, re-weighted, then removed: each job equals the oracle
    on a copy of the model with the LoRA merged into the weights at that strength."""
    from test_lora import make_peft_lora, merged_folder

    pool = flux_pool
    base_req = request(h=64, w=64, msl=8)
    base = pool.generate(base_req).samples
    (tmp_path / "lora").mkdir()
    path, pairs = make_peft_lora("flux", model_dir("flux"), tmp_path / "lora", seed=11)
    for strength in (1.0, 0.5):
        got = pool.generate(request(h=64, w=64, msl=8, loras=[(str(path), strength)]))
        merged = merged_folder(model_dir("flux"), tmp_path / f"merged{strength}",
                               [(pairs, strength)])
        want = oracle("flux", base_req, path=merged)
        assert maxdiff(got.samples, base) > 1e-3, "the LoRA changed nothing"
        assert maxdiff(got.samples, want) <= TOL, f"strength {strength}"
    off = pool.generate(base_req).samples
    assert maxdiff(off, base) <= 1e-6


def test_sd3_one_rank_compiled_matches_diffusers(model_dir, oracle):
    req = request(h=128, w=96, msl=16, cfg=2.5, negative_prompt="ugly")
    with WorkerPool(model_dir("sd3"), ParallelConfig(), device="cpu", threads_per_rank=1,
                    compile=True) as pool:
        res = pool.generate(req)
    assert all(s["compiles"] > 0 for s in compile_stats(res))
    assert maxdiff(res.samples, oracle("sd3", req)) <= TOL


def test_model_calls_report_compiling_and_match_diffusers(model_dir):
    """A host sampler's calls (the xDiT MODEL under KSampler) on a compiled pool: the first
    call reports compiling through the denoiser's `on_event` and counts its graphs; the same
    call again compiles nothing and reports nothing; both equal the diffusers transformer."""
    import diffusers

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from test_model_calls import comfy_call, reference

    folder = model_dir("sd3")
    tr = diffusers.SD3Transformer2DModel.from_pretrained(
        str(folder), subfolder="transformer", torch_dtype=torch.float32).eval()
    call = comfy_call("sd3", tr, 1, 8, 6, seed=3)
    want = reference("sd3", tr, call["x"], call["timestep"], call["context"], call["y"], None)
    config = ParallelConfig()
    with WorkerPool(folder, config, device="cpu", threads_per_rank=1, compile=True) as pool:
        events = []
        den = PoolDenoiser(pool, config.with_world_size(1), "sd3", on_event=events.append)
        first = den(**call)
        first_stats = dict(den.last_stats)
        n_first = len(events)
        again = den(**call)
    assert first_stats["compiles"] > 0 and n_first > 0
    assert all(e["phase"] == "compiling" for e in events[:n_first]), events
    assert den.last_stats["compiles"] == 0 and len(events) == n_first, events
    assert maxdiff(first, want) <= TOL and maxdiff(again, first) <= 1e-6


def test_two_transformers_register_the_compile_callbacks_once():
    """A model of two transformers (Wan 2.2's experts) installs both; dynamo's compile
    callbacks are registered once per worker, or every compile would count twice."""
    import torch
    from torch._dynamo.callback import callback_handler

    from workers.runtime.compile import Compiler

    class T(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    c = Compiler(True)
    starts = len(callback_handler.start_callbacks)
    ends = len(callback_handler.end_callbacks)
    for t in (T(), T()):
        c.install(t, ("blocks",), backend="eager")
    try:
        assert c.blocks == 2
        assert len(callback_handler.start_callbacks) - starts == 1
        assert len(callback_handler.end_callbacks) - ends == 1
    finally:
        callback_handler.remove_start_callback(c._started)
        callback_handler.remove_end_callback(c._ended)
