"""The control channel between the host and rank 0: authenticated, framed, pickled.

Authentication is a challenge-response on the per-pool secret (HMAC-SHA256 of a random
nonce, both directions) over fixed-size messages with a timeout, so a client without the
secret, or one sending garbage, is dropped before a single byte of it is unpickled.
Frames are `8-byte pickle length + 4-byte buffer count + 8 bytes per buffer length`, the
pickle, then the buffers: pickle protocol 5 hands large numpy arrays over out of band, so a
latent crosses the socket without being copied into the pickle, and is received straight
into its own buffer. Tensors travel by value (never as shared-memory handles, which break
when a process exits).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
from typing import Any, Optional

NONCE = 32
DIGEST = 32
MAGIC = b"XDIT1"
AUTH_TIMEOUT = 5.0


class AuthError(ConnectionError):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes, received in place into one buffer."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return buf


def _mac(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


class Channel:
    def __init__(self, sock: socket.socket):
        import threading
        self.sock = sock
        self.sock.settimeout(None)
        self._send_lock = threading.Lock()  # cancel() may send from another thread

    def send(self, obj: Any) -> None:
        buffers: list = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        head = struct.pack(f"!QI{len(raws)}Q", len(data), len(raws), *(r.nbytes for r in raws))
        with self._send_lock:
            self.sock.sendall(head)
            self.sock.sendall(data)
            for r in raws:
                self.sock.sendall(r)

    def recv(self, timeout: Optional[float] = None) -> Any:
        """Next message; raises TimeoutError when `timeout` passes first (nothing consumed)."""
        if timeout is not None and not self.poll(timeout):
            raise TimeoutError("no message")
        n, count = struct.unpack("!QI", _recv_exact(self.sock, 12))
        sizes = struct.unpack(f"!{count}Q", _recv_exact(self.sock, 8 * count)) if count else ()
        data = _recv_exact(self.sock, n)
        buffers = [_recv_exact(self.sock, k) for k in sizes]
        return pickle.loads(data, buffers=buffers)

    def poll(self, timeout: float = 0.0) -> bool:
        import select
        r, _, _ = select.select([self.sock], [], [], timeout)
        return bool(r)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def server_handshake(sock: socket.socket, secret: bytes) -> Channel:
    """Authenticate an accepted connection; raises AuthError (caller drops it)."""
    sock.settimeout(AUTH_TIMEOUT)
    try:
        nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce)
        reply = _recv_exact(sock, DIGEST + NONCE)
        if not hmac.compare_digest(reply[:DIGEST], _mac(secret, nonce, b"client")):
            raise AuthError("client failed authentication")
        sock.sendall(_mac(secret, reply[DIGEST:], b"server"))
    except (OSError, ConnectionError) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"handshake failed: {e}") from None
    return Channel(sock)


def connect(address: tuple, secret: bytes, timeout: float = 10.0) -> Channel:
    sock = socket.create_connection(address, timeout=timeout)
    try:
        head = _recv_exact(sock, len(MAGIC) + NONCE)
        if head[: len(MAGIC)] != MAGIC:
            raise AuthError(f"{address} is not an xDiT pool")
        mine = os.urandom(NONCE)
        sock.sendall(_mac(secret, head[len(MAGIC):], b"client") + mine)
        if not hmac.compare_digest(_recv_exact(sock, DIGEST), _mac(secret, mine, b"server")):
            raise AuthError(f"{address} answered with the wrong secret")
    except ConnectionError as e:
        sock.close()
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"pool at {address} refused the secret ({e})") from None
    except BaseException:
        sock.close()
        raise
    return Channel(sock)


def parse_address(text: str) -> tuple:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
