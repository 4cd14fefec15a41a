"""The "net" transport's serving side: offers, the requests that wait for them, and the
one thread that answers requests on the ROUTER socket (and, under CurveZMQ, ZAP).

Owns what a process holds for its peers, and its bounds: offers (count and bytes, each
until fetched, cancelled or expired), waiting requests (count, per IP address, each
until its wait ends), bytes still being sent. A request is 24 bytes or dropped
unparsed; a reply's bytes go to the socket without a copy on CPU. Fetching is
fetches.py's.
"""

from __future__ import annotations

import dataclasses
import heapq
import hmac
import logging
import math
import secrets
import struct
import threading
import time
from typing import Any

import jax
import numpy as np

from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError
from jax_m2n._src.jobs import channel
from jax_m2n._src.jobs.net import wire
from jax_m2n._src.jobs.net.curve import CurveKeys
from jax_m2n._src.jobs.transport import OFFER_GRACE_S

logger = logging.getLogger("jax_m2n")

API = wire.API

# Defaults of the bounds (the transport's constructor takes others): offers held at
# once, and the bytes of their arrays plus those of replies still being sent.
MAX_OFFERS = 1 << 16
MAX_OFFER_BYTES = 1 << 40
# Requests for tickets not offered yet: each waits at most its own wait (the fetch's
# `timeout_s`), capped at MAX_WAIT_S; at most MAX_WAITING of them, at most half of those
# from one IP address (a stranger's well-formed requests cannot take every slot).
MAX_WAIT_S = 600.0
MAX_WAITING = 1 << 16
MAX_WAITING_PER_HOST = MAX_WAITING // 2


@dataclasses.dataclass
class _Offer:
  arrays: list[Any]
  nbytes: int
  deadline: float


@dataclasses.dataclass
class _Waiting:
  ident: bytes
  rid: int
  host: str
  deadline: float


def _host_bytes(a: Any) -> np.ndarray:
  """An offered array's bytes as flat uint8 (on CPU the array's own buffer; on an
  accelerator a device-to-host copy, which JAX keeps with the array while it lives)."""
  return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


def _peer_host(frame: Any) -> str:
  """The IP address a request came from (zmq's per-message metadata)."""
  try:
    return frame.get("Peer-Address")
  except Exception:  # noqa: BLE001 - no metadata (not TCP): one bucket
    return ""


class Server:
  """The ROUTER socket bound to `host` (a free port), its thread, and the offers.

  Threads: `offer`, `cancel`, `held` from any thread; the sockets only on the serving
  thread. `close` stops the thread (bounded) and drops every offer.
  """

  def __init__(self, ctx: Any, host: str, curve: CurveKeys | None, max_offers: int,
               max_offer_bytes: int):
    zmq = self._zmq = wire.zmq_module()
    self._curve = curve
    self.max_offers, self.max_offer_bytes = max_offers, max_offer_bytes
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._offers: dict[int, _Offer] = {}
    self._offer_bytes = 0
    self._expiries: list[tuple[float, int]] = []   # (deadline, ticket), lazily pruned
    self._waiting: dict[int, list[_Waiting]] = {}
    self._waiting_count = 0
    self._waiting_per_host: dict[str, int] = {}
    self._waits: list[tuple[float, int]] = []      # (deadline, ticket), lazily pruned
    self._ready: list[int] = []                    # tickets offered while awaited
    self._withdrawn: list[int] = []                # tickets cancelled while awaited
    self._sending: list[tuple[list[Any], int]] = []  # (zmq trackers, bytes) in flight
    self._sending_bytes = 0
    # Counters (tests and the bench read them).
    self.dropped = 0   # requests of the wrong shape (dropped unanswered)
    self.refused = 0   # requests refused (BUSY), handshakes refused by the ZAP handler
    self.served = 0
    self.served_bytes = 0
    self._zap = None
    self._router = self._bind(ctx, host)
    try:
      if curve is not None:
        # The ZAP endpoint is one per context: the transport's context is its own.
        self._zap = ctx.socket(zmq.REP)
        self._zap.bind("inproc://zeromq.zap.01")
      self._waker = wire.Waker(ctx, zmq, "serve")
    except BaseException:
      for s in (self._router, self._zap):
        if s is not None:
          s.close(0)
      raise
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name="jax_m2n-net-serve")
    self._thread.start()

  def _bind(self, ctx: Any, host: str) -> Any:
    zmq = self._zmq
    sock = ctx.socket(zmq.ROUTER)
    wire.tune(sock, zmq)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not silence
    sock.setsockopt(zmq.SNDHWM, 0)  # replies reference offered arrays: bounded by them
    if self._curve is not None:
      sock.setsockopt(zmq.CURVE_SERVER, 1)
      sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.server_secret)
      sock.setsockopt(zmq.ZAP_DOMAIN, b"jax_m2n")
    bind = channel.bind_host(API, host)
    if ":" in bind:
      sock.setsockopt(zmq.IPV6, 1)
    try:
      sock.bind(f"tcp://{channel.join_address(bind, 0)[:-1]}*")
    except zmq.ZMQError as e:
      sock.close(0)
      raise ReshardRuntimeError(f"{API}: the data socket must bind {host!r}; got {e}. "
                                "Hint: the host must be an address of this machine.") from None
    port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    self.address = channel.join_address(host, port)
    return sock

  @property
  def held(self) -> tuple[int, int]:
    with self._lock:
      return len(self._offers), self._offer_bytes + self._sending_bytes

  # Any thread -------------------------------------------------------------------------

  def offer(self, arrays, timeout_s, ticket=None) -> int:
    arrays = list(arrays)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
        0 < timeout_s < math.inf):
      raise ReshardValueError(f"{API}.offer: timeout_s must be a finite number > 0; got "
                              f"{timeout_s!r}.")
    if ticket is None:
      ticket = secrets.randbits(64)
    elif type(ticket) is not int or not 0 <= ticket < 1 << 64:
      raise ReshardValueError(f"{API}.offer: ticket must be an int in [0, 2**64); got "
                              f"{ticket!r}.")
    nbytes = sum(int(a.nbytes) for a in arrays)
    deadline = time.monotonic() + timeout_s + OFFER_GRACE_S
    with self._lock:
      if self._stop.is_set():
        raise ReshardRuntimeError(f"{API}.offer: the transport must be open; it is "
                                  "closed.")
      if ticket in self._offers:
        raise ReshardValueError(f"{API}.offer: ticket must not be offered already; got "
                                f"{ticket} twice.")
      held = self._offer_bytes + self._sending_bytes
      if len(self._offers) >= self.max_offers or held + nbytes > self.max_offer_bytes:
        raise ReshardRuntimeError(
            f"{API}.offer: the offers held must stay within max_offers="
            f"{self.max_offers} and max_offer_bytes={self.max_offer_bytes}; got "
            f"{len(self._offers)} offers and {held} bytes held, and {nbytes} more "
            "bytes offered (offers leave when fetched, cancelled or expired).")
      self._offers[ticket] = _Offer(arrays, nbytes, deadline)
      self._offer_bytes += nbytes
      heapq.heappush(self._expiries, (deadline, ticket))
      awaited = ticket in self._waiting
      if awaited:
        self._ready.append(ticket)
    if awaited:
      self._waker.wake()
    return ticket

  def cancel(self, ticket: int) -> bool:
    with self._lock:
      offer = self._offers.pop(ticket, None)
      if offer is not None:
        self._offer_bytes -= offer.nbytes
      awaited = ticket in self._waiting
      if awaited:
        self._withdrawn.append(ticket)
    if awaited:
      self._waker.wake()
    return offer is not None

  def close(self) -> bool:
    """Stops the thread (it closes its sockets) and drops every offer; False where the
    thread did not stop within 5 s."""
    with self._lock:
      self._stop.set()
      self._offers.clear()
      self._offer_bytes = 0
    self._waker.close_sender()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout=5.0)
    return not self._thread.is_alive()

  # The serving thread -----------------------------------------------------------------

  def _loop(self) -> None:
    zmq = self._zmq
    poller = zmq.Poller()
    sockets = [s for s in (self._router, self._waker.socket, self._zap) if s is not None]
    for s in sockets:
      poller.register(s, zmq.POLLIN)
    try:
      wire.run("serving", poller, self._stop, self._timeout_ms, self._step, zmq)
    finally:
      with self._lock:
        self._sending.clear()
      for s in sockets:
        s.close(0)

  def _step(self, events: dict[Any, int]) -> None:
    zmq = self._zmq
    if self._waker.socket in events:
      self._waker.drain()
    if self._zap is not None and self._zap in events:
      self._answer_zap()
    if self._router in events:
      for _ in range(256):  # a burst, then the bookkeeping
        try:
          frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
          break
        try:
          self._request(frames)
        except Exception:  # noqa: BLE001 - a bad request must not end the server
          self.dropped += 1
          logger.exception("jax_m2n net: a request failed")
    self._due()

  def _timeout_ms(self) -> int:
    with self._lock:
      due = [q[0][0] for q in (self._expiries, self._waits) if q]
      busy = bool(self._ready or self._withdrawn or self._sending)
    left = min(due, default=time.monotonic() + wire.TICK_S) - time.monotonic()
    return max(1, int(1000 * min(0.05 if busy else wire.TICK_S, left)))

  def _request(self, frames: list[Any]) -> None:
    """One request: served now, kept waiting for its offer, or refused (BUSY); a
    request of any other shape is dropped unanswered."""
    if len(frames) != 2 or len(frames[1]) != wire.REQUEST.size:
      self.dropped += 1
      return
    magic, ticket, rid, wait_ms = wire.REQUEST.unpack(frames[1].bytes)
    if magic != wire.REQUEST_MAGIC:
      self.dropped += 1
      return
    ident = frames[0].bytes
    with self._lock:
      offer = self._offers.pop(ticket, None)
      if offer is not None:
        self._offer_bytes -= offer.nbytes
      else:
        host = _peer_host(frames[1])
        if (self._waiting_count >= MAX_WAITING
            or self._waiting_per_host.get(host, 0) >= MAX_WAITING_PER_HOST):
          self.refused += 1
        else:
          deadline = time.monotonic() + min(wait_ms / 1000, MAX_WAIT_S)
          self._waiting.setdefault(ticket, []).append(_Waiting(ident, rid, host, deadline))
          self._waiting_count += 1
          self._waiting_per_host[host] = self._waiting_per_host.get(host, 0) + 1
          heapq.heappush(self._waits, (deadline, ticket))
          return
    if offer is None:
      self._send_status(ident, rid, wire.BUSY)
    else:
      self._send_offer(ident, rid, ticket, offer)

  def _due(self) -> None:
    """Offers that arrived for waiting requests, withdrawn tickets, expiries, and the
    bytes whose sending finished."""
    now = time.monotonic()
    serve, answer = [], []
    with self._lock:
      ready, self._ready = self._ready, []
      for ticket in ready:
        offer = self._offers.get(ticket)
        waiters = self._waiting.get(ticket)
        if offer is None or not waiters:
          continue
        w = waiters.pop(0)
        self._unwait(ticket, w, waiters)
        del self._offers[ticket]
        self._offer_bytes -= offer.nbytes
        serve.append((w, ticket, offer))
      withdrawn, self._withdrawn = self._withdrawn, []
      for ticket in withdrawn:
        for w in self._waiting.pop(ticket, []):
          self._unwait(ticket, w, None)
          answer.append((w, wire.WITHDRAWN))
      while self._expiries and self._expiries[0][0] <= now:
        _, ticket = heapq.heappop(self._expiries)
        offer = self._offers.get(ticket)
        if offer is not None and offer.deadline <= now:
          del self._offers[ticket]
          self._offer_bytes -= offer.nbytes
      while self._waits and self._waits[0][0] <= now:
        _, ticket = heapq.heappop(self._waits)
        waiters = self._waiting.get(ticket, [])
        for w in [w for w in waiters if w.deadline <= now]:
          waiters.remove(w)
          self._unwait(ticket, w, waiters)
          answer.append((w, wire.EXPIRED))
      # Entries of offers fetched and requests served stay in the heaps until their
      # deadline: rebuilt from what is live once they outnumber it.
      if len(self._expiries) > 2 * len(self._offers) + 1024:
        self._expiries = [(o.deadline, t) for t, o in self._offers.items()]
        heapq.heapify(self._expiries)
      if len(self._waits) > 2 * self._waiting_count + 1024:
        self._waits = [(w.deadline, t) for t, ws in self._waiting.items() for w in ws]
        heapq.heapify(self._waits)
      while self._sending and all(t.done for t in self._sending[0][0]):
        self._sending_bytes -= self._sending.pop(0)[1]
    for w, ticket, offer in serve:
      self._send_offer(w.ident, w.rid, ticket, offer)
    for w, status in answer:
      self._send_status(w.ident, w.rid, status)

  def _unwait(self, ticket: int, w: _Waiting, rest: list[_Waiting] | None) -> None:
    """Forgets waiting request `w` (the lock is held); `rest`: the ticket's others."""
    self._waiting_count -= 1
    left = self._waiting_per_host[w.host] - 1
    if left:
      self._waiting_per_host[w.host] = left
    else:
      del self._waiting_per_host[w.host]
    if not rest:
      self._waiting.pop(ticket, None)

  def _send_status(self, ident: bytes, rid: int, status: int) -> None:
    try:
      self._router.send_multipart(
          [ident, wire.HEAD.pack(wire.HEAD_MAGIC, rid, status, 0)], self._zmq.NOBLOCK)
    except self._zmq.ZMQError:
      pass  # the peer is gone: nothing to answer

  def _send_offer(self, ident: bytes, rid: int, ticket: int, offer: _Offer) -> None:
    """Sends an offer's arrays (zero-copy: zmq holds the host buffers until sent)."""
    zmq = self._zmq
    try:
      for a in offer.arrays:  # every device-to-host copy starts before one is awaited
        if isinstance(a, jax.Array) and a.devices().pop().platform != "cpu":
          a.copy_to_host_async()
      hosts = [_host_bytes(a) for a in offer.arrays]
    except Exception:  # noqa: BLE001 - the fetch fails, named; the server lives
      logger.exception("jax_m2n net: an offer could not be read")
      self._send_status(ident, rid, wire.FAILED)
      return
    head = wire.HEAD.pack(wire.HEAD_MAGIC, rid, wire.OK, len(hosts)) + struct.pack(
        f"<{len(hosts)}Q", *(h.size for h in hosts))
    inline = offer.nbytes <= wire.INLINE_BYTES
    try:
      trackers = [self._router.send_multipart(
          [ident, head] + (hosts if inline else []), zmq.NOBLOCK, copy=False,
          track=True)]
    except zmq.ZMQError:  # the peer left before its answer: the offer stays
      with self._lock:
        if ticket not in self._offers and not self._stop.is_set():
          self._offers[ticket] = offer
          self._offer_bytes += offer.nbytes
      return
    try:
      for a, h in enumerate([] if inline else hosts):
        for at in range(0, h.size, wire.CHUNK_BYTES):
          trackers.append(self._router.send_multipart(
              [ident, wire.CHUNK.pack(wire.CHUNK_MAGIC, rid, a, at),
               h[at:at + wire.CHUNK_BYTES]], zmq.NOBLOCK, copy=False, track=True))
    except zmq.ZMQError:
      pass  # the peer left mid-reply: its fetch failed with its connection
    self.served += 1
    self.served_bytes += offer.nbytes
    with self._lock:
      self._sending.append((trackers, offer.nbytes))
      self._sending_bytes += offer.nbytes

  def _answer_zap(self) -> None:
    """The ZAP handler (CurveZMQ): admits only the client key of `CurveKeys`."""
    zmq = self._zmq
    try:
      frames = self._zap.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
      return
    ok = (len(frames) >= 7 and frames[5] == b"CURVE"
          and hmac.compare_digest(frames[6], self._curve.client_public_raw()))
    if not ok:
      self.refused += 1
    request_id = frames[1] if len(frames) > 1 else b""
    self._zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                              b"OK" if ok else b"unknown client key", b"", b""])
