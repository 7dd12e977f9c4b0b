"""What every family's adapter shares: loading a diffusers folder or a single file, VAE
space, decoding. Each family's own steps live in its workers/models/<family>.py."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from .. import families
from ..loading.loaded_model import LoadedModel
from . import latent_layout

# per-row text, for families whose prompts of one batch pad to the longest: the job's mask
# ([B, L] bool, made by `encode`) and, once sliced for a replica, its host row lengths
TEXT_MASK = "text_mask"
TEXT_LENGTHS = "text_lengths"


def text_encoder_device_of(model) -> "object":
    """Where the (rank-0) text encoders run: prompts are encoded there; the embeddings are
    moved to the transformer's device by the job broadcast."""
    enc = getattr(model, "encoder", None)
    return enc.device if enc is not None else model.device


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)




def load_vae(model: LoadedModel):
    """The folder's own VAE class (vae/config.json `_class_name`), on the model's device."""
    import diffusers

    name = model.vae_config.get("_class_name") or "AutoencoderKL"
    known = families.vae_classes()  # what some family declares (its `classes.vae`)
    if name not in known:
        raise ValueError(f"{os.path.join(model.path, 'vae')} holds a {name}; the pool decodes "
                         f"with {', '.join(known[:-1])} or {known[-1]} only (decode the LATENT with "
                         f"ComfyUI's VAEDecode instead)")
    vae = getattr(diffusers, name).from_pretrained(model.path, subfolder="vae",
                                                   torch_dtype=model.dtype)
    return vae.to(model.device).eval().requires_grad_(False)


def vae_mode(model: LoadedModel, pixels) -> torch.Tensor:
    """A preprocessed image [1, 3, (1,) H, W] in -1..1 -> the raw VAE latent the diffusers
    pipelines take (the distribution's mode: their sample_mode "argmax"), fp32 on the CPU."""
    if model.vae is None:
        model.vae = load_vae(model)
    x = pixels.to(model.device, model.vae.dtype)
    return model.vae.encode(x).latent_dist.mode().float().cpu()


def vae_scale_factor(model: LoadedModel) -> int:
    """Image pixels per VAE latent pixel, as the pipelines compute it from the VAE config
    (2D VAEs: its block list; Qwen-Image's 3-D VAE: its temporal-downsample entries)."""
    cfg = model.vae_config
    if cfg.get("temperal_downsample") is not None:
        return 2 ** len(cfg["temperal_downsample"])
    return 2 ** (len(cfg.get("block_out_channels", (0, 0, 0, 0))) - 1)


class DiTAdapter:
    """A family's worker steps. A subclass names its `family` (workers/families); the
    family's id, transformer class, block lists (and their single-file names) and default
    pipeline are copied from it."""
    family = None
    arch = ""
    transformer_class = ""
    pipeline_class = ""
    block_lists: tuple = ()  # the transformer's block lists in execution order (PipeFusion)
    # single files in BFL/ComfyUI naming: its name of each diffusers block list, from the
    # family's `blocks.bfl` (the converter works key by key, so PipeFusion stages skip other
    # stages' blocks unread); an adapter whose converter needs the whole state sets None
    # (SD3: read whole, then converted)
    bfl_blocks: dict | None = None
    lora_alphas = False  # LoRA network alphas go to load_lora_into_transformer (FLUX.1)
    cfg_rescale = False  # true CFG rescaled to the conditional prediction's norm (Qwen-Image)
    latents_fp32 = False  # the loop keeps fp32 latents whatever the model's dtype (Wan)
    # more of the folder's components the text-encoding pipeline leaves unloaded (beside
    # the transformer and the VAE): Wan 2.2's second expert
    encoder_skips: tuple = ()
    # the diffusers pipeline whose LoRA loader reads and loads this family's LoRA files
    # (workers/loading/lora.py), where the family's own pipelines have none ("": theirs)
    lora_pipeline = ""
    # the LoRA formats its loader reads, for the message on a file it cannot read
    lora_formats = "diffusers/PEFT"
    # the step cache's view of a block (workers/sampling/step_cache.py): None where blocks
    # take hidden_states (and encoder_hidden_states) and return them as the usual formats;
    # else the keywords of the states a block returns, in its output's order, the latent's
    # first (LTX-2: its video and its sound, each with its own cached residual)
    block_states = None
    # conditioning keys beside the text states that hold one row per latent row (a MODEL
    # call batches them as it batches the text: LTX-2's sound prompt states)
    row_conds: tuple = ()
    # the transformer takes one timestep for all the rows of a call (their AdaLN rows are
    # shared): `forward` runs rows at other timesteps as separate transformer calls, which
    # the step cache cannot gate as one call (such a MODEL call is refused under it)
    one_timestep: bool = False
    # a single file's tensors (names in its naming, prefix stripped) of modules the family's
    # ComfyUI model holds beside the transformer: the loaders leave them to `raw_text`
    side_prefixes: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fam = cls.__dict__.get("family")
        if fam is not None:
            cls.arch, cls.transformer_class = fam.id, fam.classes.transformer
            cls.block_lists, cls.pipeline_class = fam.blocks.lists, fam.classes.pipelines[0]
            if "bfl_blocks" not in cls.__dict__:
                cls.bfl_blocks = dict(zip(fam.blocks.lists, fam.blocks.bfl or fam.blocks.lists))

    def __init__(self, path=None):
        if path is not None:
            self.pipeline_class = self._pipeline_of(path)

    def _pipeline_of(self, path) -> str:
        """The pipeline that encodes `path`'s prompts (a folder's model_index.json decides
        where the family has several); a single file: the family's default."""
        if not os.path.isdir(str(path)):
            return self.family.classes.pipelines[0]
        from .detect import pipeline_class
        return pipeline_class(self.family, path)

    @staticmethod
    def bfl_to_diffusers(sd: dict, config: dict) -> dict:
        """A single file's tensors in BFL/ComfyUI naming -> diffusers names (splitting fused
        tensors along dim 0 only: workers/loading/single_file.row_map relies on it)."""
        raise NotImplementedError

    @staticmethod
    def computed_buffers(transformer) -> None:
        """Make again, on the CPU, the tables the transformer's __init__ computes outside its
        checkpoint (non-persistent buffers, plain tensor attributes): a meta-built transformer
        has them on the meta device, without data. Where the model wants them on the device,
        the adapter's `assemble` moves them. None by default."""

    def check_lora_keys(self, path: str, keys) -> None:
        """Refuse, in one line, a LoRA file whose keys diffusers' converter would drop."""

    def load(self, path: str, device, dtype, with_text_encoders: bool,
             stage=None, weights: str = "auto", text_encoders: str = "auto",
             shard=None) -> LoadedModel:
        """`stage` = (index, count, split): PipeFusion, load only that stage's blocks.
        `weights`: auto | fp8 | full (workers/loading/weights.py); `text_encoders`: where rank 0 runs
        T5/CLIP (auto | cpu | gpu | cuda:N). The transformer goes straight from the file to
        `device`, tensor by tensor (no host copy), so all ranks may load at once. `shard`
        (weight sharding, workers/parallel/sharding.py): the transformer is sharded as it is built
        and only this rank's rows are read (workers/loading/shards.py)."""
        import diffusers

        from ..loading.meta import meta_transformer
        from ..loading.weights import has_safetensors, load_folder, parameter_bytes, to_fp8

        self.pipeline_class = self._pipeline_of(path)  # an adapter made without the path
        if shard is not None:
            from ..loading.shards import load_shards
            transformer, report = load_shards(self, path, device, dtype, weights, shard)
            return self.assemble(path, transformer, report, device, dtype,
                                 with_text_encoders, text_encoders)
        if os.path.isfile(path):  # one .safetensors transformer (ComfyUI's model folders)
            from ..loading.single_file import load_single_file
            return load_single_file(self, path, device, dtype, stage=stage, weights=weights)
        tcls = getattr(diffusers, self.transformer_class)
        folder = os.path.join(path, "transformer")
        stage_info = None
        if stage is not None:
            from ..loading.stages import load_stage_transformer
            transformer, stage_info, report = load_stage_transformer(
                tcls, folder, self.block_lists, *stage, device=device, dtype=dtype,
                weights=weights)
        elif has_safetensors(folder):
            transformer = meta_transformer(tcls, folder)
            report = load_folder(transformer, self.block_lists, folder, device, dtype, weights)
        else:  # .bin weights: diffusers' own loader (through host memory)
            transformer = tcls.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
            transformer.to(device).eval().requires_grad_(False)
            from ..loading.weights import LoadReport
            n = to_fp8(transformer, self.block_lists) if weights == "fp8" else 0
            report = LoadReport(weights="fp8" if n else "full", fp8_layers=n,
                                transformer_bytes=parameter_bytes(transformer))
        return self.assemble(path, transformer, report.as_dict(), device, dtype,
                             with_text_encoders, text_encoders, stage_info)

    def assemble(self, path: str, transformer, report: dict, device, dtype,
                 with_text_encoders: bool, text_encoders: str = "auto",
                 stage_info=None) -> LoadedModel:
        """The LoadedModel around a loaded transformer, whichever loader made it: a diffusers
        folder's scheduler and VAE configs and (rank 0) its text encoders; a single file's
        released defaults and no text encoders (ComfyUI encodes)."""
        import diffusers

        encoder, te_device = None, None
        if os.path.isfile(path):
            from .detect import single_file_config
            sf = single_file_config(path)
            sched, vae = families.family(sf["arch"]).detection.released(sf["config"])
        else:
            sched = _read_json(os.path.join(path, "scheduler", "scheduler_config.json"))
            vae = _read_json(os.path.join(path, "vae", "config.json"))
            if with_text_encoders:
                te_device = self._text_encoder_device(path, device, dtype, text_encoders)
                pcls = getattr(diffusers, self.pipeline_class)
                skip = dict.fromkeys(("transformer", "vae") + self.encoder_skips, None)
                encoder = pcls.from_pretrained(path, torch_dtype=dtype, **skip)
                encoder.to(te_device)
        model = LoadedModel(path=path, arch=self.arch, transformer=transformer, encoder=encoder,
                            scheduler_config=sched, vae_config=vae, device=device, dtype=dtype,
                            stage=stage_info)
        model.load_report = dict(report, text_encoders=te_device)  # Worker.describe()
        return model

    def _text_encoder_device(self, path, device, dtype, option) -> str:
        """workers/loading/weights.text_encoder_device with this GPU's free memory (after the
        transformer load) and the encoders' size in `dtype` (from their headers)."""
        import torch

        from ..loading.weights import device_name, folder_tensor_bytes, text_encoder_device
        free, need = None, 0
        if torch.device(device).type == "cuda" and str(option) == "auto":
            free = torch.cuda.mem_get_info(device_name(device))[0]
            need = folder_tensor_bytes([os.path.join(path, d) for d in os.listdir(path)
                                        if d.startswith("text_encoder")], dtype)
        out = text_encoder_device(option, device, free, need)
        if out.startswith("cuda:") and int(out[5:]) >= torch.cuda.device_count():
            raise ValueError(f"text_encoders {option!r}: this worker sees "
                             f"{torch.cuda.device_count()} GPU(s); use gpu, auto or cpu")
        return out

    def make_scheduler(self, model: LoadedModel, shift=None):
        """The folder's scheduler class (scheduler_config.json `_class_name`; the loop's
        `check_scheduler` refuses one it does not run), FlowMatch Euler where unnamed;
        `shift`: the request's flow shift in place of the folder's (`with_shift`)."""
        import diffusers

        from ..sampling.flow_step import with_shift
        name = model.scheduler_config.get("_class_name") or "FlowMatchEulerDiscreteScheduler"
        cls = getattr(diffusers, name, None)
        if cls is None:
            raise ValueError(f"scheduler {name!r} is not a diffusers scheduler")
        config = dict(model.scheduler_config)
        if shift is not None:
            config = with_shift(name, config, float(shift))
        return cls.from_config(config)

    def scale_shift(self, model: LoadedModel) -> tuple:
        """The VAE's (scale, shift), scalars or per-channel lists: model space <-> raw VAE
        space (workers/families.latent_norm)."""
        return families.latent_norm(model.vae_config)

    def to_raw(self, model: LoadedModel, latents: torch.Tensor, height: int, width: int):
        """Model-space latents -> raw VAE space [B,C,h,w] (what the VAE decodes)."""
        scale, shift = self.scale_shift(model)
        return latent_layout.to_raw(self.arch, latents, scale, shift, height, width)

    def job_raw(self, model: LoadedModel, latents: dict, req):
        """A job's `outputs` (model space) -> what `decode` takes (`to_raw` of the image or
        video at the request's size; a family whose decode also makes the sound takes both)."""
        return self.to_raw(model, latents["samples"], req.height, req.width)

    def comfy_to_raw(self, model: LoadedModel, samples: torch.Tensor):
        """ComfyUI LATENT samples -> raw VAE space (what `decode` takes)."""
        scale, shift = self.scale_shift(model)
        return latent_layout.comfy_to_raw(self.arch, samples, scale, shift)

    def decode_video(self, model: LoadedModel, raw, group=None, control=None, weights=()):
        """A causal 3-D VAE's decode of raw latents [B, C, T, h, w] -> [B, 3, frames, H, W]
        in -1..1 (the VAE's dtype); under a group in row bands over its ranks
        (workers/parallel/vae_parallel.py, collective: the latents are needed on group rank 0 only,
        the frames come back there and None elsewhere; `weights`: the group ranks' shares of
        the bands, workers/parallel/shares.py)."""
        if model.vae is None:
            model.vae = load_vae(model)
        if group is not None:
            from ..parallel.vae_parallel import decode_parallel
            x = None if raw is None else raw.to(model.device, model.vae.dtype)
            return decode_parallel(model.vae, x, group, control=control, weights=weights)
        return model.vae.decode(raw.to(model.device, model.vae.dtype), return_dict=False)[0]

    def decode(self, model: LoadedModel, raw, group=None, control=None, weights=()):
        """Raw-VAE-space latents -> IMAGE [B,H,W,3] in 0..1 (float32, CPU); a video family's
        [B, C, T, h, w] -> its frames [B * F, H, W, 3] (`decode_video`); a family whose decode
        makes its sound too returns Decoded's fields as a dict (images, audio, sample_rate).
        With `group` (and its control-plane twin `control`): patch-parallel decode
        (workers/parallel/vae_parallel.py), collective over the group; the latents are needed on group
        rank 0 only, the image is returned there and None elsewhere."""
        if self.family.latent.video:  # frames of each video in order, as ComfyUI's VAEDecode
            # the weights only where uneven: an adapter's own decode_video may predate them
            vid = self.decode_video(model, raw, group, control,
                                    **({"weights": weights} if weights else {}))
            if vid is None:
                return None
            vid = (vid.float() / 2 + 0.5).clamp(0, 1)  # [B, 3, F, H, W]
            return vid.permute(0, 2, 3, 4, 1).flatten(0, 1).cpu()
        if model.vae is None:
            model.vae = load_vae(model)
        x = None if raw is None else raw.to(model.device, model.vae.dtype)
        if group is not None:
            from ..parallel.vae_parallel import decode_parallel
            img = decode_parallel(model.vae, x, group, control=control, weights=weights)
            if img is None:
                return None
        else:
            img = model.vae.decode(x, return_dict=False)[0]
        return (img.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()

    def job_noise(self, noise, req):
        """The host's noise (model space, the LATENT's shape) -> the loop's (rank 0, before
        the job is broadcast): the same, but where the family denoises more than the LATENT
        holds (MiniMax-H3's sound, drawn from the request's seed)."""
        return noise

    def outputs(self, samples, req) -> dict:
        """The loop's final latents -> the job's Latents fields (`samples`, model space; a
        family with a sound track: the video's and the sound's apart, `audio` too)."""
        if self.family.capability(families.SoundTrack) is None:
            return {"samples": samples}
        video, audio = latent_layout.split_sound(self.arch, samples, req.height, req.width,
                                                 req.frames or 1)
        return {"samples": video, "audio": audio}

    def decode_audio(self, model: LoadedModel, audio):
        """A family with sound: its `outputs` audio latent -> (waveform [B, channels,
        samples] in -1..1, fp32 on the CPU, sample rate); None for a family without."""
        return None

    # per-architecture
    def pack(self, x):  # [B,16,h,w] model-space latent -> what the transformer takes
        return x

    def unpack(self, x, height, width):
        return x

    # ---- a LATENT of several parts (workers/sampling/latent_parts.py; ComfySpec.latent_parts)
    def parts_problem(self, model, shapes) -> str:
        """What is wrong with a MODEL call's parts (their per-row shapes) for this model,
        or ""."""
        return ""

    def pack_parts(self, parts: list):
        """A MODEL call's parts ([rows, ...] each, on the device) -> what `forward` takes."""
        raise NotImplementedError(f"{self.family.name} takes one latent tensor")

    def unpack_parts(self, pred, shapes) -> list:
        """`forward`'s prediction -> the parts ([rows, *shape] each, `shapes` the call's)."""
        raise NotImplementedError(f"{self.family.name} takes one latent tensor")

    def parts_extra(self, model, shapes, inputs: dict) -> dict:
        """The forward inputs of parts of these shapes (`inputs`: the call's scalar model
        inputs, the family's ComfySpec.call_inputs), made once per size on the device."""
        raise NotImplementedError(f"{self.family.name} takes one latent tensor")

    def context_tokens(self, cond: dict) -> dict:
        """The tokens of every stream beside the latent's in a call with this conditioning
        ({stream: count}, PipeFusion's plans): the text stream's, the prompt states'
        length. A family that declares other streams, or counts its text otherwise, says
        so here."""
        streams = self.layout.streams
        extra = [s.name for s in streams.streams if s.role == "context"]
        if extra or streams.text is None:
            raise NotImplementedError(f"{self.family.name} declares the streams "
                                      f"{list(streams.names)}; its adapter counts them")
        return {streams.text.name: int(cond["encoder_hidden_states"].shape[1])}

    def token_grid(self, height: int, width: int, frames: int = 1) -> tuple:
        """(token rows, tokens per row) of a `frames`-frame image: the tokens in order are
        `rows` runs of `cols` (PipeFusion's patches are bands of whole rows)."""
        return height // 16, width // 16

    def latent_rows(self, x, r0: int, r1: int, cols: int):
        """View of token rows r0..r1 (16 pixels each) of a model-space latent as the
        transformer takes it (PipeFusion's patches)."""
        raise NotImplementedError

    def stage_states(self, config) -> tuple:
        """PipeFusion: where the family's blocks take and return several streams by keyword
        (LTX-2's video and sound, each its own width), ((keyword, stream, width), ...) in the
        order the blocks return them: what one stage passes the next. () (the default):
        the blocks pass on [context, latent] or one joined stream."""
        return ()

    def denoised_parts(self, x, rows: int, cols: int) -> tuple:
        """PipeFusion: (the latent stream's part of the loop's latent, or of a prediction of
        its shape, as `latent_rows` reads it; {stream: view [B, tokens, C]} of each other
        stream the model denoises with it, a sound track). A family whose loop latent holds
        only the latent stream: (x, {})."""
        return x, {}

    def timesteps(self, scheduler, steps: int, latents, device):
        raise NotImplementedError

    def job_extra(self, model, req) -> dict:
        """A job's per-size forward inputs (`forward_extra` of its image size); a family whose
        forward reads more of the request (a sound track's length: the frames) says so here."""
        return self.forward_extra(model, req.height, req.width)

    def job_timesteps(self, scheduler, steps: int, latents, device, extra: dict):
        """A job's timesteps (`timesteps`); `extra`: its `job_extra`, for a family whose
        schedule depends on more than the latents' shape tells."""
        return self.timesteps(scheduler, steps, latents, device)

    def initial_latents(self, latents, extra: dict):
        """The loop's first latents from the job's noise (`extra`: this replica's forward
        inputs, its references included): as they are, but where a family's start frame is
        clean tokens of the latent itself (LTX-2's first latent frame)."""
        return latents

    def lora_transformers(self, model) -> tuple:
        """The transformers a LoRA goes into: each of the model's (Wan 2.2's experts), but
        where the family's pipeline loads LoRAs into one of them only."""
        return model.transformers()

    def transformer_for(self, model, extra) -> "object":
        """The transformer a forward with `extra` runs (the step's expert)."""
        return model.transformer

    def experts_per_step(self, model, scheduler, steps: int) -> list:
        """Which of the model's transformers runs each step of a `steps`-step schedule
        (after `timesteps`): 0 for every step but where a family has experts (Wan 2.2)."""
        return [0] * steps

    def encode(self, model, texts, max_sequence_length) -> dict:
        """Prompt texts -> the transformer's text inputs (rank 0 only)."""
        raise NotImplementedError

    def job_cond(self, cond: dict) -> dict:
        """A Sampler job's branch once made (text and start-image states), before the job
        is broadcast: what the family's pipeline does to it once (Wan 2.1 I2V pads the
        text). Not used on the MODEL path, which takes ComfyUI's conditioning as it is."""
        return cond

    def conditioning(self, cond, pooled) -> dict:
        """ComfyUI CONDITIONING tensors -> the transformer's text inputs."""
        raise NotImplementedError

    def raw_text(self, model, context):
        """Text states of the family's second kind (`ComfySpec.raw_context_width`) -> the
        context `conditioning` takes, through the model's own modules for them."""
        raise NotImplementedError(f"{self.arch} takes one kind of text states")

    def forward(self, model, latents, t, cond: dict, guidance, extra=None, jak=None):
        """One transformer call -> the prediction, in the layout of `latents`."""
        raise NotImplementedError

    # ---- guidance (workers/sampling/guidance.py) -------------------------------------------
    def guidance_passes(self, model, req) -> list:
        """A step's forward passes, in order: plain CFG's (uncond, cond; cond alone at cfg
        1). A family whose pipeline runs more declares them here (each pass's `changes` are
        forward inputs its `forward` reads from `extra`)."""
        from ..sampling.guidance import COND, UNCOND
        by_name = {"uncond": UNCOND, "cond": COND}
        return [by_name[n] for n in families.guidance_pass_names(self.family, None, req.cfg)]

    def guide(self, preds: dict, latents, sigma, scale: float, extra: dict, req):
        """The passes' predictions (by pass name) -> the step's prediction: classifier-free
        guidance at `scale` (this step's), rescaled where the family's pipeline rescales."""
        from ..sampling.flow_step import combine
        if "uncond" not in preds:
            return preds["cond"]
        return combine(preds["uncond"], preds["cond"], scale, self.cfg_rescale)

    def reference_methods(self) -> tuple:
        """ComfyUI's reference methods the family takes (first: the default); () for a
        family without reference images."""
        refs = self.family.capability(families.References)
        return () if refs is None else refs.methods

    def reference_inputs(self, model, raws, method, height, width) -> dict:
        """Reference images -> {"tokens", "ids"} (workers/models/flux.py); not for this
        family."""
        raise ValueError(f"reference images are not supported by {self.family.name} models")

    def encode_reference_images(self, model, images, height, width) -> dict:
        """Reference images (PIL, RGB; rank 0) -> {"latents": one ComfyUI LATENT per image,
        what `reference_inputs` takes, "prompt_images": the images the text encoder reads
        with the prompt, or None}: resized, preprocessed and encoded with the folder's own
        VAE exactly as the family's diffusers pipeline prepares its references; not for
        this family."""
        raise ValueError(f"reference images are not supported by {self.family.name} models")

    def start_condition(self, model, req, images, batch: int):
        """Image-to-video (rank 0): the request's start frame (`images`: the reference
        images as PIL, or the GenerationRequest's concat_latent / concat_mask / image_embeds) -> {"references":
        the job's references ({"tokens": the condition, [1 or B, ...] model space, which
        every step joins to the latents}), "cond": what both guidance branches add to their
        conditioning}; None where the job has no start frame (then `images`, if any, are
        references). Not for this family."""
        if req.concat_latent is not None:
            raise ValueError(f"image-to-video inputs (concat_latent) are not supported by "
                             f"{self.family.name} models")
        return None

    def start_frame_inputs(self, req, images, takes_start: bool):
        """The start frame a video job was given, checked alike for every image-to-video
        family: None where the model takes none (and none came), else (height, width,
        frames, the one start image, or None where ComfyUI's concat_latent came instead)."""
        from .. import messages
        name = self.family.name
        given = req.concat_latent is not None
        if not takes_start:
            if given or images:
                raise ValueError(messages.NO_START_IMAGE.format(name=name))
            return None
        if given and images:
            raise ValueError(messages.START_IMAGE_TWICE)
        if not given and not images:
            raise ValueError(messages.NEEDS_START_IMAGE.format(name=name))
        if images and len(images) != 1:
            raise ValueError(f"{name} image-to-video takes one start image (got "
                             f"{len(images)})")
        return (int(req.height), int(req.width), int(req.frames),
                images[0] if images else None)

    def pack_references(self, refs) -> torch.Tensor:
        """Model-space references [b_i, C, (1,) h, w] (a call's, from ComfyUI) -> tokens
        [b, M, C * 4] (a batch-1 reference shared by the others) for the families that pack
        2x2 latent pixels a token. Odd sizes are padded circularly to whole tokens, as
        ComfyUI's models pad them."""
        import torch.nn.functional as F
        toks = []
        for r in refs:
            if r.dim() == 5:  # a one-frame axis
                r = r[:, :, 0]
            ph, pw = r.shape[-2] % 2, r.shape[-1] % 2
            if ph or pw:
                r = F.pad(r, (0, pw, 0, ph), mode="circular")
            toks.append(self.pack(r))
        b = max(t.shape[0] for t in toks)
        return torch.cat([t.expand(b, -1, -1) for t in toks], 1)

    @staticmethod
    def guidance_rows(guidance, rows: int, device):
        """Embedded guidance as the transformer takes it, fp32 [rows] on the device (None
        stays None). A job passes a device scalar made once (workers/sampling/denoise.py), a model call
        one value per row; a plain number is filled on the device, never built on the host
        and copied in per forward (that copy would stall the stream every call)."""
        if guidance is None:
            return None
        if not torch.is_tensor(guidance):
            return torch.full((rows,), float(guidance), device=device, dtype=torch.float32)
        return guidance.to(device, torch.float32).expand(rows)

    @staticmethod
    def slice_cond(cond: dict, sl: slice) -> dict:
        """The conditioning of a batch slice; per-token ids (2-D) are shared by the batch.

        A `text_mask` (rows padded to a common text length, `row_text_mask`) becomes the
        slice's `text_lengths`: its rows' real token counts as host numbers, read here once
        per job (on the CPU, before the job reaches the device), which `attention_kwargs`
        hands to the attention of every forward (no step reads the mask)."""
        out = {}
        for k, v in cond.items():
            if k == TEXT_MASK:
                out[TEXT_LENGTHS] = tuple(int(n) for n in v[sl].sum(1).tolist())
            elif v.dim() >= 2 and k in ("encoder_hidden_states", "pooled_projections"):
                out[k] = v[sl]
            else:
                out[k] = v
        return out

    @staticmethod
    def row_text_mask(keep: torch.Tensor) -> dict:
        """What `encode` adds for rows of different prompt lengths padded to the longest:
        `keep` [B, L] (True for the tokens a row attends to when alone) as the cond's
        `text_mask`; nothing when every row keeps every token. docs/design.md#numerics-rule-6: a row
        must not see its batch mates' padding."""
        keep = keep.bool()
        return {} if bool(keep.all()) else {TEXT_MASK: keep.cpu()}

    @staticmethod
    def attention_kwargs(cond: dict, jak: Optional[dict]) -> Optional[dict]:
        """The attention kwargs of a forward: `jak` plus the rows' real text lengths where
        the rows were padded to a common length (the sharded attention then drops each
        row's padded text keys, workers/parallel/attention.py)."""
        lengths = cond.get(TEXT_LENGTHS)
        if lengths is None:
            return jak
        return dict(jak or {}, text_lengths=lengths)
