"""A torch rank's copies: boxes of the publisher's shards into the rank's tensors.

Owns the torch side of both data paths: `Mapped` (a publisher's mapped export, `local.
Import`, as one torch byte tensor; `DeviceMapped`: its GPU export's lent allocations as
torch CUDA views), `copy_local` (each box of this rank read straight
out of the export's slot with one `Tensor.copy_`, the dtype conversion fused into it),
and `compose` (the packs one network fetch delivered, viewed without a copy through
dlpack, copied into the rank's tensors). Transposes and fused parts are views of the
destination. Plans nothing; talks to no one.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Sequence

import numpy as np
import torch

from jax_m2n._src.jobs import local, pieces
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE, Manifest
from jax_m2n._src.layout import box_size
from jax_m2n._src.torch.planning import RankPlan
from jax_m2n._src.torch.targets import TORCH_OF, Part


def _slices(box, origin) -> tuple[slice, ...]:
  return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def part_view(dst: torch.Tensor, part: Part) -> torch.Tensor:
  """The part's region of the local tensor, in the leaf's own coordinates (relative to
  `part.box`): a view (transposed where the part is)."""
  ext = [hi - lo for lo, hi in part.box]
  if part.transpose:
    ext = ext[::-1]
  v = dst[tuple(slice(a, a + e) for a, e in zip(part.at, ext))]
  return v.t() if part.transpose else v


class Mapped:
  """A publisher process's mapped export (`local.Import`, CPU) as one uint8 tensor:
  shard (leaf, device, slot) is a view of it (no copy)."""

  def __init__(self, imp: local.Import):
    self.imp = imp
    spans = [imp.base(k, None) for k in imp.slots]
    self.lo = min(b for b, _ in spans)
    stride = spans[0][1]
    n = max(b for b, _ in spans) - self.lo + imp.keep * stride
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(self.lo))
    self.bytes = torch.from_numpy(raw)  # read only by convention: never written here

  def shard(self, t: int, k: int, slot: int, box, dtype: np.dtype) -> torch.Tensor:
    base, stride = self.imp.base(k, None)
    at = base + slot * stride + self.imp.offsets[(t, k)] - self.lo
    shape = tuple(hi - lo for lo, hi in box)
    n = math.prod(shape) * dtype.itemsize
    return self.bytes[at:at + n].view(TORCH_OF[dtype]).view(shape)


class _CudaMemory:
  """A device address as `__cuda_array_interface__` (what torch's as_tensor wraps
  without a copy; torch refuses the read-only flag, so it is not set)."""

  def __init__(self, address: int, nbytes: int):
    self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                     "data": (address, False), "version": 3,
                                     "strides": None}


class DeviceMapped:
  """A publisher process's GPU export (`local.Import` of lent allocations, mapped by
  fd on device `ordinal`): shard (leaf, device, slot) is a torch CUDA view of it."""

  def __init__(self, imp: local.Import, ordinal: int):
    self.imp, self.ordinal = imp, ordinal

  def shard(self, t: int, k: int, slot: int, box, dtype: np.dtype) -> torch.Tensor:
    shape = tuple(hi - lo for lo, hi in box)
    n = math.prod(shape) * dtype.itemsize
    [address] = self.imp.addresses(np.array([self.imp.rows[(t, k)]]), slot, self.ordinal)
    raw = torch.as_tensor(_CudaMemory(int(address), max(n, 1)),
                          device=f"cuda:{self.ordinal}")
    return raw[:n].view(TORCH_OF[dtype]).view(shape)


def local_sources(rp: RankPlan, m: Manifest, mapped: dict[int, Any], slot_of: dict[int, int]
                  ) -> list[list[tuple[Part, tuple[slice, ...], torch.Tensor]]]:
  """Per target, its copies out of the slots `slot_of` (per publisher process): (part,
  the region of the part's view, the source region). Made once per (plan, slots)."""
  out = []
  for target in rp.targets:
    row = []
    for part in target.parts:
      t = part.leaf
      dtype = np.dtype(local.published_dtypes(m)[t])
      for k, box in rp.boxes.get(t, []):
        p = m.devices[k]
        sbox = m.plan_layouts[t].box_of(PUBLISHER_DEVICE_BASE + k)
        src = mapped[p].shard(t, k, slot_of[p], sbox, dtype)[_slices(box, sbox)]
        row.append((part, _slices(box, part.box), src))
    out.append(row)
  return out


def copy_local(sources, tensors: Sequence[torch.Tensor], names: Sequence[str],
               written: list[str]) -> None:
  """Runs `local_sources`' copies into `tensors` (one per target, in order); each
  target's name goes to `written` once its copies ran."""
  for dst, row, name in zip(tensors, sources, names):
    for part, region, src in row:
      part_view(dst, part)[region].copy_(src)
    written.append(name)


def where_leaves(rp: RankPlan) -> dict[int, tuple[int, Part]]:
  """Per manifest leaf this rank receives, (target index, its part)."""
  return {part.leaf: (i, part) for i, target in enumerate(rp.targets)
          for part in target.parts}


def compose(packs: list[list[Any]], arrays: Sequence[Any], where: dict[int, tuple[int, Part]],
            tensors: Sequence[torch.Tensor], touched: set[int]) -> int:
  """Copies one fetch's packs (`arrays`: what the transport delivered, one per pack of
  `packs`) into `tensors`; the targets written go into `touched`. Returns the bytes."""
  n = 0
  for pack, arr in zip(packs, arrays):
    flat = torch.from_dlpack(arr)
    n += flat.numel() * flat.element_size()
    offsets = [0] if len(pack) == 1 else pieces.run_offsets([op.box for op in pack])
    flat = flat.reshape(-1)
    for op, at in zip(pack, offsets):
      i, part = where[op.tensor]
      shape = tuple(hi - lo for lo, hi in op.box)
      src = flat[at:at + box_size(op.box)].view(shape)
      part_view(tensors[i], part)[_slices(op.box, part.box)].copy_(src)
      touched.add(i)
  return n
