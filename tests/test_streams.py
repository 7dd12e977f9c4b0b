"""Token streams declared as data (workers/streams.py) and the shared code that works
from the declaration (workers/parallel/sequence_parallel.py, attention.py).

* A three-stream layout (text held whole on every rank, video and audio sharded) splits,
  pads and positions its tokens right at sp 2 and 3 with lengths no degree divides.
* Wrong declarations are refused with a message that says what is wrong.
* Multi-process (gloo, forked from one launcher): a toy module with that layout, its video
  and audio each self-attending, cross-attending each other in both directions, the video
  reaching the text, and one joint attention over all three, gives under Ulysses 2, Ring 2
  and Ring 3 what one process gives with plain attention; its outputs are gathered by the
  sequence-parallel gather.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.parallel.sequence_parallel import SequenceLayout, SequencePlan  # noqa: E402
import gloo_worlds  # noqa: E402
from toy_streams import attend_streams  # noqa: E402
from workers.streams import Attention, Stream, TokenLayout  # noqa: E402

LENGTHS = {"text": 5, "video": 11, "audio": 7}  # none divisible by 2 or 3
ATTENTIONS = (
    Attention(("video",)), Attention(("audio",)),
    Attention(("video",), ("audio",)), Attention(("audio",), ("video",)),  # both directions
    Attention(("video",), ("text",)),  # keys held whole: no exchange
    Attention(("text", "video", "audio")),  # joint, with the replicated stream in it
)
LAYOUT = TokenLayout((Stream("text", "text", "replicate"), Stream("video", "latent"),
                      Stream("audio", "context")), ATTENTIONS)


def _plans(sp, padded):
    return [SequencePlan(r, sp, dict(LENGTHS), padded=padded, layout=LAYOUT)
            for r in range(sp)]


@pytest.mark.parametrize("sp", [2, 3])
def test_three_streams_split_near_evenly_and_replicate(sp):
    for plan in _plans(sp, False):
        assert plan.sizes("video") == [11 // sp + (r < 11 % sp) for r in range(sp)]
        assert plan.sizes("audio") == [7 // sp + (r < 7 % sp) for r in range(sp)]
        assert plan.sizes("text") == [5] * sp  # whole on every rank
        assert plan.local_slice("text") == slice(0, 5)
        assert plan.context_streams() == ("audio",)
        assert plan.latent_stream == "video" and plan.text_stream == "text"
        assert plan.lengths(("video", "audio")) == [
            a + b for a, b in zip(plan.sizes("video"), plan.sizes("audio"))]
        assert plan.lengths() == [5 + a + b for a, b in
                                  zip(plan.sizes("video"), plan.sizes("audio"))]


@pytest.mark.parametrize("sp", [2, 3])
@pytest.mark.parametrize("padded", [True, False])
def test_three_streams_shard_pad_and_rejoin(sp, padded):
    full = {s: torch.arange(n).float().view(1, n, 1) + 100 * i
            for i, (s, n) in enumerate(LENGTHS.items())}
    for s in ("video", "audio"):
        parts = []
        for plan in _plans(sp, padded):
            x = plan.shard(full[s], 1, s)
            assert x.shape[1] == plan.local_len(s)
            assert x.shape[1] == (max(plan.sizes(s)) if padded else plan.sizes(s)[plan.sp_rank])
            n = plan.sizes(s)[plan.sp_rank]
            assert torch.equal(x[:, n:], torch.zeros_like(x[:, n:]))  # the padding: zeros
            parts.append(x[:, :n])
        assert torch.equal(torch.cat(parts, 1), full[s])  # every token once, in order
    for plan in _plans(sp, padded):
        assert plan.shard(full["text"], 1, "text") is full["text"]


@pytest.mark.parametrize("sp", [2, 3])
def test_three_streams_positions_cover_each_token_once(sp):
    order = ("text", "video", "audio")
    total = sum(LENGTHS.values())
    seen = torch.cat([p.positions(("video", "audio")) for p in _plans(sp, False)])
    assert sorted(seen.tolist()) == list(range(LENGTHS["video"] + LENGTHS["audio"]))
    for plan in _plans(sp, False):
        pos = plan.positions(order)
        assert pos[:5].tolist() == list(range(5))  # the whole text, on every rank
        assert pos.numel() == plan.lengths(order)[plan.sp_rank] and pos.max() < total


def test_all_sharded_view_keeps_the_counts():
    plan = SequencePlan(1, 3, dict(LENGTHS), padded=True, layout=LAYOUT)
    view = plan.all_sharded()
    assert view.tokens == plan.tokens and view.padded
    assert view.sizes("text") == [2, 2, 1] and plan.sizes("text") == [5, 5, 5]
    assert view.layout.attentions == LAYOUT.attentions


def test_a_patch_plan_takes_latent_rows_and_the_context_with_the_first_patch():
    """PipeFusion on the three streams: a patch computes a range of the latent stream; the
    branch's first patch of a step also computes every other stream; the stage boundary
    carries the sharded context (the audio), never the replicated text."""
    from workers.parallel.pipefusion.activations import carried_context
    from workers.parallel.pipefusion.plan import PatchPlan
    later = [PatchPlan(r, 2, dict(LENGTHS), layout=LAYOUT, image_range=(3, 8),
                       with_text=False) for r in range(2)]
    assert [p.selected(s) for p in later[:1] for s in LENGTHS] == [(0, 0), (3, 5), (0, 0)]
    assert [p.local_slice("video") for p in later] == [slice(3, 6), slice(6, 8)]
    assert [carried_context(p, p.sp_rank) for p in later] == [0, 0]
    first = [PatchPlan(r, 2, dict(LENGTHS), layout=LAYOUT, image_range=(0, 4))
             for r in range(2)]
    assert first[0].selected("audio") == (0, 7) and first[0].selected("text") == (0, 5)
    assert [carried_context(p, p.sp_rank) for p in first] == [4, 3]  # the audio's shares
    assert first[0].key(("video",)) != later[0].key(("video",))


# -- wrong declarations -------------------------------------------------------------------
@pytest.mark.parametrize("streams,attentions,message", [
    ((Stream("text", "text"), Stream("video", "latent")), (Attention(("video", "audio")),),
     "declares only ['text', 'video']"),
    ((Stream("video", "latent"), Stream("video", "context")), (), "stream names repeat"),
    ((Stream("text", "text"), Stream("video", "latent", "replicate")), (),
     "one sharded stream must have the role 'latent'"),
    ((Stream("video", "latent"), Stream("audio", "latent")), (),
     "one sharded stream must have the role 'latent'"),
    ((Stream("video", "latent", "split"),), (), "splits 'split'"),
    ((Stream("video", "latent"), Stream("audio", "sound")), (), "has role 'sound'"),
    ((Stream("video", "latent", pad_multiple=0),), (), "pads to a multiple of 0"),
    ((Stream("video", "latent"), Stream("audio")), (Attention(("video",)),),
     "streams ['audio'] take part in no attention"),
])
def test_a_wrong_layout_is_refused_with_what_is_wrong(streams, attentions, message):
    with pytest.raises(ValueError, match="token layout") as e:
        TokenLayout(streams, attentions)
    assert message in str(e.value)


def test_a_plan_must_count_every_declared_stream():
    with pytest.raises(ValueError, match=r"gives token counts for \['text', 'video'\], the "
                                         r"layout declares the streams \['text', 'video', "
                                         r"'audio'\]"):
        SequencePlan(0, 2, {"text": 5, "video": 11}, layout=LAYOUT)
    with pytest.raises(ValueError, match="whole numbers >= 0"):
        SequencePlan(0, 2, dict(LENGTHS, audio=-1), layout=LAYOUT)


def test_an_undeclared_attention_is_refused():
    assert LAYOUT.attention(("audio",), ("video",)).keys == ("video",)
    with pytest.raises(ValueError, match=r"attention of text over video is not declared.*"
                                         r"declared: video -> video, audio -> audio"):
        LAYOUT.attention(("text",), ("video",))


def test_a_sequence_layout_splits_only_declared_streams():
    with pytest.raises(ValueError, match=r"splits streams \['image'\], which its token layout "
                                         r"does not declare"):
        SequenceLayout(split_inputs={"hidden_states": ("image", 1)}, split_outputs={},
                       gather_output=("proj_out", 1), token_counts=None,
                       attention_processor=None, replaces=(), streams=LAYOUT)


def test_the_families_declare_what_their_flags_said():
    """Wan's text is held whole and reached by cross-attention (outside the memory plan's
    sequence); Z-Image pads both streams to 32; Qwen-Image's positions follow its token
    order and it pads odd references; the rest keep the joint text + image default."""
    from workers import families
    f = families.FAMILIES
    assert not f["wan"].tokens.in_sequence("text")
    assert f["wan"].tokens.stream("text").split == "replicate"
    assert all(s.pad_multiple == 32 for s in f["z_image"].tokens.streams)
    q = f["qwen_image"].tokens.latent
    assert q.positions == "order" and q.pads_odd_references
    for fid in ("flux", "flux2", "chroma", "sd3", "hunyuan_video15", "qwen_image"):
        assert f[fid].tokens.in_sequence("text"), fid


# -- multi-process: Ulysses and Ring on the toy three-stream module ---------------------
HEADS, DIM, WIDTH = 6, 4, 24  # 6 heads: Ulysses 2 and 3 divide them


class ToyStreams(torch.nn.Module):
    """Each stream's own q/k/v projections; a stream's output sums its queries' results over
    every attention it is a query of (the layout's)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.proj = {s: [torch.randn(WIDTH, HEADS * DIM, generator=gen) / WIDTH ** 0.5
                         for _ in range(3)] for s in LENGTHS}

    def forward(self, x: dict, attend, local_len) -> dict:
        """`x`: stream -> [B, S, WIDTH] (this rank's tokens); `attend(q, k, v, queries,
        keys)`; `local_len(stream)`: its tokens in `x`."""
        qkv = {s: [(t @ w).unflatten(-1, (HEADS, DIM)) for w in self.proj[s]]
               for s, t in x.items()}
        return attend_streams(qkv, ATTENTIONS, attend, local_len)


def _plain(q, k, v, queries, keys):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)


def _toy_cases(rank, world, ulysses, ring, report):
    from workers.parallel.attention import ShardedAttention
    from workers.parallel.sequence_parallel import gather_stream
    from workers.parallel.topology import build_topology

    topo = build_topology(rank, world, 1, 1, 1, ulysses, ring)
    gen = torch.Generator().manual_seed(11)
    full = {s: torch.randn(2, n, WIDTH, generator=gen) for s, n in LENGTHS.items()}
    toy = ToyStreams()
    want = toy(full, _plain, lambda s: LENGTHS[s])
    for fault in ("", "keep_padding"):
        attn = ShardedAttention(topo, "cpu", fault=fault)
        for padded in (True, False):
            plan = SequencePlan(topo.sp_rank, topo.sp, dict(LENGTHS), padded=padded,
                                layout=LAYOUT)
            local = {s: plan.shard(t, 1, s) for s, t in full.items()}
            got = toy(local, lambda q, k, v, qs, ks: attn(q, k, v, plan, qs, keys=ks),
                      plan.local_len)
            for s in LENGTHS:
                whole = gather_stream(got[s], 1, plan, s, topo.group("sp")) \
                    if plan.sharded(s) else got[s]
                report[f"u{ulysses}r{ring}/{fault or 'exact'}/"
                       f"{'padded' if padded else 'unpadded'}/{s}"] = \
                    float((whole - want[s]).abs().max())
    # the undeclared attention is refused on the parallel path too
    plan = SequencePlan(topo.sp_rank, topo.sp, dict(LENGTHS), padded=True, layout=LAYOUT)
    q = torch.zeros(2, plan.local_len("text"), HEADS, DIM)
    try:
        ShardedAttention(topo, "cpu")(q, q, q, plan, ("text",), keys=("text",))
        report[f"u{ulysses}r{ring}/undeclared"] = "ran"
    except ValueError as e:
        report[f"u{ulysses}r{ring}/undeclared"] = str(e)


WORLDS = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gloo_worlds.reports(__file__, tmp_path_factory.mktemp("streams"), WORLDS)


@pytest.mark.parametrize("layout", ["u2r1", "u1r2", "u3r1", "u1r3"])
def test_ulysses_and_ring_are_exact_on_three_streams(reports, layout):
    got = [(r, k, v) for rep in reports.values() for r, one in enumerate(rep)
           for k, v in one.items() if k.startswith(f"{layout}/exact/")]
    assert len(got) == 2 * len(LENGTHS) * int(layout[1] if layout[1] != "1" else layout[3])
    for rank, key, diff in got:
        assert diff <= 1e-5, (rank, key, diff)


@pytest.mark.parametrize("layout", ["u2r1", "u1r2", "u3r1", "u1r3"])
def test_keeping_padded_keys_is_caught(reports, layout):
    """Negative control: the padded keys kept (an uneven shard's zeros attended) moves the
    sharded streams' outputs far beyond the tolerance."""
    got = {k: v for rep in reports.values() for one in rep for k, v in one.items()
           if k.startswith(f"{layout}/keep_padding/padded/")}
    assert max(got.values()) > 1e-3, got


def test_the_parallel_attention_refuses_an_undeclared_one(reports):
    for rep in reports.values():
        for one in rep:
            for k, v in one.items():
                if k.endswith("/undeclared"):
                    assert "attention of text over text is not declared" in v, (k, v)


if __name__ == "__main__" and sys.argv[1:2] == ["launch"]:
    gloo_worlds.launch(sys.argv[2], WORLDS, _toy_cases)
