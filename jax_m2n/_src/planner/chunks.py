"""Chunks and steps: how a plan's transfers are cut and ordered for a transport.

Owns the split of every transfer into chunks of at most `chunk_bytes` and the step of each
chunk (docs/schedule_format.md, "Ordering contract"): a chunk runs one step after the
chunks it reads (or later, on the emulated network), so a leader forwards or fans out
chunk c while chunk c+1 arrives.
Tensors are started in waves so that no step holds much more than a few chunks' bytes
per device; on the emulated network steps are matchings instead (`_matched_steps`).
Per-tensor work is cached on the (shared) TensorPlan; per-plan work is array
arithmetic. Pure; no devices, no encodings. The chunk size is the plan's
(`Plan.chunk_bytes`: the caller's, or chunking.py's rule).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from jax_m2n._src.layout import MAX_RANK, Box, box_size, intersect

# How many chunks' bytes one step may hold per device before the next tensor is
# deferred to a later step (bounds staging memory and keeps NCCL groups moderate).
STEP_CHUNKS = 4
# A transfer nobody reads from (no forward or fan-out follows it) gains nothing from
# pipelining; it is cut only to bound staging, in chunks this many times larger (on
# H200 a 1 GiB point-to-point copy was fastest in 256 MiB pieces, 4 x the 64 MiB
# default: each NCCL step drains the pipe; docs/cuda_transport.md).
LEAF_CHUNK_FACTOR = 4
# (box, placed chunk) pairs compared at once where chunks are placed after their
# parents' (`_meeting`): bounds the temporaries (~150 MiB).
_PAIR_BLOCK = 1 << 20
# A transfer of more placed chunks than this has those a box may meet searched for;
# one of fewer has all of them compared.
_SEARCH_CHUNKS = 64


@dataclasses.dataclass(frozen=True)
class Chunk:
  """A piece of one transfer moved in one step."""

  transfer: int  # index into Plan.transfers
  box: Box
  step: int


def chunk_box(box: Box, itemsize: int, limit: int) -> list[Box]:
  """Splits a box into row-major chunks of at most `limit` bytes (one row at least)."""
  n = box_size(box) * itemsize
  if n <= limit or not box:
    return [box]
  d = next((i for i, (lo, hi) in enumerate(box) if hi - lo > 1), None)
  if d is None:
    return [box]
  lo, hi = box[d]
  slab = n // (hi - lo)
  if slab <= limit:
    rows = max(1, limit // slab)
    return [box[:d] + ((r, min(r + rows, hi)),) + box[d + 1:] for r in range(lo, hi, rows)]
  out = []
  for r in range(lo, hi):
    out.extend(chunk_box(box[:d] + ((r, r + 1),) + box[d + 1:], itemsize, limit))
  return out


def _ranges(start: np.ndarray, count: np.ndarray):
  """The ranges [start[i], start[i] + count[i]) concatenated: (i per element, the
  element)."""
  owner = np.repeat(np.arange(len(count), dtype=np.int64), count)
  offset = np.cumsum(count) - count
  return owner, start[owner] + np.arange(len(owner), dtype=np.int64) - offset[owner]


def _cut(xs, rows: np.ndarray, sizes: np.ndarray, itemsize: int, rank: int):
  """The chunks of transfers `rows` of `xs` cut by `chunk_box` at `sizes` bytes, once
  per distinct (box, size): (transfer, index in its transfer, lo, hi), padded to
  MAX_RANK with (0, 1), in the order of `rows`."""
  cuts: dict[tuple[int, int], list[Box]] = {}
  boxes: list[Box] = []
  counts = []
  for b, size in zip(xs.box[rows].tolist(), sizes.tolist()):
    cut = cuts.get((b, size))
    if cut is None:
      cut = cuts[(b, size)] = chunk_box(xs.boxes[b], itemsize, size)
    boxes.extend(cut)
    counts.append(len(cut))
  counts = np.array(counts, np.int64)
  a = np.array(boxes, np.int64).reshape(len(boxes), rank, 2)
  lo = np.zeros((len(boxes), MAX_RANK), np.int64)
  hi = np.ones((len(boxes), MAX_RANK), np.int64)
  lo[:, :rank], hi[:, :rank] = a[:, :, 0], a[:, :, 1]
  owner, index = _ranges(np.zeros(len(rows), np.int64), counts)
  return rows[owner], index, lo, hi


def _tensor_chunks(xs, itemsize: int, limit: int, rank: int, lo: np.ndarray,
                   hi: np.ndarray):
  """The chunks of every transfer of `xs` (boxes `lo`, `hi`: `_box_columns`) in transfer
  order: (transfer (k,), step (k,), lo (k, MAX_RANK), hi (k, MAX_RANK)), steps local to
  the tensor. A transfer inside its one parent follows the parent's chunks (chunk i
  reads exactly what parent chunk i wrote: their intersections, one step later); any
  other is cut by `chunk_box` (a leaf's chunk k at step k) and each chunk runs one step
  after the latest parent chunk it meets (step 0 when it meets none). By array
  arithmetic, one pass per wave of transfers whose parents are placed (`_waves`)."""
  n = len(xs)
  child, p = _parent_pairs(xs)
  waves = _waves(n, child, p)
  if waves is None:
    raise ValueError("chunks: the transfers' parents form a cycle.")
  n_parents = np.bincount(child, minlength=n)
  read = np.zeros(n, bool)
  read[p] = True
  first = np.maximum(xs.parent.astype(np.int64), 0)
  follows = ((n_parents == 1) & (lo[first] <= lo).all(axis=1)
             & (hi <= hi[first]).all(axis=1) & (lo < hi).all(axis=1))
  by_child = p[np.argsort(child, kind="stable")]  # each transfer's parents, in order
  # Row-major strides of a shape holding every box (flat positions order the chunks).
  extent = np.maximum(hi.max(axis=0), 1) if n else np.ones(MAX_RANK, np.int64)
  strides = np.cumprod(np.append(extent[1:], 1)[::-1])[::-1].astype(np.int64)
  parent_start = np.cumsum(n_parents) - n_parents
  # Placed chunks (every transfer's contiguous, from start[t], count[t] of them).
  start, count = np.zeros(n, np.int64), np.zeros(n, np.int64)
  placed = [np.zeros(0, np.int64), np.zeros(0, np.int64),
            np.zeros((0, MAX_RANK), np.int64), np.zeros((0, MAX_RANK), np.int64)]
  for w, wave in enumerate(waves):
    if w == 0:
      rows = np.flatnonzero(wave)
      sizes = np.where(read[rows], limit, LEAF_CHUNK_FACTOR * limit)
      pieces = [_cut(xs, rows, sizes, itemsize, rank)]
    else:
      _, step, plo, phi = placed
      placed_q = (start, count, plo, phi, strides)
      # A following transfer: its parent's chunks that meet its box, cut to it.
      rows = np.flatnonzero(wave & follows)
      parts = []
      for i, r in _meeting(lo[rows], hi[rows], first[rows], *placed_q):
        clo, chi = np.maximum(plo[r], lo[rows[i]]), np.minimum(phi[r], hi[rows[i]])
        meets = (clo < chi).all(axis=1)
        parts.append((rows[i][meets], step[r][meets] + 1, clo[meets], chi[meets]))
      pieces = [tuple(np.concatenate(c) for c in zip(*parts))] if parts else []
      # Any other: its own chunks, each one step after the latest parent chunk it meets.
      rows = np.flatnonzero(wave & ~follows)
      t, _, clo, chi = _cut(xs, rows, np.full(len(rows), limit), itemsize, rank)
      j, k = _ranges(parent_start[t], n_parents[t])  # every (chunk, parent) pair
      cut_step = np.zeros(len(t), np.int64)
      for i, r in _meeting(clo[j], chi[j], by_child[k], *placed_q):
        c = j[i]
        meets = (np.maximum(clo[c], plo[r]) < np.minimum(chi[c], phi[r])).all(axis=1)
        np.maximum.at(cut_step, c, np.where(meets, step[r] + 1, 0))
      pieces.append((t, cut_step, clo, chi))
    for piece in pieces:  # a piece's transfers ascend, each one's chunks in order
      c = np.bincount(piece[0], minlength=n)
      has = c > 0
      start[has] = len(placed[0]) + (np.cumsum(c) - c)[has]
      count[has] = c[has]
      placed = [np.concatenate([a, b]) for a, b in zip(placed, piece)]
  order = np.argsort(placed[0], kind="stable")
  return tuple(a[order] for a in placed)


def derived(tp, key, build):
  """`build(tp)` computed once per TensorPlan object and `key` (kept on the object).

  TensorPlans are cached and shared by the tensors of a plan and between plans (a model
  stage has ~15 distinct ones for ~140 tensors), so per-tensor work is done once per
  object. Keyed on identity: hashing a TensorPlan hashes its whole transfer tuple.
  """
  cache = tp.__dict__.setdefault("_m2n_derived", {})
  out = cache.get(key)
  if out is None:
    out = cache[key] = build(tp)
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class TensorChunks:
  """The chunks of one TensorPlan as arrays, in transfer order, steps local.

  Boxes are padded to MAX_RANK with (0, 1), so extents beyond the rank are 1.
  """

  transfer: np.ndarray  # (n,) index into the TensorPlan's transfers
  step: np.ndarray      # (n,) step local to the tensor
  lo: np.ndarray        # (n, MAX_RANK)
  hi: np.ndarray        # (n, MAX_RANK)
  rank: int             # the tensor's rank (boxes beyond it are padding)
  length: int           # local steps the tensor spans
  peak: int             # most bytes of non-local chunks on one device in one local step


def tensor_chunks(tp, chunk_bytes: int) -> TensorChunks:
  """The chunks of `tp` for `chunk_bytes` (cached on `tp`, and shared by the
  TensorPlans of one `structure`)."""
  return derived(tp, ("chunks", chunk_bytes),
                 lambda tp: _structure_chunks(structure(tp), chunk_bytes))


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
  """A key for what is derived from a TensorPlan, with one TensorPlan that has it (to
  derive it from; not compared): TensorPlans of equal keys derive the same. Compared
  and hashed by `key`."""

  key: tuple
  tp: Any

  def __eq__(self, other) -> bool:
    return isinstance(other, Structure) and self.key == other.key

  def __hash__(self) -> int:
    return hash(self.key)


def renamed_devices(tp) -> np.ndarray:
  """The devices of `tp`'s transfers (sources, then destinations) in order of first
  appearance: device k is renamed k in `structure` (cached on `tp`)."""
  def build(tp):
    xs = tp.transfers
    ids, first = np.unique(np.concatenate([xs.src, xs.dst]), return_index=True)
    out = ids[np.argsort(first, kind="stable")].astype(np.int64)
    out.flags.writeable = False
    return out
  return derived(tp, "renamed_devices", build)


def structure(tp) -> Structure:
  """What `tp`'s chunks depend on: itemsize, rank, boxes, parents, and its devices
  renamed (`renamed_devices`; cached on `tp`). TensorPlans of one structure (a model's
  layers on other devices: 114 distinct TensorPlans, 22 structures in the DeepSeek-V3
  plan) have the same chunks: they see devices only as equal or not (what is local,
  what one device holds in one step)."""
  def build(tp):
    xs = tp.transfers
    devices = renamed_devices(tp)
    by_id = np.argsort(devices, kind="stable")
    columns = [by_id[np.searchsorted(devices[by_id], c)] for c in (xs.src, xs.dst)]
    columns += [xs.box, xs.parent]
    return Structure((tp.itemsize, len(tp.src.shape), xs.boxes,
                      tuple(sorted(xs.extra_parents.items())),
                      b"".join(c.astype(np.int64).tobytes() for c in columns)), tp)
  return derived(tp, "structure", build)


@functools.lru_cache(maxsize=4096)
def _structure_chunks(shape: Structure, chunk_bytes: int) -> TensorChunks:
  """The chunks of every TensorPlan of structure `shape` (built from its first)."""
  return _build_tensor_chunks(shape.tp, chunk_bytes)


def _meeting(lo, hi, q, start, count, plo, phi, strides):
  """The placed chunks of transfer `q[i]` that box i (`lo[i]`, `hi[i]`) may meet, as
  blocks (i, r) of at most _PAIR_BLOCK pairs, i ascending and each i's chunks `r` in
  their order (a superset of those that meet: the caller compares the boxes).

  A transfer's placed chunks tile its box in row-major order, so the flat positions
  (`strides`) of their first and last elements ascend without overlap: the chunks a box
  can meet are the run whose flat span overlaps the box's, found by binary search (for
  a transfer of more than _SEARCH_CHUNKS). A transfer of fewer, or whose chunks are
  not so ordered, gives all of them."""
  first = start[q]
  last = first + count[q]
  live = (lo < hi).all(axis=1)
  searched = count[q] > _SEARCH_CHUNKS  # the others: every chunk (a few)
  if searched.any():
    bmin, bmax = lo @ strides, (hi - 1) @ strides
    for parent in np.unique(q[searched]).tolist():
      mine = np.flatnonzero(q == parent)
      s0, n = int(start[parent]), int(count[parent])
      fmin, fmax = plo[s0:s0 + n] @ strides, (phi[s0:s0 + n] - 1) @ strides
      if (fmin <= fmax).all() and (fmin[1:] > fmax[:-1]).all():
        first[mine] = s0 + np.searchsorted(fmax, bmin[mine], "left")
        last[mine] = s0 + np.searchsorted(fmin, bmax[mine], "right")
  runs = np.where(live, np.maximum(last - first, 0), 0)
  ends = np.cumsum(runs)
  b0 = 0
  while b0 < len(q):
    done = int(ends[b0 - 1]) if b0 else 0
    b1 = max(b0 + 1, int(np.searchsorted(ends, done + _PAIR_BLOCK, "right")))
    owner, r = _ranges(first[b0:b1], runs[b0:b1])
    yield owner + b0, r
    b0 = b1


def _parent_pairs(xs):
  """(child, parent) index arrays: one pair per parent of every transfer of `xs`."""
  parent = xs.parent.astype(np.int64)
  child = np.flatnonzero(parent >= 0)
  p = parent[child]
  if xs.extra_parents:  # every parent of a multi-parent one
    multi = np.fromiter(xs.extra_parents, np.int64, len(xs.extra_parents))
    lists = [xs.extra_parents[int(c)] for c in multi]
    sizes = np.array([len(ps) for ps in lists], np.int64)
    single = ~np.isin(child, multi)
    child = np.concatenate([child[single], np.repeat(multi, sizes)])
    p = np.concatenate([p[single], np.concatenate(lists).astype(np.int64)])
  return child, p


def _waves(n: int, child: np.ndarray, p: np.ndarray):
  """The `n` transfers in waves (boolean masks), each transfer in the first wave after
  all its parents' (`child`, `p`: `_parent_pairs`); the first wave holds those without a
  parent. None on a cycle."""
  done = np.ones(n, bool)
  done[child] = False
  out = [done.copy()]
  while not done.all():
    waiting = np.bincount(child[~done[p]], minlength=n)  # parents not placed yet
    ready = ~done & (waiting == 0)
    if not ready.any():
      return None  # a cycle: not a route's parents
    out.append(ready)
    done |= ready
  return out


def _single_chunk_steps(xs, itemsize: int, limit: int, lo, hi):
  """The steps `_tensor_chunks` gives when every transfer of `xs` is one chunk, by
  array arithmetic (one pass per wave); None otherwise.

  Then a transfer's only chunk is its box, at step 0 without a parent, else one step
  after the latest parent it meets (their boxes intersect), and at step 0 when it meets
  none (`_tensor_chunks`' branches for one-chunk parents). The planner's common case:
  fan-out of small replicated leaves, millions of transfers at 256 devices; a merged
  fan-out (routes._whole_fanout) has several parents.
  """
  n = len(xs)
  child, p = _parent_pairs(xs)
  read = np.zeros(n, bool)
  read[p] = True
  size = np.where(read, limit, LEAF_CHUNK_FACTOR * limit)
  if xs.extra_parents:  # cut like any box inside no single parent (`_tensor_chunks`)
    size[np.fromiter(xs.extra_parents, np.int64, len(xs.extra_parents))] = limit
  elems = xs.box_elements
  if elems.dtype == object:
    return None
  elems = elems[xs.box]
  if not ((elems * itemsize <= size) | (elems <= 1)).all():
    return None
  meets = (np.maximum(lo[child], lo[p]) < np.minimum(hi[child], hi[p])).all(axis=1)
  waves = _waves(n, child, p)
  if waves is None:
    return None
  step = np.zeros(n, np.int64)
  for ready in waves[1:]:
    pairs = ready[child]
    np.maximum.at(step, child[pairs], np.where(meets[pairs], step[p[pairs]] + 1, 0))
  return step


def _box_columns(xs, rank: int):
  """(lo, hi) of every transfer's box, padded to MAX_RANK with (0, 1)."""
  n = len(xs)
  boxes = np.array(xs.boxes, np.int64).reshape(len(xs.boxes), rank, 2)
  lo = np.zeros((n, MAX_RANK), np.int64)
  hi = np.ones((n, MAX_RANK), np.int64)
  lo[:, :rank] = boxes[:, :, 0][xs.box]
  hi[:, :rank] = boxes[:, :, 1][xs.box]
  return lo, hi


def _build_tensor_chunks(tp, limit: int) -> TensorChunks:
  rank = len(tp.src.shape)
  xs = tp.transfers
  lo, hi = _box_columns(xs, rank)
  step = _single_chunk_steps(xs, tp.itemsize, limit, lo, hi)
  if step is not None:
    transfer = np.arange(len(xs), dtype=np.int64)
  else:
    transfer, step, lo, hi = _tensor_chunks(xs, tp.itemsize, limit, rank, lo, hi)
  n = len(step)
  length = int(step.max()) + 1 if n else 0
  # Bytes per (device, local step) of non-local chunks: the tensor's footprint.
  src = tp.transfers.src.astype(np.int64)[transfer]
  dst = tp.transfers.dst.astype(np.int64)[transfer]
  cross = src != dst
  nbytes = np.prod(hi - lo, axis=1)[cross] * tp.itemsize
  peak = 0
  if cross.any():
    dev = np.concatenate([src[cross], dst[cross]])
    at = np.concatenate([step[cross], step[cross]])
    _, inverse = np.unique(dev * length + at, return_inverse=True)
    load = np.zeros(inverse.max() + 1, np.int64)
    np.add.at(load, inverse.reshape(-1), np.concatenate([nbytes, nbytes]))
    peak = int(load.max())
  for a in (transfer, step, lo, hi):
    a.flags.writeable = False
  return TensorChunks(transfer, step, lo, hi, rank, length, peak)


class Chunks:
  """Every chunk of a plan, global steps, sorted by step (stable), as arrays.

  A sequence of `Chunk` too (built on access; the arrays are what encoders use).
  Attributes (`tensor` and `step` int32 below 2**31 chunks, else int64; the others
  int64): `tensor`, `index` (chunk index in the tensor's `TensorChunks`), `transfer`
  (index into Plan.transfers), `step`, `order` (position of each chunk in the
  tensor-by-tensor concatenation), `parts` (the `TensorChunks` of each tensor; boxes stay
  there, per distinct TensorPlan, rather than copied per plan), `starts` (per tensor,
  the position of its first chunk in the concatenation), `first_transfer` (per tensor,
  the index of its first transfer in Plan.transfers). `order` and `transfer` are built
  on first access (the encoder reads neither).
  """

  def __init__(self, tensor, index, step, parts, starts, first_transfer):
    self.tensor, self.index, self.step = tensor, index, step
    self.parts, self.starts, self.first_transfer = parts, starts, first_transfer

  @functools.cached_property
  def order(self) -> np.ndarray:
    return self.starts[self.tensor] + self.index

  @functools.cached_property
  def transfer(self) -> np.ndarray:
    local = _cat([tc.transfer for tc in self.parts])[self.order]
    return local + self.first_transfer[self.tensor]

  @property
  def n_steps(self) -> int:
    return int(self.step[-1]) + 1 if len(self.step) else 0

  def __len__(self) -> int:
    return len(self.step)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[k] for k in range(*i.indices(len(self)))]
    if not -len(self) <= i < len(self):
      raise IndexError(i)
    part, k = self.parts[self.tensor[i]], self.index[i]
    box = tuple(zip(part.lo[k, :part.rank].tolist(), part.hi[k, :part.rank].tolist()))
    return Chunk(int(self.transfer[i]), box, int(self.step[i]))

  def __iter__(self):
    return (self[i] for i in range(len(self)))


@dataclasses.dataclass(frozen=True, eq=False)
class Steps:
  """Where every chunk of a plan falls, per tensor, without the plan's chunk list.

  The plan's chunks in the tensor-by-tensor concatenation are tensor t's `parts[t]`
  from position `starts[t]`; the global step of its chunk k is `of(t, k)`: its local
  step plus the tensor's wave offset (`offsets`), or, on matched steps, its own
  (`matched`). `schedule_chunks` sorts them all by step (stable); one device's chunks
  can be taken from here in that order without building the others' (`key`).
  """

  parts: tuple            # per tensor its TensorChunks (shared per TensorPlan)
  starts: np.ndarray      # (n_tensors,) int64: first chunk's position in the concatenation
  offsets: np.ndarray | None  # (n_tensors,) int64 wave offsets; None on matched steps
  matched: tuple | None   # per tensor its chunks' steps (int64); None in waves
  n_steps: int
  n_chunks: int

  def of(self, t: int, k: np.ndarray) -> np.ndarray:
    """The global steps (int64) of chunks `k` (indices in tensor `t`'s part)."""
    if self.matched is not None:
      return self.matched[t][k]
    return self.parts[t].step[k] + self.offsets[t]

  def key(self, tensor: np.ndarray, index: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Per chunk (its tensor, index in the tensor's part, global step) an int64 that
    ascends in the plan's chunk order (by step, then position in the concatenation)."""
    return (step.astype(np.int64) * max(self.n_chunks, 1) + self.starts[tensor]
            + index.astype(np.int64))


def plan_steps(plan) -> Steps:
  """The `Steps` of `plan` (its tensors' chunks made, cached per TensorPlan)."""
  limit = plan.chunk_bytes
  made: dict[int, TensorChunks] = {}  # per TensorPlan object (leaves share a few)
  parts = []
  for tp in plan.tensors:
    tc = made.get(id(tp))
    if tc is None:
      tc = made[id(tp)] = tensor_chunks(tp, limit)
    parts.append(tc)
  counts = np.array([len(tc.step) for tc in parts], np.int64)
  starts = np.cumsum(counts) - counts
  offsets = matched = None
  if plan.transport.matched_steps:
    matched = tuple(np.asarray(s, np.int64) for s in _matched_steps(plan, parts))
    n_steps = max((int(s.max()) + 1 for s in matched if len(s)), default=0)
  else:
    offsets = np.array(_wave_offsets(parts, limit), np.int64)
    n_steps = max((int(o) + tc.length for o, tc in zip(offsets, parts) if len(tc.step)),
                  default=0)
  for a in (starts, offsets):
    if a is not None:
      a.flags.writeable = False
  return Steps(tuple(parts), starts, offsets, matched, n_steps, int(counts.sum()))


def schedule_chunks(plan, steps: Steps) -> Chunks:
  """Every chunk of `plan` (its `steps`), with global steps, sorted by step (stable).

  Steps are each tensor's local steps offset by waves (below), or, where the transport
  runs matched steps (`Plan.transport.matched_steps`: the emulated network), assigned
  by `_matched_steps`. The chunks themselves (boxes, order within a tensor) are the
  same either way.
  """
  parts = steps.parts
  counts = np.array([len(tc.step) for tc in parts], np.int64)
  # The per-chunk columns in 32 bits where they fit: fresh pages are most of their cost
  # (2.7M chunks: 21 MB each at 64 bits).
  narrow = np.int32 if steps.n_chunks < 1 << 31 else np.int64
  if steps.matched is not None:
    step = _cat(list(steps.matched), narrow)
  else:  # each tensor's local steps plus its wave's offset, in one pass
    step = _cat([tc.step for tc in parts], narrow)
    step += np.repeat(steps.offsets.astype(narrow), counts)
  n_transfers = np.array([len(tp.transfers) for tp in plan.tensors], np.int64)
  starts = steps.starts
  # Sorted by step: the tensor of each chunk by one gather, its index from its position
  # in the concatenation (in place: fewer fresh pages), the steps from their counts.
  index = np.argsort(step, kind="stable")
  tensor = np.repeat(np.arange(len(parts), dtype=narrow), counts)[index]
  index -= starts.astype(narrow)[tensor]
  per_step = np.bincount(step)
  step = np.repeat(np.arange(len(per_step), dtype=narrow), per_step)
  return Chunks(tensor, index, step, tuple(parts), starts,
                np.cumsum(n_transfers) - n_transfers)


def _wave_offsets(parts, limit: int) -> list[int]:
  """Per tensor, the offset of its local steps in the global steps (waves)."""
  cap = STEP_CHUNKS * limit
  usage: dict[int, int] = {}
  offsets = []
  offset = 0
  for tc in parts:
    # Waves: a tensor starts at the first step from which adding its peak keeps every
    # step it spans under the cap (or that step is still empty).
    peak, length = tc.peak, tc.length
    if peak:
      while any(usage.get(s, 0) and usage[s] + peak > cap
                for s in range(offset, offset + length)):
        offset += 1
      for s in range(offset, offset + length):
        usage[s] = usage.get(s, 0) + peak
    offsets.append(offset)
  return offsets


def _matched_steps(plan, parts) -> list[np.ndarray]:
  """Global steps in which the chunks that cross the network form a matching: at most
  one per device and direction per step.

  The emulated NIC (xla_ffi/nic_emulator.h) reserves a transfer's egress and ingress
  queues together, in the order each receiving device runs its ops: two receivers that
  pull from the same two sources in the same order serialize (1.5-1.7x the busiest
  device's bytes, measured on issue 23's case), and no order within a step avoids it,
  since the device threads reserve in whatever order they get a core. A matching needs
  no order. Each chunk goes to the first step after the chunks it reads (a leaf's
  chunk k, off the network, to step k, as `_tensor_chunks` does) in which its source's
  egress and its destination's ingress are free, tensors and transfers in plan order
  (first fit). A Python loop over chunks: emulated plans are small (8 CPU devices).
  """
  topo = plan.topology
  busy: dict[tuple[int, int], set[int]] = {}  # (direction, device) -> steps taken
  out = []
  for tp, tc in zip(plan.tensors, parts):
    xs = list(tp.transfers)
    network = [topo.domain_of(x.src) != topo.domain_of(x.dst) for x in xs]
    done: list[list[tuple[tuple, int]]] = [[] for _ in xs]  # per transfer: (box, step)
    steps = np.empty(len(tc.step), np.int64)
    lo, hi = tc.lo[:, :tc.rank].tolist(), tc.hi[:, :tc.rank].tolist()
    for i, t in enumerate(tc.transfer.tolist()):
      x = xs[t]
      box = tuple(zip(lo[i], hi[i]))
      if not x.parents:
        step = 0 if network[t] else len(done[t])
      else:
        step = 1 + max((ps for p in x.parents for pbox, ps in done[p]
                        if intersect(pbox, box) is not None), default=-1)
      if network[t]:
        taken_out = busy.setdefault((0, x.src), set())
        taken_in = busy.setdefault((1, x.dst), set())
        while step in taken_out or step in taken_in:
          step += 1
        taken_out.add(step)
        taken_in.add(step)
      done[t].append((box, step))
      steps[i] = step
    out.append(steps)
  return out


def _cat(arrays, dtype=np.int64) -> np.ndarray:
  return (np.concatenate(arrays, dtype=dtype, casting="same_kind") if arrays
          else np.zeros((0,), dtype))
