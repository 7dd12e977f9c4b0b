"""PipeFusion's stage-to-stage transfers (workers/sampling/patch_pipeline.py): at every tick
what a stage sends the next is, tensor for tensor, what the next one posts to receive (shape
and dtype: under NCCL a mismatch hangs the pair), both read from the one plan
(workers/parallel/pipefusion/activations.stage_transfers).

* joined activations of a bf16 model whose loop keeps fp32 latents (Wan) travel in the
  blocks' dtype on both sides;
* stage states with a sound (LTX-2's video and audio): the sound's state, empty off a step's
  first patch, is neither sent nor received there;
* a stage whose activations do not fit the patch is refused in one line before any transfer
  is posted.

One process: two PatchPipelines (stage 0 and 1) on fakes of the job, model, adapter and
topology; the transfer is recorded where it would be posted.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import workers.sampling.patch_pipeline as pp  # noqa: E402
from workers.streams import Stream, TokenLayout  # noqa: E402

ROWS, COLS, TEXT, AUDIO, C = 4, 3, 5, 6, 8
BLOCKS = torch.bfloat16  # the model's dtype: what its blocks carry
JOINED = TokenLayout((Stream("video", "latent"), Stream("text", "text", "replicate")))
SOUND = TokenLayout((Stream("video", "latent"),
                     Stream("audio", "context", "replicate", denoised=True),
                     Stream("text", "text", "replicate")))
STATES = (("hidden_states", "video", 16), ("audio_hidden_states", "audio", 4))


class Posted(Exception):
    def __init__(self, sends, recvs):
        super().__init__("posted")
        self.sends, self.recvs = sends, recvs


class Topo:
    sp_rank, sp = 0, 1

    def __init__(self, stage):
        self.stage = stage

    def degree(self, name):
        return 2 if name == "pipefusion" else 1

    def index(self, name):
        return self.stage

    def global_rank(self, pipefusion):
        return pipefusion

    def group(self, name):
        return None


class Adapter:
    def __init__(self, layout, states, sound):
        self.layout = SimpleNamespace(streams=layout)
        self.family = SimpleNamespace(stream_width=lambda config: 16,
                                      capability=lambda kind: None)  # no references
        self.states, self.sound = states, sound

    def token_grid(self, height, width, frames=1):
        return ROWS, COLS

    def context_tokens(self, cond):
        return {"text": TEXT}

    def stage_states(self, config):
        return self.states

    def latent_rows(self, x, r0, r1, cols):
        return x.narrow(1, r0 * cols, (r1 - r0) * cols)

    def denoised_parts(self, x, rows, cols):
        if not self.sound:
            return x, {}
        n = rows * cols
        return x.narrow(1, 0, n), {"audio": x.narrow(1, n, x.shape[1] - n)}


def _pipelines(layout, states, sound, steps=3):
    adapter = Adapter(layout, states, sound)
    job = SimpleNamespace(request=SimpleNamespace(height=64, width=48, frames=1),
                          options={"warmup_steps": 1, "pipeline_patches": 2})
    prep = SimpleNamespace(timesteps=list(range(steps)), extras=[{}] * steps, extra={})
    latents = torch.zeros(1, ROWS * COLS + (AUDIO if sound else 0), C)  # fp32 loop latents
    out = []
    for stage in (0, 1):
        model = SimpleNamespace(stage=SimpleNamespace(count=2, index=stage), dtype=BLOCKS,
                                transformer=SimpleNamespace(config={}),
                                device=torch.device("cpu"))
        p = pp.PatchPipeline(job, model, adapter, prep, {1: {}}, Topo(stage))
        p.denoised = {s: int(v.shape[1]) for s, v in
                      adapter.denoised_parts(latents, ROWS, COLS)[1].items()}
        out.append(p)
    return out, latents


def _block_outputs(m, states, hidden=16):
    """What stage 0's last block returns for micro `m`: the patch's video rows (and with a
    step's first patch the sound), in the blocks' dtype."""
    video = (m.rows[1] - m.rows[0]) * COLS
    if not states:
        return torch.zeros(1, video, hidden, dtype=BLOCKS)
    return [torch.zeros(1, video, 16, dtype=BLOCKS),
            torch.zeros(1, AUDIO if m.with_text else 0, 4, dtype=BLOCKS)]


def _posted(p, tick, latents):
    try:
        p._tick(tick, latents, lambda step: None)
    except Posted as e:
        return e
    raise AssertionError("the tick posted no transfer")


def _walk(monkeypatch, layout, states, sound, outputs=_block_outputs):
    """Every tick's stage-0 sends to stage 1 and stage 1's receives from stage 0."""
    def exchange(sends, recvs, group, device):
        raise Posted(sends, recvs)

    monkeypatch.setattr(pp, "exchange", exchange)
    (p0, p1), latents = _pipelines(layout, states, sound)
    ticks = []
    for tick in range(p0.sched.ticks):
        done = p0.sched.compute_at(0, tick - 1)
        if done is not None:
            p0.outgoing = (p0.plan(done), outputs(done, states))
        sent = _posted(p0, tick, latents).sends
        got = _posted(p1, tick, latents).recvs
        ticks.append(([(tuple(t.shape), t.dtype) for t, peer in sent if peer == 1],
                      [(tuple(s), dt) for s, dt, peer in got if peer == 0], done))
    return ticks


def test_joined_activations_travel_in_the_blocks_dtype(monkeypatch):
    """A bf16 model with fp32 loop latents: the receiver posts the blocks' dtype, not the
    loop's (a 4-byte buffer for a 2-byte send)."""
    ticks = _walk(monkeypatch, JOINED, (), False)
    assert sum(1 for sent, _, _ in ticks if sent) >= 4
    for sent, got, done in ticks:
        assert sent == got, f"micro {done}"
        assert all(dt == BLOCKS for _, dt in got)


def test_the_sound_state_is_sent_exactly_where_it_is_received(monkeypatch):
    ticks = _walk(monkeypatch, SOUND, STATES, True)
    empty = 0
    for sent, got, done in ticks:
        assert sent == got, f"micro {done}"
        if done is not None:
            # the sound goes with a step's first patch only; off it, no empty transfer
            assert len(sent) == (2 if done.with_text else 1)
            empty += not done.with_text
    assert empty >= 2


def test_activations_that_do_not_fit_the_patch_are_refused_before_the_transfer(monkeypatch):
    """A sound state of tokens where the plan has none (a receiver never posts it), or an
    fp32 state: one clear error, and nothing posted."""
    def sound_everywhere(m, states):
        video, audio = _block_outputs(m, states)
        return [video, torch.zeros(1, AUDIO, 4, dtype=BLOCKS)]

    def fp32(m, states):
        return [t.float() for t in _block_outputs(m, states)]

    for outputs, wrong in ((sound_everywhere, f"(1, {AUDIO}, 4)"), (fp32, "torch.float32")):
        with pytest.raises(RuntimeError, match="stage 0 produced activations") as e:
            _walk(monkeypatch, SOUND, STATES, True, outputs)
        assert wrong in str(e.value) and "the next stage receives" in str(e.value)
