"""Patch-parallel VAE decode (workers/parallel/vae_parallel.py) equals the single-process
`vae.decode(latents).sample` within 1e-4 at 2 and 4 ranks, and each rank decodes only its
own band of latent rows (counted at the decoder's input, which is where the per-rank memory
saving comes from).

One launcher process imports torch and diffusers once and forks the ranks of each world size
(2, then 4; gloo over a FileStore on loopback, one thread per rank); every case runs inside
those two launches and rank 0 compares with the single decode, writing a JSON report.

VAEs: the tiny FLUX and SD3 VAEs, a wider random AutoencoderKL in the real VAEs' shape (32
groups, 3 resnets per up block, a post_quant_conv), and float64 copies, where the parallel
decode must agree to 1e-10 (exact up to summation order, far below fp32 rounding). Latent
heights that do not divide by the rank count, bands of one row (the thin-band halo path),
fewer rows than ranks (rank 0 decodes alone) and batch 2 are covered. Negative controls
switch off one part of the scheme each (halo, GroupNorm all-reduce, attention K/V gather)
and must be far off.

Bands: a forward pre-hook on each VAE's decoder records the latent rows every rank's decoder
is given during each parallel decode; the test compares them with the balanced split written
out below (first h % n bands one row taller; rank 0 alone below n rows).

Memory is measured, not asserted (RSS ratios are the benchmark's business, not a test's on a
shared machine): peak RSS above the RSS at entry (VmHWM reset through /proc/self/clear_refs;
glibc told to mmap blocks above 128 KiB so freed tensors leave RSS) for one decode, at 1 rank
(rank 0 decoding alone) and on every rank at 2 and 4 ranks.
`python tests/test_vae_parallel.py report [latent]` prints every figure (default latent 128:
a 1024x1024 image); the test decodes a 512x512 image that way as one more exactness case.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
TOL64 = 1e-10
NEGATIVE_MIN = 1e-2
WORLDS = (2, 4)

# (vae, latent height, latent width, batch); "...64": the same VAE in float64
CASES = [
    ("flux", 13, 10, 1),
    ("flux", 16, 16, 1),
    ("flux", 9, 22, 2),
    ("flux", 5, 7, 1),    # 4 ranks: bands 2,1,1,1 (thin-band halo path)
    ("flux", 3, 5, 1),    # 4 ranks: fewer rows than ranks -> rank 0 alone
    ("sd3", 13, 10, 1),
    ("sd3", 11, 6, 2),
    ("wide", 9, 22, 1),
    ("wide", 7, 5, 2),
    ("flux64", 13, 10, 1),
    ("wide64", 9, 7, 2),
]
NEGATIVE = [("flux", 13, 10, 1, f) for f in ("no_halo", "local_groupnorm", "local_attention")]
TEST_MEM_LATENT = 64  # 512x512 image

# Latent rows each rank's decoder gets, per latent height and world size, written out:
# balanced bands (the first h % n one row taller); fewer rows than ranks -> rank 0 decodes
# the whole latent and the others nothing (0).
BANDS = {
    (13, 2): [7, 6], (13, 4): [4, 3, 3, 3],
    (16, 2): [8, 8], (16, 4): [4, 4, 4, 4],
    (9, 2): [5, 4], (9, 4): [3, 2, 2, 2],
    (5, 2): [3, 2], (5, 4): [2, 1, 1, 1],
    (3, 2): [2, 1], (3, 4): [3, 0, 0, 0],
    (11, 2): [6, 5], (11, 4): [3, 3, 3, 2],
    (7, 2): [4, 3], (7, 4): [2, 2, 2, 1],
    (TEST_MEM_LATENT, 2): [32, 32], (TEST_MEM_LATENT, 4): [16, 16, 16, 16],
}


# ---------------------------------------------------------------------------------------
# rank side (forked from the launcher)

def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _measure(fn):
    """(result, peak MB above the RSS at entry, seconds)."""
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_kb("VmRSS")
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    return out, (_rss_kb("VmHWM") - base) / 1024, dt


def _wide_vae():
    import torch
    from diffusers import AutoencoderKL
    torch.manual_seed(1234)  # same weights on every rank
    return AutoencoderKL(in_channels=3, out_channels=3,
                         down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(32, 64, 128, 128), layers_per_block=2,
                         norm_num_groups=32, latent_channels=16, use_quant_conv=False,
                         use_post_quant_conv=True)


def _rank_main(rank, world, store, flux_dir, sd3_dir, mem_latent, out):
    import copy

    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKL

    from workers.parallel.vae_parallel import decode_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    vaes = {a: AutoencoderKL.from_pretrained(d, subfolder="vae")
            for a, d in (("flux", flux_dir), ("sd3", sd3_dir))}
    vaes["wide"] = _wide_vae()
    for v in list(vaes.values()):
        v.eval().requires_grad_(False)
    for k in ("flux", "wide"):
        vaes[k + "64"] = copy.deepcopy(vaes[k]).double()
    report = {"world": world, "cases": [], "negative": [], "memory": {}}

    # the latent rows this rank's decoder is given, one entry per decoder call
    decoded: list = []
    for v in vaes.values():
        v.decoder.register_forward_pre_hook(lambda m, args: decoded.append(int(args[0].shape[2])))

    def parallel(name, z, fault=None):
        """decode_parallel, and every rank's decoder-input rows for it (on rank 0)."""
        decoded.clear()
        out = decode_parallel(vaes[name], z, fault=fault)
        rows = [None] * world
        dist.all_gather_object(rows, list(decoded))
        decoded.clear()
        return out, rows

    def latents(name, h, w, b):  # only rank 0 has them; decode_parallel broadcasts
        g = torch.Generator().manual_seed(h * 1000 + w * 10 + b)
        dtype = torch.float64 if name.endswith("64") else torch.float32
        return torch.randn(b, 16, h, w, generator=g, dtype=dtype) if rank == 0 else None

    def compare(name, h, w, b, fault=None):
        z = latents(name, h, w, b)
        got, rows = parallel(name, z, fault=fault)
        if rank != 0:
            assert got is None
            return
        want = vaes[name].decode(z).sample
        assert got.shape == want.shape, (got.shape, want.shape)
        report["negative" if fault else "cases"].append(
            {"vae": name, "latent": [b, 16, h, w], "fault": fault,
             "max_abs_diff": (got - want).abs().max().item(),
             "ref_abs_max": want.abs().max().item(), "decoder_rows": rows})

    with torch.inference_mode():
        # memory first, before anything bigger has run in this process; one small decode
        # before it so that one-time initialisation (oneDNN, gloo pairs) is not counted
        decode_parallel(vaes["flux"], latents("flux", 8, 8, 1))
        z = latents("flux", mem_latent, mem_latent, 1)
        dist.barrier()
        decoded.clear()
        par, peak, secs = _measure(lambda: decode_parallel(vaes["flux"], z))
        mem_rows = [None] * world
        dist.all_gather_object(mem_rows, list(decoded))
        peaks = [None] * world
        dist.all_gather_object(peaks, {"rank": rank, "peak_mb": round(peak, 1),
                                       "seconds": round(secs, 2)})
        if rank == 0:
            single, peak1, secs1 = _measure(lambda: vaes["flux"].decode(z).sample)
            report["memory"] = {"image": list(single.shape), "parallel": peaks,
                                "single": {"peak_mb": round(peak1, 1), "seconds": round(secs1, 2)},
                                "image_mb": single.numel() * 4 / 2**20,
                                "max_abs_diff": (par - single).abs().max().item(),
                                "decoder_rows": mem_rows}
            del single, par
        dist.barrier()

        for case in CASES:
            compare(*case)
        for case in NEGATIVE:
            compare(*case)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def _launch(workdir, flux_dir, sd3_dir, mem_latent, worlds):
    """Launcher process: import once, then fork every world's ranks (no torch compute has
    happened here, so forking is safe)."""
    import multiprocessing as mp

    import torch  # noqa: F401
    from diffusers import AutoencoderKL  # noqa: F401  (diffusers imports lazily: force it)

    sys.path.insert(0, str(ROOT))
    from workers.parallel import vae_check
    vae_check._allowed_types()  # imports the diffusers block modules it checks against

    ctx = mp.get_context("fork")
    deadline = time.monotonic() + 240
    for world in worlds:
        store = os.path.join(workdir, f"store{world}")
        out = os.path.join(workdir, f"report{world}.json")
        procs = [ctx.Process(target=_rank_main, args=(r, world, store, flux_dir, sd3_dir,
                                                      mem_latent, out), daemon=True)
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
            sys.exit(f"world {world}: rank exit codes {codes}")


# ---------------------------------------------------------------------------------------
# host side

def run_worlds(workdir, flux_dir, sd3_dir, mem_latent=TEST_MEM_LATENT, worlds=WORLDS) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, __file__, "launch", str(workdir), str(flux_dir),
                    str(sd3_dir), str(mem_latent), *map(str, worlds)],
                   env=env, cwd=str(ROOT), timeout=300, check=True)
    return {w: json.loads((Path(workdir) / f"report{w}.json").read_text()) for w in worlds}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, model_dir):
    return run_worlds(tmp_path_factory.mktemp("vae_parallel"), model_dir("flux"), model_dir("sd3"))


@pytest.mark.parametrize("world", WORLDS)
def test_matches_single_decode(reports, world):
    rep = reports[world]
    assert len(rep["cases"]) == len(CASES)
    bad = [c for c in rep["cases"]
           if not c["max_abs_diff"] <= (TOL64 if c["vae"].endswith("64") else TOL)]
    assert not bad, bad
    # not a degenerate comparison: the images have content
    assert all(c["ref_abs_max"] > 0.5 for c in rep["cases"])
    assert rep["memory"]["max_abs_diff"] <= TOL


@pytest.mark.parametrize("world", WORLDS)
def test_negative_controls_are_far_off(reports, world):
    rep = reports[world]
    assert [c["fault"] for c in rep["negative"]] == [c[-1] for c in NEGATIVE]
    for c in rep["negative"]:
        assert c["max_abs_diff"] > NEGATIVE_MIN, c


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_decodes_only_its_band(reports, world):
    """Every parallel decode (the cases, the negative controls and the 512x512 one) gives
    each rank's decoder exactly its band of latent rows, in one call: no rank decodes the
    whole latent (what would keep memory per rank from falling) or another's rows."""
    rep = reports[world]
    decodes = [(c["latent"][2], c["decoder_rows"]) for c in rep["cases"] + rep["negative"]]
    decodes.append((TEST_MEM_LATENT, rep["memory"]["decoder_rows"]))
    assert len(decodes) == len(CASES) + len(NEGATIVE) + 1
    for h, rows in decodes:
        want = [[r] if r else [] for r in BANDS[(h, world)]]
        assert rows == want, f"latent height {h} on {world} ranks: decoder rows {rows}, " \
                             f"expected {want}"


def test_band_rows():
    from workers.parallel.vae_parallel import band_rows
    assert band_rows(13, 4) == [4, 3, 3, 3]
    assert band_rows(16, 2) == [8, 8]
    assert band_rows(5, 4) == [2, 1, 1, 1]


def test_unsupported_decoder_refused():
    import torch
    from diffusers import AutoencoderKL

    from workers.parallel.vae_parallel import check_decoder
    vae = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
                        latent_channels=4)
    check_decoder(vae)
    vae.decoder.up_blocks[0].upsamplers[0].conv = torch.nn.Conv2d(8, 8, 3, padding=2)
    with pytest.raises(NotImplementedError, match="padding"):
        check_decoder(vae)
    vae.decoder.up_blocks[0].upsamplers[0].conv = torch.nn.ConvTranspose2d(8, 8, 3, padding=1)
    with pytest.raises(NotImplementedError, match="ConvTranspose2d"):
        check_decoder(vae)


def _print_report(mem_latent: int):
    sys.path.insert(0, str(ROOT))
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    with tempfile.TemporaryDirectory() as d:
        dirs = [ensure_tiny_model(arch, Path(d) / "models") for arch in ("flux", "sd3")]
        t = time.perf_counter()
        reps = run_worlds(d, *dirs, mem_latent=mem_latent)
        print(f"launch + both worlds: {time.perf_counter() - t:.1f} s")
    for w, rep in reps.items():
        print(f"== {w} ranks")
        for c in rep["cases"] + rep["negative"]:
            print(f"  {c['vae']:6s} latent {c['latent']} fault={c['fault']}: "
                  f"max abs diff {c['max_abs_diff']:.2e}")
        print("  memory", json.dumps(rep["memory"]))


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        _launch(*sys.argv[2:5], int(sys.argv[5]), [int(w) for w in sys.argv[6:]])
    else:
        _print_report(int(sys.argv[2]) if len(sys.argv) > 2 else 128)
