"""Known bugs injected into a worker for the tests' negative controls."""


def lse_zero(ctx):
    """Ring attention merges blocks with a zero log-sum-exp (yunchang TORCH_MATH's bug)."""
    ctx.options["attention_fault"] = "lse_zero"


def keep_padding(ctx):
    """Padded keys of uneven shards are kept in the attention."""
    ctx.options["attention_fault"] = "keep_padding"
