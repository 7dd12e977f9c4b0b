"""docs/design.md#numerics-rule-6: a prompt's result never depends on its batch mates.

For every family and every exact method (1 rank, Ulysses 2, Ring 2, CFG parallel; and
PipeFusion 2, whose algorithm is the same for a row alone or batched, for the families that
pad a batch's prompts to the longest): row 0 of the batch
[A, B] equals [A] alone (fp32, <= 1e-4 on the final LATENT), where A, B and the negative
prompt have three different token lengths. ComfyUI's noise makes row 0 of a batch the
batch-1 noise (for a nested AV LATENT the sound's noise follows the whole batch's video, so
the test gives [A] alone row 0's noise of the batch). Every latent the family returns is
compared (a video's sound too). Families whose
prompts of one batch are padded to the longest (Chroma, Qwen-Image) depend on each row
carrying its own text length to the attention; the others pad every prompt to
max_sequence_length and must stay independent too.

Negative control: with the sharded attention keeping padded keys (the `keep_padding`
fault), a Chroma row sees its batch mate's padding and the check fails.
"""
from __future__ import annotations

import json

import pytest

from comfyui_xdit import GenerationRequest, ParallelConfig
from comfyui_xdit.comfy_convert import job_noise
from family_requests import A, B, NEGATIVE, small_request

from .cases import CASES, NCCL_RULES, params

TOL = 1e-4
# one rank and the two-rank methods (on the suite's NCCL-rules pools); PipeFusion 2 (the
# suite's pipelined split) only for the families that pad a batch's prompts to the longest,
# where its patch attention must keep per-row text too
CONFIGS = {
    "1 rank": ParallelConfig(),
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
}


def request(arch: str, prompts, **kw) -> GenerationRequest:
    return small_request(arch, prompts, **kw)


def _pool(family_pools, arch, name):
    if name == "pipefusion2":
        blocks = family_pools.get(arch, ParallelConfig()).model_info.blocks
        return family_pools.get(arch, CASES[arch].pipefusion(blocks, 1))
    config = CONFIGS[name]
    hooks = {"worker_hooks": [NCCL_RULES]} if config.ranks > 1 else {}
    return family_pools.get(arch, config, **hooks)


def _token_counts(folder) -> list:
    """Token counts of A, B and the negative prompt under each tokenizer of the folder."""
    from transformers import AutoTokenizer
    index = json.loads((folder / "model_index.json").read_text())
    out = []
    for name in sorted(k for k in index if k.startswith("tokenizer")):
        tok = AutoTokenizer.from_pretrained(str(folder / name))
        out.append([len(tok(t).input_ids) for t in (A, B, NEGATIVE)])
    return out


def row0_distance(pool, arch: str) -> tuple:
    """(max |row 0 of [A, B] - [A] alone|, max |row 1 - row 0|) on `pool`."""
    # row 0's noise given to [A] alone: a nested (AV) LATENT's noise draws the sound after
    # the whole batch's video, so the seed alone would give row 0 other sound noise
    req = request(arch, [A, B])
    noise = job_noise(arch, req.seed, 2, req.height, req.width, req.frames)
    first = tuple(n[:1] for n in noise) if isinstance(noise, tuple) else noise[:1]
    alone = pool.generate(request(arch, [A]), noise=first).latents
    both = pool.generate(req, noise=noise).latents
    assert both.samples.shape[0] == 2 and both.samples.shape[1:] == alone.samples.shape[1:]
    fields = [name for name, _ in both.items()]  # the video and, with it, its sound
    return (max(float((getattr(both, f)[:1] - getattr(alone, f)).abs().max()) for f in fields),
            max(float((getattr(both, f)[1] - getattr(both, f)[0]).abs().max()) for f in fields))


@pytest.mark.parametrize("arch", params("batch_independence"))
def test_row_equals_the_prompt_alone(arch, model_dir, family_pools):
    counts = _token_counts(model_dir(arch))
    assert any(len(set(c)) == 3 for c in counts), f"A, B, negative token counts {counts}"
    # PipeFusion where the family runs it (not where its builder exempts it)
    names = list(CONFIGS) + (["pipefusion2"] if CASES[arch].padded
                             and "pipefusion" not in CASES[arch].exempt else [])
    for name in names:
        err, apart = row0_distance(_pool(family_pools, arch, name), arch)
        print(f"{arch} {name}: row 0 of [A, B] vs [A] alone {err:.2e} "
              f"(row 1 vs row 0 {apart:.2e})")
        assert apart > 1e-3, f"{arch} {name}: B's row equals A's; the test proves nothing"
        assert err <= TOL, f"{arch} {name}: row 0 depends on its batch mate ({err:.2e})"


@pytest.mark.parametrize("arch", [p for p in params("batch_independence")
                                  if CASES[p.values[0]].padded])
def test_row_equals_the_prompt_alone_with_the_step_cache(arch, family_pools):
    """The step cache decides per row, and a row's decision reads its own tokens only:
    with the cache skipping, row 0 of [A, B] still equals [A] alone (Ulysses 2)."""
    cache = {"threshold": 0.5, "warmup": 1, "head": 1, "tail": 0, "max_skips": 3}
    pool = _pool(family_pools, arch, "ulysses2")
    alone = pool.generate(request(arch, [A], cache=cache, steps=6))
    both = pool.generate(request(arch, [A, B], cache=cache, steps=6))
    assert alone.stats[0]["cache"]["skipped"] > 0, alone.stats[0]["cache"]
    err = float((both.samples[:1] - alone.samples).abs().max())
    print(f"{arch} ulysses2 + step cache: row 0 of [A, B] vs [A] alone {err:.2e}")
    assert err <= TOL


def test_negative_control_a_row_that_sees_its_mates_padding(family_pools):
    """Chroma pads the batch's prompts to the longest: with padded keys kept in the
    attention, row 0 attends to the pad tokens B's length gave it, and moves."""
    pool = family_pools.get("chroma", ParallelConfig(ulysses=2),
                            worker_hooks=["xdit_testhooks.faults:keep_padding"])
    err, _ = row0_distance(pool, "chroma")
    print(f"chroma ulysses2, padded keys kept: row 0 vs alone {err:.2e}")
    assert err > 10 * TOL
