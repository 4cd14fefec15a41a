"""A subscriber process's part of a pull: JAX's transfer server, driven by the plan.

Owns running one PullPlan on this process: asking each publisher process for its
pieces (it cuts them and offers each wave under a random uuid), pulling them wave by
wave, offering and pulling the forwards between the subscriber job's own processes
(their transfer servers, the job's key-value store), the copies inside the process
(local pieces, fan-out), and composing each destination shard. Every wait is bounded.
It never plans, and never reads a sharding.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import socket
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src import transfer_server as jax_transfer
from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.jobs import channel, pieces
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.planning import PUBLISHER_PROCESS_BASE, PullPlan
from jax_m2n._src.layout import box_size
from jax_m2n._src.planner import DST_SHARD
from jax_m2n._src.processes import bootstrap

# Bytes this process pulled from publishers / from its own job's peers (tests, bench).
stats = collections.Counter()

# How long after its deadline a piece the publisher offered stays offered (the
# transfer server drops it then: a subscriber that died mid-pull leaks nothing).
OFFER_GRACE_S = 30.0


def offer_deadline(timeout_s: float) -> datetime.datetime:
  """The transfer server's deadline for an offer (an absolute wall-clock time)."""
  return datetime.datetime.now() + datetime.timedelta(seconds=timeout_s + OFFER_GRACE_S)


# ---------------------------------------------------------------------------------------
# Transfer servers
# ---------------------------------------------------------------------------------------

_servers: dict[str, Any] = {}
_servers_lock = threading.Lock()


def transfer_server(host: str) -> Any:
  """This process's transfer server bound to `host` (one per host, made on first use).

  The server's bulk transport listens on `host` too: the peer it pulls from connects
  back to it, so it must be an address the peer can reach."""
  with _servers_lock:
    server = _servers.get(host)
    if server is None:
      server = _servers[host] = jax_transfer.start(host)
    return server


def local_host_towards(host: str) -> str:
  """The address of this machine's interface that routes to `host` (no packet is
  sent: a UDP socket's connect only picks the route)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_DGRAM) as s:
      s.connect((host, 9))
      return s.getsockname()[0]
  except OSError:
    return "::1" if family == socket.AF_INET6 else "127.0.0.1"


def peer_uuid(salt: bytes, wave: int, sender: int, receiver: int) -> int:
  """A forward's uuid inside the subscriber job: unguessable without the pull's
  random salt (the transfer server authenticates nobody), derivable by both sides."""
  h = hashlib.blake2b(salt + f"|{wave}|{sender}|{receiver}".encode(), digest_size=8)
  return int.from_bytes(h.digest(), "little")


# ---------------------------------------------------------------------------------------
# One pull
# ---------------------------------------------------------------------------------------

class Link:
  """A publisher process as the engine uses it: its control client and its transfer
  server's connection, plus how messages name it."""

  def __init__(self, client: channel.Client, connection: Any, name: str):
    self.client = client
    self.connection = connection
    self.name = name


def request_pieces(pp: PullPlan, links: dict[int, Link], version: int,
                   timeout_s: float, answer_s: float) -> dict[int, list[int]]:
  """Asks each publisher process for the pieces it sends this process, one offer per
  wave; returns their uuids (per publisher process, in wave order)."""
  uuids = {}
  for k, groups in sorted(pp.packed_requests.items()):
    reply = links[k].client.call(pieces_body(pp, k, version, timeout_s), answer_s,
                                 f"the pieces of version {version}")
    got = reply.get("uuids")
    if not isinstance(got, list) or len(got) != len(groups) or not all(
        type(u) is int and 0 <= u < 1 << 64 for u in got):
      raise ReshardRuntimeError(f"Subscriber.pull: {links[k].name} answered the pieces "
                                "request with a malformed list of uuids.")
    uuids[k] = got
  return uuids


def pieces_body(pp: PullPlan, k: int, version: int, timeout_s: float) -> dict[str, Any]:
  """The pieces request to publisher process k: its boxes, one group per wave."""
  groups = pp.packed_requests[k]
  wire = sorted({op.tensor for packs in groups for pack in packs for op in pack})
  return {"op": "pieces", "version": version,
          "wire": [[t, pp.wire[t].name] for t in wire],
          "groups": [[[[op.tensor, op.src - PUBLISHER_DEVICE_BASE,
                        *[lo for lo, _ in op.box], *[hi for _, hi in op.box]]
                       for op in pack] for pack in packs] for packs in groups],
          "timeout_ms": int(timeout_s * 1000)}


def run(pp: PullPlan, links: dict[int, Link], uuids: dict[int, list[int]] | None,
        waits: Any, salt: bytes, timeout_s: float,
        pulled: dict[int, Any] | None = None) -> list[list[jax.Array]]:
  """Runs this process's waves; returns per leaf its local destination shards (in
  `pp.local_dst` order, in the delivered dtype). `waits` is the subscriber job's
  CallWaits (None in a one-process job). `pulled` (a relay's): per publisher process,
  an iterator over its waves' pack arrays, already pulled (then `uuids` is None)."""
  me = jax.process_index()
  devices = {d.id: d for d in jax.local_devices()}
  store = pieces.Store()
  deadline = time.monotonic() + timeout_s
  # The publisher's pieces depend on nothing: every wave's pull is issued at once, so
  # the transfer server streams them together; a wave waits only for its own.
  arrived: dict[int, list[tuple[str, list[Any], jax.Array]]] = {}
  offers = {k: iter(u) for k, u in (uuids or {}).items()}
  for wave in pp.waves:
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        k = peer - PUBLISHER_PROCESS_BASE
        packs = pp.packs_of(ops)
        if pulled is not None:
          arrays = next(pulled[k])
        else:
          arrays = links[k].connection.pull(next(offers[k]), [
              _pack_spec(pp, pack, devices) for pack in packs])
          stats["pulled_bytes"] += sum(a.nbytes for a in arrays)
        arrived.setdefault(wave.depth, []).extend(
            (links[k].name, pack, a) for pack, a in zip(packs, arrays))
  for wave in pp.waves:
    w = wave.depth
    if wave.sends:  # forwards to the job's own processes: one array per box
      eng = bootstrap.engine()
      for peer, ops in sorted(wave.sends.items()):
        arrays = _boxes(pp, store, ops)
        eng.server.await_pull(peer_uuid(salt, w, me, peer), arrays,
                              timeout=offer_deadline(timeout_s))
        stats["forwarded_bytes"] += sum(a.nbytes for a in arrays)
      waits.post(f"w{w}")
    _local(pp, store, wave.local, devices)  # fan-out inside this process
    pending = []
    for name, pack, arr in arrived.get(w, []):
      if len(pack) == 1:
        store.add(pack[0].tensor, pack[0].dst, pack[0].dst_kind, pack[0].box, arr)
      else:
        for op, at in zip(pack, pieces.run_offsets([op.box for op in pack])):
          store.add(op.tensor, op.dst, op.dst_kind, op.box, arr, at)
      pending.append((name, arr))
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        continue
      waits.gather(f"w{w}", [peer], f"process {peer}'s forwards (wave {w})")
      eng = bootstrap.engine()
      arrays = eng.connection(peer).pull(peer_uuid(salt, w, peer, me), [
          _pack_spec(pp, [op], devices) for op in ops])
      stats["forwarded_in_bytes"] += sum(a.nbytes for a in arrays)
      for op, arr in zip(ops, arrays):
        store.add(op.tensor, op.dst, op.dst_kind, op.box, arr)
        pending.append((f"process {peer} of this job", arr))
    if pending:
      _wait_ready(pending, waits, w, deadline, timeout_s)
  return _compose(pp, store, devices)


def _boxes(pp: PullPlan, store: pieces.Store, ops) -> list[jax.Array]:
  """The box each op reads, as an array of its own in the wire dtype (one program per
  source device)."""
  batches: dict[int, pieces.Batch] = {}
  slots = []
  for op in ops:
    batch = batches.setdefault(op.src, pieces.Batch())
    wire = pp.wire[op.tensor]
    slots.append((op.src, batch.box(store.parts(op.tensor, op.src, op.src_kind, op.box),
                                    pieces.shape_of(op.box), wire, wire)))
  results = {k: b.run() for k, b in batches.items()}
  return [results[k][j] for k, j in slots]


def _local(pp: PullPlan, store: pieces.Store, ops, devices) -> None:
  """A wave's copies inside this process, packed per (source device, destination
  device, wire dtype): one cut and one device_put per pack (a fan-out of a 200-leaf
  model is hundreds of boxes)."""
  groups: dict[tuple[int, int, Any], list[Any]] = {}
  for op in ops:
    groups.setdefault((op.src, op.dst, pp.wire[op.tensor]), []).append(op)
  for (src, dst, dtype), group in groups.items():
    batch = pieces.Batch()  # per device pair: its outputs go to dst
    j = batch.pack([(store.parts(op.tensor, op.src, op.src_kind, op.box),
                     pieces.shape_of(op.box)) for op in group], dtype)
    flat = batch.run(devices[dst])[j]
    for op, at in zip(group, pieces.run_offsets([op.box for op in group])):
      store.add(op.tensor, op.dst, op.dst_kind, op.box, flat, at)


def _compose(pp: PullPlan, store: pieces.Store, devices) -> list[list[jax.Array]]:
  """Every local destination shard, from the pieces delivered into it, converted to
  the delivered dtype: one program per device."""
  batches: dict[int, pieces.Batch] = {}
  slots: list[list[Any]] = []
  for t, local in enumerate(pp.local_dst):
    row = []
    for d in local:
      box = pp.plan.tensors[t].dst.box_of(d.id)
      if box_size(box) == 0:  # nothing arrives for an empty box
        row.append(jax.device_put(np.zeros(pieces.shape_of(box), pp.out[t]), d))
        continue
      batch = batches.setdefault(d.id, pieces.Batch())
      row.append((d.id, batch.box(store.parts(t, d.id, DST_SHARD, box),
                                  pieces.shape_of(box), pp.wire[t], pp.out[t])))
    slots.append(row)
  results = {k: b.run() for k, b in batches.items()}
  return [[results[v[0]][v[1]] if isinstance(v, tuple) else v for v in row]
          for row in slots]


def _pack_spec(pp: PullPlan, pack, devices) -> jax.ShapeDtypeStruct:
  """What one pack arrives as: its one box's shape, or several boxes flattened and
  concatenated (one array per (source device, destination device, dtype) and wave: the
  transfer server's cost is per array)."""
  sharding = jax.sharding.SingleDeviceSharding(devices[pack[0].dst])
  if len(pack) == 1:
    shape = pieces.shape_of(pack[0].box)
  else:
    shape = (sum(box_size(op.box) for op in pack),)
  return jax.ShapeDtypeStruct(shape, pp.wire[pack[0].tensor], sharding=sharding)


def _wait_ready(pending: Sequence[tuple[str, jax.Array]], waits: Any, w: int,
                deadline: float, timeout_s: float) -> None:
  """Waits (bounded; a peer's failure or death in the subscriber job ends it) until
  every pulled array has arrived; a failed pull is an error naming its sender."""
  left = list(pending)

  def ready() -> bool:
    nonlocal left
    left = [(p, a) for p, a in left if not a.is_ready()]
    return not left

  if waits is not None:
    waits.wait_ready(ready, {}, f"the wave-{w} transfers to arrive")
  else:
    delay = 1e-4
    while not ready():
      if time.monotonic() > deadline:
        raise ReshardTimeoutError(
            f"Subscriber.pull: the pieces from {left[0][0]} must arrive within "
            f"timeout_s={timeout_s:g}; got {len(left)} array(s) still missing (the "
            "publisher stalled, or its link is too slow for this timeout).")
      time.sleep(delay)
      delay = min(2 * delay, 2e-3)
  for name, arr in pending:
    try:
      arr.block_until_ready()
    except Exception as e:  # noqa: BLE001 - the engine's failure, named
      raise ReshardRuntimeError(
          f"Subscriber.pull: the transfer from {name} failed (wave {w}; it died or "
          f"closed mid-transfer): {type(e).__name__}: {e}") from e
