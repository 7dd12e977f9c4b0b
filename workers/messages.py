"""User-facing messages the workers and the host both give (one home each)."""

NO_TEXT_ENCODERS = ("this model is a single .safetensors file, which has no text encoders: "
                    "connect positive (and, with cfg > 1, negative) CONDITIONING from ComfyUI's "
                    "text-encoder nodes (DualCLIPLoader / TripleCLIPLoader + CLIPTextEncode) "
                    "instead of prompt text, or use a diffusers model folder")
NO_VAE = ("this model is a single .safetensors file, which has no VAE for the pool: take the "
          "LATENT and decode it with ComfyUI's VAE (VAEDecode, or the xDiT Decode node's vae "
          "input), or use a diffusers model folder")
REFERENCE_IMAGES_NEED_VAE = ("reference images are encoded with the model folder's own VAE, "
                             "and this single .safetensors file has none: give the reference "
                             "as a LATENT instead (ComfyUI's VAEEncode + ReferenceLatent, or "
                             "GenerationRequest.reference_latents), or use a diffusers model "
                             "folder")

# image-to-video (Wan I2V), {name}: the family's name
NEEDS_START_IMAGE = ("this {name} model is image-to-video and needs a start image: give one "
                     "image (--image FILE, GenerationRequest.reference_images) or ComfyUI's "
                     "WanImageToVideo conditioning with a start_image (concat_latent)")
NO_START_IMAGE = ("this {name} model is text-to-video and takes no start image (--image, "
                  "reference_images, concat_latent): remove it, or use an image-to-video "
                  "(I2V) model")
START_IMAGE_TWICE = ("give the start image once: as reference_images (the image) or as "
                     "ComfyUI's concat_latent (its latent), not both")
NEEDS_IMAGE_EMBEDS = ("this {name} model also reads the start image's CLIP vision states: "
                      "connect clip_vision_output (CLIPVisionEncode of the start image, "
                      "crop none) to WanImageToVideo, or give the image itself "
                      "(reference_images)")

# PipeFusion already reuses one-step-stale activations for most of each step, and a skip
# decision would have to be shared by stages computing different patches of different steps
# at once: refused rather than approximated twice.
CACHE_WITH_PIPEFUSION = ("the step cache cannot be combined with PipeFusion (PipeFusion "
                         "already reuses stale activations); set the cache threshold to 0 or "
                         "pipefusion to 1")


def cfg_degree_refusal(degree: int, passes) -> "str | None":
    """Why cfg-parallel at `degree` cannot run a step whose guidance passes are `passes`
    (their names, in order), or None: each cfg rank runs its own passes, so a rank without
    one would only wait (the host refuses it before a launch, the workers again per job)."""
    n = len(passes)
    if int(degree) <= max(n, 1):
        return None
    fix = f"use cfg-parallel {n} or less" if n > 1 else \
        "turn cfg-parallel off or set cfg > 1 (classifier-free guidance)"
    return (f"cfg-parallel {degree} needs {degree} guidance passes per step; this run has "
            f"{n} ({', '.join(passes)}): {fix}")


def _status_mb(pid, field: str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rss_mb(pid="self") -> float:
    """Resident memory of a process in MiB (Linux /proc; 0 where unavailable)."""
    return _status_mb(pid, "VmRSS")


def peak_rss_mb(pid="self") -> float:
    """This process image's peak resident memory in MiB (VmHWM, which exec starts afresh;
    getrusage's ru_maxrss keeps the launching process's peak across fork and exec, so a
    worker started by a host that once held 10 GB would report 10 GB)."""
    return _status_mb(pid, "VmHWM")
