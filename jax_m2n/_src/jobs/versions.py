"""A publisher process's held versions: snapshots of its shards, or the caller's own
arrays lent, and their manifests.

Owns checking what is published (reshard's rules for a source, where they apply),
taking a version's snapshot (a copy of each of this process's shards, or its
conversion to the published dtype: into the layout set's export on CPU, as XLA
buffers on GPUs) or holding the caller's arrays (`lend`, GPUs: no copy; a lent version
is gone once one of its arrays is donated or deleted), the manifest of each layout set
(cached), the exports (exports.py) and the per-wire-dtype copies of a held version,
and dropping versions beyond `keep`. Threads: `add` runs on the trainer's thread, the
rest on the server thread; one lock. Knows no sockets or transports.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable

import jax
import numpy as np

from jax_m2n._src import checks
from jax_m2n._src import jax_compat
from jax_m2n._src import local_copy as local_copy_lib
from jax_m2n._src.errors import (ReshardRuntimeError, ReshardTypeError, ReshardValueError,
                                 VersionGone)
from jax_m2n._src.jobs import exports, manifest as manifest_lib, pieces
from jax_m2n._src.layout import Box, Layout, box_size

logger = logging.getLogger("jax_m2n")
# Manifests kept per publisher (a training run publishes one layout set, a few at most).
MAX_MANIFESTS = 16


@dataclasses.dataclass
class Version:
  """One held version on this process.

  Its shards live in XLA buffers (`shards`), or, where its layout set's export is the
  snapshot (CPU), only in the export's slot `slot`, materialized as XLA buffers on the
  first request that needs them (the network path's cut, a delta's compare).
  """

  number: int
  manifest: manifest_lib.Manifest
  # (leaf, publisher device index) -> (box, snapshot array on that device, or None
  # while it lives only in the export)
  shards: dict[tuple[int, int], tuple[Box, jax.Array | None]]
  nbytes: int
  export: exports.Export | None = None
  slot: int = -1
  devices: dict[int, Any] = dataclasses.field(default_factory=dict)
  # Per wire dtype asked for, the shards converted to it (made once per version on
  # the first request, dropped with the version): a conversion costs one pass per
  # version, not one per subscriber, and the pieces are then cut without converting.
  wire: dict[Any, dict[tuple[int, int], jax.Array]] = dataclasses.field(
      default_factory=dict)
  # The caller's own arrays the version lends (no copy; GPUs), and how it is held:
  # "lent", or "snapshot" with why where lending was asked for and not done.
  lent: tuple[jax.Array, ...] = ()
  how: str = "snapshot"

  def gone(self) -> bool:
    """Whether a lent array was donated or deleted (the version's bytes may be gone)."""
    return any(a.is_deleted() for a in self.lent)

  def device_bytes(self) -> dict[str, int]:
    """Per device, the bytes this version holds in XLA buffers beside the caller's
    own arrays: its snapshot (none where lent or only in the CPU export) and its wire
    conversions."""
    out: dict[str, int] = {}
    mine = {id(a) for a in self.lent}
    arrays = [a for _, a in self.shards.values() if a is not None and id(a) not in mine]
    arrays += [a for c in self.wire.values() for a in c.values()]
    for a in arrays:
      key = str(a.device)
      out[key] = out.get(key, 0) + int(a.nbytes)
    return out

  def shard(self, t: int, k: int, dtype: np.dtype) -> tuple[Box, jax.Array]:
    """Leaf t's shard on publisher device k, in `dtype`, with its box."""
    box, array = self.shards[(t, k)]
    if array is None:
      self._materialize()
      box, array = self.shards[(t, k)]
    if array.dtype == dtype:
      return box, array
    converted = self.wire.setdefault(dtype, {})
    got = converted.get((t, k))
    if got is None:
      got = converted[(t, k)] = pieces.converter(np.dtype(dtype))(array)
    return box, got

  def _materialize(self) -> None:
    """The shards as XLA buffers, copied out of the export's slot (one program per
    device), while the slot still holds this version.

    Raises:
      VersionGone: the slot was reused for a newer version meanwhile.
    """
    export = self.export
    with export.lock:
      if export.slot_of(self.number) != self.slot:
        raise VersionGone(f"Publisher: version {self.number} must still be held to be "
                          "served; it was dropped meanwhile.")
      per_device: dict[int, list[tuple[int, int]]] = {}
      for t, k in self.shards:
        per_device.setdefault(k, []).append((t, k))
      for k, keys in per_device.items():
        boxes, outs = [], []
        for i, (t, _) in enumerate(keys):
          box, _ = self.shards[(t, k)]
          shape = tuple(hi - lo for lo, hi in box)
          dtype = manifest_lib.dtype_of(self.manifest.leaves[t].dtype)
          boxes.append(local_copy_lib.Box(i, i, shape, dtype, (0,) * len(shape),
                                          (0,) * len(shape), shape))
          outs.append(local_copy_lib.Out(shape, dtype))
        arrays = local_copy_lib.local_copy(
            self.devices[k], [export.pointer(t, k, self.slot) for t, _ in keys],
            boxes, outs)
        jax.block_until_ready(arrays)  # before the slot may be written again
        for (t, _), a in zip(keys, arrays):
          self.shards[(t, k)] = (self.shards[(t, k)][0], a)



def _snapshot(array: jax.Array, dtype: np.dtype) -> jax.Array:
  """A copy of one single-device array in `dtype`, never aliasing it (the trainer may
  donate or overwrite its arrays once publish returns)."""
  if array.dtype == dtype:
    return jax.device_put(array, may_alias=False)
  return pieces.converter(np.dtype(dtype))(array)


@functools.lru_cache(maxsize=1024)  # a trainer publishes the same shardings each step
def _sharding_ok(sharding: Any) -> bool:
  """Whether a published leaf's sharding meets the rules of a source (nothing
  unreduced, in device memory)."""
  try:
    checks.check_reduction("", "", sharding, "source")
    checks.check_memory_kind("", "", sharding, "source")
  except (ReshardTypeError, ReshardValueError):
    return False
  return True


# manifest.DTYPES as dtypes (a dtype's name is slow to get: this runs per leaf, per
# publish).
_PUBLISHABLE = frozenset(np.dtype(name) for name in manifest_lib.DTYPES)


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
    if leaf.dtype not in _PUBLISHABLE:
      raise ReshardTypeError(
          f"{api}: every leaf must hold numbers or bools "
          f"({', '.join(manifest_lib.DTYPES)}); got {leaf.dtype} at {name}.")
    checks.check_rank(api, name, leaf.shape)
    if not _sharding_ok(leaf.sharding):  # the rules again, naming the leaf
      checks.check_reduction(api, name, leaf.sharding, "source")
      checks.check_memory_kind(api, name, leaf.sharding, "source")
  outs = checks.dtypes_per_leaf(api, dtype, tree, treedef, len(leaves))
  dtypes = [np.dtype(l.dtype) if o is None else np.dtype(jax.dtypes.canonicalize_dtype(o))
            for o, l in zip(outs, leaves)]
  for t, d in enumerate(dtypes):
    if d not in _PUBLISHABLE:
      raise ReshardTypeError(f"{api}: dtype must be one of {manifest_lib.DTYPES}; got "
                             f"{d} for {names()[t]}.")
  return [p for p, _ in with_path], leaves, dtypes


class Versions:
  """The versions this process holds, at most `keep`, newest last."""

  def __init__(self, keep: int, fds: Callable[[], Any], lend_limit: float | None = None):
    self.keep = keep
    self.lend_limit = lend_limit
    self.allocations = exports.Allocations()  # GPUs: what local readers map
    self.lock = threading.Lock()
    self.published = 0
    self._held: collections.OrderedDict[int, Version] = collections.OrderedDict()
    self._fds = fds  # this process's fd server (made on first need)
    self._exports: dict[str, exports.Export] = {}
    # (structure, avals, shardings, dtypes) -> (manifest, per leaf device -> box,
    # device id -> publisher device index)
    self._manifests: dict[Any, tuple[Any, ...]] = {}

  def add(self, tree: Any, paths: list[Any], leaves: list[jax.Array],
          dtypes: list[np.dtype], processes: Any, lend: bool = False) -> Version:
    """Snapshots `leaves` (checked: `check_published`) as the next version: into the
    layout set's export where that is the snapshot (CPU: one copy, no XLA buffer),
    else as XLA buffers; or, with `lend` on GPUs, holds the arrays themselves (those
    in the published dtype; `lend_limit` may refuse, `Version.how` says). Written
    into the layout set's export where local subscribers use one."""
    m, boxes, index = self._layouts(tree, paths, leaves, dtypes, processes)
    arrays, devices, mine = {}, {}, {}
    for t, (leaf, dt) in enumerate(zip(leaves, dtypes)):
      for dev, arr in zip(jax_compat.addressable_device_assignment(leaf.sharding),
                          jax_compat.single_device_arrays(leaf)):
        k = index[dev.id]
        devices[k] = dev
        if arr.dtype == dt:
          arrays[(t, k)] = mine[(t, k)] = arr
        else:
          arrays[(t, k)] = pieces.converter(np.dtype(dt))(arr)
    nbytes = sum(box_size(boxes[t][k]) * dtypes[t].itemsize for t, k in arrays)
    on_cpu = _export_is_snapshot(devices)
    how = "snapshot"
    if lend:
      how = ("snapshot (CPU: XLA's CPU buffers cannot be shared)" if on_cpu
             else self._lendable(list(mine.values())))
    export = self._exports.get(m.id)
    if export is None and on_cpu:
      export = self._export(m.id, arrays, boxes, devices)
    with self.lock:
      number = self.published + 1
    lent: tuple[jax.Array, ...] = ()
    if on_cpu:
      shards = {key: (boxes[key[0]][key[1]], None) for key in arrays}
    elif how == "lent":
      shards = {key: (boxes[key[0]][key[1]], a) for key, a in arrays.items()}
      # The caller's global arrays too: donating or deleting one marks it deleted.
      lent = tuple(mine.values()) + tuple(leaves)
    else:
      shards = {key: (boxes[key[0]][key[1]],
                      _snapshot(a, a.dtype) if key in mine else a)
                for key, a in arrays.items()}
      arrays = {key: a for key, (_, a) in shards.items()}
    slot = self._write(export, number, arrays, bool(lent))
    with self.lock:
      self.published = number
      version = self._held[number] = Version(number, m, shards, nbytes, export, slot,
                                             devices, lent=lent, how=how)
      dropped = []
      while len(self._held) > self.keep:
        dropped.append(self._held.popitem(last=False)[1])
    self._dropped(dropped)
    return version

  def _write(self, export: exports.Export | None, number: int,
             arrays: dict[tuple[int, int], jax.Array], lent: bool) -> int:
    """The version into the export (its slot), or -1 where there is none or it cannot
    be exported (logged: local subscribers then find it gone)."""
    if export is None:
      return -1
    try:
      return export.write(number, arrays, lent)
    except (ReshardRuntimeError, RuntimeError) as e:  # (RuntimeError: a deleted array)
      logger.warning("jax_m2n Publisher: version %d cannot be exported to local "
                     "subscribers: %s", number, e)
      return -1

  def _lendable(self, arrays: list[jax.Array]) -> str:
    """"lent", or why the version is snapshotted instead: an array outside one VMM
    allocation, or (`lend_limit`) an allocation larger than lend_limit x the bytes lent
    from it (e.g. XLA's preallocated pool: a reader would map all of it)."""
    if self.lend_limit is None:
      return "lent"
    per: dict[int, int] = {}
    sizes: dict[int, int] = {}
    try:
      for a in arrays:
        ident, _, alloc = self.allocations.locate(a)
        per[ident] = per.get(ident, 0) + int(a.nbytes)
        sizes[ident] = alloc.nbytes
    except ReshardRuntimeError as e:
      return f"snapshot (not lendable: {e})"
    finally:
      self._trim()
    over = [i for i in per if sizes[i] > self.lend_limit * per[i]]
    if over:
      return (f"snapshot (pooled memory: an allocation of {sizes[over[0]]} bytes lends "
              f"{per[over[0]]}, over lend_limit={self.lend_limit:g}x)")
    return "lent"

  def _dropped(self, versions: list[Version], close: bool = True) -> None:
    """After versions left `_held`: their slots cleared (before their buffers go),
    unused allocations released, and (`close`: a publish dropped them) the exports of
    layout sets no longer held closed. A lent version dropped between publishes
    (donated, deleted, released) keeps its layout set's export: the trainer's next
    publish writes into it (it may be publishing into it now)."""
    for v in versions:
      if v.export is not None:
        v.export.forget(v.number)
    gone = []
    if close:
      with self.lock:
        live = {v.manifest.id for v in self._held.values()}
        gone = [self._exports.pop(mid) for mid in list(self._exports) if mid not in live]
    for e in gone:
      e.close()
    self._trim()

  def _trim(self) -> None:
    with self.lock:
      live = set().union(*(e.allocation_ids() for e in self._exports.values()))
    self.allocations.keep_only(live)

  def _export(self, manifest_id: str, arrays: dict[tuple[int, int], jax.Array],
              boxes: list[dict[int, Box]], devices: dict[int, Any]) -> exports.Export:
    export = self._exports[manifest_id] = exports.Export(
        {(t, k): (boxes[t][k], a.dtype) for (t, k), a in arrays.items()}, devices,
        self.keep, self._fds, self.allocations)
    return export

  def export_for(self, manifest_id: str) -> exports.Export | None:
    """The export of a held layout set for a local subscriber, made on first need
    where it is not the snapshot (GPUs: the slot tables naming the held versions'
    allocations); None where no held version has that layout set."""
    with self.lock:
      held = [v for v in self._held.values() if v.manifest.id == manifest_id]
      export = self._exports.get(manifest_id)
    if export is not None or not held:
      return export
    arrays = {key: a for key, (_, a) in held[-1].shards.items()}
    boxes: list[dict[int, Box]] = [{} for _ in held[-1].manifest.leaves]
    for (t, k), (box, _) in held[-1].shards.items():
      boxes[t][k] = box
    export = self._export(manifest_id, arrays, boxes, held[-1].devices)
    for v in held:
      v.export, v.slot = export, self._write(
          export, v.number, {key: a for key, (_, a) in v.shards.items()}, bool(v.lent))
    return export

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
    self._prune()
    with self.lock:
      return self._held.get(number)

  def numbers(self) -> list[int]:
    self._prune()
    with self.lock:
      return list(self._held)

  def listing(self) -> list[list[Any]]:
    """[[number, manifest id], ...] of the held versions, oldest first."""
    self._prune()
    with self.lock:
      return [[n, v.manifest.id] for n, v in self._held.items()]

  def alive(self, number: int) -> bool:
    """Whether `number` is held with every byte it had (a lent version whose array
    was donated or deleted is dropped here: a reader's confirmation after its copy)."""
    return self.get(number) is not None

  def release(self, number: int) -> bool:
    """Stops lending version `number` (`Publisher.wait_pulled`: the caller is about
    to donate its arrays): dropped at once where it is lent. Returns whether it was."""
    with self.lock:
      v = self._held.get(number)
      if v is None or not v.lent:
        return False
      del self._held[number]
    self._dropped([v], close=False)
    return True

  def _prune(self) -> None:
    """Drops the lent versions whose arrays went (donated or deleted)."""
    with self.lock:
      gone = [n for n, v in self._held.items() if v.lent and v.gone()]
      dropped = [self._held.pop(n) for n in gone]
    if dropped:
      self._dropped(dropped, close=False)

  def device_bytes(self) -> dict[str, int]:
    """Per device, the bytes held for weight sync beside the caller's own arrays
    (snapshots and wire conversions of the held versions; on CPU the export slots,
    which are the snapshots)."""
    out: dict[str, int] = {}
    with self.lock:
      held = list(self._held.values())
      cpu = [e for e in self._exports.values() if e.tables is None]
    for v in held:
      for d, n in v.device_bytes().items():
        out[d] = out.get(d, 0) + n
    for e in cpu:
      for k, n in e.slot_bytes.items():
        d = str(e.devices[k])
        out[d] = out.get(d, 0) + e.keep * n
    return out

  def versions(self) -> list[Version]:
    with self.lock:
      return list(self._held.values())

  def newest_of(self, manifest_id: str) -> Version | None:
    """The newest held version of a layout set, or None."""
    with self.lock:
      return next((v for v in reversed(self._held.values())
                   if v.manifest.id == manifest_id), None)

  def manifest(self, manifest_id: str) -> manifest_lib.Manifest | None:
    with self.lock:
      return next((v.manifest for v in self._held.values()
                   if v.manifest.id == manifest_id), None)

  def exports(self) -> list[exports.Export]:
    """The exports of the held layout sets (the local data plane's memory)."""
    with self.lock:
      return list(self._exports.values())

  def clear(self) -> None:
    """Drops every version and frees every export."""
    with self.lock:
      self._held.clear()
      gone, self._exports = list(self._exports.values()), {}
    for e in gone:
      e.close()
    self.allocations.keep_only(set())


def _export_is_snapshot(devices: dict[int, Any]) -> bool:
  """Whether a version's export is its one snapshot: on CPU (host memory shared as it
  is: no second copy); on GPUs XLA's buffers are the snapshot and are exported as they
  are (their allocations, by file descriptor), made only for local subscribers."""
  return next(iter(devices.values())).platform == "cpu"
