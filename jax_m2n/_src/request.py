"""One reshard call as values: its options (`Options`, frozen and hashable, carried whole
by every path) and its leaves with their per-leaf arguments (`Request`, the eager
path's one argument). Owns the shape of a call; checks nothing (checks.py makes both,
after every rule) and moves nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

# The timeout a call waits for its peers when the caller names none (`timeout_s=None`).
DEFAULT_TIMEOUT_MS = 300_000


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
  """The per-call options of a reshard, checked (`checks.options` makes them).

  Frozen and hashable: the eager path keys its program cache on it, the traced path
  carries it as one parameter of the `jax_m2n_reshard` primitive, the cross-process path
  fingerprints it. Adding an option means adding a field here and its rule in
  `checks.options`, not editing the signatures between them.

  Attributes:
    route: `hierarchical`, `flat` or `gather_bcast`.
    topology: as given, in a hashable spelling: None (one domain per process), a
      domain size (int), device-id tuples per domain, or a `jax_m2n.Topology`.
    timeout_ms: how long a device waits for its peers, whole milliseconds.
    chunk_bytes: the caller's bound on one chunk, or None (chosen per plan).

  Example:
    >>> Options(route="flat", timeout_ms=2000) == Options("flat", None, 2000, None)
    True
  """

  route: str = "hierarchical"
  topology: Any = None
  timeout_ms: int = DEFAULT_TIMEOUT_MS
  chunk_bytes: int | None = None

  @property
  def timeout_s(self) -> float:
    """`timeout_ms` in seconds (what waits in Python take)."""
    return self.timeout_ms / 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
  """A reshard of `leaves` (flattened from one pytree by `treedef`).

  Per leaf i: `dsts[i]` (a Sharding, a ShapeDtypeStruct with one, or None: keep),
  `srcs[i]` (the src_sharding given for it, or None), `out_dtypes[i]` (the dtype to
  convert to, or None: keep) and `donate[i]`. Per call: `options`. `names()` returns
  the leaves' names for messages (formed only when a message needs them: that costs
  more than the checks).
  """

  leaves: Sequence[Any]
  treedef: Any
  dsts: Sequence[Any]
  srcs: Sequence[Any]
  out_dtypes: Sequence[Any]
  donate: Sequence[bool]
  options: Options
  names: Callable[[], list[str]]

  def __len__(self) -> int:
    return len(self.leaves)

  def replace(self, **changes: Any) -> "Request":
    """This request with some fields changed (e.g. leaves converted first)."""
    return dataclasses.replace(self, **changes)

  def subset(self, index: Sequence[int]) -> "Request":
    """The request of leaves `index` alone (in that order), as a flat list; itself
    where `index` is every leaf in order."""
    if len(index) == len(self.leaves):
      return self
    names = self.names
    return Request(
        leaves=[self.leaves[i] for i in index],
        treedef=jax.tree.structure([0] * len(index)),
        dsts=[self.dsts[i] for i in index],
        srcs=[self.srcs[i] for i in index],
        out_dtypes=[self.out_dtypes[i] for i in index],
        donate=[self.donate[i] for i in index],
        options=self.options,
        names=lambda: [names()[i] for i in index])
