"""The public entry points `reshard` and `plan`.

Owns the contract users read (docstrings), flattening pytrees and choosing the path:
the eager per-device programs (eager/) outside jit, the shard_map lowering
(traced.py) inside it. Argument rules live in checks.py; nothing here moves data.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec, Sharding

from jax_m2n._src import call_plan
from jax_m2n._src import checks
from jax_m2n._src import eager
from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import jax_compat
from jax_m2n._src import quantize
from jax_m2n._src import schedule
from jax_m2n._src import traced
from jax_m2n._src import transforms
from jax_m2n._src.checks import (broadcast_prefix, check_dtype, check_holds,
                                 check_mesh, check_reduction,
                                 check_src_sharding, is_format,
                                 layout_delegated_because, plan_leaf, is_uneven,
                                 donate_flags,
                                 is_dst_leaf, LazyName,
                                 leaf_aval, dtypes_per_leaf,
                                 dst_sharding_of, leaf_names, map_native_error,
                                 normalize_dst)
from jax_m2n._src.errors import API, ReshardTypeError, ReshardValueError
from jax_m2n._src.planner import Plan
from jax_m2n._src.request import Options, Request
from jax_m2n._src.topology import Topology

logger = logging.getLogger("jax_m2n")

# What a reshard stages into a jaxpr is attributed to the user's line, not ours.
jax_compat.exclude_from_source_info(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)

# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------

def reshard(x: Any, dst_sharding: Any, *, route: str = "hierarchical",
            topology: Topology | int | Sequence[Sequence[int]] | None = None,
            donate: bool = False, src_sharding: Any = None,
            timeout_s: float | None = None, chunk_bytes: int | None = None,
            dtype: Any = None) -> Any:
  """Moves arrays into new layouts, possibly on other devices: a drop-in for
  `jax.device_put(x, dst)` and `jax.sharding.reshard(x, dst)`.

  The result equals `jax.device_put(x, dst_sharding)`: the same values, shards,
  sharding (same devices, same order), committedness, weak_type and memory kind. Where
  it moves device arrays between device layouts, only the bytes each destination device
  needs move, each source byte crosses the slow links once per destination domain, and
  replicas are filled by fan-out inside a domain.

  What runs where (a `logging.getLogger("jax_m2n")` debug line names the path):
    * Outside jit, committed device arrays: jax_m2n's eager path, one small compiled
      program per participating device (cached). Source and destination device sets may
      be disjoint (trainer -> generator), overlapping or identical.
    * Inside `jax.jit`: jax_m2n's `jax_m2n_reshard` custom call on every device of the
      jit (no XLA collective). Where the source layout is known (the type, on meshes
      with `AxisType.Explicit` axes, or `src_sharding=`) it runs in one `shard_map`.
      Without either, only XLA's partitioner knows where the operand lives: for a
      destination that is a `NamedSharding` on Auto axes in device memory, the call is
      placed by `jax.experimental.custom_partitioning`, whose partition step reads the
      layout XLA gives the operand (on any mesh of the jit's devices) and plans from it;
      other leaves (rank 0, zero size, an Explicit-axes destination) are handed to XLA
      (`with_sharding_constraint`; XLA moves the data).
    * Delegated to `jax.device_put`, honestly, where jax_m2n adds nothing (no
      device-to-device layout change of plain bytes): numpy arrays and Python scalars
      (host -> devices), uncommitted arrays, typed PRNG key arrays, sub-byte dtypes
      (int4), host memory kinds (`pinned_host`, `unpinned_host`) as source or
      destination, `None` destinations (the source layout is kept, as device_put
      does), concrete layouts (a `jax.experimental.layout.Format` destination: the
      handlers write the default layout only) and ranks above 8 (the handlers' bound);
      inside jit the last two and destinations with uneven shards (e.g. (113003,) over
      8 devices: XLA pads them, as for `with_sharding_constraint`) go to XLA. Outside
      jit uneven shards are refused, as jax.device_put refuses them.

  Dtype conversion: `reshard(x, dst, dtype=d)` equals `jax.device_put(x.astype(d), dst)`
  bit for bit (XLA's rounding: nearest-even, subnormals kept, overflow to inf, or NaN for
  float8_e4m3fn; NaNs as XLA CPU's convert makes them). Between two of float32, float16,
  bfloat16, float8_e4m3fn and float8_e5m2 the conversion is fused into the copies: a
  narrowing one happens on the source device before the bytes leave it, a widening one
  on the destination after they arrive, so links carry the smaller type (the plan and
  its costs count those bytes) and no full-size converted copy is made. Any other pair
  (integers, float64, complex, other float8 kinds) is converted with `astype` on the
  source first (a full-size temporary), then moved; so are leaves handed to
  `jax.device_put` (see below).

  Transformations: `jax.grad` / `vjp` / `jvp` (the cotangent is resharded back to the
  source layout, eagerly by jax_m2n and in jit by the custom call, and converted back to
  the source dtype after a conversion, as astype's), `jax.vmap` (each
  example lands in the destination layout; the batch dimension is sharded as JAX's own
  rules say: on Explicit axes as in the batched operand's type, as
  `jax.sharding.reshard`; on Auto axes over `spmd_axis_name`, else not, as
  `with_sharding_constraint`), `jax.jit`. On Explicit axes the cotangent carries the
  source's sharded type, as JAX checks.

  Not supported (a `ReshardValueError` naming the feature): unreduced / reduced
  shardings (`P(..., unreduced={...})`; jax_m2n moves bytes and does not sum partial
  values: reduce first), inside jit a source and a destination on different devices
  or device orders, or an Explicit-axes source with an Auto-axes destination.

  Collective contract: a reshard is collective over every participating device (a
  device holding a source or a destination shard of any leaf). Every process that owns
  a participating device must call `reshard` with identical layouts, route and topology,
  in the same order as its peers. A device whose peers never arrive fails after
  `timeout_s` with `ReshardTimeoutError` on every waiting device, never hangs.

  Asynchronous (eager path; on CUDA, and on CPU with `JAX_M2N_CPU_ASYNC=1`): like
  `jax.device_put`, the call returns once every device's program is dispatched; the
  outputs are ordinary arrays that later work waits on (`block_until_ready`, first use,
  another jit), and a later `reshard` reading them is ordered after them. On CPU by
  default the call returns when the transfer has finished (XLA runs the small
  programs inline; see docs/design.md, "Dispatch"). When an error can surface:
    * Known before anything runs (bad arguments, a deleted source buffer, a failure
      while dispatching a device's program): raised by this call; no outputs.
    * Known only while the transfer runs (a peer that never comes, a handler,
      transport, CUDA/NCCL or allocation failure): the outputs carry it - JAX raises it
      (`jax.errors.JaxRuntimeError`, message containing `jax_m2n_reshard`) at
      `block_until_ready` or first use - and the first eager `reshard` call that starts
      after it was seen (within milliseconds; on CUDA when the stream has run) raises it
      as a `ReshardError` naming the failed call ("eager reshard #N (site S, ...)"), the
      original error chained; that call runs nothing, and each failure is raised so
      once. A failure fails every device of the call: no output is silently wrong.
  A blocking CPU call raises every error itself.

  Args:
    x: a pytree of arrays: `jax.Array`s (committed or not), numpy arrays, Python
      scalars. Inside jit or a transformation: traced arrays.
    dst_sharding: for each leaf a `jax.sharding.Sharding`, a `jax.Device`, a bare
      `PartitionSpec` (on the mesh of `jax.set_mesh`), a `jax.ShapeDtypeStruct` with a
      sharding (same shape and dtype as the leaf) or `None` (keep); one of them, or a
      pytree prefix of `x` of them (as for `jax.device_put`).
    route: `"hierarchical"` (default), `"flat"` (direct sends to every replica) or
      `"gather_bcast"` (the legacy refit baseline).
    topology: NVLink domains: a `jax_m2n.Topology`, a domain size (int) or lists of
      device ids. Default: the devices of one process form one domain.
    donate: a bool, or a pytree prefix of `x` of bools (as for `jax.device_put`): the
      sources marked True are deleted once every leaf has moved; an unmarked leaf is
      never touched, nor (as by jax.device_put) an array that appears at several
      leaves of x or that a None destination returns. Ignored inside jit (use jit's `donate_argnums`).
    src_sharding: the source layout (a Sharding or a pytree prefix of them). Inside jit
      optional: without it the layout XLA's partitioner gives the operand is used (see
      above); with it the plan is made at trace time, and the source may be on another
      mesh than the jit's inputs. Under vmap it is the per-example layout. Outside jit
      optional, and checked against `x.sharding`.
    timeout_s: how long a device waits for its peers: a number of seconds in
      [0.001, 2**40/1000] (default 300 s).
    chunk_bytes: bound on one pipelined chunk of a transfer (a leader forwards chunk c
      while chunk c+1 arrives), in bytes on the wire. Default: chosen per plan from its
      bytes on the slowest stage and its forwarding hops, so that forwarding and
      fan-out overlap injection, at most 16 MiB on CPU, 64 MiB on GPU (docs/design.md,
      "Chunks and steps").
    dtype: the dtype of the outputs: a dtype (`jnp.bfloat16`, `np.float32`, a name such
      as `"float8_e4m3fn"`), None (keep, the default), or a pytree prefix of x of them
      (as `donate`). A ShapeDtypeStruct destination must then have that dtype. A
      `jax_m2n.Quantize` spec (alone or in the prefix) quantizes its leaves on the
      source and returns QArrays (see `jax_m2n.Quantize`).

  Returns:
    A pytree like `x` of arrays with the destination shardings.

  Raises:
    ReshardTypeError (also TypeError): an argument of the wrong type (a leaf that is no
      array, a destination that is no Sharding/Device/PartitionSpec, a non-number
      timeout_s, a malformed topology, a donate that is not bools, a dtype that is no
      dtype of numbers or bool).
    ReshardValueError (also ValueError): structures do not match, shapes or dtypes would
      change, a sharding cannot hold the shape (outside jit: uneven shards, as
      jax.device_put), a mesh lists a device twice or is an
      AbstractMesh, unreduced shardings, devices on another platform, an unknown route,
      a timeout_s below 1 ms, devices of another process on CPU, or a layout inside jit
      that needs the eager path. Raised before any data moves; the message names the
      leaf.
    ReshardTimeoutError (also ReshardRuntimeError, TimeoutError): a peer did not arrive
      within `timeout_s`.
    ReshardTransferGuardError (also ReshardRuntimeError, jax.errors.JaxRuntimeError):
      `jax.transfer_guard_device_to_device("disallow_explicit")` refuses the move
      between devices, as it refuses jax.device_put's (raised before anything moves;
      "log_explicit" logs it instead; see docs/design.md, "Transfer guards").
    ReshardRuntimeError (also RuntimeError): the native handler failed (its message
      included), or (asynchronous calls) an earlier call failed after returning. No
      partial outputs are returned. Inside jit on GPU a failure can surface
      after the step: see `jax_m2n.check_errors`.

  Examples:
    Trainer -> generator, across device sets (eager):

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
    >>> bool((w2 == jax.device_put(w, w2.sharding)).all())
    True

    A pytree with a prefix of destinations, a None leaf (kept) and donation:

    >>> params = {"w": w, "b": jax.device_put(np.ones(4), devs[0]), "step": 3}
    >>> out = jax_m2n.reshard(params, {"w": NamedSharding(generator, P()),
    ...                                "b": devs[5], "step": None},
    ...                       donate={"w": True, "b": False, "step": False})
    >>> w.is_deleted(), params["b"].is_deleted(), int(out["step"])
    (True, False, 3)

    fp32 weights to a bf16 generator: converted on the trainer, bf16 on the wire:

    >>> import jax.numpy as jnp
    >>> v = jax.device_put(np.linspace(0, 1, 32, dtype=np.float32).reshape(4, 8),
    ...                    NamedSharding(trainer, P("tp", None)))
    >>> vb = jax_m2n.reshard(v, NamedSharding(generator, P("tp", None)),
    ...                      dtype=jnp.bfloat16)
    >>> vb.dtype, bool((np.asarray(vb) == np.asarray(v.astype(jnp.bfloat16))).all())
    (dtype(bfloat16), True)

    Gradients flow through; the cotangent comes back in the source layout:

    >>> x = jax.device_put(np.arange(8.0), NamedSharding(trainer, P("tp")))
    >>> g = jax.grad(lambda v: jax_m2n.reshard(v, devs[6]).sum())(x)
    >>> g.sharding == x.sharding
    True

    Inside jit, as with `jax.device_put`: the source layout is the one XLA gives the
    operand (or pass `src_sharding=`, or use Explicit-axes types):

    >>> mesh = jax.sharding.Mesh(devs, ("x",))
    >>> y = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
    >>> f = jax.jit(lambda v: jax_m2n.reshard(v, NamedSharding(mesh, P(None, "x"))))
    >>> f(y).sharding == NamedSharding(mesh, P(None, "x"))
    True
    >>> "jax_m2n_reshard" in f.lower(y).compile().as_text()
    True
  """
  if dtype is not None and quantize.has_spec(dtype):  # values + scales: quantize.py
    return quantize.reshard(reshard, x, dst_sharding, dtype, route=route,
                            topology=topology, donate=donate, src_sharding=src_sharding,
                            timeout_s=timeout_s, chunk_bytes=chunk_bytes)
  fast = _fast_key(x, dst_sharding, route, topology, donate, src_sharding, timeout_s,
                   chunk_bytes, dtype)
  if fast is not None:
    key, leaves, treedef = fast
    hit = _fast_cache.get(key)
    if hit is not None:
      outs = _fast_call(hit, leaves, donate)
      if outs is not None:
        return jax.tree_util.tree_unflatten(treedef, outs)
  options = checks.options(API, route, topology, timeout_s, chunk_bytes)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  name_cache: list[list[str]] = []

  def names() -> list[str]:
    if not name_cache:
      name_cache.append(leaf_names(x))
    return name_cache[0]

  dsts = broadcast_prefix(API, "dst_sharding", dst_sharding, x, treedef, n, names)
  srcs = ([None] * n if src_sharding is None else
          broadcast_prefix(API, "src_sharding", src_sharding, x, treedef, n, names))
  flags = donate_flags(API, donate, x, treedef, n)
  out_dtypes = dtypes_per_leaf(API, dtype, x, treedef, n)
  if not n:
    return jax.tree_util.tree_unflatten(treedef, [])
  if dtype is not None:
    out_dtypes, dsts = _conversions(leaves, dsts, out_dtypes, names)
  # Leaf names only where a message needs one (LazyName): forming them costs more than
  # these checks.
  dsts = [d if isinstance(d, Sharding) else normalize_dst(API, LazyName(names, i), d)
          for i, d in enumerate(dsts)]
  seen: set[int] = set()  # a prefix repeats one sharding object: check it once
  for i, d in enumerate(dsts):  # before anything asks these shardings for devices
    d = d.sharding if isinstance(d, jax.ShapeDtypeStruct) else d
    if id(d) not in seen:
      seen.add(id(d))
      check_mesh(API, LazyName(names, i), d, "destination")
      check_reduction(API, LazyName(names, i), d, "destination")
    if srcs[i] is not None:
      check_src_sharding(API, LazyName(names, i), srcs[i])
      check_reduction(API, LazyName(names, i), srcs[i], "source")
    leaf = leaves[i]
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      s = leaf.sharding
      if id(s) not in seen:
        seen.add(id(s))
        check_reduction(API, LazyName(names, i), s, "source")
  traced = (not jax_compat.trace_state_clean()) or any(
      isinstance(v, jax.core.Tracer) for v in leaves)
  if traced:
    outs = _reshard_tracers(leaves, dsts, srcs, options, names, out_dtypes)
  else:
    record = [] if fast is not None else None
    outs = eager.reshard(Request(leaves=leaves, treedef=treedef, dsts=dsts, srcs=srcs,
                                 out_dtypes=out_dtypes, donate=flags, options=options,
                                 names=names), record)
    if record:
      with _fast_cache.lock:  # put evicts: two threads putting at once would race
        _fast_cache.put(fast[0], record[0])
  return jax.tree_util.tree_unflatten(treedef, outs)


# ---------------------------------------------------------------------------------------
# The repeated eager call: one lookup in place of the argument work
# ---------------------------------------------------------------------------------------

# A refit calls reshard with the same arguments and layouts every step. The first call
# runs every check above; where its whole outcome follows from the arguments' types and
# values and the leaves' types and layouts (every leaf moved by one cached eager entry,
# nothing delegated, no astype first), that entry's key is remembered under the call's
# key (the entry itself stays in eager's bounded cache only), and a later call with an
# equal key goes straight to it (docs/benchmarks.md, "Fixed cost"). Checked on every
# call still: what can differ between arrays of one layout (committed, deleted, one
# array donated twice) and the trace state; any doubt takes the full path, which
# raises what it must.
_fast_cache = eager._LruCache(eager._EAGER_CACHE_SIZE)

# Argument types whose equal values mean equal outcomes (bool is no int here: the full
# path refuses a bool timeout_s, chunk_bytes or dtype).
_FAST_NUMBER = (type(None), int, float)


def _fast_key(x, dst_sharding, route, topology, donate, src_sharding, timeout_s,
              chunk_bytes, dtype) -> tuple[Any, list[Any], Any] | None:
  """(key, leaves, treedef) of an eager call that may take the fast path; None where
  it may not (traced, host data, a PartitionSpec destination read from the context
  mesh, a pytree of dtypes or donate flags, src_sharding, debug logging...)."""
  array_type = jax_compat.array_type()
  if (array_type is None or src_sharding is not None or type(donate) is not bool
      or type(route) is not str or type(timeout_s) not in _FAST_NUMBER
      or type(chunk_bytes) not in (type(None), int)
      or not (topology is None or type(topology) is int or isinstance(topology, Topology))
      or not (dtype is None or isinstance(dtype, (np.dtype, type, str)))
      or logger.isEnabledFor(logging.DEBUG) or not jax_compat.trace_state_clean()):
    return None
  leaves, treedef = jax.tree_util.tree_flatten(x)
  parts = []
  for leaf in leaves:
    if type(leaf) is not array_type:  # no tracer, numpy array or scalar
      return None
    parts.append(leaf.aval)  # shape, dtype, weak_type
    parts.append(leaf.sharding)
  if isinstance(dst_sharding, Sharding):
    dst = dst_sharding
  else:
    flat, tree = jax.tree_util.tree_flatten(dst_sharding, is_leaf=is_dst_leaf)
    if any(isinstance(d, PartitionSpec) for d in flat):  # depends on the context mesh
      return None
    dst = (tree, tuple(flat))
  try:  # hashed once: the cache's get and move_to_end would hash it twice more
    key = eager._Key((treedef, dst, route, topology, donate, type(timeout_s), timeout_s,
                      chunk_bytes, type(dtype), dtype,
                      jax.config.jax_enable_x64 if dtype is not None else None,
                      tuple(parts)))
  except TypeError:  # an unhashable destination or topology: the full path says why
    return None
  return key, leaves, treedef


def _fast_call(hit, leaves: list[Any], donate: bool) -> list[Any] | None:
  """Runs a remembered call's entry; None where the full path must run instead (it
  raises what is wrong: a deleted or uncommitted leaf, an array donated twice)."""
  key, weak = hit
  entry = eager._eager_cache.get(key)  # only what that bounded cache still holds
  if entry is None:
    return None
  for leaf in leaves:
    if leaf.is_deleted() or not leaf.committed:
      return None
  if donate and len({id(v) for v in leaves}) != len(leaves):
    return None
  outs = entry(leaves, donate)
  if weak:
    outs = [jax_compat.with_weak_type(y) if w else y for y, w in zip(outs, weak)]
  return outs


def _conversions(leaves, dsts, out_dtypes, names) -> tuple[list[Any], list[Any]]:
  """Per leaf the dtype to convert to (None where it already has it, as JAX would
  canonicalize it) and the destinations, a ShapeDtypeStruct checked against that dtype
  and replaced by its sharding."""
  out_dtypes, dsts = list(out_dtypes), list(dsts)
  for i, (leaf, o) in enumerate(zip(leaves, out_dtypes)):
    if o is None:
      continue
    have, weak = getattr(leaf, "dtype", None), getattr(leaf, "weak_type", False)
    if have is None and isinstance(leaf, (bool, int, float, complex)):  # weakly typed
      have, weak = jax.typeof(leaf).dtype, jax.typeof(leaf).weak_type
    if have is None or not (have == np.bool_ or jax.dtypes.issubdtype(have, np.number)):
      raise ReshardTypeError(
          f"{API}: a leaf of x converted with dtype= must be an array of numbers or "
          f"bools; got {type(leaf).__name__} {getattr(leaf, 'dtype', '')} at "
          f"{names()[i]}.")
    want = jax.dtypes.canonicalize_dtype(o)
    if np.dtype(have) == want and not weak:
      out_dtypes[i] = None
    if isinstance(dsts[i], jax.ShapeDtypeStruct):
      dsts[i] = dst_sharding_of(API, names()[i], dsts[i], np.shape(leaf),
                                 want if out_dtypes[i] is not None else have)
  return out_dtypes, dsts


def _reshard_tracers(leaves, dsts, srcs, options: Options, names,
                     out_dtypes=None) -> list[Any]:
  """Traced leaves (jit, grad, vmap): checks what the types tell, then one primitive.
  A conversion is fused into the primitive where schedule.fused_conversion says, else
  it is `astype` in the traced program before the reshard."""
  out_dtypes = list(out_dtypes or [None] * len(leaves))
  leaves = list(leaves)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and getattr(context, "manual_axes", ()):
    raise ReshardValueError(
        f"{API}: reshard must be called outside shard_map (it lowers to its own SPMD "
        f"program over whole arrays); got a call under manual mesh axes "
        f"{tuple(context.manual_axes)}. Hint: call it on the global arrays, inside jit "
        "or eagerly.")
  outs: list[Any] = list(leaves)
  staged = []
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    name = names()[i]
    if dst is None:  # keep the layout: jax.device_put(x, None) is the identity
      if out_dtypes[i] is not None:
        outs[i] = eager._astype(leaf, out_dtypes[i])
      continue
    aval = leaf_aval(API, name, leaf)
    shape, dtype = tuple(aval.shape), aval.dtype
    in_jit = jax_compat.is_staged(leaf)
    # The destination is checked before any astype (JAX's order: nothing runs first).
    fmt = dst if is_format(dst) else None
    if fmt is not None or (isinstance(dst, jax.ShapeDtypeStruct) and
                           jax.dtypes.issubdtype(dtype, jax.dtypes.extended)):
      dst_sharding = dst.sharding  # a typed key's struct: JAX checks it
    else:
      dst_sharding = dst_sharding_of(API, name, dst, shape, dtype if out_dtypes[i]
                                      is None else out_dtypes[i])
    if dst_sharding is not None:
      check_mesh(API, name, dst_sharding, "destination")
      check_reduction(API, name, dst_sharding, "destination")
    uneven = in_jit and is_uneven(dst_sharding, shape)
    if not uneven and dst_sharding is not None:
      check_holds(API, name, dst_sharding, shape, "destination")
    if out_dtypes[i] is not None and not schedule.fused_conversion(dtype, out_dtypes[i]):
      leaf = leaves[i] = eager._astype(leaf, out_dtypes[i])  # unfused: convert, then move
      out_dtypes[i] = None
      aval = leaf_aval(API, name, leaf)
      shape, dtype = tuple(aval.shape), aval.dtype
    why = layout_delegated_because(shape, dst) or (
        "uneven shards (JAX pads them inside jit)" if uneven else None)
    if why is not None:  # XLA's move in jit, jax.device_put's outside
      if out_dtypes[i] is not None:
        leaf = eager._astype(leaf, out_dtypes[i])
      outs[i] = (jax.device_put(leaf, fmt) if fmt is not None or not in_jit
                 else transforms.constrain(leaf, dst_sharding))
      logger.debug("reshard: %s delegated to %s (%s)", name,
                   "jax.device_put" if fmt is not None or not in_jit
                   else "XLA's partitioner (in jit)", why)
      continue
    if (not isinstance(leaf, jax.core.Tracer) and not isinstance(leaf, jax.Array)) or (
        eager._dtype_delegated_because(dtype) is not None):  # typed keys, int4: JAX's
      if out_dtypes[i] is not None:
        leaf = eager._astype(leaf, out_dtypes[i])
      put = (transforms.constrain if jax_compat.is_staged(leaf)
             else jax.device_put)  # in jit, jax.device_put would keep the layout
      outs[i] = put(leaf, dst_sharding)
      logger.debug("reshard: %s delegated to jax.device_put (host data or extended "
                   "dtype)", name)
      continue
    check_dtype(API, name, dtype)
    if in_jit:  # before the memory-kind delegation: JAX's own device check names less
      traced.check_staged_devices(name, aval, srcs[i], dst_sharding)
    space = getattr(aval, "memory_space", None)
    host_source = space is not None and "host" in str(space).lower()
    if host_source or not eager._default_memory(dst_sharding):  # device <-> host: JAX's
      if out_dtypes[i] is not None:
        leaf = eager._astype(leaf, out_dtypes[i])
      outs[i] = jax.device_put(leaf, dst_sharding)
      logger.debug("reshard: %s delegated to jax.device_put (memory kind %s)", name,
                   dst_sharding.memory_kind)
      continue
    typed = getattr(aval, "sharding", None)
    check_reduction(API, name, typed, "source")
    if in_jit and (isinstance(typed, jax.sharding.NamedSharding) and not typed.mesh.empty and any(
        t == jax.sharding.AxisType.Explicit for t in typed.mesh.axis_types)
        and isinstance(dst_sharding, jax.sharding.NamedSharding) and not any(
            t == jax.sharding.AxisType.Explicit for t in dst_sharding.mesh.axis_types)):
      raise ReshardValueError(
          f"{API}: inside jit, {name} typed on Explicit mesh axes must go to a "
          f"destination on Explicit axes (JAX keeps the layout in the type there); got "
          f"destination mesh axis types {dst_sharding.mesh.axis_types}. Hint: build the "
          "destination mesh with axis_types=(AxisType.Explicit, ...), or call reshard "
          "outside jit.")
    if (jax_compat.trace_state_clean() and not isinstance(leaf, jax.core.Tracer)
        and isinstance(leaf, jax.Array) and eager.delegated_because(leaf, dst_sharding)):
      if out_dtypes[i] is not None:
        leaf = eager._astype(leaf, out_dtypes[i])
      outs[i] = jax.device_put(leaf, dst_sharding)  # a constant under a transformation
      continue
    staged.append((i, dst_sharding))
  if staged:
    ys = transforms.bind([leaves[i] for i, _ in staged], [d for _, d in staged],
                         [srcs[i] for i, _ in staged], options,
                         [out_dtypes[i] for i, _ in staged])
    for (i, dst), y in zip(staged, ys):
      if isinstance(y, jax.core.Tracer) and not transforms._is_explicit(dst):
        # The layout the jit's outputs report comes from the jaxpr, not from inside the
        # lowering: state it here too (a no-op for XLA, the value is already there).
        y = traced.state_layout(y, dst)
      outs[i] = y
  return outs


def check_errors() -> None:
  """Raises the error of an in-jit reshard that failed after returning, if any.

  Inside jit, the CUDA transport detects a timeout or an NCCL failure after the custom
  call has returned to XLA (a watchdog): that step's outputs are invalid and nothing
  raises until jax_m2n is called again. A training loop calls this (cheap: no device
  work) after a step to ask. Every later reshard raises the same error until the
  transport is re-initialized. The CPU transport fails inside the call, so on CPU this
  never raises.

  Raises:
    ReshardTimeoutError: a peer did not arrive within `timeout_s` (also TimeoutError).
    ReshardRuntimeError: the transport failed (also RuntimeError).

  Example:
    >>> jax_m2n.check_errors()  # nothing failed
  """
  for platform in ("cuda", "gpu", "cpu"):
    sticky = m2n_ffi.sticky_error(platform)
    if sticky is not None:
      raise map_native_error(RuntimeError(sticky))


def plan(x: Any, dst_sharding: Any, *, route: str = "hierarchical",
         topology: Topology | int | Sequence[Sequence[int]] | None = None,
         src_sharding: Any = None, chunk_bytes: int | None = None,
         dtype: Any = None) -> Plan:
  """The plan `reshard(x, dst_sharding, ...)` would run, without moving anything.

  Args:
    x: arrays (or `jax.ShapeDtypeStruct`s with a sharding), a pytree.
    dst_sharding: as for `reshard`.
    route, topology: as for `reshard`.
    src_sharding: source layouts, when `x`'s leaves carry none.
    chunk_bytes: as for `reshard` (default: chosen per plan for the destinations'
      platform; `Plan.chunk_bytes` says what was chosen).
    dtype: as for `reshard`: a fused conversion is planned with the bytes on the wire
      (the narrower of the two types).

  Returns:
    The `Plan` (transfers, chunks, bytes per link, cost estimates, workspace).

  Raises:
    ReshardTypeError, ReshardValueError: what `reshard` refuses, with the same classes
      (a mesh listing a device twice, an AbstractMesh, unreduced shardings, a bool
      chunk_bytes...), and what jax_m2n does not plan: leaves `reshard` hands to JAX
      (typed PRNG keys and int4: ReshardTypeError; concrete layouts, rank above 8) and
      `None` destinations (nothing moves).

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:8])
    >>> trainer = jax.sharding.Mesh(devs[:4].reshape(1, 4), ("dp", "tp"))
    >>> generator = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    >>> w = jax.ShapeDtypeStruct((4, 8), np.float32,
    ...                          sharding=NamedSharding(trainer, P("tp", None)))
    >>> p = jax_m2n.plan(w, NamedSharding(generator, P("tp", None)))
    >>> p.bytes_by_link  # 128 bytes injected, 128 fanned out to the dp replicas
    {'local': 0, 'nvlink': 256, 'network': 0}
    >>> jax_m2n.plan(w, NamedSharding(generator, P("tp", None)),
    ...              dtype="bfloat16").bytes_by_link  # bf16 on the wire
    {'local': 0, 'nvlink': 128, 'network': 0}
  """
  api = "plan"
  options = checks.options(api, route, topology, None, chunk_bytes)
  if dtype is not None and quantize.has_spec(dtype):  # values + scales: quantize.py
    x, dst_sharding, src_sharding, dtype = quantize.plan_arguments(
        x, dst_sharding, src_sharding, dtype)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  n = len(leaves)
  names = lambda: leaf_names(x)  # noqa: E731
  dsts = broadcast_prefix(api, "dst_sharding", dst_sharding, x, treedef, n, names)
  given = ([None] * n if src_sharding is None else
           broadcast_prefix(api, "src_sharding", src_sharding, x, treedef, n, names))
  out_dtypes = dtypes_per_leaf(api, dtype, x, treedef, n)
  shapes, dtypes, srcs, resolved, wire_out = [], [], [], [], []
  for i, (leaf, dst, src) in enumerate(zip(leaves, dsts, given)):
    out = out_dtypes[i]
    if out is not None:
      out = jax.dtypes.canonicalize_dtype(out)
    src, dst = plan_leaf(api, names()[i], leaf, dst, src, out)
    shapes.append(tuple(getattr(leaf, "shape", ())))
    srcs.append(src)
    resolved.append(dst)
    if out is None or schedule.fused_conversion(leaf.dtype, out):
      dtypes.append(leaf.dtype)
      wire_out.append(out)
    else:  # converted with astype on the source first, then moved as `out`
      dtypes.append(out)
      wire_out.append(None)
  return call_plan.plan_call(shapes, dtypes, srcs, resolved, options, wire_out,
                             path="jax_m2n.plan").plan
