"""Schedule encoding: a plan's chunks as the flat int64 `schedule` attribute.

Owns the byte-level format of docs/schedule_format.md (version `SCHEDULE_VERSION`),
mirrored by xla_ffi/schedule.h: slots of operand/result/workspace buffers, local
coordinates, steps, workspace layout (full-tensor buffers and pack staging). Knows
plans; knows nothing about shardings, JAX or transports. The per-tensor part of the ops
is cached on the (shared) TensorPlan; per plan only array arithmetic runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import ml_dtypes
import numpy as np

from jax_m2n._src.layout import MAX_RANK
from jax_m2n._src.planner import chunks as chunks_lib
from jax_m2n._src.planner import DST_SHARD, FULL_TMP, SRC_SHARD, STAGES, Plan

SCHEDULE_VERSION = 3
# The same array narrow: every element after the header an int32, two to an int64 word
# (little-endian, element 2k in the low half of word k), an odd count padded with PAD
# (never a value: narrow values lie in (-2^31, 2^31)). Written by `encode` until the
# packed form below; still decoded (docs/schedule_format.md).
NARROW_VERSION = 4
PAD = -(1 << 31)
# The same elements packed: after the header, one word with their count, then each as a
# zigzag LEB128 varint, the bytes in little-endian words, the last one zero-padded.
# What `encode` writes: a DeepSeek-V3-shaped refit's per-device encoding is 3.5x smaller
# than narrow, and XLA keeps about 5 bytes a byte of it in each compiled program
# (docs/schedule_format.md, "Packed schedules").
PACKED_VERSION = 5
MAGIC = 0x4D324E5F  # "M2N_"
HEADER_WIDTH = 8
TENSOR_WIDTH = 4 + MAX_RANK  # elem_bytes, rank, dims, src_type, dst_type
OP_FIXED = 11
# The decoded op table's width (`decode`); an encoded record holds OP_FIXED + 3 * rank
# of its tensor's elements (version 3: rank-sized records).
OP_WIDTH = OP_FIXED + 3 * MAX_RANK
ALIGN = 256

STAGE_CODES = {name: i for i, name in enumerate(STAGES)}

# Element type codes of a fused conversion (xla_ffi/convert.h ElemType); 0: none.
TYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.float16): 2,
              np.dtype(ml_dtypes.bfloat16): 3, np.dtype(ml_dtypes.float8_e4m3fn): 4,
              np.dtype(ml_dtypes.float8_e5m2): 5}
NO_CONVERSION = (0, 0)


def fused_conversion(src_dtype, dst_dtype) -> bool:
  """Whether the transports convert `src_dtype` -> `dst_dtype` in flight: two
  different types among f32, f16, bf16, f8_e4m3fn, f8_e5m2."""
  s, d = np.dtype(src_dtype), np.dtype(dst_dtype)
  return s != d and s in TYPE_CODES and d in TYPE_CODES


def type_codes(src_dtype, dst_dtype) -> tuple[int, int]:
  """(src_type, dst_type) of a tensor record: the codes of a fused conversion, else
  (0, 0)."""
  if not fused_conversion(src_dtype, dst_dtype):
    return NO_CONVERSION
  return TYPE_CODES[np.dtype(src_dtype)], TYPE_CODES[np.dtype(dst_dtype)]


def source_dtype(src_dtype, dst_dtype) -> np.dtype:
  """The dtype a leaf's bytes are in when they leave the source: its own where nothing
  converts or the transports convert in flight (`fused_conversion`), else `dst_dtype`
  (converted with astype on the source first). reshard's rule, and a pull's (the
  publisher converts); then `wire_dtype(source_dtype(s, d), d)` is what crosses."""
  s, d = np.dtype(src_dtype), np.dtype(dst_dtype)
  return s if s == d or fused_conversion(s, d) else d


def wire_dtype(src_dtype, dst_dtype) -> np.dtype:
  """The type the bytes cross links in: the narrower of the two for a fused
  conversion (narrow on the sender, widen on the receiver), else the source type."""
  s, d = np.dtype(src_dtype), np.dtype(dst_dtype)
  if fused_conversion(s, d) and d.itemsize <= s.itemsize:
    return d
  return s


def _align(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Buffers:
  """Which buffers each device has: operand/result slots and workspace offsets."""

  operands: dict[int, dict[int, int]]   # device -> tensor -> operand index
  results: dict[int, dict[int, int]]    # device -> tensor -> result index
  tmp: dict[int, dict[int, int]]        # device -> tensor -> workspace byte offset
  tmp_bytes: dict[int, int]             # device -> bytes of its full-tensor buffers


def wire_itemsizes(dtypes, out_dtypes=None) -> tuple[list[int], tuple | None]:
  """What planning and encoding need of each leaf's conversion: the itemsizes to plan
  with (wire bytes) and the `types` argument of `encode` (None when nothing converts).
  `out_dtypes`: per leaf the destination dtype, None (or the same dtype) to keep."""
  out_dtypes = out_dtypes or [None] * len(dtypes)
  itemsizes, types = [], []
  for dt, out in zip(dtypes, out_dtypes):
    out = dt if out is None else out
    itemsizes.append(wire_dtype(dt, out).itemsize)
    types.append(type_codes(dt, out))
  return itemsizes, (tuple(types) if any(t != NO_CONVERSION for t in types) else None)


def _tmp_devices(tp) -> frozenset:
  """Devices that hold a full-tensor workspace buffer of `tp` (cached on `tp`)."""
  def build(tp):
    xs = tp.transfers
    return frozenset(np.concatenate([xs.src[xs.src_kind == FULL_TMP],
                                     xs.dst[xs.dst_kind == FULL_TMP]]).tolist())
  return chunks_lib.derived(tp, "tmp_devices", build)


@functools.lru_cache(maxsize=256)
def buffers(plan: Plan) -> Buffers:
  """Operand/result slots: a device has an operand for every tensor whose source layout
  lists it and a result for every tensor whose destination layout lists it, in tensor
  order; full-tensor workspace buffers come first in the workspace, in tensor order."""
  operands: dict[int, dict[int, int]] = {}
  results: dict[int, dict[int, int]] = {}
  for t, tp in enumerate(plan.tensors):
    for d in tp.src.devices:
      slots = operands.setdefault(d, {})
      slots[t] = len(slots)
    for d in tp.dst.devices:
      slots = results.setdefault(d, {})
      slots[t] = len(slots)
  return Buffers(operands, results, *_tmp_buffers(plan))


def _tmp_buffers(plan: Plan) -> tuple[dict[int, dict[int, int]], dict[int, int]]:
  """`Buffers.tmp` and `Buffers.tmp_bytes`: per device its full-tensor workspace
  buffers, in tensor order."""
  tmp: dict[int, dict[int, int]] = {}
  tmp_bytes: dict[int, int] = {}
  for t, tp in enumerate(plan.tensors):
    for dev in sorted(_tmp_devices(tp)):
      offset = tmp_bytes.get(dev, 0)
      tmp.setdefault(dev, {})[t] = offset
      tmp_bytes[dev] = offset + _align(tp.nbytes)
  return tmp, tmp_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class _TensorOps:
  """The plan-independent part of one TensorPlan's ops, one row per chunk in
  TensorChunks order: step local, tensor 0, devices, slots and packs unset (-1); the
  devices are `src` and `dst`. All but those are shared by the TensorPlans of one
  `_ops_structure`."""

  rows: np.ndarray        # (n, OP_FIXED + 3 * rank): the tensor's record width
  src: np.ndarray         # (n,) source device of each op
  dst: np.ndarray         # (n,) destination device
  src_pack: np.ndarray    # (n,) bool: cross-device and not contiguous on the source
  dst_pack: np.ndarray    # (n,) bool: same on the destination
  nbytes: np.ndarray      # (n,) aligned bytes of the chunk


def _tensor_ops(tp, chunk_bytes: int) -> _TensorOps:
  """The ops of `tp` (cached on `tp`): its structure's, on its own devices."""
  def build(tp):
    shared = _structure_ops(_ops_structure(tp), chunk_bytes)
    tc = chunks_lib.tensor_chunks(tp, chunk_bytes)
    src = tp.transfers.src.astype(np.int64)[tc.transfer]
    dst = tp.transfers.dst.astype(np.int64)[tc.transfer]
    for a in (src, dst):
      a.flags.writeable = False
    return dataclasses.replace(shared, src=src, dst=dst)
  return chunks_lib.derived(tp, ("ops", chunk_bytes), build)


def _ops_structure(tp) -> chunks_lib.Structure:
  """What `tp`'s ops but their devices depend on: its chunks' structure, its shape,
  stages and buffer kinds, and per renamed device its source and destination box.
  TensorPlans of one such structure have the same ops on renamed devices."""
  def build(tp):
    xs = tp.transfers
    # Each device's first box in a layout (Layout.box_of), by a dict built backwards.
    src, dst = (dict(zip(reversed(layout.devices), reversed(layout.boxes)))
                for layout in (tp.src, tp.dst))
    boxes = tuple((src.get(d), dst.get(d))
                  for d in chunks_lib.renamed_devices(tp).tolist())
    return chunks_lib.Structure(
        (chunks_lib.structure(tp).key, tuple(tp.src.shape), xs.stage.tobytes(),
         xs.src_kind.tobytes(), xs.dst_kind.tobytes(), boxes), tp)
  return chunks_lib.derived(tp, "ops_structure", build)


@functools.lru_cache(maxsize=4096)
def _structure_ops(shape: chunks_lib.Structure, chunk_bytes: int) -> _TensorOps:
  """The ops of every TensorPlan of structure `shape` (built from its first)."""
  return _build_tensor_ops(shape.tp, chunk_bytes)


def _contiguous_rows(extent: np.ndarray, dims: np.ndarray) -> np.ndarray:
  """Per row, whether a box of `extent` inside a row-major buffer of `dims` is one byte
  range: past the first extent that is not 1, extents equal dims."""
  rank = extent.shape[1]
  if rank == 0:
    return np.ones(len(extent), bool)
  not_one = extent != 1
  first = np.where(not_one.any(axis=1), not_one.argmax(axis=1), rank)
  later = np.arange(rank)[None, :] > first[:, None]
  return ~((extent != dims) & later).any(axis=1)


def _geometry_columns(tp, dev: np.ndarray, kind: np.ndarray):
  """(origin, dims) rows (n, rank) of the buffers (`dev`, `kind`) of `tp`: a
  full-tensor buffer spans the tensor, a shard its box in the source or destination
  layout (the first entry of the device there)."""
  rank = len(tp.src.shape)
  origin = np.zeros((len(dev), rank), np.int64)
  dims = np.ones((len(dev), rank), np.int64)
  dims[kind == FULL_TMP] = tp.src.shape
  for code, layout in ((SRC_SHARD, tp.src), (DST_SHARD, tp.dst)):
    sel = np.flatnonzero(kind == code)
    devices = np.array(layout.devices, np.int64)
    boxes = np.array(layout.boxes, np.int64).reshape(len(devices), rank, 2)
    by_id = np.argsort(devices, kind="stable")
    at = by_id[np.searchsorted(devices[by_id], dev[sel])]
    origin[sel] = boxes[at, :, 0]
    dims[sel] = boxes[at, :, 1] - boxes[at, :, 0]
  return origin, dims


def _build_tensor_ops(tp, chunk_bytes: int) -> _TensorOps:
  tc = chunks_lib.tensor_chunks(tp, chunk_bytes)
  xs = tp.transfers
  src = xs.src.astype(np.int64)[tc.transfer]
  dst = xs.dst.astype(np.int64)[tc.transfer]
  src_kind = xs.src_kind.astype(np.int64)[tc.transfer]
  dst_kind = xs.dst_kind.astype(np.int64)[tc.transfer]
  s_origin, s_dims = _geometry_columns(tp, src, src_kind)
  d_origin, d_dims = _geometry_columns(tp, dst, dst_kind)
  n, rank = len(tc.step), tc.rank
  # The record's fields only: OP_FIXED, then per dim extent, source and destination
  # start (bytes a fresh page costs dominate this build).
  rows = np.full((n, OP_FIXED + 3 * rank), -1, np.int64)
  rows[:, 0] = tc.step
  rows[:, 1] = xs.stage[tc.transfer]  # STAGES order: the format's stage codes
  rows[:, 2] = 0
  rows[:, 4], rows[:, 7] = src_kind, dst_kind
  lo = tc.lo[:, :rank]
  extent = tc.hi[:, :rank] - lo
  rows[:, OP_FIXED::3] = extent
  rows[:, OP_FIXED + 1::3] = lo - s_origin
  rows[:, OP_FIXED + 2::3] = lo - d_origin
  cross = src != dst
  src_pack = cross & ~_contiguous_rows(extent, s_dims)
  dst_pack = cross & ~_contiguous_rows(extent, d_dims)
  nbytes = -(-(np.prod(extent, axis=1) * tp.itemsize) // ALIGN) * ALIGN
  for a in (rows, src, dst, src_pack, dst_pack, nbytes):
    a.flags.writeable = False
  return _TensorOps(rows, src, dst, src_pack, dst_pack, nbytes)


def _slot_table(plan: Plan, tmp: dict[int, dict[int, int]],
                devices: np.ndarray) -> np.ndarray:
  """(kind, tensor, device position) -> slot; -1 where the buffer does not exist: the
  slots of `buffers` by array arithmetic (a device's operand slot of a tensor counts
  the earlier tensors whose source layout lists it; results alike), `tmp` its
  workspace offsets (`_tmp_buffers`)."""
  n = len(plan.tensors)
  table = np.full((3, n, len(devices)), -1, np.int64)
  for kind, side in ((SRC_SHARD, "src"), (DST_SHARD, "dst")):
    by_layout: dict[int, tuple] = {}  # id -> (layout, its tensors): tensors share a few
    for t, tp in enumerate(plan.tensors):
      layout = getattr(tp, side)
      by_layout.setdefault(id(layout), (layout, []))[1].append(t)
    # Per (device position, tensor) 1 where listed; counted along the tensors (the
    # contiguous axis: an int64 cumsum there is ~20x one across rows).
    listed = np.zeros((len(devices), n), np.int64)
    for layout, tensors in by_layout.values():
      at = np.searchsorted(devices, np.array(layout.devices, np.int64))
      listed[np.ix_(at, tensors)] = 1
    table[kind] = np.where(listed == 1, np.cumsum(listed, axis=1) - 1, -1).T
  position = {int(d): j for j, d in enumerate(devices)}
  for dev, slots in tmp.items():
    tensors = np.fromiter(slots.keys(), np.int64, len(slots))
    table[FULL_TMP, tensors, position[dev]] = np.fromiter(slots.values(), np.int64,
                                                          len(slots))
  return table


def _repack_for_types(types, tensor, src_kind, dst_kind, cross, src_pack, dst_pack):
  """Adds the staging a conversion needs (docs/schedule_format.md): a cross-device op
  packs on the sender when its source buffer's type is not the wire type (narrowing) and
  unpacks on the receiver when its destination buffer's type is not (widening)."""
  codes = np.array(types, np.int64).reshape(-1, 2)
  size = np.array([0, 4, 2, 2, 1, 1], np.int64)
  src_code, dst_code = codes[tensor, 0], codes[tensor, 1]
  wire = np.where(size[dst_code] <= size[src_code], dst_code, src_code)
  def type_of(kind):
    return np.where(kind == SRC_SHARD, src_code, np.where(kind == DST_SHARD, dst_code, wire))
  converting = src_code != 0
  return (src_pack | (cross & converting & (type_of(src_kind) != wire)),
          dst_pack | (cross & converting & (type_of(dst_kind) != wire)))


@dataclasses.dataclass(frozen=True, eq=False)
class _Table:
  """What every device's encoding of a plan shares, for one (staging, types), built
  by array arithmetic without the plan's op list (a process encoding its own devices
  never builds the others' ops, `_Ops`).

  `base` holds the rows of each distinct ops structure once (tensor-local steps,
  devices, slots and packs unset), `src` and `dst` the devices of each distinct
  TensorPlan's (`src_pos`, `dst_pos`: their positions in `devices`); chunk k of tensor
  t is row `part_start[t] + k` of `base` on devices `dev_start[t] + k`, its global step
  `steps.of(t, k)`, with its plan step, tensor, slots and packs filled in by
  `_Ops.rows`. `packed` are the order keys (`steps.key`) of the ops that pack on a
  side, ascending, and `packs` their offsets on each side: the pack areas of every
  device, which its workspace (`ws`, in every encoding's prefix) and its peers' rows
  need.
  """

  base: np.ndarray          # (rows of the distinct ops structures, widest record)
  part_start: np.ndarray    # (n_tensors,) first row of each tensor's part in `base`
  src: np.ndarray           # (rows of the distinct TensorPlans,) source devices
  dst: np.ndarray           # (rows of the distinct TensorPlans,) destination devices
  src_pos: np.ndarray       # (rows of the distinct TensorPlans,) positions in `devices`
  dst_pos: np.ndarray
  dev_start: np.ndarray     # (n_tensors,) first row of each tensor's in `src`, `dst`
  distinct: np.ndarray      # (distinct TensorPlans, 2): first row in `src`, in `base`
  which: np.ndarray         # (n_tensors,) each tensor's row in `distinct`
  steps: chunks_lib.Steps
  packed: np.ndarray | None  # order keys of the ops that pack on a side; None: no staging
  packs: np.ndarray | None   # (len(packed), 2) src_pack, dst_pack offsets (-1: none)
  devices: np.ndarray       # (n_devices,) global ids, ascending
  slots: np.ndarray         # `_slot_table`
  ws: dict                  # device -> workspace bytes
  prefix: np.ndarray        # header (n_ops 0), devices, ws, tensors
  prefix_varints: np.ndarray  # the prefix's elements after the header as varints
  width: np.ndarray         # (n_tensors,) record width of each tensor's ops

  def touching(self, local: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tensor, index, step) of the ops whose source or destination is one of the
    devices `local`, in op order: per distinct TensorPlan its chunks on them, once."""
    wanted = np.isin(self.devices, np.array(local, np.int64))
    ends = np.append(self.distinct[1:, 0], len(self.src))
    mine = [np.flatnonzero(wanted[self.src_pos[d0:d1]] | wanted[self.dst_pos[d0:d1]])
            for d0, d1 in zip(self.distinct[:, 0].tolist(), ends.tolist())]
    per_tensor = [mine[w] for w in self.which.tolist()]
    counts = np.fromiter(map(len, per_tensor), np.int64, len(per_tensor))
    tensor = np.repeat(np.arange(len(per_tensor), dtype=np.int64), counts)
    index = _cat_rows(per_tensor, (0,))
    step = _global_steps(self.steps, self.base, self.part_start, tensor, index)
    order = np.argsort(self.steps.key(tensor, index, step), kind="stable")
    narrow = np.int32 if self.steps.n_chunks < 1 << 31 else np.int64
    return tensor[order].astype(narrow), index[order], step[order].astype(narrow)


@dataclasses.dataclass(frozen=True, eq=False)
class _Ops:
  """Ops of a plan in op order (step, then the tensor-by-tensor chunk order): every
  op, or those of some devices (`_ops`), with what `encode` needs to write any of
  those devices' rows in O(its rows) after one scan of two small per-op columns.

  `src_pos` and `dst_pos` are the positions in `table.devices` of each op's source
  and destination (`device_ops` finds a device's ops by one scan of both: ~1 ms for the
  DeepSeek-V3 plan's 2.7M ops, where grouping every device's took ~90 ms).
  """

  table: _Table
  tensor: np.ndarray        # (n_ops,) per op
  index: np.ndarray         # (n_ops,) chunk index in the tensor's part
  step: np.ndarray          # (n_ops,)
  src_pos: np.ndarray       # (n_ops,) position of each op's source in `table.devices`
  dst_pos: np.ndarray       # (n_ops,) of its destination

  def device_ops(self, j: int) -> np.ndarray:
    """The ops that touch the device at position `j` (its source or destination
    side), in op order."""
    return np.flatnonzero((self.src_pos == j) | (self.dst_pos == j))

  def pack_rows(self, ops: np.ndarray) -> np.ndarray:
    """The (src_pack, dst_pack) offsets (len(ops), 2) of `ops` (-1: none; staging)."""
    table = self.table
    out = np.full((len(ops), 2), -1, np.int64)
    if len(table.packed) and len(ops):
      key = table.steps.key(self.tensor[ops], self.index[ops], self.step[ops])
      at = np.minimum(np.searchsorted(table.packed, key), len(table.packed) - 1)
      hit = table.packed[at] == key
      out[hit] = table.packs[at[hit]]
    return out

  def rows(self, ops: np.ndarray, width: int) -> np.ndarray:
    """The rows (n, width) of `ops` (indices in op order): their first `width` fields
    (at most the widest record's)."""
    t = self.table
    tensor, index = self.tensor[ops], self.index[ops]
    rows = t.base[t.part_start[tensor] + index, :width]
    on = t.dev_start[tensor] + index
    rows[:, 3], rows[:, 6] = t.src[on], t.dst[on]
    rows[:, 0] = self.step[ops]
    rows[:, 2] = tensor
    for kind_col, slot_col, position in ((4, 5, self.src_pos), (7, 8, self.dst_pos)):
      rows[:, slot_col] = t.slots[rows[:, kind_col], tensor, position[ops]]
    if t.packed is not None:
      rows[:, 9:11] = self.pack_rows(ops)
    return rows

  def encode(self, ops: np.ndarray) -> np.ndarray:
    """The encoding of `ops`: the header, then the prefix's elements and each op's
    rank-sized record as varints, written per block of ops (a block's rows as wide as
    its widest record, each row's first `width` fields kept in row-major order): no
    array of every element is made."""
    table = self.table
    head = table.prefix[:HEADER_WIDTH].copy()
    head[5] = len(ops)
    width = table.width[self.tensor[ops]]
    streams = [table.prefix_varints]
    for start in range(0, len(ops), _BLOCK_OPS):
      block = slice(start, start + _BLOCK_OPS)
      w_block = width[block]
      w = int(w_block.max())
      rows = self.rows(ops[block], w)
      if (w_block != w).any():
        rows = rows[np.arange(w)[None, :] < w_block[:, None]]
      streams.append(_varints(rows.reshape(-1)))
    out = _packed(head, len(table.prefix) - HEADER_WIDTH + int(width.sum()), streams)
    out.flags.writeable = False
    return out


def pack(wide: np.ndarray) -> np.ndarray:
  """`wide` (version 3) as PACKED_VERSION: the header, the count of the elements after
  it, then each of them as a zigzag LEB128 varint (1 byte below 64 in magnitude, 2
  below 8192, at most 10), the bytes in little-endian words, the last zero-padded."""
  body = np.asarray(wide[HEADER_WIDTH:], np.int64)
  return _packed(wide[:HEADER_WIDTH], len(body), [_varints(body)])


def _packed(header: np.ndarray, count: int, streams: list) -> np.ndarray:
  """A packed schedule: `header` (its version set to PACKED_VERSION), `count`, then the
  varint byte `streams` one after another."""
  size = sum(len(b) for b in streams)
  out = np.zeros(HEADER_WIDTH + 1 + -(-size // 8), np.int64)
  out[:HEADER_WIDTH] = header
  out[1] = PACKED_VERSION
  out[HEADER_WIDTH] = count
  stream = out[HEADER_WIDTH + 1:].view(np.uint8)  # little-endian words
  at = 0
  for b in streams:
    stream[at:at + len(b)] = b
    at += len(b)
  return out


def _varints(body: np.ndarray) -> np.ndarray:
  """The zigzag LEB128 varints of `body` (int64) as one uint8 array, by array
  arithmetic in the narrowest unsigned type that holds them: each element's byte
  count, its first byte's position, then byte k of the elements that have one."""
  zigzag = ((body << 1) ^ (body >> 63)).view(np.uint64)
  top = int(zigzag.max()) if len(body) else 0
  kind = np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.uint64
  z = zigzag.astype(kind)
  width = max(1, -(-top.bit_length() // 7))
  n_bytes = np.ones(len(z), np.uint8)
  for k in range(1, width):
    n_bytes += z >= kind(1 << (7 * k))
  ends = np.cumsum(n_bytes, dtype=np.int64)
  starts = ends - n_bytes
  stream = np.empty(int(ends[-1]) if len(body) else 0, np.uint8)
  stream[starts] = (z & kind(0x7F)) | (n_bytes > 1) * kind(0x80)
  for k in range(1, width):
    has = np.flatnonzero(n_bytes > k)
    group = (z[has] >> kind(7 * k)) & kind(0x7F)
    stream[starts[has] + k] = group | (n_bytes[has] > k + 1) * kind(0x80)
  return stream


def widen(schedule: np.ndarray) -> np.ndarray:
  """A schedule as version 3: a narrow one widened (a PAD dropped), a packed one
  unpacked, a wide one as it is (xla_ffi/schedule.cc does the same before decoding;
  this one trusts its input: tests and debugging)."""
  a = np.asarray(schedule, np.int64)
  if len(a) < HEADER_WIDTH or a[0] != MAGIC or a[1] not in (NARROW_VERSION,
                                                             PACKED_VERSION):
    return a
  head = a[:HEADER_WIDTH].copy()
  head[1] = SCHEDULE_VERSION
  if a[1] == PACKED_VERSION:
    return np.concatenate([head, _unpack(a)])
  body = np.ascontiguousarray(a[HEADER_WIDTH:]).astype("<i8").view("<i4").astype(np.int64)
  if len(body) and body[-1] == PAD:
    body = body[:-1]
  return np.concatenate([head, body])


def _unpack(a: np.ndarray) -> np.ndarray:
  """The elements of a packed schedule `a` after its header (`pack`'s inverse)."""
  count = int(a[HEADER_WIDTH])
  stream = np.ascontiguousarray(a[HEADER_WIDTH + 1:]).view(np.uint8)
  last = np.flatnonzero(stream < 0x80)[:count]  # each element's last byte
  starts = np.concatenate([[0], last[:-1] + 1]) if count else last
  z = np.zeros(count, np.uint64)
  for k in range(int((last - starts).max()) + 1 if count else 0):
    more = starts + k <= last
    group = stream[starts[more] + k].astype(np.uint64) & np.uint64(0x7F)
    z[more] |= group << np.uint64(7 * k)
  return (z >> np.uint64(1)).view(np.int64) ^ -(z & np.uint64(1)).view(np.int64)


# Ops written per block by `_Ops.encode`: its temporaries (~1.5 MiB) stay in memory the
# process reuses; fresh pages cost ~2 ms a MB on a 2-core VM.
_BLOCK_OPS = 1 << 13


def _positions(devices: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """The positions of device `ids` in `devices` (ascending): uint16 where they fit
  (a quarter of the bytes `device_ops` scans), else int64."""
  pos = np.searchsorted(devices, ids)
  return pos.astype(np.uint16) if len(devices) < (1 << 16) else pos


def _base_rows(parts: list) -> np.ndarray:
  """The ops structures' rows one after another, as wide as the widest (a narrower
  record's row padded with -1, never written: `_Ops.encode` keeps a tensor's width)."""
  width = max((p.shape[1] for p in parts), default=OP_FIXED)
  base = np.full((sum(len(p) for p in parts), width), -1, np.int64)
  at = 0
  for p in parts:
    base[at:at + len(p), :p.shape[1]] = p
    at += len(p)
  return base


def _cat_rows(parts: list, empty: tuple) -> np.ndarray:
  """`parts` (int64 arrays) concatenated; an array of shape `empty` when none."""
  return np.concatenate(parts) if parts else np.zeros(empty, np.int64)


@functools.lru_cache(maxsize=64)
def _table(plan: Plan, staging: bool, types: tuple | None = None) -> _Table:
  """What the encodings of `plan` share (`_Table`). `types`: per tensor (src_type,
  dst_type) codes, None when nothing converts; the plan's itemsizes are then the wire
  itemsizes."""
  tmp, tmp_bytes = _tmp_buffers(plan)
  steps = plan.steps
  devices = np.array(plan.devices, np.int64)
  ws = dict(tmp_bytes)
  # The distinct TensorPlans' devices and their ops structures' rows (the TensorPlans
  # of one share its rows array), once each.
  first: dict[int, int] = {}  # id(tp) -> its row in `distinct`
  row_first: dict[int, int] = {}  # id(rows) -> first row in base
  distinct, shapes, which = [], [], []
  n_devs = n_rows = 0
  for tp in plan.tensors:
    if id(tp) not in first:
      ops = _tensor_ops(tp, plan.chunk_bytes)
      if id(ops.rows) not in row_first:
        row_first[id(ops.rows)] = n_rows
        n_rows += len(ops.rows)
        shapes.append(ops)
      first[id(tp)] = len(distinct)
      distinct.append((n_devs, row_first[id(ops.rows)], ops))
      n_devs += len(ops.src)
    which.append(first[id(tp)])
  which = np.array(which, np.int64)
  parts = np.array([(d0, r0) for d0, r0, _ in distinct], np.int64).reshape(-1, 2)
  dev_start, part_start = parts[which, 0], parts[which, 1]
  base = _base_rows([p.rows for p in shapes])
  src = _cat_rows([p.src for *_, p in distinct], (0,))
  dst = _cat_rows([p.dst for *_, p in distinct], (0,))
  src_pos, dst_pos = _positions(devices, src), _positions(devices, dst)
  packed = packs = None
  if staging:
    tmp_end = np.array([tmp_bytes.get(int(d), 0) for d in devices], np.int64)
    packed, packs, peak = _pack_areas(
        plan, types, steps, base, part_start, dev_start, which, src, dst, src_pos,
        dst_pos, [(p.src_pack, p.dst_pack, p.nbytes) for p in shapes], tmp_end)
    for j in np.flatnonzero(peak):
      d = int(devices[j])
      ws[d] = ws.get(d, 0) + int(peak[j])
  prefix = _prefix(plan, ws, steps.n_steps, 0, types)
  width = np.array([OP_FIXED + 3 * len(tp.src.shape) for tp in plan.tensors], np.int64)
  for a in (base, part_start, src, dst, src_pos, dst_pos, dev_start, parts, which,
            prefix, width):
    a.flags.writeable = False
  varints = _varints(prefix[HEADER_WIDTH:])
  varints.flags.writeable = False
  return _Table(base, part_start, src, dst, src_pos, dst_pos, dev_start, parts, which,
                steps, packed, packs, devices, _slot_table(plan, tmp, devices), ws,
                prefix, varints, width)


def _pack_areas(plan, types, steps, base, part_start, dev_start, which, src, dst,
                src_pos, dst_pos, shapes, tmp_end):
  """The pack staging of every device: per (device, step) the ops that pack there, in
  op order, their aligned bytes one after another past the device's full-tensor
  buffers (`tmp_end`; an op packs on at most one side per device: packing ops cross
  devices). Found per distinct (TensorPlan, conversion) among its chunks, not over the
  plan's ops. Returns (order keys of the packing ops ascending, their (src, dst)
  offsets (-1: none), per device position its largest pack area)."""
  src_flags = _cat_rows([f for f, _, _ in shapes], (0,)).astype(bool)
  dst_flags = _cat_rows([f for _, f, _ in shapes], (0,)).astype(bool)
  nbytes = _cat_rows([n for _, _, n in shapes], (0,))
  found: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
  on_src, on_dst = [], []
  for t, tp in enumerate(plan.tensors):
    code = None if types is None else types[t]
    hit = found.get((int(which[t]), code))
    if hit is None:
      r0, d0 = int(part_start[t]), int(dev_start[t])
      n = len(steps.parts[t].step)
      sp, dp = src_flags[r0:r0 + n], dst_flags[r0:r0 + n]
      if types is not None:
        sp, dp = _repack_for_types(types, np.full(n, t), base[r0:r0 + n, 4],
                                   base[r0:r0 + n, 7], src[d0:d0 + n] != dst[d0:d0 + n],
                                   sp, dp)
      hit = found[(int(which[t]), code)] = (np.flatnonzero(sp), np.flatnonzero(dp))
    on_src.append(hit[0])
    on_dst.append(hit[1])
  n_src = np.fromiter(map(len, on_src), np.int64, len(on_src))
  n_dst = np.fromiter(map(len, on_dst), np.int64, len(on_dst))
  tensors = np.arange(len(plan.tensors), dtype=np.int64)
  tensor = np.concatenate([np.repeat(tensors, n_src), np.repeat(tensors, n_dst)])
  index = np.concatenate([_cat_rows(on_src, (0,)), _cat_rows(on_dst, (0,))])
  side = np.repeat(np.array([0, 1], np.int64), [int(n_src.sum()), int(n_dst.sum())])
  on = dev_start[tensor] + index
  dev = np.where(side == 0, src_pos[on], dst_pos[on]).astype(np.int64)
  step = _global_steps(steps, base, part_start, tensor, index)
  key = steps.key(tensor, index, step)
  by_device = np.lexsort((key, dev))
  key, dev, side, step = key[by_device], dev[by_device], side[by_device], step[by_device]
  size = nbytes[part_start[tensor[by_device]] + index[by_device]]
  end = np.cumsum(size)
  new_group = np.ones(len(key), bool)
  new_group[1:] = (dev[1:] != dev[:-1]) | (step[1:] != step[:-1])
  group_start = np.maximum.accumulate(np.where(new_group, np.arange(len(key)), 0))
  used = end - size - (end - size)[group_start]
  packed, at = np.unique(key, return_inverse=True)
  packs = np.full((len(packed), 2), -1, np.int64)
  packs[at.reshape(-1), side] = used + tmp_end[dev]
  peak = np.zeros(len(tmp_end), np.int64)
  np.maximum.at(peak, dev, used + size)
  for a in (packed, packs):
    a.flags.writeable = False
  return packed, packs, peak


def _global_steps(steps, base, part_start, tensor: np.ndarray,
                  index: np.ndarray) -> np.ndarray:
  """The global steps (int64) of the chunks (`tensor`, `index`): a wave's offset plus
  the local step (column 0 of the chunk's base row), or the matched step."""
  if steps.matched is None:
    return base[part_start[tensor] + index, 0] + steps.offsets[tensor]
  out = np.empty(len(tensor), np.int64)
  for t in np.unique(tensor).tolist():
    mine = tensor == t
    out[mine] = steps.of(t, index[mine])
  return out


@functools.lru_cache(maxsize=16)
def _ops(plan: Plan, staging: bool, types: tuple | None, local: tuple | None) -> _Ops:
  """The ops of `plan` that touch the devices `local` (None: every op, the plan's
  chunks), in op order."""
  table = _table(plan, staging, types)
  if local is None:
    chunks = plan.chunks
    tensor, index, step = chunks.tensor, chunks.index, chunks.step
  else:
    tensor, index, step = table.touching(local)
  # Per op its row in src, dst; in place, 32 bits where the rows fit: fresh pages cost
  # ~2 ms a MB here (2.7M ops: 21 MB at 64 bits).
  narrow = np.int32 if len(table.src) < 1 << 31 else np.int64
  on = table.dev_start.astype(narrow)[tensor]
  on += index
  src_pos, dst_pos = table.src_pos[on], table.dst_pos[on]
  del on
  for a in (src_pos, dst_pos):
    a.flags.writeable = False
  return _Ops(table, tensor, index, step, src_pos, dst_pos)


@functools.lru_cache(maxsize=16)
def _spmd(plan: Plan, staging: bool, types: tuple | None = None) -> np.ndarray:
  """The SPMD encoding (every op)."""
  ops = _ops(plan, staging, types, None)
  return ops.encode(np.arange(len(ops.step)))


def _prefix_width(plan: Plan) -> int:
  return HEADER_WIDTH + 2 * len(plan.devices) + TENSOR_WIDTH * len(plan.tensors)


def _prefix(plan: Plan, ws: dict[int, int], n_steps: int, n_ops: int,
            types: tuple | None = None) -> np.ndarray:
  """Header, devices, ws and tensors: everything of an encoding before its ops."""
  devices = plan.devices
  tensors = np.zeros((len(plan.tensors), TENSOR_WIDTH), np.int64)
  for t, tp in enumerate(plan.tensors):
    shape = tp.src.shape
    tensors[t, 0] = tp.itemsize
    tensors[t, 1] = len(shape)
    tensors[t, 2:2 + len(shape)] = shape
    if types is not None:
      tensors[t, 2 + MAX_RANK:] = types[t]
  header = np.array([MAGIC, SCHEDULE_VERSION, len(plan.tensors), len(devices), n_steps,
                     n_ops, OP_FIXED, MAX_RANK], np.int64)
  return np.concatenate([header, np.array(devices, np.int64),
                         np.array([ws.get(d, 0) for d in devices], np.int64),
                         tensors.reshape(-1)])


def _check_types(plan: Plan, types):
  """None for no conversion, else a hashable tuple of (src_type, dst_type) per tensor."""
  if types is None:
    return None
  types = tuple((int(s), int(d)) for s, d in types)
  if len(types) != len(plan.tensors):
    raise ValueError(f"encode: types must give one (src_type, dst_type) per tensor "
                     f"({len(plan.tensors)}); got {len(types)}.")
  return None if all(t == NO_CONVERSION for t in types) else types


def workspace_bytes(plan: Plan, device: int | None = None, staging: bool = False,
                    types=None) -> int:
  """Workspace a device needs (device=None: the largest over devices, for SPMD)."""
  ws = _table(plan, staging, _check_types(plan, types)).ws
  if device is None:
    return max(ws.values(), default=0)
  return ws.get(device, 0)


def encode(plan: Plan, device: int | None = None, staging: bool = False,
           types=None, local=None) -> np.ndarray:
  """The `schedule` attribute for one device (eager dispatch) or every device (SPMD).

  Args:
    plan: the plan to run.
    device: the global id of the device the encoding is for; its ops only. None: all
      ops (one SPMD program for every device).
    staging: reserve workspace for pack/unpack of non-contiguous boxes (CUDA transport),
      and of boxes that convert on a sender or receiver.
    types: per tensor `(src_type, dst_type)` codes (`type_codes`), or None: nothing
      converts. With conversions, the plan must have been made with the wire itemsizes
      (`wire_dtype`): elem_bytes, workspace and staging are wire bytes.
    local: the global ids of the devices this caller encodes (a process's own, with
      `device` among them), or None: any. Only their ops are found (once per plan,
      staging, types and `local`), not every device's; the encoding is the same.

  Returns:
    A read-only 1-D int64 array (docs/schedule_format.md): version 3's elements packed
    (PACKED_VERSION: zigzag varints, ~1.2 bytes an element here). The SPMD encoding
    is cached with the plan and types: repeated calls return the same array. A device's
    costs O(its ops) plus a scan of two 2-byte columns of the ops of `local` (of the
    plan's, when None) once those are found.

  Raises:
    ValueError: `device` is not in `local`.
  """
  types = _check_types(plan, types)
  if device is None:
    return _spmd(plan, staging, types)  # cached and read-only: shared by every caller
  local = _local_key(plan, local)
  if local is not None and device not in local:
    raise ValueError(f"encode: device {device} must be one of local {list(local)}.")
  ops = _ops(plan, staging, types, local)
  devices = ops.table.devices
  j = int(np.searchsorted(devices, device))
  if j < len(devices) and devices[j] == device:
    return ops.encode(ops.device_ops(j))
  return ops.encode(np.zeros(0, np.int64))


def _local_key(plan: Plan, local) -> tuple | None:
  """`local` as a cache key: its device ids ascending, or None where it holds every
  device of `plan` (or is None)."""
  if local is None:
    return None
  key = tuple(sorted({int(d) for d in local}))
  return None if set(plan.devices) <= set(key) else key


def clear_caches() -> None:
  """Forgets every cached encoding table, SPMD encoding, digest, buffer slots and
  shared ops (benchmarks of cold encoding)."""
  for cache in (_table, _ops, _spmd, _plan_digest, buffers, _structure_ops):
    cache.cache_clear()


def decode(schedule: np.ndarray) -> dict:
  """Inverse of `encode`, for tests and debugging (the C++ decoder is the real one):
  the ops as a full-width table (n_ops, OP_WIDTH), dims beyond a tensor's rank
  (extent 1, starts 0). A narrow or packed schedule is widened first ("version" is 3
  either way)."""
  a = widen(schedule)
  magic, version, n_tensors, n_devices, n_steps, n_ops, op_fixed, max_rank = a[:8]
  if magic != MAGIC or version != SCHEDULE_VERSION:
    raise ValueError(f"decode: bad magic/version {magic:#x}/{version}.")
  at = HEADER_WIDTH
  devices = a[at:at + n_devices]; at += n_devices
  ws = a[at:at + n_devices]; at += n_devices
  tensors = a[at:at + n_tensors * TENSOR_WIDTH].reshape(n_tensors, TENSOR_WIDTH)
  at += n_tensors * TENSOR_WIDTH
  ops = np.zeros((n_ops, OP_WIDTH), np.int64)
  ops[:, OP_FIXED::3] = 1
  for i in range(n_ops):
    width = OP_FIXED + 3 * int(tensors[a[at + 2], 1])
    ops[i, :width] = a[at:at + width]
    at += width
  if at != len(a):
    raise ValueError(f"decode: {len(a) - at} trailing elements.")
  return {"version": int(version), "n_steps": int(n_steps), "devices": devices.tolist(),
          "ws": dict(zip(devices.tolist(), ws.tolist())), "tensors": tensors, "ops": ops}


def digest(sched: np.ndarray) -> bytes:
  """A 16-byte hash of one encoding (`encode`'s array, per device or SPMD): a cache key
  for the program that carries it, compared instead of the whole array."""
  return hashlib.blake2b(np.ascontiguousarray(sched, np.int64).tobytes(),
                         digest_size=16).digest()


def plan_digest(plan: Plan, staging: bool = False, types=None) -> bytes:
  """A 16-byte hash of everything every device's encoding of `plan` holds (the shared
  prefix: header, devices, workspace, tensors; the slots; each distinct TensorPlan's
  rows on its devices, the tensors' step offsets and, with staging, the packing ops'
  offsets: every op's record and place follow from them), without the plan's op list
  or the SPMD encoding: the same on every process that plans the same call, and
  different where any device's encoding differs. Cached per plan, staging and types."""
  return _plan_digest(plan, staging, _check_types(plan, types))


@functools.lru_cache(maxsize=256)
def _plan_digest(plan: Plan, staging: bool, types: tuple | None) -> bytes:
  table = _table(plan, staging, types)
  h = hashlib.blake2b(digest_size=16)
  h.update(b"staging" if staging else b"direct")
  h.update(table.prefix.tobytes())
  h.update(table.slots.tobytes())
  # Each distinct TensorPlan's rows on its devices (their local steps in column 0), and
  # where each tensor's start: with the steps' offsets (or matched steps), every op's
  # place in op order.
  ends = np.append(table.distinct[1:, 0], len(table.src))
  for (d0, r0), d1 in zip(table.distinct.tolist(), ends.tolist()):
    rows = table.base[r0:r0 + d1 - d0].copy()
    rows[:, 3], rows[:, 6] = table.src[d0:d1], table.dst[d0:d1]
    h.update(rows.tobytes())
  steps = table.steps
  for a in (table.dev_start, table.part_start,
            *(steps.matched if steps.matched is not None else (steps.offsets,))):
    h.update(np.ascontiguousarray(a, np.int64).tobytes())
  if table.packed is not None:  # the packing ops' order keys and offsets
    h.update(table.packed.tobytes())
    h.update(table.packs.tobytes())
  return h.digest()


def site_key(tag: bytes, sched, salt: int = 0) -> int:
  """A call site's rendezvous key (the custom call's `site` attribute,
  docs/schedule_format.md "Sites and generations"): from the SPMD encoding of its
  schedule (an array) or its `plan_digest` (bytes), so equal for every participant of
  one call and stable across processes."""
  h = hashlib.blake2b(digest_size=8)
  h.update(tag)
  h.update(salt.to_bytes(8, "little", signed=False))
  h.update(sched if isinstance(sched, bytes) else np.ascontiguousarray(sched).tobytes())
  return int.from_bytes(h.digest(), "little") >> 1  # a non-negative int64
