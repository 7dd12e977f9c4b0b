"""LoRA for every family: a LoRA over every Linear layer of the family's transformer blocks
(each of its block lists, and the layers its builder adds as `LORA_LAYERS`), at strength
0.7 with alpha / r = 2, run on the suite's Ulysses 2 pool under the NCCL-rules emulation,
equals a copy of the model whose weights are merged (W + s * (alpha / r) * B A) at one rank
(<= 1e-4). Written in diffusers/PEFT's format (`transformer.<layer>.lora_A / lora_B`, alpha
in the file's adapter metadata) for every family, and in ComfyUI's
(`diffusion_model.<layer>.lora_down / lora_up / alpha`) where the family's builder lists it
in `LORA_FORMATS`. The same warm pool switches per job: at another strength the result
moves, and without the LoRA it gives back its base result exactly. Negative control: the
LoRA moves the result (> 1e-3).

LoRA files in a family's own formats (BFL, kohya, per expert) are the family's own tests.
"""
from __future__ import annotations

import importlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from comfyui_xdit import ParallelConfig, WorkerPool
from family_requests import families

from .cases import CASES, NCCL_RULES, TOL, maxdiff, params

R, ALPHA, STRENGTH = 4, 8.0, 0.7
FORMATS = ("peft", "comfy")


def _builder(arch: str):
    return importlib.import_module(f"comfyui_xdit.testmodels.{arch}")


def formats(arch: str) -> tuple:
    declared = tuple(getattr(_builder(arch), "LORA_FORMATS", ("peft",)))
    assert set(declared) <= set(FORMATS) and "peft" in declared, (arch, declared)
    return declared


def reached(arch: str) -> tuple:
    """The layer prefixes the LoRA covers: the family's block lists, and what its builder
    adds as `LORA_LAYERS` (layers outside the blocks its LoRAs reach, e.g. a text refiner)."""
    return tuple(f"{name}." for name in families.family(arch).blocks.lists) + \
        tuple(getattr(_builder(arch), "LORA_LAYERS", ()))


def block_linears(folder, arch: str) -> dict:
    """{layer: (file, in, out)} for every 2-D weight under `reached(arch)`."""
    lists = reached(arch)
    out = {}
    for f in sorted((folder / "transformer").glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.startswith(lists) and key.endswith(".weight"):
                    shape = st.get_slice(key).get_shape()
                    if len(shape) == 2:
                        out[key[: -len(".weight")]] = (f.name, shape[1], shape[0])
    return out


def make_lora(folder, arch: str, dest) -> tuple:
    """-> ({format: file}, {layer: (A, B)}): one random LoRA, written in every format the
    family reads."""
    layers = block_linears(folder, arch)
    lists = reached(arch)
    assert all(any(n.startswith(b) for n in layers) for b in lists), (arch, lists)
    g = torch.Generator().manual_seed(7)
    pairs = {n: (torch.randn(R, i, generator=g) * 0.1, torch.randn(o, R, generator=g) * 0.1)
             for n, (_, i, o) in layers.items()}
    files = {}
    peft = {}
    for n, (a, b) in pairs.items():
        peft[f"transformer.{n}.lora_A.weight"], peft[f"transformer.{n}.lora_B.weight"] = a, b
    meta = {"transformer.r": R, "transformer.lora_alpha": ALPHA,
            "transformer.target_modules": sorted(pairs)}
    files["peft"] = dest / "peft.safetensors"
    save_file(peft, str(files["peft"]),
              metadata={"lora_adapter_metadata": json.dumps(meta), "format": "pt"})
    if "comfy" in formats(arch):
        comfy = {}
        for n, (a, b) in pairs.items():
            comfy[f"diffusion_model.{n}.lora_down.weight"] = a
            comfy[f"diffusion_model.{n}.lora_up.weight"] = b
            comfy[f"diffusion_model.{n}.alpha"] = torch.tensor(ALPHA)
        files["comfy"] = dest / "comfy.safetensors"
        save_file(comfy, str(files["comfy"]))
    return files, pairs


def merged_folder(folder, arch: str, dest, pairs: dict, strength: float):
    """A copy of the model whose transformer weights are W + s * (alpha / r) * B @ A."""
    shutil.copytree(folder, dest)
    layers = block_linears(folder, arch)
    for name in {f for f, _, _ in layers.values()}:
        path = dest / "transformer" / name
        w = load_file(str(path))
        for n, (a, b) in pairs.items():
            if layers[n][0] == name:
                key = f"{n}.weight"
                w[key] = (w[key].float() + strength * (ALPHA / R) * (b @ a)).to(w[key].dtype)
        save_file(w, str(path), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("arch", params("lora"))
def test_lora_equals_merged_weights_and_switches_per_job(arch, family_pools, model_dir,
                                                         tmp_path):
    c = CASES[arch]
    folder = model_dir(arch)
    files, pairs = make_lora(folder, arch, tmp_path)
    req = c.request()
    with WorkerPool(merged_folder(folder, arch, tmp_path / "merged", pairs, STRENGTH),
                    ParallelConfig(), device="cpu", threads_per_rank=1) as merged:
        want = merged.generate(req).samples
    pool = family_pools.get(arch, ParallelConfig(ulysses=2), worker_hooks=[NCCL_RULES])
    base = pool.generate(req).samples
    moved = maxdiff(want, base)
    assert moved > 1e-3, f"{arch}: the LoRA changes nothing ({moved:.2e})"
    for fmt, path in files.items():
        got = pool.generate(c.request(loras=[(str(path), STRENGTH)])).samples
        d = maxdiff(got, want)
        print(f"{arch} LoRA ({fmt}) on Ulysses 2: {d:.2e} from the merged weights "
              f"(the LoRA moves it {moved:.2e})")
        assert d <= TOL, f"{arch} LoRA {fmt}: {d:.3e} from the merged weights"
    other = pool.generate(c.request(loras=[(str(files["peft"]), STRENGTH / 2)])).samples
    assert maxdiff(other, want) > 1e-3, f"{arch}: the strength is not read"
    again = pool.generate(req).samples
    assert torch.equal(again, base), f"{arch}: without the LoRA {maxdiff(again, base):.2e} " \
                                     f"from the base result"
