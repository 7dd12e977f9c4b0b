"""Uneven splits (docs/design.md#numerics-rule-7: uneven is exact too): the shares'
arithmetic (workers/parallel/shares.py), the sequence plan's shards by weight, and the
sharded attention over unpadded shards of unequal length (workers/parallel/uneven.py:
Ulysses' all-to-all with per-rank split sizes, Ring with unequal blocks, the hybrid).

Multi-process (gloo ranks): the three-stream toy of tests/test_streams.py (a replicated text,
video and audio sharded; self, cross and joint attentions) and a text + image layout whose
rows carry their own text lengths give, under weights 3:1, 1:2:4 and 1:3:2:1, what one
process gives with plain attention. Negative control: the same shards attended as if they
were the even split's (the weights dropped on the attention's side) fail.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gloo_worlds  # noqa: E402
from toy_streams import attend_streams  # noqa: E402
from workers.parallel.degrees import Degrees  # noqa: E402
from workers.parallel.sequence_parallel import SequencePlan  # noqa: E402
from workers.parallel.shares import parse_split, share_sizes, sizes_for  # noqa: E402
from workers.streams import Attention, Stream, TokenLayout, even_sizes, text_image  # noqa: E402

LENGTHS = {"text": 5, "video": 23, "audio": 13}
ATTENTIONS = (
    Attention(("video",)), Attention(("audio",)),
    Attention(("video",), ("audio",)), Attention(("audio",), ("video",)),
    Attention(("video",), ("text",)),
    Attention(("text", "video", "audio")),
)
LAYOUT = TokenLayout((Stream("text", "text", "replicate"), Stream("video", "latent"),
                      Stream("audio", "context")), ATTENTIONS)
WEIGHTS = {2: (3.0, 1.0), 3: (1.0, 2.0, 4.0), 4: (1.0, 3.0, 2.0, 1.0)}


# -- the arithmetic -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 23, 64, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_equal_weights_are_exactly_the_even_split(n, parts):
    assert share_sizes(n, [2.5] * parts) == even_sizes(n, parts)
    assert sizes_for(n, parts, ()) == even_sizes(n, parts)


@pytest.mark.parametrize("n,weights,want", [
    (100, (3, 1), [75, 25]), (10, (2, 1), [7, 3]), (23, (1, 2, 4), [3, 7, 13]),
    (3, (100, 1, 1), [1, 1, 1]),  # every rank keeps a token while there are enough
    (1, (1, 5), [0, 1]),
])
def test_shares_are_proportional_and_whole(n, weights, want):
    got = share_sizes(n, weights)
    assert got == want and sum(got) == n


def test_a_split_is_parsed_or_refused_in_one_line():
    assert parse_split("even", 2) == () and parse_split("auto", 2) == "auto"
    assert parse_split("3,2", 2) == (3.0, 2.0) and parse_split("2,2", 2) == ()
    for bad, says in (("3,2,1", "3 weights for 2 ranks"), ("3,-1", "positive numbers"),
                      ("fast", "'even', 'auto' or 2 positive weights")):
        with pytest.raises(ValueError, match=says):
            parse_split(bad, 2)


def test_degrees_carry_the_split_off_the_axes():
    d = Degrees(ulysses=2, split=(3, 1))
    assert d.axes() == dict(dp=1, cfg=1, pipefusion=1, ring=1, ulysses=2)
    assert d.to_wire() == dict(d.axes(), split=[3, 1])
    assert Degrees.from_wire(d.to_wire()) == d and d.evenly() == Degrees(ulysses=2)
    assert Degrees(ring=2, split=(1, 1)).to_wire() == Degrees(ring=2).to_wire()  # even
    with pytest.raises(ValueError, match="3 weights for 2 ranks"):
        Degrees(ulysses=2, split=(1, 2, 3))


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_a_weighted_plan_shards_every_token_once_unpadded(sp):
    full = {s: torch.arange(n).float().view(1, n, 1) for s, n in LENGTHS.items()}
    plans = [SequencePlan(r, sp, dict(LENGTHS), layout=LAYOUT, weights=WEIGHTS[sp])
             for r in range(sp)]
    assert plans[0].uneven and plans[0].sizes("video") == share_sizes(23, WEIGHTS[sp])
    for s in ("video", "audio"):
        parts = [p.shard(full[s], 1, s) for p in plans]
        assert [x.shape[1] for x in parts] == share_sizes(LENGTHS[s], WEIGHTS[sp])
        assert torch.equal(torch.cat(parts, 1), full[s])


# -- multi-process --------------------------------------------------------------------------
HEADS, DIM, WIDTH = 12, 4, 24  # Ulysses 2, 3 and 4 divide 12


def _plain(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)


def _project(x, gen):
    return [(x @ (torch.randn(WIDTH, HEADS * DIM, generator=gen) / WIDTH ** 0.5))
            .unflatten(-1, (HEADS, DIM)) for _ in range(3)]


def _toy(x, attend, local_len):
    gen = torch.Generator().manual_seed(3)
    qkv = {s: _project(t, gen) for s, t in sorted(x.items())}
    return attend_streams(qkv, ATTENTIONS, attend, local_len)


def _cases(rank, world, ulysses, ring, report):
    from workers.parallel.attention import ShardedAttention
    from workers.parallel.sequence_parallel import gather_stream
    from workers.parallel.topology import build_topology

    topo = build_topology(rank, world, 1, 1, 1, ulysses, ring)
    name = f"u{ulysses}r{ring}"
    attn = ShardedAttention(topo, "cpu")
    gen = torch.Generator().manual_seed(11)
    full = {s: torch.randn(2, n, WIDTH, generator=gen) for s, n in LENGTHS.items()}
    want = _toy(full, lambda q, k, v, qs, ks: _plain(q, k, v), lambda s: LENGTHS[s])
    plan = SequencePlan(topo.sp_rank, topo.sp, dict(LENGTHS), layout=LAYOUT,
                        weights=WEIGHTS[world])
    local = {s: plan.shard(t, 1, s) for s, t in full.items()}
    got = _toy(local, lambda q, k, v, qs, ks: attn(q, k, v, plan, qs, keys=ks),
               plan.local_len)
    for s in LENGTHS:
        whole = gather_stream(got[s], 1, plan, s, topo.group("sp")) if plan.sharded(s) \
            else got[s]
        report[f"{name}/streams/{s}"] = float((whole - want[s]).abs().max())

    # text + image, joint, rows of their own text lengths (the rest of the text is padding)
    lay = text_image()
    tokens, real = {"text": 9, "image": 29}, [9, 4]
    q, k, v = (torch.randn(2, 38, HEADS, DIM, generator=gen) for _ in range(3))
    rows = []
    for b, n in enumerate(real):
        keep = torch.cat([torch.arange(n), torch.arange(9, 38)])
        rows.append(_plain(q[b:b + 1], k[b:b + 1, keep], v[b:b + 1, keep]))
    want = torch.cat(rows)
    for weights, tag in ((WEIGHTS[world], "exact"), ((), "weights_dropped")):
        mine = SequencePlan(topo.sp_rank, topo.sp, dict(tokens), layout=lay,
                            weights=WEIGHTS[world])
        seen = SequencePlan(topo.sp_rank, topo.sp, dict(tokens), layout=lay, weights=weights)
        idx = mine.positions(("text", "image"))
        loc = [t[:, idx] for t in (q, k, v)]
        try:
            out = attn(*loc, seen, ("text", "image"), text_lengths=real)
            from workers.parallel.topology import all_gather
            back = torch.zeros_like(q)
            mine_out = torch.zeros(2, max(mine.lengths()), HEADS, DIM)
            mine_out[:, :out.shape[1]] = out
            parts = [torch.zeros_like(mine_out) for _ in range(topo.sp)]
            all_gather(parts, mine_out, group=topo.group("sp"))
            for r, p in enumerate(parts):
                back[:, mine.positions(("text", "image"), r)] = p[:, :mine.lengths()[r]]
            report[f"{name}/rows/{tag}"] = float((back - want).abs().max())
        except RuntimeError as e:  # the control may be refused outright: also caught
            report[f"{name}/rows/{tag}"] = f"refused: {str(e).splitlines()[0]}"


WORLDS = {2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gloo_worlds.reports(__file__, tmp_path_factory.mktemp("uneven"), WORLDS)


@pytest.mark.parametrize("layout", ["u2r1", "u1r2", "u3r1", "u1r3", "u2r2", "u4r1", "u1r4"])
def test_uneven_shards_attend_exactly(reports, layout):
    got = [(r, k, v) for rep in reports.values() for r, one in enumerate(rep)
           for k, v in one.items() if k.startswith(f"{layout}/") and "dropped" not in k]
    assert len(got) >= 4
    for rank, key, diff in got:
        assert isinstance(diff, float) and diff <= 1e-5, (rank, key, diff)


@pytest.mark.parametrize("layout", ["u2r1", "u1r2", "u2r2"])
def test_negative_control_shares_on_one_side_only(reports, layout):
    """The shards cut by weight but attended as the even split's: wrong (or refused)."""
    got = [one[f"{layout}/rows/weights_dropped"] for rep in reports.values() for one in rep
           if f"{layout}/rows/weights_dropped" in one]
    assert got and all(isinstance(v, str) or v > 1e-3 for v in got), got


if __name__ == "__main__" and sys.argv[1:2] == ["launch"]:
    gloo_worlds.launch(sys.argv[2], WORLDS, _cases)
