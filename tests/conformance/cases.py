"""Each registered family's conformance case: the request the suite runs and the capabilities
it checks, read from the registry and from the family's test-model builder, never listed.

A family's builder (comfyui_xdit/testmodels/<id>.py) declares its small request as
`TEST_REQUEST` (tests/family_requests.py: an image size whose tokens split unevenly, the text
length, whether a batch pads its prompts to the longest). Every capability below applies to
every family; a family that cannot have one declares it in its builder as
`CONFORMANCE_EXEMPT = {"capability": "why"}`, so an exemption is written where the family
lives, with its reason, and shows in the test ids as a skip with that reason. A new family
joins the suite by being registered.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from comfyui_xdit import ParallelConfig
from family_requests import A, B, IDS, families, settings, small_request

TOL = 1e-4
PROMPTS = [A, B, "a small red house"]  # three rows of three text lengths: dp 2 splits them unevenly

# every capability the suite checks, with the layouts that check it
TWO_RANKS = {
    "ulysses2": ParallelConfig(ulysses=2),
    "ring2": ParallelConfig(ring=2),
    "cfg2": ParallelConfig(cfg_parallel=True),
    "dp2": ParallelConfig(dp=2),
}
FOUR_RANKS = {
    "ulysses2xring2": ParallelConfig(ulysses=2, ring=2),
    "cfg2xring2": ParallelConfig(cfg_parallel=True, ring=2),
    "cfg2xulysses2": ParallelConfig(cfg_parallel=True, ulysses=2),
    "dp2xulysses2": ParallelConfig(dp=2, ulysses=2),
    "ring4": ParallelConfig(ring=4),
    "ulysses4": ParallelConfig(ulysses=4),  # where 4 divides the head count
}
SHARDED = {"sharded-ulysses2": ParallelConfig(ulysses=2), "sharded-dp2": ParallelConfig(dp=2)}
CAPABILITIES = ("sequence_parallel", "cfg_parallel", "data_parallel", "hybrid",
                "weight_sharding", "pipefusion", "step_cache", "model_call",
                "batch_independence", "lora", "single_file", "pipefusion_oracle",
                "pipefusion_sp", "pipefusion_start_image", "pipefusion_start_image_oracle")
NCCL_RULES = "xdit_testhooks.nccl_rules:install"


@dataclass(frozen=True)
class Case:
    arch: str
    padded: bool  # a batch's prompts are padded to the longest (rows carry their lengths)
    exempt: dict = field(default_factory=dict)  # capability -> why the family lacks it
    # where one rank is held to the family's diffusers pipeline (its builder's ORACLE_TEST,
    # "file::test"): the oracle is family-specific code (noise layout, packing, the
    # pipeline's own arguments), so it lives in the family's own test file
    oracle: str = ""

    def request(self, prompts=PROMPTS, **kw):
        return small_request(self.arch, prompts, **kw)

    def pipefusion(self, blocks: int, warmup: int) -> ParallelConfig:
        """PipeFusion 2, 2 patches, every block but the last on the first stage: a split
        every family runs (Z-Image's test model needs its refiners and a main block on the
        first stage, which the balanced split does not give)."""
        return ParallelConfig(pipefusion=2, warmup_steps=warmup, pipeline_patches=2,
                              pipefusion_split=f"{blocks - 1},1")

    def pipefusion_sp(self, blocks: int, warmup: int) -> ParallelConfig:
        """The same pipeline with ulysses 2 inside each stage (4 ranks)."""
        import dataclasses
        return dataclasses.replace(self.pipefusion(blocks, warmup), ulysses=2)


def _derived_exemptions(arch: str) -> dict:
    """Capabilities a family lacks by what the registry says of it, with the reason: a
    start image under PipeFusion runs where the family makes video from one (on its test
    model's `i2v` variant where that is another model), and its stale-K/V oracle takes it
    where the family's own test model takes one (optional)."""
    fam = families.family(arch)
    out = {}
    i2v = fam.capability(families.ImageToVideo)
    if i2v is None:
        out["pipefusion_start_image"] = f"{fam.name} makes no video from a start image"
    if i2v is None or not i2v.optional:
        out["pipefusion_start_image_oracle"] = (f"{fam.name}'s test model takes no start "
                                                f"image (its oracle runs text-to-video)")
    return out


def case(arch: str) -> Case:
    builder = importlib.import_module(f"comfyui_xdit.testmodels.{arch}")
    exempt = dict(_derived_exemptions(arch), **getattr(builder, "CONFORMANCE_EXEMPT", {}))
    if "pipefusion" in exempt:  # no PipeFusion: none of its checks
        for cap in ("pipefusion_oracle", "pipefusion_sp", "pipefusion_start_image",
                    "pipefusion_start_image_oracle"):
            exempt.setdefault(cap, exempt["pipefusion"])
    unknown = set(exempt) - set(CAPABILITIES)
    assert not unknown, f"{arch} exempts unknown capabilities {unknown}"
    assert families.family(arch) is not None
    return Case(arch, bool(settings(arch)["padded"]), exempt,
                getattr(builder, "ORACLE_TEST", ""))


CASES = {arch: case(arch) for arch in IDS}


def params(capability: str, layouts: dict | None = None) -> list:
    """pytest params: (arch) or (arch, layout name), one per family (x layout); a family that
    exempts `capability` gets a skip that says why."""
    import pytest
    out = []
    for arch, c in CASES.items():
        marks = [pytest.mark.skip(reason=f"{arch}: {c.exempt[capability]}")] \
            if capability in c.exempt else []
        if layouts is None:
            out.append(pytest.param(arch, marks=marks, id=arch))
        else:
            out += [pytest.param(arch, name, marks=marks, id=f"{arch}-{name}")
                    for name in layouts]
    return out


def maxdiff(a, b) -> float:
    """Max abs difference of two tensors, or of two results' Latents field by field (a
    family with a sound track: the video latent and the sound latent each)."""
    if hasattr(a, "items"):
        fa, fb = dict(a.items()), dict(b.items())
        assert fa.keys() == fb.keys(), (list(fa), list(fb))
        return max(maxdiff(fa[k], fb[k]) for k in fa)
    if isinstance(a, (list, tuple)):  # a LATENT of parts (a MODEL call's): part by part
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (type(b), len(a))
        return max(maxdiff(pa, pb) for pa, pb in zip(a, b))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())
