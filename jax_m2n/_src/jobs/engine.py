"""A subscriber process's part of a full pull, driven by the plan, over the transport.

Owns running one `Pull` on this process: asking each publisher process for its pieces
(it cuts them and offers each wave under a ticket), fetching them wave by wave,
offering and fetching the forwards between the subscriber job's own processes, the
copies inside the process (local pieces, fan-out), and composing each destination
shard. Every wait is bounded. It never plans, never reads a sharding, and moves bytes
only through `transport.Transport`.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import secrets
from typing import Any, Callable

import jax
import numpy as np

from jax_m2n._src import local_copy as local_copy_lib
from jax_m2n._src import schedule
from jax_m2n._src.errors import PlanUnknown, ReshardRuntimeError, Unconfirmed
from jax_m2n._src.jobs import pieces
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.planning import PUBLISHER_PROCESS_BASE, PullPlan
from jax_m2n._src.jobs.pull import API, Pull, wait_arrived
from jax_m2n._src.jobs.transport import Arrived
from jax_m2n._src.layout import box_size, intersect
from jax_m2n._src.planner import DST_SHARD

# How long a publisher holds a pull of the newest version (`Pull.number` None) while it
# has none newer than the subscriber's last; then the subscriber asks the usual way
# (the versions long poll).
NEWEST_WAIT_S = 0.5
# ... and answers it within this more (from its server thread, before it offers the
# bytes): a publisher that died or closed is named as fast as by a long poll.
NEWEST_ANSWER_S = 1.0

# Bytes this process fetched from publishers / exchanged with its own job's peers
# (tests, bench).
stats = collections.Counter()


def peer_ticket(salt: bytes, wave: int, sender: int, receiver: int) -> int:
  """A forward's ticket inside the subscriber job: unguessable without the pull's
  random salt, derivable by both sides."""
  h = hashlib.blake2b(salt + f"|{wave}|{sender}|{receiver}".encode(), digest_size=8)
  return int.from_bytes(h.digest(), "little")


def pull_ticket(salt: bytes, seq: int, group: int) -> int:
  """The ticket of group `group` of a registered plan's pull number `seq`: derived by
  both sides from the plan's random salt (sent only over the control channel), so the
  subscriber fetches before the publisher's answer arrives."""
  h = hashlib.blake2b(salt + f"|{seq}|{group}".encode(), digest_size=8)
  return int.from_bytes(h.digest(), "little")


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


def tickets_of(reply: dict[str, Any], n: int, name: str, what: str) -> list[int]:
  """A reply's `tickets`: `n` ints in [0, 2**64); anything else is the sender's fault."""
  got = reply.get("tickets")
  if not isinstance(got, list) or len(got) != n or not all(
      type(u) is int and 0 <= u < 1 << 64 for u in got):
    raise ReshardRuntimeError(f"{API}: {name} answered {what} with a malformed list of "
                              "tickets.")
  return got


def register(pull: Pull, answer_s: float) -> dict[int, bytes]:
  """Registers the pull's plan with each publisher process it reads from that does not
  have it yet (its packs, wire dtypes and a random salt; the publisher prepares its
  cut); returns per process the plan's salt."""
  key = plan_key(pull.plan)
  salts = {}
  for k in sorted(pull.plan.packed_requests):
    link = pull.links[k]
    salt = link.plans.get(key)
    if salt is None:
      salt = secrets.token_bytes(16)
      body = dict(pieces_body(pull.plan, k, pull.number, pull.timeout_s), op="register",
                  plan=key, manifest=pull.request.manifest.id, salt=salt.hex())
      link.client.call(body, answer_s, "the registration of a plan")
      link.plans[key] = salt
    salts[k] = salt
  return salts


def plan_key(pp: PullPlan) -> str:
  return hashlib.blake2b(pp.fingerprint.encode(), digest_size=16).hexdigest()


def request(pull: Pull, answer_s: float) -> tuple[dict[int, list[int]], list[Any]]:
  """Sends each publisher process this process reads from its pull (registering the
  plan first, once per publisher process and plan), without waiting for the answers:
  returns the tickets to fetch at once (derived from the plan's salt and the pull's
  random number) and the open requests (`confirm` waits for their answers). A pull
  that recurs costs one message to each publisher process and no piece list."""
  seq = secrets.randbits(62)
  key = plan_key(pull.plan)
  tickets, opened = {}, []
  for k, salt in register(pull, answer_s).items():
    link = pull.links[k]
    which = ({"version": pull.number} if pull.number is not None else
             {"after": pull.after,
              "wait_ms": int(min(NEWEST_WAIT_S, pull.timeout_s) * 1000)})
    if pull.number is None and pull.options.version is not None:
      which["want"] = pull.options.version  # that one, in one message too
    opened.append((link, key, link.client.start(
        dict(op="pull", plan=key, seq=seq, timeout_ms=pull.options.timeout_ms, **which),
        _what(pull))))
    tickets[k] = [pull_ticket(salt, seq, g)
                  for g in range(len(pull.plan.packed_requests[k]))]
  return tickets, opened


def prepare(pp: PullPlan) -> None:
  """Compiles what `run` composes with (the direct path's copies), where it takes it."""
  _direct_recipe(pp)


def confirm(pull: Pull, opened: list[Any], answer_s: float) -> None:
  """Waits for the publisher processes' answers to `request`'s pulls (errors raise:
  a version gone, a plan forgotten); on a failure, fails the fetches still pending
  from those processes (their offers will not come)."""
  try:
    for link, key, seq in opened:
      try:  # a pull of the newest is answered before its offers: within a bound
        reply = link.client.finish(seq, answer_s if pull.number is not None else
                                   NEWEST_WAIT_S + NEWEST_ANSWER_S, _what(pull))
      except PlanUnknown:
        link.plans.pop(key, None)  # the next pull registers it again
        raise
      if pull.number is None:  # which version the publisher offered, or none
        pull.number = _offered_version(link, reply, pull.after)
  except BaseException:
    for link, _, _ in opened:
      pull.transport.forget(link.address)
    raise


def _what(pull: Pull) -> str:
  if pull.number is None and pull.options.version is not None:
    return f"the pull of version {pull.options.version}"
  return (f"the pull of version {pull.number}" if pull.number is not None else
          f"the pull of the newest version after {pull.after}")


def _offered_version(link: Any, reply: dict[str, Any], after: int) -> int:
  """The version a pull of the newest was offered; raises Unconfirmed (with the version
  the publisher named, if any) where it offered none."""
  if "newer" in reply:
    newer = reply["newer"]
    if newer is None:
      raise Unconfirmed(None)
    if (isinstance(newer, list) and len(newer) == 2 and type(newer[0]) is int
        and newer[0] > after and isinstance(newer[1], str)):
      raise Unconfirmed((newer[0], newer[1]))
  elif type(reply.get("version")) is int and reply["version"] > after:
    return reply["version"]
  raise ReshardRuntimeError(f"{API}: {link.name} answered the pull of the newest "
                            f"version with a malformed answer.")


def run(pull: Pull, tickets: dict[int, list[int]] | None,
        pulled: dict[int, Any] | None = None,
        confirm: Callable[[], None] | None = None) -> list[list[jax.Array]]:
  """Runs this process's waves; returns per leaf its local destination shards (in
  `pp.local_dst` order, in the delivered dtype). `tickets`: per publisher process, its
  offers in wave order. `pulled` (a relay's): per publisher process, an iterator over
  its waves' pack arrays, already fetched (then `tickets` is None). `confirm` runs
  once every fetch from the publisher is issued, before any wait (the answers to the
  requests that made the offers: errors raise before waiting for what never comes)."""
  pp, transport = pull.plan, pull.transport
  me = jax.process_index()
  devices = {d.id: d for d in jax.local_devices()}
  recipe = _direct_recipe(pp)
  if recipe is not None:
    return _run_direct(pull, recipe, tickets, pulled, confirm, devices)
  store = pieces.Store()
  # The publisher's pieces depend on nothing: every wave's fetch is issued at once, so
  # the transport streams them together; a wave waits only for its own.
  arrived: dict[int, list[tuple[str, list[list[Any]], Any]]] = {}
  offers = {k: iter(u) for k, u in (tickets or {}).items()}
  for wave in pp.waves:
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        k = peer - PUBLISHER_PROCESS_BASE
        packs = pp.packs_of(ops)
        fetch = Arrived(next(pulled[k])) if pulled is not None else transport.fetch(
            pull.links[k].address, next(offers[k]),
            [pack_spec(pp, pack, devices) for pack in packs], timeout_s=pull.timeout_s)
        arrived.setdefault(wave.depth, []).append((pull.links[k].name, packs, fetch))
  if confirm is not None:
    confirm()
  for wave in pp.waves:
    w = wave.depth
    if wave.sends:  # forwards to the job's own processes: one array per box
      for peer, ops in sorted(wave.sends.items()):
        arrays = _boxes(pp, store, ops)
        transport.offer(arrays, pull.timeout_s, ticket=peer_ticket(pull.salt, w, me, peer))
        stats["forwarded_bytes"] += sum(a.nbytes for a in arrays)
      pull.waits.post(f"w{w}")
    _local(pp, store, wave.local, devices)  # fan-out inside this process
    pending = [(name, packs, fetch) for name, packs, fetch in arrived.get(w, [])]
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        continue
      pull.waits.gather(f"w{w}", [peer], f"process {peer}'s forwards (wave {w})")
      pending.append((f"process {peer} of this job", [[op] for op in ops],
                      transport.fetch(pull.peers[peer], peer_ticket(pull.salt, w, peer, me),
                                      [pack_spec(pp, [op], devices) for op in ops],
                                      timeout_s=pull.timeout_s)))
    if not pending:
      continue
    got = wait_arrived(pull, [(name, fetch) for name, _, fetch in pending],
                       f"the wave-{w} transfers")
    for (name, packs, _), arrays in zip(pending, got):
      key = "forwarded_in_bytes" if name.startswith("process ") else "pulled_bytes"
      stats[key] += 0 if pulled is not None and key == "pulled_bytes" else sum(
          a.nbytes for a in arrays)
      for pack, arr in zip(packs, arrays):
        if len(pack) == 1:
          store.add(pack[0].tensor, pack[0].dst, pack[0].dst_kind, pack[0].box, arr)
        else:
          for op, at in zip(pack, pieces.run_offsets([op.box for op in pack])):
            store.add(op.tensor, op.dst, op.dst_kind, op.box, arr, at)
  return _compose(pp, store, devices)


# ---------------------------------------------------------------------------------------
# The direct path: every destination shard composed straight from the packs that arrived
# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _direct_recipe(pp: PullPlan) -> Any:
  """How this process composes its destination shards straight from the packs the
  publisher sends (no fan-out copies, no per-piece Python work per pull), where it
  can: CPU devices (each reads any device's memory: host memory), nothing forwarded
  to or from the job's other processes, and the arriving pieces tile every
  destination box exactly (the flat route: a device's own pieces; the hierarchical:
  each element once per process). Per destination device: its outputs (leaf, index
  in pp.local_dst[leaf]), its slots' pack indices and element offsets in the packs,
  and the prepared local_copy. None: the waves' path (`run`). Cached per plan."""
  if any(d.platform != "cpu" for d in jax.local_devices()) or any(
      wave.sends or any(p < PUBLISHER_PROCESS_BASE for p in wave.recvs)
      for wave in pp.waves):
    return None
  packs = [pack for wave in pp.waves for peer, ops in sorted(wave.recvs.items())
           for pack in pp.packs_of(ops)]
  by_tensor: dict[int, list[tuple[Any, int, int]]] = {}  # t -> (op, pack, offset)
  for index, pack in enumerate(packs):
    offsets = pieces.run_offsets([op.box for op in pack]) if len(pack) > 1 else [-1]
    for op, at in zip(pack, offsets):
      by_tensor.setdefault(op.tensor, []).append((op, index, at))
  per_device: dict[int, Any] = {}
  for t, local in enumerate(pp.local_dst):
    published = pp.wire[t]
    delivered = pp.out[t] if (pp.out[t] == published or schedule.fused_conversion(
        published, pp.out[t])) else published
    for j, d in enumerate(local):
      box = pp.plan.tensors[t].dst.box_of(d.id)
      if box_size(box) == 0:
        continue  # an empty box: zeros, made by the run
      # The pieces that landed on d where they cover its box (the flat route), else
      # every piece of the leaf that arrived (the hierarchical route: leaders share the
      # box, each element arrives once per process).
      mine = [x for x in by_tensor.get(t, []) if x[0].dst == d.id]
      if sum(box_size(intersect(x[0].box, box) if box else ()) for x in mine) != (
          box_size(box)):
        mine = by_tensor.get(t, [])
      outputs, slots, boxes, outs, slot_of = per_device.setdefault(
          d.id, ([], [], [], [], {}))
      out = len(outputs)
      outputs.append((t, j))
      outs.append(local_copy_lib.Out(pieces.shape_of(box), delivered))
      covered = 0
      for op, index, at in mine:
        part = intersect(op.box, box) if box else ()
        if part is None:
          continue
        key = (index, at)
        if key not in slot_of:
          slot_of[key] = len(slots)
          slots.append(key)
        boxes.append(local_copy_lib.Box(
            out, slot_of[key], pieces.shape_of(op.box), published,
            tuple(lo - o for (lo, _), (o, _) in zip(part, op.box)),
            tuple(lo - o for (lo, _), (o, _) in zip(part, box)), pieces.shape_of(part)))
        covered += box_size(part)
      if covered != box_size(box):
        return None  # pieces that overlap or fall short: the waves' path
  devices = {d.id: d for d in jax.local_devices()}
  return len(packs), {d: (outputs, np.array([i for i, _ in slots], np.int64),
                          np.array([max(o, 0) for _, o in slots], np.int64),
                          local_copy_lib.copier(devices[d], boxes, outs, len(slots)))
                      for d, (outputs, slots, boxes, outs, _) in per_device.items()}


def _run_direct(pull: Pull, recipe: Any, tickets, pulled, confirm, devices
                ) -> list[list[jax.Array]]:
  """`run` on the direct path: fetch every pack, then one local_copy per destination
  device out of them."""
  pp = pull.plan
  pending, sizes = [], []
  offers = {k: iter(u) for k, u in (tickets or {}).items()}
  for wave in pp.waves:
    for peer, ops in sorted(wave.recvs.items()):
      k = peer - PUBLISHER_PROCESS_BASE
      packs = pp.packs_of(ops)
      sizes.append(len(packs))
      pending.append((pull.links[k].name, Arrived(next(pulled[k])) if pulled is not None
                      else pull.transport.fetch(
                          pull.links[k].address, next(offers[k]),
                          [pack_spec(pp, pack, devices) for pack in packs],
                          timeout_s=pull.timeout_s)))
  if confirm is not None:
    confirm()
  arrays = [a for got in wait_arrived(pull, pending, "the pieces") for a in got]
  if pulled is None:
    stats["pulled_bytes"] += sum(a.nbytes for a in arrays)
  assert len(arrays) == recipe[0], (len(arrays), recipe[0])
  bases = np.array([a.unsafe_buffer_pointer() for a in arrays], np.int64)
  items = np.array([a.dtype.itemsize for a in arrays], np.int64)
  shards: list[list[Any]] = [[None] * len(devs) for devs in pp.local_dst]
  jobs = [(copy, bases[index] + at * items[index])
          for _, index, at, copy in recipe[1].values()]
  for (outputs, _, _, _), got in zip(recipe[1].values(), local_copy_lib.copy_all(jobs)):
    for (t, j), a in zip(outputs, got):
      shards[t][j] = a if a.dtype == pp.out[t] else pieces.converter(pp.out[t])(a)
  for t, row in enumerate(shards):
    for j, a in enumerate(row):
      if a is None:  # an empty destination box: nothing arrives for it
        d = pp.local_dst[t][j]
        row[j] = jax.device_put(np.zeros(pieces.shape_of(
            pp.plan.tensors[t].dst.box_of(d.id)), pp.out[t]), d)
  jax.block_until_ready([a for row in shards for a in row])  # before `arrays` go
  return shards


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


def pack_spec(pp: PullPlan, pack, devices) -> jax.ShapeDtypeStruct:
  """What one pack arrives as: its one box's shape, or several boxes flattened and
  concatenated (one array per (source device, destination device, dtype) and wave: the
  transfer server's cost is per array)."""
  sharding = jax.sharding.SingleDeviceSharding(devices[pack[0].dst])
  if len(pack) == 1:
    shape = pieces.shape_of(pack[0].box)
  else:
    shape = (sum(box_size(op.box) for op in pack),)
  return jax.ShapeDtypeStruct(shape, pp.wire[pack[0].tensor], sharding=sharding)
