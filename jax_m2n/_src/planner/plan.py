"""The plan of a reshard call: the `Plan` container and its cache.

Owns `plan_reshard` (checks, the size limits of size.py, then one cached `TensorPlan`
per tensor by the chosen route) and what a `Plan` answers (transfers, traffic,
estimates, chunks, summaries). Pure and deterministic: every rank derives the same
plan; never touches devices, buffers or JAX runtime state. Chunks and steps are derived
lazily (`Plan.chunks`) by planner/chunks.py, only when a schedule is needed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
from typing import Sequence

from jax_m2n._src import collector
from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.layout import Layout
from jax_m2n._src.planner import chunking as chunking_lib
from jax_m2n._src.planner import chunks as chunks_lib
from jax_m2n._src.planner import cost
from jax_m2n._src.planner.chunking import Chunking, Transport
from jax_m2n._src.planner.cost import Traffic, sol_ms
from jax_m2n._src.planner.routes import route_tensor
from jax_m2n._src.planner.size import PlanSize, check_plan_size
from jax_m2n._src.planner.transfers import ROUTES, STAGES, Transfer, Transfers
from jax_m2n._src.topology import Topology

logger = logging.getLogger("jax_m2n")


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
    return cost._bound_loads(self)


def _check_pair(src: Layout, dst: Layout, where: str) -> None:
  if src.shape != dst.shape:
    raise ReshardValueError(
        f"{where}: source and destination must have the same global shape; got "
        f"{src.shape} and {dst.shape}.")


@functools.lru_cache(maxsize=4096)
def plan_tensor(src: Layout, dst: Layout, itemsize: int, topology: Topology,
                route: str) -> TensorPlan:
  """The route of one tensor; cached, so equal (layouts, itemsize, topology) plan once."""
  _check_pair(src, dst, "plan")
  if route not in ROUTES:
    raise ReshardValueError(f"plan: route must be one of {ROUTES}; got {route!r}.")
  with collector.paused(promote=True):
    transfers = route_tensor(src, dst, itemsize, topology, route)
  return TensorPlan(src, dst, itemsize, topology, transfers)


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
    chunking: the transport the schedule is for and the caller's chunk bytes, if any
      (`chunk_bytes` is what the chunks use).
  """

  route: str
  topology: Topology
  tensors: tuple[TensorPlan, ...]
  chunking: Chunking = Chunking()

  @functools.cached_property
  def transport(self) -> Transport:
    """The transport's fixed costs (per call, step, chunk) the estimate counts."""
    return chunking_lib.transport_of(self.chunking, self.topology)

  @functools.cached_property
  def chunk_bytes(self) -> int:
    """Bound on the bytes of one chunk: the caller's, else chosen for this plan from
    its bytes on the slowest stage and its forwarding hops
    (`chunking.default_chunk_bytes`)."""
    if self.chunking.chunk_bytes is not None:
      return self.chunking.chunk_bytes
    return chunking_lib.default_chunk_bytes(self, self.transport)

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
    """The bytes of this route's schedule step by step (`cost.step_ms`): pipeline fill
    and drain and uneven steps included, the transport's fixed costs not. Builds the
    chunks."""
    return cost.step_ms(self)

  def schedule_estimate_ms(self) -> float:
    """This route's time as the schedule that will run takes it (`cost.schedule_ms`):
    its steps' bytes plus the transport's cost per call, step and chunk. Builds the
    chunks."""
    return cost.schedule_ms(self)

  @functools.cached_property
  def estimate_ms(self) -> dict[str, float]:
    """Per route, the estimate of the schedule that route would run with the same
    tensors, topology and chunking (`schedule_estimate_ms`). The aggregate of a route
    is `route_estimate_ms()`; the bound no route beats, `sol_ms`."""
    out = {}
    for route in ROUTES:
      p = self if route == self.route else self.with_route(route)
      out[route] = p.schedule_estimate_ms()
    return out

  @functools.cached_property
  def sol_ms(self) -> float:
    return sol_ms(self.tensors)

  def with_route(self, route: str) -> "Plan":
    return plan_reshard([tp.src for tp in self.tensors], [tp.dst for tp in self.tensors],
                        self.itemsizes, self.topology, route, self.chunking)

  @functools.cached_property
  def steps(self):
    """Where each tensor's chunks fall in the schedule (a `planner.chunks.Steps`):
    every device's chunks in order without the plan's whole chunk list.

    Raises ReshardValueError, before building anything, over MAX_PLAN_CHUNKS chunks.
    """
    counts = collections.Counter(map(id, self.tensors))  # tensors share TensorPlans
    distinct = {id(tp): tp for tp in self.tensors}.values()
    check_plan_size([tp.src for tp in distinct], [tp.dst for tp in distinct],
                    [tp.itemsize for tp in distinct], self.route, self.chunk_bytes,
                    [counts[id(tp)] for tp in distinct])
    return chunks_lib.plan_steps(self)

  @functools.cached_property
  def chunks(self):
    """The chunked, step-assigned schedule (a `planner.chunks.Chunks`): every chunk of
    `steps`, sorted by step.

    Raises ReshardValueError, before building anything, over MAX_PLAN_CHUNKS chunks.
    """
    return chunks_lib.schedule_chunks(self, self.steps)

  def describe(self, size: PlanSize | None = None) -> str:
    """One line: route, tensors, devices, transfers by stage, bytes by link."""
    stages: collections.Counter = collections.Counter()
    for tp in self.tensors:
      stages.update(tp.transfers.stage_counts())
    links = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.bytes_by_link.items())
    return (f"route {self.route}: {len(self.tensors)} tensor(s), "
            f"{fmt_bytes(self.payload_bytes)}, {len(self.devices)} devices; transfers "
            + (", ".join(f"{s} {stages[s]}" for s in STAGES if stages[s]) or "none")
            + f"; bytes by link: {links}"
            + (f"; size bound {size.transfers} transfers" if size is not None else ""))

  def summary(self) -> str:
    """A readable summary (the `plan` command without --json)."""
    lines = []
    stages: collections.Counter = collections.Counter()
    for tp in self.tensors:
      stages.update(tp.transfers.stage_counts())
    lines.append(f"route: {self.route}   tensors: {len(self.tensors)}   payload: "
                 f"{fmt_bytes(self.payload_bytes)}   devices: {len(self.devices)}")
    lines.append("transfers: " + ", ".join(f"{s} {stages[s]}" for s in STAGES if stages[s]))
    lines.append("bytes by link: " + ", ".join(
        f"{k} {fmt_bytes(v)}" for k, v in self.bytes_by_link.items()))
    lines.append(f"topology: nvlink {self.topology.nvlink_gbps:g} GB/s, network "
                 f"{self.topology.nic_gbps:g} GB/s per device")
    for route, ms in self.estimate_ms.items():
      mark = " <-" if route == self.route else ""
      lines.append(f"estimate {route:>12}: {fmt_time(ms):>10}{mark}")
    lines.append(f"bound (sol)         : {fmt_time(self.sol_ms):>10}")
    lines.append(f"schedule: {len(self.chunks)} chunks of at most "
                 f"{fmt_bytes(self.chunk_bytes)} in {self.chunks.n_steps} steps "
                 f"({self.transport.name} transport: {self.transport.call_us:g} us per "
                 f"call, {self.transport.step_us:g} us per step)")
    return "\n".join(lines)


def fmt_time(ms: float) -> str:
  """A duration given in ms, in the unit that reads best: `142 ns`, `3.5 us`, `12 ms`."""
  if not math.isfinite(ms):
    return f"{ms} ms"
  for unit, scale in (("s", 1e3), ("ms", 1.0), ("us", 1e-3)):
    if abs(ms) >= scale:
      return f"{ms / scale:.4g} {unit}"
  return f"{ms * 1e6:.4g} ns"


def fmt_bytes(n: int) -> str:
  """A byte count in readable units ("1.50 MiB", "512 B")."""
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


@functools.lru_cache(maxsize=256)
def plan_cached(src: tuple[Layout, ...], dst: tuple[Layout, ...],
                 itemsizes: tuple[int, ...], topology: Topology, route: str,
                 chunking: Chunking) -> Plan:
  size = check_plan_size(src, dst, itemsizes, route)
  # plan_tensor once per distinct object triple (a model's leaves share a few layouts;
  # each lookup hashes two Layouts and the topology in Python).
  planned: dict[tuple[int, int, int], TensorPlan] = {}
  tensors = []
  for s, d, i in zip(src, dst, itemsizes):
    tp = planned.get((id(s), id(d), i))  # (s and d held by the arguments)
    if tp is None:
      tp = planned[(id(s), id(d), i)] = plan_tensor(s, d, i, topology, route)
    tensors.append(tp)
  plan = Plan(route, topology, tuple(tensors), chunking)
  if logger.isEnabledFor(logging.DEBUG):
    logger.debug("planned %s", plan.describe(size))
  return plan


def plan_reshard(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
                 itemsizes: Sequence[int], topology: Topology | None = None,
                 route: str = "hierarchical",
                 chunk_bytes: int | Chunking | None = None) -> Plan:
  """Plans the reshard of several tensors (one pytree) in one call.

  Args:
    src_layouts: the source layout of each tensor.
    dst_layouts: the destination layout of each tensor (same global shapes).
    itemsizes: bytes per element of each tensor.
    topology: NVLink domains and bandwidths (default: one domain).
    route: `hierarchical` (the product), `flat` or `gather_bcast` (baselines).
    chunk_bytes: bound on one chunk of a transfer (pipelining, staging): an int, or a
      `Chunking` (the transport the schedule runs on, and its chunk bytes or None),
      or None: `Chunking("cpu")`, chunks chosen per plan
      (`chunking.default_chunk_bytes`).

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
  chunking = _chunking(chunk_bytes)
  for i, (s, d) in enumerate(zip(src_layouts, dst_layouts)):
    _check_pair(s, d, f"plan (tensor {i})")
  return plan_cached(tuple(src_layouts), tuple(dst_layouts),
                      tuple(int(i) for i in itemsizes), topology or Topology(), route,
                      chunking)


def _chunking(chunk_bytes) -> Chunking:
  """`plan_reshard`'s chunk_bytes as a checked `Chunking`."""
  if chunk_bytes is None:
    return Chunking()
  if isinstance(chunk_bytes, Chunking):
    given = chunk_bytes.chunk_bytes
    if given is None:
      return chunk_bytes
  else:
    given = chunk_bytes
  if isinstance(given, bool) or not isinstance(given, int) or given < 1:
    raise ReshardValueError(
        f"plan: chunk_bytes must be a positive int; got {given!r}.")
  if isinstance(chunk_bytes, Chunking):
    return chunk_bytes
  return Chunking(chunk_bytes=int(given))
