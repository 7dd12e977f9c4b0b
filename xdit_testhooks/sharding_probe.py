"""Weight sharding, observed from inside a worker (tests): forwards counted per rank, the
block weights resident inside and between blocks, and the bytes each forward's all-gathers
bring in, read from FSDP's own buffers. Attached by `probes.measure_sharding`; the product
keeps only the hook point (workers/parallel/sharding.py `WeightSharding.probe`).

Each residency reading walks every block's FSDP groups, so it never runs in production,
where it would put O(blocks^2) Python into every forward and hold up FSDP2's prefetch."""
from __future__ import annotations


class ShardingProbe:
    def __init__(self, sharding):
        self.sharding = sharding
        self.forwards = 0  # transformer forwards run while sharded
        self.block_forwards = 0
        self.gathered = 0  # parameter elements all-gathered (whole tensors) so far
        self.peak_in_block = self.peak_between = 0
        numel = {id(b): n for b, n in zip(sharding.blocks, sharding.block_numels)}
        # an all-gather's input is the rank's padded shard; each rank receives the others'
        self.received_per_forward = sharding.received_per_forward()

        def enter(module, args):
            self.forwards += 1
            self.gathered += sharding.root_numel

        def block(module, args):  # after FSDP's own pre-forward: gathered + prefetch
            self.block_forwards += 1
            self.gathered += numel[id(module)]
            self.peak_in_block = max(self.peak_in_block, sharding.block_resident())

        def after(module, args, output):  # after FSDP's post-forward: resharded
            self.peak_between = max(self.peak_between, sharding.block_resident())

        sharding.transformer.register_forward_pre_hook(enter)
        for b in sharding.blocks:
            b.register_forward_pre_hook(block)
            b.register_forward_hook(after)

    def counts(self) -> dict:
        return {"peak_block_params_between_blocks": self.peak_between,
                "peak_block_params_in_block": self.peak_in_block,
                "received_bytes_per_forward_per_rank": self.received_per_forward,
                "forwards": self.forwards, "block_forwards": self.block_forwards,
                "gathered_params": self.gathered}
