"""Scaffolding of the live ComfyUI tests (tests/test_comfyui_live*.py, skipped unless
COMFYUI_PATH is set): placing models and helper packs into a ComfyUI checkout, running its
`main.py --cpu` for a test module, and talking to it over HTTP and /ws."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMFY = os.environ.get("COMFYUI_PATH")
skip_without_comfyui = pytest.mark.skipif(not COMFY,
                                          reason="COMFYUI_PATH not set (live ComfyUI test)")
HELPERS = {"xdit-live-test-helpers": "xdit_test_conditioning",
           "xdit-live-test-model-nodes": "xdit_test_model_nodes"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base, path, data=None, timeout=30):
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(base + path, data=body, method="POST" if data is not None
                                 else "GET", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw


def comfy_vae(path: Path) -> None:
    """A random 16-channel VAE in the layout ComfyUI's VAELoader recognises (ch 128,
    ch_mult 1,2,4,4, 2 res blocks), saved in diffusers key format, which ComfyUI converts."""
    if path.exists():
        return
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    import torch
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                        block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                        down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(tmp))
    tmp.rename(path)


def comfy_flux2_vae(path: Path) -> None:
    """A random FLUX.2 VAE (diffusers AutoencoderKLFlux2 at its default widths: 32 latent
    channels, ch 128, ch_mult 1,2,4,4, 2 res blocks, which ComfyUI fixes) with random
    batch-norm statistics, saved in diffusers key format: ComfyUI 0.8.0's VAELoader
    converts it and, seeing `bn.running_mean`, builds its FLUX.2 VAE (128-channel LATENTs,
    16x). ~84 M parameters, fp32."""
    if path.exists():
        return
    from diffusers import AutoencoderKLFlux2
    from safetensors.torch import save_file
    import torch
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2()
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    sd["bn.running_mean"] = 0.2 * torch.randn(sd["bn.running_mean"].shape, generator=g)
    sd["bn.running_var"] = 0.5 + torch.rand(sd["bn.running_var"].shape, generator=g)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(sd, str(tmp))
    tmp.rename(path)


def link_packs(comfy: Path, *helpers: str) -> None:
    """This pack and the named test-only helper packs (tests/live_helpers) into
    custom_nodes/, as symlinks (kept between modules)."""
    pairs = [("comfyui-xdit-under-test", ROOT)]
    pairs += [(name, ROOT / "tests" / "live_helpers" / HELPERS[name]) for name in helpers]
    for name in HELPERS:  # a helper link left dangling (a removed checkout) fails ComfyUI's start
        path = comfy / "custom_nodes" / name
        if path.is_symlink() and not path.exists():
            path.unlink()
    for name, target in pairs:
        path = comfy / "custom_nodes" / name
        if path.is_symlink() and path.resolve() != target.resolve():
            path.unlink()  # another checkout's link: this one is under test
        if not path.is_symlink() and not path.exists():
            path.symlink_to(target, target_is_directory=True)


def _settings_nodes() -> dict:
    """{node id: (loader input, {widget: default})} of the settings nodes, read from the
    value types the nodes are built from (comfyui_xdit/nodes/settings.py): a widget added
    there (ParallelSettings' split, say) is in every graph these tests send."""
    from comfyui_xdit.nodes import settings as s
    return {f"xDiT.{t.__name__}": (inp, {w.name or n: d for n, d, w in s._widgets(t)
                                         if not w.optional})
            for t, inp in ((s.ParallelSettings, "parallel"),
                           (s.PipeFusionSettings, "pipefusion"),
                           (s.EngineSettings, "engine"))}


SETTINGS = _settings_nodes()  # the settings nodes: loader input, widgets with their defaults


def twin_ksamplers(wf: dict, out: dict, positive, negative, latent="6", *, seed, steps,
                   cfg, sampler, scheduler) -> None:
    """The same KSampler on the xDiT MODEL (node "2": LATENT saved to out["x"]) and on
    ComfyUI's own model of the same file (node "3": out["n"]), each LATENT saved by the test
    helpers' XDiTTestSaveTensors; `positive` / `negative` are node outputs ([id, index])."""
    for b, model, k, s in (("x", ["2", 0], "7", "12"), ("n", ["3", 0], "8", "13")):
        wf[k] = {"class_type": "KSampler",
                 "inputs": {"model": model, "seed": seed, "steps": steps, "cfg": cfg,
                            "sampler_name": sampler, "scheduler": scheduler,
                            "positive": positive, "negative": negative,
                            "latent_image": [latent, 0], "denoise": 1.0}}
        wf[s] = {"class_type": "XDiTTestSaveTensors",
                 "inputs": {"latent": [k, 0], "path": out[b]}}


def with_settings(wf: dict, loader: str, **choices) -> dict:
    """Connect to loader node `loader` the settings nodes that carry `choices` (named as the
    nodes' widgets, e.g. ulysses=2, compile=True), as nodes "<loader>0<k>"; returns wf."""
    left = dict(choices)
    for k, (cls, (inp, defaults)) in enumerate(SETTINGS.items(), 1):
        mine = {n: left.pop(n) for n in list(left) if n in defaults}
        if mine:
            nid = f"{loader}0{k}"
            wf[nid] = {"class_type": cls, "inputs": dict(defaults, **mine)}
            wf[loader]["inputs"][inp] = [nid, 0]
    assert not left, f"no settings node has {sorted(left)}"
    return wf


def place(src: Path, dst: Path) -> Path:
    """A fresh copy of the model folder `src` at `dst` (whatever was there is replaced)."""
    if dst.is_symlink() or dst.exists():
        dst.unlink() if dst.is_symlink() else shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)
    return dst


@contextlib.contextmanager
def running_comfyui(comfy: Path, log: Path, *args: str):
    """`main.py --cpu` on a free port (COMFYUI_PYTHON: its venv's python) until the block
    ends: yields {"base", "port", "log"}. Then the pack's pools are unloaded, ComfyUI is
    stopped, and its log must show no failed custom-node import."""
    py = os.environ.get("COMFYUI_PYTHON", sys.executable)
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([py, "main.py", "--cpu", "--listen", "127.0.0.1", "--port",
                                 str(port), "--disable-auto-launch", *args], cwd=comfy,
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            http(base, "/system_stats", timeout=5)
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("ComfyUI did not start:\n" + log.read_text()[-4000:])
            time.sleep(1)
    try:
        yield {"base": base, "port": port, "log": log}
    finally:
        try:
            http(base, "/xdit/unload", {})
        except Exception:
            pass
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text()
    assert "IMPORT FAILED" not in text, text[-3000:]


def ws_connect(comfy, client_id):
    """A /ws connection whose reads time out after 5 s (`messages` polls). The handshake
    may wait longer: a busy server (a loaded machine, a model being freed) answered it late,
    and a 5-s handshake failed the test ("Cannot write to closing transport" in its log)."""
    import websocket
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{comfy['port']}/ws?clientId={client_id}", timeout=120)
    ws.settimeout(5)
    return ws


def messages(ws, until, timeout):
    """/ws messages until `until(message)` holds (JSON ones as dicts; progress text as
    {"type": "progress_text", "node", "text"}; previews as {"type": "binary_preview"})."""
    import websocket
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            m = ws.recv()
        except websocket.WebSocketTimeoutException:
            continue
        if isinstance(m, bytes):
            (kind,) = struct.unpack(">I", m[:4])
            if kind == 3:  # ComfyUI's progress text: node id length, node id, text
                (n,) = struct.unpack(">I", m[4:8])
                out.append({"type": "progress_text", "node": m[8:8 + n].decode(),
                            "text": m[8 + n:].decode()})
            else:
                out.append({"type": "binary_preview", "size": len(m)})
            if until(out[-1]):
                return out
            continue
        msg = json.loads(m)
        out.append(msg)
        if until(msg):
            return out
    raise AssertionError(f"timed out; last messages: {out[-8:]}")


def run(comfy, wf, timeout=600):
    """Queue API-format workflow `wf`; (prompt id, its /ws messages up to success or error)."""
    cid = uuid.uuid4().hex
    ws = ws_connect(comfy, cid)
    pid = http(comfy["base"], "/prompt", {"prompt": wf, "client_id": cid})["prompt_id"]
    msgs = messages(ws, lambda m: m.get("type") in ("execution_success", "execution_error")
                    and m["data"].get("prompt_id") == pid, timeout)
    ws.close()
    return pid, msgs


def history(comfy, pid: str, timeout: float = 120) -> dict:
    """A finished prompt's /history entry. ComfyUI sends execution_success from its executor
    and writes the entry afterwards, in its queue worker: on a loaded machine the entry can
    lag the message, so wait for it (a missing entry after `timeout` fails naming the
    prompt)."""
    deadline = time.monotonic() + timeout
    while True:
        hist = http(comfy["base"], f"/history/{pid}")
        if pid in hist:
            return hist[pid]
        if time.monotonic() > deadline:
            raise AssertionError(f"no /history entry for prompt {pid} after {timeout} s")
        time.sleep(0.2)


def wait_for_memory(gib: float, what: str, wait_s: float = 900) -> None:
    """Wait (up to `wait_s`) until the machine has `gib` GiB available for `what`, else skip
    saying so: the wide models' branches (FLUX.1-wide, FLUX.2-wide) are large, and a shared
    machine's other work comes and goes (an OOM kill would take someone else's process)."""
    deadline = time.monotonic() + wait_s
    while True:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f
                         if line.startswith("MemAvailable:")) / 2 ** 20
        if avail >= gib:
            return
        if time.monotonic() > deadline:
            pytest.skip(f"{what} needs ~{gib:.0f} GiB of memory; {avail:.1f} GiB available")
        time.sleep(10)


def tensors(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))
