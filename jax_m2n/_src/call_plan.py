"""From a call to its plan: the one way every path (eager, in jit, across processes,
`jax_m2n.plan`, and new rooms such as jobs/) turns a call into the plan it runs.

Owns the steps between the caller's shardings and the planner (devices, platform,
topology, layouts, wire types, chunking, the plan, its debug line). Checks no argument
(checks.py did), touches no device state, compiles and moves nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Sequence

import numpy as np
from jax.sharding import Sharding

from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.layout import Layout
from jax_m2n._src.planner import Chunking, Plan, plan_reshard
from jax_m2n._src.request import Options
from jax_m2n._src.topology import Topology, as_topology

logger = logging.getLogger("jax_m2n")


@dataclasses.dataclass(frozen=True, eq=False)
class CallPlan:
  """A call's plan with what it was planned from (`plan_call` makes it).

  Attributes:
    shapes: per leaf, the global shape.
    dtypes: per leaf, the dtype of the operand (what the source holds).
    out_dtypes: per leaf, the dtype of the result (the operand's where nothing
      converts; a different one is converted in flight, `schedule.fused_conversion`).
    srcs, dsts: per leaf, the source and destination shardings (no srcs for a pull:
      its sources are `src_layouts` over the publisher's devices).
    devices: every participating device (of any leaf, source or destination) by id.
    platform: their platform (`cpu`, `gpu`, `cuda`).
    topology: the topology planned for (`options.topology` resolved on `devices`).
    src_layouts, dst_layouts: per leaf, the layouts (`Layout.from_sharding`).
    types: `schedule.encode`'s `types` (the conversion codes; None: none).
    options: the call's options.
    plan: the plan (`planner.plan_reshard`; cached: equal calls share one).
  """

  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  out_dtypes: tuple[np.dtype, ...]
  srcs: tuple[Sharding, ...]
  dsts: tuple[Sharding, ...]
  devices: dict[int, Any]
  platform: str
  topology: Topology
  src_layouts: tuple[Layout, ...]
  dst_layouts: tuple[Layout, ...]
  types: tuple | None
  options: Options
  plan: Plan

  @property
  def crossing(self) -> tuple[int, ...]:
    """The leaves whose bytes move from one device to another (the device-to-device
    transfer guard applies to them; a leaf copied within each device does not)."""
    return tuple(t for t, tp in enumerate(self.plan.tensors)
                 if len(tp.transfers) and bool((tp.transfers.src != tp.transfers.dst).any()))

  @property
  def wire_dtypes(self) -> list[np.dtype]:
    """Per leaf, the type its bytes cross links in (`schedule.wire_dtype`)."""
    pairs = list(zip(self.dtypes, self.out_dtypes))
    wire = {p: schedule.wire_dtype(*p) for p in dict.fromkeys(pairs)}  # once per distinct
    return [wire[p] for p in pairs]


def chunking(platform: str, chunk_bytes: int | None) -> Chunking:
  """The planner's chunking of a call on `platform`: the CPU or the CUDA transport's
  costs and bounds, at the caller's chunk bytes (None: chosen per plan)."""
  return Chunking("cpu" if platform == "cpu" else "cuda", chunk_bytes)


def plan_call(shapes: Sequence[Sequence[int]], dtypes: Sequence[Any],
              srcs: Sequence[Sharding] | None, dsts: Sequence[Sharding], options: Options,
              out_dtypes: Sequence[Any] | None = None, *, path: str,
              src_layouts: Sequence[Layout] | None = None,
              topology: Topology | None = None,
              chunking_for: str | None = None) -> CallPlan:
  """The plan of one reshard call: every path's one way from a call to its plan.

  Pure in its arguments (plans are cached, so every process and every path derives the
  same plan from the same call); the arguments were checked by checks.py before.

  Args:
    shapes: per leaf, the global shape.
    dtypes: per leaf, the operand dtype.
    srcs: per leaf, the source sharding (concrete devices); None with `src_layouts`.
    dsts: per leaf, the destination sharding (concrete devices, the same platform).
    options: the call's `Options` (route, topology, timeout, chunk bytes).
    out_dtypes: per leaf, the result dtype of a conversion fused into the copies
      (`schedule.fused_conversion`), None (or the list) to keep the operand's.
    path: which path plans, for the debug line (e.g. `eager per-device programs`).
    src_layouts: per leaf, the source layout, where the source devices are not this
      job's (a pull between separate jobs: the publisher's devices under plan ids of
      their own, jobs/planning.py); `srcs` is None then.
    topology: the domains to plan for, where not `options.topology` resolved on the
      devices (a pull: one domain per process of either job).
    chunking_for: the transport whose chunking to plan with, where not the devices'
      platform's (a pull: "cpu", the costs of moving arrays between processes).

  Returns:
    The `CallPlan`: devices, platform, topology, layouts, wire types and the `Plan`.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jax_m2n._src.request import Options
    >>> devs = np.array(jax.devices()[:8])
    >>> src = NamedSharding(jax.sharding.Mesh(devs[:4], ("x",)), P("x"))
    >>> dst = NamedSharding(jax.sharding.Mesh(devs[4:], ("x",)), P())
    >>> call = plan_call([(8,)], [np.float32], [src], [dst], Options(), path="doc")
    >>> call.platform, call.plan.payload_bytes, sorted(call.devices) == list(range(8))
    ('cpu', 32, True)
  """
  key = (tuple(map(tuple, shapes)), tuple(dtypes),
         None if srcs is None else tuple(srcs), tuple(dsts), options,
         None if out_dtypes is None else tuple(out_dtypes),
         None if src_layouts is None else tuple(src_layouts), topology, chunking_for)
  with _planned_lock:
    hit = _planned.get(key)
    if hit is not None:
      _planned.move_to_end(key)
  if hit is not None:  # a repeated call: a lookup
    _log_plan(hit.plan, len(hit.dst_layouts), options, path)
    if _same_objects(hit, key[2] or (), key[3]):
      return hit
    return dataclasses.replace(hit, srcs=key[2] or (), dsts=key[3])  # its own, equal
  call = _plan_call(shapes, dtypes, srcs, dsts, options, out_dtypes, path=path,
                    src_layouts=src_layouts, topology=topology,
                    chunking_for=chunking_for)
  with _planned_lock:
    _planned[key] = call
    if len(_planned) > _PLANNED_CALLS:
      _planned.popitem(last=False)
  return call


# The calls planned lately, by their arguments (equal calls share one CallPlan): a
# repeated call's planning is one lookup, not a pass over its leaves' layouts.
_PLANNED_CALLS = 256
_planned: collections.OrderedDict[tuple, CallPlan] = collections.OrderedDict()
_planned_lock = threading.Lock()


def clear_cache() -> None:
  """Forgets the planned calls (benchmarks of a first call)."""
  with _planned_lock:
    _planned.clear()


def _same_objects(hit: CallPlan, srcs: tuple, dsts: tuple) -> bool:
  """Whether a cached call holds this call's own sharding objects (not equal ones)."""
  return (len(hit.srcs) == len(srcs) and all(a is b for a, b in zip(hit.srcs, srcs))
          and all(a is b for a, b in zip(hit.dsts, dsts)))


def _plan_call(shapes, dtypes, srcs, dsts, options, out_dtypes, *, path, src_layouts,
               topology, chunking_for) -> CallPlan:
  """plan_call's work for a call not planned lately."""
  # A model's leaves mostly share their shapes, dtypes and shardings: each step below
  # runs once per distinct value (or object), not once per leaf (20,000 leaves).
  normal: dict[Any, tuple[int, ...]] = {}
  shapes = tuple(_normal_shape(s, normal) for s in shapes)
  dtypes = tuple(np.dtype(d) for d in dtypes)
  out_dtypes = tuple(dt if o is None else np.dtype(o)
                     for dt, o in zip(dtypes, out_dtypes or [None] * len(dtypes)))
  devices: dict[int, Any] = {}
  for s in {id(s): s for s in (*(srcs or ()), *dsts)}.values():
    for d in jax_compat.device_assignment(s):
      devices[d.id] = d
  platform = next(iter(devices.values())).platform if devices else "cpu"
  if topology is None:
    topology = as_topology(options.topology, devices.values() if devices else None)
  if src_layouts is None:
    src_layouts = _layouts(srcs, shapes)
  dst_layouts = _layouts(dsts, shapes)
  pairs = list(zip(dtypes, out_dtypes))
  distinct = {p: k for k, p in enumerate(dict.fromkeys(pairs))}
  sizes, codes = schedule.wire_itemsizes([a for a, _ in distinct],
                                         [b for _, b in distinct])
  itemsizes = [sizes[distinct[p]] for p in pairs]
  types = None if codes is None else tuple(codes[distinct[p]] for p in pairs)
  plan = plan_layouts(tuple(src_layouts), dst_layouts, itemsizes, topology, options,
                      chunking_for or platform, path=path)
  return CallPlan(shapes, dtypes, out_dtypes, tuple(srcs or ()), tuple(dsts), devices,
                  platform, topology, tuple(src_layouts), dst_layouts, types, options,
                  plan)


def _normal_shape(shape: Sequence[int], normal: dict[Any, tuple[int, ...]]
                  ) -> tuple[int, ...]:
  """`shape` as a tuple of ints; equal shapes (tuples) made once, into one object."""
  if type(shape) is not tuple:
    return tuple(int(d) for d in shape)
  got = normal.get(shape)
  if got is None:
    got = normal[shape] = tuple(int(d) for d in shape)
  return got


def _layouts(shardings: Sequence[Sharding], shapes: Sequence[tuple[int, ...]]
             ) -> tuple[Layout, ...]:
  """Per leaf, `Layout.from_sharding(sharding, shape)`: once per distinct pair of
  objects (`shapes` as `_normal_shape` made them share)."""
  made: dict[tuple[int, int], Layout] = {}
  out = []
  for s, shape in zip(shardings, shapes):
    key = (id(s), id(shape))  # both held by the arguments while this runs
    layout = made.get(key)
    if layout is None:
      layout = made[key] = Layout.from_sharding(s, shape)
    out.append(layout)
  return tuple(out)


def plan_layouts(src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout],
                 itemsizes: Sequence[int], topology: Topology, options: Options,
                 platform: str, *, path: str) -> Plan:
  """The plan between layouts already known (plan_call's last step). Logs the one
  debug line of every plan."""
  plan = plan_reshard(src_layouts, dst_layouts, itemsizes, topology, options.route,
                      chunking(platform, options.chunk_bytes))
  _log_plan(plan, len(dst_layouts), options, path)
  return plan


def _log_plan(plan: Plan, leaves: int, options: Options, path: str) -> None:
  """The one debug line of every plan (a cached one too)."""
  if logger.isEnabledFor(logging.DEBUG):  # the traffic summary costs a pass over the plan
    logger.debug("reshard: planned %d leaves, route %s, %d payload bytes, bytes by link "
                 "%s, devices %s (%s)", leaves, options.route, plan.payload_bytes,
                 plan.bytes_by_link, list(plan.devices), path)
