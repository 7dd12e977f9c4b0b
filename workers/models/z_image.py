"""Z-Image: unpacked 16-channel latents patchified inside the model, one stream of shared
weights, learned pad tokens, the timestep as 1 - sigma and a negated output.

diffusers' ZImageTransformer2DModel.forward takes lists (one latent and one text per row) and
builds its sequences with Python loops and padded copies, so no hook can split it. The pool
runs the same computation with the transformer's own modules in `split_forward` (installed
as the transformer's forward at load, so the sequence-parallel hooks, the step cache's gates,
weight sharding, LoRA and compile see the usual module tree), on batched tensors:

- image: `x_pad_token` up to a multiple of 32 tokens, then the embedded patches (the pads
  lead, so PipeFusion's first patch of a step computes them, as context like the text);
  RoPE ids (P + 1, row, column) with P the row's padded text length, the pads at (0, 0, 0);
- text: the Qwen3 states embedded, then `cap_pad_token` from each row's real length up to its
  own multiple of 32 (P), then zeros up to the batch's longest P (masked); RoPE (1..P, 0, 0);
- the image refiner (modulated) on the image, the text refiner (not) on the text, then the
  main blocks on [image, text], the final layer on the image.

The learned pads are real tokens (they attend and are attended); only the zeros between a row
and the batch's longest are dropped as keys, by each row's padded text length
(`text_lengths`, host numbers, as Qwen-Image's). Under sequence parallelism both streams are
split once, after padding, and both refiners and the main blocks run on the shards: the
image refiner's attention over the image shards, the text refiner's over the text shards,
the main blocks' over both (attention does not depend on the order of its keys, so the
local [image, text] order is exact). The final layer's output is gathered. Where the rows'
padded text lengths differ, the text refiner runs on the whole text on every rank instead
and the text is split after it (see split_forward). PipeFusion: the refiners and one main
block sit on stage 0 (`check_stages`), so the stages pass on the joined stream.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .. import families
from ..families.z_image import padded
from ..parallel.processors import need_plan
from ..parallel.sequence_parallel import SequenceLayout
from .base import TEXT_LENGTHS, DiTAdapter, text_encoder_device_of
from .flux import dynamic_shift_args, shifted_timesteps

PATCH = "2-1"  # the transformer's embedder / final layer key: patch 2, one frame


@dataclass(frozen=True)
class Attend:
    """What a block's attention covers, passed to the blocks as their attention mask (the
    stock blocks hand it on to the processor untouched): the forward's sequence plan (None:
    this rank holds the whole sequence, attended without collectives), the streams its
    sequence holds in order, and each row's real text length (learned pads included; keys
    past it are masked), None when every row fills the text."""
    plan: object
    streams: tuple
    text_lengths: Optional[tuple] = None


def whole_attention(q, k, v, lengths) -> torch.Tensor:
    """Attention over every token held here ([B, S, H, D]), each row over its first
    `lengths[b]` keys; no collective."""
    import torch.nn.functional as F

    def t(x):
        return x.transpose(1, 2)

    return torch.cat([t(F.scaled_dot_product_attention(t(q[b:b + 1]), t(k[b:b + 1, :n]),
                                                        t(v[b:b + 1, :n])))
                      for b, n in enumerate(lengths)])


class ZImageShardedAttnProcessor:
    """Z-Image's attention (q/k/v projections, per-head RMS norms, complex RoPE, output
    projection) on the local token shard; the attention itself is the method's (every
    rank's keys of the streams its `Attend` names)."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 freqs_cis=None):
        if not isinstance(attention_mask, Attend):
            raise RuntimeError("Z-Image's sharded attention needs the pool's forward "
                               "(workers/models/z_image.split_forward)")
        spec = attention_mask
        q, k, v = (f(hidden_states).unflatten(-1, (attn.heads, -1))
                   for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        if freqs_cis is not None:
            q = apply_rotary_emb(q, freqs_cis, use_real=False)
            k = apply_rotary_emb(k, freqs_cis, use_real=False)
        if spec.plan is None:  # the whole text on this rank (split_forward)
            out = whole_attention(q, k, v, spec.text_lengths)
        else:
            out = self.attention(q, k, v, need_plan(spec.plan), spec.streams, attn,
                                 text_lengths=spec.text_lengths)
        out = attn.to_out[0](out.flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def patchify(x: torch.Tensor, p: int = 2) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/p)(w/p), p*p*C]: tokens row by row, each token's features in
    (row in patch, column in patch, channel) order, as the transformer's embedder reads."""
    b, c, h, w = x.shape
    return x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(
        b, (h // p) * (w // p), p * p * c)


def unpatchify(x: torch.Tensor, h: int, w: int, p: int = 2) -> torch.Tensor:
    """Inverse of `patchify` for a latent of h x w pixels."""
    b, _, f = x.shape
    c = f // (p * p)
    return x.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)


def _grid_ids(rows: int, cols: int, first: int, device) -> torch.Tensor:
    """RoPE ids (first, row, column) of a rows x cols token grid, row by row."""
    r = torch.arange(rows, device=device, dtype=torch.int32).repeat_interleave(cols)
    c = torch.arange(cols, device=device, dtype=torch.int32).repeat(rows)
    return torch.stack([torch.full_like(r, first), r, c], 1)


def _text_ids(n: int, device) -> torch.Tensor:
    """RoPE ids (1..n, 0, 0) of n text tokens."""
    ids = torch.zeros(n, 3, device=device, dtype=torch.int32)
    ids[:, 0] = torch.arange(1, n + 1, device=device, dtype=torch.int32)
    return ids


def _with_pads(x: torch.Tensor, real: int, total: int, pad) -> torch.Tensor:
    """x [n >= real, dim] -> [total, dim]: its first `real` tokens, then the learned `pad`
    up to `total`."""
    return torch.cat([x[:real], pad.to(x.dtype).expand(total - real, -1)])


def split_forward(self, hidden_states, timestep, encoder_hidden_states, text_lengths=None,
                  joint_attention_kwargs=None, return_dict=False):
    """The Z-Image transformer on batched tensors (module doc), bound as the transformer's
    forward. hidden_states [B, C, h, w], timestep [B] (1 - sigma), encoder_hidden_states
    [B, L, D] (rows padded to the longest), text_lengths: each row's real text tokens (host
    numbers; None: every row fills L). Returns ([B, C, h, w],): the model's output, which
    ZImagePipeline negates."""
    jak = joint_attention_kwargs or {}
    plan = jak.get("sp_plan")
    b, _, h, w = hidden_states.shape
    dev, dtype = hidden_states.device, hidden_states.dtype
    rows, cols = h // 2, w // 2
    n = rows * cols
    n_pad, length = padded(n), encoder_hidden_states.shape[1]
    real = tuple(int(v) for v in text_lengths) if text_lengths is not None else (length,) * b
    row_text = tuple(padded(v) for v in real)  # each row's text with its learned pads
    text = padded(length)
    limits = [int(v) for v in self.config.axes_lens]  # RoPE table lengths per axis
    if text + 2 > limits[0] or rows > limits[1] or cols > limits[2]:
        raise ValueError(f"Z-Image's RoPE reaches {limits[0] - 2} text tokens and "
                         f"{limits[1]} x {limits[2]} image tokens; got {text} (padded) and "
                         f"{rows} x {cols}: use a shorter prompt or a smaller image")

    adaln = self.t_embedder(timestep * self.t_scale).type_as(hidden_states)
    # image: the learned pads up to a multiple of 32, then the embedded patches (the pads
    # first, as PipeFusion runs them: context its first patch computes, like the text)
    x = self.all_x_embedder[PATCH](patchify(hidden_states))
    x = torch.cat([self.x_pad_token.to(dtype).expand(b, n_pad - n, -1), x], 1)
    # text: embedded; each row's learned pads up to its own multiple, then zeros (masked)
    cap = self.cap_embedder(encoder_hidden_states)
    cap = torch.stack([torch.cat([_with_pads(cap[i], real[i], row_text[i], self.cap_pad_token),
                                  cap.new_zeros(text - row_text[i], cap.shape[-1])])
                       for i in range(b)])
    # RoPE: text (1..P, 0, 0); image (P + 1, row, column) with the row's own P, pads (0, 0, 0)
    rope = self.rope_embedder
    cap_freqs = rope(_text_ids(text, dev)).unsqueeze(0)
    pad_ids = torch.zeros(n_pad - n, 3, device=dev, dtype=torch.int32)
    by_len = {p: rope(torch.cat([pad_ids, _grid_ids(rows, cols, p + 1, dev)]))
              for p in dict.fromkeys(row_text)}
    x_freqs = torch.stack([by_len[p] for p in row_text]) if len(by_len) > 1 else \
        by_len[row_text[0]].unsqueeze(0)

    lengths = None if all(p == text for p in row_text) else row_text
    # rows of other text lengths under sequence parallelism: the text refiner runs on the
    # whole text on every rank (a text shard may hold only a short row's masked tail, and a
    # ring block without keys has no log-sum-exp to merge), and the text is split after it
    whole_text = lengths is not None and plan is not None and plan.sp_size > 1
    # PipeFusion: a step's later patches carry no text (their attention reads it cached)
    with_text = plan is None or plan.selected("text")[1] > 0
    if plan is not None:  # this rank's tokens of each stream
        x, x_freqs = plan.shard(x, 1, "image"), plan.shard(x_freqs, 1, "image")
        if not whole_text:
            cap, cap_freqs = plan.shard(cap, 1, "text"), plan.shard(cap_freqs, 1, "text")
    # the blocks take the state positionally, the rest by name (PipeFusion's stand-ins for
    # other stages' blocks pass the state through)
    for layer in self.noise_refiner:
        x = layer(x, attn_mask=Attend(plan, ("image",)), freqs_cis=x_freqs, adaln_input=adaln)
    if with_text:
        for layer in self.context_refiner:
            cap = layer(cap, attn_mask=Attend(None if whole_text else plan, ("text",), lengths),
                        freqs_cis=cap_freqs)
    if whole_text:
        cap, cap_freqs = plan.shard(cap, 1, "text"), plan.shard(cap_freqs, 1, "text")
    joint = Attend(plan, ("image", "text"), lengths)
    freqs = torch.cat([x_freqs.expand(b, -1, -1), cap_freqs.expand(b, -1, -1)], 1)
    local = x.shape[1]
    x = torch.cat([x, cap], 1)
    for layer in self.layers:
        x = layer(x, attn_mask=joint, freqs_cis=freqs, adaln_input=adaln)
    out = self.all_final_layer[PATCH](x[:, :local], c=adaln)  # gathered by the layout
    return (unpatchify(out[:, n_pad - n:], h, w),)


def check_stages(cfg: dict, info) -> None:
    """PipeFusion: the refiners and at least one main block run on the first stage (the
    refiners take the image and the text apart; the stages pass the joined stream on)."""
    refiners = 2 * int(cfg["n_refiner_layers"])
    if info is not None and info.ranges[0][1] <= refiners:
        raise ValueError(f"PipeFusion: Z-Image's {refiners} refiner blocks and at least one "
                         f"main block run on the first stage; this split gives it "
                         f"{info.ranges[0][1]} blocks: use a split whose first count is > "
                         f"{refiners} (pipefusion_split), or fewer stages")


def _token_counts(transformer, kw):
    """The text's and the image's tokens of a call, each padded to the learned-pad multiple."""
    h, w = kw["hidden_states"].shape[-2:]
    return {"text": padded(kw["encoder_hidden_states"].shape[1]),
            "image": padded((h // 2) * (w // 2))}


class ZImageAdapter(DiTAdapter):
    family = families.FAMILIES["z_image"]
    lora_formats = "diffusers/PEFT or ComfyUI (diffusion_model.)"
    layout = SequenceLayout(
        split_inputs={},  # split_forward shards both streams itself, once padded
        split_outputs={},
        gather_output=(f"all_final_layer.{PATCH}", 1),
        token_counts=_token_counts,
        streams=families.FAMILIES["z_image"].tokens,
        attention_processor=ZImageShardedAttnProcessor,
        replaces=("ZSingleStreamAttnProcessor",),
    )

    def assemble(self, path, transformer, report, device, dtype, with_text_encoders,
                 text_encoders="auto", stage_info=None):
        """The transformer's forward becomes `split_forward`; a variant the pool does not
        run, or a PipeFusion split through the refiners, is refused."""
        family = self.family
        cfg = family.full_config(transformer.config)
        family.detection.check_config(cfg)
        check_stages(cfg, stage_info)
        transformer.forward = types.MethodType(split_forward, transformer)
        return super().assemble(path, transformer, report, device, dtype, with_text_encoders,
                                text_encoders, stage_info)

    def context_tokens(self, cond: dict) -> dict:
        """The text with its learned pads (PipeFusion's plans)."""
        return {"text": padded(cond["encoder_hidden_states"].shape[1])}

    def latent_rows(self, x, r0, r1, cols):  # [B, 16, h, w], 2x2 latent pixels per token
        return x.narrow(2, 2 * r0, 2 * (r1 - r0))

    def timesteps(self, scheduler, steps, latents, device):
        """ZImagePipeline's: linear sigmas 1 .. 1/steps through the scheduler's shift (mu
        by the image tokens, used only with dynamic shifting)."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift
        h, w = latents.shape[-2:]
        mu = calculate_shift((h // 2) * (w // 2), *dynamic_shift_args(scheduler.config))
        return shifted_timesteps(scheduler, steps, mu, device)

    def encode(self, model, texts, max_sequence_length):
        """ZImagePipeline's prompt states (Qwen3's second-to-last hidden states, each row's
        real tokens only), padded to the longest row; rows of other lengths carry their
        mask (`row_text_mask`)."""
        states = model.encoder.encode_prompt(
            prompt=list(texts), device=text_encoder_device_of(model),
            do_classifier_free_guidance=False, max_sequence_length=max_sequence_length)[0]
        longest = max(s.shape[0] for s in states)
        out = torch.zeros(len(states), longest, states[0].shape[-1], dtype=states[0].dtype,
                          device=states[0].device)
        keep = torch.zeros(len(states), longest, dtype=torch.bool)
        for i, s in enumerate(states):
            out[i, :s.shape[0]] = s
            keep[i, :s.shape[0]] = True
        return {"encoder_hidden_states": out, **self.row_text_mask(keep)}

    def conditioning(self, cond, pooled):
        # ComfyUI's Z-Image CONDITIONING: Qwen3's states of one prompt, unpadded
        return {"encoder_hidden_states": cond}

    def forward(self, model, latents, t, cond, guidance, extra=None, jak=None):
        """The model takes 1 - sigma (t is sigma x 1000) and predicts the negated
        velocity."""
        b = latents.shape[0]
        out = model.transformer(
            hidden_states=latents, timestep=(1000 - t.expand(b).to(latents.dtype)) / 1000,
            encoder_hidden_states=cond["encoder_hidden_states"],
            text_lengths=cond.get(TEXT_LENGTHS), joint_attention_kwargs=jak,
            return_dict=False)[0]
        return -out

    def forward_extra(self, model, height, width):
        return {}

    @staticmethod
    def bfl_to_diffusers(sd, config):
        """ComfyUI's names (comfy/ldm/lumina NextDiT) -> diffusers': the fused q/k/v split
        in three along rows, the rest renamed."""
        dim = int(config["dim"])
        out = {}
        for k, v in sd.items():
            if k.endswith(".attention.qkv.weight"):
                base = k[: -len("qkv.weight")]
                for i, part in enumerate(("to_q", "to_k", "to_v")):
                    out[f"{base}{part}.weight"] = v[i * dim:(i + 1) * dim]
                continue
            out[_RENAMES.get(k, None) or _rename_block(k)] = v
        return out


_RENAMES = {"x_embedder.weight": f"all_x_embedder.{PATCH}.weight",
            "x_embedder.bias": f"all_x_embedder.{PATCH}.bias",
            "final_layer.linear.weight": f"all_final_layer.{PATCH}.linear.weight",
            "final_layer.linear.bias": f"all_final_layer.{PATCH}.linear.bias",
            "final_layer.adaLN_modulation.1.weight":
                f"all_final_layer.{PATCH}.adaLN_modulation.1.weight",
            "final_layer.adaLN_modulation.1.bias":
                f"all_final_layer.{PATCH}.adaLN_modulation.1.bias"}
_BLOCK_RENAMES = {".attention.q_norm.": ".attention.norm_q.",
                  ".attention.k_norm.": ".attention.norm_k.",
                  ".attention.out.": ".attention.to_out.0."}


def _rename_block(name: str) -> str:
    for a, b in _BLOCK_RENAMES.items():
        if a in name:
            return name.replace(a, b)
    return name
