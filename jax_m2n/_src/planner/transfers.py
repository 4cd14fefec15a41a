"""Transfers: the vocabulary of a route and its columnar container.

Owns what one transfer is (source and destination device, stage, box, the buffer kinds
it reads and writes, the transfers it depends on) and `Transfers`, one route's transfers
as numpy columns. Builds no route and prices nothing (routes.py, cost.py do).
"""

from __future__ import annotations

import collections.abc
import functools
import operator
from typing import NamedTuple

import numpy as np

from jax_m2n._src.layout import Box, box_size

ROUTES = ("hierarchical", "flat", "gather_bcast")
STAGES = ("local", "inject", "forward", "fanout", "gather", "bcast")
LINKS = ("local", "nvlink", "network")

# Buffer kinds a transfer reads from / writes to (same codes as docs/schedule_format.md).
SRC_SHARD, DST_SHARD, FULL_TMP = 0, 1, 2


class Transfer(NamedTuple):
  """One region moved from one device to another (or copied on one device).

  `box` is in global coordinates. `src_kind`/`dst_kind` say which buffer of the device is
  read/written: its source shard (0), its destination shard (1) or a full-tensor
  workspace buffer (2, gather_bcast only). `parents` are the indices (in the same
  tensor's transfer list) of the transfers that deliver what this one reads; `depth` is
  the longest chain of parents.
  """

  tensor: int
  src: int
  dst: int
  stage: str
  box: Box
  src_kind: int
  dst_kind: int
  parents: tuple[int, ...]
  depth: int


STAGE_CODES = {s: i for i, s in enumerate(STAGES)}
LOCAL, INJECT, FORWARD, FANOUT, GATHER, BCAST = range(len(STAGES))


class Transfers(collections.abc.Sequence):
  """The transfers of one route as columns: one row per transfer, in plan order.

  Memory is linear in the transfers (~23 bytes each) plus one entry per distinct box:
  a route's fan-out repeats one box to every replica of a domain, and millions of
  per-transfer Python objects cost more to build than to plan. Indexing and iteration
  give `Transfer` records (built on access); the columns are what the accounting, the
  chunker and the encoder read.

  Columns (numpy, read-only): `src`, `dst` (int32 device ids), `stage` (int8 index into
  STAGES), `src_kind`, `dst_kind` (int8 buffer kinds), `box` (int32 index into
  `boxes`), `parent` (int32 first parent, -1 for none), `depth` (int32). `extra_parents`
  maps the few transfers with more than one parent (gather_bcast) to all of them.
  `tensor` is the tensor index every record carries.
  """


  def __init__(self, tensor, src, dst, stage, src_kind, dst_kind, box, boxes, parent,
               extra_parents, depth):
    self.tensor = tensor
    self.src, self.dst, self.stage = src, dst, stage
    self.src_kind, self.dst_kind, self.box = src_kind, dst_kind, box
    self.boxes, self.parent, self.extra_parents, self.depth = (
        boxes, parent, extra_parents, depth)
    for a in (src, dst, stage, src_kind, dst_kind, box, parent, depth):
      a.flags.writeable = False

  @staticmethod
  def empty() -> "Transfers":
    z = np.zeros(0, np.int32)
    return Transfers(0, z, z.copy(), z.astype(np.int8), z.astype(np.int8),
                     z.astype(np.int8), z.copy(), (), z.copy(), {}, z.copy())

  def with_tensor(self, tensor: int) -> "Transfers":
    """The same transfers carrying tensor index `tensor` (columns shared)."""
    return Transfers(tensor, self.src, self.dst, self.stage, self.src_kind, self.dst_kind,
                     self.box, self.boxes, self.parent, self.extra_parents, self.depth)

  def __len__(self) -> int:
    return len(self.src)

  def _parents(self, i: int, p: int) -> tuple[int, ...]:
    if p < 0:
      return ()
    return self.extra_parents.get(i) or (p,)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return list(self._records(*i.indices(len(self))))
    n = len(self)
    i = operator.index(i)
    if i < 0:
      i += n
    if not 0 <= i < n:
      raise IndexError(i)
    return next(self._records(i, i + 1, 1))

  def __iter__(self):
    n = len(self)
    for start in range(0, n, 1 << 16):
      yield from self._records(start, min(n, start + (1 << 16)), 1)

  def _records(self, start: int, stop: int, step: int):
    sl = slice(start, stop, step)
    new, boxes, stages, tensor = tuple.__new__, self.boxes, STAGES, self.tensor
    extra = self.extra_parents
    for i, s, t, g, b, sk, dk, p, d in zip(
        range(start, stop, step), self.src[sl].tolist(), self.dst[sl].tolist(),
        self.stage[sl].tolist(), self.box[sl].tolist(), self.src_kind[sl].tolist(),
        self.dst_kind[sl].tolist(), self.parent[sl].tolist(), self.depth[sl].tolist()):
      parents = () if p < 0 else (extra.get(i) or (p,)) if extra else (p,)
      yield new(Transfer, (tensor, s, t, stages[g], boxes[b], sk, dk, parents, d))

  def __eq__(self, other):
    if not isinstance(other, Transfers):
      return NotImplemented
    return (self.tensor == other.tensor and len(self) == len(other)
            and all(np.array_equal(getattr(self, c), getattr(other, c))
                    for c in ("src", "dst", "stage", "src_kind", "dst_kind", "parent",
                              "depth"))
            and np.array_equal(self.box, other.box)
            and self.extra_parents == other.extra_parents
            and tuple(self.boxes) == tuple(other.boxes))

  def __hash__(self) -> int:
    return hash((self.tensor, len(self)))

  def __repr__(self) -> str:
    return f"Transfers({len(self)} transfers, {len(self.boxes)} distinct boxes)"

  @functools.cached_property
  def box_elements(self) -> np.ndarray:
    """Elements of each distinct box (int64, or Python ints past int64)."""
    sizes = [box_size(b) for b in self.boxes]
    if sizes and max(sizes) >= 1 << 62:
      return np.array(sizes, object)
    return np.array(sizes, np.int64)

  def nbytes(self, itemsize: int) -> np.ndarray:
    """Bytes of every transfer: int64, or Python ints where their sum could overflow."""
    elems = self.box_elements
    if elems.dtype == object or (
        len(elems) and int(elems.max()) * itemsize * max(len(self), 1) >= 1 << 62):
      return elems.astype(object)[self.box] * itemsize
    return elems[self.box] * itemsize

  def stage_counts(self) -> dict[str, int]:
    counts = np.bincount(self.stage, minlength=len(STAGES)).tolist()
    return {s: c for s, c in zip(STAGES, counts) if c}


