"""A publisher process's held versions: snapshots of its shards and their manifests.

Owns checking what is published (reshard's rules for a source, where they apply),
taking a version's snapshot (a copy of each of this process's shards, or its
conversion to the published dtype), the manifest of each layout set (cached), the
per-wire-dtype copies of a held version, and dropping versions beyond `keep`.
Threads: `add` runs on the trainer's thread, the rest on the server thread; one lock.
Knows no sockets or transports.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any

import jax
import numpy as np

from jax_m2n._src import checks
from jax_m2n._src import jax_compat
from jax_m2n._src.errors import ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import manifest as manifest_lib
from jax_m2n._src.layout import Box, Layout

# Manifests kept per publisher (a training run publishes one layout set, a few at most).
MAX_MANIFESTS = 16


@dataclasses.dataclass
class Version:
  """One held version on this process."""

  number: int
  manifest: manifest_lib.Manifest
  # (leaf, publisher device index) -> (box, snapshot array on that device)
  shards: dict[tuple[int, int], tuple[Box, jax.Array]]
  nbytes: int
  # Per wire dtype asked for, the shards converted to it (made once per version on
  # the first request, dropped with the version): a conversion costs one pass per
  # version, not one per subscriber, and the pieces are then cut without converting.
  wire: dict[Any, dict[tuple[int, int], jax.Array]] = dataclasses.field(
      default_factory=dict)

  def shard(self, t: int, k: int, dtype: np.dtype) -> tuple[Box, jax.Array]:
    """Leaf t's shard on publisher device k, in `dtype`, with its box."""
    box, array = self.shards[(t, k)]
    if array.dtype == dtype:
      return box, array
    converted = self.wire.setdefault(dtype, {})
    got = converted.get((t, k))
    if got is None:
      got = converted[(t, k)] = _converter(np.dtype(dtype))(array)
    return box, got


@functools.lru_cache(maxsize=64)
def _converter(dtype: Any):
  return jax.jit(lambda a: a.astype(dtype))


def _snapshot(array: jax.Array, dtype: np.dtype) -> jax.Array:
  """A copy of one single-device array in `dtype`, never aliasing it (the trainer may
  donate or overwrite its arrays once publish returns)."""
  if array.dtype == dtype:
    return jax.device_put(array, may_alias=False)
  return _converter(np.dtype(dtype))(array)


def check_published(api: str, tree: Any, dtype: Any
                    ) -> tuple[list[Any], list[jax.Array], list[np.dtype]]:
  """`tree`'s key paths, leaves and published dtypes, after every rule (a global
  jax.Array of numbers or bools, alive, rank at most 8, in device memory, nothing
  unreduced; `dtype` a prefix of dtypes as reshard's)."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = [v for _, v in with_path]
  names = lambda: [jax.tree_util.keystr(p) or "the root" for p, _ in with_path]  # noqa: E731
  for t, leaf in enumerate(leaves):
    name = checks.LazyName(names, t)
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
      raise ReshardTypeError(
          f"{api}: every leaf must be a global jax.Array; got {type(leaf).__name__} at "
          f"{name}. Hint: jax.device_put it onto the trainer's devices.")
    if leaf.is_deleted():
      raise ReshardValueError(f"{api}: every leaf must be alive; got a deleted array at "
                              f"{name}.")
    if np.dtype(leaf.dtype).name not in manifest_lib.DTYPES:
      raise ReshardTypeError(
          f"{api}: every leaf must hold numbers or bools "
          f"({', '.join(manifest_lib.DTYPES)}); got {leaf.dtype} at {name}.")
    checks.check_rank(api, name, leaf.shape)
    checks.check_reduction(api, name, leaf.sharding, "source")
    checks.check_memory_kind(api, name, leaf.sharding, "source")
  outs = checks.dtypes_per_leaf(api, dtype, tree, treedef, len(leaves))
  dtypes = [np.dtype(l.dtype) if o is None else np.dtype(jax.dtypes.canonicalize_dtype(o))
            for o, l in zip(outs, leaves)]
  for t, d in enumerate(dtypes):
    if d.name not in manifest_lib.DTYPES:
      raise ReshardTypeError(f"{api}: dtype must be one of {manifest_lib.DTYPES}; got "
                             f"{d} for {names()[t]}.")
  return [p for p, _ in with_path], leaves, dtypes


class Versions:
  """The versions this process holds, at most `keep`, newest last."""

  def __init__(self, keep: int):
    self.keep = keep
    self.lock = threading.Lock()
    self.published = 0
    self._held: collections.OrderedDict[int, Version] = collections.OrderedDict()
    # (structure, avals, shardings, dtypes) -> (manifest, per leaf device -> box,
    # device id -> publisher device index)
    self._manifests: dict[Any, tuple[Any, ...]] = {}

  def add(self, tree: Any, paths: list[Any], leaves: list[jax.Array],
          dtypes: list[np.dtype], processes: Any) -> Version:
    """Snapshots `leaves` (checked: `check_published`) as the next version."""
    m, boxes, index = self._layouts(tree, paths, leaves, dtypes, processes)
    shards, nbytes = {}, 0
    for t, (leaf, dt) in enumerate(zip(leaves, dtypes)):
      devices = jax_compat.addressable_device_assignment(leaf.sharding)
      for dev, arr in zip(devices, jax_compat.single_device_arrays(leaf)):
        k = index[dev.id]
        snap = _snapshot(arr, dt)
        shards[(t, k)] = (boxes[t][k], snap)
        nbytes += snap.nbytes
    with self.lock:
      self.published += 1
      version = self._held[self.published] = Version(self.published, m, shards, nbytes)
      while len(self._held) > self.keep:
        self._held.popitem(last=False)
    return version

  def _layouts(self, tree, paths, leaves, dtypes, processes):
    """The manifest of this layout set, each leaf's box per publisher device and the
    publisher device index of each device id (cached per layout set)."""
    key = (jax.tree_util.tree_structure(tree),
           tuple((l.shape, l.dtype, l.sharding) for l in leaves), tuple(dtypes))
    got = self._manifests.get(key)
    if got is None:
      m = manifest_lib.build(leaves, [manifest_lib.key_path(p) for p in paths], dtypes,
                             manifest_lib.skeleton_of(tree), processes)
      index = {i: k for k, i in enumerate(
          sorted({d.id for l in leaves for d in l.sharding.device_set}))}
      boxes = []
      for leaf in leaves:
        layout = Layout.from_sharding(leaf.sharding, leaf.shape)
        boxes.append({index[d]: b for d, b in zip(layout.devices, layout.boxes)})
      if len(self._manifests) >= MAX_MANIFESTS:
        self._manifests.pop(next(iter(self._manifests)))
      got = self._manifests[key] = (m, boxes, index)
    return got

  def get(self, number: int) -> Version | None:
    with self.lock:
      return self._held.get(number)

  def numbers(self) -> list[int]:
    with self.lock:
      return list(self._held)

  def listing(self) -> list[list[Any]]:
    """[[number, manifest id], ...] of the held versions, oldest first."""
    with self.lock:
      return [[n, v.manifest.id] for n, v in self._held.items()]

  def manifest(self, manifest_id: str) -> manifest_lib.Manifest | None:
    with self.lock:
      return next((v.manifest for v in self._held.values()
                   if v.manifest.id == manifest_id), None)

  def clear(self) -> None:
    with self.lock:
      self._held.clear()
