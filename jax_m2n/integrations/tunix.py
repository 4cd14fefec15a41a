"""tunix's resharding through jax_m2n: `install()` and `uninstall()`.

Owns the one hook tunix offers: `tunix.rl.reshard.reshard_pytree` (the per-step weight
sync, model loading onto another mesh, the rollout engines' `transfer_state_*`) builds
its backend on every call from `[Pathways, jax.device_put]`, the first that loads.
`install()` replaces the second, so Pathways stays first where it is present and every
other call runs `jax_m2n.reshard`. No tunix source is edited; tunix is imported only by
`install()`, never by `import jax_m2n`. Nothing here moves data itself.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

import jax_m2n

__all__ = ["install", "is_installed", "reshard", "reshard_count", "uninstall"]

logger = logging.getLogger("jax_m2n")

_API = "jax_m2n.integrations.tunix"
# tunix.rl.reshard's fallback backend: the module attribute install() replaces.
_HOOK = "_get_reshard_fn_jax_device_put"

_lock = threading.Lock()
_saved: list[Any] = []  # [what _HOOK was before install()], empty when not installed
_count = [0]  # reshard calls made through this module since import


def install() -> None:
  """Makes tunix reshard through `jax_m2n.reshard` (idempotent).

  Afterwards `tunix.rl.reshard.reshard_pytree` tries Pathways first, as before, and
  where Pathways is absent calls `jax_m2n.integrations.tunix.reshard` (with tunix's
  `donate_input`) where it called `jax.device_put`. This covers every tunix path that
  reshards: `RLCluster.sync_weights` (the rollout's `update_params`), model loading onto
  another mesh (`RLCluster._load_model`, `reshard_model_to_mesh`) and the rollout
  engines' `transfer_state_with_mappings` / `transfer_state_directly` (chunked by
  `reshard_chunk_size` or not). Calling it again changes nothing.

  Collective contract: as `jax_m2n.reshard`'s; in a multi-process job every process
  installs the adapter before its first weight sync.

  Raises:
    ImportError: tunix is not importable (`pip install "jax_m2n[tunix]"`).

  Example:
    >>> from jax_m2n.integrations import tunix as m2n_tunix  # doctest: +SKIP
    >>> m2n_tunix.install()  # before building the RLCluster  # doctest: +SKIP
  """
  module = _tunix_reshard_module()
  with _lock:
    current = getattr(module, _HOOK)
    if current is _get_reshard_fn:
      return
    _saved[:] = [current]
    setattr(module, _HOOK, _get_reshard_fn)
  logger.debug("%s: installed (tunix.rl.reshard.%s -> jax_m2n)", _API, _HOOK)


def uninstall() -> None:
  """Gives tunix its own fallback back (`jax.device_put`); a no-op when not installed.

  Restores what `install()` replaced. Where something else has replaced tunix's hook
  since `install()`, that replacement is left in place (it may call ours) and only this
  module's record is dropped.
  """
  module = _tunix_reshard_module()
  with _lock:
    if not _saved:
      return
    if getattr(module, _HOOK) is _get_reshard_fn:
      setattr(module, _HOOK, _saved[0])
    _saved.clear()
  logger.debug("%s: uninstalled", _API)


def is_installed() -> bool:
  """Whether tunix's fallback reshard is `jax_m2n`'s now (False without tunix)."""
  try:
    module = _tunix_reshard_module()
  except ImportError:
    return False
  return getattr(module, _HOOK) is _get_reshard_fn


def reshard_count() -> int:
  """How many reshard calls went through this module since it was imported (each
  `reshard_pytree` call, or each chunk of a chunked transfer, counts one)."""
  return _count[0]


def reshard(source: Any, target: Any, *, donate: bool = False) -> Any:
  """`jax_m2n.reshard(source, target)` for the call shapes tunix makes.

  Args:
    source: a pytree of arrays (an `nnx.State`, a nested dict, a flat dict keyed by
      tuple paths...). Typed PRNG-key leaves move as their key data (`uint32`), device
      to device, and are wrapped again on the destination (with `jax.device_put`, a key
      between device layouts goes through host memory, which tunix's transfer guard
      refuses); key leaves are never donated.
    target: a pytree like `source` whose leaves are shardings or arrays (an array
      stands for its sharding), or one sharding for all leaves.
    donate: tunix's `donate_input`: the source arrays are deleted once moved (except
      typed keys, which are a few bytes).

  Returns:
    A pytree like `source` in the target shardings, equal to
    `jax.device_put(source, target)` (host memory kinds such as `pinned_host`
    are delegated to `jax.device_put` by `jax_m2n.reshard`, as there).

  Raises:
    jax_m2n.ReshardError: as `jax_m2n.reshard`, before any data moves.
  """
  with _lock:
    _count[0] += 1
  target = jax.tree_util.tree_map(_as_sharding, target)
  leaves, treedef = jax.tree_util.tree_flatten(source)
  keys = [i for i, leaf in enumerate(leaves) if _is_typed_key(leaf)]
  if not keys:
    return jax_m2n.reshard(source, target, donate=donate)
  if isinstance(target, Sharding):
    dsts = [target] * len(leaves)
  else:
    try:
      dsts = treedef.flatten_up_to(target)
    except (TypeError, ValueError):  # a prefix, or a mismatch: reshard says which
      return jax_m2n.reshard(source, target, donate=donate)
  moved, flags = list(leaves), [donate] * len(leaves)
  wrapped = []
  for i in keys:
    flags[i] = False
    data = jax.random.key_data(leaves[i])
    data_dst = _key_data_sharding(dsts[i], data.ndim)
    if data_dst is not None:
      moved[i], dsts[i] = data, data_dst
      wrapped.append(i)
  outs = jax_m2n.reshard(moved, dsts, donate=flags)
  for i in wrapped:
    outs[i] = jax.random.wrap_key_data(outs[i], impl=jax.random.key_impl(leaves[i]))
  return jax.tree_util.tree_unflatten(treedef, outs)


# ---------------------------------------------------------------------------------------
# The hook and its helpers
# ---------------------------------------------------------------------------------------

def _get_reshard_fn(*, donate: bool, cache_resharding_plans: bool = False,
                    use_experimental_pre_reshard: bool = False):
  """tunix's backend factory signature; returns `fn(source, shardings)`. jax_m2n
  caches its plans and programs itself, and needs no pre-reshard: the two flags are
  tunix's Pathways options and are ignored, as by tunix's device_put fallback."""
  del cache_resharding_plans, use_experimental_pre_reshard
  return functools.partial(reshard, donate=bool(donate))


def _tunix_reshard_module():
  try:
    import tunix.rl.reshard as module  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        f"{_API}: tunix must be importable to install the adapter; got {e!r}. Install "
        f"it with: pip install \"jax_m2n[tunix]\".") from e
  if not callable(getattr(module, _HOOK, None)):
    raise ImportError(
        f"{_API}: tunix.rl.reshard must define {_HOOK} (the device_put fallback "
        f"reshard_pytree uses); got a tunix without it ({getattr(module, '__file__', '?')})."
        " Use a google-tunix release in the range jax_m2n[tunix] names.")
  return module


def _as_sharding(leaf: Any) -> Any:
  return leaf.sharding if isinstance(leaf, jax.Array) else leaf


def _is_typed_key(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return (isinstance(leaf, jax.Array) and dtype is not None
          and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def _key_data_sharding(dst: Any, data_ndim: int) -> Any:
  """The sharding of a key's data that lands like the key in `dst`: the key's spec
  padded with None up to the data's rank (the trailing key-data axes are whole); None
  where jax_m2n should be handed the key itself (another destination type, or host
  memory, where jax_m2n delegates to jax.device_put anyway)."""
  if getattr(dst, "memory_kind", None) not in (None, "device"):
    return None
  if isinstance(dst, NamedSharding):
    spec = tuple(dst.spec) + (None,) * (data_ndim - len(dst.spec))
    return NamedSharding(dst.mesh, PartitionSpec(*spec), memory_kind=dst.memory_kind)
  if isinstance(dst, SingleDeviceSharding):
    return dst
  return None
