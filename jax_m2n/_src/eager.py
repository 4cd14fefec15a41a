"""The eager path: one small compiled program per participating device, any device sets.

Owns building (and caching) the per-device programs of a reshard outside jit,
dispatching them concurrently (one thread per device), and assembling their outputs
into global arrays. Argument rules live in checks.py; it never decides what moves.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import jax_compat
from jax_m2n._src import schedule
from jax_m2n._src.checks import (_API, _check_dtype, _check_holds, _check_in_process,
                                 _check_memory_kind, _check_mesh, _check_reduction,
                                 _check_topology, _dst_sharding_of,
                                 _map_native_error, _platform_of, _same_layout, _site,
                                 _topology_key)
from jax_m2n._src.errors import (ReshardError, ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardTypeError, ReshardValueError)
from jax_m2n._src.layout import Layout
from jax_m2n._src.planner import Plan, plan_reshard
from jax_m2n._src.processes import call as processes_call
from jax_m2n._src.topology import as_topology

logger = logging.getLogger("jax_m2n")

# ---------------------------------------------------------------------------------------
# Eager: one small program per participating device, dispatched from per-device threads
# ---------------------------------------------------------------------------------------

class _Worker:
  """A thread of one device: its "dev" worker dispatches its programs where a dispatch
  may wait for the device's peers (and compiles them); its "watch" worker waits for
  their completion, in order, and records their errors.

  A handler that waits for its peers inside the dispatch (CUDA's host rendezvous; CPU
  where XLA runs the program inline) needs the programs of one reshard dispatched
  concurrently: dispatched one after another from one Python thread they run one after
  another and the first waits forever (DESIGN.md, "Dispatch"). One thread per device,
  reused by every call (starting threads per call would cost more than a 1 KiB reshard).
  A bare queue, not a ThreadPoolExecutor: a call posts its programs without futures
  (executor.submit and waiting on futures cost about 10 us per device per call).
  """

  def __init__(self, device_id: int, role: str = "dev"):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._loop, name=f"jax_m2n-{role}{device_id}",
                                    daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while True:
      fn, args = self._queue.get()
      if fn is None:  # stop() at interpreter exit
        return
      try:
        fn(*args)  # fn reports its own outcome (post) or sets its future's (submit)
      except BaseException:  # noqa: BLE001 - never reached by post/submit's callers;
        logger.exception("reshard: a device worker's task raised")  # keep the thread
      del fn, args

  def stop(self) -> None:
    """Asks the thread to end once the tasks already posted have run."""
    self._queue.put((None, None))

  def post(self, fn: Callable[..., None], *args: Any) -> None:
    """Runs fn(*args) on this thread; fn must not raise (it records its own errors)."""
    self._queue.put((fn, args))

  def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs fn(*args) on this thread; its result or exception in the returned future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
      if not future.set_running_or_notify_cancel():
        return
      try:
        future.set_result(fn(*args))
      except BaseException as e:  # noqa: BLE001 - the future carries it
        future.set_exception(e)
    self.post(run)
    return future


def _executor(device_id: int) -> _Worker:
  """Device `device_id`'s worker, made on first use."""
  ex = _executors.get(device_id)
  if ex is None:
    with _executors_lock:
      ex = _executors.get(device_id)
      if ex is None:
        ex = _executors[device_id] = _Worker(device_id)
  return ex


_executors: dict[int, _Worker] = {}
_executors_lock = threading.Lock()


def _outcomes(futures: Sequence[concurrent.futures.Future]
              ) -> tuple[list[Any], list[BaseException | None]]:
  """Waits for every future; returns (results, errors), None where there is none."""
  concurrent.futures.wait(futures)
  errors = [f.exception() for f in futures]
  results = [f.result() if e is None else None for f, e in zip(futures, errors)]
  return results, errors


# How often a waiting thread wakes: waits are in Python (not in a native call), so
# Ctrl-C reaches them at once; the period only bounds how late a signal handler that
# does not raise is noticed.
_WAIT_PERIOD_S = 0.25


def _wait_interruptibly(event: "threading.Event | _Latch") -> None:
  """Waits for `event` in Python, waking every _WAIT_PERIOD_S (Ctrl-C raises)."""
  while not event.wait(_WAIT_PERIOD_S):
    pass


class _Latch:
  """A one-shot event: set() once, wait() by any number of threads. A bare lock held
  until set; made per call, where a threading.Event (a Condition over an RLock) costs
  about 4 us of a 50 us call."""

  __slots__ = ("_lock",)

  def __init__(self):
    self._lock = threading.Lock()
    self._lock.acquire()

  def set(self) -> None:
    """Opens the latch; must be called at most once."""
    self._lock.release()

  def is_set(self) -> bool:
    return not self._lock.locked()

  def wait(self, timeout: float | None = None) -> bool:
    """Whether the latch is open, waiting up to `timeout` seconds (None: no bound)."""
    if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
      return False
    self._lock.release()  # let the next waiter through
    return True


class _Outcomes:
  """What the worker threads report of one call's programs (worker dispatch): each
  program's outputs or error; the last one to finish wakes the caller (one Event:
  cheaper than waiting on futures)."""

  def __init__(self, n: int):
    self.results: list[Any] = [None] * n
    self.errors: list[BaseException | None] = [None] * n
    self._left = n
    self._lock = threading.Lock()
    self.done = _Latch()
    if not n:
      self.done.set()

  def finished(self) -> None:
    with self._lock:
      self._left -= 1
      if not self._left:
        self.done.set()


# Fault injection for tests (tests/failure_test.py, tests/async_test.py): called with
# (device id, phase) on the thread that dispatches a device's program, where phase is
# "dispatch" (before its program is dispatched); whatever it raises is that device's
# failure. None in normal use.
_fault_hook: Callable[[int, str], None] | None = None


# One eager dispatch at a time per process: interleaving two calls' per-device programs
# from several user threads could order them differently on different devices. Only
# the dispatch holds it: the programs run (and finish) without it.
_dispatch_lock = threading.Lock()

# The CPU handler's generation tickets (xla_ffi/cpu_transport.h, CpuCall::ticket): each
# eager program's last operand is a device scalar naming its call's generation modulo
# _TICKETS, so that a device whose earlier program failed before its handler ran never
# joins that earlier call's generation. At most _MAX_IN_FLIGHT calls of one site run
# at once (a further call waits for the oldest), so tickets are never ambiguous.
_TICKETS = 64
_MAX_IN_FLIGHT = _TICKETS // 2


@functools.lru_cache(maxsize=None)  # one list per device: bounded by the device count
def _tickets(device) -> list[jax.Array]:
  """Device scalars 0.._TICKETS-1 on `device`, made once and reused by every call."""
  # Made under jax.transfer_guard("allow"): these host -> device copies are jax_m2n's
  # own, not the caller's data, and must not trip a caller's guard (tunix wraps its
  # weight sync in transfer_guard("disallow_explicit")).
  with jax.transfer_guard("allow"):
    return jax.device_put([np.int32(k) for k in range(_TICKETS)], device)


@dataclasses.dataclass
class _DeviceProgram:
  device: Any                                  # jax.Device
  call: Callable[..., Any]                     # the compiled per-device program
  operands: tuple[tuple[int, int], ...]        # (leaf, index into leaf's shards)
  results: tuple[int, ...]                     # leaves this device holds a dst shard of
  schedule: np.ndarray

  @functools.cached_property
  def tickets(self) -> list[jax.Array]:
    """The device's generation tickets (CPU; see _TICKETS)."""
    return _tickets(self.device)


def _compile(jitted, in_types, x64: bool) -> Callable[..., Any]:
  with jax.enable_x64(x64):
    return jitted.lower(*in_types).compile()


def _run_device(prog: _DeviceProgram, args: list) -> list:
  """Dispatches one device's program; returns its outputs (not yet ready: errors of
  the transfer surface when they are waited on)."""
  if _fault_hook is not None:
    _fault_hook(prog.device.id, "dispatch")
  _check_live(prog, args)
  return prog.call(*args)


def _check_live(prog: _DeviceProgram, args: list) -> None:
  """Every input buffer of a device's program must be alive: a shard deleted behind the
  global array's back (its buffer donated to another jit; `x.is_deleted()` is then still
  False) would otherwise fail inside JAX, before the handler."""
  for (leaf, _), a in zip(prog.operands, args):
    if a.is_deleted():
      raise ReshardValueError(
          f"{_API}: every source shard must be alive; got a deleted buffer for leaf "
          f"{leaf} on device {prog.device.id} (deleted or donated behind the array's "
          "back, e.g. by another jit's donate_argnums).")


def _reached_handler(e: BaseException) -> bool:
  """Whether a program's error came from the jax_m2n handler (its messages name it)."""
  return "jax_m2n_reshard" in str(e)


def _failure_text(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  return text if len(text) <= 2000 else text[:2000] + "..."


class _Watcher:
  """The one thread that waits for the eager calls' programs to finish and records
  what they ended with (_Call.settle). A call hands over its programs' tokens with
  one append (no thread hand-off per device); the thread polls their readiness
  (is_ready, backing off from 0.1 to 2 ms while nothing finishes), so a device whose
  program failed before its handler (e.g. out of memory allocating its outputs inside
  XLA) is seen, and its generation given up, within milliseconds even while its peers
  wait for it - a blocking wait on one peer's output would see it only at the timeout.
  """

  _POLL_MIN_S = 1e-4
  _POLL_MAX_S = 2e-3

  def __init__(self):
    self._pending: collections.deque = collections.deque()
    self._wake = threading.Event()
    self._stopping = False
    self._thread = threading.Thread(target=self._loop, name="jax_m2n-watch", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Asks the thread to end (at interpreter exit: what it still watches is not
    settled)."""
    self._stopping = True
    self._wake.set()

  def add(self, call: "_Call", tokens: Sequence[tuple[int, Any]]) -> None:
    self._pending.append((call, tokens))
    self._wake.set()

  def _loop(self) -> None:
    active: list[tuple[Any, int, Any]] = []
    delay = self._POLL_MIN_S
    while not self._stopping:
      if not active:
        self._wake.wait()
      if self._stopping:
        return
      self._wake.clear()
      while self._pending:
        call, tokens = self._pending.popleft()
        active.extend((call, i, t) for i, t in tokens)
      still = []
      entry = token = None
      for entry in active:
        call, i, token = entry
        try:
          ready = token.is_ready()
        except BaseException:  # noqa: BLE001 - settle() records it
          ready = True
        if ready:
          call.settle(i, token)
        else:
          still.append(entry)
      progressed = len(still) < len(active)
      active = still
      entry = token = still = call = tokens = None  # hold no finished output
      if active:
        delay = self._POLL_MIN_S if progressed else min(2 * delay, self._POLL_MAX_S)
        self._wake.wait(delay)


_watcher_instance: list[_Watcher] = []


@atexit.register
def _stop_threads_at_exit() -> None:
  """Ends jax_m2n's threads while the interpreter still runs. A daemon thread caught at
  finalization inside a native call (the watcher polling an output's is_ready) is
  unwound through C++ frames that do not rethrow, and the process aborts ("FATAL:
  exception not rethrown", seen with JAX_M2N_CPU_ASYNC=1 on jax 0.11.2)."""
  threads = [*_watcher_instance, *_executors.values()]
  for t in threads:
    t.stop()
  deadline = time.monotonic() + 2.0  # a thread stuck in a transfer does not hold exit
  for t in threads:
    t._thread.join(max(0.0, deadline - time.monotonic()))  # noqa: SLF001 - this module's


def _watcher() -> _Watcher:
  if not _watcher_instance:
    with _executors_lock:
      if not _watcher_instance:
        _watcher_instance.append(_Watcher())
  return _watcher_instance[0]


# Calls that failed after returning, not yet raised by jax_m2n: the next eager reshard
# raises them (before it moves anything).
_failed_calls: collections.deque = collections.deque()
_failed_lock = threading.Lock()
_call_counter = itertools.count(1)


def _raise_failed_calls() -> None:
  """Raises (once) the error of earlier calls that failed after they returned."""
  if not _failed_calls:
    return
  with _failed_lock:
    calls = list(_failed_calls)
    _failed_calls.clear()
  if not calls:
    return
  first = calls[0]
  more = (f" ({len(calls) - 1} later call(s) failed too: "
          f"{', '.join(c.name for c in calls[1:])})" if len(calls) > 1 else "")
  error = type(first.error)(
      f"{_API}: an earlier asynchronous call, {first.name}, failed after it returned "
      f"(its outputs carry the error); this call did not run{more}: {first.error}")
  error.__cause__ = first.error
  raise error


class _SiteState:
  """The generations of one CPU site (one plan): the next one to hand out and the calls
  still running. Guarded by _dispatch_lock (begin) and its own lock (end)."""

  def __init__(self, site: int):
    self.site = site
    self.next = 0
    self.in_flight: collections.deque = collections.deque()
    self.lock = threading.Lock()

  def begin(self, module: Any, device_ids: Sequence[int], call: "_Call") -> int:
    """The generation of a new call on `device_ids` (under _dispatch_lock)."""
    while len(self.in_flight) >= _MAX_IN_FLIGHT:
      _wait_interruptibly(self.in_flight[0].done)
    with self.lock:
      idle = not self.in_flight
      self.in_flight.append(call)
    if idle:
      # Nothing of this site runs: the devices' join counts are final. Bring any device
      # an earlier failure left behind level with the rest (healed).
      counts = module.joined(self.site, list(device_ids))
      top = max(max(counts, default=0), self.next)
      behind = [d for d, c in zip(device_ids, counts) for _ in range(top - c)]
      if behind:
        module.abandon(self.site, behind, "the device was behind its peers after an "
                       "earlier failed call (healed)")
      self.next = top
    index = self.next
    self.next += 1
    return index

  def end(self, call: "_Call") -> None:
    with self.lock:
      self.in_flight.remove(call)


_site_states: dict[int, _SiteState] = {}


@functools.lru_cache(maxsize=1)
def _cpu_module() -> Any:
  """The CPU extension module (m2n_ffi.load imports by name on every call)."""
  return m2n_ffi.load("cpu")


def _site_state(site: int) -> _SiteState:
  s = _site_states.get(site)
  if s is None:
    s = _site_states[site] = _SiteState(site)
  return s


class _Call:
  """One eager reshard after dispatch: which programs run, in which generation, and
  what they ended with. The watcher threads fill it in; the last one finalizes it."""

  def __init__(self, entry: "_EagerReshard", programs: Sequence[_DeviceProgram]):
    self.entry = entry
    self.programs = list(programs)
    self.seq = next(_call_counter)
    self.index = -1                      # the CPU generation
    self.errors: list[BaseException | None] = [None] * len(programs)
    self.dispatched = [False] * len(programs)
    self.error: BaseException | None = None
    self.raised = False                  # raised to the user by jax_m2n already
    self.done = _Latch()
    self._left = 0
    self._lock = threading.Lock()

  @property
  def name(self) -> str:
    where = f"site {self.entry.site}"
    if self.index >= 0:
      where += f", generation {self.index}"
    return (f"eager reshard #{self.seq} ({where}, devices "
            f"{sorted(p.device.id for p in self.programs)})")

  def give_up(self, i: int, cause: str) -> None:
    """Program i will not (or did not) reach the handler: its peers fail now."""
    state = self.entry
    if state.platform == "cpu" and self.index >= 0:
      m2n_ffi.load("cpu").abandon_generation(
          state.site, [self.programs[i].device.id], self.index,
          f"its program failed before the handler ran: {cause}")

  def abort(self, cause: str) -> None:
    """Aborts this call's generation on every device (e.g. the caller was interrupted)."""
    state = self.entry
    if state.platform == "cpu" and self.index >= 0:
      m2n_ffi.load("cpu").abort(state.site, self.index,
                                [p.device.id for p in state.programs], cause)

  def watch(self, tokens: Sequence[tuple[int, Any]]) -> None:
    """Hands the dispatched programs' tokens (program index, last output) to the
    watcher thread, which settles each when it is ready; settles them here at once
    where every one is ready already (a blocking CPU call: XLA ran the programs inline),
    saving the watcher's wake-up (about 80 us of a tiny call on a loaded 2-core host:
    the woken thread takes the GIL and a core from the caller)."""
    self._left = len(tokens)
    if not tokens:
      self._finalize()
      return
    for _, token in tokens:
      try:
        if not token.is_ready():
          break
      except BaseException:  # noqa: BLE001 - settle() records it
        pass
    else:
      for i, token in tokens:
        self.settle(i, token)
      return
    _watcher().add(self, tokens)

  def settle(self, i: int, token: Any) -> None:
    """Program i has finished (on the watcher thread): records its error, if any (and
    gives its generation up where its handler never ran); the last one finalizes."""
    try:
      token.block_until_ready()
    except BaseException as e:  # noqa: BLE001 - the call's error, recorded
      self.errors[i] = e
      try:
        self.give_up(i, _failure_text(e))  # a no-op where the handler ran
      except BaseException:  # noqa: BLE001 - keep the watcher alive
        logger.exception("reshard: abandoning a failed device's generation failed")
    finally:
      with self._lock:
        self._left -= 1
        last = not self._left
      if last:
        self._finalize()

  def _finalize(self) -> None:
    entry = self.entry
    try:
      if entry.platform == "cpu" and self.index >= 0 and (
          len(self.programs) != len(entry.programs) or not all(self.dispatched)):
        # Devices never dispatched (tests: a peer that never comes) give up only now,
        # so their peers time out as they would for a device that never came.
        ran = {p.device.id for p, d in zip(self.programs, self.dispatched) if d}
        absent = [p.device.id for p in entry.programs if p.device.id not in ran]
        if absent:
          m2n_ffi.load("cpu").abandon_generation(entry.site, absent, self.index,
                                                 "its program was not dispatched")
      errors = [e for e in self.errors if e is not None]
      sticky = m2n_ffi.sticky_error(entry.platform)
      if sticky is not None:
        errors.append(ReshardError(sticky))
      if errors:
        self.error = entry._error(self.programs, self.errors, errors)
        with _failed_lock:
          if not self.raised:
            _failed_calls.append(self)
    except BaseException as e:  # noqa: BLE001 - never leave a waiter hanging
      self.error = self.error or ReshardRuntimeError(
          f"{_API}: {self.name} could not be checked: {_failure_text(e)}")
    finally:
      if entry.platform == "cpu":
        entry.site_state().end(self)
      self.done.set()

  def take_error(self) -> BaseException | None:
    """The call's error, if any, marked as raised (the next reshard will not)."""
    with _failed_lock:
      self.raised = True
      try:
        _failed_calls.remove(self)
      except ValueError:
        pass
    return self.error


def _run_guarded(prog: _DeviceProgram, args: list, outcomes: _Outcomes, i: int,
                 call: "_Call") -> None:
  """Dispatches program i on its device's worker thread (worker dispatch), its outputs
  or error into `outcomes`; a failure before the handler gives the device's generation
  up at once (its peers, possibly waiting inside their own dispatch, fail now)."""
  try:
    outcomes.results[i] = _run_device(prog, args)
  except BaseException as e:  # noqa: BLE001 - every failure is the call's to raise
    outcomes.errors[i] = e
    try:
      call.give_up(i, _failure_text(e))  # a no-op where the handler ran
    except BaseException as give_up_error:  # noqa: BLE001 - raised in e's place
      outcomes.errors[i] = give_up_error
  finally:
    outcomes.finished()


@dataclasses.dataclass
class _EagerReshard:
  """Everything one (shapes, dtypes, shardings, route, topology) needs, built once."""

  plan: Plan
  programs: list[_DeviceProgram]
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
  avals: list[Any] = dataclasses.field(default_factory=list)  # per leaf, after call 1

  def __post_init__(self):
    self.avals = [None] * len(self.out_avals)
    self.device_ids = [p.device.id for p in self.programs]
    self._site_state: _SiteState | None = None

  def site_state(self) -> "_SiteState":
    """This site's generations (CPU), shared with every entry of the site."""
    if self._site_state is None:
      self._site_state = _site_state(self.site)
    return self._site_state

  def __call__(self, leaves: Sequence[jax.Array], donate: bool | Sequence[bool],
               devices: Sequence[int] | None = None,
               block: bool = False) -> list[jax.Array]:
    """Dispatches the reshard and returns its outputs (not yet ready); `block` waits
    for completion and raises the call's error; `devices` (tests only) dispatches a
    subset (the rest are given up after the others finish) and returns [].

    Raises at once what is known before the programs run (an earlier call's failure,
    a dead shard, a failed dispatch; no partial outputs)."""
    _raise_failed_calls()
    results, call = self._dispatch(leaves, devices)
    if block:
      self._wait(call, results)
    if devices is not None:
      return []
    _donate(leaves, donate)
    return self._assemble(results)

  # -- dispatch, waiting and failure handling -------------------------------------------

  def _dispatch(self, leaves: Sequence[jax.Array], devices: Sequence[int] | None
                ) -> tuple[list[Any], _Call]:
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
    with _dispatch_lock:
      arguments = [[shards[t][k] for t, k in p.operands] for p in programs]
      del shards
      for p, args in zip(programs, arguments):  # before anything is dispatched
        _check_live(p, args)
      call = _Call(self, programs)
      if cpu:
        call.index = self.site_state().begin(_cpu_module(), self.device_ids, call)
        ticket = call.index % _TICKETS
        for p, args in zip(programs, arguments):
          args.append(p.tickets[ticket])
      results: list[Any] = [None] * len(programs)
      try:
        if self.caller_dispatch:
          for i, (p, args) in enumerate(zip(programs, arguments)):
            try:
              results[i] = _run_device(p, args)
            except Exception as e:  # noqa: BLE001 - device i's failure
              call.errors[i] = e
              break
            call.dispatched[i] = True
        else:
          outcomes = _Outcomes(len(programs))
          for i, (p, args) in enumerate(zip(programs, arguments)):
            _executor(p.device.id).post(_run_guarded, p, args, outcomes, i, call)
          try:
            _wait_interruptibly(outcomes.done)
          except BaseException as interrupt:
            # The dispatches may be waiting for their peers: stop them first.
            call.abort(f"the calling thread was interrupted ({_failure_text(interrupt)})")
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
        call.abort(f"the calling thread was interrupted ({_failure_text(interrupt)})")
        self._stop(call, results)
        raise
      del arguments
      if any(e is not None for e in call.errors):
        call.abort("another device's program failed to dispatch")
        self._stop(call, results)
        error = call.error
        raise error if error is not None else ReshardRuntimeError(
            f"{_API}: {call.name} failed to dispatch.")
      call.watch([(i, outs[-1]) for i, outs in enumerate(results)])
    return results, call

  def _stop(self, call: _Call, results: Sequence[Any]) -> None:
    """After a failed dispatch: gives up the devices that did not dispatch, waits until
    the dispatched programs have stopped (milliseconds: their generation is aborted),
    and frees their outputs."""
    for i, d in enumerate(call.dispatched):
      if not d:
        call.give_up(i, _failure_text(call.errors[i]) if call.errors[i] is not None
                     else "its program was not dispatched")
    call.watch([(i, results[i][-1]) for i, d in enumerate(call.dispatched) if d])
    call.done.wait()
    call.take_error()  # raised here, by the caller: not again by the next call
    for i, d in enumerate(call.dispatched):
      if d:
        for o in results[i] or ():
          o.delete()

  def _wait(self, call: _Call, results: Sequence[Any]) -> None:
    """block=True: waits (interruptibly) until the call has finished; raises its error
    (outputs freed). Ctrl-C aborts the call's generation, waits until its programs have
    stopped and every device is back in step, then raises KeyboardInterrupt."""
    try:
      _wait_interruptibly(call.done)
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

  def _error(self, programs: Sequence[_DeviceProgram],
             failed: Sequence[BaseException | None],
             errors: Sequence[BaseException]) -> BaseException:
    """The error to raise: the root cause first (a device that failed before its
    handler: its own exception, named and chained, as a ReshardRuntimeError unless it
    is a ReshardError already), else the handler's (a timeout first)."""
    for p, e in zip(programs, failed):
      if e is None or _reached_handler(e):
        continue
      if isinstance(e, ReshardError):
        return e
      error = ReshardRuntimeError(
          f"{_API}: device {p.device.id} failed before the transfer started, so the "
          f"call failed on every device: {_failure_text(e)}")
      error.__cause__ = e
      return error
    mapped = [_map_native_error(e) for e in errors]
    k = next((i for i, m in enumerate(mapped) if isinstance(m, ReshardTimeoutError)), 0)
    mapped[k].__cause__ = errors[k]
    return mapped[k]

  # -- outputs --------------------------------------------------------------------------

  def _assemble(self, results: Sequence[Any]) -> list[jax.Array]:
    """The global output arrays from the programs' per-device outputs."""
    out = []
    for t, ((shape, dtype, sharding), slots) in enumerate(zip(self.out_avals,
                                                              self.out_slots)):
      arrays = [results[p][r] for p, r in slots]
      y = jax_compat.array_from_single_device_arrays(shape, sharding, arrays, dtype,
                                                     self.avals[t])
      if self.avals[t] is None:
        self.avals[t] = jax_compat.reusable_aval(y)
      out.append(y)
    return out


def _donate(leaves: Sequence[jax.Array], donate: bool | Sequence[bool]) -> None:
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


def _build_eager(shapes, dtypes, srcs, dsts, route, topology, timeout_ms,
                 chunk_bytes, out_dtypes=None, treedef=None) -> _EagerReshard:
  # Devices of several processes on CPU: the cross-process engine (processes/).
  # Operands have `dtypes`, results `out_dtypes` (a fused conversion; None: keep).
  out_dtypes = [o if o is not None else dt
                for o, dt in zip(out_dtypes or [None] * len(dtypes), dtypes)]
  devices = {}
  for s in itertools.chain(srcs, dsts):
    for d in jax_compat.device_assignment(s):
      devices[d.id] = d
  platform = _platform_of(devices.values())
  if platform == "cpu" and processes_call.spans_processes(devices.values()):
    return processes_call.CrossProcessReshard(shapes, dtypes, srcs, dsts, route, topology,
                                              timeout_ms, chunk_bytes, out_dtypes, treedef)
  _check_in_process(_API, platform, devices.values())
  staging = platform != "cpu"
  m2n_ffi.ensure_registered(platform, timeout_ms)
  topo = as_topology(topology, devices.values())
  src_layouts = [Layout.from_sharding(s, shape) for s, shape in zip(srcs, shapes)]
  dst_layouts = [Layout.from_sharding(s, shape) for s, shape in zip(dsts, shapes)]
  itemsizes, types = schedule.wire_itemsizes(dtypes, out_dtypes)
  plan = plan_reshard(src_layouts, dst_layouts, itemsizes, topo, route, chunk_bytes)
  if logger.isEnabledFor(logging.DEBUG):  # the traffic summary costs a pass over the plan
    logger.debug("reshard: planned %d leaves, route %s, %d payload bytes, bytes by link "
                 "%s, devices %s (eager per-device programs)", len(shapes), route,
                 plan.payload_bytes, plan.bytes_by_link, list(plan.devices))
  site = _site(b"eager", schedule.encode(plan, None, staging, types))
  bufs = schedule.buffers(plan)
  timeout = np.int64(timeout_ms)
  extra = m2n_ffi.transport_attrs(platform, topo, plan.devices)
  if platform == "cpu":
    extra = {**extra, "tickets": np.int64(_TICKETS)}

  local = [d for d in plan.devices if devices[d].process_index == jax.process_index()]
  src_shard_index = [
      {d.id: i for i, d in enumerate(jax_compat.addressable_device_assignment(s))} for s in srcs]
  programs: list[_DeviceProgram] = []
  to_compile = []
  result_index: dict[tuple[int, int], tuple[int, int]] = {}  # (leaf, dev) -> (prog, r)
  for dev_id in local:
    device = devices[dev_id]
    ops = bufs.operands.get(dev_id, {})
    res = bufs.results.get(dev_id, {})
    operand_leaves = sorted(ops, key=ops.get)
    result_leaves = sorted(res, key=res.get)
    sharding = _single_device_sharding(device)
    in_types = []
    for t in operand_leaves:
      box = src_layouts[t].box_of(dev_id)
      in_types.append(jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in box), dtypes[t],
                                           sharding=sharding))
    out_types = []
    for t in result_leaves:
      box = dst_layouts[t].box_of(dev_id)
      out_types.append(jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in box),
                                            out_dtypes[t]))
    workspace = max(1, schedule.workspace_bytes(plan, dev_id, staging, types))
    out_types.append(jax.ShapeDtypeStruct((workspace,), np.uint8))
    if platform == "cpu":  # the generation ticket, last (see _TICKETS)
      in_types.append(jax.ShapeDtypeStruct((), np.int32, sharding=sharding))
    sched = schedule.encode(plan, dev_id, staging, types)
    # The workspace is a returned output, so XLA keeps the call on every device, even
    # on a source-only one. has_side_effect=True would do the same but costs 3-8x the
    # dispatch time (JAX leaves its C++ fast path for programs with effects).
    call = jax.ffi.ffi_call(m2n_ffi.TARGET_NAME, out_types, has_side_effect=False)

    cpu_async = platform == "cpu" and _CPU_ASYNC

    def body(*shards, call=call, sched=sched, cpu_async=cpu_async):
      outs = tuple(call(*shards, schedule=sched, site=np.int64(site), timeout_ms=timeout,
                        **extra))
      if cpu_async:
        outs += (_async_token(outs[-1]),)
      return outs

    n_out = len(out_types) + cpu_async
    jitted = jax.jit(body, in_shardings=(sharding,) * len(in_types),
                     out_shardings=(sharding,) * n_out)
    for r, t in enumerate(result_leaves):
      result_index[(t, dev_id)] = (len(programs), r)
    programs.append(_DeviceProgram(
        device, None,
        tuple((t, src_shard_index[t][dev_id]) for t in operand_leaves),
        tuple(result_leaves), sched))
    to_compile.append((jitted, in_types))

  # Compile the per-device programs concurrently, on the devices' threads (XLA compiles
  # without the GIL): the first call of a many-device reshard pays about one compile.
  # The caller's `jax.enable_x64` context is thread-local: the workers trace under it.
  x64 = bool(jax.config.jax_enable_x64)
  futures = [_executor(p.device.id).submit(_compile, jitted, in_types, x64)
             for p, (jitted, in_types) in zip(programs, to_compile)]
  compiled, errors = _outcomes(futures)
  for e in errors:
    if e is not None:
      raise e
  for p, c in zip(programs, compiled):
    p.call = c
  # A reshard within one device (e.g. a dtype conversion in place) has no peer to wait
  # for: the calling thread dispatches it (no hand-off to the device's worker).
  caller_dispatch = len(plan.devices) == 1 or (
      platform == "cpu" and _CPU_ASYNC and _cpu_async(compiled))

  out_avals, out_slots = [], []
  for t, (shape, dtype, dst) in enumerate(zip(shapes, out_dtypes, dsts)):
    out_avals.append((tuple(shape), dtype, dst))
    out_slots.append([result_index[(t, d.id)] 
                      for d in jax_compat.addressable_device_assignment(dst)])
  return _EagerReshard(plan, programs, out_avals, out_slots, src_shard_index, platform,
                       site, caller_dispatch)


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


# Compiled per-device programs by (tree, shapes, dtypes, shardings, route, topology,
# timeout, chunk size). A model's refit is one entry; the bound only stops growth when
# layouts keep changing.
class _LruCache:
  """A bounded least-recently-used map, safe across threads (functools.lru_cache keys on
  the function's arguments; here the key is formed before building, and tests look in)."""

  def __init__(self, size: int):
    self.size = size
    self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self.lock = threading.Lock()  # held while building a missing entry

  def get(self, key: Hashable) -> Any:
    value = self._data.get(key)
    if value is not None:
      try:
        self._data.move_to_end(key)
      except KeyError:  # evicted by another thread meanwhile
        pass
    return value

  def put(self, key: Hashable, value: Any) -> None:
    self._data[key] = value
    self._data.move_to_end(key)
    while len(self._data) > self.size:
      self._data.popitem(last=False)

  def __getitem__(self, key: Hashable) -> Any:
    return self._data[key]

  def __len__(self) -> int:
    return len(self._data)

  def __iter__(self):
    return iter(list(self._data))

  def clear(self) -> None:
    self._data.clear()


_EAGER_CACHE_SIZE = 256
_eager_cache = _LruCache(_EAGER_CACHE_SIZE)


class _Key(tuple):
  """A cache key that hashes its parts once: the cache hashes a key several times per
  call, and a sharding's hash is Python code (a 16-leaf key took 128 of them)."""

  def __init__(self, parts: tuple):
    self._hash = tuple.__hash__(self)  # TypeError when a part is unhashable

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    return self is other or tuple.__eq__(self, other)

  def __ne__(self, other: Any) -> bool:
    return not self.__eq__(other)


def _eager_key(treedef, leaves, dsts, src_shardings, route, topology, timeout_ms,
               chunk_bytes, out_dtypes=None):
  """The cache key (None when it cannot be formed: then validation says why).

  A given src_sharding is part of the key: its agreement with x.sharding was checked
  when the entry was built.
  """
  parts = []
  for x, d, s in zip(leaves, dsts, src_shardings):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return None
    parts.append((x.shape, x.dtype, x.sharding, d, s))
  try:
    converts = out_dtypes is not None and any(o is not None for o in out_dtypes)
    key = _Key((treedef, tuple(parts), route, _topology_key(topology), timeout_ms,
                chunk_bytes, tuple(out_dtypes) if converts else ()))
  except TypeError:  # unhashable topology or destination: validation says why
    return None
  return key


def _validate_eager(x, leaves, dsts, src_shardings, donate: Sequence[bool], topology,
                    names) -> list[Sharding]:
  """Every rule of the eager path (`donate`: one flag per leaf); returns the destination
  shardings."""
  _check_topology(_API, topology)
  out = []
  seen: dict[int, str] = {}
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    name = names()[i]
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
      hint = (" Hint: put host data on devices first with jax.device_put."
              if isinstance(leaf, (np.ndarray, np.generic, int, float, complex, bool))
              else "")
      raise ReshardTypeError(
          f"{_API}: every leaf of x must be a jax.Array; got {type(leaf).__name__} at "
          f"{name}.{hint}")
    if leaf.is_deleted():
      raise ReshardValueError(
          f"{_API}: {name} must be a live array; got a deleted (or donated) array.")
    if not leaf.committed:
      raise ReshardValueError(
          f"{_API}: {name} must be committed to its devices (its sharding is then "
          f"what the source layout is); got an uncommitted array on {leaf.sharding}. "
          "Hint: jax.device_put(x, sharding) commits it.")
    _check_dtype(_API, name, leaf.dtype)
    dst_sharding = _dst_sharding_of(_API, name, dst, leaf.shape, leaf.dtype)
    src = leaf.sharding
    _check_holds(_API, name, dst_sharding, leaf.shape, "destination")
    _check_memory_kind(_API, name, src, "source")
    _check_memory_kind(_API, name, dst_sharding, "destination")
    src_platform = _platform_of(src.device_set)
    dst_platform = _platform_of(dst_sharding.device_set)
    if src_platform != dst_platform or any(
        d.platform != dst_platform for d in dst_sharding.device_set):
      raise ReshardValueError(
          f"{_API}: the destination devices of {name} must be on the source's platform "
          f"({src_platform}); got platform {dst_platform} ({dst_sharding}). Hint: "
          "jax.device_put moves data between platforms.")
    given = src_shardings[i]
    if given is not None and not _same_layout(given, src, leaf.shape):
      raise ReshardValueError(
          f"{_API}: src_sharding of {name} must describe the array's actual layout; got "
          f"{given} for an array sharded as {src}. Hint: outside jit, src_sharding can "
          "be left out.")
    _check_mesh(_API, name, dst_sharding, "destination")
    _check_reduction(_API, name, src, "source")
    _check_reduction(_API, name, dst_sharding, "destination")
    if donate[i]:
      if id(leaf) in seen:
        raise ReshardValueError(
            f"{_API}: a donated array must appear once in x; got the same array at "
            f"{seen[id(leaf)]} and {name}.")
      seen[id(leaf)] = name
    out.append(dst_sharding)
  return out


def _reshard_eager(x, leaves, treedef, dsts, src_shardings, route, topology, donate,
                   timeout_ms, chunk_bytes, names, out_dtypes=None,
                   record: list | None = None) -> list[jax.Array]:
  """Runs (building and caching on first use) the per-device programs of one reshard.

  `donate` (one flag per leaf) is checked here; the caller deletes donated sources.
  `record`: the entry's cache key is appended to it (nothing where none is cached).
  """
  key = _eager_key(treedef, leaves, dsts, src_shardings, route, topology, timeout_ms,
                   chunk_bytes, out_dtypes)
  fn = _eager_cache.get(key) if key is not None else None
  if fn is not None:
    for i, leaf in enumerate(leaves):  # what may change between calls of one key
      if leaf.is_deleted() or not leaf.committed:
        _validate_eager(x, leaves, dsts, src_shardings, donate, topology, names)
    if any(donate) and len({id(v) for v in leaves}) != len(leaves):
      _validate_eager(x, leaves, dsts, src_shardings, donate, topology, names)
    if record is not None:
      record.append(key)
    return fn(leaves, False)
  dst_shardings = _validate_eager(x, leaves, dsts, src_shardings, donate, topology, names)
  shapes = [tuple(v.shape) for v in leaves]
  dtypes = [v.dtype for v in leaves]
  srcs = [v.sharding for v in leaves]
  with _eager_cache.lock:
    fn = _eager_cache.get(key) if key is not None else None
    if fn is None:
      fn = _build_eager(shapes, dtypes, srcs, dst_shardings, route, topology, timeout_ms,
                        chunk_bytes, out_dtypes, treedef)
      if key is not None:
        _eager_cache.put(key, fn)
  if record is not None and key is not None:
    record.append(key)
  return fn(leaves, False)



# ---------------------------------------------------------------------------------------
# Which leaves jax_m2n moves and which it hands to jax.device_put
# ---------------------------------------------------------------------------------------

_HOST_TYPES = (np.ndarray, np.generic, int, float, complex, bool)


@functools.lru_cache(maxsize=1024)
def _default_memory(sharding: Sharding) -> bool:
  kind = getattr(sharding, "memory_kind", None)
  if kind is None:
    return True
  try:
    return kind == next(iter(sharding.device_set)).default_memory().kind
  except Exception:  # noqa: BLE001 - some backends expose no memories
    return True


@functools.lru_cache(maxsize=256)  # bounded by the dtypes in use
def _dtype_delegated_because(dtype: Any) -> str | None:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return f"extended dtype {dtype}"
  if jax.dtypes.itemsize_bits(dtype) % 8:
    return f"sub-byte dtype {dtype}"
  return None


def delegated_because(leaf: Any, dst: Any) -> str | None:
  """Why jax.device_put, not jax_m2n, moves this leaf (None: jax_m2n moves it).

  jax_m2n adds nothing where no device-to-device layout change happens: host data,
  uncommitted arrays (a default placement, not a layout), `None` destinations (keep),
  typed PRNG keys, sub-byte dtypes (int4: the handlers copy whole bytes), and host
  memory kinds (a device <-> host copy).
  """
  if dst is None:
    return "destination None (keep the layout)"
  if not isinstance(leaf, jax.Array):
    return "host data"
  reason = _dtype_delegated_because(leaf.dtype)
  if reason is not None:
    return reason
  if isinstance(leaf, jax.core.Tracer):
    return None
  if not leaf.committed:
    return "uncommitted array"
  dst_sharding = dst.sharding if isinstance(dst, jax.ShapeDtypeStruct) else dst
  if not _default_memory(leaf.sharding) or (
      isinstance(dst_sharding, Sharding) and not _default_memory(dst_sharding)):
    return "host memory kind"
  return None


def _check_delegated(name: str, leaf: Any, dst: Any) -> Any:
  """The rules a delegated leaf must meet before anything moves; its destination."""
  if dst is None:
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise ReshardValueError(
          f"{_API}: {name} must be a live array; got a deleted (or donated) array.")
    return None
  if not isinstance(leaf, jax.Array) and not isinstance(leaf, _HOST_TYPES) and not hasattr(
      leaf, "__jax_array__"):
    raise ReshardTypeError(
        f"{_API}: every leaf of x must be an array (a jax.Array, a numpy array or a "
        f"Python/numpy scalar); got {type(leaf).__name__} at {name}.")
  if isinstance(leaf, jax.Array) and leaf.is_deleted():
    raise ReshardValueError(
        f"{_API}: {name} must be a live array; got a deleted (or donated) array.")
  shape = np.shape(leaf)
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    dtype = jax.numpy.asarray(leaf).dtype  # a Python scalar: its default dtype
  dst_sharding = _dst_sharding_of(_API, name, dst, shape, dtype) if not (
      jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
      and isinstance(dst, jax.ShapeDtypeStruct)) else dst.sharding
  _check_mesh(_API, name, dst_sharding, "destination")
  _check_reduction(_API, name, dst_sharding, "destination")
  if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    _check_holds(_API, name, dst_sharding, shape, "destination")
  return dst_sharding


def _astype(leaf: Any, dtype: Any) -> Any:
  """`leaf.astype(dtype)` where it runs today (a jax.Array's devices, numpy on host)."""
  return leaf.astype(dtype) if hasattr(leaf, "astype") else np.asarray(leaf).astype(dtype)


def reshard_leaves(leaves: Sequence[Any], treedef: Any, dsts: Sequence[Any],
                   srcs: Sequence[Any], donate: Sequence[bool], route: str, topology: Any,
                   timeout_ms: int, chunk_bytes: int, names: Callable[[], list[str]],
                   out_dtypes: Sequence[Any] | None = None,
                   record: list | None = None) -> list[Any]:
  """Eagerly reshards concrete leaves: jax_m2n's programs for device layouts, jax.device_put
  for the rest (see `delegated_because`). Every check runs before anything moves; a
  donated source is deleted only after every leaf has moved. `out_dtypes`: per leaf the
  destination dtype (None: keep); converted in flight where schedule.fused_conversion
  says, else by `astype` first (on the source) and then moved.

  `record` (api's fast path): where one cached entry moved every leaf as it came (no
  delegation, no astype first), (its _eager_cache key, per-leaf weak_type flags or ())
  is appended: calling that entry(leaves, donate) and marking those outputs weak is
  then this call."""
  n = len(leaves)
  originals = leaves
  out_dtypes = list(out_dtypes) if out_dtypes is not None else [None] * n
  converted_first = False
  if any(o is not None for o in out_dtypes):
    leaves = list(leaves)
    for i, o in enumerate(out_dtypes):
      if o is not None and (delegated_because(leaves[i], dsts[i]) is not None or
                            not schedule.fused_conversion(leaves[i].dtype, o)) and not (
          isinstance(leaves[i], jax.Array) and leaves[i].is_deleted()):  # checks say
        leaves[i], out_dtypes[i] = _astype(leaves[i], o), None
        converted_first = True
  moved, delegated = [], []
  for i in range(n):
    (moved if delegated_because(leaves[i], dsts[i]) is None else delegated).append(i)
  delegated_dsts = {i: _check_delegated(names()[i], leaves[i], dsts[i]) for i in delegated}
  outs: list[Any] = [None] * n
  entry: list = [] if record is not None and not delegated and not converted_first else None
  if moved:
    sub = len(moved) != n
    sub_names = (lambda: [names()[i] for i in moved]) if sub else names
    m_leaves = [leaves[i] for i in moved]
    ys = _reshard_eager(
        None, m_leaves, jax.tree.structure([0] * len(moved)) if sub else treedef,
        [dsts[i] for i in moved], [srcs[i] for i in moved], route, topology,
        [donate[i] for i in moved], timeout_ms, chunk_bytes, sub_names,
        [out_dtypes[i] for i in moved], entry)
    weak = [leaves[i].weak_type and out_dtypes[i] is None for i in moved]
    for i, y, w in zip(moved, ys, weak):
      outs[i] = jax_compat.with_weak_type(y) if w else y
    if entry:
      record.append((entry[0], tuple(weak) if any(weak) else ()))
    if logger.isEnabledFor(logging.DEBUG):
      logger.debug("reshard: eager per-device path moved %d of %d leaves", len(moved), n)
  for i in delegated:
    given = srcs[i]
    if given is not None and isinstance(leaves[i], jax.Array) and not _same_layout(
        given, leaves[i].sharding, leaves[i].shape):
      raise ReshardValueError(
          f"{_API}: src_sharding of {names()[i]} must describe the array's actual "
          f"layout; got {given} for an array sharded as {leaves[i].sharding}.")
  for i in delegated:
    outs[i] = jax.device_put(leaves[i], delegated_dsts[i])
  if delegated:
    logger.debug("reshard: delegated %d of %d leaves to jax.device_put (%s)",
                 len(delegated), n,
                 sorted({delegated_because(leaves[i], dsts[i]) for i in delegated}))
  _donate([originals[i] for i in _donatable(originals, outs, donate, delegated_dsts)],
          True)
  return outs


def _donatable(originals: Sequence[Any], outs: Sequence[Any], donate: Sequence[bool],
               delegated: Any) -> list[int]:
  """The leaves whose source may be deleted: marked True, not returned by this call
  (a None destination returns its source), not also at a leaf marked False (one array
  twice in x), and sharing no buffer with a delegated result. jax.device_put keeps
  such an array alive, and so do we: a donation never deletes what the caller keeps."""
  kept = {id(y) for y in outs}
  kept.update(id(x) for x, flag in zip(originals, donate) if not flag)
  return [i for i, x in enumerate(originals)
          if donate[i] and id(x) not in kept and not (
              i in delegated and _shares_buffers(outs[i], x))]


def _shares_buffers(y: Any, x: Any) -> bool:
  """Whether jax.device_put returned x's own buffers in a new Array (an uncommitted
  array committed where it already is): deleting x would delete the result."""
  if not isinstance(x, jax.Array) or not isinstance(y, jax.Array) or x.is_deleted():
    return False
  try:
    mine = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in mine for s in y.addressable_shards)
  except Exception:  # noqa: BLE001 - no pointer to compare (a typed key): keep x
    return True
