"""Test-only ComfyUI pack for tests/test_comfyui_live_model.py (never shipped: the live test
links this folder into custom_nodes/ for its run only).

* XDiTTestRandomConditioning: a seeded random CONDITIONING of any widths (SD3: context 4096,
  pooled 2048; FLUX: 4096 / 768; FLUX.2: its text width and pooled_dim 0, i.e.
  `pooled_output` None as CLIPTextEncode gives it), since ComfyUI's text-encoder loaders only
  know the real encoders' shapes. Same seed, same tensors, in every process.
* XDiTTestWanStartFrame: stands in for WanImageToVideo where no ComfyUI-loadable Wan VAE
  exists (a tiny one is not): the same CONDITIONING values (a seeded random raw start latent
  as concat_latent_image, concat_mask 0 on the first latent frame) and the empty video LATENT;
  given a CLIP_VISION_OUTPUT, it goes into both conditionings as WanImageToVideo puts it.
  `channels` / `scale` (optional: 16, 8) give other latent layouts, e.g. HunyuanVideo 1.5's
  32 channels at 1/16 for HunyuanVideo15ImageToVideo, whose VAE has no tiny ComfyUI twin.
* XDiTTestClipVisionOutput: a seeded random CLIP_VISION_OUTPUT (ComfyUI's clip_vision.Output,
  penultimate_hidden_states [1, tokens, width]) for Wan 2.1 I2V's clip_fea, since no tiny
  CLIP vision model loads into ComfyUI's CLIPVisionLoader.
* XDiTTestEmptyAVLatent: LTX-2's empty AV LATENT (EmptyLTXVLatentVideo's video latent and
  LTXVEmptyLatentAudio's sound latent nested as LTXVConcatAVLatent nests them), since
  LTXVEmptyLatentAudio reads its shape from an audio VAE no tiny model loads into ComfyUI.
* XDiTTestLTXVStandInVAEs: stands in for LTX-2's video VAE and audio VAE (none loads tiny
  into ComfyUI) where ComfyUI's own LTX-2 nodes read them, so LTXVImgToVideoInplace and
  LTXVEmptyLatentAudio run unchanged: the video one's `downscale_index_formula` (8, 32, 32)
  and an `encode` of an IMAGE to a [B, 128, 1, H/32, W/32] start latent (the image averaged
  over each 32x32 block through a seeded random 3 -> 128 map, plus seeded noise: the same
  image, the same latent in every process); the audio one's latent channels (8), mel bins
  (16), sample rate and latents a second (LTX-2's 25).
* XDiTTestSaveTensors: writes an IMAGE and / or a LATENT to a .safetensors file at full
  float precision, so two branches of a graph can be compared beyond 8-bit PNGs (a nested
  LATENT's parts as latent_0, latent_1, ...) and an AUDIO's waveform (its keys and
  sample rate, with the rate's Python type, in the file's metadata).
* XDiTTestCountCalls: the MODEL with a model function wrapper that records each of the
  sampler's model calls (its sigma and its rows' cond / uncond) into a JSON file, so a test
  counts the calls a step makes (every call of an xDiT MODEL is one pool request).
"""


class XDiTTestRandomConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "context_dim": ("INT", {"default": 4096, "min": 1, "max": 65536}),
                             "pooled_dim": ("INT", {"default": 2048, "min": 0, "max": 8192}),
                             "guidance": ("FLOAT", {"default": -1.0, "min": -1.0,
                                                    "max": 100.0})},
                # a conditioning key set to True: a text encoder's word on its states
                # (ComfyUI 0.33.0's LTX-2 encoder sets unprocessed_ltxav_embeds)
                "optional": {"flag": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "xDiT tests"

    def make(self, seed, tokens, context_dim, pooled_dim, guidance, flag=""):
        import torch
        g = torch.Generator().manual_seed(int(seed))
        ctx = torch.randn(1, tokens, context_dim, generator=g)
        # pooled_dim 0: a family without pooled text (FLUX.2); the key is still there,
        # holding None, as ComfyUI's CLIPTextEncode always sets it
        pooled = torch.randn(1, pooled_dim, generator=g) if pooled_dim else None
        extra = {"pooled_output": pooled}
        if guidance >= 0:  # FLUX embedded guidance (what FluxGuidance sets)
            extra["guidance"] = float(guidance)
        if flag:
            extra[flag] = True
        return ([[ctx, extra]],)


class XDiTTestWanStartFrame:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"positive": ("CONDITIONING",), "negative": ("CONDITIONING",),
                             "width": ("INT", {"default": 64, "min": 16, "max": 4096}),
                             "height": ("INT", {"default": 48, "min": 16, "max": 4096}),
                             "length": ("INT", {"default": 9, "min": 1, "max": 1024}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})},
                "optional": {"clip_vision_output": ("CLIP_VISION_OUTPUT",),
                             "channels": ("INT", {"default": 16, "min": 1, "max": 256}),
                             "scale": ("INT", {"default": 8, "min": 1, "max": 64})}}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT")
    FUNCTION = "make"
    CATEGORY = "xDiT tests"

    def make(self, positive, negative, width, height, length, seed, clip_vision_output=None,
             channels=16, scale=8):
        import torch
        t = (length - 1) // 4 + 1
        h, w = height // scale, width // scale
        g = torch.Generator().manual_seed(int(seed))
        start = torch.randn(1, channels, t, h, w, generator=g)
        mask = torch.ones(1, 1, t, h, w)
        mask[:, :, :1] = 0.0

        values = dict(concat_latent_image=start, concat_mask=mask)
        if clip_vision_output is not None:
            values["clip_vision_output"] = clip_vision_output

        def put(c):
            return [[e[0], dict(e[1], **values)] for e in c]
        return (put(positive), put(negative),
                {"samples": torch.zeros(1, channels, t, h, w)})


class XDiTTestClipVisionOutput:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "tokens": ("INT", {"default": 257, "min": 1, "max": 1024}),
                             "width": ("INT", {"default": 1280, "min": 1, "max": 8192})}}

    RETURN_TYPES = ("CLIP_VISION_OUTPUT",)
    FUNCTION = "make"
    CATEGORY = "xDiT tests"

    def make(self, seed, tokens, width):
        import torch
        from comfy.clip_vision import Output
        g = torch.Generator().manual_seed(int(seed))
        out = Output()
        out["penultimate_hidden_states"] = torch.randn(1, tokens, width, generator=g)
        out["last_hidden_state"] = torch.randn(1, tokens, width, generator=g)
        out["image_embeds"] = torch.randn(1, width, generator=g)
        return (out,)


class XDiTTestSaveTensors:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {"default": ""})},
                "optional": {"images": ("IMAGE",), "latent": ("LATENT",), "audio": ("AUDIO",)}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "xDiT tests"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # always run: the test reads the file this run writes

    def save(self, path, images=None, latent=None, audio=None):
        import os
        from safetensors.torch import save_file
        out, meta = {}, {}
        if audio is not None:  # ComfyUI's AUDIO: {"waveform": [B, ch, samples], "sample_rate"}
            out["audio"] = audio["waveform"].detach().float().cpu().contiguous()
            meta = {"audio_keys": ",".join(sorted(audio)),
                    "sample_rate": repr(audio["sample_rate"]),
                    "sample_rate_type": type(audio["sample_rate"]).__name__}
        if images is not None:
            out["image"] = images.detach().float().cpu().contiguous()
        if latent is not None:
            samples = latent["samples"]
            if getattr(samples, "is_nested", False):  # an AV LATENT: its parts
                for i, t in enumerate(samples.unbind()):
                    out[f"latent_{i}"] = t.detach().float().cpu().contiguous()
            else:
                out["latent"] = samples.detach().float().cpu().contiguous()
        tmp = path + ".tmp"
        save_file(out, tmp, metadata=meta or None)
        os.replace(tmp, path)
        return {}


class XDiTTestCountCalls:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "path": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "xDiT tests"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # always run: each run's file starts empty

    def wrap(self, model, path):
        import json
        calls = []

        def counted(apply_model, args):
            t = args["timestep"]
            calls.append({"sigma": [float(v) for v in t.reshape(-1).tolist()],
                          "cond_or_uncond": list(args["cond_or_uncond"])})
            with open(path, "w") as f:
                json.dump(calls, f)
            return apply_model(args["input"], args["timestep"], **args["c"])

        out = model.clone()
        out.set_model_unet_function_wrapper(counted)
        return (out,)


class XDiTTestEmptyAVLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": ("INT", {"default": 96, "min": 32, "max": 4096}),
                             "height": ("INT", {"default": 64, "min": 32, "max": 4096}),
                             "frames": ("INT", {"default": 9, "min": 1, "max": 1000}),
                             "frame_rate": ("INT", {"default": 25, "min": 1, "max": 1000})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = "xDiT tests"

    def make(self, width, height, frames, frame_rate):
        import math

        import torch
        from comfy.nested_tensor import NestedTensor
        video = torch.zeros(1, 128, (frames - 1) // 8 + 1, height // 32, width // 32)
        # the LTX-2 audio VAE's count: 16 kHz mel frames, hop 160, 4x in time
        sound = torch.zeros(1, 8, math.ceil(frames / frame_rate * 16000 / 160 / 4), 16)
        return ({"samples": NestedTensor((video, sound)), "sample_rate": 16000,
                 "type": "audio"},)


class _StandInVideoVAE:
    downscale_index_formula = (8, 32, 32)

    def __init__(self, seed: int):
        self.seed = int(seed)

    def encode(self, pixels):
        import torch
        g = torch.Generator().manual_seed(self.seed)
        proj = torch.randn(128, 3, generator=g)
        b, h, w, _ = pixels.shape
        blocks = torch.nn.functional.avg_pool2d(pixels[..., :3].movedim(-1, 1).float(), 32)
        noise = torch.randn(b, 128, 1, h // 32, w // 32, generator=g)
        return torch.einsum("oc,bchw->bohw", proj, blocks).unsqueeze(2) + noise


class _StandInAudioVAE:
    latent_channels = 8
    latent_frequency_bins = 16
    sample_rate = 16000
    latents_per_second = 16000 / 160 / 4  # 16 kHz mel frames, hop 160, 4x in time: 25

    @property
    def first_stage_model(self):  # where ComfyUI 0.33.0's node reads the counts
        return self

    def num_of_latents_from_frames(self, frames_number, frame_rate):
        import math
        return math.ceil(float(frames_number) / frame_rate * self.latents_per_second)


class XDiTTestLTXVStandInVAEs:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})}}

    RETURN_TYPES = ("VAE", "VAE")
    RETURN_NAMES = ("video_vae", "audio_vae")
    FUNCTION = "make"
    CATEGORY = "xDiT tests"

    def make(self, seed):
        return (_StandInVideoVAE(seed), _StandInAudioVAE())


NODE_CLASS_MAPPINGS = {"XDiTTestLTXVStandInVAEs": XDiTTestLTXVStandInVAEs,
                       "XDiTTestRandomConditioning": XDiTTestRandomConditioning,
                       "XDiTTestEmptyAVLatent": XDiTTestEmptyAVLatent,
                       "XDiTTestSaveTensors": XDiTTestSaveTensors,
                       "XDiTTestCountCalls": XDiTTestCountCalls,
                       "XDiTTestWanStartFrame": XDiTTestWanStartFrame,
                       "XDiTTestClipVisionOutput": XDiTTestClipVisionOutput}
