"""The cost model: bytes per link, the data-movement bound and the time estimates.

Owns the traffic of a route (bytes per link class, per device and direction), the bound
no route can beat (`sol_ms`, the paper's Eqs. 3-9 generalized), a route's aggregate
estimate (its busiest link, start to end) and the estimate of its schedule step by step.
Reads transfers and chunks; builds neither.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Sequence

import numpy as np

from jax_m2n._src.layout import box_size, intersect
from jax_m2n._src.planner import chunking
from jax_m2n._src.planner.size import plan_size
from jax_m2n._src.planner.transfers import LINKS, Transfers
from jax_m2n._src.topology import Topology

# Tensors and plans arrive as plan.py's TensorPlan and Plan (which import this module):
# read by their attributes, not imported.
TensorPlan = Any


def _ms(nbytes: float, gbps: float) -> float:
  return nbytes / (gbps * 1e6)


# One side of a Traffic (egress or ingress): its devices in order of first appearance
# (n,), and their bytes (n, 2): over nvlink, over the network (int64, or Python ints
# where a sum could overflow).
Side = tuple[np.ndarray, np.ndarray]


class Traffic:
  """Bytes per link class, and per device egress/ingress per link class.

  Kept as arrays (`sides`: egress, ingress); `egress` and `ingress` are their dicts
  (device -> {"nvlink": bytes, "network": bytes}, devices in order of first
  appearance), made when read: a plan of 1,040 tensors over 256 devices merged 58,000
  of them per plan where arrays add in one pass.
  """

  def __init__(self, by_link: dict[str, int], egress: Side, ingress: Side):
    self.by_link = by_link
    self.sides = (egress, ingress)

  @functools.cached_property
  def egress(self) -> dict[int, dict[str, int]]:
    return _side_dict(self.sides[0])

  @functools.cached_property
  def ingress(self) -> dict[int, dict[str, int]]:
    return _side_dict(self.sides[1])

  @staticmethod
  def of(transfers: Transfers, itemsizes: Sequence[int], topo: Topology) -> "Traffic":
    """The traffic of one tensor's transfers (columns; exact integer sums)."""
    n = transfers.nbytes(itemsizes[transfers.tensor])
    src, dst = transfers.src, transfers.dst
    cross = src != dst
    by_link = {k: 0 for k in LINKS}
    by_link["local"] = int(n[~cross].sum())
    if not cross.any():
      return Traffic(by_link, _EMPTY_SIDE, _EMPTY_SIDE)
    n, src, dst = n[cross], src[cross], dst[cross]
    devices = np.unique(np.concatenate([src, dst]))
    domain = topo.domains_of(devices)
    s_at, d_at = np.searchsorted(devices, src), np.searchsorted(devices, dst)
    network = domain[s_at] != domain[d_at]
    for link, on in (("nvlink", ~network), ("network", network)):
      by_link[link] = int(n[on].sum())
    sides = []
    for at in (s_at, d_at):
      # Per device position, its bytes over nvlink then network, devices in order of
      # first appearance on this side (as a loop would add them).
      loads = np.zeros(2 * len(devices), n.dtype)
      np.add.at(loads, 2 * at + network, n)
      seen, first = np.unique(at, return_index=True)
      seen = seen[np.argsort(first, kind="stable")]
      sides.append((devices[seen], loads.reshape(-1, 2)[seen]))
    return Traffic(by_link, *sides)

  @staticmethod
  def merge(parts: "Sequence[Traffic]") -> "Traffic":
    """The sum of `parts`, devices in order of first appearance. The tensors of one
    route share one Traffic object: each distinct object is added once, times how often
    it appears (exact integer sums; the order of first appearance is the same)."""
    by_link = {k: 0 for k in LINKS}
    counts = collections.Counter(map(id, parts))
    distinct = list({id(p): p for p in parts}.values())
    for part in distinct:
      for k, v in part.by_link.items():
        by_link[k] += counts[id(part)] * v
    sides = []
    for s in range(2):
      pieces = [p.sides[s] for p in distinct]
      devices = np.concatenate([d for d, _ in pieces]) if pieces else _EMPTY_SIDE[0]
      if not len(devices):
        sides.append(_EMPTY_SIDE)
        continue
      # Python ints where a part is, or where the sums could overflow int64 (a part's
      # own total fits: Transfers.nbytes).
      object_sums = (any(l.dtype == object for _, l in pieces) or
                     sum(counts[id(p)] * int(l.sum()) for p, (_, l) in
                         zip(distinct, pieces)) >= 1 << 62)
      loads = np.concatenate([
          (l.astype(object) if object_sums else l) * counts[id(p)]
          for p, (_, l) in zip(distinct, pieces)])
      ids, first, inverse = np.unique(devices, return_index=True, return_inverse=True)
      total = np.zeros((len(ids), 2), loads.dtype)
      np.add.at(total, inverse.reshape(-1), loads)
      order = np.argsort(first, kind="stable")
      sides.append((ids[order], total[order]))
    return Traffic(by_link, *sides)

  def loads(self) -> np.ndarray:
    """(devices of egress, then of ingress, 2): each one's bytes over nvlink and over
    the network, in the sides' order."""
    return np.concatenate([loads for _, loads in self.sides])

  def link_ms(self, topo: Topology) -> np.ndarray:
    """`loads()` as milliseconds at the link classes' bandwidths (float64)."""
    return self.loads().astype(np.float64) / (
        np.array([topo.nvlink_gbps, topo.nic_gbps]) * 1e6)

  def time_ms(self, topo: Topology) -> float:
    """Max over devices and directions of bytes / bandwidth of the link class."""
    return float(self.link_ms(topo).max(initial=0.0))


def _side_dict(side: Side) -> dict[int, dict[str, int]]:
  devices, loads = side
  return {d: {"nvlink": nv, "network": net}
          for d, (nv, net) in zip(devices.tolist(), loads.tolist())}


_EMPTY_SIDE: Side = (np.zeros(0, np.int64), np.zeros((0, 2), np.int64))


def sol_ms(tensors: Sequence[TensorPlan]) -> float:
  """The data-movement bound: no route can be faster (bytes that must cross links).

  Per device and per domain, summed over tensors:
    * a destination device must take in the bytes of its box it does not hold itself;
    * a destination domain must take in over the network, at its devices' NICs, the
      bytes its devices need that no source in the domain holds;
    * a source replica group must send out, at its devices' links, one copy of each byte
      that a device outside the group needs (over the network if needed outside the
      group's domains).
  """
  total: dict[tuple[str, int], float] = {}
  for tp in tensors:
    for k, v in tp.bound_loads.items():
      total[k] = total.get(k, 0.0) + v
  return max(total.values(), default=0.0)


def _bound_loads(tp: TensorPlan) -> dict[tuple[str, int], float]:
  """One tensor's share of the bound: ms per (kind, device or domain)."""
  topo = tp.topology
  dev_in: dict[int, float] = {}
  dev_out: dict[int, float] = {}
  dom_in: dict[int, float] = {}
  fastest = max(topo.nvlink_gbps, topo.nic_gbps)
  src_shards = tp.src.shards()
  dst_devices = [t for _, ts in tp.dst.shards() for t in ts]
  for dbox, ts in tp.dst.shards():
    for t in ts:
      held = tp.src.box_of(t)
      own = intersect(held, dbox) if held is not None else None
      need = box_size(dbox) - (box_size(own) if own is not None else 0)
      dev_in[t] = dev_in.get(t, 0.0) + _ms(need * tp.itemsize, fastest)
  doms: dict[int, list[int]] = {}
  for t in dst_devices:
    doms.setdefault(topo.domain_of(t), []).append(t)
  for dom, ts in doms.items():
    local_boxes = [b for b, hs in src_shards
                   if any(topo.domain_of(h) == dom for h in hs)]
    needed = {tp.dst.box_of(t) for t in ts}
    remote = 0
    for dbox in needed:
      remote += box_size(dbox) - sum(
          box_size(i) for i in (intersect(b, dbox) for b in local_boxes) if i is not None)
    dom_in[dom] = dom_in.get(dom, 0.0) + _ms(
        remote * tp.itemsize / len(ts), topo.nic_gbps)
  for sbox, holders in src_shards:
    hold_doms = {topo.domain_of(h) for h in holders}
    any_out = net_out = 0
    for dbox, ts in tp.dst.shards():
      piece = intersect(sbox, dbox)
      if piece is None:
        continue
      if any(t not in holders for t in ts):
        any_out += box_size(piece)
      if any(topo.domain_of(t) not in hold_doms for t in ts):
        net_out += box_size(piece)
    share = max(_ms(any_out * tp.itemsize, fastest),
                _ms(net_out * tp.itemsize, topo.nic_gbps)) / len(holders)
    for h in holders:
      dev_out[h] = dev_out.get(h, 0.0) + share
  loads = {("in", d): v for d, v in dev_in.items()}
  loads.update({("out", d): v for d, v in dev_out.items()})
  loads.update({("domain", d): v for d, v in dom_in.items()})
  return loads



def step_ms(plan) -> float:
  """A plan's bytes as its schedule runs them: step by step, each step as long as its
  busiest device and direction (bytes / link bandwidth, as the aggregate
  `Traffic.time_ms`).

  The transports start a step's chunks when the previous step has ended (the CPU
  transport at a barrier of every device; the CUDA transport per device, one NCCL group
  per step), so a step whose load is uneven, and the steps that fill and drain a
  pipeline (the first chunk's forwarding hops, the last chunk's fan-out) cost more than
  the aggregate bound, which assumes every link busy from start to end. Equal to the
  aggregate for a one-step schedule; never below it. Builds the chunks.
  """
  return float(_per_step(plan)[0].sum())


# Above this many transfers or chunks (a lower bound from the layouts, `plan_size`) a
# plan's estimate is the chunking rule's model rather than its chunks step by step,
# unless the chunks exist already: chunking a DeepSeek-V3-sized refit (~600k transfers
# per stage) for the three routes' estimates takes minutes of Python (the planner
# bench's `bound_and_estimates`: 171 s against 3 s for the aggregates).
EXACT_ESTIMATE_TRANSFERS = 1 << 16
EXACT_ESTIMATE_CHUNKS = 1 << 15


def schedule_ms(plan) -> float:
  """The estimate of the schedule that will run: `step_ms` plus the transport's fixed
  costs (`plan.transport`): one call, every step, and per step the chunks of the device
  that runs the most of them (a device runs its chunks one after another), plus, on
  the emulated network, its latency once per step that crosses it.

  For a plan of more than EXACT_ESTIMATE_TRANSFERS transfers or EXACT_ESTIMATE_CHUNKS
  chunks whose chunks were not built,
  the chunking rule's model instead (`chunking.modelled_ms`: the aggregate stretched
  by the pipeline's fill and drain, plus the same fixed costs), never below the
  aggregate."""
  if "chunks" not in plan.__dict__:
    transfers = sum(len(tp.transfers) for tp in plan.tensors)
    if transfers > EXACT_ESTIMATE_TRANSFERS or plan_size(
        [tp.src for tp in plan.tensors], [tp.dst for tp in plan.tensors],
        plan.itemsizes, plan.route, plan.chunk_bytes).chunks > EXACT_ESTIMATE_CHUNKS:
      return max(chunking.modelled_ms(plan), plan.traffic.time_ms(plan.topology))
  transport = plan.transport
  longest, chunks_per_step, network_steps = _per_step(plan)
  latency = plan.topology.nic_latency_us if plan.topology.emulate_network else 0.0
  n_steps = len(longest)
  return float(longest.sum() + 1e-3 * (
      transport.call_us + n_steps * transport.step_us
      + chunks_per_step.sum() * transport.chunk_us + network_steps * latency))


def _per_step(plan) -> tuple[np.ndarray, np.ndarray, int]:
  """Per step: the busiest device and direction's ms, and the most chunks one device
  runs (its destination's); and how many steps cross the network."""
  chunks = plan.chunks
  n_steps = chunks.n_steps
  longest = np.zeros(n_steps, np.float64)
  if not len(chunks):
    return longest, np.zeros(0, np.int64), 0
  topo = plan.topology
  src = np.empty(len(chunks), np.int64)
  dst = np.empty(len(chunks), np.int64)
  ms = np.empty(len(chunks), np.float64)
  for t, (tp, part) in enumerate(zip(plan.tensors, chunks.parts)):
    mine = chunks.tensor == t
    k = chunks.index[mine]
    x = part.transfer[k]
    src[mine], dst[mine] = tp.transfers.src[x], tp.transfers.dst[x]
    ms[mine] = np.prod(part.hi[k] - part.lo[k], axis=1) * (tp.itemsize / 1e6)
  devices = np.unique(np.concatenate([src, dst]))
  n_dev = len(devices)
  d_all = np.searchsorted(devices, dst)
  step = chunks.step.astype(np.int64)  # (32 bits there) keys below pass 2**31
  keys, per_device = np.unique(step * n_dev + d_all, return_counts=True)
  chunks_per_step = np.zeros(n_steps, np.int64)
  np.maximum.at(chunks_per_step, keys // n_dev, per_device)
  cross = src != dst
  src, dst, ms, step = src[cross], dst[cross], ms[cross], step[cross]
  if not len(step):
    return longest, chunks_per_step, 0
  domain = topo.domains_of(devices)
  s_at, d_at = np.searchsorted(devices, src), np.searchsorted(devices, dst)
  network = domain[s_at] != domain[d_at]
  ms = ms / np.where(network, topo.nic_gbps, topo.nvlink_gbps)
  for at in (s_at, d_at):  # egress, ingress
    for on in (network, ~network):  # per link class
      key = (step[on] * n_dev + at[on]) if on.any() else np.zeros(0, np.int64)
      keys, inverse = np.unique(key, return_inverse=True)
      load = np.bincount(inverse.reshape(-1), weights=ms[on], minlength=len(keys))
      np.maximum.at(longest, keys // n_dev, load)
  return longest, chunks_per_step, len(np.unique(step[network]))
