"""The planner: from two layouts and a topology to the exact transfers of a route.

Owns the decisions of what moves where: pieces (src box ∩ dst box), one owner per piece,
leaders per destination shard and domain, ring forwarding between domains, local fan-out,
the two baseline routes, the byte accounting and the cost model (the paper's Eqs. 3-9,
generalized). Pure and deterministic: every rank derives the same plan; never touches
devices, buffers or JAX runtime state. Chunks and steps are derived lazily (`Plan.chunks`)
by `jax_m2n._src.chunks`, only when a schedule is needed.
"""

from __future__ import annotations

import bisect
import collections.abc
import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import math
import operator
from typing import NamedTuple, Sequence

import numpy as np

from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.layout import Box, Layout, box_size, full_box, intersect
from jax_m2n._src.topology import Topology

ROUTES = ("hierarchical", "flat", "gather_bcast")
STAGES = ("local", "inject", "forward", "fanout", "gather", "bcast")
LINKS = ("local", "nvlink", "network")

# Buffer kinds a transfer reads from / writes to (same codes as docs/schedule_format.md).
SRC_SHARD, DST_SHARD, FULL_TMP = 0, 1, 2

DEFAULT_CHUNK_BYTES = 16 << 20

# Bounds on one plan, checked from the layouts alone before any route is built
# (`check_plan_size`). A transfer costs ~0.2 us and ~25-50 bytes to plan (columns), but
# ~1 us and ~0.3 KB once chunked and encoded (per transfer in Python): 8M transfers are
# seconds and a few GB of schedule, beyond which a plan is refused rather than left to
# run for minutes into a MemoryError (a 100,000-way replication would be 10**10
# transfers). A DeepSeek-V3-sized refit over 4,096 devices is ~3M per stage.
MAX_PLAN_TRANSFERS = 1 << 23
MAX_PLAN_CHUNKS = 1 << 24

logger = logging.getLogger("jax_m2n")


class Transfer(NamedTuple):
  """One region moved from one device to another (or copied on one device).

  `box` is in global coordinates. `src_kind`/`dst_kind` say which buffer of the device is
  read/written: its source shard (0), its destination shard (1) or a full-tensor
  workspace buffer (2, gather_bcast only). `parents` are the indices (in the same
  tensor's transfer list) of the transfers that deliver what this one reads; `depth` is
  the longest chain of parents.
  """

  tensor: int
  src: int
  dst: int
  stage: str
  box: Box
  src_kind: int
  dst_kind: int
  parents: tuple[int, ...]
  depth: int


STAGE_CODES = {s: i for i, s in enumerate(STAGES)}
_LOCAL, _INJECT, _FORWARD, _FANOUT, _GATHER, _BCAST = range(len(STAGES))


class Transfers(collections.abc.Sequence):
  """The transfers of one route as columns: one row per transfer, in plan order.

  Memory is linear in the transfers (~23 bytes each) plus one entry per distinct box:
  a route's fan-out repeats one box to every replica of a domain, and millions of
  per-transfer Python objects cost more to build than to plan. Indexing and iteration
  give `Transfer` records (built on access); the columns are what the accounting, the
  chunker and the encoder read.

  Columns (numpy, read-only): `src`, `dst` (int32 device ids), `stage` (int8 index into
  STAGES), `src_kind`, `dst_kind` (int8 buffer kinds), `box` (int32 index into
  `boxes`), `parent` (int32 first parent, -1 for none), `depth` (int32). `extra_parents`
  maps the few transfers with more than one parent (gather_bcast) to all of them.
  `tensor` is the tensor index every record carries.
  """


  def __init__(self, tensor, src, dst, stage, src_kind, dst_kind, box, boxes, parent,
               extra_parents, depth):
    self.tensor = tensor
    self.src, self.dst, self.stage = src, dst, stage
    self.src_kind, self.dst_kind, self.box = src_kind, dst_kind, box
    self.boxes, self.parent, self.extra_parents, self.depth = (
        boxes, parent, extra_parents, depth)
    for a in (src, dst, stage, src_kind, dst_kind, box, parent, depth):
      a.flags.writeable = False

  @staticmethod
  def empty() -> "Transfers":
    z = np.zeros(0, np.int32)
    return Transfers(0, z, z.copy(), z.astype(np.int8), z.astype(np.int8),
                     z.astype(np.int8), z.copy(), (), z.copy(), {}, z.copy())

  def with_tensor(self, tensor: int) -> "Transfers":
    """The same transfers carrying tensor index `tensor` (columns shared)."""
    return Transfers(tensor, self.src, self.dst, self.stage, self.src_kind, self.dst_kind,
                     self.box, self.boxes, self.parent, self.extra_parents, self.depth)

  def __len__(self) -> int:
    return len(self.src)

  def _parents(self, i: int, p: int) -> tuple[int, ...]:
    if p < 0:
      return ()
    return self.extra_parents.get(i) or (p,)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return list(self._records(*i.indices(len(self))))
    n = len(self)
    i = operator.index(i)
    if i < 0:
      i += n
    if not 0 <= i < n:
      raise IndexError(i)
    return next(self._records(i, i + 1, 1))

  def __iter__(self):
    n = len(self)
    for start in range(0, n, 1 << 16):
      yield from self._records(start, min(n, start + (1 << 16)), 1)

  def _records(self, start: int, stop: int, step: int):
    sl = slice(start, stop, step)
    new, boxes, stages, tensor = tuple.__new__, self.boxes, STAGES, self.tensor
    extra = self.extra_parents
    for i, s, t, g, b, sk, dk, p, d in zip(
        range(start, stop, step), self.src[sl].tolist(), self.dst[sl].tolist(),
        self.stage[sl].tolist(), self.box[sl].tolist(), self.src_kind[sl].tolist(),
        self.dst_kind[sl].tolist(), self.parent[sl].tolist(), self.depth[sl].tolist()):
      parents = () if p < 0 else (extra.get(i) or (p,)) if extra else (p,)
      yield new(Transfer, (tensor, s, t, stages[g], boxes[b], sk, dk, parents, d))

  def __eq__(self, other):
    if not isinstance(other, Transfers):
      return NotImplemented
    return (self.tensor == other.tensor and len(self) == len(other)
            and all(np.array_equal(getattr(self, c), getattr(other, c))
                    for c in ("src", "dst", "stage", "src_kind", "dst_kind", "parent",
                              "depth"))
            and np.array_equal(self.box, other.box)
            and self.extra_parents == other.extra_parents
            and tuple(self.boxes) == tuple(other.boxes))

  def __hash__(self) -> int:
    return hash((self.tensor, len(self)))

  def __repr__(self) -> str:
    return f"Transfers({len(self)} transfers, {len(self.boxes)} distinct boxes)"

  @functools.cached_property
  def box_elements(self) -> np.ndarray:
    """Elements of each distinct box (int64, or Python ints past int64)."""
    sizes = [box_size(b) for b in self.boxes]
    if sizes and max(sizes) >= 1 << 62:
      return np.array(sizes, object)
    return np.array(sizes, np.int64)

  def nbytes(self, itemsize: int) -> np.ndarray:
    """Bytes of every transfer: int64, or Python ints where their sum could overflow."""
    elems = self.box_elements
    if elems.dtype == object or (
        len(elems) and int(elems.max()) * itemsize * max(len(self), 1) >= 1 << 62):
      return elems.astype(object)[self.box] * itemsize
    return elems[self.box] * itemsize

  def stage_counts(self) -> dict[str, int]:
    counts = np.bincount(self.stage, minlength=len(STAGES)).tolist()
    return {s: c for s, c in zip(STAGES, counts) if c}



@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """The route of one tensor (cached and shared between plans)."""

  src: Layout
  dst: Layout
  itemsize: int
  topology: Topology
  transfers: Transfers  # tensor index 0; re-indexed by Plan

  @property
  def nbytes(self) -> int:
    return math.prod(self.src.shape) * self.itemsize

  @functools.cached_property
  def traffic(self) -> "Traffic":
    return Traffic.of(self.transfers, (self.itemsize,), self.topology)

  @functools.cached_property
  def bound_loads(self) -> "dict[tuple[str, int], float]":
    return _bound_loads(self)


@functools.lru_cache(maxsize=256)
def _shards(layout: Layout) -> tuple[tuple[Box, tuple[int, ...]], ...]:
  """`layout.shards()`, once per distinct layout: the size check and the route both need
  it, and a model's tensors repeat a few layouts (~3 ms each over 4,096 devices)."""
  return tuple(layout.shards())


def _check_pair(src: Layout, dst: Layout, where: str) -> None:
  if src.shape != dst.shape:
    raise ReshardValueError(
        f"{where}: source and destination must have the same global shape; got "
        f"{src.shape} and {dst.shape}.")


class _Balance:
  """Least-loaded choice among candidates (ties broken by order): load balancing."""

  def __init__(self):
    self.load: dict[int, int] = {}

  def pick(self, candidates: Sequence[int], nbytes: int) -> int:
    load = self.load
    best, least = candidates[0], load.get(candidates[0], 0)
    for d in candidates:  # the first of the least loaded
      n = load.get(d, 0)
      if n < least:
        best, least = d, n
    load[best] = least + nbytes
    return best


def _split_dim(box: Box) -> int | None:
  for d, (lo, hi) in enumerate(box):
    if hi - lo > 1:
      return d
  return None


def _split_for_leaders(regions: Sequence[Box], itemsize: int,
                       rho: int) -> list[tuple[Box, int, int]]:
  """Spreads regions over `rho` leaders so that led bytes are (nearly) equal.

  Returns (sub-region, leader position in [0, rho), index of the region it came from). Regions are cut into
  slabs along their outermost dim of extent > 1, at row granularity, only where a
  leader's share ends inside a region. With equal regions and q a multiple of the leader
  count this is exactly the paper's a_j / b_j rule; with fewer regions than leaders (one
  source feeding three replicas) every replica still leads an equal share.
  """
  if rho == 1:
    return [(r, 0, i) for i, r in enumerate(regions)]
  sizes = [box_size(r) * itemsize for r in regions]
  total = sum(sizes)
  ends = [((k + 1) * total + rho // 2) // rho for k in range(rho)]  # leader k's share ends

  def leader_at(position: float) -> int:  # the first leader whose share ends after it
    return min(bisect.bisect_right(ends, position), rho - 1)

  out = []
  pos = 0
  for i, (region, size) in enumerate(zip(regions, sizes)):
    k = bisect.bisect_right(ends, pos, 0, rho - 1)  # first share end after pos
    if k == rho - 1 or ends[k] >= pos + size or size == 0:
      # No share ends inside the region: one leader takes it whole (the common case).
      out.append((region, leader_at(pos + size / 2), i))
      pos += size
      continue
    d = _split_dim(region)
    if d is None:
      out.append((region, leader_at(pos + size / 2), i))
      pos += size
      continue
    lo, hi = region[d]
    rows = hi - lo
    row_bytes = size // rows
    cuts = {0, rows}
    for e in ends[:-1]:
      if pos < e < pos + size:
        cuts.add(min(rows, max(0, round((e - pos) / row_bytes))))
    cuts = sorted(cuts)
    for a, b in zip(cuts, cuts[1:]):
      sub = region[:d] + ((lo + a, lo + b),) + region[d + 1:]
      out.append((sub, leader_at(pos + (a + b) / 2 * row_bytes), i))
    pos += size
  return out


class _Rows:
  """Transfers under construction: one tuple per transfer (src, dst, stage code, box id,
  src kind, dst kind, first parent or -1, depth); boxes interned to ids."""

  def __init__(self):
    self.rows: list[tuple[int, ...]] = []
    self.boxes: list[Box] = []
    self.box_ids: dict[Box, int] = {}
    self.extra_parents: dict[int, tuple[int, ...]] = {}

  def box_id(self, box: Box) -> int:
    b = self.box_ids.get(box)
    if b is None:
      b = self.box_ids[box] = len(self.boxes)
      self.boxes.append(box)
    return b

  def add(self, s: int, t: int, stage: int, box: Box, skind: int, dkind: int,
          parents: Sequence[int] = (), depth: int = 0) -> int:
    i = len(self.rows)
    if len(parents) > 1:
      self.extra_parents[i] = tuple(parents)
    self.rows.append((s, t, stage, self.box_id(box), skind, dkind,
                      parents[0] if parents else -1, depth))
    return i

  def columns(self) -> np.ndarray:
    """(n, 8) int64, one row per transfer."""
    n = len(self.rows)
    return np.fromiter(itertools.chain.from_iterable(self.rows), np.int64,
                       8 * n).reshape(n, 8)


def _transfers(cols: np.ndarray, boxes, extra_parents) -> Transfers:
  return Transfers(
      0, cols[:, 0].astype(np.int32), cols[:, 1].astype(np.int32),
      cols[:, 2].astype(np.int8), cols[:, 4].astype(np.int8), cols[:, 5].astype(np.int8),
      cols[:, 3].astype(np.int32), tuple(boxes), cols[:, 6].astype(_index(len(cols))),
      extra_parents, cols[:, 7].astype(np.int32))


def _index(n: int):
  """The integer type for indices below n."""
  return np.int32 if n < 1 << 31 else np.int64


def _route_tensor(src: Layout, dst: Layout, itemsize: int, topo: Topology,
                  route: str) -> Transfers:
  out = _Rows()
  add = out.add
  src_shards = _shards(src)
  dst_shards = _shards(dst)
  if not dst_shards:
    return Transfers.empty()
  owners = _Balance()
  domains: dict[int, int] = {}

  def domain_of(device: int) -> int:  # one topology lookup per device
    d = domains.get(device)
    if d is None:
      d = domains[device] = topo.domain_of(device)
    return d

  holder_sets = {holders: frozenset(holders) for _, holders in src_shards}
  # holders -> domain -> the holders in that domain, in holder order.
  holders_in: dict[tuple[int, ...], dict[int, list[int]]] = {}
  for _, holders in src_shards:
    by_dom = holders_in.setdefault(holders, {})
    for h in holders:
      by_dom.setdefault(domain_of(h), []).append(h)
  source_domains = {dom for by_dom in holders_in.values() for dom in by_dom}

  if route == "gather_bcast":
    # Legacy refit: gather the whole tensor on the first source device, then broadcast
    # the whole tensor along a chain through every destination device (a ring
    # broadcast, as NCCL's), and let each destination keep its box.
    root = src.devices[0]
    gathered = []
    for box, holders in src_shards:
      owner = root if root in holders else owners.pick(holders, box_size(box) * itemsize)
      gathered.append(add(owner, root, _GATHER, box, SRC_SHARD, FULL_TMP))
    whole = full_box(src.shape)
    chain = sorted({t for _, ts in dst_shards for t in ts} - {root},
                   key=lambda t: (topo.domain_of(t) != topo.domain_of(root),
                                  topo.domain_of(t), t))
    arrival = {root: (tuple(gathered), 1)}
    prev = root
    for t in chain:
      parents, depth = arrival[prev]
      arrival[t] = ((add(prev, t, _BCAST, whole, FULL_TMP, FULL_TMP, parents, depth),),
                    depth + 1)
      prev = t
    for box, ts in dst_shards:
      for t in ts:
        parents, depth = arrival[t]
        add(t, t, _LOCAL, box, FULL_TMP, DST_SHARD, parents, depth)
    return _transfers(out.columns(), out.boxes, out.extra_parents)

  # Fan-out is built for the whole tensor at once, as arrays, after the routing loop:
  # per destination shard (segment), the transfers that arrive at a leader ("arrivals":
  # index, source shard of the region, group of candidate receivers), in fan-out order.
  shard_index = {}  # source device -> index of the source shard it holds
  for k, (_, holders) in enumerate(src_shards):
    for h in holders:
      shard_index[h] = k
  arr_x: list[int] = []
  arr_shard: list[int] = []
  arr_group: list[int] = []
  groups: list[Sequence[int]] = []  # candidate receivers of a fan-out, in order
  seg_rows: list[int] = []  # per destination shard: transfers routed up to its end
  seg_arrivals: list[int] = []  # per destination shard: arrivals up to its end
  rows = out.rows

  for dbox, replicas in dst_shards:
    # Contributions: (region, holders) ordered by source shard.
    contributions = []
    cshard = []
    for k, (sbox, holders) in enumerate(src_shards):
      region = intersect(sbox, dbox)
      if region is not None:
        contributions.append((region, holders))
        cshard.append(k)
    by_domain: dict[int, list[int]] = {}
    for t in replicas:
      by_domain.setdefault(domain_of(t), []).append(t)

    if route == "flat":
      for region, holders in contributions:
        nbytes = box_size(region) * itemsize
        for t in replicas:
          if t in holders:
            add(t, t, _LOCAL, region, SRC_SHARD, DST_SHARD)
          else:
            local = [h for h in holders if domain_of(h) == domain_of(t)]
            add(owners.pick(local or holders, nbytes), t, _INJECT, region,
                SRC_SHARD, DST_SHARD)
      continue

    # Hierarchical. Per domain: regions a replica holds itself are local copies and
    # that replica leads them; regions some source in the domain holds are injected over
    # NVLink; the rest must cross the network: once, into the first domain of a ring,
    # then forwarded leader to leader.
    own_group: dict[int, int] = {}  # local copy -> group of the replicas it serves
    # contribution index -> domain -> positions in led[domain] of its slabs there (the
    # ring); indexed, not searched: a 1,000-way replicated shard has 125 domains x 1,000
    # contributions.
    network_regions: dict[int, dict[int, list[int]]] = {}
    # domain -> (box, leader, transfer(s), contribution index)
    led: dict[int, list[tuple[Box, int, int | list[int], int]]] = {}
    # The split of the same remote contributions over the same number of leaders is the
    # same in every domain (most domains of a wide replication): computed once.
    splits: dict[tuple[tuple[int, ...], int], list[tuple[Box, int, int]]] = {}
    slabs_of: dict[tuple[tuple[int, ...], int], dict[int, list[int]]] = {}
    hsets = [holder_sets[holders] for _, holders in contributions]
    every = list(range(len(contributions)))
    for dom, reps in by_domain.items():
      entries = led[dom] = []
      has_sources = dom in source_domains
      if not has_sources:  # every contribution comes over the network (most domains)
        remote = every
      else:
        remote = []  # contribution indices this domain must receive from a device
      rep_set = frozenset(reps)
      for ci, hset in enumerate(hsets if has_sources else ()):
        if rep_set.isdisjoint(hset):  # the common case: no replica holds it
          remote.append(ci)
          continue
        region = contributions[ci][0]
        own = [t for t in reps if t in hset]
        # Replicas that hold the region copy it locally; the others get it from one of
        # them, spread round-robin (with one holder, all of the others: the domain's
        # group, filtered like any fan-out).
        others = [t for t in reps if t not in hset]
        for k, t in enumerate(own):
          x = add(t, t, _LOCAL, region, SRC_SHARD, DST_SHARD)
          if len(own) > 1:
            own_group[x] = len(groups)
            groups.append(others[k::len(own)])
          entries.append((region, t, x, ci))
        if not own:
          remote.append(ci)
      if not remote:
        continue
      key = (tuple(remote), len(reps))
      split = splits.get(key)
      if split is None:
        split = splits[key] = _split_for_leaders(
            [contributions[ci][0] for ci in remote], itemsize, len(reps))
      if not has_sources:
        # Every slab comes over the network (remote is every contribution): the
        # domain's entries, and per contribution the positions of its slabs (shared by
        # the domains of this split; read only).
        entries.extend([(sub, reps[position], -1 - k, k) for sub, position, k in split])
        slabs = slabs_of.get(key)
        if slabs is None:
          slabs = slabs_of[key] = {}
          for j, (_, _, k) in enumerate(split):
            slabs.setdefault(k, []).append(j)
        for ci, js in slabs.items():
          per_domain = network_regions.get(ci)
          if per_domain is None:
            per_domain = network_regions[ci] = {}
          per_domain[dom] = js
        continue
      for sub, position, k in split:
        ci = remote[k]
        leader = reps[position]
        local = holders_in[contributions[ci][1]].get(dom) if has_sources else None
        if local:
          entries.append((sub, leader, add(owners.pick(local, box_size(sub) * itemsize),
                                           leader, _INJECT, sub, SRC_SHARD, DST_SHARD),
                          ci))
        else:
          per_domain = network_regions.get(ci)
          if per_domain is None:
            per_domain = network_regions[ci] = {}
          slots = per_domain.get(dom)
          if slots is None:
            slots = per_domain[dom] = []
          slots.append(len(entries))
          entries.append((sub, leader, -1 - ci, ci))  # filled in by the ring below

    # Ring: each network-bound contribution enters the ring at the domain after its
    # owner's, then moves leader to leader; a later domain's slab may straddle two slabs
    # of the previous domain, so forwarding intersects them.
    box_id, append = out.box_id, rows.append
    several = False  # whether an entry arrived in several pieces (a list of transfers)
    for ci, doms in network_regions.items():
      region, holders = contributions[ci]
      owner = owners.pick(holders, box_size(region) * itemsize)
      home = domain_of(owner)
      ring = sorted(doms)
      if ring[-1] < 1 << 30 and 0 <= home < 1 << 30:  # the domains after home, then the rest
        cut = bisect.bisect_right(ring, home)
        ring = ring[cut:] + ring[:cut]
      else:
        ring.sort(key=lambda dm: ((dm - home - 1) % (1 << 30), dm))
      previous = None  # (box, box id, leader, transfer, depth) arrived in the previous domain
      for dom in ring:
        entries = led[dom]
        slots = doms[dom]
        if previous is not None and len(previous) == 1 and len(slots) == 1:
          i = slots[0]
          sub, leader = entries[i][:2]
          pbox, pb, pleader, px, pdepth = previous[0]
          if pbox == sub:  # one slab here and before, the same: one forward (most rings)
            x = len(rows)
            append((pleader, leader, _FORWARD, pb, DST_SHARD, DST_SHARD, px, pdepth + 1))
            entries[i] = (sub, leader, x, ci)
            previous = [(sub, pb, leader, x, pdepth + 1)]
            continue
        arrived = []
        for i in slots:
          sub, leader = entries[i][:2]
          if previous is None:
            x = len(rows)
            b = box_id(sub)
            append((owner, leader, _INJECT, b, SRC_SHARD, DST_SHARD, -1, 0))
            arrived.append((sub, b, leader, x, 0))
            entries[i] = (sub, leader, x, ci)
            continue
          parts = []
          for pbox, pb, pleader, px, pdepth in previous:
            if pbox == sub:
              piece, b = sub, pb
            else:
              piece = intersect(pbox, sub)
              if piece is None:
                continue
              b = box_id(piece)
            x = len(rows)
            append((pleader, leader, _FORWARD, b, DST_SHARD, DST_SHARD, px, pdepth + 1))
            parts.append(x)
            arrived.append((piece, b, leader, x, pdepth + 1))
          if len(parts) == 1:
            entries[i] = (sub, leader, parts[0], ci)
          else:
            entries[i] = (sub, leader, parts, ci)
            several = True
        previous = arrived

    # Fan-out inside each domain (built below): every leader copies what it leads to
    # the other replicas of the shard there, skipping replicas that hold the region.
    for dom, reps in by_domain.items():
      g = len(groups)
      groups.append(reps)
      entries = led[dom]
      if not several and not own_group:  # one transfer per entry, the domain's group
        arr_x.extend([e[2] for e in entries])
        arr_shard.extend([cshard[e[3]] for e in entries])
        arr_group.extend([g] * len(entries))
        continue
      for _, _, x, ci in entries:
        shard = cshard[ci]
        if type(x) is int:
          arr_x.append(x)
          arr_shard.append(shard)
          arr_group.append(own_group.get(x, g))
        else:
          for xi in x:
            arr_x.append(xi)
            arr_shard.append(shard)
            arr_group.append(g)
    seg_rows.append(len(rows))
    seg_arrivals.append(len(arr_x))

  cols = out.columns()
  if not arr_x:
    return _transfers(cols, out.boxes, out.extra_parents)
  return _with_fanout(cols, out.boxes, out.extra_parents, arr_x, arr_shard, arr_group,
                      groups, shard_index, seg_rows, seg_arrivals)


def _with_fanout(cols, boxes, extra_parents, arr_x, arr_shard, arr_group, groups,
                 shard_index, seg_rows, seg_arrivals) -> Transfers:
  """The routed transfers `cols` with the fan-out of every arrival placed after its
  destination shard's transfers, as the route orders them.

  Arrival a (transfer arr_x[a] into its leader) is copied to every device of
  groups[arr_group[a]], in order, except the leader and devices that hold source shard
  arr_shard[a] themselves. A copy reads the leader's destination shard one step after
  the arrival, or its source shard at once when the arrival is the leader's own local
  copy from its source shard. Arrays throughout: this is most of a wide replication's
  transfers (4,032 of the 4,096 per region of a 64-device domain).
  """
  ax = np.array(arr_x, np.int64)
  ashard = np.array(arr_shard, np.int32)
  agroup = np.array(arr_group, np.int64)
  glen = np.array([len(g) for g in groups], np.int64)
  goff = np.cumsum(glen) - glen
  gflat = np.fromiter(itertools.chain.from_iterable(groups), np.int64, int(glen.sum()))
  gshard = np.array([shard_index.get(t, -1) for t in gflat.tolist()], np.int32)
  gflat = gflat.astype(np.int32)
  # Every (arrival, candidate) pair, arrival-major; then the ones that receive.
  n_cand = glen[agroup]
  index = _index(int(n_cand.sum()) + len(gflat))
  arrival = np.repeat(np.arange(len(ax), dtype=index), n_cand)
  at = np.arange(len(arrival), dtype=index)
  at += np.repeat((goff[agroup] - (np.cumsum(n_cand) - n_cand)).astype(index), n_cand)
  leader = cols[ax, 1].astype(np.int32)
  keep = gflat[at] != leader[arrival]
  keep &= gshard[at] != ashard[arrival]
  fa = arrival[keep]
  fdst = gflat[at[keep]]
  del arrival, at, keep
  # Positions: each destination shard's (segment's) routed transfers, then its fan-out.
  n_seg = len(seg_rows)
  seg_rows = np.array(seg_rows, np.int64)
  seg_arr = np.array(seg_arrivals, np.int64)
  fans_upto = np.concatenate([[0], np.cumsum(np.bincount(fa, minlength=len(ax)))])
  fan_before = np.concatenate([[0], fans_upto[seg_arr[:-1]]])  # fan-outs of earlier segs
  rows_seg = np.repeat(np.arange(n_seg), np.diff(seg_rows, prepend=0))
  row_pos = np.arange(len(cols), dtype=np.int64) + fan_before[rows_seg]
  arr_seg = np.repeat(np.arange(n_seg), np.diff(seg_arr, prepend=0))
  n = len(cols) + len(fa)
  fan_pos = np.arange(len(fa), dtype=np.int64)
  fan_pos += np.repeat(seg_rows[arr_seg], np.bincount(fa, minlength=len(ax)))
  wide = _index(n)
  # Per arrival: what its copies read (the leader's source shard or its destination).
  xs = cols[ax]
  from_source = (xs[:, 2] == _LOCAL) & (xs[:, 4] == SRC_SHARD)
  per_arrival = {
      "src": leader,
      "box": xs[:, 3].astype(np.int32),
      "src_kind": np.where(from_source, SRC_SHARD, DST_SHARD).astype(np.int8),
      "parent": np.where(from_source, -1, row_pos[ax]).astype(wide),
      "depth": np.where(from_source, 0, xs[:, 7] + 1).astype(np.int32),
  }
  parent = cols[:, 6]
  routed = {"src": cols[:, 0], "dst": cols[:, 1], "stage": cols[:, 2], "box": cols[:, 3],
            "src_kind": cols[:, 4], "dst_kind": cols[:, 5],
            "parent": np.where(parent >= 0, row_pos[parent], -1), "depth": cols[:, 7]}
  types = {"src": np.int32, "dst": np.int32, "stage": np.int8, "box": np.int32,
           "src_kind": np.int8, "dst_kind": np.int8, "parent": wide, "depth": np.int32}
  out = {}
  for name, dtype in types.items():
    col = out[name] = np.empty(n, dtype)
    col[row_pos] = routed[name]
    if name == "dst":
      col[fan_pos] = fdst
    elif name == "stage":
      col[fan_pos] = _FANOUT
    elif name == "dst_kind":
      col[fan_pos] = DST_SHARD
    else:
      col[fan_pos] = per_arrival[name][fa]
  return Transfers(0, out["src"], out["dst"], out["stage"], out["src_kind"],
                   out["dst_kind"], out["box"], tuple(boxes), out["parent"], extra_parents,
                   out["depth"])


# ---------------------------------------------------------------------------------------
# Plan size, from the layouts alone (linear in devices)
# ---------------------------------------------------------------------------------------

class PlanSize(NamedTuple):
  """Lower bounds on the size of a plan (exact for `flat` on JAX's grid layouts).

  transfers: transfers of the distinct tensor routes (what the planner builds).
  chunks: chunks of the schedule of every tensor (what `Plan.chunks` and the schedule
    encoding build), for the plan's chunk_bytes.
  """

  transfers: int
  chunks: int


def _overlap_counter(shards, ndim: int):
  """Per dim, a function counting the source intervals that overlap [lo, hi); None
  where a dim's distinct intervals overlap each other (not a grid: count 1)."""
  counters = []
  for k in range(ndim):
    intervals = sorted({b[k] for b, _ in shards})
    starts = [lo for lo, _ in intervals]
    ends = [hi for _, hi in intervals]
    if any(ends[i] > starts[i + 1] for i in range(len(intervals) - 1)):
      counters.append(None)
    else:
      counters.append((starts, ends))
  return counters


@functools.lru_cache(maxsize=4096)
def _tensor_size(src: Layout, dst: Layout, itemsize: int, route: str) -> tuple[int, int]:
  """(transfers, bytes written into destination buffers) of one tensor's route, at
  least. Every destination replica receives each source piece of its box by at least
  one transfer (a local copy if it holds it), so transfers >= sum over destination
  shards of replicas x intersecting source shards; on a grid the latter is the product
  over dims of overlapping source intervals (two binary searches per dim)."""
  src_shards = _shards(src)
  dst_shards = _shards(dst)
  if route == "gather_bcast":
    devices = {t for _, ts in dst_shards for t in ts}
    chain = len(devices - {src.devices[0]}) if src.devices else len(devices)
    nbytes = math.prod(src.shape) * itemsize
    return (len(src_shards) + chain + len(devices),
            chain * nbytes + sum(len(ts) * box_size(b) for b, ts in dst_shards) * itemsize)
  counters = _overlap_counter(src_shards, src.ndim)
  transfers = received = 0
  for dbox, replicas in dst_shards:
    pieces = 1
    for (lo, hi), counter in zip(dbox, counters):
      if counter is not None:
        starts, ends = counter
        pieces *= bisect.bisect_left(starts, hi) - bisect.bisect_right(ends, lo)
    transfers += len(replicas) * max(pieces, 1)
    received += len(replicas) * box_size(dbox) * itemsize
  return transfers, received


def plan_size(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
              itemsizes: Sequence[int], route: str = "hierarchical",
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> PlanSize:
  """Lower bounds on the transfers and chunks of a plan, without building it.

  Time linear in the devices of the layouts (times rank and log of the shard count),
  cached per distinct (layouts, itemsize, route). Transfers count each distinct tensor
  route once (equal layouts share one); chunks count every tensor.
  """
  from jax_m2n._src.chunks import LEAF_CHUNK_FACTOR
  seen = set()
  transfers = chunks = 0
  for s, d, i in zip(src_layouts, dst_layouts, itemsizes):
    n, received = _tensor_size(s, d, int(i), route)
    if (s, d, i) not in seen:
      seen.add((s, d, i))
      transfers += n
    chunks += max(n, -(-received // (LEAF_CHUNK_FACTOR * chunk_bytes)))
  return PlanSize(transfers, chunks)


def check_plan_size(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
                    itemsizes: Sequence[int], route: str = "hierarchical",
                    chunk_bytes: int | None = None) -> PlanSize:
  """Refuses, before any planning, a plan over `MAX_PLAN_TRANSFERS` transfers (or, with
  `chunk_bytes`, over `MAX_PLAN_CHUNKS` chunks).

  Called by `plan_reshard` (transfers) and `Plan.chunks` (chunks) on a cache miss;
  callers that want to fail before other work (the CLI, the public API's argument
  checks) may call it first. Takes well under a second for a million devices.

  Returns:
    The `PlanSize` (lower bounds) when within the limits.

  Raises:
    ReshardValueError: one line naming the size, the limit and what to change.
  """
  size = plan_size(src_layouts, dst_layouts, itemsizes, route,
                   chunk_bytes or DEFAULT_CHUNK_BYTES)
  if size.transfers > MAX_PLAN_TRANSFERS:
    devices = len({d for l in dst_layouts for d in l.devices})
    raise ReshardValueError(
        f"plan: a plan must have at most {MAX_PLAN_TRANSFERS} transfers "
        f"(MAX_PLAN_TRANSFERS); got at least {size.transfers} for route {route!r} "
        f"({len(src_layouts)} tensor(s), {devices} destination devices). Use fewer "
        f"destination replicas or fewer source shards per destination shard.")
  if chunk_bytes is not None and size.chunks > MAX_PLAN_CHUNKS:
    raise ReshardValueError(
        f"plan: a plan must have at most {MAX_PLAN_CHUNKS} chunks (MAX_PLAN_CHUNKS); got "
        f"at least {size.chunks} with chunk_bytes={chunk_bytes}. Use a larger "
        f"chunk_bytes.")
  return size


@functools.lru_cache(maxsize=4096)
def plan_tensor(src: Layout, dst: Layout, itemsize: int, topology: Topology,
                route: str) -> TensorPlan:
  """The route of one tensor; cached, so equal (layouts, itemsize, topology) plan once."""
  _check_pair(src, dst, "plan")
  if route not in ROUTES:
    raise ReshardValueError(f"plan: route must be one of {ROUTES}; got {route!r}.")
  with _no_young_collections():
    transfers = _route_tensor(src, dst, itemsize, topology, route)
  return TensorPlan(src, dst, itemsize, topology, transfers)


@contextlib.contextmanager
def _no_young_collections():
  """Plans with the cyclic GC off and hands what it allocated to the oldest generation.

  A route allocates millions of small tuples and no cycles. Left in the young generation
  they are rescanned by the collections that follow (a third of the planning time of a
  DeepSeek-V3-sized model even with the GC off while routing). `gc.freeze` then
  `gc.unfreeze` moves every tracked object to the oldest generation in O(1), so only the
  next full collection visits them, once. Skipped (plain disable) when the application
  froze objects itself: unfreezing would undo its freeze.
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if gc.get_freeze_count() == 0:
      gc.freeze()
      gc.unfreeze()
    if enabled:
      gc.enable()


# ---------------------------------------------------------------------------------------
# Accounting and the cost model
# ---------------------------------------------------------------------------------------

def _ms(nbytes: float, gbps: float) -> float:
  return nbytes / (gbps * 1e6)


@dataclasses.dataclass
class Traffic:
  """Bytes per link class, and per device egress/ingress per link class."""

  by_link: dict[str, int]
  egress: dict[int, dict[str, int]]
  ingress: dict[int, dict[str, int]]

  @staticmethod
  def of(transfers: Transfers, itemsizes: Sequence[int], topo: Topology) -> "Traffic":
    """The traffic of one tensor's transfers (columns; exact integer sums)."""
    n = transfers.nbytes(itemsizes[transfers.tensor])
    src, dst = transfers.src, transfers.dst
    cross = src != dst
    by_link = {k: 0 for k in LINKS}
    by_link["local"] = int(n[~cross].sum())
    egress: dict[int, dict[str, int]] = {}
    ingress: dict[int, dict[str, int]] = {}
    if not cross.any():
      return Traffic(by_link, egress, ingress)
    n, src, dst = n[cross], src[cross], dst[cross]
    devices = np.unique(np.concatenate([src, dst]))
    domain = np.array([topo.domain_of(d) for d in devices.tolist()], np.int64)
    s_at, d_at = np.searchsorted(devices, src), np.searchsorted(devices, dst)
    network = domain[s_at] != domain[d_at]
    for link, on in (("nvlink", ~network), ("network", network)):
      by_link[link] = int(n[on].sum())
    for side, at in ((egress, s_at), (ingress, d_at)):
      # Devices in order of first appearance on this side (as a loop would add them).
      seen, first = np.unique(at, return_index=True)
      for j in seen[np.argsort(first, kind="stable")].tolist():
        side[int(devices[j])] = {"nvlink": 0, "network": 0}
      for link, on in (("nvlink", ~network), ("network", network)):
        for j, v in zip(*_sum_by(at[on], n[on])):
          side[int(devices[j])][link] = v
    return Traffic(by_link, egress, ingress)

  @staticmethod
  def merge(parts: "Sequence[Traffic]") -> "Traffic":
    by_link = {k: 0 for k in LINKS}
    egress: dict[int, dict[str, int]] = {}
    ingress: dict[int, dict[str, int]] = {}
    for part in parts:
      for k, v in part.by_link.items():
        by_link[k] += v
      for mine, theirs in ((egress, part.egress), (ingress, part.ingress)):
        for d, loads in theirs.items():
          m = mine.setdefault(d, {"nvlink": 0, "network": 0})
          m["nvlink"] += loads["nvlink"]
          m["network"] += loads["network"]
    return Traffic(by_link, egress, ingress)

  def time_ms(self, topo: Topology) -> float:
    """Max over devices and directions of bytes / bandwidth of the link class."""
    worst = 0.0
    for side in (self.egress, self.ingress):
      for loads in side.values():
        worst = max(worst, _ms(loads["nvlink"], topo.nvlink_gbps),
                    _ms(loads["network"], topo.nic_gbps))
    return worst


def _sum_by(keys: np.ndarray, values: np.ndarray) -> tuple[list[int], list[int]]:
  """Exact integer sums of `values` per distinct key: (keys, sums) as Python ints."""
  if not len(keys):
    return [], []
  order = np.argsort(keys, kind="stable")
  keys, values = keys[order], values[order]
  starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
  if values.dtype == object:
    sums = [sum(values[a:b].tolist()) for a, b in zip(starts, list(starts[1:]) + [len(keys)])]
  else:
    sums = np.add.reduceat(values, starts).tolist()
  return keys[starts].tolist(), sums


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


# ---------------------------------------------------------------------------------------
# The plan of a whole call (a pytree of tensors)
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The plan of one reshard call: every tensor's route, accounting and cost.

  Attributes:
    route: `hierarchical`, `flat` or `gather_bcast`.
    topology: the topology planned for.
    tensors: one `TensorPlan` per tensor (pytree leaf), in leaf order.
    chunk_bytes: bound on the bytes of one chunk (see `chunks`).
  """

  route: str
  topology: Topology
  tensors: tuple[TensorPlan, ...]
  chunk_bytes: int = DEFAULT_CHUNK_BYTES

  @functools.cached_property
  def transfers(self) -> Sequence[Transfer]:
    """Every transfer of every tensor, before chunking, `tensor` set to the leaf index
    (the tensor's `Transfers` itself for one tensor; records built on access)."""
    if len(self.tensors) == 1:
      return self.tensors[0].transfers  # planned with tensor index 0 already
    return tuple(itertools.chain.from_iterable(
        tp.transfers.with_tensor(i) for i, tp in enumerate(self.tensors)))

  @property
  def itemsizes(self) -> tuple[int, ...]:
    return tuple(tp.itemsize for tp in self.tensors)

  @property
  def payload_bytes(self) -> int:
    return sum(tp.nbytes for tp in self.tensors)

  @functools.cached_property
  def traffic(self) -> Traffic:
    return Traffic.merge([tp.traffic for tp in self.tensors])

  @property
  def bytes_by_link(self) -> dict[str, int]:
    return dict(self.traffic.by_link)

  @functools.cached_property
  def devices(self) -> tuple[int, ...]:
    """Every participating device (holds a source or a destination box), sorted."""
    ds = set()
    for tp in self.tensors:
      ds.update(tp.src.devices)
      ds.update(tp.dst.devices)
    return tuple(sorted(ds))

  def route_estimate_ms(self) -> float:
    """This route's time bound: max over devices of bytes / link bandwidth."""
    return self.traffic.time_ms(self.topology)

  def step_estimate_ms(self) -> float:
    """This route's time as its schedule runs: step by step, each step as long as its
    busiest device and direction (bytes / link bandwidth, as `route_estimate_ms`).

    The transports start a step's chunks when the previous step has ended (the CPU
    transport at a barrier of every device; the CUDA transport per device, one NCCL group
    per step), so a step whose load is uneven, and the steps that fill and drain a
    pipeline (the first chunk's forwarding hops, the last chunk's fan-out) cost more than
    the aggregate bound, which assumes every link busy from start to end. Equal to
    `route_estimate_ms` for a one-step schedule; never below it. Builds the chunks.
    """
    chunks = self.chunks
    if not len(chunks):
      return 0.0
    topo = self.topology
    src = np.empty(len(chunks), np.int64)
    dst = np.empty(len(chunks), np.int64)
    ms = np.empty(len(chunks), np.float64)
    for t, (tp, part) in enumerate(zip(self.tensors, chunks.parts)):
      mine = chunks.tensor == t
      k = chunks.index[mine]
      x = part.transfer[k]
      src[mine], dst[mine] = tp.transfers.src[x], tp.transfers.dst[x]
      ms[mine] = np.prod(part.hi[k] - part.lo[k], axis=1) * (tp.itemsize / 1e6)
    cross = src != dst
    src, dst, ms, step = src[cross], dst[cross], ms[cross], chunks.step[cross]
    if not len(step):
      return 0.0
    devices = np.unique(np.concatenate([src, dst]))
    domain = np.array([topo.domain_of(d) for d in devices.tolist()], np.int64)
    s_at, d_at = np.searchsorted(devices, src), np.searchsorted(devices, dst)
    network = domain[s_at] != domain[d_at]
    ms = ms / np.where(network, topo.nic_gbps, topo.nvlink_gbps)
    n_steps, n_dev = chunks.n_steps, len(devices)
    longest = np.zeros(n_steps, np.float64)
    for at in (s_at, d_at):  # egress, ingress
      for on in (network, ~network):  # per link class
        key = (step[on] * n_dev + at[on]) if on.any() else np.zeros(0, np.int64)
        keys, inverse = np.unique(key, return_inverse=True)
        load = np.bincount(inverse.reshape(-1), weights=ms[on], minlength=len(keys))
        np.maximum.at(longest, keys // n_dev, load)
    return float(longest.sum())

  @functools.cached_property
  def estimate_ms(self) -> dict[str, float]:
    """The cost-model estimate of every route for the same tensors and topology."""
    out = {}
    for route in ROUTES:
      p = self if route == self.route else self.with_route(route)
      out[route] = p.route_estimate_ms()
    return out

  @functools.cached_property
  def sol_ms(self) -> float:
    return sol_ms(self.tensors)

  def with_route(self, route: str) -> "Plan":
    return plan_reshard([tp.src for tp in self.tensors], [tp.dst for tp in self.tensors],
                        self.itemsizes, self.topology, route, self.chunk_bytes)

  @functools.cached_property
  def chunks(self):
    """The chunked, step-assigned schedule (a `jax_m2n._src.chunks.Chunks`).

    Raises ReshardValueError, before building anything, over MAX_PLAN_CHUNKS chunks.
    """
    from jax_m2n._src import chunks
    check_plan_size([tp.src for tp in self.tensors], [tp.dst for tp in self.tensors],
                    self.itemsizes, self.route, self.chunk_bytes)
    return chunks.schedule_chunks(self)

  def describe(self, size: PlanSize | None = None) -> str:
    """One line: route, tensors, devices, transfers by stage, bytes by link."""
    from collections import Counter
    stages: Counter = Counter()
    for tp in self.tensors:
      stages.update(tp.transfers.stage_counts())
    links = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in self.bytes_by_link.items())
    return (f"route {self.route}: {len(self.tensors)} tensor(s), "
            f"{_fmt_bytes(self.payload_bytes)}, {len(self.devices)} devices; transfers "
            + (", ".join(f"{s} {stages[s]}" for s in STAGES if stages[s]) or "none")
            + f"; bytes by link: {links}"
            + (f"; size bound {size.transfers} transfers" if size is not None else ""))

  def summary(self) -> str:
    """A readable summary (the `plan` command without --json)."""
    from collections import Counter
    lines = []
    stages: Counter = Counter()
    for tp in self.tensors:
      stages.update(tp.transfers.stage_counts())
    lines.append(f"route: {self.route}   tensors: {len(self.tensors)}   payload: "
                 f"{_fmt_bytes(self.payload_bytes)}   devices: {len(self.devices)}")
    lines.append("transfers: " + ", ".join(f"{s} {stages[s]}" for s in STAGES if stages[s]))
    lines.append("bytes by link: " + ", ".join(
        f"{k} {_fmt_bytes(v)}" for k, v in self.bytes_by_link.items()))
    lines.append(f"topology: nvlink {self.topology.nvlink_gbps:g} GB/s, network "
                 f"{self.topology.nic_gbps:g} GB/s per device")
    for route, ms in self.estimate_ms.items():
      mark = " <-" if route == self.route else ""
      lines.append(f"estimate {route:>12}: {fmt_time(ms):>10}{mark}")
    lines.append(f"bound (sol)         : {fmt_time(self.sol_ms):>10}")
    return "\n".join(lines)


def fmt_time(ms: float) -> str:
  """A duration given in ms, in the unit that reads best: `142 ns`, `3.5 us`, `12 ms`."""
  if not math.isfinite(ms):
    return f"{ms} ms"
  for unit, scale in (("s", 1e3), ("ms", 1.0), ("us", 1e-3)):
    if abs(ms) >= scale:
      return f"{ms / scale:.4g} {unit}"
  return f"{ms * 1e6:.4g} ns"


def _fmt_bytes(n: int) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


@functools.lru_cache(maxsize=256)
def _plan_cached(src: tuple[Layout, ...], dst: tuple[Layout, ...],
                 itemsizes: tuple[int, ...], topology: Topology, route: str,
                 chunk_bytes: int) -> Plan:
  size = check_plan_size(src, dst, itemsizes, route)
  tensors = tuple(plan_tensor(s, d, i, topology, route)
                  for s, d, i in zip(src, dst, itemsizes))
  plan = Plan(route, topology, tensors, chunk_bytes)
  if logger.isEnabledFor(logging.DEBUG):
    logger.debug("planned %s", plan.describe(size))
  return plan


def plan_reshard(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
                 itemsizes: Sequence[int], topology: Topology | None = None,
                 route: str = "hierarchical",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Plan:
  """Plans the reshard of several tensors (one pytree) in one call.

  Args:
    src_layouts: the source layout of each tensor.
    dst_layouts: the destination layout of each tensor (same global shapes).
    itemsizes: bytes per element of each tensor.
    topology: NVLink domains and bandwidths (default: one domain).
    route: `hierarchical` (the product), `flat` or `gather_bcast` (baselines).
    chunk_bytes: bound on one chunk of a transfer (pipelining, staging).

  Returns:
    A `Plan`. Plans are cached: the same arguments return the same object, and every
    rank derives the same plan without talking.

  Example:
    >>> from jax_m2n._src.layout import parse_layout
    >>> src = parse_layout("mesh(dp=1, tp=4) P(tp, None) @0", (4, 8))
    >>> dst = parse_layout("mesh(dp=2, tp=2) P(tp, None) @4", (4, 8))
    >>> plan_reshard([src], [dst], [4]).bytes_by_link["nvlink"]  # injected + fanned out
    256
  """
  if route not in ROUTES:
    raise ReshardValueError(f"plan: route must be one of {ROUTES}; got {route!r}.")
  if not (len(src_layouts) == len(dst_layouts) == len(itemsizes)):
    raise ReshardValueError(
        f"plan: src_layouts, dst_layouts and itemsizes must have equal lengths; got "
        f"{len(src_layouts)}, {len(dst_layouts)} and {len(itemsizes)}.")
  if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
    raise ReshardValueError(
        f"plan: chunk_bytes must be a positive int; got {chunk_bytes!r}.")
  for i, (s, d) in enumerate(zip(src_layouts, dst_layouts)):
    _check_pair(s, d, f"plan (tensor {i})")
  return _plan_cached(tuple(src_layouts), tuple(dst_layouts),
                      tuple(int(i) for i in itemsizes), topology or Topology(), route,
                      int(chunk_bytes))
