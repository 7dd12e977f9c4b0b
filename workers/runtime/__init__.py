"""The worker process itself: entry point, control channel and typed protocol, the
per-rank job runner, test hooks, shared message texts, compilation."""
