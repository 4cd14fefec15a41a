"""A pull as values: its options (`PullOptions`, a reshard's `Options` extended with what
a pull needs more) and, per published leaf, what the caller asked (`PullRequest`: the
dst sharding, the delivered dtype, the Quantize spec, the donated arrays, how to build
the result's pytree).

Owns building both once at the API (`pull_options`, `pull_request`), with reshard's own
rules (checks.py, quantize.resolve) for everything the two calls share, so the same
mistake gets the same error from `reshard` and `Subscriber.pull`. Moves nothing, plans
nothing.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import checks
from jax_m2n._src import collector
from jax_m2n._src import quantize
from jax_m2n._src.errors import ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import manifest as manifest_lib
from jax_m2n._src.jobs.manifest import Manifest
from jax_m2n._src.request import Options

# The routes a pull runs (gather_bcast, reshard's legacy baseline, gathers on a trainer
# device first: the trainer job would have to run part of the plan itself).
ROUTES = ("hierarchical", "flat")
# The data paths: "local" reads the publisher's memory (same host), "network" crosses
# the transport; "auto" takes local where every publisher process shares this host.
PATHS = ("auto", "local", "network")
# How messages name the pytree dst and dtype are prefixes of.
PUBLISHED = "the published pytree"


@dataclasses.dataclass(frozen=True, slots=True)
class PullOptions(Options):
  """A pull's options: a reshard's (`route`: hierarchical or flat; `timeout_ms`: the
  bound on each wait of the pull) and a pull's own.

  Attributes:
    version: the version to pull, or None (the newest not yet pulled).
    delta: whether only the elements that changed since the last pull cross: True,
      False, or "auto" (per leaf, where it pays: delta_auto.py).
    path: "auto", "local" or "network" (PATHS).
  """

  version: int | None = None
  delta: bool | str = False
  path: str = "auto"


def pull_options(api: str, *, route: Any = "hierarchical", timeout_s: Any = None,
                 version: Any = None, delta: Any = False, path: Any = "auto"
                 ) -> PullOptions:
  """The pull's `PullOptions` after every per-call rule (reshard's for route and
  timeout, then the pull's own), before anything is asked of the publisher."""
  base = checks.options(api, route=route, timeout_s=timeout_s)
  if route not in ROUTES:
    raise ReshardValueError(f"{api}: route must be one of {ROUTES}; got {route!r}.")
  if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                              or version < 1):
    raise ReshardValueError(f"{api}: version must be None or an int >= 1; got "
                            f"{version!r}.")
  if not isinstance(delta, (bool, str)):
    raise ReshardTypeError(f"{api}: delta must be a bool or 'auto'; got "
                           f"{type(delta).__name__}.")
  if isinstance(delta, str) and delta != "auto":
    raise ReshardValueError(f"{api}: delta must be True, False or 'auto'; got {delta!r}.")
  if path not in PATHS:
    raise ReshardValueError(f"{api}: path must be one of {PATHS}; got {path!r}.")
  return PullOptions(base.route, None, base.timeout_ms, None, version, delta, path)


@dataclasses.dataclass(frozen=True, eq=False)
class PullRequest:
  """One pull of the published pytree `manifest` describes.

  Attributes:
    manifest: what the version is made of.
    dsts: per published leaf, its destination sharding (checked).
    outs: per leaf, the delivered dtype (the published one where a Quantize spec
      applies: those leaves are quantized on arrival).
    specs: per leaf, its resolved Quantize spec (`quantize.resolve`) or None.
    donated: the previous version's arrays, deleted once the new one has arrived.
    options: the pull's options.
    build: the result's pytree from the delivered leaves (in manifest order).
  """

  manifest: Manifest
  dsts: tuple[Sharding, ...]
  outs: tuple[np.dtype, ...]
  specs: tuple[Any, ...]
  donated: tuple[jax.Array, ...]
  options: PullOptions
  build: Callable[[list[Any]], Any]

  @property
  def quantized(self) -> bool:
    return any(s is not None for s in self.specs)


_DST_LEAF_TYPES = checks.DST_TYPES + (jax.Array,)


def _is_dst_leaf(v: Any) -> bool:  # checks.is_dst_leaf, or an array (one isinstance)
  return v is None or isinstance(v, _DST_LEAF_TYPES)


def _as_struct(v: Any) -> Any:
  """An array given as a destination stands for its shape and sharding."""
  if isinstance(v, jax.Array):
    return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
  return v


def _published(api: str, m: Manifest, dst: Any, dst_leaves: int
               ) -> tuple[Any, Any, Callable]:
  """The published pytree (ShapeDtypeStruct leaves) that dst and dtype are prefixes
  of, its treedef, and how to build the result from the delivered leaves: dst's own
  structure where dst is the whole tree with the published key paths (how custom
  nodes such as flax's State come back), else the published skeleton's. `dst_leaves`:
  how many leaves dst has (flattened with `_is_dst_leaf`)."""
  made: dict[tuple, jax.ShapeDtypeStruct] = {}  # one per (shape, dtype), shared
  structs = []
  for l in m.leaves:
    struct = made.get((l.shape, l.dtype))  # not `or`: a struct's truth is its length
    if struct is None:
      struct = made[(l.shape, l.dtype)] = jax.ShapeDtypeStruct(
          l.shape, manifest_lib.dtype_of(l.dtype))
    structs.append(struct)
  if dst_leaves == len(m.leaves):  # (a prefix has fewer: no key paths to compare)
    flat, treedef = jax.tree_util.tree_flatten_with_path(dst, is_leaf=_is_dst_leaf)
    if [manifest_lib.key_path(p) for p, _ in flat] == [l.path for l in m.leaves]:
      return (jax.tree_util.tree_unflatten(treedef, structs), treedef,
              lambda arrays: jax.tree_util.tree_unflatten(treedef, arrays))
  if m.skeleton is None:
    raise ReshardValueError(
        f"{api}: dst must be the whole pytree (not a prefix) when the published pytree "
        "holds nodes other than dicts, lists, tuples and None (their classes do not "
        "travel); got a prefix. Hint: pass this job's own params (or their shardings) "
        "as dst.")
  tree = manifest_lib.rebuild(m.skeleton, structs)
  return (tree, jax.tree_util.tree_structure(tree),
          lambda arrays: manifest_lib.rebuild(m.skeleton, arrays))


# Checked requests by (manifest, dst, dtype): a pull that recurs every version with the
# same arguments checks them once (the checks are pure functions of these).
_CACHE_SIZE = 64
_cache: collections.OrderedDict[Any, PullRequest] = collections.OrderedDict()


def _cache_key(m: Manifest, leaves: list[Any], treedef: Any, dtype: Any) -> Any:
  """A hashable key for (m, dst, dtype) (dst as its `leaves` and `treedef`, flattened
  with `_is_dst_leaf`), or None where one cannot be formed safely (a PartitionSpec
  depends on the context mesh; unhashable leaves)."""
  parts = []
  for v in leaves:
    if isinstance(v, jax.Array):
      v = (v.shape, v.dtype, v.sharding)
    elif isinstance(v, jax.sharding.PartitionSpec):
      return None
    parts.append(v)
  dtypes, dtree = jax.tree_util.tree_flatten(
      dtype, is_leaf=lambda v: v is None or isinstance(v, quantize.Quantize))
  key = (m.id, treedef, tuple(parts), dtree, tuple(dtypes))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def pull_request(api: str, m: Manifest, dst: Any, dtype: Any, donate: Any,
                 options: PullOptions) -> PullRequest:
  """The checked request of pulling `m` into `dst` as `dtype`: dst and dtype are
  pytree prefixes of the published pytree, broadcast as reshard broadcasts its own
  (checks.broadcast_prefix, quantize.spec_leaves), and each destination meets
  reshard's rules (checks.check_destination, in device memory).

  Raises:
    ReshardValueError / ReshardTypeError: a dst or dtype that does not fit the
      published pytree, a destination or dtype that breaks a rule; before any byte
      moves.
  """
  with collector.paused():  # key paths, structs and checks per leaf: no cycles
    return _pull_request(api, m, dst, dtype, donate, options)


def _pull_request(api: str, m: Manifest, dst: Any, dtype: Any, donate: Any,
                  options: PullOptions) -> PullRequest:
  """pull_request's work."""
  donated = tuple(_donated(api, donate))
  leaves, dst_tree = jax.tree_util.tree_flatten(dst, is_leaf=_is_dst_leaf)
  key = _cache_key(m, leaves, dst_tree, dtype)
  got = _cache.get(key) if key is not None else None
  if got is not None:
    _cache.move_to_end(key)
    return dataclasses.replace(got, donated=donated, options=options)
  n = len(m.leaves)
  names = m.names
  tree, treedef, build = _published(api, m, dst, len(leaves))
  specs = (quantize.spec_leaves(api, dtype, tree, treedef, n, PUBLISHED)
           if quantize.has_spec(dtype) else  # as reshard: its messages name Quantize
           checks.dtypes_per_leaf(api, dtype, tree, treedef, n, x_name=PUBLISHED))
  if any(isinstance(v, jax.Array) for v in leaves):
    leaves = [_as_struct(v) for v in leaves]  # (jax.tree.map's leaves, without a pass)
  dsts = (leaves if dst_tree == treedef else  # what broadcast_prefix returns for it
          checks.broadcast_prefix(api, "dst", dst_tree.unflatten(leaves), tree, treedef,
                                  n, PUBLISHED))
  outs, resolved, shardings = [], [], []
  checked: dict[tuple, Sharding] = {}
  named: set[np.dtype] = set()
  # Per (shape, dtype, spec object, destination object) without a Quantize spec, the
  # (delivered dtype, checked sharding) of its first leaf: the rules below are pure in
  # these, and 20,000 leaves mostly share a few.
  done: dict[tuple, tuple[np.dtype, Sharding]] = {}
  for t, (leaf, spec, d) in enumerate(zip(m.leaves, specs, dsts)):
    plain = not isinstance(spec, quantize.Quantize)
    if plain:
      same = (leaf.shape, leaf.dtype, id(spec), id(d))  # (both held by specs, dsts)
      got = done.get(same)
      if got is not None:
        resolved.append(None)
        outs.append(got[0])
        shardings.append(got[1])
        continue
    published = manifest_lib.dtype_of(leaf.dtype)
    if not plain:
      resolved.append(quantize.resolve(api, names, t, spec, leaf.shape, published))
      out = published
    else:
      resolved.append(None)
      out = published if spec is None else np.dtype(jax.dtypes.canonicalize_dtype(spec))
      if out not in named:  # (a dtype's name costs more than the rest of the check)
        if out.name not in manifest_lib.DTYPES:
          raise ReshardTypeError(f"{api}: dtype must be one of {manifest_lib.DTYPES}; "
                                 f"got {out} for {names()[t]}.")
        named.add(out)
    if d is None:
      raise ReshardTypeError(
          f"{api}: the destination of {names()[t]} must be a Sharding, a Device, a "
          "PartitionSpec (under jax.set_mesh), an array or a ShapeDtypeStruct; got None "
          "(a pull has no layout to keep).")
    if isinstance(d, jax.ShapeDtypeStruct) and d.dtype != out:  # an array's dtype:
      d = jax.ShapeDtypeStruct(d.shape, out, sharding=d.sharding)  # its shape counts
    rule = ((d, leaf.shape, out) if isinstance(d, (Sharding, jax.ShapeDtypeStruct))
            else None)
    got = checked.get(rule) if rule is not None else None
    if got is None:  # the rules are pure in (d, shape, dtype): once per distinct
      got = checks.check_destination(api, checks.LazyName(names, t), d, leaf.shape, out,
                                     device_memory=True)
      if rule is not None:
        checked[rule] = got
    shardings.append(got)
    outs.append(out)
    if plain:
      done[same] = (out, got)
  check_fits(api, m, shardings, outs)
  request = PullRequest(m, tuple(shardings), tuple(outs), tuple(resolved), donated,
                        options, build)
  if key is not None:
    _cache[key] = request
    while len(_cache) > _CACHE_SIZE:
      _cache.popitem(last=False)
  return request


def check_fits(api: str, m: Manifest, shardings, outs) -> None:
  """A pull's destination shards must fit this process's devices: the bytes each local
  device would receive (its shards of every leaf, at the delivered dtype) against what
  it can hold at all (a GPU's memory pool, memory_stats' bytes_limit; for all CPU
  devices together, the host's MemTotal). Capacity, not free memory: a generator
  whose pool is full of caches still pulls into donated buffers. A manifest that
  announces absurd sizes is refused here, before any request or allocation."""
  need: dict[Any, int] = collections.Counter()
  largest = (0, -1)
  count: dict[tuple, list[int]] = {}  # per distinct (sharding, shape, dtype): its leaves
  for t, (leaf, sharding, out) in enumerate(zip(m.leaves, shardings, outs)):
    count.setdefault((sharding, leaf.shape, out), []).append(t)
  for (sharding, shape, out), ts in count.items():
    nbytes = int(np.prod(sharding.shard_shape(shape), dtype=object)) * out.itemsize
    for d in sharding.addressable_devices:
      need[d] += nbytes * len(ts)
    largest = max(largest, (nbytes, ts[-1]))
  holds = {d: (d.memory_stats() or {}).get("bytes_limit") for d in need
           if d.platform != "cpu"}
  host = sum(n for d, n in need.items() if d.platform == "cpu")
  if host:
    holds["this host"], need["this host"] = _host_total(), host
  for where, limit in holds.items():
    if limit is not None and need[where] > limit:
      raise ReshardValueError(
          f"{api}: the pulled version must fit {where}'s memory; its destination shards "
          f"there take {_gib(need[where])} and it holds at most {_gib(limit)} (largest "
          f"shard: {m.names()[largest[1]]}, {_gib(largest[0])}). Is this the publisher "
          "you meant?")


def _host_total() -> int | None:
  """MemTotal of /proc/meminfo in bytes (None where there is none)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def _gib(n: int) -> str:
  return f"{n / (1 << 30):.3g} GiB"


def _donated(api: str, donate: Any) -> list[jax.Array]:
  if donate is None or donate is False:
    return []
  leaves = jax.tree_util.tree_leaves(donate)
  for leaf in leaves:
    if not isinstance(leaf, jax.Array):
      raise ReshardTypeError(f"{api}: donate must be None or a pytree of jax.Arrays (the "
                             f"previous version's); got a {type(leaf).__name__} leaf.")
  return leaves
