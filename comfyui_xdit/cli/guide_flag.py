"""`generate --guide NAME=VALUE`: the request's `extra_guidance` (the guidance passes beyond
cond / uncond a family declares, its ExtraGuidance capability), one setting a flag."""
from __future__ import annotations

import argparse

from comfyui_xdit.planning.request import families


def guide_settings() -> dict:
    """Every family's extra-guidance settings (name -> (default, help)), for --guide."""
    out = {}
    for f in families.FAMILIES.values():
        extra = f.capability(families.ExtraGuidance)
        out.update({} if extra is None else extra.settings)
    return out


def parse_guide(text):
    """NAME=VALUE: a number, or for a list setting (stg_blocks) block indices like 28,29."""
    name, sep, value = text.partition("=")
    known = guide_settings()
    if not sep or name not in known:
        raise argparse.ArgumentTypeError(f"--guide wants NAME=VALUE, NAME one of "
                                         f"{', '.join(known)} (got {text!r})")
    listed = isinstance(known[name][0], tuple)
    try:
        if listed:
            return name, [int(v) for v in value.split(",") if v.strip()]
        return name, float(value)
    except ValueError:
        want = "block indices like 28,29" if listed else "a number"
        raise argparse.ArgumentTypeError(f"--guide {name}: {value!r} is not {want}")



def add_guide_flag(p, takers: str) -> None:
    p.add_argument("--guide", type=parse_guide, action="append", default=[],
                   metavar="NAME=VALUE",
                   help=f"extra guidance passes ({takers}), repeat for several: "
                        + "; ".join(f"{k}: {h}" for k, (_, h) in guide_settings().items())
                        .replace("%", "%%")
                        + ". e.g. --guide stg_scale=1 --guide stg_blocks=29")
