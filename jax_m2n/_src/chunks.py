"""Chunks and steps: how a plan's transfers are cut and ordered for a transport.

Owns the split of every transfer into chunks of at most `chunk_bytes` and the step of each
chunk (docs/schedule_format.md, "Ordering contract"): a chunk runs one step after the
chunks it reads, so a leader forwards or fans out chunk c while chunk c+1 arrives.
Tensors are started in waves so that no step holds much more than a few chunks' bytes
per device. Pure; no devices, no encodings.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jax_m2n._src.layout import Box, box_size, intersect

# How many chunks' bytes one step may hold per device before the next tensor is
# deferred to a later step (bounds staging memory and keeps NCCL groups moderate).
STEP_CHUNKS = 4
# A transfer nobody reads from (no forward or fan-out follows it) gains nothing from
# pipelining; it is cut only to bound staging, in chunks this many times larger (on
# H200 a 1 GiB point-to-point copy was fastest in 256 MiB pieces, 4 x the 64 MiB
# default: each NCCL step drains the pipe; docs/cuda_transport.md).
LEAF_CHUNK_FACTOR = 4


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


def _tensor_chunks(transfers, itemsize: int, limit: int) -> list[list[tuple[Box, int]]]:
  """Per transfer of one tensor: (box, step) of its chunks, steps local to the tensor."""
  out: list[list[tuple[Box, int]]] = []
  read = {p for x in transfers for p in x.parents}
  for i, x in enumerate(transfers):
    if not x.parents:
      size = limit if i in read else LEAF_CHUNK_FACTOR * limit
      out.append([(b, k) for k, b in enumerate(chunk_box(x.box, itemsize, size))])
      continue
    parent = transfers[x.parents[0]]
    if len(x.parents) == 1 and intersect(parent.box, x.box) == x.box:
      # Follow the parent's chunks: chunk i reads exactly what parent chunk i wrote.
      mine = []
      for pbox, pstep in out[x.parents[0]]:
        piece = intersect(pbox, x.box)
        if piece is not None:
          mine.append((piece, pstep + 1))
      out.append(mine)
      continue
    mine = []
    for b in chunk_box(x.box, itemsize, limit):
      step = 0
      for p in x.parents:
        for pbox, pstep in out[p]:
          if intersect(pbox, b) is not None:
            step = max(step, pstep + 1)
      mine.append((b, step))
    out.append(mine)
  return out


def schedule_chunks(plan) -> list[Chunk]:
  """Every chunk of `plan`, with global steps, sorted by step (stable)."""
  limit = plan.chunk_bytes
  cap = STEP_CHUNKS * limit
  usage: dict[int, int] = {}
  chunks: list[Chunk] = []
  base = 0  # index of the tensor's first transfer in plan.transfers
  offset = 0
  for tp in plan.tensors:
    per_transfer = _tensor_chunks(tp.transfers, tp.itemsize, limit)
    # Bytes per (device, local step) of non-local chunks: the tensor's footprint.
    load: dict[tuple[int, int], int] = {}
    length = 0
    for x, cs in zip(tp.transfers, per_transfer):
      for b, s in cs:
        length = max(length, s + 1)
        if x.src != x.dst:
          n = box_size(b) * tp.itemsize
          load[(x.src, s)] = load.get((x.src, s), 0) + n
          load[(x.dst, s)] = load.get((x.dst, s), 0) + n
    peak = max(load.values(), default=0)
    if peak:
      while any(usage.get(s, 0) and usage[s] + peak > cap
                for s in range(offset, offset + length)):
        offset += 1
      for s in range(offset, offset + length):
        usage[s] = usage.get(s, 0) + peak
    for i, cs in enumerate(per_transfer):
      for b, s in cs:
        chunks.append(Chunk(base + i, b, offset + s))
    base += len(tp.transfers)
  chunks.sort(key=lambda c: c.step)
  return chunks
