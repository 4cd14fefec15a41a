"""One cross-process reshard layout, built once and called many times: the plan every
process derives alike, this process's waves of it, the fingerprint, the outputs.

Owns the lifecycle of a call across processes: number it, agree on the arguments, run
this process's waves, wait until every participant is done, assemble the global
outputs, donate. A process with no participating device posts its fingerprint and
returns at once. Argument rules stay in checks.py; what moves is the planner's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import jax

from jax_m2n._src import call_plan
from jax_m2n._src import checks
from jax_m2n._src import jax_compat
from jax_m2n._src.errors import API as _API
from jax_m2n._src.errors import (PeerFailed, ReshardError, ReshardRuntimeError,
                                 ReshardValueError)
from jax_m2n._src.layout import Layout
from jax_m2n._src.processes import bootstrap, programs, sequence, transfer_engine

logger = logging.getLogger("jax_m2n")

# One cross-process call at a time per process: call numbers are taken in call order,
# and two threads' calls interleaved differently on two processes would pair wrongly.
_call_lock = threading.Lock()


def spans_processes(devices) -> bool:
  """Whether some of `devices` belong to another process than this one."""
  me = jax.process_index()
  return any(d.process_index != me for d in devices)


def _layout_key(layout: Layout) -> tuple:
  return tuple(layout.shards())


class CrossProcessReshard:
  """Everything one planned call (shapes, dtypes, shardings, options) needs across
  processes; `entry(leaves, donate)` runs one call (the eager cache's contract)."""

  def __init__(self, call: call_plan.CallPlan, treedef: Any = None):
    """`call`: the call's plan (`call_plan.plan_call`); `treedef`: its pytree structure
    (part of the fingerprint every participant compares)."""
    options, topo = call.options, call.topology
    devices = call.devices
    self.devices = devices
    # What the eager cache reads of any entry (eager/cache._Grouped): a large pytree
    # runs as several such calls, numbered alike on every process.
    self.platform = "cpu"
    self.caller_dispatch = False
    self.out_avals = [(sh, o, d) for sh, o, d in zip(call.shapes, call.out_dtypes,
                                                       call.dsts)]
    self.timeout_ms = options.timeout_ms
    self.crossing = call.crossing
    self.shapes = list(call.shapes)
    self.out_dtypes = list(call.out_dtypes)
    self.dsts = list(call.dsts)
    self.srcs = list(call.srcs)
    process_of = bootstrap.process_of_device()
    self.process_of = process_of
    self.me = jax.process_index()
    self.participants = sorted({process_of[d] for d in devices})
    self.avals: list[Any] = [None] * len(self.shapes)  # per leaf, after a checked call
    self.src_layouts = list(call.src_layouts)
    self.dst_layouts = list(call.dst_layouts)
    self.wire = call.wire_dtypes
    self.plan = call.plan
    self.network_bytes = transfer_engine.network_bytes(self.plan, process_of)
    self.fingerprint = sequence.fingerprint({
        "pytree structure": str(treedef) if treedef is not None else len(call.shapes),
        "shapes": self.shapes, "dtypes": sequence.distinct(call.dtypes, str),
        "destination dtypes": sequence.distinct(call.out_dtypes, str),
        "source shardings": sequence.distinct(self.src_layouts, _layout_key),
        "destination shardings": sequence.distinct(self.dst_layouts, _layout_key),
        "route": options.route, "topology": repr(topo),
        "chunk_bytes": self.plan.chunking})
    self.waves = (transfer_engine.waves_of(self.plan, self.me, process_of)
                  if self.me in self.participants else [])
    self.local_dst = [list(jax_compat.addressable_device_assignment(d)) for d in self.dsts]
    self.src_index = [{d.id: i for i, d in enumerate(
        jax_compat.addressable_device_assignment(s))} for s in self.srcs]
    # This process's programs, once per plan (compiled by the first call).
    self.schedule = programs.build(
        self.waves, len(self.shapes), call.dtypes, self.out_dtypes, self.wire,
        self.src_layouts, self.dst_layouts, self.src_index, self.local_dst, devices)
    bootstrap.engine().server  # every process of the job serves (peers pull from it)
    if logger.isEnabledFor(logging.DEBUG):
      logger.debug("reshard: %d of the planned bytes cross processes %s (transfer "
                   "server)", self.network_bytes, self.participants)

  def __call__(self, leaves: Sequence[jax.Array], donate: bool | Sequence[bool],
               devices: Sequence[int] | None = None, block: bool = False
               ) -> list[jax.Array]:
    """One call: returns the global outputs once every participant is done (the
    result is ready: the engine's transfers have completed). `devices`/`block` are the
    in-process entries' test hooks; here every call blocks and runs every device.
    The device-to-device transfer guard is asked first (every process must set it
    alike, as every other argument: a refusing process fails its peers by timeout)."""
    if self.crossing:
      checks.check_transfer_guard(_API, lambda: f"{len(self.crossing)} leaves across "
                                  f"processes {self.participants}")
    with _call_lock:
      return self._call(leaves, donate)

  def _call(self, leaves, donate) -> list[jax.Array]:
    if len(self.participants) == 1:  # all in another process: that one runs it alone
      return self._assemble([[] for _ in self.shapes])
    # Every process numbers the calls that span processes.
    n = sequence.next_call(takes_part=self.me in self.participants)
    if self.me not in self.participants:
      return self._assemble([[] for _ in self.shapes])
    waits = sequence.CallWaits(n, self.participants, self.timeout_ms)
    names = lambda: f"{len(leaves)} leaves"  # noqa: E731
    try:
      waits.post("fp", self.fingerprint)
      run = transfer_engine.Run(self.schedule, self._slots(leaves), waits,
                                self.fingerprint)
      run.request()  # waits at the senders until they offer: no byte moves yet
      waits.agree(self.fingerprint, names)
      run.offer()
      run.wait(run.copy_inputs())  # the pulls, and what the local copies read
      arrays = run.assemble()
      run.settle([a for per_leaf in arrays for a in per_leaf])
      waits.end()  # every participant done (a call succeeds or fails everywhere)
      waits.finish()
    except BaseException as e:
      self._failed(waits, e)
      if isinstance(e, Exception) and not isinstance(e, ReshardError):
        raise ReshardRuntimeError(
            f"{_API}: cross-process call #{n} failed on process {self.me}: "
            f"{type(e).__name__}: {e}") from e
      raise
    out = self._assemble(arrays)
    flags = [donate] * len(leaves) if isinstance(donate, bool) else donate
    for x, flag in zip(leaves, flags):
      if flag is True and not x.is_deleted():
        x.delete()
    return out

  def _failed(self, waits, e: BaseException) -> None:
    """A failed call: the peers learn it (unless every process raises on its own: a
    fingerprint mismatch, or a relayed failure), pending pulls fail and connections
    are made afresh by the next call."""
    if isinstance(e, ReshardValueError):  # every process raises it on its own
      waits.close_outcome()
    elif not isinstance(e, PeerFailed):
      waits.fail(f"{type(e).__name__}: {e}")
    waits.finish(failed=True)
    bootstrap.engine().drop_connections()

  def _slots(self, leaves) -> list:
    """The call's slots (programs.Schedule), its source shards filled in."""
    slots: list = [None] * self.schedule.slots
    held: dict[int, list] = {}
    for s, t, i in self.schedule.sources:
      arrays = held.get(t)
      if arrays is None:
        arrays = held[t] = jax_compat.single_device_arrays(leaves[t])
      slots[s] = arrays[i]
    return slots

  def _assemble(self, arrays) -> list[jax.Array]:
    """The global outputs from this process's shards of them: checked by JAX the
    first time, then built from that abstract value (the checks cost most of the
    host time of a call's thousand shards)."""
    out = []
    for t, (shape, dst, arrs, dt) in enumerate(zip(self.shapes, self.dsts, arrays,
                                                   self.out_dtypes)):
      y = jax_compat.array_from_single_device_arrays(shape, dst, arrs, dt, self.avals[t])
      if self.avals[t] is None:
        self.avals[t] = jax_compat.reusable_aval(y)
      out.append(y)
    return out
