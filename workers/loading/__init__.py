"""Loading a transformer onto a rank, in one place:

* header.py — the header reader (names, dtypes, shapes, byte ranges) of safetensors and
  GGUF files.
* checkpoint.py — a checkpoint's tensors read one at a time by positioned reads.
* gguf_quant.py, gguf_load.py — GGUF blocks dequantised in torch ops; GGUF Linears kept in
  blocks and dequantised per call.
* meta.py — the transformer built on the meta device from a folder's config or a single
  file's weight shapes, its weights to be assigned.
* weights.py — tensor-by-tensor loading straight to the device, and fp8 storage.
* single_file.py — ComfyUI / BFL single files: their names converted to diffusers'.
* shards.py — shard-only loading for weight sharding: each rank reads its rows.
* stages.py — PipeFusion's stages: which blocks a rank holds, loading only those, and the
  hooks at a stage's boundaries.
* prefetch.py — the checkpoint read into the page cache while the worker still imports.
* transformer_file.py — a single file's family, naming, config and storage, from its header.
* loaded_model.py — the model a rank holds once loaded, whichever loader made it.

Nothing here imports the adapters (workers/models/): they call in.
"""
