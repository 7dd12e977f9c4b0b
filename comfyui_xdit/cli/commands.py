"""`python -m comfyui_xdit ...` (or `comfyui-xdit ...` once installed): demo, tiny-model,
generate, bench, ... (docs/design.md#command-line fixes the flags).

`bench` runs the benchmarks, which live outside this package (`benchmarks/` at the repository
root, `python -m benchmarks`): they are imported only when `bench` runs.

Bad input exits 2 with one line on stderr, before any worker starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from comfyui_xdit.planning.config import ATTENTION_BACKENDS, WEIGHTS, ConfigError, EngineOptions, ParallelConfig
from comfyui_xdit.cli.cfg_flag import add_cfg_parallel
from comfyui_xdit.cli.guide_flag import add_guide_flag
from comfyui_xdit.cli.images import VIDEO_SUFFIXES, save_pngs, save_video, save_wav
from comfyui_xdit.planning.request import GenerationRequest, cache_settings, families


def family_names(keep=lambda fam: True) -> str:
    """The families `keep` selects, from the registry (a new family appears in the help
    without editing it): "FLUX.1, FLUX.2, ..."."""
    return ", ".join(f.name for f in families.FAMILIES.values() if keep(f))


def _video(fam) -> bool:
    return fam.latent.video


def _references(fam) -> bool:
    return fam.capability(families.References) is not None


def _image_to_video(fam) -> bool:
    return fam.capability(families.ImageToVideo) is not None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the whole usage)
        raise ConfigError(f"{self.prog}: {message}")


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer (got {text!r})")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1 (got {v})")
        return v
    return parse


def _lora(text):
    """FILE, FILE:STRENGTH or FILE:STRENGTH:high|low (Wan 2.2 A14B: that expert only)."""
    expert = None
    head, sep, last = text.rpartition(":")
    if sep and last in ("high", "low"):
        text, expert = head, last
    path, sep, strength = text.rpartition(":")
    try:
        entry = (path, float(strength)) if sep else (text, 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lora wants FILE:STRENGTH or FILE:STRENGTH:high|low "
                                         f"(got {text!r})")
    return entry if expert is None else entry + (expert,)


def _add_generate(sub):
    video = family_names(_video)
    p = sub.add_parser("generate", help=f"generate images (.png), videos (.mp4 for {video}) "
                                        f"or LATENTs (.safetensors) on a local or attached pool")
    p.add_argument("--model", required=True,
                   help=f"diffusers folder: {family_names()}")
    p.add_argument("--model-2", default=None, dest="model_2",
                   help="Wan 2.2 A14B from two single files: the low-noise expert's file "
                        "(--model the high-noise one's)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--negative-prompt", default="",
                   help=f"what to steer away from (used where CFG runs: --cfg > 1; by "
                        f"default {family_names(lambda f: f.defaults.cfg > 1)})")
    p.add_argument("--seed", type=int, required=True,
                   help="noise seed: the same initial noise as ComfyUI's KSampler with this "
                        "seed, whatever the parallel degrees")
    p.add_argument("--steps", type=_positive("--steps"), required=True,
                   help="denoising steps")
    p.add_argument("--height", type=int, required=True,
                   help="image height in pixels, a multiple of 16")
    p.add_argument("--width", type=int, required=True,
                   help="image width in pixels, a multiple of 16")
    p.add_argument("--guidance", type=float, default=None,
                   help=f"embedded guidance ({family_names(lambda f: f.defaults.guidance)})")
    p.add_argument("--cfg", type=float, default=None, help="classifier-free guidance scale")
    p.add_argument("--cfg-2", type=float, default=None, dest="cfg_2",
                   help="Wan 2.2 A14B: the low-noise expert's guidance scale (default: --cfg)")
    p.add_argument("--shift", type=float, default=None,
                   help="the scheduler's flow shift in place of the model's (ComfyUI's "
                        "ModelSamplingSD3 shift), e.g. 12 for Wan 2.2 T2V A14B as its original "
                        "code samples")
    p.add_argument("--frames", type=_positive("--frames"), default=None,
                   help=f"video models ({video}): frames per video, 4k + 1 (e.g. 81); "
                        f"image models make 1")
    p.add_argument("--fps", type=float, default=None,
                   help="frame rate of a video --out (default 16, Wan's; a model that makes "
                        "a sound track: the rate its sound is timed at, LTX-2's 24)")
    p.add_argument("--wav", default=None, metavar="FILE",
                   help="a model that makes a sound track (LTX-2): also write each video's "
                        "sound as a .wav (FILE, then FILE-1.wav, ...); the .mp4 carries it "
                        "anyway")
    p.add_argument("--max-sequence-length", type=int, default=GenerationRequest.max_sequence_length,
                   help=f"text tokens per prompt (default "
                        f"{GenerationRequest.max_sequence_length})")
    _add_parallel_flags(p)
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="PipeFusion: full synchronous steps before the patch pipeline")
    p.add_argument("--pipeline-patches", type=_positive("--pipeline-patches"), default=None,
                   help="PipeFusion: patches per step (default: the pipefusion degree)")
    p.add_argument("--pipefusion-split", default="balanced",
                   help="PipeFusion stage split: balanced (compute, weights <= 1/N + 5%%) | "
                        "compute | memory | block counts like 10,9")
    p.add_argument("--lora", type=_lora, action="append", default=[],
                   metavar="FILE[:STRENGTH[:high|low]]",
                   help="repeat for several; Wan 2.2 A14B: :high or :low puts it into that "
                        "expert only (default: both)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help=f"reference / edit image ({family_names(_references)}: their "
                        f"reference / edit models, a diffusers folder): repeat for several "
                        f"references; for an image-to-video folder "
                        f"({family_names(_image_to_video)}), the start frame")
    add_guide_flag(p, family_names(lambda f: f.capability(families.ExtraGuidance)))
    _add_cache_flags(p)
    p.add_argument("--out", required=True,
                   help=out_forms().replace("%", "%%") + "; decoded with the model's VAE, "
                                                         "patch-parallel")
    p.add_argument("--attach", default=None, metavar="HOST:PORT",
                   help="use a pool started with `serve` (secret: $XDIT_POOL_SECRET or --secret-file)")
    p.add_argument("--secret-file", default=None,
                   help="with --attach: a file holding the pool's secret (hex), else "
                        "$XDIT_POOL_SECRET")
    p.set_defaults(func=run_generate)


def _read_secret(args) -> bytes:
    if args.secret_file:
        try:
            with open(args.secret_file) as f:
                text = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --secret-file: {e}") from None
    else:
        text = os.environ.get("XDIT_POOL_SECRET", "")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError("the pool secret must be at least 32 hex digits, from "
                          "--secret-file or $XDIT_POOL_SECRET (make one: "
                          "python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def _add_serve(sub):
    p = sub.add_parser("serve", help="worker entry point, e.g. under torchrun on several nodes")
    p.add_argument("--model", required=True, help="diffusers folder every rank loads")
    p.add_argument("--listen", default="127.0.0.1:0",
                   help="rank 0's control address; 0.0.0.0:PORT to accept other machines")
    p.add_argument("--secret-file", default=None, help="else $XDIT_POOL_SECRET (hex)")
    p.add_argument("--address-file", default=None, help="rank 0 writes HOST:PORT here")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                   help="where the ranks run (default cuda: one GPU per rank)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16",
                   help="weights and compute dtype (default bf16)")
    p.add_argument("--threads-per-rank", type=_positive("--threads-per-rank"), default=None,
                   help="CPU only: torch threads per rank (default: cores / ranks)")
    p.add_argument("--pipefusion", type=_positive("--pipefusion"), default=1,
                   help="PipeFusion degree the pool is launched for (each rank loads one stage)")
    p.add_argument("--pipefusion-inner", type=_positive("--pipefusion-inner"), default=1,
                   help="ulysses x ring per PipeFusion stage")
    p.add_argument("--pipefusion-split", default="balanced",
                   help="PipeFusion stage split: balanced | compute | memory | block counts "
                        "like 10,9")
    _add_engine_flags(p)
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from comfyui_xdit.planning.model_info import read_model_info

    read_model_info(args.model)
    if int(os.environ.get("RANK", "0")) == 0:
        _read_secret(args)  # fail early, with the clear message, on rank 0
    argv = ["--model", str(Path(args.model).resolve()), "--listen", args.listen,
            "--device", args.device, "--dtype", args.dtype,
            "--threads", str(args.threads_per_rank or 0),
            "--pipefusion", str(args.pipefusion), "--pipefusion-inner",
            str(args.pipefusion_inner), "--pipefusion-split", args.pipefusion_split,
            *engine_from_args(args).worker_argv()]
    if args.secret_file:
        argv += ["--secret-file", args.secret_file]
    if args.address_file:
        argv += ["--address-file", args.address_file]
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from workers.runtime.serve import main as worker_main
    return worker_main(argv)


def _add_status(sub):
    p = sub.add_parser("status", help="show an attached pool's ranks, memory and state")
    p.add_argument("--attach", required=True, metavar="HOST:PORT",
                   help="rank 0's address, as given to `serve --listen`")
    p.add_argument("--secret-file", default=None,
                   help="a file holding the pool's secret (hex), else $XDIT_POOL_SECRET")
    p.set_defaults(func=run_status)


def run_status(args) -> int:
    from comfyui_xdit.client.pool import WorkerPool

    try:
        pool = WorkerPool.attach(args.attach, _read_secret(args))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        pool.model_info  # connects
        info = pool.status()
    finally:
        pool.close()
    print(format_status(info))
    return 0


def format_status(info: dict) -> str:
    lines = [f"model: {info.get('model')}  arch: {info.get('arch')}  world size: "
             f"{info.get('world_size')}  state: {info.get('state')}"
             + (f" (job {info.get('job_id')}, step {info.get('step')}/{info.get('total')})"
                if info.get("state") == "running" else "")]
    if info.get("fp8_compute"):
        lines.append(info["fp8_compute"])  # which fp8 path multiplies
    split = {r["rank"]: r for r in (info.get("split") or {}).get("ranks", [])}
    lines.append("rank  pid      host                 device   rss_mb  share  own_s")
    for r in info.get("ranks", []):
        sh = split.get(r["rank"], {})
        lines.append(f"{r['rank']:<5} {r['pid']:<8} {r['host'][:20]:<20} {r['device']:<8} "
                     f"{r.get('rss_mb', 0):<7.0f} "
                     f"{sh.get('share', 0):<6.2f} {sh.get('own_s', '-')}")
    if (info.get("split") or {}).get("holds_back"):
        lines.append(info["split"]["holds_back"])
    return "\n".join(lines)


def _add_cache_flags(p) -> None:
    """The step cache (off unless --cache is given; its defaults are CacheSettings')."""
    d = cache_settings()()
    p.add_argument("--cache", type=float, nargs="?", const=d.threshold, default=0.0,
                   metavar="THRESHOLD",
                   help=f"step cache: skip a step's middle blocks when the first blocks' "
                        f"residual changed less than this (relative L1; without a value "
                        f"{d.threshold:g}); 0: off")
    for name, help_ in (("warmup", f"calls per row that always compute (default {d.warmup})"),
                        ("head", f"first blocks that always run (default {d.head})"),
                        ("tail", f"last blocks that always run (default {d.tail})"),
                        ("max-skips", f"most skipped calls in a row, 0 = no limit (default "
                                      f"{d.max_skips})")):
        p.add_argument(f"--cache-{name}", type=int, default=None, help=f"step cache: {help_}")
    p.add_argument("--cache-taylor", action="store_true",
                   help="step cache: forecast the skipped residual to first order (TaylorSeer)")


def _cache_from_args(args):
    if not args.cache:
        return None
    out = {"threshold": args.cache, "taylor": args.cache_taylor}
    for name in ("warmup", "head", "tail", "max_skips"):
        v = getattr(args, f"cache_{name}")
        if v is not None:
            out[name] = v
    return out


def _add_parallel_flags(p):
    """The degrees (world size = dp x cfg x pipefusion x ulysses x ring) and where ranks run."""
    p.add_argument("--world-size", type=_positive("--world-size"), default=None,
                   help="ranks; must equal dp x cfg x pipefusion x ulysses x ring (default: "
                        "that product)")
    p.add_argument("--dp", type=_positive("--dp"), default=1,
                   help="data parallel degree: the batch of prompts split over replicas")
    add_cfg_parallel(p)
    p.add_argument("--ulysses", type=_positive("--ulysses"), default=1,
                   help="Ulysses sequence-parallel degree (attention heads split; divides "
                        "the head count)")
    p.add_argument("--ring", type=_positive("--ring"), default=1,
                   help="Ring sequence-parallel degree (keys and values passed around a "
                        "ring)")
    p.add_argument("--pipefusion", type=_positive("--pipefusion"), default=1,
                   help="PipeFusion degree: each rank holds 1/N of the blocks (close to "
                        "exact, not exact)")
    p.add_argument("--split", default="even",
                   help="work per rank for GPUs of different speed or memory, exact whatever "
                        "it is: even (default), auto (measured per rank) or one weight per "
                        "rank, e.g. 3,2")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the ranks run (default cpu; cuda: one GPU per rank)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="weights and compute dtype (default fp32; CPU ranks run fp32 only)")
    p.add_argument("--threads-per-rank", type=_positive("--threads-per-rank"), default=None,
                   help="CPU only: torch threads per rank (default: cores / ranks)")
    _add_engine_flags(p)


def _add_engine_flags(p):
    """EngineOptions beyond --device/--dtype (comfyui_xdit/planning/config.py)."""
    p.add_argument("--attention", choices=list(ATTENTION_BACKENDS), default="auto",
                   help="attention kernel, chosen once per pool: auto picks the fastest the "
                        "device has (cuDNN/flash-attn with LSE for Ring, plain SDPA otherwise)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks while the pool warms up")
    p.add_argument("--weights", choices=list(WEIGHTS), default="auto",
                   help="auto: as the checkpoint (fp8 files stay fp8); fp8: store the block "
                        "weights in fp8 e4m3fn; full: every weight in --dtype")
    p.add_argument("--text-encoders", default="auto",
                   help="where T5/CLIP run on rank 0: auto | cpu | gpu | cuda:N")
    p.add_argument("--shard-weights", action="store_true",
                   help="FSDP2-shard the transformer's block weights over every rank (exact; "
                        "for models larger than one GPU)")
    p.add_argument("--shard-split", default="even",
                   help="with --shard-weights, each rank's share of the weights: even, memory "
                        "(by each GPU's size) or one weight per rank, e.g. 3,2 (exact)")


def engine_from_args(args) -> EngineOptions:
    return EngineOptions(device=args.device, dtype=args.dtype, attention=args.attention,
                         compile=args.compile, weights=args.weights,
                         text_encoders=args.text_encoders,
                         shard_weights=args.shard_weights,
                         shard_split=getattr(args, "shard_split", "even")).validate()


def config_from_args(args) -> ParallelConfig:
    return ParallelConfig(dp=args.dp, cfg_parallel=args.cfg_parallel, pipefusion=args.pipefusion,
                          ulysses=args.ulysses, ring=args.ring,
                          warmup_steps=getattr(args, "warmup_steps", 1),
                          pipeline_patches=getattr(args, "pipeline_patches", None),
                          pipefusion_split=getattr(args, "pipefusion_split", "balanced"),
                          world_size=args.world_size, split=getattr(args, "split", "even"))


def output_kind(out: str) -> str:
    """What `--out` asks for: "latent" (.safetensors), "png" (one PNG per image), "video"
    (.mp4 / .webm / .mkv / ...), "frames" (a `%04d.png`-style pattern, or a directory: one PNG
    per frame). Anything else is refused in one line."""
    path = Path(out)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return "latent"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    if "%" in path.name:
        if suffix != ".png":
            raise ConfigError(f"--out {out!r}: a frame pattern must end in .png "
                              f"(e.g. frames_%04d.png)")
        try:
            path.name % 0
        except (TypeError, ValueError):
            raise ConfigError(f"--out {out!r}: a frame pattern holds one integer field such "
                              f"as %04d (e.g. frames_%04d.png)") from None
        return "frames"
    if suffix == ".png":
        return "png"
    if str(out).endswith(("/", os.sep)) or path.is_dir() or not suffix:
        return "frames"
    raise ConfigError(f"--out {out!r} must be {out_forms()}")


def out_forms() -> str:
    """What --out takes, for its help and its error alike."""
    videos = " / ".join("x" + s for s in VIDEO_SUFFIXES)
    return (f"x.safetensors (the LATENT; 5-D for video), x.png (images), or for video "
            f"{videos}, frames_%04d.png or a directory (one PNG per frame)")


def check_output(kind: str, out: str, info, frames: int) -> None:
    """Refuse, in one line, an --out the model cannot make: a video or frame sequence from an
    image model, one PNG for a video of several frames."""
    fam = info.family
    video = fam.latent.video
    if kind in ("video", "frames") and not video:
        raise ConfigError(f"--out {out!r} is a video, but {fam.name} makes images: write "
                          f".png or .safetensors (video needs a video model: "
                          f"{family_names(_video)})")
    if kind == "png" and video and frames > 1:
        raise ConfigError(f"--out {out!r} is one PNG, but {fam.name} makes {frames} frames: "
                          f"write x.mp4, frames_%04d.png, a directory or x.safetensors")


def run_generate(args) -> int:
    from comfyui_xdit.planning.model_info import read_model_info
    from comfyui_xdit.client.pool import WorkerPool

    out = Path(args.out)
    kind = output_kind(args.out)
    if not out.parent.exists():
        raise ConfigError(f"--out directory {str(out.parent)!r} does not exist")
    if args.fps is not None and args.fps <= 0:
        raise ConfigError(f"--fps must be > 0 (got {args.fps:g})")
    config = config_from_args(args)
    images = [read_image(f) for f in args.image]
    extra = {} if args.frames is None else {"frames": args.frames}
    request = GenerationRequest(
        prompt=args.prompt, negative_prompt=args.negative_prompt, seed=args.seed,
        steps=args.steps, height=args.height, width=args.width, guidance=args.guidance,
        cfg=args.cfg, cfg_2=args.cfg_2, shift=args.shift,
        max_sequence_length=args.max_sequence_length,
        loras=args.lora, output="latent" if kind == "latent" else "image",
        cache=_cache_from_args(args), reference_images=images or None,
        extra_guidance=dict(args.guide) or None, **extra)
    if args.attach:
        pool = WorkerPool.attach(args.attach, _read_secret(args), config)
    else:
        info = read_model_info(args.model, args.model_2)
        config.validate(info, request)  # before anything launches
        check_output(kind, args.out, info, request.frames)
        if args.cfg_2 is not None and info.experts < 2:
            raise ConfigError(f"--cfg-2 is the second expert's guidance scale (Wan 2.2 A14B); "
                              f"{args.model} has one transformer: use --cfg")
        e = engine_from_args(args)
        pool = WorkerPool(args.model, config, device=e.device, dtype=e.dtype,
                          threads_per_rank=args.threads_per_rank, attention=e.attention,
                          compile=e.compile, weights=e.weights, text_encoders=e.text_encoders,
                          shard_weights=e.shard_weights, shard_split=e.shard_split,
                          model_path_2=args.model_2)
    with pool:
        if args.attach:
            served = pool.model_info.path
            if Path(served).name != Path(args.model).name:
                raise ConfigError(f"the pool at {args.attach} serves {served!r}, not "
                                  f"{args.model!r}; attach to a pool serving that model")
            check_output(kind, args.out, pool.model_info, request.frames)
        result = pool.generate(request)
    fps = args.fps or _sound_fps(pool.model_info.arch) or 16.0
    written = write_output(result, out, kind, request.batch, fps,
                           wav=None if args.wav is None else Path(args.wav))
    print(json.dumps({"out": [str(p) for p in written], "config": config.describe(),
                      "timings": result.timings}))
    return 0


def read_image(path: str):
    """--image FILE -> an RGB PIL image (loaded now: a bad file is refused in one line)."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise ConfigError(f"--image {path!r}: no such file") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"--image {path!r} is not an image PIL can read ({e})") from None


def _sound_fps(arch: str):
    """The frame rate a family's sound track is timed at (None: it makes none)."""
    from comfyui_xdit import bridge
    sound = bridge.latent_layout.sound_of(arch)
    return None if sound is None else float(sound.fps)


def write_output(result, out: Path, kind: str = "png", batch: int = 1, fps: float = 16,
                 wav: Path | None = None) -> list:
    """The result as --out asks: the LATENT (4-D, or 5-D [B, 16, T, h, w] for video), PNGs,
    or each video of the batch (the IMAGE batch holds batch x frames frames, video by video)
    as a video file or a PNG per frame. The b-th video of a batch > 1 goes to `out` with
    `-b` after its stem (x-1.mp4, frames_%04d-1.png, DIR-1/), the first to `out` itself. A
    result with a sound track (Decoded.audio) muxes each video's into its file and, with
    `wav`, writes it there too (named alike)."""
    if kind == "latent":
        from safetensors.torch import save_file
        latents = getattr(result, "latents", None)  # the video's and, with it, its sound's
        tensors = dict(latents.items()) if latents is not None else {"samples": result.samples}
        save_file({k: t.float().contiguous() for k, t in tensors.items()}, str(out))
        return [out]
    if kind == "png":
        return save_pngs(result.images, out)
    frames = result.images
    per = int(frames.shape[0]) // max(1, batch)
    written = []
    decoded = getattr(result, "decoded", None)
    sound = None if decoded is None else decoded.audio
    if wav is not None and sound is None:
        raise ConfigError("--wav: this model makes no sound track")
    for b in range(batch):
        target = out if b == 0 else out.with_name(f"{out.stem}-{b}{out.suffix}")
        track = None if sound is None else sound[b]
        written += save_video(frames[b * per:(b + 1) * per], target, fps=fps, audio=track,
                              sample_rate=None if sound is None else decoded.sample_rate)
        if wav is not None:
            written += save_wav(track, decoded.sample_rate,
                                wav if b == 0 else wav.with_name(f"{wav.stem}-{b}{wav.suffix}"))
    return written


def _add_bench(sub):
    # listed here; its options are the benchmarks' own (parsed by benchmarks/cli.py)
    sub.add_parser("bench", add_help=False,
                   help="time/step and bytes/step of 1 vs 2 CPU ranks (the benchmarks, "
                        "benchmarks/ in a checkout; `bench --help` for the options)")


def run_bench(argv) -> int:
    """`bench ...`: the benchmarks' command line, imported now (they are not part of the
    node pack ComfyUI loads, and may be missing from an install)."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "benchmarks" / "__init__.py").is_file() and str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    try:
        from benchmarks.cli import main as bench_main
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.cli"):
            raise
        raise ConfigError("bench: the benchmarks are not installed here (they live in "
                          "benchmarks/ of a checkout of the comfyui-xdit repository, next to "
                          "comfyui_xdit/); run `python -m comfyui_xdit bench` or "
                          "`python -m benchmarks` from such a checkout") from None
    return bench_main(argv, prog=f"{_prog()} bench")


def _prog() -> str:
    """The name the user typed: the console script's, else the module form."""
    return "comfyui-xdit" if Path(sys.argv[0]).name == "comfyui-xdit" else "python -m comfyui_xdit"


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser (tests walk it: each option says what it does)."""
    parser = _Parser(prog=_prog(),
                     description=f"xDiT-style parallel {family_names()} sampling on a warm "
                                 f"worker pool. `generate` writes images (.png), videos "
                                 f"({family_names(_video)}: .mp4, .webm, .mkv, or one PNG per "
                                 f"frame) or ComfyUI LATENTs (.safetensors).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from comfyui_xdit.cli import demo, memory_plan_command
    from comfyui_xdit.testmodels import tiny_model, trained_model
    demo.add_cli(sub)
    tiny_model.add_cli(sub)
    trained_model.add_cli(sub)
    memory_plan_command.add_cli(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_status(sub)
    _add_bench(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        if argv[:1] == ["bench"]:
            return run_bench(argv[1:])
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a pool failure: one line, the details are in the message
        from comfyui_xdit.client.pool import PoolError
        if isinstance(e, PoolError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise
