"""The host's user-facing error (a leaf module: everything may import it, it imports nothing)."""


class ConfigError(ValueError):
    """A request or configuration that cannot run; the message is one user-facing line."""
