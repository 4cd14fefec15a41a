"""The public entry points `reshard`, `plan` and `check_errors`.

Owns the contract users read (the docstrings), flattening pytrees and choosing the path:
the repeated call's fast path (fast_path.py), the eager per-device programs (eager/)
outside jit, the traced leaves (traced_leaves.py) inside jit or a transformation, the
quantized expansion (quantize.py). Argument rules live in checks.py, the way from a call
to its plan in call_plan.py; nothing here moves data.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax

from jax_m2n._src import call_plan
from jax_m2n._src import checks
from jax_m2n._src import eager
from jax_m2n._src import errors
from jax_m2n._src import fast_path
from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import jax_compat
from jax_m2n._src import quantize
from jax_m2n._src import schedule
from jax_m2n._src import traced_leaves
from jax_m2n._src.errors import API
from jax_m2n._src.planner import Plan
from jax_m2n._src.request import Request
from jax_m2n._src.topology import Topology

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
    * Outside jit, committed device arrays: jax_m2n's eager path, one compiled
      program per participating device over every leaf of the call, compiled once per
      (device's schedule, buffers) and reused by later calls and by other pytrees of
      the same layouts. Source and destination device sets may be disjoint (trainer ->
      generator), overlapping or identical.
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
  leaves, treedef = jax.tree_util.tree_flatten(x)
  # A repeated call whose outcome follows from its arguments' types and layouts: one
  # lookup (fast_path.py); else every check, then the traced or the eager path.
  fast = fast_path.key(leaves, treedef, dst_sharding, route, topology, donate,
                       src_sharding, timeout_s, chunk_bytes, dtype)
  outs = fast_path.call(fast, leaves, donate) if fast is not None else None
  if outs is None:
    outs = _reshard_leaves(x, leaves, treedef, dst_sharding, route, topology, donate,
                           src_sharding, timeout_s, chunk_bytes, dtype, fast)
  return jax.tree_util.tree_unflatten(treedef, outs)


def _reshard_leaves(x, leaves, treedef, dst_sharding, route, topology, donate,
                    src_sharding, timeout_s, chunk_bytes, dtype, fast) -> list[Any]:
  """`reshard`'s full path over x's flattened leaves: the argument rules (checks.py,
  before anything moves), then the traced leaves inside a trace, else the eager path;
  the outputs in leaf order. `fast`: the call's fast-path key (the eager path's
  outcome is remembered under it), or None."""
  options = checks.options(API, route, topology, timeout_s, chunk_bytes)
  n = len(leaves)
  names = checks.names_once(x)  # formed once, only when a message or plan needs them
  dsts = checks.broadcast_prefix(API, "dst_sharding", dst_sharding, x, treedef, n)
  srcs = ([None] * n if src_sharding is None else
          checks.broadcast_prefix(API, "src_sharding", src_sharding, x, treedef, n))
  flags = checks.donate_flags(API, donate, x, treedef, n)
  out_dtypes = checks.dtypes_per_leaf(API, dtype, x, treedef, n)
  if not n:
    return []
  if dtype is not None:
    out_dtypes, dsts = checks.conversions(API, leaves, dsts, out_dtypes, names)
  dsts = checks.check_call_shardings(API, leaves, dsts, srcs, names)
  if not jax_compat.trace_state_clean() or any(
      isinstance(v, jax.core.Tracer) for v in leaves):
    return traced_leaves.reshard(leaves, dsts, srcs, options, names, out_dtypes)
  record = [] if fast is not None else None
  outs = eager.reshard(Request(leaves=leaves, treedef=treedef, dsts=dsts, srcs=srcs,
                               out_dtypes=out_dtypes, donate=flags, options=options,
                               names=names), record)
  if record:
    fast_path.remember(fast, record)
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
      raise errors.map_native_error(RuntimeError(sticky))


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
  names = checks.names_once(x)  # formed only for a message, once per call
  dsts = checks.broadcast_prefix(api, "dst_sharding", dst_sharding, x, treedef, n)
  given = ([None] * n if src_sharding is None else
           checks.broadcast_prefix(api, "src_sharding", src_sharding, x, treedef, n))
  out_dtypes = checks.dtypes_per_leaf(api, dtype, x, treedef, n)
  shapes, dtypes, srcs, resolved, wire_out = [], [], [], [], []
  for i, (leaf, dst, src) in enumerate(zip(leaves, dsts, given)):
    out = out_dtypes[i]
    if out is not None:
      out = jax.dtypes.canonicalize_dtype(out)
    src, dst = checks.plan_leaf(api, checks.LazyName(names, i), leaf, dst, src, out)
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
