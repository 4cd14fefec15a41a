"""The eager programs' cache: its key (what a built entry depends on), the rules a call
must meet before an entry is built or reused, and the lookup-or-build of one entry.

Owns the cache only; what an entry holds and how it runs is programs.py.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Hashable

import jax
import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import collector
from jax_m2n._src.checks import (check_dtype, check_holds, check_memory_kind,
                                 dst_sharding_of, platform_of, same_layout)
from jax_m2n._src.eager.programs import build_programs
from jax_m2n._src.errors import API, ReshardTypeError, ReshardValueError
from jax_m2n._src.request import Request


# A call's built programs (programs.EagerReshard) by (tree, shapes, dtypes, shardings,
# options): a model's refit is one entry, one program per participating device over
# every leaf; the bound only stops growth when layouts keep changing. The compiled
# per-device programs themselves are shared between entries (programs.program_cache).
class LruCache:
  """A bounded least-recently-used map, safe across threads (functools.lru_cache keys on
  the function's arguments; here the key is formed before building, and tests look in)."""

  def __init__(self, size: int):
    self.size = size
    self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self.lock = threading.Lock()  # held while building a missing entry

  def get(self, key: Hashable) -> Any:
    value = self._data.get(key)
    if value is not None:
      try:
        self._data.move_to_end(key)
      except KeyError:  # evicted by another thread meanwhile
        pass
    return value

  def put(self, key: Hashable, value: Any) -> None:
    self._data[key] = value
    self._data.move_to_end(key)
    while len(self._data) > self.size:
      self._data.popitem(last=False)

  def __getitem__(self, key: Hashable) -> Any:
    return self._data[key]

  def __len__(self) -> int:
    return len(self._data)

  def __iter__(self):
    return iter(list(self._data))

  def clear(self) -> None:
    self._data.clear()


EAGER_CACHE_SIZE = 256
eager_cache = LruCache(EAGER_CACHE_SIZE)


class HashedKey(tuple):
  """A cache key that hashes its parts once: the cache hashes a key several times per
  call, and a sharding's hash is Python code (a 16-leaf key took 128 of them)."""

  def __init__(self, parts: tuple):
    self._hash = tuple.__hash__(self)  # TypeError when a part is unhashable

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    return self is other or tuple.__eq__(self, other)

  def __ne__(self, other: Any) -> bool:
    return not self.__eq__(other)


def eager_key(request: Request) -> HashedKey | None:
  """The cache key of `request`'s programs (None when it cannot be formed: then
  validation says why).

  A given src_sharding is part of the key: its agreement with x.sharding was checked
  when the entry was built. So is jax_enable_x64, which the programs are traced under
  (programs._x64_for).
  """
  parts = []
  for x, d, s in zip(request.leaves, request.dsts, request.srcs):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return None
    parts.append((x.shape, x.dtype, x.sharding, d, s))
  out_dtypes = request.out_dtypes
  try:
    converts = any(o is not None for o in out_dtypes)
    key = HashedKey((request.treedef, tuple(parts), request.options,
                tuple(out_dtypes) if converts else (), bool(jax.config.jax_enable_x64)))
  except TypeError:  # an unhashable destination: validation says why
    return None
  return key


class _LeafName:
  """Leaf i's name in a message: formed (with the call's other names) only when a
  message is, not for every leaf a check passes (856 leaves: 0.6 s of names)."""

  __slots__ = ("_names", "_i")

  def __init__(self, names, i: int):
    self._names, self._i = names, i

  def __str__(self) -> str:
    return self._names()[self._i]

  def __format__(self, spec: str) -> str:
    return format(str(self), spec)


def check_request(request: Request) -> list[Sharding]:
  """Every rule of the eager path beyond those of every path (checks.py's
  check_call_shardings ran on the call: meshes, unreduced shardings, src_sharding's
  type); returns the destination shardings."""
  out = []
  for i, (leaf, dst) in enumerate(zip(request.leaves, request.dsts)):
    name = _LeafName(request.names, i)
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
      hint = (" Hint: put host data on devices first with jax.device_put."
              if isinstance(leaf, (np.ndarray, np.generic, int, float, complex, bool))
              else "")
      raise ReshardTypeError(
          f"{API}: every leaf of x must be a jax.Array; got {type(leaf).__name__} at "
          f"{name}.{hint}")
    if leaf.is_deleted():
      raise ReshardValueError(
          f"{API}: {name} must be a live array; got a deleted (or donated) array.")
    if not leaf.committed:
      raise ReshardValueError(
          f"{API}: {name} must be committed to its devices (its sharding is then "
          f"what the source layout is); got an uncommitted array on {leaf.sharding}. "
          "Hint: jax.device_put(x, sharding) commits it.")
    check_dtype(API, name, leaf.dtype)
    dst_sharding = dst_sharding_of(API, name, dst, leaf.shape, leaf.dtype)
    src = leaf.sharding
    check_holds(API, name, dst_sharding, leaf.shape, "destination")
    check_memory_kind(API, name, src, "source")
    check_memory_kind(API, name, dst_sharding, "destination")
    src_platform = platform_of(src.device_set)
    dst_platform = platform_of(dst_sharding.device_set)
    if src_platform != dst_platform or any(
        d.platform != dst_platform for d in dst_sharding.device_set):
      raise ReshardValueError(
          f"{API}: the destination devices of {name} must be on the source's platform "
          f"({src_platform}); got platform {dst_platform} ({dst_sharding}). Hint: "
          "jax.device_put moves data between platforms.")
    given = request.srcs[i]
    if given is not None and not same_layout(given, src, leaf.shape):
      raise ReshardValueError(
          f"{API}: src_sharding of {name} must describe the array's actual layout; got "
          f"{given} for an array sharded as {src}. Hint: outside jit, src_sharding can "
          "be left out.")
    out.append(dst_sharding)
  return out


def lookup_or_build(request: Request, record: list | None = None) -> Any:
  """The per-device programs of `request` (every leaf moved by jax_m2n), from the cache
  or built now, after every check of the eager path (nothing runs here: the caller
  calls the entry with the leaves once every other leaf is checked too).

  `record`: the entry's cache key is appended to it (nothing where none is cached).
  """
  key = eager_key(request)
  fn = eager_cache.get(key) if key is not None else None
  if fn is not None:
    for leaf in request.leaves:  # what may change between calls of one key
      if leaf.is_deleted() or not leaf.committed:
        check_request(request)  # raises what is wrong
    if record is not None:
      record.append(key)
    return fn
  dst_shardings = check_request(request)
  with eager_cache.lock:
    fn = eager_cache.get(key) if key is not None else None
    if fn is None:
      with collector.paused(promote=True):  # plans, schedules and programs of every leaf
        fn = build_programs(request, dst_shardings)
      if key is not None:
        eager_cache.put(key, fn)
  if record is not None and key is not None:
    record.append(key)
  return fn
