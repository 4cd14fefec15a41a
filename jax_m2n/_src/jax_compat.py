"""The one place jax_m2n touches private JAX names, behind a version guard.

Every private attribute or module of JAX that jax_m2n uses is reached through a function
here, so a JAX upgrade that renames one breaks this file (and tests/jax_compat_test.py,
which calls each of them) rather than a reshard in the middle of a training run. Owns no
logic beyond the access itself; where a public spelling exists it is used instead.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Sharding

# JAX releases this shim was written against and is tested with (CPU 0.10.x, GPU 0.11.x).
SUPPORTED_JAX = ((0, 10), (0, 11))


def jax_version() -> tuple[int, int, int]:
  """jax.__version__ as (major, minor, patch); dev suffixes are dropped."""
  parts = [int(re.match(r"\d*", p).group() or 0) for p in jax.__version__.split(".")[:3]]
  return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def version_supported() -> bool:
  return jax_version()[:2] in SUPPORTED_JAX


from jax._src import core as _core  # trace_state_clean: no public spelling in 0.10-0.11


def trace_state_clean() -> bool:
  """False while JAX traces (inside jit, shard_map, grad...): reshard then stages."""
  return _core.trace_state_clean()


def device_assignment(sharding: Sharding) -> tuple[Any, ...]:
  """Every device of a sharding, in its order (the order shards are numbered in)."""
  return sharding._device_assignment  # noqa: SLF001 - no public spelling


def addressable_device_assignment(sharding: Sharding) -> tuple[Any, ...]:
  """The devices of this process, in the sharding's order."""
  return sharding._addressable_device_assignment  # noqa: SLF001


def single_device_arrays(x: jax.Array) -> list[jax.Array]:
  """x's single-device arrays in `addressable_device_assignment` order."""
  arrays = getattr(x, "_arrays", None)
  if arrays is not None:
    return list(arrays)
  order = {d: i for i, d in enumerate(addressable_device_assignment(x.sharding))}
  out: list[Any] = [None] * len(order)
  for s in x.addressable_shards:
    out[order[s.device]] = s.data
  return out


try:  # the class behind jax.Array; checked construction is the public fallback
  from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover - a JAX without it takes the public path
  _ArrayImpl = None


def array_type() -> type | None:
  """The class of concrete jax.Arrays (`type(x) is array_type()` excludes tracers and
  host data); None on a JAX without it (callers then take their general path)."""
  return _ArrayImpl


def array_from_single_device_arrays(shape: Sequence[int], sharding: Sharding,
                                    arrays: Sequence[jax.Array], dtype: Any,
                                    aval: Any = None) -> jax.Array:
  """A committed global array from per-device arrays already known to fit.

  With `aval` (from an earlier, checked construction of the same layout) this skips
  JAX's checks, which cost about half the per-leaf time of a small reshard.
  """
  if aval is not None and _ArrayImpl is not None:
    return _ArrayImpl(aval, sharding, list(arrays), committed=True, _skip_checks=True)
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, list(arrays),
                                                  dtype=dtype)


def arrays_of_known_layouts(known: Sequence[tuple[Any, Sharding]],
                            groups: Sequence[Sequence[jax.Array]]) -> list[jax.Array]:
  """Per (aval, sharding) of `known` (each aval from `reusable_aval`, so this JAX has
  ArrayImpl) and its group of per-device arrays, the committed global array, unchecked:
  `array_from_single_device_arrays` for many leaves in one comprehension. A sharding
  of None: the group's one array is the leaf's array already (`result_handler`)."""
  make = _ArrayImpl
  return [make(aval, sharding, list(arrays), committed=True, _skip_checks=True)
          if sharding is not None else arrays[0]
          for (aval, sharding), arrays in zip(known, groups)]


def runtime_parts(compiled: Any) -> tuple[Callable, Sequence[Any]] | None:
  """(its runtime executable's execute_sharded, its result handlers) of `compiled` (a
  jax.stages.Compiled), or None where this JAX lacks that structure, or the program
  has effects or host callbacks, or jit pruned one of its arguments."""
  try:
    unsafe = compiled._executable.unsafe_call  # noqa: SLF001 - no public spelling
    execute = unsafe.xla_executable.execute_sharded
    handlers = unsafe.out_handler.handlers
    plain = not (unsafe.ordered_effects or unsafe.has_unordered_effects
                 or unsafe.has_host_callbacks or unsafe.mut)
    kept = len(unsafe.kept_var_idx) == len(compiled.in_avals[0])
  except (AttributeError, TypeError, IndexError):
    return None
  return (execute, handlers) if plain and kept else None


def runtime_execute(compiled: Any, parts: tuple[Callable, Sequence[Any]] | None
                    ) -> Callable[[Sequence[jax.Array]], list[jax.Array]]:
  """What runs `compiled` (a jax.stages.Compiled of one device) on single-device
  arrays: with `parts` (`runtime_parts(compiled)`, its result handlers possibly
  replaced by `result_handler`s) through its runtime executable and those handlers
  (C++), returning its flat outputs in order: JAX's call without its Python checks of
  the arguments; with None, JAX's checked call."""
  if parts is None:
    return lambda args: jax.tree.leaves(compiled(*args))
  execute, handlers = parts
  return lambda args: execute(list(args)).consume_with_handlers(handlers)


def result_handler(aval: Any, sharding: Sharding) -> Any:
  """A runtime result handler (for `runtime_execute`'s parts) that makes a program's
  one-device output the committed array of `aval` (from `reusable_aval`) and
  `sharding` (a sharding of that one device) itself, unchecked; None where this JAX
  has no such handler (the caller then assembles the array as before)."""
  try:
    from jax._src.lib import xla_client
    return xla_client.array_result_handler(aval, sharding, committed=True,
                                           _skip_checks=True)
  except (ImportError, AttributeError, TypeError):
    return None


def reusable_aval(y: jax.Array) -> Any:
  """y's abstract value if `array_from_single_device_arrays` may reuse it, else None."""
  if _ArrayImpl is not None and type(y) is _ArrayImpl:
    return y.aval
  return None


@functools.lru_cache(maxsize=1)
def one_device_abstract_sharding() -> Sharding:
  """A sharding of one device, none in particular (a 1-device AbstractMesh): a
  program lowered with it is compiled for a device given then (`lower_abstract`)."""
  mesh = jax.sharding.AbstractMesh((1,), ("d",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def lower_abstract(jitted: Any, in_types: Sequence[Any], platform: str) -> Any:
  """`jitted` lowered for `platform` over `one_device_abstract_sharding()` operands:
  `.compile(device_assignment=(device,))` then places it on any one device."""
  return jitted.trace(*in_types).lower(lowering_platforms=(platform,))


def with_module(lowered: Any, edit: Any) -> Any:
  """A copy of `lowered` (jax.stages.Lowered) whose MLIR module is a clone of its
  own, changed in place by `edit(module)`; `lowered` itself is left as it was.

  JAX has no public way to compile an edited module as a Lowered; this copies the
  Lowered and its lowering (pxla.MeshComputation), replacing the module and the
  compiled executable it caches.
  """
  from jax._src.lib.mlir import ir  # the MLIR bindings JAX lowers with
  lowering = copy.copy(lowered._lowering)  # noqa: SLF001 - see above
  module = lowering._hlo  # noqa: SLF001
  with module.context:
    # A Module, as the compiler takes it (an Operation's clone is a bare ModuleOp).
    clone = ir.Module.parse(_bytecode(module))
    edit(clone)
  lowering._hlo = clone  # noqa: SLF001
  lowering._executable = None  # noqa: SLF001 - the clone's compile is its own
  out = copy.copy(lowered)
  out._lowering = lowering  # noqa: SLF001
  return out


def _bytecode(module: Any) -> bytes:
  """`module` as MLIR bytecode (parsed back by ir.Module.parse)."""
  import io
  buffer = io.BytesIO()
  module.operation.write_bytecode(file=buffer)
  return buffer.getvalue()


def module_ops(module: Any) -> list[Any]:
  """Every operation nested in an MLIR module (or its operation), outermost first."""
  out, stack = [], [module.operation]
  while stack:
    op = stack.pop()
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          out.append(child.operation)
          stack.append(child.operation)
  return out


def context_mesh() -> Any:
  """The concrete mesh of jax.set_mesh / jax.sharding.use_mesh, also while tracing;
  None when none is set (jax.sharding.get_mesh refuses to answer inside jit)."""
  from jax._src import mesh as mesh_lib  # no public spelling usable inside jit
  getter = getattr(mesh_lib, "get_concrete_mesh", None)
  try:
    mesh = getter() if getter is not None else jax.sharding.get_mesh()
  except ValueError:  # jax.sharding.get_mesh inside jit
    return None
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return mesh


def plain_aval(aval: Any) -> Any:
  """aval without a layout in its type (what an Auto-axes destination gives)."""
  from jax._src import core  # ShapedArray's home; jax.core re-exports vary by version
  return core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)


def with_weak_type(y: jax.Array) -> jax.Array:
  """y, weakly typed (as jax.device_put keeps a weak input's type); no copy."""
  if _ArrayImpl is None or type(y) is not _ArrayImpl:
    return y
  return _ArrayImpl(y.aval.update(weak_type=True), y.sharding, list(y._arrays),
                    committed=y.committed, _skip_checks=True)


def primitive_machinery() -> Any:
  """(Primitive, ad, batching, mlir): what defining a JAX primitive takes."""
  from jax._src.interpreters import batching  # not_mapped/moveaxis are not re-exported
  from jax.extend.core import Primitive
  from jax.interpreters import ad, mlir
  return Primitive, ad, batching, mlir


def register_batching_rule(primitive: Any, rule: Any) -> None:
  """Registers `rule(axis_data, args, dims, **params)` as `primitive`'s vmap rule: the
  form that sees the vmap's axis data (its spmd_axis_name, the mesh axes its batch
  dimension is sharded over), as jax.sharding.reshard's own rule does."""
  from jax._src.interpreters import batching  # fancy_primitive_batchers: private
  batching.fancy_primitive_batchers[primitive] = rule


def vmap_batch_axes(axis_data: Any) -> tuple[Any, Any]:
  """(explicit_mesh_axis, spmd_name) of a vmap's axis data: the Explicit mesh axes of
  the batch dimension (None: unsharded) and the vmap's spmd_axis_name (None: none)."""
  return (getattr(axis_data, "explicit_mesh_axis", None),
          getattr(axis_data, "spmd_name", None))


def is_staged(v: Any) -> bool:
  """Whether a traced value is (or wraps) a value being staged into a jaxpr (jit), as
  opposed to a JVP/batch tracer over concrete arrays (eager grad or vmap)."""
  from jax._src.interpreters import partial_eval as pe  # no public spelling
  seen = 0
  while isinstance(v, jax.core.Tracer) and seen < 64:
    if isinstance(v, (pe.DynamicJaxprTracer, pe.JaxprTracer)):
      return True
    nxt = None
    for attr in ("primal", "val"):
      nxt = getattr(v, attr, None)
      if nxt is not None:
        break
    if nxt is None:
      return True  # an unknown tracer: treat as staged (the stricter rules)
    v, seen = nxt, seen + 1
  return False


def is_jaxpr_tracer(v: Any) -> bool:
  """Whether `v` is being staged into a jaxpr directly (jit), not through a vmap or JVP
  tracer."""
  from jax._src.interpreters import partial_eval as pe  # no public spelling
  return isinstance(v, pe.DynamicJaxprTracer)


def tangent_zero(primal: Any) -> Any:
  """The symbolic zero tangent of a primal value (spelled differently across JAX)."""
  from jax.interpreters import ad
  zero = ad.Zero
  if hasattr(zero, "from_primal_value"):
    return zero.from_primal_value(primal)
  from jax._src import ad_util  # jax 0.10: p2tz
  return ad_util.p2tz(primal)



def with_partitioner_mesh(ctx: Any, mesh: Any) -> Any:
  """A lowering rule's context in which `mesh` (a concrete Mesh) is the partitioner's
  mesh and its devices the jit's device assignment, as custom_partitioning's lowering
  needs; None where `ctx` is not a whole-program jit lowering over mesh.size devices,
  or names other devices. The caller must know the jit's device assignment is
  `mesh`'s order (JAX refuses a program whose shardings order devices differently)."""
  try:
    from jax._src import sharding_impls  # ShardingContext: no public spelling
  except ImportError:
    return None
  axis_context = getattr(ctx.module_context, "axis_context", None)
  if not isinstance(axis_context, sharding_impls.ShardingContext):
    return None
  devices = tuple(mesh.devices.flat)
  if axis_context.num_devices != len(devices):
    return None
  if axis_context.device_assignment is not None and tuple(
      d.id for d in axis_context.device_assignment) != tuple(d.id for d in devices):
    return None
  try:
    new = dataclasses.replace(axis_context, device_assignment=devices,
                              abstract_mesh=mesh.abstract_mesh)
    return ctx.replace(module_context=ctx.module_context.replace(axis_context=new))
  except (AttributeError, TypeError, ValueError):
    # A JAX whose contexts changed shape: the caller falls back to XLA's partitioner
    # (correct, slower); tests/jax_compat_test.py fails loudly on such a JAX.
    return None


def exclude_from_source_info(path: str) -> None:
  """Makes JAX attribute operations staged from files under `path` to their caller:
  the user's line is what JAX's errors (e.g. "Received incompatible devices for jitted
  computation ... at file:line") and HLO metadata name, as for JAX's own files."""
  from jax._src import source_info_util  # register_exclusion: no public spelling
  source_info_util.register_exclusion(path)


def device_to_device_guard() -> str:
  """The device-to-device transfer guard level in effect on this thread: `allow`,
  `log`, `disallow`, `log_explicit` or `disallow_explicit` (what
  `jax.transfer_guard_device_to_device` / `jax.transfer_guard` set; the thread's
  setting, else the global one, else JAX's default `allow`)."""
  from jax._src.lib import guard_lib  # the guards' state: no public reader
  level = guard_lib.thread_local_state().device_to_device
  if level is None:
    level = guard_lib.global_state().device_to_device
  return "allow" if level is None else level.name.lower()


def distributed_client() -> Any:
  """The `jax.distributed` key-value client (None before jax.distributed.initialize):
  the store the multi-controller control plane bootstraps through (processes/)."""
  from jax._src import distributed  # global_state: no public spelling in 0.10-0.11
  return distributed.global_state.client


def distributed_coordinator_address() -> str | None:
  """The `jax.distributed` coordinator's "host:port" (None outside a job): where every
  process of the job already connects, so the cross-process engine binds the local
  address that routes there (processes/bootstrap.transfer_host)."""
  from jax._src import distributed  # global_state: no public spelling in 0.10-0.11
  return distributed.global_state.coordinator_address

