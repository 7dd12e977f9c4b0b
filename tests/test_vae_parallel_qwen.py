"""Patch-parallel decode of Qwen-Image's causal 3-D VAE (workers/parallel/vae_parallel.py,
AutoencoderKLQwenImage) equals the single-process `vae.decode(latents).sample` of a latent
[B, 16, T, h, w] (one frame, as Qwen-Image decodes, and two or three frames: the Wan-style
feature cache, see tests/test_vae_parallel_wan.py) within 1e-5 (fp32) / 1e-10 (fp64) at 2 and
4 gloo ranks, and each rank's decoder is given only its own band of latent rows, per frame.

One launcher process imports torch and diffusers once and forks the ranks of each launch
(gloo over a FileStore on loopback, one thread per rank), as tests/test_vae_parallel.py does:
2 ranks, 4 ranks, and 4 ranks again under the NCCL-rules emulation
(xdit_testhooks/nccl_rules.py, point-to-point order and collective order both checked), where
the halo exchange of the middle ranks (both neighbours, one batch per conv) must not deadlock.

VAEs: the tiny Qwen-Image folder's VAE (base_dim 8, dim_mult [1, 2, 2, 2], one resnet per
block), a wider random one with the released block structure (dim_mult [1, 2, 4, 4], two
resnets per block, temporal upsampling in the last two up blocks, base_dim 16 instead of 96),
and a float64 copy of each. Odd and even latent heights, batch 1 and 2, one-row bands at 4
ranks (the halo is the whole band), fewer rows than ranks (rank 0 decodes alone), two- and
three-frame latents. Negative controls switch off the halo exchange or the K/V gather and must
be far off.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5
TOL64 = 1e-10
NEGATIVE_MIN = 1e-2
LAUNCHES = {"2": (2, False), "4": (4, False), "4-nccl-rules": (4, True)}

# (vae, frames, latent height, latent width, batch); "...64": the same VAE in float64
CASES = [
    ("tiny", 1, 9, 6, 1),
    ("tiny", 1, 8, 10, 2),
    ("tiny", 1, 5, 7, 1),    # 4 ranks: bands 2,1,1,1
    ("tiny", 1, 3, 5, 1),    # 4 ranks: fewer rows than ranks -> rank 0 alone
    ("tiny", 2, 6, 4, 1),    # two frames (the feature cache)
    ("wide", 3, 7, 5, 1),    # three frames, temporal upsampling
    ("wide", 1, 11, 7, 1),
    ("wide", 1, 8, 6, 2),
    ("tiny64", 1, 7, 5, 2),
    ("wide64", 1, 9, 4, 1),
]
RULES_CASES = [("tiny", 1, 9, 6, 1), ("wide", 1, 8, 6, 2)]
NEGATIVE = [("tiny", 1, 9, 6, 1, "no_halo"), ("tiny", 1, 9, 6, 1, "local_attention"),
            ("wide", 1, 11, 7, 1, "no_halo"), ("wide", 1, 11, 7, 1, "local_attention")]

# Latent rows each rank's decoder gets, written out: balanced bands (the first h % n one
# row taller); rank 0 alone (the others nothing) below n rows.
BANDS = {
    (1, 9, 2): [5, 4], (1, 9, 4): [3, 2, 2, 2],
    (1, 8, 2): [4, 4], (1, 8, 4): [2, 2, 2, 2],
    (1, 5, 2): [3, 2], (1, 5, 4): [2, 1, 1, 1],
    (1, 3, 2): [2, 1], (1, 3, 4): [3, 0, 0, 0],
    (2, 6, 2): [3, 3], (2, 6, 4): [2, 2, 1, 1],
    (3, 7, 2): [4, 3], (3, 7, 4): [2, 2, 2, 1],
    (1, 11, 2): [6, 5], (1, 11, 4): [3, 3, 3, 2],
    (1, 7, 2): [4, 3], (1, 7, 4): [2, 2, 2, 1],
}


# ---------------------------------------------------------------------------------------
# rank side (forked from the launcher)

def _wide_vae():
    import torch
    from diffusers import AutoencoderKLQwenImage
    torch.manual_seed(4321)  # same weights on every rank
    return AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                  temperal_downsample=[False, True, True])


def _rank_main(rank, world, rules, store, tiny_dir, out):
    import copy
    import datetime

    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKLQwenImage

    from workers.parallel.vae_parallel import decode_parallel

    torch.set_num_threads(1)
    emulation = None
    if rules:
        from xdit_testhooks import nccl_rules
        emulation = nccl_rules.install()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    vaes = {"tiny": AutoencoderKLQwenImage.from_pretrained(tiny_dir, subfolder="vae"),
            "wide": _wide_vae()}
    for v in list(vaes.values()):
        v.eval().requires_grad_(False)
    for k in ("tiny", "wide"):
        vaes[k + "64"] = copy.deepcopy(vaes[k]).double()
    report = {"world": world, "rules": rules, "cases": [], "negative": []}

    decoded: list = []  # latent rows this rank's decoder is given, one entry per call
    for v in vaes.values():
        v.decoder.register_forward_pre_hook(lambda m, args: decoded.append(int(args[0].shape[3])))

    def compare(name, t, h, w, b, fault=None):
        g = torch.Generator().manual_seed(h * 1000 + w * 10 + b)
        dtype = torch.float64 if name.endswith("64") else torch.float32
        z = torch.randn(b, 16, t, h, w, generator=g, dtype=dtype) if rank == 0 else None
        decoded.clear()
        got = decode_parallel(vaes[name], z, fault=fault)
        rows = [None] * world
        dist.all_gather_object(rows, list(decoded))
        if rank != 0:
            assert got is None
            return
        want = vaes[name].decode(z).sample
        assert got.shape == want.shape, (got.shape, want.shape)
        report["negative" if fault else "cases"].append(
            {"vae": name, "latent": [b, 16, t, h, w], "fault": fault,
             "max_abs_diff": (got - want).abs().max().item(),
             "ref_abs_max": want.abs().max().item(), "decoder_rows": rows})

    with torch.inference_mode():
        for case in (RULES_CASES if rules else CASES):
            compare(*case)
        if not rules:
            for case in NEGATIVE:
                compare(*case)
    dist.barrier()
    stats = [None] * world
    dist.all_gather_object(stats, emulation.job_stats() if emulation else None)
    report["rules_stats"] = stats
    if rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def _launch(workdir, tiny_dir, names):
    """Launcher process: import once, then fork every launch's ranks (no torch compute has
    happened here, so forking is safe)."""
    import multiprocessing as mp

    import torch  # noqa: F401
    from diffusers import AutoencoderKLQwenImage  # noqa: F401  (diffusers imports lazily)

    sys.path.insert(0, str(ROOT))
    from workers.parallel import vae_check
    vae_check._allowed_types()  # imports the diffusers block modules it checks against

    ctx = mp.get_context("fork")
    deadline = time.monotonic() + 400
    for name in names:
        world, rules = LAUNCHES[name]
        store = os.path.join(workdir, f"store-{name}")
        out = os.path.join(workdir, f"report-{name}.json")
        procs = [ctx.Process(target=_rank_main, args=(r, world, rules, store, tiny_dir, out),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        if codes != [0] * world:
            sys.exit(f"launch {name}: rank exit codes {codes}")


# ---------------------------------------------------------------------------------------
# host side

def run_launches(workdir, tiny_dir, names=tuple(LAUNCHES)) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               XDIT_NCCL_RULES_TIMEOUT="10", XDIT_NCCL_RULES_COLLECTIVES="1")
    subprocess.run([sys.executable, __file__, "launch", str(workdir), str(tiny_dir), *names],
                   env=env, cwd=str(ROOT), timeout=450, check=True)
    return {n: json.loads((Path(workdir) / f"report-{n}.json").read_text()) for n in names}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, model_dir):
    return run_launches(tmp_path_factory.mktemp("vae_parallel_qwen"), model_dir("qwen_image"))


def _check_cases(rep, cases):
    assert [(c["vae"], *c["latent"][2:], c["latent"][0]) for c in rep["cases"]] == \
        [(v, t, h, w, b) for v, t, h, w, b in cases]
    bad = [c for c in rep["cases"]
           if not c["max_abs_diff"] <= (TOL64 if c["vae"].endswith("64") else TOL)]
    assert not bad, bad
    assert all(c["ref_abs_max"] > 0.3 for c in rep["cases"])  # the images have content
    for c in rep["cases"]:
        _, _, t, h, _ = c["latent"]
        want = [[r] * t if r else [] for r in BANDS[(t, h, rep["world"])]]  # a call per frame
        assert c["decoder_rows"] == want, c


@pytest.mark.parametrize("launch", ["2", "4"])
def test_matches_single_decode(reports, launch):
    _check_cases(reports[launch], CASES)


@pytest.mark.parametrize("launch", ["2", "4"])
def test_negative_controls_are_far_off(reports, launch):
    rep = reports[launch]
    assert [(c["vae"], c["fault"]) for c in rep["negative"]] == [(c[0], c[-1]) for c in NEGATIVE]
    for c in rep["negative"]:
        assert c["max_abs_diff"] > NEGATIVE_MIN, c
        _, _, t, h, _ = c["latent"]
        assert c["decoder_rows"] == [[r] for r in BANDS[(t, h, rep["world"])]], c


def test_under_nccl_rules(reports):
    rep = reports["4-nccl-rules"]
    _check_cases(rep, RULES_CASES)
    # the emulation carried every rank's halo exchanges (it was in force)
    assert all(s is not None and s["ops"] > 0 and s["batches"] > 0 for s in rep["rules_stats"]), \
        rep["rules_stats"]


def test_unsupported_qwen_decoder_refused():
    from diffusers import AutoencoderKLQwenImage
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    from workers.parallel.vae_parallel import check_decoder
    vae = AutoencoderKLQwenImage(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    check_decoder(vae)
    res = vae.decoder.up_blocks[0].resnets[0]
    saved = res.conv1
    res.conv1 = QwenImageCausalConv3d(16, 16, 3, padding=2)
    with pytest.raises(NotImplementedError, match="QwenImageCausalConv3d"):
        check_decoder(vae)
    res.conv1 = saved
    vae.decoder.up_blocks[0].upsamplers[0].resample[0].mode = "bilinear"
    with pytest.raises(NotImplementedError, match="bilinear"):
        check_decoder(vae)
    vae.decoder.up_blocks[0].upsamplers[0].resample[0].mode = "nearest-exact"
    vae.decoder.norm_out.channel_first = False
    with pytest.raises(NotImplementedError, match="RMS norm"):
        check_decoder(vae)


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        _launch(sys.argv[2], sys.argv[3], sys.argv[4:])
