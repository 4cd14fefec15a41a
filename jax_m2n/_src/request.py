"""One reshard call's arguments, checked and flattened: what travels from api.reshard to
the eager path as one frozen object instead of a dozen loose parameters.

Owns the shape of a call (per leaf: the array, its destination, its given source
layout, its output dtype, its donation flag; per call: route, topology, timeout, chunk
size, leaf names for messages). It checks nothing (checks.py does, before a Request is
made) and moves nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
  """A reshard of `leaves` (flattened from one pytree by `treedef`).

  Per leaf i: `dsts[i]` (a Sharding, a ShapeDtypeStruct with one, or None: keep),
  `srcs[i]` (the src_sharding given for it, or None), `out_dtypes[i]` (the dtype to
  convert to, or None: keep) and `donate[i]`. Per call: `route`, `topology` (as given:
  None, a domain size, device id lists or a Topology), `timeout_ms`, `chunk_bytes` (the
  planner's Chunking: a transport and the caller's chunk bytes or None, per plan).
  `names()` returns the leaves' names for messages (formed only when a message needs
  them: that costs more than the checks).
  """

  leaves: Sequence[Any]
  treedef: Any
  dsts: Sequence[Any]
  srcs: Sequence[Any]
  out_dtypes: Sequence[Any]
  donate: Sequence[bool]
  route: str
  topology: Any
  timeout_ms: int
  chunk_bytes: Any  # planner.Chunking (checks._chunk_bytes)
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
        route=self.route, topology=self.topology, timeout_ms=self.timeout_ms,
        chunk_bytes=self.chunk_bytes,
        names=lambda: [names()[i] for i in index])
