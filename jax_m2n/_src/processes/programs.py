"""The per-device programs of this process's part of a cross-process plan, built once
per plan: per (wave, device) one program that reads every box the device sends or
copies in that wave, packed into one flat buffer per (receiving device, dtype); per
destination device one program that assembles all its destination shards; the specs
of every pull. A repeated call runs a handful of dispatches per (device, wave, peer),
never a Python step per transfer.

Owns turning waves of ops (transfer_engine.waves_of) into programs over numbered
slots (the arrays of one call). It never plans, moves no bytes, makes no key-value
call; transfer_engine.Run runs what it builds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax

from jax_m2n._src import collector, local_copy
from jax_m2n._src.errors import API as _API
from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.layout import Box, box_size, intersect
from jax_m2n._src.planner import SRC_SHARD
from jax_m2n._src.schedule import TYPE_CODES

# A piece of more bytes than this moves as an array of its own (a whole destination
# shard lands as the output itself, no assembly copy: a 256 MiB copy between two
# processes took 1.6-1.8x the raw pull with one); smaller pieces of one (sending
# device, receiving device, dtype) share one flat buffer: the transfer server and
# JAX's dispatch cost per array, and a model's pytree has thousands of small pieces.
PACK_MAX_BYTES = 256 << 10

_DST = 1  # the buffer kind of a destination shard (planner: DST_SHARD)

# An expression over the slots of one call, evaluated inside one jitted program:
#   ("in", slot)                       the slot's array itself
#   ("flat", slot, offset, shape)      elements [offset, offset + size) of a flat slot
#   ("slice", expr, starts, limits)
#   ("cast", expr, dtype)
#   ("compose", shape, dtype, ((starts, expr), ...))   pieces into zeros
#   ("pack", ((expr, ...)))            the exprs raveled and concatenated
Expr = tuple


@functools.lru_cache(maxsize=None)
def _sharding(device: Any) -> jax.sharding.SingleDeviceSharding:
  return jax.sharding.SingleDeviceSharding(device)


def _shape(box: Box) -> tuple[int, ...]:
  return tuple(hi - lo for lo, hi in box)


def _rel(box: Box, origin: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
  return (tuple(lo - o for (lo, _), (o, _) in zip(box, origin)),
          tuple(hi - o for (_, hi), (o, _) in zip(box, origin)))


def _eval(e: Expr, env: dict[int, Any], memo: dict[Expr, Any]) -> Any:
  out = memo.get(e)
  if out is not None:
    return out
  kind = e[0]
  if kind == "in":
    out = env[e[1]]
  elif kind == "flat":
    _, slot, offset, shape = e
    out = lax.slice(env[slot], (offset,), (offset + math.prod(shape),)).reshape(shape)
  elif kind == "slice":
    out = lax.slice(_eval(e[1], env, memo), e[2], e[3])
  elif kind == "cast":
    out = _eval(e[1], env, memo).astype(e[2])
  elif kind == "compose":
    _, shape, dtype, parts = e
    out = jax.numpy.zeros(shape, dtype)
    for starts, p in parts:
      out = lax.dynamic_update_slice(out, _eval(p, env, memo), starts)
  elif kind == "pack":
    out = jax.numpy.concatenate([_eval(p, env, memo).reshape(-1) for p in e[1]])
  else:
    raise AssertionError(kind)
  memo[e] = out
  return out


@dataclasses.dataclass(frozen=True)
class Program:
  """One jitted program on one device: `fn(*arrays of inputs)` returns the arrays of
  `outputs` (slots, or for an assembly positions in the call's flat outputs)."""

  fn: Callable
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  device: Any
  foreign: tuple[int, ...]  # positions of inputs on another device (moved first)

  def __call__(self, arrays: Sequence[Any]) -> list[Any]:
    args = [arrays[s] for s in self.inputs]
    for i in self.foreign:
      args[i] = jax.device_put(args[i], self.device)
    return self.fn(*args)


def _program(device: Any, exprs: Sequence[Expr], outputs: Sequence[int],
             where: Sequence[int]) -> Program:
  """The jitted program of `exprs` on `device` (`where`: per slot, its device id;
  an input on another device, a direct piece a program reads, moves first)."""
  inputs: list[int] = []
  seen: set[Expr] = set()

  def walk(e):
    if e in seen:
      return
    seen.add(e)
    if e[0] in ("in", "flat"):
      inputs.append(e[1])
    elif e[0] in ("slice", "cast"):
      walk(e[1])
    elif e[0] == "compose":
      for _, p in e[3]:
        walk(p)
    elif e[0] == "pack":
      for p in e[1]:
        walk(p)
  for e in exprs:
    walk(e)
  inputs = sorted(set(inputs))
  exprs = tuple(exprs)

  def fn(*args):
    env = dict(zip(inputs, args))
    memo: dict[Expr, Any] = {}
    return [_eval(e, env, memo) for e in exprs]
  foreign = tuple(i for i, s in enumerate(inputs) if where[s] != device.id)
  return Program(jax.jit(fn, out_shardings=_sharding(device)), tuple(inputs),
                 tuple(outputs), device, foreign)


@dataclasses.dataclass(frozen=True)
class WaveSteps:
  """What one wave runs on this process, in order: `copies` (the reads, one local
  copy per device, as Schedule.copies; they read raw pointers, so only once
  `copy_inputs` are ready), `programs` (the reads a local copy does not express, one
  per device), `moves` (one batched device_put between this process's devices: from
  slots, to devices, into slots), `sends` ((peer, slots) offered to each receiving
  process) and `recvs` ((peer, specs, slots) pulled from each sending process)."""

  depth: int
  copies: tuple[tuple[Any, np.ndarray, np.ndarray, tuple[int, ...]], ...]
  copy_inputs: tuple[int, ...]
  programs: tuple[Program, ...]
  moves: tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]
  sends: tuple[tuple[int, tuple[int, ...]], ...]
  recvs: tuple[tuple[int, tuple[jax.ShapeDtypeStruct, ...], tuple[int, ...]], ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """This process's programs of one plan.

  Attributes:
    slots: how many arrays a call holds (source shards, program outputs, pulls).
    sources: (slot, leaf, index into the leaf's single-device arrays) per source shard.
    waves: per wave, its steps.
    copy_inputs: the slots the local copies read (ready before they run).
    copies: per destination device, the local copy (local_copy.Copier) of its
      destination shards: (copier, per pointer its slot and byte offset, positions in
      the flat outputs); it reads raw pointers, so only once its inputs are ready.
    assemble: per destination device, the program of the destination shards a local
      copy does not express (zero-size, or converting other than between floats).
    passthrough: (position, slot) of outputs that are an array delivered whole.
    out_offsets: per leaf, its first position in the flat outputs (leaf t's shards are
      positions out_offsets[t]:out_offsets[t + 1], in addressable device order).
  """

  slots: int
  sources: tuple[tuple[int, int, int], ...]
  waves: tuple[WaveSteps, ...]
  copies: tuple[tuple[Any, np.ndarray, np.ndarray, tuple[int, ...]], ...]
  copy_inputs: tuple[int, ...]
  assemble: tuple[Program, ...]
  passthrough: tuple[tuple[int, int], ...]
  out_offsets: tuple[int, ...]


class _Builder:
  """The static state of one call while its schedule is built: which slot holds each
  source shard and which expressions the pieces delivered to each buffer are."""

  def __init__(self, src_dtypes: Sequence[Any], wire: Sequence[Any],
               out_dtypes: Sequence[Any]):
    self.src_dtypes = [np.dtype(d) for d in src_dtypes]
    self.wire = [np.dtype(d) for d in wire]
    def floats(a, c):
      return a == c or bool(TYPE_CODES.get(a) and TYPE_CODES.get(c))
    # Per leaf: whether one local copy converts its source to its result as the
    # source -> wire -> result conversions do (at most one of them converts).
    self.copyable = [floats(a, w) and floats(w, np.dtype(o)) and (a == w or w == o)
                     for a, w, o in zip(self.src_dtypes, self.wire, out_dtypes)]
    self.where: list[int] = []  # per slot, the id of the device its array is on
    self.n = 0
    self.shapes: list[tuple[int, ...]] = []  # per slot, its array's shape and dtype
    self.dtypes: list[np.dtype] = []
    self.shards: dict[tuple[int, int], tuple[Box, int]] = {}
    self.source_slots: set[int] = set()
    self.pieces: dict[tuple[int, int, int], list[tuple[Box, Expr]]] = {}

  def slot(self, shape: Sequence[int], dtype: Any, device: int) -> int:
    self.n += 1
    self.shapes.append(tuple(shape))
    self.dtypes.append(np.dtype(dtype))
    self.where.append(device)
    return self.n - 1

  def direct(self, op: Any) -> bool:
    """Whether op's piece is read by raw pointer where it lies: a small or local
    piece of a source shard into a destination shard whose conversions one local copy
    makes (a local piece is not moved at all; a sent one shares one flat buffer
    per (wave, receiving process, dtype)). Every process derives it alike."""
    return (op.src_kind == SRC_SHARD and op.dst_kind == _DST
            and self.copyable[op.tensor])

  def source(self, e: Expr):
    """(slot, element offset, shape, starts, extent) where `e` is a box of one
    slot's array (a slice of a slice of a flat view or of an array), else None."""
    extent = None
    starts: Any = None
    while e[0] == "slice":
      if extent is None:
        extent = tuple(hi - lo for lo, hi in zip(e[2], e[3]))
      starts = e[2] if starts is None else tuple(a + c for a, c in zip(starts, e[2]))
      e = e[1]
    if e[0] == "in":
      slot, offset, shape = e[1], 0, self.shapes[e[1]]
    elif e[0] == "flat":
      slot, offset, shape = e[1], e[2], e[3]
    else:
      return None
    return (slot, offset, shape, starts or (0,) * len(shape),
            extent if extent is not None else shape)

  def copy_boxes(self, e: Expr, shape: tuple[int, ...], dtype: np.dtype):
    """`e` (an output of `shape`, `dtype`) as (slot, offset, local_copy.Box with
    out 0 and slot 0) per part, else None: what local_copy cannot express."""
    if not math.prod(shape):
      return None
    converted = e[0] == "cast"
    if converted:  # the assembly's conversion, wire -> out: floats only
      e = e[1]
    parts = list(e[3] if e[0] == "compose" else (((0,) * len(shape), e),))
    out = []
    while parts:
      dst_start, p = parts.pop()
      if p[0] == "compose":  # a piece assembled where it is read
        parts += [(tuple(a + c for a, c in zip(dst_start, at)), q) for at, q in p[3]]
        continue
      if p[0] == "cast" and not converted and p[2] == dtype:
        p = p[1]  # a source shard read in the result's dtype: one conversion
      src = self.source(p)
      if src is None:
        return None
      slot, offset, src_shape, starts, extent = src
      src_dtype = self.dtypes[slot]
      if src_dtype != dtype and not (TYPE_CODES.get(src_dtype) and TYPE_CODES.get(dtype)):
        return None
      out.append((slot, offset * src_dtype.itemsize, local_copy.Box(
          0, 0, tuple(src_shape), src_dtype, tuple(starts), tuple(dst_start),
          tuple(extent))))
    return out

  def read(self, t: int, device: int, kind: int, box: Box, dtype: Any) -> Expr:
    """Box `box` of buffer (t, device, kind) in `dtype` (a source shard is cast to
    the wire dtype first, as the bytes that cross links are)."""
    wire = self.wire[t]
    if kind == SRC_SHARD:
      held, slot = self.shards[(t, device)]
      e: Expr = ("in", slot)
      if held != box:
        e = ("slice", e, *_rel(box, held))
      if self.src_dtypes[t] != wire:
        e = ("cast", e, wire)
      return e if wire == dtype else ("cast", e, np.dtype(dtype))
    e = self._compose(t, device, kind, box)
    return e if wire == dtype else ("cast", e, np.dtype(dtype))

  def _compose(self, t: int, device: int, kind: int, box: Box) -> Expr:
    pieces = self.pieces.get((t, device, kind), [])
    if box_size(box) == 0:
      return ("compose", _shape(box), self.wire[t], ())
    for pbox, e in pieces:  # the common case: one piece holds the whole box
      if pbox == box:
        return e
      if intersect(pbox, box) == box:
        return ("slice", e, *_rel(box, pbox))
    parts, covered = [], 0
    for pbox, e in pieces:
      part = intersect(pbox, box)
      if part is None:
        continue
      if part != pbox:
        e = ("slice", e, *_rel(part, pbox))
      parts.append((_rel(part, box)[0], e))
      covered += box_size(part)
    if covered != box_size(box):
      raise ReshardRuntimeError(
          f"{_API}: internal error: device {device} holds {covered} of the "
          f"{box_size(box)} elements of box {box} of leaf {t} it must read.")
    return ("compose", _shape(box), self.wire[t], tuple(parts))

  def deliver(self, op: Any, e: Expr) -> None:
    self.pieces.setdefault((op.tensor, op.dst, op.dst_kind), []).append((op.box, e))


def _item_shape(item) -> tuple[int, ...]:
  """The shape of an item's array: its piece's box, or flat."""
  pieces = item[3]
  if item[4]:
    return _shape(pieces[0][0].box)
  return (sum(box_size(op.box) for op, _ in pieces),)


def _own(op: Any, wire: np.dtype) -> bool:
  """Whether op's piece moves as an array of its own (else in a flat buffer)."""
  return box_size(op.box) * wire.itemsize > PACK_MAX_BYTES


class _Items:
  """The arrays one (wave, peer) or one wave's in-process moves carry, in op order:
  a piece of its own is one item; the small direct pieces (_Builder.direct) of one
  dtype one flat item, on the sending device and landing on the receiving device of
  its first piece (what reads it reads raw pointers, on any device of the process);
  the other small pieces of one (sending device, receiving device, dtype) one flat
  item (made at its first piece). Both sides of a transfer derive the same items
  from the same ops."""

  def __init__(self, b: _Builder):
    self.b = b
    self.items: list[list] = []   # [src, dst, dtype, [(op, payload)], own]
    self._flat: dict[tuple, list] = {}

  def add(self, op: Any, wire: np.dtype, payload: Any) -> None:
    if _own(op, wire):
      self.items.append([op.src, op.dst, wire, [(op, payload)], True])
      return
    key = (-1, -1, wire) if self.b.direct(op) else (op.src, op.dst, wire)
    item = self._flat.get(key)
    if item is None:
      item = self._flat[key] = [op.src, op.dst, wire, [], False]
      self.items.append(item)
    item[3].append((op, payload))


def build(waves: Sequence[Any], leaves: int, src_dtypes: Sequence[Any],
          out_dtypes: Sequence[Any], wire: Sequence[Any], src_layouts: Sequence[Any],
          dst_layouts: Sequence[Any], src_index: Sequence[dict[int, int]],
          local_dst: Sequence[Sequence[Any]], devices: dict[int, Any]) -> Schedule:
  """The schedule of this process's `waves` of a plan of `leaves` leaves.

  Args:
    waves: this process's waves (transfer_engine.waves_of).
    src_dtypes, out_dtypes, wire: per leaf, the operand, result and wire dtypes.
    src_layouts, dst_layouts: per leaf, the layouts (`box_of(device id)`).
    src_index: per leaf, {device id: index in its single-device arrays} of this
      process's source devices.
    local_dst: per leaf, this process's destination devices in addressable order.
    devices: every participating device by id.
  """
  with collector.paused():
    return _build(waves, leaves, out_dtypes, src_dtypes, wire, src_layouts,
                  dst_layouts, src_index, local_dst, devices)


def _build(waves, leaves, out_dtypes, src_dtypes, wire, src_layouts, dst_layouts,
           src_index, local_dst, devices) -> Schedule:
  b = _Builder(src_dtypes, wire, out_dtypes)
  sources = []
  for t in range(leaves):
    for dev, i in src_index[t].items():
      box = src_layouts[t].box_of(dev)
      s = b.slot(_shape(box), src_dtypes[t], dev)
      b.shards[(t, dev)] = (box, s)
      b.source_slots.add(s)
      sources.append((s, t, i))
  steps = [_wave(b, w, devices) for w in waves]
  # The assembly: per destination device, its shards of every leaf.
  out_offsets = [0]
  by_device: dict[int, tuple[list, list]] = {}
  copy_of: dict[int, tuple[list, list, dict, list]] = {}  # boxes, outs, entries, pos
  passthrough = []
  for t in range(leaves):
    out_dtype = np.dtype(out_dtypes[t])
    for k, d in enumerate(local_dst[t]):
      pos = out_offsets[-1] + k
      box = dst_layouts[t].box_of(d.id)
      e = b.read(t, d.id, _DST, box, out_dtype)
      if e[0] == "in" and e[1] not in b.source_slots:
        passthrough.append((pos, e[1]))  # delivered whole: the output itself
        continue
      parts = b.copy_boxes(e, _shape(box), out_dtype)
      if parts is None:
        exprs, outs = by_device.setdefault(d.id, ([], []))
        exprs.append(e)
        outs.append(pos)
        continue
      _add_copy(copy_of, d.id, parts, _shape(box), out_dtype, pos)
    out_offsets.append(out_offsets[-1] + len(local_dst[t]))
  assemble = tuple(_program(devices[d], exprs, outs, b.where)
                   for d, (exprs, outs) in sorted(by_device.items()))
  copies, copy_inputs = _copiers(copy_of, devices)
  return Schedule(b.n, tuple(sources), tuple(steps), copies, copy_inputs, assemble,
                  tuple(passthrough), tuple(out_offsets))


def _wave(b: _Builder, wave: Any, devices: dict[int, Any]) -> WaveSteps:
  """One wave's steps; its deliveries are registered after its reads (a wave reads
  only what earlier waves delivered)."""
  reads: dict[int, tuple[list, list]] = {}  # per sending device: exprs, slots
  copies: dict[int, tuple[list, list, dict, list]] = {}  # boxes, outs, entries, slots
  delivered: list[tuple[Any, Expr]] = []

  def materialize(item) -> int:
    """The slot holding `item`'s array on its sending device: the array itself, else
    an output of the device's local copy (or, what it does not express, program)."""
    src, _, w, pieces, own = item
    e = pieces[0][1] if own else ("pack", tuple(p for _, p in pieces))
    if e[0] == "in":
      return e[1]  # a whole source shard (or delivered array) as it is
    shape = _item_shape(item)
    s = b.slot(shape, w, src)
    parts = (b.copy_boxes(e, shape, w) if own else _pack_boxes(b, pieces, w))
    if parts is None:
      exprs, slots = reads.setdefault(src, ([], []))
      exprs.append(e)
      slots.append(s)
      return s
    _add_copy(copies, src, parts, shape, w, s)
    return s

  def unpack(item, slot) -> None:
    """The pieces of `item` (landed in `slot`) delivered as views of it."""
    _, _, _, pieces, own = item
    if own:
      delivered.append((pieces[0][0], ("in", slot)))
      return
    offset = 0
    for op, _ in pieces:
      delivered.append((op, ("flat", slot, offset, _shape(op.box))))
      offset += box_size(op.box)

  moves = _Items(b)
  for op in wave.local:
    if box_size(op.box) == 0:
      continue
    w = b.wire[op.tensor]
    e = b.read(op.tensor, op.src, op.src_kind, op.box, w)
    if op.src == op.dst or b.direct(op):
      delivered.append((op, e))  # read where it is, by whichever copy reads it
    else:
      moves.add(op, w, e)
  move_from, move_to, move_into = [], [], []
  for item in moves.items:
    move_from.append(materialize(item))
    move_to.append(devices[item[1]])
    s = b.slot(_item_shape(item), item[2], item[1])
    move_into.append(s)
    unpack(item, s)
  sends = []
  for peer, ops in sorted(wave.sends.items()):
    items = _Items(b)
    for op in ops:
      if box_size(op.box):
        w = b.wire[op.tensor]
        items.add(op, w, b.read(op.tensor, op.src, op.src_kind, op.box, w))
    if items.items:  # the receiver, from the same ops, pulls nothing either
      sends.append((peer, tuple(materialize(item) for item in items.items)))
  recvs = []
  for peer, ops in sorted(wave.recvs.items()):
    items = _Items(b)
    for op in ops:
      if box_size(op.box):
        items.add(op, b.wire[op.tensor], None)
    specs, slots = [], []
    for item in items.items:
      shape, w = _item_shape(item), item[2]
      specs.append(jax.ShapeDtypeStruct(shape, w, sharding=_sharding(devices[item[1]])))
      s = b.slot(shape, w, item[1])
      slots.append(s)
      unpack(item, s)
    if slots:
      recvs.append((peer, tuple(specs), tuple(slots)))
  programs = tuple(_program(devices[d], exprs, slots, b.where)
                   for d, (exprs, slots) in sorted(reads.items()))
  copied, inputs = _copiers(copies, devices)
  for op, e in delivered:
    b.deliver(op, e)
  return WaveSteps(wave.depth, copied, inputs, programs,
                   (tuple(move_from), tuple(move_to), tuple(move_into)), tuple(sends),
                   tuple(recvs))


def _add_copy(copies: dict, device: int, parts, shape: tuple[int, ...], dtype: np.dtype,
              where: int) -> None:
  """One more output (`shape`, `dtype`, going to `where`: a slot or an assembly's
  position) of `device`'s local copy in `copies` ({device: (boxes, outs, entries,
  where each output goes)}), read from `parts` ((slot, byte offset, Box) as
  _Builder.copy_boxes gives them); each distinct (slot, offset) is one pointer."""
  boxes, outs, entries, at = copies.setdefault(device, ([], [], {}, []))
  for slot, offset, cb in parts:
    entry = entries.setdefault((slot, offset), len(entries))
    boxes.append(cb._replace(out=len(outs), slot=entry))
  outs.append(local_copy.Out(shape, dtype))
  at.append(where)


def _copiers(copies: dict, devices: dict[int, Any]) -> tuple[tuple, tuple[int, ...]]:
  """Per device, its local copy: (copier, per pointer its slot and byte offset,
  where its outputs go: slots, or an assembly's positions); and every slot they
  read."""
  out, inputs = [], set()
  for d, (boxes, outs, entries, slots) in sorted(copies.items()):
    copier = local_copy.copier(devices[d], boxes, outs, len(entries))
    keys = list(entries)
    inputs.update(slot for slot, _ in keys)
    out.append((copier, np.array([s for s, _ in keys], np.int64),
                np.array([o for _, o in keys], np.int64), tuple(slots)))
  return tuple(out), tuple(sorted(inputs))


# A flat item whose pieces take more contiguous runs than this is a program's.
_MAX_RUNS = 4096


def _pack_boxes(b: _Builder, pieces, w: np.dtype):
  """The 1-D local-copy boxes of a flat item (its pieces raveled one after another):
  each piece's box cut into runs contiguous in its source and in the item; None
  where a piece is not a box of one slot's array or the runs are too many."""
  out, at, runs = [], 0, 0
  for op, p in pieces:
    shape = _shape(op.box)
    parts = b.copy_boxes(p, shape, w)
    if parts is None:
      return None
    for slot, offset, cb in parts:
      src_shape, st, ex, ds = cb.src_shape, cb.src_start, cb.extent, cb.dst_start
      rank = len(shape)
      k = rank  # dims k.. are whole in the source and in the piece: one run
      while k > 0 and ex[k - 1] == src_shape[k - 1] == shape[k - 1]:
        k -= 1
      k = max(k - 1, 0)
      run = math.prod(ex[k:])
      s_stride = [math.prod(src_shape[i + 1:]) for i in range(rank)]
      d_stride = [math.prod(shape[i + 1:]) for i in range(rank)]
      grids = np.meshgrid(*[np.arange(n) for n in ex[:k]], indexing="ij")
      def at_k(start, i, k=k, grids=grids):  # index i along the piece's runs
        return start[i] + (grids[i] if i < k else 0)
      src_at = sum(at_k(st, i) * s_stride[i] for i in range(rank))
      dst_at = sum(at_k(ds, i) * d_stride[i] for i in range(rank))
      src_at = np.broadcast_to(np.asarray(src_at, np.int64), grids[0].shape if k else ())
      dst_at = np.broadcast_to(np.asarray(dst_at, np.int64), src_at.shape)
      runs += src_at.size
      if runs > _MAX_RUNS:
        return None
      flat = (math.prod(src_shape),)
      for a, c in zip(src_at.reshape(-1).tolist(), dst_at.reshape(-1).tolist()):
        out.append((slot, offset, local_copy.Box(0, 0, flat, cb.src_dtype, (a,),
                                                 (at + c,), (run,))))
    at += math.prod(shape)
  return out
