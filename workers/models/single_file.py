"""Single-file FLUX.1 / SD3 transformers: build the diffusers model from one .safetensors.

The diffusers config comes from the weight shapes (`detect.single_file_config`, the same code
the host uses to validate the file before any worker starts); keys in BFL /
ComfyUI naming are converted to diffusers naming, then the weights are assigned to a model
built on the meta device (no random init, one copy in memory) in the requested dtype. Only
the transformer's tensors are read, so a full checkpoint's VAE and text encoders cost nothing.

A single file has no scheduler, VAE or text encoders: the scheduler config and the VAE's
latent scale/shift are the released models' (models/facts.py), the text comes in as ComfyUI
CONDITIONING, and images are decoded by ComfyUI's VAE.
"""
from __future__ import annotations

import torch

from . import LoadedModel
from .detect import single_file_config
from .facts import CLASS_BY_ARCH, SCHEDULER_DEFAULTS, VAE_LATENT


def defaults_for(arch: str, config: dict) -> tuple[dict, dict]:
    """(scheduler config, VAE latent config) for a single-file model."""
    if arch == "flux":
        sched = SCHEDULER_DEFAULTS["flux-dev" if config.get("guidance_embeds") else "flux-schnell"]
    else:
        sched = SCHEDULER_DEFAULTS["sd3"]
    return dict(sched), dict(VAE_LATENT[arch])


# ---- BFL / ComfyUI naming -> diffusers naming --------------------------------------------
def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """BFL's final modulation is (shift, scale); diffusers' AdaLayerNormContinuous wants
    (scale, shift)."""
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


_FLUX_TOP = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
_FLUX_DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
_FLUX_SINGLE = {
    "modulation.lin": "norm.linear",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
    "linear2": "proj_out",
}


def _rename(name: str, table: dict):
    """'a.b.weight' with 'a.b' in table -> mapped name (suffix kept); None if no rule."""
    for src, dst in table.items():
        if name == src:
            return dst
        if name.startswith(src + "."):
            return dst + name[len(src):]
    return None


def convert_flux_bfl(sd: dict, hidden: int) -> dict:
    """FLUX BFL/ComfyUI keys -> diffusers FluxTransformer2DModel keys. Any key without a
    rule raises (a silently dropped tensor would load as garbage)."""
    out, unknown = {}, []
    for name, w in sd.items():
        parts = name.split(".")
        if name.startswith("final_layer.adaLN_modulation.1."):
            out["norm_out.linear." + parts[-1]] = _swap_halves(w)
        elif parts[0] == "double_blocks":
            i, rest = parts[1], ".".join(parts[2:])
            pre = f"transformer_blocks.{i}."
            if rest in ("img_attn.qkv.weight", "img_attn.qkv.bias", "txt_attn.qkv.weight",
                        "txt_attn.qkv.bias"):
                names = ("to_q", "to_k", "to_v") if rest.startswith("img") else \
                    ("add_q_proj", "add_k_proj", "add_v_proj")
                for n, t in zip(names, w.chunk(3, dim=0)):
                    out[f"{pre}attn.{n}.{parts[-1]}"] = t
            else:
                new = _rename(rest, _FLUX_DOUBLE)
                if new is None:
                    unknown.append(name)
                else:
                    out[pre + new] = w
        elif parts[0] == "single_blocks":
            i, rest = parts[1], ".".join(parts[2:])
            pre = f"single_transformer_blocks.{i}."
            if rest in ("linear1.weight", "linear1.bias"):
                mlp = w.shape[0] - 3 * hidden
                q, k, v, m = w.split([hidden, hidden, hidden, mlp], dim=0)
                for n, t in (("attn.to_q", q), ("attn.to_k", k), ("attn.to_v", v),
                             ("proj_mlp", m)):
                    out[f"{pre}{n}.{parts[-1]}"] = t
            else:
                new = _rename(rest, _FLUX_SINGLE)
                if new is None:
                    unknown.append(name)
                else:
                    out[pre + new] = w
        else:
            new = _rename(name, _FLUX_TOP)
            if new is None:
                unknown.append(name)
            else:
                out[new] = w
    if unknown:
        raise ValueError(f"{len(unknown)} tensor(s) with no FLUX rule, e.g. {unknown[:3]} "
                         f"(scaled-fp8 or other non-standard files are not supported)")
    return out


def convert_sd3_bfl(sd: dict) -> dict:
    """SD3 BFL/ComfyUI (MMDiT) keys -> diffusers SD3Transformer2DModel keys, with diffusers'
    own converter (it derives every size from the tensors)."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    sd = dict(sd)
    out = convert_sd3_transformer_checkpoint_to_diffusers(sd)
    if sd:  # the converter pops what it used: anything left had no rule
        raise ValueError(f"{len(sd)} tensor(s) with no SD3 rule, e.g. {sorted(sd)[:3]}")
    return out


# ---- loading -------------------------------------------------------------------------------
def read_transformer_state(path: str, prefix: str) -> dict:
    """The transformer's tensors of a file (prefix stripped); other parts are not read."""
    from safetensors import safe_open
    sd = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for k in f.keys():
            if k.startswith(prefix):
                sd[k[len(prefix):]] = f.get_tensor(k)
    return sd


def to_diffusers_state(arch: str, naming: str, sd: dict, config: dict) -> dict:
    if naming == "diffusers":
        return sd
    if arch == "flux":
        return convert_flux_bfl(sd, config["num_attention_heads"] * config["attention_head_dim"])
    return convert_sd3_bfl(sd)


def _skeleton(arch: str, config: dict):
    """The transformer for `config` on the meta device (no memory, no random init)."""
    import diffusers

    cls = getattr(diffusers, CLASS_BY_ARCH[arch])
    kw = dict(config)
    for k in ("axes_dims_rope", "dual_attention_layers"):
        if k in kw:
            kw[k] = tuple(kw[k])
    with torch.device("meta"):
        return cls(**kw)


def build_transformer(arch: str, config: dict, state: dict, dtype):
    """A diffusers transformer for `config` holding exactly `state` (strict: a missing or an
    extra tensor, or a shape that does not fit, raises)."""
    model = _skeleton(arch, config)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.device.type == "meta"]
    if left:
        raise ValueError(f"tensors not in the file: {left[:3]}")
    return model


# the file's block names for diffusers' block lists (BFL/ComfyUI naming)
_BFL_BLOCKS = {"transformer_blocks": {"flux": "double_blocks", "sd3": "joint_blocks"},
               "single_transformer_blocks": {"flux": "single_blocks"}}


def load_single_file(adapter, path: str, device, dtype, stage=None) -> LoadedModel:
    """`stage` = (index, count, split): PipeFusion, keep only that stage's blocks."""
    sf = single_file_config(path)
    if sf["arch"] != adapter.arch:
        raise ValueError(f"{path} is a {sf['arch']} file, not {adapter.arch}")
    sched, vae = defaults_for(sf["arch"], sf["config"])
    if stage is not None:
        transformer, info = _load_stage(adapter, path, sf, stage, device, dtype)
        return LoadedModel(path=path, arch=sf["arch"], transformer=transformer, encoder=None,
                           scheduler_config=sched, vae_config=vae, device=device, dtype=dtype,
                           stage=info)
    state = read_transformer_state(path, sf["prefix"])
    state = to_diffusers_state(sf["arch"], sf["naming"], state, sf["config"])
    transformer = build_transformer(sf["arch"], sf["config"], state, dtype)
    del state
    transformer.to(device).eval().requires_grad_(False)
    return LoadedModel(path=path, arch=sf["arch"], transformer=transformer, encoder=None,
                       scheduler_config=sched, vae_config=vae, device=device, dtype=dtype)


def _load_stage(adapter, path: str, sf: dict, stage, device, dtype):
    """PipeFusion from a file: read only this stage's blocks (plus the shared layers). FLUX
    and diffusers-named files convert tensor by tensor, so other blocks are never read;
    diffusers' SD3 converter needs every block, so a BFL-named SD3 file is read whole once
    (on the CPU) and the other blocks dropped."""
    from ..pipefusion_stages import (keep_stage_blocks, materialize_stage, plan_stages,
                                     stage_block_names)
    arch, lists = sf["arch"], adapter.block_lists
    tr = _skeleton(arch, sf["config"])
    info = plan_stages(tr, lists, *stage)
    others = stage_block_names(tr, lists, info)  # "transformer_blocks.3", ...

    def elsewhere(name: str) -> bool:  # a diffusers-named tensor of another stage's block
        parts = name.split(".")
        return len(parts) > 2 and f"{parts[0]}.{parts[1]}" in others

    raw_others = set()
    if sf["naming"] == "diffusers":
        raw_others = others
    elif arch == "flux":
        raw_others = {f"{_BFL_BLOCKS[b.split('.')[0]]['flux']}.{b.split('.')[1]}"
                      for b in others}
    from safetensors import safe_open
    state = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for k in f.keys():
            if not k.startswith(sf["prefix"]):
                continue
            name = k[len(sf["prefix"]):]
            parts = name.split(".")
            if len(parts) > 2 and f"{parts[0]}.{parts[1]}" in raw_others:
                continue
            state[name] = f.get_tensor(k)
    state = to_diffusers_state(arch, sf["naming"], state, sf["config"])
    state = {k: v for k, v in state.items() if not elsewhere(k)}
    keep_stage_blocks(tr, lists, info)
    materialize_stage(tr, lists, info, state, device, dtype)
    return tr, info
