"""Benchmark data: deterministic, finite test tensors and bitwise comparison.

Owns how a case's global arrays are generated (the same bytes in every process that asks,
from a name-derived seed: the JAX process and the torch.distributed workers agree without
talking) and what "bitwise equal" means. numpy only: imported by spawned torch workers,
never touches JAX or devices.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint32")


def np_dtype(name: str) -> np.dtype:
  """The numpy dtype of a name in DTYPES (bfloat16 through ml_dtypes)."""
  if name not in DTYPES:
    raise ValueError(f"bench: dtype must be one of {DTYPES}; got {name!r}.")
  if name == "bfloat16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def _mantissa_bits(dtype: np.dtype) -> int | None:
  if dtype.kind != "f" and dtype.name != "bfloat16":
    return None
  try:
    return int(np.finfo(dtype).nmant)
  except (TypeError, ValueError):
    import ml_dtypes
    return int(ml_dtypes.finfo(dtype).nmant)


def seed_of(*names: str) -> int:
  """A stable 32-bit seed from names (case, tensor): equal in every process."""
  return zlib.crc32("/".join(names).encode())


def make_array(shape, dtype_name: str, seed: int) -> np.ndarray:
  """Random bits shaped as `dtype`, every value finite and normal (bitwise comparable).

  Floats: the top exponent bit is cleared (never inf/NaN) and the lowest exponent bit set
  (never subnormal), so no copy path can canonicalize or flush a value; integers: raw
  random bits. About 1-2 GB/s on one core.
  """
  dtype = np_dtype(dtype_name)
  n = math.prod(shape)
  k = dtype.itemsize
  words = -(-n * k // 8)
  raw = np.random.PCG64(seed).random_raw(max(1, words))
  bits = raw.view(f"<u{k}")[:n]
  nmant = _mantissa_bits(dtype)
  if nmant is not None:
    top = 8 * k - 2
    ubits = np.dtype(f"<u{k}").type
    bits &= ubits(((1 << (8 * k)) - 1) ^ (1 << top))
    bits |= ubits(1 << nmant)
  return bits.view(dtype).reshape(shape)


def bits_view(a: np.ndarray) -> np.ndarray:
  """`a` viewed as unsigned ints of its itemsize (no copy), for bitwise comparison."""
  k = a.dtype.itemsize
  if k in (1, 2, 4, 8):
    return a.view(f"u{k}") if a.ndim else a.reshape(1).view(f"u{k}")
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def same_bits(actual: np.ndarray, expected: np.ndarray) -> bool:
  """Whether two arrays have the same shape, dtype and bytes."""
  if actual.shape != expected.shape or actual.dtype != expected.dtype:
    return False
  return bool(np.array_equal(bits_view(actual), bits_view(expected)))


def describe_mismatch(actual: np.ndarray, expected: np.ndarray) -> str:
  """A short description of how two arrays differ (for an 'invalid' result)."""
  if actual.shape != expected.shape or actual.dtype != expected.dtype:
    return (f"got {actual.dtype}{list(actual.shape)}, expected "
            f"{expected.dtype}{list(expected.shape)}")
  diff = np.argwhere(bits_view(actual) != bits_view(expected))
  where = tuple(int(v) for v in diff[0]) if len(diff) else ()
  return f"{len(diff)} of {actual.size} elements differ; first at {where}"
