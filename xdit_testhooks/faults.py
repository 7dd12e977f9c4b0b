"""Known bugs injected into a worker for the tests' negative controls."""


def lse_zero(ctx):
    """Ring attention merges blocks with a zero log-sum-exp (yunchang TORCH_MATH's bug)."""
    ctx.options["attention_fault"] = "lse_zero"


def keep_padding(ctx):
    """Padded keys of uneven shards are kept in the attention."""
    ctx.options["attention_fault"] = "keep_padding"


# ---- transfer schedules that gloo forgives and NCCL does not (negative controls for the
# NCCL-rules emulation, xdit_testhooks/nccl_rules.py) --------------------------------------
def early_dp_receive(ctx):
    """The old data-parallel collector: rank 0 posts its receives from the other replicas'
    leaders when the job starts; they send when it ends (after every step's broadcasts)."""
    import torch
    import torch.distributed as dist

    import workers.sampling.denoise as denoise
    import workers.parallel.p2p as p2p

    p2p.warm_pairs = lambda *a, **k: None  # the old code created pair links lazily
    original = denoise.run_job

    def run_job(job, model, adapter, topo, control, emit=None, should_stop=lambda: False,
                **kw):
        dp = topo.degree("dp")
        if dp == 1:
            return original(job, model, adapter, topo, control, emit, should_stop, **kw)
        leaders = [topo.global_rank(dp=d, cfg=0, pipefusion=0, ring=0, ulysses=0)
                   for d in range(dp)]
        posted = []
        if topo.rank == 0:
            for src in leaders[1:]:
                buf = torch.empty(1, device=model.device)
                posted.append(dist.irecv(buf, src=src))
        out = original(job, model, adapter, topo, control, emit, should_stop, **kw)
        if topo.rank in leaders[1:]:
            dist.send(torch.zeros(1, device=model.device), dst=0)
        for work in posted:
            work.wait()
        return out

    denoise.run_job = run_job


def ungrouped_exchange(ctx):
    """Point-to-point issued one by one, sends before receives (what the old PipeFusion did
    on a stage pair): fine on gloo, where a send does not wait for its receive; on NCCL both
    directions of a pair share one ordered stream and the two sends wait for each other."""
    import torch.distributed as dist

    import workers.parallel.p2p as p2p

    class _Done:
        def __init__(self, bufs, works):
            self.bufs, self.works = bufs, works

        def wait(self):
            for w in self.works:
                w.wait()
            return self.bufs

    def post(sends, recvs, group, device):
        works = [dist.isend(t.contiguous(), dst=peer, group=group) for t, peer in sends]
        bufs = []
        for shape, dtype, peer in recvs:
            import torch
            buf = torch.empty(shape, dtype=dtype, device=device)
            works.append(dist.irecv(buf, src=peer, group=group))
            bufs.append(buf)
        return _Done(bufs, works)

    p2p.post = post


def cpu_on_data_plane(ctx):
    """CFG parallel's all-gather of the two predictions is handed host copies: the bug class
    NCCL punishes hardest (a CPU tensor in a device collective). With the plane check on
    (the shared-GPU and NCCL-rules modes) it must be reported, by name."""
    import workers.sampling.flow_step as flow_step
    import workers.sampling.guidance as guidance

    real = flow_step.all_gather

    def all_gather(parts, x, group):
        return real([p.cpu() for p in parts], x.cpu(), group=group)

    # the whole-image step gathers its passes in guidance.py, PipeFusion's in flow_step.py
    flow_step.all_gather = guidance.all_gather = all_gather


def unreduced_cache(ctx):
    """The step cache's decision taken per shard, not over the row: sequence-parallel rank 1
    sees a zero change (so it skips whenever it may) while rank 0 reduces nothing and keeps
    its own number. The ranks of one row then disagree, and the one that skipped leaves its
    peer alone in the next collective: the bug the reduction exists for, which the NCCL-rules
    emulation must report (a skip that happened to agree would pass unnoticed)."""
    import workers.sampling.step_cache as step_cache

    real = step_cache.call_on_ranks

    def call_on_ranks(run, model, adapter, keys, topo, control, sharded, *args, **kw):
        call = real(run, model, adapter, keys, topo, control, sharded, *args, **kw)
        if call is not None and topo.sp > 1:
            def own(t):
                if topo.sp_rank == 1:
                    t[:, 0] = 0
            call.reduce = own
        return call

    step_cache.call_on_ranks = call_on_ranks
    import workers.sampling.denoise as denoise
    import workers.sampling.model_call as model_call
    denoise.call_on_ranks = model_call.call_on_ranks = call_on_ranks


def split_gather_even(ctx):
    """An uneven split applied on one side only: the input hooks shard the tokens by the
    split's weights, the output gather reads the shards as the even split's (each cut or
    padded to the even length, so the collective still matches)."""
    import dataclasses

    import workers.parallel.sequence_parallel as sp

    real = sp.gather_stream

    def gather_stream(x, dim, plan, stream, group):
        even = dataclasses.replace(plan, weights=())
        if plan.sharded(stream) and plan.sp_size > 1:
            x = sp.pad_tokens(x.narrow(dim, 0, min(x.shape[dim], max(even.sizes(stream)))),
                              dim, max(even.sizes(stream)))
        return real(x, dim, even, stream, group)

    sp.gather_stream = gather_stream


def shard_rows_swapped(ctx):
    """Weight sharding by weight (workers/parallel/uneven_sharding.py) reassembles each
    parameter with the ranks' rows in reverse rank order: every collective still matches,
    only the weights are wrong."""
    import torch

    import workers.parallel.uneven_sharding as us

    real = us.UnevenWeightSharding.gather

    def gather(self, u):
        real(self, u)
        for e in u.params:
            if len([n for n in e.rows if n]) < 2:
                continue
            whole = e.param.data.reshape((-1,) + e.shape[1:])
            parts = torch.split(whole, e.rows)
            e.param.data = torch.cat(parts[::-1]).view(e.shape)

    us.UnevenWeightSharding.gather = gather


def passes_from_the_wrong_rank(ctx):
    """The gather of a step's guidance passes files each prediction under the next pass's
    name (pass p read from the slot of pass p + 1, an off-by-one in which cfg rank ran it):
    every collective still matches, only the combination reads the wrong passes."""
    import workers.sampling.denoise as denoise

    real = denoise.gather_passes

    def gather_passes(mine, n, degree, group):
        got = real(mine, n, degree, group)
        return got[1:] + got[:1]

    denoise.gather_passes = gather_passes


def pipefusion_local_sound(ctx):
    """PipeFusion with ulysses / ring inside a stage: an attention that reads or writes a
    stream denoised beside the latent's (a sound track) is not exchanged over the stage's
    sp ranks, so each rank's sound sees only its own shard of the other tokens (MiniMax-H3's
    joint attention, LTX-2's sound queries over the video)."""
    from workers.parallel.pipefusion.cache import PatchAttention

    real = PatchAttention.exchanges

    def exchanges(self, plan, streams, keys):
        if any(plan.layout.stream(s).denoised for s in (*streams, *keys)):
            return False
        return real(self, plan, streams, keys)

    PatchAttention.exchanges = exchanges
