"""Schedule encoding: a plan's chunks as the flat int64 `schedule` attribute.

Owns the byte-level format of docs/schedule_format.md (version `SCHEDULE_VERSION`),
mirrored by xla_ffi/schedule.h: slots of operand/result/workspace buffers, local
coordinates, steps, workspace layout (full-tensor buffers and pack staging). Knows
plans; knows nothing about shardings, JAX or transports.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jax_m2n._src.layout import MAX_RANK, Box, box_size
from jax_m2n._src.planner import DST_SHARD, FULL_TMP, SRC_SHARD, STAGES, Plan

SCHEDULE_VERSION = 1
MAGIC = 0x4D324E5F  # "M2N_"
HEADER_WIDTH = 8
TENSOR_WIDTH = 2 + MAX_RANK
OP_FIXED = 11
OP_WIDTH = OP_FIXED + 3 * MAX_RANK
ALIGN = 256

STAGE_CODES = {name: i for i, name in enumerate(STAGES)}


def _align(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


def _contiguous(extent, dims) -> bool:
  """Whether a box of `extent` inside a row-major buffer of `dims` is one byte range."""
  k = 0
  while k < len(dims) and extent[k] == 1:
    k += 1
  return all(e == d for e, d in zip(extent[k + 1:], dims[k + 1:]))


@dataclasses.dataclass(frozen=True)
class Buffers:
  """Which buffers each device has: operand/result slots and workspace offsets."""

  operands: dict[int, dict[int, int]]   # device -> tensor -> operand index
  results: dict[int, dict[int, int]]    # device -> tensor -> result index
  tmp: dict[int, dict[int, int]]        # device -> tensor -> workspace byte offset
  tmp_bytes: dict[int, int]             # device -> bytes of its full-tensor buffers


@functools.lru_cache(maxsize=256)
def buffers(plan: Plan) -> Buffers:
  """Operand/result slots: a device has an operand for every tensor whose source layout
  lists it and a result for every tensor whose destination layout lists it, in tensor
  order; full-tensor workspace buffers come first in the workspace."""
  operands: dict[int, dict[int, int]] = {}
  results: dict[int, dict[int, int]] = {}
  for t, tp in enumerate(plan.tensors):
    for d in tp.src.devices:
      slots = operands.setdefault(d, {})
      slots[t] = len(slots)
    for d in tp.dst.devices:
      slots = results.setdefault(d, {})
      slots[t] = len(slots)
  tmp: dict[int, dict[int, int]] = {}
  tmp_bytes: dict[int, int] = {}
  for x in plan.transfers:
    for dev, kind in ((x.src, x.src_kind), (x.dst, x.dst_kind)):
      if kind == FULL_TMP and x.tensor not in tmp.get(dev, {}):
        offset = tmp_bytes.get(dev, 0)
        tmp.setdefault(dev, {})[x.tensor] = offset
        tmp_bytes[dev] = offset + _align(plan.tensors[x.tensor].nbytes)
  return Buffers(operands, results, tmp, tmp_bytes)


def _buffer(plan: Plan, bufs: Buffers, device: int, tensor: int, kind: int):
  """(slot, origin, dims) of one buffer of one device."""
  tp = plan.tensors[tensor]
  if kind == FULL_TMP:
    return bufs.tmp[device][tensor], (0,) * len(tp.src.shape), tp.src.shape
  layout, slots = ((tp.src, bufs.operands) if kind == SRC_SHARD else (tp.dst, bufs.results))
  box = layout.box_of(device)
  return (slots[device][tensor], tuple(lo for lo, _ in box),
          tuple(hi - lo for lo, hi in box))


@functools.lru_cache(maxsize=256)
def _ops(plan: Plan, staging: bool) -> tuple[np.ndarray, dict[int, int], int]:
  """All ops of a plan (n_ops x OP_WIDTH), workspace bytes per device, step count."""
  bufs = buffers(plan)
  chunks = plan.chunks
  transfers = plan.transfers
  rows = np.zeros((len(chunks), OP_WIDTH), np.int64)
  ws = dict(bufs.tmp_bytes)
  stage_use: dict[tuple[int, int], int] = {}  # (device, step) -> staging bytes used
  stage_peak: dict[int, int] = {}
  for i, c in enumerate(chunks):
    x = transfers[c.transfer]
    tp = plan.tensors[x.tensor]
    s_slot, s_origin, s_dims = _buffer(plan, bufs, x.src, x.tensor, x.src_kind)
    d_slot, d_origin, d_dims = _buffer(plan, bufs, x.dst, x.tensor, x.dst_kind)
    extent = tuple(hi - lo for lo, hi in c.box)
    packs = [-1, -1]
    if staging and x.src != x.dst:
      nbytes = _align(box_size(c.box) * tp.itemsize)
      for side, (dev, dims) in enumerate(((x.src, s_dims), (x.dst, d_dims))):
        if not _contiguous(extent, dims):
          used = stage_use.get((dev, c.step), 0)
          packs[side] = used  # relative to the device's staging base, fixed below
          stage_use[(dev, c.step)] = used + nbytes
          stage_peak[dev] = max(stage_peak.get(dev, 0), used + nbytes)
    row = rows[i]
    row[:OP_FIXED] = (c.step, STAGE_CODES[x.stage], x.tensor, x.src, x.src_kind, s_slot,
                      x.dst, x.dst_kind, d_slot, packs[0], packs[1])
    for d in range(MAX_RANK):
      base = OP_FIXED + 3 * d
      if d < len(extent):
        lo = c.box[d][0]
        row[base:base + 3] = (extent[d], lo - s_origin[d], lo - d_origin[d])
      else:
        row[base:base + 3] = (1, 0, 0)
  # Staging sits after the full-tensor buffers of each device.
  if staging:
    for col, devcol in ((9, 3), (10, 6)):
      mask = rows[:, col] >= 0
      if mask.any():
        base = np.array([bufs.tmp_bytes.get(int(d), 0) for d in rows[mask, devcol]])
        rows[mask, col] += base
    for dev, peak in stage_peak.items():
      ws[dev] = ws.get(dev, 0) + peak
  n_steps = (max(c.step for c in chunks) + 1) if chunks else 0
  return rows, ws, n_steps


def workspace_bytes(plan: Plan, device: int | None = None, staging: bool = False) -> int:
  """Workspace a device needs (device=None: the largest over devices, for SPMD)."""
  _, ws, _ = _ops(plan, staging)
  if device is None:
    return max(ws.values(), default=0)
  return ws.get(device, 0)


def encode(plan: Plan, device: int | None = None, staging: bool = False) -> np.ndarray:
  """The `schedule` attribute for one device (eager dispatch) or every device (SPMD).

  Args:
    plan: the plan to run.
    device: the global id of the device the encoding is for; its ops only. None: all
      ops (one SPMD program for every device).
    staging: reserve workspace for pack/unpack of non-contiguous boxes (CUDA transport).

  Returns:
    A read-only 1-D int64 array (docs/schedule_format.md, version 1).
  """
  rows, ws, n_steps = _ops(plan, staging)
  if device is not None:
    rows = rows[(rows[:, 3] == device) | (rows[:, 6] == device)]
  devices = plan.devices
  tensors = np.zeros((len(plan.tensors), TENSOR_WIDTH), np.int64)
  for t, tp in enumerate(plan.tensors):
    shape = tp.src.shape
    tensors[t, 0] = tp.itemsize
    tensors[t, 1] = len(shape)
    tensors[t, 2:2 + len(shape)] = shape
  header = np.array([MAGIC, SCHEDULE_VERSION, len(plan.tensors), len(devices), n_steps,
                     len(rows), OP_WIDTH, MAX_RANK], np.int64)
  out = np.concatenate([
      header, np.array(devices, np.int64),
      np.array([ws.get(d, 0) for d in devices], np.int64),
      tensors.reshape(-1), rows.reshape(-1)]).astype(np.int64)
  out.flags.writeable = False
  return out


def decode(schedule: np.ndarray) -> dict:
  """Inverse of `encode`, for tests and debugging (the C++ decoder is the real one)."""
  a = np.asarray(schedule, np.int64)
  magic, version, n_tensors, n_devices, n_steps, n_ops, op_width, max_rank = a[:8]
  if magic != MAGIC or version != SCHEDULE_VERSION:
    raise ValueError(f"decode: bad magic/version {magic:#x}/{version}.")
  at = HEADER_WIDTH
  devices = a[at:at + n_devices]; at += n_devices
  ws = a[at:at + n_devices]; at += n_devices
  tensors = a[at:at + n_tensors * TENSOR_WIDTH].reshape(n_tensors, TENSOR_WIDTH)
  at += n_tensors * TENSOR_WIDTH
  ops = a[at:at + n_ops * op_width].reshape(n_ops, op_width)
  at += n_ops * op_width
  if at != len(a):
    raise ValueError(f"decode: {len(a) - at} trailing elements.")
  return {"version": int(version), "n_steps": int(n_steps), "devices": devices.tolist(),
          "ws": dict(zip(devices.tolist(), ws.tolist())), "tensors": tensors, "ops": ops}
