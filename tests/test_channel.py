"""The control channel's security (docs/design.md#the-pool): loopback only, authenticated with
a per-pool secret, nothing unpickled before authentication, in both directions.

Every attack carries a pickle "bomb" whose unpickling would create a marker file, so "nothing
was unpickled" is observable, not assumed. Part one runs `channel.server_handshake` in a
local server thread; part two attacks a real 2-rank pool while it is running a job.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import stat
import struct
import threading
import time

import psutil
import pytest
import torch

from comfyui_xdit import GenerationRequest, ParallelConfig
from workers.runtime import channel
from workers.runtime.channel import AuthError, connect, server_handshake

HELLO = len(channel.MAGIC) + channel.NONCE


class Bomb:
    """Unpickling this creates the file at `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def bomb_frame(path) -> bytes:
    """A well-formed channel frame (8-byte length + pickle) carrying a Bomb, padded so that
    it alone fills the handshake reply the server waits for."""
    data = pickle.dumps([Bomb(path), "x" * 200], protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!Q", len(data)) + data


def test_bomb_works(tmp_path):
    """Positive control: the payload used below really does create its file when unpickled."""
    marker = tmp_path / "control"
    frame = bomb_frame(marker)
    pickle.loads(frame[8:])
    assert marker.exists()


@pytest.fixture
def unpickles(monkeypatch):
    """Counts every pickle.loads in this process during the test (the channel's only way to
    turn bytes into objects)."""
    calls = []
    real = pickle.loads

    def spy(data, *a, **kw):
        calls.append(len(data))
        return real(data, *a, **kw)

    monkeypatch.setattr(pickle, "loads", spy)
    return calls


def read_until_dropped(sock: socket.socket, within: float) -> bytes | None:
    """Everything the peer sends until it closes the connection; None if it is still open
    after `within` seconds."""
    sock.settimeout(0.2)
    got = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


# ---- attacks, shared by the local server and the real pool --------------------------------

def attack_garbage(address, marker):
    """Reads the challenge, answers with random bytes, then sends a pickle frame."""
    s = socket.create_connection(address, timeout=10)
    try:
        hello = s.recv(HELLO, socket.MSG_WAITALL)
        assert hello[: len(channel.MAGIC)] == channel.MAGIC
        s.sendall(os.urandom(channel.DIGEST + channel.NONCE))
        try:
            s.sendall(bomb_frame(marker))
        except OSError:
            pass  # already dropped
        return read_until_dropped(s, 8.0)
    finally:
        s.close()


def attack_pickle_first(address, marker):
    """Sends pickle frames straight away, without even reading the challenge."""
    s = socket.create_connection(address, timeout=10)
    try:
        s.sendall(bomb_frame(marker) * 2)
        rest = read_until_dropped(s, 8.0)
        return None if rest is None else rest[HELLO:]
    finally:
        s.close()


def attack_wrong_mac(address, marker):
    """A well-formed reply with a wrong MAC (HMAC under another secret), then a frame."""
    s = socket.create_connection(address, timeout=10)
    try:
        hello = s.recv(HELLO, socket.MSG_WAITALL)
        nonce = hello[len(channel.MAGIC):]
        s.sendall(channel._mac(os.urandom(32), nonce, b"client") + os.urandom(channel.NONCE))
        try:
            s.sendall(bomb_frame(marker))
        except OSError:
            pass
        return read_until_dropped(s, 8.0)
    finally:
        s.close()


def attack_echo(address, marker):
    """Echoes the server's challenge back as the reply (64 well-sized, plausible bytes)."""
    s = socket.create_connection(address, timeout=10)
    try:
        hello = s.recv(HELLO, socket.MSG_WAITALL)
        s.sendall(hello[len(channel.MAGIC):] * 2)
        try:
            s.sendall(bomb_frame(marker))
        except OSError:
            pass
        return read_until_dropped(s, 8.0)
    finally:
        s.close()


def attack_half(address, marker):
    """Half a reply, then hang up."""
    s = socket.create_connection(address, timeout=10)
    s.recv(HELLO, socket.MSG_WAITALL)
    s.sendall(b"\x80\x05" + b"\0" * 10)
    s.close()
    return b""


ATTACKS = {"garbage": attack_garbage, "pickle_first": attack_pickle_first,
           "wrong_mac": attack_wrong_mac, "echo": attack_echo, "half": attack_half}


def attack_silent(address, within):
    """Connects and sends nothing: must be dropped once the handshake times out. Returns
    what the server sent after its challenge (None: still open after `within` s)."""
    s = socket.create_connection(address, timeout=10)
    try:
        got = read_until_dropped(s, within)
        if got is not None:
            assert got[: len(channel.MAGIC)] == channel.MAGIC
            got = got[HELLO:]
        return got
    finally:
        s.close()


# ---- a local server running server_handshake ----------------------------------------------

SECRET = os.urandom(32)


@pytest.fixture
def server(monkeypatch):
    """A loopback server: authenticates each connection with server_handshake; an
    authenticated client gets its first message echoed back. Yields (address, outcomes)."""
    monkeypatch.setattr(channel, "AUTH_TIMEOUT", 1.0)  # the silent client's wait, shortened
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.1)
    outcomes: queue.Queue = queue.Queue()
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            try:
                chan = server_handshake(conn, SECRET)
            except AuthError as e:
                outcomes.put(("refused", str(e)))
                conn.close()
                continue
            except BaseException as e:  # anything else is a bug in the handshake
                outcomes.put(("crashed", repr(e)))
                conn.close()
                continue
            try:
                msg = chan.recv(timeout=10)
                chan.send(("echo", msg))
                outcomes.put(("ok", None))
            except Exception as e:
                outcomes.put(("error", repr(e)))
            finally:
                chan.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield lsock.getsockname(), outcomes
    stop.set()
    t.join(5)
    lsock.close()


def round_trip(address, secret=SECRET):
    chan = connect(address, secret)
    try:
        payload = ("hello", torch.arange(6.0).reshape(2, 3))
        chan.send(payload)
        kind, back = chan.recv(timeout=10)
        assert kind == "echo" and back[0] == "hello" and torch.equal(back[1], payload[1])
    finally:
        chan.close()


def test_right_secret_round_trip(server):
    """Positive control: the legitimate path works (so the refusals below mean something)."""
    address, outcomes = server
    round_trip(address)
    assert outcomes.get(timeout=5) == ("ok", None)


def test_wrong_secret_gets_auth_error(server, unpickles):
    address, outcomes = server
    with pytest.raises(AuthError):
        connect(address, os.urandom(32))
    assert outcomes.get(timeout=5)[0] == "refused"
    assert unpickles == []
    round_trip(address)  # the server still serves the right secret


@pytest.mark.parametrize("name", list(ATTACKS))
def test_unauthenticated_bytes_are_dropped_unread(server, unpickles, tmp_path, name):
    address, outcomes = server
    marker = tmp_path / "unpickled"
    extra = ATTACKS[name](address, marker)
    assert extra == b"", f"server sent {extra!r} to an unauthenticated client (None: kept open)"
    assert outcomes.get(timeout=5)[0] == "refused"
    assert unpickles == [], "the server unpickled bytes from an unauthenticated client"
    assert not marker.exists()
    round_trip(address)


def test_silent_client_is_dropped(server, unpickles):
    address, outcomes = server
    assert attack_silent(address, within=channel.AUTH_TIMEOUT + 3.0) == b"", \
        "a silent client was kept open past the handshake timeout"
    assert outcomes.get(timeout=5)[0] == "refused"
    assert unpickles == []
    round_trip(address)


def test_replayed_handshake_is_refused(server, unpickles, tmp_path):
    """A recorded valid reply (for an old challenge) does not authenticate a new connection:
    the server's nonce is fresh each time."""
    address, outcomes = server
    s = socket.create_connection(address, timeout=10)
    old_nonce = s.recv(HELLO, socket.MSG_WAITALL)[len(channel.MAGIC):]
    s.close()
    assert outcomes.get(timeout=5)[0] == "refused"
    recorded = channel._mac(SECRET, old_nonce, b"client") + os.urandom(channel.NONCE)
    s = socket.create_connection(address, timeout=10)
    try:
        hello = s.recv(HELLO, socket.MSG_WAITALL)
        assert hello[len(channel.MAGIC):] != old_nonce
        s.sendall(recorded + bomb_frame(tmp_path / "unpickled"))
        assert read_until_dropped(s, 5.0) == b""
    finally:
        s.close()
    assert outcomes.get(timeout=5)[0] == "refused"
    assert unpickles == [] and not (tmp_path / "unpickled").exists()


# ---- the client does not trust a server without the secret --------------------------------

def fake_server(behaviour):
    """A one-connection server running `behaviour(conn)`; returns its address."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        try:
            conn, _ = lsock.accept()
            with conn:
                behaviour(conn)
        except OSError:
            pass
        finally:
            lsock.close()

    threading.Thread(target=run, daemon=True).start()
    return lsock.getsockname()


def test_client_refuses_a_server_without_the_secret(unpickles, tmp_path):
    marker = tmp_path / "unpickled"

    def impostor(conn):  # a proper challenge, then a made-up proof and a pickle frame
        conn.sendall(channel.MAGIC + os.urandom(channel.NONCE))
        conn.recv(channel.DIGEST + channel.NONCE, socket.MSG_WAITALL)
        conn.sendall(os.urandom(channel.DIGEST) + bomb_frame(marker))
        time.sleep(1.0)

    with pytest.raises(AuthError):
        connect(fake_server(impostor), SECRET)

    def not_a_pool(conn):
        conn.sendall(bomb_frame(marker))
        time.sleep(1.0)

    with pytest.raises(AuthError):
        connect(fake_server(not_a_pool), SECRET)
    assert unpickles == [] and not marker.exists()


# ---- a real pool -------------------------------------------------------------------------

REQ = GenerationRequest(prompt=["a cat under attack"], seed=11, steps=60, height=64,
                        width=64, max_sequence_length=8)


@pytest.fixture(scope="module")
def real_pool(pools):
    pool = pools("flux", 2)
    pool.reconfigure(ParallelConfig(ulysses=2))
    return pool


def pool_secret(pool) -> bytes:
    with open(os.path.join(pool._tmp, "secret")) as f:
        return bytes.fromhex(f.read().strip())


def pool_address(pool) -> tuple:
    with open(os.path.join(pool._tmp, "address")) as f:
        return channel.parse_address(f.read())


def test_real_pool_listens_on_loopback_only(real_pool):
    pool = real_pool
    host, port = pool_address(pool)
    assert host == "127.0.0.1"
    assert len(pool_secret(pool)) >= 32
    for name in ("secret", ""):
        mode = stat.S_IMODE(os.stat(os.path.join(pool._tmp, name)).st_mode)
        assert mode & 0o077 == 0, f"{name or 'the pool dir'} is readable by others ({oct(mode)})"
    listening = []
    for pid in pool.worker_pids():
        for c in psutil.Process(pid).net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.append((pid, c.laddr.ip, c.laddr.port))
    assert (pool.worker_pids()[0], "127.0.0.1", port) in listening
    beyond = [x for x in listening if x[1] not in ("127.0.0.1", "::1")]
    assert not beyond, f"pool sockets listening beyond loopback: {beyond}"


def test_real_pool_drops_attackers_while_a_job_runs(real_pool, tmp_path):
    pool = real_pool
    want = pool.generate(REQ).samples  # warm reference run
    pids, launches = pool.worker_pids(), pool.launches
    address, secret = pool_address(pool), pool_secret(pool)
    started, events, outcome = threading.Event(), [], {}

    def on_event(event):
        events.append(event)
        started.set()

    def job():
        try:
            outcome["result"] = pool.generate(REQ, on_event=on_event)
        except BaseException as e:
            outcome["error"] = e
        finally:
            started.set()

    t = threading.Thread(target=job, daemon=True)
    t.start()
    try:
        assert started.wait(120)
        assert "error" not in outcome and len(events) < REQ.steps, "job not running"
        markers = {name: tmp_path / f"{name}.unpickled" for name in ATTACKS}
        wrong = bytearray(secret)
        wrong[0] ^= 1  # one bit off
        with pytest.raises(AuthError):
            connect(address, bytes(wrong))
        for name, attack in ATTACKS.items():
            extra = attack(address, markers[name])
            assert extra == b"", f"{name}: the pool answered {extra!r} (None: kept open)"
        # last: it holds the pool's acceptor for its handshake timeout (5 s)
        assert attack_silent(address, within=channel.AUTH_TIMEOUT + 5) == b"", \
            "a silent client was never dropped"
    finally:
        t.join(120)
    assert not t.is_alive()
    assert "error" not in outcome, repr(outcome.get("error"))
    assert torch.equal(outcome["result"].samples, want)
    assert [e["step"] for e in events] == list(range(1, REQ.steps + 1))
    assert not [n for n, m in markers.items() if m.exists()], "a pickle was unpickled"
    assert pool.worker_pids() == pids and pool.launches == launches
    # and the pool still takes jobs
    assert torch.equal(pool.generate(REQ).samples, want)
