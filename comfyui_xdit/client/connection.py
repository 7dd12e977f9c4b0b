"""The control connection to rank 0: sending, receiving while every worker is watched (a dead
one fails the wait at once, naming itself), cancel, and connecting to an attached pool.

`PoolConnection` is the part of `WorkerPool` (comfyui_xdit/client/pool.py) that owns the
authenticated channel (`_chan`, comfyui_xdit/client/channel.py); the typed messages are
workers/runtime/protocol.py's.
"""
from __future__ import annotations

import time

from comfyui_xdit.bridge import protocol as P
from comfyui_xdit.client.channel import connect
from comfyui_xdit.errors import ConfigError, PoolError


class PoolConnection:
    """Rank 0's channel, as the pool uses it (mixed into `WorkerPool`)."""

    def _connect_attached(self) -> None:
        address, secret = self._attached
        self._chan = connect(address, secret)
        msg = self._recv(self.step_timeout, f"waiting for the pool at {address[0]}:{address[1]}")
        if isinstance(msg, P.Busy):
            self._shutdown()
            raise PoolError(f"the pool at {address[0]}:{address[1]} is in use: {msg.reason}")
        if not isinstance(msg, P.Ready):
            raise PoolError(f"unexpected first message from rank 0: {msg.KIND!r}")
        self._remote = msg.info
        if self._config_given and self.config.ranks != self._remote["world_size"]:
            n = self._remote["world_size"]
            self._shutdown()
            raise ConfigError(f"the pool at {address[0]}:{address[1]} has {n} ranks but "
                              f"{self.config.describe()} = {self.config.ranks}; give a "
                              f"configuration whose degrees multiply to {n}")

    def _send(self, msg) -> None:
        self._chan.send(P.to_wire(msg))

    def _recv(self, timeout: float, when: str):
        """Next message from rank 0, watching every worker while waiting."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                if self._chan.poll(0.1):
                    return P.from_wire(self._chan.recv())
            except (ConnectionError, OSError, EOFError):
                time.sleep(0.2)  # let the exit code of a dying worker appear
                self._check_alive(when)
                self._shutdown()
                raise PoolError(f"lost the control connection to rank 0 ({when})") from None
            self._check_alive(when)
            if time.monotonic() > deadline:
                self._shutdown()
                raise PoolError(f"no answer from the pool for {timeout:.0f}s ({when}); "
                                f"workers were stopped")

    def _check_alive(self, when: str) -> None:
        dead = self._dead(when)
        if dead:
            self._shutdown()
            err = PoolError(dead)
            err.log_path = self.last_death.get("log")
            raise err

    def _raise_fatal(self, reported: str, when: str) -> None:
        """Rank 0 gave up (its collective failed): name the rank that actually died, if one
        did (rank 0's own report is then only the lost peer: it stays in the logs), then
        stop the pool."""
        deadline = time.monotonic() + 2.0
        dead = self._dead(when)
        while dead is None and time.monotonic() < deadline and self._procs:
            time.sleep(0.1)
            dead = self._dead(when)
        self._shutdown()
        if dead:
            err = PoolError(dead)
            err.log_path = self.last_death.get("log")
            raise err
        raise PoolError(" ".join(str(reported).split()))

    def _cancel_and_drain(self, job_id: int) -> None:
        """The caller gave up on the job (e.g. ComfyUI's interrupt): stop it on the workers
        and wait until they are idle again, so the next job starts clean."""
        try:
            self._send(P.Cancel(job_id))
            while True:
                msg = self._recv(self.step_timeout, f"cancelling job {job_id}")
                if isinstance(msg, (P.Cancelled, P.Result, P.Error)) and \
                        msg.job_id in (job_id, None):
                    if isinstance(msg, P.Error) and msg.fatal:
                        self._raise_fatal(msg.message, f"cancelling job {job_id}")
                    return
        except PoolError:
            return

    def cancel(self) -> None:
        """Stop the running job within one denoising step (safe from any thread)."""
        job, chan = self._running_job, self._chan
        if job is not None and chan is not None:
            try:
                chan.send(P.to_wire(P.Cancel(job)))
            except OSError:
                pass
