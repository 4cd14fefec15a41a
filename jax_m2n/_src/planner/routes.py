"""Routes: from two layouts and a topology to the transfers of one tensor.

Owns the three routes, each its own function: `hierarchical` (the product: one owner
per piece, leaders per destination shard and domain, a ring forwarding between domains,
fan-out inside each), `flat` (every destination replica sent from a source) and
`gather_bcast` (the legacy refit: gather on one device, broadcast along a chain). Pure
and deterministic (every rank derives the same transfers); prices nothing (cost.py),
chunks nothing (planner/chunks.py).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import zlib
from typing import Callable, Sequence

import numpy as np

from jax_m2n._src.layout import Box, Layout, box_size, full_box, intersect
from jax_m2n._src.planner.transfers import (
    BCAST, FANOUT, FORWARD, GATHER, INJECT, LOCAL, DST_SHARD, FULL_TMP, SRC_SHARD,
    Transfers)
from jax_m2n._src.topology import Topology


def route_tensor(src: Layout, dst: Layout, itemsize: int, topo: Topology,
                 route: str) -> Transfers:
  """The transfers of one tensor by `route` (one of ROUTES; checked by the caller)."""
  return _ROUTES[route](src, dst, itemsize, topo)


@functools.lru_cache(maxsize=256)
def shards(layout: Layout) -> tuple[tuple[Box, tuple[int, ...]], ...]:
  """`layout.shards()`, once per distinct layout: the size check and the route both need
  it, and a model's tensors repeat a few layouts (~3 ms each over 4,096 devices)."""
  return tuple(layout.shards())



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


# The least a leader leads when a region set is split over a domain's replicas: below
# it a split buys nothing. 64 KiB crosses NVLink in ~0.15 us (450 GB/s a direction),
# while every extra leader costs its slab's network transfer plus a fan-out to each of
# the domain's other replicas, each op a fixed ~1-3 us of handler and launch work: a
# 4 KiB norm over a 64-replica domain split evenly is 64 slivers x 63 copies = 4,032
# ops, led whole it is 63. 0 restores the paper's rule (every replica leads an equal
# share, whatever the size); read at call time, so planner.clear_caches() after a change.
MIN_LEAD_BYTES = 64 << 10


def _split_for_leaders(regions: Sequence[Box], itemsize: int, rho: int,
                       min_lead_bytes: int = 0,
                       shard: int = 0) -> list[tuple[Box, int, int]]:
  """Spreads regions over leaders of a domain of `rho` replicas so that led bytes are
  (nearly) equal, each leader leading at least `min_lead_bytes` (0: no minimum).

  Returns (sub-region, leader position in [0, rho), index of the region it came from).
  The leaders are n = max(1, min(rho, total // min_lead_bytes)) consecutive positions
  (all rho with no minimum), starting at (shard * n) % rho so that the shards of one
  tensor (`shard`: the destination shard's index, offset per tensor) spread over the
  replicas: only the tensor's own layouts decide, as a plan cached per tensor must. Regions are cut into
  slabs along their outermost dim of extent > 1, at row granularity, only where a
  leader's share ends inside a region. With equal regions and q a multiple of the leader
  count this is exactly the paper's a_j / b_j rule; with fewer regions than leaders (one
  source feeding three replicas) every leader still leads an equal share.
  """
  sizes = [box_size(r) * itemsize for r in regions]
  total = sum(sizes)
  n = rho
  if min_lead_bytes > 0:
    n = max(1, min(rho, total // min_lead_bytes))
  start = (shard * n) % rho
  if n == 1:
    return [(r, start, i) for i, r in enumerate(regions)]
  ends = [((k + 1) * total + n // 2) // n for k in range(n)]  # leader k's share ends

  def leader_at(position: float) -> int:  # the position of the leader of a byte
    return (start + min(bisect.bisect_right(ends, position), n - 1)) % rho

  out = []
  pos = 0
  for i, (region, size) in enumerate(zip(regions, sizes)):
    k = bisect.bisect_right(ends, pos, 0, n - 1)  # first share end after pos
    if k == n - 1 or ends[k] >= pos + size or size == 0:
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


def _domain_lookup(topo: Topology) -> Callable[[int], int]:
  """`topo.domain_of`, one topology lookup per device."""
  domains: dict[int, int] = {}

  def domain_of(device: int) -> int:
    d = domains.get(device)
    if d is None:
      d = domains[device] = topo.domain_of(device)
    return d
  return domain_of


def _contributions(src_shards, dbox: Box) -> tuple[list[tuple[Box, tuple[int, ...]]],
                                                   list[int]]:
  """The pieces of destination box `dbox`: (region, holders) and the index of the source
  shard of each, in source-shard order."""
  contributions = []
  cshard = []
  for k, (sbox, holders) in enumerate(src_shards):
    region = intersect(sbox, dbox)
    if region is not None:
      contributions.append((region, holders))
      cshard.append(k)
  return contributions, cshard


# ---------------------------------------------------------------------------------------
# gather_bcast: the legacy refit
# ---------------------------------------------------------------------------------------

def route_gather_bcast(src: Layout, dst: Layout, itemsize: int,
                       topo: Topology) -> Transfers:
  """Gathers the whole tensor on the first source device, then broadcasts it along a
  chain through every destination device (a ring broadcast, as NCCL's); each
  destination keeps its box."""
  src_shards, dst_shards = shards(src), shards(dst)
  if not dst_shards:
    return Transfers.empty()
  out = _Rows()
  add = out.add
  owners = _Balance()
  root = src.devices[0]
  gathered = []
  for box, holders in src_shards:
    owner = root if root in holders else owners.pick(holders, box_size(box) * itemsize)
    gathered.append(add(owner, root, GATHER, box, SRC_SHARD, FULL_TMP))
  whole = full_box(src.shape)
  chain = sorted({t for _, ts in dst_shards for t in ts} - {root},
                 key=lambda t: (topo.domain_of(t) != topo.domain_of(root),
                                topo.domain_of(t), t))
  arrival = {root: (tuple(gathered), 1)}
  prev = root
  for t in chain:
    parents, depth = arrival[prev]
    arrival[t] = ((add(prev, t, BCAST, whole, FULL_TMP, FULL_TMP, parents, depth),),
                  depth + 1)
    prev = t
  for box, ts in dst_shards:
    for t in ts:
      parents, depth = arrival[t]
      add(t, t, LOCAL, box, FULL_TMP, DST_SHARD, parents, depth)
  return _transfers(out.columns(), out.boxes, out.extra_parents)


# ---------------------------------------------------------------------------------------
# flat: direct sends
# ---------------------------------------------------------------------------------------

def route_flat(src: Layout, dst: Layout, itemsize: int, topo: Topology) -> Transfers:
  """Every destination replica receives each piece of its box from a source: its own
  local copy if it holds the piece, else from the least-loaded holder, one in its domain
  where there is one."""
  src_shards, dst_shards = shards(src), shards(dst)
  if not dst_shards:
    return Transfers.empty()
  out = _Rows()
  add = out.add
  owners = _Balance()
  domain_of = _domain_lookup(topo)
  for dbox, replicas in dst_shards:
    contributions, _ = _contributions(src_shards, dbox)
    for region, holders in contributions:
      nbytes = box_size(region) * itemsize
      for t in replicas:
        if t in holders:
          add(t, t, LOCAL, region, SRC_SHARD, DST_SHARD)
        else:
          local = [h for h in holders if domain_of(h) == domain_of(t)]
          add(owners.pick(local or holders, nbytes), t, INJECT, region,
              SRC_SHARD, DST_SHARD)
  return _transfers(out.columns(), out.boxes, out.extra_parents)


# ---------------------------------------------------------------------------------------
# hierarchical: the product
# ---------------------------------------------------------------------------------------

def route_hierarchical(src: Layout, dst: Layout, itemsize: int,
                       topo: Topology) -> Transfers:
  """The paper's route, per destination shard (in order), in three parts:

    1. lead (`_lead`): per domain of the shard's replicas, the regions a replica holds
       itself are local copies led by that replica; the regions a source in the domain
       holds are injected over NVLink; the rest must cross the network, spread over the
       domain's replicas as leaders (`_split_for_leaders`: equal led bytes, at least
       MIN_LEAD_BYTES a leader);
    2. forward (`_forward_ring`): each network-bound piece is injected once, into the
       first domain of a ring (the domain after its owner's), then forwarded leader to
       leader;
    3. fan out (`_Arrivals`, `_with_fanout`): every leader copies what it leads to the
       other replicas of the shard in its domain, skipping those that hold it; a small
       shard (at most MIN_LEAD_BYTES) led whole by one leader is copied whole, once
       per receiver, after all of its pieces have arrived (`_whole_fanout`).
  """
  src_shards, dst_shards = shards(src), shards(dst)
  if not dst_shards:
    return Transfers.empty()
  out = _Rows()
  owners = _Balance()
  domain_of = _domain_lookup(topo)
  sources = _Sources(src_shards, domain_of)
  arrivals = _Arrivals()
  turn = _turn(src, dst)
  whole: list[Box | None] = []  # per destination shard: its box if its fan-out may merge
  for shard, (dbox, replicas) in enumerate(dst_shards):
    contributions, cshard = _contributions(src_shards, dbox)
    by_domain: dict[int, list[int]] = {}
    for t in replicas:
      by_domain.setdefault(domain_of(t), []).append(t)
    led, own_group, network_regions = _lead(out, owners, sources, arrivals.groups,
                                            contributions, by_domain, itemsize,
                                            turn + shard)
    several = _forward_ring(out, owners, domain_of, contributions, led, network_regions,
                            itemsize)
    arrivals.add_segment(led, by_domain, cshard, own_group, several, len(out.rows))
    whole.append(dbox if box_size(dbox) * itemsize <= MIN_LEAD_BYTES else None)
  cols = out.columns()
  if not arrivals.x:
    return _transfers(cols, out.boxes, out.extra_parents)
  return _with_fanout(cols, out.boxes, out.extra_parents, arrivals.x, arrivals.shard,
                      arrivals.group, arrivals.groups, sources.shard_index,
                      arrivals.seg_rows, arrivals.seg_arrivals, whole)


def _turn(src: Layout, dst: Layout) -> int:
  """Where a tensor starts counting its leaders: a checksum of its shape and devices,
  the same on every rank (no process-salted hash), so that the small tensors of a model,
  each led by few replicas, are led by different ones rather than all by the first."""
  key = np.array(src.shape + src.devices + dst.devices, np.int64)
  return zlib.crc32(key.tobytes())


class _Sources:
  """Where a tensor's source shards are: per holder tuple its set and its holders per
  domain (in holder order), the domains that hold any source, and the index of the
  source shard each source device holds."""

  def __init__(self, src_shards, domain_of: Callable[[int], int]):
    self.holder_sets = {holders: frozenset(holders) for _, holders in src_shards}
    self.holders_in: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for _, holders in src_shards:
      by_dom = self.holders_in.setdefault(holders, {})
      for h in holders:
        by_dom.setdefault(domain_of(h), []).append(h)
    self.domains = {dom for by_dom in self.holders_in.values() for dom in by_dom}
    self.shard_index: dict[int, int] = {}
    for k, (_, holders) in enumerate(src_shards):
      for h in holders:
        self.shard_index[h] = k


def _lead(out: "_Rows", owners: "_Balance", sources: _Sources, groups: list,
          contributions, by_domain: dict[int, list[int]], itemsize: int, shard: int):
  """Part 1 of the hierarchical route for one destination shard: who leads what in each
  domain. Adds the local copies and the NVLink injects to `out` (and, for a region that
  several replicas hold, a fan-out group per holder to `groups`). `shard`, the
  destination shard's index plus the tensor's `_turn`, picks the first leader of a split
  with fewer leaders than replicas (`_split_for_leaders`).

  Returns (led, own_group, network_regions): `led[domain]`, the domain's entries (box,
  leader, transfer(s) or -1 - contribution until the ring fills it in, contribution
  index); `own_group`, local copy -> group of the replicas it serves; `network_regions`,
  contribution -> domain -> positions in led[domain] of its slabs that cross the network
  (indexed, not searched: a 1,000-way replicated shard has 125 domains x 1,000
  contributions).
  """
  add = out.add
  holders_in, source_domains = sources.holders_in, sources.domains
  own_group: dict[int, int] = {}
  network_regions: dict[int, dict[int, list[int]]] = {}
  led: dict[int, list[tuple[Box, int, int | list[int], int]]] = {}
  # The split of the same remote contributions over the same number of leaders is the
  # same in every domain (most domains of a wide replication): computed once.
  splits: dict[tuple[tuple[int, ...], int], list[tuple[Box, int, int]]] = {}
  slabs_of: dict[tuple[tuple[int, ...], int], dict[int, list[int]]] = {}
  hsets = [sources.holder_sets[holders] for _, holders in contributions]
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
        x = add(t, t, LOCAL, region, SRC_SHARD, DST_SHARD)
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
          [contributions[ci][0] for ci in remote], itemsize, len(reps), MIN_LEAD_BYTES,
          shard)
    if not has_sources:
      # Every slab comes over the network (remote is every contribution): the domain's
      # entries, and per contribution the positions of its slabs (shared by the domains
      # of this split; read only).
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
                                         leader, INJECT, sub, SRC_SHARD, DST_SHARD),
                        ci))
      else:
        per_domain = network_regions.get(ci)
        if per_domain is None:
          per_domain = network_regions[ci] = {}
        slots = per_domain.get(dom)
        if slots is None:
          slots = per_domain[dom] = []
        slots.append(len(entries))
        entries.append((sub, leader, -1 - ci, ci))  # filled in by the ring
  return led, own_group, network_regions


def _forward_ring(out: "_Rows", owners: "_Balance", domain_of: Callable[[int], int],
                  contributions, led, network_regions, itemsize: int) -> bool:
  """Part 2 of the hierarchical route for one destination shard: each network-bound
  contribution enters the ring at the domain after its owner's, then moves leader to
  leader. A later domain's slab may straddle two slabs of the previous domain, so
  forwarding intersects them. Fills in the `led` entries the ring delivers; returns
  whether an entry arrived in several pieces (a list of transfers)."""
  rows = out.rows
  box_id, append = out.box_id, rows.append
  several = False
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
          append((pleader, leader, FORWARD, pb, DST_SHARD, DST_SHARD, px, pdepth + 1))
          entries[i] = (sub, leader, x, ci)
          previous = [(sub, pb, leader, x, pdepth + 1)]
          continue
      arrived = []
      for i in slots:
        sub, leader = entries[i][:2]
        if previous is None:
          x = len(rows)
          b = box_id(sub)
          append((owner, leader, INJECT, b, SRC_SHARD, DST_SHARD, -1, 0))
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
          append((pleader, leader, FORWARD, b, DST_SHARD, DST_SHARD, px, pdepth + 1))
          parts.append(x)
          arrived.append((piece, b, leader, x, pdepth + 1))
        if len(parts) == 1:
          entries[i] = (sub, leader, parts[0], ci)
        else:
          entries[i] = (sub, leader, parts, ci)
          several = True
      previous = arrived
  return several


class _Arrivals:
  """Part 3 of the hierarchical route, gathered shard by shard: what arrives at the
  leaders, fanned out for the whole tensor at once, as arrays, by `_with_fanout`.

  Per arrival: its transfer (`x`), the source shard of its region (`shard`) and its
  group of candidate receivers (`group`, an index into `groups`); per destination shard
  (segment), the transfers routed and the arrivals up to its end.
  """

  def __init__(self):
    self.x: list[int] = []
    self.shard: list[int] = []
    self.group: list[int] = []
    self.groups: list[Sequence[int]] = []  # candidate receivers of a fan-out, in order
    self.seg_rows: list[int] = []
    self.seg_arrivals: list[int] = []

  def add_segment(self, led, by_domain: dict[int, list[int]], cshard: list[int],
                  own_group: dict[int, int], several: bool, n_rows: int) -> None:
    """Every leader of the shard copies what it leads to the other replicas of the
    shard in its domain (the domain's group, or a holder's own group)."""
    arr_x, arr_shard, arr_group, groups = self.x, self.shard, self.group, self.groups
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
    self.seg_rows.append(n_rows)
    self.seg_arrivals.append(len(arr_x))


def _with_fanout(cols, boxes, extra_parents, arr_x, arr_shard, arr_group, groups,
                 shard_index, seg_rows, seg_arrivals,
                 whole: Sequence[Box | None] = ()) -> Transfers:
  """The routed transfers `cols` with the fan-out of every arrival placed after its
  destination shard's transfers, as the route orders them.

  Arrival a (transfer arr_x[a] into its leader) is copied to every device of
  groups[arr_group[a]], in order, except the leader and devices that hold source shard
  arr_shard[a] themselves. A copy reads the leader's destination shard one step after
  the arrival, or its source shard at once when the arrival is the leader's own local
  copy from its source shard. Arrays throughout: this is most of a wide replication's
  transfers (4,032 of the 4,096 per region of a 64-device domain). `whole`, per
  segment: the destination shard's box where its fan-out may be merged
  (`_whole_fanout`), else None.
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
  from_source = (xs[:, 2] == LOCAL) & (xs[:, 4] == SRC_SHARD)
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
      col[fan_pos] = FANOUT
    elif name == "dst_kind":
      col[fan_pos] = DST_SHARD
    else:
      col[fan_pos] = per_arrival[name][fa]
  xs = Transfers(0, out["src"], out["dst"], out["stage"], out["src_kind"],
                 out["dst_kind"], out["box"], tuple(boxes), out["parent"], extra_parents,
                 out["depth"])
  if MIN_LEAD_BYTES <= 0 or extra_parents or not any(b is not None for b in whole):
    return xs
  return _whole_fanout(xs, whole, arr_seg, agroup, leader.astype(np.int64),
                       row_pos[ax], fa, fdst.astype(np.int64), fan_pos)


def _whole_fanout(xs: Transfers, whole: Sequence[Box | None], arr_seg: np.ndarray,
                  agroup: np.ndarray, leader: np.ndarray, arr_pos: np.ndarray,
                  fa: np.ndarray, fdst: np.ndarray, fan_pos: np.ndarray) -> Transfers:
  """`xs` (the hierarchical route's transfers, fan-out included) with the fan-out of
  small destination shards merged.

  Where one device leads every piece of a destination shard in its domain (every
  arrival of a fan-out group reaches that leader, and the group's pieces make up the
  whole shard) and a receiver gets every one of those pieces from it, the receiver's
  copies become one copy of the whole shard from the leader's destination shard, after
  all of the pieces (their transfers are its parents). Only for shards of at most MIN_LEAD_BYTES (`whole[segment]`, the shard's
  box, not None): the merged copy waits for the last piece, which costs nothing at that
  size and saves a copy per piece (a 1-D norm sharded four ways over the source and
  replicated over 64 devices: 4 fan-out copies per receiver become 1). Same bytes, same
  receivers, same buffers.

  Per arrival: its segment, fan-out group, leader and position in `xs`; per fan-out
  row (arrival-major): its arrival `fa`, receiver `fdst` and position `fan_pos`.
  """
  n_groups = int(agroup.max()) + 1
  g_count = np.bincount(agroup, minlength=n_groups)
  g_min = np.full(n_groups, np.iinfo(np.int64).max, np.int64)
  g_max = np.full(n_groups, -1, np.int64)
  np.minimum.at(g_min, agroup, leader)
  np.maximum.at(g_max, agroup, leader)
  small = np.array([b is not None for b in whole], bool)
  g_small = np.zeros(n_groups, bool)
  g_small[agroup] = small[arr_seg]
  # The group's pieces must make up the whole shard: where a receiver (or the leader)
  # also holds a piece itself (a local copy of its own, in a group of its own), the
  # group is only part of the shard, and a whole copy would overwrite that piece
  # without waiting for it.
  elems = xs.box_elements
  if elems.dtype == object:
    return xs
  whole_elems = np.array([box_size(b) if b is not None else -1 for b in whole], np.int64)
  g_elems = np.zeros(n_groups, np.int64)
  np.add.at(g_elems, agroup, elems[xs.box[arr_pos]])
  g_whole = np.full(n_groups, -2, np.int64)
  g_whole[agroup] = whole_elems[arr_seg]
  g_ok = (g_min == g_max) & (g_count > 1) & g_small & (g_elems == g_whole)
  f_group = agroup[fa]
  candidate = np.flatnonzero(g_ok[f_group])
  if not len(candidate):
    return xs
  # A (group, receiver) merges when the receiver gets every arrival of the group.
  key = f_group[candidate] * (int(fdst.max()) + 1) + fdst[candidate]
  _, first, inverse, counts = np.unique(key, return_index=True, return_inverse=True,
                                        return_counts=True)
  full = counts == g_count[f_group[candidate[first]]]
  if not full.any():
    return xs
  merged = candidate[full[inverse]]               # fan-out rows that merge
  reps = candidate[first[full]]                   # one per (group, receiver): its first
  drop = np.zeros(len(xs), bool)
  drop[fan_pos[merged]] = True
  drop[fan_pos[reps]] = False
  new_pos = np.cumsum(~drop) - 1
  keep = np.flatnonzero(~drop)
  boxes = list(xs.boxes)
  box_ids = {b: i for i, b in enumerate(boxes)}
  box, src_kind = xs.box.copy(), xs.src_kind.copy()
  parent, depth = xs.parent.astype(np.int64), xs.depth.copy()
  order = np.argsort(agroup, kind="stable")       # arrivals by group, in order
  starts = np.searchsorted(agroup[order], np.arange(n_groups))
  # Per merging group (in order of its first merged copy): the whole box, the first
  # parent, the depth and every parent of its copies; then every copy at once.
  rep_group = f_group[reps]
  g_box, g_parent, g_depth = (np.zeros(n_groups, np.int64) for _ in range(3))
  g_parents: dict[int, tuple[int, ...]] = {}
  for g in rep_group.tolist():
    if g in g_parents:
      continue
    arrs = order[starts[g]:starts[g] + g_count[g]]
    b = whole[int(arr_seg[arrs[0]])]
    bid = box_ids.get(b)
    if bid is None:
      bid = box_ids[b] = len(boxes)
      boxes.append(b)
    ps = arr_pos[arrs]
    g_box[g], g_parent[g], g_depth[g] = bid, ps[0], int(xs.depth[ps].max()) + 1
    g_parents[g] = tuple(new_pos[ps].tolist())
  rows = fan_pos[reps]
  box[rows], src_kind[rows] = g_box[rep_group], DST_SHARD
  parent[rows], depth[rows] = g_parent[rep_group], g_depth[rep_group]
  extra = {r: g_parents[g] for r, g in zip(new_pos[rows].tolist(), rep_group.tolist())}
  parent = np.where(parent >= 0, new_pos[np.maximum(parent, 0)], -1)
  return Transfers(0, xs.src[keep], xs.dst[keep], xs.stage[keep], src_kind[keep],
                   xs.dst_kind[keep], box[keep], tuple(boxes),
                   parent[keep].astype(_index(len(keep))), extra, depth[keep])


_ROUTES = {"hierarchical": route_hierarchical, "flat": route_flat,
           "gather_bcast": route_gather_bcast}
