"""Single-file transformers (ComfyUI's diffusion_models files): build the diffusers model from one
.safetensors.

The diffusers config comes from the weight shapes (`transformer_file.single_file_config`, the same code
the host uses to validate the file before any worker starts); keys in BFL /
ComfyUI naming are converted to diffusers naming, then the weights are assigned to a model
built on the meta device (no random init, one copy in memory) in the requested dtype. Only
the transformer's tensors are read, so a full checkpoint's VAE and text encoders cost nothing.

A single file has no scheduler, VAE or text encoders: the scheduler config and the VAE's
latent scale/shift are the released models' (the family's `released`), the text comes in as ComfyUI
CONDITIONING, and images are decoded by ComfyUI's VAE.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import families
from .loaded_model import LoadedModel


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


_QKV_NAMES = {"img": ("to_q", "to_k", "to_v"), "txt": ("add_q_proj", "add_k_proj", "add_v_proj")}


def _convert_bfl(sd: dict, top: dict, double: dict, single: dict, label: str,
                 hidden: int | None = None) -> dict:
    """BFL/ComfyUI keys of a FLUX-family model -> diffusers keys, key by key (so a PipeFusion
    stage reads only its blocks), with the model's rename tables. The double blocks' fused
    qkv is split in three; with `hidden` (FLUX.1) the single blocks' fused `linear1` is split
    into q, k, v and the MLP input, which FLUX.2 keeps fused. Any key without a rule raises
    (a silently dropped tensor would load as garbage)."""
    out, unknown = {}, []
    for name, w in sd.items():
        parts = name.split(".")
        kind = parts[0] if len(parts) > 3 else None  # "<kind>.<i>.<rest>"
        rest = ".".join(parts[2:])
        # the fused tensor a weight/bias belongs to (its other tensors, e.g. scales, never split)
        fused = rest.rsplit(".", 1)[0] if parts[-1] in ("weight", "bias") else None
        if name.startswith("final_layer.adaLN_modulation.1."):
            out["norm_out.linear." + parts[-1]] = _swap_halves(w)  # (shift, scale) swapped
            continue
        if kind == "double_blocks" and fused in ("img_attn.qkv", "txt_attn.qkv"):
            for n, t in zip(_QKV_NAMES[rest[:3]], w.chunk(3, dim=0)):
                out[f"transformer_blocks.{parts[1]}.attn.{n}.{parts[-1]}"] = t
            continue
        if kind == "single_blocks" and hidden is not None and fused == "linear1":
            split = [hidden, hidden, hidden, w.shape[0] - 3 * hidden]
            for n, t in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
                            w.split(split, dim=0)):
                out[f"single_transformer_blocks.{parts[1]}.{n}.{parts[-1]}"] = t
            continue
        if kind == "double_blocks":
            new = _rename(rest, double)
            new = None if new is None else f"transformer_blocks.{parts[1]}.{new}"
        elif kind == "single_blocks":
            new = _rename(rest, single)
            new = None if new is None else f"single_transformer_blocks.{parts[1]}.{new}"
        else:
            new = _rename(name, top)
        if new is None:
            unknown.append(name)
        else:
            out[new] = w
    if unknown:
        raise ValueError(f"{len(unknown)} tensor(s) with no {label} rule, e.g. {unknown[:3]}")
    return out


def convert_flux_bfl(sd: dict, hidden: int) -> dict:
    """FLUX.1 BFL/ComfyUI keys -> diffusers FluxTransformer2DModel keys."""
    return _convert_bfl(sd, _FLUX_TOP, _FLUX_DOUBLE, _FLUX_SINGLE, "FLUX", hidden)


# FLUX.2 BFL / ComfyUI names -> diffusers Flux2Transformer2DModel names. FLUX.2 has no
# biases, shares one modulation per stream kind, and its single blocks keep the fused
# qkv + MLP input (`linear1`) fused in diffusers too.
_FLUX2_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
}
_FLUX2_DOUBLE = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
_FLUX2_SINGLE = {
    "linear1": "attn.to_qkv_mlp_proj",
    "linear2": "attn.to_out",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
}


def convert_flux2_bfl(sd: dict) -> dict:
    """FLUX.2 BFL/ComfyUI keys -> diffusers Flux2Transformer2DModel keys."""
    return _convert_bfl(sd, _FLUX2_TOP, _FLUX2_DOUBLE, _FLUX2_SINGLE, "FLUX.2")


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
SCALE_SUFFIX = ".scale_weight"
# scaled-fp8 files also carry these; without fp8 matmuls the input scales are not used
# marker tensors with no weight: scaled-fp8 files', and ComfyUI's Qwen-Image-Edit 2511
# files' (read into the config as zero_cond_t, workers/families/qwen_image.py)
IGNORED = ("scaled_fp8", "__index_timestep_zero__")
IGNORED_SUFFIXES = (".scale_input",)


def read_transformer_state(path: str, prefix: str, arch: Optional[str] = None) -> dict:
    """The transformer's tensors of a file (prefix stripped), on the CPU; other parts are
    not read (with `arch`: nor the modules beside it, `beside_transformer`). (Tests and
    tools; the loader streams instead.)"""
    from .weights import Checkpoint
    with Checkpoint.open([path]) as ck:
        return {k[len(prefix):]: ck.read(k) for k in ck.keys() if k.startswith(prefix)
                and not (arch and beside_transformer(arch, k[len(prefix):]))}


def beside_transformer(arch: str, name: str) -> bool:
    """A tensor of a single file (its name in the file's naming, prefix stripped) that is
    not the transformer's but a module's the family's ComfyUI model holds beside it (the
    adapter's `side_prefixes`, which the adapter loads itself)."""
    return name.startswith(families.family(arch).adapter_class().side_prefixes or ("\0",))


def to_diffusers_state(arch: str, naming: str, sd: dict, config: dict) -> dict:
    """A file's tensors -> diffusers names, by the family adapter's converter."""
    if naming == "diffusers":
        return sd
    return families.family(arch).adapter_class().bfl_to_diffusers(sd, config)


def row_map(ck, sf: dict) -> dict:
    """{diffusers name: (shape, [(file tensor name, first row, stop row), ...], scale_weight
    name or None)} of a single file's transformer: which rows of which file tensors make up
    each diffusers tensor, in order (a fused qkv / linear1 part: one row range of the fused
    tensor; FLUX's final modulation: its two halves swapped). Found by running the very
    conversion the whole loader runs (`to_diffusers_state`) on index tensors (one entry per
    row, encoding tensor and row): the converters only split, chunk and concatenate along
    dim 0, so every output row names the file row it came from. Nothing is read."""
    arch, naming, prefix = sf["arch"], sf["naming"], sf["prefix"]
    names = [k[len(prefix):] for k in ck.keys() if k.startswith(prefix)
             and not beside_transformer(arch, k[len(prefix):])]
    scale_of = {n[: -len(SCALE_SUFFIX)] + ".weight": prefix + n for n in names
                if n.endswith(SCALE_SUFFIX)}
    names = [n for n in names if not (n.endswith(SCALE_SUFFIX) or n in IGNORED
                                      or n.endswith(IGNORED_SUFFIXES))]
    big = 1 << 40
    fake = {}
    for i, n in enumerate(names):
        shape = ck.shape(prefix + n)
        fake[n] = torch.arange(shape[0] if shape else 1, dtype=torch.int64) + i * big
    out = {}
    for dname, idx in to_diffusers_state(arch, naming, fake, sf["config"]).items():
        vals = idx.reshape(-1).tolist()
        segs = []
        for v in vals:
            t, r = divmod(int(v), big)
            if segs and segs[-1][0] == t and segs[-1][2] == r:
                segs[-1][2] = r + 1
            else:
                segs.append([t, r, r + 1])
        fshape = ck.shape(prefix + names[segs[0][0]]) if segs else []
        shape = [len(vals)] + list(fshape[1:]) if fshape else []
        srcs = {names[t] for t, _, _ in segs}
        scale = scale_of.get(srcs.pop()) if len(srcs) == 1 else None
        if any(n in scale_of for n in {names[t] for t, _, _ in segs}) and scale is None:
            raise ValueError(f"{dname}: made of several scaled tensors")
        out[dname] = (shape, [(prefix + names[t], a, b) for t, a, b in segs], scale)
    return out


def build_transformer(arch: str, config: dict, state: dict, dtype):
    """A diffusers transformer for `config` holding exactly `state` (strict: a missing or an
    extra tensor, or a shape that does not fit, raises)."""
    from .meta import skeleton
    model = skeleton(arch, config)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.device.type == "meta"]
    if left:
        raise ValueError(f"tensors not in the file: {left[:3]}")
    return model


def file_tensors(ck, sf: dict, device, dtype, skip=lambda name: False):
    """(diffusers name, tensor on `device` in the file's dtype, scale_weight or None) of a
    single file's transformer, one tensor at a time. FLUX and diffusers-named files convert
    key by key (so `skip`ped blocks, in the file's naming, are never read); diffusers' SD3
    converter needs every block, so a BFL-named SD3 file is read whole (each tensor cast to
    `dtype` as it arrives, fp8 ones dequantized) and then converted."""
    from .weights import dequantize, is_fp8
    arch, naming, prefix = sf["arch"], sf["naming"], sf["prefix"]
    names = [k[len(prefix):] for k in ck.keys() if k.startswith(prefix)
             and not beside_transformer(arch, k[len(prefix):])]
    scale_of = {n[: -len(SCALE_SUFFIX)] + ".weight": prefix + n for n in names
                if n.endswith(SCALE_SUFFIX)}
    names = [n for n in names if not (n.endswith(SCALE_SUFFIX) or n in IGNORED
                                      or n.endswith(IGNORED_SUFFIXES) or skip(n))]

    def scale(n):
        return ck.read(scale_of[n], device) if n in scale_of else None

    keywise = families.family(arch).adapter_class().bfl_blocks is not None
    if naming == "diffusers":
        for n in names:
            yield n, ck.read(prefix + n, device), scale(n)
    elif keywise:
        for n in names:
            s = scale(n)
            for out, t in to_diffusers_state(arch, naming, {n: ck.read(prefix + n, device)},
                                             sf["config"]).items():
                yield out, t, s  # a fused tensor's parts share its scale
    else:
        state = {}
        for n in names:
            t = ck.read(prefix + n, device)
            state[n] = dequantize(t, scale(n), torch.float32).to(dtype) if is_fp8(t) else \
                (t.to(dtype) if t.is_floating_point() else t)
        for out, t in to_diffusers_state(arch, naming, state, sf["config"]).items():
            yield out, t, None


def load_single_file(adapter, path: str, device, dtype, stage=None,
                     weights: str = "auto") -> LoadedModel:
    """`stage` = (index, count, split): PipeFusion, keep only that stage's blocks.
    `weights`: auto | fp8 | full (workers/loading/weights.py); a scaled-fp8 file's scale_weight
    tensors are applied (kept beside the fp8 weights, or folded in when dequantized)."""
    from .weights import Checkpoint, device_name, load_tensors
    from .meta import meta_transformer_of
    tr, sf = meta_transformer_of(adapter, path)
    lists = adapter.block_lists
    info, skip, elsewhere = None, (lambda name: False), (lambda name: False)
    if stage is not None:
        from .stages import keep_stage_blocks, plan_stages, stage_block_names
        info = plan_stages(tr, lists, *stage)
        others = stage_block_names(tr, lists, info)  # "transformer_blocks.3", ...
        raw_others = set()
        if sf["naming"] == "diffusers":
            raw_others = others
        elif adapter.bfl_blocks is not None:
            raw_others = {f"{adapter.bfl_blocks[b.split('.')[0]]}.{b.split('.')[1]}"
                          for b in others}

        def in_block(name, blocks):
            parts = name.split(".")
            return len(parts) > 2 and f"{parts[0]}.{parts[1]}" in blocks
        skip = lambda name: in_block(name, raw_others)  # noqa: E731
        elsewhere = lambda name: in_block(name, others)  # noqa: E731
        keep_stage_blocks(tr, lists, info)
    with Checkpoint.open([path]) as ck:
        if ck.gguf:  # ComfyUI-GGUF's files: workers/loading/gguf_load.py
            from .gguf_load import gguf_tensors
            source = gguf_tensors(ck, row_map(ck, sf), tr, device_name(device), weights,
                                  keep=lambda n: not elsewhere(n))
        else:
            source = ((n, t, s) for n, t, s in file_tensors(ck, sf, device_name(device), dtype,
                                                            skip) if not elsewhere(n))
        report = load_tensors(tr, lists, source, dtype, weights)
    report.checkpoint_fp8 = sf.get("storage", {}).get("fp8", False)
    report.checkpoint_scaled = sf.get("storage", {}).get("scaled", False)
    report.tensors_read, report.bytes_read = ck.reads, ck.bytes_read
    if stage is not None:
        from .stages import finish_stage
        finish_stage(tr, lists, info)
    return adapter.assemble(path, tr, report.as_dict(), device, dtype, False, stage_info=info)
