"""The in-jit path: one SPMD program, a shard_map over a common refinement of the meshes.

Owns lowering a reshard traced inside jit: finding each leaf's source layout (its type,
src_sharding= or the context mesh), refining source and destination meshes into one
mesh, and emitting one `jax_m2n_reshard` custom call per device inside `shard_map`; or,
where only XLA's partitioner knows the source layout, the same per-device call placed by
custom_partitioning. Never dispatches eagerly and never decides what moves (the planner
does).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jax_m2n._src import call_plan
from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.checks import check_holds, check_in_process, check_rank, platform_of
from jax_m2n._src.errors import API, ReshardTypeError, ReshardValueError, Unplaceable
from jax_m2n._src.request import Options

logger = logging.getLogger("jax_m2n")

# ---------------------------------------------------------------------------------------
# Inside jit: one SPMD program, shard_map over a common refinement of the meshes
# ---------------------------------------------------------------------------------------

_jit_sites = itertools.count(1)


def _outside_jit_hint() -> str:
  return " Hint: call jax_m2n.reshard outside jit (it accepts any layouts there)."


def _typed_sharding(aval) -> NamedSharding | None:
  """The sharding JAX's type system knows for an abstract value (explicit axes), if any."""
  s = getattr(aval, "sharding", None)
  if not isinstance(s, NamedSharding) or s.mesh.empty:
    return None
  types = getattr(s.mesh, "axis_types", ())
  if not types or not all(t == jax.sharding.AxisType.Explicit for t in types):
    return None
  return s


def _spec_entries(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
  """A PartitionSpec as one tuple of mesh axis names per dim (None -> ())."""
  out = []
  for e in tuple(spec) + (None,) * (ndim - len(spec)):
    out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
  return tuple(out)


def _has_type(v, abstract_mesh, spec: PartitionSpec) -> bool:
  s = jax.typeof(v).sharding
  return (s.mesh == abstract_mesh and
          _spec_entries(s.spec, v.ndim) == _spec_entries(spec, v.ndim))


def _concrete_mesh_for(abstract_mesh, candidates: Sequence[Sharding]):
  for s in candidates:
    if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh) and (
        s.mesh.abstract_mesh == abstract_mesh):
      return s.mesh
  try:  # the context mesh of jax.set_mesh; JAX refuses get_mesh inside jit
    mesh = jax.sharding.get_mesh()
  except Exception:  # noqa: BLE001
    mesh = None
  if isinstance(mesh, Mesh) and not mesh.empty and mesh.abstract_mesh == abstract_mesh:
    return mesh
  return None


def _as_named(api: str, name: str, s: Sharding, what: str) -> NamedSharding:
  if isinstance(s, NamedSharding):
    if not isinstance(s.mesh, Mesh):
      raise ReshardValueError(
          f"{api}: inside jit the {what} sharding of {name} must be on a concrete Mesh; "
          f"got {s}.{_outside_jit_hint()}")
    return s
  if isinstance(s, SingleDeviceSharding):
    (d,) = s.device_set
    return NamedSharding(Mesh(np.array([d]), ("m2n_single",)), PartitionSpec())
  raise ReshardValueError(
      f"{api}: inside jit the {what} sharding of {name} must be a NamedSharding (or "
      f"SingleDeviceSharding); got {type(s).__name__} {s}.{_outside_jit_hint()}")


@dataclasses.dataclass(frozen=True)
class _Refinement:
  mesh: Mesh
  axes: dict[tuple[int, str], tuple[str, ...]]  # (id(mesh), axis) -> refined axes

  def spec(self, s: NamedSharding, ndim: int) -> PartitionSpec:
    entries = []
    for names in _spec_entries(s.spec, ndim):
      refined = tuple(a for n in names for a in self.axes[(id(s.mesh), n)])
      entries.append(None if not refined else refined[0] if len(refined) == 1
                     else refined)
    return PartitionSpec(*entries)


def _refine(api: str, name: str, shardings: Sequence[NamedSharding],
            explicit: bool) -> _Refinement:
  """A mesh over the same devices whose axes refine every given mesh's axes.

  Both meshes must flatten to the same device order and their prefix products (major
  axis first) must form a divisor chain, e.g. (4,) and (2, 2), or (2, 4) and (4, 2).
  """
  meshes: list[Mesh] = []
  for s in shardings:
    if not any(s.mesh is m for m in meshes):
      meshes.append(s.mesh)
  first = meshes[0]
  types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto)
  if all(m == first for m in meshes) and all(
      t == types for t in first.axis_types):
    return _Refinement(first, {(id(m), a): (a,) for m in meshes for a in m.axis_names})
  order = tuple(d.id for d in first.devices.flat)
  cuts = {1}
  for m in meshes:
    if tuple(d.id for d in m.devices.flat) != order:
      raise ReshardValueError(
          f"{api}: inside jit the meshes of {name} must list the same devices in the "
          f"same order; got {tuple(d.id for d in m.devices.flat)} and {order}."
          f"{_outside_jit_hint()}")
    p = 1
    for size in m.devices.shape:
      p *= size
      cuts.add(p)
  chain = sorted(cuts)
  for a, b in zip(chain, chain[1:]):
    if b % a:
      raise Unplaceable(
          f"{api}: inside jit the meshes of {name} must refine a common mesh (their "
          f"axis-size prefix products must divide one another); got mesh shapes "
          f"{[tuple(m.devices.shape) for m in meshes]}.{_outside_jit_hint()}")
  sizes = [b // a for a, b in zip(chain, chain[1:])] or [1]
  names = tuple(f"m2n_r{i}" for i in range(len(sizes)))  # no leading "_": Shardy drops such axes
  mesh = Mesh(np.array(first.devices.flat, dtype=object).reshape(sizes), names,
              axis_types=(types,) * len(names))
  axes: dict[tuple[int, str], tuple[str, ...]] = {}
  for m in meshes:
    p = 1
    for axis, size in zip(m.axis_names, m.devices.shape):
      lo, hi = p, p * size
      axes[(id(m), axis)] = tuple(
          names[i] for i in range(len(chain) - 1) if chain[i] >= lo and chain[i + 1] <= hi)
      p = hi
  return _Refinement(mesh, axes)


def _reshard_traced(leaves, dsts, src_shardings, options: Options, names,
                    out_dtypes=None) -> list:
  """`out_dtypes`: per leaf the destination dtype of a fused conversion, None: keep."""
  out_dtypes = list(out_dtypes or [None] * len(leaves))
  shapes, dtypes, srcs, dst_named, typed_any = [], [], [], [], False
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    name = names()[i]
    aval = jax.typeof(leaf)
    shape, dtype = tuple(aval.shape), aval.dtype
    # The lowering's preconditions on the primitive's operands (the call's arguments
    # were checked before it was bound): a transformation may have batched them since,
    # and a batch dimension can leave a destination unable to hold the shape or take
    # the rank past the handlers' bound.
    dst_sharding = dst
    check_holds(API, name, dst_sharding, shape, "destination")
    check_rank(API, name, shape)
    typed = _typed_sharding(aval)
    given = src_shardings[i]
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      given = given if given is not None else leaf.sharding
    if typed is not None:
      typed_any = True
      concrete = _concrete_mesh_for(typed.mesh, [given, dst_sharding])
      if given is not None:
        g = _as_named(API, name, given, "source")
        if (g.mesh.abstract_mesh != typed.mesh or
            _spec_entries(g.spec, len(shape)) != _spec_entries(typed.spec, len(shape))):
          raise ReshardValueError(
              f"{API}: src_sharding of {name} must match the sharding in its type; got "
              f"{given} for a value typed {typed}.")
        src = g
      elif concrete is None:
        raise Unplaceable(
            f"{API}: inside jit the devices of {name}'s mesh must be known; got a value "
            f"typed {typed} and no concrete mesh for it. Hint: pass src_sharding=, or "
            "use jax.set_mesh(mesh).")
      else:
        src = NamedSharding(concrete, typed.spec)
    elif given is not None:
      if not isinstance(given, Sharding):
        raise ReshardTypeError(
            f"{API}: src_sharding of {name} must be a jax.sharding.Sharding; got "
            f"{type(given).__name__}.")
      src = given
    else:
      raise ReshardValueError(
          f"{API}: inside jit the source sharding of {name} must be known; got a value "
          f"whose type carries no sharding ({aval.str_short() if hasattr(aval, 'str_short') else aval}). "
          "Hint: pass src_sharding= (the layout x has inside the jit), or use "
          "explicit-sharding meshes (jax.make_mesh(..., axis_types=Explicit)) so JAX "
          "knows it.")
    check_holds(API, name, src, shape, "source")
    src = _as_named(API, name, src, "source")
    dnamed = _as_named(API, name, dst_sharding, "destination")
    _check_same_devices(name, src, dnamed)
    if srcs and jax_compat.device_assignment(src) != jax_compat.device_assignment(srcs[0]):
      raise ReshardValueError(
          f"{API}: inside jit every leaf must be on the same devices; got "
          f"{[d.id for d in jax_compat.device_assignment(src)]} for {name} and "
          f"{[d.id for d in jax_compat.device_assignment(srcs[0])]} for {names()[0]}."
          f"{_outside_jit_hint()}")
    shapes.append(shape)
    dtypes.append(dtype)
    srcs.append(src)
    dst_named.append(dnamed)
  if not leaves:
    return []

  refinement = _refine(API, names()[0] if len(leaves) == 1 else "x",
                       srcs + dst_named, typed_any)
  src_specs = [refinement.spec(s, len(shape)) for s, shape in zip(srcs, shapes)]
  dst_specs = [refinement.spec(s, len(shape)) for s, shape in zip(dst_named, shapes)]

  # Zero-size leaves move no bytes: they stay out of the call and are made empty in
  # place (XLA 0.11.2 crashes compiling a shard_map over empty and non-empty arrays).
  empty = [math.prod(shape) == 0 for shape in shapes]
  if any(empty):
    live = [i for i, e in enumerate(empty) if not e]
    live_outs = iter(_reshard_traced(
        [leaves[i] for i in live], [dsts[i] for i in live], [srcs[i] for i in live],
        options, lambda: [names()[i] for i in live], [out_dtypes[i] for i in live])
        if live else [])
    result = []
    for i, e in enumerate(empty):
      if not e:
        result.append(next(live_outs))
        continue
      y = jnp.zeros(shapes[i], out_dtypes[i] or dtypes[i])
      dst = dst_named[i]
      if any(t == jax.sharding.AxisType.Explicit for t in dst.mesh.axis_types):
        y = jax.sharding.reshard(y, dst)
      else:
        y = jax.lax.with_sharding_constraint(y, dst)
      result.append(y)
    return result

  body = _spmd_body(srcs, dst_named, shapes, dtypes, options, b"jit", out_dtypes)

  mesh = refinement.mesh
  if typed_any:  # a type-level cast onto the refined mesh: the same bytes, no copy
    leaves = [v if _has_type(v, mesh.abstract_mesh, sp)
              else jax.sharding.reshard(v, NamedSharding(mesh, sp))
              for v, sp in zip(leaves, src_specs)]
  smap = jax.shard_map(body, mesh=mesh, in_specs=tuple(src_specs),
                       out_specs=tuple(dst_specs), check_vma=False)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and context != mesh.abstract_mesh:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      outs = smap(*leaves)
  else:
    outs = smap(*leaves)
  result = []
  for y, dst in zip(outs, dst_named):
    if any(t == jax.sharding.AxisType.Explicit for t in dst.mesh.axis_types) or typed_any:
      if not _has_type(y, dst.mesh.abstract_mesh, dst.spec):
        y = jax.sharding.reshard(y, dst)
    else:
      y = jax.lax.with_sharding_constraint(y, dst)
    result.append(y)
  return result



def _prime_factors(n: int) -> list[int]:
  out, p = [], 2
  while n > 1:
    while n % p == 0:
      out.append(p)
      n //= p
    p += 1
  return out or [1]


def prime_mesh_sharding(dst: NamedSharding) -> NamedSharding:
  """The same layout as `dst` (Auto axes, a concrete Mesh) on a mesh of the same devices
  in the same order whose axes are `dst`'s split into prime sizes ((4, 2) -> (2, 2, 2)):
  `dst` itself where every axis is already prime or 1."""
  mesh = dst.mesh
  factors = {a: _prime_factors(n) for a, n in mesh.shape.items()}
  if all(len(f) == 1 for f in factors.values()):
    return dst
  names, sizes, split = [], [], {}
  for a, f in factors.items():  # no leading "_": Shardy drops such axes
    split[a] = tuple(f"m2n_{a}_{i}" for i in range(len(f)))
    names.extend(split[a])
    sizes.extend(f)
  prime = Mesh(np.array(mesh.devices.flat, dtype=object).reshape(sizes), tuple(names),
               axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  entries = []
  for e in dst.spec:
    if e is None or e is PartitionSpec.UNCONSTRAINED:
      entries.append(e)
    else:
      entries.append(tuple(x for a in ((e,) if isinstance(e, str) else e)
                           for x in split[a]))
  return NamedSharding(prime, PartitionSpec(*entries), memory_kind=dst.memory_kind)


def state_layout(v: Any, dst: Any) -> Any:
  """A traced value constrained to `dst` where the jit's outputs read their layout
  from: the jaxpr. On Auto axes two constraints of one layout (no data moves): on
  `prime_mesh_sharding(dst)`, then on `dst`. XLA's Shardy, given only the second for a
  value whose operand lives on a mesh of another shape ((2, 4) P('b', 'a') -> (4, 2)
  P('d', 'c')), gives the jit's output another layout ({devices=[1,2,4]<=[8]
  last_tile_dim_replicate}) that JAX 0.10.2 cannot name (an IndivisibleError from the
  jit, for JAX's own with_sharding_constraint too); through the prime mesh it keeps
  `dst`. Under vmap (or a JVP) only `dst`: the batch rule of spmd_axis_name= names
  `dst`'s own mesh axes."""
  if jax_compat.is_jaxpr_tracer(v) and isinstance(dst, NamedSharding) and isinstance(
      dst.mesh, Mesh) and all(t == jax.sharding.AxisType.Auto for t in dst.mesh.axis_types):
    v = jax.lax.with_sharding_constraint(v, prime_mesh_sharding(dst))
  return jax.lax.with_sharding_constraint(v, dst)


def check_staged_devices(name: str, aval, given: Sharding | None, dst: Sharding) -> None:
  """At trace time, what lowering would refuse later (after JAX's own device checks
  had raised a less clear error): source and destination on the jit's devices."""
  typed = _typed_sharding(aval)
  src = given
  if src is None and typed is not None:
    mesh = _concrete_mesh_for(typed.mesh, [dst])
    src = NamedSharding(mesh, typed.spec) if mesh is not None else None
  context = jax_compat.context_mesh()
  if context is not None and isinstance(dst, (NamedSharding, SingleDeviceSharding)):
    # Under jax.set_mesh the context mesh's device order is the jit's (JAX checks it).
    want = [d.id for d in context.devices.flat]
    got = [d.id for d in jax_compat.device_assignment(_as_named(API, name, dst,
                                                                "destination"))]
    if got != want:
      raise ReshardValueError(
          f"{API}: inside jit the destination of {name} must be on the jit's devices "
          f"in their order (under jax.set_mesh, the context mesh's); got destination "
          f"devices {got} and context mesh devices {want}. Hint: call "
          "jax_m2n.reshard outside jit to move arrays between device sets.")
  if src is None:
    # On Auto axes the type still names the source's mesh shape (not its devices): a
    # destination on another number of devices cannot be on the jit's devices.
    s = getattr(aval, "sharding", None)
    mesh = getattr(s, "mesh", None)
    if (isinstance(mesh, jax.sharding.AbstractMesh) and not mesh.empty and
        mesh.size != len(dst.device_set)):
      raise ReshardValueError(
          f"{API}: inside jit the destination of {name} must be on the jit's devices "
          f"(those of its source); got destination devices "
          f"{[d.id for d in jax_compat.device_assignment(dst)]} for a source on a mesh "
          f"of {mesh.size} devices {dict(mesh.shape)}. Hint: call jax_m2n.reshard "
          "outside jit to move arrays between device sets.")
  if src is None or not isinstance(src, (NamedSharding, SingleDeviceSharding)):
    return
  _check_same_devices(name, _as_named(API, name, src, "source"),
                      _as_named(API, name, dst, "destination"))


def _check_same_devices(name: str, src: NamedSharding, dst: NamedSharding) -> None:
  """Inside jit: source and destination on the same devices in the same order (the
  jit's device assignment)."""
  if jax_compat.device_assignment(src) != jax_compat.device_assignment(dst):
    raise ReshardValueError(
        f"{API}: inside jit the source and destination of {name} must be on the same "
        f"devices in the same order (jit's device assignment); got source devices "
        f"{[d.id for d in jax_compat.device_assignment(src)]} and destination devices "
        f"{[d.id for d in jax_compat.device_assignment(dst)]}. Hint: call "
        "jax_m2n.reshard outside jit to move arrays between device sets.")


def _spmd_body(srcs: Sequence[Sharding], dsts: Sequence[Sharding], shapes, dtypes,
               options: Options, tag: bytes, out_dtypes=None):
  """The per-device body of an in-jit reshard: one custom call over local shards, run
  by every device of the SPMD program (the schedule names each device's ops). Operands
  have `dtypes`, results `out_dtypes` (None: the same): the call converts in flight."""
  devices = jax_compat.device_assignment(srcs[0])
  platform = platform_of(devices)
  check_in_process(API, platform, devices)
  staging = platform != "cpu"
  m2n_ffi.ensure_registered(platform, options.timeout_ms)
  planned = call_plan.plan_call(shapes, dtypes, srcs, dsts, options, out_dtypes,
                                path="in-jit custom call")
  plan, types = planned.plan, planned.types
  sched = schedule.encode(plan, None, staging, types)
  site = schedule.site_key(tag, sched, next(_jit_sites))
  workspace = max(1, schedule.workspace_bytes(plan, None, staging, types))
  out_types = [jax.ShapeDtypeStruct(s.shard_shape(shape), dt)
               for s, shape, dt in zip(dsts, shapes, planned.out_dtypes)]
  out_types.append(jax.ShapeDtypeStruct((workspace,), np.uint8))
  call = jax.ffi.ffi_call(m2n_ffi.TARGET_NAME, out_types)
  extra = m2n_ffi.transport_attrs(platform, planned.topology, plan.devices)
  timeout_ms = options.timeout_ms

  def body(*shards):
    outs = call(*shards, schedule=sched, site=np.int64(site),
                timeout_ms=np.int64(timeout_ms), **extra)
    return tuple(outs[:-1])

  return body


# ---------------------------------------------------------------------------------------
# Inside jit, source layout known only to XLA's partitioner: custom_partitioning
# ---------------------------------------------------------------------------------------


def partitionable(dst: Any) -> bool:
  """Whether a leaf whose source layout only XLA's partitioner knows can go to `dst`
  through `reshard_partitioned`: a NamedSharding on a concrete Mesh with Auto axes, in
  device memory (host memory kinds and typed layouts take the other paths), on a
  platform with a transport (CPU devices of this process, or GPUs)."""
  if not (isinstance(dst, NamedSharding) and isinstance(dst.mesh, Mesh) and
          all(t == jax.sharding.AxisType.Auto for t in dst.mesh.axis_types) and
          dst.memory_kind in (None, "device")):
    return False
  platform = platform_of(dst.mesh.devices.flat)
  if platform == "cpu":
    return dst.is_fully_addressable
  return platform in ("gpu", "cuda")


def _factor_rule(shapes: Sequence[tuple[int, ...]]) -> str:
  """A Shardy sharding rule with one free factor per dimension: nothing links an
  operand's dims to a result's, so each keeps its own layout (the operand's from XLA,
  the result's from the destination constraint)."""
  names = itertools.count()
  ins = [" ".join(f"i{next(names)}" for _ in s) for s in shapes]
  outs = [" ".join(f"o{next(names)}" for _ in s) for s in shapes]
  return ", ".join(ins) + " -> " + ", ".join(outs)


def reshard_partitioned(leaves, dsts: Sequence[NamedSharding], options: Options,
                        out_dtypes=None) -> list:
  """Inside jit, leaves whose source layout only XLA's partitioner knows, every
  destination on one mesh (whose device order is the jit's): one custom_partitioning
  op whose partition callback reads each operand's sharding (any layout over the jit's
  devices, on whatever mesh) and emits jax_m2n's custom call over the local shards,
  with the same plan and schedule as `_reshard_traced` with src_sharding=. To be
  lowered with `jax_compat.with_partitioner_mesh(ctx, dsts[0].mesh)`."""
  from jax.experimental.custom_partitioning import custom_partitioning

  shapes = [tuple(jax.typeof(v).shape) for v in leaves]
  dtypes = [jax.typeof(v).dtype for v in leaves]
  for i, (shape, dst) in enumerate(zip(shapes, dsts)):  # as _reshard_traced's
    check_holds(API, f"x[{i}]", dst, shape, "destination")
    check_rank(API, f"x[{i}]", shape)
  mesh = dsts[0].mesh
  n = len(leaves)  # the callbacks below outlive the trace: they must hold no tracer
  out_dtypes = list(out_dtypes or [None] * n)

  def same(*xs):  # the reference (one device: the layout and dtype are the difference)
    return tuple(x if o is None else x.astype(o) for x, o in zip(xs, out_dtypes))

  def partition(part_mesh, arg_shapes, result_shape):
    del part_mesh, result_shape
    # HLO shardings over the jit's device assignment, which is `mesh`'s device order:
    # JAX refuses a jit whose shardings (here the constraint that api.reshard puts on
    # each output) order its devices differently.
    srcs = [a.sharding for a in arg_shapes]
    body = _spmd_body(srcs, dsts, shapes, dtypes, options, b"jit", out_dtypes)
    logger.debug("reshard: custom_partitioning path (in jit) for %d leaves, source "
                 "layouts from XLA's partitioner: %s", n, srcs)
    return mesh, body, tuple(dsts), tuple(srcs)

  def infer(part_mesh, arg_shapes, result_shape):  # GSPMD's propagation
    del part_mesh, arg_shapes, result_shape
    return tuple(dsts)

  moved = custom_partitioning(same)
  # decode_shardings=False: operand shardings arrive as HLO shardings over the jit's
  # devices, so a source on another mesh than the destination's is read as it is.
  moved.def_partition(partition, infer_sharding_from_operands=infer,
                      decode_shardings=False,
                      sharding_rule=lambda *_: _factor_rule(shapes))
  outs = moved(*leaves)
  return [jax.lax.with_sharding_constraint(y, d) for y, d in zip(outs, dsts)]
