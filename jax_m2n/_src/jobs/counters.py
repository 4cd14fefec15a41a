"""A publisher process's counts, and its `PublisherStats` record.

Owns what the serving side counts as it answers (the control connections heard from
and when, the requests answered by operation, the errors answered by cause, the bytes
offered per version through the transport, when each version was published) and the
record built from them (`Counters.stats`). Counted through two thin wrappers the
publisher hands serving.py: a `Caller` whose replies are counted, and a transport
whose offers are. Every table is bounded; one lock (the server thread counts, any
thread reads). Decides nothing and answers nothing itself.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from jax_m2n._src.jobs import channel, records

# A connection is "connected" while heard from within this window: a subscriber asks
# for versions every 0.5 s while it waits and pulls every training step, so a few
# minutes covers slow steps without counting a long-gone one.
WINDOW_S = 300.0
# Connections remembered (least recently heard dropped), and versions whose egress and
# publish time are kept.
MAX_PEERS = 1024
MAX_VERSIONS = 256
# The requests that move a version's data (a local subscriber asks "local" once per
# layout set, then reads memory without asking).
DATA_OPS = ("pull", "pieces", "delta", "local")


@dataclasses.dataclass
class _Peer:
  seen: float
  calls: int = 0
  op: str = ""
  version: int = 0
  pulled: int = 0  # the newest version it said it pulled (after its copy)


@dataclasses.dataclass(frozen=True)
class CountedCaller(channel.Caller):
  """A `channel.Caller` whose reply is counted (answered, or an error by its kind)."""

  counters: Any = None
  op: str = ""

  def reply(self, body: dict[str, Any]) -> None:
    self.counters.replied(self.op, body)
    super().reply(body)


class CountedTransport:
  """A transport whose offers are counted (their bytes, to the version being served);
  everything else is the transport's."""

  def __init__(self, transport: Any, counters: "Counters"):
    self.inner = transport
    self._counters = counters

  def offer(self, arrays, timeout_s, ticket=None):
    arrays = list(arrays)
    ticket = self.inner.offer(arrays, timeout_s, ticket)
    self._counters.offered(sum(int(a.nbytes) for a in arrays))
    return ticket

  def __getattr__(self, name: str) -> Any:
    return getattr(self.inner, name)


class Counters:
  """One publisher process's counts (see the module's comment).

  `bind` gives it what the record reads beside the counts (the process index, the
  control server, the held versions, the transport) once the publisher has them.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._peers: collections.OrderedDict[bytes, _Peer] = collections.OrderedDict()
    self._published: collections.OrderedDict[int, float] = collections.OrderedDict()
    self._offered: collections.OrderedDict[int, int] = collections.OrderedDict()
    self._answered: collections.Counter = collections.Counter()
    self._failures: collections.Counter = collections.Counter()
    self._offered_total = 0
    self._serving = 0  # the version whose request is being answered (server thread)
    self._bound: tuple[Any, ...] | None = None
    self._pulls = threading.Condition(self._lock)  # notified on each `pulled`

  def bind(self, pid: int, server: Any, versions: Any, transport: Any,
           spec: str) -> None:
    self._bound = (pid, server, versions, transport, spec)

  @property
  def bound(self) -> bool:
    return self._bound is not None

  # Counting (the publisher's and the server's threads) -------------------------------

  def published(self, number: int) -> None:
    with self._lock:
      self._published[number] = time.time()
      while len(self._published) > MAX_VERSIONS:
        self._published.popitem(last=False)

  def called(self, caller: channel.Caller, op: str, body: dict[str, Any]
             ) -> CountedCaller:
    """Notes a request of `op` from `caller`'s connection; returns the caller to
    answer it through (its reply is counted)."""
    if op == "status":  # who asks how the publisher is is no subscriber
      return CountedCaller(caller.server, caller.peer, caller.seq, self, op)
    version = body.get("version", body.get("after"))
    with self._lock:
      peer = self._peers.pop(caller.peer, None) or _Peer(0.0)
      peer.seen, peer.op = time.monotonic(), op
      peer.calls += 1
      if type(version) is int and op != "pulled":  # (pulled: counted once held)
        peer.version = max(peer.version, version)
      self._peers[caller.peer] = peer
      while len(self._peers) > MAX_PEERS:
        self._peers.popitem(last=False)
    return CountedCaller(caller.server, caller.peer, caller.seq, self, op)

  def confirmed(self, peer: bytes, number: int, held: bool) -> None:
    """A subscriber connection's confirmation of a lent pull on the local line
    (line.py): noted as its `pulled` call would be, and counted as pulled where the
    version is still `held`."""
    with self._lock:
      got = self._peers.pop(peer, None) or _Peer(0.0)
      got.seen, got.op = time.monotonic(), "pulled"
      got.calls += 1
      if held:
        got.pulled = max(got.pulled, number)
        got.version = max(got.version, number)
      self._peers[peer] = got
      while len(self._peers) > MAX_PEERS:
        self._peers.popitem(last=False)
      self._pulls.notify_all()

  def pulled(self, peer: bytes, number: int) -> None:
    """A subscriber connection says it pulled version `number` (after its copy)."""
    with self._lock:
      got = self._peers.get(peer)
      if got is not None:
        got.pulled = max(got.pulled, number)
        got.version = max(got.version, number)
      self._pulls.notify_all()

  def wait_pulled(self, number: int, n: int, timeout_s: float) -> int:
    """Waits until `n` subscriber connections said they pulled `number` or a newer
    version; returns how many have (fewer where `timeout_s` passed first)."""
    deadline = time.monotonic() + timeout_s
    with self._lock:
      while True:
        have = sum(1 for p in self._peers.values() if p.pulled >= number)
        left = deadline - time.monotonic()
        if have >= n or left <= 0:
          return have
        self._pulls.wait(min(left, 0.1))

  def replied(self, op: str, body: dict[str, Any]) -> None:
    if op == "pulled":  # a subscriber's word after its pull (mostly unanswered)
      return
    with self._lock:
      if "error" in body:
        self._failures[str(body.get("kind", "runtime"))] += 1
      else:
        self._answered[op] += 1

  def serving(self, number: int) -> None:
    """The next offers are of version `number` (the server thread, before it cuts)."""
    self._serving = number

  def offered(self, nbytes: int) -> None:
    with self._lock:
      self._offered_total += nbytes
      self._offered[self._serving] = self._offered.get(self._serving, 0) + nbytes
      while len(self._offered) > MAX_VERSIONS:
        self._offered.popitem(last=False)

  def counting(self, transport: Any) -> CountedTransport:
    """`transport`, its offers counted here."""
    return CountedTransport(transport, self)

  # Reading (any thread) --------------------------------------------------------------

  def stats(self) -> records.PublisherStats:
    """The record of this process now (see `records.PublisherStats`)."""
    pid, server, versions, transport, spec = self._bound
    held = [(n, versions.get(n)) for n in versions.numbers()]
    exports = versions.exports()
    lent = versions.allocations.sizes()
    served = getattr(transport, "counters", {}).get("served_bytes")
    now = time.monotonic()
    with self._lock:
      peers = tuple(records.PeerSeen(p.hex(), round(now - s.seen, 3), s.calls, s.op,
                                     s.version)
                    for p, s in reversed(self._peers.items())
                    if now - s.seen <= WINDOW_S)
      held = tuple(records.HeldVersion(n, v.nbytes, self._published.get(n, 0.0),
                                       self._offered.get(n, 0), v.how, v.device_bytes())
                   for n, v in held if v is not None)
      last = max(self._published, default=0)
      failures = dict(self._failures)
      if server.refused:
        failures["refused"] = server.refused
      return records.PublisherStats(
          process=pid, address=server.address, transport=spec, versions=held,
          held_bytes=sum(v.bytes for v in held), last_version=versions.published,
          last_published_at=self._published.get(last),
          subscribers=len(peers),
          window_s=WINDOW_S, peers=peers,
          pulls_answered=sum(self._answered[op] for op in DATA_OPS),
          answered=dict(self._answered), failures=failures,
          offered_bytes=self._offered_total, served_bytes=served,
          exports=len(exports),
          export_bytes=sum(e.memory_bytes() for e in exports),
          device_bytes=versions.device_bytes(),
          lent_allocations=len(lent), lent_allocation_bytes=sum(lent))
