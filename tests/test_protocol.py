"""The typed messages: their parts (degrees, conditionings, results) cross the channel as plain
values and come back typed on the other side, whose classes live under another package name."""
from __future__ import annotations

import pickle

import pytest
import torch

import workers.runtime.protocol as P
from comfyui_xdit.bridge import worker_module
from comfyui_xdit.planning.config import ParallelConfig
from workers.parallel.degrees import AXES, Degrees
from workers.runtime.conditioning import Conditioning
from workers.runtime.outputs import Decoded, Latents

HOST = worker_module("runtime.protocol")  # the host's copy: other classes, same messages


def _classes(v) -> set:
    """Types in a wire value that are neither builtins nor tensors / arrays."""
    if isinstance(v, dict):
        return set().union(*[_classes(x) for x in v.values()], set())
    if isinstance(v, (list, tuple)):
        return set().union(*[_classes(x) for x in v], set())
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.Tensor)):
        return set()
    return {type(v)}


def test_a_predict_crosses_as_plain_values_and_arrives_typed():
    hc = worker_module("runtime.conditioning").Conditioning
    cond = hc(context=torch.randn(2, 5, 8), pooled=torch.randn(2, 4),
              ref_latents=[torch.randn(2, 16, 4, 4)], ref_method="index")
    msg = HOST.Predict(call_id=3, config=ParallelConfig(ulysses=2, cfg_parallel=True).degrees(),
                       x=torch.zeros(4, 16, 4, 4), timestep=torch.zeros(4),
                       chunks=[("a", 2), ("b", 2)], conds={"a": cond, "b": {"context":
                                                                             torch.zeros(2, 5, 8)}})
    wire = HOST.to_wire(msg)
    assert _classes(wire) == set()
    got = P.from_wire(pickle.loads(pickle.dumps(wire)))
    assert got.config == Degrees(dp=1, cfg=2, pipefusion=1, ulysses=2, ring=1)
    assert isinstance(got.conds["a"], Conditioning) and isinstance(got.conds["b"], Conditioning)
    assert got.conds["a"].ref_method == "index" and got.conds["b"].pooled is None
    assert torch.equal(got.conds["a"].context, cond.context)


def test_a_result_carries_named_tensors():
    latents, images = torch.randn(1, 16, 4, 4), torch.rand(1, 32, 32, 3)
    wire = P.to_wire(P.Result(job_id=1, latents=Latents(samples=latents),
                              decoded=Decoded(images=images)))
    assert _classes(wire) == set()
    got = HOST.from_wire(wire)
    assert torch.equal(got.latents.samples, latents) and torch.equal(got.decoded.images, images)
    decode = HOST.from_wire(P.to_wire(P.Result(job_id=2, decoded=Decoded(images=images))))
    assert decode.latents is None
    doubled = got.latents.map(lambda name, t: t * 2)
    assert [n for n, _ in doubled.items()] == ["samples"]
    assert torch.equal(doubled.samples, latents * 2)


def test_degrees_are_by_name():
    d = Degrees.from_wire({"ulysses": 2, "ring": 1, "dp": 1, "cfg": 2, "pipefusion": 1})
    assert d == Degrees(cfg=2, ulysses=2) and d.sp == 2 and d.world == 4
    assert set(AXES) == set(d.to_wire())
    with pytest.raises(TypeError):  # never positional
        Degrees(1, 2, 1, 1, 2)
    with pytest.raises(ValueError, match="exactly the axes"):
        Degrees.from_wire({"dp": 1, "cfg": 1})
    assert Degrees(cfg=4).world == 4  # a guidance pass per cfg rank (LTX-2's four)
    with pytest.raises(ValueError, match="cfg must be an integer >= 1"):
        Degrees(cfg=0)
    bad = ("predict", dict(HOST.to_wire(HOST.Predict(call_id=1, config=Degrees(), x=None,
                                                     timestep=None))[1], config={"dp": 1}))
    with pytest.raises(P.ProtocolError, match="bad 'predict' message"):
        P.from_wire(bad)


def test_conditioning_shape_rules_in_one_place():
    ok = Conditioning(context=torch.zeros(2, 5, 8), pooled=torch.zeros(2, 4),
                      image_embeds=torch.zeros(2, 3, 6), ref_latents=[torch.zeros(2, 16, 4, 4)])
    assert ok.problems(2) == [] and ok.rows == 2
    assert ok.problems(1)[0].startswith("context must be [1, ..., ...]")
    bad = Conditioning(context=torch.zeros(2, 5), context_2=torch.zeros(1, 5, 8),
                       ref_latents=[torch.zeros(2, 16, 4)], ref_method=3)
    problems = bad.problems(2)
    assert len(problems) == 4, problems
    assert any("context_2 must be [2, ..., ...] (got (1, 5, 8))" in p for p in problems)
    assert Conditioning(context=torch.zeros(1, 2, 3), ref_latents=[]).problems(1) == \
        ["ref_latents must be a non-empty list of latents"]
    with pytest.raises(ValueError, match="context required"):
        Conditioning.from_wire({"cond": torch.zeros(1, 2, 3)})


def test_a_job_request_crosses_as_plain_values_and_arrives_typed():
    from workers.runtime.request import GenerationRequest
    from workers.sampling.cache_settings import CacheSettings
    host_request = worker_module("runtime.request").GenerationRequest
    req = host_request(prompt=[], positive={"cond": torch.randn(1, 5, 8),
                                            "pooled": torch.randn(1, 4)},
                       batch_size=2, steps=2, height=64, width=64, cache={"threshold": 0.1})
    assert type(req.positive).__name__ == "Conditioning" and req.batch == 2  # a dict, read
    req = req.resolved("flux")
    wire = HOST.to_wire(HOST.Job(job_id=1, request=req, config=Degrees(),
                                 noise=torch.zeros(2, 16, 4)))
    assert _classes(wire) == set()
    got = P.from_wire(pickle.loads(pickle.dumps(wire))).request
    assert isinstance(got, GenerationRequest) and isinstance(got.positive, Conditioning)
    assert got.cache == CacheSettings(threshold=0.1) and got.cfg == req.cfg == 1.0
    assert torch.equal(got.positive.context, req.positive.context) and got.negative is None
    unknown = ("job", dict(wire[1], request=dict(wire[1]["request"], colour="red")))
    with pytest.raises(P.ProtocolError, match="unknown \\['colour'\\]"):
        P.from_wire(unknown)


def test_a_request_names_each_bad_field_and_what_would_be_right():
    from workers.runtime.request import GenerationRequest
    bad = GenerationRequest(prompt=["a"], steps=0, height=100, seed=-1, output="png",
                            positive={"context": torch.zeros(3, 5, 8), "pooled": None},
                            batch_size=2, cache={"threshold": -1})
    problems = bad.problems()
    assert len(problems) == 6, problems  # one line per bad field
    for want in ("positive conditioning batch 3 is neither 1 nor the batch 2",
                 "seed must be an integer in [0, 2^64) (got -1)",
                 "steps must be an integer >= 1 (got 0)", "height 100 is not a positive "
                 "multiple of 16 (try 96)", "output must be 'latent' or 'image'",
                 "cache threshold must be a number >= 0"):
        assert any(want in p for p in problems), (want, problems)
    assert GenerationRequest(prompt=["a"], height=64, width=64).problems() == []
    # a conditioning that is no Conditioning is named, not taken
    assert GenerationRequest(prompt=[], positive={"text": 1}).problems()[0].startswith(
        "positive conditioning must be a Conditioning or a dict of its fields")
