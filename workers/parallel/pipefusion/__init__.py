"""PipeFusion: patch-level pipeline parallelism over the transformer's blocks, in one place.

Each pipeline stage holds a contiguous run of blocks. The image's token rows are cut into
`patches` bands. During `warmup_steps` a whole image goes through the stages in one piece
(exact; it fills every layer's K/V cache). After that the patches flow through the stages
one after another: while stage 1 works on patch 0, stage 0 already computes patch 1. In every
attention layer a patch's queries see a K/V cache of the full sequence in which only that
patch's slice (and the text and reference images, carried by each step's first patch) is
fresh; the rest is one step stale. The last stage finishes a patch's Euler step and sends
those latent rows straight back to stage 0, which starts the next step with them: there is
no bubble between steps, only the fill at the start. Ulysses/Ring run inside a stage,
cfg-parallel pipelines exchange the last stage's predictions per patch, dp replicas are
independent pipelines.

It plugs into the plain denoising loop (workers/sampling/denoise.py) as one `StepStrategy`,
`PatchPipeline` (workers/sampling/patch_pipeline.py): it walks the tick table, does the
transfers, the patch calls and the last stage's guidance and Euler step on a patch's rows.
This package holds the parts it runs on:

* schedule.py — the tick table: which micro-batch each stage computes when, NCCL-safe;
* plan.py — `PatchPlan`: the tokens one patch call computes (a SequencePlan);
* cache.py — `PatchAttention` and the job's K/V caches;
* activations.py — a job's activation slots at a stage's boundaries (which blocks a
  rank holds, loading only those and the boundary hooks: workers/loading/stages.py).

Nothing here is imported at package import.
"""
