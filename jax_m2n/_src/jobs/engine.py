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
import functools
import hashlib
import socket
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.jobs import channel
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE
from jax_m2n._src.jobs.planning import PUBLISHER_PROCESS_BASE, PullPlan
from jax_m2n._src.layout import box_size, intersect
from jax_m2n._src.planner import DST_SHARD
from jax_m2n._src.processes import bootstrap, transfer_engine

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
      from jax.experimental import transfer
      client = jax.local_devices()[0].client
      address = channel.join_address(host, 0)
      server = _servers[host] = transfer.start_transfer_server(client, address,
                                                               [address])
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
# Fused cutting and composing: one compiled program per device, not one per piece
# ---------------------------------------------------------------------------------------

# A part of an output: (input index, starts and limits in the input, offset in the
# output). An output: (shape, dtype assembled in, dtype delivered, parts).
Part = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@functools.lru_cache(maxsize=512)
def _fused(outputs: tuple[tuple[tuple[int, ...], Any, Any, tuple[Part, ...]], ...]):
  """A compiled program from a device's inputs to `outputs` (each cut from parts of the
  inputs, then converted): a pull's pieces cost one dispatch per device. The same
  signature recurs every version, so it compiles once."""
  def f(*inputs):
    outs = []
    for shape, dtype, out_dtype, parts in outputs:
      if len(parts) == 1 and parts[0][3] == (0,) * len(shape) and tuple(
          hi - lo for lo, hi in zip(parts[0][1], parts[0][2])) == shape:
        i, starts, limits, _ = parts[0]
        outs.append(lax.slice(inputs[i], starts, limits).astype(out_dtype))
        continue
      out = jnp.zeros(shape, dtype)
      for i, starts, limits, offset in parts:
        out = lax.dynamic_update_slice(out, lax.slice(inputs[i], starts, limits).astype(
            dtype), offset)
      outs.append(out.astype(out_dtype))
    return tuple(outs)
  return jax.jit(f)


def run_fused(inputs: Sequence[jax.Array], outputs) -> list[jax.Array]:
  """`_fused(outputs)(*inputs)`, with outputs that are an input as it is (one whole
  part in its own dtype) passed through without a copy."""
  result: list[Any] = [None] * len(outputs)
  todo = []
  for j, (shape, dtype, out_dtype, parts) in enumerate(outputs):
    if len(parts) == 1:
      i, starts, limits, offset = parts[0]
      a = inputs[i]
      if (tuple(a.shape) == shape and all(v == 0 for v in starts) and tuple(limits) == shape
          and a.dtype == out_dtype):
        result[j] = a
        continue
    todo.append(j)
  if todo:
    used = sorted({i for j in todo for i, *_ in outputs[j][3]})
    index = {i: k for k, i in enumerate(used)}
    sig = tuple((outputs[j][0], outputs[j][1], outputs[j][2],
                 tuple((index[i], st, li, off) for i, st, li, off in outputs[j][3]))
                for j in todo)
    for j, a in zip(todo, _fused(sig)(*[inputs[i] for i in used])):
      result[j] = a
  return result


def _rel(box, origin) -> tuple[tuple[int, ...], tuple[int, ...]]:
  return (tuple(lo - o for (lo, _), (o, _) in zip(box, origin)),
          tuple(hi - o for (_, hi), (o, _) in zip(box, origin)))


def compose_outputs(pp: PullPlan, buffers: Any) -> list[list[jax.Array]]:
  """Every local destination shard, composed from the pieces delivered into it: one
  fused program per device."""
  by_device: dict[int, list[tuple[int, int]]] = {}
  for t, local in enumerate(pp.local_dst):
    for j, d in enumerate(local):
      by_device.setdefault(d.id, []).append((t, j))
  out: list[list[Any]] = [[None] * len(local) for local in pp.local_dst]
  for dev, slots in by_device.items():
    inputs, ids, outputs = [], {}, []
    for t, _ in slots:
      box = pp.plan.tensors[t].dst.box_of(dev)
      shape = tuple(hi - lo for lo, hi in box)
      parts, covered = [], 0
      for pbox, arr in buffers.pieces.get((t, dev, DST_SHARD), []):
        part = intersect(pbox, box) if box else ()
        if part is None:
          continue
        k = ids.setdefault(id(arr), len(inputs))
        if k == len(inputs):
          inputs.append(arr)
        starts, limits = _rel(part, pbox)
        parts.append((k, starts, limits, _rel(part, box)[0]))
        covered += box_size(part)
      if covered != box_size(box):
        raise ReshardRuntimeError(
            f"Subscriber.pull: internal error: device {dev} holds {covered} of the "
            f"{box_size(box)} elements of leaf {t}'s box {box}.")
      outputs.append((shape, pp.wire[t], pp.out[t], tuple(parts)))
    arrays = _compose_device(inputs, outputs, dev, pp)
    for (t, j), a in zip(slots, arrays):
      out[t][j] = a
  return out


def _compose_device(inputs, outputs, dev: int, pp: PullPlan) -> list[jax.Array]:
  device = next(d for local in pp.local_dst for d in local if d.id == dev)
  result: list[Any] = [None] * len(outputs)
  real = [j for j, o in enumerate(outputs) if o[3]]
  for j, (shape, _, out_dtype, parts) in enumerate(outputs):
    if not parts:  # a zero-size box: nothing delivered
      result[j] = jax.device_put(np.zeros(shape, out_dtype), device)
  if real:
    for j, a in zip(real, run_fused(inputs, [outputs[j] for j in real])):
      result[j] = a
  return result


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
    wire = sorted({op.tensor for packs in groups for pack in packs for op in pack})
    body = {"op": "pieces", "version": version,
            "wire": [[t, pp.wire[t].name] for t in wire],
            "groups": [[[[op.tensor, op.src - PUBLISHER_DEVICE_BASE,
                          *[lo for lo, _ in op.box], *[hi for _, hi in op.box]]
                         for op in pack] for pack in packs] for packs in groups],
            "timeout_ms": int(timeout_s * 1000)}
    reply = links[k].client.call(body, answer_s, f"the pieces of version {version}")
    got = reply.get("uuids")
    if not isinstance(got, list) or len(got) != len(groups) or not all(
        type(u) is int and 0 <= u < 1 << 64 for u in got):
      raise ReshardRuntimeError(f"Subscriber.pull: {links[k].name} answered the pieces "
                                "request with a malformed list of uuids.")
    uuids[k] = got
  return uuids


def run(pp: PullPlan, links: dict[int, Link], uuids: dict[int, list[int]],
        waits: Any, salt: bytes, timeout_s: float) -> list[list[jax.Array]]:
  """Runs this process's waves; returns per leaf its local destination shards (in
  `pp.local_dst` order, in the delivered dtype). `waits` is the subscriber job's
  CallWaits (None in a one-process job)."""
  me = jax.process_index()
  devices = {d.id: d for d in jax.local_devices()}
  buffers = transfer_engine.Buffers({}, list(pp.wire), devices)
  deadline = time.monotonic() + timeout_s
  # The publisher's pieces depend on nothing: every wave's pull is issued at once, so
  # the transfer server streams them together; a wave waits only for its own.
  from_publisher: dict[int, list[tuple[str, list[Any], Any, jax.Array]]] = {}
  offers = {k: iter(u) for k, u in uuids.items()}
  for wave in pp.waves:
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        k = peer - PUBLISHER_PROCESS_BASE
        packs = pp.packs_of(ops)
        arrays = links[k].connection.pull(next(offers[k]), [
            _pack_spec(pp, pack, devices) for pack in packs])
        stats["pulled_bytes"] += sum(a.nbytes for a in arrays)
        for pack, a in zip(packs, arrays):  # unpacked when it lands (XLA waits for it)
          pieces = [a] if len(pack) == 1 else list(_unpacker(tuple(
              tuple(hi - lo for lo, hi in op.box) for op in pack))(a))
          from_publisher.setdefault(wave.depth, []).append(
              (links[k].name, pack, a, pieces))
  for wave in pp.waves:
    w = wave.depth
    for peer, ops in sorted(wave.sends.items()):  # forwards to the job's own processes
      arrays = [buffers.read(op, copy=False) for op in ops]
      eng = bootstrap.engine()
      eng.server.await_pull(peer_uuid(salt, w, me, peer), arrays,
                            timeout=offer_deadline(timeout_s))
      stats["forwarded_bytes"] += sum(a.nbytes for a in arrays)
    if wave.sends:
      waits.post(f"w{w}")
    _local(pp, buffers, wave.local, devices)  # fan-out and copies inside this process
    pending = []
    for name, pack, arr, pieces in from_publisher.get(w, []):
      for op, piece in zip(pack, pieces):
        buffers.deliver(op, piece)
      pending.append((name, arr))
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        continue
      waits.wait(f"w{w}", [peer], f"process {peer}'s forwards (wave {w})")
      eng = bootstrap.engine()
      address = eng.kv.key_value_try_get(f"{bootstrap.PREFIX}/addr/{peer}")
      arrays = eng.connection(peer, address).pull(peer_uuid(salt, w, peer, me),
                                                  _specs(pp, ops, devices))
      stats["forwarded_in_bytes"] += sum(a.nbytes for a in arrays)
      for op, arr in zip(ops, arrays):
        buffers.deliver(op, arr)
        pending.append((f"process {peer} of this job", arr))
    if pending:
      _wait_ready(pending, waits, w, deadline, timeout_s)
  return compose_outputs(pp, buffers)


def _local(pp: PullPlan, buffers: Any, ops, devices) -> None:
  """A wave's copies inside this process, packed: per (source device, destination
  device, wire dtype) one fused cut, one device_put, one unpack (a fan-out of a
  200-leaf model is hundreds of boxes)."""
  groups: dict[tuple[int, int, Any], list[Any]] = {}
  for op in ops:
    groups.setdefault((op.src, op.dst, pp.wire[op.tensor]), []).append(op)
  for (src, dst, dtype), group in groups.items():
    if len(group) == 1 or src == dst:
      for op in group:
        arr = buffers.read(op, copy=op.src == op.dst)
        if op.src != op.dst:
          arr = jax.device_put(arr, devices[op.dst])
        buffers.deliver(op, arr)
      continue
    inputs, ids, parts = [], {}, []
    for op in group:
      held = next(((pbox, a) for pbox, a in buffers.pieces.get(
          (op.tensor, op.src, op.src_kind), []) if intersect(pbox, op.box) == op.box),
          None)
      if held is None:  # the box spans several delivered pieces: composed first
        held = (op.box, buffers.compose(op.tensor, op.src, op.src_kind, op.box, dtype))
      pbox, a = held
      i = ids.setdefault(id(a), len(inputs))
      if i == len(inputs):
        inputs.append(a)
      parts.append((i, *_rel(op.box, pbox)))
    flat = jax.device_put(_packer(tuple(parts), dtype)(*inputs), devices[dst])
    for op, piece in zip(group, _unpacker(tuple(
        tuple(hi - lo for lo, hi in op.box) for op in group))(flat)):
      buffers.deliver(op, piece)


def _pack_spec(pp: PullPlan, pack, devices) -> jax.ShapeDtypeStruct:
  """What one pack arrives as: its one piece's shape, or several pieces flattened and
  concatenated (one array per (source device, destination device, dtype) and wave: the
  transfer server's cost is per array)."""
  sharding = jax.sharding.SingleDeviceSharding(devices[pack[0].dst])
  if len(pack) == 1:
    shape = tuple(hi - lo for lo, hi in pack[0].box)
  else:
    shape = (sum(box_size(op.box) for op in pack),)
  return jax.ShapeDtypeStruct(shape, pp.wire[pack[0].tensor], sharding=sharding)


@functools.lru_cache(maxsize=512)
def _packer(parts: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], dtype: Any):
  """A compiled program cutting boxes of a device's inputs and concatenating them
  flattened, in `dtype` (the publisher's side of a pack)."""
  def f(*inputs):
    return jnp.concatenate([lax.slice(inputs[i], st, li).astype(dtype).reshape(-1)
                            for i, st, li in parts])
  return jax.jit(f)


@functools.lru_cache(maxsize=512)
def _unpacker(shapes: tuple[tuple[int, ...], ...]):
  """The subscriber's side of a pack: the pieces, each reshaped from its run."""
  def f(flat):
    out, at = [], 0
    for shape in shapes:
      n = int(np.prod(shape))
      out.append(lax.slice(flat, (at,), (at + n,)).reshape(shape))
      at += n
    return tuple(out)
  return jax.jit(f)


def _specs(pp: PullPlan, ops, devices) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in op.box), pp.wire[op.tensor],
                               sharding=jax.sharding.SingleDeviceSharding(devices[op.dst]))
          for op in ops]


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
    waits.wait(f"w{w}", [], f"the wave-{w} transfers to arrive", ready)
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
