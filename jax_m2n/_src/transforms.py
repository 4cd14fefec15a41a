"""The `jax_m2n_reshard` JAX primitive: how reshard behaves under jit, grad and vmap.

Owns the rules JAX needs for a traced reshard: its abstract value (shape, dtype,
weak_type kept; the destination sharding in the type on Explicit axes), its eager
implementation (eager/'s per-device programs), its lowering inside jit (traced.py's
shard_map, or custom_partitioning where only XLA knows the source layout), its JVP and
transpose (a reshard is linear: the cotangent is resharded back to the source layout,
on Explicit axes the one in the source's type, and a converting reshard's cotangent
converted back to the source dtype, as astype's) and its batching rule (the batch
dimension sharded as jax.sharding.reshard / with_sharding_constraint shard it).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jax_m2n._src import jax_compat
from jax_m2n._src import eager
from jax_m2n._src import traced
from jax_m2n._src.errors import API, ReshardValueError, Unplaceable
from jax_m2n._src.request import Options, Request

logger = logging.getLogger("jax_m2n")

Primitive, ad, batching, mlir = jax_compat.primitive_machinery()

reshard_p = Primitive("jax_m2n_reshard")
reshard_p.multiple_results = True


def bind(leaves: Sequence[Any], dsts: Sequence[Any], srcs: Sequence[Any],
         options: Options, out_dtypes: Sequence[Any] | None = None) -> list[Any]:
  """Stages (or, on concrete values, runs) one reshard of `leaves`; `out_dtypes`: per
  leaf the dtype of a fused conversion (schedule.fused_conversion), None: keep. The
  call's options travel whole, as one parameter of the primitive."""
  out_dtypes = tuple(out_dtypes) if out_dtypes is not None else (None,) * len(leaves)
  return reshard_p.bind(*leaves, dsts=tuple(dsts), srcs=tuple(srcs), options=options,
                        out_dtypes=out_dtypes)


def _names(n: int):
  return lambda: [f"x[{i}]" for i in range(n)]


def _impl(*leaves, dsts, srcs, options, out_dtypes):
  # Concrete values (a JVP's primal, a transpose's cotangent, a vmapped batch): the
  # eager path, from the arrays' actual layouts (a cotangent's layout is whatever the
  # backward pass produced, not necessarily the forward destination).
  n = len(leaves)
  return eager.reshard(Request(
      leaves=list(leaves), treedef=jax.tree.structure([0] * n), dsts=list(dsts),
      srcs=[None] * n, out_dtypes=list(out_dtypes), donate=[False] * n,
      options=options, names=_names(n)))


def is_explicit(sharding: Any) -> bool:
  return isinstance(sharding, NamedSharding) and any(
      t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)


def _abstract_eval(*avals, dsts, srcs, options, out_dtypes):
  del srcs, options
  outs = []
  for aval, dst, out_dtype in zip(avals, dsts, out_dtypes):
    if out_dtype is not None:  # as astype: the new dtype, never weak
      aval = aval.update(dtype=out_dtype, weak_type=False)
    if is_explicit(dst):
      spec = tuple(dst.spec) + (None,) * (aval.ndim - len(dst.spec))
      aval = aval.update(sharding=NamedSharding(dst.mesh.abstract_mesh,
                                                PartitionSpec(*spec)))
    elif dst is not None and is_explicit(getattr(aval, "sharding", None)):
      # An Auto (or single-device) destination carries no layout in the type.
      aval = jax_compat.plain_aval(aval)
    outs.append(aval)
  return outs


def _lowered(*leaves, dsts, srcs, options, out_dtypes):
  """Inside jit: jax_m2n's shard_map where the source layout is known (its type on
  Explicit axes, or src_sharding=); XLA's partitioner (a sharding constraint) where it is
  not, since only XLA knows then where the operand lives (a conversion is then XLA's
  `convert` before the constraint)."""
  leaves = list(leaves)
  outs = [v if o is None else v.astype(o) for v, o in zip(leaves, out_dtypes)]
  known, unknown = [], []
  for i, (leaf, dst, src) in enumerate(zip(leaves, dsts, srcs)):
    if dst is None:
      continue
    if src is not None or traced._typed_sharding(jax.typeof(leaf)) is not None:
      known.append(i)
    else:
      unknown.append(i)

  def traced_path(idx):
    return traced._reshard_traced([leaves[i] for i in idx], [dsts[i] for i in idx],
                                  [srcs[i] for i in idx], options,
                                  lambda: [f"x[{i}]" for i in idx],
                                  [out_dtypes[i] for i in idx])

  groups = [known] if known else []
  try:
    ys = traced_path(known) if known else []
  except Unplaceable:  # leaf by leaf; what still cannot be placed goes to XLA
    groups, ys = [], []
    for i in known:
      try:
        ys.extend(traced_path([i]))
        groups.append([i])
      except Unplaceable as e:
        unknown.append(i)
        logger.debug("reshard: x[%d] handed to XLA's partitioner (in jit): %s", i, e)
  for i, y in zip([i for g in groups for i in g], ys):
    outs[i] = y
  if groups:
    logger.debug("reshard: traced shard_map path (in jit) for %d leaves",
                 sum(map(len, groups)))
  for i in unknown:
    dst = dsts[i]
    dst = dst.sharding if isinstance(dst, jax.ShapeDtypeStruct) else dst
    outs[i] = constrain(outs[i], dst)
  if unknown:
    logger.debug("reshard: delegated %d leaves to XLA's partitioner (in jit, source "
                 "layout not in the type, no src_sharding=, and a destination that "
                 "custom_partitioning cannot place: %s)", len(unknown),
                 [dsts[i] for i in unknown])
  return outs


def constrain(v: Any, dst: Any) -> Any:
  """XLA's move of a traced value to `dst` (jax.device_put inside jit keeps the
  operand's layout): jax.sharding.reshard on Explicit axes, else a constraint."""
  return (jax.sharding.reshard(v, dst) if is_explicit(dst) else
          traced.state_layout(v, dst))


def _sharding_of(dst: Any) -> Any:
  return dst.sharding if isinstance(dst, jax.ShapeDtypeStruct) else dst


def _lowering(ctx, *values, dsts, srcs, out_dtypes, options):
  """Inside jit: leaves whose source layout only XLA's partitioner knows (no
  src_sharding=, not in the type) and whose destination is a device-memory
  NamedSharding on Auto axes go through custom_partitioning (traced.reshard_partitioned,
  one op per destination mesh), which reads the layout XLA gives each operand and runs
  jax_m2n's custom call; every other leaf through `_lowered`."""
  groups: dict[Any, list[int]] = {}
  rest = []
  for i, (aval, dst, src) in enumerate(zip(ctx.avals_in, dsts, srcs)):
    dst = _sharding_of(dst)
    if (dst is not None and src is None and traced._typed_sharding(aval) is None and
        aval.ndim and aval.size and traced.partitionable(dst)):
      groups.setdefault(dst.mesh, []).append(i)
    else:
      rest.append(i)
  outs: list[Any] = [None] * len(values)

  def lower(fun, c, idx, **kw):
    c = c.replace(avals_in=[ctx.avals_in[i] for i in idx],
                  avals_out=[ctx.avals_out[i] for i in idx])
    ys = mlir.lower_fun(fun, multiple_results=True)(c, *[values[i] for i in idx], **kw)
    for i, y in zip(idx, ys):
      outs[i] = y

  for mesh, idx in groups.items():
    sub = jax_compat.with_partitioner_mesh(ctx, mesh)
    if sub is None:  # not a whole-program jit over the mesh's devices
      rest.extend(idx)
      continue
    lower(lambda *xs, idx=idx: traced.reshard_partitioned(
        list(xs), [_sharding_of(dsts[i]) for i in idx], options,
        [out_dtypes[i] for i in idx]), sub, idx)
  if rest:
    rest.sort()
    lower(_lowered, ctx, rest, dsts=tuple(dsts[i] for i in rest),
          srcs=tuple(srcs[i] for i in rest),
          out_dtypes=tuple(out_dtypes[i] for i in rest), options=options)
  return outs


def _concrete_sharding(v: Any) -> Any:
  if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer):
    return v.sharding
  return None


def _jvp(primals, tangents, *, dsts, srcs, out_dtypes, **params):
  # Source layouts of concrete primals are known now; the transpose needs them.
  srcs = tuple(s if s is not None else _concrete_sharding(p)
               for s, p in zip(srcs, primals))
  outs = reshard_p.bind(*primals, dsts=dsts, srcs=srcs, out_dtypes=out_dtypes, **params)
  live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
  t_outs: list[Any] = [jax_compat.tangent_zero(y) for y in outs]
  if live:
    ys = reshard_p.bind(*[tangents[i] for i in live],
                        dsts=tuple(dsts[i] for i in live),
                        srcs=tuple(srcs[i] for i in live),
                        out_dtypes=tuple(out_dtypes[i] for i in live), **params)
    for i, y in zip(live, ys):
      t_outs[i] = y
  return outs, t_outs


def _transpose(cts, *args, dsts, srcs, out_dtypes, **params):
  # The cotangent goes back to the source layout (None, where unknown: left as XLA
  # placed it, which is value-equal), and to the source dtype where the forward
  # converted (astype's transpose).
  live = [i for i, ct in enumerate(cts) if type(ct) is not ad.Zero]
  out: list[Any] = [ad.Zero(a.aval) if ad.is_undefined_primal(a) else None for a in args]
  if live:
    back = tuple(None if out_dtypes[i] is None else
                 (args[i].aval.dtype if ad.is_undefined_primal(args[i])
                  else jax.typeof(args[i]).dtype) for i in live)
    ys = reshard_p.bind(*[ad.instantiate_zeros(cts[i]) for i in live],
                        dsts=tuple(_cotangent_dst(srcs[i], args[i], dsts[i])
                                   for i in live),
                        srcs=tuple(dsts[i] for i in live), out_dtypes=back, **params)
    for i, y in zip(live, ys):
      out[i] = y
  return out


def _cotangent_dst(src: Any, primal: Any, dst: Any) -> Any:
  """Where a cotangent goes back to: the source layout (src_sharding= or the primal's
  concrete layout), else, on Explicit axes, the one in the primal's type (JAX checks
  that the cotangent carries it); None where unknown (left as XLA placed it)."""
  if src is not None:
    return src
  aval = primal.aval if ad.is_undefined_primal(primal) else jax.typeof(primal)
  typed = traced._typed_sharding(aval)
  if typed is None:
    return None
  mesh = traced._concrete_mesh_for(typed.mesh, [_sharding_of(dst)])
  return NamedSharding(mesh, typed.spec) if mesh is not None else None


def _batched(sharding: Any, what: str, batch_entry: Any = None) -> Any:
  """A sharding for the same layout with a leading batch dimension sharded as
  `batch_entry` (None: unsharded)."""
  if sharding is None or isinstance(sharding, SingleDeviceSharding):
    return sharding
  if isinstance(sharding, jax.ShapeDtypeStruct):
    sharding = sharding.sharding
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(batch_entry, *sharding.spec),
                         memory_kind=sharding.memory_kind)
  raise ReshardValueError(
      f"{API}: under jax.vmap the {what} sharding must be a NamedSharding or a "
      f"SingleDeviceSharding (the batch dimension is added to its spec); got "
      f"{type(sharding).__name__} {sharding}.")


def _batch_entry(axis_data: Any, sharding: Any, what: str) -> Any:
  """The batch dimension's spec entry, as JAX's own rules place it: on Explicit axes
  the mesh axes the batched operand's type gives it (jax.sharding.reshard), on Auto
  axes the vmap's spmd_axis_name (with_sharding_constraint), else None."""
  sharding = _sharding_of(sharding)
  if not isinstance(sharding, NamedSharding):
    return None
  explicit_axes, spmd = jax_compat.vmap_batch_axes(axis_data)
  if is_explicit(sharding):
    return explicit_axes
  if spmd is None:
    return None
  spmd = (spmd,) if isinstance(spmd, str) else tuple(spmd)
  used = {a for e in sharding.spec if e is not None
          for a in ((e,) if isinstance(e, str) else e)}
  if set(spmd) & used:
    raise ReshardValueError(
        f"{API}: under jax.vmap(spmd_axis_name={spmd}) the {what} sharding must not "
        f"name those mesh axes (the batch dimension is sharded over them); got spec "
        f"{sharding.spec}.")
  return spmd[0] if len(spmd) == 1 else spmd


def _batch(axis_data, args, dims, *, dsts, srcs, **params):
  # An unmapped operand's dim is None (batching.not_mapped in some JAX versions).
  mapped = [d is not None and d is not getattr(batching, "not_mapped", None)
            for d in dims]
  args = [jax.numpy.moveaxis(a, d, 0) if m and d != 0 else a
          for a, d, m in zip(args, dims, mapped)]
  dsts = tuple(_batched(s, "destination", _batch_entry(axis_data, s, "destination"))
               if m else s for s, m in zip(dsts, mapped))
  srcs = tuple(_batched(s, "source", _batch_entry(axis_data, s, "source"))
               if m else s for s, m in zip(srcs, mapped))
  outs = reshard_p.bind(*args, dsts=dsts, srcs=srcs, **params)
  return outs, [0 if m else None for m in mapped]


reshard_p.def_impl(_impl)
reshard_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(reshard_p, _lowering)
ad.primitive_jvps[reshard_p] = _jvp
ad.primitive_transposes[reshard_p] = _transpose
jax_compat.register_batching_rule(reshard_p, _batch)
