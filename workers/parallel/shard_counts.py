"""What a weight sharding holds on a rank (`counts()`, in `status` and every job's stats):
one definition for FSDP2's even split (workers/parallel/sharding.py) and the split by weight
(workers/parallel/uneven_sharding.py), so their figures mean the same."""
from __future__ import annotations

# summed over a model's transformers (Wan 2.2's two experts, each sharded alike)
SUMMED = ("block_params", "block_params_local", "block_params_resident_now",
          "nonblock_params", "nonblock_params_local", "weight_bytes_local")


def sharding_counts(s, block_local: int, nonblock_local: int, **extra) -> dict:
    """Sharding `s`'s counts in parameter elements: its blocks' and the rest's, whole and
    this rank's (`block_local`, `nonblock_local`), what is allocated now, `extra` figures of
    its own; its model's other transformers (`s.others`) added in, and the test probe's
    readings (`s.probe`)."""
    out = {"ranks": s.world, "load": s.load_mode,
           "block_params": sum(s.block_numels), "largest_block_params": max(s.block_numels),
           "block_params_local": block_local,
           "block_params_resident_now": s.block_resident(),
           "nonblock_params": s.root_numel, "nonblock_params_local": nonblock_local, **extra}
    for o in s.others:
        c = o.counts()
        for k in SUMMED:
            if k in out:
                out[k] += c[k]
        out["largest_block_params"] = max(out["largest_block_params"],
                                          c["largest_block_params"])
    if s.others:
        out["transformers"] = 1 + len(s.others)
    if s.probe is not None:
        out.update(s.probe.counts())
    return out
