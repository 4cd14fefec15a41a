"""A pull's lifecycle on one subscriber process.

Owns the steps between `Subscriber.pull` and its result: choosing the version (newest
not yet pulled, or the one asked; in a multi-process job process 0 chooses and tells
the others through the job's key-value store), fetching its manifest (cached), the
request (request.py) and plan (planning.py), the data path (a delta: delta.py; through
a relay: relay.py; else engine.py), assembling the global arrays, quantizing,
donating. Every wait is bounded; a multi-process job fails together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
import time
from typing import Any

import jax
import numpy as np

from jax_m2n._src import jax_compat
from jax_m2n._src import quantize
from jax_m2n._src.errors import (PeerFailed, PlanUnknown, ReshardError,
                                 ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError, Unconfirmed, VersionGone)
from jax_m2n._src.jobs import delta as delta_lib, delta_auto, engine, exports, local
from jax_m2n._src.jobs import manifest as manifest_lib, planning, records
from jax_m2n._src.jobs.connections import Connections
from jax_m2n._src.jobs.pull import API, Pull
from jax_m2n._src.jobs.request import PullOptions, pull_request
from jax_m2n._src.processes import sequence

logger = logging.getLogger("jax_m2n")
# A waiting pull asks the publisher every POLL_S and allows ANSWER_S more for the
# answer: a publisher that died or stalled is named within POLL_S + ANSWER_S = 1.5 s.
POLL_S = 0.5
ANSWER_S = 1.0
# A control request that is not a long poll (manifests, pieces) must be answered within
# this long (a pieces request waits for a lagging trainer process to publish), or the
# pull's timeout_s where longer: the publisher's answer to a pull cuts its pieces, which
# for a first pull of a large model includes compiling (minutes for 20,000 leaves).
REQUEST_S = 60.0


def _answer_s(p: Pull) -> float:
  return max(REQUEST_S, p.timeout_s)
MAX_MANIFESTS = 16


@dataclasses.dataclass
class State:
  """What a Subscriber keeps between pulls."""

  connections: Connections
  relay: Any = None                       # relay.Member, or None
  version: int = 0                        # the last successful pull's
  manifests: dict[str, manifest_lib.Manifest] = dataclasses.field(default_factory=dict)
  last: delta_lib.Last | None = None      # what a delta pull applies to
  auto: delta_auto.Estimates = dataclasses.field(  # what delta="auto" chooses by
      default_factory=delta_auto.Estimates)
  peers: dict[int, str] | None = None     # the job's processes' transport addresses
  imports: dict[tuple[int, str], Any] = dataclasses.field(default_factory=dict)
  path: str = ""                          # the last pull's data path
  local_mid: str | None = None            # the layout set of the last local pull
  net_mid: str | None = None              # ... of the last full network pull
  trace: records.Trace = dataclasses.field(default_factory=records.Trace)  # this pull's

  def close(self) -> None:
    for imp in self.imports.values():
      imp.close()
    self.imports.clear()
    self.connections.close()


def pull(state: State, dst: Any, dtype: Any, donate: Any, options: PullOptions) -> Any:
  """`Subscriber.pull` after its options were checked (see its contract)."""
  try:
    if jax.process_count() > 1:
      return _pull_job(state, dst, dtype, donate, options)
    return _pull_one(state, dst, dtype, donate, options)
  except ReshardRuntimeError:
    for imp in state.imports.values():  # a dead trainer's GPU memory is not kept mapped
      if not imp.alive():
        imp.unmap()
    raise


def _pull_one(state: State, dst: Any, dtype: Any, donate: Any,
              options: PullOptions) -> Any:
  deadline = time.monotonic() + options.timeout_s  # for a version, where none is yet
  while True:
    got = None
    ahead = Ahead.begin(state, options, writing=True)
    if ahead is not None:  # the copy runs while the publisher confirms the version
      state.trace.chose(ahead.number)
      try:
        return _pull(state, dst, dtype, donate, options, ahead.number, ahead.mid, None,
                     b"", ahead)
      except (Unconfirmed, VersionGone):
        got = ahead.answer()  # the publisher's word (raises where it closed or died)
      except BaseException:
        ahead.drain()
        raise
    elif _newest_in_one(state, options):  # the version named by the pull's answer
      try:
        return _pull(state, dst, dtype, donate, options, None, state.net_mid, None, b"")
      except Unconfirmed as e:
        got = e.got  # a newer version of another layout set, or none yet
    number, mid = got if got is not None else choose(state, options, deadline)
    state.trace.chose(number)
    try:
      return _pull(state, dst, dtype, donate, options, number, mid, None, b"")
    except VersionGone:
      if options.version is not None:
        raise
      state.trace.retry("version gone")
      # dropped while we asked for it: the next newest


def _pull_job(state: State, dst, dtype, donate, options: PullOptions) -> Any:
  """A pull in a multi-process generator job: process 0 chooses the version and a
  random salt (the forwards' tickets) and posts them under the call's key."""
  waits = sequence.CallWaits(sequence.next_call(), range(jax.process_count()),
                             options.timeout_ms)
  try:
    if waits.pid == 0:
      number, mid = choose(state, options)
      salt = secrets.token_bytes(16)
      waits.post("version", json.dumps([number, mid, salt.hex()]))
    else:
      got = waits.gather("version", [0], "the version process 0 chose")[0]
      number, mid, salt_hex = json.loads(got)
      salt = bytes.fromhex(salt_hex)
    state.trace.chose(number)
    return _pull(state, dst, dtype, donate, options, number, mid, waits, salt)
  except BaseException as e:
    if not isinstance(e, PeerFailed):  # the peers fail at once, naming it
      waits.fail(f"{type(e).__name__}: {e}")
    waits.finish(failed=True)
    if isinstance(e, Exception) and not isinstance(e, ReshardError):
      raise ReshardRuntimeError(f"{API}: failed on process {waits.pid}: "
                                f"{type(e).__name__}: {e}") from e
    raise


def choose(state: State, options: PullOptions, deadline: float | None = None
           ) -> tuple[int, str]:
  """(version, manifest id): the newest held version after the last pull, or
  `options.version`, as the publisher says now (a version published before this call
  is never missed): a long poll of POLL_S, answered at once when there is one, or the
  moment the trainer publishes it; until `deadline` (default: timeout_s from now)."""
  root = state.connections.root()
  version = options.version
  after = state.version if version is None else version - 1
  if deadline is None:
    deadline = time.monotonic() + options.timeout_s
  while True:
    wait_s = max(0.0, min(POLL_S, deadline - time.monotonic()))
    listing = _listing(root, root.call(
        {"op": "versions", "after": after, "wait_ms": int(wait_s * 1000)},
        wait_s + ANSWER_S, "the list of versions"))
    got = _answer(root, listing, version, after)
    if got is not None:
      return got
    if time.monotonic() >= deadline:
      want = (f"a version newer than {after}" if version is None
              else f"version {version}")
      raise ReshardTimeoutError(
          f"{API}: {want} must be published within timeout_s={options.timeout_s:g}; "
          f"got none ({root.peer} is alive and holds "
          f"{sorted(listing['numbers']) or 'no version'}).")


class Ahead:
  """A steady local pull begun before the publisher confirms its version: where the
  last pull was local and the exports of its layout set already hold the version to
  pull (committed, in every publisher process mapped; the plan must read no other):
  the one asked, or without `version` a newer one than the last pull's (the same in
  every process mapped), the versions request is sent and, while it is answered, that
  version is copied; the result is returned only if the answer names the same version
  and layout set (as `choose` would take it), so the round trip overlaps the copy and
  the publisher still hears every pull (its stats, `jobs status`). Use: `begin` (None:
  ask first), then `_pull(..., ahead)`, which calls `confirmed` before it finishes;
  `answer` or `drain` where it did not. `lent`: the version was taken as lent (no
  request now: confirmed after its copy, local.confirm)."""

  def __init__(self, root: Any, number: int, mid: str, version: int | None,
               after: int, lent: bool = False):
    self.root, self.number, self.mid = root, number, mid
    self._version, self._after = version, after
    # A lent version is confirmed after its copy instead (local.confirm): no request
    # now; asked only where that failed.
    self.lent = lent
    self._seq = None if lent else root.start(
        {"op": "versions", "after": after, "wait_ms": 0, "pulling": number},
        "the list of versions")
    self._done = False
    self._got: tuple[int, str] | None = None

  @classmethod
  def begin(cls, state: State, options: PullOptions, writing: bool = False
            ) -> "Ahead | None":
    """`writing`: the caller's copy also takes a slot still being written (it waits
    for the commit and raises Unconfirmed where the committed slot needs a mapping or
    other flags: local.run's `ahead`); else only a committed one."""
    mid = state.local_mid
    root = state.connections.live_root()
    if (options.path == "network" or mid is None or root is None
        or mid not in state.manifests):
      return None
    imports = [imp for (_, m), imp in state.imports.items() if m == mid]
    latest = {int(imp.latest[0]) for imp in imports if imp.latest is not None}
    if len(latest) != 1:  # none mapped, or the publisher processes disagree for now
      return None
    number = options.version if options.version is not None else latest.pop()
    # Its slot committed, or (`writing`) still being written (-number: a snapshot's
    # copy in flight).
    held = [np.flatnonzero((np.abs(imp.header) if writing else imp.header) == number)
            for imp in imports]
    if ((options.version is None and number <= state.version)
        or number == exports.CLOSED or not all(h.size for h in held)):
      return None
    slots = [int(h[0]) for h in held]
    lent = any(imp.lent(s) for imp, s in zip(imports, slots))
    if not lent and any(imp.tables is not None and imp.header[s] == number
                        and imp.missing(s) for imp, s in zip(imports, slots)):
      return None  # (mapping a new allocation is a control call: not while one is open)
    after = state.version if options.version is None else number - 1
    return cls(root, number, mid, options.version, after, lent)

  def answer(self) -> tuple[int, str] | None:
    """(version, manifest id) the publisher names: the one asked where it holds it,
    else the newest after the last pull (None: none yet). Raises as `choose` does
    (closed, died; the version asked no longer held)."""
    if not self._done:
      self._done = True
      body = {"op": "versions", "after": self._after, "wait_ms": 0}
      listing = _listing(self.root, self.root.call(body, ANSWER_S, "the list of versions")
                         if self._seq is None else self.root.finish(
                             self._seq, ANSWER_S, "the list of versions"))
      self._got = _answer(self.root, listing, self._version, self._after)
    return self._got

  def confirmed(self) -> bool:
    if self.lent:  # confirmed after the copy by local.confirm (or it raised)
      return True
    return self.answer() == (self.number, self.mid)

  def drain(self) -> None:
    """Reads the answer where a failure left it open (its own failure is dropped: the
    first one is what the caller reports)."""
    if not self._done and not self.lent:
      try:
        self.answer()
      except ReshardError:
        pass


def _listing(root: Any, reply: dict[str, Any]) -> dict[str, Any]:
  """A versions answer or notice, checked: {"numbers": {version: manifest id}, ...}."""
  held = reply.get("versions")
  if not isinstance(held, list) or not all(
      isinstance(v, list) and len(v) == 2 and type(v[0]) is int
      and isinstance(v[1], str) for v in held):
    raise ReshardRuntimeError(f"{API}: {root.peer} answered with a malformed list "
                              "of versions.")
  published = reply.get("published")
  return {"numbers": {n: mid for n, mid in held}, "closed": bool(reply.get("closed")),
          "keep": reply.get("keep"),
          "published": published if type(published) is int else 0}


def _answer(root: Any, listing: dict[str, Any], version: int | None,
            after: int) -> tuple[int, str] | None:
  """The version a listing offers (the newest after `after`, or `version`), or None:
  wait for another."""
  if listing["closed"]:
    raise ReshardRuntimeError(f"{API}: {root.peer} closed (the trainer stopped "
                              "publishing).")
  numbers = listing["numbers"]
  if version is None:
    newer = [n for n in numbers if n > after]
    return (max(newer), numbers[max(newer)]) if newer else None
  if version in numbers:
    return version, numbers[version]
  if (numbers and version < max(numbers)) or version <= listing["published"]:
    raise VersionGone(  # (dropped, or a lent version whose arrays went)
        f"{API}: version must be one the publisher holds; got {version}, and "
        f"{root.peer} holds {sorted(numbers)} (keep={listing['keep']}).")
  return None


def _manifest(state: State, mid: str) -> manifest_lib.Manifest:
  m = state.manifests.get(mid)
  if m is None:
    reply = state.connections.root().call({"op": "manifest", "id": mid}, REQUEST_S,
                                          "a manifest")
    m = manifest_lib.from_json(reply.get("manifest"))
    if m.id != mid:
      raise ReshardRuntimeError(f"{API}: the manifest must match its id; got another.")
    if len(state.manifests) >= MAX_MANIFESTS:
      state.manifests.pop(next(iter(state.manifests)))
    state.manifests[mid] = m
  return m


def _peers(state: State, waits: Any, address: str) -> dict[int, str]:
  """Every process of this job's transport address (exchanged on the first pull; also
  the port the job's peers probe when this process falls silent)."""
  if state.peers is None:
    waits.engine.post_probe_address(address)
    waits.post("transport", address)
    got = waits.gather("transport", waits.peers, "the transport addresses of the job")
    state.peers = dict(zip(waits.peers, got))
  return state.peers


def _newest_in_one(state: State, options: PullOptions) -> bool:
  """Whether this pull may ask for the newest version and its bytes in one message
  (`_pull` with number None; a version asked by number too): the last pull was a full
  network pull of the same layout set (`net_mid`), and no delta or relay is asked for;
  `_pull` then also needs the plan registered with the one publisher process it reads
  from, and a transport that fetches before the offers exist."""
  return (options.delta is False and options.path != "local" and state.relay is None
          and state.net_mid in state.manifests)


def _pull(state: State, dst, dtype, donate, options: PullOptions, number: int | None,
          mid: str, waits: Any, salt: bytes, ahead: Ahead | None = None) -> Any:
  """Pulls version `number` of layout set `mid` (None: the newest after the last pull,
  or the version asked, as the one publisher process the plan reads from names and
  offers it in one message: `_newest_in_one`)."""
  m = _manifest(state, mid)
  request = pull_request(API, m, dst, dtype, donate, options)
  planning.check_devices(API, request.dsts)
  local_path = local_path_of(API, options, m)
  # delta or full (in a multi-process job agreed by every process)
  choice = delta_lib.choose(state.last, state.auto, request, local_path, waits)
  pp = planning.plan_pull(m, request.dsts, request.outs, "flat" if
                          choice.base is not None or local_path else options.route)
  if ahead is not None and not (local_path and all(
      (k, m.id) in state.imports for k in pp.requests)):
    raise Unconfirmed  # (it would map an export: a control call while one is open)
  conn = state.connections
  transport = conn.transport(m)
  if number is None and (local_path or choice.base is not None or len(pp.requests) != 1
                         or not transport.early_fetch
                         or engine.plan_key(pp) not in conn.link(
                             next(iter(pp.requests)), m).plans):
    raise Unconfirmed  # (a first pull of this plan, or from several processes)
  if waits is not None:
    waits.post("fp", pp.fingerprint)
    waits.agree(pp.fingerprint, lambda: f"{len(m.leaves)} leaves")
  state.trace.planned(pp)
  full_s = None  # a full pull's data path, its seconds (delta="auto" learns from them)
  warm = bool(pp.avals)  # the plan ran before (its first pull plans and compiles)
  try:
    p = Pull(request, pp, number, {k: conn.link(k, m) for k in pp.requests}, transport,
             waits, salt, _peers(state, waits, transport.address) if waits else {},
             after=state.version if options.version is None else options.version - 1)
    imports = _imports(state, p, m) if local_path else None
    confirmed = False  # whether the publisher processes heard the pull after its copy
    if imports is not None:  # the publisher's memory, read in place (local.py)
      try:
        shards, confirmed = local.run(p, imports, None if ahead is None else ahead.lent)
      finally:
        state.trace.steps = p.steps
      state.path = state.trace.path = "local"
      state.local_mid, state.net_mid = m.id, None
    elif choice.base is not None:  # a delta (delta.py): pulled directly, never relayed
      in_place = {id(a) for a in request.donated} >= {id(a) for a in choice.base}
      shards = delta_lib.run(p, choice, in_place, _answer_s(p))
      state.path, state.trace.path = "network", "delta"
      state.local_mid = state.net_mid = None
    else:
      pulled = None
      if state.relay is not None and p.links:
        pulled = state.relay.receive(conn.root(), p, _answer_s(p))
      start = time.perf_counter()
      shards = _full(p, pulled, state.trace)
      full_s = time.perf_counter() - start if pulled is None and warm else None
      state.path, state.trace.path = "network", "network" if pulled is None else "relay"
      state.local_mid, state.net_mid = None, m.id if pulled is None else None
  except VersionGone:
    raise
  except ReshardError:
    conn.forget_broken()
    raise
  if waits is not None:
    waits.end()  # every process of the job done: a pull succeeds or fails everywhere
    waits.finish()
  state.trace.lap("move")
  if ahead is not None:
    if not ahead.confirmed():
      raise Unconfirmed
    state.trace.lap("wait")  # what the answer took beyond the copy
  if number is None:
    state.trace.version = p.number  # named by the pull's answer (its wait is in move)
  if local_path and not confirmed and ahead is None:
    _tell_pulled(p)  # (a steady pull says so in its one request: Ahead)
  if full_s is not None:
    delta_lib.after_full(p, choice, full_s, _answer_s(p))  # what delta="auto" learns
  return _finish(state, request, pp, p.number, shards)


def _tell_pulled(p: Pull) -> None:
  """Each publisher process read from hears that a local pull not confirmed otherwise
  (a first one) is done: its status shows the version, `Publisher.wait_pulled` counts
  it; no answer awaited. (A steady local pull names its version in its one request,
  a lent one confirms after its copy, a network pull is counted where it is served.)"""
  for link in p.links.values():
    try:
      link.client.tell({"op": "pulled", "version": p.number}, "the pull's end")
    except ReshardError:
      pass  # a broken connection: the next pull reconnects and says so


def prepare(state: State, dst: Any, dtype: Any, options: PullOptions) -> int:
  """`Subscriber.prepare`: the first pull's work for the newest held version's layout
  set (waiting up to the timeout for one), without moving weights: the manifest, the
  checked request and the plan; on the local path the exports mapped and the copies
  compiled, on the network the plan registered with each publisher process (which
  prepares its cut) and this process's compose compiled. Returns the version it
  prepared for."""
  root = state.connections.root()
  number, mid = choose(state, dataclasses.replace(options, version=None)) if (
      state.version == 0) else _newest(root, options)
  m = _manifest(state, mid)
  request = pull_request("Subscriber.prepare", m, dst, dtype, None, options)
  planning.check_devices("Subscriber.prepare", request.dsts)
  local_path = local_path_of(API, options, m)
  pp = planning.plan_pull(m, request.dsts, request.outs,
                          "flat" if local_path else options.route)
  conn = state.connections
  p = Pull(request, pp, number, {k: conn.link(k, m) for k in pp.requests},
           conn.transport(m))
  if local_path and _imports(state, p, m) is not None:
    local.prepare(pp)
    state.local_mid = m.id  # the first pull copies while its version is confirmed
  else:
    engine.register(p, _answer_s(p))
    engine.prepare(pp)
    state.net_mid = m.id  # the first pull asks for the newest and its bytes at once
  return number


def _newest(root: Any, options: PullOptions) -> tuple[int, str]:
  """The newest version held now (after an earlier pull: prepare never waits for a
  newer one)."""
  listing = _listing(root, root.call({"op": "versions", "after": 0, "wait_ms": 0},
                                     ANSWER_S, "the list of versions"))
  got = _answer(root, listing, None, 0)
  if got is None:
    raise ReshardRuntimeError(f"{API}: prepare needs a held version; {root.peer} holds "
                              "none.")
  return got


def _full(p: Pull, pulled: Any, trace: records.Trace) -> list[list[jax.Array]]:
  """A full pull over the transport (or from a relay's chunks, `pulled`); a plan a
  publisher process forgot is registered again and the pull retried once (`trace`
  notes it)."""
  if pulled is not None:
    return engine.run(p, None, pulled)
  for attempt in range(2):
    try:
      tickets, opened = engine.request(p, _answer_s(p))
      confirm = lambda: engine.confirm(p, opened, _answer_s(p))  # noqa: E731
      if not p.transport.early_fetch:
        confirm = confirm()  # the offers first, then the fetches
      return engine.run(p, tickets, None, confirm)
    except PlanUnknown:
      if attempt:
        raise
      trace.retry("plan re-registered")
  raise AssertionError("unreachable")


def local_path_of(api: str, options: PullOptions, m: manifest_lib.Manifest) -> bool:
  """Whether this pull reads the publisher's memory in place: every publisher process
  shares this host (`path="auto"`), or the caller asked (`path="local"`: refused where
  it cannot be, before any byte moves). Also the torch subscriber's rule."""
  if options.path == "network":
    return False
  here = exports.host_identity()
  elsewhere = [k for k, (_, _, host, _) in enumerate(m.processes)
               if not here or host != here]
  if options.path == "local" and elsewhere:
    raise ReshardValueError(
        f"{api}: path='local' needs every publisher process on this host (same kernel, "
        f"network namespace and user); got trainer process(es) {elsewhere[:8]} "
        "elsewhere. Hint: path='auto' takes the network there.")
  return not elsewhere


def _imports(state: State, p: Pull, m: manifest_lib.Manifest
             ) -> dict[int, local.Import] | None:
  """The exports this pull reads, mapped (once per layout set and publisher process);
  None where a publisher process declines (it cannot export: the network then)."""
  out = {}
  for k, link in p.links.items():
    imp = state.imports.get((k, m.id))
    if imp is not None and int(imp.latest[0]) == exports.CLOSED:
      state.imports.pop((k, m.id)).close()  # freed meanwhile (its layout set dropped)
      imp = None
    if imp is None:
      reply = link.client.call(local.describe_request(m.id), _answer_s(p),
                               "the local export")
      if not reply.get("local"):
        if p.options.path == "local":
          raise ReshardValueError(f"{API}: path='local' needs {link.name} to export the "
                                  f"version; it declined: {reply.get('why')}.")
        logger.info("Subscriber.pull: %s declined the local path (%s); the network "
                    "then", link.name, reply.get("why"))
        return None
      if len(state.imports) >= MAX_MANIFESTS:
        state.imports.pop(next(iter(state.imports))).close()
      imp = state.imports[(k, m.id)] = local.Import(reply, link.name, m.id)
    out[k] = imp
  return out


@functools.lru_cache(maxsize=64)
def _result_bytes(pp: planning.PullPlan) -> int:
  """The bytes of a pull's result where nothing is quantized: every leaf's global size
  in its delivered dtype (per plan; plans hash by identity)."""
  return sum(int(np.prod(t.src.shape, dtype=object)) * out.itemsize
             for t, out in zip(pp.plan.tensors, pp.out))


def _finish(state: State, request, pp: planning.PullPlan, number: int, shards) -> Any:
  """The global arrays from this process's shards; quantized leaves as QArrays; the
  donated arrays deleted; the record a later delta pull applies to."""
  m = request.manifest
  avals = pp.avals or [None] * len(m.leaves)
  arrays = [jax_compat.array_from_single_device_arrays(l.shape, d, s, o, aval)
            for l, d, s, o, aval in zip(m.leaves, request.dsts, shards, request.outs, avals)]
  if not pp.avals:
    pp.avals.extend(jax_compat.reusable_aval(a) for a in arrays)
  state.last = (delta_lib.record(number, m.id, request.dsts, request.outs, arrays)
                if request.options.delta else None)
  quantized = [t for t, s in enumerate(request.specs) if s is not None]
  if not quantized:
    state.trace.result_bytes = _result_bytes(pp)
  if quantized:
    for t, q in zip(quantized, quantize.quantize_where_they_live(
        [arrays[t] for t in quantized], [request.specs[t] for t in quantized])):
      arrays[t] = q
  keep = {id(a) for a in arrays}
  for a in request.donated:
    if id(a) not in keep and not a.is_deleted():
      a.delete()
  state.version = max(state.version, number)
  return request.build(arrays)
