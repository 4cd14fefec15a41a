"""Argument checks of every path (eager, traced, cross-process, jax_m2n.plan).

Owns every rule a reshard argument must satisfy and the messages that state them, in
sections: per-call options, pytree prefixes, shardings, leaves, where the call runs.
All of it runs before any data moves; it never plans, compiles or dispatches.
"""

from __future__ import annotations

import functools
import logging
import numbers
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jax_m2n._src import jax_compat
from jax_m2n._src.errors import (ReshardTransferGuardError, ReshardTypeError,
                                 ReshardValueError, Unplaceable)
from jax_m2n._src.layout import MAX_RANK, Layout
from jax_m2n._src.planner import ROUTES
from jax_m2n._src.request import DEFAULT_TIMEOUT_MS, Options
from jax_m2n._src.topology import Topology, as_topology

logger = logging.getLogger("jax_m2n")


# ---------------------------------------------------------------------------------------
# Per call: the options (route, timeout, topology, chunk bytes)
# ---------------------------------------------------------------------------------------

DEFAULT_TIMEOUT_S = DEFAULT_TIMEOUT_MS / 1000
_MAX_TIMEOUT_S = float(2**40 // 1000)  # the handlers' bound on the timeout_ms attribute
_MIN_TIMEOUT_S = 1e-3  # the handlers' resolution: one millisecond


def _check_route(api: str, route: Any) -> None:
  if not isinstance(route, str):
    raise ReshardTypeError(
        f"{api}: route must be a str, one of {ROUTES}; got {type(route).__name__} "
        f"{route!r}.")
  if route not in ROUTES:
    raise ReshardValueError(
        f"{api}: route must be one of {ROUTES}; got {route!r}. Hint: 'hierarchical' is "
        "the product; 'flat' and 'gather_bcast' are baselines.")


def _timeout_ms(api: str, timeout_s: Any) -> int:
  """timeout_s in whole milliseconds (the handlers' resolution); refuses what rounds away."""
  if timeout_s is None:
    timeout_s = DEFAULT_TIMEOUT_S
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
    raise ReshardTypeError(
        f"{api}: timeout_s must be a number of seconds; got {type(timeout_s).__name__} "
        f"{timeout_s!r}.")
  if not (_MIN_TIMEOUT_S <= timeout_s <= _MAX_TIMEOUT_S):
    raise ReshardValueError(
        f"{api}: timeout_s must be in [{_MIN_TIMEOUT_S}, {_MAX_TIMEOUT_S:.0f}] seconds "
        f"(the handlers wait in whole milliseconds); got {timeout_s!r}.")
  return max(1, int(round(float(timeout_s) * 1000)))


def _check_topology(api: str, topology: Any) -> Any:
  """Raises as_topology's ReshardTypeError (a wrong kind: a bool, a dict, a flat list, a
  device id that is not an int...) or ReshardValueError (a rule: a domain size below 1, a
  device in two domains...), each naming the rule and the value.

  Returns the topology with plain ints (hashable: part of cache keys).
  """
  if topology is None or isinstance(topology, Topology):  # as_topology accepts these
    return topology
  as_topology(topology, (), api)
  if isinstance(topology, numbers.Integral):
    return int(topology)
  if isinstance(topology, (list, tuple)):
    return tuple(tuple(int(d) for d in g) for g in topology)
  return topology


def _check_chunk_bytes(api: str, chunk_bytes: Any) -> int | None:
  """chunk_bytes as a positive int, or None (chosen per plan: planner/chunking.py)."""
  if chunk_bytes is None:
    return None
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral):
    raise ReshardTypeError(
        f"{api}: chunk_bytes must be a positive int; got {type(chunk_bytes).__name__} "
        f"{chunk_bytes!r}.")
  if chunk_bytes < 1:
    raise ReshardValueError(
        f"{api}: chunk_bytes must be a positive int; got {chunk_bytes!r}.")
  return int(chunk_bytes)


def options(api: str, route: Any = "hierarchical", topology: Any = None,
            timeout_s: Any = None, chunk_bytes: Any = None) -> Options:
  """The call's `Options` after every per-call rule (route, timeout, topology, chunk
  bytes), each checked here once, before any leaf is looked at."""
  _check_route(api, route)
  timeout_ms = _timeout_ms(api, timeout_s)
  return Options(route, _check_topology(api, topology), timeout_ms,
                 _check_chunk_bytes(api, chunk_bytes))


# ---------------------------------------------------------------------------------------
# Pytree prefixes: dst_sharding, src_sharding, donate, dtype
# ---------------------------------------------------------------------------------------

try:  # concrete layouts as destinations (jax.device_put accepts them)
  from jax.experimental.layout import Format as _Format
except ImportError:  # pragma: no cover - a JAX without it
  _Format = None


_DST_TYPES = (Sharding, jax.ShapeDtypeStruct, PartitionSpec, jax.Device) + (
    (_Format,) if _Format is not None else ())
DST_TYPES = _DST_TYPES  # what a destination leaf may be (besides None)


def is_dst_leaf(v: Any) -> bool:
  return v is None or isinstance(v, _DST_TYPES)


class LazyName:
  """Leaf i's name, formed only when a message is formatted (`f"{name}"`): forming the
  names flattens x with paths, which costs more than the whole check on success."""

  __slots__ = ("_names", "_i")

  def __init__(self, names: Callable[[], list[str]], i: int):
    self._names, self._i = names, i

  def __str__(self) -> str:
    return self._names()[self._i]

  def __format__(self, spec: str) -> str:
    return format(str(self), spec)


def leaf_names(x: Any) -> list[str]:
  """`x['w'][0]`-style names of the leaves of x, in leaf order (error messages only)."""
  return ["x" + jax.tree_util.keystr(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(x)[0]]


def names_once(x: Any) -> Callable[[], list[str]]:
  """`leaf_names(x)` formed at most once per call, on the first message that needs a
  name (a LazyName per leaf reads it: O(leaves), not O(leaves^2))."""
  cache: list[list[str]] = []

  def names() -> list[str]:
    if not cache:
      cache.append(leaf_names(x))
    return cache[0]
  return names


def _broadcast(api: str, rule: str, prefix: Any, x: Any, treedef, n: int,
               is_leaf: Callable[[Any], bool] | None, x_name: str = "x") -> list[Any]:
  """The leaves of `prefix` (a pytree prefix of x) broadcast onto x's `n` leaves, one
  per leaf of its subtree of x (jax.device_put's rule: a None node of x has no leaves,
  so {'b': None} takes any prefix entry there). `rule` states what the argument must
  be, for the error raised where prefix is no prefix of x."""
  flat, tree = jax.tree_util.tree_flatten(prefix, is_leaf=is_leaf)
  if tree == treedef:
    return flat
  full: list[Any] = []
  try:
    jax.tree.map(lambda p, sub: full.extend([p] * jax.tree.structure(sub).num_leaves),
                 prefix, x, is_leaf=is_leaf)
  except (ValueError, TypeError) as e:
    raise ReshardValueError(
        f"{api}: {rule}; got structure {tree} for {x_name} of structure {treedef}. "
        f"Detail: {e}") from None
  if len(full) != n:
    raise ReshardValueError(
        f"{api}: {rule}; got {len(full)} leaves after broadcasting onto the {n} leaves "
        f"of {x_name}.")
  return full


def broadcast_prefix(api: str, what: str, prefix: Any, x: Any, treedef,
                     n: int, x_name: str = "x") -> list[Any]:
  """The leaves of `prefix` (one destination or source per leaf, like jax.device_put's
  argument) broadcast onto x's leaves (`x_name`: how messages call x)."""
  if prefix is None or isinstance(prefix, _DST_TYPES):
    return [prefix] * n
  return _broadcast(api, f"{what} must be one Sharding or a pytree prefix of {x_name} "
                    "(as for jax.device_put)", prefix, x, treedef, n, is_dst_leaf, x_name)


def donate_flags(api: str, donate: Any, x: Any, treedef, n: int) -> list[bool]:
  """One flag per leaf from a bool or a pytree prefix of x of bools (jax.device_put's
  `donate`); anything else is refused, so no leaf is deleted by accident."""
  if isinstance(donate, (bool, np.bool_)):
    return [bool(donate)] * n
  flat = jax.tree_util.tree_leaves(donate)
  bad = next((v for v in flat if not isinstance(v, (bool, np.bool_))), None)
  if bad is not None or donate is None:
    what = donate if bad is None else bad
    raise ReshardTypeError(
        f"{api}: donate must be a bool or a pytree prefix of x of bools (as for "
        f"jax.device_put); got {type(what).__name__} {what!r}.")
  return [bool(v) for v in _broadcast(
      api, "donate must be a bool or a pytree prefix of x of bools (as for "
      "jax.device_put)", donate, x, treedef, n, None)]


def is_dtype_leaf(v: Any) -> bool:
  """A leaf of a `dtype=` prefix: None (keep), a np.dtype, a scalar type or a name."""
  return v is None or isinstance(v, (np.dtype, type, str))


def as_dtype(api: str, v: Any) -> np.dtype:
  """One `dtype=` value as a numpy dtype of JAX arrays (bool or a number type)."""
  try:
    dt = np.dtype(v)
  except Exception:  # noqa: BLE001 - numpy raises TypeError or others
    dt = None
  if (isinstance(v, (bool, np.bool_, numbers.Number)) or dt is None or
      not (dt == np.bool_ or jax.dtypes.issubdtype(dt, np.number))):
    raise ReshardTypeError(
        f"{api}: dtype must be a dtype (np.float32, jnp.bfloat16, 'float8_e4m3fn', a "
        f"np.dtype), None (keep) or a pytree prefix of x of them; got "
        f"{type(v).__name__} {v!r}.")
  return dt


def dtypes_per_leaf(api: str, dtype: Any, x: Any, treedef, n: int, *,
                is_leaf: Callable[[Any], bool] = is_dtype_leaf,
                convert: Callable[[Any], Any] | None = None,
                what: str = "one dtype", x_name: str = "x") -> list[Any]:
  """One destination dtype per leaf (None: keep) from `dtype=`: a dtype, None, or a
  pytree prefix of x of them, broadcast like `donate` and `dst_sharding`. `is_leaf`
  and `convert` (default: `as_dtype`) widen what a leaf may be (quantize.py adds
  Quantize specs); `what` names it in errors."""
  convert = convert or (lambda v: as_dtype(api, v))
  if dtype is None:
    return [None] * n
  if is_leaf(dtype):
    return [convert(dtype)] * n
  flat = _broadcast(api, f"dtype must be {what} or a pytree prefix of {x_name} of them "
                    "(None: keep)", dtype, x, treedef, n, is_leaf, x_name)
  return [None if v is None else convert(v) for v in flat]


def conversions(api: str, leaves: Sequence[Any], dsts: Sequence[Any],
                out_dtypes: Sequence[Any],
                names: Callable[[], list[str]]) -> tuple[list[Any], list[Any]]:
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
          f"{api}: a leaf of x converted with dtype= must be an array of numbers or "
          f"bools; got {type(leaf).__name__} {getattr(leaf, 'dtype', '')} at "
          f"{names()[i]}.")
    want = jax.dtypes.canonicalize_dtype(o)
    if np.dtype(have) == want and not weak:
      out_dtypes[i] = None
    if isinstance(dsts[i], jax.ShapeDtypeStruct):
      dsts[i] = dst_sharding_of(api, names()[i], dsts[i], np.shape(leaf),
                                want if out_dtypes[i] is not None else have)
  return out_dtypes, dsts


# ---------------------------------------------------------------------------------------
# Shardings: destinations and sources, on every path
# ---------------------------------------------------------------------------------------

def normalize_dst(api: str, name: str, dst: Any) -> Any:
  """A jax.Device as its SingleDeviceSharding, a PartitionSpec on the context mesh (as
  jax.device_put reads them); anything else unchanged (checked later)."""
  if isinstance(dst, jax.Device):
    return SingleDeviceSharding(dst)
  if isinstance(dst, PartitionSpec):
    mesh = jax_compat.context_mesh()
    if mesh is None:
      raise ReshardValueError(
          f"{api}: a PartitionSpec destination of {name} must be used under a mesh "
          f"context; got {dst} with none set. Hint: `with jax.set_mesh(mesh):`, or "
          "NamedSharding(mesh, spec).")
    return NamedSharding(mesh, dst)
  return dst


def dst_sharding_of(api: str, name: str, dst: Any, shape, dtype) -> Sharding:
  """The destination sharding of one leaf; checks a ShapeDtypeStruct's shape/dtype."""
  if isinstance(dst, jax.ShapeDtypeStruct):
    if tuple(dst.shape) != tuple(shape) or np.dtype(dst.dtype) != np.dtype(dtype):
      raise ReshardValueError(
          f"{api}: the destination of {name} must keep its shape and dtype (jax_m2n "
          f"moves data, it does not reshape or cast); got {dtype}{list(shape)} -> "
          f"{np.dtype(dst.dtype)}{list(dst.shape)}. Hint: reshape before or after "
          f"{api}; convert with dtype= (the destination then has that dtype).")
    dst = dst.sharding
    if dst is None:
      raise ReshardTypeError(
          f"{api}: a ShapeDtypeStruct destination of {name} must carry a sharding; got "
          "sharding=None.")
  dst = normalize_dst(api, name, dst)
  if not isinstance(dst, Sharding):
    raise ReshardTypeError(
        f"{api}: the destination of {name} must be a jax.sharding.Sharding, a "
        f"jax.Device, a PartitionSpec (under jax.set_mesh) or None; got "
        f"{type(dst).__name__} {dst!r}.")
  return dst


def check_src_sharding(api: str, name: Any, src: Any) -> None:
  """A src_sharding= leaf must be a Sharding (None: unknown)."""
  if src is not None and not isinstance(src, Sharding):
    raise ReshardTypeError(
        f"{api}: src_sharding of {name} must be a jax.sharding.Sharding or None; got "
        f"{type(src).__name__} {src!r}.")


def check_reduction(api: str, name: str, sharding: Any, what: str) -> None:
  """Unreduced / reduced specs (partial sums) are refused, by name, before data moves."""
  spec = getattr(sharding, "spec", None)
  for kind in ("unreduced", "reduced"):
    axes = getattr(spec, kind, None)
    if axes:
      raise ReshardValueError(
          f"{api}: the {what} sharding of {name} must not be {kind} (jax_m2n moves "
          f"bytes; it does not sum partial values); got {kind}={set(axes)} in {spec}. "
          "Hint: reduce first (jax.sharding.reshard to a spec without "
          f"{kind}=, or a psum), then reshard.")


def check_mesh(api: str, name: str, sharding: Any, what: str) -> None:
  """A concrete device set with no device listed twice."""
  mesh = getattr(sharding, "mesh", None)
  if mesh is not None and isinstance(mesh, jax.sharding.AbstractMesh):
    raise ReshardValueError(
        f"{api}: the {what} sharding of {name} must be on a concrete Mesh (devices "
        f"known); got an AbstractMesh {mesh}. Hint: NamedSharding(jax.make_mesh(...), "
        "spec), or a PartitionSpec under jax.set_mesh(mesh).")
  if mesh is not None:
    ids, dup = _mesh_duplicates(mesh)
    if dup:
      raise ReshardValueError(
          f"{api}: the {what} mesh of {name} must list each device once; got devices "
          f"{dup} more than once in {ids}.")


@functools.lru_cache(maxsize=256)  # meshes are immutable; a refit checks one each call
def _mesh_duplicates(mesh: Any) -> tuple[list[int], list[int]]:
  """A mesh's device ids and those it lists more than once."""
  ids = [d.id for d in mesh.devices.flat]
  if len(set(ids)) == len(ids):
    return ids, []
  return ids, sorted({i for i in ids if ids.count(i) > 1})


def check_holds(api: str, name: str, sharding: Sharding, shape, what: str) -> None:
  """A sharding must be able to hold `shape`: right rank, divisible dims."""
  if isinstance(sharding, NamedSharding):
    spec = sharding.spec
    if len(spec) > len(shape):
      raise ReshardValueError(
          f"{api}: the {what} sharding of {name} must have at most one PartitionSpec "
          f"entry per dim; got {spec} for shape {tuple(shape)} (rank {len(shape)}).")
    if spec is PartitionSpec.UNCONSTRAINED or any(
        e is PartitionSpec.UNCONSTRAINED for e in spec):
      raise ReshardValueError(
          f"{api}: the {what} sharding of {name} must be fully specified; got {spec}.")
  try:
    sharding.shard_shape(tuple(shape))
  except Exception as e:  # noqa: BLE001 - JAX raises several types here
    raise ReshardValueError(
        f"{api}: the {what} sharding of {name} must be able to hold shape "
        f"{tuple(shape)} (sharded dims divisible by their mesh size, as "
        f"jax.device_put requires); got {sharding}. JAX says: {e}") from None


def is_uneven(sharding: Any, shape) -> bool:
  """Whether a NamedSharding of the right rank splits a dim unevenly (JAX pads such
  shards inside jit, as with_sharding_constraint does; device_put refuses them)."""
  if not isinstance(sharding, NamedSharding) or len(sharding.spec) > len(shape):
    return False
  try:
    sharding.shard_shape(tuple(shape))
  except Exception:  # noqa: BLE001 - JAX's IndivisibleError (a ValueError)
    return True
  return False


def check_call_shardings(api: str, leaves: Sequence[Any], dsts: Sequence[Any],
                         srcs: Sequence[Any], names: Callable[[], list[str]]) -> list[Any]:
  """The rules every leaf's shardings meet on every path, each checked here once per
  sharding object (a prefix repeats one): destinations normalized (a Device as its
  SingleDeviceSharding, a PartitionSpec on the context mesh) on a concrete mesh listing
  each device once, nothing unreduced; a given src_sharding a Sharding, not unreduced;
  a concrete leaf's own sharding not unreduced. Returns the destinations; leaf names
  are formed only where a message needs one (LazyName)."""
  dsts = [d if isinstance(d, Sharding) else normalize_dst(api, LazyName(names, i), d)
          for i, d in enumerate(dsts)]
  seen: set[int] = set()
  for i, d in enumerate(dsts):  # before anything asks these shardings for devices
    d = d.sharding if isinstance(d, jax.ShapeDtypeStruct) else d
    if id(d) not in seen:
      seen.add(id(d))
      check_mesh(api, LazyName(names, i), d, "destination")
      check_reduction(api, LazyName(names, i), d, "destination")
    if srcs[i] is not None:
      check_src_sharding(api, LazyName(names, i), srcs[i])
      check_reduction(api, LazyName(names, i), srcs[i], "source")
    leaf = leaves[i]
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      s = leaf.sharding
      if id(s) not in seen:
        seen.add(id(s))
        check_reduction(api, LazyName(names, i), s, "source")
  return dsts


def same_layout(a: Sharding, b: Sharding, shape) -> bool:
  """Whether two shardings place `shape` identically (same devices, same boxes)."""
  if a == b:
    return True
  return Layout.from_sharding(a, shape) == Layout.from_sharding(b, shape)


# ---------------------------------------------------------------------------------------
# Leaves: what jax_m2n moves and what it hands to JAX
# ---------------------------------------------------------------------------------------

def leaf_aval(api: str, name: Any, leaf: Any) -> Any:
  """The abstract value of a (possibly traced) leaf; a leaf that is no array raises."""
  try:
    aval = jax.typeof(leaf)
  except TypeError:
    aval = None
  if aval is None or not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
    raise ReshardTypeError(
        f"{api}: every leaf of x must be an array; got {type(leaf).__name__} at "
        f"{name}.")
  return aval


def check_rank(api: str, name: str, shape) -> None:
  """The native handlers' rank bound (higher ranks are jax.device_put's, see
  `layout_delegated_because`)."""
  if len(shape) > MAX_RANK:
    raise ReshardValueError(
        f"{api}: {name} must have rank at most {MAX_RANK}; got shape {tuple(shape)}.")


def is_format(dst: Any) -> bool:
  """A concrete-layout destination (jax.experimental.layout.Format)."""
  return _Format is not None and isinstance(dst, _Format)


def layout_delegated_because(shape, dst: Any) -> str | None:
  """Why XLA (in jit) or jax.device_put (eagerly), not jax_m2n, places this leaf:
  a concrete layout (Format: jax_m2n moves bytes in the default layout only) or a rank
  above the handlers' bound. None: jax_m2n may move it."""
  if is_format(dst):
    return "concrete layout (jax.experimental.layout.Format)"
  if len(shape) > MAX_RANK:
    return f"rank {len(shape)} above {MAX_RANK}"
  return None


def check_host_leaf(api: str, name: Any, leaf: Any) -> None:
  """Host data handed to jax.device_put must be of a JAX type (no str, no object)."""
  if isinstance(leaf, (np.ndarray, np.generic)):
    try:
      ok = leaf.dtype == np.bool_ or jax.dtypes.issubdtype(leaf.dtype, np.number)
    except TypeError:
      ok = False
    if not ok:
      raise ReshardTypeError(
          f"{api}: every leaf of x must be an array of numbers or bools; got "
          f"{type(leaf).__name__} of dtype {leaf.dtype} at {name}.")


def check_dtype(api: str, name: str, dtype) -> None:
  """Whole bytes per element, no extended dtypes: the handler copies plain bytes."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    raise ReshardTypeError(
        f"{api}: {name} must have a plain array dtype; got the extended dtype {dtype}. "
        "Hint: reshard jax.random.key_data(keys) and wrap the result again.")
  if jax.dtypes.itemsize_bits(dtype) % 8:
    raise ReshardTypeError(
        f"{api}: {name} must have whole bytes per element; got {dtype} "
        f"({jax.dtypes.itemsize_bits(dtype)} bits). Hint: bitcast packed sub-byte data "
        "to uint8 first.")


def check_memory_kind(api: str, name: str, sharding: Sharding, what: str) -> None:
  kind = sharding.memory_kind
  if kind is None:
    return
  device = next(iter(sharding.device_set))
  try:
    default = device.default_memory().kind
  except Exception:  # noqa: BLE001 - some backends expose no memories
    default = kind
  if kind != default:
    raise ReshardValueError(
        f"{api}: the {what} of {name} must be in device memory ({default!r}); got "
        f"memory kind {kind!r}. Hint: move between memory kinds with jax.device_put.")


# The leaves plan_leaf accepted, by what its rules read of them (type, shape, dtype,
# source and destination sharding, result dtype): a repeated plan() of a model checks
# each distinct leaf once, later ones are a lookup. Only successes are kept (a refused
# leaf is refused again with its own name); cleared when full.
_PLANNED_LEAVES: set[tuple] = set()
_PLANNED_LEAVES_MAX = 1 << 14


def _plan_leaf_key(leaf: Any, dst: Any, src: Any, out: Any) -> tuple | None:
  """What plan_leaf's rules read of one leaf, or None where that is not all hashable
  and immutable (a PartitionSpec reads the context mesh, a Device or host data)."""
  if not isinstance(dst, Sharding) or (src is not None and not isinstance(src, Sharding)):
    return None
  if type(leaf) is jax.ShapeDtypeStruct or (
      isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)):
    return (type(leaf), tuple(leaf.shape), leaf.dtype,
            leaf.sharding if src is None else src, dst, out)
  return None


def plan_leaf(api: str, name: Any, leaf: Any, dst: Any, src: Any,
               out: Any) -> tuple[Sharding, Sharding]:
  """plan()'s rules for one leaf (reshard's, and no leaf reshard hands to JAX): its
  source and destination shardings. `name` (a str or a LazyName) is formatted only in
  a message."""
  key = _plan_leaf_key(leaf, dst, src, out)
  if key is not None and key in _PLANNED_LEAVES:
    return key[3], dst
  src, dst = _plan_leaf_checked(api, name, leaf, dst, src, out)
  if key is not None:
    if len(_PLANNED_LEAVES) >= _PLANNED_LEAVES_MAX:
      _PLANNED_LEAVES.clear()
    _PLANNED_LEAVES.add(key)
  return src, dst


def _plan_leaf_checked(api: str, name: Any, leaf: Any, dst: Any, src: Any,
                       out: Any) -> tuple[Sharding, Sharding]:
  if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
    raise ReshardTypeError(
        f"{api}: every leaf of x must be an array or ShapeDtypeStruct; got "
        f"{type(leaf).__name__} at {name}.")
  shape = tuple(leaf.shape)
  check_src_sharding(api, name, src)
  src = src if src is not None else getattr(leaf, "sharding", None)
  if not isinstance(src, Sharding):
    raise ReshardValueError(
        f"{api}: the source sharding of {name} must be known; got "
        f"{src!r}. Hint: pass src_sharding=.")
  if dst is None:
    raise ReshardValueError(
        f"{api}: the destination of {name} must be a Sharding, a Device or a "
        "PartitionSpec (None keeps the layout: reshard moves nothing there, so there "
        "is nothing to plan); got None.")
  # What reshard hands to JAX (typed keys, int4, concrete layouts, rank > 8) jax_m2n
  # does not plan.
  check_dtype(api, name, leaf.dtype)
  why = layout_delegated_because(shape, dst)
  if why is not None:
    raise ReshardValueError(
        f"{api}: {name} must be a leaf jax_m2n moves; got one that reshard "
        f"hands to JAX ({why}), which jax_m2n does not plan.")
  check_mesh(api, name, src, "source")
  check_reduction(api, name, src, "source")
  check_holds(api, name, src, shape, "source")
  return src, check_destination(api, name, dst, shape,
                                leaf.dtype if out is None else out)


def check_destination(api: str, name: Any, dst: Any, shape, dtype, *,
                      device_memory: bool = False) -> Sharding:
  """One leaf's destination after every rule a destination jax_m2n moves into meets
  (the shape and dtype of a ShapeDtypeStruct, a Device or PartitionSpec normalized, a
  concrete mesh listing each device once, nothing unreduced, able to hold `shape`;
  with `device_memory`, in device memory): plan()'s and a pull's one check, so the
  same mistake gets the same error from reshard, plan and Subscriber.pull."""
  dst = dst_sharding_of(api, name, dst, shape, dtype)
  check_mesh(api, name, dst, "destination")
  check_reduction(api, name, dst, "destination")
  check_holds(api, name, dst, shape, "destination")
  if device_memory:
    check_memory_kind(api, name, dst, "destination")
  return dst


# ---------------------------------------------------------------------------------------
# Where the call runs: platforms, processes, shard_map, transfer guards
# ---------------------------------------------------------------------------------------

def platform_of(devices) -> str:
  return next(iter(devices)).platform


def check_in_process(api: str, platform: str, devices) -> None:
  """The CPU transport meets its peers in one process. Inside jit (its only caller
  now: eager calls across processes go to processes/), a CPU mesh spanning processes
  is handed to XLA's partitioner (its gloo collectives) as an unplaceable layout."""
  if platform != "cpu":
    return
  me = jax.process_index()
  remote = sorted(d.id for d in devices if d.process_index != me)
  if remote:
    raise Unplaceable(
        f"{api}: inside jit on CPU every participating device must belong to this "
        f"process (the CPU custom call is in-process); got devices {remote} of other "
        "processes: XLA's partitioner moves them (jax_cpu_collectives_implementation="
        "'gloo').")


def check_outside_shard_map(api: str) -> None:
  """A reshard lowers to its own SPMD program over whole arrays: never under the
  manual mesh axes of a shard_map."""
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and getattr(context, "manual_axes", ()):
    raise ReshardValueError(
        f"{api}: reshard must be called outside shard_map (it lowers to its own SPMD "
        f"program over whole arrays); got a call under manual mesh axes "
        f"{tuple(context.manual_axes)}. Hint: call it on the global arrays, inside jit "
        "or eagerly.")


def check_transfer_guard(api: str, crossing: Callable[[], str]) -> None:
  """The device-to-device transfer guard, applied to a move between devices as JAX
  applies it to jax.device_put's (an explicit transfer): refused under
  `disallow_explicit`, logged under `log_explicit`, allowed otherwise. `crossing()`
  describes what moves (formed only when needed). A move that jax.device_put makes
  through the host (its host guards apply) and jax_m2n between devices meets this
  guard instead (docs/design.md, "Transfer guards")."""
  level = jax_compat.device_to_device_guard()
  if level == "disallow_explicit":
    raise ReshardTransferGuardError(
        f"{api}: a move between devices must be allowed by the device-to-device "
        f"transfer guard (jax_m2n moves device to device, an explicit transfer as "
        f"jax.device_put's); got level {level!r}. Disallowed device-to-device "
        f"transfer: {crossing()}. Hint: 'log_explicit' logs it instead; inside jit "
        "no transfer guard applies.")
  if level == "log_explicit":
    logger.warning("device-to-device transfer: %s (jax_m2n.reshard)", crossing())
