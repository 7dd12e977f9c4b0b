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
    assert fam.id == fid and fam.name and fam.block_lists and fam.pipelines
    assert fam.latent.channels > 0 and fam.latent.pixels_per_token == 16
    assert fam.markers and fam.config_from_shapes is not None and fam.released is not None
    assert len(fam.block_counts) == len(fam.block_lists)
    assert families.BY_CLASS[fam.transformer_class] is fam
    for naming, _ in fam.markers:
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
