"""Wan 2.1 / 2.2 (WanTransformer3DModel): video latents [B, 16, T, h, w] the transformer
patchifies itself (3-D patches (1, 2, 2): tokens in frame, row, column order), UMT5 text
states reached by cross-attention only, UniPC flow steps on fp32 latents (as WanPipeline keeps
them), and for Wan 2.2 A14B two experts: the high-noise transformer for timesteps at or above
the folder's boundary (boundary_ratio x 1000), the low-noise `transformer_2` below it, each
with its own guidance scale (`cfg`, `cfg_2`).

Sequence parallelism splits the video tokens: the 3-D patch convolution's output (flattened
to tokens) and the RoPE tables with them; the self-attention runs through the method's
attention, the cross-attention stays local (every rank holds the whole text). Wan's blocks
call their attention without keyword arguments, so the plan reaches the processors by a hook
(`SequenceLayout.plan_by_hook`).
"""
from __future__ import annotations

import json
import os

import torch

from .. import families
from ..processors import WanShardedAttnProcessor
from ..sequence_parallel import SequenceLayout
from .base import DiTAdapter, text_encoder_device_of


def _token_counts(transformer, kw):
    _, _, f, h, w = kw["hidden_states"].shape
    pt, ph, pw = transformer.config.patch_size
    return 0, (f // pt) * (h // ph) * (w // pw)


def read_index(path: str) -> dict:
    """A folder's model_index.json (a single file: {})."""
    p = os.path.join(path, "model_index.json")
    if not os.path.isfile(p):
        return {}
    with open(p) as f:
        return json.load(f)


EXPAND_TIMESTEPS = ("this Wan folder sets expand_timesteps (Wan 2.2 TI2V-5B: per-token "
                    "timesteps and the 48-channel Wan 2.2 VAE), which the pool does not run; "
                    "Wan 2.1 and 2.2 A14B folders run")


class WanAdapter(DiTAdapter):
    family = families.FAMILIES["wan"]
    bfl_blocks = {"blocks": "blocks"}
    latents_fp32 = True
    layout = SequenceLayout(
        split_inputs={},
        split_outputs={"patch_embedding": ("image", 2, "flatten"),
                       "rope": (("image", 1), ("image", 1))},
        gather_output=("proj_out", 1),
        token_counts=_token_counts,
        attention_processor=WanShardedAttnProcessor,
        replaces=("WanAttnProcessor",),
        kwargs_name="attention_kwargs",
        plan_by_hook=True,
    )

    def load(self, path, device, dtype, with_text_encoders, stage=None, weights="auto",
             text_encoders="auto", shard=None):
        index = read_index(path) if os.path.isdir(path) else {}
        if index.get("expand_timesteps"):
            raise ValueError(EXPAND_TIMESTEPS)
        model = super().load(path, device, dtype, with_text_encoders, stage=stage,
                             weights=weights, text_encoders=text_encoders, shard=shard)
        model.index = index
        if index.get("transformer_2") and index["transformer_2"][0] is not None:
            if stage is not None or shard is not None:
                raise ValueError("PipeFusion and weight sharding do not run Wan 2.2's two "
                                 "experts yet; use Ulysses, Ring, CFG or data parallel")
            model.transformer_2 = self.load_expert(path, "transformer_2", device, dtype, weights)
        return model

    def load_expert(self, path, subfolder, device, dtype, weights):
        """Another transformer of the folder (Wan 2.2's low-noise expert), loaded as the
        first one is: from its config on the meta device, tensor by tensor to `device`."""
        import diffusers

        from ..weights import has_safetensors, load_folder
        from .base import meta_transformer
        tcls = getattr(diffusers, self.transformer_class)
        folder = os.path.join(path, subfolder)
        if not has_safetensors(folder):
            tr = tcls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
            return tr.to(device).eval().requires_grad_(False)
        tr = meta_transformer(tcls, folder)
        load_folder(tr, self.block_lists, folder, device, dtype, weights)
        tr.rope.to(device)
        return tr

    @staticmethod
    def computed_buffers(transformer) -> None:
        """WanRotaryPosEmbed's cos / sin tables (non-persistent buffers, in no checkpoint):
        a meta-built model's rope module made again on the CPU as __init__ makes it (fp32;
        `assemble` moves it to the device)."""
        rope = transformer.rope
        if rope.freqs_cos.device.type == "meta":
            with torch.device("cpu"):
                transformer.rope = type(rope)(rope.attention_head_dim, rope.patch_size,
                                              rope.max_seq_len)

    def assemble(self, path, transformer, report, device, dtype, *args, **kw):
        transformer.rope.to(device)  # once, not per forward
        return super().assemble(path, transformer, report, device, dtype, *args, **kw)

    def pack(self, x):
        return x

    def unpack(self, x, height, width):
        return x

    def timesteps(self, scheduler, steps, latents, device):
        # set on the CPU (its timesteps stay there: the expert choice reads them, no device
        # read), then the copy the loop uses goes to the device
        scheduler.set_timesteps(steps)
        return scheduler.timesteps.to(device)

    def experts_per_step(self, model, scheduler, steps):
        if model.transformer_2 is None:
            return [0] * steps
        ratio = (model.index or {}).get("boundary_ratio")
        if ratio is None:
            raise ValueError("this Wan folder has a transformer_2 but no boundary_ratio in "
                             "model_index.json (which step switches experts)")
        boundary = float(ratio) * int(scheduler.config.num_train_timesteps)
        return [0 if float(t) >= boundary else 1 for t in scheduler.timesteps.tolist()]

    def encode(self, model, texts, max_sequence_length):
        pe, _ = model.encoder.encode_prompt(
            prompt=list(texts), do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=max_sequence_length, device=text_encoder_device_of(model))
        return {"encoder_hidden_states": pe}

    def conditioning(self, cond, pooled):
        return {"encoder_hidden_states": cond}

    def forward_extra(self, model, height, width):
        return {}

    def transformer_for(self, model, extra):
        return model.transformer_2 if (extra or {}).get("expert") == 1 else model.transformer

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        tr = self.transformer_for(model, extra)
        b = latents.shape[0]
        return tr(hidden_states=latents.to(model.dtype), timestep=t.expand(b),
                  encoder_hidden_states=cond["encoder_hidden_states"],
                  encoder_hidden_states_image=cond.get("image_embeds"),
                  attention_kwargs=dict(jak or {}), return_dict=False)[0]

    def decode(self, model, raw, group=None, control=None):
        """Raw latents [B, 16, T, h, w] -> the frames as an IMAGE batch [B * F, H, W, 3]
        (each video's frames in order, as ComfyUI's VAEDecode gives a video)."""
        from .base import load_vae
        if model.vae is None:
            model.vae = load_vae(model)
        if group is not None:
            from ..vae_parallel import decode_parallel
            x = None if raw is None else raw.to(model.device, model.vae.dtype)
            vid = decode_parallel(model.vae, x, group, control=control)
            if vid is None:
                return None
        else:
            vid = model.vae.decode(raw.to(model.device, model.vae.dtype), return_dict=False)[0]
        vid = (vid.float() / 2 + 0.5).clamp(0, 1)  # [B, 3, F, H, W]
        return vid.permute(0, 2, 3, 4, 1).flatten(0, 1).cpu()

    @staticmethod
    def bfl_to_diffusers(sd, config):
        raise NotImplementedError("Wan single files in ComfyUI naming: not yet")
