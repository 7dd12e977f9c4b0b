"""What several tiny-model builders share: the CLIP and T5 text models and the FLUX-style VAE
(sizes only, weights seeded per component), the knob checks' wording, and writing a model
folder (quiet saves, ordinary file modes, a cache that several processes may fill at once).

The tokenizers are in text.py; each family's recipe is comfyui_xdit/testmodels/<family>.py.
Heavy imports (torch, diffusers, transformers) happen inside the functions.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import uuid

from comfyui_xdit.bridge import families  # the released VAE statistics
from comfyui_xdit.testmodels.text import CLIP_MAX_LENGTH, _seeded


# Text encoder sizes (weights are seeded per component, so one seed gives every builder
# using a part the same weights for it).
CLIP_L = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
# CLIP-G differs from CLIP-L in width so mix-ups of the two change shapes, like the real pair.
CLIP_G = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, projection_dim=48)
# T5 d_model (96) > CLIP-L + CLIP-G hidden (80): SD3's zero padding of the CLIP states is real.
T5 = dict(d_model=96, d_kv=16, d_ff=192, num_layers=2, num_heads=4)


def clip_text_model(cls, cfg: dict, tokenizer, seed: int, salt: int):
    """A CLIP text model of class `cls` (with or without projection), sizes `cfg`."""
    from transformers import CLIPTextConfig

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **cfg,
    )
    return _seeded(seed, salt, cls, config)


def t5_model(tokenizer, seed: int, salt: int):
    """A T5 v1.1 encoder of size T5."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        feed_forward_proj="gated-gelu",  # T5 v1.1, as in FLUX's and SD3's T5-XXL
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **T5,
    )
    return _seeded(seed, salt, T5EncoderModel, config)


def kl_vae(arch: str, seed: int, salt: int):
    """The 16-channel, 8x AutoencoderKL of FLUX.1 / SD3 / Chroma, carrying family `arch`'s
    released latent statistics, so raw-VAE-space LATENT conversion is meaningful."""
    from diffusers import AutoencoderKL

    return _seeded(
        seed,
        salt,
        AutoencoderKL,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,  # 4 levels -> 8x, like the real VAEs
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=16,
        sample_size=128,
        **families.family(arch).detection.released({})[1],  # scaling_factor, shift_factor
        use_quant_conv=False,  # FLUX and SD3 VAEs have no quant convs
        use_post_quant_conv=False,
    )


# ---- the builders' checks -----------------------------------------------------------------

# Knobs that only some family takes, and the one line that refuses one elsewhere; a builder
# names the ones it takes in refuse_knobs.
FAMILY_KNOBS = {"sd35": "sd35 (QK RMS norm, dual-attention blocks) applies to --arch sd3 only"}


def head_dim(cfg: dict) -> int:
    return cfg["width"] // cfg["heads"]


def require_head_dim(cfg: dict, ok: bool, what: str) -> None:
    """Raise, naming the arch, the need and the width / heads split, unless `ok`."""
    if not ok:
        raise ValueError(f"{cfg['arch']} needs {what}; width {cfg['width']} / heads "
                         f"{cfg['heads']} = {head_dim(cfg)}")


def refuse_knobs(cfg: dict, *taken: str) -> None:
    """Raise for a family knob set in `cfg` that is not among `taken`."""
    for knob, why in FAMILY_KNOBS.items():
        if cfg.get(knob) and knob not in taken:
            raise ValueError(why)


# ---- writing a folder ---------------------------------------------------------------------

def current_umask() -> int:
    """Read the umask without os.umask's set-and-restore, which would briefly change it for
    every other thread of the host process (ComfyUI)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def normalize_modes(out: pathlib.Path) -> None:
    """safetensors files come out 0600 and cached_build's temp dir 0700; give the model
    ordinary umask-based modes so a shared cache is readable like any other model folder."""
    umask = current_umask()
    index = json.loads((out / "model_index.json").read_text())
    os.chmod(out, 0o777 & ~umask)
    for name in [k for k in index if not k.startswith("_")]:
        sub = out / name
        if not sub.is_dir():
            continue
        os.chmod(sub, 0o777 & ~umask)
        for f in sub.iterdir():
            if f.is_file():
                os.chmod(f, 0o666 & ~umask)


@contextlib.contextmanager
def quiet_transformers():
    """transformers draws a "Writing model shards" bar per text encoder; the CLI and test
    output should carry only what matters. The global setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_name(prefix: str, cfg: dict) -> str:
    """A cache folder name: the prefix and a hash of everything the build depends on."""
    blob = json.dumps(cfg, sort_keys=True).encode()
    return f"{prefix}-{hashlib.sha256(blob).hexdigest()[:12]}"


@contextlib.contextmanager
def file_lock(path: pathlib.Path):
    """Advisory inter-process lock, so concurrent callers wait instead of all building the
    same model on the same cores. Correctness does not depend on it (the final rename is
    atomic); where flock is unavailable it is a no-op."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_complete(path: pathlib.Path) -> bool:
    return (path / "model_index.json").is_file() and (path / "tiny_model.json").is_file()


def cached_build(cache_dir: str | os.PathLike, name: str, build) -> pathlib.Path:
    """cache_dir/name, made by `build(tmp_folder)` once and then reused.

    The build happens in a temporary sibling directory that is renamed into place, so a
    reader never sees a half-written folder, and several processes may call this at once:
    a file lock serialises the builders and a lost rename race just adopts the winner's
    folder.
    """
    cache = pathlib.Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / name
    if is_complete(final):
        return final
    with file_lock(cache / f".{final.name}.lock"):
        if is_complete(final):
            return final
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
        try:
            build(tmp)
            if final.exists():  # left incomplete by something else: move it aside first
                trash = cache / f".{final.name}.trash-{uuid.uuid4().hex}"
                with contextlib.suppress(OSError):
                    os.rename(final, trash)
                    shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
