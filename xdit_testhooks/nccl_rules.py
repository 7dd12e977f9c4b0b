"""NCCL's point-to-point rules, emulated on gloo: a worker hook (workers/runtime/hooks.py).

    WorkerPool(..., worker_hooks=["xdit_testhooks.nccl_rules:install"])

installs it in every rank before `init_process_group`, and turns on the plane check
(workers/parallel/topology.py: every collective and point-to-point call's tensors must suit its
group's plane). gloo forgives schedules that NCCL deadlocks on (docs/design.md#nccls-rules);
under this hook they deadlock on CPU too, and the rank that
waits raises `NcclOrderError` within the timeout (`XDIT_NCCL_RULES_TIMEOUT` seconds,
default `DEFAULT_TIMEOUT`), with one message naming both ranks, the group, the operation
and what heads the pair's queue; the message also goes to stderr (logger
"xdit.nccl_rules"), so a pool's rank log shows it.

What is emulated, for `torch.distributed.isend / irecv / send / recv / batch_isend_irecv`
on every data-plane group (control-plane gloo twins, `workers.parallel.topology.is_control`, and
collectives keep gloo's own behaviour):

1. One communicator per (group, pair of ranks): every send and receive between two ranks on
   one group, both directions, runs in the order this rank issued it (one FIFO and one
   executor thread per (group, peer)), and each is a rendezvous: a send completes only when
   the peer has received it (data on one tag, an acknowledgement back on another). Two
   ranks whose queues for the pair both start with a send, or both with a receive, wait for
   each other forever: that is reported.
2. The first operation a rank issues toward a peer (per group) blocks the issuing thread
   until the peer has issued its first operation toward this rank (NCCL creates the pair's
   communicator collectively). The meeting goes through the rendezvous store.
3. `batch_isend_irecv`: the operations of one call toward one peer are in flight together
   and complete together; pairs first met in one call are met together. Across calls the
   pair's order holds.

4. With `XDIT_NCCL_RULES_COLLECTIVES=1`: every collective on a data-plane group must be the
   same operation, in the same order, on every rank of the group (NCCL hangs, or mixes up
   buffers, when one rank's n-th collective on a communicator is another kind than its
   peers'). Each rank publishes its n-th collective's kind and shapes in the store and
   compares them with its peers' before issuing it; a mismatch, or a peer that never issues
   its n-th, is reported (opt-in: it costs store round trips on every collective). The
   group is read from the `group=` keyword, as workers/parallel/topology.py passes it; a call giving
   its group positionally would be counted on the default group.

Tags are ignored for matching, as NCCL does: the n-th send from A to B matches B's n-th
receive from A. The hook wraps whatever is installed in `torch.distributed` at install time
(another hook, such as the byte meter, stays in the chain in either order): user data goes
through the wrapped functions, the emulation's own messages (acknowledgements) through
torch's.

Not modelled: NCCL's small-message buffering (a short send may complete without its
receive on real NCCL; here every send waits, so this is stricter), PyTorch's choice of the
group-wide communicator for batched operations (all batches of a group then share one
stream across peers; here each pair has its own), receives from any source (refused, NCCL
has none), CUDA streams and events. A deadlock is declared by a timeout, so a legitimate
wait longer than the timeout (a peer computing that long between two matched operations)
is reported too.
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from typing import Optional

from xdit_testhooks.p2p_ops import is_send as p2p_is_send

SPEC = "xdit_testhooks.nccl_rules:install"
ENV_TIMEOUT = "XDIT_NCCL_RULES_TIMEOUT"
ENV_COLLECTIVES = "XDIT_NCCL_RULES_COLLECTIVES"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single",
               "all_to_all", "broadcast", "reduce_scatter_tensor", "gather")
DEFAULT_TIMEOUT = 10.0  # seconds an operation may wait for its match before it is a deadlock

# gloo matches point-to-point messages on (peer, tag); the emulation's own tags live far
# above the small tags user code passes (and user tags are not used at all on data groups).
_TAG_DATA = 1 << 26
_TAG_ACK = 2 << 26
_TAG_SPAN = 1 << 25  # per-direction sequence numbers wrap here (in flight: a handful)
_STORE_PREFIX = "xdit_nccl_rules"

log = logging.getLogger("xdit.nccl_rules")

_EMULATION = None  # one per process: a second install returns it instead of wrapping again


class NcclOrderError(RuntimeError):
    """A point-to-point schedule that deadlocks under NCCL's rules."""


def timeout_seconds() -> float:
    """The deadlock timeout: `XDIT_NCCL_RULES_TIMEOUT` (tests) or `DEFAULT_TIMEOUT`."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    return float(raw) if raw else DEFAULT_TIMEOUT


def install(ctx=None):
    """Worker hook: wrap torch.distributed's point-to-point functions (before the process
    group exists) and turn on the plane check. Returns the emulation; its `job_stats()`
    counts what it carried."""
    global _EMULATION
    if ctx is not None:
        ctx.options["check_planes"] = True
    if _EMULATION is None:
        _EMULATION = NcclRules(timeout_seconds())
    return _EMULATION


def _fmt_shape(t) -> str:
    return "(" + ", ".join(str(int(s)) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


class _Op:
    """One point-to-point operation issued by this rank."""

    __slots__ = ("kind", "tensor", "pair", "index", "seq", "api", "unit", "done", "error",
                 "future")

    def __init__(self, kind, tensor, pair, api):
        self.kind = kind  # "send" | "recv"
        self.tensor = tensor
        self.pair = pair
        self.api = api  # what the user called: isend, irecv, send, recv, batch_isend_irecv
        self.index = 0  # 1-based number in this rank's order for the pair (both directions)
        self.seq = 0  # 0-based number among this rank's ops of this kind toward the peer
        self.unit = None
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.future = None

    def describe(self) -> str:
        to = "to" if self.kind == "send" else "from"
        return (f"{self.kind} #{self.index} of the pair (the {_ordinal(self.seq + 1)} "
                f"{self.kind} {to} rank {self.pair.peer}; tensor {_fmt_shape(self.tensor)} "
                f"{_dtype(self.tensor)}; issued by {self.api})")


class _Unit:
    """What runs at once on a pair: one operation, or one batch call's operations with the
    peer."""

    __slots__ = ("ops", "batch")

    def __init__(self, ops, batch):
        self.ops, self.batch = ops, batch

    def describe(self) -> str:
        inner = "; ".join(op.describe() for op in self.ops)
        return f"[batch of {len(self.ops)}: {inner}]" if self.batch else inner


class _Pair:
    """This rank's side of one (group, peer) communicator: its FIFO and executor thread."""

    def __init__(self, rules, group, peer, group_peer, me):
        import torch.distributed as dist

        self.rules = rules
        self.group = group
        self.peer = peer  # global rank
        self.group_peer = group_peer  # rank in `group`
        self.me = me  # global rank
        self.ranks = list(dist.get_process_group_ranks(group))
        self.is_world = group is dist.group.WORLD
        self.name = _group_name(group)
        self.issued = 0
        self.counts = {"send": 0, "recv": 0}
        self.met = False
        self.error: Optional[BaseException] = None
        self.head: Optional[_Unit] = None
        self.pending: list = []  # units queued, not yet started (for messages)
        self.last_progress = self.started = time.monotonic()
        self.keep = []  # gloo works (and their tensors) abandoned after a failure
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"nccl-rules g{self.name} {me}->{peer}")
        self.thread.start()

    # -- description ------------------------------------------------------------------
    def where(self) -> str:
        g = "the default group" if self.is_world else f"group {self.name}"
        return f"{g} (ranks {self.ranks})"

    def fifo(self) -> str:
        with self.lock:
            head, pending = self.head, list(self.pending)
        parts = [f"Head of rank {self.me}'s queue for the pair: "
                 + (head.describe() if head is not None else "(empty)")]
        if pending:
            more = "; ".join(u.describe() for u in pending[:3])
            extra = f" (+{len(pending) - 3} more)" if len(pending) > 3 else ""
            parts.append(f"Queued behind it: {more}{extra}")
        return ". ".join(parts)

    # -- issue (host thread) ----------------------------------------------------------
    def number(self, op: _Op) -> None:
        self.issued += 1
        op.index = self.issued
        op.seq = self.counts[op.kind]
        self.counts[op.kind] += 1

    def enqueue(self, unit: _Unit) -> None:
        with self.lock:
            self.pending.append(unit)
        self.queue.put(unit)

    # -- executor thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            unit = self.queue.get()
            with self.lock:
                self.pending.remove(unit)
                self.head = unit
            self.last_progress = self.started = time.monotonic()
            error = self.error
            if error is None:
                try:
                    self.rules._execute(self, unit)
                except BaseException as exc:  # noqa: BLE001 - reported through the works
                    error = self.error = self.rules._failure(self, unit, exc)
            for op in unit.ops:
                op.error = error
                op.done.set()
                if op.future is not None:
                    _settle(op)
            with self.lock:
                self.head = None
            self.last_progress = time.monotonic()


def _settle(op) -> None:
    fut, op.future = op.future, None
    if fut is None:
        return
    if op.error is not None:
        fut.set_exception(op.error)
    else:
        fut.set_result([op.tensor])


def _group_name(group) -> str:
    try:
        import torch.distributed.distributed_c10d as c10d
        return str(c10d._get_process_group_name(group))
    except Exception:  # noqa: BLE001
        return str(getattr(group, "group_name", id(group)))


class _Work:
    """What isend / irecv / batch_isend_irecv return under the emulation."""

    def __init__(self, op: _Op, rules):
        self._op = op
        self._rules = rules

    def wait(self, timeout=None) -> bool:
        op, pair = self._op, self._op.pair
        limit = None
        if timeout is not None:
            secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
                else float(timeout)
            if secs > 0:
                limit = time.monotonic() + secs
        # the executor settles every operation within the timeout of reaching the head of
        # its queue; this is a safety net for an executor that stops making progress
        stall = self._rules.timeout + 10.0
        while not op.done.wait(0.2):
            if time.monotonic() - pair.last_progress > stall:
                msg = (f"NCCL rules (emulation): rank {pair.me} waited on {op.describe()} with "
                       f"rank {pair.peer} on {pair.where()}, and the pair's executor made no "
                       f"progress for {stall:.0f} s. {pair.fifo()}")
                log.error(msg)
                raise NcclOrderError(msg)
            if limit is not None and time.monotonic() > limit:
                raise RuntimeError(f"timed out after {timeout} waiting for {op.describe()}")
        if op.error is not None:
            raise op.error
        return True

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self):
        return self._op.error

    def result(self) -> list:
        self.wait()
        return [self._op.tensor]

    def source_rank(self) -> int:
        return self._op.pair.group_peer

    _source_rank = source_rank

    def synchronize(self) -> None:
        pass

    def block_current_stream(self) -> None:
        pass

    def get_future(self):
        import torch

        op = self._op
        fut = torch.futures.Future()
        if op.done.is_set():
            if op.error is not None:
                fut.set_exception(op.error)
            else:
                fut.set_result([op.tensor])
            return fut
        op.future = fut
        if op.done.is_set():  # settled meanwhile: settle here (once)
            _settle(op)
        return fut

    def __repr__(self):
        state = "done" if self._op.done.is_set() else "pending"
        return f"<nccl_rules work {self._op.describe()} {state}>"


class NcclRules:
    """The emulation installed in one process (see the module docstring)."""

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        self.pairs: dict = {}
        self.lock = threading.Lock()
        self.stats = {"ops": 0, "batches": 0}
        self._install()

    # -- the hook protocol (workers/runtime/hooks.py) ----------------------------------------------
    def job_started(self) -> None:
        self.stats = {"ops": 0, "batches": 0}

    def job_stats(self) -> dict:
        """What it carried, and the plane check's device (so tests see the check is on)."""
        return dict(self.stats, pairs=len(self.pairs), timeout_s=self.timeout,
                    plane_check=self._plane_check())

    # -- wrapping ------------------------------------------------------------------------
    def _install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        try:
            from workers.parallel.topology import is_control, plane_check
        except ImportError:  # outside the repository: every group is a data group
            def is_control(group):
                return False

            def plane_check():
                return None
        self._is_control = is_control
        self._plane_check = plane_check
        self.c10d = c10d
        orig = {name: getattr(dist, name) for name in
                ("isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp")}
        self.orig = orig
        rules = self

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            g = rules._data_group(group)
            if g is None:
                return orig["isend"](tensor, dst, group, tag, group_dst)
            peer, gp = rules._peer(g, dst, group_dst, "dst")
            if peer == dist.get_rank():
                return orig["isend"](tensor, dst, group, tag, group_dst)
            return rules._issue([("send", tensor, g, peer, gp)], "isend")[0]

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            g = rules._data_group(group)
            if g is None:
                return orig["irecv"](tensor, src, group, tag, group_src)
            peer, gp = rules._peer(g, src, group_src, "src")
            if peer == dist.get_rank():
                return orig["irecv"](tensor, src, group, tag, group_src)
            return rules._issue([("recv", tensor, g, peer, gp)], "irecv")[0]

        def send(tensor, dst=None, group=None, tag=0, group_dst=None):
            g = rules._data_group(group)
            if g is None:
                return orig["send"](tensor, dst, group, tag, group_dst)
            peer, gp = rules._peer(g, dst, group_dst, "dst")
            if peer == dist.get_rank():
                return orig["send"](tensor, dst, group, tag, group_dst)
            rules._issue([("send", tensor, g, peer, gp)], "send")[0].wait()
            return None

        def recv(tensor, src=None, group=None, tag=0, group_src=None):
            g = rules._data_group(group)
            if g is None:
                return orig["recv"](tensor, src, group, tag, group_src)
            peer, gp = rules._peer(g, src, group_src, "src")
            if peer == dist.get_rank():
                return orig["recv"](tensor, src, group, tag, group_src)
            rules._issue([("recv", tensor, g, peer, gp)], "recv")[0].wait()
            return peer

        wrappers = {"isend": isend, "irecv": irecv, "send": send, "recv": recv}
        for name, fn in wrappers.items():
            fn.__wrapped__ = orig[name]
            fn.__name__ = fn.__qualname__ = name
        mine = {isend: orig["isend"], irecv: orig["irecv"], send: orig["send"],
                recv: orig["recv"]}

        def unwrap(op):
            """Our wrappers -> what they wrap: torch checks a P2POp's op by identity with its
            own isend/irecv (the hook under us, if any, unwraps its own)."""
            return mine.get(op, op)

        sends = {c10d.isend, c10d.send, orig["isend"], orig["send"], isend, send}
        recvs = {c10d.irecv, c10d.recv, orig["irecv"], orig["recv"], irecv, recv}

        def is_send(op) -> bool:
            return p2p_is_send(op, sends, recvs)

        self._is_send = is_send
        base = orig["P2POp"]

        class P2POp(base):
            """A P2POp built with `dist.isend` / `dist.irecv` (our wrappers) carries what they
            wrap, which torch (or the hook under us) recognises."""

            def __new__(cls, op, *a, **k):
                return base.__new__(cls, unwrap(op), *a, **k)

            def __init__(self, op, *a, **k):
                super().__init__(unwrap(op), *a, **k)

        P2POp.__name__ = P2POp.__qualname__ = "P2POp"

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                op.op = unwrap(op.op)
            if not p2p_op_list:
                return orig["batch_isend_irecv"](p2p_op_list)
            g = rules._data_group(p2p_op_list[0].group)
            if g is None or any(op.group is not p2p_op_list[0].group for op in p2p_op_list):
                return orig["batch_isend_irecv"](p2p_op_list)
            me = dist.get_rank()
            if any(op.peer == me for op in p2p_op_list):
                return orig["batch_isend_irecv"](p2p_op_list)  # to self: no pair
            specs = [("send" if is_send(op.op) else "recv", op.tensor, g, op.peer,
                      rules._group_peer(op)) for op in p2p_op_list]
            return rules._issue(specs, "batch_isend_irecv")

        if os.environ.get(ENV_COLLECTIVES, "").strip() == "1":
            self._wrap_collectives(dist)

        batch_isend_irecv.__wrapped__ = orig["batch_isend_irecv"]
        for name, fn in (("isend", isend), ("irecv", irecv), ("send", send), ("recv", recv),
                         ("batch_isend_irecv", batch_isend_irecv), ("P2POp", P2POp)):
            setattr(dist, name, fn)

    # -- rule 4: collectives match ------------------------------------------------------
    def _wrap_collectives(self, dist) -> None:
        rules = self
        self.coll_seq: dict = {}
        for name in COLLECTIVES:
            real = getattr(dist, name)

            def wrapped(*args, _real=real, _name=name, **kwargs):
                rules._match(_name, kwargs.get("group"), args)
                return _real(*args, **kwargs)
            wrapped.__wrapped__ = real
            wrapped.__name__ = wrapped.__qualname__ = name
            setattr(dist, name, wrapped)

    def _match(self, name, group, args) -> None:
        """Publish this rank's n-th collective on `group` and compare it with its peers'."""
        import torch
        import torch.distributed as dist

        g = self._data_group(group)
        if g is None:
            return
        gname = _group_name(g)
        seq = self.coll_seq[gname] = self.coll_seq.get(gname, 0) + 1
        shapes = []
        for a in args:
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if torch.is_tensor(x):
                    shapes.append(_fmt_shape(x))
        mine = f"{name} {' '.join(shapes)}"
        me, store = dist.get_rank(), self._store()
        prefix = f"{_STORE_PREFIX}/{gname}/coll/{seq}"
        store.set(f"{prefix}/{me}", mine)
        for peer in dist.get_process_group_ranks(g):
            if peer == me:
                continue
            key = f"{prefix}/{peer}"
            try:
                store.wait([key], datetime.timedelta(seconds=self.timeout))
            except Exception:  # noqa: BLE001 - the store's timeout error
                msg = (f"NCCL rules (emulation): rank {me} issued collective #{seq} on group "
                       f"{gname} ({mine}); rank {peer} never issued its #{seq} within "
                       f"{self.timeout:.0f} s (it is waiting elsewhere: a deadlock on NCCL)")
                log.error(msg)
                raise NcclOrderError(msg) from None
            theirs = store.get(key).decode(errors="replace")
            if theirs.split(" ")[0] != name:
                msg = (f"NCCL rules (emulation): collective #{seq} on group {gname}: rank {me} "
                       f"issues {mine}, rank {peer} issues {theirs} (ranks of a communicator "
                       f"must issue the same collectives in the same order)")
                log.error(msg)
                raise NcclOrderError(msg)

    # -- issue ---------------------------------------------------------------------------
    def _data_group(self, group):
        """The group an operation runs on, or None when the emulation leaves it to gloo (a
        control-plane twin, or a group this rank is not in)."""
        c10d = self.c10d
        g = c10d._group_or_default_group(group)
        if self._is_control(g) or c10d._rank_not_in_group(g):
            return None
        return g

    def _peer(self, group, global_rank, group_rank, what):
        """(global peer, group peer) from a global or a group rank."""
        if global_rank is None and group_rank is None:
            if what == "src":
                raise NcclOrderError("NCCL rules (emulation): a receive from any source has no "
                                     "NCCL equivalent; name the source rank")
        gp = self.c10d._canonicalize_group_rank(group, global_rank, group_rank)
        peer = self.c10d._canonicalize_group_rank(group, global_rank, group_rank,
                                                  return_global=True)
        return peer, gp

    def _group_peer(self, op) -> int:
        gp = getattr(op, "group_peer", None)
        return gp if gp is not None else self.c10d.get_group_rank(op.group, op.peer)

    def _pair(self, group, peer, group_peer) -> _Pair:
        import torch.distributed as dist

        key = (id(group), peer)
        with self.lock:
            pair = self.pairs.get(key)
            if pair is None:
                pair = self.pairs[key] = _Pair(self, group, peer, group_peer, dist.get_rank())
        return pair

    def _issue(self, specs, api) -> list:
        """Number and queue `specs` [(kind, tensor, group, peer, group_peer)] as one call;
        meet new peers first (blocking this thread). Returns one work per spec, in order."""
        ops, by_pair = [], {}
        for kind, tensor, group, peer, gp in specs:
            pair = self._pair(group, peer, gp)
            if pair.error is not None:
                raise pair.error
            op = _Op(kind, tensor, pair, api)
            ops.append(op)
            by_pair.setdefault(pair, []).append(op)
        for pair, mine in by_pair.items():
            for op in mine:
                pair.number(op)
        new = [p for p in by_pair if not p.met]
        if new:
            self._meet(new, {p: by_pair[p][0] for p in new})
        for pair, mine in by_pair.items():
            unit = _Unit(mine, batch=(api == "batch_isend_irecv"))
            for op in mine:
                op.unit = unit
            pair.enqueue(unit)
        self.stats["ops"] += len(ops)
        if api == "batch_isend_irecv":
            self.stats["batches"] += 1
        return [_Work(op, self) for op in ops]

    # -- rule 2: first contact -----------------------------------------------------------
    def _store(self):
        return self.c10d._get_default_store()

    def _meet(self, pairs, first_ops) -> None:
        """Block until every peer in `pairs` has issued its first operation toward us."""
        store = self._store()
        for p in pairs:
            store.set(f"{_STORE_PREFIX}/{p.name}/hello/{p.me}-{p.peer}", "1")
        deadline = time.monotonic() + self.timeout
        for p in pairs:
            key = f"{_STORE_PREFIX}/{p.name}/hello/{p.peer}-{p.me}"
            left = max(deadline - time.monotonic(), 0.001)
            try:
                store.wait([key], datetime.timedelta(seconds=left))
            except Exception as exc:  # noqa: BLE001 - the store's timeout error
                op = first_ops[p]
                msg = (f"NCCL rules violated (first contact): rank {p.me}'s first send/recv with "
                       f"rank {p.peer} on {p.where()} - {op.describe()} - blocks rank "
                       f"{p.me}'s host until rank {p.peer} makes its own first send/recv with "
                       f"rank {p.me} (NCCL creates the pair's communicator on both at once), and "
                       f"rank {p.peer} made none within {self.timeout:g} s. Head of rank "
                       f"{p.me}'s queue for the pair: this operation (the pair's first). Rank "
                       f"{p.peer} is likely blocked elsewhere, e.g. in a collective that waits "
                       f"for rank {p.me}, whose host never gets there: a deadlock on NCCL. "
                       f"Create pair links up front in one global order "
                       f"(workers/parallel/p2p.warm_pairs) or make the first operation at the same "
                       f"point on both ranks.")
                err = NcclOrderError(msg)
                err.__cause__ = exc
                p.error = err
                log.error(msg)
                raise err from exc
            p.met = True

    # -- rule 1 and 3: the executor ------------------------------------------------------
    def _execute(self, pair: _Pair, unit: _Unit) -> None:
        """Run one unit with real gloo messages: post every data op (through the wrapped
        functions), acknowledge each receive, and wait until each send is acknowledged."""
        import torch

        c10d = self.c10d
        g, gp = pair.group, pair.group_peer
        deadline = time.monotonic() + self.timeout
        sends = [op for op in unit.ops if op.kind == "send"]
        recvs = [op for op in unit.ops if op.kind == "recv"]
        # acknowledgements of our sends: posted first, they arrive once the peer received
        acks_in = []
        for op in sends:
            buf = torch.full((1,), -1, dtype=torch.int64)
            w = c10d.irecv(buf, group=g, tag=_TAG_ACK + op.seq % _TAG_SPAN, group_src=gp)
            acks_in.append((op, w, buf))
            pair.keep.append((w, buf))
        data = self._post(pair, unit)
        acks_out = []
        for op in recvs:
            self._wait(data[op], deadline, pair, op, "its data")
            ack = torch.full((1,), op.seq, dtype=torch.int64)
            w = c10d.isend(ack, group=g, tag=_TAG_ACK + op.seq % _TAG_SPAN, group_dst=gp)
            acks_out.append((op, w, ack))
            pair.keep.append((w, ack))
        for op in sends:
            self._wait(data[op], deadline, pair, op, "a matching receive")
        for op, w, buf in acks_in:
            self._wait(w, deadline, pair, op, "its receipt")
            if int(buf.item()) != op.seq:
                raise NcclOrderError(
                    f"NCCL rules (emulation): rank {pair.me}'s {op.describe()} was acknowledged "
                    f"as send {int(buf.item()) + 1} by rank {pair.peer}: streams out of step")
        for op, w, _ in acks_out:
            self._wait(w, deadline, pair, op, "the peer to take its acknowledgement")
        pair.keep.clear()

    def _post(self, pair: _Pair, unit: _Unit) -> dict:
        """Post the unit's data operations through the wrapped functions: {op: gloo work}."""
        orig = self.orig
        g = pair.group

        def tag(op):
            return _TAG_DATA + op.seq % _TAG_SPAN

        works = None
        if unit.batch:
            try:
                p2p = [orig["P2POp"](orig["isend"] if op.kind == "send" else orig["irecv"],
                                     op.tensor, pair.peer, g, tag(op)) for op in unit.ops]
                got = orig["batch_isend_irecv"](p2p)
                if got is not None and len(got) == len(unit.ops):
                    works = dict(zip(unit.ops, got))
                elif got:
                    works = {op: _All(got) for op in unit.ops}
            except ValueError:  # a wrapper under us that P2POp does not accept
                works = None
        if works is None:
            works = {}
            for op in unit.ops:
                fn = orig["isend"] if op.kind == "send" else orig["irecv"]
                key = "dst" if op.kind == "send" else "src"
                works[op] = fn(op.tensor, **{key: pair.peer}, group=g, tag=tag(op))
        for w in works.values():
            pair.keep.append((w, None))
        return works

    def _wait(self, work, deadline, pair: _Pair, op: _Op, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=max(left, 0.001)))
        except Exception as exc:  # noqa: BLE001
            exc.nccl_rules_waiting = (op, what, left <= 0 or "Timed out" in str(exc))
            raise

    def _failure(self, pair: _Pair, unit: _Unit, exc: BaseException) -> BaseException:
        """The error every op of a failed unit (and every later op of the pair) raises; also
        logged, and published in the store for the peer's message."""
        if isinstance(exc, NcclOrderError):
            log.error(str(exc))
            return exc
        op, what, timed_out = getattr(exc, "nccl_rules_waiting", (unit.ops[0], "", False))
        waited = time.monotonic() - pair.started
        mine = pair.fifo()
        theirs = None
        try:
            store = self._store()
            store.set(f"{_STORE_PREFIX}/{pair.name}/stuck/{pair.me}-{pair.peer}", mine)
            key = f"{_STORE_PREFIX}/{pair.name}/stuck/{pair.peer}-{pair.me}"
            store.wait([key], datetime.timedelta(seconds=min(2.0, self.timeout / 2)))
            theirs = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the peer reported nothing (blocked elsewhere)
            pass
        side = (f"Rank {pair.peer}'s side: {theirs}" if theirs else
                f"Rank {pair.peer} reported no stuck operation with rank {pair.me} (it may be "
                f"blocked elsewhere: a collective, another pair, or host code)")
        if timed_out:
            how = f"waited {waited:.1f} s for {what or 'its match'}"
        elif "closed" in str(exc).lower():
            how = (f"waited {waited:.1f} s for {what or 'its match'} until rank {pair.peer} "
                   f"closed the connection (it timed out on the pair, or exited)")
        else:
            how = f"failed after {waited:.1f} s in gloo: {_short(exc)}"
        if timed_out or theirs:
            msg = (f"NCCL rules violated (deadlock): rank {pair.me} <-> rank {pair.peer} on "
                   f"{pair.where()}: rank {pair.me}'s {op.describe()} {how}. {mine}. {side}. "
                   f"On NCCL both directions of a pair run on one stream in issue order and "
                   f"a send completes only when its receive runs: this schedule deadlocks "
                   f"there (gloo forgives it).")
            err: BaseException = NcclOrderError(msg)
        else:
            msg = (f"NCCL rules (emulation): rank {pair.me}'s {op.describe()} with rank "
                   f"{pair.peer} on {pair.where()} {how}. {mine}. {side}.")
            err = RuntimeError(msg)
        err.__cause__ = exc
        log.error(msg)
        return err


def _short(exc) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class _All:
    """Several gloo works waited as one (a backend that coalesced a batch)."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait(timeout) if timeout is not None else w.wait()
        return True
