"""The local data plane's two copies: `local_copy` and `local_store`.

Owns the local copy schedule's encoding (docs/schedule_format.md, "The local copy
schedule"; the decoder is xla_ffi/local_copy.cc), the argument checks, and the cache
of compiled programs (one per schedule and device). Knows nothing of publishers,
versions or shardings; never maps, opens or frees memory (local_memory.py does).

Addresses are raw: the caller guarantees that each pointer addresses readable (copy)
or writable (store) memory of at least the bytes its boxes name, in this process (host
memory on CPU; device memory of the output's GPU on CUDA, e.g. an opened IPC mapping),
until the returned arrays are ready.
"""

from __future__ import annotations

import collections
import ctypes
import functools
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from jax_m2n._src import ffi
from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError, ReshardValueError
from jax_m2n._src.layout import MAX_RANK
from jax_m2n._src.schedule import TYPE_CODES

MAGIC = 0x4C43505F  # "LCP_"
VERSION = 1
# On CUDA every pointer must be a multiple of this: the copy kernels read up to 32
# bytes at once from addresses they only learn on the device (cudaMalloc and IPC
# mappings are 256-byte aligned; place shards at multiples of 256 bytes).
CUDA_POINTER_ALIGN = 32
# A compiled program fills at most this many outputs: XLA's compile time of one custom
# call grows faster than its outputs (CPU, measured: 1,024 outputs 0.19 s, 4,096 2.2 s),
# so a 20,000-leaf pytree is copied by programs of this many, like outputs grouped (see
# `_programs`: 20,000 like leaves compile one program per device).
PROGRAM_OUTPUTS = 256
# Element sizes of the dtypes copied as opaque bytes (bool .. complex128).
_ELEM_BYTES = (1, 2, 4, 8, 16)
# A Copier keeps the pointer tables of this many recent address sets on its device: a
# pull that recurs at the same addresses (a lent version: the trainer's own buffers;
# a snapshot: one of `keep` slots) sends none (no host-to-device transfer per call).
DEVICE_TABLES = 8


class Out(NamedTuple):
  """One output array of a local copy (created on the call's device)."""
  shape: tuple[int, ...]
  dtype: np.dtype


class Box(NamedTuple):
  """One box of a local copy: `extent` elements from `src_start` in the source shard at
  pointer-table entry `slot` (a dense row-major array of `src_shape`, `src_dtype`) to
  `dst_start` in output `out`. `src_dtype` equal to the output's dtype copies; two
  different types among float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 convert
  as `astype` does."""
  out: int
  slot: int
  src_shape: tuple[int, ...]
  src_dtype: np.dtype
  src_start: tuple[int, ...]
  dst_start: tuple[int, ...]
  extent: tuple[int, ...]


def _type_code(dtype: np.dtype) -> int:
  return TYPE_CODES.get(dtype, 0)


def encode(boxes: Sequence[Box], outs: Sequence[Out], n_slots: int) -> np.ndarray:
  """The `schedule` attribute of jax_m2n_local_copy (int64[]); see the module's doc.

  Checks types and ranks; the geometry (boxes inside their shards and outputs, tiling
  each output exactly) is checked by the native decoder (`_program`).

  Raises:
    ReshardTypeError / ReshardValueError: a field of the wrong type or rule.
  """
  per_out: list[list[Box]] = [[] for _ in outs]
  for i, box in enumerate(boxes):
    if not isinstance(box, Box):
      raise ReshardTypeError(f"local_copy: boxes must be local_copy.Box; got "
                             f"{type(box).__name__} at {i}.")
    if not 0 <= box.out < len(outs):
      raise ReshardValueError(f"local_copy: box {i}'s out must be in [0, {len(outs)}); "
                              f"got {box.out}.")
    per_out[box.out].append(box)
  words = [MAGIC, VERSION, n_slots, len(outs)]
  for o, (out, out_boxes) in enumerate(zip(outs, per_out)):
    dtype, rank = np.dtype(out.dtype), len(out.shape)
    if rank > MAX_RANK or dtype.itemsize not in _ELEM_BYTES:
      raise ReshardValueError(f"local_copy: output {o} must have rank <= {MAX_RANK} and "
                              f"1, 2, 4, 8 or 16-byte elements; got shape {out.shape} "
                              f"dtype {dtype}.")
    code = _type_code(dtype)
    words += [code, dtype.itemsize, rank, len(out_boxes), *out.shape]
    for box in out_boxes:
      src_dtype = np.dtype(box.src_dtype)
      if src_dtype != dtype and not (code and _type_code(src_dtype)):
        raise ReshardValueError(
            f"local_copy: a box's src_dtype must equal its output's dtype {dtype} or both "
            f"be among float32, float16, bfloat16, float8_e4m3fn, float8_e5m2; got "
            f"{src_dtype} into output {o}.")
      fields = (box.src_shape, box.src_start, box.dst_start, box.extent)
      if any(len(f) != rank for f in fields):
        raise ReshardValueError(
            f"local_copy: a box's src_shape, src_start, dst_start and extent must have "
            f"its output's rank {rank}; got {fields} into output {o}.")
      words += [box.slot, _type_code(src_dtype) if code else 0]
      for f in fields:
        words += f
  return np.asarray(words, dtype=np.int64)


@functools.lru_cache(maxsize=256)
def _program(boxes: tuple[Box, ...], outs: tuple[Out, ...], n_slots: int,
             platform: str):
  """The jitted local copy of one schedule (compiled per device by jit's own cache)."""
  module = ffi.ensure_local_registered(platform)
  schedule = encode(boxes, outs, n_slots)
  cpu = module if platform == "cpu" else ffi.load("cpu")
  try:
    cpu.check_local_copy_schedule(schedule)
  except ValueError as e:
    raise ReshardValueError(f"local_copy: {e}.") from None
  results = [jax.ShapeDtypeStruct(tuple(o.shape), np.dtype(o.dtype)) for o in outs]
  call = jax.ffi.ffi_call("jax_m2n_local_copy", results)
  return jax.jit(lambda pointers: call(pointers, schedule=schedule))


@functools.lru_cache(maxsize=1024)
def _executable(boxes: tuple[Box, ...], outs: tuple[Out, ...], n_slots: int,
                device: jax.Device):
  """`_program` compiled now for `device` (ahead of time: a prepared copy compiles
  when it is prepared, not on its first call)."""
  table = jax.ShapeDtypeStruct((2 * n_slots,), np.uint32,
                               sharding=jax.sharding.SingleDeviceSharding(device))
  return _program(boxes, outs, n_slots, device.platform).lower(table).compile()


def _pointer_table(pointers, name: str, platform: str) -> np.ndarray:
  """The int64 addresses, checked; callers pass them to XLA as their uint32 halves
  (`.view(np.uint32)`): without jax_enable_x64, JAX would truncate int64 to int32."""
  table = np.asarray(pointers)
  if table.ndim != 1 or table.dtype.kind not in "iu":
    raise ReshardTypeError(f"{name}: pointers must be a 1-D integer array; got "
                           f"{table.dtype} of shape {table.shape}.")
  table = table.astype(np.int64)
  if platform != "cpu" and np.any(table % CUDA_POINTER_ALIGN):
    bad = table[table % CUDA_POINTER_ALIGN != 0][0]
    raise ReshardValueError(f"{name}: every pointer must be a multiple of "
                            f"{CUDA_POINTER_ALIGN} on a GPU; got {hex(int(bad))}.")
  return table


def local_copy(device: jax.Device, pointers, boxes: Sequence[Box],
               outs: Sequence[Out]) -> list[jax.Array]:
  """Fills new arrays on `device` with boxes read straight from raw memory: one copy,
  converting dtypes on the way, as one custom call on `device` (its XLA stream on CUDA).

  The program is compiled once per (boxes, outs, len(pointers), device); the pointer
  table is an operand, so a new version at other addresses reuses it.

  Args:
    device: the device the outputs live on (CPU or CUDA).
    pointers: int64[n_slots]: the base address of each source shard, readable in this
      process (host memory on CPU, memory of `device` on CUDA, each a multiple of
      CUDA_POINTER_ALIGN there), valid until the outputs are ready.
    boxes: every output element is written by exactly one box (checked).
    outs: the outputs' shapes and dtypes.

  Returns:
    One jax.Array per output on `device`, in order.

  Raises:
    ReshardTypeError / ReshardValueError: before anything runs.
    ReshardRuntimeError: the native call failed.

  Example (CPU; `src` is a host buffer that stays alive):
    >>> import numpy as np, jax
    >>> src = np.arange(12, dtype=np.float32).reshape(3, 4)
    >>> box = Box(0, 0, (3, 4), np.dtype(np.float32), (1, 0), (0, 0), (2, 4))
    >>> out, = local_copy(jax.devices()[0], [src.ctypes.data], [box],
    ...                   [Out((2, 4), np.dtype(np.float32))])
    >>> np.asarray(out)[1].tolist()
    [8.0, 9.0, 10.0, 11.0]
  """
  table = _pointer_table(pointers, "local_copy", device.platform)  # checked first
  return copier(device, boxes, outs, int(table.size))(table)


def copier(device: jax.Device, boxes: Sequence[Box], outs: Sequence[Out],
           n_slots: int) -> "Copier":
  """`local_copy` prepared once for a schedule: checks and compiles now, and returns
  a `Copier`: `copy(pointers) -> list[jax.Array]` runs it at other addresses each
  time (a pull that recurs every version pays only the call).

  Raises:
    ReshardTypeError / ReshardValueError: before anything runs (here, not per copy).
  """
  outs = tuple(Out(tuple(int(d) for d in o.shape), np.dtype(o.dtype)) for o in outs)
  for o, out in enumerate(outs):
    if jax.dtypes.canonicalize_dtype(out.dtype) != out.dtype:
      raise ReshardValueError(f"local_copy: output {o}'s dtype must be one JAX holds as "
                              f"is; got {out.dtype} with jax_enable_x64 off.")
  boxes = tuple(boxes)
  try:
    hash(boxes)
  except TypeError:  # lists among a box's fields: the cache key needs tuples
    boxes = tuple(Box(*(tuple(int(v) for v in f) if isinstance(f, (list, np.ndarray))
                        else f for f in box)) for box in boxes)
  for i, box in enumerate(boxes):
    if not isinstance(box, Box):
      raise ReshardTypeError(f"local_copy: boxes must be local_copy.Box; got "
                             f"{type(box).__name__} at {i}.")
  for i, box in enumerate(boxes):  # what folding starts into pointers hides (_programs)
    if not 0 <= box.out < len(outs):
      raise ReshardValueError(f"local_copy: box {i}'s out must be in [0, {len(outs)}); "
                              f"got {box.out}.")
    if not 0 <= box.slot < n_slots:
      raise ReshardValueError(f"local_copy: box {i}'s slot must be in [0, {n_slots}); "
                              f"got {box.slot}.")
    if len(box.src_start) == len(box.src_shape) == len(box.extent):
      for d, (lo, n, size) in enumerate(zip(box.src_start, box.extent, box.src_shape)):
        if lo < 0 or lo + n > size:
          raise ReshardValueError(
              f"local_copy: box {i}: src_start[{d}] + extent = {lo + n} must be <= "
              f"src_dims = {size} (and src_start >= 0; got {lo}).")
  return Copier(device, _programs(boxes, outs, device), n_slots, len(outs))


class Copier:
  """A `local_copy` prepared for one schedule on one device (`copier` makes it):
  `copier(pointers)` runs it at those addresses; `copy_all` runs several (one per
  device) with one transfer of all their pointer tables."""

  def __init__(self, device: jax.Device, programs: list, n_slots: int, n_outs: int):
    self.device, self.programs = device, programs
    self.n_slots, self.n_outs = n_slots, n_outs
    # The pointers' int64 bytes -> their tables on the device (DEVICE_TABLES most
    # recent): the same addresses again are neither checked nor sent again.
    self.on_device: collections.OrderedDict[bytes, list[jax.Array]] = (
        collections.OrderedDict())

  def __call__(self, pointers: Sequence[int]) -> list[jax.Array]:
    return copy_all([(self, pointers)])[0]

  def tables(self, pointers: Sequence[int]) -> tuple[bytes, list[np.ndarray]]:
    """The pointers' int64 bytes (the key of `on_device`) and per program its pointer
    table (checked)."""
    table = _pointer_table(pointers, "local_copy", self.device.platform)
    if table.size != self.n_slots:
      raise ReshardValueError(f"local_copy: pointers must have {self.n_slots} entries "
                              f"(the schedule's slots); got {table.size}.")
    return table.tobytes(), [(table[slots] + offsets).view(np.uint32)
                             for _, _, slots, offsets in self.programs]

  def run(self, on_device: Sequence[jax.Array]) -> list[jax.Array]:
    """Runs the programs on their tables (on this device); the outputs in order."""
    results: list[jax.Array] = [None] * self.n_outs  # type: ignore[list-item]
    try:
      for (program, members, _, _), table in zip(self.programs, on_device):
        for o, a in zip(members, program(table)):
          results[o] = a
    except jax.errors.JaxRuntimeError as e:
      raise ReshardRuntimeError(f"local_copy: the native call failed on {self.device}: "
                                f"{e}") from e
    return results


def copy_all(jobs: Sequence[tuple[Copier, Sequence[int]]]) -> list[list[jax.Array]]:
  """Runs each (copier, pointers): the pointer tables a copier does not hold on its
  device yet (its `on_device` map: the same addresses as a recent call) cross in one
  `jax.device_put` (one dispatch, not one per device and program); per job its
  outputs."""
  held: list[Any] = []  # per job, its tables on its device (None: sent below)
  tables, devices, sent = [], [], []
  for j, (c, pointers) in enumerate(jobs):
    hit = None  # the same int64 addresses again: checked when they were first sent
    if (type(pointers) is np.ndarray and pointers.dtype == np.int64
        and pointers.ndim == 1):
      hit = c.on_device.get(pointers.tobytes())
    if hit is None:
      key, mine = c.tables(pointers)
      hit = c.on_device.get(key)
      if hit is None:
        sent.append((j, c, key, len(tables), len(mine)))
        tables += mine
        devices += [c.device] * len(mine)
    held.append(hit)
  if tables:
    with jax.transfer_guard("allow"):  # jax_m2n's own tables, not the caller's data
      arrays = jax.device_put(tables, devices)
    for j, c, key, at, n in sent:
      held[j] = c.on_device[key] = arrays[at:at + n]
      while len(c.on_device) > DEVICE_TABLES:
        c.on_device.popitem(last=False)
  return [c.run(on_device) for (c, _), on_device in zip(jobs, held)]


def _programs(boxes: tuple[Box, ...], outs: tuple[Out, ...], device: jax.Device) -> list:
  """The compiled programs of one copy: (program, its outputs' indices, per program
  slot the caller's slot and a byte offset to add to its pointer).

  Outputs are grouped by what their copy looks like; a program fills at most
  PROGRAM_OUTPUTS outputs: whole chunks of one group (so a pytree of many like leaves
  compiles a few programs, not one per PROGRAM_OUTPUTS leaves), then what is left of
  every group together. On CPU each box's start is folded into
  a pointer of its own (the program then reads from its box's first element), which is
  what makes like leaves at different places one program; on CUDA a pointer must stay
  CUDA_POINTER_ALIGN-aligned, so boxes keep their starts and share their slots."""
  per_out: list[list[Box]] = [[] for _ in outs]
  for box in boxes:
    per_out[box.out].append(box)
  fold = device.platform == "cpu"
  groups: dict[Any, list[int]] = {}
  for o, out in enumerate(outs):
    key = (out, tuple((b.src_shape, b.src_dtype, b.dst_start, b.extent) if fold else
                      b._replace(out=0) for b in per_out[o]))
    groups.setdefault(key, []).append(o)
  # Full chunks of a group are alike (one compiled program serves them all); what is
  # left of every group shares programs, so a pytree of a few leaves of each of many
  # shapes is one call per device, not one per shape (each call costs a dispatch and
  # its pointer table a transfer).
  chunks, rest = [], []
  for members in groups.values():
    full = len(members) - len(members) % PROGRAM_OUTPUTS
    chunks += [members[i:i + PROGRAM_OUTPUTS] for i in range(0, full, PROGRAM_OUTPUTS)]
    rest += members[full:]
  chunks += [rest[i:i + PROGRAM_OUTPUTS] for i in range(0, len(rest), PROGRAM_OUTPUTS)]
  programs = []
  for chunk in chunks:
    program_boxes, slots, offsets, used = [], [], [], {}
    for j, o in enumerate(chunk):
      for b in per_out[o]:
        if fold:  # the box's first element, in bytes from its shard's start
          at, stride = 0, 1
          for lo, size in zip(reversed(b.src_start), reversed(b.src_shape)):
            at, stride = at + lo * stride, stride * size
          offsets.append(at * np.dtype(b.src_dtype).itemsize)
          slots.append(b.slot)
          program_boxes.append(Box(j, len(slots) - 1, b.src_shape, b.src_dtype,
                                   (0,) * len(b.src_start), b.dst_start, b.extent))
        else:
          if b.slot not in used:
            used[b.slot] = len(slots)
            slots.append(b.slot)
            offsets.append(0)
          program_boxes.append(b._replace(out=j, slot=used[b.slot]))
    programs.append((_executable(tuple(program_boxes), tuple(outs[o] for o in chunk),
                                 len(slots), device), chunk,
                     np.asarray(slots, np.int64), np.asarray(offsets, np.int64)))
  return programs


class Stored:
  """What a CPU local_store returns: its copies are done when it returns (numpy's copy:
  as fast as the custom call for 256 MiB, and 5x faster to dispatch for ~100 small
  arrays), so it is always ready. Same waiting surface as the jax.Array of CUDA."""

  def block_until_ready(self) -> "Stored":
    return self

  def is_ready(self) -> bool:
    return True


@functools.lru_cache(maxsize=None)
def _store_program(platform: str):
  ffi.ensure_local_registered(platform)
  call = jax.ffi.ffi_call("jax_m2n_local_store",
                          jax.ShapeDtypeStruct((), np.uint8), has_side_effect=True)
  return jax.jit(lambda pointers, *arrays: call(pointers, *arrays))


def local_store(arrays: Sequence[jax.Array], address: int,
                offsets: Sequence[int]) -> "jax.Array | Stored":
  """Copies each array (all on one device) whole, as dense row-major bytes, to
  `address + offsets[i]`. On CUDA: one custom call on the arrays' stream, returning at
  once; on CPU: numpy's copy, done on return.

  Args:
    arrays: single-device arrays on one device.
    address: base of writable memory in this process (host memory on CPU, memory of the
      arrays' GPU on CUDA), valid until the result is ready.
    offsets: per array, its byte offset (multiples of CUDA_POINTER_ALIGN on CUDA); the
      caller keeps the ranges disjoint and inside the memory.

  Returns:
    Something with `block_until_ready()` and `is_ready()`, ready once every byte has
    landed: a uint8 scalar jax.Array on CUDA, a `Stored` on CPU.

  Raises:
    ReshardTypeError / ReshardValueError: before anything is copied.

  Example:
    >>> import numpy as np, jax
    >>> dst = np.zeros(4, np.float32)
    >>> done = local_store([jax.numpy.ones(2)], dst.ctypes.data, [8])
    >>> done.block_until_ready().is_ready(), dst.tolist()
    (True, [0.0, 0.0, 1.0, 1.0])
  """
  arrays = list(arrays)
  if len(offsets) != len(arrays) or not arrays:
    raise ReshardValueError(f"local_store: offsets must have one entry per array (and "
                            f"arrays must not be empty); got {len(offsets)} offsets for "
                            f"{len(arrays)} arrays.")
  devices = set()
  for i, x in enumerate(arrays):
    if not isinstance(x, jax.Array) or len(x.devices()) != 1:
      raise ReshardTypeError(f"local_store: arrays must be single-device jax.Arrays; "
                             f"got {type(x).__name__} at {i}.")
    devices |= x.devices()
  if len(devices) != 1:
    raise ReshardValueError(f"local_store: arrays must all live on one device; got "
                            f"{sorted(str(d) for d in devices)}.")
  device, = devices
  if any(int(o) < 0 for o in offsets):
    raise ReshardValueError(f"local_store: offsets must be >= 0; got {list(offsets)}.")
  table = _pointer_table(np.asarray([int(address) + int(o) for o in offsets],
                                    dtype=np.int64), "local_store", device.platform)
  if device.platform == "cpu":
    for x, at in zip(arrays, table):
      src = np.asarray(x).reshape(-1).view(np.uint8)  # the buffer itself: no copy
      np.copyto(_host_bytes(int(at), src.size), src)
    return Stored()
  with jax.transfer_guard("allow"):  # jax_m2n's own table, not the caller's data
    table = jax.device_put(table.view(np.uint32), device)
  return _store_program(device.platform)(table, *arrays)


def _host_bytes(address: int, nbytes: int) -> np.ndarray:
  """A writable uint8 view of `nbytes` of host memory at `address` (the caller vouches
  for it)."""
  return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
