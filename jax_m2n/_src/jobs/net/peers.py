"""The "net" transport's connections on the fetching side: one DEALER per peer address
with its monitor, registered on the fetching thread's poller.

Owns the connections' socket options and bounds (what a peer can make this process
hold), their table, and the reading of monitor events as reasons; it never reads a
reply and knows no fetches (fetches.py).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from jax_m2n._src.jobs import channel
from jax_m2n._src.jobs.net import wire
from jax_m2n._src.jobs.net.curve import CurveKeys

API = wire.API

# Replies a connection may queue before zmq stops reading it (x CHUNK_BYTES at most).
QUEUED_MESSAGES = 64


class Peer:
  """A connection to one address: a DEALER and its monitor (the fetching thread's)."""

  def __init__(self, ctx: Any, zmq: Any, curve: CurveKeys | None, address: str):
    self._zmq = zmq
    self.address = address
    self.received = time.monotonic()  # when it last sent something
    host, port = channel.split_address(f"{API}.fetch", address)
    sock = ctx.socket(zmq.DEALER)
    wire.tune(sock, zmq)
    sock.setsockopt(zmq.SNDHWM, 0)  # requests: bounded by the fetches in flight
    # What the peer can make this process hold: frames of one chunk at most, and
    # QUEUED_MESSAGES of them (the thread copies them out as they come).
    sock.setsockopt(zmq.MAXMSGSIZE, max(wire.CHUNK_BYTES, wire.INLINE_BYTES)
                    + wire.MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
    if curve is not None:
      sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
      sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
      sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)
    if ":" in host:
      sock.setsockopt(zmq.IPV6, 1)
    self.sock = sock
    self.monitor = sock.get_monitor_socket(
        zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
      sock.connect(f"tcp://{channel.join_address(host, port)}")
    except zmq.ZMQError:
      self.close()
      raise

  def broken(self) -> str | None:
    """Why the connection is over (a monitor event), or None."""
    from zmq.utils.monitor import recv_monitor_message  # pylint: disable=import-outside-toplevel
    zmq = self._zmq
    why = None
    while True:
      try:
        event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
      except zmq.Again:
        return why
      why = why or {
          zmq.EVENT_DISCONNECTED: "it closed the connection (it died or closed)",
          zmq.EVENT_CONNECT_RETRIED: "it refused the connection (nothing listens there)",
          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused this process's CurveZMQ key",
      }.get(event, "the handshake failed (other CurveZMQ keys, or not a jax_m2n net "
                   "transport)")

  def close(self) -> None:
    try:
      self.sock.disable_monitor()
    except self._zmq.ZMQError:
      pass
    self.monitor.close(0)
    self.sock.close(0)


class Peers:
  """The fetching thread's connections by address, their sockets registered on its
  poller (the fetching thread's alone, like the poller)."""

  def __init__(self, ctx: Any, zmq: Any, curve: CurveKeys | None, poller: Any):
    self._ctx, self._zmq, self._curve, self._poller = ctx, zmq, curve, poller
    self._by_address: dict[str, Peer] = {}
    self._by_socket: dict[Any, Peer] = {}

  def __contains__(self, address: str) -> bool:
    return address in self._by_address

  def connect(self, address: str) -> Peer:
    """The connection to `address`, made (and registered) where there is none."""
    peer = self._by_address.get(address)
    if peer is None:
      peer = self._by_address[address] = Peer(self._ctx, self._zmq, self._curve, address)
      for s in (peer.sock, peer.monitor):
        self._poller.register(s, self._zmq.POLLIN)
        self._by_socket[s] = peer
    return peer

  def current(self, peer: Peer) -> bool:
    """Whether `peer` is still the connection to its address (not dropped)."""
    return self._by_address.get(peer.address) is peer

  def hit(self, events: Iterable[Any]) -> set[Peer]:
    """The connections whose data or monitor socket is among `events`."""
    return {self._by_socket[s] for s in events if s in self._by_socket}

  def quiet(self, now: float, for_s: float) -> set[str]:
    """The addresses whose peer sent nothing for `for_s` before `now`."""
    return {a for a, p in self._by_address.items() if now - p.received > for_s}

  def drop(self, address: str) -> None:
    """Closes the connection to `address`, if any: its monitor, its socket."""
    peer = self._by_address.pop(address, None)
    if peer is None:
      return
    for s in (peer.sock, peer.monitor):
      if self._by_socket.pop(s, None) is not None:
        self._poller.unregister(s)
    peer.close()

  def close(self) -> None:
    """Closes every connection."""
    for address in list(self._by_address):
      self.drop(address)
