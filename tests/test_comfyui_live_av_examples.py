"""The audio-video example workflows in a real ComfyUI (skipped unless COMFYUI_PATH is set;
COMFYUI_PYTHON: its venv's python; docs/testing.md "The live ComfyUI suites").

example_workflows/xdit_ltx2_text_to_video, xdit_ltx2_image_to_video and
xdit_minimax_h3_text_to_video (on ComfyUI 0.8.0 and later, which have the AV LATENT; on
0.3.64 the Sampler refuses them in one line) run with the tiny diffusers folders (`tiny-model`'s, t2v) placed in
models/diffusers/ under the names the examples load, each in both forms:

* the API form through /prompt, shrunk (SHRINK: size, frames, steps; everything else as
  shipped: device / dtype / world size auto, the prompt typed into the sampler, the start
  image ComfyUI's own input/example.png), with the test helpers' XDiTTestSaveTensors on
  Decode (xDiT)'s IMAGE and AUDIO and on the sampler's LATENT;
* the UI form loaded into the real frontend (headless Chromium), the same widgets shrunk
  there, its API prompt (the frontend's graphToPrompt) equal to the API twin's, and queued
  from the page as a user's Queue button does.

What the user gets is checked in each: SaveVideo's file, read back with PyAV (ComfyUI's
video library, in its venv), has a video stream of the LATENT's frames at its size and an
audio stream at the family's sample rate (LTX-2's vocoder 24 kHz, MiniMax-H3's audio VAE
32 kHz) lasting the video's duration; Decode's AUDIO is ComfyUI's AUDIO ({"waveform"
[B, channels, samples], "sample_rate" int}). And each example names only nodes this ComfyUI
has and files its loaders list once placed, and its Note names them.
"""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
import urllib.parse
from pathlib import Path

import pytest

from live_comfy import (COMFY, ROOT, history, http, link_packs, place, run, running_comfyui,
                        skip_without_comfyui)

pytestmark = skip_without_comfyui



def _workflow_files():
    """scripts/workflow_files.py: the files each example loads, as docs/workflow-files.md
    and the examples' Notes list them."""
    spec = importlib.util.spec_from_file_location("workflow_files",
                                                  ROOT / "scripts" / "workflow_files.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FPS = 24  # CreateVideo's fps in every example
# family -> (example stem, the folder it loads, audio sample rate)
EXAMPLES = {"xdit_ltx2_text_to_video": ("ltx2", "LTX-2", 24000),
            "xdit_ltx2_image_to_video": ("ltx2", "LTX-2", 24000),
            "xdit_minimax_h3_text_to_video": ("minimax_h3", "MiniMax-H3", 32000)}
# the examples shrunk, by node class: LTX-2 96 x 64, 9 frames (2 latent frames of 3 x 2);
# MiniMax-H3 96 x 64 from EmptyHunyuanLatentVideo's length 25: 7 latent frames, 22 video
# frames ((7 - 2) / 5 x 17 + 5)
SHRINK = {"EmptyLTXVLatentVideo": {"width": 96, "height": 64, "length": 9},
          "EmptyHunyuanLatentVideo": {"width": 96, "height": 64, "length": 25},
          "xDiT.Sampler": {"steps": 2}}
# the UI form runs at another seed, so that none of its nodes is served from ComfyUI's cache
# of an API run of the same example (its own run makes the file probed)
UI_SHRINK = dict(SHRINK, **{"xDiT.Sampler": dict(SHRINK["xDiT.Sampler"], seed=2)})
FRAMES = {"ltx2": 9, "minimax_h3": 22}
SIZE = (96, 64)  # width, height
# AAC frames are 1024 samples: the decoded track may differ from the waveform by one frame
AAC_FRAME = 1024
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def av_latent_here(comfy: Path) -> bool:
    """Whether this ComfyUI has the AV LATENT Sampler (xDiT) gives a video with its sound
    as (a NestedTensor: 0.8.0 and later). The examples need nothing else of the family
    from ComfyUI (the diffusers folder brings its own encoders and VAEs): without it the
    Sampler refuses them in one line."""
    return (comfy / "comfy" / "nested_tensor.py").exists()


def release_hop_vocoder(folder: Path) -> None:
    """The tiny LTX-2 folder's vocoder upsamples a mel frame 4x (132 samples, 5.5 ms, for 9
    frames of video): here a random one at the release's 240x (6 x 5 x 2 x 2 x 2: 16 kHz mel
    frames of hop 160 to 24 kHz), so the track lasts what the release's would."""
    import torch
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    cfg = json.loads((folder / "vocoder" / "config.json").read_text())
    torch.manual_seed(0)
    LTX2Vocoder(in_channels=cfg["in_channels"], hidden_channels=32,
                out_channels=cfg["out_channels"], resnet_kernel_sizes=[3],
                resnet_dilations=[[1]], output_sampling_rate=24000).save_pretrained(
        folder / "vocoder")


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfyui_xdit.testmodels.tiny_model import ensure_tiny_model

    comfy = Path(COMFY)
    link_packs(comfy, "xdit-live-test-model-nodes")
    cache = tmp_path_factory.mktemp("av-models")
    for fam, folder in {f: name for f, name, _ in EXAMPLES.values()}.items():
        placed = place(ensure_tiny_model(fam, cache), comfy / "models" / "diffusers" / folder)
        if fam == "ltx2":
            release_hop_vocoder(placed)
    log = tmp_path_factory.mktemp("comfy-av-examples") / "comfyui.log"
    with running_comfyui(comfy, log) as server:
        yield dict(server, tmp=log.parent, av=av_latent_here(comfy), path=comfy,
                   info=http(server["base"], "/object_info", timeout=120))




def _shrunk_api(stem: str, shrink: dict = SHRINK) -> dict:
    wf = json.loads((ROOT / "example_workflows" / f"{stem}_api.json").read_text())
    for node in wf.values():
        node["inputs"].update(shrink.get(node["class_type"], {}))
    return wf


def _ok(msgs):
    last = msgs[-1]
    assert last["type"] == "execution_success", \
        (last["data"].get("node_type"), last["data"].get("exception_message"),
         "".join(last["data"].get("traceback") or [])[-3000:])


def _saved_video(comfy, pid: str, save_id: str, dst: Path) -> Path:
    """SaveVideo's file of prompt `pid` (its /history entry), fetched through /view."""
    out = history(comfy, pid)["outputs"]
    assert save_id in out, (save_id, out)
    files = [f for key in ("images", "videos", "animated", "gifs") for f in out[save_id].get(key, [])
             if isinstance(f, dict) and "filename" in f]
    assert len(files) == 1, out[save_id]
    q = urllib.parse.urlencode({k: files[0].get(k, "") for k in ("filename", "subfolder", "type")})
    dst.write_bytes(http(comfy["base"], f"/view?{q}", timeout=60))
    return dst


def probe(path: Path) -> dict:
    """The file's streams as a player sees them (PyAV: every packet decoded)."""
    av = pytest.importorskip("av", reason="PyAV (ComfyUI's video library) is not in this venv")
    fig = {}
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        fig.update(container=c.format.name, video_codec=v.codec_context.name,
                   width=v.codec_context.width, height=v.codec_context.height,
                   fps=float(v.average_rate), audio_streams=len(c.streams.audio))
        fig["frames"] = sum(1 for _ in c.decode(video=0))
    if fig["audio_streams"]:
        with av.open(str(path)) as c:
            a = c.streams.audio[0]
            fig.update(audio_codec=a.codec_context.name, sample_rate=a.codec_context.sample_rate,
                       channels=a.codec_context.layout.nb_channels)
            samples, peak = 0, 0.0
            for frame in c.decode(audio=0):
                x = frame.to_ndarray()
                samples += frame.samples
                peak = max(peak, float(abs(x).max()) if x.size else 0.0)
            fig.update(audio_samples=samples, audio_s=samples / fig["sample_rate"],
                       audio_peak=peak)
    return fig


def _check_video(fig: dict, fam: str, rate: int, waveform_samples: int | None = None) -> None:
    """The file holds the video and its sound: frames, size, rate and duration."""
    frames = FRAMES[fam]
    assert (fig["width"], fig["height"]) == SIZE, fig
    assert fig["frames"] == frames and round(fig["fps"]) == FPS, fig
    assert fig["audio_streams"] == 1, fig  # the sound reached the file
    assert fig["sample_rate"] == rate, fig
    # SaveVideo keeps ceil(rate / fps x frames) samples of the waveform (never more)
    kept = math.ceil(rate / FPS * frames)
    if waveform_samples is not None:
        kept = min(kept, waveform_samples)
    assert abs(fig["audio_samples"] - kept) <= AAC_FRAME, (fig, kept)
    assert abs(fig["audio_s"] - frames / FPS) <= AAC_FRAME / rate + 1 / FPS, fig
    assert fig["audio_peak"] > 1e-4, fig  # not silence


@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_example_names_only_nodes_and_files_that_exist(comfy, stem):
    """Both forms name only nodes this ComfyUI has (the Note is the frontend's own); every
    file the example loads is in its loader's list once placed, in docs/workflow-files.md
    and in the UI form's Note."""
    _, folder, _ = EXAMPLES[stem]
    info = comfy["info"]
    api = json.loads((ROOT / "example_workflows" / f"{stem}_api.json").read_text())
    ui = json.loads((ROOT / "example_workflows" / f"{stem}.json").read_text())
    types = {n["class_type"] for n in api.values()} | {n["type"] for n in ui["nodes"]}
    assert types - {"Note", "MarkdownNote"} <= set(info), sorted(types - set(info))
    notes = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Note"]
    assert len(notes) == 1, stem
    page = (ROOT / "docs" / "workflow-files.md").read_text()
    wff = _workflow_files()
    rows = wff.needs()[stem]
    assert ("xDiT.LoadModel", "models/diffusers", folder) in rows, rows
    for node, where, file in rows:
        spec = info[node]["input"]["required"]
        widget = next(name for name, _, f in wff.LOADERS[node] if f == where)
        options = spec[widget][0] if isinstance(spec[widget][0], list) else \
            spec[widget][1].get("options", [])
        assert file in options, (node, widget, file, options)
        assert (comfy["path"] / where / file).exists(), (where, file)
        assert f"{where}/{file}" in notes[0], (file, notes[0])
        assert f"`{stem}`" in page and (f"`{file}/`" in page or f"`{file}`" in page), file


@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_api_example_saves_a_video_with_its_sound(comfy, stem):
    fam, folder, rate = EXAMPLES[stem]
    wf = _shrunk_api(stem)
    by_type = {}
    for nid, node in wf.items():
        by_type.setdefault(node["class_type"], []).append(nid)
    (loader,) = by_type["xDiT.LoadModel"]
    assert wf[loader]["inputs"]["model"] == folder
    assert (wf[loader]["inputs"]["device"], wf[loader]["inputs"]["world_size"]) == \
        ("auto", "auto")
    (sampler,), (decode,), (create,), (save,) = (by_type[t] for t in (
        "xDiT.Sampler", "xDiT.Decode", "CreateVideo", "SaveVideo"))
    assert wf[create]["inputs"].get("audio") == [decode, 1], "the sound is not in the video"
    saved = comfy["tmp"] / f"{stem}-api.safetensors"
    wf["99"] = {"class_type": "XDiTTestSaveTensors",
                "inputs": {"path": str(saved), "images": [decode, 0], "audio": [decode, 1],
                           "latent": [sampler, 0]}}
    pid, msgs = run(comfy, wf, timeout=1500)
    if not comfy["av"]:  # refused in one line, before anything ran
        err = msgs[-1]["data"]
        assert msgs[-1]["type"] == "execution_error" and err["node_type"] == "xDiT.Sampler", err
        assert "AV LATENT" in err["exception_message"] and "0.8.0 or later" in \
            err["exception_message"] and "\n" not in err["exception_message"].strip(), err
        print(f"\n{stem}: {err['exception_message']}")
        return
    _ok(msgs)
    from safetensors import safe_open
    with safe_open(str(saved), "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    frames = FRAMES[fam]
    # ComfyUI's AUDIO: waveform [B, channels, samples], sample_rate an int
    assert meta["audio_keys"] == "sample_rate,waveform", meta
    assert meta["sample_rate_type"] == "int" and int(meta["sample_rate"]) == rate, meta
    wave = t["audio"]
    assert wave.dim() == 3 and wave.shape[0] == 1 and wave.shape[1] in (1, 2), wave.shape
    assert bool(wave.isfinite().all()) and float(wave.std()) > 0
    assert t["image"].shape == (frames, SIZE[1], SIZE[0], 3), t["image"].shape
    assert "latent_1" in t, sorted(t)  # the sampler's LATENT nests the sound
    fig = probe(_saved_video(comfy, pid, save, comfy["tmp"] / f"{stem}-api.mp4"))
    fig.update(waveform=list(wave.shape), waveform_s=wave.shape[-1] / rate,
               latent_video=list(t["latent_0"].shape), latent_audio=list(t["latent_1"].shape))
    print(f"\n{stem} (API): {json.dumps(fig)}")
    _check_video(fig, fam, rate, wave.shape[-1])
    assert fig["channels"] == wave.shape[1], fig
    # the waveform lasts the video: LTX-2's causal audio VAE gives 4 (L - 1) + 1 mel frames
    # of L latents (30 ms short of 4 L), L = round(frames / 24 x 25)
    assert abs(fig["waveform_s"] - frames / FPS) <= 0.1, fig


# the UI form in the page: widgets shrunk as UI_SHRINK says, its prompt, then queued
UI_RUN = """async ([g, shrink]) => {
  const app = window.app;
  await app.loadGraphData(g);
  for (const n of app.graph._nodes) {
    for (const [name, v] of Object.entries(shrink[n.type] || {})) {
      const w = (n.widgets || []).find((w) => w.name === name);
      if (!w) throw new Error(`${n.type} has no widget ${name}`);
      w.value = v;
    }
  }
  const p = await app.graphToPrompt();
  window.__avDone = null;
  window.__avQueued = null;
  app.api.addEventListener("execution_success",
                           (e) => { window.__avDone = {ok: true, detail: e.detail}; });
  app.api.addEventListener("execution_error",
                           (e) => { window.__avDone = {ok: false, detail: e.detail}; });
  // a prompt the server refuses (validation) runs nothing: end the wait with its answer
  const queue = app.api.queuePrompt.bind(app.api);
  app.api.queuePrompt = async (...args) => {
    try {
      const r = await queue(...args);
      window.__avQueued = r;
      return r;
    } catch (e) {
      window.__avDone = {ok: false, detail: String(e) + " " + JSON.stringify(e.response ?? null)};
      throw e;
    }
  };
  await app.queuePrompt(0);
  return p.output;
}"""


@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_ui_example_queued_in_the_frontend_saves_a_video_with_its_sound(comfy, stem,
                                                                         tmp_path):
    fam, _, rate = EXAMPLES[stem]
    if not comfy["av"]:
        pytest.skip("this ComfyUI has no AV LATENT (0.8.0 and later): the Sampler refuses "
                    "the example in one line (the API test checks it)")
    pw = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium (Debian package chromium)")
    g = json.loads((ROOT / "example_workflows" / f"{stem}.json").read_text())
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(comfy["base"] + "/", wait_until="networkidle", timeout=120_000)
        page.wait_for_function("window.app && window.app.graph && window.app.api",
                               timeout=60_000)
        sent = page.evaluate(UI_RUN, [g, UI_SHRINK])
        page.wait_for_function("window.__avDone", timeout=1_500_000, polling=1000)
        done = page.evaluate("window.__avDone")
        queued = page.evaluate("window.__avQueued")
        browser.close()
    assert done["ok"], done
    assert queued and queued["prompt_id"] == done["detail"]["prompt_id"], (queued, done)
    # the page sent the API twin (shrunk alike): same nodes, links and values
    api = _shrunk_api(stem, UI_SHRINK)
    assert {k: n["class_type"] for k, n in sent.items()} == \
        {k: n["class_type"] for k, n in api.items()}
    for nid, node in api.items():
        for name, value in node["inputs"].items():
            assert sent[nid]["inputs"].get(name) == value, (nid, name, sent[nid]["inputs"])
    (save,) = [k for k, n in api.items() if n["class_type"] == "SaveVideo"]
    fig = probe(_saved_video(comfy, done["detail"]["prompt_id"], save, tmp_path / "ui.mp4"))
    print(f"\n{stem} (UI, queued in the frontend): {json.dumps(fig)}")
    _check_video(fig, fam, rate)
