"""The host package's rooms keep their promises: only `comfyui_xdit/nodes/` imports ComfyUI
(and there only the modules ComfyUI itself loads), and nothing ComfyUI runs (the nodes' logic,
the pool client, the planning) pulls in the test-model builders, the test hooks or the
benchmarks."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "comfyui_xdit"
COMFY_MODULES = {"comfy", "comfy_api", "comfy_execution", "comfy_extras", "folder_paths",
                 "node_helpers", "latent_preview", "server", "execution", "nodes"}
MAY_IMPORT_COMFY = {"nodes/extension.py", "nodes/model_nodes.py", "nodes/comfy_model.py"}


def _top_imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_node_modules_import_comfyui():
    offenders = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        bad = _top_imports(path) & COMFY_MODULES
        if bad and rel not in MAY_IMPORT_COMFY:
            offenders[rel] = sorted(bad)
    assert not offenders, f"ComfyUI imported outside comfyui_xdit/nodes' entry modules: {offenders}"
    # The check sees imports: a module known to import ComfyUI is found (negative control).
    assert _top_imports(PKG / "nodes" / "extension.py") & COMFY_MODULES


def test_what_comfyui_runs_needs_no_test_builders():
    code = ("import sys\n"
            "import comfyui_xdit, comfyui_xdit.nodes.logic, comfyui_xdit.nodes.model_calls\n"
            "import comfyui_xdit.client.pool, comfyui_xdit.planning.memory_plan\n"
            "from comfyui_xdit import WorkerPool\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('benchmarks', 'xdit_testhooks') or m.startswith('comfyui_xdit.testmodels')"
            " or m.split('.')[:2] == ['comfyui_xdit', 'cli'])\n"
            "assert not bad, bad\n"
            "import comfyui_xdit.testmodels.tiny_model\n"
            "assert 'comfyui_xdit.testmodels' in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
