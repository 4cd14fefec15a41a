"""The local line: a subscriber's word to a publisher process on its host after a local
pull's copy (a lent version's confirmation), without the control channel's round trip.

Why: a lent version is confirmed after its copy (none of its arrays donated or deleted
meanwhile), so that round trip adds to every lent pull; over the control channel
(CurveZMQ over TCP, a server thread) it took 0.21 ms, over a Unix socket 0.011 ms
(median, one 2-core CPU host, two processes).

Owns `Server` (the publisher's side: an abstract-namespace Unix socket with a random
name, served by one daemon thread with a selector; peers of another uid are refused
(SO_PEERCRED); a connection must first show a one-use ticket within CLIENT_S, issued
over the authenticated control channel and bound there to that subscriber's control
connection; then each request, a version as a little-endian int64, gets one byte: the
handler's answer, 1 or 0) and `Client` (the subscriber's side). What a request means
is the handler's (serving.py); nothing here knows versions or arrays.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable

from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)

logger = logging.getLogger("jax_m2n")

TICKET_BYTES = 32
REQUEST = struct.Struct("<q")
# An unauthenticated connection must show its ticket within this long.
CLIENT_S = 1.0
# How long a ticket stays good (it travels in the answer that describes the export,
# and the subscriber connects at once).
TICKET_S = 30.0
MAX_CLIENTS = 256
MAX_READ = 4096
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer_uid(sock: socket.socket) -> int:
  return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                       _UCRED.size))[1]


@dataclasses.dataclass
class _Conn:
  buf: bytearray
  deadline: float | None  # None once its ticket was shown
  bound: Any = None        # what its ticket was issued for


class Server:
  """Answers local requests: `handler(bound, number) -> bool` runs on the line's
  thread for each request of a connection whose ticket (`offer(bound)`) was good.

  Example:
    >>> server = Server(lambda bound, n: n == 3)
    >>> client = Client(server.name, server.offer(b"peer"))
    >>> client.ask(3), client.ask(4)
    (True, False)
    >>> client.close(); server.close()
  """

  def __init__(self, handler: Callable[[Any, int], bool], max_clients: int = MAX_CLIENTS):
    self.name = f"jax_m2n.line.{secrets.token_hex(16)}"
    self._handler = handler
    self._max_clients = max_clients
    self._lock = threading.Lock()
    self._tickets: dict[bytes, tuple[Any, float]] = {}  # ticket -> (bound, expiry)
    self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._listener.bind("\0" + self.name)
    self._listener.listen(64)
    self._listener.setblocking(False)
    self._wake_r, self._wake_w = socket.socketpair()
    self._selector = selectors.DefaultSelector()
    self._selector.register(self._listener, selectors.EVENT_READ, None)
    self._selector.register(self._wake_r, selectors.EVENT_READ, None)
    self._clients: dict[socket.socket, _Conn] = {}
    self._closed = False
    self.refused = 0  # connections refused or dropped for a rule (tests read it)
    self._thread = threading.Thread(target=self._serve, name="jax_m2n-line", daemon=True)
    self._thread.start()

  def offer(self, bound: Any, ttl_s: float = TICKET_S) -> bytes:
    """A one-use ticket that binds the connection showing it to `bound`."""
    ticket = secrets.token_bytes(TICKET_BYTES)
    with self._lock:
      if self._closed:
        raise ReshardValueError("line.Server.offer: the server must be open; got closed.")
      self._tickets[ticket] = (bound, time.monotonic() + ttl_s)
    return ticket

  def clients(self) -> int:
    """Connections open now (tests)."""
    return len(self._clients)

  def _drop(self, conn: socket.socket, refused: bool) -> None:
    self.refused += int(refused)
    self._selector.unregister(conn)
    del self._clients[conn]
    conn.close()

  def _accept(self) -> None:
    try:
      conn, _ = self._listener.accept()
    except (BlockingIOError, InterruptedError):
      return
    try:
      same_user = _peer_uid(conn) == os.getuid()
    except OSError:
      same_user = False
    if not same_user or len(self._clients) >= self._max_clients:
      self.refused += 1
      conn.close()
      return
    conn.setblocking(False)
    self._clients[conn] = _Conn(bytearray(), time.monotonic() + CLIENT_S)
    self._selector.register(conn, selectors.EVENT_READ, None)

  def _read(self, conn: socket.socket) -> None:
    c = self._clients[conn]
    try:
      data = conn.recv(MAX_READ)
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      data = b""
    if not data:
      self._drop(conn, refused=False)  # the subscriber left
      return
    c.buf += data
    if c.deadline is not None:  # its ticket first
      if len(c.buf) < TICKET_BYTES:
        return
      ticket = bytes(c.buf[:TICKET_BYTES])
      del c.buf[:TICKET_BYTES]
      with self._lock:
        entry = self._tickets.pop(ticket, None)
      if entry is None or entry[1] < time.monotonic():
        self._drop(conn, refused=True)
        return
      c.bound, c.deadline = entry[0], None
    n = len(c.buf) // REQUEST.size
    if not n:
      return
    requests = [v for (v,) in REQUEST.iter_unpack(bytes(c.buf[:n * REQUEST.size]))]
    del c.buf[:n * REQUEST.size]
    try:
      answer = bytes(1 if self._handler(c.bound, v) else 0 for v in requests)
    except Exception:  # noqa: BLE001 - a handler bug: this connection ends, not the line
      logger.exception("jax_m2n jobs: a local line request failed")
      self._drop(conn, refused=False)
      return
    try:
      conn.sendall(answer)
    except OSError:  # gone, or not reading what it asked (its buffer full)
      self._drop(conn, refused=False)

  def _sweep(self) -> None:
    now = time.monotonic()
    for conn, c in list(self._clients.items()):
      if c.deadline is not None and c.deadline < now:
        self._drop(conn, refused=True)
    with self._lock:
      for t in [t for t, (_, expiry) in self._tickets.items() if expiry < now]:
        del self._tickets[t]

  def _serve(self) -> None:
    while not self._closed:
      for key, _ in self._selector.select(timeout=0.1):
        sock = key.fileobj
        if sock is self._listener:
          self._accept()
        elif sock is self._wake_r:
          sock.recv(64)
        elif sock in self._clients:
          self._read(sock)
      self._sweep()

  def close(self, timeout_s: float = 5.0) -> None:
    """Stops the thread and closes every connection (their clients see it closed)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._tickets.clear()
    self._wake_w.send(b"x")
    self._thread.join(timeout_s)
    for conn in list(self._clients):
      self._drop(conn, refused=False)
    for sock in (self._listener, self._wake_r, self._wake_w):
      sock.close()
    self._selector.close()


class Client:
  """A connection to a `Server` on this host (`name`, `ticket`: from the publisher's
  authenticated answer): `start(number)` sends a request, `finish(timeout_s)` reads its
  answer; `ask` does both. One request at a time.

  Raises (each call): ReshardRuntimeError where the server is gone, of another user,
  refused the ticket or closed the connection; ReshardTimeoutError where it did not
  answer in time. The client is then closed (a late answer would be read as the next
  one's).
  """

  def __init__(self, name: str, ticket: bytes, connect_s: float = 1.0):
    if not isinstance(ticket, bytes) or len(ticket) != TICKET_BYTES:
      raise ReshardValueError(f"line.Client: ticket must be {TICKET_BYTES} bytes; got "
                              f"{type(ticket).__name__} of length {len(ticket)}.")
    self.name = name
    self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      self._sock.settimeout(connect_s)
      self._sock.connect("\0" + name)
      if _peer_uid(self._sock) != os.getuid():
        raise ReshardRuntimeError(f"line.Client: the server {name!r} must run as this "
                                  "user; got another uid.")
      self._sock.sendall(ticket)
    except OSError as e:
      self.close()
      raise ReshardRuntimeError(f"line.Client: the server {name!r} must be reachable; "
                                f"got {e}.") from None
    except BaseException:
      self.close()
      raise

  def start(self, number: int) -> None:
    sock = self._usable()
    try:
      sock.sendall(REQUEST.pack(number))
    except OSError as e:
      self.close()
      raise ReshardRuntimeError(f"line.Client: sending to {self.name!r} failed ({e}); "
                                "the publisher closed or died.") from None

  def finish(self, timeout_s: float) -> bool:
    sock = self._usable()
    try:
      sock.settimeout(timeout_s)
      got = sock.recv(1)
    except socket.timeout:
      self.close()
      raise ReshardTimeoutError(f"line.Client: {self.name!r} must answer within "
                                f"{timeout_s:.1f} s; got no answer (the publisher "
                                "stalled).") from None
    except OSError as e:
      got, error = b"", e
    else:
      error = None
    if not got:
      self.close()
      raise ReshardRuntimeError(f"line.Client: {self.name!r} closed the line "
                                f"({error or 'refused the ticket, closed or died'}).")
    return got == b"\x01"

  def ask(self, number: int, timeout_s: float = 1.0) -> bool:
    self.start(number)
    return self.finish(timeout_s)

  @property
  def closed(self) -> bool:
    return self._sock is None

  def _usable(self) -> socket.socket:
    if self._sock is None:
      raise ReshardRuntimeError(f"line.Client: the line to {self.name!r} must be open; "
                                "got closed.")
    return self._sock

  def close(self) -> None:
    if self._sock is not None:
      sock, self._sock = self._sock, None
      sock.close()
