"""Code that tests and benchmarks run inside the workers through `WorkerPool(worker_hooks=...)`
(workers/runtime/hooks.py): fault injection and the NCCL-rules emulation. Not part of the product:
ComfyUI never loads it."""
