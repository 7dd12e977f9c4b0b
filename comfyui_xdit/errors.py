"""The host's user-facing errors (a leaf module: everything may import it, it imports nothing)."""


class ConfigError(ValueError):
    """A request or configuration that cannot run; the message is one user-facing line."""


class PoolError(RuntimeError):
    """A job failed inside the pool; the message names the rank and what happened."""


class JobCancelled(PoolError):
    pass
