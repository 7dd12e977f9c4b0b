"""ComfyUI 0.33.0's LTX-2 CONDITIONING on the xDiT MODEL (docs/models.md#ltx-2-video-with-its-sound):
text states before the text connectors (caption_channels wide, not two of them side by side),
which ComfyUI's LTXAV runs through the connectors its single file holds. The pool runs the
file's connectors; its MODEL call on such states must equal the call on the states diffusers'
connectors (the tiny folder's own, LTX2TextConnectors' video and audio connector) make of
them in ComfyUI's convention, written out here: the prompt's tokens, then the connectors'
learnable registers up to 1024 tokens (diffusers' connector puts its registers where the
mask says padding). On 2 ranks, Ulysses and CFG parallel. Negative control: other states
move the prediction. A width of neither kind, or a file without connectors, is one error.
And 0.33.0's block order (its video-to-audio attention reads the video after the
audio-to-video update), which the MODEL runs where ComfyUI's own LTXAV does; Sampler (xDiT)
taking such states; and how the MODEL tells 0.33.0's audio-video gates from 0.8.0's.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import ParallelConfig

TOL = 1e-4
TOKENS = 7  # the prompt's (family_requests' text states' count)
PADDED = 1024  # ComfyUI's connectors pad every shorter prompt to this many tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from comfyui_xdit.testmodels import ltx2
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model, write_comfy_file

    cache = tmp_path_factory.mktemp("ltx2-comfy-text")
    folder = ensure_tiny_model("ltx2", cache, **ltx2.SINGLE_FILE_MODEL)
    path = write_comfy_file("ltx2", folder, cache / "ltx2-comfy.safetensors")
    return folder, path


def _diffusers_connectors(folder, raw):
    """The folder's diffusers connectors on `raw` [B, tokens, width] in ComfyUI's
    convention -> ComfyUI's context [B, 1024, 2 x width] (the video's, then the sound's)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    conn = LTX2TextConnectors.from_pretrained(str(folder), subfolder="connectors").eval()
    b, n, width = raw.shape
    x = torch.cat([raw, raw.new_zeros(b, PADDED - n, width)], 1)
    mask = torch.cat([torch.zeros(n), torch.full((PADDED - n,), -torch.finfo(x.dtype).max)])
    mask = mask.view(1, 1, 1, PADDED).expand(b, -1, -1, -1)
    with torch.no_grad():
        return torch.cat([conn.video_connector(x, mask)[0], conn.audio_connector(x, mask)[0]],
                         -1)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", [ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)],
                         ids=["ulysses2", "cfg_parallel"])
def test_text_before_the_connectors_equals_the_diffusers_connectors(model, layout_pools,
                                                                    layout):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from family_requests import model_call_inputs

    folder, path = model
    call = model_call_inputs("ltx2", folder)
    width = call["context"].shape[2] // 2  # caption_channels: one stream's states
    raw = torch.randn(2, TOKENS, width, generator=torch.Generator().manual_seed(3))
    processed = _diffusers_connectors(folder, raw)
    assert processed.shape == (2, PADDED, 2 * width)
    pool = layout_pools.get(path, layout)
    got = PoolDenoiser(pool, layout, "ltx2")(**dict(call, context=raw, frame_rate=24.0))
    want = PoolDenoiser(pool, layout, "ltx2")(**dict(call, context=processed,
                                                      frame_rate=24.0))
    figs = {part: _rel(a, b) for part, a, b in zip(("video", "audio"), got, want)}
    print(f"\n{layout}: rel L2 {figs}")
    assert all(v <= TOL for v in figs.values()), figs
    another = torch.randn(2, TOKENS, width, generator=torch.Generator().manual_seed(4))
    other = PoolDenoiser(pool, layout, "ltx2")(**dict(call, context=another,
                                                       frame_rate=24.0))
    assert _rel(other[0], want[0]) > 1e-3, "the text states are not read"


def test_text_of_neither_width_or_without_connectors_is_one_error(model, layout_pools,
                                                                  tmp_path):
    from safetensors.torch import load_file, save_file

    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    from family_requests import model_call_inputs

    folder, path = model
    call = model_call_inputs("ltx2", folder)
    width = call["context"].shape[2] // 2
    one = ParallelConfig()
    pool = layout_pools.get(path, one)
    with pytest.raises(Exception, match=rf"tokens, {2 * width}\] \(the transformer's\) or "
                                        rf"\[rows, tokens, {width}\]"):
        PoolDenoiser(pool, one, "ltx2")(**dict(call, context=torch.zeros(2, 5, width + 8)))
    sd = load_file(str(path))
    bare = tmp_path / "no-connectors.safetensors"
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file({k: v for k, v in sd.items() if "embeddings_connector" not in k}, str(bare),
              metadata=meta)
    with pytest.raises(Exception, match="holds no LTX-2 text connectors"):
        PoolDenoiser(layout_pools.get(bare, one), one, "ltx2")(
            **dict(call, context=torch.zeros(2, 5, width)))


# ---- ComfyUI 0.33.0's block order (workers/models/ltx2_block_order.py) ----------------------
ORDER = {"v2a_after_a2v": 1.0}


def _call(pool, layout, call, order: bool):
    from comfyui_xdit.nodes.model_calls import PoolDenoiser
    model = PoolDenoiser(pool, layout, "ltx2")
    if order:
        model.model_inputs = dict(ORDER)
    return model(**dict(call, frame_rate=24.0))


def test_block_order_is_the_pools_on_2_ranks_and_moves_only_the_audio_to_video_effect(
        model, layout_pools, tmp_path):
    """ComfyUI 0.33.0's order (the video-to-audio attention reads the video after the
    audio-to-video update) on the xDiT MODEL: at Ulysses 2 and at CFG parallel it equals one
    rank; it moves the prediction (it is read: 0.33.0's LTXAV differs from 0.8.0's); with
    the file's audio-to-video output projections zeroed (nothing to read after the update)
    it equals the reference order, so the hooks change nothing else. ComfyUI 0.33.0's own
    LTXAV is the live suite's oracle (tests/test_comfyui_live_ltx2_model.py)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from family_requests import model_call_inputs

    folder, path = model
    call = model_call_inputs("ltx2", folder)
    one = ParallelConfig()
    ref = _call(layout_pools.get(path, one), one, call, True)
    plain = _call(layout_pools.get(path, one), one, call, False)
    moved = [_rel(a, b) for a, b in zip(ref, plain)]
    assert min(moved) > 1e-3, moved
    figs = {}
    for layout in (ParallelConfig(ulysses=2), ParallelConfig(cfg_parallel=True)):
        got = _call(layout_pools.get(path, layout), layout, call, True)
        figs[str(layout.ulysses) + str(layout.cfg)] = [_rel(a, b) for a, b in zip(got, ref)]
    print(f"\nblock order vs 1 rank: {figs}; vs the reference order: {moved}")
    assert all(v <= TOL for pair in figs.values() for v in pair), figs
    sd = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    for k in sd:
        if ".audio_to_video_attn.to_out.0." in k:
            sd[k] = torch.zeros_like(sd[k])
    quiet = tmp_path / "no-a2v.safetensors"
    save_file(sd, str(quiet), metadata=meta)
    a = _call(layout_pools.get(quiet, one), one, call, True)
    b = _call(layout_pools.get(quiet, one), one, call, False)
    assert max(_rel(x, y) for x, y in zip(a, b)) <= 1e-6


def test_sampler_takes_text_before_the_connectors(model):
    """Sampler (xDiT) on the single file with ComfyUI 0.33.0's CONDITIONING (states before the
    text connectors, flagged `unprocessed_ltxav_embeds`) equals the Sampler with the states
    the folder's diffusers connectors make of them (ComfyUI 0.8.0's kind), video and sound, at
    Ulysses 2; the worker runs the file's connectors first. Negative control: other states
    before the connectors move the result."""
    from comfyui_xdit.nodes.handles import ModelHandle
    from comfyui_xdit.nodes.operations import SampleInputs, sample
    from comfyui_xdit.nodes.pool_registry import PoolRegistry
    from family_requests import model_call_inputs

    folder, path = model
    width = model_call_inputs("ltx2", folder)["context"].shape[2] // 2
    gen = torch.Generator().manual_seed(5)
    raw_pos, raw_neg, raw_other = (torch.randn(1, TOKENS, width, generator=gen)
                                   for _ in range(3))
    flag = {"unprocessed_ltxav_embeds": True}
    empty = {"samples": torch.zeros(1, 128, 2, 2, 3)}
    run = dict(latent=empty, seed=5, steps=2, cfg=3.0)
    reg = PoolRegistry()
    try:
        handle = ModelHandle(path=str(path), device="cpu", dtype="fp32", ulysses=2,
                             world_size=2, threads_per_rank=1)

        def go(pos, neg, extra):
            return sample(handle, SampleInputs(positive=[[pos, dict(extra)]],
                                               negative=[[neg, dict(extra)]], **run),
                          registry=reg)
        got = go(raw_pos, raw_neg, flag)
        want = go(_diffusers_connectors(folder, raw_pos), _diffusers_connectors(folder, raw_neg),
                  {})
        other = go(raw_other, raw_neg, flag)
    finally:
        reg.unload_all()
    figs = {part: _rel(got[part], want[part]) for part in ("samples", "audio")}
    moved = _rel(other["samples"], want["samples"])
    print(f"\nSampler, text before the connectors, Ulysses 2: rel L2 {figs} (other states "
          f"{moved:.2e})")
    assert all(v <= TOL for v in figs.values()), figs
    assert moved > 1e-3, f"the text states are not read ({moved:.2e})"


# ---- ComfyUI 0.33.0's audio-video gates (workers/models/ltx2_cross_gates.py) ----------------
def _stand_in_comfy(monkeypatch, gate):
    """A stand-in `comfy.ldm.lightricks.av_model` whose LTXAVModel prepares the gates' inputs
    with `gate(own, other)` (each stream's scaled timesteps), as ComfyUI's does, for
    `comfy_cross_gates` to read."""
    import sys
    import types

    class LTXAVModel:
        def _prepare_timestep(self, timestep, batch_size, hidden_dtype, **kwargs):
            v = timestep * self.timestep_scale_multiplier
            a = kwargs["a_timestep"] * self.timestep_scale_multiplier
            f = self.av_ca_timestep_scale_multiplier / self.timestep_scale_multiplier
            self.av_ca_a2v_gate_adaln_single(gate(v, a).flatten() * f, {})
            self.av_ca_v2a_gate_adaln_single(gate(a, v).flatten() * f, {})

    module = types.ModuleType("comfy.ldm.lightricks.av_model")
    module.LTXAVModel = LTXAVModel
    for name in ("comfy", "comfy.ldm", "comfy.ldm.lightricks"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "comfy.ldm.lightricks.av_model", module)


def test_the_gates_are_told_apart_from_comfyuis_own_timestep_preparation(monkeypatch):
    """`comfy_cross_gates` reads the gates' inputs off ComfyUI's own `_prepare_timestep`: a
    stream's own tokens' timesteps (0.8.0) -> 0, the other stream's largest (0.33.0) -> 1;
    anything else (the other stream's smallest here) is one error naming what it saw."""
    from workers.families.ltx2 import comfy_cross_gates

    for gate, want in ((lambda own, other: own, 0.0),
                       (lambda own, other: other.max().expand_as(own), 1.0)):
        _stand_in_comfy(monkeypatch, gate)
        assert comfy_cross_gates() == {"cross_gate_other_max": want}
    _stand_in_comfy(monkeypatch, lambda own, other: other.min().expand_as(own))
    with pytest.raises(ValueError, match="does not know") as e:
        comfy_cross_gates()
    assert "\n" not in str(e.value)
