"""The example workflows: each UI-format file (the graph editor's saved format, made in the
real ComfyUI frontend by tests/live_helpers/export_ui_workflows.py) describes the same nodes,
links and widget values as its API-format twin, references only nodes that exist, and has a
same-named .jpg thumbnail. tests/test_comfyui_live.py also runs them in a real ComfyUI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WF = ROOT / "example_workflows"
API_FILES = sorted(WF.glob("*_api.json"))
# stock ComfyUI nodes the examples may use (checked against /object_info by the live test)
STOCK = {"EmptySD3LatentImage", "EmptyLatentImage", "SaveImage", "PreviewImage", "VAELoader",
         "VAEDecode", "CLIPTextEncode", "DualCLIPLoader", "TripleCLIPLoader", "FluxGuidance",
         "KSampler", "KSamplerAdvanced", "ModelSamplingFlux", "ModelSamplingSD3",
         "CLIPLoader", "EmptyHunyuanLatentVideo", "CreateVideo", "SaveVideo",
         "SaveAnimatedWEBP", "LoadImage", "WanImageToVideo", "EmptyHunyuanVideo15Latent",
         "HunyuanVideo15ImageToVideo", "CLIPVisionLoader", "CLIPVisionEncode",
         "EmptyLTXVLatentVideo"}


def our_node_ids() -> set:
    """node_id="..." of every schema in the node modules (comfyui_xdit/nodes/*.py; read as
    text: importing needs ComfyUI)."""
    return {n for f in (ROOT / "comfyui_xdit" / "nodes").glob("*.py")
            for n in re.findall(r'node_id="([^"]+)"', f.read_text())}


def api_graph(api: dict):
    nodes = {str(k): v["class_type"] for k, v in api.items()}
    links, widgets = set(), {}
    for nid, node in api.items():
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                links.add((str(value[0]), int(value[1]), str(nid), name))
            else:
                widgets[(str(nid), name)] = value
    return nodes, links, widgets


# canvas-only nodes the frontend leaves out of the API prompt (the files Note)
VIRTUAL = {"Note", "MarkdownNote"}


def ui_graph(ui: dict):
    nodes = {str(n["id"]): n for n in ui["nodes"] if n["type"] not in VIRTUAL}
    links = set()
    for link_id, src, src_slot, dst, dst_slot, _type in ui["links"]:
        assert str(src) in nodes and str(dst) in nodes, f"link {link_id} to a missing node"
        target = nodes[str(dst)]
        assert dst_slot < len(target["inputs"]), f"link {link_id}: no input slot {dst_slot}"
        assert target["inputs"][dst_slot]["link"] == link_id
        assert link_id in nodes[str(src)]["outputs"][src_slot]["links"]
        links.add((str(src), int(src_slot), str(dst), target["inputs"][dst_slot]["name"]))
    return nodes, links


def test_every_api_workflow_has_a_ui_twin_and_a_thumbnail():
    assert {p.name for p in API_FILES} >= {"xdit_flux_text_to_image_api.json",
                                           "xdit_sd3_text_to_image_api.json"}
    for api_file in API_FILES:
        ui = api_file.with_name(api_file.name.replace("_api.json", ".json"))
        thumb = ui.with_suffix(".jpg")
        assert ui.is_file() and thumb.is_file(), api_file.name
        assert thumb.read_bytes()[:3] == b"\xff\xd8\xff" and thumb.stat().st_size > 10_000


@pytest.mark.parametrize("api_file", API_FILES, ids=lambda p: p.name)
def test_ui_and_api_describe_the_same_graph(api_file):
    api = json.loads(api_file.read_text())
    ui = json.loads(api_file.with_name(api_file.name.replace("_api.json", ".json")).read_text())
    a_nodes, a_links, a_widgets = api_graph(api)
    u_nodes, u_links = ui_graph(ui)
    assert {k: n["type"] for k, n in u_nodes.items()} == a_nodes
    assert u_links == a_links
    assert ui["last_node_id"] >= max(int(k) for k in u_nodes)
    assert ui["last_link_id"] >= max(link[0] for link in ui["links"])
    known = our_node_ids() | STOCK
    assert {"xDiT.LoadModel", "xDiT.Sampler", "xDiT.Decode"} <= our_node_ids()
    assert set(a_nodes.values()) <= known, set(a_nodes.values()) - known
    # widget values: every API value is the UI node's value of the widget of that name
    for (nid, name), value in a_widgets.items():
        node = u_nodes[nid]
        names = [i["name"] for i in node["inputs"] if i.get("widget")]
        vals = [v for v in node["widgets_values"] if v not in ("fixed", "randomize",
                                                               "increment", "decrement")]
        assert name in names, (nid, name)
        assert vals[names.index(name)] == value, (nid, name, vals, names)


def test_the_comparison_can_fail():
    api = json.loads(API_FILES[0].read_text())
    ui = json.loads(API_FILES[0].with_name(API_FILES[0].name.replace("_api.json", ".json"))
                    .read_text())
    _, a_links, _ = api_graph(api)
    ui["links"][0][4] = 1 - ui["links"][0][4]  # plug one link into another input
    with pytest.raises(AssertionError):
        assert ui_graph(ui)[1] == a_links


def test_examples_fit_any_machine_and_say_where_their_model_goes():
    """The examples ask for device/dtype auto (CUDA where this ComfyUI has it,
    else CPU) and name model folders that the README's install section and the loader's
    tooltip both place under models/diffusers/."""
    from comfyui_xdit.nodes import node_text

    readme = (ROOT / "README.md").read_text()
    # the loader's tooltip names the examples' folders (read from the examples themselves)
    loader = (ROOT / "comfyui_xdit" / "nodes" / "loader_nodes.py").read_text()
    assert "node_text.example_models_text()" in loader
    tooltips = node_text.example_models_text()
    for api_file in API_FILES:
        api = json.loads(api_file.read_text())
        loaders = [n for n in api.values() if n["class_type"] == "xDiT.LoadModel"]
        assert loaders, api_file.name
        for node in loaders:
            inputs = node["inputs"]
            assert (inputs["device"], inputs["dtype"]) == ("auto", "auto"), api_file.name
            assert f"models/diffusers/{inputs['model']}" in readme, inputs["model"]
            assert f"models/diffusers/{inputs['model']}" in tooltips, inputs["model"]
