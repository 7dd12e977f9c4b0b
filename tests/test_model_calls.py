"""The xDiT MODEL's per-call protocol (comfyui_xdit/nodes/model_calls.py, workers/sampling/model_call.py):
each call ComfyUI's samplers would make returns exactly what the single-process diffusers
transformer returns for the same inputs under ComfyUI's model conventions, with the
conditional/unconditional rows and the batch split over 2 and 4 ranks, and each
conditioning sent to the pool once per sampling run.

The reference is written here from diffusers alone: FLUX takes packed 2x2 latents, sigma as
its timestep (its pipeline divides sigma * 1000 by 1000) and zero text ids; SD3 takes the
latents as they are and sigma * 1000.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from comfyui_xdit import ParallelConfig
from comfyui_xdit.planning.config import ConfigError
from comfyui_xdit.nodes.model_calls import PoolDenoiser
from comfyui_xdit.client.pool import PoolError

from conftest import pack_flux, unpack_flux

TOL = 1e-5


@pytest.fixture(scope="module")
def transformers(model_dir):
    import diffusers
    made = {}

    def get(arch):
        if arch not in made:
            cls = diffusers.FluxTransformer2DModel if arch == "flux" else \
                diffusers.SD3Transformer2DModel
            made[arch] = cls.from_pretrained(str(model_dir(arch)), subfolder="transformer",
                                             torch_dtype=torch.float32).eval()
        return made[arch]
    return get


def reference(arch, tr, x, timestep, context, y, guidance):
    """ComfyUI's FLUX / SD3 model output for these inputs, from the diffusers transformer."""
    n, _, h, w = x.shape
    with torch.inference_mode():
        if arch == "flux":
            ids = torch.zeros(h // 2, w // 2, 3)
            ids[..., 1] += torch.arange(h // 2)[:, None]
            ids[..., 2] += torch.arange(w // 2)[None, :]
            g = guidance if tr.config.guidance_embeds else None
            out = tr(hidden_states=pack_flux(x), timestep=timestep, guidance=g,
                     pooled_projections=y, encoder_hidden_states=context,
                     txt_ids=torch.zeros(context.shape[1], 3), img_ids=ids.reshape(-1, 3),
                     return_dict=False)[0]
            return unpack_flux(out, h * 8, w * 8)
        return tr(hidden_states=x, timestep=timestep, encoder_hidden_states=context,
                  pooled_projections=y, return_dict=False)[0]


def comfy_call(arch, tr, batch, h, w, tokens=7, seed=0):
    """The inputs of one batched sampler call: the unconditional then the conditional chunk
    of `batch` rows each, as ComfyUI's calc_cond_batch builds them."""
    gen = torch.Generator().manual_seed(seed)
    cfg = tr.config
    n = 2 * batch
    x = torch.randn(n, 16, h, w, generator=gen)
    ctx = torch.randn(2, tokens, cfg.joint_attention_dim, generator=gen)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=gen)
    context = torch.cat([ctx[i:i + 1].expand(batch, -1, -1) for i in range(2)])
    y = torch.cat([pooled[i:i + 1].expand(batch, -1) for i in range(2)])
    sigma = torch.tensor(0.7)
    timestep = (sigma if arch == "flux" else sigma * 1000).expand(n)
    guidance = torch.full((n,), 3.5) if arch == "flux" else None
    options = {"uuids": [uuid.uuid4(), uuid.uuid4()], "cond_or_uncond": [1, 0]}
    return dict(x=x, timestep=timestep, context=context, y=y, guidance=guidance,
                transformer_options=options)


CASES = [  # (arch, world, config, batch, latent h, w): cfg rows and the batch over 2 and 4
    ("flux", 2, ParallelConfig(cfg_parallel=True), 1, 8, 6),
    ("flux", 2, ParallelConfig(ulysses=2), 3, 10, 8),
    ("flux", 2, ParallelConfig(dp=2), 3, 8, 6),
    ("flux", 4, ParallelConfig(cfg_parallel=True, ring=2), 3, 10, 8),
    ("flux", 4, ParallelConfig(dp=2, ulysses=2), 1, 8, 6),
    ("sd3", 2, ParallelConfig(ring=2), 1, 10, 8),
    ("sd3", 2, ParallelConfig(cfg_parallel=True), 3, 8, 6),
    ("sd3", 4, ParallelConfig(cfg_parallel=True, ulysses=2), 3, 10, 8),
    ("sd3", 4, ParallelConfig(dp=2, ring=2), 1, 8, 6),
]


@pytest.mark.parametrize("arch,world,config,batch,h,w", CASES,
                         ids=[f"{a}-{c.describe().replace(' ', '')}-b{b}-{h}x{w}"
                              for a, _, c, b, h, w in CASES])
def test_call_equals_diffusers_transformer(pools, transformers, arch, world, config, batch,
                                           h, w):
    pool = pools(arch, world)
    tr = transformers(arch)
    den = PoolDenoiser(pool, config.with_world_size(world), arch)
    call = comfy_call(arch, tr, batch, h, w, seed=world * 10 + batch)
    want = reference(arch, tr, call["x"], call["timestep"],
                     call["context"], call["y"], call["guidance"])
    got = den(**call)
    assert got.shape == call["x"].shape and got.dtype == call["x"].dtype
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{config.describe()}: max abs diff {diff:.3e}"
    # not a degenerate pass: the two conditionings give different predictions
    n = call["x"].shape[0] // 2
    swapped = dict(call, context=call["context"].flip(0), y=call["y"].flip(0),
                   transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()]})
    other = den(**swapped)
    assert (other[:n] - got[:n]).abs().max().item() > 1e-3


def test_conditioning_crosses_once_per_run(pools, transformers):
    pool = pools("flux", 2)
    tr = transformers("flux")
    den = PoolDenoiser(pool, ParallelConfig(cfg_parallel=True).with_world_size(2), "flux")
    call = comfy_call("flux", tr, 1, 8, 8, seed=3)
    first = den(**call)
    puts = den.last_stats["cond_puts"]
    for sigma in (0.5, 0.3):  # the later steps of the same run: latents and timesteps only
        step = dict(call, timestep=torch.full((2,), sigma), x=call["x"] * sigma)
        got = den(**step)
        want = reference("flux", tr, step["x"], step["timestep"], call["context"], call["y"],
                         call["guidance"])
        assert (got - want).abs().max().item() <= TOL
    assert den.calls == 3 and den.conds_sent == 2
    assert den.last_stats["cond_puts"] == puts  # the workers cached them, nothing re-put
    # a new run (new uuids) sends its conditionings again
    den(**dict(call, transformer_options={"uuids": [uuid.uuid4(), uuid.uuid4()]}))
    assert den.conds_sent == 4
    assert (first - reference("flux", tr, call["x"], call["timestep"], call["context"],
                              call["y"], call["guidance"])).abs().max().item() <= TOL


def test_forgotten_conditioning_is_sent_again(pools, transformers):
    """The host believes the pool holds a conditioning it does not (e.g. evicted): rank 0
    asks for it and the call still returns the right answer."""
    pool = pools("sd3", 2)
    tr = transformers("sd3")
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "sd3")
    call = comfy_call("sd3", tr, 1, 8, 6, seed=5)
    for u in call["transformer_options"]["uuids"]:  # never sent, but marked known
        den._known[f"{u}:1:{call['context'].shape[1]}"] = None
    den._launches = (id(pool), pool.launches)
    got = den(**call)
    want = reference("sd3", tr, call["x"], call["timestep"], call["context"], call["y"], None)
    assert (got - want).abs().max().item() <= TOL
    assert den.conds_sent == 2


def test_bad_calls_are_refused_and_the_pool_stays_warm(pools, transformers):
    pool = pools("flux", 2)
    tr = transformers("flux")
    pids = pool.worker_pids()
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "flux")
    call = comfy_call("flux", tr, 1, 8, 6, seed=9)
    with pytest.raises(PoolError, match=r"latents \[batch, 16"):
        den(**dict(call, x=torch.randn(2, 4, 8, 6)))
    with pytest.raises(ConfigError, match="ControlNet"):
        den(**call, control={"output": [torch.zeros(1)]})
    with pytest.raises(ConfigError, match="patches"):
        den(**dict(call, transformer_options=dict(call["transformer_options"],
                                                  patches_replace={"dit": {"x": 1}})))
    with pytest.raises(ConfigError, match="a reference latent has shape"):  # rows 1 or N
        den(**call, ref_latents=[torch.zeros(5, 16, 8, 6)])
    with pytest.raises(ConfigError, match="PipeFusion"):
        PoolDenoiser(pool, ParallelConfig(pipefusion=2), "flux")
    got = den(**call)  # still warm, same workers, right answer
    want = reference("flux", tr, call["x"], call["timestep"], call["context"], call["y"],
                     call["guidance"])
    assert (got - want).abs().max().item() <= TOL
    assert pool.worker_pids() == pids


# ---- ComfyUI's LoRA loaders on the xDiT MODEL: recorded per clone ----------------------------
def _stand_in_comfy(monkeypatch, model_patcher=object):
    """ComfyUI's modules that comfy_model.py imports, stood in for (ComfyUI is not
    installable in CI): `model_patcher`'s ModelPatcher, and the two conditioning classes
    the MODEL's own derive from (comfy.conds: a value in `cond`)."""
    import sys
    import types

    comfy = types.ModuleType("comfy")
    mods = {"comfy": comfy}
    for name in ("conds", "model_base", "model_management", "model_patcher",
                 "supported_models"):
        mods[f"comfy.{name}"] = types.ModuleType(f"comfy.{name}")
        setattr(comfy, name, mods[f"comfy.{name}"])
    mods["comfy.model_patcher"].ModelPatcher = model_patcher

    class CONDRegular:
        def __init__(self, cond):
            self.cond = cond

    mods["comfy.conds"].CONDRegular = CONDRegular
    mods["comfy.conds"].CONDConstant = type("CONDConstant", (CONDRegular,), {})
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    monkeypatch.delitem(sys.modules, "comfyui_xdit.nodes.comfy_model", raising=False)


def test_comfyui_lora_loaders_record_patches_on_the_clone(monkeypatch):
    """ComfyUI's LoraLoader / LoraLoaderModelOnly (comfy.sd.load_lora_for_models) clone the
    MODEL's patcher and call add_patches on the clone: the xDiT patcher records the LoRA in
    the clone's transformer options (what each diffusion-model call receives), leaves the
    original MODEL without it, and refuses a model merge in one line naming the patch.
    ComfyUI is not installable in CI: its modules are stood in for here with ModelPatcher's
    clone rule (`self.__class__(...)`, its model_options deep-copied; 0.3.64 and 0.8.0); the
    pool side is tests/test_comfy_loras.py."""
    import copy
    import sys
    import types

    from comfyui_xdit.nodes import comfy_loras

    class ModelPatcher:  # the part of comfy.model_patcher.ModelPatcher a LoRA loader uses
        def __init__(self, model, load_device=None, offload_device=None, size=0, **kw):
            self.model, self.patches = model, {}
            self.model_options = {"transformer_options": {}}

        def clone(self):
            n = self.__class__(self.model)
            n.model_options = copy.deepcopy(self.model_options)
            return n

    _stand_in_comfy(monkeypatch, ModelPatcher)
    from comfyui_xdit.nodes.comfy_model import XditModelPatcher, _lora_names, _Weightless

    class LoRA:  # ComfyUI's LoRAAdapter's attributes
        name = "lora"
        weights = (torch.ones(6, 2), torch.ones(2, 4), 4.0, None, None, None)

    patcher = XditModelPatcher(object())
    key = "diffusion_model.blocks.0.attn.to_q.weight"
    first = patcher.clone()
    assert first.add_patches({key: LoRA()}, 0.8) == [key]  # what load_lora_for_models does
    second = first.clone()
    second.add_patches({(key, (0, 0, 6)): LoRA()}, -0.6)  # a chained loader
    sources = second.model_options["transformer_options"][comfy_loras.OPTION]
    assert [s.strength for s in sources] == [0.8, -0.6]
    assert sources[0] is first.model_options["transformer_options"][comfy_loras.OPTION][0]
    assert comfy_loras.OPTION not in patcher.model_options["transformer_options"]
    assert sources[0].layers["blocks.0.attn.to_q"][0][1][0, 0].item() == 2.0  # alpha / rank
    with pytest.raises(ConfigError) as e:  # ModelMergeSimple's patches
        patcher.clone().add_patches({key: (torch.ones(6, 4),)}, 0.5, 0.5)
    msg = str(e.value)
    assert "model merge" in msg and key in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="model merge"):  # ModelMergeSimple's model2
        patcher.get_key_patches("diffusion_model.")
    with pytest.raises(ConfigError, match="LoRA hooks"):
        patcher.add_hook_patches(object(), {key: LoRA()})

    # the MODEL's state dict names the pool's weights (meta: no data) for ComfyUI's key map,
    # and the names that map adds (comfy.lora stood in for by one FLUX-like entry)
    seen = {}

    def model_lora_keys_unet(model, key_map):
        seen["keys"] = sorted(model.state_dict())
        return {"transformer.a.to_q": ("diffusion_model.a.qkv.weight", (0, 0, 6))}
    lora = types.ModuleType("comfy.lora")
    lora.model_lora_keys_unet = model_lora_keys_unet
    monkeypatch.setitem(sys.modules, "comfy.lora", lora)
    monkeypatch.setattr(sys.modules["comfy"], "lora", lora, raising=False)
    model = type("M", (_Weightless, torch.nn.Module), {})()
    weights, rows, parts = _lora_names(model, {"a.to_q": [6, 4]})
    assert seen["keys"] == ["diffusion_model.a.to_q.weight"]
    assert model.state_dict()["diffusion_model.a.to_q.weight"].is_meta
    assert "a.qkv" in weights and rows["a.qkv"] == 6 and parts["a.qkv"] == [("a.to_q", 0, 6)]
    monkeypatch.delitem(sys.modules, "comfyui_xdit.nodes.comfy_model", raising=False)


# ---- MiniMax-H3's conditionings on the xDiT MODEL: read once, one call for cond + uncond -----
class _Pool:
    """What PoolDenoiser asks of a pool, recording each model call (a zero prediction)."""
    launches = 0

    def __init__(self):
        self.calls = []

    def model_call(self, config, x, t, g, chunks, conds, **kw):
        self.calls.append(dict(chunks=chunks, conds=conds, t=t, **kw))
        return torch.zeros_like(x), {}, list(conds)


class _Tags:
    """A prompt's token tags that count their host reads."""
    reads = 0

    def reshape(self, *shape):
        return self

    def tolist(self):
        _Tags.reads += 1
        return [1, 1]


def test_minimax_conditionings_are_read_once_and_share_a_call(monkeypatch):
    """The MODEL's conditionings (comfy_model.pool_conds, on ComfyUI's MiniMaxH3
    extra_conds): the payload's scalars read once per conditioning, not per call; the
    texts of other lengths (cond 8, uncond 5 tokens) concatenated as ComfyUI concatenates
    a call's conditionings, zero-padded, with each row's length beside; the call sends each
    conditioning's text at its own length, the carry and the shifts (a node's
    transformer_options) with it; a payload with keyframes refused in one line."""
    import sys

    _stand_in_comfy(monkeypatch)
    from comfyui_xdit.nodes.comfy_model import pool_conds
    from comfyui_xdit.nodes.model_calls import INPUTS, LENGTHS

    pool = _Pool()
    den = PoolDenoiser(pool, ParallelConfig(ulysses=2).with_world_size(2), "minimax_h3")
    conds_class = sys.modules["comfy.conds"]
    made = []
    for tokens in (8, 5):
        payload = {"audio_scale": 4.0, "seed": 0, "text_token_tags": _Tags()}
        made.append(pool_conds({"c_crossattn": conds_class.CONDRegular(torch.randn(1, tokens, 16)),
                                "minimax_payload": conds_class.CONDConstant(payload)}, den))
    assert _Tags.reads == 2 and all("minimax_payload" not in c for c in made)
    first, second = made
    assert first["c_crossattn"].can_concat(second["c_crossattn"])
    context = first["c_crossattn"].concat([second["c_crossattn"]])
    lengths = first[LENGTHS].concat([second[LENGTHS]])
    assert context.shape == (2, 8, 16) and lengths == (8, 5)
    assert torch.equal(context[1, 5:], torch.zeros(3, 16))
    video, audio = torch.randn(2, 24, 7, 4, 6), torch.randn(2, 32, 2, 37)
    for _ in range(3):  # steps
        den([video, audio], torch.tensor([700.0, 700.0]), context=context,
            transformer_options={"uuids": ["c", "u"], "minimax_h3_sigma_shift_video": 10.0},
            **{INPUTS: first[INPUTS].cond, LENGTHS: lengths})
    assert _Tags.reads == 2 and len(pool.calls) == 3
    call = pool.calls[0]
    assert [k for k, _ in call["chunks"]] == ["c:1:8", "u:1:5"]
    assert torch.equal(call["conds"]["u:1:5"].context, context[1:, :5])
    assert call["inputs"] == {"audio_scale": 4.0, "sigma_shift_video": 10.0,
                              "sigma_shift_audio": 3.0}
    with pytest.raises(ConfigError, match="keyframes"):
        pool_conds({"minimax_payload": conds_class.CONDConstant(
            {"keyframes": [{"resolved_frame_index": 0}]})}, den)


# ---- a timestep per token (a noise mask on the LATENT) ---------------------------------------
def test_a_timestep_per_token_is_refused_in_one_line_where_the_family_takes_none():
    """Every family whose ComfyUI model takes no timestep per token (no TokenTimesteps)
    refuses one, or the mask input ComfyUI passes with it, in one line that names the noise
    mask and the families that take one, before any pool is asked; a family that declares it
    takes it (the pool-side checks: tests/conformance/test_token_timesteps.py)."""
    from comfyui_xdit.bridge import families
    from comfyui_xdit.nodes import token_timesteps

    takers = [f.name for f in families.FAMILIES.values()
              if f.capability(families.TokenTimesteps)]
    assert takers
    refusing = [a for a, f in families.FAMILIES.items()
                if not f.capability(families.TokenTimesteps)]
    assert refusing
    for arch in refusing:
        fam = families.family(arch)
        den = PoolDenoiser(None, ParallelConfig(), arch)
        with pytest.raises(ConfigError) as e:
            den._timesteps(torch.full((2, 12, 1), 0.5), 2, (16, 2, 3))
        line = str(e.value)
        assert "\n" not in line and "noise mask" in line and takers[0] in line, line
        with pytest.raises(ConfigError, match="noise mask"):
            token_timesteps.pool_timesteps(fam, (torch.full((2,), 0.5), torch.full((2,), 0.7)),
                                           2, [(16, 2, 3), (8, 9, 16)], 1.0)
        with pytest.raises(ConfigError, match=r"noise mask \(denoise_mask\)"):
            den._refuse(None, {}, {"denoise_mask": torch.ones(2, 1, 2, 3)})
    # the one-per-row call is unchanged: every token at its row's timestep collapses to [N]
    for arch in [a for a, f in families.FAMILIES.items()
                 if f.capability(families.TokenTimesteps)]:
        fam = families.family(arch)
        spec = fam.capability(families.TokenTimesteps)
        shapes = [(4,) + (3,) * max(spec.token_axes[i]) for i in range(len(spec.token_axes))]
        tokens = spec.tokens(shapes)
        steps = [torch.full((2, k, 1), 0.5) for k in tokens]
        assert tuple(token_timesteps.pool_timesteps(fam, steps, 2, shapes, 2.0).shape) == (2,)
        steps[0][:, 0] = 0.0
        t = token_timesteps.pool_timesteps(fam, steps, 2, shapes, 2.0)
        assert tuple(t.shape) == (2, sum(tokens)) and float(t[0, 0]) == 0 and \
            float(t[0, 1]) == 1.0


def test_the_workers_check_a_calls_timesteps_against_the_family():
    """Rank 0 checks a call's timesteps before anything is broadcast (a host other than the
    xDiT MODEL may send any): one per row always; one per token of the parts only for a
    family that takes it, and then exactly the parts' token count."""
    from comfyui_xdit.bridge import families, worker_module
    problem = worker_module("sampling.model_call").timestep_problem
    for arch, fam in families.FAMILIES.items():
        spec = fam.capability(families.TokenTimesteps)
        shapes = [(4, 2, 2, 3)] if spec is None else \
            [(4,) + (2,) * max(axes) for axes in spec.token_axes]
        assert problem(fam, torch.zeros(2), 2, shapes) == ""
        if spec is None:
            assert "one timestep per latent row" in problem(fam, torch.zeros(2, 12), 2, shapes)
            continue
        tokens = sum(spec.tokens(shapes))
        assert problem(fam, torch.zeros(2, tokens), 2, shapes) == ""
        assert f"one per token [2, {tokens}]" in problem(fam, torch.zeros(2, tokens - 1), 2,
                                                         shapes)
