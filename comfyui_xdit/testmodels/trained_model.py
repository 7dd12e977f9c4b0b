"""A small FLUX-shaped model trained on drawn shapes ("a red circle on the left").

Random weights say nothing about a step cache or about PipeFusion's stale K/V: a trained
velocity field changes smoothly along the sampling trajectory, a random one does not. This
builds the tiny FLUX folder of `flux.py` (same text encoders, tokenizers, scheduler) and
trains two of its parts on pictures it draws itself, so nothing is downloaded:

1. the VAE as an autoencoder of its posterior means (on 32x32 crops: it is convolutional, and
   crops are 4x cheaper), its variance kept small, its latents pulled towards FLUX's latent
   statistics, so that model space
   `(raw - shift) * scale` is roughly zero-mean, unit-variance, as for the released VAE;
2. the transformer by flow matching (rectified flow, logit-normal times, the prompt dropped
   10% of the time so true CFG works), on the frozen random text encoders' embeddings.

Deterministic: fixed seeds and a fixed thread count give the same weights on the same torch
build. The recipe and the final losses are written to the folder's tiny_model.json.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import time

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import flux, parts, tiny_model

_flux = bridge.family_module("flux")  # the released VAE's latent statistics

RECIPE = {
    "kind": "trained-shapes", "version": 2, "seed": 0, "image": 64, "width": 128, "heads": 4,
    "depth": 2, "text_len": 32, "threads": 2, "per_prompt": 12,
    "vae_steps": 2000, "vae_batch": 16, "vae_crop": 32, "vae_lr": 2e-3,
    "steps": 2500, "batch": 32, "lr": 1e-3, "drop_prompt": 0.1,
}
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 50, 40), "green": (40, 170, 70), "blue": (50, 90, 230),
          "yellow": (235, 210, 50)}
PLACES = {"on the left": (0.27, 0.5), "on the right": (0.73, 0.5), "at the top": (0.5, 0.27),
          "at the bottom": (0.5, 0.73), "in the middle": (0.5, 0.5)}
BACKGROUND = (236, 232, 222)


def prompts() -> list:
    """Every prompt the model was trained on: 3 shapes x 4 colours x 5 places."""
    return [f"a {c} {s} {p}" for s in SHAPES for c in COLORS for p in PLACES]


def draw(prompt: str, size: int, rng):
    """The picture a prompt names, with its size and position jittered by `rng`."""
    import numpy as np
    from PIL import Image, ImageDraw

    words = prompt.split()
    color, shape, place = COLORS[words[1]], words[2], " ".join(words[3:])
    fx, fy = PLACES[place]
    r = size * rng.uniform(0.15, 0.2)
    cx = size * fx + rng.uniform(-0.04, 0.04) * size
    cy = size * fy + rng.uniform(-0.04, 0.04) * size
    img = Image.new("RGB", (size, size), BACKGROUND)
    d = ImageDraw.Draw(img)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    else:
        d.polygon([(cx, cy - r * 1.1), (cx - r * 1.1, cy + r * 0.9), (cx + r * 1.1, cy + r * 0.9)],
                  fill=color)
    return np.asarray(img)


def _data(recipe: dict):
    """Images [N,3,S,S] in [-1,1] and their prompt indices [N]."""
    import numpy as np
    import torch

    rng = np.random.default_rng(recipe["seed"])
    texts = prompts()
    imgs, idx = [], []
    for i, p in enumerate(texts):
        for _ in range(recipe["per_prompt"]):
            imgs.append(draw(p, recipe["image"], rng))
            idx.append(i)
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x, torch.tensor(idx)


def _set_lr(opt, base: float, step: int, steps: int, warm: int = 1) -> None:
    """Linear warm-up over `warm` steps, then cosine decay to 0."""
    lr = base * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
    for group in opt.param_groups:
        group["lr"] = lr


def _train_vae(vae, images, recipe, log):
    """Autoencoder on random crops; the latent's batch statistics pulled to FLUX's."""
    import torch

    facts = _flux.VAE_LATENT
    shift, scale = facts["shift_factor"], facts["scaling_factor"]
    g = torch.Generator().manual_seed(recipe["seed"] + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=recipe["vae_lr"], weight_decay=0.0)
    steps, b, c, s = recipe["vae_steps"], recipe["vae_batch"], recipe["vae_crop"], recipe["image"]
    vae.train()
    loss_v = 0.0
    for step in range(steps):
        _set_lr(opt, recipe["vae_lr"], step, steps)
        pick = torch.randint(len(images), (b,), generator=g)
        ox, oy = (int(v) for v in torch.randint(0, (s - c) // 8 + 1, (2,), generator=g) * 8)
        x = images[pick, :, oy:oy + c, ox:ox + c]
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.mean).sample  # the pool decodes means: train on them
        stats = (dist.mean.mean() - shift) ** 2 + (dist.mean.std() * scale - 1) ** 2
        # a small posterior variance, so that sampling it (diffusers' img2img) stays near
        loss = (rec - x).pow(2).mean() + 0.01 * stats + 0.01 * dist.var.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_v = 0.9 * loss_v + 0.1 * float(loss.detach()) if step else float(loss.detach())
        if step % 100 == 0 or step == steps - 1:
            log(f"vae {step + 1}/{steps} loss {loss_v:.4f}")
    vae.eval()
    return loss_v


def _train_transformer(pipe, latents, idx, recipe, log):
    """Rectified flow on packed model-space latents, conditioned on frozen text embeddings."""
    import torch

    tr = pipe.transformer
    texts = prompts() + [""]
    with torch.no_grad():
        embeds, pooled, txt_ids = pipe.encode_prompt(texts, prompt_2=None,
                                                    max_sequence_length=recipe["text_len"])
    h = w = latents.shape[-1]
    packed = pipe._pack_latents(latents, len(latents), latents.shape[1], h, w)
    img_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, latents.device, latents.dtype)
    g = torch.Generator().manual_seed(recipe["seed"] + 2)
    opt = torch.optim.AdamW(tr.parameters(), lr=recipe["lr"], weight_decay=0.0)
    steps, b, empty = recipe["steps"], recipe["batch"], len(texts) - 1
    warm = max(1, steps // 20)
    tr.train()
    loss_v = 0.0
    for step in range(steps):
        _set_lr(opt, recipe["lr"], step, steps, warm)
        pick = torch.randint(len(packed), (b,), generator=g)
        x0 = packed[pick]
        cond = torch.where(torch.rand(b, generator=g) < recipe["drop_prompt"], empty, idx[pick])
        noise = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(b, generator=g))
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        guidance = 1 + 4 * torch.rand(b, generator=g)  # any FLUX guidance value: ignored
        pred = tr(hidden_states=xt, timestep=sigma, guidance=guidance,
                  pooled_projections=pooled[cond], encoder_hidden_states=embeds[cond],
                  txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        loss = (pred - (noise - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        loss_v = 0.98 * loss_v + 0.02 * float(loss.detach()) if step else float(loss.detach())
        if step % 100 == 0 or step == steps - 1:
            log(f"transformer {step + 1}/{steps} loss {loss_v:.4f}")
    tr.eval()
    return loss_v


def build_trained_model(out_dir, recipe: dict | None = None, log=print) -> pathlib.Path:
    """Trains and writes the diffusers folder; returns its path."""
    import torch

    recipe = dict(RECIPE, **(recipe or {}))
    cfg = tiny_model.resolve_config("flux", seed=recipe["seed"], depth=recipe["depth"],
                                    width=recipe["width"], heads=recipe["heads"])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe["threads"])
    t0 = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]):
            pipe = flux.build_pipeline(cfg)
            images, idx = _data(recipe)
            vae_loss = _train_vae(pipe.vae, images, recipe, log)
            with torch.no_grad():
                raw = torch.cat([pipe.vae.encode(images[i:i + 64]).latent_dist.mean
                                 for i in range(0, len(images), 64)])
                rec = torch.cat([pipe.vae.decode(raw[i:i + 64]).sample
                                 for i in range(0, len(raw), 64)])
            vae_psnr = float(10 * torch.log10(4 / (rec.clamp(-1, 1) - images).pow(2).mean()))
            facts = _flux.VAE_LATENT
            latents = (raw - facts["shift_factor"]) * facts["scaling_factor"]
            log(f"vae: reconstruction PSNR {vae_psnr:.1f} dB, model-space latent mean "
                f"{float(latents.mean()):.3f} std {float(latents.std()):.3f}")
            tr_loss = _train_transformer(pipe, latents, idx, recipe, log)
    finally:
        torch.set_num_threads(threads)
    with parts.quiet_transformers():
        pipe.save_pretrained(out, safe_serialization=True)
    report = dict(cfg, recipe=recipe, trained={
        "vae_loss": round(vae_loss, 5), "vae_psnr_db": round(vae_psnr, 2),
        "transformer_loss": round(tr_loss, 5), "train_s": round(time.perf_counter() - t0, 1)})
    (out / "tiny_model.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    parts.normalize_modes(out)
    return out


def ensure_trained_model(cache_dir, recipe: dict | None = None, log=print) -> pathlib.Path:
    """Trains into cache_dir once (keyed by the recipe), then reuses the folder."""
    key = dict(RECIPE, **(recipe or {}), builder_version=tiny_model.BUILDER_VERSION)
    return tiny_model.cached_build(cache_dir, tiny_model.cache_name("flux-trained", key),
                                   lambda tmp: build_trained_model(tmp, recipe, log))


def sample_grid(model_dir, out_png, *, steps: int = 20, seed: int = 0, cfg: float = 1.0):
    """One sample per place for a few prompts, decoded by the folder's VAE, as one PNG (the
    picture in docs/)."""
    import numpy as np
    import torch
    from diffusers import FluxPipeline
    from PIL import Image

    pipe = FluxPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    rows = []
    for color, shape in (("red", "circle"), ("blue", "square"), ("yellow", "triangle"),
                         ("green", "circle")):
        texts = [f"a {color} {shape} {p}" for p in PLACES]
        with torch.no_grad():
            imgs = pipe(texts, height=64, width=64, num_inference_steps=steps,
                        max_sequence_length=RECIPE["text_len"], guidance_scale=3.5,
                        generator=torch.Generator().manual_seed(seed), output_type="np").images
        rows.append(np.concatenate(list(imgs), axis=1))
    grid = (np.concatenate(rows, axis=0) * 255).round().clip(0, 255).astype(np.uint8)
    Image.fromarray(grid).resize((grid.shape[1] * 2, grid.shape[0] * 2), Image.NEAREST).save(out_png)
    return out_png


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "trained-model",
        help="train the small FLUX-shaped model on drawn shapes, for quality measurements "
             "(CPU, offline; its recipe and time: docs/testing.md, the trained test model)",
        description="Train a small FLUX-shaped model on drawn coloured shapes ('a red circle on "
                    "the left'), for quality measurements; nothing is downloaded. Its recipe, "
                    "time and what it measures: docs/testing.md#the-trained-test-model.")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--steps", type=int, default=RECIPE["steps"],
                   help=f"transformer training steps (default {RECIPE['steps']})")
    p.add_argument("--vae-steps", type=int, default=RECIPE["vae_steps"],
                   help=f"VAE training steps (default {RECIPE['vae_steps']})")
    p.add_argument("--picture", default=None, help="also write a PNG grid of samples here")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    if args.steps < 1 or args.vae_steps < 1:
        print("trained-model: error: --steps and --vae-steps must be >= 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    path = build_trained_model(args.out, {"steps": args.steps, "vae_steps": args.vae_steps},
                               log=lambda m: print(f"[{time.perf_counter() - t0:6.1f} s] {m}",
                                                   file=sys.stderr, flush=True))
    if args.picture:
        sample_grid(path, args.picture)
    print(path)
    return 0
