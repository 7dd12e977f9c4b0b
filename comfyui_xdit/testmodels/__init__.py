"""Small random-weight models built offline, for tests and the demo (never used by the nodes)."""
