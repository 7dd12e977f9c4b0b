"""The trained shapes model's command (comfyui_xdit/testmodels/trained_model.py) on a
shortened recipe: the pictures say what the prompts say, two builds are byte-identical
(deterministic), the folder loads as a FluxPipeline and records its recipe and losses. The
full recipe's result (its loss, its samples) is in docs/performance.md."""
from __future__ import annotations

import json

import numpy as np
import pytest

from comfyui_xdit.testmodels import trained_model as tm

SHORT = {"steps": 3, "vae_steps": 2, "per_prompt": 1}


def test_drawn_pictures_match_their_prompts():
    rng = np.random.default_rng(0)
    assert len(tm.prompts()) == 60 and len(set(tm.prompts())) == 60
    for prompt in ("a red circle on the left", "a blue square at the top",
                   "a yellow triangle in the middle"):
        img = tm.draw(prompt, 64, rng).astype(int)
        color = np.array(tm.COLORS[prompt.split()[1]])
        ys, xs = np.nonzero((np.abs(img - color).sum(-1) < 30))
        assert len(xs) > 100, prompt  # the shape is there, in its colour
        fx, fy = tm.PLACES[" ".join(prompt.split()[3:])]
        assert abs(xs.mean() / 64 - fx) < 0.1 and abs(ys.mean() / 64 - fy) < 0.1, prompt


def test_short_recipe_is_deterministic_and_loads(tmp_path):
    a = tm.build_trained_model(tmp_path / "a", SHORT, log=lambda m: None)
    b = tm.build_trained_model(tmp_path / "b", SHORT, log=lambda m: None)
    for part in ("transformer", "vae"):
        fa = sorted((a / part).glob("*.safetensors"))
        assert fa and [f.read_bytes() for f in fa] == \
            [f.read_bytes() for f in sorted((b / part).glob("*.safetensors"))]
    info = json.loads((a / "tiny_model.json").read_text())
    assert info["recipe"]["steps"] == 3 and info["trained"]["transformer_loss"] > 0
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(str(a))
    assert pipe.transformer.config.num_layers == tm.RECIPE["depth"]


def test_bad_steps_exit_2(capsys):
    import argparse
    with pytest.raises(SystemExit) as e:
        raise SystemExit(tm.run_cli(argparse.Namespace(out="x", steps=0, vae_steps=1,
                                                       picture=None)))
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
