"""Chroma: FLUX.1's blocks, packing, RoPE ids and schedule; T5 text only, no pooled text, no
guidance input, true CFG.

Text and its mask. ChromaPipeline pads T5's input to max_sequence_length, runs T5 with the
tokenizer's mask, and gives the transformer a text mask meant to keep the prompt's tokens
(EOS included) and the first padding token and to drop the rest. In diffusers 0.42.1 that
mask is a float 0/1 tensor which the blocks turn into a [B,1,S,S] float tensor and SDPA
*adds* to the logits, so nothing is masked (a known bug: diffusers issues #11724, #12116,
#13619). We do not reproduce the bug, and we pass no mask at all (the sharded attention takes
none): we follow the intended mask by dropping the masked tokens. `encode` keeps the first
`longest real length + 1` text tokens of a branch's prompts (prompt tokens + EOS + one pad,
for the longest prompt of the job; T5's states of the kept tokens do not depend on how far
the input was padded, since T5 ran masked), and a shorter prompt's row carries its own
length (`row_text_mask`, the mechanism Qwen-Image's padded prompts use): the attention drops
that row's further text keys, so each row attends to its own tokens + EOS + one pad, as it
would alone (docs/design.md#numerics-rule-6). ComfyUI's Chroma CONDITIONING
is unpadded already (prompt tokens + EOS, T5 run unmasked) and is used as it comes. Where
the buggy mask is all ones (every prompt and negative prompt of the job has
max_sequence_length - 1 real tokens) the pipeline and the pool compute the same thing
(tests/test_chroma.py).

ComfyUI's Chroma accepts a guidance value (FluxGuidance) that its approximator embeds;
diffusers' embeds 0 always, and so does this adapter (a call's guidance is ignored).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .. import families
from .base import DiTAdapter, text_encoder_device_of
from .flux import FluxAdapter

# BFL / ComfyUI names -> diffusers ChromaTransformer2DModel names: FLUX.1's without the
# modulation layers (time_in, vector_in, guidance_in, *_mod.lin, modulation.lin,
# final_layer.adaLN_modulation), plus the approximator (`distilled_guidance_layer`, whose
# residual MLPs are `in_layer`/`out_layer` in BFL and `linear_1`/`linear_2` in diffusers,
# its RMSNorms `.scale` / `.weight`). The fused double-block qkv and single-block linear1
# (q | k | v | MLP input) are split along dim 0, as FLUX.1's.
_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "final_layer.linear": "proj_out",
    "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
    "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj",
}
def _without_modulation(rules: dict) -> dict:
    """FLUX.1's per-block rename rules less its per-block modulations, which Chroma replaces
    by the one approximator (workers/loading/single_file.py holds FLUX's rules)."""
    return {k: v for k, v in rules.items() if not k.endswith(("_mod.lin", "modulation.lin"))}


def _approximator_names(layers: int) -> dict:
    out = {}
    for j in range(layers):
        a = f"distilled_guidance_layer.layers.{j}."
        out[a + "in_layer"] = a + "linear_1"
        out[a + "out_layer"] = a + "linear_2"
        out[f"distilled_guidance_layer.norms.{j}.scale"] = \
            f"distilled_guidance_layer.norms.{j}.weight"
    return out


def convert_chroma_bfl(sd: dict, config: dict) -> dict:
    """Chroma BFL/ComfyUI keys -> diffusers keys, key by key (a PipeFusion stage reads only
    its blocks); a key without a rule raises."""
    from ..loading.single_file import _FLUX_DOUBLE, _FLUX_SINGLE, _convert_bfl
    top = dict(_TOP, **_approximator_names(int(config["approximator_layers"])))
    hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return _convert_bfl(sd, top, _without_modulation(_FLUX_DOUBLE),
                        _without_modulation(_FLUX_SINGLE), "Chroma", hidden)


def longest_text(mask: torch.Tensor) -> int:
    """How many text tokens a batch keeps: ChromaPipeline's keep-mask ([B, L], 1 for the
    prompt's tokens and the first pad token) summed per row, the longest row."""
    return max(1, int(mask.sum(dim=1).max().item()))


def _approximator_input(emb, zero_guidance, timestep):
    """The approximator's input rows, as diffusers' ChromaCombinedTimestepTextProjEmbeddings
    makes them (timestep and guidance embeddings beside each modulation index's embedding),
    with guidance 0's embedding made once on the device."""
    b, rows = timestep.shape[0], emb.mod_proj.shape[0]
    t = emb.time_proj(timestep).to(timestep.dtype)
    g = zero_guidance.to(timestep.dtype).expand(b, -1)
    mod = emb.mod_proj.to(t.dtype).repeat(b, 1, 1)
    return torch.cat([torch.cat([t, g], dim=1).unsqueeze(1).repeat(1, rows, 1), mod],
                     dim=-1).to(timestep.dtype)


class ChromaAdapter(FluxAdapter):
    family = families.FAMILIES["chroma"]
    lora_alphas = True  # ChromaPipeline loads LoRAs with FLUX's loader (FluxLoraLoaderMixin)
    lora_formats = "diffusers/PEFT"

    def timesteps(self, scheduler, steps, latents, device):
        # ChromaPipeline: linear sigmas always, shifted by FLUX's dynamic mu
        mu = self.schedule_mu(scheduler, latents.shape[1], steps)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=device,
                                mu=mu)
        scheduler.set_begin_index(0)
        return scheduler.timesteps

    def encode(self, model, texts, max_sequence_length):
        pe, ids, mask = model.encoder.encode_prompt(
            prompt=list(texts), device=text_encoder_device_of(model),
            num_images_per_prompt=1, do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)[:3]
        keep = longest_text(mask)
        return {"encoder_hidden_states": pe[:, :keep], "txt_ids": ids[:keep],
                **self.row_text_mask(mask[:, :keep])}

    def conditioning(self, cond, pooled):
        # ComfyUI's Chroma CONDITIONING: unpadded T5 states, no pooled output; text ids zero
        return {"encoder_hidden_states": cond,
                "txt_ids": torch.zeros(cond.shape[1], 3, dtype=cond.dtype)}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        b = latents.shape[0]
        hidden, ids, keep = self.with_references(latents, extra)
        out = model.transformer(
            hidden_states=hidden, timestep=t.expand(b).to(latents.dtype) / 1000,
            encoder_hidden_states=cond["encoder_hidden_states"], txt_ids=cond["txt_ids"],
            img_ids=ids, joint_attention_kwargs=self.attention_kwargs(cond, jak),
            return_dict=False)[0]
        return out if keep is None else out[:, keep]

    reference_inputs = DiTAdapter.reference_inputs  # no reference images

    @staticmethod
    def computed_buffers(transformer) -> None:
        """The modulation-index table (`time_text_embed.mod_proj`, a non-persistent buffer
        diffusers computes at init, never in a checkpoint), made again on the CPU for a
        transformer built on the meta device, exactly as __init__ makes it."""
        from diffusers.models.embeddings import get_timestep_embedding
        emb = transformer.time_text_embed
        rows, width = emb.mod_proj.shape
        emb.mod_proj = get_timestep_embedding(torch.arange(rows) * 1000, width,
                                              flip_sin_to_cos=True, downscale_freq_shift=0)

    def assemble(self, path, transformer, report, device, dtype, *args, **kw):
        emb = transformer.time_text_embed
        emb.mod_proj = emb.mod_proj.to(device)  # once, not per forward
        # diffusers embeds guidance 0 from `torch.tensor([0] * batch)` on the host every
        # forward (a host-to-device copy each call): the same embedding made once, on the device
        zero = emb.guidance_proj(torch.zeros(1, device=device))
        emb.forward = functools.partial(_approximator_input, emb, zero)
        return super().assemble(path, transformer, report, device, dtype, *args, **kw)

    @staticmethod
    def bfl_to_diffusers(sd, config):
        return convert_chroma_bfl(sd, config)
