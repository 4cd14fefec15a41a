"""The arithmetic of a quantized reshard: qwix's absmax quantization, the same on every layout.

Owns the per-tile computation (absmax, scale, FP8 values) and the compiled program that
runs it on the source devices. Knows nothing of plans or shardings beyond jit's
out_shardings; never moves data between devices.

Why not just call qwix's code under jit: XLA compiles qwix's two divisions differently
by the shape each device holds. A division by a broadcast divisor (absmax / qmax with
more than one scale; x / broadcast(scale)) becomes a multiplication by the divisor's
reciprocal on XLA:CPU, a division by a constant (qmax inside jit) always does, and one
with nothing to broadcast stays a division; and XLA:CPU's max reductions over several
axes drop NaN. So qwix's own result depends on the layout (`tests/quantize_test.py`
shows one). The reference here is qwix on the unsharded array on the same platform:
each step below is written so that XLA has no choice left (the platform's division
rule probed once, constants behind optimization barriers, NaN carried by an `any`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def generic_broadcast(op: Callable, x: jax.Array, y: jax.Array) -> jax.Array:
  """qwix's call_with_generic_broadcast: y's axis of size a // tile meets x's a."""
  x_shape, y_shape, o_shape = [], [], []
  for a, b in zip(x.shape, y.shape):
    o_shape.append(max(a, b))
    if a == b or a == 1 or b == 1:
      x_shape.append(a)
      y_shape.append(b)
    elif a % b == 0:
      x_shape.extend((b, a // b))
      y_shape.extend((b, 1))
    else:
      x_shape.extend((a, 1))
      y_shape.extend((a, b // a))
  return op(x.reshape(x_shape), y.reshape(y_shape)).reshape(o_shape)


# How XLA divides by a broadcast divisor, per platform and dtype (qwix's absmax / qmax
# and x / broadcast(scale) compile to this): "exact" (a true division), "reciprocal"
# (times 1 / b rounded to the dtype) or "reciprocal_f32" (times 1 / b kept in f32: a
# bf16 reciprocal whose rounding XLA:CPU elides). Measured once per platform and dtype.
RULES = ("exact", "reciprocal", "reciprocal_f32")


def _wide(dtype: np.dtype) -> type:
  return np.float64 if np.dtype(dtype).itemsize == 8 else np.float32


def _candidates(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> dict[str, np.ndarray]:
  wide = _wide(dtype)
  one = np.array(1, dtype)
  return {"exact": (a.astype(wide) / b.astype(wide)).astype(dtype),
          "reciprocal": (a.astype(wide) * (one / b).astype(wide)).astype(dtype),
          "reciprocal_f32": (a.astype(wide) * (wide(1) / b.astype(wide))).astype(dtype)}


def _probe_values(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
  """Dividends (and the divisor 448) on which the rules that differ for `dtype` give
  different quotients."""
  dtype = np.dtype(dtype)
  rng = np.random.default_rng(0)
  a = (rng.standard_normal(1 << 14) * 4).astype(dtype)
  b = np.array(448, dtype)
  c = _candidates(a, b, dtype)
  keep = np.zeros(a.shape, bool)
  for i, r in enumerate(RULES):
    for s in RULES[i + 1:]:
      differ = c[r].view(np.uint8).reshape(a.size, -1) != c[s].view(np.uint8).reshape(
          a.size, -1)
      differ = differ.any(axis=1)
      keep[np.argmax(differ)] |= differ.any()
  return np.resize(a[keep], 64), b  # 64 elements: a broadcast XLA rewrites


@functools.lru_cache(maxsize=None)
def divide_rule(platform: str, dtype: np.dtype) -> str:
  """The rule (one of RULES) XLA on `platform` follows for `a / broadcast(b)` in
  `dtype`, the first that matches. XLA:CPU in jax 0.10.2: "reciprocal" for float16,
  float32 and float64; for bfloat16 its f32 reciprocal gives the true quotient on every
  pair of mantissas (checked exhaustively), so "exact" matches first."""
  dtype = np.dtype(dtype)
  a, b = _probe_values(dtype)
  with jax.ensure_compile_time_eval():
    device = jax.devices(platform)[0]
    got = np.asarray(jax.jit(jnp.divide)(jax.device_put(a, device),
                                         jax.device_put(b, device)))
  for rule, want in _candidates(a, b, dtype).items():
    if got.tobytes() == want.tobytes():
      return rule
  logging.getLogger("jax_m2n").warning(
      "quantize: XLA on %s divides %s by a broadcast divisor by none of %s (got %s for "
      "%s / %s); quantizing with true divisions, which may differ from qwix's result "
      "in the last bit.", platform, dtype, RULES, got, a, b)
  return "exact"


def _divide(a: jax.Array, b: jax.Array, rule: str, broadcast: Callable) -> jax.Array:
  """a / broadcast(b) by `rule` (b small: its reciprocal is materialized)."""
  if rule == "exact":
    return broadcast(jnp.divide, a, b)
  if rule == "reciprocal":
    return broadcast(jnp.multiply, a, _rounded(1 / b))
  wide = _wide(a.dtype)
  return broadcast(jnp.multiply, a.astype(wide), _rounded(1 / b.astype(wide))).astype(
      a.dtype)


def _rounded(*arrays):
  """The arrays as stored in their dtype (no excess precision carried past here):
  small scale-sized arrays only."""
  out = jax.lax.optimization_barrier(arrays)
  return out if len(arrays) > 1 else out[0]


def quantize_arrays(x: jax.Array, leaf: Any, platform: str) -> tuple[jax.Array, jax.Array]:
  """(qvalue, scale) of x as qwix.quantize(x, ...) makes them on one device of
  `platform` (absmax calibration; `leaf` is quantize._Leaf).

  absmax per tile (NaN where the tile holds a NaN: numpy's max); scale = absmax / qmax
  (1 where below sqrt(tiny): all-zero tiles), rounded up to a power of two for mxfp8,
  then in scale_dtype; values x / scale clipped to the qtype's range and cast. Every
  step in x's dtype, as qwix. Runs on whatever layout x has: under jit with x sharded,
  each device reduces its own elements and XLA combines the partial maxima of tiles
  that span shards (max is exact and order-free).
  """
  split, reduce_axes = [], []
  for (kind, tile), dim in zip(leaf.axes, leaf.shape):
    if kind == "tile":
      split.extend((dim // tile, tile))
    else:
      split.append(dim)
    if kind != "keep":
      reduce_axes.append(len(split) - 1)
  axes = tuple(reduce_axes)
  magnitude = jnp.abs(x.reshape(split))
  nan = jnp.isnan(magnitude)
  absmax = jnp.max(jnp.where(nan, jnp.zeros_like(magnitude), magnitude), axis=axes,
                   keepdims=True)
  absmax = jnp.where(jnp.any(nan, axis=axes, keepdims=True), jnp.full_like(absmax, jnp.nan),
                     absmax).reshape(leaf.scale_shape)
  dtype, qtype = x.dtype, leaf.qdtype
  qmax = float(jnp.finfo(qtype).max)
  rule = divide_rule(platform, np.dtype(dtype))
  if absmax.size > 1:  # qwix's absmax / qmax divides by a broadcast qmax
    scale = _divide(absmax, np.array(qmax, dtype), rule,
                    lambda op, a, b: op(a, jnp.asarray(b)))
  else:  # nothing to broadcast: a true division, qmax kept from constant folding
    absmax, divisor = _rounded(absmax, jnp.full(absmax.shape, qmax, dtype))
    scale = absmax / divisor
  scale = _rounded(scale)
  tiny_sqrt = jnp.sqrt(jnp.finfo(dtype).tiny)
  scale = jnp.where(scale < tiny_sqrt, jnp.ones_like(scale), scale)
  if leaf.kind == "mxfp8":
    log2_scale = jnp.ceil(_rounded(jnp.log2(_rounded(scale))))
    scale = (2**log2_scale).astype(dtype)
  scale = _rounded(scale.astype(dtype))
  if x.size == scale.size:  # one element per scale: qwix's division has no broadcast
    qvalue = x / scale.reshape(x.shape)
  else:
    qvalue = _divide(x, scale, rule, generic_broadcast)
  finfo = jnp.finfo(qtype)
  qvalue = qvalue.clip(finfo.min.astype(dtype), finfo.max.astype(dtype))
  return qvalue.astype(qtype), scale.astype(leaf.scale_dtype)


@functools.lru_cache(maxsize=256)
def program(leaves: tuple[Any, ...], out_shardings: tuple[Any, ...],
            platform: str) -> Callable:
  """One compiled program quantizing a group of leaves on their (common) devices, each
  output in its given layout. Excess precision is off: every bf16/f16 step rounds as
  qwix's eager ops do."""
  def body(xs):
    return tuple(quantize_arrays(x, leaf, platform) for x, leaf in zip(xs, leaves))
  return jax.jit(body, out_shardings=out_shardings,
                 compiler_options={"xla_allow_excess_precision": False})
