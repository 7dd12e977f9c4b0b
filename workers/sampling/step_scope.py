"""The step scope: what the denoising loop and model calls enter around each step's work.

A test hook may give the worker its own (`ctx.options["step_scope"]`,
xdit_testhooks/host_syncs.py, which watches the host synchronisations in a step); without
one it is `no_step_scope`.
"""
from __future__ import annotations

import contextlib


def no_step_scope(kind: str, index):
    """The `step_scope` of a worker without test hooks: in production it is this shared,
    free null context."""
    return contextlib.nullcontext()
