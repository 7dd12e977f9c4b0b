"""Small random-weight diffusers model folders, built offline: the entry points.

Every test and the demo need a model of each family without any hub download, so each family
has a builder, comfyui_xdit/testmodels/<family id>.py, writing a complete diffusers pipeline
(transformer, VAE, text encoders, tokenizers, scheduler) from nothing. The shapes keep the
real models' structure (latent channels, VAE downsampling, patch packing, RoPE axes, text
conditioning) so the parallel code paths are exercised, while the sizes keep a 4-step 128x128
run well under a second on one CPU thread.

A builder module defines:
- `VARIANTS`: the `variant` values it takes, the first the default (empty: none);
- `check(cfg)`: raises ValueError (one line) for knobs the family cannot take; `cfg` has arch,
  seed, depth, width, heads and, when given, variant and the family knobs (sd35);
- optionally `key_extras(cfg)`: extra cache-key entries of its recipe;
- `build_pipeline(cfg)`: the pipeline to save, for the resolved config;
- optionally `VARIANT_HELP`: what its variants are, for the CLI's --variant help.
This module finds it by the arch's name and names no family itself; shared parts are in
parts.py (models, folders, cache) and text.py (tokenizers).

Heavy imports (torch, diffusers, transformers) happen inside the functions: the CLI and the
ComfyUI entry import this module cheaply.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import sys

from comfyui_xdit import bridge
from comfyui_xdit.testmodels.fp8_file import write_fp8_file  # noqa: F401 - public entry point
from comfyui_xdit.testmodels.gguf_file import write_gguf_file  # noqa: F401 - public entry point
from comfyui_xdit.testmodels.parts import cache_name, cached_build, normalize_modes, quiet_transformers

ARCHS = bridge.families.IDS
BUILDERS = "comfyui_xdit.testmodels"  # the package holding one builder module per arch

# Bump when the folder layout or any builder's config changes: it is part of the cache key,
# so ensure_tiny_model never serves a folder built by an older recipe.
BUILDER_VERSION = 1

DEFAULT_DEPTH = 2  # e.g. FLUX: 2 double + 2 single blocks; SD3: 2 joint blocks
DEFAULT_HEAD_DIM = 16  # width defaults to heads * 16


def builder(arch: str):
    """The builder module of `arch` (comfyui_xdit/testmodels/<arch>.py). A family without one
    yet is an error here, when it is built, not when this module is imported."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    name = f"{BUILDERS}.{arch}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ValueError(f"no tiny-model builder for arch {arch!r} yet: "
                         f"{name.replace('.', '/')}.py is missing") from None


def _variants() -> dict[str, tuple[str, ...]]:
    """Each arch with a builder that takes variants: its VARIANTS (the default first)."""
    out = {}
    for arch in ARCHS:
        try:
            variants = tuple(getattr(builder(arch), "VARIANTS", ()))
        except ValueError:  # no builder yet: nothing to offer
            continue
        if variants:
            out[arch] = variants
    return out


DTYPES = ("fp32", "bf16", "fp16")  # the saved weights' dtype (`dtype`; fp32 by default)


def resolve_config(arch: str, *, seed: int = 0, depth: int | None = None, width: int | None = None,
                   heads: int = 4, sd35: bool = False, variant: str | None = None,
                   transformer: dict | None = None, dtype: str | None = None) -> dict:
    """Validate the knobs and fill in defaults; the result is what the cache key hashes, so
    equivalent calls (explicit default vs omitted) share one folder. `transformer` and a
    `dtype` other than fp32 enter the key only when given: every other folder keeps its key."""
    family = builder(arch)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    depth = DEFAULT_DEPTH if depth is None else depth
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be an integer >= 1, got {heads!r}")
    width = heads * DEFAULT_HEAD_DIM if width is None else width
    if not isinstance(width, int) or width < 1 or width % heads:
        raise ValueError(f"width must be a positive multiple of heads ({heads}), got {width!r}")
    variants = tuple(getattr(family, "VARIANTS", ()))
    if variant is not None and not variants:
        takers = list(_variants())
        if not takers:
            raise ValueError(f"variant applies to no arch (got arch {arch!r})")
        takers = " or ".join(filter(None, [", ".join(takers[:-1]), takers[-1]]))
        raise ValueError(f"variant applies to --arch {takers} only (got arch {arch!r})")
    if variant is not None and variant not in variants:
        raise ValueError(f"unknown {arch} variant {variant!r}: expected one of "
                         f"{', '.join(variants)}")
    knobs = {"arch": arch, "seed": seed, "depth": depth, "width": width, "heads": heads}
    if variant is not None:
        knobs["variant"] = variant
    if sd35:
        knobs["sd35"] = True
    family.check(dict(knobs))
    out = {k: v for k, v in knobs.items() if k != "variant"}
    out["builder_version"] = BUILDER_VERSION
    if variant is not None and variant != variants[0]:  # the default keeps its key
        out["variant"] = variant
    if transformer:
        if not isinstance(transformer, dict) or not all(isinstance(k, str) for k in transformer):
            raise ValueError(f"transformer must map config names to values, got {transformer!r}")
        out["transformer"] = json.loads(json.dumps(transformer, sort_keys=True))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype not in (None, "fp32"):
        out["dtype"] = dtype
    extras = getattr(family, "key_extras", lambda cfg: {})(dict(knobs))
    if set(extras) & set(out):
        raise RuntimeError(f"{arch}.key_extras may add keys only, not {sorted(set(extras) & set(out))}")
    return dict(out, **extras)


@contextlib.contextmanager
def transformer_overrides(arch: str, entries: dict | None, meta: bool = False):
    """While open, the builders construct `arch`'s transformer class with `entries` in place
    of their own config values, and with `meta` on the meta device (each builder makes its
    components through text._seeded)."""
    from comfyui_xdit.testmodels import text

    name = bridge.families.family(arch).classes.transformer
    saved, saved_meta = dict(text.CONFIG_OVERRIDES), set(text.ON_META)
    if entries:
        text.CONFIG_OVERRIDES[name] = dict(entries)
    if meta:
        text.ON_META.add(name)
    try:
        yield
    finally:
        text.CONFIG_OVERRIDES.clear()
        text.CONFIG_OVERRIDES.update(saved)
        text.ON_META.clear()
        text.ON_META.update(saved_meta)


def _check_overrides(arch: str, pipe, entries: dict | None) -> None:
    """A builder that made its transformer without text._seeded would ignore `entries`:
    refused here rather than saved as something it is not."""
    if not entries:
        return
    name = bridge.families.family(arch).classes.transformer
    made = [m for m in pipe.components.values() if type(m).__name__ == name]
    for m in made or [None]:
        got = {} if m is None else json.loads(json.dumps(dict(m.config), default=list))
        bad = {k: got.get(k) for k, v in json.loads(json.dumps(entries)).items() if got.get(k) != v}
        if m is None or bad:
            raise ValueError(f"the {arch} builder did not take the transformer entries "
                             f"{sorted(bad or entries)}")


def planned_transformer(arch: str, **kw) -> tuple[dict, int]:
    """(config, parameter count) of the transformer `build_tiny_model(arch, ..., **kw)` would
    write, the transformer built on the meta device (the small parts for real): nothing of
    its size allocated, nothing written."""
    import torch

    cfg = resolve_config(arch, **kw)
    name = bridge.families.family(arch).classes.transformer
    with torch.random.fork_rng(devices=[]), \
            transformer_overrides(arch, cfg.get("transformer"), meta=True):
        pipe = builder(arch).build_pipeline(cfg)
    _check_overrides(arch, pipe, cfg.get("transformer"))
    tr = next(m for m in pipe.components.values() if type(m).__name__ == name)
    return (json.loads(json.dumps(dict(tr.config), default=list)),
            sum(p.numel() for p in tr.parameters()))


def build_tiny_model(arch: str, out_dir: str | os.PathLike, *, seed: int = 0, depth: int | None = None,
                     width: int | None = None, heads: int = 4, sd35: bool = False,
                     variant: str | None = None, transformer: dict | None = None,
                     dtype: str | None = None) -> pathlib.Path:
    """Writes a complete diffusers folder (model_index.json, transformer/, vae/, text_encoder*/,
    tokenizer*/, scheduler/) and returns its path.

    depth: transformer block count (of each kind where a family has two; default 2).
    width: transformer hidden size = heads * head_dim (default heads * 16).
    heads: attention heads (default 4, so Ulysses degrees 2 and 4 divide it).
    sd35: SD3.5-style blocks (QK RMS norm, dual attention); arch sd3 only.
    variant: one of the arch's builder's VARIANTS (default its first), described in
    comfyui_xdit/testmodels/<arch>.py.
    transformer: config entries of the transformer class replacing the builder's own (the
    bench's released widths, e.g. an FFN width); refused if the builder does not take them.
    dtype: the saved weights' dtype (default fp32; bf16 halves a large model's files).
    Same arguments -> byte-identical safetensors.
    """
    cfg = resolve_config(arch, seed=seed, depth=depth, width=width, heads=heads, sd35=sd35,
                         variant=variant, transformer=transformer, dtype=dtype)
    import torch

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Build on the default RNG but leave the caller's RNG state as it was.
    with torch.random.fork_rng(devices=[]), transformer_overrides(arch, cfg.get("transformer")):
        pipe = builder(arch).build_pipeline(cfg)
    _check_overrides(arch, pipe, cfg.get("transformer"))
    if cfg.get("dtype"):
        to = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[cfg["dtype"]])
        for part in pipe.components.values():
            if isinstance(part, torch.nn.Module):
                part.to(to)
    with quiet_transformers():
        pipe.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    normalize_modes(out)
    return out


def ensure_tiny_model(arch: str, cache_dir: str | os.PathLike, **kw) -> pathlib.Path:
    """Builds into cache_dir/<arch>-<hash of the kwargs> once, then reuses it."""
    cfg = resolve_config(arch, **kw)
    return cached_build(cache_dir, cache_name(cfg["arch"], cfg), lambda tmp: build_tiny_model(
        arch, tmp, **{k: cfg[k] for k in ("seed", "depth", "width", "heads")},
        sd35=bool(cfg.get("sd35")), variant=cfg.get("variant"),
        transformer=cfg.get("transformer"), dtype=cfg.get("dtype")))


def write_comfy_file(arch: str, folder, out) -> pathlib.Path:
    """The folder's transformer as ComfyUI's single file (`model.diffusion_model.` keys, in
    the names the family's builder gives: its `single_file(state)`, and the tensors its
    `single_file_extra(folder)` adds, modules ComfyUI's model holds beside the transformer;
    the safetensors metadata its `single_file_metadata(config, folder)` gives, where
    ComfyUI's detection needs more than the shapes), for ComfyUI's UNETLoader /
    checkpoint loaders and the pack's."""
    from safetensors.torch import load_file, save_file

    mod = builder(arch)
    if not hasattr(mod, "single_file"):
        raise ValueError(f"the {arch} test-model builder writes no ComfyUI single file")
    tr = pathlib.Path(folder) / "transformer"
    state = mod.single_file(load_file(str(tr / "diffusion_pytorch_model.safetensors")))
    if hasattr(mod, "single_file_extra"):  # modules ComfyUI's model holds beside it
        extra = mod.single_file_extra(folder)
        if set(extra) & set(state):
            raise ValueError(f"the {arch} builder's extra tensors overlap the transformer's")
        state.update(extra)
    config = json.loads((tr / "config.json").read_text())
    meta = mod.single_file_metadata(config, folder) if hasattr(mod, "single_file_metadata") \
        else None
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()},
              str(out), metadata=meta)
    return out


def add_cli(subparsers) -> None:
    """Adds the `tiny-model` subcommand to the package CLI."""
    families = bridge.families
    names = [families.family(a).name for a in ARCHS]
    variants = _variants()
    p = subparsers.add_parser(
        "tiny-model",
        help="write a small random-weight diffusers model folder (offline)",
        description=f"Write a small random-weight {', '.join(names[:-1])} or {names[-1]} "
                    "diffusers folder; nothing is downloaded.",
    )
    p.add_argument("--arch", required=True, choices=ARCHS, help="model family")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--depth", type=int, default=None, help=f"transformer blocks (default {DEFAULT_DEPTH})")
    p.add_argument("--width", type=int, default=None,
                   help=f"transformer hidden size, a multiple of --heads (default heads*{DEFAULT_HEAD_DIM})")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--sd35", action="store_true",
                   help="SD3.5-style blocks: QK RMS norm and dual attention (arch sd3)")
    p.add_argument("--variant", choices=sorted({v for vs in variants.values() for v in vs}),
                   default=None,
                   help="; ".join(getattr(builder(a), "VARIANT_HELP", None)
                                  or f"{a}: {', '.join([f'{vs[0]} (default)', *vs[1:]])}"
                                  for a, vs in variants.items()))
    p.add_argument("--gguf", default=None, metavar="TYPE",
                   help="write the transformer alone as a GGUF single file (ComfyUI-GGUF's "
                        "layout, diffusers names) to --out, its weights in TYPE: Q8_0, Q6_K, "
                        "Q5_K, Q5_0, Q5_1, Q4_K, Q4_0, Q4_1, F16 or BF16")
    p.add_argument("--comfy-file", action="store_true",
                   help="write the transformer alone as ComfyUI's single file (its "
                        "model.diffusion_model. keys and names) to --out, for families whose "
                        "builder declares one")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Runs `tiny-model`; bad knobs exit 2 with one line on stderr."""
    kw = dict(seed=args.seed, depth=args.depth, width=args.width, heads=args.heads,
              sd35=args.sd35, variant=args.variant)
    try:
        if getattr(args, "gguf", None):
            import tempfile
            with tempfile.TemporaryDirectory() as tmp:
                folder = build_tiny_model(args.arch, tmp, **kw)
                path = write_gguf_file(
                    folder / "transformer" / "diffusion_pytorch_model.safetensors", args.out,
                    args.gguf.upper(), arch=args.arch)
        elif getattr(args, "comfy_file", False):
            import tempfile
            with tempfile.TemporaryDirectory() as tmp:
                path = write_comfy_file(args.arch, build_tiny_model(args.arch, tmp, **kw),
                                        args.out)
        else:
            path = build_tiny_model(args.arch, args.out, **kw)
    except ValueError as exc:
        print(f"tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover - convenience entry
    _parser = argparse.ArgumentParser(prog="tiny_model")
    add_cli(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
