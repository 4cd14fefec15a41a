"""Quantized reshards: `reshard(x, dst, dtype=Quantize(...))`, FP8 values and scales on the wire.

Owns the quantization spec (`Quantize`), the quantized leaf without qwix
(`QuantizedArray`), the arithmetic (qwix 0.1.8's `quantize_api` with absmax
calibration, op for op), the planning of scales (shape and sharding per layout) and the
expansion of one call into one plain reshard of values + scales. Quantizes on the
source layout; moves only through `api.reshard` (passed in: no import of api here).
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import types
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jax_m2n._src import jax_compat
from jax_m2n._src import quantize_numerics as numerics
from jax_m2n._src.checks import (LazyName, as_dtype, broadcast_prefix, donate_flags,
                                 dst_sharding_of, dtypes_per_leaf, is_dtype_leaf,
                                 leaf_aval, names_once, normalize_dst)
from jax_m2n._src.errors import ReshardTypeError, ReshardValueError

QTYPES = ("float8_e4m3fn", "float8_e5m2", "mxfp8")
# The leaf dtypes qwix quantizes (numerics.should_quantize).
_SOURCE_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, np.float16, np.float32,
                                              np.float64))
_STORAGE = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
            "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
            "mxfp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_MX_TILE = 32  # qwix's (and OCP MX's) block size for mxfp8


# ---------------------------------------------------------------------------------------
# The spec and the quantized leaf
# ---------------------------------------------------------------------------------------

class Quantize:
  """A quantization spec for `jax_m2n.reshard(..., dtype=...)` (and `jax_m2n.plan`).

  Passed as `dtype=` (alone, or as leaves of a pytree prefix of x mixed with plain
  dtypes and None), it makes each leaf it covers arrive as a quantized array equal, bit
  for bit, to `qwix.quantize(jax.device_put(x, dst), qtype, tiled_axes=...,
  channelwise_axes=..., scale_dtype=...)` (qwix's `quantize_api`, absmax calibration):
  a `qwix.QArray` where qwix is installed (`pip install jax_m2n[qwix]`), else a
  `jax_m2n.QuantizedArray` with the same fields. The absmax, the scales and the FP8
  values are computed on the source layout; the FP8 values and the scales are what
  cross the links (one plan); no full-size temporary is made on the destination.

  Axes (negative ones count from the end, per leaf): each axis in `tiled_axes` gets one
  scale per tile of that size (an int; a float `f` means `round(dim * f)`, qwix's
  "1 / tile count"), each in `channelwise_axes` one scale per index, every other axis
  shares its scale (no axes at all: one scale per tensor). `mxfp8` needs tiles of 32.

  Args:
    qtype: "float8_e4m3fn", "float8_e5m2" (or those numpy/jnp dtypes) or "mxfp8"
      (e4m3fn values, power-of-two scales, tiles of 32).
    tiled_axes: a mapping axis -> tile size.
    channelwise_axes: axes with one scale per index.
    scale_dtype: the dtype of the scales (None: the leaf's dtype, as qwix).

  The rules that depend on a leaf (its dtype must be bfloat16, float16, float32 or
  float64; axes in range; tiles dividing the shape; a known qtype) are checked by
  reshard/plan per leaf, before any data moves, naming the leaf.

  Example:
    >>> spec = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={0: 128, 1: 128})
    >>> spec
    Quantize('float8_e4m3fn', tiled_axes={0: 128, 1: 128}, channelwise_axes=(), scale_dtype=None)
  """

  __slots__ = ("qtype", "tiled_axes", "channelwise_axes", "scale_dtype", "_key")

  def __init__(self, qtype: Any, *, tiled_axes: Mapping[int, int | float] | None = None,
               channelwise_axes: Any = (), scale_dtype: Any = None):
    if tiled_axes is None:
      tiled_axes = {}
    if not isinstance(tiled_axes, Mapping):
      raise ReshardTypeError(
          "Quantize: tiled_axes must be a mapping axis -> tile size; got "
          f"{type(tiled_axes).__name__} {tiled_axes!r}.")
    for a, t in tiled_axes.items():
      if not _is_int(a) or isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise ReshardTypeError(
            "Quantize: tiled_axes must map int axes to int (or float) tile sizes; got "
            f"{a!r}: {t!r}.")
    try:
      channelwise = tuple(channelwise_axes)
    except TypeError:
      channelwise = None
    if channelwise is None or not all(_is_int(a) for a in channelwise):
      raise ReshardTypeError(
          "Quantize: channelwise_axes must be a sequence of int axes; got "
          f"{type(channelwise_axes).__name__} {channelwise_axes!r}.")
    if scale_dtype is not None:
      scale_dtype = as_dtype("Quantize", scale_dtype)
      if not jnp.issubdtype(scale_dtype, jnp.floating):
        raise ReshardTypeError(
            f"Quantize: scale_dtype must be a floating dtype or None; got {scale_dtype}.")
    try:
      hash(qtype)
    except TypeError:
      raise ReshardTypeError(
          f"Quantize: qtype must be one of {QTYPES} (a name or a dtype); got "
          f"{type(qtype).__name__} {qtype!r}.") from None
    tiled = {int(a): t for a, t in tiled_axes.items()}
    set_ = object.__setattr__
    set_(self, "qtype", qtype)
    set_(self, "tiled_axes", types.MappingProxyType(tiled))
    set_(self, "channelwise_axes", tuple(int(a) for a in channelwise))
    set_(self, "scale_dtype", scale_dtype)
    set_(self, "_key", (type(qtype), qtype, tuple(sorted(tiled.items())),
                        self.channelwise_axes, scale_dtype))

  def __setattr__(self, name, value):
    raise AttributeError(f"Quantize is immutable; cannot set {name}.")

  def __eq__(self, other):
    return isinstance(other, Quantize) and self._key == other._key

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):
    return (f"Quantize({self.qtype!r}, tiled_axes={dict(self.tiled_axes)}, "
            f"channelwise_axes={self.channelwise_axes}, scale_dtype="
            f"{None if self.scale_dtype is None else self.scale_dtype.name!r})")


def _is_int(v: Any) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@jax.tree_util.register_pytree_node_class
class QuantizedArray:
  """A quantized array: what a quantized reshard returns where qwix is not installed.

  The fields are qwix's `QArray`'s: `qvalue` (the FP8 values, in the destination
  layout), `scale` (one per tile: `qvalue.shape[i] // scale.shape[i]` elements of axis
  i share one; sharded so that each destination device holds the scales of its own
  shard, or replicated along an axis whose shards do not end on tile boundaries),
  `zero_point` (always None: symmetric quantization) and `qtype` (the spec's qtype).
  A pytree node with children (qvalue, scale, zero_point) and `qtype` as static data,
  like qwix's; `dequantize()` gives `qvalue * scale` in the scale's dtype.
  """

  __slots__ = ("qvalue", "scale", "zero_point", "qtype")

  def __init__(self, qvalue, scale, zero_point=None, qtype=None):
    self.qvalue, self.scale, self.zero_point = qvalue, scale, zero_point
    self.qtype = qvalue.dtype if qtype is None else qtype

  shape = property(lambda self: self.qvalue.shape)
  ndim = property(lambda self: self.qvalue.ndim)
  dtype = property(lambda self: self.scale.dtype)

  def dequantize(self) -> jax.Array:
    """`qvalue` times its scales, in the scale's dtype (qwix.dequantize's arithmetic)."""
    q = self.qvalue.astype(self.scale.dtype)
    return numerics.generic_broadcast(jnp.multiply, q, self.scale)

  def tree_flatten(self):
    return (self.qvalue, self.scale, self.zero_point), self.qtype

  @classmethod
  def tree_unflatten(cls, qtype, children):
    return cls(*children, qtype=qtype)

  def __repr__(self):
    return (f"QuantizedArray(qvalue={self.qvalue!r}, scale={self.scale!r}, "
            f"qtype={self.qtype!r})")


@functools.lru_cache(maxsize=1)
def _qarray_type() -> Any:
  """qwix.QArray where qwix is installed, else None (imported once, on first use)."""
  try:
    import qwix  # noqa: PLC0415 - optional, and slow to import (flax)
  except ImportError:
    return None
  return qwix.QArray


def _wrap(qvalue, scale, qtype) -> Any:
  qarray = _qarray_type()
  if qarray is not None:
    return qarray(qvalue, scale, None, qtype)
  return QuantizedArray(qvalue, scale, None, qtype)


# ---------------------------------------------------------------------------------------
# Per leaf: the resolved spec (checked against the leaf) and the scale layouts
# ---------------------------------------------------------------------------------------

class _Leaf(NamedTuple):
  """One quantized leaf's spec resolved against its shape and dtype (hashable).

  axes: per dim ("keep", 1) channelwise, ("tile", t) tiled, ("all", dim) shared.
  """
  qtype: Any          # the spec's qtype, as the QArray carries it
  kind: str           # one of QTYPES
  dtype: np.dtype     # the leaf's
  shape: tuple[int, ...]
  axes: tuple[tuple[str, int], ...]
  scale_dtype: np.dtype

  @property
  def qdtype(self) -> np.dtype:
    return _STORAGE[self.kind]

  @property
  def tiles(self) -> tuple[int, ...]:
    """Elements of each axis that share one scale."""
    return tuple(t for _, t in self.axes)

  @property
  def scale_shape(self) -> tuple[int, ...]:
    return tuple(d // t for d, t in zip(self.shape, self.tiles))


def _qtype_kind(qtype: Any) -> str | None:
  if isinstance(qtype, str) and qtype == "mxfp8":
    return "mxfp8"
  try:
    dt = np.dtype(qtype)
  except Exception:  # noqa: BLE001 - numpy raises several types
    return None
  for kind in ("float8_e4m3fn", "float8_e5m2"):
    if dt == _STORAGE[kind]:
      return kind
  return None


_NAME = "\x00leaf\x00"  # where a message names the leaf: filled in only on failure


def resolve(api: str, names: Callable[[], list[str]], i: int, spec: Quantize,
             shape: tuple[int, ...], dtype: np.dtype) -> _Leaf:
  """The spec checked against leaf i (every rule; the message names the leaf)."""
  try:
    return _resolve_cached(api, spec, shape, dtype)
  except (ReshardTypeError, ReshardValueError) as e:
    raise type(e)(str(e).replace(_NAME, names()[i])) from None


@functools.lru_cache(maxsize=4096)  # a refit resolves the same leaves every step
def _resolve_cached(api: str, spec: Quantize, shape: tuple[int, ...],
                    dtype: np.dtype) -> _Leaf:
  name = _NAME
  kind = _qtype_kind(spec.qtype)
  if kind is None:
    raise ReshardValueError(
        f"{api}: the qtype of the Quantize spec for {name} must be one of {QTYPES}; got "
        f"{spec.qtype!r}.")
  if dtype not in _SOURCE_DTYPES:
    raise ReshardTypeError(
        f"{api}: {name} quantized with dtype=Quantize(...) must be bfloat16, float16, "
        f"float32 or float64 (what qwix quantizes); got {dtype}.")
  rank = len(shape)
  if math.prod(shape) == 0:
    raise ReshardValueError(
        f"{api}: {name} quantized with dtype=Quantize(...) must not be empty (absmax "
        f"has no value); got shape {shape}.")

  def axis_of(a: int, what: str) -> int:
    if not -rank <= a < rank:
      raise ReshardValueError(
          f"{api}: the {what} of the Quantize spec for {name} must be axes of its shape "
          f"{shape}; got axis {a}.")
    return a % rank

  tiled = {}
  for a, t in spec.tiled_axes.items():
    axis = axis_of(a, "tiled_axes")
    if axis in tiled:
      raise ReshardValueError(
          f"{api}: the tiled_axes of the Quantize spec for {name} must name each axis "
          f"once; got {dict(spec.tiled_axes)} (axis {axis} twice).")
    size = round(shape[axis] * t) if isinstance(t, float) else int(t)
    if size <= 0 or shape[axis] % size:
      raise ReshardValueError(
          f"{api}: the tile size of axis {axis} of {name} must divide its size "
          f"{shape[axis]}; got {t!r} (shape {shape}, tiled_axes "
          f"{dict(spec.tiled_axes)}).")
    if kind == "mxfp8" and t != _MX_TILE:
      raise ReshardValueError(
          f"{api}: mxfp8 tiles of {name} must have {_MX_TILE} elements (qwix's MX block "
          f"size); got {t!r} on axis {axis}.")
    tiled[axis] = size
  if kind == "mxfp8" and not tiled:
    raise ReshardValueError(
        f"{api}: an mxfp8 Quantize spec for {name} must tile at least one axis "
        f"(tiled_axes={{axis: {_MX_TILE}}}); got none.")
  channel = set()
  for a in spec.channelwise_axes:
    axis = axis_of(a, "channelwise_axes")
    if axis in tiled:
      raise ReshardValueError(
          f"{api}: an axis of {name} must be tiled or channelwise, not both; got axis "
          f"{axis} in both.")
    channel.add(axis)
  axes = tuple(("keep", 1) if i in channel else ("tile", tiled[i]) if i in tiled
               else ("all", d) for i, d in enumerate(shape))
  scale_dtype = dtype if spec.scale_dtype is None else spec.scale_dtype
  return _Leaf(spec.qtype, kind, dtype, tuple(shape), axes, scale_dtype)


def scale_sharding(sharding: Sharding, leaf: _Leaf) -> Sharding:
  """The layout of a leaf's scales beside values laid out by `sharding`.

  Each device gets the scales of the tiles its own shard covers: a NamedSharding's
  spec is kept on every axis whose shards end on tile boundaries (the axis size and its
  shard size divisible by the shard count and the tile); an axis whose shards cut
  through tiles, and axes with one shared scale, are replicated (each device then holds
  every scale along that axis: at most 1/tile of the values' elements). One device:
  there. Other sharding types: every scale on every device of the sharding.
  """
  if isinstance(sharding, SingleDeviceSharding):
    return sharding
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
    entries = []
    for entry, dim, tile in zip(spec, leaf.shape, leaf.tiles):
      names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
      k = math.prod(sharding.mesh.shape[a] for a in names)
      aligned = k > 1 and tile < dim and dim % k == 0 and (dim // k) % tile == 0
      entries.append(entry if aligned else None)
    return NamedSharding(sharding.mesh, PartitionSpec(*entries),
                         memory_kind=sharding.memory_kind)
  devices = np.array(jax_compat.device_assignment(sharding))
  return NamedSharding(jax.sharding.Mesh(devices, ("devices",)), PartitionSpec(),
                       memory_kind=sharding.memory_kind)


# ---------------------------------------------------------------------------------------
# The call: expand quantized leaves into (values, scales), one plain reshard, wrap
# ---------------------------------------------------------------------------------------

def _is_spec_leaf(v: Any) -> bool:
  return is_dtype_leaf(v) or isinstance(v, Quantize)


def has_spec(dtype: Any) -> bool:
  """Whether a `dtype=` argument holds a Quantize spec (cheap for plain dtypes)."""
  if dtype is None or isinstance(dtype, (np.dtype, type, str)):
    return False
  if isinstance(dtype, Quantize):
    return True
  return any(isinstance(v, Quantize)
             for v in jax.tree_util.tree_leaves(dtype, is_leaf=_is_spec_leaf))


def spec_leaves(api: str, dtype: Any, x: Any, treedef, n: int,
                x_name: str = "x") -> list[Any]:
  """One entry per leaf of x: a Quantize, a dtype or None (checks.dtypes_per_leaf' rule)."""
  return dtypes_per_leaf(api, dtype, x, treedef, n, is_leaf=_is_spec_leaf,
                     convert=lambda v: v if isinstance(v, Quantize) else as_dtype(api, v),
                     what="one dtype or Quantize", x_name=x_name)


def _leaf_info(api: str, name: str, leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
  aval = leaf_aval(api, name, leaf)
  if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
    raise ReshardTypeError(
        f"{api}: {name} quantized with dtype=Quantize(...) must be bfloat16, float16, "
        f"float32 or float64 (what qwix quantizes); got {aval.dtype}.")
  return tuple(aval.shape), np.dtype(aval.dtype)


def _per_leaf(api: str, x: Any, dst_sharding: Any, src_sharding: Any, dtype: Any):
  """x's leaves, treedef and names, with per leaf its spec (Quantize, dtype or None),
  destination and src_sharding (prefixes broadcast as reshard does)."""
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  names = names_once(x)
  specs = spec_leaves(api, dtype, x, treedef, n)
  dsts = broadcast_prefix(api, "dst_sharding", dst_sharding, x, treedef, n)
  srcs = ([None] * n if src_sharding is None else
          broadcast_prefix(api, "src_sharding", src_sharding, x, treedef, n))
  return leaves, treedef, names, specs, dsts, srcs


def reshard(move: Callable[..., Any], x: Any, dst_sharding: Any, dtype: Any, *,
            route: str, topology: Any, donate: Any, src_sharding: Any,
            timeout_s: Any, chunk_bytes: Any) -> Any:
  """`api.reshard` with Quantize specs in `dtype` (`move` is api.reshard itself).

  Every leaf covered by a spec is checked (naming it), then quantized where it lives:
  eagerly by one compiled program per source device set (committed arrays; host data
  and uncommitted arrays are first put on the destination, as reshard hands them to
  jax.device_put), inside jit in the traced program. Then one `move` call takes every
  plain leaf, every value array to its destination and every scale array to
  `scale_sharding(destination)`, and each quantized leaf is returned as a QArray.
  """
  api = "reshard"
  leaves, treedef, names, specs, dsts, srcs = _per_leaf(api, x, dst_sharding,
                                                        src_sharding, dtype)
  n = len(leaves)
  flags = donate_flags(api, donate, x, treedef, n)
  traced = (not jax_compat.trace_state_clean()) or any(
      isinstance(v, jax.core.Tracer) for v in leaves)
  plans = {}  # leaf index -> (_Leaf, dst Sharding or None)
  for i, spec in enumerate(specs):
    if not isinstance(spec, Quantize):
      continue
    shape, leaf_dtype = _leaf_info(api, LazyName(names, i), leaves[i])
    leaf = resolve(api, names, i, spec, shape, leaf_dtype)
    dst = dsts[i]
    if dst is not None:
      dst = dst_sharding_of(api, LazyName(names, i), dst, shape, leaf.qdtype)
    plans[i] = (leaf, dst)
  # Quantize where each leaf lives: committed arrays grouped by device assignment.
  quantized: dict[int, tuple[Any, Any]] = {}
  direct: dict[int, Any] = {}  # host data: quantized on its destination, not moved
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, (leaf, dst) in plans.items():
    v = leaves[i]
    if traced:
      quantized[i] = numerics.quantize_arrays(jnp.asarray(v), leaf, _platform(dst))
    elif isinstance(v, jax.Array) and v.committed:
      key = tuple(d.id for d in jax_compat.device_assignment(v.sharding))
      groups.setdefault(key, []).append(i)
    else:  # as reshard: host data and uncommitted arrays go through jax.device_put
      put = jax.device_put(v, dst)
      direct[i] = _run_program([put], [leaf])[0]
  for members in groups.values():
    outs = _run_program([leaves[i] for i in members], [plans[i][0] for i in members])
    quantized.update(zip(members, outs))
  # One plain reshard: plain leaves, then (values, scales) of each quantized leaf.
  # An array at several leaves of x is never donated (as jax.device_put; the eager
  # rule, eager/delegate._donatable): the plain call sees only some of its leaves.
  count = collections.Counter(id(v) for v in leaves)
  flags = [f and count[id(v)] == 1 for f, v in zip(flags, leaves)]
  in_leaves, in_dsts, in_srcs, in_dtypes, in_flags, slots = [], [], [], [], [], []
  for i in range(n):
    if i in direct:
      continue
    if i not in plans:
      slots.append(i)
      in_leaves.append(leaves[i])
      in_dsts.append(dsts[i])
      in_srcs.append(srcs[i])
      in_dtypes.append(specs[i])
      in_flags.append(flags[i])
      continue
    leaf, dst = plans[i]
    qvalue, scale = quantized[i]
    slots.append(i)
    in_leaves += [qvalue, scale]
    in_dsts += [dst, None if dst is None else scale_sharding(dst, leaf)]
    src = srcs[i]
    in_srcs += [src, None if src is None else scale_sharding(
        normalize_dst(api, LazyName(names, i), src), leaf)]
    in_dtypes += [None, None]
    in_flags += [False, False]  # ours: dropped when this call returns
  moved = move(in_leaves, in_dsts, route=route, topology=topology,
               donate=in_flags if any(in_flags) else False,
               src_sharding=None if all(s is None for s in in_srcs) else in_srcs,
               timeout_s=timeout_s, chunk_bytes=chunk_bytes,
               dtype=None if all(d is None for d in in_dtypes) else in_dtypes)
  outs: list[Any] = [None] * n
  pos = 0
  for i in slots:
    if i in plans:
      outs[i] = _wrap(moved[pos], moved[pos + 1], plans[i][0].qtype)
      pos += 2
    else:
      outs[i] = moved[pos]
      pos += 1
  for i, (qvalue, scale) in direct.items():
    outs[i] = _wrap(qvalue, scale, plans[i][0].qtype)
  if not traced:  # a donated quantized source: deleted once everything has moved
    for i in plans:
      if flags[i] and isinstance(leaves[i], jax.Array) and i not in direct:
        leaves[i].delete()
  return jax.tree_util.tree_unflatten(treedef, outs)


def _run_program(xs: list[jax.Array], leaves: list[_Leaf]) -> list[tuple[Any, Any]]:
  """Quantizes arrays of one device assignment in one compiled program, on their own
  layouts: the values keep each array's sharding, the scales get `scale_sharding`."""
  outs = tuple((x.sharding, scale_sharding(x.sharding, leaf))
               for x, leaf in zip(xs, leaves))
  platform = next(iter(xs[0].sharding.device_set)).platform
  return list(numerics.program(tuple(leaves), outs, platform)(tuple(xs)))


def quantize_where_they_live(arrays: Sequence[jax.Array], leaves: Sequence[_Leaf]
                             ) -> list[Any]:
  """Each array quantized on its own layout (`leaves[i]`: its resolved spec, from
  `resolve`), as a QArray: one compiled program per device assignment. The jobs layer
  quantizes a pulled leaf this way, on the dst layout it arrived in."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, x in enumerate(arrays):
    key = tuple(d.id for d in jax_compat.device_assignment(x.sharding))
    groups.setdefault(key, []).append(i)
  out: list[Any] = [None] * len(arrays)
  for members in groups.values():
    for i, (qvalue, scale) in zip(members, _run_program(
        [arrays[i] for i in members], [leaves[i] for i in members])):
      out[i] = _wrap(qvalue, scale, leaves[i].qtype)
  return out


def _platform(sharding: Any) -> str:
  """The platform a traced leaf is quantized for: its destination's, else the default."""
  devices = getattr(sharding, "device_set", None)
  return next(iter(devices)).platform if devices else jax.default_backend()


def plan_arguments(x: Any, dst_sharding: Any, src_sharding: Any,
                   dtype: Any) -> tuple[list[Any], list[Any], list[Any] | None,
                                        list[Any] | None]:
  """`plan`'s arguments with each quantized leaf as its value and scale arrays
  (ShapeDtypeStructs in the layouts a quantized reshard moves them between)."""
  api = "plan"
  leaves, treedef, names, specs, dsts, srcs = _per_leaf(api, x, dst_sharding,
                                                        src_sharding, dtype)
  out_x, out_dst, out_src, out_dtype = [], [], [], []
  for i, spec in enumerate(specs):
    v, dst, src = leaves[i], dsts[i], srcs[i]
    if not isinstance(spec, Quantize):
      out_x.append(v)
      out_dst.append(dst)
      out_src.append(src)
      out_dtype.append(spec)
      continue
    shape, leaf_dtype = _leaf_info(api, LazyName(names, i), v)
    leaf = resolve(api, names, i, spec, shape, leaf_dtype)
    src = src if src is not None else getattr(v, "sharding", None)
    if not isinstance(src, Sharding):
      raise ReshardValueError(
          f"{api}: the source sharding of {LazyName(names, i)} must be known; got {src!r}. "
          "Hint: pass src_sharding=.")
    dst = dst_sharding_of(api, LazyName(names, i), dst, shape, leaf.qdtype)
    out_x += [jax.ShapeDtypeStruct(shape, leaf.qdtype, sharding=src),
              jax.ShapeDtypeStruct(leaf.scale_shape, leaf.scale_dtype,
                                   sharding=scale_sharding(src, leaf))]
    out_dst += [dst, scale_sharding(dst, leaf)]
    out_src += [None, None]
    out_dtype += [None, None]
  return (out_x, out_dst, None if all(s is None for s in out_src) else out_src,
          None if all(d is None for d in out_dtype) else out_dtype)
