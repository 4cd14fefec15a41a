"""Which leaves jax_m2n moves and which it hands to jax.device_put, and the whole eager
reshard of a list of leaves (conversions first where unfused, moved leaves through the
cache, delegated ones through device_put, donation last).

Owns that choice and its checks; it never builds or runs programs itself.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.checks import (check_holds, check_host_leaf, dst_sharding_of,
                                 is_format, layout_delegated_because, same_layout)
from jax_m2n._src.eager.cache import lookup_or_build
from jax_m2n._src.eager.programs import donate_sources
from jax_m2n._src.errors import API, ReshardTypeError, ReshardValueError
from jax_m2n._src.request import Request

logger = logging.getLogger("jax_m2n")


_HOST_TYPES = (np.ndarray, np.generic, int, float, complex, bool)


@functools.lru_cache(maxsize=1024)
def default_memory(sharding: Sharding) -> bool:
  kind = getattr(sharding, "memory_kind", None)
  if kind is None:
    return True
  try:
    return kind == next(iter(sharding.device_set)).default_memory().kind
  except Exception:  # noqa: BLE001 - some backends expose no memories
    return True


@functools.lru_cache(maxsize=256)  # bounded by the dtypes in use
def dtype_delegated_because(dtype: Any) -> str | None:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return f"extended dtype {dtype}"
  if jax.dtypes.itemsize_bits(dtype) % 8:
    return f"sub-byte dtype {dtype}"
  return None


def delegated_because(leaf: Any, dst: Any) -> str | None:
  """Why jax.device_put, not jax_m2n, moves this leaf (None: jax_m2n moves it).

  jax_m2n adds nothing where no device-to-device layout change happens: host data,
  uncommitted arrays (a default placement, not a layout), `None` destinations (keep),
  typed PRNG keys, sub-byte dtypes (int4: the handlers copy whole bytes), host
  memory kinds (a device <-> host copy), concrete layouts (Format) and ranks above
  the handlers' bound.
  """
  if dst is None:
    return "destination None (keep the layout)"
  if not isinstance(leaf, jax.Array):
    return "host data"
  reason = (dtype_delegated_because(leaf.dtype) or
            layout_delegated_because(leaf.shape, dst))
  if reason is not None:
    return reason
  if isinstance(leaf, jax.core.Tracer):
    return None
  if not leaf.committed:
    return "uncommitted array"
  dst_sharding = dst.sharding if isinstance(dst, jax.ShapeDtypeStruct) else dst
  if not default_memory(leaf.sharding) or (
      isinstance(dst_sharding, Sharding) and not default_memory(dst_sharding)):
    return "host memory kind"
  return None


def _check_delegated(name: str, leaf: Any, dst: Any, given_src: Any = None) -> Any:
  """The rules a delegated leaf must meet before anything moves, beyond those of every
  path (checks.check_call_shardings) (`given_src`: its src_sharding, or None); its
  destination."""
  if given_src is not None and isinstance(leaf, jax.Array) and not leaf.is_deleted() and (
      not same_layout(given_src, leaf.sharding, leaf.shape)):
    raise ReshardValueError(
        f"{API}: src_sharding of {name} must describe the array's actual "
        f"layout; got {given_src} for an array sharded as {leaf.sharding}.")
  if dst is None:
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise ReshardValueError(
          f"{API}: {name} must be a live array; got a deleted (or donated) array.")
    return None
  if not isinstance(leaf, jax.Array) and not isinstance(leaf, _HOST_TYPES) and not hasattr(
      leaf, "__jax_array__"):
    raise ReshardTypeError(
        f"{API}: every leaf of x must be an array (a jax.Array, a numpy array or a "
        f"Python/numpy scalar); got {type(leaf).__name__} at {name}.")
  if isinstance(leaf, jax.Array) and leaf.is_deleted():
    raise ReshardValueError(
        f"{API}: {name} must be a live array; got a deleted (or donated) array.")
  check_host_leaf(API, name, leaf)
  shape = np.shape(leaf)
  if is_format(dst):  # jax.device_put applies the concrete layout
    _check_delegated(name, leaf, dst.sharding)
    return dst
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:  # a Python scalar: its default dtype, read from its type (making
    # an array of it would be an implicit host-to-device transfer of our own)
    dtype = jax.typeof(leaf).dtype
  dst_sharding = dst_sharding_of(API, name, dst, shape, dtype) if not (
      jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
      and isinstance(dst, jax.ShapeDtypeStruct)) else dst.sharding
  if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    check_holds(API, name, dst_sharding, shape, "destination")
  return dst_sharding


def astype(leaf: Any, dtype: Any) -> Any:
  """`leaf.astype(dtype)` where it runs today (a jax.Array's devices, numpy on host)."""
  return leaf.astype(dtype) if hasattr(leaf, "astype") else np.asarray(leaf).astype(dtype)


def reshard(request: Request, record: list | None = None) -> list[Any]:
  """Eagerly reshards concrete leaves: jax_m2n's programs for device layouts, jax.device_put
  for the rest (see `delegated_because`). Every check runs before anything moves; a
  donated source is deleted only after every leaf has moved. `request.out_dtypes`: per
  leaf the destination dtype (None: keep); converted in flight where
  schedule.fused_conversion says, else by `astype` first (on the source) and then moved.

  `record` (api's fast path): where one cached entry moved every leaf as it came (no
  delegation, no astype first), (its eager_cache key, per-leaf weak_type flags or ())
  is appended: calling that entry(leaves, donate) and marking those outputs weak is
  then this call."""
  n = len(request)
  originals = request.leaves
  names, donate = request.names, request.donate
  leaves, dsts, srcs = request.leaves, request.dsts, request.srcs
  converted_first = False
  if any(o is not None for o in request.out_dtypes):
    leaves, out_dtypes = list(leaves), list(request.out_dtypes)
    for i, o in enumerate(out_dtypes):
      if o is not None and (delegated_because(leaves[i], dsts[i]) is not None or
                            not schedule.fused_conversion(leaves[i].dtype, o)) and not (
          isinstance(leaves[i], jax.Array) and leaves[i].is_deleted()):  # checks say
        _check_delegated(names()[i], leaves[i], dsts[i])  # the destination before astype
        leaves[i], out_dtypes[i] = astype(leaves[i], o), None
        converted_first = True
    if converted_first:
      request = request.replace(leaves=leaves, out_dtypes=out_dtypes)
  out_dtypes = request.out_dtypes
  moved, delegated = [], []
  for i in range(n):
    (moved if delegated_because(leaves[i], dsts[i]) is None else delegated).append(i)
  # Every leaf is checked before any moves: the delegated ones here, the moved ones
  # when their programs are looked up (or built); only then does anything run.
  delegated_dsts = {i: _check_delegated(names()[i], leaves[i], dsts[i], srcs[i])
                    for i in delegated}
  outs: list[Any] = [None] * n
  entry: list = [] if record is not None and not delegated and not converted_first else None
  if moved:
    sub = request.subset(moved)
    programs = lookup_or_build(sub, entry)
    ys = programs(sub.leaves, False)
    weak = [leaves[i].weak_type and out_dtypes[i] is None for i in moved]
    for i, y, w in zip(moved, ys, weak):
      outs[i] = jax_compat.with_weak_type(y) if w else y
    if entry:
      record.append((entry[0], tuple(weak) if any(weak) else ()))
    if logger.isEnabledFor(logging.DEBUG):
      logger.debug("reshard: eager per-device path moved %d of %d leaves", len(moved), n)
  for i in delegated:
    outs[i] = jax.device_put(leaves[i], delegated_dsts[i])
  if delegated:
    logger.debug("reshard: delegated %d of %d leaves to jax.device_put (%s)",
                 len(delegated), n,
                 sorted({delegated_because(leaves[i], dsts[i]) for i in delegated}))
  donate_sources([originals[i] for i in _donatable(originals, outs, donate, delegated_dsts)],
          True)
  return outs


def _donatable(originals: Sequence[Any], outs: Sequence[Any], donate: Sequence[bool],
               delegated: Any) -> list[int]:
  """The leaves whose source may be deleted: marked True, at no other leaf of x, not
  returned by this call (a None destination returns its source), and sharing no buffer
  with a delegated result. jax.device_put ignores the donation of an array that appears
  twice in x (whatever the flags) or is returned, and so do we: a donation never
  deletes what the caller keeps."""
  count = collections.Counter(id(x) for x in originals)
  returned = {id(y) for y in outs}
  return [i for i, x in enumerate(originals)
          if donate[i] and count[id(x)] == 1 and id(x) not in returned and not (
              i in delegated and _shares_buffers(outs[i], x))]


def _shares_buffers(y: Any, x: Any) -> bool:
  """Whether jax.device_put returned x's own buffers in a new Array (an uncommitted
  array committed where it already is): deleting x would delete the result."""
  if not isinstance(x, jax.Array) or not isinstance(y, jax.Array) or x.is_deleted():
    return False
  try:
    mine = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in mine for s in y.addressable_shards)
  except Exception:  # noqa: BLE001 - no pointer to compare (a typed key): keep x
    return True
