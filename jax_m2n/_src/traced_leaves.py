"""A reshard of traced leaves (inside jit, grad, vmap): which leaf goes where.

Owns sorting a traced call's leaves: kept, handed to XLA or to `jax.device_put`,
converted first where a conversion is not fused, the rest bound as one
`jax_m2n_reshard` primitive (transforms.py). Checks only what the traced types tell
(checks.py ran the rest); moves no data itself.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding

from jax_m2n._src import checks
from jax_m2n._src import eager
from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src import traced
from jax_m2n._src import transforms
from jax_m2n._src.errors import API, ReshardValueError
from jax_m2n._src.request import Options

logger = logging.getLogger("jax_m2n")


def reshard(leaves: Sequence[Any], dsts: Sequence[Any], srcs: Sequence[Any],
            options: Options, names: Callable[[], list[str]],
            out_dtypes: Sequence[Any] | None = None) -> list[Any]:
  """The outputs of a traced reshard of `leaves` (flat; `dsts`, `srcs`, `out_dtypes`
  per leaf, checked by checks.py): checks what the types tell, then one primitive. A
  conversion is fused into the primitive where schedule.fused_conversion says, else it
  is `astype` in the traced program before the reshard."""
  out_dtypes = list(out_dtypes or [None] * len(leaves))
  leaves = list(leaves)
  checks.check_outside_shard_map(API)
  outs: list[Any] = list(leaves)
  staged = []
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    name = names()[i]
    if dst is None:  # keep the layout: jax.device_put(x, None) is the identity
      if out_dtypes[i] is not None:
        outs[i] = eager.astype(leaf, out_dtypes[i])
      continue
    aval = checks.leaf_aval(API, name, leaf)
    shape, dtype = tuple(aval.shape), aval.dtype
    in_jit = jax_compat.is_staged(leaf)
    # The destination is checked before any astype (JAX's order: nothing runs first).
    fmt = dst if checks.is_format(dst) else None
    if fmt is not None or (isinstance(dst, jax.ShapeDtypeStruct) and
                           jax.dtypes.issubdtype(dtype, jax.dtypes.extended)):
      dst_sharding = dst.sharding  # a typed key's struct: JAX checks it
    else:
      dst_sharding = checks.dst_sharding_of(
          API, name, dst, shape, dtype if out_dtypes[i] is None else out_dtypes[i])
    uneven = in_jit and checks.is_uneven(dst_sharding, shape)
    if not uneven and dst_sharding is not None:
      checks.check_holds(API, name, dst_sharding, shape, "destination")
    if out_dtypes[i] is not None and not schedule.fused_conversion(dtype, out_dtypes[i]):
      leaf = leaves[i] = eager.astype(leaf, out_dtypes[i])  # unfused: convert, then move
      out_dtypes[i] = None
      aval = checks.leaf_aval(API, name, leaf)
      shape, dtype = tuple(aval.shape), aval.dtype
    why = checks.layout_delegated_because(shape, dst) or (
        "uneven shards (JAX pads them inside jit)" if uneven else None)
    if why is not None:  # XLA's move in jit, jax.device_put's outside
      outs[i] = _delegate(leaf, out_dtypes[i], fmt if fmt is not None else dst_sharding,
                          jax.device_put if fmt is not None or not in_jit
                          else transforms.constrain)
      logger.debug("reshard: %s delegated to %s (%s)", name,
                   "jax.device_put" if fmt is not None or not in_jit
                   else "XLA's partitioner (in jit)", why)
      continue
    if (not isinstance(leaf, jax.core.Tracer) and not isinstance(leaf, jax.Array)) or (
        eager.dtype_delegated_because(dtype) is not None):  # typed keys, int4: JAX's
      # In jit, jax.device_put would keep the layout: XLA's constraint moves it.
      outs[i] = _delegate(leaf, out_dtypes[i], dst_sharding,
                          transforms.constrain if jax_compat.is_staged(leaf)
                          else jax.device_put)
      logger.debug("reshard: %s delegated to jax.device_put (host data or extended "
                   "dtype)", name)
      continue
    checks.check_dtype(API, name, dtype)
    if in_jit:  # before the memory-kind delegation: JAX's own device check names less
      traced.check_staged_devices(name, aval, srcs[i], dst_sharding)
    space = getattr(aval, "memory_space", None)
    host_source = space is not None and "host" in str(space).lower()
    if host_source or not eager.default_memory(dst_sharding):  # device <-> host: JAX's
      outs[i] = _delegate(leaf, out_dtypes[i], dst_sharding, jax.device_put)
      logger.debug("reshard: %s delegated to jax.device_put (memory kind %s)", name,
                   dst_sharding.memory_kind)
      continue
    typed = getattr(aval, "sharding", None)
    checks.check_reduction(API, name, typed, "source")
    if in_jit and transforms.is_explicit(typed) and isinstance(
        dst_sharding, NamedSharding) and not transforms.is_explicit(dst_sharding):
      raise ReshardValueError(
          f"{API}: inside jit, {name} typed on Explicit mesh axes must go to a "
          f"destination on Explicit axes (JAX keeps the layout in the type there); got "
          f"destination mesh axis types {dst_sharding.mesh.axis_types}. Hint: build the "
          "destination mesh with axis_types=(AxisType.Explicit, ...), or call reshard "
          "outside jit.")
    if (jax_compat.trace_state_clean() and not isinstance(leaf, jax.core.Tracer)
        and isinstance(leaf, jax.Array) and eager.delegated_because(leaf, dst_sharding)):
      # A constant under a transformation that jax_m2n does not move.
      outs[i] = _delegate(leaf, out_dtypes[i], dst_sharding, jax.device_put)
      continue
    staged.append((i, dst_sharding))
  if staged:
    ys = transforms.bind([leaves[i] for i, _ in staged], [d for _, d in staged],
                         [srcs[i] for i, _ in staged], options,
                         [out_dtypes[i] for i, _ in staged])
    for (i, dst), y in zip(staged, ys):
      if isinstance(y, jax.core.Tracer) and not transforms.is_explicit(dst):
        # The layout the jit's outputs report comes from the jaxpr, not from inside the
        # lowering: state it here too (a no-op for XLA, the value is already there).
        y = traced.state_layout(y, dst)
      outs[i] = y
  return outs


def _delegate(leaf: Any, out_dtype: Any, dst: Any, put: Callable[[Any, Any], Any]) -> Any:
  """A leaf JAX moves: converted first (astype) where asked, then `put` to `dst`."""
  if out_dtype is not None:
    leaf = eager.astype(leaf, out_dtype)
  return put(leaf, dst)
