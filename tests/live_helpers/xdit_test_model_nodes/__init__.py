"""Test-only ComfyUI pack for tests/test_comfyui_live_model.py (never shipped: the live test
links this folder into custom_nodes/ for its run only).

* XDiTTestRandomConditioning: a seeded random CONDITIONING of any widths (SD3: context 4096,
  pooled 2048; FLUX: 4096 / 768), since ComfyUI's text-encoder loaders only know the real
  encoders' shapes. Same seed, same tensors, in every process.
* XDiTTestSaveTensors: writes an IMAGE and / or a LATENT to a .safetensors file at full
  float precision, so two branches of a graph can be compared beyond 8-bit PNGs.
"""


class XDiTTestRandomConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "context_dim": ("INT", {"default": 4096, "min": 1, "max": 8192}),
                             "pooled_dim": ("INT", {"default": 2048, "min": 1, "max": 8192}),
                             "guidance": ("FLOAT", {"default": -1.0, "min": -1.0,
                                                    "max": 100.0})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "xDiT tests"

    def make(self, seed, tokens, context_dim, pooled_dim, guidance):
        import torch
        g = torch.Generator().manual_seed(int(seed))
        ctx = torch.randn(1, tokens, context_dim, generator=g)
        pooled = torch.randn(1, pooled_dim, generator=g)
        extra = {"pooled_output": pooled}
        if guidance >= 0:  # FLUX embedded guidance (what FluxGuidance sets)
            extra["guidance"] = float(guidance)
        return ([[ctx, extra]],)


class XDiTTestSaveTensors:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {"default": ""})},
                "optional": {"images": ("IMAGE",), "latent": ("LATENT",)}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "xDiT tests"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # always run: the test reads the file this run writes

    def save(self, path, images=None, latent=None):
        import os
        from safetensors.torch import save_file
        out = {}
        if images is not None:
            out["image"] = images.detach().float().cpu().contiguous()
        if latent is not None:
            out["latent"] = latent["samples"].detach().float().cpu().contiguous()
        tmp = path + ".tmp"
        save_file(out, tmp)
        os.replace(tmp, path)
        return {}


NODE_CLASS_MAPPINGS = {"XDiTTestRandomConditioning": XDiTTestRandomConditioning,
                       "XDiTTestSaveTensors": XDiTTestSaveTensors}
