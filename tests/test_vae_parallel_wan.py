"""Patch-parallel decode of Wan's causal 3-D video VAE (workers/parallel/vae_parallel.py,
AutoencoderKLWan) equals the single-process `vae.decode(latents).sample` of multi-frame latents
[B, 16, T, h, w] (T = 1, 2, 3: 1, 5, 9 frames) within 1e-5 (fp32) / 1e-10 (fp64) at 2, 3 and 4
gloo ranks, and each rank's decoder is given only its own band of latent rows, once per frame.

The decoder runs one latent frame per call and keeps a feature cache (the last frames of every
causal conv's input, here each rank's own band): from the second frame on, a 3x3x3 conv
convolves [cached frames, new frame], and its H halo must cover the cached frames too. The
negative control "no_cache_halo" exchanges halos on the new frames only and must be far off
(from the second frame); "no_halo" (no exchange at all) too.

One launcher process imports torch and diffusers once and forks the ranks of each launch
(gloo over a FileStore on loopback, one thread per rank), as tests/test_vae_parallel_qwen.py
does: 2 ranks, 3 ranks, and 4 ranks under the NCCL-rules emulation (xdit_testhooks/
nccl_rules.py, point-to-point order and collective matching checked).

VAEs, random weights built in the ranks (same seed): "wan", Wan 2.1's structure at base_dim 16
(dim_mult [1, 2, 2, 2], one resnet per block, temporal upsampling in the first two up blocks:
scale factors 4 in time and 8 in space, as its config says), its float64 copy, and "wan22",
Wan 2.2 TI2V-5B's structure (is_residual: up blocks with a channel-repeating DupUp3D shortcut;
48 latent channels, patch_size 2 unpatchified after the decoder: 16x in space).
Latent heights split unevenly, one-row bands, fewer rows than ranks (rank 0 decodes alone),
batch 1 and 2.

`python tests/test_vae_parallel_wan.py` prints every case's figures; `... memory [T h w world]`
measures peak RSS and seconds of one decode with the released Wan 2.1 structure (random
weights) on every rank vs rank 0 alone (not a test: figures, on a quiet machine).
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
LAUNCHES = {"2": (2, False), "3": (3, False), "4-nccl-rules": (4, True)}

# (vae, latent frames, latent height, latent width, batch); "wan64": float64
CASES = [
    ("wan", 1, 7, 6, 1),
    ("wan", 2, 9, 5, 2),
    ("wan", 3, 7, 6, 1),
    ("wan", 3, 5, 4, 2),     # 4 ranks: bands 2,1,1,1 (one-row bands)
    ("wan", 2, 2, 4, 1),     # 3 and 4 ranks: fewer rows than ranks -> rank 0 alone
    ("wan64", 3, 5, 3, 1),
    ("wan22", 2, 5, 4, 1),
]
RULES_CASES = [("wan", 1, 7, 6, 1), ("wan", 2, 9, 5, 2), ("wan", 3, 7, 6, 1), ("wan", 3, 5, 4, 2),
               ("wan22", 2, 5, 4, 1)]
NEGATIVE = [("wan", 3, 7, 6, 1, "no_cache_halo"), ("wan", 3, 7, 6, 1, "no_halo")]

# Latent rows each rank's decoder gets, written out: balanced bands (the first h % n one
# row taller); rank 0 alone (the others nothing) below n rows.
BANDS = {
    (7, 2): [4, 3], (7, 3): [3, 2, 2], (7, 4): [2, 2, 2, 1],
    (9, 2): [5, 4], (9, 3): [3, 3, 3], (9, 4): [3, 2, 2, 2],
    (5, 2): [3, 2], (5, 3): [2, 2, 1], (5, 4): [2, 1, 1, 1],
    (2, 2): [1, 1], (2, 3): [2, 0, 0], (2, 4): [2, 0, 0, 0],
}


# ---------------------------------------------------------------------------------------
# rank side (forked from the launcher)

def make_vaes():
    """The test's VAEs (random weights, a fixed seed each): {"wan", "wan64", "wan22"}."""
    import copy

    import torch
    from diffusers import AutoencoderKLWan
    torch.manual_seed(2101)
    wan = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True],
                           scale_factor_temporal=4, scale_factor_spatial=8)
    torch.manual_seed(2202)
    wan22 = AutoencoderKLWan(base_dim=16, decoder_base_dim=24, z_dim=48, dim_mult=[1, 2, 2, 2],
                             num_res_blocks=1, temperal_downsample=[False, True, True],
                             is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                             latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
                             scale_factor_temporal=4, scale_factor_spatial=16)
    vaes = {"wan": wan, "wan22": wan22}
    for v in vaes.values():
        v.eval().requires_grad_(False)
    vaes["wan64"] = copy.deepcopy(wan).double()
    return vaes


def _rank_main(rank, world, rules, store, out):
    import datetime

    import torch
    import torch.distributed as dist

    from workers.parallel.vae_parallel import decode_parallel

    torch.set_num_threads(1)
    emulation = None
    if rules:
        from xdit_testhooks import nccl_rules
        emulation = nccl_rules.install()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    vaes = make_vaes()
    report = {"world": world, "rules": rules, "cases": [], "negative": []}

    decoded: list = []  # latent rows this rank's decoder is given, one entry per call
    for v in vaes.values():
        v.decoder.register_forward_pre_hook(lambda m, args: decoded.append(int(args[0].shape[3])))

    def compare(name, t, h, w, b, fault=None):
        g = torch.Generator().manual_seed(t * 10000 + h * 1000 + w * 10 + b)
        vae = vaes[name]
        dtype = torch.float64 if name.endswith("64") else torch.float32
        z = torch.randn(b, vae.config.z_dim, t, h, w, generator=g, dtype=dtype) \
            if rank == 0 else None
        decoded.clear()
        tick = time.perf_counter()
        got = decode_parallel(vae, z, fault=fault)
        secs = time.perf_counter() - tick
        rows = [None] * world
        dist.all_gather_object(rows, list(decoded))
        if rank != 0:
            assert got is None
            return
        tick = time.perf_counter()
        want = vae.decode(z).sample
        secs1 = time.perf_counter() - tick
        assert got.shape == want.shape, (got.shape, want.shape)
        # per output frame: a cache-halo fault leaves the first latent frame's (output frame
        # 0) exact and breaks the later ones
        per_frame = (got - want).abs().amax(dim=(0, 1, 3, 4))
        report["negative" if fault else "cases"].append(
            {"vae": name, "latent": [b, vae.config.z_dim, t, h, w], "fault": fault,
             "image": list(want.shape), "max_abs_diff": per_frame.max().item(),
             "frame_diffs": per_frame.tolist(), "ref_abs_max": want.abs().max().item(),
             "decoder_rows": rows, "seconds": round(secs, 3), "seconds_single": round(secs1, 3)})

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


def _launch(workdir, names):
    """Launcher process: import once, then fork every launch's ranks (no torch compute has
    happened here, so forking is safe)."""
    import multiprocessing as mp

    import torch  # noqa: F401
    from diffusers import AutoencoderKLWan  # noqa: F401  (diffusers imports lazily)

    sys.path.insert(0, str(ROOT))
    from workers.parallel import vae_check
    vae_check._allowed_types()  # imports the diffusers block modules it checks against

    ctx = mp.get_context("fork")
    deadline = time.monotonic() + 400
    for name in names:
        world, rules = LAUNCHES[name]
        store = os.path.join(workdir, f"store-{name}")
        out = os.path.join(workdir, f"report-{name}.json")
        procs = [ctx.Process(target=_rank_main, args=(r, world, rules, store, out), daemon=True)
                 for r in range(world)]
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

def run_launches(workdir, names=tuple(LAUNCHES)) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               XDIT_NCCL_RULES_TIMEOUT="10", XDIT_NCCL_RULES_COLLECTIVES="1")
    subprocess.run([sys.executable, __file__, "launch", str(workdir), *names],
                   env=env, cwd=str(ROOT), timeout=450, check=True)
    return {n: json.loads((Path(workdir) / f"report-{n}.json").read_text()) for n in names}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_launches(tmp_path_factory.mktemp("vae_parallel_wan"))


def _check_cases(rep, cases):
    assert [(c["vae"], *c["latent"][2:], c["latent"][0]) for c in rep["cases"]] == \
        [(v, t, h, w, b) for v, t, h, w, b in cases]
    bad = [c for c in rep["cases"]
           if not c["max_abs_diff"] <= (TOL64 if c["vae"].endswith("64") else TOL)]
    assert not bad, bad
    for c in rep["cases"]:
        b, _, t, h, w = c["latent"]
        scale = 16 if c["vae"] == "wan22" else 8
        assert c["image"] == [b, 3, 1 + 4 * (t - 1), scale * h, scale * w], c
        assert c["ref_abs_max"] > 0.05, c  # the video has content
        want = [[r] * t if r else [] for r in BANDS[(h, rep["world"])]]  # a call per frame
        assert c["decoder_rows"] == want, c


@pytest.mark.parametrize("launch", ["2", "3"])
def test_matches_single_decode(reports, launch):
    _check_cases(reports[launch], CASES)


@pytest.mark.parametrize("launch", ["2", "3"])
def test_negative_controls_are_far_off(reports, launch):
    rep = reports[launch]
    assert [(c["vae"], c["fault"]) for c in rep["negative"]] == [(c[0], c[-1]) for c in NEGATIVE]
    for c in rep["negative"]:
        assert c["max_abs_diff"] > NEGATIVE_MIN, c
        if c["fault"] == "no_cache_halo":
            # the first latent frame has no cache: exact; the later frames are not
            assert c["frame_diffs"][0] <= TOL, c
            assert min(c["frame_diffs"][1:]) > NEGATIVE_MIN, c


def test_under_nccl_rules(reports):
    rep = reports["4-nccl-rules"]
    _check_cases(rep, RULES_CASES)
    # the emulation carried every rank's halo exchanges (it was in force)
    assert all(s is not None and s["ops"] > 0 and s["batches"] > 0 for s in rep["rules_stats"]), \
        rep["rules_stats"]


def test_wan_decoders_accepted_and_unsupported_refused():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    from workers.parallel.vae_parallel import check_decoder
    vaes = make_vaes()
    for v in vaes.values():
        check_decoder(v)
    vae = vaes["wan"]
    res = vae.decoder.up_blocks[0].resnets[0]
    saved = res.conv1
    res.conv1 = WanCausalConv3d(32, 32, 3, stride=(1, 2, 2), padding=1)
    with pytest.raises(NotImplementedError, match="WanCausalConv3d"):
        check_decoder(vae)
    res.conv1 = saved
    vae.decoder.up_blocks[0].upsamplers[0].resample[0].mode = "bilinear"
    with pytest.raises(NotImplementedError, match="bilinear"):
        check_decoder(vae)


def _print_report():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        reps = run_launches(d)
        print(f"all launches: {time.perf_counter() - t:.1f} s")
    for name, rep in reps.items():
        print(f"== {name}")
        for c in rep["cases"] + rep["negative"]:
            print(f"  {c['vae']:6s} latent {c['latent']} fault={c['fault']}: max abs diff "
                  f"{c['max_abs_diff']:.2e} per frame max {max(c['frame_diffs']):.1e} "
                  f"first {c['frame_diffs'][0]:.1e}; {c['seconds']} s "
                  f"(single {c['seconds_single']} s); rows {c['decoder_rows']}")


# ---------------------------------------------------------------------------------------
# `python tests/test_vae_parallel_wan.py memory [T h w world]`: peak RSS and seconds of one
# decode with the released Wan 2.1 VAE structure (base_dim 96, dim_mult [1, 2, 4, 4], two
# resnets per block; random weights), every rank of a patch-parallel decode vs rank 0 alone.

def _memory_rank(rank, world, store, shape, out):
    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKLWan

    from test_vae_parallel import _measure
    from workers.parallel.vae_parallel import decode_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    torch.manual_seed(96)
    vae = AutoencoderKLWan().eval().requires_grad_(False)  # the released config's structure
    t, h, w = shape
    z = torch.randn(1, 16, t, h, w, generator=torch.Generator().manual_seed(0)) \
        if rank == 0 else None
    with torch.inference_mode():
        decode_parallel(vae, torch.randn(1, 16, 1, 4, 4) if rank == 0 else None)  # warm-up
        dist.barrier()
        par, peak, secs = _measure(lambda: decode_parallel(vae, z))
        peaks = [None] * world
        dist.all_gather_object(peaks, {"rank": rank, "peak_mb": round(peak, 1),
                                       "seconds": round(secs, 2)})
        if rank == 0:
            single, peak1, secs1 = _measure(lambda: vae.decode(z).sample)
            Path(out).write_text(json.dumps({
                "latent": list(z.shape), "video": list(single.shape),
                "max_abs_diff": (par - single).abs().max().item(),
                "video_mb": single.numel() * 4 / 2**20, "parallel": peaks,
                "single": {"peak_mb": round(peak1, 1), "seconds": round(secs1, 2)}}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _memory(shape, world):
    import multiprocessing as mp
    import tempfile

    import torch  # noqa: F401
    from diffusers import AutoencoderKLWan  # noqa: F401

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import test_vae_parallel  # noqa: F401
    from workers.parallel import vae_check
    vae_check._allowed_types()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "memory.json")
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_memory_rank,
                             args=(r, world, os.path.join(d, "store"), shape, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        print(Path(out).read_text())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "launch":
        _launch(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 1 and sys.argv[1] == "memory":
        args = [int(a) for a in sys.argv[2:]] or [2, 16, 16, 2]
        _memory(tuple(args[:3]), args[3])
    else:
        _print_report()
