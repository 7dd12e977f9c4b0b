"""The tiny Chroma diffusers folder (`tiny-model --arch chroma`): ChromaPipeline with FLUX.1's
T5 (same salt, so the same weights as the FLUX test model's T5 of the seed) and VAE, a Chroma
transformer of its own salt, the released scheduler. Its knobs and RoPE are FLUX.1's."""
from __future__ import annotations

from comfyui_xdit import bridge
from comfyui_xdit.testmodels import bfl_names, parts
from comfyui_xdit.testmodels.flux import check, key_extras  # noqa: F401 - FLUX.1's RoPE axes
from comfyui_xdit.testmodels.text import _seeded, _t5_tokenizer

_flux = bridge.family_module("flux")  # RoPE axes
_chroma = bridge.family_module("chroma")  # scheduler

VARIANTS: tuple[str, ...] = ()

# Chroma's approximator (the MLP making every block's modulation from the timestep): its
# input stays the released 64 channels (16 timestep + 16 guidance + 32 modulation index),
# the only width ComfyUI's comfy/ldm/chroma accepts; hidden width and depth are small.
CHROMA_APPROXIMATOR = dict(approximator_num_channels=64, approximator_hidden_dim=32,
                           approximator_layers=2)


# the family-wide tests' small request (tests/family_requests.py)
TEST_REQUEST = dict(padded=True)  # a batch pads its prompts to the longest
# the test (under tests/) that holds one rank of this model to its diffusers pipeline;
# the conformance suite holds every method to one rank
ORACLE_TEST = "test_chroma.py::test_one_rank_matches_the_pipeline"
# PipeFusion's stale-K/V oracle for the conformance suite (tests/conformance/test_pipefusion.py):
# the test module's factory of the model folder, and the request fields it needs
# (prompts of max_sequence_length - 1 real tokens: ChromaPipeline's mask is then all ones)
PIPEFUSION_ORACLE = dict(oracle="test_pipefusion_reference:ChromaReference",
                         request=dict(prompt=["a red cat", "a blue dog"],
                                      negative_prompt="dark old photo", max_sequence_length=5))

def build_pipeline(cfg: dict):
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    seed, heads, head_dim = cfg["seed"], cfg["heads"], parts.head_dim(cfg)
    tokenizer = _t5_tokenizer()
    text_encoder = parts.t5_model(tokenizer, seed, 2)
    transformer = _seeded(
        seed,
        6,
        ChromaTransformer2DModel,
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=cfg["depth"],
        num_single_layers=cfg["depth"],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=parts.T5["d_model"],
        axes_dims_rope=_flux.rope_axes(head_dim),
        **CHROMA_APPROXIMATOR,
    )
    vae = parts.kl_vae(cfg["arch"], seed, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(**_chroma.SCHEDULER)
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)


def single_file(sd: dict) -> dict:
    """The transformer's diffusers state dict in BFL / ComfyUI Chroma names (its blocks
    without their own modulation; the approximator's layers as in_layer / out_layer), for the
    conformance suite's single-file theme."""
    out = {}
    for p in ("weight", "bias"):
        out[f"img_in.{p}"] = sd[f"x_embedder.{p}"]
        out[f"txt_in.{p}"] = sd[f"context_embedder.{p}"]
        out[f"final_layer.linear.{p}"] = sd[f"proj_out.{p}"]
        for n in ("in_proj", "out_proj"):
            out[f"distilled_guidance_layer.{n}.{p}"] = sd[f"distilled_guidance_layer.{n}.{p}"]
    layers = {k.split(".")[2] for k in sd if k.startswith("distilled_guidance_layer.layers.")}
    for j in range(len(layers)):
        a = f"distilled_guidance_layer.layers.{j}."
        for p in ("weight", "bias"):
            out[f"{a}in_layer.{p}"] = sd[f"{a}linear_1.{p}"]
            out[f"{a}out_layer.{p}"] = sd[f"{a}linear_2.{p}"]
        out[f"distilled_guidance_layer.norms.{j}.scale"] = \
            sd[f"distilled_guidance_layer.norms.{j}.weight"]
    bfl_names.double_blocks(sd, out, modulation=False)
    bfl_names.single_blocks(sd, out, modulation=False)
    return bfl_names.same_size(out, sd)
