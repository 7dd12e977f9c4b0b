"""Ideogram 4: one packed stream of [text, image] tokens, 3-axis MRoPE, the timestep as
1 - sigma, and asymmetric guidance through a second transformer.

diffusers' Ideogram4Transformer2DModel.forward takes the whole packed sequence with per-token
roles (`indicator`), a segment id per token turned into an [L, L] mask, and masks image and
text contributions by multiplying with 0/1 masks. The pipeline left-pads every prompt to
max_sequence_length in a segment of its own, so the pads never reach a real token. The pool
runs the same computation with the transformer's own modules in `split_forward` (installed as
the forward at load, so the sequence-parallel hooks, the step cache, weight sharding and LoRA
see the usual module tree):

- text: the prompt's own tokens only, rows of a batch right-padded to the longest with each
  row's length carried to the attention (its padded keys dropped), embedded by
  llm_cond_norm / llm_cond_proj plus the text role embedding; RoPE ids (i, i, i);
- image: input_proj of the latent tokens plus the image role embedding; RoPE ids
  65536 + (0, row, column);
- the blocks on [image, text] (the order the pipeline's mask and ids make no difference
  to; the image first, as the step cache measures the latent stream's leading tokens), the
  final layer on the image (gathered by the layout).

The unconditional pass (`guidance_passes`) runs the folder's `unconditional_transformer` on
the image tokens alone, no text, as the pipeline does; guidance mixes g * cond + (1 - g) *
uncond. The pipeline's tokens hold (row in patch, column in patch, channel) per token where
ComfyUI's FLUX.2 LATENT (model space here) holds (channel, row, column): `forward` reorders.
"""
from __future__ import annotations

import math
import os
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import families
from ..families.ideogram4 import IMAGE_POSITION_OFFSET, SCHEDULE
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from ..sampling.guidance import COND, Pass
from .base import TEXT_LENGTHS, text_encoder_device_of
from .flux2 import Flux2Adapter

BRANCH = "branch"  # the forward input naming the guidance branch's transformer
UNCOND_ALONE = Pass("uncond", changes=((BRANCH, "uncond"),))  # no negative prompt: no text
BRANCHES = families.FAMILIES["ideogram4"].capability(families.BranchTransformers)
TEXT_ROLE, IMAGE_ROLE = 0, 1  # rows of embed_image_indicator
STREAMS = families.FAMILIES["ideogram4"].tokens


@dataclass(frozen=True)
class Attend:
    """What a block's attention covers, handed to the blocks as their attention mask (the
    stock blocks pass it on to the processor untouched): the forward's sequence plan, the
    streams its sequence holds in order, each row's real text length (None: every row fills
    the text)."""
    plan: object
    streams: tuple
    text_lengths: Optional[tuple] = None


class Ideogram4ShardedAttnProcessor:
    """Ideogram 4's attention (q/k/v projections, per-head RMS norms, rotate-half MRoPE, the
    output projection) on the local token shard; the attention itself is the method's."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if not isinstance(attention_mask, Attend):
            raise RuntimeError("Ideogram 4's sharded attention needs the pool's forward "
                               "(workers/models/ideogram4.split_forward)")
        spec = attention_mask
        q, k, v = (f(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
                   for f in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        cos, sin = (c.unsqueeze(2) for c in image_rotary_emb)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = self.attention(q, k, v, need_plan(spec.plan), spec.streams, attn,
                             text_lengths=spec.text_lengths)
        return attn.to_out[0](out.flatten(2, 3).to(q.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def image_ids(rows: int, cols: int, device) -> torch.Tensor:
    """RoPE ids of a rows x cols token grid, row by row: 65536 + (0, row, column)."""
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return torch.stack([torch.zeros_like(r), r, c], 1) + IMAGE_POSITION_OFFSET


def split_forward(self, hidden_states, timestep, img_ids, encoder_hidden_states=None,
                  text_lengths=None, joint_attention_kwargs=None, return_dict=False):
    """The Ideogram 4 transformer on [text, image] (module doc), bound as its forward.
    hidden_states [B, N, C] image tokens in the transformer's channel order, timestep [B]
    (1 - sigma), img_ids [N, 3], encoder_hidden_states [B, L, D] or None (the
    unconditional pass: the image alone), text_lengths each row's real text tokens (host
    numbers; None: every row fills L). Returns ([B, N, C],): the velocity towards the data."""
    plan = (joint_attention_kwargs or {}).get("sp_plan")
    dev, dtype = hidden_states.device, hidden_states.dtype
    roles = self.embed_image_indicator.weight.to(dtype)
    x = self.input_proj(hidden_states) + roles[IMAGE_ROLE]
    t_cond = self.t_embedding(timestep)
    if timestep.dim() == 1:
        t_cond = t_cond.unsqueeze(1)
    adaln = F.silu(self.adaln_proj(t_cond))
    img_pos = img_ids.to(dev).unsqueeze(0)
    texts, positions, streams = [], [], ("image",)
    if encoder_hidden_states is not None:
        n = encoder_hidden_states.shape[1]
        text = self.llm_cond_proj(self.llm_cond_norm(encoder_hidden_states)) + roles[TEXT_ROLE]
        text_pos = torch.arange(n, device=dev).view(1, n, 1).expand(1, n, 3)
        if plan is not None:
            text, text_pos = plan.shard(text, 1, "text"), plan.shard(text_pos, 1, "text")
        texts, positions, streams = [text], [text_pos], ("image", "text")
    if plan is not None:
        x, img_pos = plan.shard(x, 1, "image"), plan.shard(img_pos, 1, "image")
    local_image = x.shape[1]
    h = torch.cat([x] + texts, 1)  # the image first (the step cache measures its tokens)
    cos, sin = self.rotary_emb(torch.cat([img_pos] + positions, 1))
    rotary = (cos.to(dtype), sin.to(dtype))
    lengths = None if text_lengths is None or encoder_hidden_states is None else \
        tuple(int(v) for v in text_lengths)
    if lengths is not None and all(v == encoder_hidden_states.shape[1] for v in lengths):
        lengths = None
    attend = Attend(plan, streams, lengths)
    for layer in self.layers:
        h = layer(h, attention_mask=attend, image_rotary_emb=rotary, adaln_input=adaln)
    return (self.final_layer(h[:, :local_image], conditioning=adaln),)  # gathered by the layout


def _token_counts(transformer, kw):
    text = kw.get("encoder_hidden_states")
    return {"text": 0 if text is None else int(text.shape[1]),
            "image": int(kw["hidden_states"].shape[1])}


def to_ideogram(tokens: torch.Tensor) -> torch.Tensor:
    """FLUX.2's token channels (channel, row, column in patch) -> Ideogram 4's (row, column,
    channel)."""
    b, n, f = tokens.shape
    return tokens.view(b, n, f // 4, 4).transpose(2, 3).reshape(b, n, f)


def from_ideogram(tokens: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_ideogram`."""
    b, n, f = tokens.shape
    return tokens.view(b, n, 4, f // 4).transpose(2, 3).reshape(b, n, f)


class Ideogram4Adapter(Flux2Adapter):
    """FLUX.2's latent space, packing, patch rows and VAE statistics (inherited); Ideogram
    4's own forward, schedule, text and guidance."""
    family = families.FAMILIES["ideogram4"]
    lora_formats = "diffusers/PEFT"
    encoder_skips = ("unconditional_transformer",)  # rank 0's text encoder holds neither
    layout = SequenceLayout(
        split_inputs={},  # split_forward shards both streams itself
        split_outputs={},
        gather_output=("final_layer", 1),
        token_counts=_token_counts,
        streams=STREAMS,
        attention_processor=Ideogram4ShardedAttnProcessor,
        replaces=("Ideogram4AttnProcessor",),
    )

    def check_lora_keys(self, path, keys):
        """diffusers / PEFT names only (no other converter is known for this model)."""

    def load(self, path, device, dtype, with_text_encoders, stage=None, weights="auto",
             text_encoders="auto", shard=None, branch=None):
        """Both transformers: the folder's `transformer` (conditional) and
        `unconditional_transformer`, the second as `transformer_2`. `branch` (a cfg rank
        under CFG parallel): only that branch's transformer, as `transformer`."""
        if branch is not None and branch not in BRANCHES.branches:
            raise ValueError(f"branch {branch!r}: Ideogram 4's are {list(BRANCHES.branches)}")
        self.branch = branch
        if stage is not None:
            raise ValueError("PipeFusion does not run Ideogram 4 yet (each stage would hold "
                             "its blocks of both transformers); use ulysses, ring, cfg or dp")
        if os.path.isfile(str(path)):
            raise ValueError(f"{path}: Ideogram 4 runs from a diffusers folder (its two "
                             f"transformers); a single transformer file is not supported yet")
        subfolders = dict(zip(BRANCHES.branches, BRANCHES.subfolders))
        if branch is not None and subfolders[branch] != "transformer":
            # this rank runs the unconditional pass alone: the conditional transformer is
            # never read (rank 0 still encodes the prompts with the folder's text encoder)
            tr, report = self.load_branch(path, subfolders[branch], device, dtype, weights,
                                          shard)
            return self.assemble(path, tr, dict(report, branch=branch), device, dtype,
                                 with_text_encoders, text_encoders)
        model = super().load(path, device, dtype, with_text_encoders, weights=weights,
                             text_encoders=text_encoders, shard=shard)
        if branch is None:
            model.transformer_2 = self.load_branch(path, subfolders["uncond"], device,
                                                   dtype, weights, shard)[0]
        else:
            model.load_report["branch"] = branch
        return model

    def load_branch(self, path, subfolder, device, dtype, weights, shard):
        """Another transformer of the folder, loaded as the first one is (from its config on
        the meta device, tensor by tensor to `device`; under weight sharding, this rank's
        rows only), its forward the pool's. -> (transformer, its load report)."""
        import diffusers

        from ..loading.meta import meta_transformer
        from ..loading.weights import load_folder
        if shard is not None:
            from ..loading.shards import load_shards
            tr, report = load_shards(self, path, device, dtype, weights, shard,
                                     subfolder=subfolder)
        else:
            folder = os.path.join(path, subfolder)
            tr = meta_transformer(getattr(diffusers, self.transformer_class), folder)
            report = load_folder(tr, self.block_lists, folder, device, dtype, weights)
        tr.rotary_emb.to(device)
        self._pool_forward(tr)
        return tr, (report.as_dict() if hasattr(report, "as_dict") else dict(report or {}))

    @staticmethod
    def computed_buffers(transformer) -> None:
        """The MRoPE's inverse frequencies (a non-persistent buffer) made again on the CPU."""
        rope = transformer.rotary_emb
        with torch.device("cpu"):
            transformer.rotary_emb = type(rope)(rope.head_dim, transformer.config.rope_theta,
                                                rope.mrope_section)

    @staticmethod
    def _pool_forward(transformer) -> None:
        transformer.forward = types.MethodType(split_forward, transformer)

    def assemble(self, path, transformer, report, device, dtype, with_text_encoders,
                 text_encoders="auto", stage_info=None):
        transformer.rotary_emb.to(device)
        self._pool_forward(transformer)
        return super().assemble(path, transformer, report, device, dtype, with_text_encoders,
                                text_encoders, stage_info)

    branch = None  # the one branch this rank holds (CFG parallel), None: both

    def lora_transformers(self, model) -> tuple:
        """The conditional transformer alone, as Ideogram4Pipeline's LoRA loader (none on
        a rank that holds the unconditional one only)."""
        return () if self.branch == "uncond" else (model.transformer,)

    def transformer_for(self, model, extra):
        want = (extra or {}).get(BRANCH) or "cond"
        if self.branch is None:
            return model.transformer_2 if want == "uncond" else model.transformer
        if want != self.branch:
            raise ValueError(f"this rank holds only the {self.branch} branch's transformer "
                             f"(CFG parallel loads one per cfg rank); a {want} pass cannot "
                             f"run here: use cfg > 1 with cfg parallel")
        return model.transformer

    def guidance_passes(self, model, req) -> list:
        """The unconditional pass reads no prompt: the second transformer, image only."""
        return [UNCOND_ALONE, COND] if float(req.cfg) > 1.0 else [COND]

    def timesteps(self, scheduler, steps, latents, device):
        """Ideogram4Pipeline's logit-normal sigmas, the mean shifted by the image's pixels
        (16 x 16 a token)."""
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas
        pixels = int(latents.shape[1]) * 256
        mu = SCHEDULE["mu"] + 0.5 * math.log(pixels / SCHEDULE["base_pixels"])
        sigmas = _logit_normal_sigmas(steps, mu, std=SCHEDULE["std"])
        scheduler.set_timesteps(sigmas=sigmas.tolist(), device=device)
        scheduler.set_begin_index(0)
        return scheduler.timesteps

    def encode(self, model, texts, max_sequence_length):
        """Ideogram4Pipeline's prompt states (13 Qwen3-VL layers side by side), each row its
        own tokens only (the pipeline's left pads sit in a segment of their own, so no real
        token sees them), right-padded to the longest row with its mask."""
        enc = model.encoder
        states, _, _, indicator = enc.encode_prompt(
            prompt=list(texts), grid_h=1, grid_w=1, max_sequence_length=max_sequence_length,
            device=text_encoder_device_of(model))
        from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR
        real = (indicator[:, :max_sequence_length] == LLM_TOKEN_INDICATOR).sum(1).tolist()
        longest = max(real)
        out = states.new_zeros(len(real), longest, states.shape[-1])
        keep = torch.zeros(len(real), longest, dtype=torch.bool)
        for i, n in enumerate(real):
            out[i, :n] = states[i, max_sequence_length - n:max_sequence_length]
            keep[i, :n] = True
        return {"encoder_hidden_states": out, **self.row_text_mask(keep)}

    def conditioning(self, cond, pooled):
        return {"encoder_hidden_states": cond}

    def forward_extra(self, model, height, width):
        return {"img_ids": image_ids(height // 16, width // 16, model.device)}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        """The model takes 1 - sigma (t is sigma x 1000) and predicts the velocity towards
        the data; the loop's is its negation."""
        extra = extra or {}
        tr = self.transformer_for(model, extra)
        b = latents.shape[0]
        uncond = extra.get(BRANCH) == "uncond"
        out = tr(hidden_states=to_ideogram(latents),
                 timestep=(1.0 - t.expand(b).float() / 1000).to(model.dtype),
                 img_ids=extra["img_ids"],
                 encoder_hidden_states=None if uncond else cond["encoder_hidden_states"],
                 text_lengths=None if uncond else cond.get(TEXT_LENGTHS),
                 joint_attention_kwargs=jak, return_dict=False)[0]
        return -from_ideogram(out)

    @staticmethod
    def bfl_to_diffusers(sd, config):
        raise ValueError("Ideogram 4 single files are not supported yet")

