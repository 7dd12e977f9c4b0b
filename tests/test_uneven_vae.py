"""Patch-parallel VAE decode in bands by share (workers/parallel/vae_parallel.py with
`weights`): 2 ranks at 3:1 and 1:3, 3 ranks at 1:2:4 decode a small AutoencoderKL's latent
to the one-process image (fp32, <= 1e-4), each rank decoding the rows its weight gives it;
band_rows by weight leave no rank without a row."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gloo_worlds  # noqa: E402

WEIGHTS = {2: [(3.0, 1.0), (1.0, 3.0)], 3: [(1.0, 2.0, 4.0)]}


def _vae():
    import torch
    from diffusers import AutoencoderKL
    torch.manual_seed(7)  # the same weights on every rank
    return AutoencoderKL(in_channels=3, out_channels=3,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 32),
                         layers_per_block=1, norm_num_groups=8, latent_channels=4).eval()


def _cases(rank, world, ulysses, ring, report):
    import torch
    import torch.distributed as dist

    from workers.parallel.vae_parallel import band_rows, decode_parallel
    vae = _vae()
    rows = []
    vae.decoder.register_forward_pre_hook(lambda m, a: rows.append(int(a[0].shape[2])))
    z = torch.randn(1, 4, 24, 10, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = vae.decode(z).sample
        for w in WEIGHTS[world]:
            rows.clear()
            got = decode_parallel(vae, z if rank == 0 else None, weights=w)
            if rank == 0:
                report[f"{w}/diff"] = float((got - want).abs().max())
            report[f"{w}/rows"] = rows[0] if rows else None
            report[f"{w}/band"] = band_rows(24, world, w)[rank]
        dist.barrier()


WORLDS = {2: [(1, 1)], 3: [(1, 1)]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gloo_worlds.reports(__file__, tmp_path_factory.mktemp("uneven_vae"), WORLDS)


def test_bands_by_share_decode_exactly(reports):
    for world, ranks in reports.items():
        for w in WEIGHTS[world]:
            assert ranks[0][f"{w}/diff"] <= 1e-4, (world, w, ranks[0][f"{w}/diff"])
            bands = [r[f"{w}/band"] for r in ranks]
            assert sum(bands) == 24 and bands != [24 // world] * world, bands
            # each rank's decoder ran its band (plus the halo rows it borrows)
            assert all(r[f"{w}/rows"] >= r[f"{w}/band"] for r in ranks), ranks


def test_band_rows_by_weight_keep_a_row_each():
    from workers.parallel.vae_parallel import band_rows
    assert band_rows(24, 2, (3, 1)) == [18, 6] and band_rows(24, 2) == [12, 12]
    assert band_rows(5, 4, (100, 1, 1, 1)) == [2, 1, 1, 1]


if __name__ == "__main__" and sys.argv[1:2] == ["launch"]:
    gloo_worlds.launch(sys.argv[2], WORLDS, _cases)
