"""The per-device programs of one layout: building and compiling them (one small jitted
custom call per participating device), and running them as one reshard (dispatch,
waiting, errors, assembling the global outputs).

Owns one cache entry's contents; the cache and its key live in cache.py, the call
lifecycle in calls.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import logging
import operator
import os
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from jax_m2n._src import call_plan, collector
from jax_m2n._src import errors as errors_lib
from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.checks import check_transfer_guard
from jax_m2n._src.eager import dispatch
from jax_m2n._src.eager.calls import (TICKETS, Call, SiteState, cpu_module,
                                      dispatch_lock, failure_text, mark_issued,
                                      raise_failed_calls, reached_handler, run_guarded,
                                      state_of_site, ticket_scalars, tickets_of,
                                      wait_for_other_issuers)
from jax_m2n._src.eager.dispatch import (Outcomes, check_live, executor_of,
                                         gather_outcomes, wait_interruptibly)
from jax_m2n._src.errors import API, ReshardError, ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.planner import Plan
from jax_m2n._src.processes import call as processes_call
from jax_m2n._src.request import Request

logger = logging.getLogger("jax_m2n")

# The plan's debug line names the path: per-device programs, or across processes the
# transfer server (processes/ logs its part).
_PATH = "eager"


class Executable:
  """A device's compiled program (a jax.stages.Compiled), called through its runtime
  executable: `executable(*shards)` returns its outputs, one single-device array
  each, in order. JAX's own call of a Compiled checks every argument in Python on its
  first call (~14 ms for 107 operands and 857 results: 3.6 s of a 256-device first
  call) before its C++ path takes over; here every call is the runtime's, whose
  arguments the eager path has built itself (their devices, shapes and dtypes are the
  program's by construction; check_live has seen them alive)."""

  __slots__ = ("compiled", "base", "_parts", "_execute", "__weakref__")

  def __init__(self, compiled: Any, base: "Executable | None" = None,
               parts: tuple[Callable, Sequence[Any]] | None = None):
    self.compiled = compiled
    self.base = base  # the cached program this one makes other outputs of (kept alive)
    self._parts = jax_compat.runtime_parts(compiled) if base is None else parts
    self._execute = jax_compat.runtime_execute(compiled, self._parts)

  def __call__(self, *args: jax.Array) -> list[jax.Array]:
    return self._execute(args)

  def making(self, outputs: dict[int, tuple[Any, Sharding]]) -> "Executable | None":
    """The same program, whose output i of `outputs` comes out as the committed array
    of that (aval, sharding) (a leaf whose only shard it is: nothing to assemble); or
    None where this JAX cannot (the runtime call, or its result handler, is not
    there). One cached program serves entries of other destination shardings too."""
    if self._parts is None:
      return None
    execute, handlers = self._parts
    handlers = list(handlers)
    for i, (aval, sharding) in outputs.items():
      handlers[i] = jax_compat.result_handler(aval, sharding)
      if handlers[i] is None:
        return None
    return Executable(self.compiled, self.base or self, (execute, handlers))


@dataclasses.dataclass
class DeviceProgram:
  device: Any                                  # jax.Device
  call: Executable | None                      # the compiled per-device program
  operands: tuple[tuple[int, int], ...]        # (leaf, index into leaf's shards)
  results: tuple[int, ...]                     # leaves this device holds a dst shard of

  @functools.cached_property
  def tickets(self) -> Any:
    """The device's generation tickets (CPU; see TICKETS)."""
    return tickets_of(self.device)


def _x64_for(dtypes: Sequence[Any]) -> bool:
  """The jax_enable_x64 value the programs of these operand and result dtypes are
  traced under: the caller's, or True where a dtype is 64-bit while x64 is off (the
  trace would narrow it, and the program would refuse the actual arrays)."""
  x64 = bool(jax.config.jax_enable_x64)
  return x64 or any(jax.dtypes.canonicalize_dtype(d) != d for d in dtypes)


def _jitted(in_sig, out_sig, workspace: int, sched: np.ndarray, platform: str,
            attrs: dict, cpu_async: bool, sharding: Sharding) -> tuple[Any, list]:
  """One device's program before lowering: the jitted jax_m2n custom call over its
  shards (the CPU generation ticket last), its results and workspace, and its
  operands' types, all placed by `sharding` (one device's)."""
  in_types = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
              for shape, dtype in in_sig]
  if platform == "cpu":  # the generation ticket, last (see TICKETS)
    in_types.append(jax.ShapeDtypeStruct((), np.int32, sharding=sharding))
  out_types = [jax.core.ShapedArray(shape, dtype) for shape, dtype in out_sig]
  out_types.append(jax.core.ShapedArray((workspace,), np.uint8))
  # The workspace is a returned output, so XLA keeps the call on every device, even
  # on a source-only one. has_side_effect=True would do the same but costs 3-8x the
  # dispatch time (JAX leaves its C++ fast path for programs with effects).
  call = jax.ffi.ffi_call(m2n_ffi.TARGET_NAME, out_types, has_side_effect=False)

  def body(*shards):
    outs = tuple(call(*shards, schedule=sched, **attrs))
    if cpu_async:
      outs += (_async_token(outs[-1]),)
    return outs

  # The operands' types carry the device; explicit in/out shardings would put a
  # sharding annotation on every parameter and result, which doubled the compile of a
  # program of 857 results (0.22 -> 0.11 s CPU). A program without operands (a
  # destination-only device without a ticket) is placed by its outputs' sharding.
  jitted = jax.jit(body) if in_types else jax.jit(body, out_shardings=sharding)
  return jitted, in_types


def _lower(device, in_sig, out_sig, workspace: int, sched: np.ndarray, platform: str,
           attrs: dict, cpu_async: bool, x64: bool) -> Any:
  """One device's program, lowered for `device` (jax.stages.Lowered)."""
  jitted, in_types = _jitted(in_sig, out_sig, workspace, sched, platform, attrs,
                             cpu_async, _single_device_sharding(device))
  with jax.enable_x64(x64):
    return jitted.lower(*in_types)


def _lower_shared(in_sig, out_sig, workspace: int, sched: np.ndarray, platform: str,
                  attrs: dict, cpu_async: bool, x64: bool) -> Any:
  """The program of every device of one buffer signature, lowered once for no device
  in particular: `_compile_for_device` makes each device's from it. Tracing and
  lowering a program of ~1,000 buffers costs ~50 ms and holds the GIL; a device's copy
  with its own schedule costs ~2 ms."""
  jitted, in_types = _jitted(in_sig, out_sig, workspace, sched, platform, attrs,
                             cpu_async, jax_compat.one_device_abstract_sharding())
  with jax.enable_x64(x64):
    return jax_compat.lower_abstract(jitted, in_types, platform)


def _compile_for_device(shared: Any, sched: np.ndarray, device: Any) -> Any:
  """`device`'s compiled program: a copy of `shared` (from `_lower_shared`) with
  `sched` as its custom call's schedule, compiled with that device's assignment."""
  lowered = jax_compat.with_module(shared, lambda module: _set_schedule(module, sched))
  return lowered.compile(device_assignment=(device,))


def _set_schedule(module: Any, sched: np.ndarray) -> None:
  """Replaces the `schedule` attribute of the jax_m2n custom call in `module` (an MLIR
  module of `_jitted`'s program: one such call) by `sched`."""
  from jax._src.lib.mlir import ir  # the MLIR bindings JAX lowers with
  from jax.interpreters import mlir
  calls = [op for op in jax_compat.module_ops(module)
           if op.name == "stablehlo.custom_call" and ir.StringAttr(
               op.attributes["call_target_name"]).value == m2n_ffi.TARGET_NAME]
  if len(calls) != 1:
    raise ReshardRuntimeError(f"{API}: a lowered program must hold one "
                              f"{m2n_ffi.TARGET_NAME} call; got {len(calls)}.")
  op = calls[0]
  config = ir.DictAttr(op.attributes["mhlo.backend_config"])
  entries = {config[i].name: config[i].attr for i in range(len(config))}
  entries["schedule"] = mlir.ir_attribute(sched)  # as jax.ffi.ffi_call writes it
  op.attributes["mhlo.backend_config"] = ir.DictAttr.get(entries)


def _extent(box) -> tuple[int, ...]:
  return tuple(hi - lo for lo, hi in box)


# Compiled per-device programs by (device, schedule digest, buffers, attributes): shared
# by every cache entry of the same layouts while one holds them. Weak values: this map
# keeps nothing alive itself (a compiled program holds its schedule), so what stays
# resident is bounded by the entries' cache (cache.eager_cache) as before.
program_cache: "weakref.WeakValueDictionary[Any, Any]" = weakref.WeakValueDictionary()


@dataclasses.dataclass
class EagerReshard:
  """Everything one (shapes, dtypes, shardings, route, topology) needs, built once."""

  plan: Plan
  programs: list[DeviceProgram]
  out_avals: list[tuple[tuple[int, ...], Any, Sharding]]  # shape, dtype, dst sharding
  # Per leaf: for each of dst's addressable devices (in its order): (program, result).
  out_slots: list[list[tuple[int, int]]]
  src_shard_index: list[dict[int, int]]      # per leaf: device id -> index in _arrays
  platform: str
  site: int
  # True: the programs run asynchronously in XLA (CPU: PjRt's pool), so the calling
  # thread dispatches them one after another; False: each is dispatched from its
  # device's worker thread, concurrently (its dispatch may wait for its peers).
  caller_dispatch: bool = False
  x64: bool = False  # the jax_enable_x64 value the programs were traced under
  # Asynchronous CPU programs with peers (JAX_M2N_CPU_ASYNC=1): one issuing thread at a
  # time (calls.wait_for_other_issuers).
  one_issuer: bool = False
  # The leaves whose bytes move between devices: the device-to-device transfer guard
  # applies to a call that moves any (call_plan.CallPlan.crossing).
  crossing: tuple[int, ...] = ()
  avals: list[Any] = dataclasses.field(default_factory=list)  # per leaf, after call 1

  def __post_init__(self):
    self.avals = [None] * len(self.out_avals)
    self._gather: list[Callable[[list], Any]] | None = None  # _gatherers
    self._known: list[tuple[Any, Sharding]] | None = None  # per leaf (aval, sharding)
    self.device_ids = [p.device.id for p in self.programs]
    self._site_state: SiteState | None = None

  def site_state(self) -> "SiteState":
    """This site's generations (CPU), shared with every entry of the site."""
    if self._site_state is None:
      self._site_state = state_of_site(self.site)
    return self._site_state

  def __call__(self, leaves: Sequence[jax.Array], donate: bool | Sequence[bool],
               devices: Sequence[int] | None = None,
               block: bool = False) -> list[jax.Array]:
    """Dispatches the reshard and returns its outputs (not yet ready); `block` waits
    for completion and raises the call's error; `devices` (tests only) dispatches a
    subset (the rest are given up after the others finish) and returns [].

    Raises at once what is known before the programs run (an earlier call's failure,
    a dead shard, a failed dispatch; no partial outputs)."""
    raise_failed_calls()
    if self.crossing:
      check_transfer_guard(API, lambda: crossing_text(self.out_avals, self.crossing))
    # What the outputs are made of is read before the programs run: a first call
    # finishing meanwhile may hand one-device leaves to the handlers of later calls.
    known = self._known
    with collector.paused():  # a result per leaf per device: 55,000 at 64 x 856
      results, call = self._dispatch(leaves, devices)
      if block:
        self._wait(call, results)
      if devices is not None:
        return []
      donate_sources(leaves, donate)
      return self._assemble(results, known)

  # -- dispatch, waiting and failure handling -------------------------------------------

  def _dispatch(self, leaves: Sequence[jax.Array], devices: Sequence[int] | None
                ) -> tuple[list[Any], Call]:
    """Dispatches every program and returns their outputs with the call's record, or
    raises (after the dispatched programs have stopped) if a dispatch failed.

    On CPU each program's last operand is its generation ticket; its outputs end with
    a token the watchers wait on. A failure before the handler (here, or later inside
    XLA) gives the device's generation up at once: its peers fail in milliseconds, and
    every later call of the layout works.
    """
    shards = [jax_compat.single_device_arrays(x) for x in leaves]
    programs = self.programs
    if devices is not None:
      programs = [p for p in programs if p.device.id in devices]
    cpu = self.platform == "cpu"
    dispatch_lock.acquire()
    locked = True
    try:
      arguments = [[shards[t][k] for t, k in p.operands] for p in programs]
      del shards
      for p, args in zip(programs, arguments):  # before anything is dispatched
        check_live(p, args)
      if self.one_issuer:
        wait_for_other_issuers()
      call = Call(self, programs)
      if cpu:
        call.index = self.site_state().begin(cpu_module(), self.device_ids, call)
        if self.one_issuer:  # from here on, every way out finalizes the call
          mark_issued(call)
        scalars = ticket_scalars([p.tickets for p in programs], call.index % TICKETS)
        for args, scalar in zip(arguments, scalars):
          args.append(scalar)
      results: list[Any] = [None] * len(programs)
      try:
        if self.caller_dispatch:
          for i, (p, args) in enumerate(zip(programs, arguments)):
            try:
              results[i] = dispatch.run_device(p, args)  # tests wrap it
            except Exception as e:  # noqa: BLE001 - device i's failure
              call.errors[i] = e
              break
            call.dispatched[i] = True
        else:
          outcomes = Outcomes(len(programs))
          for i, (p, args) in enumerate(zip(programs, arguments)):
            executor_of(p.device.id).post(run_guarded, p, args, outcomes, i, call)
          # Each device's worker runs what is posted to it in order: a later call's
          # programs queue behind these on every device, so the lock is not held
          # while they run. Held, a call waiting for a peer that never comes kept
          # every later call of the process (the one whose ticket would have let
          # that device skip ahead, failing this call at once) waiting until its
          # timeout (issue 22, "healing race").
          dispatch_lock.release()
          locked = False
          try:
            wait_interruptibly(outcomes.done)
          except BaseException as interrupt:
            # The dispatches may be waiting for their peers: stop them first.
            call.abort(f"the calling thread was interrupted ({failure_text(interrupt)})")
            outcomes.done.wait()
            raise
          finally:
            results = outcomes.results
            for i, e in enumerate(outcomes.errors):
              call.errors[i] = e
              call.dispatched[i] = e is None
      except BaseException as interrupt:
        # Interrupted while dispatching: stop what runs, put every device back in step
        # (the watchers give up the rest), then let the interrupt through.
        call.abort(f"the calling thread was interrupted ({failure_text(interrupt)})")
        self._stop(call, results)
        raise
      del arguments
      if any(e is not None for e in call.errors):
        call.abort("another device's program failed to dispatch")
        self._stop(call, results)
        error = call.error
        raise error if error is not None else ReshardRuntimeError(
            f"{API}: {call.name} failed to dispatch.")
      call.watch([(i, outs[-1]) for i, outs in enumerate(results)])
    finally:
      if locked:
        dispatch_lock.release()
    return results, call

  def _stop(self, call: Call, results: Sequence[Any]) -> None:
    """After a failed dispatch: gives up the devices that did not dispatch, waits until
    the dispatched programs have stopped (milliseconds: their generation is aborted),
    and frees their outputs."""
    for i, d in enumerate(call.dispatched):
      if not d:
        call.give_up(i, failure_text(call.errors[i]) if call.errors[i] is not None
                     else "its program was not dispatched")
    call.watch([(i, results[i][-1]) for i, d in enumerate(call.dispatched) if d])
    call.done.wait()
    call.take_error()  # raised here, by the caller: not again by the next call
    for i, d in enumerate(call.dispatched):
      if d:
        for o in results[i] or ():
          o.delete()

  def _wait(self, call: Call, results: Sequence[Any]) -> None:
    """block=True: waits (interruptibly) until the call has finished; raises its error
    (outputs freed). Ctrl-C aborts the call's generation, waits until its programs have
    stopped and every device is back in step, then raises KeyboardInterrupt."""
    try:
      wait_interruptibly(call.done)
    except BaseException:
      call.abort("the calling thread was interrupted while waiting")
      call.done.wait()
      call.take_error()
      for outs in results:
        for o in outs or ():
          o.delete()
      raise
    error = call.take_error()
    if error is not None:
      for outs in results:
        for o in outs or ():
          o.delete()
      raise error

  def _error(self, programs: Sequence[DeviceProgram],
             failed: Sequence[BaseException | None],
             errors: Sequence[BaseException]) -> BaseException:
    """The error to raise: the root cause first (a device that failed before its
    handler: its own exception, named and chained, as a ReshardRuntimeError unless it
    is a ReshardError already), else the handler's (a timeout first)."""
    for p, e in zip(programs, failed):
      if e is None or reached_handler(e):
        continue
      if isinstance(e, ReshardError):
        return e
      error = ReshardRuntimeError(
          f"{API}: device {p.device.id} failed before the transfer started, so the "
          f"call failed on every device: {failure_text(e)}")
      error.__cause__ = e
      return error
    mapped = [errors_lib.map_native_error(e) for e in errors]
    k = next((i for i, m in enumerate(mapped) if isinstance(m, ReshardTimeoutError)), 0)
    mapped[k].__cause__ = errors[k]
    return mapped[k]

  # -- outputs --------------------------------------------------------------------------

  def _gatherers(self, results: Sequence[Any]) -> list[Callable[[list], Any]]:
    """Per leaf, what picks its per-device outputs out of all programs' outputs laid
    end to end (`out_slots` as flat indices; built on the first call: an
    operator.itemgetter per leaf halves the assembly of 856 leaves on 8 devices)."""
    if self._gather is None:
      start = np.cumsum([0] + [len(r) for r in results[:-1]]).tolist()
      gather = []
      for slots in self.out_slots:
        flat = [start[p] + r for p, r in slots]
        if len(flat) == 1:
          gather.append(lambda outs, i=flat[0]: (outs[i],))
        else:
          gather.append(operator.itemgetter(*flat) if flat else lambda outs: ())
      self._gather = gather
    return self._gather

  def _assemble(self, results: Sequence[Any], known: list | None) -> list[jax.Array]:
    """The global output arrays from the programs' per-device outputs; `known`: what
    `_known` was when they were dispatched."""
    every = list(itertools.chain.from_iterable(results))
    groups = [gather(every) for gather in self._gatherers(results)]
    if known is not None:  # every leaf's aval checked by an earlier call
      return jax_compat.arrays_of_known_layouts(known, groups)
    out = []
    checked: dict[Any, Any] = {}  # first call: one checked leaf per (shape, dtype, sharding)
    for t, ((shape, dtype, sharding), arrays) in enumerate(zip(self.out_avals, groups)):
      aval = self.avals[t]
      if aval is None:
        aval = self.avals[t] = checked.get((shape, dtype, sharding))
      if aval is not None:
        y = jax_compat.array_from_single_device_arrays(shape, sharding, arrays, dtype,
                                                       aval)
      else:  # checked by JAX, under the x64 value the programs were traced under
        with jax.enable_x64(self.x64):
          y = jax_compat.array_from_single_device_arrays(shape, sharding, arrays, dtype)
        self.avals[t] = checked[(shape, dtype, sharding)] = jax_compat.reusable_aval(y)
      out.append(y)
    if all(a is not None for a in self.avals):
      self._known = [(a, s) for a, (_, _, s) in zip(self.avals, self.out_avals)]
      self._make_one_device_leaves()
    return out

  def _make_one_device_leaves(self) -> None:
    """Once every aval is known: the leaves whose destination is one device get their
    array from their program's own result handler (C++), not from a second array
    built around it (856 leaves on one CPU device: 4.06 -> 0.28 ms a call). `_known`
    then says None for them. Where this JAX cannot, nothing changes."""
    per_program: dict[int, dict[int, tuple[Any, Sharding]]] = {}
    direct = set()  # the leaves
    for t, (slots, (aval, sharding)) in enumerate(zip(self.out_slots, self._known)):
      if len(slots) == 1 and len(sharding.device_set) == 1:
        p, r = slots[0]
        per_program.setdefault(p, {})[r] = (aval, sharding)
        direct.add(t)
    made = {p: self.programs[p].call.making(outs) for p, outs in per_program.items()}
    if not made or any(m is None for m in made.values()):
      return
    for p, call in made.items():
      self.programs[p].call = call
    # The programs first, then `_known`: a call that reads the new `_known` runs the
    # new programs.
    self._known = [(a, None if t in direct else s) for t, (a, s) in enumerate(self._known)]


def crossing_text(out_avals: Sequence[tuple[Any, Any, Sharding]],
                  crossing: Sequence[int]) -> str:
  """What a call moves between devices, for the transfer guard's error or log line:
  the first such leaf (JAX's form, `aval=..., dst_sharding=...`) and how many more."""
  shape, dtype, sharding = out_avals[crossing[0]]
  more = f" (and {len(crossing) - 1} more leaves)" if len(crossing) > 1 else ""
  aval = jax.core.ShapedArray(shape, dtype)
  return f"aval={aval!r}, dst_sharding={sharding}{more}"


def donate_sources(leaves: Sequence[jax.Array], donate: bool | Sequence[bool]) -> None:
  """Frees the sources marked for donation (one flag, or one per leaf) once the reshard
  has completed; an unmarked leaf is never touched."""
  flags = [donate] * len(leaves) if isinstance(donate, bool) else donate
  for x, flag in zip(leaves, flags):
    # Host data (numpy, Python scalars) is not JAX's to free: jax.device_put ignores it.
    if flag is True and isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()


@functools.lru_cache(maxsize=None)  # one per device: bounded by the device count
def _single_device_sharding(device) -> SingleDeviceSharding:
  """One SingleDeviceSharding per device, shared by every build: JAX's compile caches
  keep the shardings of the programs they hold, so fresh ones per build piled up
  (26k of them after 8,000 layouts, issue 14)."""
  return SingleDeviceSharding(device)


def build_programs(request: Request, dsts: Sequence[Sharding]) -> EagerReshard:
  """The per-device programs of `request` (its leaves' shapes, dtypes and layouts; no
  reference to the leaves is kept) into destination shardings `dsts`, compiled."""
  options = request.options
  planned = call_plan.plan_call([v.shape for v in request.leaves],
                                [v.dtype for v in request.leaves],
                                [v.sharding for v in request.leaves], dsts, options,
                                request.out_dtypes, path=_PATH)
  devices, platform, plan = planned.devices, planned.platform, planned.plan
  if platform == "cpu" and processes_call.spans_processes(devices.values()):
    # Devices of several processes on CPU: the cross-process engine (processes/).
    return processes_call.CrossProcessReshard(planned, request.treedef)
  shapes, dtypes, out_dtypes = planned.shapes, planned.dtypes, planned.out_dtypes
  srcs, types = planned.srcs, planned.types
  src_layouts, dst_layouts = planned.src_layouts, planned.dst_layouts
  timeout_ms = options.timeout_ms
  staging = platform != "cpu"
  m2n_ffi.ensure_registered(platform, timeout_ms)
  site = schedule.site_key(b"eager", schedule.plan_digest(plan, staging, types))
  bufs = schedule.buffers(plan)
  timeout = np.int64(timeout_ms)
  extra = m2n_ffi.transport_attrs(platform, planned.topology, plan.devices)
  if platform == "cpu":
    extra = {**extra, "tickets": np.int64(TICKETS)}

  local = [d for d in plan.devices if devices[d].process_index == jax.process_index()]
  src_shard_index = [
      {d.id: i for i, d in enumerate(jax_compat.addressable_device_assignment(s))} for s in srcs]
  x64 = _x64_for(dtypes + out_dtypes)
  cpu_async = platform == "cpu" and _CPU_ASYNC
  attrs = dict(site=np.int64(site), timeout_ms=timeout, **extra)
  attrs_key = tuple((k, v.tobytes() if isinstance(v, np.ndarray) else v)
                    for k, v in sorted(attrs.items()))
  # Each missing program is lowered on the lowering thread (tracing and lowering hold
  # the GIL) and compiled on the compile pool (XLA compiles without it) as soon as its
  # device's schedule is encoded here: compiles start with the first device, not after
  # the last one's encoding (256 devices: 2.5 s of encoding on this thread). On CPU the
  # devices of one buffer signature (shards of the same shapes and dtypes: a pipeline
  # stage's, a mesh's) share one lowering, copied per device with its own schedule.
  # Not on the calling thread: its thread-local contexts (a `jax.set_mesh` mesh above
  # all) are the caller's, not these programs'. The caller's `jax.enable_x64` is one
  # of them: the programs are traced under its value, or with x64 on where a leaf's
  # dtype needs it (an int64 array made while x64 was on, moved after it was turned
  # off, as jax.device_put moves it; the key says which). Each lowered module is freed
  # by its compile's pool thread once compiled: held until every compile was done, 256
  # of them added 1.8 GiB to the peak RSS.
  compile_pool = dispatch.build_pool("compile")
  lowering = dispatch.build_pool("lower")
  shared: dict[tuple, Any] = {}  # buffer signature -> its lowering (lowering thread only)

  def lower_then_compile(device, in_sig, out_sig, workspace: int,
                         sched: np.ndarray) -> concurrent.futures.Future:
    if platform != "cpu":
      # GPUs lower per device until a several-GPU run has checked the shared lowering
      # there (the one-GPU machine never has two devices of one signature).
      return compile_pool.submit(
          _lower(device, in_sig, out_sig, workspace, sched, platform, attrs, cpu_async,
                 x64).compile)
    sig = (in_sig, out_sig, workspace)
    if sig not in shared:
      shared[sig] = _lower_shared(in_sig, out_sig, workspace, sched, platform, attrs,
                                  cpu_async, x64)
    # The device's copy is made on the compile thread, just before its compile: made
    # here, every copy would wait in the pool's queue at once.
    return compile_pool.submit(_compile_for_device, shared[sig], sched, device)

  programs: list[DeviceProgram] = []
  pending: list[tuple[Any, concurrent.futures.Future]] = []  # (key, its lowering)
  result_index: dict[tuple[int, int], tuple[int, int]] = {}  # (leaf, dev) -> (prog, r)
  try:
    for dev_id in local:
      device = devices[dev_id]
      ops = bufs.operands.get(dev_id, {})
      res = bufs.results.get(dev_id, {})
      operand_leaves = sorted(ops, key=ops.get)
      result_leaves = sorted(res, key=res.get)
      in_sig = tuple((_extent(src_layouts[t].box_of(dev_id)), dtypes[t])
                     for t in operand_leaves)
      out_sig = tuple((_extent(dst_layouts[t].box_of(dev_id)), out_dtypes[t])
                      for t in result_leaves)
      workspace = max(1, schedule.workspace_bytes(plan, dev_id, staging, types))
      sched = schedule.encode(plan, dev_id, staging, types, local)  # this process's ops
      # A device's program depends on its schedule, its buffers and the call's
      # attributes only: later builds of the same layouts (another pytree of them, an
      # evicted entry) reuse it, compiling nothing.
      key = (platform, dev_id, hashlib.blake2b(sched, digest_size=16).digest(),
             sched.size, attrs_key, in_sig, out_sig, workspace, x64, cpu_async)
      for r, t in enumerate(result_leaves):
        result_index[(t, dev_id)] = (len(programs), r)
      call = program_cache.get(key)
      programs.append(DeviceProgram(
          device, call, tuple((t, src_shard_index[t][dev_id]) for t in operand_leaves),
          tuple(result_leaves)))
      if call is None:
        pending.append((key, lowering.submit(lower_then_compile, device, in_sig,
                                             out_sig, workspace, sched)))
  finally:
    # Every submitted build is finished, even when encoding a later device failed.
    lowered, errors = gather_outcomes([f for _, f in pending])
    compiled, compile_errors = gather_outcomes([f for f in lowered if f is not None])
  for e in errors + compile_errors:
    if e is not None:
      raise e
  missing = [i for i, p in enumerate(programs) if p.call is None]
  for (k, _), i, c in zip(pending, missing, compiled):
    programs[i].call = program_cache[k] = Executable(c)
  compiled = [p.call.compiled for p in programs]
  # A reshard within one device (e.g. a dtype conversion in place) has no peer to wait
  # for: the calling thread dispatches it (no hand-off to the device's worker).
  cpu_async = platform == "cpu" and _CPU_ASYNC and _cpu_async(compiled)
  caller_dispatch = len(plan.devices) == 1 or cpu_async

  out_avals, out_slots = [], []
  for t, (shape, dtype, dst) in enumerate(zip(shapes, out_dtypes, dsts)):
    out_avals.append((tuple(shape), dtype, dst))
    out_slots.append([result_index[(t, d.id)] 
                      for d in jax_compat.addressable_device_assignment(dst)])
  return EagerReshard(plan, programs, out_avals, out_slots, src_shard_index, platform,
                       site, caller_dispatch, x64,
                       one_issuer=cpu_async and len(plan.devices) > 1,
                       crossing=planned.crossing)


# Opt-in asynchronous eager reshards on CPU (docs/design.md, "Dispatch"): the programs
# then run in XLA's CPU client thread pool, where a program waiting for its peers can
# deadlock against an XLA multi-device program (a collective) running at the same time
# (the pool has one thread per device). Off by default: on CPU the call returns when the
# transfer has finished. Read when a layout's programs are built.
_CPU_ASYNC = os.environ.get("JAX_M2N_CPU_ASYNC", "") == "1"

# XLA's CPU client runs a program whose cost analysis counts fewer flops than this
# inline, on the calling thread, until it has finished (xla/pjrt/cpu/cpu_client.cc,
# `cheap_computation_`); a costlier one is queued on the client's thread pool (behind
# the device's earlier programs) and the call returns at once, its outputs not ready.
_XLA_CPU_CHEAP_FLOPS = 1000


def _async_token(workspace: jax.Array) -> jax.Array:
  """A 1-element output computed after the handler (2,048 flops, well under a
  microsecond): it makes XLA's CPU client run the program asynchronously, and it is what
  the watcher waits on. The custom call alone counts -1 flops, so XLA would run it
  inline and the caller would wait for the whole transfer."""
  v = workspace[:1].astype(np.float32)
  m = jax.numpy.broadcast_to(v, (16, 64)) @ jax.numpy.broadcast_to(v, (64,))
  return m[:1]


def _cpu_async(compiled: Sequence[Any]) -> bool:
  """Whether XLA's CPU client runs these programs asynchronously (then the calling
  thread dispatches them one after another and returns): async dispatch on, and every
  program costlier than XLA's inline threshold. Otherwise they are dispatched from
  the devices' worker threads, and a dispatch returns when its program has finished."""
  try:
    if not jax.config.values.get("jax_cpu_enable_async_dispatch", True):
      return False
    for c in compiled:
      cost = c.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      if not cost or float(cost.get("flops", 0.0)) < _XLA_CPU_CHEAP_FLOPS:
        return False
  except Exception:  # noqa: BLE001 - no cost analysis: the safe (concurrent) dispatch
    logger.debug("reshard: no cost analysis; per-device worker dispatch", exc_info=True)
    return False
  return True
