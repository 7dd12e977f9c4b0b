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
MAY_IMPORT_COMFY = {"nodes/extension.py", "nodes/node_io.py", "nodes/loader_nodes.py",
                    "nodes/settings_nodes.py", "nodes/sampler_nodes.py", "nodes/model_nodes.py",
                    "nodes/comfy_model.py"}


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
            "import comfyui_xdit, comfyui_xdit.nodes.discovery, comfyui_xdit.nodes.settings\n"
            "import comfyui_xdit.nodes.handles, comfyui_xdit.nodes.pool_registry\n"
            "import comfyui_xdit.nodes.operations, comfyui_xdit.nodes.node_text\n"
            "import comfyui_xdit.nodes.model_calls\n"
            "import comfyui_xdit.client.pool, comfyui_xdit.planning.model_facts\n"
            "import comfyui_xdit.planning.memory_arithmetic, comfyui_xdit.planning.launch_policy\n"
            "import comfyui_xdit.planning.calibration, comfyui_xdit.planning.plan_tables\n"
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


# ---- no circle of imports in the product ---------------------------------------------------
PRODUCT = ("comfyui_xdit", "workers", "xdit_testhooks")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _edges(path: Path, modules: set) -> set:
    """Product modules `path` imports, at module level or inside a function (a lazy import
    is an edge too): `from .x import y` resolves to package.x, or to package.x.y where y is
    a module."""
    me = _module_of(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != me:
                out.add(t)
                break
    return out


def _circles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict:
    files = [p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_of(p) for p in files}
    # a package's __init__ is imported with any of its modules: not an edge back to it
    return {_module_of(p): {t for t in _edges(p, modules)
                            if not _module_of(p).startswith(t + ".")} for p in files}


def test_no_import_circle_in_the_product():
    circles = _circles(_graph())
    assert not circles, f"import circles (lazy imports count): {circles}"


def test_the_circle_check_finds_a_circle():
    """Negative control: a loading module importing the adapters' base back is a circle."""
    g = _graph()
    g["workers.loading.meta"] = set(g["workers.loading.meta"]) | {"workers.models.base"}
    assert any("workers.loading.meta" in c for c in _circles(g))


def _bridge_uses(path: Path) -> set:
    """The names a host module takes from the bridge: `bridge.X` and `from ...bridge import X`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "bridge":
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module == "comfyui_xdit.bridge":
            used |= {a.name for a in node.names}
    return used


def test_the_host_reaches_workers_only_through_the_bridge():
    """The host reads workers/ through one module, comfyui_xdit/bridge.py, which names each
    worker module it hands on once, with its reason: no other host module loads a worker
    module, every name taken from the bridge is one it lists, every listed module is used
    and loads, and so does every family's description module."""
    from comfyui_xdit import bridge
    used, loaders = set(), {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel == "bridge.py":
            continue
        text = path.read_text()
        for word in ("worker_module", "comfyui_xdit_workers", "spec_from_file_location"):
            if word in text:
                loaders.setdefault(rel, []).append(word)
        used |= _bridge_uses(path)
    assert not loaders, f"host modules that load worker modules themselves: {loaders}"
    listed = set(bridge.MODULES) | {"family_module"}
    assert used == listed, (sorted(used - listed), sorted(listed - used))
    for name, (module, why) in bridge.MODULES.items():
        assert why and getattr(bridge, name).__name__ == f"comfyui_xdit_workers.{module}"
    assert len({module for module, _ in bridge.MODULES.values()}) == len(bridge.MODULES)
    for fid in bridge.families.IDS:
        assert bridge.family_module(fid).FAMILY.id == fid
    # negative control: the scan sees both ways of taking a name from the bridge
    assert {"families", "latent_layout"} <= _bridge_uses(PKG / "comfy_convert.py")


# ---- workers/ runs one way ------------------------------------------------------------------
# workers/' rooms from the top floor down; a room imports only rooms on floors below its own
WORKER_FLOORS = (("runtime",), ("models",), ("sampling", "loading"), ("parallel",),
                 ("families",), ("streams", "messages"))


def _arrows_up(graph: dict) -> list:
    floor = {room: i for i, rooms in enumerate(WORKER_FLOORS) for room in rooms}

    def room(module):
        parts = module.split(".")
        return parts[1] if parts[0] == "workers" and len(parts) > 1 else None

    out = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = room(src), room(dst)
            if a is not None and b is not None and a != b and floor[a] >= floor[b]:
                out.append(f"{src} -> {dst}")
    return sorted(out)


def test_workers_folders_import_only_the_floors_below():
    """The worker folders stand in one order (docs/architecture.md): no import, lazy ones
    included, runs back up, nor sideways between two folders of one floor."""
    g = _graph()
    rooms = {m.split(".")[1] for m in g if m.startswith("workers.") and m.count(".") >= 1}
    assert rooms == {r for floor in WORKER_FLOORS for r in floor}, rooms
    assert not _arrows_up(g), _arrows_up(g)
    # negative control: a loader reading the adapters' package back is caught
    g["workers.loading.meta"] = set(g["workers.loading.meta"]) | {"workers.models.detect"}
    assert _arrows_up(g) == ["workers.loading.meta -> workers.models.detect"]
