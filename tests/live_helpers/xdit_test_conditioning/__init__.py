"""Test-only ComfyUI pack for tests/test_comfyui_live.py: a CONDITIONING source for the tiny
random FLUX model. ComfyUI's own CLIP loaders only know the real text encoders' shapes, so the
live single-file workflow gets its conditioning from the tiny diffusers folder's encoders (the
same tensors ComfyUI's CLIPTextEncode produces for FLUX: T5 states + CLIP-L pooled).
XDiTTestFlux2Conditioning does the same for the tiny FLUX.2 folder (Qwen3 states;
pooled_output None, as CLIPTextEncode sets it for FLUX.2).
Never shipped: the live test links this folder into custom_nodes/ for its run only."""


class _TextConditioning:
    """A prompt encoded by a tiny diffusers folder's own text encoders."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"default": "a small red cube"}),
                             "model_folder": ("STRING", {"default": ""}),
                             "max_sequence_length": ("INT", {"default": 16, "min": 1,
                                                             "max": 512})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = "xDiT tests"


class XDiTTestConditioning(_TextConditioning):
    def encode(self, text, model_folder, max_sequence_length):
        import diffusers
        pipe = diffusers.FluxPipeline.from_pretrained(model_folder, transformer=None, vae=None)
        pe, pooled, _ = pipe.encode_prompt(prompt=[text], prompt_2=None,
                                           max_sequence_length=max_sequence_length)
        return ([[pe.detach().float(), {"pooled_output": pooled.detach().float()}]],)


class XDiTTestFlux2Conditioning(_TextConditioning):
    """FLUX.2's CONDITIONING as ComfyUI's FLUX.2 text encoders give it through CLIPTextEncode
    (ComfyUI 0.8.0): the text states [B, T, D] and a `pooled_output` key holding None (FLUX.2
    has no pooled text; CLIPTextEncode always sets the key, and ComfyUI's FLUX model reads it:
    `Flux.encode_adm` is `kwargs["pooled_output"]`). The tiny folder's own encoder stands in
    for ComfyUI's, which only loads the real encoders."""

    def encode(self, text, model_folder, max_sequence_length):
        import diffusers
        pipe = diffusers.Flux2KleinPipeline.from_pretrained(model_folder, transformer=None,
                                                            vae=None)
        pe, _ = pipe.encode_prompt(prompt=[text], max_sequence_length=max_sequence_length)
        return ([[pe.detach().float(), {"pooled_output": None}]],)


NODE_CLASS_MAPPINGS = {"XDiTTestConditioning": XDiTTestConditioning,
                       "XDiTTestFlux2Conditioning": XDiTTestFlux2Conditioning}
