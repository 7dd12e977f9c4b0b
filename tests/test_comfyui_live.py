"""The pack inside a real ComfyUI (skipped unless COMFYUI_PATH is set).

COMFYUI_PATH: a ComfyUI checkout; COMFYUI_PYTHON: its venv's python (with this pack's
requirements). The test links this pack into custom_nodes/ (plus a test-only CONDITIONING
source, tests/live_helpers/xdit_test_conditioning), puts the tiny FLUX model into
models/diffusers/, the same transformer as a BFL single file into models/diffusion_models/ and
a ComfyUI-loadable random VAE into models/vae/, starts `main.py --cpu`, then: /object_info
lists the nodes and both kinds of model, the example API workflow runs to a saved image
(sampled and decoded on the pool: Decode (xDiT)) with progress over /ws, a single-file
workflow runs with CONDITIONING and ComfyUI's VAE, and /interrupt cancels a long job.
The example workflows run unmodified (device auto; the tiny models stand in under
the folder names they use), cuda forced on this CPU-only ComfyUI is refused with one message,
a killed worker reaches the user as one sentence, and the node shows launch progress.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from live_comfy import (COMFY, ROOT, comfy_vae, history, http, link_packs, messages, place,
                        run, running_comfyui, skip_without_comfyui, with_settings, ws_connect)

pytestmark = skip_without_comfyui

MODEL_NAME = "xdit-test-flux"
FILE_NAME = "xdit-test-flux.safetensors"
FILE_OPTION = f"diffusion_models/{FILE_NAME}"
VAE_NAME = "xdit-test-vae.safetensors"
# the folder names the example workflows use (README: where models go)
EXAMPLE_MODELS = {"xdit_flux_text_to_image_api.json": ("FLUX.1-dev", "flux"),
                  "xdit_flux_pipefusion_api.json": ("FLUX.1-dev", "flux"),
                  "xdit_sd3_text_to_image_api.json": ("stable-diffusion-3.5-medium", "sd3")}
# what the Sampler node says when its job is done (nodes/node_text.py's job_text)
DONE = re.compile(r"^\d+ steps?, \d+ ranks?( \([^)]*\))?, [\d.]+ s( \+ [\d.]+ s launch)?"
                  r"(, (\d+ of \d+ calls computed|\d+/\d+ calls) in full)?$")


@pytest.fixture(scope="module")
def comfy(model_dir, tmp_path_factory):
    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-helpers")
    diffusers_dir = comfy / "models" / "diffusers"
    model = place(model_dir("flux"), diffusers_dir / MODEL_NAME)
    for name, arch in EXAMPLE_MODELS.values():  # tiny models under the examples' names
        place(model_dir(arch), diffusers_dir / name)
    from single_file_util import write_single_file
    (comfy / "models" / "diffusion_models").mkdir(parents=True, exist_ok=True)
    write_single_file(model_dir("flux"), "flux", comfy / "models" / "diffusion_models" / FILE_NAME)
    comfy_vae(comfy / "models" / "vae" / VAE_NAME)
    log = tmp_path_factory.mktemp("comfy") / "comfyui.log"
    with running_comfyui(comfy, log, "--preview-method", "latent2rgb") as server:
        yield dict(server, model=model)

# headless Debian chromium with nothing reaching out of the machine
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def _pool(comfy, model: str = MODEL_NAME) -> dict:
    """The status of the pool of `model` (several stay warm side by side)."""
    pools = http(comfy["base"], "/xdit/status")["pools"]
    found = [p for p in pools if p["model"].rstrip("/").endswith(model)]
    assert len(found) == 1, [p["model"] for p in pools]
    return found[0]


def _workflow(steps: int, size: int = 64) -> dict:
    wf = json.loads((ROOT / "example_workflows" / "xdit_flux_text_to_image_api.json").read_text())
    wf["1"]["inputs"].update(model=MODEL_NAME, device="cpu", dtype="fp32", world_size="2")
    with_settings(wf, "1", ulysses=2)
    wf["2"]["inputs"].update(width=size, height=size)
    wf["3"]["inputs"].update(steps=steps, max_sequence_length=16, prompt="a small red cube")
    assert wf["4"]["class_type"] == "xDiT.Decode"  # decoded on the pool, the folder's VAE
    wf["5"]["inputs"]["filename_prefix"] = "xdit-live-test"
    return wf


def _single_file_workflow(comfy, prompt_text: str = "") -> dict:
    """The single-file model: CONDITIONING in, ComfyUI's VAE (Decode's vae input) out."""
    wf = _workflow(2)
    wf["1"]["inputs"]["model"] = FILE_OPTION
    wf["3"]["inputs"].update(prompt=prompt_text, positive=["7", 0], seed=3)
    wf["4"]["inputs"]["vae"] = ["8", 0]
    wf["5"]["inputs"]["filename_prefix"] = "xdit-live-single"
    wf["7"] = {"class_type": "XDiTTestConditioning",
               "inputs": {"text": "a small red cube", "model_folder": str(comfy["model"]),
                          "max_sequence_length": 16}}
    wf["8"] = {"class_type": "VAELoader", "inputs": {"vae_name": VAE_NAME}}
    if prompt_text:  # the prompt-text path, no CONDITIONING
        del wf["3"]["inputs"]["positive"]
    return wf


FRONTEND_ONLY = {"Note", "MarkdownNote"}


def test_object_info_lists_nodes(comfy):
    info = http(comfy["base"], "/object_info")
    for n in ("xDiT.LoadModel", "xDiT.Sampler", "xDiT.Decode", "xDiT.UnloadPool"):
        assert n in info and info[n]["category"] == "xDiT"
    assert info["xDiT.Decode"]["output"] == ["IMAGE", "AUDIO"]  # AUDIO: a video's sound
    models = json.dumps(info["xDiT.LoadModel"]["input"]["required"]["model"])
    assert MODEL_NAME in models and FILE_OPTION in models  # a folder and a single file
    # the example workflows (API and UI format) only use nodes this ComfyUI has; the
    # HunyuanVideo 1.5 ones need its nodes (ComfyUI 0.8.0; 0.3.64 has none)
    for f in (ROOT / "example_workflows").glob("*.json"):
        if f.name.startswith("xdit_hunyuan_video15") and "EmptyHunyuanVideo15Latent" not in info:
            continue
        g = json.loads(f.read_text())
        # (Note / MarkdownNote: the frontend's own nodes, never in /object_info)
        types = {n["type"] for n in g["nodes"]} - FRONTEND_ONLY if "nodes" in g else \
            {n["class_type"] for n in g.values()}
        assert types <= set(info), (f.name, types - set(info))
    seed = info["xDiT.Sampler"]["input"]["required"]["seed"][1]
    assert seed["max"] == 2 ** 64 - 1 and seed.get("control_after_generate")
    js = http(comfy["base"], "/extensions/comfyui-xdit-under-test/xdit.js")
    assert b"xDiT.StatusPanel" in js
    # four loader widgets; the rest on three settings nodes plugged into it
    loader = info["xDiT.LoadModel"]["input"]
    assert list(loader["required"]) == ["model", "device", "dtype", "world_size"]
    assert {k: v[0] for k, v in loader["optional"].items()} == {
        "parallel": "XDIT_PARALLEL", "pipefusion": "XDIT_PIPEFUSION", "engine": "XDIT_ENGINE",
        "low_noise_model": "XDIT_EXPERT_FILE"}  # Wan 2.2 A14B's second file
    for n, out in (("xDiT.ParallelSettings", "XDIT_PARALLEL"),
                   ("xDiT.PipeFusionSettings", "XDIT_PIPEFUSION"),
                   ("xDiT.EngineSettings", "XDIT_ENGINE")):
        assert info[n]["category"] == "xDiT/settings" and info[n]["output"] == [out]
    # cfg-parallel's degree: an optional input (a workflow saved before it validates)
    degree = info["xDiT.ParallelSettings"]["input"]["optional"]["cfg_degree"]
    assert degree[0] == "INT" and (degree[1]["default"], degree[1]["min"]) == (2, 2), degree
    # a bad widget is refused at validation, with the ConfigError's message, once
    wf = _workflow(2)
    wf["1"]["inputs"]["dtype"] = "bf16"
    try:
        http(comfy["base"], "/prompt", {"prompt": wf, "client_id": "x"})
        raise AssertionError("invalid configuration accepted")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        assert "dtype bf16 does not run on cpu" in json.dumps(body["node_errors"])
        # one message, once (not once per loader input)
        assert [len(v["errors"]) for v in body["node_errors"].values()] == [1], body
    # a bad layout from a settings node: its value exists only at execution, so the
    # loader's one line comes as the execution error
    wf = with_settings(_workflow(2), "1", ulysses=3)
    wf["1"]["inputs"]["world_size"] = "4"
    _, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_error", msgs[-1]
    err = msgs[-1]["data"]["exception_message"]
    assert "world size 4 != dp 1 x cfg 1 x pipefusion 1 x ulysses 3" in err, err
    assert msgs[-1]["data"]["node_type"] == "xDiT.LoadModel"


def test_workflow_runs_with_progress_and_saves_an_image(comfy):
    pid, msgs = run(comfy, _workflow(3))
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    progress = [m["data"] for m in msgs if m.get("type") == "progress" and m["data"].get("node") == "3"]
    assert [p["value"] for p in progress][-1] == 3 and progress[-1]["max"] == 3
    assert any(m.get("type") == "binary_preview" for m in msgs)
    hist = history(comfy, pid)
    images = hist["outputs"]["5"]["images"]
    assert images and images[0]["filename"].startswith("xdit-live-test")
    img = http(comfy["base"], "/view?filename={filename}&subfolder={subfolder}&type={type}"
                .format(**images[0]))
    assert img[:8] == b"\x89PNG\r\n\x1a\n"
    st = http(comfy["base"], "/xdit/status")
    pool = _pool(comfy)
    assert pool["world_size"] == 2 and pool["state"] == "idle"


def test_pipefusion_workflow_through_the_api(comfy):
    """The loader's PipeFusion inputs through /prompt: a 2-stage pool (each rank holds half
    the blocks, shown per rank by /xdit/status) produces the image."""
    wf = _workflow(3)
    del wf["1"]["inputs"]["parallel"]
    with_settings(wf, "1", pipefusion=2, warmup_steps=1, pipeline_patches=0,
                  pipefusion_split="balanced")
    pid, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    progress = [m["data"] for m in msgs if m.get("type") == "progress" and m["data"].get("node") == "3"]
    assert progress and progress[-1]["value"] == 3
    assert history(comfy, pid)["outputs"]["5"]["images"]
    pool = _pool(comfy)
    assert [r["stage"]["index"] for r in pool["ranks"]] == [0, 1]
    texts = [m["text"] for m in msgs if m.get("type") == "progress_text" and m["node"] == "3"]
    assert texts[-1].startswith("3 steps, 2 ranks (PipeFusion 2), "), texts
    # a degree the model cannot take is refused before anything launches
    wf["1"]["inputs"]["world_size"] = "8"
    with_settings(wf, "1", pipefusion=8)
    _, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_error", msgs[-1]
    assert "exceeds the model's 4 transformer blocks" in msgs[-1]["data"]["exception_message"]


def test_step_cache_node_with_the_sampler(comfy):
    """Step cache (xDiT) into Sampler (xDiT): the run skips calls, the node's text says how
    many were computed in full while it runs and at the end, and the image is saved."""
    wf = _workflow(6)
    wf["9"] = {"class_type": "xDiT.CacheSettings",
               "inputs": {"threshold": 5.0, "warmup": 1, "head_blocks": 1, "tail_blocks": 0,
                          "max_skips": 3, "taylor": False}}
    wf["3"]["inputs"]["cache"] = ["9", 0]
    pid, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    assert history(comfy, pid)["outputs"]["5"]["images"]
    texts = [m["text"] for m in msgs if m.get("type") == "progress_text" and m["node"] == "3"]
    assert any(re.fullmatch(r"step \d/6, \d of \d calls computed in full", s) for s in texts), texts
    # warmup 1, then at most 3 skips in a row: calls 1 and 5 computed, 2-4 and 6 skipped
    assert DONE.match(texts[-1]) and texts[-1].endswith(", 2/6 calls in full"), texts


def test_single_file_workflow_with_conditioning_and_decode(comfy):
    """diffusion_models/<file> samples with CONDITIONING on a 2-rank pool; Decode uses the
    connected VAE. Prompt text on the file fails with the clear message; the next run works."""
    pid, msgs = run(comfy, _single_file_workflow(comfy))
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    hist = history(comfy, pid)
    images = hist["outputs"]["5"]["images"]
    assert images and images[0]["filename"].startswith("xdit-live-single")
    pool = _pool(comfy, FILE_NAME)
    assert pool["world_size"] == 2
    pids = [r["pid"] for r in pool["ranks"]]
    _, msgs = run(comfy, _single_file_workflow(comfy, prompt_text="a cat"))
    assert msgs[-1]["type"] == "execution_error"
    err = msgs[-1]["data"]["exception_message"]
    assert "no text encoders" in err and "CONDITIONING" in err, err
    wf = _single_file_workflow(comfy)
    wf["3"]["inputs"]["seed"] = 4
    _, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    assert [r["pid"] for r in _pool(comfy, FILE_NAME)["ranks"]] == pids  # the same workers


def test_interrupt_cancels_a_long_job(comfy):
    cid = uuid.uuid4().hex
    ws = ws_connect(comfy, cid)
    wf = _workflow(5000)
    wf["3"]["inputs"]["seed"] = 2
    pid = http(comfy["base"], "/prompt", {"prompt": wf, "client_id": cid})["prompt_id"]
    # a denoising step (max 5000), not the launch's progress (max = ranks)
    messages(ws, lambda m: m.get("type") == "progress" and m["data"].get("node") == "3"
              and m["data"]["max"] == 5000, 300)
    t = time.monotonic()
    http(comfy["base"], "/interrupt", {})
    msgs = messages(ws, lambda m: m.get("type") in ("execution_interrupted", "execution_success",
                                                     "execution_error")
                     and m["data"].get("prompt_id") == pid, 120)
    ws.close()
    assert msgs[-1]["type"] == "execution_interrupted", msgs[-1]
    assert time.monotonic() - t < 30
    last = [m["data"]["value"] for m in msgs if m.get("type") == "progress"]
    assert not last or last[-1] < 5000
    assert _pool(comfy)["state"] == "idle"  # the pool stays warm


def test_web_panel_renders_in_headless_chromium(comfy, tmp_path):
    """The xDiT sidebar tab renders the pool status in a real browser with no console errors
    from our script; a screenshot is saved (to $XDIT_SCREENSHOT or the test's tmp dir)."""
    pw = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium (Debian package chromium)")
    # a job first, done before the page opens, so the panel has a warm pool to show (a job
    # still launching under load showed neither ranks nor "No pool" within the wait)
    _, msgs = run(comfy, _workflow(steps=2), timeout=1200)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    errors = []
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(comfy["base"] + "/", wait_until="networkidle", timeout=120_000)
        tab = page.locator(".xdit-status-tab-button, [class*='xdit-status']").first
        tab.wait_for(timeout=60_000)
        # ComfyUI's first-run dialogs (templates, news) open late, when the page is loaded
        # and its workflows fetched, and cover the sidebar: close them and click the tab
        # until the panel shows
        pools = page.locator(".xdit-pools")
        for _ in range(60):
            if pools.count() and pools.first.is_visible():
                break
            for _ in range(3):
                page.keyboard.press("Escape")
                page.wait_for_timeout(300)
            tab.click(force=True)
            page.wait_for_timeout(2000)
        page.wait_for_selector(".xdit-pools", timeout=30_000)
        page.wait_for_function(  # the panel polls /xdit/status: slow on a loaded machine
            "document.querySelector('.xdit-pools').innerText.includes('rank')",
            timeout=120_000, polling=500)
        text = page.inner_text(".xdit-pools")
        shot = Path(os.environ.get("XDIT_SCREENSHOT", tmp_path / "xdit-panel.png"))
        page.screenshot(path=str(shot))
        # the UI-format example workflows load in the real frontend with every node and link
        loaded = {}
        for f in sorted((ROOT / "example_workflows").glob("*.json")):
            g = json.loads(f.read_text())
            if "nodes" not in g:
                continue
            loaded[f.name] = page.evaluate(
                """async (g) => { await window.app.loadGraphData(g);
                   const gr = window.app.graph;
                   return [gr._nodes.map(n => n.type).sort(),
                           Object.keys(gr.links || {}).length || (gr._links ? gr._links.size : 0)]; }""",
                g)
            assert loaded[f.name][0] == sorted(n["type"] for n in g["nodes"]), f.name
            assert loaded[f.name][1] == len(g["links"]), f.name
        assert len(loaded) >= 2
        browser.close()
    assert "rank" in text, text
    ours = [e for e in errors if "xdit" in e.lower()]
    assert not ours, ours
    assert shot.stat().st_size > 10_000


# node boxes (title included) and each text widget's element, in page pixels; found by the
# widget's text (the frontends render it in a .dom-widget element with no node id)
NODE_TEXT_GEOMETRY = """() => {
  const app = window.app, c = app.canvas, nodes = app.graph._nodes;
  const T = (window.LiteGraph && LiteGraph.NODE_TITLE_HEIGHT) || 30;
  const cr = c.canvas.getBoundingClientRect();
  const at = (x, y) => { const p = c.ds.convertOffsetToCanvas([x, y]);
                         return [p[0] + cr.left, p[1] + cr.top]; };
  const box = (n) => { const a = at(n.pos[0], n.pos[1] - T);
                       const b = at(n.pos[0] + n.size[0], n.pos[1] + n.size[1]);
                       return {left: a[0], top: a[1], right: b[0], bottom: b[1]}; };
  const rect = (e) => { const r = e.getBoundingClientRect();
                        return {left: r.left, top: r.top, right: r.right, bottom: r.bottom}; };
  const els = [...document.querySelectorAll(".dom-widget")];
  const texts = [];
  for (const n of nodes) {
    const w = (n.widgets || []).find((w) => w.name === "$$node-text-preview");
    if (!w) continue;
    const text = String(w.value ?? "");
    const el = els.find((e) => e.innerText.trim() === text.trim());
    const box_el = el && el.firstElementChild, span = el && el.querySelector("span");
    texts.push({id: n.id, type: n.type, text, found: !!box_el,
                box: box(n), rect: box_el ? rect(box_el) : null,
                scrollWidth: box_el?.scrollWidth, clientWidth: box_el?.clientWidth,
                scrollHeight: box_el?.scrollHeight, clientHeight: box_el?.clientHeight,
                lines: span ? span.getClientRects().length : 0,
                textWidth: span ? span.getBoundingClientRect().width / c.ds.scale : 0});
  }
  return {scale: c.ds.scale, texts,
          nodes: nodes.map((n) => ({id: n.id, type: n.type, box: box(n)}))};
}"""
# the whole graph at scale 1, clear of the frontend's top bar, side bar and queue toast
FIT_GRAPH = """() => {
  const c = window.app.canvas, nodes = window.app.graph._nodes;
  const x0 = Math.min(...nodes.map((n) => n.pos[0])), y0 = Math.min(...nodes.map((n) => n.pos[1]));
  c.ds.scale = 1;
  c.ds.offset[0] = 110 - x0;
  c.ds.offset[1] = 260 - y0;
  c.setDirty(true, true);
}"""


def _overlap(a: dict, b: dict, tol: float = 1.0) -> bool:
    return (min(a["right"], b["right"]) - max(a["left"], b["left"]) > tol and
            min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > tol)


def _inside(a: dict, b: dict, tol: float = 1.0) -> bool:
    return (a["left"] >= b["left"] - tol and a["right"] <= b["right"] + tol and
            a["top"] >= b["top"] - tol and a["bottom"] <= b["bottom"] + tol)


def test_node_texts_fit_their_nodes_in_the_real_frontend(comfy, tmp_path):
    """The UI-format FLUX example, loaded into the page and queued from it (the tiny model,
    cpu, 2 ranks, 64x64, 2 steps, launching the pool): every xDiT node's text is one line
    inside its node, not cut (scroll size = client size) and over no other node; the console
    shows no error or warning from the pack. A screenshot of the finished graph is saved
    (node-texts.png in $XDIT_SCREENSHOT_DIR, else the test's tmp dir)."""
    pw = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium (Debian package chromium)")
    g = json.loads((ROOT / "example_workflows" / "xdit_flux_text_to_image.json").read_text())
    # every node runs (not served from ComfyUI's cache), so each sends its text, and the
    # Sampler launches the pool: its launch texts, then its longest closing text (once the
    # jobs queued before, e.g. the panel test's, are done)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        queue = http(comfy["base"], "/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            break
        time.sleep(1)
    http(comfy["base"], "/free", {"unload_models": True, "free_memory": True})
    http(comfy["base"], "/xdit/unload", {})
    console = []
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1050})
        page.on("console", lambda m: console.append(
            (m.type, m.text, (m.location or {}).get("url", ""))))
        page.on("pageerror", lambda e: console.append(("pageerror", f"{e}\n{e.stack}", "")))
        page.goto(comfy["base"] + "/", wait_until="networkidle", timeout=120_000)
        page.wait_for_function("window.app && window.app.graph && window.app.api",
                               timeout=60_000)
        page.wait_for_timeout(2000)
        for _ in range(5):  # ComfyUI's first-run dialogs (templates, news) cover the page
            if page.locator(".p-dialog-mask").count() == 0:
                break
            page.keyboard.press("Escape")
            page.wait_for_timeout(500)
        page.add_style_tag(content=".minimap-main-container { display: none !important; }")
        page.evaluate("""async ([g, model]) => {
          const app = window.app;
          await app.loadGraphData(g);
          const set = (n, name, v) => { n.widgets.find((w) => w.name === name).value = v; };
          for (const n of app.graph._nodes) {
            if (n.type === "xDiT.LoadModel") {
              set(n, "model", model); set(n, "device", "cpu"); set(n, "dtype", "fp32");
              set(n, "world_size", "2");
            }
            if (n.type === "EmptySD3LatentImage") { set(n, "width", 64); set(n, "height", 64); }
            if (n.type === "xDiT.Sampler") {
              set(n, "steps", 2); set(n, "max_sequence_length", 16); set(n, "seed", 9);
            }
          }
          window.__xditDone = null;
          window.__xditTexts = [];
          app.api.addEventListener("progress_text",
                                   (e) => window.__xditTexts.push([e.detail.nodeId, e.detail.text]));
          app.api.addEventListener("execution_success", () => { window.__xditDone = "success"; });
          app.api.addEventListener("execution_error",
                                   (e) => { window.__xditDone = JSON.stringify(e.detail); });
          await app.queuePrompt(0);
        }""", [g, MODEL_NAME])
        page.wait_for_function("window.__xditDone", timeout=600_000, polling=500)
        done = page.evaluate("window.__xditDone")
        sent = page.evaluate("window.__xditTexts")
        page.wait_for_timeout(1000)
        page.evaluate(FIT_GRAPH)
        page.wait_for_timeout(1500)
        geo = page.evaluate(NODE_TEXT_GEOMETRY)
        boxes = [n["box"] for n in geo["nodes"]]
        clip = {"x": min(b["left"] for b in boxes) - 20, "y": min(b["top"] for b in boxes) - 40,
                "width": max(b["right"] for b in boxes) - min(b["left"] for b in boxes) + 40,
                "height": max(b["bottom"] for b in boxes) - min(b["top"] for b in boxes) + 60}
        shot = Path(os.environ.get("XDIT_SCREENSHOT_DIR", tmp_path)) / "node-texts.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), clip=clip)
        browser.close()
    assert done == "success", done
    texts = {t["type"]: t for t in geo["texts"]}
    print(f"\nscale {geo['scale']}; screenshot {shot}; texts sent: {sent}")
    for t in geo["texts"]:
        print(f"{t['type']}: {t['text']!r}: text {t['textWidth']:.1f} px in a "
              f"{t['clientWidth']}x{t['clientHeight']} box (scroll "
              f"{t['scrollWidth']}x{t['scrollHeight']}), {t['lines']} line(s)")
    assert {"xDiT.LoadModel", "xDiT.Sampler", "xDiT.Decode"} <= set(texts), texts
    assert texts["xDiT.LoadModel"]["text"] == "runs on cpu, fp32, 2 ranks"
    assert DONE.match(texts["xDiT.Sampler"]["text"]), texts["xDiT.Sampler"]
    assert re.fullmatch(r"2 ranks, [\d.]+ s", texts["xDiT.Decode"]["text"])
    for t in geo["texts"]:
        assert t["found"], t
        assert t["scrollWidth"] <= t["clientWidth"], t  # no horizontal cut
        assert t["scrollHeight"] <= t["clientHeight"], t  # nothing below the box's edge
        assert t["lines"] == 1, t  # one line: no wrap
        own = next(n["box"] for n in geo["nodes"] if n["id"] == t["id"])
        assert _inside(t["rect"], own), t
        hit = [n for n in geo["nodes"] if n["id"] != t["id"] and _overlap(t["rect"], n["box"])]
        assert not hit, (t, hit)
    for n in geo["nodes"]:  # nor has a text grown its node over another
        hit = [m for m in geo["nodes"] if m["id"] != n["id"] and _overlap(n["box"], m["box"])]
        assert not hit, (n, hit)
    bad = [m for m in console if m[0] in ("error", "warning", "pageerror")]
    ours = [m for m in bad if re.search(r"xdit", m[1] + m[2], re.I)]
    print(f"console: {len(bad)} errors/warnings, none from the pack:",
          sorted({m[1].splitlines()[0][:100] for m in bad}))
    assert not ours, ours
    assert shot.stat().st_size > 10_000


def _refused(comfy, wf) -> dict:
    try:
        http(comfy["base"], "/prompt", {"prompt": wf, "client_id": "x"})
    except urllib.error.HTTPError as e:
        assert e.code == 400
        return json.loads(e.read())
    raise AssertionError("the workflow was accepted")


@pytest.mark.parametrize("name", sorted(EXAMPLE_MODELS))
def test_example_workflow_runs_unmodified_on_cpu(comfy, name):
    """The example as shipped (device auto, dtype auto, 1024x1024, its steps): on this
    CPU-only ComfyUI auto means cpu/fp32, and the image is saved."""
    wf = json.loads((ROOT / "example_workflows" / name).read_text())
    loader = next(n for n in wf.values() if n["class_type"] == "xDiT.LoadModel")
    assert loader["inputs"]["device"] == "auto" and loader["inputs"]["model"] == \
        EXAMPLE_MODELS[name][0]
    pid, msgs = run(comfy, wf, timeout=1200)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    saved = [o for o in history(comfy, pid)["outputs"].values()
             if o.get("images")]
    assert saved and saved[0]["images"][0]["filename"].endswith(".png")
    texts = [m["text"] for m in msgs if m.get("type") == "progress_text"]
    assert "runs on cpu, fp32, 2 ranks" in texts, texts
    sampler = next(k for k, n in wf.items() if n["class_type"] == "xDiT.Sampler")
    last = [m["text"] for m in msgs if m.get("type") == "progress_text"
            and m["node"] == sampler][-1]  # what ran, not the launch's "loading 2/2"
    steps = wf[sampler]["inputs"]["steps"]
    assert last.startswith(f"{steps} steps, 2 ranks") and DONE.match(last), last
    print(f"\n{name}: Sampler text after the run: {last!r}")
    pool = _pool(comfy, EXAMPLE_MODELS[name][0])
    assert (pool["device"], pool["dtype"]) == ("cpu", "fp32")


def test_cuda_forced_on_a_cpu_comfyui_is_refused_once(comfy):
    wf = json.loads((ROOT / "example_workflows" / "xdit_flux_text_to_image_api.json")
                    .read_text())
    wf["1"]["inputs"]["device"] = "cuda"
    body = _refused(comfy, wf)
    errors = [e for v in body["node_errors"].values() for e in v["errors"]]
    assert len(errors) == 1, body
    assert "device cuda: ComfyUI runs with --cpu; use device auto" in errors[0]["details"]
    # a missing model says where it looked and what it found, also once
    wf["1"]["inputs"].update(device="auto", model="FLUX.1-schnell")
    errors = [e for v in _refused(comfy, wf)["node_errors"].values() for e in v["errors"]]
    assert len(errors) == 1 and "model 'FLUX.1-schnell' not found" in errors[0]["details"]
    assert "models/diffusers" in errors[0]["details"] and "FLUX.1-dev" in errors[0]["details"]


def test_launch_progress_shows_on_the_node_before_step_1(comfy):
    http(comfy["base"], "/xdit/unload", {})  # the next job launches the pool
    wf = _workflow(3)
    wf["3"]["inputs"]["seed"] = 5
    pid, msgs = run(comfy, wf)
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    first_step = next(i for i, m in enumerate(msgs) if m.get("type") == "progress"
                      and m["data"]["node"] == "3" and m["data"]["max"] == 3)
    before = msgs[:first_step]
    texts = [m["text"] for m in before if m.get("type") == "progress_text" and m["node"] == "3"]
    assert texts[0] == "starting 2 workers" and "loading 2/2" in texts, texts
    # the launch text is replaced by what ran when the job is done
    done = [m["text"] for m in msgs if m.get("type") == "progress_text" and m["node"] == "3"]
    assert done[-1].startswith("3 steps, 2 ranks (Ulysses 2), ") and \
        done[-1].endswith(" s launch") and DONE.match(done[-1]), done
    print(f"\nSampler text after a launching run: {done[-1]!r}")
    bars = [(m["data"]["value"], m["data"]["max"]) for m in before
            if m.get("type") == "progress" and m["data"]["node"] == "3"]
    assert bars and bars[0] == (0, 2) and bars[-1] == (2, 2), bars


def test_killed_worker_reaches_the_dialog_as_one_sentence(comfy):
    cid = uuid.uuid4().hex
    ws = ws_connect(comfy, cid)
    wf = _workflow(5000)
    wf["3"]["inputs"]["seed"] = 6
    pid = http(comfy["base"], "/prompt", {"prompt": wf, "client_id": cid})["prompt_id"]
    messages(ws, lambda m: m.get("type") == "progress" and m["data"].get("node") == "3"
              and m["data"]["max"] == 5000, 300)
    ranks = _pool(comfy)["ranks"]
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    msgs = messages(ws, lambda m: m.get("type") in ("execution_error", "execution_success",
                                                     "execution_interrupted")
                     and m["data"].get("prompt_id") == pid, 120)
    ws.close()
    assert msgs[-1]["type"] == "execution_error", msgs[-1]
    err = msgs[-1]["data"]["exception_message"].strip()  # ComfyUI adds a newline
    assert err.startswith("worker rank 1 (pid ") and "was killed by SIGKILL" in err, err
    assert "\n" not in err and "^^^" not in err and "last log lines" not in err, err
    st = http(comfy["base"], "/xdit/status")
    assert err in st["last_error"] and os.path.isfile(st["last_error_log"])
    assert err.endswith(f"Full log: {st['last_error_log']}")
    assert "rank 1 log" in comfy["log"].read_text()  # the full log on ComfyUI's console
    # the next job relaunches and clears the panel's error
    pid, msgs = run(comfy, _workflow(2))
    assert msgs[-1]["type"] == "execution_success", msgs[-1]
    assert http(comfy["base"], "/xdit/status")["last_error"] is None


def test_interrupt_during_the_launch_stops_it(comfy):
    http(comfy["base"], "/xdit/unload", {})
    cid = uuid.uuid4().hex
    ws = ws_connect(comfy, cid)
    wf = _workflow(3)
    wf["3"]["inputs"]["seed"] = 8
    pid = http(comfy["base"], "/prompt", {"prompt": wf, "client_id": cid})["prompt_id"]
    messages(ws, lambda m: m.get("type") == "progress_text" and m["node"] == "3"
              and m["text"] == "starting 2 workers", 300)
    t = time.monotonic()
    http(comfy["base"], "/interrupt", {})
    msgs = messages(ws, lambda m: m.get("type") in ("execution_interrupted", "execution_success",
                                                     "execution_error")
                     and m["data"].get("prompt_id") == pid, 120)
    ws.close()
    assert msgs[-1]["type"] == "execution_interrupted", msgs[-1]
    assert time.monotonic() - t < 30
    assert not [m for m in msgs if m.get("type") == "progress" and m["data"]["max"] == 3]
    pools = http(comfy["base"], "/xdit/status")["pools"]
    mine = [p for p in pools if p["model"].rstrip("/").endswith(MODEL_NAME)]
    assert mine and mine[0]["state"] == "stopped" and mine[0]["launches"] == 0
