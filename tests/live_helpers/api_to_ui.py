"""Make a UI-format example workflow (and a schematic .jpg thumbnail) from its API-format twin
and a running ComfyUI's /object_info, where no browser is available for
export_ui_workflows.py (which uses the real frontend and is preferred):

    python tests/live_helpers/api_to_ui.py http://127.0.0.1:8188 example_workflows/X_api.json

The node layout follows the frontend's serialization (version 0.4): each node's link inputs
first, then its widget inputs (optional ones with shape 7), `widgets_values` in widget
order with "fixed" after a seed widget (control_after_generate), links as
[id, from node, from slot, to node, to slot (index in the node's inputs), type]. The nodes
are placed in columns by graph depth.
"""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _spec_type(spec) -> str:
    t = spec[0]
    return "COMBO" if isinstance(t, list) else str(t)


def _opts(spec) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def convert(api: dict, info: dict) -> dict:
    ids = sorted(api, key=int)
    # columns by depth (longest path from a source), rows in id order
    depth = {}

    def d(nid):
        if nid not in depth:
            ups = [str(v[0]) for v in api[nid]["inputs"].values() if isinstance(v, list)]
            depth[nid] = 1 + max((d(u) for u in ups), default=-1)
        return depth[nid]
    for nid in ids:
        d(nid)
    order = sorted(ids, key=lambda n: (depth[n], int(n)))
    nodes, links, out_links = {}, [], {}
    link_id = 0
    for nid in ids:  # links first, numbered in (target id, input) order
        for name, v in api[nid]["inputs"].items():
            if isinstance(v, list):
                link_id += 1
                out_links.setdefault((str(v[0]), int(v[1])), []).append(link_id)
    link_id = 0
    col_y = {}
    for nid in ids:
        node = api[nid]
        ct = node["class_type"]
        spec = info[ct]
        req, opt = spec["input"].get("required", {}), spec["input"].get("optional", {})
        allin = [(n, s, False) for n, s in req.items()] + [(n, s, True) for n, s in opt.items()]
        sockets = [x for x in allin if _spec_type(x[1]) not in WIDGET_TYPES]
        widgets = [x for x in allin if _spec_type(x[1]) in WIDGET_TYPES]
        inputs, values = [], []
        for name, s, optional in sockets + widgets:
            item = {"localized_name": name, "name": name}
            if optional:
                item["shape"] = 7
            item["type"] = _spec_type(s)
            if _spec_type(s) in WIDGET_TYPES:
                item["widget"] = {"name": name}
            item["link"] = None
            inputs.append(item)
        for name, s, optional in widgets:
            if name in node["inputs"]:
                values.append(node["inputs"][name])
            elif "default" in _opts(s):
                values.append(_opts(s)["default"])
            else:
                values.append(s[0][0] if isinstance(s[0], list) and s[0] else None)
            if _opts(s).get("control_after_generate"):
                values.append("fixed")
        names = spec.get("output_name") or spec["output"]
        outputs = [{"localized_name": n, "name": n, "type": t,
                    "links": out_links.get((nid, i), [])}
                   for i, (n, t) in enumerate(zip(names, spec["output"]))]
        height = 46 + 24 * (len(widgets) + max(len(sockets), len(outputs)))
        col = depth[nid]
        y = col_y.get(col, 60)
        col_y[col] = y + height + 50
        n = {"id": int(nid), "type": ct, "pos": [40 + 360 * col, y], "size": [300, height],
             "flags": {}, "order": order.index(nid), "mode": 0, "inputs": inputs,
             "outputs": outputs, "properties": {"Node name for S&R": ct}}
        if widgets:
            n["widgets_values"] = values
        if node.get("_meta", {}).get("title") and node["_meta"]["title"] != \
                spec.get("display_name", ct):
            n["title"] = node["_meta"]["title"]
        nodes[nid] = n
    for nid in ids:  # now wire the links into the target inputs
        for name, v in api[nid]["inputs"].items():
            if not isinstance(v, list):
                continue
            link_id += 1
            slot = next(i for i, x in enumerate(nodes[nid]["inputs"]) if x["name"] == name)
            nodes[nid]["inputs"][slot]["link"] = link_id
            src = nodes[str(v[0])]
            links.append([link_id, int(v[0]), int(v[1]), int(nid), slot,
                          src["outputs"][int(v[1])]["type"]])
    return {"id": "00000000-0000-0000-0000-000000000000", "revision": 0,
            "last_node_id": max(int(n) for n in ids), "last_link_id": link_id,
            "nodes": [nodes[n] for n in ids], "links": links, "groups": [], "config": {},
            "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4}


def thumbnail(ui: dict, path: Path) -> None:
    """A schematic picture of the graph (node boxes, titles, widget values, links)."""
    from PIL import Image, ImageDraw

    x1 = max(n["pos"][0] + n["size"][0] for n in ui["nodes"]) + 40
    y1 = max(n["pos"][1] + n["size"][1] for n in ui["nodes"]) + 40
    img = Image.new("RGB", (int(x1), int(y1)), (32, 32, 36))
    dr = ImageDraw.Draw(img)
    for gx in range(0, int(x1), 20):
        dr.line([(gx, 0), (gx, y1)], fill=(38, 38, 42))
    for gy in range(0, int(y1), 20):
        dr.line([(0, gy), (x1, gy)], fill=(38, 38, 42))
    byid = {n["id"]: n for n in ui["nodes"]}
    colors = {"MODEL": (180, 160, 255), "XDIT_MODEL": (120, 200, 255), "LATENT": (255, 150, 200),
              "CONDITIONING": (255, 200, 110), "IMAGE": (120, 220, 160), "VAE": (255, 110, 110),
              "CLIP": (250, 220, 80)}
    for _, src, s_slot, dst, d_slot, t in ui["links"]:
        a, b = byid[src], byid[dst]
        p0 = (a["pos"][0] + a["size"][0], a["pos"][1] + 40 + 24 * s_slot)
        p1 = (b["pos"][0], b["pos"][1] + 40 + 24 * d_slot)
        mid = (p0[0] + p1[0]) / 2
        dr.line([p0, (mid, p0[1]), (mid, p1[1]), p1], fill=colors.get(t, (200, 200, 200)),
                width=3)
    for n in ui["nodes"]:
        x, y = n["pos"]
        w, h = n["size"]
        dr.rectangle([x, y - 26, x + w, y + h], fill=(53, 53, 58), outline=(90, 90, 96))
        dr.rectangle([x, y - 26, x + w, y], fill=(40, 60, 80) if n["type"].startswith("xDiT")
                     else (60, 60, 66))
        dr.text((x + 10, y - 20), n.get("title", n["type"]), fill=(235, 235, 235))
        row = y + 10
        for i in n["inputs"]:
            if not i.get("widget"):
                dr.ellipse([x - 5, row + 2, x + 5, row + 12],
                           fill=colors.get(i["type"], (200, 200, 200)))
                dr.text((x + 12, row), i["name"], fill=(200, 200, 200))
                row += 24
        vals = [v for v in n.get("widgets_values", []) if v != "fixed"]
        names = [i["name"] for i in n["inputs"] if i.get("widget")]
        for name, v in zip(names, vals):
            dr.rounded_rectangle([x + 8, row, x + w - 8, row + 20], radius=8,
                                 fill=(34, 34, 38))
            dr.text((x + 16, row + 4), f"{name}: {str(v)[:34]}", fill=(190, 190, 190))
            row += 24
    img.save(str(path), "JPEG", quality=92)


if __name__ == "__main__":
    base, api_path = sys.argv[1], Path(sys.argv[2])
    with urllib.request.urlopen(base + "/object_info", timeout=60) as r:
        info = json.loads(r.read())
    ui = convert(json.loads(api_path.read_text()), info)
    ui_path = api_path.with_name(api_path.name.replace("_api.json", ".json"))
    ui_path.write_text(json.dumps(ui, indent=1) + "\n")
    thumbnail(ui, ui_path.with_suffix(".jpg"))
    print(ui_path, ui_path.with_suffix(".jpg"))
