"""The control channel between jobs: zmq endpoints that speak messages.py over CurveZMQ.

Owns the sockets: a `Server` (a CURVE ROUTER socket behind handshake.Gate, served by one
thread: requests reassembled within bounds and handed to a handler; replies and notices
posted from any thread and sent by outbox.py) and a `Client` (a CURVE DEALER socket: one
request at a time, each answered within a deadline or reported as a dead peer; its
messages exchanged by exchange.py, its traffic counted here). Every wait is bounded;
nothing here knows versions, arrays or plans.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Callable

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import auth, handshake, messages
from jax_m2n._src.jobs.exchange import Exchange
from jax_m2n._src.jobs.messages import ProtocolError
from jax_m2n._src.jobs.outbox import Outbox

logger = logging.getLogger("jax_m2n")

# How often the server loop runs its tick (deferred replies, expiries) while idle.
TICK_S = 0.05
# Messages (of at most messages.MAX_FRAME_BYTES) zmq queues per authenticated peer
# before it stops reading that peer's connection: 4 MiB.
SERVER_RCVHWM = 64
# A client's send queue: one whole request of MAX_MESSAGE_BYTES fits.
CLIENT_SNDHWM = messages.MAX_MESSAGE_BYTES // messages.CHUNK_BYTES + 64

# Every client's traffic in this process (a pull's control round trips, for tests and
# benchmarks): calls, messages and bytes sent and received, notices (those dropped
# beyond exchange.MAX_NOTICES too).
stats: collections.Counter = collections.Counter()
_stats_lock = threading.Lock()


def split_address(api: str, address: Any) -> tuple[str, int]:
  """("host", port) of "host:port" (IPv6 hosts in brackets: "[::1]:7000")."""
  if not isinstance(address, str):
    raise ReshardTypeError(
        f"{api}: address must be a 'host:port' string; got {type(address).__name__} "
        f"{address!r}.")
  host, sep, port = address.rpartition(":")
  if host.startswith("[") and host.endswith("]"):
    host = host[1:-1]
  if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
    raise ReshardValueError(
        f"{api}: address must be 'host:port' with a port in [0, 65535]; got "
        f"{address!r}. Hint: '127.0.0.1:7000', '0.0.0.0:7000', '[::1]:7000'.")
  return host, int(port)


def join_address(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_host(api: str, host: str) -> str:
  """An IP literal for zmq's bind (it binds interfaces, not host names)."""
  try:
    ipaddress.ip_address(host)
    return host
  except ValueError:
    pass
  try:
    return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
  except OSError as e:
    raise ReshardValueError(f"{api}: the host of address must resolve; got {host!r} "
                            f"({e}).") from None


def is_wildcard(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_unspecified
  except ValueError:
    return False


@dataclasses.dataclass(frozen=True)
class Caller:
  """Whom a call came from, to answer it: `reply(body)` from any thread, now or later
  (once). `peer` names the connection for `Server.notify`."""

  server: "Server"
  peer: bytes
  seq: int

  def reply(self, body: dict[str, Any]) -> None:
    self.server._post(self.peer, {"type": "reply", "seq": self.seq, "body": body})


def _keys(api: str, key: Any) -> auth.Keys:
  if not isinstance(key, auth.Keys):
    raise ReshardTypeError(f"{api}: key must come from auth.as_key(api, token); got "
                           f"{type(key).__name__}.")
  return key


def _bind(zmq: Any, ctx: Any, gate: handshake.Gate, api: str, address: str, host: str,
          port: int) -> tuple[Any, int]:
  """(A ROUTER socket of `ctx` behind `gate`, bound to `address` = host:port, its port);
  port 0: a free one, chosen by zmq."""
  sock = ctx.socket(zmq.ROUTER)
  try:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, SERVER_RCVHWM)
    if ":" in host:
      sock.setsockopt(zmq.IPV6, 1)
    gate.protect(sock)
    bound = bind_host(api, host)
    try:
      # Port 0: a free port, chosen by zmq.
      sock.bind(f"tcp://{join_address(bound, port)}" if port
                else f"tcp://{join_address(bound, 0)[:-1]}*")
    except zmq.ZMQError as e:
      raise ReshardRuntimeError(
          f"{api}: the control socket must bind {address!r}; got {e}. Hint: another "
          "process holds the port, or the host is not an address of this machine."
      ) from None
  except BaseException:
    sock.close(0)
    raise
  return sock, int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])


class Server:
  """A CURVE ROUTER socket bound to `address`, served by one daemon thread.

  Only clients holding the token's keys get through the handshake (handshake.Gate, its
  own thread); nothing else reaches this thread. `handler(caller, body)` runs on the
  server thread for every call; it answers with `caller.reply(...)` at once, or later
  from any thread (encoded there, sent by the server thread), or from `tick()` (on the
  server thread, every TICK_S or after `wake()`). `notify(peer, body)` sends a client
  a message it did not ask for. A malformed or oversized request is answered with an
  error and changes nothing.
  """

  def __init__(self, api: str, address: str, key: Any,
               handler: Callable[[Caller, dict[str, Any]], None],
               tick: Callable[[], None] | None = None, name: str = "jax_m2n-publisher"):
    zmq = auth.zmq_module()
    keys = _keys(api, key)
    self._zmq = zmq
    self._api = api
    self._handler = handler
    self._tick = tick
    self.host, port = split_address(api, address)
    # A context of its own: its own ZAP endpoint (one handler per context) and I/O thread.
    self._ctx = zmq.Context(io_threads=1)
    self._gate = handshake.Gate(zmq, self._ctx, keys, name)
    try:
      self._sock, self.port = _bind(zmq, self._ctx, self._gate, api, address, self.host,
                                    port)
    except BaseException:
      self._gate.close()
      self._ctx.term()
      raise
    self._gate.start(self.port)
    self.refused = 0  # requests refused (tests read it)
    self.stats: collections.Counter = collections.Counter()  # calls, replies, notices
    self._outbox = Outbox(zmq, self._ctx, self._sock, self.stats)
    self._assembler = messages.Assembler()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  @property
  def address(self) -> str:
    return join_address(self.host, self.port)

  @property
  def gate(self) -> handshake.Gate:
    """The handshake's guard (tests and benchmarks read its `stats` and `budget`)."""
    return self._gate

  def wake(self) -> None:
    """Runs `tick()` soon on the server thread (any thread may call it)."""
    self._outbox.wake()

  def notify(self, to: Caller | bytes, body: dict[str, Any]) -> None:
    """Sends `body` to a connected client unasked (any thread): `to` is a Caller of that
    client or its `peer`. The client reads it with `Client.wait_notice` (its calls keep
    notices aside meanwhile); a client gone meanwhile never gets it (zmq drops it). A
    client that reads nothing holds about 2,000 messages in zmq's queues (1,000 each
    way); beyond, zmq drops what is sent to it, replies included: notices are for
    rare events (a version published), not a stream."""
    peer = to.peer if isinstance(to, Caller) else to
    self._post(peer, {"type": "notice", "body": body})

  def close(self) -> None:
    """Stops the threads (bounded), then closes the sockets and the context."""
    self._stop.set()
    self._outbox.stop()
    joined = True
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout=5.0)
      joined = not self._thread.is_alive()
    self._sock.close(0)
    self._outbox.close()
    self._gate.close()
    if joined:  # every socket of the context is closed: term returns at once
      self._ctx.term()

  def _post(self, peer: bytes, message: dict[str, Any]) -> None:
    """Sends `message` to `peer` from the server thread (any thread may post)."""
    self._outbox.post(peer, message, threading.current_thread() is self._thread)

  # The server thread ------------------------------------------------------------------

  def _loop(self) -> None:
    zmq = self._zmq
    poller = zmq.Poller()
    poller.register(self._sock, zmq.POLLIN)
    poller.register(self._outbox.socket, zmq.POLLIN)
    while not self._stop.is_set():
      try:
        events = dict(poller.poll(int(TICK_S * 1000)))
      except zmq.ZMQError:
        return  # closed under us
      if self._stop.is_set():
        return
      if self._outbox.socket in events:
        self._outbox.drain()
      self._outbox.flush()
      if self._sock in events:
        for _ in range(256):  # a burst, then the tick
          try:
            peer = self._sock.recv(zmq.NOBLOCK)
          except zmq.Again:
            break
          except zmq.ZMQError:
            return
          self._receive(peer)
      self._assembler.expire()
      try:
        if self._tick is not None:
          self._tick()
      except Exception:  # noqa: BLE001 - the server must outlive a bad tick
        logger.exception("jax_m2n jobs: the publisher's tick failed")

  def _receive(self, peer: bytes) -> None:
    """One message of `peer` (its routing id read already): one chunk frame. A message
    of several frames is refused (each frame is read and dropped: zmq holds it whole)."""
    frames, chunk = 0, b""
    while self._sock.getsockopt(self._zmq.RCVMORE):
      frame = self._sock.recv()
      frames += 1
      if frames == 1:
        chunk = frame
    if frames != 1:
      self._refuse(peer, None, f"message: must be one frame per chunk; got {frames}.")
      return
    self.stats["received"] += 1
    seq = None
    try:
      data = self._assembler.add(peer, chunk)
      if data is None:
        return
      message = messages.decode(data)
      if message["type"] != "call":
        raise ProtocolError(f"message: type must be call; got "
                            f"{messages._short(message['type'])}.")
      seq = messages.field(message, "seq", int, lo=0, hi=1 << 62)
      body = messages.field(message, "body", dict)
      self.stats["calls"] += 1
      self._handler(Caller(self, peer, seq), body)
    except ProtocolError as e:
      self._refuse(peer, seq, str(e))
    except Exception as e:  # noqa: BLE001 - a handler bug must not end the server
      logger.exception("jax_m2n jobs: a control message failed")
      self._refuse(peer, seq, f"internal error: {type(e).__name__}: {e}")

  def _refuse(self, peer: bytes, seq: int | None, why: str) -> None:
    self.refused += 1
    self._post(peer, {"type": "error", "seq": seq, "message": why})


class Client:
  """One authenticated connection to a `Server`: one request at a time; notices the
  server sends unasked wait in a queue for `wait_notice`.

  Raises from the constructor: ReshardValueError for a wrong token (the publisher
  dropped or refused our keys), ReshardRuntimeError when nothing completes the
  handshake within `connect_s` (the error names what was seen: no listener, another
  protocol, a refusal of this address, a stall).
  """

  def __init__(self, api: str, address: str, key: Any, connect_s: float, peer: str):
    zmq = auth.zmq_module()
    keys = _keys(api, key)
    self._zmq = zmq
    self._api = api
    self.address = address
    self.peer = peer  # how messages name it: "the publisher at 1.2.3.4:7000"
    host, port = split_address(api, address)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # Replies come whole in one frame (this side connects out; it is no listening port).
    sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES + messages.CURVE_OVERHEAD)
    sock.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
    if ":" in host:
      sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    monitor = sock.get_monitor_socket(handshake.client_events(zmq))
    self._sock = sock
    self._lock = threading.Lock()
    self._open: int | None = None  # a request started and not finished
    self._exchange = Exchange(sock, zmq, api, peer, self._count)
    self.broken: str | None = None
    self.stats: collections.Counter = collections.Counter()
    started = time.monotonic()
    try:
      sock.connect(f"tcp://{join_address(host, port)}")
      handshake.wait(zmq, monitor, api, peer, host, port, started + connect_s, connect_s)
    except BaseException:
      sock.disable_monitor()
      monitor.close(0)
      sock.close(0)
      raise
    sock.disable_monitor()
    monitor.close(0)

  def _count(self, name: str, n: int) -> None:
    self.stats[name] += n
    with _stats_lock:
      stats[name] += n

  def call(self, body: dict[str, Any], answer_s: float, what: str) -> dict[str, Any]:
    """Sends one request; returns the body of its reply (notices that arrive meanwhile
    are kept for `wait_notice`).

    Raises:
      ReshardRuntimeError: no reply within `answer_s` (the peer died, closed or
        stalled: named; the client is then broken), a refused request, a broken client;
        the reply's own error, as its kind says (ReshardValueError /
        ReshardRuntimeError / ReshardTimeoutError / VersionGone).
    """
    return self.finish(self.start(body, what), answer_s, what)

  def start(self, body: dict[str, Any], what: str) -> int:
    """Sends one request without waiting for its reply (`finish` waits): a caller with
    requests for several servers sends them all, then waits. One request at a time per
    client: `finish` it before the next `start` or `call`. Returns its number."""
    with self._lock:
      self._usable()
      if self._open is not None:
        raise ReshardRuntimeError(f"{self._api}: {self.peer}: one request at a time; "
                                  f"request {self._open} is not finished.")
      try:
        self._open = self._exchange.send(body, what)
      except self._zmq.ZMQError as e:
        self.broken = f"sending {what} failed ({e})"
        raise ReshardRuntimeError(f"{self._api}: {self.peer}: {self.broken}.") from None
      return self._open

  def tell(self, body: dict[str, Any], what: str) -> None:
    """Sends one request whose reply nobody waits for (dropped as a late one when it
    comes): a word to the server, e.g. a subscriber's "pulled". Allowed while another
    request is open. Raises as `start` does."""
    with self._lock:
      self._usable()
      try:
        self._exchange.send(body, what)
      except self._zmq.ZMQError as e:
        self.broken = f"sending {what} failed ({e})"
        raise ReshardRuntimeError(f"{self._api}: {self.peer}: {self.broken}.") from None

  def finish(self, seq: int, answer_s: float, what: str) -> dict[str, Any]:
    """The reply to request `seq` (`start`), waiting at most `answer_s`; raises as
    `call` does."""
    with self._lock:
      self._open = None
      message = self._exchange.reply(seq, time.monotonic() + answer_s)
      if message is None:
        self.broken = f"no answer to {what} within {answer_s:.1f} s"
        raise ReshardRuntimeError(
            f"{self._api}: {self.peer} must answer {what} within {answer_s:.1f} s; "
            "got no answer (the publisher died, closed or stalled).")
      return self._exchange.body(message, what)

  def poll_notices(self) -> list[dict[str, Any]]:
    """Every notice that has arrived, without waiting (oldest first).

    Raises:
      ReshardRuntimeError: the client is broken or closed.
    """
    with self._lock:
      self._usable()
      if self._open is None:  # (while a request is open, its reply is not read here)
        while self._exchange.receive(None) is not None:
          pass  # a late reply of an earlier request: dropped; notices are kept
      out = list(self._exchange.notices)
      self._exchange.notices.clear()
      return out

  def wait_notice(self, timeout_s: float) -> dict[str, Any] | None:
    """The next notice the server sent (kept while calls ran), or None after
    `timeout_s`. Any thread; a call from another thread goes between its polls.

    Raises:
      ReshardRuntimeError: the client is broken or closed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
      with self._lock:
        if self._exchange.notices:
          return self._exchange.notices.popleft()
        self._usable()
        left = deadline - time.monotonic()
        if left <= 0:
          return None
        # A reply read here is a late one (no call runs while the lock is held): dropped.
        self._exchange.receive(time.monotonic() + min(left, TICK_S))

  def _usable(self) -> None:
    """Raises where the client is broken or closed (the lock is held)."""
    if self.broken is not None:
      raise ReshardRuntimeError(f"{self._api}: {self.peer} is unusable: {self.broken}")

  def close(self) -> None:
    with self._lock:
      self.broken = "closed"
      self._sock.close(0)
