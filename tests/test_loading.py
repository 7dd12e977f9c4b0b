"""Loading straight to the device: the meta-built transformer gets exactly diffusers'
weights, each tensor is read once (a PipeFusion stage reads only its own), and no full host
copy is made (peak RSS measured in a fresh process, with a full-copy control that the same
measurement catches)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _equal_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("arch", ["flux", "sd3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folder_load_equals_from_pretrained(model_dir, arch, dtype):
    import diffusers

    from workers.models import get_adapter
    folder = model_dir(arch)
    ad = get_adapter(arch)
    m = ad.load(str(folder), torch.device("cpu"), dtype, False)
    want = getattr(diffusers, ad.transformer_class).from_pretrained(
        str(folder), subfolder="transformer", torch_dtype=dtype)
    _equal_state(m.transformer, want)
    n = len(want.state_dict())
    size = (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    rep = m.load_report
    assert rep["tensors_read"] == n  # each tensor read once
    assert size - 100_000 < rep["bytes_read"] < size  # all the data, once (header aside)
    assert rep["weights"] == "full" and rep["fp8_layers"] == 0


def test_sharded_folder_and_pipefusion_stages(model_dir, tmp_path):
    """A sharded checkpoint (index json) loads the same; each PipeFusion stage reads only its
    blocks' tensors (plus the shared layers), and together the stages hold every block."""
    import diffusers

    from workers.models import get_adapter
    from workers.loading.stages import load_stage_transformer
    src = model_dir("flux")
    ref = diffusers.FluxTransformer2DModel.from_pretrained(str(src), subfolder="transformer")
    shard = tmp_path / "sharded"
    shard.mkdir()
    for name in os.listdir(src):
        if name != "transformer":
            os.symlink(src / name, shard / name)
    ref.save_pretrained(shard / "transformer", max_shard_size="300KB")
    assert len(list((shard / "transformer").glob("*.safetensors"))) > 2
    assert list((shard / "transformer").glob("*.index.json"))
    ad = get_adapter("flux")
    _equal_state(ad.load(str(shard), torch.device("cpu"), torch.float32, False).transformer, ref)
    total = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    full = ref.state_dict()
    seen, read = {}, []
    for stage in range(2):
        tr, info, rep = load_stage_transformer(
            diffusers.FluxTransformer2DModel, str(shard / "transformer"), ad.block_lists,
            stage, 2, "balanced", device=torch.device("cpu"), dtype=torch.float32)
        sd = tr.state_dict()
        for k, v in sd.items():
            assert torch.equal(v, full[k]), k
            seen[k] = True
        read.append(rep.bytes_read)
        assert rep.bytes_read == sum(t.numel() * t.element_size() for t in sd.values())
    assert set(seen) == set(full)  # every tensor on some stage
    assert max(read) < 0.8 * total  # no stage read the whole model


# ---- host memory ---------------------------------------------------------------------------
MEASURE = r"""
import os, sys, json
sys.path.insert(0, sys.argv[1])
import torch, diffusers
torch.set_num_threads(1)
from workers.loading.meta import meta_transformer
from workers.loading.weights import load_folder
folder, how = sys.argv[2], sys.argv[3]
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
tr = meta_transformer(diffusers.FluxTransformer2DModel, folder)
lists = ("transformer_blocks", "single_transformer_blocks")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before = status("VmRSS:")
if how == "stream-meta":  # the GPU path's host cost: every tensor leaves the host
    load_folder(tr, lists, folder, "meta", torch.bfloat16, "auto")
elif how == "stream-cpu":
    load_folder(tr, lists, folder, "cpu", torch.float32, "auto")
elif how == "copy-meta":  # control: the whole file on the host first, then to the device
    from safetensors.torch import load
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors"), "rb") as f:
        sd = load(f.read())
    tr.load_state_dict({k: v.to("meta", torch.bfloat16) for k, v in sd.items()}, assign=True)
    del sd
print(json.dumps({"growth": status("VmHWM:") - before}))
"""


@pytest.fixture(scope="module")
def big_flux(tmp_path_factory):
    """A ~240 MB fp32 FLUX transformer folder (weights constant: only the bytes matter)."""
    import diffusers
    from safetensors.torch import save_file
    folder = tmp_path_factory.mktemp("big") / "transformer"
    folder.mkdir()
    cfg = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
               attention_head_dim=192, num_attention_heads=4, joint_attention_dim=96,
               pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 88, 88))
    with torch.device("meta"):
        tr = diffusers.FluxTransformer2DModel(**cfg)
    (folder / "config.json").write_text(json.dumps(
        dict(cfg, _class_name="FluxTransformer2DModel",
             axes_dims_rope=list(cfg["axes_dims_rope"]))))
    save_file({k: torch.full(v.shape, 0.01) for k, v in tr.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))
    return folder


def _growth(folder, how) -> int:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(ROOT), str(folder), how],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def test_no_host_copy_while_loading(big_flux):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    size = (big_flux / "diffusion_pytorch_model.safetensors").stat().st_size
    assert size > 200 * 2 ** 20
    stream = _growth(big_flux, "stream-meta")
    copy = _growth(big_flux, "copy-meta")
    cpu = _growth(big_flux, "stream-cpu")
    mb = 2 ** 20
    print(f"file {size / mb:.0f} MB; peak host RSS growth while loading: streamed to a device "
          f"{stream / mb:.0f} MB, full host copy (control) {copy / mb:.0f} MB, streamed to "
          f"the CPU (the model itself) {cpu / mb:.0f} MB")
    assert copy > 0.9 * size  # the measurement sees a full host copy
    assert stream < 0.25 * size  # the loader makes none: about one tensor at a time
    assert cpu < 1.5 * size  # on the CPU: the model, not the model plus a copy
