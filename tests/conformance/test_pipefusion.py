"""PipeFusion 2 for every family: with `warmup_steps >= steps` every step is a synchronous
pass through both stages, so it equals one rank (<= 1e-4 on every latent the family
denoises, a sound track's too; hence the family's pipeline);
pipelined (warmup 1 of 3, 2 patches), the patches reuse one-step-stale K/V: not the exact
result (negative control: the staleness is really used), yet close to it (relative L2 <= 5%).
Both stages are uneven (every block but the last on the first stage) and the token grid
does not split into equal bands.

Pipelined, the result is exactly its stale-K/V algorithm: it equals (<= 1e-4) a
single-process oracle of that algorithm on the family's diffusers transformer (each patch
its own fresh K/V, the other patches' latest: this step's for patches already computed, the
previous step's for the rest). The oracle is family-specific code (its text, noise,
schedule, band forward and attention processor); the family's builder names it as
`PIPEFUSION_ORACLE = dict(oracle="<test module>:<factory of the model folder>",
request={...})`, the request fields the oracle needs on top of the suite's small request.
The factory's `run(request, warmup, patches, refresh)` returns the final LATENT: a tensor,
or, for a family that denoises more than one latent (a video and its sound), a tuple of
them in the order of the pool's `Latents` fields; every one is compared. Negative control:
the oracle whose caches are never refreshed after warmup differs from the pool on every
latent.

With ulysses 2 inside each stage (4 ranks, under the NCCL-rules emulation) the same two
results hold: full warmup equals one rank, pipelined equals the stale-K/V oracle (the sp
ranks gather a patch's K/V before the cache refresh; a stream every rank keeps whole, LTX-2's
sound, takes part as its shard would), for every family: the 4-rank pool's launch and its
two jobs cost 3-5 s a family on the shared 2-core machine. Negative control: the sound's
attention left unexchanged between a stage's sp ranks is caught at full warmup.

A start image (image-to-video: Wan's and HunyuanVideo 1.5's join the noise along channels,
on their `i2v` test models; LTX-2's is the video's first latent frame, called at timestep 0
and kept) is no context token of the patches: at full warmup PipeFusion 2 equals one rank
(itself held to the image-to-video pipeline); where the family's own test model takes one
(LTX-2), pipelined equals the oracle given the same image, at sp 1 and with ulysses 2
inside each stage.
"""
from __future__ import annotations

import importlib

import pytest

from .cases import CASES, NCCL_RULES, TOL, families, maxdiff, params

REL_CLOSE = 0.05
_ORACLE_RUNS: dict = {}  # (arch, request, warmup, refresh) -> the oracle's latents


def _pipefusion_pool(arch, family_pools, warmup, sp: bool = False, hooks=(NCCL_RULES,)):
    """PipeFusion 2 (`sp`: with ulysses 2 inside each stage, under `hooks`)."""
    from comfyui_xdit import ParallelConfig
    blocks = family_pools.get(arch, ParallelConfig()).model_info.blocks
    if not sp:
        return family_pools.get(arch, CASES[arch].pipefusion(blocks, warmup))
    return family_pools.get(arch, CASES[arch].pipefusion_sp(blocks, warmup),
                            worker_hooks=list(hooks))


def _check_heads(arch, family_pools):
    from comfyui_xdit import ParallelConfig
    heads = family_pools.get(arch, ParallelConfig()).model_info.heads
    assert heads % 2 == 0, f"{arch}'s test model has {heads} heads; ulysses 2 needs even"


@pytest.mark.parametrize("arch", params("pipefusion"))
def test_full_warmup_equals_one_rank(arch, family_pools):
    c = CASES[arch]
    steps = c.request().steps
    # every latent the family denoises (a sound track's too)
    want = family_pools.one_rank(arch, c.request()).latents
    got = _pipefusion_pool(arch, family_pools, steps).generate(c.request()).latents
    d = maxdiff(got, want)
    print(f"{arch} PipeFusion 2, warmup {steps} of {steps}: {d:.2e} from 1 rank")
    assert d <= TOL, f"{arch}: {d:.3e}"


@pytest.mark.parametrize("arch", params("pipefusion"))
def test_pipelined_is_stale_but_close(arch, family_pools):
    c = CASES[arch]
    want = family_pools.one_rank(arch, c.request()).samples
    got = _pipefusion_pool(arch, family_pools, 1).generate(c.request()).samples
    d = maxdiff(got, want)
    rel = float((got - want).norm() / want.norm())
    print(f"{arch} PipeFusion 2, warmup 1: {d:.2e} max abs, {rel:.2%} relative L2 from 1 rank")
    # the exact run would fail a check at this distance (SD3's tiny model: 5e-4)
    assert d > 2 * TOL, f"{arch}: pipelined equals the exact run; nothing was stale"
    assert rel <= REL_CLOSE, f"{arch}: pipelined is {rel:.2%} away from the exact run"


def stale_kv_oracle(arch: str, folder):
    """(the family's oracle of PipeFusion's stale-K/V schedule on `folder`, its request's
    extra fields), from the builder's PIPEFUSION_ORACLE."""
    declared = importlib.import_module(f"comfyui_xdit.testmodels.{arch}").PIPEFUSION_ORACLE
    module, _, name = declared["oracle"].partition(":")
    return getattr(importlib.import_module(module), name)(folder), dict(declared["request"])


def as_latents(got, parts) -> dict:
    """The oracle's result named as the pool's latents (`got`: its `Latents`): one tensor is
    the samples; a tuple holds them all, in the fields' order."""
    names = [name for name, _ in got.items()]
    parts = parts if isinstance(parts, (list, tuple)) else (parts,)
    assert len(parts) == len(names), f"the oracle gives {len(parts)} latents, the pool {names}"
    return dict(zip(names, parts))


def oracle_run(arch, folder, req, refresh: bool = True):
    """The family's oracle, pipelined (warmup 1, 2 patches), once per request."""
    key = (arch, repr(req), refresh)
    if key not in _ORACLE_RUNS:
        _ORACLE_RUNS[key] = stale_kv_oracle(arch, folder)[0].run(req, 1, 2, refresh=refresh)
    return _ORACLE_RUNS[key]


def oracle_request(arch, **kw):
    """The suite's request with the fields the family's oracle needs."""
    declared = importlib.import_module(f"comfyui_xdit.testmodels.{arch}").PIPEFUSION_ORACLE
    return CASES[arch].request(**dict(declared["request"], **kw))


@pytest.mark.parametrize("arch", params("pipefusion_oracle"))
def test_pipelined_equals_its_stale_kv_oracle(arch, family_pools, model_dir):
    req = oracle_request(arch)
    got = dict(_pipefusion_pool(arch, family_pools, 1).generate(req).latents.items())
    want = as_latents(got, oracle_run(arch, model_dir(arch), req))
    frozen = as_latents(got, oracle_run(arch, model_dir(arch), req, refresh=False))
    d = maxdiff(got, want)
    far = {name: maxdiff(frozen[name], got[name]) for name in got}
    print(f"{arch} PipeFusion 2, warmup 1: {d:.2e} from its stale-K/V oracle "
          f"(never refreshed: {', '.join(f'{k} {v:.2e}' for k, v in far.items())})")
    assert d <= TOL, f"{arch}: pipelined PipeFusion {d:.3e} from its stale-K/V oracle"
    for name, f in far.items():
        assert f > 10 * TOL, f"{arch}: the oracle's refreshes change nothing in {name} ({f:.2e})"


@pytest.mark.parametrize("arch", params("pipefusion_sp"))
def test_sp_inside_a_stage_full_warmup_equals_one_rank(arch, family_pools):
    c = CASES[arch]
    _check_heads(arch, family_pools)
    steps = c.request().steps
    want = family_pools.one_rank(arch, c.request()).latents
    got = _pipefusion_pool(arch, family_pools, steps, sp=True).generate(c.request()).latents
    d = maxdiff(got, want)
    print(f"{arch} PipeFusion 2 x ulysses 2, warmup {steps} of {steps}: {d:.2e} from 1 rank")
    assert d <= TOL, f"{arch}: {d:.3e}"


@pytest.mark.parametrize("arch", params("pipefusion_sp"))
def test_sp_inside_a_stage_pipelined_equals_its_stale_kv_oracle(arch, family_pools,
                                                                 model_dir):
    _check_heads(arch, family_pools)
    req = oracle_request(arch)
    got = dict(_pipefusion_pool(arch, family_pools, 1, sp=True).generate(req).latents.items())
    d = maxdiff(got, as_latents(got, oracle_run(arch, model_dir(arch), req)))
    print(f"{arch} PipeFusion 2 x ulysses 2, warmup 1: {d:.2e} from its stale-K/V oracle")
    assert d <= TOL, f"{arch}: pipelined PipeFusion x ulysses {d:.3e} from its oracle"


def start_image():
    """An RGB start image of another size than the video's (the family resizes it)."""
    import numpy as np
    from PIL import Image
    rgb = np.random.RandomState(3).rand(50, 70, 3)
    return Image.fromarray((rgb * 255).astype("uint8"))


def start_image_model(arch, model_dir, tmp_path_factory):
    """The family's test model that takes a start image: its own (LTX-2's, optional), or
    its builder's `i2v` variant."""
    if families.family(arch).capability(families.ImageToVideo).optional:
        return model_dir(arch)
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model
    return ensure_tiny_model(arch, tmp_path_factory.getbasetemp() / "i2v", variant="i2v")


@pytest.mark.parametrize("arch", params("pipefusion_start_image"))
def test_start_image_full_warmup_equals_one_rank(arch, family_pools, model_dir,
                                                 tmp_path_factory):
    """Where the start image joins the noise along channels (Wan, HunyuanVideo 1.5) or is
    the video's first latent frame (LTX-2), it is no context token of the patches: PipeFusion
    2 at full warmup equals one rank given the same image."""
    from comfyui_xdit import ParallelConfig
    c = CASES[arch]
    folder = start_image_model(arch, model_dir, tmp_path_factory)
    req = c.request(reference_images=[start_image()])
    one = family_pools.get(arch, ParallelConfig(), path=folder).generate(req).latents
    blocks = family_pools.get(arch, ParallelConfig(), path=folder).model_info.blocks
    got = family_pools.get(arch, c.pipefusion(blocks, req.steps), path=folder).generate(
        req).latents
    d = maxdiff(got, one)
    print(f"{arch} start image: PipeFusion 2 full warmup {d:.2e} from 1 rank")
    assert d <= TOL, f"{arch}: start image, full warmup {d:.3e} from one rank"


@pytest.mark.parametrize("arch", params("pipefusion_start_image_oracle"))
def test_start_image_pipelined_equals_its_stale_kv_oracle(arch, family_pools, model_dir):
    """Pipelined from a start image, at sp 1 and with ulysses 2 inside each stage, equal
    to the oracle given the same image; negative control: the image moves the result."""
    image = [start_image()]
    req = oracle_request(arch, reference_images=image)
    got = {}
    for name, sp in (("", False), (" x ulysses 2", True)):
        got[name] = dict(_pipefusion_pool(arch, family_pools, 1, sp=sp).generate(req)
                         .latents.items())
    want = as_latents(got[""], oracle_run(arch, model_dir(arch), req))
    d = {name: maxdiff(g, want) for name, g in got.items()}
    moved = maxdiff(got[""], as_latents(got[""], oracle_run(arch, model_dir(arch),
                                                           oracle_request(arch))))
    print(f"{arch} start image, pipelined: "
          f"{', '.join(f'PipeFusion 2{k} {v:.2e}' for k, v in d.items())} from its "
          f"stale-K/V oracle (the oracle without the image: {moved:.2e})")
    for name, v in d.items():
        assert v <= TOL, f"{arch}: start image, PipeFusion 2{name} {v:.3e} from its oracle"
    assert moved > 10 * TOL, f"{arch}: the start image changes nothing ({moved:.2e})"


@pytest.mark.parametrize("arch", [a for a in CASES if any(
    s.denoised for s in families.family(a).tokens.streams)])
def test_negative_control_sound_not_exchanged_inside_a_stage_is_caught(arch, family_pools):
    """The full-warmup check fails where the sound's attention is left to each sp rank's
    own shard of the other streams (xdit_testhooks.faults.pipefusion_local_sound)."""
    c = CASES[arch]
    steps = c.request().steps
    want = family_pools.one_rank(arch, c.request()).latents
    pool = _pipefusion_pool(arch, family_pools, steps, sp=True,
                            hooks=["xdit_testhooks.faults:pipefusion_local_sound"])
    d = maxdiff(pool.generate(c.request()).latents, want)
    print(f"{arch} PipeFusion 2 x ulysses 2, sound not exchanged: {d:.2e} from 1 rank")
    assert d > 10 * TOL, f"{arch}: the unexchanged sound went unnoticed ({d:.2e})"
