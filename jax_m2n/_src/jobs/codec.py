"""The delta codec: which elements changed, how a piece's changes are encoded, decoded and
applied. Pure functions on arrays (numpy on the host; compiled programs or numpy for the
apply): no sockets, no versions, no waiting (delta.py serves and pulls with them).

The change test is bitwise in the wire dtype; per chunk of CHUNK elements a piece
crosses as nothing, a bitmap + the changed values, index runs + the changed values, or
dense, whichever is smallest; nothing is ever taken as equal by value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src.errors import ReshardRuntimeError
from jax_m2n._src.jobs import pieces
from jax_m2n._src.layout import Box

# Elements per chunk: the unit that crosses as nothing, sparse or dense. A bitmap costs
# CHUNK / 8 bytes (a smaller last chunk's: its size / 8), so a chunk goes sparse while
# fewer than about 15/16 of its elements changed; 16 Ki elements keeps the per-chunk
# mode list (one int in the reply) at 1/16 Ki of the elements and a bitmap at 2 KiB.
CHUNK = 1 << 14
NOTHING, BITMAP, RUNS, DENSE = 0, 1, 2, 3
MODES = ("nothing", "bitmap", "runs", "dense")
# A run is two int32s (its start in the piece, its length): pieces of at most 2**31
# elements take runs; larger ones cross as bitmaps or dense.
MAX_RUN_PIECE = (1 << 31) - 1


# ---------------------------------------------------------------------------------------
# The change test and the encoding (numpy, host memory)
# ---------------------------------------------------------------------------------------

def _bits(x: np.ndarray) -> np.ndarray:
  """`x` (1-D) as unsigned ints of its width, or as rows of bytes for wider types:
  what the change test compares (NaN payloads and -0.0 are bits like any other)."""
  kind = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(x.dtype.itemsize)
  if kind is not None:
    return x.view(kind)
  return x.view(np.uint8).reshape(x.size, x.dtype.itemsize)


def changed(new: np.ndarray, old: np.ndarray) -> np.ndarray:
  """The change test: a bool per element of two flat arrays of one dtype, True where
  their bits differ (so NaN == NaN of the same payload, and 0.0 != -0.0)."""
  a, b = _bits(new), _bits(old)
  diff = a != b
  return diff if diff.ndim == 1 else diff.any(axis=1)


@dataclasses.dataclass
class Encoded:
  """One piece's delta: per chunk a mode (NOTHING, BITMAP, RUNS, DENSE), the bitmaps of
  BITMAP chunks (CHUNK / 8 bytes each, a partial last chunk's its size / 8 rounded
  up; little bit order), the runs of RUNS chunks (int32
  pairs: start in the piece, length) and the values, in element order: every element
  of a DENSE chunk and the changed ones of the sparse chunks, in the wire dtype."""

  modes: np.ndarray
  bitmaps: np.ndarray
  runs: np.ndarray
  values: np.ndarray
  changed: int

  @property
  def nbytes(self) -> int:
    return self.bitmaps.nbytes + self.runs.nbytes + self.values.nbytes


def encode(new: np.ndarray, old: np.ndarray | None, chunk: int = CHUNK) -> Encoded:
  """The smallest per-chunk encoding of `new` (flat, the wire dtype) against `old` (its
  base, the same dtype and size), or every chunk dense when there is no base.

  Example:
    >>> e = encode(np.array([1, 2, 3], np.float32), np.array([1, 5, 3], np.float32), 8)
    >>> e.modes.tolist(), e.bitmaps.tolist(), e.values.tolist(), e.changed
    ([1], [2], [2.0], 1)
  """
  if old is None:
    return encode_changes(new, None, chunk)
  if old.shape != new.shape or old.dtype != new.dtype:
    raise ValueError(f"delta.encode: old must be new's shape and dtype; got {old.shape} "
                     f"{old.dtype} against {new.shape} {new.dtype}.")
  return encode_changes(new, changed(new, old), chunk)


def encode_changes(new: np.ndarray, mask: np.ndarray | None, chunk: int = CHUNK
                   ) -> Encoded:
  """`encode` from the change test's result (`mask`, a bool per element; None: every
  element changed)."""
  n = new.size
  nchunks = -(-n // chunk)
  itemsize = new.dtype.itemsize
  if mask is None:
    return Encoded(np.full(nchunks, DENSE, np.int8), np.zeros(0, np.uint8),
                   np.zeros(0, np.int32), new, n)
  grid = np.zeros(nchunks * chunk, bool)
  grid[:n] = mask
  rows = grid.reshape(nchunks, chunk)
  count = rows.sum(axis=1)
  starts = rows.copy()
  starts[:, 1:] &= ~rows[:, :-1]
  nruns = starts.sum(axis=1)
  sizes = np.full(nchunks, chunk, np.int64)
  sizes[-1] = n - (nchunks - 1) * chunk
  cost = np.stack([-(-sizes // 8) + count * itemsize,             # BITMAP
                   np.where(n <= MAX_RUN_PIECE, 8 * nruns + count * itemsize,
                            np.iinfo(np.int64).max),            # RUNS
                   sizes * itemsize])                             # DENSE
  modes = (np.argmin(cost, axis=0) + 1).astype(np.int8)
  modes[count == 0] = NOTHING
  dense = np.repeat(modes == DENSE, chunk)[:n]
  values = new[grid[:n] | dense]
  bitmaps = np.packbits(rows[modes == BITMAP], axis=1, bitorder="little").reshape(-1)
  if modes[-1] == BITMAP:  # a partial last chunk's bitmap ends with the piece
    bitmaps = bitmaps[:bitmaps.size - chunk // 8 + -(-int(sizes[-1]) // 8)]
  in_runs = np.repeat(modes == RUNS, chunk)
  ends = rows.copy()
  ends[:, :-1] &= ~rows[:, 1:]
  first = np.flatnonzero(starts.reshape(-1) & in_runs)
  last = np.flatnonzero(ends.reshape(-1) & in_runs)
  runs = np.stack([first, last - first + 1], axis=1).astype(np.int32).reshape(-1)
  return Encoded(modes, bitmaps, runs, values, int(count.sum()))


def bitmap_bytes(modes: Sequence[int], n: int, chunk: int = CHUNK) -> int:
  """The bytes of a piece's bitmaps: CHUNK / 8 per BITMAP chunk, the last chunk's
  rounded up from its own size."""
  nbitmaps = sum(1 for m in modes if m == BITMAP)
  if not nbitmaps:
    return 0
  last = n - (len(modes) - 1) * chunk
  return nbitmaps * (chunk // 8) - (chunk // 8 - -(-last // 8) if modes[-1] == BITMAP
                                    else 0)


def decode(modes: np.ndarray, bitmaps: np.ndarray, runs: np.ndarray, n: int,
           chunk: int = CHUNK) -> np.ndarray:
  """The positions (ascending, in the flat piece of `n` elements) that `values` of an
  `Encoded` fill, in their order.

  Raises:
    ReshardRuntimeError: a malformed delta (wrong sizes, positions outside the piece
      or their chunk's mode).
  """
  nchunks = -(-n // chunk)
  modes = np.asarray(modes, np.int8)
  if modes.shape != (nchunks,) or ((modes < NOTHING) | (modes > DENSE)).any():
    raise ReshardRuntimeError(f"Subscriber.pull: a delta must have one mode per chunk; "
                              f"got {modes.size} for {nchunks}.")
  rows = np.zeros((nchunks, chunk), bool)
  rows[modes == DENSE] = True
  nbitmaps = int((modes == BITMAP).sum())
  if bitmaps.size != bitmap_bytes(modes.tolist(), n, chunk) or runs.size % 2:
    raise ReshardRuntimeError("Subscriber.pull: a delta's bitmaps and runs must match "
                              "its modes; got other sizes.")
  if nbitmaps:
    padded = np.zeros(nbitmaps * (chunk // 8), np.uint8)
    padded[:bitmaps.size] = bitmaps
    rows[modes == BITMAP] = np.unpackbits(padded.reshape(nbitmaps, chunk // 8), axis=1,
                                          bitorder="little").astype(bool)
  if runs.size:
    first, length = runs[0::2].astype(np.int64), runs[1::2].astype(np.int64)
    if (length < 1).any() or (first < 0).any() or (first + length > n).any() or (
        (first // chunk) != (first + length - 1) // chunk).any() or (
        modes[first // chunk] != RUNS).any():
      raise ReshardRuntimeError("Subscriber.pull: a delta's runs must lie inside their "
                                "RUNS chunks; got others.")
    total = int(length.sum())
    at = np.repeat(first - np.cumsum(length) + length, length) + np.arange(total)
    rows.reshape(-1)[at] = True
  flat = rows.reshape(-1)
  if nchunks and modes[-1] == DENSE:
    flat[n:] = False  # a dense last chunk ends with the piece
  if flat[n:].any():
    raise ReshardRuntimeError("Subscriber.pull: a delta must mark no position past its "
                              "piece; got some.")
  return np.flatnonzero(flat[:n])


# ---------------------------------------------------------------------------------------
# Applying decoded changes to the previous result's shards
# ---------------------------------------------------------------------------------------

# On CPU the shards are host memory: numpy updates copies of them (nothing to compile;
# XLA compiles per program and per device: a program updating a 26-leaf model's shards
# on 4 devices took 13 s to compile on this 2-core machine, as pieces.Batch found for
# composing). Elsewhere compiled programs of at most pieces.PROGRAM_BOXES shards update
# the donated shards in place. (Tests flip this to run the compiled path on CPU.)
HOST_APPLY = True


@functools.lru_cache(maxsize=256)
def _program(sig: tuple[tuple[int, str], ...], names: tuple[str, ...], donate: bool
             ) -> Any:
  """The program that updates a few shards of one device: per shard (scatter size,
  wire dtype), its positions from one int32 array and its values from its wire dtype's
  array (both concatenated in shard order), converted to the shard's dtype as a full
  pull converts (XLA's convert, elementwise)."""
  def apply(prevs, at, values):
    outs, i, v = [], 0, dict.fromkeys(names, 0)
    for p, (size, name) in zip(prevs, sig):
      vals = values[names.index(name)][v[name]:v[name] + size]
      flat = p.reshape(-1).at[at[i:i + size]].set(vals.astype(p.dtype), mode="drop",
                                                  unique_indices=True)
      outs.append(flat.reshape(p.shape))
      i += size
      v[name] += size
    return outs
  return jax.jit(apply, donate_argnums=(0,) if donate else ())


def programs_built() -> int:
  """How many apply programs were built so far (each compiles on its first call)."""
  return _program.cache_info().misses


def apply_compiled(pp: Any, device: Any, group, parts, donate: bool) -> list[jax.Array]:
  """Updates `group`'s shards (leaf, index, shard) on `device` with one compiled
  program, in place where `donate`."""
  sig, at, values = [], [], {}
  for (t, _, p), updates in zip(group, parts):
    n = sum(a.size for a, _ in updates)
    size = _bucket((p.shape, p.dtype, pp.wire[t], device.id), n)
    idx = np.full(size, p.size, np.int32)  # past the end: dropped
    vals = np.zeros(size, pp.wire[t])
    if updates:
      idx[:n] = np.concatenate([a for a, _ in updates])
      vals[:n] = np.concatenate([v for _, v in updates])
    sig.append((size, pp.wire[t].name))
    at.append(idx)
    values.setdefault(pp.wire[t].name, []).append(vals)
  names = tuple(sorted(values))
  return _program(tuple(sig), names, donate)(
      [p for _, _, p in group], jax.device_put(np.concatenate(at), device),
      [jax.device_put(np.concatenate(values[k]), device) for k in names])


def apply_host(pp: Any, device: Any, group, parts, donate: bool) -> list[jax.Array]:
  """Updates `group`'s shards on a CPU `device` with numpy: each shard copied, its
  changed elements set, put back (the donated shards are deleted by the pull). The
  values are converted to the shard's dtype by XLA, as a full pull converts them."""
  del donate  # the copies replace the donated shards, which the pull then deletes
  out = []
  for (t, _, p), updates in zip(group, parts):
    if not updates:
      out.append(jax.device_put(p, device, may_alias=False))
      continue
    at = np.concatenate([a for a, _ in updates])
    vals = np.concatenate([v for _, v in updates])
    if vals.dtype != p.dtype:
      convert = pieces.converter(np.dtype(p.dtype))
      vals = np.asarray(convert(jax.device_put(vals, device)))
    host = np.array(p)
    host.reshape(-1)[at] = vals
    out.append(jax.device_put(host, device))
  return out


# Per destination shard (shape, dtype, device): the scatter size it last used (pulls of
# several subscribers may run on several threads).
_buckets: dict[tuple[Any, ...], int] = {}
_buckets_lock = threading.Lock()


def _bucket(key: tuple[Any, ...], n: int) -> int:
  """The scatter size for `n` updates of one shard: a power of two (at least 256),
  kept while n stays between 1/8 of it and it. Each size is one compilation per shard
  shape and device, and a training run's change counts drift around a level: without
  the hysteresis a count wandering across a power of two recompiled (~50 ms a shard)."""
  with _buckets_lock:
    last = _buckets.get(key)
    if last is not None and last // 8 <= n <= last:
      return last
    if len(_buckets) > 1 << 16:
      _buckets.clear()
    size = _buckets[key] = max(256, 1 << max(0, n - 1).bit_length())
    return size


def in_shard(positions: np.ndarray, shape: tuple[int, ...], box: Box, dbox: Box
              ) -> np.ndarray:
  """Flat positions in a piece of `shape` at `box` -> flat positions in the destination
  shard at `dbox` (which contains the box)."""
  if not shape:
    return positions
  dshape = tuple(hi - lo for lo, hi in dbox)
  if tuple(box[1:]) == tuple(dbox[1:]):  # whole rows of the shard: one offset
    return positions + (box[0][0] - dbox[0][0]) * math.prod(dshape[1:])
  index = np.unravel_index(positions, shape)
  return np.ravel_multi_index(
      tuple(i + (lo - dlo) for i, (lo, _), (dlo, _) in zip(index, box, dbox)), dshape)
