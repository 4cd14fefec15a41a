"""A torch rank's plan: the publisher's layouts (from the manifest) -> this rank's boxes.

Owns `plan_rank`: reshard's own planner (`call_plan.plan_layouts`) with the publisher's
layouts as the source side (its plan ids, one domain per trainer process) and, as the
destination, this rank's box of each leaf it receives (one plan device: the rank), on
the flat route (a torch rank has no job of its own to forward inside). Its result is
what the jobs engine asks a publisher for (`packed_requests`, `wire`, `fingerprint`:
the same protocol as a JAX Subscriber's) and, per leaf, the boxes that land on this
rank. Cached per (manifest, targets, rank). Moves nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import numpy as np

from jax_m2n._src import call_plan, schedule
from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.jobs import manifest as manifest_lib
from jax_m2n._src.jobs.manifest import Manifest
from jax_m2n._src.jobs.planning import PUBLISHER_PROCESS_BASE
from jax_m2n._src.layout import Layout, box_size, intersect
from jax_m2n._src.planner import DST_SHARD
from jax_m2n._src.processes import transfer_engine
from jax_m2n._src.request import Options
from jax_m2n._src.topology import Topology
from jax_m2n._src.torch.targets import NUMPY_OF, Target


@dataclasses.dataclass(frozen=True, eq=False)
class RankPlan:
  """One torch rank's part of a pull (the fields the jobs engine reads are named as a
  `planning.PullPlan`'s).

  Attributes:
    targets: the resolved targets (targets.resolve).
    wire: per manifest leaf, the dtype its bytes cross in (the narrower of a float
      conversion: the publisher narrows, this rank widens).
    requests: per publisher process, the ops it sends this rank, one list per wave
      (op.tensor: the manifest's leaf index).
    boxes: per manifest leaf this rank receives, [(publisher device index, box)]: the
      pieces that tile this rank's box (what the local path copies).
    fingerprint: identifies the plan (the publisher keeps it registered by it).
    nbytes: the bytes this rank receives (wire dtype).
  """

  targets: tuple[Target, ...]
  wire: tuple[np.dtype, ...]
  requests: dict[int, list[list[transfer_engine.Op]]]
  boxes: dict[int, list[tuple[int, tuple]]]
  fingerprint: str
  nbytes: int

  def packs_of(self, ops: list[transfer_engine.Op]) -> list[list[transfer_engine.Op]]:
    """`ops` grouped by (source device, wire dtype), first-appearance order: one array
    each (the publisher cuts them so)."""
    packs: dict[tuple[int, object], list[transfer_engine.Op]] = {}
    for op in ops:
      packs.setdefault((op.src, self.wire[op.tensor]), []).append(op)
    return list(packs.values())

  @functools.cached_property
  def packed_requests(self) -> dict[int, list[list[list[transfer_engine.Op]]]]:
    return {k: [self.packs_of(ops) for ops in groups]
            for k, groups in self.requests.items()}


@functools.lru_cache(maxsize=64)
def plan_rank(api: str, m: Manifest, targets: tuple[Target, ...], rank: int,
              world: int) -> RankPlan:
  """The plan of pulling `targets` (this rank's parts of the manifest's leaves) from
  the publisher: reshard's planner, flat route, the publisher's layouts as the source.
  Every rank derives its own part alike (pure in its arguments)."""
  published = [manifest_lib.dtype_of(l.dtype) for l in m.leaves]
  wire = list(published)
  used, dst_layouts = [], []
  for target in targets:
    out = NUMPY_OF[target.dtype]
    for part in target.parts:
      if box_size(part.box) == 0:
        continue
      wire[part.leaf] = schedule.wire_dtype(published[part.leaf], out)
      used.append(part.leaf)
      dst_layouts.append(Layout(m.leaves[part.leaf].shape, (rank,), (part.box,)))
  process_of = {rank: rank}
  for k, p in enumerate(m.devices):
    process_of[manifest_lib.PUBLISHER_DEVICE_BASE + k] = PUBLISHER_PROCESS_BASE + p
  domains: dict[int, list[int]] = {}
  for device, p in sorted(process_of.items()):
    domains.setdefault(p, []).append(device)
  topology = Topology(domains=tuple(tuple(ds) for _, ds in sorted(domains.items())))
  src_layouts = [m.plan_layouts[t] for t in used]
  plan = call_plan.plan_layouts(src_layouts, dst_layouts,
                                [wire[t].itemsize for t in used], topology,
                                Options(route="flat"), "cpu", path="torch pull")
  boxes: dict[int, list[tuple[int, tuple]]] = {}
  for i, tp in enumerate(plan.tensors):
    t, mine, tr = used[i], dst_layouts[i].boxes[0], tp.transfers
    got = []
    for j in range(len(tr)):
      x = tr[j]
      if x.dst == rank and x.dst_kind == DST_SHARD:
        got.append((x.src - manifest_lib.PUBLISHER_DEVICE_BASE, tuple(x.box)))
    if sum(box_size(intersect(b, mine) or ()) for _, b in got) != box_size(mine):
      raise ReshardValueError(f"{api}: the plan must deliver each box of this rank "
                              f"exactly once; it does not for leaf {m.names()[t]}.")
    boxes[t] = got
  requests: dict[int, list[list[transfer_engine.Op]]] = {}
  nbytes = 0
  for wave in transfer_engine.waves_of(plan, rank, process_of):
    for peer, ops in sorted(wave.recvs.items()):
      ops = [dataclasses.replace(op, tensor=used[op.tensor]) for op in ops]
      nbytes += sum(box_size(op.box) * wire[op.tensor].itemsize for op in ops)
      requests.setdefault(peer - PUBLISHER_PROCESS_BASE, []).append(ops)
  fingerprint = hashlib.blake2b(repr((
      "torch rank", rank, world, m.id, used, [l.boxes for l in dst_layouts],
      [str(wire[t]) for t in used])).encode(), digest_size=16).hexdigest()
  return RankPlan(targets, tuple(wire), requests, boxes, fingerprint, nbytes)
