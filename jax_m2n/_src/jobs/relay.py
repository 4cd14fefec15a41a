"""Relays among subscriber jobs, the data path: one copy of a version out of the trainer
per group.

Owns the chunked offers the trainer makes to a group's head (`offer_chunks`) and a
member's part (`Member`: joining, pulling the chunks from its upstream, re-routing to
the trainer when its upstream dies or stalls, leaving cleanly; `_Forwarder`: offering
each chunk to its children as soon as it has arrived). Who forwards to whom is
membership.py's. A group is the one-process subscriber jobs pulling one version with the
same plan (manifest, dst layouts, dtypes, route), chunk size, fanout and platform. It
plans nothing and never reads a sharding: it moves the packs the plan asks the trainer
for, cut into flat chunks, through the transport.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import math
import secrets
import socket
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_m2n._src.errors import ProtocolError, ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.jobs import channel, engine, messages
from jax_m2n._src.jobs.planning import PullPlan
from jax_m2n._src.jobs.pull import Pull
from jax_m2n._src.jobs.transport import Pending

logger = logging.getLogger("jax_m2n")

# Chunks of 1 MiB: a hop of a chain adds one chunk's time to the version (8 ms at
# 1 Gbit/s), and the transport's cost per array stays small against it
# (docs/benchmarks.md, "Relays").
CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 30
# A chain (fanout 1): each member sends each byte once, so no link carries more than
# one copy (a tree of fanout F sends F copies out of each inner member).
FANOUT = 1
# An upstream that is alive but delivers no chunk for this long is passed over (one
# that died while connected is noticed at once: its transport connection closes).
# One that died before the pulls connected may not be (a fetch from an address nothing
# listens on waits for its timeout): after PROBE_S without a chunk, and before the
# first pull, a plain TCP connect to its transport's port says whether anything
# listens there.
STALL_S = 10.0
PROBE_S = 0.5
# A member that leaves waits at most this long for its children to finish the version
# they pull from it (they re-route to the trainer if it goes sooner).
LEAVE_S = 10.0
# A member's long poll for its children (answered at once when one joins).
CHILDREN_WAIT_S = 0.5
# Bytes this process pulled as a member: from the trainer, from other members (tests,
# bench), and chunk bytes the trainer offered (on the publisher).
stats = collections.Counter()


def group_key(pp: PullPlan, chunk_bytes: int, fanout: int) -> str:
  """The group a pull relays in: subscribers of the same plan (the fingerprint covers
  the manifest, structure, dst layouts, dtypes and route), chunk size, fanout and
  platform get the same chunks and so can forward them to each other."""
  text = json.dumps([pp.fingerprint, chunk_bytes, fanout, jax.devices()[0].platform,
                     sorted(pp.requests)])
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def chunk_ticket(salt: str, member: str, slot: int, k: int, j: int) -> int:
  """The ticket under which `member` offers chunk j (of trainer process k's packs) to its
  child in `slot`: unguessable without the relay's random salt."""
  h = hashlib.blake2b(f"{salt}|{member}|{slot}|{k}|{j}".encode(), digest_size=8)
  return int.from_bytes(h.digest(), "little")


def chunks_of(shapes: list[tuple[tuple[int, ...], Any]], chunk_bytes: int
              ) -> list[tuple[int, int, int]]:
  """(array index, first element, elements) of every chunk of arrays of these (shape,
  dtype)s, flattened, in order: no chunk spans two arrays."""
  out = []
  for a, (shape, dtype) in enumerate(shapes):
    n = math.prod(shape)
    step = max(1, chunk_bytes // np.dtype(dtype).itemsize)
    out.extend((a, s, min(step, n - s)) for s in range(0, n, step))
  return out


@functools.lru_cache(maxsize=256)
def _slicer(size: int):
  return jax.jit(lambda a, s: lax.dynamic_slice_in_dim(a.reshape(-1), s, size))


def digest(array: jax.Array) -> str:
  """A chunk's digest (BLAKE2b, 128 bits, hex) over its bytes on the host (on CPU its
  buffer itself; on GPUs a device-to-host copy): what a member checks each chunk it got
  from another member against (the publisher's, `chunk_digests`)."""
  return hashlib.blake2b(np.ascontiguousarray(np.asarray(array)).view(np.uint8),
                         digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------
# The trainer's side
# ---------------------------------------------------------------------------------------

def chunk_digests(groups: list[list[jax.Array]], body: dict[str, Any]) -> dict[str, Any]:
  """The digest of every chunk of a pieces request's packs (as `offer_chunks` cuts
  them), in order: {"digests": [...]}. A member gets them from the publisher, never
  from another member, so a lying member cannot make its child accept what it sent."""
  chunk_bytes = messages.field(body, "chunk_bytes", int, lo=MIN_CHUNK_BYTES,
                               hi=MAX_CHUNK_BYTES)
  arrays = [np.asarray(a).reshape(-1) for group in groups for a in group]
  table = chunks_of([(a.shape, a.dtype) for a in arrays], chunk_bytes)
  return {"digests": [hashlib.blake2b(arrays[a][start:start + size].view(np.uint8),
                                      digest_size=16).hexdigest()
                      for a, start, size in table]}


def offer_chunks(offer: Callable[[list[jax.Array]], int], groups: list[list[jax.Array]],
                 body: dict[str, Any]) -> dict[str, Any]:
  """Offers (`offer(arrays) -> ticket`) the asked chunks of a pieces request's packs
  (`groups`: per wave, the packs' arrays, as the publisher cut them) each under its own
  ticket; returns {"tickets": [...]} in the order asked."""
  chunk_bytes = messages.field(body, "chunk_bytes", int, lo=MIN_CHUNK_BYTES,
                               hi=MAX_CHUNK_BYTES)
  arrays = [a for group in groups for a in group]
  table = chunks_of([(a.shape, a.dtype) for a in arrays], chunk_bytes)
  asked = messages.int_list(body.get("chunks"), "pieces: chunks", 0, len(table) - 1,
                            len(table))
  if not asked:
    raise ProtocolError("pieces: chunks must name at least one chunk.")
  tickets = []
  for j in asked:
    a, start, size = table[j]
    array = arrays[a]
    if size == math.prod(array.shape):
      chunk = array.reshape(-1)
    else:
      chunk = _slicer(size)(array, np.int32(start))
    tickets.append(offer([chunk]))
    stats["offered_chunk_bytes"] += chunk.nbytes
  return {"tickets": tickets}


# ---------------------------------------------------------------------------------------
# A member's side
# ---------------------------------------------------------------------------------------

def _listening(address: str) -> bool:
  """Whether a process listens at `address`: False on a refused (or unroutable)
  connection; True when it connects or the answer is slow (a loaded link is no
  death)."""
  host, port = address.rsplit(":", 1)
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
  except TimeoutError:
    return True
  except OSError as e:
    logger.info("jax_m2n relay: nothing listens at %s: %s", address, e)
    return False
  return True


def _state(fetch: Pending | None) -> str:
  """"pending" (or not asked yet), "ok" or "failed" (the fetch that fills it
  broke)."""
  if fetch is None or not fetch.done():
    return "pending"
  try:
    fetch.result()
  except Exception:  # noqa: BLE001 - the transport's failure: the caller re-routes
    return "failed"
  return "ok"


class _Version:
  """One version's chunks on a member: per trainer process k, its chunk table and the
  fetches bringing them (replaced where a re-route fetched one again)."""

  def __init__(self, pp: PullPlan, version: int, key: str, salt: str,
               chunk_bytes: int):
    self.version, self.key, self.salt = version, key, salt
    self.chunk_bytes = chunk_bytes
    devices = {d.id: d for d in jax.local_devices()}
    self.specs: dict[int, list[list[jax.ShapeDtypeStruct]]] = {}
    self.table: dict[int, list[tuple[int, int, int]]] = {}
    self.chunk_specs: dict[int, list[jax.ShapeDtypeStruct]] = {}
    for k, groups in sorted(pp.packed_requests.items()):
      specs = [[engine.pack_spec(pp, pack, devices) for pack in packs]
               for packs in groups]
      flat = [s for group in specs for s in group]
      self.specs[k] = specs
      self.table[k] = chunks_of([(s.shape, s.dtype) for s in flat], chunk_bytes)
      self.chunk_specs[k] = [jax.ShapeDtypeStruct((n,), flat[a].dtype,
                                                  sharding=flat[a].sharding)
                             for a, _, n in self.table[k]]
    self.order = [(k, j) for k in sorted(self.table) for j in range(len(self.table[k]))]
    self.fetches: dict[tuple[int, int], Pending] = {}
    self.sources: dict[tuple[int, int], str] = {}  # "trainer" or "peers"
    # The publisher's digest of each chunk (where it came from a member) and the
    # chunks checked: only those are used and forwarded.
    self.digests: dict[tuple[int, int], str] = {}
    self.good: set[tuple[int, int]] = set()
    self.lock = threading.Lock()
    self.stop = threading.Event()

  def get(self, kj: tuple[int, int]) -> Pending | None:
    with self.lock:
      return self.fetches.get(kj)

  def put(self, kj: tuple[int, int], fetch: Pending, source: str) -> None:
    with self.lock:
      self.fetches[kj] = fetch
      self.sources[kj] = source
      self.good.discard(kj)

  def check(self, kj: tuple[int, int]) -> bool:
    """Whether chunk kj (arrived) is what the publisher offered: its digest where it
    came from a member (a chunk from the trainer is its own). Checked ones are `good`."""
    if self.sources[kj] == "peers" and digest(self.array(kj)) != self.digests[kj]:
      stats["bad_chunks"] += 1
      return False
    with self.lock:
      self.good.add(kj)
    return True

  def array(self, kj: tuple[int, int]) -> jax.Array:
    """Chunk kj, arrived (`_state` said "ok")."""
    return self.get(kj).result()[0]

  def packs(self) -> dict[int, Any]:
    """Per trainer process, an iterator over its waves' pack arrays (what
    `engine.run` would have fetched), assembled from the chunks."""
    out = {}
    for k, specs in self.specs.items():
      flat = [s for group in specs for s in group]
      parts: list[list[jax.Array]] = [[] for _ in flat]
      for j, (a, _, _) in enumerate(self.table[k]):
        parts[a].append(self.array((k, j)))
      arrays = [(p[0] if len(p) == 1 else jnp.concatenate(p)).reshape(s.shape)
                for p, s in zip(parts, flat)]
      it = iter(arrays)
      out[k] = iter([[next(it) for _ in group] for group in specs])
    return out


def _upstream_of(api: str, reply: dict[str, Any]) -> tuple[str, str] | None:
  """A join's upstream member (its id and transport address), or None: the trainer."""
  upstream = reply.get("upstream")
  if upstream is None:
    return None
  if not (isinstance(upstream, list) and len(upstream) == 2
          and all(isinstance(x, str) for x in upstream)):
    raise ReshardRuntimeError(f"{api}: the publisher answered a relay join with a "
                              f"malformed upstream; got {messages._short(upstream)}.")
  return upstream[0], upstream[1]


class Member:
  """This subscriber (a one-process job) as a relay member: `receive` pulls one
  version's packs through the relay; `close` leaves cleanly.

  Args:
    api: the name errors carry.
    client: makes a new control client to the publisher's process 0 (each forwarding
      thread has its own: a zmq socket serves one thread).
    chunk_bytes, fanout: the relay's chunk size and tree fanout (1: a chain).
  """

  def __init__(self, api: str, client: Callable[[], channel.Client],
               chunk_bytes: int = CHUNK_BYTES, fanout: int = FANOUT):
    self.api = api
    self.id = secrets.token_hex(8)
    self.client = client
    self.chunk_bytes = chunk_bytes
    self.fanout = fanout
    self._versions: list[tuple[_Forwarder, _Version]] = []
    self.upstream: str | None = None  # whom the last pull was told to pull from

  def receive(self, root: channel.Client, pull: Pull, answer_s: float
              ) -> dict[int, Any] | None:
    """Pulls `pull`'s version through the relay: per trainer process, an iterator over
    its waves' pack arrays (`engine.run`'s `pulled=`); None where the coordinator says
    to pull directly (the group relays a newer version already). Every chunk is
    offered to this member's children as soon as it has arrived (by a thread that
    outlives the call until the relay closes)."""
    self._versions = [(f, v) for f, v in self._versions if f.is_alive()]
    key = group_key(pull.plan, self.chunk_bytes, self.fanout)
    reply = root.call({"op": "relay_join", "version": pull.number, "group": key,
                       "member": self.id, "address": pull.transport.address,
                       "fanout": self.fanout}, answer_s, "a relay join")
    if reply.get("direct"):
      return None
    upstream = _upstream_of(self.api, reply)
    self.upstream = "the trainer" if upstream is None else upstream[1]
    logger.info("jax_m2n relay: version %d: member %s pulls from %s", pull.number,
                self.id, "the trainer" if upstream is None else upstream)
    v = _Version(pull.plan, pull.number, key, str(reply.get("salt")), self.chunk_bytes)
    forwarder = _Forwarder(self, v, pull.transport, pull.timeout_s)
    forwarder.start()
    self._versions.append((forwarder, v))
    try:
      if upstream is not None:
        try:
          _digests(self.api, pull, v, answer_s)
          if not _listening(upstream[1]):
            raise ReshardRuntimeError("nothing listens there (it died)")
          for k, j in v.order:  # all at once: each waits until the upstream offers it
            v.put((k, j), pull.transport.fetch(upstream[1], chunk_ticket(
                v.salt, upstream[0], int(reply.get("slot", 0)), k, j),
                [v.chunk_specs[k][j]], timeout_s=pull.timeout_s), "peers")
        except Exception as e:  # noqa: BLE001 - an unreachable upstream: re-route now
          logger.warning("jax_m2n relay: version %d: upstream %s unreachable: %s",
                         pull.number, upstream[1], e)
          self._reroute(root, pull, v, upstream[0], v.order, answer_s)
          upstream = None
      else:
        _from_trainer(pull, v, v.order, answer_s)
      self._wait(root, pull, v, upstream, answer_s)
    except BaseException:
      v.stop.set()  # nothing more to forward: the children re-route
      raise
    root.call({"op": "relay_done", "version": pull.number, "group": key,
               "member": self.id}, answer_s, "a relay report")
    return v.packs()

  def _reroute(self, root: channel.Client, pull: Pull, v: _Version, up_id: str,
               missing: list[tuple[int, int]], answer_s: float) -> None:
    """The upstream died or stalled: the coordinator learns it (no one else is given
    it), and the missing chunks come from the trainer."""
    root.call({"op": "relay_reroute", "version": v.version, "group": v.key,
               "member": self.id, "upstream": up_id}, answer_s, "a relay re-route")
    stats["reroutes"] += 1
    _from_trainer(pull, v, missing, answer_s)

  def _wait(self, root: channel.Client, pull: Pull, v: _Version,
            upstream: tuple[str, str] | None, answer_s: float) -> None:
    """Waits (bounded) until every chunk has arrived; re-routes to the trainer when a
    transfer from the upstream member fails (it died: its connection closed) or no
    chunk arrives from it for STALL_S."""
    last = probed = time.monotonic()
    ready: set[tuple[int, int]] = set()
    delay = 1e-4
    while len(ready) < len(v.order):
      failed = progressed = False
      for kj in v.order:  # in order, up to the first still in flight (they arrive
        if kj in ready:   # in order: a scan of every chunk would cost CPU per wait)
          continue
        state = _state(v.get(kj))
        if state != "ok":
          failed = state == "failed"
          break
        if not v.check(kj):  # not what the publisher offered: the upstream lies
          logger.warning("jax_m2n relay: version %d: chunk %s from member %s does not "
                         "match the publisher's digest; the rest comes from the "
                         "trainer", v.version, kj, upstream[0] if upstream else "?")
          failed = True
          break
        ready.add(kj)
        progressed = True
        stats[f"from_{v.sources[kj]}_bytes"] += v.array(kj).nbytes
      now = time.monotonic()
      if progressed:
        last, delay = now, 1e-4
      if failed and upstream is None:
        raise ReshardRuntimeError(
            f"{self.api}: the chunks of version {v.version} from the trainer must "
            "arrive; a transfer failed (the trainer died or closed mid-transfer).")
      gone = False
      if upstream is not None and not failed and now - max(last, probed) > PROBE_S:
        probed = now
        gone = not _listening(upstream[1])
      if failed or gone or (upstream is not None and now - last > STALL_S):
        logger.warning("jax_m2n relay: version %d: upstream %s %s; the rest comes from "
                       "the trainer", v.version, upstream[1],
                       "failed" if failed else "is gone" if gone else "stalled")
        self._reroute(root, pull, v, upstream[0],
                      [kj for kj in v.order if kj not in ready], answer_s)
        upstream, last = None, time.monotonic()
        continue
      if now > pull.deadline:
        raise ReshardTimeoutError(
            f"{self.api}: the chunks of version {v.version} must arrive within "
            f"timeout_s={pull.timeout_s:g}; got {len(ready)} of {len(v.order)}.")
      if not progressed:
        time.sleep(delay)
        delay = min(2 * delay, 2e-3)

  def close(self, root: channel.Client | None, answer_s: float) -> None:
    """Leaves: no new child is given this member; waits (at most LEAVE_S) until the
    children pulling from it have their version (the coordinator counts a child until
    it says it is done: every chunk offered may still be in flight), then stops
    forwarding."""
    deadline = time.monotonic() + LEAVE_S
    versions = sorted({v.version for _, v in self._versions})
    try:
      while root is not None and versions:
        reply = root.call({"op": "relay_leave", "member": self.id, "versions": versions},
                          answer_s, "a relay leave")
        if not reply.get("pending"):
          break
        if time.monotonic() > deadline:
          logger.warning("jax_m2n relay: member %s leaves with %s child(ren) still "
                         "pulling version(s) %s from it after %g s; they re-route to "
                         "the trainer", self.id, reply["pending"], versions, LEAVE_S)
          break
        time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - the publisher is gone: nothing to wait for
      logger.info("jax_m2n relay: leaving without the publisher: %s", e)
    for _, v in self._versions:
      v.stop.set()
    for f, _ in self._versions:
      f.join(timeout=5.0)
    self._versions.clear()


def _from_trainer(pull: Pull, v: _Version, wanted: list[tuple[int, int]],
                answer_s: float) -> None:
  """Asks each trainer process for the `wanted` chunks of its packs; fetches them."""
  per: dict[int, list[int]] = {}
  for k, j in wanted:
    per.setdefault(k, []).append(j)
  for k, js in sorted(per.items()):
    link = pull.links[k]
    body = dict(engine.pieces_body(pull.plan, k, v.version, pull.timeout_s),
                chunk_bytes=v.chunk_bytes, chunks=js)
    reply = link.client.call(body, answer_s, f"the chunks of version {v.version}")
    for j, ticket in zip(js, engine.tickets_of(reply, len(js), link.name,
                                               "the chunks request")):
      v.put((k, j), pull.transport.fetch(link.address, ticket, [v.chunk_specs[k][j]],
                                         timeout_s=pull.timeout_s), "trainer")

def _digests(api: str, pull: Pull, v: _Version, answer_s: float) -> None:
  """The publisher's digest of every chunk this member will get from another member
  (one request to each trainer process, sent together)."""
  opened = []
  for k in sorted(v.table):
    link = pull.links[k]
    body = dict(engine.pieces_body(pull.plan, k, v.version, pull.timeout_s),
                op="digests", chunk_bytes=v.chunk_bytes)
    opened.append((k, link, link.client.start(body, "the chunks' digests")))
  for k, link, seq in opened:
    got = link.client.finish(seq, answer_s, "the chunks' digests").get("digests")
    if not isinstance(got, list) or len(got) != len(v.table[k]) or not all(
        isinstance(d, str) and len(d) == 32 for d in got):
      raise ReshardRuntimeError(f"{api}: {link.name} answered the digests request "
                                "with a malformed list.")
    v.digests.update(((k, j), d) for j, d in enumerate(got))


class _Forwarder(threading.Thread):
  """The forwarding thread of one version on a member: offers each chunk, once it has
  arrived, to each child (in order), until every child there will be has every chunk.
  The children come from `_poll_children`, a thread of its own: a control call never holds
  up an offer (the calls cross the same links as the chunks)."""

  def __init__(self, member: Member, v: _Version, transport: Any, timeout_s: float):
    super().__init__(name=f"jax_m2n relay v{v.version}", daemon=True)
    self._member, self._v = member, v
    self._transport, self._timeout_s = transport, timeout_s
    self._children: list[tuple[str, int]] = []
    self._learned = threading.Event()  # no more children will come

  def run(self) -> None:
    v = self._v
    threading.Thread(target=self._poll_children, daemon=True,
                     name=f"jax_m2n relay children v{v.version}").start()
    offered: dict[int, int] = {}  # slot -> chunks offered to it, in order
    try:
      while not v.stop.is_set():
        progressed = False
        for _, slot in list(self._children):
          n = offered.get(slot, 0)
          while n < len(v.order):
            k, j = v.order[n]
            if (k, j) not in v.good:
              break  # not arrived and checked yet (or fetched again after a re-route)
            self._transport.offer([v.array((k, j))], self._timeout_s,
                                  ticket=chunk_ticket(v.salt, self._member.id, slot, k, j))
            n += 1
            progressed = True
          offered[slot] = n
        if self._learned.is_set() and all(offered.get(s, 0) == len(v.order)
                                          for _, s in list(self._children)):
          return
        if not progressed:
          time.sleep(1e-3)
    except Exception as e:  # noqa: BLE001 - the transport closed: children re-route
      logger.warning("jax_m2n relay: version %d: forwarding ended: %s", v.version, e)
    finally:
      v.stop.set()

  def _poll_children(self) -> None:
    """Long-polls the coordinator for this member's children of the version (answered
    at once when one joins) until it has `fanout` of them or the relay closes."""
    v, member, client = self._v, self._member, None
    try:
      client = member.client()
      while not v.stop.is_set() and len(self._children) < member.fanout:
        reply = client.call({"op": "relay_children", "version": v.version,
                             "group": v.key, "member": member.id,
                             "known": len(self._children),
                             "wait_ms": int(CHILDREN_WAIT_S * 1000)},
                            CHILDREN_WAIT_S + 5.0, "the relay's children")
        got = [(str(c), int(s)) for c, s in reply.get("children", [])]
        self._children.extend(got[len(self._children):])
        if reply.get("closed"):
          break
    except Exception as e:  # noqa: BLE001 - the publisher went: no more children
      logger.info("jax_m2n relay: version %d: no more children: %s", v.version, e)
    finally:
      self._learned.set()
      if client is not None:
        client.close()
