"""Weight sharding by weight (`shard_split`, workers/parallel/uneven_sharding.py): GPUs of
different memory hold shares of the weights in proportion, exactly.

* Each rank reads only its rows of each tensor (3:1: rank 0 three quarters), the ranks
  together read every parameter byte once; at rest a rank holds its rows, inside a block its
  rows plus that block whole, after the job nothing gathered; the result equals the
  unsharded pool's (fp32, <= 1e-4). Negative control: the even split's reads are halves.
* fp8 storage (each rank quantises its own rows; the scales' all-reduce places them by the
  rows' offsets) and a whole load sharded afterwards (ranks loading in turn with fp8) equal
  the unsharded pool with the same options.

The conformance suite holds every family to one rank (tests/conformance/test_uneven_exact.py).
"""
from __future__ import annotations

import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig, WorkerPool

TOL = 1e-4
MEASURE = "xdit_testhooks.probes:measure_sharding"


def _request(batch=2):
    return GenerationRequest(prompt=["a photo of a red cat", "a dog on the grass"][:batch],
                             seed=7, steps=2, height=64, width=96, max_sequence_length=8,
                             cfg=2.0, negative_prompt="ugly")


def _run(path, config, **opts):
    with WorkerPool(str(path), config, device="cpu", threads_per_rank=1, **opts) as pool:
        res = pool.generate(_request())
        return res, pool.status()["ranks"]


def test_each_rank_reads_and_holds_its_share_and_the_result_is_exact(model_dir):
    path = model_dir("flux")
    want, _ = _run(path, ParallelConfig(ulysses=2))
    got, ranks = _run(path, ParallelConfig(ulysses=2), shard_weights=True, shard_split="3,1",
                      worker_hooks=[MEASURE])
    even, even_ranks = _run(path, ParallelConfig(ulysses=2), shard_weights=True)
    d = (got.samples - want.samples).abs().max().item()
    print(f"flux ulysses 2, weights 3:1: max abs vs unsharded {d:.2e}")
    assert d <= TOL and (even.samples - want.samples).abs().max().item() <= TOL
    reads = [r["load"]["bytes_read"] - r["load"]["buffer_bytes_read"] for r in ranks]
    assert all(r["load"]["loaded"] == "shards only" for r in ranks)
    even_reads = [r["load"]["bytes_read"] - r["load"]["buffer_bytes_read"] for r in even_ranks]
    assert sum(reads) == sum(even_reads)  # every parameter byte read once, either way
    print(f"read per rank, 3:1 {reads}, even {even_reads}")
    assert abs(reads[0] / sum(reads) - 0.75) < 0.03
    assert abs(even_reads[0] / sum(even_reads) - 0.5) < 0.03  # negative control
    held = [st["sharding"] for st in got.stats]
    for r, c in enumerate(held):
        local, big, total = c["block_params_local"], c["largest_block_params"], c["block_params"]
        assert abs(local / total - (0.75, 0.25)[r]) < 0.03, (r, c)
        assert c["block_params_resident_now"] == local  # nothing left gathered
        assert c["peak_block_params_between_blocks"] == local
        assert c["peak_block_params_in_block"] == local + big
    assert sum(c["block_params_local"] for c in held) == held[0]["block_params"]
    assert len({(c["forwards"], c["block_forwards"]) for c in held}) == 1


@pytest.mark.parametrize("load_in_turn,loaded", [(False, "shards only"),
                                                 (True, "whole, then sharded")])
def test_fp8_and_a_whole_load_sharded_by_weight_equal_unsharded(model_dir, load_in_turn,
                                                                loaded):
    path = model_dir("flux")
    opts = dict(dtype="bf16", weights="fp8")
    want, _ = _run(path, ParallelConfig(ring=2), **opts)
    got, _ = _run(path, ParallelConfig(ring=2), shard_weights=True, shard_split="1,3",
                  load_in_turn=load_in_turn, **opts)
    c = got.stats[1]["sharding"]
    assert c["load"] == loaded and c["shard_split"] == [1.0, 3.0]
    assert abs(c["block_params_local"] / c["block_params"] - 0.75) < 0.03
    d = (got.samples - want.samples).abs().max().item()
    print(f"bf16 fp8, weights 1:3, {loaded}: max abs vs unsharded {d:.2e}")
    assert d <= TOL


# -- the gather, in one process ------------------------------------------------------------
class _Block(torch.nn.Module):
    """A block whose parameters have rows on both ranks, on one only (one row; a 0-dim
    scale) and on none (0 rows)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.row = torch.nn.Parameter(torch.randn(1, 8))
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.nothing = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.lin(x) * self.scale + self.row + self.nothing.sum()


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class _TwoRanks:
    """Both ranks' shardings in one process: the all-gather reads each rank's window of the
    unit, checks they are the same size (as NCCL takes them) and records what was sent."""

    def __init__(self):
        self.shardings, self.sent = [], []

    def all_gather_into_tensor(self, out, x, group):
        assert group is self
        k = next(k for s in self.shardings for k, u in enumerate(s.units) if u.window is x)
        parts = [s.units[k].window for s in self.shardings]
        assert len({p.numel() for p in parts}) == 1 and out.numel() == 2 * x.numel()
        out.copy_(torch.cat(parts))
        self.sent.append(x)


def test_the_gather_sends_each_ranks_window_of_one_buffer_and_rebuilds_every_parameter(
        monkeypatch):
    """Weights 3:1: each unit's all-gather sends a view of the rank's one buffer (no padded
    copy per call), equal sizes on both ranks; every parameter is whole again, those with
    rows on one rank or none included, and the forward equals the unsharded model's. The
    small rank's buffer stays smaller; the counts are the shared definition's."""
    import copy

    from workers.parallel import topology
    from workers.parallel.uneven_sharding import UnevenWeightSharding

    torch.manual_seed(0)
    model, x = _Toy(), torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    ranks = _TwoRanks()
    monkeypatch.setattr(topology, "all_gather_into_tensor", ranks.all_gather_into_tensor)
    copies = [copy.deepcopy(model) for _ in range(2)]
    for r, m in enumerate(copies):
        ranks.shardings.append(UnevenWeightSharding(m, ["blocks"], ranks, "cpu", (3, 1), r))
    big, small = ranks.shardings
    assert small.shard_bytes() < big.shard_bytes()
    for r, (m, s) in enumerate(zip(copies, ranks.shardings)):
        ranks.sent.clear()
        with torch.no_grad():
            got = m(x)
        assert torch.equal(got, want), f"rank {r}"
        assert len(ranks.sent) == 3  # the root and two blocks, once each
        assert all(t.untyped_storage().data_ptr() == s.buffer.untyped_storage().data_ptr()
                   for t in ranks.sent)
        assert all(p.untyped_storage().size() == 0 for p in m.parameters())  # released
    counts = [s.counts() for s in ranks.shardings]
    assert sum(c["block_params_local"] for c in counts) == counts[0]["block_params"]
    assert [c["weight_bytes_local"] for c in counts] == [s.shard_bytes() for s in (big, small)]
    assert counts[1]["shard_split"] == [3.0, 1.0] and counts[1]["ranks"] == 2
