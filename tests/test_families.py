"""A model family is two files: its description (workers/families/<id>.py) and its worker
adapter (workers/models/<id>.py), plus its tiny test model's builder
(comfyui_xdit/testmodels/<id>.py). This test keeps it so: no other module of the product
(comfyui_xdit/, workers/) or of the test hooks names a family to branch on it (a
comparison, a membership test, a dict keyed by family, a subscript or a default argument).
The benchmarks (which build and name their own FLUX- and SD3-shaped models) and the tests
may."""
from __future__ import annotations

import ast
import pathlib

import pytest

from comfyui_xdit.bridge import worker_module

ROOT = pathlib.Path(__file__).resolve().parent.parent
families = worker_module("families")
IDS = set(families.IDS)
SCANNED = ("comfyui_xdit", "workers", "xdit_testhooks")
ALLOWED = ({f"workers/families/{i}.py" for i in IDS} | {f"workers/models/{i}.py" for i in IDS}
           | {f"comfyui_xdit/testmodels/{i}.py" for i in IDS})


def _allowed(rel: str) -> bool:
    return rel in ALLOWED or rel.startswith("workers/families/_")


def _is_id(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in IDS


def _ids_in(node) -> list:
    """Family names in `node` itself or in a tuple / list / set literal it is."""
    if _is_id(node):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e for e in node.elts if _is_id(e)]
    return []


def branches(source: str) -> list:
    """(line, what) of every place `source` names a family to decide something."""
    out = []
    for node in ast.walk(ast.parse(source)):
        found = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                found += _ids_in(side)
        elif isinstance(node, ast.Dict):
            found += [k for k in node.keys if k is not None and _is_id(k)]
        elif isinstance(node, ast.Subscript):
            found += _ids_in(node.slice)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += [d for d in node.args.defaults + node.args.kw_defaults
                      if d is not None and _is_id(d)]
        out += [(n.lineno, n.value) for n in found]
    return out


def test_the_scan_catches_each_kind_of_branch():
    fam = sorted(IDS)[0]
    for src in (f"x = a == {fam!r}", f"x = a in ({fam!r}, 'zz')", f"d = {{{fam!r}: 1}}",
                f"y = t[{fam!r}]", f"def f(arch={fam!r}): pass", f"x = {fam!r} != b"):
        assert branches(src), src
    assert not branches(f"f = family({fam!r})\nname = 'other'\nx = a == 'other'")


def test_no_module_outside_the_families_branches_on_a_family_name():
    bad = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if _allowed(rel):
                continue
            bad += [f"{rel}:{line} names {name!r}" for line, name in branches(path.read_text())]
    assert not bad, ("family names outside the family descriptions and adapters (ask "
                     "workers/families instead):\n" + "\n".join(bad))


@pytest.mark.parametrize("fid", sorted(IDS))
def test_each_family_is_its_files_and_complete(fid):
    fam = families.family(fid)
    assert (ROOT / "workers" / "families" / f"{fid}.py").is_file()
    assert (ROOT / "workers" / "models" / f"{fid}.py").is_file()
    assert (ROOT / "comfyui_xdit" / "testmodels" / f"{fid}.py").is_file()  # tiny_model's builder
    assert fam.id == fid and fam.name and fam.blocks.lists and fam.classes.pipelines
    assert fam.latent.channels > 0 and fam.latent.pixels_per_token % 16 == 0  # LTX-2: 32
    det = fam.detection
    assert det.markers and det.config_from_shapes is not None and det.released is not None
    assert len(fam.blocks.counts) == len(fam.blocks.lists)
    assert not fam.blocks.bfl or len(fam.blocks.bfl) == len(fam.blocks.lists)
    assert families.BY_CLASS[fam.classes.transformer] is fam
    for naming, _ in det.markers:
        assert naming in ("bfl", "diffusers")


def test_families_are_discovered_from_their_modules():
    """The registry is filled by the family modules themselves (a new family is its module,
    not an entry in a list elsewhere), in their declared order."""
    modules = {p.stem for p in (ROOT / "workers" / "families").glob("*.py")
               if not p.stem.startswith("_")}
    assert set(families.IDS) == modules
    orders = [families.FAMILIES[i].order for i in families.IDS]
    assert orders == sorted(orders)
    assert "_IDS" not in (ROOT / "workers" / "families" / "__init__.py").read_text()


# the stream flags the family's token layout will hold (one core field, `layout`)
LAYOUT_FLAGS = {"text_in_sequence", "pad_multiple", "pipefusion_references", "odd_references"}


def test_a_family_is_a_small_core_and_optional_capabilities():
    """`Family` holds what every family has (at most 12 fields, the layout's flags counted
    as the one field they are becoming); what only some have is a capability, at most one of
    each kind, looked up by kind (None where the family lacks it)."""
    import dataclasses

    core = [f.name for f in dataclasses.fields(families.Family) if f.name not in LAYOUT_FLAGS]
    assert len(core) + bool(LAYOUT_FLAGS & {f.name for f in dataclasses.fields(
        families.Family)}) <= 12, core
    kinds = families.CAPABILITIES
    for fam in families.FAMILIES.values():
        held = [type(c) for c in fam.capabilities]
        assert len(set(held)) == len(held) and set(held) <= set(kinds), (fam.id, held)
        for kind in kinds:
            got = fam.capability(kind)
            assert (got is None) == (kind not in held), (fam.id, kind)
            assert got is None or isinstance(got, kind)
    # every kind is some family's (no dead capability) and a family without any is valid
    assert {type(c) for f in families.FAMILIES.values() for c in f.capabilities} == set(kinds)
    bare = dataclasses.replace(families.family("sd3"), capabilities=())
    assert all(bare.capability(k) is None for k in kinds)
    refs = families.References(methods=("index",))
    with pytest.raises(TypeError, match="one of each"):
        dataclasses.replace(bare, capabilities=(refs, refs))
    with pytest.raises(TypeError, match="one of each"):
        dataclasses.replace(bare, capabilities=("not a capability",))


def test_each_capability_is_read_through_its_kind():
    """A capability is read where it is needed, by its kind (`capability(families.X)`):
    each kind has a reader in the product, and no module reads a family field that moved
    into one (the scan's negative control: a moved name is found in a snippet)."""
    moved = ("reference_methods", "reference_image_size", "image_to_video", "expert_boundary",
             "causal_vae", "vae_whole_video", "presets", "model_cfg_first", "lora_formats",
             "needs_pooled", "text_2_conditioning", "text_extra_tokens", "undistilled_cfg")
    import re
    pattern = re.compile(r"(?:\b(?:fam|family|f|FAMILY)|\))\.(" + "|".join(moved) + r")\b")
    assert pattern.search("x = self.family.expert_boundary(cfg)")
    assert not pattern.search("x = self.reference_methods()")  # the adapter's method
    source = {p.relative_to(ROOT).as_posix(): p.read_text()
              for top in SCANNED + ("benchmarks",) for p in (ROOT / top).rglob("*.py")}
    stale = [f"{rel}: .{m.group(1)}" for rel, text in source.items()
             for m in pattern.finditer(text)]
    assert not stale, stale
    product = "\n".join(t for rel, t in source.items() if not rel.startswith("workers/families/"))
    unread = [k.__name__ for k in families.CAPABILITIES
              if f"families.{k.__name__})" not in product]
    assert not unread, f"capabilities no module reads: {unread}"


def test_fp8_files_cover_every_familys_blocks():
    """The fp8 test files quantise the Linears inside every family's block lists, in both
    namings, as the registry names them (a new family's blocks are covered without editing
    fp8_file)."""
    from comfyui_xdit.testmodels.fp8_file import block_prefixes

    prefixes = block_prefixes()
    assert len(prefixes) == len(set(prefixes))
    for fam in families.FAMILIES.values():
        for name in fam.blocks.lists + fam.blocks.bfl:
            assert f"{name}." in prefixes, (fam.id, name)
    assert "double_blocks." in prefixes and "blocks." in prefixes  # BFL and Wan's names
    assert not any(p.startswith(("img_in", "txt_in", "proj_out")) for p in prefixes)


def test_an_unsupported_scheduler_is_told_which_family_runs_which():
    """The scheduler message lists the families by their released schedulers, from the
    registry: each family is named once."""
    from diffusers import DDIMScheduler

    check = worker_module("sampling.denoise").check_scheduler
    with pytest.raises(ValueError, match="is not supported") as e:
        check(DDIMScheduler())
    for fam in families.FAMILIES.values():
        assert str(e.value).count(fam.name) == 1, (fam.name, str(e.value))


def test_pipefusion_validates_every_denoised_stream_with_sp_and_a_start_image():
    """PipeFusion carries a stream denoised beside the latent's (a sound track) with the
    text: every family that declares one, kept whole on every rank or sharded, validates at
    pipefusion alone, with ulysses and with ring inside a stage, and, where it takes a start
    image, with one (the conformance suite runs them: tests/conformance/test_pipefusion.py).
    Negative control: a start image where the family takes none is refused in one line."""
    from PIL import Image

    from comfyui_xdit import GenerationRequest, ParallelConfig
    from comfyui_xdit.errors import ConfigError
    from comfyui_xdit.planning.model_info import ModelInfo

    fams = [families.family(i) for i in sorted(IDS)]
    denoised = [f for f in fams if any(s.denoised for s in f.tokens.streams)]
    whole = [f for f in denoised if any(s.denoised and not s.sharded for s in f.tokens.streams)]
    assert denoised and whole, "no registered family denoises a second stream (kept whole)"
    for fam in denoised:
        frames = fam.latent.video_frames(2) if fam.latent.video else 1
        info = ModelInfo(path="/nowhere", arch=fam.id, heads=4, patch_size=1, blocks=8)
        size = dict(height=128, width=128, frames=frames, steps=2)
        req = GenerationRequest(prompt=["a"], **size)
        start = GenerationRequest(prompt=["a"], reference_images=[Image.new("RGB", (128, 128))],
                                  **size)
        for config in (ParallelConfig(pipefusion=2), ParallelConfig(pipefusion=2, ulysses=2),
                       ParallelConfig(pipefusion=2, ring=2)):
            config.validate(info, req)
        takes_start = fam.capability(families.ImageToVideo) is not None \
            or fam.capability(families.References) is not None
        if takes_start:  # a model of the family that takes a start image (LTX-2's: any)
            i2v = ModelInfo(path="/nowhere", arch=fam.id, heads=4, patch_size=1, blocks=8,
                            start_image=True)
            ParallelConfig(pipefusion=2, ulysses=2).validate(i2v, start)
        else:
            with pytest.raises(ConfigError) as e:
                ParallelConfig(pipefusion=2).validate(info, start)
            assert "\n" not in str(e.value)
