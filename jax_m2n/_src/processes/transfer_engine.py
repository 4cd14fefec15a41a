"""The CPU engine of cross-process reshards: JAX's transfer server between processes,
in-process copies inside one, driven by the plan's transfers in dependency order.

Owns executing one process's part of a plan: reading boxes from source shards and from
what earlier transfers delivered, one `await_pull`/`pull` per (wave, sending process,
receiving process), the in-process copies (local pieces, fan-out), assembling each
destination shard, and counting the bytes that cross processes. It never plans.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax import lax

from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.layout import Box, Layout, box_size, intersect
from jax_m2n._src.planner import SRC_SHARD, Plan
from jax_m2n._src.processes import bootstrap

from jax_m2n._src.errors import API as _API

# Bytes this process put on / took off the engine (every call; tests and the benchmark
# compare them with the plan's network bytes).
stats = collections.Counter()

# Fault injection for tests (tests/multiprocess_cpu_worker.py): called with a phase,
# "offered" once this process has offered a wave's bytes and told its peers. None in
# normal use.
_fault_hook = None


@dataclasses.dataclass(frozen=True)
class Op:
  """One transfer of the plan, as this process sees it."""

  tensor: int
  src: int            # device ids
  dst: int
  src_kind: int
  dst_kind: int
  box: Box
  stage: str


@dataclasses.dataclass
class Wave:
  """The chunks of one step: those inside this process, those it sends (by receiving
  process) and those it receives (by sending process). `depth` (the step) names the
  wave alike on every process."""

  depth: int = 0
  local: list[Op] = dataclasses.field(default_factory=list)
  sends: dict[int, list[Op]] = dataclasses.field(default_factory=dict)
  recvs: dict[int, list[Op]] = dataclasses.field(default_factory=dict)


def waves_of(plan: Plan, me: int, process_of: dict[int, int]) -> list[Wave]:
  """This process's part of `plan`, one Wave per step of its chunked schedule
  (`Plan.chunks`: a chunk runs one step after the chunks it reads, so a leader forwards
  chunk c while chunk c + 1 arrives, the paper's PIPE). Every process derives the same
  waves; a process skips the steps it has no part in."""
  transfers = plan.transfers
  by_step: dict[int, Wave] = {}
  for chunk in plan.chunks:
    x = transfers[chunk.transfer]
    ps, pd = process_of[x.src], process_of[x.dst]
    if me not in (ps, pd):
      continue
    op = Op(x.tensor, x.src, x.dst, x.src_kind, x.dst_kind, chunk.box, x.stage)
    w = by_step.get(chunk.step)
    if w is None:
      w = by_step[chunk.step] = Wave(chunk.step)
    if ps == pd:
      w.local.append(op)
    elif ps == me:
      w.sends.setdefault(pd, []).append(op)
    else:
      w.recvs.setdefault(ps, []).append(op)
  return [by_step[k] for k in sorted(by_step)]


def network_bytes(plan: Plan, process_of: dict[int, int]) -> int:
  """Bytes of the plan's transfers between devices of different processes."""
  total = 0
  for tp in plan.tensors:
    tr = tp.transfers
    if not len(tr):
      continue
    ps = np.array([process_of[int(s)] for s in tr.src.tolist()])
    pd = np.array([process_of[int(d)] for d in tr.dst.tolist()])
    total += int(np.asarray(tr.nbytes(tp.itemsize))[ps != pd].sum())
  return total


@functools.lru_cache(maxsize=4096)
def _slicer(starts: tuple[int, ...], limits: tuple[int, ...], dtype: Any):
  """A compiled slice (and cast to `dtype`): a new buffer, never the operand's."""
  def f(a):
    return lax.slice(a, starts, limits).astype(dtype)
  return jax.jit(f)


@functools.lru_cache(maxsize=4096)
def _composer(shape: tuple[int, ...], dtype: Any, out_dtype: Any,
              offsets: tuple[tuple[int, ...], ...]):
  """A compiled assembly of pieces at `offsets` into one `shape` buffer (cast last)."""
  def f(*pieces):
    out = jax.numpy.zeros(shape, dtype)
    for p, off in zip(pieces, offsets):
      out = lax.dynamic_update_slice(out, p, off)
    return out.astype(out_dtype)
  return jax.jit(f)


def _rel(box: Box, origin: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
  return (tuple(lo - o for (lo, _), (o, _) in zip(box, origin)),
          tuple(hi - o for (_, hi), (o, _) in zip(box, origin)))


def _shape(box: Box) -> tuple[int, ...]:
  return tuple(hi - lo for lo, hi in box)


class Buffers:
  """What one call's devices hold: source shards (with their boxes) and the pieces
  delivered so far into each (tensor, device, buffer kind)."""

  def __init__(self, shards: dict[tuple[int, int], tuple[Box, jax.Array]],
               wire_dtypes: Sequence[Any], devices: dict[int, Any]):
    self.shards = shards
    self.wire = wire_dtypes
    self.devices = devices
    self.pieces: dict[tuple[int, int, int], list[tuple[Box, jax.Array]]] = {}

  def read(self, op: Op, copy: bool) -> jax.Array:
    """The box `op` reads, on op.src, in the tensor's wire dtype. `copy`: never the
    source shard's own buffer (it becomes an output on the same device)."""
    wire = self.wire[op.tensor]
    if op.src_kind == SRC_SHARD:
      held, shard = self.shards[(op.tensor, op.src)]
      if not copy and held == op.box and shard.dtype == wire:
        return shard
      starts, limits = _rel(op.box, held)
      return _slicer(starts, limits, wire)(shard)
    return self.compose(op.tensor, op.src, op.src_kind, op.box, wire)

  def compose(self, t: int, device: int, kind: int, box: Box, out_dtype: Any
              ) -> jax.Array:
    """Box `box` of buffer (t, device, kind) from the pieces delivered into it."""
    pieces = self.pieces.get((t, device, kind), [])
    if box_size(box) == 0:
      return _composer(_shape(box), self.wire[t], out_dtype, ())()
    for pbox, arr in pieces:  # the common case: one piece holds the whole box
      if pbox == box:
        return arr if arr.dtype == out_dtype else _slicer(
            (0,) * len(box), _shape(box), out_dtype)(arr)
      if intersect(pbox, box) == box:
        starts, limits = _rel(box, pbox)
        return _slicer(starts, limits, out_dtype)(arr)
    parts, offsets, covered = [], [], 0
    for pbox, arr in pieces:
      part = intersect(pbox, box)
      if part is None:
        continue
      starts, limits = _rel(part, pbox)
      parts.append(arr if part == pbox else _slicer(starts, limits, arr.dtype)(arr))
      offsets.append(_rel(part, box)[0])
      covered += box_size(part)
    if covered != box_size(box):
      raise ReshardRuntimeError(
          f"{_API}: internal error: device {device} holds {covered} of the "
          f"{box_size(box)} elements of box {box} of leaf {t} it must read.")
    return _composer(_shape(box), self.wire[t], out_dtype, tuple(offsets))(*parts)

  def deliver(self, op: Op, arr: jax.Array) -> None:
    self.pieces.setdefault((op.tensor, op.dst, op.dst_kind), []).append((op.box, arr))


def uuid(call: int, wave: int, sender: int, receiver: int) -> int:
  """The transfer server's request id of one (call, wave, sender, receiver)."""
  return ((call % (1 << 20)) << 40) | ((wave % (1 << 16)) << 24) | (
      (sender % (1 << 12)) << 12) | (receiver % (1 << 12))


def run(waves: Sequence[Wave], buffers: Buffers, waits: Any) -> list[jax.Array]:
  """Runs this process's waves of call `waits.n`; returns what it received (ready)."""
  eng = waits.engine
  me = waits.pid
  received: list[tuple[int, jax.Array]] = []
  for wave in waves:
    w = wave.depth
    for peer, ops in sorted(wave.sends.items()):
      arrays = [buffers.read(op, copy=False) for op in ops]
      eng.server.await_pull(uuid(waits.n, w, me, peer), arrays)
      stats["sent_bytes"] += sum(a.nbytes for a in arrays)
    if wave.sends:
      waits.post(f"w{w}")
      if _fault_hook is not None:
        _fault_hook("offered")
    for op in wave.local:
      arr = buffers.read(op, copy=op.src == op.dst)
      if op.src != op.dst:
        arr = jax.device_put(arr, buffers.devices[op.dst])
      buffers.deliver(op, arr)
    pending = []
    for peer, ops in sorted(wave.recvs.items()):
      waits.wait(f"w{w}", [peer], f"process {peer}'s data (wave {w})")
      conn = eng.connection(peer, _address(waits, peer))
      sharding = [jax.sharding.SingleDeviceSharding(buffers.devices[op.dst]) for op in ops]
      specs = [jax.ShapeDtypeStruct(_shape(op.box), buffers.wire[op.tensor], sharding=s)
               for op, s in zip(ops, sharding)]
      arrays = conn.pull(uuid(waits.n, w, peer, me), specs)
      for op, arr in zip(ops, arrays):
        buffers.deliver(op, arr)
        pending.append((peer, arr))
    if pending:
      _wait_ready(pending, waits, w)
      stats["received_bytes"] += sum(a.nbytes for _, a in pending)
      received.extend(pending)
  return [a for _, a in received]


def _address(waits: Any, peer: int) -> str:
  return waits.kv.key_value_try_get(f"{bootstrap.PREFIX}/addr/{peer}")


def _wait_ready(pending: Sequence[tuple[int, jax.Array]], waits: Any, w: int) -> None:
  """Waits (liveness-aware, bounded) until every pulled array has arrived; a failed
  pull (its sender died mid-transfer) is a ReshardRuntimeError naming the sender."""
  left = list(pending)

  def ready() -> bool:
    nonlocal left
    left = [(p, a) for p, a in left if not a.is_ready()]
    return not left

  waits.wait(f"w{w}", [], f"the wave-{w} transfers to arrive", ready)
  for peer, arr in pending:
    try:
      arr.block_until_ready()
    except Exception as e:  # noqa: BLE001 - the engine's failure, named
      raise ReshardRuntimeError(
          f"{_API}: the transfer from process {peer} failed in cross-process call "
          f"#{waits.n} (wave {w}; the process died or closed its server mid-transfer): "
          f"{type(e).__name__}: {e}") from e
