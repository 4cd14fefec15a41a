"""A publisher process's answers to subscribers: the control calls, on the server thread.

Owns the calls a Publisher serves and where each runs: on the server thread
`versions` (a long poll), `manifest`, `status` and the relay calls (handed to the
Coordinator on process 0); on one worker thread, in order, what cuts, encodes or offers
(`register`, `pull`, `pieces`, `digests`, `delta`, `local`: offering.py; the tickets
of lent allocations, `allocations`); a subscriber's `pulled` (after its copy: for a
lent version, whether its arrays are still alive; the same on the local line, line.py,
whose ticket the `local` answer carries, bound to the asking connection); the requests
deferred until this process has published the version asked for, and the tick that
answers them. Every field of a request is checked before use. Plans nothing; holds no
version itself (versions.py does).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any, Callable

from jax_m2n._src.errors import ProtocolError, ReshardError
from jax_m2n._src.jobs import channel, line, membership, messages, status
from jax_m2n._src.jobs.counters import Counters
from jax_m2n._src.jobs.offering import Offers
from jax_m2n._src.jobs.versions import Versions

logger = logging.getLogger("jax_m2n")

# The longest a subscriber may ask the publisher to hold a long poll or an offer.
MAX_WAIT_MS = 60_000
MAX_OFFER_MS = 1 << 31
# The most allocations one request may ask tickets for.
MAX_ALLOCATIONS = 4096


class Service:
  """The handler and tick a `channel.Server` runs for one publisher process.

  Args:
    pid: this process's index in the trainer job.
    versions: its held versions.
    transport: its transport (the offers).
    counters: what it counts as it answers (counters.py; `transport` counted there).
  """

  def __init__(self, pid: int, versions: Versions, transport: Any, counters: Counters):
    self._pid = pid
    self.counters = counters
    self._versions = versions
    self._transport = transport
    self.closed = False
    self._polls: list[tuple[channel.Caller, int, float]] = []
    self._deferred: list[tuple[channel.Caller, dict[str, Any], float]] = []
    self._offers = Offers(pid, versions, transport, counters)  # the worker's side
    # Relays among subscribers (process 0 coordinates; every process offers chunks).
    self._relay = membership.Coordinator(versions.numbers)
    # What the server thread hands over (cutting, encoding, offering, registering, the
    # local exports): one worker, so requests keep their order.
    self._work = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="jax_m2n-publisher-work")
    self._line: line.Server | None = None  # made on the first local subscriber
    self._line_lock = threading.Lock()

  @property
  def waiting(self) -> bool:
    """Whether a long poll or a deferred request is still unanswered."""
    return bool(self._polls or self._deferred)

  def handle(self, caller: channel.Caller, body: dict[str, Any]) -> None:
    op = messages.field(body, "op", str, max_len=32)
    caller = self.counters.called(caller, op, body)
    if op == "versions":
      after = messages.field(body, "after", int, lo=0, hi=1 << 62)
      wait_ms = messages.field(body, "wait_ms", int, lo=0, hi=MAX_WAIT_MS)
      if "pulling" in body:  # a steady local pull of a snapshot, copying as it asks
        pulling = messages.field(body, "pulling", int, lo=1, hi=1 << 62)
        held = self._versions.get(pulling)
        if held is not None and not held.lent:
          self.counters.pulled(caller.peer, pulling)
      self._polls.append((caller, after, time.monotonic() + wait_ms / 1000))
    elif op == "manifest":
      want = messages.field(body, "id", str, max_len=64)
      found = self._versions.manifest(want)
      if found is None:
        caller.reply({"error": f"manifest {messages._short(want)} must belong to a held "
                      "version; got an unknown one (dropped: pull again).",
                      "kind": "runtime"})
      else:
        caller.reply({"manifest": found.to_json()})
    elif op == "register":
      self._submit(caller, lambda: self._offers.register(caller, body))
    elif op in ("pieces", "delta", "pull", "digests"):
      if op == "pull" and "after" in body:  # the newest after `after`, or `want`
        messages.field(body, "after", int, lo=0, hi=1 << 62)
        if "want" in body:
          body["after"] = messages.field(body, "want", int, lo=1, hi=1 << 62) - 1
        wait_ms = messages.field(body, "wait_ms", int, lo=0, hi=MAX_WAIT_MS)
        body["version"] = None
      else:
        messages.field(body, "version", int, lo=1, hi=1 << 62)
      if op == "delta":  # the version the subscriber holds (0: none)
        messages.field(body, "base", int, lo=0, hi=1 << 62)
      if op == "pull":
        messages.field(body, "plan", str, max_len=64)
        messages.field(body, "seq", int, lo=0, hi=1 << 62)
      timeout_ms = messages.field(body, "timeout_ms", int, lo=1, hi=MAX_OFFER_MS)
      if body["version"] is None:
        timeout_ms = min(timeout_ms, wait_ms)
      self._deferred.append((caller, body, time.monotonic() + min(
          timeout_ms, MAX_WAIT_MS) / 1000))
    elif op == "local":
      self._submit(caller, lambda: self._local(caller.peer, body))
    elif op == "allocations":  # a local reader maps the allocations a slot names
      want = messages.field(body, "manifest", str, max_len=64)
      ids = messages.field(body, "ids", list)
      if len(ids) > MAX_ALLOCATIONS or not all(type(i) is int for i in ids):
        raise ProtocolError(f"allocations: ids must be at most {MAX_ALLOCATIONS} ints; "
                            f"got {len(ids)} items.")
      self._submit(caller, lambda: self._allocations(want, ids))
    elif op == "pulled":  # a subscriber's word after its copy (lent: checked alive)
      number = messages.field(body, "version", int, lo=1, hi=1 << 62)
      held = self._versions.alive(number) if body.get("check") else True
      if held:
        self.counters.pulled(caller.peer, number)
      caller.reply({"held": held})
    elif op in membership.OPS and self._pid == 0:
      self._relay.handle(caller, body)
    elif op == "status":
      caller.reply(status.answer(self.counters, self._relay if self._pid == 0 else None))
    else:
      raise ProtocolError(f"call: op must be versions, manifest, register, pull, "
                          f"pieces, digests, delta, local, allocations, pulled, status "
                          f"or relay_*; got "
                          f"{messages._short(op)}.")
    self.tick()

  def tick(self) -> None:
    """Answers the long polls with news (or expired), and the deferred requests whose
    version this process has published (or whose wait expired)."""
    now = time.monotonic()
    held, published = self._versions.listing(), self._versions.published
    keep = []
    for caller, after, deadline in self._polls:
      if self.closed or any(n > after for n, _ in held) or now >= deadline:
        caller.reply({"versions": held, "closed": self.closed,
                      "keep": self._versions.keep, "published": published})
      else:
        keep.append((caller, after, deadline))
    self._polls = keep
    keep = []
    for caller, body, deadline in self._deferred:
      version = body["version"]
      if self.closed:
        caller.reply({"error": "the publisher closed.", "kind": "runtime"})
      elif version is None:  # a pull of the newest version after body["after"]
        if published > body["after"]:  # answered now (a dead publisher shows at once)
          answer, offer = self._offers.newest(caller, body)
          caller.reply(answer)
          if offer is not None:
            self._submit(None, functools.partial(self._served, caller, answer["version"],
                                                 offer))
        elif now >= deadline:
          caller.reply({"newer": None})  # none within its wait: it asks the usual way
        else:
          keep.append((caller, body, deadline))
      elif version <= published:  # cut, encode, offer: on the worker thread
        self._submit(caller, functools.partial(
            self._served, caller, version, functools.partial(self._offers.answer, caller,
                                                             body)))
      elif now >= deadline:
        caller.reply({"error": f"version {version} must be published by trainer process "
                      f"{self._pid} in time; it has published {published} so far.",
                      "kind": "timeout"})
      else:
        keep.append((caller, body, deadline))  # this process has not published it yet
    self._deferred = keep
    self._relay.tick(self.closed)
    held_numbers = {n for n, _ in held}
    gone = [v for v in self._offers.offered() if v not in held_numbers]
    if gone:  # a dropped version's offers not fetched yet: withdrawn
      self._submit(None, lambda: self._offers.withdraw(gone))

  def _served(self, caller: channel.Caller, number: int, work: Callable[[], Any]) -> Any:
    """Runs a network pull's cut and offer; once done without error the subscriber no
    longer reads the version's arrays: counted as pulled (`Publisher.wait_pulled`)."""
    got = work()
    if not (isinstance(got, dict) and "error" in got):
      self.counters.pulled(caller.peer, number)
    return got

  def _local(self, peer: bytes, body: dict[str, Any]) -> dict[str, Any]:
    """The `local` answer (offering.py), with the local line's name and a ticket bound
    to the asking connection (its confirmations count as its own `pulled`)."""
    got = self._offers.local(body)
    if got.get("local") is True:
      with self._line_lock:
        if self.closed:
          return got
        if self._line is None:
          self._line = line.Server(self._confirmed)
        got["line"], got["line_ticket"] = self._line.name, self._line.offer(peer).hex()
    return got

  def _confirmed(self, peer: bytes, number: int) -> bool:
    """A local line request (line.py's thread): `pulled` with its check, as the
    control call does it."""
    held = number >= 1 and self._versions.alive(number)
    self.counters.confirmed(peer, number, held)
    return held

  def _allocations(self, manifest_id: str, ids: list[int]) -> dict[str, Any]:
    """Tickets for the allocations (of the held versions) a local reader maps."""
    export = self._versions.export_for(manifest_id)
    if export is None or export.allocations is None or export.tables is None:
      return {"error": f"manifest {messages._short(manifest_id)} must belong to a held "
              "version exported on GPUs; got another (dropped: pull again).",
              "kind": "runtime"}
    return export.allocation_tickets(ids)

  def _submit(self, caller: channel.Caller | None,
              work: Callable[[], dict[str, Any] | None]) -> None:
    """Hands `work` to the worker thread (its answer replied to `caller`); once the
    worker stopped (close, or the interpreter exiting) the caller is told so."""
    try:
      if caller is None:
        self._work.submit(_logged, work)
      else:
        self._work.submit(self._off_thread, caller, work)
    except RuntimeError:  # the executor shut down: nothing more is served
      if caller is not None:
        caller.reply({"error": "the publisher closed.", "kind": "runtime"})

  def _off_thread(self, caller: channel.Caller, answer: Callable[[], dict[str, Any]]
                  ) -> None:
    """Runs a request's work on the worker thread and replies from there: the server
    thread keeps answering (long polls, heartbeats of waiting pulls) meanwhile."""
    try:
      caller.reply(answer())
    except ProtocolError as e:
      caller.reply({"error": str(e), "kind": "value"})
    except ReshardError as e:
      caller.reply({"error": str(e), "kind": "runtime"})
    except Exception as e:  # noqa: BLE001 - a bug must not end the worker
      logger.exception("jax_m2n Publisher: a request failed")
      caller.reply({"error": f"internal error: {type(e).__name__}: {e}",
                    "kind": "runtime"})

  def close(self) -> None:
    """Stops the worker thread (after what it is doing) and withdraws every offer."""
    self._work.shutdown(wait=True, cancel_futures=True)
    self._offers.withdraw(self._offers.offered())
    with self._line_lock:
      self.closed = True
      got, self._line = self._line, None
    if got is not None:
      got.close()


def _logged(work: Callable[[], Any]) -> None:
  """Runs work nobody waits for (withdrawing offers, offering a pull answered before):
  a failure is logged, not lost in its future."""
  try:
    work()
  except Exception:  # noqa: BLE001 - the worker must outlive it
    logger.exception("jax_m2n Publisher: work on the worker thread failed")
