"""The control channel between jobs: zmq endpoints that speak messages.py and auth.py.

Owns the sockets: a `Server` (one ROUTER socket served by one thread: handshakes,
sessions, sealed calls handed to a handler, deferred replies, bounded state) and a
`Client` (one DEALER socket: the handshake, then one sealed request at a time, each
answered within a deadline or reported as a dead peer). Every wait is bounded; nothing
here knows versions, arrays or plans.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable

from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardTypeError, ReshardValueError)
from jax_m2n._src.jobs import auth, messages
from jax_m2n._src.jobs.messages import ProtocolError

logger = logging.getLogger("jax_m2n")

# Bounds on the server's state: sessions beyond MAX_SESSIONS evict the least recently
# used; a handshake left half-done is forgotten after HANDSHAKE_S.
MAX_SESSIONS = 1024
MAX_HANDSHAKES = 256
HANDSHAKE_S = 10.0
# How often the server loop runs its tick (deferred replies, expiries) while idle.
TICK_S = 0.05


def _zmq():
  try:
    import zmq
  except ImportError:
    raise ReshardRuntimeError(
        "jax_m2n jobs: pyzmq must be installed for Publisher/Subscriber; got no module "
        "zmq. Hint: pip install 'jax_m2n[jobs]' (or pyzmq).") from None
  return zmq


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


def _bind_host(api: str, host: str) -> str:
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


@dataclasses.dataclass
class _Session:
  key: bytes
  seq: int = -1
  used: float = 0.0


@dataclasses.dataclass(frozen=True)
class Caller:
  """Whom a sealed call came from, to answer it (now or later, from the server
  thread): `reply(body)` seals and sends."""

  server: "Server"
  ident: bytes
  session: bytes
  seq: int

  def reply(self, body: dict[str, Any]) -> None:
    self.server._send_sealed(self, body)


class Server:
  """A ROUTER socket bound to `address`, served by one daemon thread.

  `handler(caller, body)` runs on the server thread for every authenticated call; it
  answers with `caller.reply(...)` at once or keeps `caller` and answers from `tick()`
  (also on the server thread, every TICK_S or after `wake()`). Anything malformed,
  oversized, unauthenticated or out of order is answered with an error (or dropped by
  zmq, for oversized frames) and changes nothing.
  """

  def __init__(self, api: str, address: str, key: bytes,
               handler: Callable[[Caller, dict[str, Any]], None],
               tick: Callable[[], None] | None = None, name: str = "jax_m2n-publisher"):
    zmq = _zmq()
    self._zmq = zmq
    self._api = api
    self._key = key
    self._handler = handler
    self._tick = tick
    host, port = split_address(api, address)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
    if ":" in host:
      sock.setsockopt(zmq.IPV6, 1)
    endpoint = f"tcp://{join_address(_bind_host(api, host), port) if port else None}"
    if not port:  # a free port, chosen by zmq
      endpoint = f"tcp://{join_address(_bind_host(api, host), 0)[:-1]}*"
    try:
      sock.bind(endpoint)
    except zmq.ZMQError as e:
      sock.close(0)
      raise ReshardRuntimeError(
          f"{api}: the control socket must bind {address!r}; got {e}. Hint: another "
          "process holds the port, or the host is not an address of this machine.") from None
    bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    self.host, self.port = host, int(bound.rsplit(":", 1)[1])
    self._sock = sock
    self._wake_in = ctx.socket(zmq.PAIR)
    self._wake_out = ctx.socket(zmq.PAIR)
    wake = f"inproc://jax_m2n-wake-{secrets.token_hex(8)}"
    self._wake_out.bind(wake)
    self._wake_in.connect(wake)
    self._wake_lock = threading.Lock()
    self._sessions: dict[bytes, _Session] = {}
    self._handshakes: dict[bytes, tuple[bytes, bytes, float]] = {}
    self._stop = threading.Event()
    self.refused = 0  # messages refused (tests read it)
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  @property
  def address(self) -> str:
    return join_address(self.host, self.port)

  def wake(self) -> None:
    """Runs `tick()` soon on the server thread (any thread may call it)."""
    with self._wake_lock:
      if not self._stop.is_set():
        self._wake_in.send(b"", self._zmq.NOBLOCK)

  def close(self) -> None:
    """Stops the thread (bounded), then closes the sockets."""
    self._stop.set()
    with self._wake_lock:
      try:
        self._wake_in.send(b"", self._zmq.NOBLOCK)
      except self._zmq.ZMQError:
        pass
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout=5.0)
    for s in (self._sock, self._wake_in, self._wake_out):
      s.close(0)

  # The server thread ------------------------------------------------------------------

  def _loop(self) -> None:
    zmq = self._zmq
    poller = zmq.Poller()
    poller.register(self._sock, zmq.POLLIN)
    poller.register(self._wake_out, zmq.POLLIN)
    while not self._stop.is_set():
      try:
        events = dict(poller.poll(int(TICK_S * 1000)))
      except zmq.ZMQError:
        return  # closed under us
      if self._stop.is_set():
        return
      if self._wake_out in events:
        while True:
          try:
            self._wake_out.recv(zmq.NOBLOCK)
          except zmq.Again:
            break
      if self._sock in events:
        for _ in range(64):  # a burst, then the tick
          try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
          except zmq.Again:
            break
          self._serve(frames)
      try:
        if self._tick is not None:
          self._tick()
      except Exception:  # noqa: BLE001 - the server must outlive a bad tick
        logger.exception("jax_m2n jobs: the publisher's tick failed")

  def _serve(self, frames: list[bytes]) -> None:
    if len(frames) != 2:  # [peer identity, one message]: anything else is refused
      self.refused += 1
      if frames:
        self._send(frames[0], {"type": "error", "message":
                               "message: must be one frame; got "
                               f"{len(frames) - 1}."})
      return
    ident, data = frames
    try:
      message = messages.decode(data)
      if message["type"] != "sealed" and len(data) > messages.MAX_HANDSHAKE_BYTES:
        raise ProtocolError(f"message: a handshake must be at most "
                            f"{messages.MAX_HANDSHAKE_BYTES} bytes; got {len(data)}.")
      kind = message["type"]
      if kind == "hello":
        self._hello(ident, message)
      elif kind == "auth":
        self._auth(ident, message)
      elif kind == "sealed":
        self._sealed(ident, message)
      else:
        raise ProtocolError(f"message: type must be hello, auth or sealed; got "
                            f"{messages._short(kind)}.")
    except ProtocolError as e:
      self.refused += 1
      self._send(ident, {"type": "error", "message": str(e)})
    except Exception as e:  # noqa: BLE001 - a handler bug must not end the server
      self.refused += 1
      logger.exception("jax_m2n jobs: a control message failed")
      self._send(ident, {"type": "error", "message": f"internal error: "
                         f"{type(e).__name__}: {e}"})

  def _send(self, ident: bytes, body: dict[str, Any]) -> None:
    try:
      self._sock.send_multipart(
          [ident, messages.encode({"m2n": messages.PROTOCOL, **body})],
          self._zmq.NOBLOCK)
    except self._zmq.ZMQError:
      pass  # the peer is gone: nothing to answer

  def _hello(self, ident: bytes, message: dict[str, Any]) -> None:
    client_nonce = messages.hex_field(message, "nonce", auth.NONCE_BYTES)
    now = time.monotonic()
    for s, (_, _, t) in list(self._handshakes.items()):
      if now - t > HANDSHAKE_S:
        del self._handshakes[s]
    if len(self._handshakes) >= MAX_HANDSHAKES:
      self._handshakes.pop(next(iter(self._handshakes)))
    session = secrets.token_bytes(auth.SESSION_BYTES)
    server_nonce = auth.nonce()
    self._handshakes[session] = (client_nonce, server_nonce, now)
    self._send(ident, {"type": "challenge", "nonce": server_nonce.hex(),
                       "session": session.hex(), "proof": auth.server_proof(
                           self._key, client_nonce, server_nonce, session).hex()})

  def _auth(self, ident: bytes, message: dict[str, Any]) -> None:
    session = messages.hex_field(message, "session", auth.SESSION_BYTES)
    proof = messages.hex_field(message, "proof", auth.MAC_BYTES)
    pending = self._handshakes.pop(session, None)
    if pending is None:
      raise ProtocolError("auth: the session must come from a hello of the last "
                          f"{HANDSHAKE_S:g} s; got an unknown session.")
    client_nonce, server_nonce, _ = pending
    if not auth.verify(auth.client_proof(self._key, client_nonce, server_nonce, session),
                       proof):
      raise ProtocolError("auth: the proof must show the publisher's token; it does "
                          "not (wrong token).")
    if len(self._sessions) >= MAX_SESSIONS:
      oldest = min(self._sessions, key=lambda s: self._sessions[s].used)
      del self._sessions[oldest]
    self._sessions[session] = _Session(
        auth.session_key(self._key, client_nonce, server_nonce, session),
        used=time.monotonic())
    self._send(ident, {"type": "welcome", "session": session.hex()})

  def _sealed(self, ident: bytes, message: dict[str, Any]) -> None:
    session = auth.session_of(message)
    state = self._sessions.get(session)
    if state is None:
      raise ProtocolError("sealed: the session must be authenticated; got an unknown "
                          "(or evicted) session. Hint: connect again.")
    seq, body = auth.open_sealed(state.key, auth.TO_SERVER, message)
    if seq <= state.seq:
      raise ProtocolError(f"sealed: seq must grow; got {seq} after {state.seq} "
                          "(replayed or out of order).")
    state.seq = seq
    state.used = time.monotonic()
    if body.get("op") == "bye":
      del self._sessions[session]
      return
    self._handler(Caller(self, ident, session, seq), body)

  def _send_sealed(self, caller: Caller, body: dict[str, Any]) -> None:
    state = self._sessions.get(caller.session)
    if state is None:
      return  # evicted or said bye meanwhile
    try:
      self._sock.send_multipart(
          [caller.ident, auth.seal(state.key, caller.session, auth.TO_CLIENT, caller.seq,
                                   body)], self._zmq.NOBLOCK)
    except self._zmq.ZMQError:
      pass


class Client:
  """One authenticated connection to a `Server` (one request at a time).

  Raises from the constructor: ReshardValueError for a wrong token (either side's
  proof fails), ReshardRuntimeError when nothing answers within `connect_s`.
  """

  _ids = itertools.count()

  def __init__(self, api: str, address: str, key: bytes, connect_s: float,
               peer: str):
    zmq = _zmq()
    self._zmq = zmq
    self._api = api
    self.address = address
    self.peer = peer  # how messages name it: "the publisher at 1.2.3.4:7000"
    host, port = split_address(api, address)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES)
    if ":" in host:
      sock.setsockopt(zmq.IPV6, 1)
    sock.connect(f"tcp://{join_address(host, port)}")
    self._sock = sock
    self._lock = threading.Lock()
    self._seq = 0
    self.broken: str | None = None
    try:
      self._handshake(key, connect_s)
    except BaseException:
      sock.close(0)
      raise

  def _exchange(self, message: dict[str, Any], deadline: float, what: str
                ) -> dict[str, Any]:
    self._sock.send(messages.encode({"m2n": messages.PROTOCOL, **message}))
    while True:
      left = deadline - time.monotonic()
      if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
        raise ReshardRuntimeError(
            f"{self._api}: {self.peer} must answer {what} in time; got no answer "
            f"within {max(0.0, deadline - self._started):.1f} s (not running, not "
            "reachable, or not a jax_m2n publisher).")
      reply = messages.decode(self._sock.recv())
      if reply["type"] == "error":
        raise ReshardValueError(f"{self._api}: {self.peer} refused {what}: "
                                f"{reply.get('message')}")
      return reply

  def _handshake(self, key: bytes, connect_s: float) -> None:
    self._started = time.monotonic()
    deadline = self._started + connect_s
    mine = auth.nonce()
    challenge = self._exchange({"type": "hello", "nonce": mine.hex()}, deadline,
                               "the handshake")
    if challenge["type"] != "challenge":
      raise ProtocolError(f"handshake: expected a challenge; got {challenge['type']}.")
    theirs = messages.hex_field(challenge, "nonce", auth.NONCE_BYTES)
    session = messages.hex_field(challenge, "session", auth.SESSION_BYTES)
    proof = messages.hex_field(challenge, "proof", auth.MAC_BYTES)
    if not auth.verify(auth.server_proof(key, mine, theirs, session), proof):
      raise ReshardValueError(
          f"{self._api}: token must be the one the publisher holds; {self.peer} proved "
          "another token (wrong token on one side, or not our publisher). Hint: give "
          "both jobs the same token.")
    try:
      welcome = self._exchange(
          {"type": "auth", "session": session.hex(),
           "proof": auth.client_proof(key, mine, theirs, session).hex()}, deadline,
          "the handshake")
    except ReshardValueError as e:
      raise ReshardValueError(
          f"{self._api}: token must be the one the publisher holds; {e}") from None
    if welcome["type"] != "welcome":
      raise ProtocolError(f"handshake: expected welcome; got {welcome['type']}.")
    self._session = session
    self._key = auth.session_key(key, mine, theirs, session)

  def call(self, body: dict[str, Any], answer_s: float, what: str) -> dict[str, Any]:
    """Sends one sealed request; returns the body of its sealed reply.

    Raises:
      ReshardRuntimeError: no reply within `answer_s` (the peer died, closed or
        stalled: named) or a broken connection; the reply's own error, as its kind
        says (ReshardValueError / ReshardRuntimeError / ReshardTimeoutError).
    """
    with self._lock:
      if self.broken is not None:
        raise ReshardRuntimeError(f"{self._api}: {self.peer} is unusable: {self.broken}")
      self._seq += 1
      seq = self._seq
      self._sock.send(auth.seal(self._key, self._session, auth.TO_SERVER, seq, body))
      started = time.monotonic()
      deadline = started + answer_s
      while True:
        left = deadline - time.monotonic()
        if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
          self.broken = f"no answer to {what} within {answer_s:.1f} s"
          raise ReshardRuntimeError(
              f"{self._api}: {self.peer} must answer {what} within {answer_s:.1f} s; "
              "got no answer (the publisher died, closed or stalled).")
        reply = messages.decode(self._sock.recv())
        if reply["type"] == "error":
          self.broken = str(reply.get("message"))
          raise ReshardRuntimeError(f"{self._api}: {self.peer} refused {what}: "
                                    f"{reply.get('message')}")
        got_seq, out = auth.open_sealed(self._key, auth.TO_CLIENT, reply)
        if got_seq != seq:
          continue  # the late answer of an earlier request: not ours
        error = out.get("error")
        if error is not None:
          kind = {"value": ReshardValueError, "timeout": ReshardTimeoutError,
                  "gone": messages.VersionGone}.get(
              out.get("kind"), ReshardRuntimeError)
          raise kind(f"{self._api}: {self.peer}: {error}")
        return out

  def close(self) -> None:
    with self._lock:
      if self.broken is None:
        try:
          self._seq += 1
          self._sock.send(auth.seal(self._key, self._session, auth.TO_SERVER,
                                    self._seq, {"op": "bye"}), self._zmq.NOBLOCK)
        except Exception:  # noqa: BLE001 - best effort
          pass
      self.broken = "closed"
      self._sock.close(0)
