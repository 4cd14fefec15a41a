"""The public entry points `reshard` and `plan`.

Owns the contract users read (docstrings), flattening pytrees and choosing the path:
the eager per-device programs (eager.py) outside jit, the shard_map lowering
(traced.py) inside it. Argument rules live in checks.py; nothing here moves data.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import jax_compat
from jax_m2n._src.checks import (_API, _broadcast_prefix, _check_holds, _check_route,
                                 _chunk_bytes, _dst_sharding_of, _leaf_names, _timeout_ms)
from jax_m2n._src.eager import _reshard_eager
from jax_m2n._src.errors import ReshardTypeError, ReshardValueError
from jax_m2n._src.layout import Layout
from jax_m2n._src.planner import DEFAULT_CHUNK_BYTES, Plan, plan_reshard
from jax_m2n._src.topology import Topology, as_topology
from jax_m2n._src.traced import _reshard_traced

# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------

def reshard(x: Any, dst_sharding: Any, *, route: str = "hierarchical",
            topology: Topology | int | Sequence[Sequence[int]] | None = None,
            donate: bool = False, src_sharding: Any = None,
            timeout_s: float | None = None, chunk_bytes: int | None = None) -> Any:
  """Moves arrays into new layouts, possibly on other devices, with one transfer plan.

  The result is bitwise equal to `jax.device_put(x, dst_sharding)` and its leaves'
  `.sharding` is `dst_sharding` (same devices, same order), but only the bytes each
  destination device needs move, each source byte crosses the slow links once per
  destination domain, and replicas are filled by fan-out inside a domain.

  Outside jit, source and destination device sets may be disjoint (trainer ->
  generator), overlapping or identical: one small compiled program runs per
  participating device (cached). Inside `jax.jit`, both must be on the jit's devices; the
  reshard lowers to the `jax_m2n_reshard` custom call on every device, with no XLA
  collective.

  Collective contract: a reshard is collective over every participating device (a
  device holding a source or a destination shard of any leaf). Every process that owns
  a participating device must call `reshard` with identical layouts, route and topology,
  in the same order as its peers. A device whose peers never arrive fails after
  `timeout_s` with `ReshardTimeoutError` on every waiting device, never hangs.

  Args:
    x: a `jax.Array` or a pytree of them (committed, not deleted). Inside jit: traced
      arrays.
    dst_sharding: a `jax.sharding.Sharding`, or a pytree prefix of `x` of them (as for
      `jax.device_put`); a `jax.ShapeDtypeStruct` with a sharding is accepted too
      (its shape and dtype must equal the leaf's).
    route: `"hierarchical"` (default), `"flat"` (direct sends to every replica) or
      `"gather_bcast"` (the legacy refit baseline).
    topology: NVLink domains: a `jax_m2n.Topology`, a domain size (int) or lists of
      device ids. Default: the devices of one process form one domain.
    donate: outside jit, free the source arrays once the call has completed (they are
      deleted; the caller must not use them again). Without it, sources are never
      modified. Ignored inside jit (use jit's `donate_argnums`).
    src_sharding: the source layout (a Sharding or a pytree prefix of them). Needed
      inside jit when the type of `x` carries no sharding (non-explicit meshes);
      outside jit optional, and checked against `x.sharding`.
    timeout_s: how long a device waits for its peers (default 300 s).
    chunk_bytes: bound on one pipelined chunk of a transfer (a leader forwards chunk c
      while chunk c+1 arrives). Default: 16 MiB on CPU, 64 MiB on GPU (measured on
      H200: fewer, larger NCCL groups win; docs/cuda_transport.md).

  Returns:
    A pytree like `x` of arrays with the destination shardings.

  Raises:
    ReshardTypeError: a leaf is not an array, a destination is not a Sharding.
    ReshardValueError: structures do not match, shapes or dtypes would change, a
      sharding cannot hold the shape, devices are on another platform, arrays are
      uncommitted or deleted, an unknown route, devices of another process on CPU, or a
      layout inside jit that needs the eager path. Raised before any data moves; the
      message names the leaf.
    ReshardTimeoutError: a peer did not arrive within `timeout_s`.
    ReshardError: the native handler failed (its message included). No partial
      outputs are returned.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:8])
    >>> trainer = jax.sharding.Mesh(devs[:4].reshape(1, 4), ("dp", "tp"))
    >>> generator = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    >>> w = jax.device_put(np.arange(32.0).reshape(4, 8),
    ...                    NamedSharding(trainer, P("tp", None)))
    >>> w2 = jax_m2n.reshard(w, NamedSharding(generator, P("tp", None)))
    >>> w2.sharding == NamedSharding(generator, P("tp", None))
    True
  """
  _check_route(_API, route)
  timeout_ms = _timeout_ms(_API, timeout_s)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  name_cache: list[list[str]] = []

  def names() -> list[str]:
    if not name_cache:
      name_cache.append(_leaf_names(x))
    return name_cache[0]

  dsts = _broadcast_prefix(_API, "dst_sharding", dst_sharding, x, treedef, n, names)
  srcs = ([None] * n if src_sharding is None else
          _broadcast_prefix(_API, "src_sharding", src_sharding, x, treedef, n, names))
  if not n:
    return jax.tree_util.tree_unflatten(treedef, [])
  traced = (not jax_compat.trace_state_clean()) or any(
      isinstance(v, jax.core.Tracer) for v in leaves)
  if traced:
    outs = _reshard_traced(leaves, dsts, srcs, route, topology, timeout_ms,
                           _chunk_bytes(_API, chunk_bytes, dsts), names)
  else:
    outs = _reshard_eager(x, leaves, treedef, dsts, srcs, route, topology, bool(donate),
                          timeout_ms, _chunk_bytes(_API, chunk_bytes, dsts), names)
  return jax.tree_util.tree_unflatten(treedef, outs)



def plan(x: Any, dst_sharding: Any, *, route: str = "hierarchical",
         topology: Topology | int | Sequence[Sequence[int]] | None = None,
         src_sharding: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Plan:
  """The plan `reshard(x, dst_sharding, ...)` would run, without moving anything.

  Args:
    x: arrays (or `jax.ShapeDtypeStruct`s with a sharding), a pytree.
    dst_sharding: as for `reshard`.
    route, topology: as for `reshard`.
    src_sharding: source layouts, when `x`'s leaves carry none.
    chunk_bytes: bound on one chunk of a transfer.

  Returns:
    The `Plan` (transfers, chunks, bytes per link, cost estimates, workspace).

  Example:
    >>> p = jax_m2n.plan(w, NamedSharding(generator, P("tp", None)))
    >>> p.bytes_by_link  # 128 bytes injected, 128 fanned out to the dp replicas
    {'local': 0, 'nvlink': 256, 'network': 0}
  """
  api = "plan"
  _check_route(api, route)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  names = lambda: _leaf_names(x)  # noqa: E731
  dsts = _broadcast_prefix(api, "dst_sharding", dst_sharding, x, treedef, n, names)
  given = ([None] * n if src_sharding is None else
           _broadcast_prefix(api, "src_sharding", src_sharding, x, treedef, n, names))
  src_layouts, dst_layouts, itemsizes, devices = [], [], [], {}
  for i, (leaf, dst, src) in enumerate(zip(leaves, dsts, given)):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise ReshardTypeError(
          f"{api}: every leaf of x must be an array or ShapeDtypeStruct; got "
          f"{type(leaf).__name__} at {names()[i]}.")
    shape = tuple(leaf.shape)
    src = src if src is not None else getattr(leaf, "sharding", None)
    if not isinstance(src, Sharding):
      raise ReshardValueError(
          f"{api}: the source sharding of {names()[i]} must be known; got "
          f"{src!r}. Hint: pass src_sharding=.")
    dst = _dst_sharding_of(api, names()[i], dst, shape, leaf.dtype)
    _check_holds(api, names()[i], src, shape, "source")
    _check_holds(api, names()[i], dst, shape, "destination")
    for d in itertools.chain(src.device_set, dst.device_set):
      devices[d.id] = d
    src_layouts.append(Layout.from_sharding(src, shape))
    dst_layouts.append(Layout.from_sharding(dst, shape))
    itemsizes.append(np.dtype(leaf.dtype).itemsize)
  topo = as_topology(topology, devices.values() if devices else None)
  return plan_reshard(src_layouts, dst_layouts, itemsizes, topo, route, chunk_bytes)