"""The "net" transport's serving side: the one thread that answers requests on the
ROUTER socket (and, under CurveZMQ, ZAP), and `offer` / `cancel` from any thread.

Owns the serving loop and the reading of requests: a request is 24 bytes or dropped
unparsed; it is served at once, kept waiting for its offer (its wait capped at
MAX_WAIT_S), or refused. What is held, and its bounds, is offer_table.py's; the sockets'
setup and the ZAP rule listen.py's; the replies' bytes replies.py's. Fetching is
fetches.py's.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from typing import Any

from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.jobs.outbox import Waker
from jax_m2n._src.jobs.net import listen, replies, wire
from jax_m2n._src.jobs.net.curve import CurveKeys
from jax_m2n._src.jobs.net.offer_table import Offer, OfferTable, Waiting
from jax_m2n._src.jobs.transport import OFFER_GRACE_S

logger = logging.getLogger("jax_m2n")

API = wire.API

# Defaults of the bounds (the transport's constructor takes others): offers held at
# once, and the bytes of their arrays plus those of replies still being sent.
MAX_OFFERS = 1 << 16
MAX_OFFER_BYTES = 1 << 40
# Requests for tickets not offered yet: each waits at most its own wait (the fetch's
# `timeout_s`), capped at MAX_WAIT_S (how many may wait: offer_table.MAX_WAITING).
MAX_WAIT_S = 600.0


def _peer_host(frame: Any) -> str:
  """The IP address a request came from (zmq's per-message metadata)."""
  try:
    return frame.get("Peer-Address")
  except Exception:  # noqa: BLE001 - no metadata (not TCP): one bucket
    return ""


def _checked_ticket(timeout_s: Any, ticket: Any) -> int:
  """An offer's ticket (a random one for None), its arguments checked."""
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
      0 < timeout_s < math.inf):
    raise ReshardValueError(f"{API}.offer: timeout_s must be a finite number > 0; got "
                            f"{timeout_s!r}.")
  if ticket is None:
    return secrets.randbits(64)
  if type(ticket) is not int or not 0 <= ticket < 1 << 64:
    raise ReshardValueError(f"{API}.offer: ticket must be an int in [0, 2**64); got "
                            f"{ticket!r}.")
  return ticket


class Server:
  """The ROUTER socket bound to `host` (a free port), its thread, and the offers.

  Threads: `offer`, `cancel`, `held` from any thread; the sockets only on the serving
  thread. `close` stops the thread (bounded) and drops every offer.
  """

  def __init__(self, ctx: Any, host: str, curve: CurveKeys | None, max_offers: int,
               max_offer_bytes: int):
    zmq = self._zmq = wire.zmq_module()
    self._curve = curve
    self._table = OfferTable(max_offers, max_offer_bytes)
    self._stop = threading.Event()
    # Counters (tests and the bench read them).
    self.dropped = 0   # requests of the wrong shape (dropped unanswered)
    self.refused = 0   # requests refused (BUSY), handshakes refused by the ZAP handler
    self.served = 0
    self.served_bytes = 0
    self._zap = None
    self._router, self.address = listen.bind(ctx, zmq, host, curve)
    try:
      if curve is not None:
        self._zap = listen.zap_socket(ctx, zmq)
      self._waker = Waker(ctx, zmq, "serve")
    except BaseException:
      for s in (self._router, self._zap):
        if s is not None:
          s.close(0)
      raise
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name="jax_m2n-net-serve")
    self._thread.start()

  @property
  def held(self) -> tuple[int, int]:
    return self._table.held

  # Any thread -------------------------------------------------------------------------

  def offer(self, arrays, timeout_s, ticket=None) -> int:
    arrays = list(arrays)
    ticket = _checked_ticket(timeout_s, ticket)
    nbytes = sum(int(a.nbytes) for a in arrays)
    deadline = time.monotonic() + timeout_s + OFFER_GRACE_S
    if self._table.add(ticket, arrays, nbytes, deadline):
      self._waker.wake()  # a request waits for it
    return ticket

  def cancel(self, ticket: int) -> bool:
    offered, awaited = self._table.cancel(ticket)
    if awaited:
      self._waker.wake()
    return offered

  def close(self) -> bool:
    """Stops the thread (it closes its sockets) and drops every offer; False where the
    thread did not stop within 5 s."""
    return wire.stop_thread(self._stop, self._table.close, self._waker, self._thread)

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
      self._table.forget_sending()
      for s in sockets:
        s.close(0)

  def _step(self, events: dict[Any, int]) -> None:
    zmq = self._zmq
    if self._waker.socket in events:
      self._waker.drain()
    if self._zap is not None and self._zap in events and listen.answer_zap(
        self._zap, zmq, self._curve):
      self.refused += 1  # a handshake refused
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
    due, busy = self._table.next_due()
    left = (time.monotonic() + wire.TICK_S if due is None else due) - time.monotonic()
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
    offer, waits = self._table.request(ticket, lambda: Waiting(
        ident, rid, _peer_host(frames[1]),
        time.monotonic() + min(wait_ms / 1000, MAX_WAIT_S)))
    if offer is not None:
      self._send_offer(ident, rid, ticket, offer)
    elif not waits:
      self.refused += 1
      replies.send_status(self._router, self._zmq, ident, rid, wire.BUSY)

  def _due(self) -> None:
    """Offers that arrived for waiting requests, withdrawn tickets, expiries, and the
    bytes whose sending finished."""
    serve, answer = self._table.due(time.monotonic())
    for w, ticket, offer in serve:
      self._send_offer(w.ident, w.rid, ticket, offer)
    for w, status in answer:
      replies.send_status(self._router, self._zmq, w.ident, w.rid, status)

  def _send_offer(self, ident: bytes, rid: int, ticket: int, offer: Offer) -> None:
    """Sends an offer's arrays (zero-copy: zmq holds the host buffers until sent)."""
    try:
      hosts = replies.read(offer.arrays)
    except Exception:  # noqa: BLE001 - the fetch fails, named; the server lives
      logger.exception("jax_m2n net: an offer could not be read")
      replies.send_status(self._router, self._zmq, ident, rid, wire.FAILED)
      return
    trackers = replies.send_arrays(self._router, self._zmq, ident, rid, hosts,
                                   offer.nbytes)
    if trackers is None:  # the peer left before its answer: the offer stays
      self._table.restore(ticket, offer)
      return
    self.served += 1
    self.served_bytes += offer.nbytes
    self._table.sending(trackers, offer.nbytes)
