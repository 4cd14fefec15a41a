"""`jax_m2n.torch.Subscriber`: a PyTorch process's side of weight sync with a JAX trainer.

Owns the torch subscriber's public calls (pull_into, pull, iter_pull, published, close)
and their arguments' checks; a pull's steps are pull.py's. The token, control channel,
errors and timeouts are the jobs layer's; JAX only receives the network path's packs
(host memory torch views).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch

from jax_m2n._src import checks
from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs import auth, lifetime, manifest as manifest_lib, pulling
from jax_m2n._src.jobs.connections import Connections
from jax_m2n._src.jobs.request import pull_options
from jax_m2n._src.torch import pull as pull_lib
from jax_m2n._src.torch.pull import TorchPull
from jax_m2n._src.torch.targets import TORCH_OF, dotted

_API = "jax_m2n.torch.Subscriber"


def dotted_name(path: str) -> str:
  """The default mapping: a leaf's dotted key path is its torch name."""
  return path


class Subscriber(lifetime.Closing):
  """Pulls versions a `jax_m2n.Publisher` published into this torch rank's tensors.

  Each rank of the generator (a torch process: one of `world_size` tensor-parallel
  ranks, or the only one) makes its own Subscriber and receives only its own slices
  (reshard's planner over the trainer's layouts; the flat route). On the trainer's
  host the bytes are read with torch copies straight out of the trainer's exported
  memory; elsewhere they cross the network (the jobs protocol, token and transport).
  Results are bitwise `x.astype(dtype)` of the published `x` (conversions among
  float32, float16, bfloat16 and float8 round to nearest even on either path).

  Args:
    address: the Publisher's address ("host:port").
    token: the publisher's token (`jax_m2n.new_token()`); a wrong one raises here.
    rank, world_size: this rank and how many ranks the placements split over.
    timeout_s: how long the publisher may take to answer the handshake.

  Raises:
    ReshardValueError: a wrong or short token, a malformed address or rank.
    ReshardRuntimeError: nothing answered at `address` within `timeout_s`.

  Example:
    >>> sub = jax_m2n.torch.Subscriber(pub.address, token=token, rank=0, world_size=2)  # doctest: +SKIP
    >>> sub.pull_into(model.state_dict(), names=my_names,                # doctest: +SKIP
    ...               placements={"qkv.weight": jax_m2n.torch.Shard(0)})
    3
  """

  def __init__(self, address: str, *, token: Any, rank: int = 0, world_size: int = 1,
               timeout_s: float = 60.0):
    key = auth.as_key(_API, token)
    if (isinstance(rank, bool) or isinstance(world_size, bool)
        or not isinstance(rank, int) or not isinstance(world_size, int)
        or not 0 <= rank < world_size):
      raise ReshardValueError(f"{_API}: rank must be an int in [0, world_size); got "
                              f"rank={rank!r}, world_size={world_size!r}.")
    self.rank, self.world_size = rank, world_size
    connect_s = checks.options(_API, timeout_s=timeout_s).timeout_s
    self._held = pull_lib.Held(pulling.State(Connections(_API, address, key, connect_s)),
                               rank, world_size)
    self._close_with(_shut, self._held)

  @property
  def version(self) -> int:
    """The version of the last successful pull (0 before the first)."""
    return self._held.state.version

  @property
  def last_pull(self) -> "TorchPull | None":
    """The record of the last successful pull (None before one): `TorchPull`."""
    return self._held.last_pull

  def pull_into(self, tensors: Mapping[str, torch.Tensor], *,
                names: Callable[[str], Any] = dotted_name,
                placements: Mapping[str, Any] | None = None, version: int | None = None,
                timeout_s: float | None = None, path: str = "auto") -> int:
    """Pulls a version into `tensors` in place; returns its number.

    Args:
      tensors: per torch name, this rank's tensor (its shape: this rank's slice under
        `placements`; its dtype: the delivered one).
      names: maps each published leaf's dotted key path ("layers.0.wq") to a torch
        name (a str), an `Into` (transposed, or one part of a fused q/k/v or gate/up
        tensor), or None (not pulled). Every target needs a leaf; every name given
        must be a target.
      placements: per torch name, `Shard(dim)`, `Replicate()` (default) or
        `Slice(offsets, sizes)` over the `world_size` ranks.
      version, timeout_s, path: as `jax_m2n.Subscriber.pull`'s (the newest after the
        last pull, or that one; the bound on each wait; "auto", "local", "network").

    Raises:
      ReshardValueError / ReshardTypeError: a missing or extra name, a shape or dtype
        that does not fit (naming the parameter), before any tensor is written.
      ReshardTimeoutError: no version in time.
      ReshardRuntimeError: the publisher died or closed (within 2 s); the message and
        the error's `written` name the tensors written before it failed.
    """
    api = f"{_API}.pull_into"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    for n, x in tensors.items():
      if not isinstance(x, torch.Tensor):
        raise ReshardTypeError(f"{api}: every target must be a torch.Tensor; got "
                               f"{type(x).__name__} for {n!r}.")
    options = pull_options(api, timeout_s=timeout_s, version=version, path=path)
    dtypes = {n: x.dtype for n, x in tensors.items()}
    shapes = {n: tuple(x.shape) for n, x in tensors.items()}
    return pull_lib.pull(self._held, api, options, names, dict(placements or {}), dtypes, shapes,
                      lambda ts: [tensors[t.name] for t in ts])

  def pull(self, *, names: Callable[[str], Any] = dotted_name,
           placements: Mapping[str, Any] | None = None, dtype: Any = None,
           version: int | None = None, timeout_s: float | None = None,
           path: str = "auto", device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Pulls a version into new tensors: {torch name: this rank's tensor} for every
    name `names` gives (arguments as `pull_into`'s; `dtype`: None for the published
    dtype, a torch dtype, or per name a mapping; `device`: where they are made)."""
    api = f"{_API}.pull"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = pull_options(api, timeout_s=timeout_s, version=version, path=path)
    made: dict[str, torch.Tensor] = {}

    def alloc(ts):
      for t in ts:
        made[t.name] = torch.empty(t.shape, dtype=t.dtype, device=device)
      return [made[t.name] for t in ts]

    pull_lib.pull(self._held, api, options, names, dict(placements or {}), dtype, None, alloc)
    return made

  def published(self, *, version: int | None = None, timeout_s: float | None = None
                ) -> tuple[int, list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """What a version is made of, without pulling it: (its number, per leaf its
    dotted name, global shape and torch dtype). Without `version`, the newest
    published after the last pull (waiting up to `timeout_s`); pull it with
    `version=` that number."""
    api = f"{_API}.published"
    if self._closed:
      raise ReshardRuntimeError(f"{api}: the subscriber must be open; got a closed one.")
    options = pull_options(api, timeout_s=timeout_s, version=version)
    number, mid = pulling.choose(self._held.state, options)
    m = pull_lib.manifest(self._held, mid)
    return number, [(dotted(l.path), tuple(l.shape),
                     TORCH_OF.get(manifest_lib.dtype_of(l.dtype))) for l in m.leaves]

  def iter_pull(self, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
    """`pull`'s tensors as (name, tensor) pairs, for a model's `load_weights`."""
    return iter(self.pull(**kwargs).items())

  def close(self) -> None:
    """Closes the connections and unmaps the exports (also at `with`'s end and when
    the last reference goes)."""
    super().close()


def _shut(held) -> None:
  held.close()
