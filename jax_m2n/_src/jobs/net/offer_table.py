"""The "net" transport's table of what a process holds for its peers: offers, the
requests that wait for them, and the bytes of replies still being sent.

Owns the bounds and the deadlines under one lock, for any thread: offers (count and
bytes, each until fetched, cancelled or expired), waiting requests (count, per IP
address, each until its wait ends), bytes in flight. It never touches a socket: the
serving thread (offers.py) sends what the table hands out.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
from typing import Any, Callable

from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError
from jax_m2n._src.jobs.net import wire

API = wire.API

# At most MAX_WAITING requests wait for tickets not offered yet, at most half of those
# from one IP address (a stranger's well-formed requests cannot take every slot).
MAX_WAITING = 1 << 16
MAX_WAITING_PER_HOST = MAX_WAITING // 2


@dataclasses.dataclass
class Offer:
  arrays: list[Any]
  nbytes: int
  deadline: float


@dataclasses.dataclass
class Waiting:
  """A request kept until its ticket is offered or its wait ends."""

  ident: bytes
  rid: int
  host: str
  deadline: float


class Waiters:
  """Requests waiting for tickets not offered yet, by ticket, bounded in count and per
  IP address; used under `OfferTable`'s lock."""

  def __init__(self):
    self._by_ticket: dict[int, list[Waiting]] = {}
    self.count = 0
    self._per_host: dict[str, int] = {}
    self._deadlines: list[tuple[float, int]] = []  # (deadline, ticket), lazily pruned

  def __contains__(self, ticket: int) -> bool:
    return ticket in self._by_ticket

  @property
  def next_deadline(self) -> float | None:
    return self._deadlines[0][0] if self._deadlines else None

  def add(self, ticket: int, w: Waiting) -> bool:
    """Keeps `w` waiting for `ticket`; False where the bounds refuse it."""
    if self.count >= MAX_WAITING or self._per_host.get(w.host, 0) >= MAX_WAITING_PER_HOST:
      return False
    self._by_ticket.setdefault(ticket, []).append(w)
    self.count += 1
    self._per_host[w.host] = self._per_host.get(w.host, 0) + 1
    heapq.heappush(self._deadlines, (w.deadline, ticket))
    return True

  def first(self, ticket: int) -> Waiting | None:
    """Takes out the oldest request waiting for `ticket`, if any."""
    waiters = self._by_ticket.get(ticket)
    if not waiters:
      return None
    w = waiters.pop(0)
    self._forget(ticket, w, waiters)
    return w

  def pop(self, ticket: int) -> list[Waiting]:
    """Takes out every request waiting for `ticket`."""
    out = self._by_ticket.pop(ticket, [])
    for w in out:
      self._forget(ticket, w, None)
    return out

  def expired(self, now: float) -> list[Waiting]:
    """Takes out the requests whose wait ended by `now`."""
    out = []
    while self._deadlines and self._deadlines[0][0] <= now:
      _, ticket = heapq.heappop(self._deadlines)
      waiters = self._by_ticket.get(ticket, [])
      for w in [w for w in waiters if w.deadline <= now]:
        waiters.remove(w)
        self._forget(ticket, w, waiters)
        out.append(w)
    # Entries of requests served stay in the heap until their deadline: rebuilt from
    # what is live once they outnumber it.
    if len(self._deadlines) > 2 * self.count + 1024:
      self._deadlines = [(w.deadline, t) for t, ws in self._by_ticket.items() for w in ws]
      heapq.heapify(self._deadlines)
    return out

  def _forget(self, ticket: int, w: Waiting, rest: list[Waiting] | None) -> None:
    """Forgets waiting request `w`; `rest`: the ticket's others."""
    self.count -= 1
    left = self._per_host[w.host] - 1
    if left:
      self._per_host[w.host] = left
    else:
      del self._per_host[w.host]
    if not rest:
      self._by_ticket.pop(ticket, None)


class OfferTable:
  """Offers by ticket, requests waiting by ticket, bytes being sent; bounded.

  Threads: every method from any thread (one lock). After `close` nothing is offered
  or restored.
  """

  def __init__(self, max_offers: int, max_offer_bytes: int):
    self.max_offers, self.max_offer_bytes = max_offers, max_offer_bytes
    self._lock = threading.Lock()
    self._closed = False
    self._offers: dict[int, Offer] = {}
    self._offer_bytes = 0
    self._expiries: list[tuple[float, int]] = []   # (deadline, ticket), lazily pruned
    self._waiting = Waiters()
    self._ready: list[int] = []                    # tickets offered while awaited
    self._withdrawn: list[int] = []                # tickets cancelled while awaited
    self._sending: list[tuple[list[Any], int]] = []  # (zmq trackers, bytes) in flight
    self._sending_bytes = 0

  @property
  def held(self) -> tuple[int, int]:
    """(offers, bytes): the offers held and their bytes plus those being sent."""
    with self._lock:
      return len(self._offers), self._offer_bytes + self._sending_bytes

  def add(self, ticket: int, arrays: list[Any], nbytes: int, deadline: float) -> bool:
    """Holds `arrays` under `ticket` until `deadline`; returns whether a request waits
    for it (the serving thread then has work: `due`).

    Raises:
      ReshardRuntimeError: the table is closed, or the bounds would be exceeded.
      ReshardValueError: `ticket` is offered already.
    """
    with self._lock:
      if self._closed:
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
      self._offers[ticket] = Offer(arrays, nbytes, deadline)
      self._offer_bytes += nbytes
      heapq.heappush(self._expiries, (deadline, ticket))
      awaited = ticket in self._waiting
      if awaited:
        self._ready.append(ticket)
    return awaited

  def cancel(self, ticket: int) -> tuple[bool, bool]:
    """Drops the offer of `ticket`; returns (whether it was held, whether a request
    waits for it: the serving thread answers it WITHDRAWN in `due`)."""
    with self._lock:
      offer = self._offers.pop(ticket, None)
      if offer is not None:
        self._offer_bytes -= offer.nbytes
      awaited = ticket in self._waiting
      if awaited:
        self._withdrawn.append(ticket)
    return offer is not None, awaited

  def close(self) -> None:
    """Drops every offer; later offers are refused."""
    with self._lock:
      self._closed = True
      self._offers.clear()
      self._offer_bytes = 0

  def request(self, ticket: int, waiter: Callable[[], Waiting]
              ) -> tuple[Offer | None, bool]:
    """A request for `ticket`: (its offer, taken out, False) where it is held; else
    (None, True) where `waiter()` now waits for it, (None, False) where the bounds on
    waiting requests refuse it. (`waiter` is called only then: a request served at
    once costs no more.)"""
    with self._lock:
      offer = self._offers.pop(ticket, None)
      if offer is None:
        return None, self._waiting.add(ticket, waiter())
      self._offer_bytes -= offer.nbytes
      return offer, False

  def restore(self, ticket: int, offer: Offer) -> None:
    """Holds a taken offer again (its requester left before its answer), unless the
    ticket was offered anew or the table closed meanwhile."""
    with self._lock:
      if ticket not in self._offers and not self._closed:
        self._offers[ticket] = offer
        self._offer_bytes += offer.nbytes

  def sending(self, trackers: list[Any], nbytes: int) -> None:
    """Counts `nbytes` in flight until every zmq tracker is done."""
    with self._lock:
      self._sending.append((trackers, nbytes))
      self._sending_bytes += nbytes

  def forget_sending(self) -> None:
    """Drops the trackers (the serving thread ended)."""
    with self._lock:
      self._sending.clear()

  def next_due(self) -> tuple[float | None, bool]:
    """(The earliest deadline held or None, whether work waits for `due` or sending is
    in flight)."""
    with self._lock:
      due = self._expiries[0][0] if self._expiries else None
      wait = self._waiting.next_deadline
      busy = bool(self._ready or self._withdrawn or self._sending)
    return due if wait is None or (due is not None and due <= wait) else wait, busy

  def due(self, now: float) -> tuple[list[tuple[Waiting, int, Offer]],
                                     list[tuple[Waiting, int]]]:
    """What is due at `now`: (requests to serve with their offers, taken out; requests
    to answer with a status: WITHDRAWN or EXPIRED). Drops expired offers and counts
    the bytes whose sending finished."""
    serve, answer = [], []
    with self._lock:
      ready, self._ready = self._ready, []
      for ticket in ready:
        offer = self._offers.get(ticket)
        w = self._waiting.first(ticket) if offer is not None else None
        if w is not None:
          del self._offers[ticket]
          self._offer_bytes -= offer.nbytes
          serve.append((w, ticket, offer))
      withdrawn, self._withdrawn = self._withdrawn, []
      for ticket in withdrawn:
        answer += [(w, wire.WITHDRAWN) for w in self._waiting.pop(ticket)]
      while self._expiries and self._expiries[0][0] <= now:
        _, ticket = heapq.heappop(self._expiries)
        offer = self._offers.get(ticket)
        if offer is not None and offer.deadline <= now:
          del self._offers[ticket]
          self._offer_bytes -= offer.nbytes
      if self._waiting.next_deadline is not None:
        answer += [(w, wire.EXPIRED) for w in self._waiting.expired(now)]
      # Entries of offers fetched stay in the heap until their deadline: rebuilt from
      # what is live once they outnumber it.
      if len(self._expiries) > 2 * len(self._offers) + 1024:
        self._expiries = [(o.deadline, t) for t, o in self._offers.items()]
        heapq.heapify(self._expiries)
      while self._sending and all(t.done for t in self._sending[0][0]):
        self._sending_bytes -= self._sending.pop(0)[1]
    return serve, answer
