"""Nothing left behind when the host stops: on SIGTERM (how services and containers stop
ComfyUI; Python's default action skips atexit) every pool of this process stops its workers
and removes its folder (its 0600 secret, store and rank logs), then the signal does what it
did before (the previous handler runs, or the process dies by SIGTERM as it would have).
Normal interpreter exit is WorkerPool's atexit hook.

Only the main thread may set a handler: the node pack installs it when ComfyUI imports it
(startup, main thread), a pool launched from the main thread (CLI, Python API) when it
launches. Cheap to import: no torch, no pool module until the signal arrives."""
from __future__ import annotations

import os
import signal
import sys
import threading

_installed = False
_previous = None


def _on_sigterm(signum, frame) -> None:
    pool_module = sys.modules.get("comfyui_xdit.client.pool")
    if pool_module is not None:
        pool_module.stop_all_for_exit()
    previous = _previous
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)  # die by the signal, as without this handler
    os.kill(os.getpid(), signum)


def install_sigterm() -> bool:
    """Install the SIGTERM cleanup once, chained to the handler there was; False where it
    cannot be (not the main thread) or was already."""
    global _installed, _previous
    if _installed or threading.current_thread() is not threading.main_thread():
        return False
    try:
        _previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # an embedded interpreter without signals
        return False
    _installed = True
    return True
