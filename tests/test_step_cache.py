"""The step cache's rule on one process (workers/sampling/step_cache.py), against diffusers' own First
Block Cache (the published rule, not this project's code), on the tiny FLUX, SD3 and FLUX.2
transformers, in a plain Euler loop:

- threshold 0 gives the uncached result bit for bit and never reads the device;
- with a threshold that skips, head 1 / tail 0 / no warmup / no cap equals diffusers'
  `apply_first_block_cache` on a copy of the transformer, call for call (same skips);
- decisions are per row: two rows batched give what each row gives alone, and the two rows
  decide differently (so one decision for the whole batch, as diffusers makes it, could not);
- the segment bookkeeping holds for SD3 (its last block returns no text) and FLUX.2 (its
  second list takes the two streams joined), and TaylorSeer's forecast changes the skipped
  calls only;
- bad settings are refused in one line.
"""
from __future__ import annotations

import copy

import pytest
import torch

from workers.sampling.step_cache import CacheSettings, RunCache, gated

LISTS = {"flux": ("transformer_blocks", "single_transformer_blocks"),
         "sd3": ("transformer_blocks",),
         "flux2": ("transformer_blocks", "single_transformer_blocks")}


def _transformer(model_dir, arch):
    import diffusers
    cls = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel",
           "flux2": "Flux2Transformer2DModel"}[arch]
    return getattr(diffusers, cls).from_pretrained(model_dir(arch), subfolder="transformer")\
        .eval().requires_grad_(False)


def _inputs(tr, arch, batch, seed=0, tokens=(4, 6), text=7):
    """Random transformer inputs: (latent [B, h*w, C], the rest of the call's kwargs)."""
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    h, w = tokens
    if arch == "sd3":
        x = torch.randn(batch, cfg.in_channels, 2 * h, 2 * w, generator=g)
        kw = {"encoder_hidden_states": torch.randn(batch, text, cfg.joint_attention_dim, generator=g),
              "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, generator=g)}
        return x, kw
    x = torch.randn(batch, h * w, cfg.in_channels, generator=g)
    ids = torch.zeros(h * w, 4 if arch == "flux2" else 3)
    ids[:, 1] = torch.arange(h).repeat_interleave(w)
    ids[:, 2] = torch.arange(w).repeat(h)
    txt_ids = torch.zeros(text, ids.shape[1])
    kw = {"encoder_hidden_states": torch.randn(batch, text, cfg.joint_attention_dim, generator=g),
          "img_ids": ids, "txt_ids": txt_ids}
    if arch == "flux":
        kw["pooled_projections"] = torch.randn(batch, cfg.pooled_projection_dim, generator=g)
    if cfg.guidance_embeds:
        kw["guidance"] = torch.full((batch,), 3.5)
    return x, kw


def _euler(tr, x, kw, steps, run=None, keys=None):
    """A plain Euler flow loop; `run`: the step cache, one call per step."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        t = sigmas[i].expand(x.shape[0])
        call = None if run is None else run.call(tr, LISTS[_arch(tr)], keys or
                                                 list(range(x.shape[0])))
        with torch.no_grad(), gated(call):
            v = tr(hidden_states=x, timestep=t, return_dict=False, **kw)[0]
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def _arch(tr):
    return {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3",
            "Flux2Transformer2DModel": "flux2"}[type(tr).__name__]


def _rels(tr, x, kw, steps):
    """The first-block rule's measure per step on an uncached run (to pick thresholds)."""
    run = RunCache(CacheSettings(threshold=1e-30, warmup=0, max_skips=0))
    rels = []
    orig = run.call

    def call(*a, **k):
        c = orig(*a, **k)
        decide = c._decide

        def spy(r):
            prev = c.rows[0].head
            if prev is not None:
                rels.append(float((r - prev).abs().sum() / prev.abs().sum()))
            decide(r)
        c._decide = spy
        return c
    run.call = call
    _euler(tr, x, kw, steps, run)
    return rels


@pytest.mark.parametrize("arch", ["flux", "sd3", "flux2"])
def test_threshold_zero_is_the_uncached_result_without_reads(model_dir, arch, monkeypatch):
    tr = _transformer(model_dir, arch)
    x, kw = _inputs(tr, arch, 2)
    plain = _euler(tr, x, kw, 5)
    run = RunCache(CacheSettings(threshold=0.0))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a read with the cache off"))
    cached = _euler(tr, x, kw, 5, run)
    assert torch.equal(plain, cached)
    assert run.stats() == {"computed": 10, "skipped": 0}
    # the lists are back as they were
    assert all(type(getattr(tr, n)) is torch.nn.ModuleList for n in LISTS[arch])


def test_equals_diffusers_first_block_cache(model_dir):
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    tr = _transformer(model_dir, "flux")
    x, kw = _inputs(tr, "flux", 1, seed=3)
    steps = 12
    rels = sorted(_rels(tr, x, kw, steps))
    threshold = rels[len(rels) // 2] * 1.01  # about half the calls are below it
    ref_tr = copy.deepcopy(tr)
    apply_first_block_cache(ref_tr, FirstBlockCacheConfig(threshold=threshold))
    ran = []
    ref_tr.transformer_blocks[1].attn.register_forward_pre_hook(lambda m, a: ran.append(1))
    with ref_tr.cache_context("cond"):
        ref = _euler(ref_tr, x, kw, steps)
    run = RunCache(CacheSettings(threshold=threshold, warmup=0, head=1, tail=0, max_skips=0))
    ours = _euler(tr, x, kw, steps, run)
    assert run.skipped > 0 and run.skipped == steps - len(ran)
    assert (ours - ref).abs().max() <= 1e-5
    # negative control: the cache changed the result (it did skip)
    assert (ours - _euler(tr, x, kw, steps)).abs().max() > 1e-4


def test_decisions_are_per_row(model_dir):
    tr = _transformer(model_dir, "flux")
    x, kw = _inputs(tr, "flux", 2, seed=5)
    steps = 10
    s = dict(warmup=1, max_skips=2)
    rels = sorted(_rels(tr, x[:1], {k: (v[:1] if k in ("encoder_hidden_states",
                                                           "pooled_projections", "guidance")
                                        else v) for k, v in kw.items()}, steps))
    threshold = rels[len(rels) // 2] * 1.01
    both = RunCache(CacheSettings(threshold=threshold, **s))
    out = _euler(tr, x, kw, steps, both)
    alone = []
    for i in range(2):
        run = RunCache(CacheSettings(threshold=threshold, **s))
        kwi = {k: (v[i:i + 1] if k in ("encoder_hidden_states", "pooled_projections", "guidance")
                   else v) for k, v in kw.items()}
        alone.append((_euler(tr, x[i:i + 1], kwi, steps, run), run.stats()))
    assert (out - torch.cat([a for a, _ in alone])).abs().max() <= 1e-5
    assert both.skipped == sum(st["skipped"] for _, st in alone) > 0
    # the rows did decide differently: one decision for the batch (diffusers' rule) could
    # not have reproduced both
    assert alone[0][1] != alone[1][1]


@pytest.mark.parametrize("arch,head,tail", [("sd3", 1, 0), ("flux", 1, 2), ("flux2", 1, 0),
                                            ("flux2", 2, 1), ("flux", 2, 0)])
def test_segments_across_lists_and_formats(model_dir, arch, head, tail):
    """Skipping everything after the warmup: the skipped calls add exactly the cached
    residuals of the last full call (checked against a run whose last full call is the
    reference); TaylorSeer changes only skipped calls."""
    tr = _transformer(model_dir, arch)
    x, kw = _inputs(tr, arch, 1, seed=7)
    steps = 6
    plain = _euler(tr, x, kw, steps)
    run = RunCache(CacheSettings(threshold=1e9, warmup=3, head=head, tail=tail, max_skips=0))
    cached = _euler(tr, x, kw, steps, run)
    assert run.stats() == {"computed": 3, "skipped": 3}
    assert torch.isfinite(cached).all() and (cached - plain).abs().max() > 0
    # the first 3 steps computed in full: equal to the plain run up to there
    assert torch.equal(_euler(tr, x, kw, 3, RunCache(CacheSettings(threshold=1e9, warmup=3,
                                                                    head=head, tail=tail))),
                       _euler(tr, x, kw, 3))
    taylor = RunCache(CacheSettings(threshold=1e9, warmup=3, head=head, tail=tail, max_skips=0,
                                    taylor=True))
    forecast = _euler(tr, x, kw, steps, taylor)
    assert (forecast - cached).abs().max() > 0


def test_bad_settings_are_one_line(model_dir):
    tr = _transformer(model_dir, "flux")
    n = sum(len(getattr(tr, name)) for name in LISTS["flux"])
    for s, msg in [(CacheSettings(threshold=-1), "threshold must be a number >= 0"),
                   (CacheSettings(threshold=0.1, head=0), "head blocks must be >= 1"),
                   (CacheSettings(threshold=0.1, head=3), "head blocks must be 1..2"),
                   (CacheSettings(threshold=0.1, head=1, tail=n - 1), "leave none"),
                   (CacheSettings(threshold=0.1, warmup=-1), "warmup must be an integer")]:
        with pytest.raises(ValueError, match=msg) as e:
            RunCache(s).call(tr, LISTS["flux"], [0])
        assert "\n" not in str(e.value)
