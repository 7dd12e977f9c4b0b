"""The README and docs/ as a user's first hour meets them: every link and #anchor lands inside
the repository, every `hf download` command is one the installed hub client accepts, every
documented `python -m comfyui_xdit` command parses (the cheap ones run), every CLI option
says what it does, the package installs a working `comfyui-xdit` command, and the table of
files the example workflows load is the script's current output. Nothing is downloaded."""
from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---- links and anchors ---------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, lower
    case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors_of(text: str) -> set:
    """The anchors of a Markdown text's headings (a repeated heading gets -1, -2, ...)."""
    out, seen = set(), {}
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list:
    """Link targets in the prose (code blocks and code spans hold no links)."""
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", text)))


def broken_links(doc: Path, text: str) -> list:
    """What is wrong with each relative link of `doc` (whose text is `text`)."""
    bad = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... leave the repo by design
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        try:
            dest.relative_to(ROOT)
        except ValueError:
            bad.append(f"{target}: outside the repository")
            continue
        if file and not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor:
            heads = anchors_of(text) if not file else anchors_of(dest.read_text()) \
                if dest.suffix == ".md" else set()
            if anchor not in heads:
                bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    return bad


def test_slugs_follow_github():
    assert slug("Example workflows: the files they need") == "example-workflows-the-files-they-need"
    assert slug("Models: where they go") == "models-where-they-go"
    assert slug("Wan (video)") == "wan-video"
    assert slug("`python -m comfyui_xdit` commands") == "python--m-comfyui_xdit-commands"
    assert anchors_of("# A b\n## A b\n```\n# not a heading\n```\n") == {"a-b", "a-b-1"}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_and_anchors_resolve_inside_the_repository(doc):
    bad = broken_links(doc, doc.read_text())
    assert not bad, f"{_rel(doc)}: " + "; ".join(bad)


def test_the_link_check_can_fail():
    doc = ROOT / "docs" / "negative-control.md"
    text = ("# Top\n[a](../README.md#no-such-heading) [b](../../elsewhere.md) [c](#top) "
            "[d](#nowhere) [e](missing.md) [f](../README.md#for-developers) `[g](#code)`\n")
    assert broken_links(doc, text) == [
        "../README.md#no-such-heading: no heading #no-such-heading in README.md",
        "../../elsewhere.md: outside the repository",
        "#nowhere: no heading #nowhere in docs/negative-control.md",
        "missing.md: no such file"]


def test_no_pointer_leaves_the_repository():
    """Not even as text: a reader of the repository has nothing beside it."""
    for doc in DOCS:
        text = doc.read_text()
        for pattern in (r"\.\./shared", r"/w[o]rk/", r"\bDESIGN\.md\b", r"steering repository",
                        r"the issue's"):
            assert not re.search(pattern, text), f"{_rel(doc)} mentions {pattern!r}"


# ---- commands in the docs ------------------------------------------------------------------

def shell_commands() -> list:
    """(doc, command) for every shell command in a code block or code span, continuation
    lines joined, comments dropped, `&&` chains split."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        chunks = FENCE.findall(text)
        chunks += [m.replace("\n", " ") for m in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
        for chunk in chunks:
            chunk = re.sub(r"\\\n\s*", " ", chunk)
            for line in chunk.splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()
                for part in line.split("&&"):
                    out.append((doc, part.strip()))
    return out


def _commands(prefixes) -> list:
    return [(d, c) for d, c in shell_commands() if c.startswith(prefixes)]


def _hf() -> str:
    """The hub client's `hf` next to this Python (the venv's), else on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("hf", path=path)


def test_no_retired_hub_command():
    for doc in DOCS:
        assert "huggingface-cli" not in doc.read_text(), (
            f"{_rel(doc)}: huggingface_hub >= 1.0 has no huggingface-cli; use `hf download`")


def test_hf_download_commands_fit_the_installed_client():
    """Each `hf download REPO [FILE] --opt ...` uses only options `hf download --help` lists
    (parsed from the help text; nothing is fetched), and names a repository owner/name."""
    found = _commands(("hf download",))
    assert len(found) >= 3, "the README, comfyui.md and workflow-files.md show hf download"
    hf = _hf()
    if hf is None:
        pytest.skip("no `hf` command here (huggingface_hub's CLI, installed with diffusers)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_COLOR="1", HF_HUB_DISABLE_TELEMETRY="1")
    help_text = subprocess.run([hf, "download", "--help"], capture_output=True, text=True,
                               env=env, timeout=120).stdout
    options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text))
    assert "--local-dir" in options, help_text
    for doc, cmd in found:
        words = shlex.split(cmd)[2:]
        assert words and re.fullmatch(r"[\w.-]+/[\w.-]+", words[0]), f"{_rel(doc)}: {cmd}"
        used = {w.split("=")[0] for w in words if w.startswith("-")}
        assert used <= options, f"{_rel(doc)}: {cmd}: {sorted(used - options)} not in hf download"


def _parser():
    from comfyui_xdit.cli.commands import build_parser
    return build_parser()


def _subparsers(parser) -> dict:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _bench_parser():
    from benchmarks.cli import add_arguments
    p = argparse.ArgumentParser(prog="bench")
    add_arguments(p)
    return p


# Documented commands that are not run here, and why (each parses all the same).
NOT_RUN = {
    "demo": "starts 2 CPU workers and runs 3 jobs (about a minute): tests/test_cli.py runs it",
    "generate": "needs a model folder (a download, or tiny-model first): tests/test_cli.py",
    "trained-model": "trains for minutes (tests/test_trained_model.py runs a short recipe)",
    "bench": "times jobs for minutes (tests/test_bench.py)",
    "serve": "a worker entry point under torchrun, for GPUs (tests/test_attach.py)",
    "status": "needs a running pool (tests/test_attach.py)",
    "tiny-model": "writes a model folder to disk: tests/test_tiny_model.py builds each arch",
}


def _synopsis(cmd: str) -> bool:
    """A usage line ([optional], a|b, ...) rather than a command to paste."""
    return bool(re.search(r"\[|\||\.\.\.|\(", cmd))


def documented_cli() -> list:
    found = []
    for doc, cmd in _commands(("python -m comfyui_xdit", "comfyui-xdit")):
        argv = shlex.split(cmd)
        argv = argv[3:] if argv[0] == "python" else argv[1:]
        found.append((doc, cmd, argv))
    return found


def test_documented_commands_parse():
    """Every command the docs show (not the usage synopses) is one the CLI accepts."""
    parser, checked = _parser(), 0
    for doc, cmd, argv in documented_cli():
        if _synopsis(cmd) or not argv or "--help" in argv:  # --help: test_help_... runs it
            continue
        try:
            if argv[0] == "bench":
                _bench_parser().parse_args(argv[1:])
            else:
                parser.parse_args(argv)
        except (SystemExit, Exception) as e:  # the CLI's parser raises ConfigError
            pytest.fail(f"{_rel(doc)}: `{cmd}` does not parse: {e}")
        checked += 1
    assert checked >= 8


def test_cheap_documented_commands_run(capsys):
    """memory-plan is arithmetic: run each documented one (0: fits or a table; 1 where the
    doc quotes it as a refusal, "`...` refuses it (exit 1)"). The others are skipped for the
    reasons in NOT_RUN."""
    from comfyui_xdit.cli.commands import main
    ran, skipped = 0, set()
    for doc, cmd, argv in documented_cli():
        if not argv or _synopsis(cmd) or "--help" in argv:
            continue
        if argv[0] != "memory-plan":
            assert argv[0] in NOT_RUN, f"{_rel(doc)}: `{cmd}`: run it here or say why not"
            skipped.add(argv[0])
            continue
        refused = f"`{cmd}` refuses it (exit 1)" in Path(doc).read_text()
        assert main(argv) == (1 if refused else 0), f"{_rel(doc)}: `{cmd}`"
        capsys.readouterr()
        ran += 1
    assert ran >= 5, "the README's and docs' memory-plan tables"
    print("not run:", {k: NOT_RUN[k] for k in sorted(skipped)})


def _run(argv, cwd, env=None):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_help_of_every_command_runs():
    """`python -m comfyui_xdit [COMMAND] --help` from the repository root: exit 0, usage out,
    the top level naming the outputs a user gets (PNG, Wan's .mp4)."""
    top = _run([sys.executable, "-m", "comfyui_xdit", "--help"], ROOT)
    assert top.returncode == 0 and "usage:" in top.stdout, top.stderr
    assert ".png" in top.stdout and ".mp4" in top.stdout and "Wan" in top.stdout
    for name in _subparsers(_parser()):
        r = _run([sys.executable, "-m", "comfyui_xdit", name, "--help"], ROOT)
        assert r.returncode == 0 and "usage:" in r.stdout, (name, r.stderr[-2000:])


# ---- every option says what it does ---------------------------------------------------------

def _undocumented(parser, where: str) -> list:
    return [f"{where} {'/'.join(a.option_strings)}" for a in parser._actions
            if a.option_strings and not (a.help or "").strip()
            and a.help is not argparse.SUPPRESS]


def test_every_cli_option_has_help():
    parser = _parser()
    missing = _undocumented(parser, "(top)")
    for name, sub in _subparsers(parser).items():
        missing += _undocumented(sub, name)
    missing += _undocumented(_bench_parser(), "bench")
    assert not missing, f"options without help: {missing}"
    # the negative control: an option without help is found
    p = argparse.ArgumentParser()
    p.add_argument("--x")
    assert _undocumented(p, "t") == ["t --x"]


def test_choices_are_explained():
    """tiny-model --variant names each of its choices in its help."""
    variant = next(a for a in _subparsers(_parser())["tiny-model"]._actions
                   if "--variant" in a.option_strings)
    for choice in variant.choices:
        assert re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", variant.help), choice


# ---- the installed package --------------------------------------------------------------------

def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_console_script_resolves():
    target = _pyproject()["project"]["scripts"]["comfyui-xdit"]
    module, _, func = target.partition(":")
    main = getattr(importlib.import_module(module), func)  # importing must not run it
    assert callable(main)
    from comfyui_xdit.cli.commands import main as cli_main
    assert main is cli_main


def test_packaging_ships_host_and_workers():
    """The pool launches `python -m workers.runtime.serve`: an install carries `workers` beside
    `comfyui_xdit`, every subpackage of both, and none of the test or benchmark code."""
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.relative_to(ROOT).as_posix().replace("/", ".")
                for p in ROOT.rglob("__init__.py") if p.parent != ROOT
                and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)}
    found = {p for p in packages if any(fnmatch.fnmatchcase(p, pat) for pat in include)}
    want = {p.parent.relative_to(ROOT).as_posix().replace("/", ".")
            for top in ("comfyui_xdit", "workers") for p in (ROOT / top).rglob("__init__.py")}
    assert want <= found, sorted(want - found)
    assert not {p for p in found if p.split(".")[0] in ("tests", "benchmarks", "xdit_testhooks")}
    deps = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in _pyproject()["project"]["dependencies"]}
    assert "torch" not in deps, "pip install -e . must never replace the machine's torch"


def test_installed_cli_runs_from_anywhere(tmp_path):
    """After `pip install -e .` (or a wheel), `python -m comfyui_xdit --help` and
    `comfyui-xdit --help` work outside the checkout; skipped where the package is not
    installed (CI runs from the checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = _run([sys.executable, "-c", "import comfyui_xdit, workers"], tmp_path, env)
    if probe.returncode != 0:
        pytest.skip("comfyui_xdit is not installed in this Python (pip install -e .)")
    r = _run([sys.executable, "-m", "comfyui_xdit", "--help"], tmp_path, env)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
    script = shutil.which("comfyui-xdit", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if script is None:
        pytest.skip("the package imports but its comfyui-xdit script is not installed")
    r = _run([script, "--help"], tmp_path, env)
    assert r.returncode == 0 and "usage: comfyui-xdit" in r.stdout, r.stderr
    # the workers the pool starts resolve from here too (client/launch.py sets PYTHONPATH)
    code = ("import sys; from comfyui_xdit.client import launch; sys.path.insert(0, "
            "str(launch.REPO_ROOT)); import workers.runtime.serve; print('ok')")
    r = _run([sys.executable, "-c", code], tmp_path, env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# ---- the example workflows' files -----------------------------------------------------------

def _workflow_files():
    spec = importlib.util.spec_from_file_location("workflow_files",
                                                  ROOT / "scripts" / "workflow_files.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_workflow_files_table_is_current():
    wf = _workflow_files()
    assert wf.page_block() == wf.table(), (
        "docs/workflow-files.md is out of date: python scripts/workflow_files.py --write")


def test_every_ui_example_carries_its_files_note(tmp_path):
    """Each UI-format example has a Note on its canvas listing the files it loads, their
    folders and sources, as the table does; a changed source makes the note stale."""
    wf = _workflow_files()
    assert wf.stale_notes() == [], "python scripts/workflow_files.py --write"
    ui = json.loads((ROOT / "example_workflows" / "xdit_flux_text_to_image.json").read_text())
    notes = [n for n in ui["nodes"] if n["type"] == "Note"]
    assert len(notes) == 1 and "models/diffusers/FLUX.1-dev/" in notes[0]["widgets_values"][0]
    assert "huggingface.co/black-forest-labs/FLUX.1-dev" in notes[0]["widgets_values"][0]
    # negative control: another source for a file the example loads
    sources = json.loads((ROOT / "scripts" / "workflow_sources.json").read_text())
    sources["FLUX.1-dev"] = {"repo": "someone/else"}
    (tmp_path / "sources.json").write_text(json.dumps(sources))
    assert "xdit_flux_text_to_image.json" in wf.stale_notes(sources_file=tmp_path / "sources.json")


def test_workflow_files_cover_every_loader():
    """Every example's loaders are read (both formats), every file has a source, and the
    README names each diffusers folder with the repository the sources give."""
    wf = _workflow_files()
    found = wf.needs()
    names = {p.name.replace("_api.json", "").replace(".json", "")
             for p in (ROOT / "example_workflows").glob("*.json")}
    assert set(found) == names
    files = {f for rows in found.values() for _, _, f in rows}
    assert {"clip_l.safetensors", "t5xxl_fp16.safetensors", "ae.safetensors",
            "clip_g.safetensors", "qwen_2.5_vl_7b_fp8_scaled.safetensors",
            "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors",
            "example.png"} <= files
    sources = json.loads((ROOT / "scripts" / "workflow_sources.json").read_text())
    readme = (ROOT / "README.md").read_text()
    for rows in found.values():
        for node, folder, file in rows:
            if folder == "models/diffusers":
                assert f"models/diffusers/{file}" in readme and sources[file]["repo"] in readme, file


def test_workflow_files_fail_on_an_unknown_file(tmp_path):
    (tmp_path / "x_api.json").write_text(json.dumps(
        {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "mystery.safetensors"}}}))
    (tmp_path / "x.json").write_text(json.dumps(
        {"nodes": [{"id": 1, "type": "VAELoader", "widgets_values": ["mystery.safetensors"]}]}))
    wf = _workflow_files()
    assert wf.needs(tmp_path) == {"x": [("VAELoader", "models/vae", "mystery.safetensors")]}
    with pytest.raises(KeyError, match="mystery.safetensors"):
        wf.table(tmp_path)
    (tmp_path / "x.json").write_text(json.dumps(
        {"nodes": [{"id": 1, "type": "VAELoader", "widgets_values": ["other.safetensors"]}]}))
    with pytest.raises(ValueError, match="load different files"):
        wf.needs(tmp_path)
    assert wf.place("models/diffusers", "diffusion_models/wan.safetensors") == \
        ("models/diffusion_models", "wan.safetensors")


def test_architecture_page_has_a_paragraph_per_folder():
    """docs/architecture.md gives each folder of the two packages its paragraph, so a
    newcomer finds a module by its folder; a folder added without one fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted({p.parent.relative_to(ROOT).as_posix()
                      for top in ("comfyui_xdit", "workers")
                      for p in (ROOT / top).rglob("__init__.py")} - {"comfyui_xdit", "workers"})
    assert "workers/parallel" in folders  # the scan sees the folders (negative control)
    missing = [f for f in folders
               if f"**`{f}/`**" not in text and f"`{f.rpartition('/')[2]}/`" not in text]
    assert not missing, f"docs/architecture.md has no paragraph for {missing}"


# ---- the project stands alone: citations stay inside the repository ------------------------

TEXT_SUFFIXES = {".py", ".md", ".js", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"}
CAPS_DOC = re.compile(r"\b[A-Z][A-Z0-9_-]+\.md\b")  # README.md-style names: a project's docs
DESIGN_CITE = re.compile(r"\bdocs/([\w-]+\.md)#([\w-]+)")
OUTSIDE_PATH = re.compile(r"/w[o]rk/|\.\.[/]shared\b")  # written so as not to match itself
# the word issue, PR or pull request with a number (with or without #), a GitHub issue address
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s*#?\d+|github\.com/\S+/(?:issues|pull)/\d+",
                   re.I)


def tracked_texts() -> list:
    """The repository's tracked text files (git's list; a fresh copy without git: the tree)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.splitlines()
        paths = [ROOT / n for n in names]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file()]


def outside_citations(text: str, repo_docs: set) -> list:
    """What `text` cites outside the repository: a README.md-style document the repository
    does not hold, or a path into the machine around it."""
    bad = [m for m in CAPS_DOC.findall(text) if m not in repo_docs]
    return bad + OUTSIDE_PATH.findall(text)


def broken_design_citations(text: str) -> list:
    """`docs/<page>.md#<anchor>` citations whose page or heading does not exist."""
    bad = []
    for page, anchor in DESIGN_CITE.findall(text):
        doc = ROOT / "docs" / page
        if not doc.exists() or anchor not in anchors_of(doc.read_text()):
            bad.append(f"docs/{page}#{anchor}")
    return bad


def test_no_file_cites_a_file_outside_the_repository():
    """Every rule the code relies on is written in the repository (docs/design.md); a
    comment, test or doc that points elsewhere leaves its reader without it."""
    files = tracked_texts()
    repo_docs = {p.name for p in files if p.suffix == ".md"}
    assert "README.md" in repo_docs and len(files) > 100  # the scan sees the tree
    bad = {}
    for path in files:
        found = outside_citations(path.read_text(errors="replace"), repo_docs)
        found += broken_design_citations(path.read_text(errors="replace"))
        if found:
            bad[_rel(path)] = sorted(set(found))
    assert not bad, f"citations outside the repository or of no section: {bad}"


def test_no_test_cites_an_issue_number():
    """A test says what it checks, not which ticket asked for it: the ticket is not in the
    repository."""
    tests = sorted((ROOT / "tests").rglob("*.py"))
    assert len(tests) > 20
    bad = {_rel(p): ISSUE.findall(p.read_text()) for p in tests}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"tests citing issue numbers: {bad}"


def test_the_standalone_checks_can_fail():
    """Negative controls: each kind of citation the two checks above forbid is found."""
    outside = "DESIGN" + ".md numerics 4; see /work" + "/shared/x; .." + "/shared/y"
    assert outside_citations(outside, {"README.md"}) == ["DESIGN" + ".md", "/wo" + "rk/", ".." + "/shared"]
    assert outside_citations("README.md and docs/design.md", {"README.md"}) == []
    assert broken_design_citations("docs/design" + ".md#numerics-rule-99") != []
    assert broken_design_citations("docs/design.md#numerics-rule-6") == []
    for cited in ("issue" + " 21: x", "(Issue #" + "12)", "issues #" + "11724, #1",
                  "PR " + "7", "github.com/a/b/issues/" + "3"):
        assert ISSUE.search(cited), cited
    for fine in ("reference latent #1", "in issue order", "send #2 of the pair"):
        assert not ISSUE.search(fine), fine


# ---- lists of families: the registry's and the example folder's -------------------------------

def _families():
    from comfyui_xdit.bridge import families
    return families


def test_package_description_and_readme_name_every_family():
    """pyproject's description, the README's opening and its single-file list name every
    family the registry holds (a family added without them fails here)."""
    fams = _families().FAMILIES.values()
    description = _pyproject()["project"]["description"]
    readme = (ROOT / "README.md").read_text()
    opening = readme.split("\n\n")[1]
    single = re.search(r"\*\*Single `\.safetensors` transformer files\*\* \(([^)]*)\)",
                       readme).group(1)
    for fam in fams:
        for where, text in (("pyproject description", description),
                            ("README opening", opening), ("README single files", single)):
            assert fam.name in text, f"{where} does not name {fam.name}"


# example file kinds (xdit_<family id>_<kind>.json) -> how the README's list says them
EXAMPLE_KINDS = {"text_to_image": "text-to-image", "text_to_video": "text-to-video",
                 "image_to_video": "image-to-video", "ksampler": "KSampler",
                 "pipefusion": "PipeFusion"}


def test_readme_example_list_is_the_example_folder():
    """The README's list of example workflows ("text-to-image graphs (FLUX.1, ...)") names,
    for each kind of example, exactly the families example_workflows/ has one of."""
    fams = _families()
    shipped = {}
    for path in (ROOT / "example_workflows").glob("xdit_*_api.json"):
        stem = path.name[len("xdit_"):-len("_api.json")]
        fid = max((f for f in fams.IDS if stem.startswith(f + "_")), key=len)
        shipped.setdefault(stem[len(fid) + 1:], set()).add(fid)
    assert set(shipped) == set(EXAMPLE_KINDS), sorted(shipped)
    text = re.search(r"## Example workflows\n\n(.*?)\n\n", (ROOT / "README.md").read_text(),
                     re.S).group(1).replace("\n", " ")
    for kind, words in EXAMPLE_KINDS.items():
        found = re.search(rf"{words}[^()]*\(([^)]*)\)", text)
        assert found, f"the README's example list has no {words} examples"
        items = [i.strip() for i in re.split(r",| and ", found.group(1)) if i.strip()]
        named = set()
        for item in items:
            ids = [f.id for f in fams.FAMILIES.values()
                   if item == f.name or item.startswith(f.name + " ")]
            assert len(ids) == 1, f"README {words} examples: {item!r} names no one family"
            named |= set(ids)
        assert named == shipped[kind], (words, sorted(named), sorted(shipped[kind]))
