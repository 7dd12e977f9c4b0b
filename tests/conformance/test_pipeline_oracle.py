"""Every registered family has its one-rank test against its diffusers pipeline
(docs/design.md#numerics-rule-4), so that "every method equals one rank" (this suite) means
"every method equals the pipeline". The oracle is family-specific code and lives in the
family's own test file; its test-model builder's `ORACLE_TEST` says where, and this checks
that the test is there and that its module (or the shared oracle in tests/conftest.py) runs
the family's pipeline class.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from family_requests import families

from .cases import CASES

TESTS = Path(__file__).resolve().parent.parent


def missing_oracle(arch: str, where: str | None) -> str:
    """What is wrong with `where` as `arch`'s oracle test ("" if nothing)."""
    if not where:
        return (f"{arch}: no one-rank oracle test declared (ORACLE_TEST in "
                f"comfyui_xdit/testmodels/{arch}.py)")
    file, _, name = where.partition("::")
    path = TESTS / file
    if not path.exists():
        return f"{arch}: {file} does not exist"
    text = path.read_text()
    names = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    if name not in names:
        return f"{arch}: {file} has no {name}"
    pipeline = families.family(arch).classes.pipelines[0]
    if pipeline not in text and pipeline not in (TESTS / "conftest.py").read_text():
        return f"{arch}: {file} never names {pipeline}"
    return ""


@pytest.mark.parametrize("arch", list(CASES))
def test_every_family_has_its_pipeline_oracle(arch):
    problem = missing_oracle(arch, CASES[arch].oracle)
    assert not problem, problem


def test_the_oracle_check_can_fail():
    assert "no one-rank oracle" in missing_oracle("flux", None)
    assert "has no" in missing_oracle("flux", "test_chroma.py::test_not_there")
    assert "never names ZImagePipeline" in missing_oracle(
        "z_image", "test_chroma.py::test_one_rank_matches_the_pipeline")
