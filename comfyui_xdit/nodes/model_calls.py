"""The denoiser behind the xDiT MODEL, without importing ComfyUI (tested in CI).

ComfyUI's samplers call a MODEL's diffusion model as `(x, timestep, context, y, guidance,
control, transformer_options, ...)`, with the conditional and unconditional rows of a step
side by side in one batch. `PoolDenoiser` turns each such call into one pool request
(workers/sampling/model_call.py) and returns what ComfyUI's own model of the family would return:

* x: model-space latents [N, 16, h, w] (ComfyUI has already applied the latent format);
  families with a frame axis get [N, 16, T, h, w]: an image family's one frame (Qwen-Image)
  is dropped for the pool and put back on the prediction, a video family's frames (Wan) go
  to the pool as they are;
  FLUX.2 (ComfyUI's newer FLUX.2 model): the normalised latent 2x2-patchified, [N, 128,
  H/16, W/16], or unpatchified [N, 32, H/8, W/8]; the pool takes the unpatchified one
  (its packing is the same pixel-unshuffle order), so a patchified x is reshaped there and
  the prediction back;
* timestep: FLUX / FLUX.2 get sigma, SD3 sigma * 1000 (ComfyUI's model sampling); the pool
  speaks the diffusers pipelines' sigma * 1000 for all;
* reference latents (`ref_latents`, from ComfyUI's ReferenceLatent node, in x's space) and
  `ref_latents_method` go to the pool with their conditioning (FLUX.1 Kontext, FLUX.2,
  Qwen-Image-Edit: its one-frame references lose the frame axis as x does);
* Wan 2.1 I2V's CLIP vision states (`clip_fea` [N, tokens, 1280], WanImageToVideo's
  clip_vision_output) go with their conditioning as the transformer's
  `encoder_hidden_states_image` (the workers pad the text to the 512 tokens diffusers' Wan
  image cross-attention reads, as ComfyUI's UMT5 encoder pads it);
* a family's second text states (its `SecondTextEncoder`: HunyuanVideo 1.5's ByT5 glyph states,
  `txt_byt5`) go with their conditioning as `context_2`;
* a LATENT of several tensors (a family's `ComfySpec.latent_parts`: ComfyUI's nested
  LATENT, e.g. LTX-2's video and sound): x is ComfyUI's list of the parts and timestep one
  per part; they go to the pool as one tensor
  (workers/sampling/latent_parts.py) and the prediction comes back as the list;
  the family's scalar model inputs (`ComfySpec.call_inputs`: LTX-2's frame_rate; those
  inside a structured input, `read_inputs`, which the MODEL reads once per conditioning
  and passes as `xdit_inputs`; those in transformer_options, `option_inputs`) go with
  every call;
* a family whose text length moves its positions (`ComfySpec.ragged_text`: MiniMax-H3)
  gets its conditionings of other lengths in one call, padded to the longest, each row's
  real length in `xdit_text_lengths` (comfy_model.py): each chunk's text goes to the pool
  at its own length, so cond and uncond share a call (and CFG parallel's ranks a pair);
* a timestep per token (a noise mask on the LATENT: an image-to-video node's start frame
  at timestep 0) for a family whose ComfyUI model takes one (its `TokenTimesteps`):
  nodes/token_timesteps.py answers the model class's patchifier calls and sends the pool
  one timestep per token, the parts' tokens end to end; other families refuse it;
* the output: the flow (velocity) prediction in x's layout.

A conditioning crosses to the pool once per sampling run: ComfyUI names the conditioning of
each chunk of rows in `transformer_options["uuids"]` (fresh for every sampling run), so a
chunk's key is its uuid, row count and token count; without uuids (a caller outside
ComfyUI's samplers) the key is a hash of the tensors. Anything the pool cannot honour
(ControlNet, attention patches, attention masks) is refused with a clear message.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Callable, Optional

from comfyui_xdit.planning.config import ConfigError, ParallelConfig
from comfyui_xdit.bridge import conditioning, families, latent_parts
from comfyui_xdit.nodes import comfy_loras, token_timesteps

Conditioning = conditioning.Conditioning  # what the pool takes

# the MODEL's own model inputs (comfy_model.py): the family's scalar inputs read once per
# conditioning (`ComfySpec.read_inputs`), each row's real text length (`ragged_text`)
INPUTS, LENGTHS = "xdit_inputs", "xdit_text_lengths"
# inputs a diffusion model call may carry that we pass on or check
_KNOWN = {"y", "guidance", "control", "transformer_options", "attention_mask", "ref_latents",
          "ref_latents_method", "clip_fea", INPUTS, LENGTHS}


class PoolDenoiser:
    """Callable with ComfyUI's diffusion-model signature; one pool request per call."""

    def __init__(self, pool, config: ParallelConfig, arch: str, cache_size: int = 16,
                 on_event: Optional[Callable[[dict], None]] = None):
        """`pool`: a WorkerPool, or a function returning the current one (the nodes' pool
        registry may replace a pool between calls; the denoiser then follows it).
        `on_event`: the calls' events (compiling, on a `compile` pool's first calls)."""
        if config.pipefusion > 1:
            raise ConfigError("PipeFusion pipelines patches across denoising steps, so it "
                              "cannot serve KSampler & co. one step at a time; use Sampler "
                              "(xDiT) for PipeFusion, or disconnect PipeFusion settings (xDiT) "
                              "from the loader for the xDiT MODEL")
        self._pool = pool
        self.config = config
        self.arch = arch
        self.family = families.family(arch)
        # the keyword ComfyUI's model passes a second text encoder's states under (None: none)
        second = self.family.capability(families.SecondTextEncoder)
        self._text_2 = None if second is None else second.comfy_input
        self.cache_size = cache_size
        self.on_event = on_event
        self._known: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._launches = None
        self.calls = 0
        self.conds_sent = 0
        self.last_stats: dict = {}
        self.timed = False  # benchmarks: each call's stats carry its phases' timings
        self.cache: Optional[dict] = None  # step cache settings (GenerationRequest.cache)
        self.cache_counts = {"computed": 0, "skipped": 0}  # rank 0's rows, every call
        self.run_counts = {"computed": 0, "skipped": 0}  # the same, this sampling run
        self._run_keys: frozenset = frozenset()
        self.expert = 0  # which transformer of a model of several (Wan 2.2 A14B) runs
        # ComfyUI's LoRA loaders (comfy_loras.py): rows of the model's weights a patch may
        # cover only part of ({layer: rows}), set by the MODEL
        self.lora_rows: dict = {}
        self.lora_parts: dict = {}  # {layer: [(pool layer, first row, rows)]} (comfy_loras)
        self.lora_expert = None  # "high" | "low": a model of two experts' transformer
        # model inputs that are a property of ComfyUI's own model class (the family's
        # ComfySpec.model_inputs, set by the MODEL): sent with every call
        self.model_inputs: dict = {}

    @property
    def pool(self):
        return self._pool() if callable(self._pool) else self._pool

    # ---- ComfyUI's call ---------------------------------------------------------------
    def __call__(self, x, timestep, context=None, y=None, guidance=None, control=None,
                 transformer_options=None, **kwargs):
        import torch

        # the family's scalar model inputs (ComfyUI's defaults where the call has none)
        inputs = dict(self.model_inputs)  # the ComfyUI model class's own (build_model's)
        for name, default in self.family.comfy.call_inputs:
            value = kwargs.pop(name, None)
            inputs[name] = float(default if value is None else value)
        for name, key, default in self.family.comfy.option_inputs:
            value = (transformer_options or {}).get(key)
            inputs[name] = float(default if value is None else value)
        if kwargs.get(INPUTS) is not None:  # the MODEL's: read once per conditioning
            inputs.update(kwargs[INPUTS])
        elif self.family.comfy.read_inputs is not None:  # a caller outside the MODEL class
            inputs.update(self.read_inputs(kwargs))
        self._refuse(control, transformer_options or {}, kwargs)
        lengths = kwargs.get(LENGTHS)
        if self.family.comfy.latent_parts or isinstance(x, (list, tuple)):
            return self._call_parts(x, timestep, context, y, transformer_options, inputs,
                                    lengths)
        # an image family with a frame axis (Qwen-Image): the pool takes [N,C,h,w]; a video
        # family's (Wan) frames stay
        framed = self.family.latent.frames and x.dim() == 5 and not self.family.latent.video
        if framed:
            if x.shape[2] != 1:
                raise ConfigError(f"the {self.family.name} xDiT MODEL takes one frame "
                                  f"(got latents {tuple(x.shape)})")
            x = x[:, :, 0]
        self._need_text(context, y)
        n = int(x.shape[0])
        t = self._timesteps(timestep, n, tuple(int(d) for d in x.shape[1:]))
        g = None
        if guidance is not None:
            g = guidance.reshape(-1).float().cpu()
            g = g.expand(n) if g.numel() == 1 else g
        patchified = self._patchified(x)
        clip = kwargs.get("clip_fea")
        refs = kwargs.get("ref_latents")
        if refs is not None:
            if framed:  # one-frame references [N, C, 1, h, w] (Qwen-Image-Edit) like x
                refs = [r[:, :, 0] if r.dim() == 5 and r.shape[2] == 1 else r for r in refs]
            refs = [self._to_pool_layout(r, patchified) for r in refs]
        text_2 = kwargs.get(self._text_2) if self._text_2 else None
        chunks, conds = self._chunks(context, y, (transformer_options or {}).get("uuids"), n,
                                     refs, kwargs.get("ref_latents_method"), clip, text_2)
        out = self._request(self._to_pool_layout(x, patchified), t, g, chunks, conds,
                            transformer_options)
        if patchified:
            out = torch.nn.functional.pixel_unshuffle(out, 2)
        if framed:
            out = out.unsqueeze(2)
        return out.to(x.device, x.dtype)

    def read_inputs(self, conds: dict) -> dict:
        """The family's scalar inputs from ComfyUI's model inputs (`ComfySpec.read_inputs`,
        which pops the structured input it reads), or one line saying what the pool cannot
        honour."""
        try:
            return self.family.comfy.read_inputs(conds)
        except ValueError as e:
            raise ConfigError(f"the {self.family.name} xDiT MODEL: {e}") from None

    def _call_parts(self, x, timestep, context, y, transformer_options, inputs, lengths=None):
        """A LATENT of several tensors (the family's `latent_parts`): ComfyUI's list of parts
        in, the list of their predictions out; one timestep per row, whichever part."""
        names = self.family.comfy.latent_parts
        if not isinstance(x, (list, tuple)) or len(x) != len(names):
            got = type(x).__name__ if not isinstance(x, (list, tuple)) else f"{len(x)} parts"
            raise ConfigError(f"the {self.family.name} xDiT MODEL takes ComfyUI's nested "
                              f"LATENT of {len(names)} parts ({', '.join(names)}); got {got}")
        self._need_text(context, y)
        try:
            flat, shapes = latent_parts.flatten(x)
        except ValueError as e:
            raise ConfigError(f"the {self.family.name} xDiT MODEL: {e}") from None
        n = int(flat.shape[0])
        # one per row, or one per token where the family takes it (token_timesteps.py)
        t = token_timesteps.pool_timesteps(self.family, timestep, n, shapes,
                                           self.family.comfy.timestep_scale)
        chunks, conds = self._chunks(context, y, (transformer_options or {}).get("uuids"), n,
                                     lengths=lengths)
        out = self._request(flat, t, None, chunks, conds, transformer_options,
                            parts=shapes, inputs=inputs)
        return [p.to(ref.device, ref.dtype) for p, ref in
                zip(latent_parts.unflatten(out.float(), shapes), x)]

    def _need_text(self, context, y) -> None:
        if context is None or (y is None and self.family.text.pooled):
            raise ConfigError(f"the xDiT MODEL needs text conditioning with a pooled output "
                              f"(CONDITIONING from ComfyUI's {self.family.name} text "
                              f"encoders)")

    def _timesteps(self, timestep, n: int, row=None):
        """ComfyUI's timestep(s) -> one per row on the pool's scale (ComfyUI's FLUX-style
        models take sigma, SD3 sigma * 1000; the pool sigma * 1000), or one per token where
        the family takes it (`row`: a latent row's shape, token_timesteps.py)."""
        if timestep.numel() not in (1, n) and row is not None:
            return token_timesteps.pool_timesteps(self.family, timestep, n, [row],
                                                  self.family.comfy.timestep_scale)
        if timestep.numel() not in (1, n):
            raise token_timesteps.refusal(self.family, f"{timestep.numel()} timesteps for {n} "
                                                       f"rows (a timestep per token)")
        t = timestep.reshape(-1).float().cpu()
        return (t.expand(n) if t.numel() == 1 else t) * self.family.comfy.timestep_scale

    def _request(self, x, t, g, chunks, conds, transformer_options, parts=(), inputs=None):
        """One pool request for pool-layout latents `x`; keeps the known conditionings and
        the step cache's counts."""
        pool = self.pool
        state = (id(pool), pool.launches)
        if self._launches != state:  # another or a relaunched pool holds no conditioning
            self._known.clear()
        loras = comfy_loras.pool_loras(
            (transformer_options or {}).get(comfy_loras.OPTION, ()), self.lora_rows,
            expert=self.lora_expert, parts=self.lora_parts)
        more = {}
        if self.expert:
            more["expert"] = self.expert
        if loras:
            more["loras"] = loras
        if parts:
            more.update(parts=parts, inputs=dict(inputs or {}))
        out, stats, sent = pool.model_call(
            self.config, x, t.contiguous(), g, chunks, conds, known=set(self._known),
            on_event=self.on_event, timed=self.timed, cache=self.cache, **more)
        self._launches = (id(pool), pool.launches)
        self.calls += 1
        self.conds_sent += len(sent)
        for k, _ in chunks:
            self._known[k] = None
            self._known.move_to_end(k)
        while len(self._known) > self.cache_size:  # the workers evict in the same order
            self._known.popitem(last=False)
        self.last_stats = stats
        if stats.get("cache"):
            keys = frozenset(k for k, _ in chunks)
            if keys.isdisjoint(self._run_keys):  # ComfyUI's keys are fresh per sampling run
                self.run_counts = {"computed": 0, "skipped": 0}
                self._run_keys = frozenset()
            self._run_keys |= keys
            for k, v in stats["cache"].items():
                self.cache_counts[k] += v
                self.run_counts[k] += v
            if self.on_event is not None:
                self.on_event({"cache": dict(self.run_counts)})
        return out

    # ---- helpers ------------------------------------------------------------------------
    def _refuse(self, control, options: dict, kwargs: dict) -> None:
        if control is not None:
            raise ConfigError("ControlNet is not supported on the xDiT MODEL; remove the "
                              "ControlNet apply node or use ComfyUI's own model")
        for name in ("patches", "patches_replace"):
            if options.get(name):
                kinds = sorted(options[name])
                raise ConfigError(f"model patches {kinds} cannot run on the xDiT MODEL (its "
                                  f"transformer lives in the worker pool); remove the node "
                                  f"that adds them or use ComfyUI's own model")
        masks = token_timesteps.mask_inputs(self.family)  # carried by the timesteps
        for name in masks:
            kwargs.pop(name, None)
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN
                         and k not in self.family.comfy.unused_inputs
                         and k != self._text_2)
        if "denoise_mask" in unknown:  # ComfyUI's name for the LATENT's noise mask
            raise token_timesteps.refusal(self.family, "a noise mask (denoise_mask)")
        if kwargs.get("attention_mask") is not None:
            raise ConfigError("attention masks are not supported on the xDiT MODEL")
        if kwargs.get("clip_fea") is not None and \
                self.family.capability(families.ImageToVideo) is None:
            raise ConfigError(f"CLIP vision states (clip_fea) are not taken by "
                              f"{self.family.name} models: remove the CLIP vision output from "
                              f"the conditioning")
        refs = kwargs.get("ref_latents")
        if refs is not None and self.family.capability(families.References) is None:
            raise ConfigError(f"reference latents (ReferenceLatent) are not supported by "
                              f"{self.family.name} models: remove the ReferenceLatent node")
        if unknown:
            raise ConfigError(f"the xDiT MODEL cannot honour model inputs {unknown}; remove "
                              f"the node that adds them or use ComfyUI's own model")

    def _patchified(self, x) -> bool:
        """x in a patchified LATENT layout (FLUX.2's 128 channels) rather than the pool's
        unpatchified one (32)."""
        spec = self.family.latent
        if spec.tokens != "flat" or x.dim() != 4:
            return False
        if x.shape[1] == spec.channels:
            return True
        if x.shape[1] != spec.channels // 4:
            raise ConfigError(f"the {self.family.name} xDiT MODEL takes latents "
                              f"[N, {spec.channels}, H/{spec.downscale}, W/{spec.downscale}] or "
                              f"[N, {spec.channels // 4}, H/{spec.downscale // 2}, "
                              f"W/{spec.downscale // 2}] (got {tuple(x.shape)})")
        return False

    @staticmethod
    def _to_pool_layout(x, patchified: bool):
        import torch
        x = x.detach().float().cpu()
        return torch.nn.functional.pixel_shuffle(x, 2) if patchified else x

    def _chunks(self, context, y, uuids, n: int, refs=None, method=None, clip=None,
                text_2=None, lengths=None):
        """[(key, rows)] and {key: Conditioning} for the rows of one call (each reference
        and the CLIP vision states sliced to the chunk's rows, a batch-1 one shared; a second
        text's states, the family's `SecondTextEncoder`, sliced as the context; `lengths`:
        each row's real text length where the context is padded, `ragged_text`)."""
        parts = len(uuids) if uuids else 1
        if n % parts:
            raise ConfigError(f"{n} latent rows cannot be split into {parts} conditionings")
        rows = n // parts
        if context.shape[0] != n or (y is not None and y.shape[0] != n):
            raise ConfigError(f"conditioning has {context.shape[0]} rows for {n} latents")
        if lengths is not None and (len(lengths) != n or any(
                len(set(lengths[i * rows:(i + 1) * rows])) != 1 for i in range(parts))):
            raise ConfigError(f"text lengths {tuple(lengths)} are not one per conditioning "
                              f"of {rows} rows")
        if text_2 is not None and (text_2.dim() != 3 or int(text_2.shape[0]) != n):
            raise ConfigError(f"second text states ({self._text_2}) have shape "
                              f"{tuple(text_2.shape)}; the xDiT MODEL takes [{n}, tokens, "
                              f"width]")
        if clip is not None and (clip.dim() != 3 or int(clip.shape[0]) not in (1, n)):
            raise ConfigError(f"CLIP vision states (clip_fea) have shape {tuple(clip.shape)}; "
                              f"the xDiT MODEL takes [1 or {n}, tokens, width]")
        for r in refs or []:
            if r.dim() != 4 or int(r.shape[0]) not in (1, n):
                raise ConfigError(f"a reference latent has shape {tuple(r.shape)}; the xDiT "
                                  f"MODEL takes [1 or {n}, C, h, w]")
        chunks, conds = [], {}
        for i in range(parts):
            sl = slice(i * rows, (i + 1) * rows)
            ctx = context[sl] if lengths is None else context[sl, :int(lengths[sl.start])]
            pooled = None if y is None else y[sl]
            mine = None if refs is None else \
                [(r if r.shape[0] == 1 else r[sl]).expand(rows, *r.shape[1:]).contiguous()
                 for r in refs]
            image = None if clip is None else \
                (clip if clip.shape[0] == 1 else clip[sl]).expand(rows, *clip.shape[1:])
            ctx_2 = None if text_2 is None else text_2[sl]
            if uuids:  # a conditioning's references are fixed for its sampling run
                key = f"{uuids[i]}:{rows}:{ctx.shape[1]}"
            else:
                key = "h:" + _digest(ctx, *([] if pooled is None else [pooled]),
                                     *(mine or []), str(method),
                                     *([] if image is None else ["clip", image]),
                                     *([] if ctx_2 is None else ["text_2", ctx_2]))
            chunks.append((key, rows))
            conds[key] = Conditioning(
                context=_wire(ctx), pooled=_wire(pooled), context_2=_wire(ctx_2),
                image_embeds=_wire(image), ref_latents=mine,
                ref_method=None if mine is None or method is None else str(method))
        return chunks, conds


def _wire(t):
    """A tensor as the pool takes it: fp32, CPU, contiguous (None stays None)."""
    return None if t is None else t.detach().float().cpu().contiguous()


def _digest(*tensors) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        if isinstance(t, str):
            h.update(t.encode())
            continue
        t = t.detach().float().cpu().contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()
