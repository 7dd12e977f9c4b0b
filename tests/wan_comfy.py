"""Test helper: tiny Wan models that ComfyUI's own loaders take, for native-vs-pool
comparisons (tests/test_comfyui_live_wan.py).

ComfyUI 0.3.64 detects a Wan single file by `head.modulation` (Wan 2.1 I2V by
`img_emb.proj.0.bias`) and reads dim, out_dim, ffn_dim, in_dim and the block count from the
weights; num_heads = dim // 128 (head dim 128), the text width (text_dim 4096, UMT5-XXL's)
and the CLIP vision width (1280) are fixed in its classes. So a ComfyUI-loadable tiny Wan has
heads of 128, text_dim 4096 and image_dim 1280: `native_wan_folder` writes such a diffusers
folder (the tiny folder's other parts, its transformer(s) rebuilt at those widths, seeded),
and `comfy_wan_file` one transformer of it as a single file in ComfyUI's (the original Wan
repository's) tensor names, which UNETLoader loads. The pool loads the folder, ComfyUI the
file: the same weights on both sides.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

# the CLIP vision width ComfyUI's Wan 2.1 I2V image projection (MLPProj) is built for
CLIP_VISION_WIDTH = 1280

# diffusers' WanTransformer3DModel names -> ComfyUI / original Wan names (prefix rules, in
# order; the block index is kept)
_RULES = [
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^blocks\.(\d+)\.attn1\.to_q\.", r"blocks.\1.self_attn.q."),
    (r"^blocks\.(\d+)\.attn1\.to_k\.", r"blocks.\1.self_attn.k."),
    (r"^blocks\.(\d+)\.attn1\.to_v\.", r"blocks.\1.self_attn.v."),
    (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.o."),
    (r"^blocks\.(\d+)\.attn1\.norm_(q|k)\.", r"blocks.\1.self_attn.norm_\2."),
    (r"^blocks\.(\d+)\.attn2\.to_q\.", r"blocks.\1.cross_attn.q."),
    (r"^blocks\.(\d+)\.attn2\.to_k\.", r"blocks.\1.cross_attn.k."),
    (r"^blocks\.(\d+)\.attn2\.to_v\.", r"blocks.\1.cross_attn.v."),
    (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.o."),
    (r"^blocks\.(\d+)\.attn2\.norm_(q|k)\.", r"blocks.\1.cross_attn.norm_\2."),
    (r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),  # diffusers' norm2: the cross-attn norm
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
    (r"^patch_embedding\.", "patch_embedding."),
    # Wan 2.1 I2V: the CLIP image tokens' projection (ComfyUI's MLPProj: LayerNorm, Linear,
    # GELU, Linear, LayerNorm as proj.0..4) and each block's image K/V
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^blocks\.(\d+)\.attn2\.add_k_proj\.", r"blocks.\1.cross_attn.k_img."),
    (r"^blocks\.(\d+)\.attn2\.add_v_proj\.", r"blocks.\1.cross_attn.v_img."),
    (r"^blocks\.(\d+)\.attn2\.norm_added_k\.", r"blocks.\1.cross_attn.norm_k_img."),
]


def comfy_name(key: str) -> str:
    """One diffusers Wan transformer tensor name in ComfyUI's naming (KeyError: unknown)."""
    for pattern, repl in _RULES:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    raise KeyError(f"no ComfyUI name for Wan tensor {key!r}")


def to_comfy(state_dict: dict) -> dict:
    out = {comfy_name(k): v.contiguous() for k, v in state_dict.items()}
    assert len(out) == len(state_dict), "two tensors mapped to one name"
    return out


def renamed_file(folder: Path, out: Path, rename) -> Path:
    """The safetensors weights of a diffusers model `folder` as one file at `out`, its
    state dict passed through `rename` (the folder's dtype kept; written whole, then moved)."""
    from safetensors.torch import load_file, save_file
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file(rename(sd), str(tmp))
    tmp.replace(out)
    return out


def comfy_wan_file(transformer_folder: Path, out: Path) -> Path:
    """The diffusers transformer in `transformer_folder` as a ComfyUI single file at `out`."""
    return renamed_file(transformer_folder, out, to_comfy)


def native_wan_folder(tiny: Path, out: Path, seed: int = 0, depth: int = 1) -> Path:
    """A copy of the tiny Wan folder `tiny` (t2v, a14b, i2v or i2v-a14b) whose transformer(s)
    have ComfyUI's fixed widths: heads of 128 (2 heads, width 256), text_dim 4096 and, with
    image K/V (Wan 2.1 I2V), image_dim 1280 (random, seeded; the folder's own text and image
    encoders no longer fit them: give CONDITIONING and CLIP vision states)."""
    import torch
    from diffusers import WanTransformer3DModel
    if (out / "model_index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(tiny, tmp)
    index = json.loads((tmp / "model_index.json").read_text())
    for k, sub in enumerate(("transformer", "transformer_2")):
        if not (index.get(sub) and index[sub][0] is not None):
            continue
        torch.manual_seed(seed * 100 + k)
        # the tiny folder's input channels (I2V: 36, the start frame's 20 beside)
        config = json.loads((tmp / sub / "config.json").read_text())
        # Wan 2.1 I2V's CLIP image K/V: ComfyUI's MLPProj takes CLIP vision width 1280 (its
        # class constant), the image K/V the model width
        image = dict(image_dim=CLIP_VISION_WIDTH, added_kv_proj_dim=2 * 128) \
            if config.get("image_dim") else {}
        tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                   attention_head_dim=128, in_channels=config["in_channels"],
                                   out_channels=16,
                                   text_dim=4096, freq_dim=256, ffn_dim=512, num_layers=depth,
                                   cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                   eps=1e-6, rope_max_seq_len=1024, **image)
        shutil.rmtree(tmp / sub)
        tr.save_pretrained(str(tmp / sub), safe_serialization=True)
    tmp.rename(out)
    return out
