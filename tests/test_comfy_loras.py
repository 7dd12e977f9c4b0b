"""ComfyUI's LoRA loaders on the xDiT MODEL (comfyui_xdit/nodes/comfy_loras.py): the patches
ComfyUI's loaders hand the MODEL patcher's `add_patches` are recorded, turned into one LoRA
file per loader at sampling time and applied by the pool as adapters; a model call with them
equals the same call with the original LoRA file given to the pool as LoRA (xDiT) at
strengths 0.8 and -0.6, at 2 ranks under Ulysses 2 and CFG parallel; chained loaders add up;
a partial LoRA (one row range of a fused qkv) works; what the pool cannot apply is refused
in one line; switching never reads the base weights again.

ComfyUI is not installable in CI: its patches are built here as its loader builds them from
the same files (comfy/lora.py: a kohya file's BFL key as it is, a diffusers file's to_q /
to_k / to_v as row ranges of BFL's fused qkv / linear1, LoRA adapters with ComfyUI's
LoRAAdapter attributes: `name` "lora", `weights` (up, down, alpha, mid, dora_scale,
reshape)).
"""
from __future__ import annotations

import os
import uuid

import pytest
import torch
from safetensors.torch import save_file

from comfyui_xdit import ParallelConfig, WorkerPool
from comfyui_xdit.client.pool import PoolError
from comfyui_xdit.nodes import comfy_loras
from comfyui_xdit.nodes.model_calls import PoolDenoiser
from comfyui_xdit.planning.config import ConfigError

from test_lora import ALPHA, READS_HOOK, R, make_kohya_flux, make_peft_lora
from test_model_calls import comfy_call

TOL = 1e-5


class FakeLoRA:
    """What ComfyUI's LoRAAdapter carries (comfy/weight_adapter/lora.py)."""
    name = "lora"

    def __init__(self, up, down, alpha=None, mid=None, dora=None):
        self.weights = (up, down, alpha, mid, dora, None)


class FakeAdapter:  # ComfyUI's LoKr / LoHa adapters: another name, other weights
    def __init__(self, name):
        self.name = name
        self.weights = (torch.ones(2, 2),)


def kohya_patches(pairs, strength=1.0):
    """ComfyUI's patches from make_kohya_flux's file: its key maps to BFL's fused qkv."""
    (down, _), = {tuple(v[0].shape): v for v in pairs.values()}.values()
    up = torch.cat([pairs[f"transformer_blocks.0.attn.to_{n}"][1] for n in "qkv"])
    return {"diffusion_model.double_blocks.0.img_attn.qkv.weight": FakeLoRA(up, down, ALPHA)}


def diffusers_patches(pairs, hidden, alpha=ALPHA):
    """ComfyUI's patches from a diffusers FLUX LoRA (its Flux key map): to_q / to_k / to_v
    are row ranges of the fused qkv (double blocks) or linear1 (single blocks)."""
    out = {}
    for name, (a, b) in pairs.items():
        parts = name.split(".")
        i, leaf = parts[1], parts[-1] if parts[-1] != "0" else parts[-2]
        qkv = {"to_q": 0, "to_k": 1, "to_v": 2}
        if parts[0] == "transformer_blocks" and leaf in qkv:
            key = (f"diffusion_model.double_blocks.{i}.img_attn.qkv.weight",
                   (0, qkv[leaf] * hidden, hidden))
        elif parts[0] == "single_transformer_blocks" and leaf in qkv:
            key = (f"diffusion_model.single_blocks.{i}.linear1.weight",
                   (0, qkv[leaf] * hidden, hidden))
        elif parts[0] == "transformer_blocks" and leaf == "to_out":
            key = f"diffusion_model.double_blocks.{i}.img_attn.proj.weight"
        else:
            raise AssertionError(name)
        out[key] = FakeLoRA(b, a, alpha)
    return out


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    import diffusers
    root = tmp_path_factory.mktemp("comfy_loras")
    tr = diffusers.FluxTransformer2DModel.from_pretrained(model_dir("flux"),
                                                          subfolder="transformer")
    hidden = tr.config.num_attention_heads * tr.config.attention_head_dim
    single = tr.single_transformer_blocks[0]
    rows = {f"double_blocks.{i}.img_attn.qkv": 3 * hidden
            for i in range(len(tr.transformer_blocks))}
    rows.update({f"single_blocks.{i}.linear1": 3 * hidden + single.proj_mlp.out_features
                 for i in range(len(tr.single_transformer_blocks))})
    (root / "peft").mkdir()
    peft, peft_pairs = make_peft_lora("flux", model_dir("flux"), root / "peft", seed=21)
    kohya, kohya_pairs = make_kohya_flux(root / "kohya.safetensors", seed=4)
    # a partial LoRA: double block 0's to_q only (a third of the fused qkv's rows), in
    # diffusers' peft names without alpha (scale 1)
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(R, hidden, generator=g) * 0.1, torch.randn(hidden, R, generator=g) * 0.1
    partial = root / "partial.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a,
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b}, str(partial))
    return {"hidden": hidden, "rows": rows, "tr": tr,
            "peft": (str(peft), diffusers_patches(peft_pairs, hidden)),
            "kohya": (str(kohya), kohya_patches(kohya_pairs)),
            "partial": (str(partial), diffusers_patches(
                {"transformer_blocks.0.attn.to_q": (a, b)}, hidden, alpha=None))}


class _WithLoras:
    """The pool with LoRA (xDiT)'s list on every model call: the original files."""

    def __init__(self, pool, loras):
        self._pool, self.loras = pool, loras

    @property
    def launches(self):
        return self._pool.launches

    def model_call(self, *args, **kw):
        return self._pool.model_call(*args, loras=self.loras, **kw)


def _options(call, sources):
    opts = {"uuids": [uuid.uuid4(), uuid.uuid4()], "cond_or_uncond": [1, 0]}
    for s in sources:
        comfy_loras.add(opts, s)
    return dict(call, transformer_options=opts)


def _calls(pool, config, files, loaders, tmp_path, seed=0):
    """(ComfyUI loaders' patches through the MODEL's denoiser, the original files given to
    the pool as LoRA (xDiT), no LoRA) for one sampler call; `loaders` [(file, strength)]."""
    den = PoolDenoiser(pool, config, "flux")
    den.lora_rows = files["rows"]
    call = comfy_call("flux", files["tr"], 1, 8, 6, seed=seed)
    sources = [comfy_loras.record(files[n][1], s) for n, s in loaders]
    got = den(**_options(call, sources))
    orig = PoolDenoiser(_WithLoras(pool, [(files[n][0], s) for n, s in loaders]), config,
                        "flux")
    want = orig(**_options(call, []))
    base = den(**_options(call, []))
    return got, want, base


@pytest.fixture(autouse=True)
def _private_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(comfy_loras, "_FOLDER", str(tmp_path))


def _diff(a, b):
    return (a - b).abs().max().item()


CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=["ulysses2", "cfg-parallel"])
@pytest.mark.parametrize("strength", [0.8, -0.6])
def test_loader_patches_equal_the_file_as_pool_lora(pools, files, tmp_path, config, strength):
    pool = pools("flux", 2)
    config = config.with_world_size(2)
    for name in ("kohya", "peft"):
        got, want, base = _calls(pool, config, files, [(name, strength)], tmp_path)
        print(f"{name} {config.describe()} x{strength}: |patches - file| = "
              f"{_diff(got, want):.2e}, |patches - base| = {_diff(got, base):.2e}")
        assert _diff(got, base) > 1e-3  # the LoRA does something
        assert _diff(got, want) <= TOL


def test_chained_loaders_add_up_and_a_partial_lora_works(pools, files, tmp_path):
    pool = pools("flux", 2)
    config = ParallelConfig(ulysses=2).with_world_size(2)
    chain = [("kohya", 0.8), ("peft", -0.6), ("kohya", 0.5)]  # a file loaded twice adds up
    got, want, base = _calls(pool, config, files, chain, tmp_path, seed=1)
    assert _diff(got, want) <= TOL and _diff(got, base) > 1e-3
    one, _, _ = _calls(pool, config, files, [("kohya", 0.8), ("peft", -0.6)], tmp_path, seed=1)
    assert _diff(one, got) > 1e-4  # the third loader counts
    got, want, base = _calls(pool, config, files, [("partial", 0.8)], tmp_path, seed=2)
    assert _diff(got, want) <= TOL and _diff(got, base) > 1e-4
    # negative control: the partial LoRA's rows put at the wrong place (key's rows) differ
    wrong = {("diffusion_model.double_blocks.0.img_attn.qkv.weight",
              (0, files["hidden"], files["hidden"])):
             next(iter(files["partial"][1].values()))}
    den = PoolDenoiser(pool, config, "flux")
    den.lora_rows = files["rows"]
    call = comfy_call("flux", files["tr"], 1, 8, 6, seed=2)
    moved = den(**_options(call, [comfy_loras.record(wrong, 0.8)]))
    assert _diff(moved, want) > 1e-4


def test_what_the_pool_cannot_apply_is_refused_in_one_line():
    up, down = torch.ones(6, 2), torch.ones(2, 4)
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    cases = [({key: ("diff", (torch.ones(6, 4),))}, 1.0, 1.0, "diff patch (a model merge)"),
             ({key: (torch.ones(6, 4),)}, 1.0, 1.0, "model merge"),
             ({key: FakeLoRA(up, down)}, 0.5, 0.5, "strength_model 0.5"),
             ({key: FakeAdapter("lokr")}, 1.0, 1.0, "LoKr adapter"),
             ({key: FakeAdapter("loha")}, 1.0, 1.0, "LoHa adapter"),
             ({key: FakeLoRA(up, down, dora=torch.ones(6))}, 1.0, 1.0, "DoRA"),
             ({(key, (0, 0, 6), lambda w: w): FakeLoRA(up, down)}, 1.0, 1.0, "function")]
    for patches, sp, sm, words in cases:
        with pytest.raises(ConfigError) as e:
            comfy_loras.record(patches, sp, sm)
        msg = str(e.value)
        assert words in msg and key in msg and "\n" not in msg, msg
    # the same LoRA on its own is taken (the refusals above are about what was added)
    assert comfy_loras.record({key: FakeLoRA(up, down)}, 0.8).layers


def test_a_layer_the_model_lacks_fails_the_call_and_the_pool_stays_warm(pools, files):
    pool = pools("flux", 2)
    pids = pool.worker_pids()
    config = ParallelConfig(ulysses=2).with_world_size(2)
    den = PoolDenoiser(pool, config, "flux")
    call = comfy_call("flux", files["tr"], 1, 8, 6, seed=3)
    bad = {"diffusion_model.double_blocks.9.img_attn.qkv.weight":
           FakeLoRA(torch.ones(3 * files["hidden"], 2), torch.ones(2, files["hidden"]))}
    with pytest.raises(PoolError, match="double_blocks.9|transformer_blocks.9"):
        den(**_options(call, [comfy_loras.record(bad, 1.0)]))
    got = den(**_options(call, []))
    want = PoolDenoiser(pool, config, "flux")(**_options(call, []))
    assert _diff(got, want) == 0 and pool.worker_pids() == pids


def test_switching_loaders_never_reads_the_base_weights_again(model_dir, files, tmp_path):
    """Calls switch between loaders' LoRAs, strengths and none: the workers open the base
    weight file once (at launch), each written LoRA file once per rank, and a call without
    LoRA returns the base output exactly."""
    weights = os.path.realpath(os.path.join(model_dir("flux"), "transformer"))
    config = ParallelConfig(cfg_parallel=True).with_world_size(2)
    with WorkerPool(model_dir("flux"), config, device="cpu", threads_per_rank=1,
                    worker_hooks=[READS_HOOK]) as pool:
        den = PoolDenoiser(pool, config, "flux")
        den.lora_rows = files["rows"]
        call = comfy_call("flux", files["tr"], 1, 8, 6, seed=4)
        base = den(**_options(call, []))
        kohya = comfy_loras.record(files["kohya"][1], 0.8)
        peft = comfy_loras.record(files["peft"][1], -0.6)
        outs = []
        for sources in ([kohya], [peft], [kohya, peft], [], [kohya],
                        [comfy_loras.record(files["kohya"][1], -0.6)]):
            outs.append(den(**_options(call, sources)))
            reads = [r[READS_HOOK] for r in den.last_stats["hooks"]]
            for rank in reads:
                base_reads = {f: n for f, n in rank.items() if f.startswith(weights + os.sep)}
                assert base_reads and set(base_reads.values()) == {1}, base_reads
                lora_reads = [n for f, n in rank.items() if "comfy-lora-" in f]
                assert len(lora_reads) <= 2, rank  # two distinct LoRAs so far
        assert len(os.listdir(tmp_path)) == 2  # one file per distinct LoRA, reused
        assert torch.equal(outs[3], base)  # none: exactly the base model
        assert torch.equal(outs[0], outs[4])  # the same loader again: the same output
        assert _diff(outs[0], outs[5]) > 1e-4  # another strength of the same file


def comfy_flux_key_map(tr) -> dict:
    """What ComfyUI's Flux key map (comfy.lora.model_lora_keys_unet, comfy.utils.
    flux_to_diffusers) gives a FLUX model for diffusers LoRA names: BFL weights, row
    ranges of the fused ones."""
    h = tr.config.num_attention_heads * tr.config.attention_head_dim
    mlp = tr.single_transformer_blocks[0].proj_mlp.out_features
    out = {}
    for i in range(len(tr.transformer_blocks)):
        qkv = f"diffusion_model.double_blocks.{i}.img_attn.qkv.weight"
        for j, n in enumerate(("to_q", "to_k", "to_v")):
            out[f"transformer.transformer_blocks.{i}.attn.{n}"] = (qkv, (0, j * h, h))
        out[f"transformer.transformer_blocks.{i}.attn.to_out.0"] = \
            f"diffusion_model.double_blocks.{i}.img_attn.proj.weight"
    for i in range(len(tr.single_transformer_blocks)):
        lin = f"diffusion_model.single_blocks.{i}.linear1.weight"
        for j, n in enumerate(("attn.to_q", "attn.to_k", "attn.to_v")):
            out[f"transformer.single_transformer_blocks.{i}.{n}"] = (lin, (0, j * h, h))
        out[f"transformer.single_transformer_blocks.{i}.proj_mlp"] = (lin, (0, 3 * h, mlp))
    return out


def test_comfyuis_key_map_renames_to_the_pools_names(pools, model_dir, files, tmp_path):
    """On a diffusers folder, ComfyUI's map names BFL weights: the MODEL's state dict names
    them too (so kohya's BFL files map), with their rows, and a LoRA on them is written in
    the pool's own names (each of to_q / to_k / to_v its rows of the fused qkv's up), equal
    to the original file; without the map's parts the workers convert it, equally."""
    from safetensors import safe_open
    from comfyui_xdit.bridge import worker_module
    shapes = worker_module("loading.comfy_lora").weight_shapes(model_dir("flux"))
    assert "transformer_blocks.0.attn.to_q" in shapes and \
        not any(k.endswith(".weight") for k in shapes)
    weights, rows, parts = comfy_loras.names_from_key_map(comfy_flux_key_map(files["tr"]),
                                                          shapes)
    assert "double_blocks.0.img_attn.qkv" in weights and rows == {**rows, **files["rows"]}
    assert [p[0] for p in parts["double_blocks.0.img_attn.qkv"]] == \
        [f"transformer_blocks.0.attn.to_{n}" for n in "qkv"]
    source = comfy_loras.record(files["peft"][1], 0.8)
    path = comfy_loras.write(source, rows, str(tmp_path), parts)
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    assert "transformer_blocks.0.attn.to_q.lora_up.weight" in keys
    assert not any("double_blocks" in k or "single_blocks" in k for k in keys), keys
    pool = pools("flux", 2)
    config = ParallelConfig(ulysses=2).with_world_size(2)
    call = comfy_call("flux", files["tr"], 1, 8, 6, seed=6)
    den = PoolDenoiser(pool, config, "flux")
    den.lora_rows, den.lora_parts = rows, parts
    got = den(**_options(call, [comfy_loras.record(files["peft"][1], 0.8)]))
    want = PoolDenoiser(_WithLoras(pool, [(files["peft"][0], 0.8)]), config, "flux")(
        **_options(call, []))
    base = den(**_options(call, []))
    assert _diff(got, want) <= TOL and _diff(got, base) > 1e-3


def test_a_single_files_own_names_sd3(model_dir, tmp_path):
    """An SD3 single file in ComfyUI's MMDiT names (under a checkpoint's prefix): ComfyUI
    maps a diffusers LoRA's to_q / to_k / to_v onto the file's fused qkv by row ranges and
    to_out.0 onto its proj; the workers find those rows with the file's own row map (SD3's
    converter needs the whole model, so it cannot run on the LoRA's layers alone) and the
    call equals the original file given to the pool, under CFG parallel at 2 ranks."""
    import diffusers
    from comfyui_xdit.bridge import worker_module
    from single_file_util import write_single_file

    single = write_single_file(model_dir("sd3"), "sd3", tmp_path / "sd3.safetensors",
                               prefix=True)
    tr = diffusers.SD3Transformer2DModel.from_pretrained(model_dir("sd3"),
                                                         subfolder="transformer")
    h = tr.config.num_attention_heads * tr.config.attention_head_dim
    (tmp_path / "lora").mkdir()
    lora, pairs = make_peft_lora("sd3", model_dir("sd3"), tmp_path / "lora", seed=31)
    patches = {}
    for name, (a, b) in pairs.items():
        i, leaf = name.split(".")[1], name.split(".")[3]
        if leaf == "to_out":
            key = f"diffusion_model.joint_blocks.{i}.x_block.attn.proj.weight"
        else:
            key = (f"diffusion_model.joint_blocks.{i}.x_block.attn.qkv.weight",
                   (0, ("to_q", "to_k", "to_v").index(leaf) * h, h))
        patches[key] = FakeLoRA(b, a, ALPHA)
    shapes = worker_module("loading.comfy_lora").weight_shapes(single)
    assert "joint_blocks.0.x_block.attn.qkv" in shapes
    _, rows, parts = comfy_loras.names_from_key_map({}, shapes)
    config = ParallelConfig(cfg_parallel=True).with_world_size(2)
    with WorkerPool(single, config, device="cpu", threads_per_rank=1) as pool:
        call = comfy_call("sd3", tr, 1, 8, 6, seed=8)
        for strength in (0.8, -0.6):
            den = PoolDenoiser(pool, config, "sd3")
            den.lora_rows, den.lora_parts = rows, parts
            got = den(**_options(call, [comfy_loras.record(patches, strength)]))
            want = PoolDenoiser(_WithLoras(pool, [(str(lora), strength)]), config, "sd3")(
                **_options(call, []))
            base = den(**_options(call, []))
            print(f"sd3 single file x{strength}: |patches - file| = {_diff(got, want):.2e}, "
                  f"|patches - base| = {_diff(got, base):.2e}")
            assert _diff(got, want) <= TOL and _diff(got, base) > 1e-3
