"""Make the UI-format example workflows and their thumbnails from the API-format ones, in the
real ComfyUI frontend (run by hand against a running ComfyUI that has this pack loaded):

    python tests/live_helpers/export_ui_workflows.py http://127.0.0.1:8188 [--thumbnails]

For each example_workflows/*_api.json: headless Chromium opens ComfyUI, the frontend's own
`app.loadApiJson` builds and arranges the graph, `app.graph.serialize()` gives the UI-format
file (written without the `_api` suffix) and a screenshot of the canvas is its `.jpg`
thumbnail (ComfyUI's Templates browser shows it). With --thumbnails only the thumbnails are
made again, from the UI-format files as they are.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIDY = """async () => {
  const app = window.app;
  const settings = {"Comfy.NodeBadge.NodeSourceBadgeMode": "None", "Comfy.Minimap.Visible": false,
                    "Comfy.Graph.CanvasInfo": false};
  for (const [k, v] of Object.entries(settings)) {
    try { await app.extensionManager.setting.set(k, v); } catch (e) {
      try { app.ui.settings.setSettingValue(k, v); } catch (e2) {} }
  }
  for (const n of app.graph._nodes) {
    const ctx = app.canvas.ctx || document.createElement("canvas").getContext("2d");
    ctx.font = "14px Arial";
    n.size[0] = Math.max(n.size[0], ctx.measureText(n.title).width + 70, 220);
    for (const w of n.widgets || []) {
      if (w.name === "control_after_generate") w.value = "fixed";  // the example's seed
    }
  }
  app.graph.arrange(60);
  // room for the text ComfyUI adds under an xDiT node when it runs (a 58 px widget; the
  // loader also grows to its computed size): what lies below such a node moves down 70 px
  const texts = new Set(["xDiT.LoadModel", "xDiT.Sampler", "xDiT.Decode"]);
  for (const n of app.graph._nodes.filter((n) => texts.has(n.type))) {
    for (const m of app.graph._nodes) {
      if (m !== n && m.pos[1] > n.pos[1] && m.pos[0] < n.pos[0] + n.size[0] &&
          m.pos[0] + m.size[0] > n.pos[0]) m.pos[1] += 70;
    }
  }
}"""
FIT_VIEW = """() => {
  const app = window.app, c = app.canvas;
  let x0 = 1e9, y0 = 1e9, x1 = -1e9, y1 = -1e9;
  for (const n of app.graph._nodes) {
    x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 30);
    x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]);
  }
  const W = c.canvas.width / (window.devicePixelRatio || 1), H = c.canvas.height / (window.devicePixelRatio || 1);
  const s = Math.min(W / (x1 - x0 + 80), H / (y1 - y0 + 80), 1.2);
  c.ds.scale = s;
  c.ds.offset = [(W / s - (x1 - x0)) / 2 - x0, (H / s - (y1 - y0)) / 2 - y0];
  c.setDirty(true, true);
  return [x0, y0, x1, y1, s];
}"""


def files_note(graph: dict, name: str) -> dict:
    """The exported graph with the Note listing its files (scripts/workflow_files.py)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("workflow_files",
                                                  ROOT / "scripts" / "workflow_files.py")
    wf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wf)
    rows = wf.needs()[name]
    return wf.with_note(graph, wf.note_text(rows, json.loads(wf.SOURCES.read_text())))


def export(base: str, names=None, out_dir: Path = ROOT / "example_workflows",
           viewport=(1280, 720)) -> list:
    """`viewport`: a wider one keeps a wide graph's thumbnail above the frontend's
    low-quality zoom (where it draws no text)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    written = []
    apis = sorted(out_dir.glob("*_api.json"))
    if names:
        apis = [p for p in apis if p.name in names]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for api_file in apis:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.goto(base + "/", wait_until="networkidle", timeout=120_000)
            page.wait_for_function("window.app && window.app.graph", timeout=60_000)
            api = json.loads(api_file.read_text())
            name = api_file.name.replace("_api.json", "")
            page.evaluate("([api, name]) => window.app.loadApiJson(api, name)", [api, name])
            page.wait_for_timeout(500)
            for _ in range(3):  # first-run dialogs cover the canvas
                if page.locator(".p-dialog-mask").count() == 0:
                    break
                page.keyboard.press("Escape")
                page.wait_for_timeout(300)
            page.evaluate(TIDY)
            page.wait_for_timeout(300)
            page.evaluate(FIT_VIEW)
            page.wait_for_timeout(500)
            # JSON.stringify as the frontend's own save does (undefined fields dropped)
            graph = json.loads(page.evaluate("() => JSON.stringify(window.app.graph.serialize())"))
            graph = files_note(graph, name)  # what scripts/workflow_files.py --write adds
            ui_file = api_file.with_name(api_file.name.replace("_api.json", ".json"))
            ui_file.write_text(json.dumps(graph, indent=1) + "\n")
            shot = ui_file.with_suffix(".jpg")
            page.locator("canvas#graph-canvas").screenshot(
                path=str(shot), type="jpeg", quality=85)
            written += [ui_file, shot]
            page.close()
        browser.close()
    return written


QUIET = """async () => {  // nothing over the canvas but the graph
  const set = async (k, v) => { try { await window.app.extensionManager.setting.set(k, v); }
                                catch (e) {} };
  await set("Comfy.NodeBadge.NodeSourceBadgeMode", "None");
  await set("Comfy.Graph.CanvasInfo", false);
  await set("Comfy.Graph.CanvasMenu", false);
  await set("Comfy.Minimap.Visible", false);
  await set("Comfy.Workflow.ShowMissingModelsWarning", false);  // models the test tree lacks
  try { await window.app.extensionManager.command.execute("Workspace.ToggleFocusMode"); }
  catch (e) {}
}"""


def thumbnails(base: str, out_dir: Path = ROOT / "example_workflows") -> list:
    """Only the thumbnails: each UI-format example loaded as it is (no re-export, so the
    files stay as committed) and its canvas shot at its thumbnail's present size (a wide
    graph's is larger: above the frontend's low-quality zoom), showing the nodes as this
    ComfyUI and this checkout define them (a newer frontend's focus mode hides its menus)."""
    from PIL import Image
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for ui_file in sorted(out_dir.glob("*.json")):
            graph = json.loads(ui_file.read_text())
            if "nodes" not in graph:
                continue
            shot = ui_file.with_suffix(".jpg")
            width, height = Image.open(shot).size if shot.exists() else (1280, 720)
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(base + "/", wait_until="networkidle", timeout=120_000)
            page.wait_for_function("window.app && window.app.graph", timeout=60_000)
            page.wait_for_timeout(3000)  # the first-run dialogs open late, cover the canvas
            for _ in range(4):
                page.keyboard.press("Escape")
                page.wait_for_timeout(400)
            page.evaluate(QUIET)
            page.evaluate("(g) => window.app.loadGraphData(g)", graph)
            page.wait_for_timeout(800)
            # no missing-model frame: the test ComfyUI lacks the examples' real files
            page.evaluate("() => { for (const n of window.app.graph._nodes) n.has_errors = false; }")
            page.evaluate(FIT_VIEW)
            page.wait_for_timeout(800)
            page.locator("canvas#graph-canvas").screenshot(
                path=str(shot), type="jpeg", quality=85)
            written.append(shot)
            page.close()
        browser.close()
    return written


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--thumbnails"]
    run = thumbnails if "--thumbnails" in sys.argv else export
    for f in run(args[0] if args else "http://127.0.0.1:8188"):
        print(f)
