"""The denoiser behind the xDiT MODEL, without importing ComfyUI (tested in CI).

ComfyUI's samplers call a MODEL's diffusion model as `(x, timestep, context, y, guidance,
control, transformer_options, ...)`, with the conditional and unconditional rows of a step
side by side in one batch. `PoolDenoiser` turns each such call into one pool request
(workers/model_call.py) and returns what ComfyUI's own FLUX / SD3 model would return:

* x: model-space latents [N, 16, h, w] (ComfyUI has already applied the latent format);
* timestep: FLUX gets sigma, SD3 sigma * 1000 (ComfyUI's model sampling); the pool speaks
  the diffusers pipelines' sigma * 1000 for both;
* the output: the flow (velocity) prediction in x's layout.

A conditioning crosses to the pool once per sampling run: ComfyUI names the conditioning of
each chunk of rows in `transformer_options["uuids"]` (fresh for every sampling run), so a
chunk's key is its uuid, row count and token count; without uuids (a caller outside
ComfyUI's samplers) the key is a hash of the tensors. Anything the pool cannot honour
(ControlNet, attention patches, masks, reference latents) is refused with a clear message.
"""
from __future__ import annotations

import collections
import hashlib
from .config import ConfigError, ParallelConfig

# inputs a FLUX / SD3 diffusion model call may carry that we pass on or check
_KNOWN = {"y", "guidance", "control", "transformer_options", "attention_mask", "ref_latents",
          "ref_latents_method"}


class PoolDenoiser:
    """Callable with ComfyUI's diffusion-model signature; one pool request per call."""

    def __init__(self, pool, config: ParallelConfig, arch: str, cache_size: int = 16):
        """`pool`: a WorkerPool, or a function returning the current one (the nodes' pool
        registry may replace a pool between calls; the denoiser then follows it)."""
        if config.pipefusion > 1:
            raise ConfigError("PipeFusion pipelines patches across denoising steps, so it "
                              "cannot serve KSampler & co. one step at a time; use Sampler "
                              "(xDiT) for PipeFusion, or set pipefusion 1 for the xDiT MODEL")
        self._pool = pool
        self.config = config
        self.arch = arch
        self.cache_size = cache_size
        self._known: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._launches = None
        self.calls = 0
        self.conds_sent = 0
        self.last_stats: dict = {}

    @property
    def pool(self):
        return self._pool() if callable(self._pool) else self._pool

    # ---- ComfyUI's call ---------------------------------------------------------------
    def __call__(self, x, timestep, context=None, y=None, guidance=None, control=None,
                 transformer_options=None, **kwargs):
        import torch

        self._refuse(control, transformer_options or {}, kwargs)
        if context is None or y is None:
            raise ConfigError("the xDiT MODEL needs text conditioning with a pooled output "
                              "(CONDITIONING from ComfyUI's FLUX / SD3 text encoders)")
        n = int(x.shape[0])
        t = timestep.reshape(-1).float().cpu().expand(n) if timestep.numel() == 1 else \
            timestep.reshape(-1).float().cpu()
        if self.arch == "flux":
            t = t * 1000.0  # ComfyUI's FLUX takes sigma; the pool sigma * 1000
        g = None
        if guidance is not None:
            g = guidance.reshape(-1).float().cpu()
            g = g.expand(n) if g.numel() == 1 else g
        chunks, conds = self._chunks(context, y, (transformer_options or {}).get("uuids"), n)
        pool = self.pool
        state = (id(pool), pool.launches)
        if self._launches != state:  # another or a relaunched pool holds no conditioning
            self._known.clear()
        out, stats, sent = pool.model_call(
            self.config, x.detach().float().cpu(), t.contiguous(), g, chunks, conds,
            known=set(self._known))
        self._launches = (id(pool), pool.launches)
        self.calls += 1
        self.conds_sent += len(sent)
        for k, _ in chunks:
            self._known[k] = None
            self._known.move_to_end(k)
        while len(self._known) > self.cache_size:  # the workers evict in the same order
            self._known.popitem(last=False)
        self.last_stats = stats
        return out.to(x.device, x.dtype)

    # ---- helpers ------------------------------------------------------------------------
    def _refuse(self, control, options: dict, kwargs: dict) -> None:
        if control is not None:
            raise ConfigError("ControlNet is not supported on the xDiT MODEL; remove the "
                              "ControlNet apply node or use ComfyUI's own model")
        for name in ("patches", "patches_replace"):
            if options.get(name):
                kinds = sorted(options[name])
                raise ConfigError(f"model patches {kinds} cannot run on the xDiT MODEL (its "
                                  f"transformer lives in the worker pool); remove the node "
                                  f"that adds them or use ComfyUI's own model")
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _KNOWN)
        if kwargs.get("attention_mask") is not None:
            raise ConfigError("attention masks are not supported on the xDiT MODEL")
        if kwargs.get("ref_latents") is not None:
            raise ConfigError("reference latents (Kontext / ReferenceLatent) are not supported "
                              "on the xDiT MODEL yet")
        if unknown:
            raise ConfigError(f"the xDiT MODEL cannot honour model inputs {unknown}; remove "
                              f"the node that adds them or use ComfyUI's own model")

    def _chunks(self, context, y, uuids, n: int):
        """[(key, rows)] and {key: {"context", "pooled"}} for the rows of one call."""
        parts = len(uuids) if uuids else 1
        if n % parts:
            raise ConfigError(f"{n} latent rows cannot be split into {parts} conditionings")
        rows = n // parts
        if context.shape[0] != n or y.shape[0] != n:
            raise ConfigError(f"conditioning has {context.shape[0]} rows for {n} latents")
        chunks, conds = [], {}
        for i in range(parts):
            ctx = context[i * rows:(i + 1) * rows]
            pooled = y[i * rows:(i + 1) * rows]
            if uuids:
                key = f"{uuids[i]}:{rows}:{ctx.shape[1]}"
            else:
                key = "h:" + _digest(ctx, pooled)
            chunks.append((key, rows))
            conds[key] = {"context": ctx.detach().float().cpu().contiguous(),
                          "pooled": pooled.detach().float().cpu().contiguous()}
        return chunks, conds


def _digest(*tensors) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().float().cpu().contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()
