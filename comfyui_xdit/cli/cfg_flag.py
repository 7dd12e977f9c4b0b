"""`--cfg-parallel [N]`, shared by `generate` and `memory-plan`: the bare flag is degree 2
(the conditional and unconditional branch on different ranks), a number the degree (a step's
guidance passes spread over N ranks: 3 or 4 for a family's extra passes)."""
from __future__ import annotations

import argparse


def cfg_degree(text):
    """The flag's value: an integer >= 1 (1: off); absent, the flag is False."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--cfg-parallel takes an optional degree, an integer >= 1 (got {text!r}); the "
            f"bare flag is 2") from None
    if v < 1:
        raise argparse.ArgumentTypeError(
            f"--cfg-parallel degree must be >= 1 (got {v}); the bare flag is 2")
    return v


def add_cfg_parallel(p) -> None:
    p.add_argument("--cfg-parallel", nargs="?", type=cfg_degree, const=2, default=False,
                   metavar="N",
                   help="a step's guidance passes on different ranks: the bare flag is 2 "
                        "(conditional and unconditional branch), N spreads them over N ranks "
                        "(3 or 4: a family's extra passes, LTX-2's STG and modality guidance, "
                        "each on ranks of its own); N may not exceed the passes a step runs")
