"""Relays among subscriber jobs: one copy of a version out of the trainer per group.

Owns the relay's membership (`Coordinator`, on the trainer's process 0: per version and
group, the members in the order they joined and whom each pulls from: a chain, or a
tree of a given fanout), the chunked offers the trainer makes to a group's head
(`offer_chunks`), and a member's part (`Member`: pulling the chunks from its upstream,
offering each to its children as soon as it has arrived, re-routing to the trainer
when its upstream dies or stalls, and leaving cleanly). A group is the one-process
subscriber jobs pulling one version with the same plan (manifest, dst layouts, dtypes,
route), chunk size, fanout and platform. It plans nothing and never reads a sharding:
it moves the packs the plan asks the trainer for, cut into flat chunks.
"""

from __future__ import annotations

import collections
import dataclasses
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

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.jobs import channel, engine, messages
from jax_m2n._src.jobs.messages import ProtocolError
from jax_m2n._src.jobs.planning import PullPlan

logger = logging.getLogger("jax_m2n")

# The control calls a Coordinator answers (the publisher hands them over).
OPS = ("relay_join", "relay_children", "relay_reroute", "relay_done", "relay_leave")
# Chunks of 1 MiB: a hop of a chain adds one chunk's time to the version (8 ms at
# 1 Gbit/s), and the transfer server's cost per array stays small against it
# (docs/benchmarks.md, "Relays").
CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 30
# A chain (fanout 1): each member sends each byte once, so no link carries more than
# one copy (a tree of fanout F sends F copies out of each inner member).
FANOUT = 1
MAX_FANOUT = 8
# An upstream that is alive but delivers no chunk for this long is passed over (one
# that died while connected is noticed at once: the transfer server's connection
# closes). One that died before the pulls connected is not (a pull from an address
# nothing listens on waits forever, measured): after PROBE_S without a chunk, and
# before the first pull, a plain TCP connect to its transfer server says whether
# anything listens there.
STALL_S = 10.0
PROBE_S = 0.5
# A member that leaves waits at most this long for its children to finish the version
# they pull from it (they re-route to the trainer if it goes sooner).
LEAVE_S = 10.0
# A member's long poll for its children (answered at once when one joins).
CHILDREN_WAIT_S = 0.5
# Bounds on the coordinator's state (a member is a few hundred bytes).
MAX_RELAYS = 256
MAX_MEMBERS = 1024

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


def chunk_uuid(salt: str, member: str, slot: int, k: int, j: int) -> int:
  """The uuid under which `member` offers chunk j (of trainer process k's packs) to its
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


# ---------------------------------------------------------------------------------------
# The trainer's side
# ---------------------------------------------------------------------------------------

def offer_chunks(server: Any, groups: list[list[jax.Array]], body: dict[str, Any],
                 timeout_s: float) -> dict[str, Any]:
  """Offers the asked chunks of a pieces request's packs (`groups`: per wave, the
  packs' arrays, as `Publisher._pieces` cut them) each under its own random uuid;
  returns {"uuids": [...]} in the order asked."""
  chunk_bytes = messages.field(body, "chunk_bytes", int, lo=MIN_CHUNK_BYTES,
                               hi=MAX_CHUNK_BYTES)
  arrays = [a for group in groups for a in group]
  table = chunks_of([(a.shape, a.dtype) for a in arrays], chunk_bytes)
  asked = messages.int_list(body.get("chunks"), "pieces: chunks", 0, len(table) - 1,
                            len(table))
  if not asked:
    raise ProtocolError("pieces: chunks must name at least one chunk.")
  deadline = engine.offer_deadline(timeout_s)
  uuids = []
  for j in asked:
    a, start, size = table[j]
    array = arrays[a]
    if size == math.prod(array.shape):
      chunk = array.reshape(-1)
    else:
      chunk = _slicer(size)(array, np.int32(start))
    uuid = secrets.randbits(64)
    server.await_pull(uuid, [chunk], timeout=deadline)
    stats["offered_chunk_bytes"] += chunk.nbytes
    uuids.append(uuid)
  return {"uuids": uuids}


@dataclasses.dataclass
class _Entry:
  member: str
  transfer: str
  upstream: str | None
  slot: int
  children: list[tuple[str, int]] = dataclasses.field(default_factory=list)
  done: bool = False
  dead: bool = False


@dataclasses.dataclass
class _Relay:
  salt: str
  fanout: int
  members: dict[str, _Entry] = dataclasses.field(default_factory=dict)
  closed: bool = False


class Coordinator:
  """Who relays to whom, per (version, group): run by the publisher's server thread
  (process 0), which hands it the relay calls and ticks it.

  A member joins when it starts pulling a version; it is the child of the first member
  (in joining order) that is alive, not leaving and has a free slot (fanout 1: the
  chain's tail), or, if none, of the trainer. A relay closes when its version is no
  longer held, or when the same group starts relaying a newer version (later pulls of
  the old one go straight to the trainer): members then stop waiting for children.
  """

  def __init__(self, held: Callable[[], list[int]]):
    self._held = held
    self._relays: collections.OrderedDict[tuple[int, str], _Relay] = (
        collections.OrderedDict())
    self._leaving: set[str] = set()
    self._polls: list[tuple[channel.Caller, tuple[int, str], str, int, float]] = []

  def handle(self, caller: channel.Caller, body: dict[str, Any]) -> None:
    op = body["op"]
    if op == "relay_leave":
      member = messages.field(body, "member", str, max_len=32)
      self._leaving.add(member)
      if len(self._leaving) > MAX_MEMBERS:
        self._leaving.pop()
      pending = sum(1 for r in self._relays.values() if not r.closed
                    for e in r.members.values() if e.upstream == member
                    and not (e.done or e.dead))
      caller.reply({"pending": pending})
      return
    key = (messages.field(body, "version", int, lo=1, hi=1 << 62),
           messages.field(body, "group", str, max_len=32))
    member = messages.field(body, "member", str, max_len=32)
    if op == "relay_join":
      caller.reply(self._join(key, member, body))
      return
    relay = self._relays.get(key)
    entry = relay.members.get(member) if relay is not None else None
    if entry is None:
      caller.reply({"error": "relay: the member must have joined this version's relay; "
                    "got an unknown one.", "kind": "value"})
    elif op == "relay_children":
      known = messages.field(body, "known", int, lo=0, hi=MAX_MEMBERS)
      wait_ms = messages.field(body, "wait_ms", int, lo=0, hi=60_000)
      self._polls.append((caller, key, member, known, time.monotonic() + wait_ms / 1000))
    elif op == "relay_reroute":
      upstream = messages.field(body, "upstream", str, max_len=32)
      if entry.upstream == upstream and upstream in relay.members:
        relay.members[upstream].dead = True
        logger.info("jax_m2n relay: version %d: member %s lost its upstream %s; it "
                    "pulls the rest from the trainer", key[0], member, upstream)
      entry.upstream = None
      caller.reply({"upstream": None})
    else:  # relay_done
      entry.done = True
      caller.reply({})
    self.tick()

  def _join(self, key: tuple[int, str], member: str, body: dict[str, Any]
            ) -> dict[str, Any]:
    transfer = messages.field(body, "transfer", str, max_len=256)
    fanout = messages.field(body, "fanout", int, lo=1, hi=MAX_FANOUT)
    version, group = key
    if version not in self._held():
      return {"error": f"version {version} must be held to be relayed.", "kind": "gone"}
    relay = self._relays.get(key)
    if relay is None:
      if any(v > version for v, g in self._relays if g == group):
        return {"direct": True}  # the group relays a newer version now
      for (v, g), old in self._relays.items():
        if g == group:
          old.closed = True
      relay = self._relays[key] = _Relay(secrets.token_hex(16), fanout)
      while len(self._relays) > MAX_RELAYS:
        self._relays.popitem(last=False)
    if relay.closed or len(relay.members) >= MAX_MEMBERS or relay.fanout != fanout:
      return {"direct": True}
    old = relay.members.get(member)
    if old is not None:  # a retry of the same pull: it keeps its place
      up = relay.members.get(old.upstream) if old.upstream else None
      return {"salt": relay.salt, "upstream": None if up is None else
              [up.member, up.transfer], "slot": old.slot}
    up = next((e for e in relay.members.values()
               if not e.dead and e.member not in self._leaving
               and len(e.children) < relay.fanout), None)
    slot = 0
    if up is not None:
      slot = len(up.children)
      up.children.append((member, slot))
    relay.members[member] = _Entry(member, transfer, up.member if up else None, slot)
    return {"salt": relay.salt, "upstream": None if up is None else
            [up.member, up.transfer], "slot": slot}

  def tick(self, closing: bool = False) -> None:
    """Answers the children polls that have news, expired or whose relay closed; drops
    the relays of versions no longer held."""
    held = set(self._held())
    for key in [k for k in self._relays if k[0] not in held]:
      del self._relays[key]
    now = time.monotonic()
    keep = []
    for caller, key, member, known, deadline in self._polls:
      relay = self._relays.get(key)
      closed = closing or relay is None or relay.closed
      children = relay.members[member].children if relay is not None else []
      if closed or len(children) > known or now >= deadline:
        caller.reply({"children": [list(c) for c in children], "closed": closed})
      else:
        keep.append((caller, key, member, known, deadline))
    self._polls = keep


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


def _state(array: jax.Array | None) -> str:
  """"pending" (or not asked yet), "ok" or "failed" (the transfer that fills it
  broke)."""
  if array is None or not array.is_ready():
    return "pending"
  try:
    array.block_until_ready()
  except Exception:  # noqa: BLE001 - the engine's failure: the caller re-routes
    return "failed"
  return "ok"


class _Version:
  """One version's chunks on a member: per trainer process k, its chunk table and the
  arrays (replaced where a re-route pulled one again)."""

  def __init__(self, pp: PullPlan, version: int, key: str, salt: str,
               chunk_bytes: int):
    self.version, self.key, self.salt = version, key, salt
    devices = {d.id: d for d in jax.local_devices()}
    self.specs: dict[int, list[list[jax.ShapeDtypeStruct]]] = {}
    self.table: dict[int, list[tuple[int, int, int]]] = {}
    self.chunk_specs: dict[int, list[jax.ShapeDtypeStruct]] = {}
    for k, groups in sorted(pp.packed_requests.items()):
      specs = [[engine._pack_spec(pp, pack, devices) for pack in packs]  # noqa: SLF001
               for packs in groups]
      flat = [s for group in specs for s in group]
      self.specs[k] = specs
      self.table[k] = chunks_of([(s.shape, s.dtype) for s in flat], chunk_bytes)
      self.chunk_specs[k] = [jax.ShapeDtypeStruct((n,), flat[a].dtype,
                                                  sharding=flat[a].sharding)
                             for a, _, n in self.table[k]]
    self.order = [(k, j) for k in sorted(self.table) for j in range(len(self.table[k]))]
    self.arrays: dict[tuple[int, int], jax.Array] = {}
    self.sources: dict[tuple[int, int], str] = {}  # "trainer" or "peers"
    self.lock = threading.Lock()
    self.stop = threading.Event()

  def get(self, kj: tuple[int, int]) -> jax.Array | None:
    with self.lock:
      return self.arrays.get(kj)

  def put(self, kj: tuple[int, int], array: jax.Array, source: str) -> None:
    with self.lock:
      self.arrays[kj] = array
      self.sources[kj] = source

  def packs(self) -> dict[int, Any]:
    """Per trainer process, an iterator over its waves' pack arrays (what
    `engine.run` would have pulled), assembled from the chunks."""
    out = {}
    for k, specs in self.specs.items():
      flat = [s for group in specs for s in group]
      parts: list[list[jax.Array]] = [[] for _ in flat]
      for j, (a, _, _) in enumerate(self.table[k]):
        parts[a].append(self.arrays[(k, j)])
      arrays = [(p[0] if len(p) == 1 else jnp.concatenate(p)).reshape(s.shape)
                for p, s in zip(parts, flat)]
      it = iter(arrays)
      out[k] = iter([[next(it) for _ in group] for group in specs])
    return out


class Member:
  """This subscriber (a one-process job) as a relay member: `receive` pulls one
  version's packs through the relay; `close` leaves cleanly.

  Args:
    api: the name errors carry.
    host: the address of this machine that the trainer and the other members reach
      (this member's transfer server binds it).
    client: makes a new control client to the publisher's process 0 (each forwarding
      thread has its own: a zmq socket serves one thread).
    chunk_bytes, fanout: the relay's chunk size and tree fanout (1: a chain).
  """

  def __init__(self, api: str, host: str, client: Callable[[], channel.Client],
               chunk_bytes: int = CHUNK_BYTES, fanout: int = FANOUT):
    self.api = api
    self.id = secrets.token_hex(8)
    self._host = host
    self._client = client
    self.chunk_bytes = chunk_bytes
    self.fanout = fanout
    self._versions: list[tuple[threading.Thread, _Version]] = []

  def receive(self, root: channel.Client, pp: PullPlan, links: dict[int, engine.Link],
              version: int, timeout_s: float, answer_s: float) -> dict[int, Any] | None:
    """Pulls `version`'s packs through the relay: per trainer process, an iterator
    over its waves' pack arrays (`engine.run`'s `pulled=`); None where the coordinator
    says to pull directly (the group relays a newer version already). Every chunk is
    offered to this member's children as soon as it has arrived (by a thread that
    outlives the call until the relay closes)."""
    self._versions = [(t, v) for t, v in self._versions if t.is_alive()]
    key = group_key(pp, self.chunk_bytes, self.fanout)
    server = engine.transfer_server(self._host)
    reply = root.call({"op": "relay_join", "version": version, "group": key,
                       "member": self.id, "transfer": server.address(),
                       "fanout": self.fanout}, answer_s, "a relay join")
    if reply.get("direct"):
      return None
    logger.info("jax_m2n relay: version %d: member %s pulls from %s", version, self.id,
                "the trainer" if reply.get("upstream") is None else reply["upstream"])
    v = _Version(pp, version, key, str(reply.get("salt")), self.chunk_bytes)
    forwarder = threading.Thread(target=self._forward, args=(v, server, timeout_s),
                                 name=f"jax_m2n relay v{version}", daemon=True)
    forwarder.start()
    self._versions.append((forwarder, v))
    upstream = reply.get("upstream")
    if upstream is not None and not (isinstance(upstream, list) and len(upstream) == 2
                                     and all(isinstance(x, str) for x in upstream)):
      v.stop.set()
      raise ReshardRuntimeError(f"{self.api}: the publisher answered a relay join with a "
                                f"malformed upstream; got {messages._short(upstream)}.")
    try:
      if upstream is None:
        self._from_trainer(pp, v, links, v.order, timeout_s, answer_s)
      else:
        try:
          if not _listening(upstream[1]):
            raise ReshardRuntimeError("nothing listens there (it died)")
          self._from_member(v, server, upstream, int(reply.get("slot", 0)))
        except Exception as e:  # noqa: BLE001 - an unreachable upstream: re-route now
          logger.info("jax_m2n relay: version %d: upstream %s unreachable: %s",
                      version, upstream[1], e)
          self._reroute(root, pp, v, links, upstream[0], v.order, timeout_s, answer_s)
          upstream = None
      self._wait(root, pp, v, links, upstream, timeout_s, answer_s)
    except BaseException:
      v.stop.set()  # nothing more to forward: the children re-route
      raise
    root.call({"op": "relay_done", "version": version, "group": key, "member": self.id},
              answer_s, "a relay report")
    return v.packs()

  def _from_trainer(self, pp: PullPlan, v: _Version, links: dict[int, engine.Link],
                    wanted: list[tuple[int, int]], timeout_s: float,
                    answer_s: float) -> None:
    """Asks each trainer process for the `wanted` chunks of its packs; pulls them."""
    per: dict[int, list[int]] = {}
    for k, j in wanted:
      per.setdefault(k, []).append(j)
    for k, js in sorted(per.items()):
      body = dict(engine.pieces_body(pp, k, v.version, timeout_s),
                  chunk_bytes=self.chunk_bytes, chunks=js)
      reply = links[k].client.call(body, answer_s, f"the chunks of version {v.version}")
      got = reply.get("uuids")
      if not isinstance(got, list) or len(got) != len(js) or not all(
          type(u) is int and 0 <= u < 1 << 64 for u in got):
        raise ReshardRuntimeError(f"{self.api}: {links[k].name} answered the chunks "
                                  "request with a malformed list of uuids.")
      for j, uuid in zip(js, got):
        spec = v.chunk_specs[k][j]
        v.put((k, j), links[k].connection.pull(uuid, [spec])[0], "trainer")

  def _from_member(self, v: _Version, server: Any, upstream: list[str], slot: int
                   ) -> None:
    """Pulls every chunk from the upstream member at once (each pull waits until the
    upstream offers that chunk: the chain's pipelining)."""
    up_id, up_address = upstream
    connection = server.connect(up_address)
    for k, j in v.order:
      spec = v.chunk_specs[k][j]
      v.put((k, j), connection.pull(chunk_uuid(v.salt, up_id, slot, k, j), [spec])[0],
            "peers")

  def _reroute(self, root: channel.Client, pp: PullPlan, v: _Version,
               links: dict[int, engine.Link], up_id: str,
               missing: list[tuple[int, int]], timeout_s: float, answer_s: float) -> None:
    """The upstream died or stalled: the coordinator learns it (no one else is given
    it), and the missing chunks come from the trainer."""
    root.call({"op": "relay_reroute", "version": v.version, "group": v.key,
               "member": self.id, "upstream": up_id}, answer_s, "a relay re-route")
    stats["reroutes"] += 1
    self._from_trainer(pp, v, links, missing, timeout_s, answer_s)

  def _wait(self, root: channel.Client, pp: PullPlan, v: _Version,
            links: dict[int, engine.Link], upstream: list[str] | None,
            timeout_s: float, answer_s: float) -> None:
    """Waits (bounded) until every chunk has arrived; re-routes to the trainer when a
    transfer from the upstream member fails (it died: its connection closed) or no
    chunk arrives from it for STALL_S."""
    deadline = time.monotonic() + timeout_s
    last = probed = time.monotonic()
    ready: set[tuple[int, int]] = set()
    delay = 1e-4
    while len(ready) < len(v.order):
      failed = False
      progressed = False
      for kj in v.order:  # in order, up to the first still in flight (they arrive
        if kj in ready:   # in order: a scan of every chunk would cost CPU per wait)
          continue
        array = v.get(kj)
        state = _state(array)
        if state == "pending":
          break
        if state == "failed":
          failed = True
          break
        ready.add(kj)
        progressed = True
        stats[f"from_{v.sources[kj]}_bytes"] += array.nbytes
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
        logger.info("jax_m2n relay: version %d: upstream %s %s; the rest comes from "
                    "the trainer", v.version, upstream[1],
                    "failed" if failed else "is gone" if gone else "stalled")
        self._reroute(root, pp, v, links, upstream[0],
                      [kj for kj in v.order if kj not in ready], timeout_s, answer_s)
        upstream, last = None, time.monotonic()
        continue
      if now > deadline:
        raise ReshardTimeoutError(
            f"{self.api}: the chunks of version {v.version} must arrive within "
            f"timeout_s={timeout_s:g}; got {len(ready)} of {len(v.order)}.")
      if not progressed:
        time.sleep(delay)
        delay = min(2 * delay, 2e-3)

  def _forward(self, v: _Version, server: Any, timeout_s: float) -> None:
    """The forwarding thread of one version: offers each chunk, once it has arrived,
    to each child (in order), until every child there will be has every chunk. The
    children come from `_children`, a thread of its own: a control call never holds
    up an offer (the calls cross the same links as the chunks)."""
    children: list[tuple[str, int]] = []
    learned = threading.Event()  # no more children will come
    threading.Thread(target=self._children, args=(v, children, learned),
                     name=f"jax_m2n relay children v{v.version}", daemon=True).start()
    offered: dict[int, int] = {}  # slot -> chunks offered to it, in order
    deadline = engine.offer_deadline(timeout_s)
    try:
      while not v.stop.is_set():
        progressed = False
        for _, slot in list(children):
          n = offered.get(slot, 0)
          while n < len(v.order):
            k, j = v.order[n]
            array = v.get((k, j))
            if _state(array) != "ok":
              break  # not arrived yet (or being pulled again after a re-route)
            server.await_pull(chunk_uuid(v.salt, self.id, slot, k, j), [array],
                              timeout=deadline)
            n += 1
            progressed = True
          offered[slot] = n
        if learned.is_set() and all(offered.get(s, 0) == len(v.order)
                                    for _, s in list(children)):
          return
        if not progressed:
          time.sleep(1e-3)
    except Exception as e:  # noqa: BLE001 - the transfer server closed: children re-route
      logger.info("jax_m2n relay: version %d: forwarding ended: %s", v.version, e)
    finally:
      v.stop.set()

  def _children(self, v: _Version, children: list[tuple[str, int]],
                learned: threading.Event) -> None:
    """Long-polls the coordinator for this member's children of version `v` (answered
    at once when one joins) until it has `fanout` of them or the relay closes."""
    client = None
    try:
      client = self._client()
      while not v.stop.is_set() and len(children) < self.fanout:
        reply = client.call({"op": "relay_children", "version": v.version,
                             "group": v.key, "member": self.id, "known": len(children),
                             "wait_ms": int(CHILDREN_WAIT_S * 1000)},
                            CHILDREN_WAIT_S + 5.0, "the relay's children")
        got = [(str(c), int(s)) for c, s in reply.get("children", [])]
        children.extend(got[len(children):])
        if reply.get("closed"):
          break
    except Exception as e:  # noqa: BLE001 - the publisher went: no more children
      logger.info("jax_m2n relay: version %d: no more children: %s", v.version, e)
    finally:
      learned.set()
      if client is not None:
        client.close()

  def close(self, root: channel.Client | None, answer_s: float) -> None:
    """Leaves: no new child is given this member; waits (at most LEAVE_S) until the
    children pulling from it have their version, then stops forwarding."""
    deadline = time.monotonic() + LEAVE_S
    try:
      while root is not None and any(t.is_alive() for t, _ in self._versions):
        reply = root.call({"op": "relay_leave", "member": self.id}, answer_s,
                          "a relay leave")
        if not reply.get("pending") or time.monotonic() > deadline:
          break
        time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - the publisher is gone: nothing to wait for
      logger.info("jax_m2n relay: leaving without the publisher: %s", e)
    for _, v in self._versions:
      v.stop.set()
    for t, _ in self._versions:
      t.join(timeout=5.0)
    self._versions.clear()
