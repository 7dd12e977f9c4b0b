"""What a job will be before it runs: parallel config, requests and their defaults, GPUs,
model discovery and the memory plan."""
