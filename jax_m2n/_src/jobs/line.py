"""The local line: a subscriber's word to a publisher process on its host after a local
pull's copy (a lent version's confirmation), without the control channel's round trip.

Why: a lent version is confirmed after its copy (none of its arrays donated or deleted
meanwhile), so that round trip adds to every lent pull; over the control channel
(CurveZMQ over TCP, a server thread) it took 0.21 ms, over a Unix socket 0.011 ms
(median, one 2-core CPU host, two processes).

Owns `Server` (the publisher's side: a local_memory.TicketServer, an abstract-namespace
Unix socket served by one thread; peers of another uid are refused; a connection must
first show a one-use ticket within CLIENT_S, issued over the authenticated control
channel and bound there to that subscriber's control connection; then each request, a version as a little-endian int64, gets one byte: the
handler's answer, 1 or 0) and `Client` (the subscriber's side). What a request means
is the handler's (serving.py); nothing here knows versions or arrays.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from typing import Any, Callable

from jax_m2n._src import local_memory
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)

logger = logging.getLogger("jax_m2n")

TICKET_BYTES = local_memory.TICKET_BYTES
REQUEST = struct.Struct("<q")
# An unauthenticated connection must show its ticket within this long.
CLIENT_S = 1.0
# How long a ticket stays good (it travels in the answer that describes the export,
# and the subscriber connects at once).
TICKET_S = 30.0
MAX_CLIENTS = 256
MAX_READ = 4096


class Server(local_memory.TicketServer):
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
    self._handler = handler
    super().__init__("jax_m2n.line", "jax_m2n-line", CLIENT_S, max_clients, backlog=64)

  def offer(self, bound: Any, ttl_s: float = TICKET_S) -> bytes:
    """A one-use ticket that binds the connection showing it to `bound`."""
    return super().offer(bound, ttl_s)

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
      good, bound = self._take(bytes(c.buf[:TICKET_BYTES]))
      del c.buf[:TICKET_BYTES]
      if not good:
        self._drop(conn, refused=True)
        return
      c.bound, c.deadline = bound, None
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
      if local_memory.peer_uid(self._sock) != os.getuid():
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
