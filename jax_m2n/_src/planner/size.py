"""Plan size, from the layouts alone: lower bounds on a plan's transfers and chunks, and
the limits that refuse a plan before any route is built.

Owns `plan_size`, `check_plan_size` and the bounds `MAX_PLAN_TRANSFERS`,
`MAX_PLAN_CHUNKS`. Linear in the devices of the layouts; builds no route, no chunk.
Pure; never touches devices.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
from typing import NamedTuple, Sequence

from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.layout import Layout, box_size
from jax_m2n._src.planner.chunking import CPU_MAX_CHUNK_BYTES
from jax_m2n._src.planner.chunks import LEAF_CHUNK_FACTOR
from jax_m2n._src.planner import routes
from jax_m2n._src.planner.routes import shards

# Bounds on one plan, checked from the layouts alone before any route is built
# (`check_plan_size`). A transfer costs ~0.2 us and ~25-50 bytes to plan (columns), but
# ~1 us and ~0.3 KB once chunked and encoded (per transfer in Python): 8M transfers are
# seconds and a few GB of schedule, beyond which a plan is refused rather than left to
# run for minutes into a MemoryError (a 100,000-way replication would be 10**10
# transfers). A DeepSeek-V3-sized refit over 4,096 devices is ~3M per stage.
MAX_PLAN_TRANSFERS = 1 << 23
MAX_PLAN_CHUNKS = 1 << 24

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
def tensor_size(src: Layout, dst: Layout, itemsize: int, route: str) -> tuple[int, int]:
  """(transfers, bytes written into destination buffers) of one tensor's route, at
  least. Every destination replica receives each source piece of its box by at least
  one transfer (a local copy if it holds it), so transfers >= sum over destination
  shards of replicas x intersecting source shards; on a grid the latter is the product
  over dims of overlapping source intervals (two binary searches per dim). A small
  shard's hierarchical fan-out may be merged (routes._whole_fanout: one copy of the
  whole shard per receiver once a leader holds it): then at least one replica receives
  every piece and each other replica at least one copy."""
  src_shards = shards(src)
  dst_shards = shards(dst)
  if route == "gather_bcast":
    devices = {t for _, ts in dst_shards for t in ts}
    chain = len(devices - {src.devices[0]}) if src.devices else len(devices)
    nbytes = math.prod(src.shape) * itemsize
    return (len(src_shards) + chain + len(devices),
            chain * nbytes + sum(len(ts) * box_size(b) for b, ts in dst_shards) * itemsize)
  counters = _overlap_counter(src_shards, src.ndim)
  merged = route == "hierarchical" and routes.MIN_LEAD_BYTES > 0
  transfers = received = 0
  for dbox, replicas in dst_shards:
    pieces = 1
    for (lo, hi), counter in zip(dbox, counters):
      if counter is not None:
        starts, ends = counter
        pieces *= bisect.bisect_left(starts, hi) - bisect.bisect_right(ends, lo)
    pieces = max(pieces, 1)
    if merged and box_size(dbox) * itemsize <= routes.MIN_LEAD_BYTES:
      transfers += pieces + len(replicas) - 1
    else:
      transfers += len(replicas) * pieces
    received += len(replicas) * box_size(dbox) * itemsize
  return transfers, received


def plan_size(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
              itemsizes: Sequence[int], route: str = "hierarchical",
              chunk_bytes: int = CPU_MAX_CHUNK_BYTES,
              counts: Sequence[int] | None = None) -> PlanSize:
  """Lower bounds on the transfers and chunks of a plan, without building it.

  Time linear in the devices of the layouts (times rank and log of the shard count),
  cached per distinct (layouts, itemsize, route). Transfers count each distinct tensor
  route once (equal layouts share one); chunks count every tensor. `counts`: per entry,
  how many tensors it stands for (None: one each).
  """
  # Leaves mostly share their layout objects: each distinct object triple is sized
  # once, with its count (a Layout hashes in Python: 20,000 leaves made 160,000 calls).
  layouts = dict(zip(map(id, src_layouts), src_layouts))
  layouts.update(zip(map(id, dst_layouts), dst_layouts))
  rows = zip(map(id, src_layouts), map(id, dst_layouts), itemsizes)
  if counts is None:
    grouped = collections.Counter(rows)
  else:
    grouped = collections.Counter()
    for row, n in zip(rows, counts):
      grouped[row] += n
  seen = set()
  transfers = chunks = 0
  for (s, d, i), count in grouped.items():
    s, d = layouts[s], layouts[d]
    n, received = tensor_size(s, d, int(i), route)
    if (s, d, i) not in seen:
      seen.add((s, d, i))
      transfers += n
    chunks += count * max(n, -(-received // (LEAF_CHUNK_FACTOR * chunk_bytes)))
  return PlanSize(transfers, chunks)


def check_plan_size(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
                    itemsizes: Sequence[int], route: str = "hierarchical",
                    chunk_bytes: int | None = None,
                    counts: Sequence[int] | None = None) -> PlanSize:
  """Refuses, before any planning, a plan over `MAX_PLAN_TRANSFERS` transfers (or, with
  `chunk_bytes`, over `MAX_PLAN_CHUNKS` chunks). `counts` as for `plan_size`.

  Called by `plan_reshard` (transfers) and `Plan.chunks` (chunks) on a cache miss;
  callers that want to fail before other work (the CLI, the public API's argument
  checks) may call it first. Takes well under a second for a million devices.

  Returns:
    The `PlanSize` (lower bounds) when within the limits.

  Raises:
    ReshardValueError: one line naming the size, the limit and what to change.
  """
  size = plan_size(src_layouts, dst_layouts, itemsizes, route,
                   chunk_bytes or CPU_MAX_CHUNK_BYTES, counts)
  if size.transfers > MAX_PLAN_TRANSFERS:
    devices = len({d for l in dst_layouts for d in l.devices})
    tensors = len(src_layouts) if counts is None else sum(counts)
    raise ReshardValueError(
        f"plan: a plan must have at most {MAX_PLAN_TRANSFERS} transfers "
        f"(MAX_PLAN_TRANSFERS); got at least {size.transfers} for route {route!r} "
        f"({tensors} tensor(s), {devices} destination devices). Use fewer "
        f"destination replicas or fewer source shards per destination shard.")
  if chunk_bytes is not None and size.chunks > MAX_PLAN_CHUNKS:
    raise ReshardValueError(
        f"plan: a plan must have at most {MAX_PLAN_CHUNKS} chunks (MAX_PLAN_CHUNKS); got "
        f"at least {size.chunks} with chunk_bytes={chunk_bytes}. Use a larger "
        f"chunk_bytes.")
  return size
