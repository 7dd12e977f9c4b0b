"""Shard-only loading from single files and fp8 checkpoints (workers/loading/shards.py `load_shards`
with `single_file.row_map`).

* The row map (diffusers name -> row ranges of the file's tensors) reproduces the whole-load
  conversion exactly, for FLUX and SD3 BFL files: every diffusers tensor assembled from its
  mapped rows (in any chunking: FSDP's two halves) equals `to_diffusers_state`'s tensor.
  Negative control: a map with one segment moved does not.
* A 2-rank sharded pool on a BFL single file (FLUX: fp32, bf16, fp8 and scaled-fp8 storage;
  SD3: fp32, scaled fp8) reads per rank about half of the file's bytes, together each byte once (the
  per-tensor scales and SD3's positional-table buffer whole on each rank); negative control:
  an unsharded pool reads all of it on every rank. A host-sampler call's result equals the
  whole-load pool's (unsharded, same file) <= 1e-4, and for the fp32 files the
  diffusers transformer's; fp8 weights stay fp8 on the sharded ranks (as many FP8Linear layers as the
  whole load).
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool

TOL = 1e-4


def _ck_and_sf(path):
    from workers.models.detect import single_file_config
    from workers.loading.weights import Checkpoint
    return Checkpoint.open([str(path)]), single_file_config(str(path))


def _assemble(ck, shape, segs, r0, r1):
    from workers.loading.shards import RowSource
    src = RowSource(ck, {"x": (shape, segs, None)})
    return src.read("x", r0, r1)


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_row_map_equals_whole_conversion(model_dir, tmp_path, arch):
    from single_file_util import write_single_file
    from workers.loading.single_file import read_transformer_state, row_map, to_diffusers_state
    from workers.loading.shards import chunk_rows

    path = write_single_file(model_dir(arch), arch, tmp_path / f"{arch}.safetensors")
    ck, sf = _ck_and_sf(path)
    whole = to_diffusers_state(arch, sf["naming"], read_transformer_state(str(path), sf["prefix"]),
                               sf["config"])
    with ck:
        table = row_map(ck, sf)
        assert set(table) == set(whole)
        fused = 0
        for name, (shape, segs, _) in table.items():
            want = whole[name]
            assert list(want.shape) == list(shape), name
            if want.dim() == 0:
                continue
            fused += any(ck.shape(k)[0] != want.shape[0] for k, _, _ in segs)
            for world in (1, 2):
                parts = [_assemble(ck, shape, segs, *chunk_rows(shape[0], world, r))
                         for r in range(world)]
                assert torch.equal(torch.cat(parts), want), (name, world)
        assert fused > 0  # the fused qkv (and FLUX's linear1) parts were among them
        # negative control: one fused part's rows shifted by one -> not the conversion
        name = next(n for n, (s, segs, _) in table.items() if ck.shape(segs[0][0])[0] > s[0])
        shape, segs, _ = table[name]
        k, a, b = segs[0]
        shift = 1 if a == 0 else -1
        bad = _assemble(ck, shape, [(k, a + shift, b + shift)], 0, shape[0])
        assert not torch.equal(bad, whole[name])


def _file_bytes(path) -> tuple:
    """(bytes of the transformer's tensors, bytes of scale_weight tensors) in the file."""
    from workers.loading.weights import Checkpoint
    with Checkpoint.open([str(path)]) as ck:
        size = {k: int(e["data_offsets"][1]) - int(e["data_offsets"][0])
                for k, (_, _, e) in ck.entries.items()}
    return sum(size.values()), sum(v for k, v in size.items() if k.endswith(".scale_weight"))


def _run(path, arch, call, shard, **opts):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    config = ParallelConfig(ulysses=2) if arch == "flux" else ParallelConfig(ring=2)
    with WorkerPool(str(path), config, device="cpu", threads_per_rank=1,
                    shard_weights=shard, **opts) as pool:
        got = PoolDenoiser(pool, config.with_world_size(2), arch)(**call)
        st = pool.status()
    return got, st


@pytest.mark.parametrize("arch,storage", [("flux", "fp32"), ("flux", "bf16"), ("flux", "fp8"),
                                          ("flux", "fp8-scaled"), ("sd3", "fp32"),
                                          ("sd3", "fp8-scaled")])
def test_single_file_sharded_reads_half(model_dir, tmp_path, arch, storage):
    import diffusers
    from safetensors.torch import load_file

    from comfyui_xdit.testmodels.tiny_model import write_fp8_file
    from single_file_util import write_single_file
    from test_model_calls import comfy_call, reference

    if arch == "flux":
        folder = model_dir(arch)
    else:  # a BFL SD3 file implies 64-wide heads (as released): the folder must have them too
        from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
        folder = ensure_tiny_model("sd3", tmp_path / "models", width=256, heads=4)
    state = None
    if storage == "bf16":
        state = {k: v.to(torch.bfloat16) for k, v in load_file(
            str(folder / "transformer" / "diffusion_pytorch_model.safetensors")).items()}
    path = write_single_file(folder, arch, tmp_path / f"{arch}-tiny.safetensors", state=state)
    if storage.startswith("fp8"):
        path = write_fp8_file(path, tmp_path / f"{arch}-tiny-{storage}.safetensors",
                              scaled=storage == "fp8-scaled")
    total, scale_bytes = _file_bytes(path)
    cls = diffusers.FluxTransformer2DModel if arch == "flux" else \
        diffusers.SD3Transformer2DModel
    tr = cls.from_pretrained(str(folder), subfolder="transformer",
                             torch_dtype=torch.float32).eval()
    call = comfy_call(arch, tr, 1, 8, 6, seed=5)
    got, st = _run(path, arch, call, True)
    want, plain = _run(path, arch, call, False)
    reads = [r["load"]["bytes_read"] for r in st["ranks"]]
    buf = {r["load"]["buffer_bytes_read"] for r in st["ranks"]}
    assert len(buf) == 1
    buf = buf.pop()  # SD3's positional table: a buffer, whole on every rank
    print(f"{arch} {storage}: file {total} B (scales {scale_bytes} B, buffers {buf} B), "
          f"sharded reads per rank {reads}, unsharded "
          f"{[r['load']['bytes_read'] for r in plain['ranks']]}")
    assert st["sharding"]["load"] == "shards only"
    assert all(r["load"]["loaded"] == "shards only" for r in st["ranks"])
    # every byte once; the scales and buffers on each rank (the scaled_fp8 marker is 0 bytes)
    assert sum(reads) == total + scale_bytes + buf
    assert max(reads) - buf <= (total - buf) / 2 + 0.05 * total
    assert all(r["load"]["bytes_read"] == total for r in plain["ranks"])  # negative control
    # fp8 weights kept in fp8 as the whole loader keeps them (FLUX: every block Linear; a BFL
    # SD3 file is dequantized before diffusers' converter: none)
    fp8_layers = {r["load"]["fp8_layers"] for r in st["ranks"] + plain["ranks"]}
    assert len(fp8_layers) == 1
    assert (fp8_layers.pop() > 0) == (arch == "flux" and storage.startswith("fp8"))
    diff = (got - want).abs().max().item()
    print(f"{arch} {storage}: shard-only vs unsharded whole load: max abs diff {diff:.2e}")
    assert diff <= TOL
    if storage == "fp32":  # the diffusers oracle of the same weights
        ref = reference(arch, tr, call["x"], call["timestep"], call["context"], call["y"],
                        call["guidance"])
        d = (got - ref).abs().max().item()
        print(f"{arch} {storage}: vs diffusers: max abs diff {d:.2e}")
        assert d <= TOL
