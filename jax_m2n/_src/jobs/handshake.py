"""Everything before a control connection is authenticated: the publisher's gate, and
a subscriber's wait for its handshake.

Owns the server side's ZAP handler (only the client key derived from the token
passes) and its budget of unauthenticated connections per peer address (read from
zmq's socket monitor; a spent budget closes the address's new connections at once), in
one thread per server; and the client side's reading of its handshake (zmq's monitor
events, then at most one probe connection) into an error naming the cause. Never
parses a byte a peer sent: zmq does, within messages.MAX_FRAME_BYTES per frame.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any

from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError
from jax_m2n._src.jobs import auth, messages

logger = logging.getLogger("jax_m2n")

# Per peer address, a token bucket of unauthenticated connections: each accepted
# connection takes one, each that authenticates gives it back, BURST refill at
# REFILL_PER_S. An address with none left has its new connections closed at accept
# (before zmq reads its greeting). A legitimate job makes a few connections, all of
# which authenticate; a flood of half-open connections or of wrong keys spends its
# address's budget in a fraction of a second, and then costs the publisher a closed
# socket per connect, so one address holds at most BURST + REFILL_PER_S x HANDSHAKE_S
# sockets. (A connection zmq closed before the gate read its accept event, such as
# garbage refused in microseconds, cannot be attributed and is not charged: it held
# nothing.)
BURST = 64
REFILL_PER_S = 16.0
# The addresses tracked at once (IPv6 ones per /64); beyond, the fullest bucket is
# forgotten (it holds nothing a peer could have spent).
MAX_ADDRESSES = 4096
# zmq closes a connection whose handshake is not done within this (ZMQ_HANDSHAKE_IVL):
# a half-open connection holds a socket at most this long.
HANDSHAKE_S = 5.0
# How long a client's diagnosis waits to see whether the publisher closes a fresh
# connection at once (its budget for this address is spent) or keeps it (it dropped
# our handshake: another token).
PROBE_S = 0.5
# How many probe connections a diagnosis opens at once: one unit that came back to a
# spent budget between our failure and the probe must not read as a dropped handshake.
PROBES = 2
# How long a client waits for zmq's reconnect (100 ms by default) after a failed
# handshake before it diagnoses the first failure alone.
RETRY_S = 0.3
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZAP (RFC 27), one per zmq context
DOMAIN = b"jax_m2n"
# The ZMTP 3 greeting's signature, the first 10 bytes any zmq peer sends.
_SIGNATURE_FIRST, _SIGNATURE_LAST = 0xFF, 0x7F


def _event(frames: list[bytes]) -> tuple[int, int] | None:
  """(event, value) of a zmq socket-monitor message (libzmq 4 format: a 2-byte event,
  a 4-byte value, then the endpoint), None for anything else."""
  if len(frames) != 2 or len(frames[0]) != 6:
    return None
  head = frames[0]
  return int.from_bytes(head[:2], "little"), int.from_bytes(head[2:], "little")


def address_key(host: str) -> str:
  """The unit an address's budget is kept for: an IPv4 address (also when mapped into
  IPv6), an IPv6 /64 (one host usually holds a whole /64)."""
  try:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
  except ValueError:
    return host
  if ip.version == 6 and ip.ipv4_mapped is not None:
    return str(ip.ipv4_mapped)
  if ip.version == 6:
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))
  return str(ip)


@dataclasses.dataclass
class _Bucket:
  tokens: float
  at: float


class Budget:
  """The per-address token buckets (pure: the gate thread feeds it).

  Example:
    >>> b = Budget(burst=2, refill_per_s=1.0)
    >>> [b.take("10.0.0.1", now=0.0) for _ in range(3)]
    [True, True, False]
    >>> b.give_back("10.0.0.1", now=0.0); b.take("10.0.0.1", now=0.0)
    True
    >>> b.take("10.0.0.2", now=0.0), b.take("10.0.0.1", now=1.0)
    (True, True)
  """

  def __init__(self, burst: int | None = None, refill_per_s: float | None = None,
               max_addresses: int | None = None):
    # The module's limits as they are now (tests lower them).
    self._burst = BURST if burst is None else burst
    self._rate = REFILL_PER_S if refill_per_s is None else refill_per_s
    self._max = MAX_ADDRESSES if max_addresses is None else max_addresses
    self._buckets: dict[str, _Bucket] = {}

  def _bucket(self, address: str, now: float) -> _Bucket:
    key = address_key(address)
    b = self._buckets.get(key)
    if b is None:
      if len(self._buckets) >= self._max:
        fullest = max(self._buckets, key=lambda k: self._buckets[k].tokens)
        del self._buckets[fullest]
      b = self._buckets[key] = _Bucket(float(self._burst), now)
    b.tokens = min(float(self._burst), b.tokens + (now - b.at) * self._rate)
    b.at = now
    return b

  def take(self, address: str, now: float) -> bool:
    """Spends one unauthenticated connection of `address`; False when none is left."""
    b = self._bucket(address, now)
    if b.tokens < 1.0:
      return False
    b.tokens -= 1.0
    return True

  def give_back(self, address: str, now: float) -> None:
    """A connection of `address` authenticated: its unit comes back."""
    b = self._bucket(address, now)
    b.tokens = min(float(self._burst), b.tokens + 1.0)

  def __len__(self) -> int:
    return len(self._buckets)


class Gate:
  """A server socket's guard: the ZAP handler and the per-address budget, one thread.

  Use: `Gate(zmq, ctx, keys, name)` (binds ctx's ZAP endpoint: one gate per context),
  `protect(sock)` before `sock.bind`, `start(port)` after, `close()` after the socket
  is closed. `stats` counts accepted, refused (closed at accept), authenticated and
  wrong_key connections.
  """

  def __init__(self, zmq: Any, ctx: Any, keys: auth.Keys, name: str):
    self._zmq = zmq
    self._client_key = keys.client_public_raw
    self._server_secret = keys.server_secret
    self._zap = ctx.socket(zmq.REP)
    self._zap.setsockopt(zmq.LINGER, 0)
    self._zap.bind(ZAP_ENDPOINT)
    self._monitor = None
    self._port = 0
    self._name = f"{name}-gate"
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.budget = Budget()
    self.stats: collections.Counter = collections.Counter()

  def protect(self, sock: Any) -> None:
    """Makes `sock` (not yet bound) a CURVE server behind this gate."""
    zmq = self._zmq
    sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never accept
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, self._server_secret)
    self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED)

  def start(self, port: int) -> None:
    self._port = port
    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
    self._thread.start()

  def close(self) -> None:
    """Stops the thread (bounded), then closes its sockets (the guarded socket must be
    closed first: its monitor then ends)."""
    self._stop.set()
    if self._thread is not None and threading.current_thread() is not self._thread:
      self._thread.join(timeout=5.0)
    for s in (self._zap, self._monitor):
      if s is not None:
        s.close(0)

  def _loop(self) -> None:
    zmq = self._zmq
    poller = zmq.Poller()
    poller.register(self._zap, zmq.POLLIN)
    poller.register(self._monitor, zmq.POLLIN)
    while not self._stop.is_set():
      try:
        events = dict(poller.poll(100))
        if self._monitor in events:
          for _ in range(256):  # a burst, then the ZAP requests
            try:
              frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
              break
            self._accepted(_event(frames))
        if self._zap in events:
          self._authenticate(self._zap.recv_multipart())
      except zmq.ZMQError:
        return  # closed under us
      except Exception:  # noqa: BLE001 - the gate must outlive a surprise
        logger.exception("jax_m2n jobs: the control gate failed on an event")

  def _authenticate(self, request: list[bytes]) -> None:
    """A ZAP request (RFC 27): version, request id, domain, address, routing id,
    mechanism, credentials. zmq sends one per connection whose CURVE HELLO and INITIATE
    proved the server key; only the token's client key passes."""
    request_id = request[1] if len(request) > 1 else b""
    ok = False
    try:
      ok = (len(request) == 7 and request[0] == b"1.0" and request[2] == DOMAIN
            and request[5] == b"CURVE"
            and hmac.compare_digest(request[6], self._client_key))
      if ok:
        self.budget.give_back(request[3].decode("ascii", "replace"), time.monotonic())
      self.stats["authenticated" if ok else "wrong_key"] += 1
    finally:  # a REP socket must answer every request, or it answers no later one
      self._zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                b"OK" if ok else b"the client key must be the token's",
                                b"", b""])

  def _accepted(self, event: tuple[int, int] | None) -> None:
    if event is None or event[0] != self._zmq.EVENT_ACCEPTED:
      return
    self.stats["accepted"] += 1
    fd = event[1]
    # A duplicate of zmq's descriptor, to read the peer's address and, when its budget
    # is spent, shut the connection down (zmq then closes it as a dropped peer). The
    # event may be read late: only a socket still bound to our port is touched.
    try:
      dup = os.dup(fd)
    except OSError:
      return
    try:
      conn = socket.socket(fileno=dup)
    except OSError:
      os.close(dup)
      return
    with conn:
      try:
        if conn.getsockname()[1] != self._port:
          return
        peer = conn.getpeername()[0]
        if not self.budget.take(peer, time.monotonic()):
          conn.shutdown(socket.SHUT_RDWR)
          self.stats["refused"] += 1
      except OSError:
        return


# ---------------------------------------------------------------------------------------
# The client side
# ---------------------------------------------------------------------------------------

def client_events(zmq: Any) -> int:
  """The monitor events `wait` reads."""
  return (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def wait(zmq: Any, monitor: Any, api: str, peer: str, host: str, port: int,
         deadline: float, connect_s: float) -> None:
  """Returns once zmq reports the client's CURVE handshake done.

  Raises:
    ReshardValueError: the publisher refused our keys (another token).
    ReshardRuntimeError: nothing accepted a connection by `deadline`; the peer speaks
      another protocol; it refuses this address for now (its budget is spent); it
      accepted but never finished the handshake.
  """
  connected = False
  # Handshakes the publisher ended. One can be a race (the gate closed a connection of a
  # spent address while zmq finished its handshake, whose ZAP reply gave a unit back):
  # the token is blamed only when zmq's own reconnect fails the same way.
  failed = 0
  retry_by = None  # zmq does not reconnect after some failures (a peer that is no zmq)
  while True:
    now = time.monotonic()
    left = deadline - now
    if retry_by is not None and now >= retry_by and not connected:
      raise diagnose(api, peer, host, port, min(PROBE_S, max(0.05, left)))
    if left <= 0:
      if connected:
        raise ReshardRuntimeError(
            f"{api}: {peer} must finish the handshake within {connect_s:.1f} s; it "
            "accepted the connection but did not (stalled, or not a jax_m2n publisher).")
      raise ReshardRuntimeError(
          f"{api}: {peer} must accept a connection within {connect_s:.1f} s; got none "
          "(not running, not reachable from here, or the address is wrong).")
    wait_s = left if retry_by is None else min(left, max(0.0, retry_by - now))
    if not monitor.poll(max(1, int(wait_s * 1000))):
      continue
    got = _event(monitor.recv_multipart())
    if got is None:
      continue
    event, value = got
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
      return
    if event == zmq.EVENT_CONNECTED:
      connected = True
    elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
      if value == 400:
        raise _wrong_token(api, peer, "its ZAP handler refused our client key")
      raise ReshardRuntimeError(
          f"{api}: {peer} must accept our handshake; it refused it for now (ZAP status "
          f"{value}). Hint: retry.")
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
      raise ReshardRuntimeError(
          f"{api}: {peer} must speak the jax_m2n control protocol {messages.PROTOCOL} "
          f"(ZeroMQ CURVE); its handshake broke the protocol (zmq error 0x{value:x}). "
          "Hint: is it a jax_m2n Publisher of the same version?")
    elif connected and event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                 zmq.EVENT_DISCONNECTED):
      connected = False
      failed += 1
      if failed >= 2:
        raise diagnose(api, peer, host, port, min(PROBE_S, max(0.05, left)))
      retry_by = time.monotonic() + RETRY_S


def _wrong_token(api: str, peer: str, how: str) -> ReshardValueError:
  return ReshardValueError(
      f"{api}: token must be the one the publisher holds; {peer} {how}, as it does for "
      "keys derived from another token (or it is a ZeroMQ CURVE server that is not "
      "this publisher). Hint: give both jobs the same token.")


def diagnose(api: str, peer: str, host: str, port: int, probe_s: float) -> Exception:
  """Why the publisher closed our connection during the handshake, from PROBES
  connections opened together that send nothing: one closed at once (this address's
  budget of unauthenticated connections is spent: a unit that came back since our
  failure, refilled or given back, serves one probe at most), all kept open after a
  ZMTP greeting (it dropped our CURVE HELLO: another token), or something that is not
  a zmq peer."""
  opened = []
  try:
    for _ in range(PROBES):
      try:
        opened.append(socket.create_connection((host, port), timeout=probe_s))
      except OSError as e:
        return ReshardRuntimeError(
            f"{api}: {peer} must accept connections; it closed ours during the handshake "
            f"and refused another ({e}): it closed or crashed meanwhile.")
    until = time.monotonic() + probe_s
    seen = [_probe(p, until) for p in opened]
  finally:
    for p in opened:
      p.close()
  for got, _ in seen:
    if got and (got[0] != _SIGNATURE_FIRST or (len(got) >= 10
                                               and got[9] != _SIGNATURE_LAST)):
      return ReshardRuntimeError(
          f"{api}: {peer} must be a jax_m2n publisher (a ZeroMQ peer); what it sends "
          f"first is not a ZMTP greeting ({got[:10]!r}).")
  if any(closed for _, closed in seen):
    return ReshardRuntimeError(
        f"{api}: {peer} must accept connections from this host; it closes them at once: "
        "its budget of unauthenticated connections for this address is spent (too many "
        f"failed or unfinished handshakes from it lately; {BURST} at once, "
        f"{REFILL_PER_S:g} more per second). Hint: retry in a few seconds, and look for "
        "what else connects from this host.")
  if not all(got for got, _ in seen):
    return ReshardRuntimeError(
        f"{api}: {peer} must be a jax_m2n publisher (a ZeroMQ peer); it accepted a "
        "connection and sent no greeting.")
  return _wrong_token(api, peer, "dropped our CURVE handshake (our HELLO did not "
                      "decrypt with its key)")


def _probe(probe: socket.socket, until: float) -> tuple[bytes, bool]:
  """What `probe` received by `until` (past it, what was already there), and whether
  it was closed. Reads 1 KiB at most (a greeting is 64 bytes)."""
  got = b""
  try:
    while len(got) < 1024:
      probe.settimeout(max(0.001, until - time.monotonic()))
      data = probe.recv(64)
      if not data:
        return got, True
      got += data
    return got, False
  except socket.timeout:
    return got, False
  except OSError:
    return got, True
