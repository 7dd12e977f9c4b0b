"""Make docs/loader.png in the real ComfyUI frontend (run by hand against a running ComfyUI
that has this pack loaded; headless Debian chromium + Playwright):

    python tests/live_helpers/loader_screenshot.py http://127.0.0.1:8188 [docs/loader.png]

The UI-format PipeFusion example is loaded as shipped; the picture is the part of the canvas
with Load model (xDiT) and the three settings nodes plugged into it, at scale 1, so it shows
the nodes' inputs and widgets as this ComfyUI and this checkout define them today.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHOWN = ("xDiT.LoadModel", "xDiT.ParallelSettings", "xDiT.PipeFusionSettings",
         "xDiT.EngineSettings", "EmptySD3LatentImage")
# the shown nodes' box in page pixels after placing them at scale 1 below the top bar
PLACE = """(types) => {
  const c = window.app.canvas, nodes = window.app.graph._nodes.filter((n) => types.includes(n.type));
  const T = (window.LiteGraph && LiteGraph.NODE_TITLE_HEIGHT) || 30;
  const x0 = Math.min(...nodes.map((n) => n.pos[0])), y0 = Math.min(...nodes.map((n) => n.pos[1] - T));
  c.ds.scale = 1;
  c.ds.offset[0] = 80 - x0;
  c.ds.offset[1] = 120 - y0;
  c.setDirty(true, true);
  const r = c.canvas.getBoundingClientRect();
  const x1 = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
  const y1 = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
  return {x: r.left + 60, y: r.top + 100, width: x1 - x0 + 40, height: y1 - y0 + 40};
}"""


def shoot(base: str, out: Path) -> Path:
    from playwright.sync_api import sync_playwright
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    graph = json.loads((ROOT / "example_workflows" / "xdit_flux_pipefusion.json").read_text())
    graph["nodes"] = [n for n in graph["nodes"] if n["type"] != "Note"]  # above the loader
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        page.goto(base + "/", wait_until="networkidle", timeout=120_000)
        page.wait_for_function("window.app && window.app.graph", timeout=60_000)
        page.wait_for_timeout(3000)  # the first-run dialogs (templates, news) open late
        for _ in range(4):  # and cover the canvas
            page.keyboard.press("Escape")
            page.wait_for_timeout(500)
        page.add_style_tag(content=".minimap-main-container { display: none !important; }")
        page.evaluate("""async () => {  // no "comfyui-xdit-under-test" badge on the nodes
          try { await window.app.extensionManager.setting.set(
                  "Comfy.NodeBadge.NodeSourceBadgeMode", "None"); } catch (e) {} }""")
        page.evaluate("(g) => window.app.loadGraphData(g)", graph)
        page.wait_for_timeout(1000)
        clip = page.evaluate(PLACE, list(SHOWN))
        page.wait_for_timeout(1000)
        page.screenshot(path=str(out), clip=clip)
        browser.close()
    return out


if __name__ == "__main__":
    print(shoot(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8188",
                Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs" / "loader.png"))
