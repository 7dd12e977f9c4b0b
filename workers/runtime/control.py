"""Rank 0's control channel to the host, and the other ranks' wait for work.

Rank 0 accepts one authenticated host connection at a time (workers/runtime/channel.py), speaks the
typed protocol (workers/runtime/protocol.py), prepares each job once and broadcasts it over the
control plane; every rank then runs it (workers/runtime/worker.py). The other ranks only ever wait
in that broadcast.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

from ..sampling.model_call import ModelCall
from . import protocol as P
from .outputs import Decoded
from .worker import DecodeJob, _broadcast, _decode, _decode_problem

log = logging.getLogger("xdit.worker")


class Link:
    """A channel that sends and receives protocol messages."""

    def __init__(self, chan):
        self.chan = chan

    def send(self, msg: P.Message) -> None:
        self.chan.send(P.to_wire(msg))

    def recv(self) -> P.Message:
        return P.from_wire(self.chan.recv())

    def poll(self, timeout: float) -> bool:
        return self.chan.poll(timeout)


def _leader_decode(worker, link, msg: P.Decode):
    job_id, samples = msg.job_id, msg.samples
    problem = _decode_problem(worker, samples)
    if problem:
        link.send(P.Error(job_id, f"ValueError: {problem}"))
        return
    _broadcast(worker.planes.control, DecodeJob(job_id))
    worker.state.update(state="running", job_id=job_id, step=0, total=0)
    t = time.perf_counter()
    try:
        # ComfyUI's LATENT -> the VAE's raw latent (FLUX.2: un-normalise, unpatchify)
        given = tuple(t.float() for t in samples) if isinstance(samples, (tuple, list)) \
            else samples.float()  # a video with its sound: (video, sound)
        images = _decode(worker, worker.adapter.comfy_to_raw(worker.model, given))
    except Exception as e:
        # the other ranks may be inside the decode's collectives: the pool cannot continue
        link.send(P.Error(job_id, f"rank 0: {type(e).__name__}: {e}", fatal=True))
        raise
    finally:
        worker.state.update(state="idle", job_id=None)
    decoded = Decoded(**images) if isinstance(images, dict) else Decoded(images=images)
    link.send(P.Result(job_id, decoded=decoded,
                       stats=[{"rank": 0, "decode_s": time.perf_counter() - t}]))


def _leader_predict(worker, link, msg: P.Predict):
    """One denoiser evaluation for a host-side sampler: checked, broadcast, run, answered.
    Latents travel as numpy arrays on the channel and in the broadcast (a tensor pickles
    through torch.save, ~30x slower: milliseconds per call at 1024x1024)."""
    from ..sampling.model_call import as_tensor, for_wire

    t = time.perf_counter()
    try:
        msg.x, msg.timestep, msg.guidance = (as_tensor(msg.x), as_tensor(msg.timestep),
                                             as_tensor(msg.guidance))
        call = worker.prepare_call(msg)
    except Exception as e:  # nothing was broadcast: the pool is still consistent
        link.send(P.Error(msg.call_id, f"{type(e).__name__}: {e}"))
        return
    if isinstance(call, list):
        link.send(P.Prediction(msg.call_id, missing=call))
        return
    t_bcast = time.perf_counter()
    _broadcast(worker.planes.control, for_wire(call))
    t_run = time.perf_counter()
    try:
        out, times = worker.call(call, emit=lambda ev: link.send(P.Event(msg.call_id, ev)))
    except Exception as e:
        link.send(P.Error(msg.call_id, f"rank 0: {type(e).__name__}: {e}", fatal=True))
        raise
    # rank 0's times in seconds: prepare (checks), broadcast of the call, the call itself,
    # of which the transformer's forward (forward_s; forward_max_s: the slowest rank's),
    # the all-gather (gather_s), and the work before / after the forward (pre_s, post_s)
    stats = {k: v for k, v in times.items() if k != "run_s"}
    stats.update(call_s=time.perf_counter() - t, prepare_s=t_bcast - t,
                 broadcast_s=t_run - t_bcast, cond_puts=worker.cond_cache.puts)
    link.send(P.Prediction(msg.call_id, out=out.numpy(), stats=stats))


def _follower_loop(worker):
    from ..sampling.denoise import Cancelled
    from ..loading.lora import LoraError
    while True:
        job = _broadcast(worker.planes.control, None)
        if job == "shutdown":
            return
        if isinstance(job, DecodeJob):
            _decode(worker, None)
            continue
        if isinstance(job, ModelCall):
            worker.call(job)
            continue
        try:
            worker.run(job)
        except (Cancelled, LoraError):  # LoraError: every rank refused the job together
            pass


class _Acceptor(threading.Thread):
    """Accepts and authenticates control connections; bad ones are logged and dropped."""

    def __init__(self, sock, secret):
        super().__init__(daemon=True, name="xdit-acceptor")
        self.sock = sock
        self.secret = secret
        self.channels = queue.Queue()
        self.busy = threading.Event()  # a host is connected: others are told so and dropped
        self.lock = threading.Lock()

    def run(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            # each handshake in its own thread: a silent client cannot hold up the next one
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True,
                             name="xdit-handshake").start()

    def _handshake(self, conn, peer):
        from .channel import AuthError, server_handshake
        try:
            chan = server_handshake(conn, self.secret)
        except AuthError as e:
            log.warning("refused control connection from %s: %s", peer, e)
            conn.close()
            return
        for _ in range(20):  # a host that just left may not be noticed yet
            if not self.busy.is_set():
                break
            time.sleep(0.1)
        with self.lock:
            if self.busy.is_set():
                log.info("control connection from %s refused: another host is connected", peer)
                try:
                    chan.send(P.to_wire(P.Busy("another host is connected to this pool")))
                finally:
                    chan.close()
                return
            self.busy.set()
        self.channels.put(Link(chan))
        log.info("control connection from %s authenticated", peer)


def _leader_loop(worker, acceptor):
    from ..sampling.denoise import Cancelled
    from ..loading.lora import LoraError

    link = None
    later = collections.deque()  # messages that arrived during a job, handled after it
    while True:
        if link is None:
            later.clear()
            link = acceptor.channels.get()
            link.send(P.Ready(worker.describe()))
        try:
            msg = later.popleft() if later else link.recv()
        except P.ProtocolError as e:
            link.send(P.Error(None, f"ProtocolError: {e}"))
            continue
        except (ConnectionError, OSError, EOFError):
            log.info("host disconnected")
            link = None
            acceptor.busy.clear()
            continue
        if isinstance(msg, P.Shutdown):
            _broadcast(worker.planes.control, "shutdown")
            link.send(P.Bye())
            return
        if isinstance(msg, P.Ping):
            link.send(P.Pong())
            continue
        if isinstance(msg, P.StatusQuery):
            link.send(P.Status(worker.describe()))
            continue
        if isinstance(msg, P.Cancel):  # arrived after its job ended: nothing to stop
            continue
        if isinstance(msg, P.Decode):
            _leader_decode(worker, link, msg)
            continue
        if isinstance(msg, P.Predict):
            _leader_predict(worker, link, msg)
            continue
        if not isinstance(msg, P.Job):
            link.send(P.Error(None, f"rank 0 does not take {msg.KIND!r} messages"))
            continue
        try:
            job = worker.prepare(msg)
        except Exception as e:  # nothing was broadcast: the pool is still consistent
            link.send(P.Error(msg.job_id, f"{type(e).__name__}: {e}"))
            continue
        _broadcast(worker.planes.control, job)
        cancelled = []

        def should_stop():
            while link.poll(0):
                m = link.recv()
                if isinstance(m, P.Cancel) and m.job_id in (None, job.job_id):
                    cancelled.append(m)
                elif isinstance(m, P.StatusQuery):
                    link.send(P.Status(worker.describe()))
                elif not isinstance(m, P.Cancel):
                    later.append(m)
            return bool(cancelled)

        def emit(event):
            if "step" in event:
                worker.state.update(step=event["step"], total=event["total"])
            link.send(P.Event(job.job_id, event))

        worker.state.update(state="running", job_id=job.job_id, step=0,
                            total=job.request.steps)
        try:
            try:
                latents, decoded, stats = worker.run(job, emit, should_stop)
            finally:
                worker.state.update(state="idle", job_id=None)
        except Cancelled as e:
            link.send(P.Cancelled(job.job_id, str(e)))
            continue
        except LoraError as e:  # every rank refused the job together: the pool is fine
            link.send(P.Error(job.job_id, f"LoraError: {e}"))
            continue
        except Exception as e:
            # other ranks may be inside a collective: the pool cannot continue
            link.send(P.Error(job.job_id, f"rank 0: {type(e).__name__}: {e}", fatal=True))
            raise
        link.send(P.Result(job.job_id, latents=latents, decoded=decoded, stats=stats))
