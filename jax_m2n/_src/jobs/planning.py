"""A pull's plan: the publisher's layouts (from the manifest) -> the subscriber's dst.

Owns `plan_pull`, the one function from a pull to its plan (through
`call_plan.plan_call`, reshard's: the publisher's layouts as the source side, its
devices under ids that cannot collide with the subscriber's, each job's processes its
domains), cached per
(manifest, dst shardings, dtypes, route): a second pull of the same shapes plans
nothing. Also this process's part of the plan: its waves, and per publisher process the
pieces to ask it for. Moves nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import call_plan
from jax_m2n._src import collector
from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.jobs import manifest as manifest_lib
from jax_m2n._src.jobs.manifest import PUBLISHER_DEVICE_BASE, Manifest
from jax_m2n._src.planner import Plan
from jax_m2n._src.processes import sequence, transfer_engine
from jax_m2n._src.request import Options
from jax_m2n._src.topology import Topology

# The publisher's processes in the plan's device -> process map (the subscriber job's
# own processes keep their indices, 0, 1, ...).
PUBLISHER_PROCESS_BASE = 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class PullPlan:
  """One pull's plan and this process's part of it.

  Attributes:
    plan: the planner's plan (tensor t is leaf t of the manifest).
    published, wire, out: per leaf, the published dtype, the dtype on the wire and the
      dtype delivered.
    dsts: per leaf, its destination sharding.
    process_of: plan device id -> process (publisher processes offset by
      PUBLISHER_PROCESS_BASE).
    participants: the subscriber job's processes that hold a destination device.
    waves: this process's waves (transfer_engine.waves_of).
    requests: per publisher process (its index), the ops it sends to this process,
      one list per wave in wave order: one transfer-server pull each.
    fingerprint: equal on every process of the subscriber job that plans alike.
    avals: per leaf, the abstract value of the result of an earlier pull of this plan
      (jax_compat.reusable_aval), filled by the first: later results skip JAX's
      checks of the shards they are made of.
  """

  plan: Plan
  published: tuple[np.dtype, ...]
  wire: tuple[np.dtype, ...]
  out: tuple[np.dtype, ...]
  dsts: tuple[Sharding, ...]
  process_of: dict[int, int]
  participants: tuple[int, ...]
  waves: tuple[transfer_engine.Wave, ...]
  requests: dict[int, list[list[transfer_engine.Op]]]
  fingerprint: str
  avals: list[Any] = dataclasses.field(default_factory=list)

  @functools.cached_property
  def local_dst(self) -> list[list[Any]]:
    """Per leaf, this process's destination devices in addressable order."""
    return [list(jax_compat.addressable_device_assignment(d)) for d in self.dsts]

  def packs_of(self, ops: list[transfer_engine.Op]) -> list[list[transfer_engine.Op]]:
    """`ops` (one wave from one publisher process) grouped by (source device,
    destination device, wire dtype), in first-appearance order: one array each."""
    packs: dict[tuple[int, int, Any], list[transfer_engine.Op]] = {}
    for op in ops:
      packs.setdefault((op.src, op.dst, self.wire[op.tensor]), []).append(op)
    return list(packs.values())

  @functools.cached_property
  def packed_requests(self) -> dict[int, list[list[list[transfer_engine.Op]]]]:
    """`requests` with each wave's ops grouped into packs (`packs_of`)."""
    return {k: [self.packs_of(ops) for ops in groups]
            for k, groups in self.requests.items()}


@functools.lru_cache(maxsize=64)
def plan_pull(manifest: Manifest, dsts: tuple[Sharding, ...], outs: tuple[np.dtype, ...],
              route: str) -> PullPlan:
  """The plan of pulling every leaf of `manifest` into `dsts` as `outs`, by `route`:
  `call_plan.plan_call`, reshard's own, with the publisher's layouts as the source side
  (its devices under plan ids of their own) and one domain per process of either job.

  Every process of the subscriber job derives the same plan (pure, from the manifest
  and the global dst shardings).
  """
  with collector.paused():  # layouts, routes, chunks and ops per leaf: no cycles
    return _plan_pull(manifest, dsts, outs, route)


def _plan_pull(manifest: Manifest, dsts: tuple[Sharding, ...], outs: tuple[np.dtype, ...],
               route: str) -> PullPlan:
  """plan_pull's work."""
  me = jax.process_index()
  # Per leaf, but once per distinct value: a model's leaves share a few dtypes.
  names = [l.dtype for l in manifest.leaves]
  by_name = {n: manifest_lib.dtype_of(n) for n in dict.fromkeys(names)}
  published = [by_name[n] for n in names]
  # What leaves the publisher: the published dtype where the copies convert in flight,
  # else the delivered one (the publisher converts first), as reshard's sources.
  pairs = list(zip(published, outs))
  by_pair = {p: schedule.source_dtype(*p) for p in dict.fromkeys(pairs)}
  sources = [by_pair[p] for p in pairs]
  process_of = {d.id: d.process_index for d in jax.devices()}
  for k, p in enumerate(manifest.devices):
    process_of[PUBLISHER_DEVICE_BASE + k] = PUBLISHER_PROCESS_BASE + p
  domains: dict[int, list[int]] = {}
  for device, p in sorted(process_of.items()):
    domains.setdefault(p, []).append(device)
  topology = Topology(domains=tuple(tuple(ds) for _, ds in sorted(domains.items())))
  call = call_plan.plan_call(
      [l.shape for l in manifest.leaves], sources, None, dsts, Options(route=route),
      outs, path="jobs pull", src_layouts=manifest.plan_layouts, topology=topology,
      chunking_for="cpu")
  plan, wire = call.plan, tuple(call.wire_dtypes)
  distinct = {id(l): l for l in call.dst_layouts}.values()  # (leaves share layouts)
  participants = tuple(sorted({process_of[d] for l in distinct for d in l.devices}))
  waves = tuple(transfer_engine.waves_of(plan, me, process_of)) if me in participants else ()
  requests: dict[int, list[list[transfer_engine.Op]]] = {}
  for wave in waves:
    for peer, ops in sorted(wave.recvs.items()):
      if peer >= PUBLISHER_PROCESS_BASE:
        requests.setdefault(peer - PUBLISHER_PROCESS_BASE, []).append(ops)
  fingerprint = sequence.fingerprint({
      "pytree structure": [l.path for l in manifest.leaves],
      "shapes": [l.shape for l in manifest.leaves],
      "dtypes": [l.dtype for l in manifest.leaves],
      "destination dtypes": sequence.distinct(outs, str),
      "source shardings": manifest.id,
      "destination shardings": sequence.distinct(call.dst_layouts,
                                                 lambda l: tuple(l.shards())),
      "route": route, "topology": repr(topology), "chunk_bytes": None})
  delivered = {o: np.dtype(o) for o in dict.fromkeys(outs)}
  return PullPlan(plan, tuple(published), wire, tuple(delivered[o] for o in outs), dsts,
                  process_of, participants, waves, requests, fingerprint)


def network_bytes(pp: PullPlan) -> dict[str, int]:
  """The plan's bytes out of the publisher's job and between the subscriber's
  processes (the 'each byte leaves the trainer once per subscriber job' check)."""
  out = {"from_publisher": 0, "inside_subscriber_job": 0}
  for tp in pp.plan.tensors:
    tr = tp.transfers
    for s, d, n in zip(tr.src.tolist(), tr.dst.tolist(),
                       np.asarray(tr.nbytes(tp.itemsize)).tolist()):
      ps, pd = pp.process_of[s], pp.process_of[d]
      if ps >= PUBLISHER_PROCESS_BASE and pd < PUBLISHER_PROCESS_BASE:
        out["from_publisher"] += n
      elif ps != pd:
        out["inside_subscriber_job"] += n
  return out


def check_devices(api: str, dsts: Sequence[Sharding]) -> None:
  """The subscriber's devices must have ids below the publisher's plan ids."""
  for d in {id(d): d for d in dsts}.values():  # (leaves mostly share a sharding)
    for dev in d.device_set:
      if dev.id >= PUBLISHER_DEVICE_BASE:
        raise ReshardValueError(
            f"{api}: destination device ids must be below {PUBLISHER_DEVICE_BASE} (the "
            f"publisher's devices are planned above it); got device {dev.id}.")
