"""The "net" transport's fetching side: the one thread that sends requests, takes
replies and monitor events, and the fetches in flight.

Owns the fetches in flight and the fetching loop: a fetch ends with its arrays, its
peer's answer that there is nothing (expired, busy, withdrawn, unreadable), its peer's
death or silence (zmq's monitor and heartbeats), `forget`, or `close`. A fetch's own
receive state machine (every byte checked against what was asked) is receive.py's;
the connections peers.py's. Serving is offers.py's.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
from typing import Any, Container, Sequence

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.jobs.outbox import Waker
from jax_m2n._src.jobs.net import wire
from jax_m2n._src.jobs.net.curve import CurveKeys
from jax_m2n._src.jobs.net.peers import Peer, Peers
from jax_m2n._src.jobs.net.receive import Fetch

API = wire.API

# A fetch whose reply has not started this long after its wait ended, from a peer that
# sent nothing for as long, fails here (a live peer answers every request it keeps by
# the request's wait; this covers one that lost it).
REPLY_GRACE_S = 10.0


class InFlight:
  """The fetches in flight by request id, and the commands for the fetching thread.

  Threads: any (one lock). `close` fails every fetch; later ones are refused.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._closed = False
    self._rids = itertools.count(1)
    self._fetches: dict[int, Fetch] = {}
    self._commands: list[tuple[str, Any]] = []

  def add(self, fetch: Fetch) -> None:
    """Keeps `fetch` and asks the thread to send its request."""
    with self._lock:
      if self._closed:
        raise ReshardRuntimeError(f"{API}.fetch: the transport must be open; it is "
                                  "closed.")
      rid = next(self._rids)
      self._fetches[rid] = fetch
      self._commands.append(("send", (rid, fetch.wait_ms)))

  def forget(self, address: str) -> None:
    """Fails the fetches from `address` and asks the thread to close its connection."""
    with self._lock:
      gone = self._pop(address)
      self._commands.append(("close", address))
    for f in gone:
      f.fail(ReshardRuntimeError(f"{API}: the fetch of ticket {f.ticket} from {address} "
                                 "was abandoned (the peer was forgotten)."))

  def close(self) -> None:
    with self._lock:
      self._closed = True
      gone = self._pop(None)
    for f in gone:
      f.fail(ReshardRuntimeError(f"{API}: the fetch of ticket {f.ticket} from "
                                 f"{f.address} was abandoned (the transport closed)."))

  def commands(self) -> list[tuple[str, Any]]:
    """Takes the commands given since the last call: ("send", (rid, wait_ms)) or
    ("close", address)."""
    with self._lock:
      commands, self._commands = self._commands, []
    return commands

  def get(self, rid: int) -> Fetch | None:
    with self._lock:
      return self._fetches.get(rid)

  def pop(self, rid: int) -> Fetch | None:
    with self._lock:
      return self._fetches.pop(rid, None)

  def answered(self, rid: int, address: str, status: int, sizes: list[int]
               ) -> tuple[Fetch | None, str | None]:
    """(The fetch a HEAD from `address` answers, or None where it was forgotten
    meanwhile; the peer's protocol error, if any). A HEAD that ends the fetch (not OK,
    or the wrong sizes) takes it out."""
    with self._lock:
      fetch = self._fetches.get(rid)
      if fetch is None:
        return None, None
      if fetch.address != address or fetch.buffers is not None:
        return None, (f"it answered request {rid}, which it was not sent or answered "
                      "already")
      if status != wire.OK or sizes != fetch.sizes:
        self._fetches.pop(rid)  # it fails in `Fetch.head`
    return fetch, None

  def fail(self, address: str, why: str) -> None:
    """Fails the fetches from the peer at `address`, saying `why`."""
    with self._lock:
      gone = self._pop(address)
    for f in gone:
      f.fail(ReshardRuntimeError(f"{API}: the fetch of ticket {f.ticket} from the peer at "
                                 f"{address} failed: {why}."))

  def late(self, now: float, quiet: Container[str], connected: Container[str]) -> None:
    """Fails the fetches whose reply never started by their deadline, from a peer
    `quiet` (it sent nothing for REPLY_GRACE_S) or no longer `connected`."""
    with self._lock:
      late = [r for r, f in self._fetches.items() if f.buffers is None
              and f.deadline < now and (f.address in quiet or f.address not in connected)]
      late = [self._fetches.pop(r) for r in late]
    for f in late:
      f.fail(ReshardTimeoutError(f"{API}: the peer at {f.address} must answer the fetch "
                                 f"of ticket {f.ticket}; got no answer in time."))

  def _pop(self, address: str | None) -> list[Fetch]:
    """Removes (the lock is held) and returns the fetches from `address` (None: all)."""
    rids = [r for r, f in self._fetches.items() if address is None or f.address == address]
    return [self._fetches.pop(r) for r in rids]


class Fetcher:
  """The fetching thread and its connections.

  Threads: `fetch` and `forget` from any thread; the sockets only on the fetching
  thread. `close` fails every fetch in flight and stops the thread (bounded).
  """

  def __init__(self, ctx: Any, curve: CurveKeys | None):
    self._zmq = wire.zmq_module()
    self._stop = threading.Event()
    self._fetches = InFlight()
    self._late_due = 0.0  # when `InFlight.late` runs next
    self._waker = Waker(ctx, self._zmq, "fetch")
    self._poller = self._zmq.Poller()
    self._poller.register(self._waker.socket, self._zmq.POLLIN)
    self._peers = Peers(ctx, self._zmq, curve, self._poller)  # the fetching thread's
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name="jax_m2n-net-fetch")
    self._thread.start()

  # Any thread -------------------------------------------------------------------------

  def fetch(self, address: str, ticket: int, specs: Sequence[Any],
            timeout_s: float | None) -> Fetch:
    fetch = Fetch(address, ticket, specs, timeout_s, REPLY_GRACE_S)
    self._fetches.add(fetch)
    self._waker.wake()
    return fetch

  def forget(self, address: str) -> None:
    self._fetches.forget(address)
    self._waker.wake()

  def close(self) -> bool:
    """Fails every fetch in flight and stops the thread (it closes its sockets); False
    where the thread did not stop within 5 s."""
    return wire.stop_thread(self._stop, self._fetches.close, self._waker, self._thread)

  # The fetching thread ----------------------------------------------------------------

  def _loop(self) -> None:
    try:
      wire.run("fetching", self._poller, self._stop, lambda: int(wire.TICK_S * 1000),
               self._step, self._zmq)
    finally:
      self._peers.close()
      self._waker.socket.close(0)

  def _step(self, events: dict[Any, int]) -> None:
    """Requests to send, connections to close, replies and monitor events to take."""
    if self._waker.socket in events:
      self._waker.drain()
    for what, arg in self._fetches.commands():
      if what == "close":
        self._peers.drop(arg)
      else:
        self._send(*arg)
    # Data before monitor events: a reply that arrived whole before its peer's
    # connection closed is delivered, not failed.
    hit = self._peers.hit(events)
    for peer in [p for p in hit if p.sock in events]:
      if not self._receive(peer):
        self._peers.drop(peer.address)
    for peer in [p for p in hit if p.monitor in events and self._peers.current(p)]:
      why = peer.broken()
      if why is not None:
        self._receive(peer)
        self._peers.drop(peer.address)
        self._fetches.fail(peer.address, why)
    if time.monotonic() >= self._late_due:
      now = time.monotonic()
      self._fetches.late(now, self._peers.quiet(now, REPLY_GRACE_S), self._peers)
      self._late_due = time.monotonic() + 0.1

  def _send(self, rid: int, wait_ms: int) -> None:
    fetch = self._fetches.get(rid)
    if fetch is None:
      return  # forgotten meanwhile
    try:
      peer = self._peers.connect(fetch.address)
      peer.sock.send(wire.REQUEST.pack(wire.REQUEST_MAGIC, fetch.ticket, rid, wait_ms),
                     self._zmq.NOBLOCK)
    except Exception as e:  # noqa: BLE001 - the fetch fails, the thread lives
      self._peers.drop(fetch.address)
      self._fetches.fail(fetch.address, f"no request could be sent: {e}")

  def _receive(self, peer: Peer) -> bool:
    """Takes what `peer` sent (a burst); False where it broke the protocol (its
    fetches then failed)."""
    zmq = self._zmq
    for _ in range(64):
      try:
        first = peer.sock.recv(zmq.NOBLOCK)
      except zmq.Again:
        return True
      peer.received = time.monotonic()
      more = peer.sock.getsockopt(zmq.RCVMORE)
      if first[:4] == wire.HEAD_MAGIC and len(first) >= wire.HEAD.size:
        error = self._head(peer, first, more)
      elif first[:4] == wire.CHUNK_MAGIC and more and len(first) == wire.CHUNK.size:
        error = self._chunk(peer, first)
      else:
        error = "it sent a malformed reply"
      wire.discard_rest(peer.sock, zmq)  # what a failed or forgotten fetch was sent
      if error is not None:
        self._fetches.fail(peer.address, error)
        return False
    return True

  def _head(self, peer: Peer, frame: bytes, inline: bool) -> str | None:
    """A reply's HEAD; `inline`: the arrays follow in the same message (a small
    reply), else as CHUNK messages. Returns the peer's protocol error, if any."""
    _, rid, status, n = wire.HEAD.unpack_from(frame)
    if len(frame) != wire.HEAD.size + 8 * n or (inline and status != wire.OK):
      return "it sent a malformed reply header"
    sizes = list(struct.unpack_from(f"<{n}Q", frame, wire.HEAD.size))
    fetch, error = self._fetches.answered(rid, peer.address, status, sizes)
    if fetch is None:
      return error  # None: forgotten meanwhile, its chunks are discarded as they come
    error = fetch.head(status, sizes, peer.sock if inline else None, self._zmq)
    if error is None and fetch.received:
      self._complete(rid, fetch)
    return error

  def _chunk(self, peer: Peer, frame: bytes) -> str | None:
    """One CHUNK message (its bytes land in place); returns the peer's protocol error,
    if any."""
    _, rid, a, at = wire.CHUNK.unpack(frame)
    fetch = self._fetches.get(rid)
    if fetch is None or fetch.buffers is None:
      return None  # a fetch forgotten or failed: its bytes are dropped
    error = fetch.chunk(peer.address, a, at, peer.sock, self._zmq)
    if error is None and fetch.received:
      self._complete(rid, fetch)
    return error

  def _complete(self, rid: int, fetch: Fetch) -> None:
    if self._fetches.pop(rid) is not None:
      fetch.place()
