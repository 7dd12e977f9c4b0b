"""How one image spreads over ranks: topology (the process groups, every collective),
point-to-point, sequence parallelism and its attention, weight sharding, patch-parallel VAE
decode, PipeFusion."""
