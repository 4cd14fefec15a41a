"""Cases shared by the local data plane's tests (tests/local_copy_test.py on CPU,
tests/gpu_local_test.py on a GPU, tests/local_worker.py's programs): random layouts of
a global array cut into source shards, the boxes that fill output regions from them,
every value of each fused type, and bitwise comparison."""

from __future__ import annotations

import subprocess
import time

import ml_dtypes
import numpy as np

from jax_m2n._src.local_copy import Box

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FUSED = (F32, F16, BF16, E4M3, E5M2)
PAIRS = [(a, b) for a in FUSED for b in FUSED if a != b]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x: np.ndarray) -> np.ndarray:
  """The bytes of each element, comparable with ==, whatever the dtype."""
  x = np.ascontiguousarray(x)
  if x.dtype.itemsize in UINT:
    return x.view(UINT[x.dtype.itemsize])
  return x.view(np.uint8).reshape(*x.shape, x.dtype.itemsize)  # complex128: 16 bytes


def random_values(rng, shape, dtype) -> np.ndarray:
  """Random bit patterns of `dtype` (every class of float value included)."""
  n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = rng.integers(0, 256, n, dtype=np.uint8)
  if dtype == np.dtype(bool):
    raw &= 1
  return raw.view(dtype).reshape(shape)


def cut(rng, shape, pieces):
  """A random guillotine partition of a box of `shape` into about `pieces` boxes:
  [(start, extent)]."""
  boxes = [((0,) * len(shape), tuple(shape))]
  for _ in range(pieces - 1):
    i = int(rng.integers(len(boxes)))
    start, extent = boxes[i]
    dims = [d for d in range(len(shape)) if extent[d] > 1]
    if not dims:
      continue
    d = int(rng.choice(dims))
    at = int(rng.integers(1, extent[d]))
    a = (start, extent[:d] + (at,) + extent[d + 1:])
    b = (start[:d] + (start[d] + at,) + start[d + 1:],
         extent[:d] + (extent[d] - at,) + extent[d + 1:])
    boxes[i:i + 1] = [a, b]
  return boxes


def case(rng, src_dtype, out_dtypes, rank=None):
  """A random layout: (sources [(start, array)], outputs [(start, shape, dtype)], boxes,
  global array). Outputs are random regions (possibly empty) of the global array."""
  rank = int(rng.integers(0, 5)) if rank is None else rank
  shape = tuple(int(d) for d in rng.integers(1, 7, rank))
  full = random_values(rng, shape, src_dtype)
  sources = []
  for start, extent in cut(rng, shape, int(rng.integers(1, 6))):
    region = tuple(slice(s, s + e) for s, e in zip(start, extent))
    sources.append((start, np.array(full[region], order="C")))  # keeps rank 0
  outputs = []
  for dtype in out_dtypes:
    lo = [int(rng.integers(0, d + 1)) for d in shape]
    hi = [int(rng.integers(l, d + 1)) for l, d in zip(lo, shape)]
    if rng.random() < 0.5:
      lo, hi = [0] * rank, list(shape)
    out_shape = tuple(h - l for l, h in zip(lo, hi))
    outputs.append((tuple(lo), out_shape, dtype))
  boxes = fill_boxes(sources, outputs, keep_empty=True)
  rng.shuffle(boxes)
  return sources, outputs, boxes, full


def fill_boxes(sources, outputs, keep_empty=False):
  """The boxes filling each output region from the source shards it meets; with
  `keep_empty`, also the empty boxes of shards that only touch it (they copy nothing)."""
  boxes = []
  for o, (lo, out_shape, _) in enumerate(outputs):
    for slot, (start, src) in enumerate(sources):
      a = [max(x, y) for x, y in zip(start, lo)]
      b = [min(x + n, y + m) for x, n, y, m in zip(start, src.shape, lo, out_shape)]
      if any(j < i for i, j in zip(a, b)) or (
          not keep_empty and any(j == i for i, j in zip(a, b))):
        continue
      boxes.append(Box(o, slot, src.shape, src.dtype, tuple(i - s for i, s in zip(a, start)),
                       tuple(i - l for i, l in zip(a, lo)),
                       tuple(j - i for i, j in zip(a, b))))
  return boxes


def all_values(dtype, rng) -> np.ndarray:
  """Every value of a 1- or 2-byte type; for f32, random bit patterns plus values next
  to every rounding boundary of the narrow types. Shape (n, 64)."""
  if dtype.itemsize < 4:
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32).astype(UINT[dtype.itemsize])
  else:
    near = np.arange(-(1 << 15), 1 << 15, dtype=np.int64).astype(np.uint32) << 13
    bits = np.concatenate([rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint32), near,
                           near + 1, near - 1])
  return bits[: bits.size // 64 * 64].view(dtype).reshape(-1, 64)


def min_ms(fn, n=10) -> float:
  """The fastest of `n` runs of `fn`, in milliseconds."""
  best = float("inf")
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best * 1e3


def end(proc: subprocess.Popen, timeout_s: float) -> None:
  """Closes a worker's stdin (its cue to exit) and waits for it; killed past
  `timeout_s`."""
  proc.stdin.close()
  try:
    proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
