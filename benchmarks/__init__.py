"""Benchmarks of comfyui-xdit: not part of the product (ComfyUI never imports them).

    python -m benchmarks [--quick] [--out bench-out]          # speed-up and bytes per step
    python -m benchmarks --pipefusion [--quick]               # PipeFusion: memory, speed, PSNR
    python -m benchmarks --engine [--preset quick|cpu|flux-dev] [--device cuda] [--dtype bf16]
                         [--compile] [--ranks 1,2,4,8]         # diffusers vs pool, eager vs
                                                              # compiled, 1 vs N ranks
    python -m benchmarks --engine --families all [--device cuda] [--compile] [--plan|--quick]
                                                              # every family at its released
                                                              # width, pool vs diffusers

(`python -m comfyui_xdit bench ...` is the same command.) Modules: `bench` (1 vs 2 CPU
ranks: ulysses, ring, cfg-parallel, dp), `pipefusion` (the PipeFusion section), `pool` (pool
overheads), `engine` (the --engine section and the FLUX.1-dev-sized
random model it builds), `engine_families` (--engine --families: the per-family sweep), `measure` (machine facts, the CPU-contention monitor, round-robin timing),
`comm_meter` (the worker hook that counts the bytes each rank sends), `cli` (the options).
This package may import comfyui_xdit and workers; they never import it.
"""
