"""ComfyUI 0.33.0's empty-latent nodes put `downscale_ratio_spacial` (pixels per latent pixel)
into the LATENT; an empty latent of another family's layout then stands for that many pixels,
as ComfyUI's own fix_empty_latent_channels reads it. Older LATENTs (no key) keep the guess
from the channel count. No ComfyUI needed."""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit.comfy_convert import latent_from_comfy
from comfyui_xdit.planning.config import ConfigError


@pytest.mark.parametrize("samples, ratio, size", [
    ((1, 16, 8, 6), 8, (64, 48)),      # EmptySD3LatentImage (0.33.0)
    ((1, 16, 8, 6), None, (64, 48)),   # the same from 0.8.0: no key, 16 channels -> 1/8
    ((1, 128, 4, 3), 16, (64, 48)),    # EmptyFlux2LatentImage's own layout
])
def test_an_empty_latent_stands_for_its_nodes_pixels_on_flux2(samples, ratio, size):
    latent = {"samples": torch.zeros(samples)}
    if ratio is not None:
        latent["downscale_ratio_spacial"] = ratio
    got = latent_from_comfy(latent, "flux2")
    assert got.empty and (got.height, got.width) == size
    assert tuple(got.samples.shape) == (1, 128, size[0] // 16, size[1] // 16)


def test_an_ltx_empty_video_latent_on_wan_is_its_nodes_size():
    """EmptyLTXVLatentVideo's 128 channels at 1/32: the channel count alone would say FLUX.2's
    1/16 and give Wan half the size."""
    latent = {"samples": torch.zeros(1, 128, 2, 2, 3), "downscale_ratio_spacial": 32}
    got = latent_from_comfy(latent, "wan")
    assert got.empty and (got.height, got.width) == (64, 96)
    assert tuple(got.samples.shape) == (1, 16, 2, 8, 12)
    older = latent_from_comfy({"samples": latent["samples"]}, "wan")
    assert (older.height, older.width) == (32, 48)


def test_the_ratio_changes_nothing_for_a_latent_of_the_models_layout():
    x = torch.zeros(1, 16, 8, 6)
    for arch in ("flux", "sd3"):
        got = latent_from_comfy({"samples": x, "downscale_ratio_spacial": 8}, arch)
        assert (got.height, got.width) == (64, 48) and torch.equal(got.samples, x)
    # a latent that is not empty is never resized, whatever its key says
    y = torch.randn(1, 16, 8, 6)
    got = latent_from_comfy({"samples": y, "downscale_ratio_spacial": 16}, "flux")
    assert (got.height, got.width) == (64, 48) and torch.equal(got.samples, y)
    with pytest.raises(ConfigError, match="16 channels"):
        latent_from_comfy({"samples": y, "downscale_ratio_spacial": 8}, "flux2")
