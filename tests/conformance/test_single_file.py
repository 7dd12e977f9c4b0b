"""Single files for every family: the family's test-model transformer written as ComfyUI's
single file (its builder's `single_file(state)`: the diffusers state dict in the names
ComfyUI's files use, written per key from that layout, independently of the loader's rules)
loads in a pool, and the pool's result equals the diffusers folder's pool at one rank
(<= 1e-4, fp32): the bare file (models/diffusion_models) at one rank for every family, and
once (the first family) the file under a full checkpoint's `model.diffusion_model.` prefix
at Ulysses 2 with its weights sharded, under the NCCL-rules emulation. Compared is the
xDiT MODEL's call (tests/family_requests.model_call_inputs: uncond and cond rows, inputs
from the registry alone), since a file holds neither text encoders nor a scheduler of its
own: the call is what ComfyUI's KSampler runs on such a file. Negative control: a file with one block tensor perturbed differs (> 1e-3).

A family whose files store no head count (the loader assumes the released head dim) declares
the test model a file can describe as `SINGLE_FILE_MODEL` (tiny-model knobs) in its builder;
it is compared with a folder pool of that model. Bad files, detection details, bf16 / fp8 /
GGUF files and a family's other layouts (pairs of experts, its own file variants) stay in the
family's and the format's own tests.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_xdit import ParallelConfig
from comfyui_xdit.testmodels import bfl_names
from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
from family_requests import families, model_call_inputs

from .cases import CASES, NCCL_RULES, TOL, maxdiff, params
from .test_model_call import call_model, one_rank

SHARDED = ParallelConfig(ulysses=2)


def _builder(arch: str):
    return importlib.import_module(f"comfyui_xdit.testmodels.{arch}")


@pytest.fixture(scope="session")
def file_models(tmp_path_factory, model_dir):
    """folder(arch): the test model a file of the family describes (its builder's
    SINGLE_FILE_MODEL, else the suite's shared one); write(arch, dest, prefix, perturb): its
    transformer as the family's single file."""
    cache = tmp_path_factory.mktemp("single_file_models")

    def folder(arch: str):
        knobs = getattr(_builder(arch), "SINGLE_FILE_MODEL", None)
        return ensure_tiny_model(arch, cache, **knobs) if knobs else model_dir(arch)

    def write(arch: str, dest, prefix: str = "", perturb: bool = False):
        state = {}
        for f in sorted((folder(arch) / "transformer").glob("*.safetensors")):
            state.update(load_file(str(f)))
        if perturb:  # one tensor of the first block list's first block
            first = families.family(arch).blocks.lists[0]
            key = next(k for k in sorted(state) if k.startswith(f"{first}.0.")
                       and k.endswith(".weight") and state[k].dim() == 2)
            g = torch.Generator().manual_seed(1)
            state[key] = state[key] + 0.05 * torch.randn(state[key].shape, generator=g)
        out = _builder(arch).single_file(state)
        save_file({prefix + k: v.contiguous() for k, v in out.items()}, str(dest))
        return dest

    return folder, write


def _reference(arch, family_pools, model_dir, folder):
    """(call, the folder pool's one-rank result): the suite's model-call reference where the
    file describes the shared test model, else a one-rank pool on the file's own folder."""
    if folder == model_dir(arch):
        return one_rank(arch, family_pools, model_dir)
    call = model_call_inputs(arch, folder)
    pool = family_pools.get(arch, ParallelConfig(), path=folder)
    return call, call_model(pool, ParallelConfig(), arch, call)


@pytest.mark.parametrize("arch", params("single_file"))
def test_single_file_equals_its_folder(arch, family_pools, model_dir, file_models, tmp_path):
    folder, write = file_models
    call, want = _reference(arch, family_pools, model_dir, folder(arch))
    bare = write(arch, tmp_path / f"{arch}.safetensors")
    pool = family_pools.get(arch, ParallelConfig(), path=bare)
    assert pool.model_info.kind == "file", pool.model_info
    d = maxdiff(call_model(pool, ParallelConfig(), arch, call), want)
    print(f"{arch} single file at 1 rank: {d:.2e} from the folder at 1 rank")
    assert d <= TOL, f"{arch} single file at 1 rank: {d:.3e} from its folder"


def _first_family() -> str:
    return next(a for a, c in CASES.items() if "single_file" not in c.exempt)


def test_sharded_checkpoint_file_equals_its_folder(family_pools, model_dir, file_models,
                                                   tmp_path):
    """Once (a pool launch per family would double the theme's time): the file under a
    checkpoint's prefix, its weights sharded at Ulysses 2 under the NCCL-rules emulation."""
    arch = _first_family()
    folder, write = file_models
    call, want = _reference(arch, family_pools, model_dir, folder(arch))
    ckpt = write(arch, tmp_path / f"{arch}-ckpt.safetensors", prefix=bfl_names.PREFIX)
    pool = family_pools.get(arch, SHARDED, path=ckpt, shard_weights=True,
                            worker_hooks=[NCCL_RULES])
    d = maxdiff(call_model(pool, SHARDED, arch, call), want)
    print(f"{arch} checkpoint-prefixed single file, sharded Ulysses 2: {d:.2e} from the "
          f"folder at 1 rank")
    assert d <= TOL, f"{arch} single file, sharded Ulysses 2: {d:.3e} from its folder"


def test_negative_control_a_perturbed_file_differs(family_pools, model_dir, file_models,
                                                   tmp_path):
    """The comparison above fails for a file whose weights are not the folder's: one block
    tensor perturbed (the first family that has single files)."""
    arch = _first_family()
    folder, write = file_models
    call, want = _reference(arch, family_pools, model_dir, folder(arch))
    bad = write(arch, tmp_path / f"{arch}-perturbed.safetensors", perturb=True)
    d = maxdiff(call_model(family_pools.get(arch, ParallelConfig(), path=bad),
                           ParallelConfig(), arch, call), want)
    print(f"{arch} single file with one tensor perturbed: {d:.2e} from its folder")
    assert d > 1e-3, f"{arch}: a perturbed file went unnoticed ({d:.2e})"
