"""The plain denoising loop and what plugs into it: flow-matching steps, the step cache,
host-sampler model calls."""
