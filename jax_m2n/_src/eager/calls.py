"""One eager call's lifecycle: the dispatch lock, CPU generations (tickets, site state,
healing), the failure watcher thread and how a failure after return reaches the next
call.

Owns what happens to a call once its programs are posted; it never builds programs
(programs.py) nor decides what moves (delegate.py).
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import logging
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src.eager import dispatch
from jax_m2n._src.eager.dispatch import (Latch, Outcomes, executors, executors_lock,
                                         wait_interruptibly)
from jax_m2n._src.errors import API, ReshardError, ReshardRuntimeError


logger = logging.getLogger("jax_m2n")


# One eager dispatch at a time per process: interleaving two calls' per-device programs
# from several user threads could order them differently on different devices. Only
# the dispatch holds it (for worker dispatch: until every program is posted to its
# device's worker): the programs run (and finish) without it.
dispatch_lock = threading.Lock()

# The CPU handler's generation tickets (xla_ffi/cpu_transport.h, CpuCall::ticket): each
# eager program's last operand is a device scalar naming its call's generation modulo
# TICKETS, so that a device whose earlier program failed before its handler ran never
# joins that earlier call's generation. At most _MAX_IN_FLIGHT calls of one site run
# at once (a further call waits for the oldest), so tickets are never ambiguous.
TICKETS = 64
_MAX_IN_FLIGHT = TICKETS // 2


class _Tickets:
  """Device scalars 0.._TICKETS-1 on one device, each made on first use and reused by
  every later call (a first call needs one: making all 64 per device cost 0.27 s of
  a loaded host's first 2,000-leaf call)."""

  __slots__ = ("_device", "_scalars")

  def __init__(self, device):
    self._device = device
    self._scalars: list[jax.Array | None] = [None] * TICKETS

  def __getitem__(self, k: int) -> jax.Array:
    scalar = self._scalars[k]
    if scalar is None:
      # Made under jax.transfer_guard("allow"): these host -> device copies are
      # jax_m2n's own, not the caller's data, and must not trip a caller's guard
      # (tunix wraps its weight sync in transfer_guard("disallow_explicit")).
      with jax.transfer_guard("allow"):
        scalar = self._scalars[k] = jax.device_put(np.int32(k), self._device)
    return scalar


def ticket_scalars(tickets: Sequence[_Tickets], k: int) -> list[jax.Array]:
  """Scalar k of each of `tickets` (one per device of a call), those not made yet made
  in one batched transfer (one transfer per device cost ~0.04 ms each, in each of a
  site's first TICKETS calls)."""
  missing = [t for t in tickets if t._scalars[k] is None]  # (this module's class)
  if missing:
    with jax.transfer_guard("allow"):  # (see _Tickets.__getitem__)
      made = jax.device_put([np.int32(k)] * len(missing),
                            [t._device for t in missing])
    for t, scalar in zip(missing, made):
      t._scalars[k] = scalar
  return [t[k] for t in tickets]


@functools.lru_cache(maxsize=None)  # one per device: bounded by the device count
def tickets_of(device) -> _Tickets:
  """`device`'s generation tickets: tickets_of(device)[k] is the scalar k on it."""
  return _Tickets(device)


def reached_handler(e: BaseException) -> bool:
  """Whether a program's error came from the jax_m2n handler (its messages name it)."""
  return "jax_m2n_reshard" in str(e)


def failure_text(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  return text if len(text) <= 2000 else text[:2000] + "..."


class _Watcher:
  """The one thread that waits for the eager calls' programs to finish and records
  what they ended with (Call.settle). A call hands over its programs' tokens with
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

  def add(self, call: "Call", tokens: Sequence[tuple[int, Any]]) -> None:
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
def stop_threads_at_exit() -> None:
  """Ends jax_m2n's threads while the interpreter still runs. A daemon thread caught at
  finalization inside a native call (the watcher polling an output's is_ready) is
  unwound through C++ frames that do not rethrow, and the process aborts ("FATAL:
  exception not rethrown", seen with JAX_M2N_CPU_ASYNC=1 on jax 0.11.2)."""
  threads = [*_watcher_instance, *executors.values()]
  for t in threads:
    t.stop()
  with executors_lock:  # the build pools: idle unless a build is running
    pools = list(dispatch.build_pools.values())
    dispatch.build_pools.clear()
  for pool in pools:
    pool.shutdown(wait=False, cancel_futures=True)
  deadline = time.monotonic() + 2.0  # a thread stuck in a transfer does not hold exit
  for t in threads:
    t._thread.join(max(0.0, deadline - time.monotonic()))  # noqa: SLF001 - this module's
  for pool in pools:
    for t in list(pool._threads):  # noqa: SLF001 - the pool's own threads
      t.join(max(0.0, deadline - time.monotonic()))


def _watcher() -> _Watcher:
  if not _watcher_instance:
    with executors_lock:
      if not _watcher_instance:
        _watcher_instance.append(_Watcher())
  return _watcher_instance[0]


# Calls that failed after returning, not yet raised by jax_m2n: the next eager reshard
# raises them (before it moves anything).
_failed_calls: collections.deque = collections.deque()
_failed_lock = threading.Lock()
_call_counter = itertools.count(1)


def raise_failed_calls() -> None:
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
      f"{API}: an earlier asynchronous call, {first.name}, failed after it returned "
      f"(its outputs carry the error); this call did not run{more}: {first.error}")
  error.__cause__ = first.error
  raise error


# Asynchronous CPU calls with peers (JAX_M2N_CPU_ASYNC=1) in flight, by issuing thread.
# XLA's CPU client runs them on its thread pool, where one device's program waits for
# its peers on a pool thread: calls issued from two Python threads at once timed out
# (DEADLINE_EXCEEDED) in most runs of two threads repeating one reshard, and of four
# sharing one source (issue 26; one thread issuing 8 calls back to back never did). So
# a thread's call first waits until the calls other threads issued have finished: one
# issuing thread at a time, each thread's own calls still pipelined.
_issued_calls: collections.deque = collections.deque()
_issued_lock = threading.Lock()


def mark_issued(call: "Call") -> None:
  """Records an asynchronous CPU call of this thread (under dispatch_lock); it is
  forgotten when it has finished (Call._finalize)."""
  call.issuer = threading.get_ident()
  with _issued_lock:
    _issued_calls.append(call)


def wait_for_other_issuers() -> None:
  """Waits (interruptibly, under dispatch_lock) until no asynchronous CPU call that
  another thread issued is in flight."""
  me = threading.get_ident()
  while True:
    with _issued_lock:
      other = next((c for c in _issued_calls if c.issuer != me), None)
    if other is None:
      return
    wait_interruptibly(other.done)


class SiteState:
  """The generations of one CPU site (one plan): the next one to hand out and the calls
  still running. Guarded by dispatch_lock (begin) and its own lock (end)."""

  def __init__(self, site: int):
    self.site = site
    self.next = 0
    self.in_flight: collections.deque = collections.deque()
    self.lock = threading.Lock()

  def begin(self, module: Any, device_ids: Sequence[int], call: "Call") -> int:
    """The generation of a new call on `device_ids` (under dispatch_lock)."""
    while len(self.in_flight) >= _MAX_IN_FLIGHT:
      wait_interruptibly(self.in_flight[0].done)
    with self.lock:
      idle = not self.in_flight
      self.in_flight.append(call)
    counts = module.joined(self.site, list(device_ids))
    if idle:
      # Nothing of this site runs: the devices' join counts are final. Bring any device
      # an earlier failure left behind level with the rest (healed).
      top = max(max(counts, default=0), self.next)
      behind = [d for d, c in zip(device_ids, counts) for _ in range(top - c)]
      if behind:
        module.abandon(self.site, behind, "the device was behind its peers after an "
                       "earlier failed call (healed)")
      self.next = top
    elif max(counts, default=0) > self.next:
      # Calls still run, but a device has passed every generation handed out (no call
      # can have put it there): the generations up to it are given up on the others
      # now, by index, which touches none of the calls in flight (issue 22: the next
      # call waited for timeout_s instead).
      top = max(counts)
      for d, c in zip(device_ids, counts):
        for k in range(max(c, self.next), top):
          module.abandon_generation(self.site, [d], k, "the device was behind a peer "
                                    "that an earlier failure put ahead (healed)")
      self.next = top
    index = self.next
    self.next += 1
    return index

  def end(self, call: "Call") -> None:
    with self.lock:
      self.in_flight.remove(call)


site_states: dict[int, SiteState] = {}


@functools.lru_cache(maxsize=1)
def cpu_module() -> Any:
  """The CPU extension module (m2n_ffi.load imports by name on every call)."""
  return m2n_ffi.load("cpu")


def state_of_site(site: int) -> SiteState:
  s = site_states.get(site)
  if s is None:
    s = site_states[site] = SiteState(site)
  return s


class Call:
  """One eager reshard after dispatch: which programs run, in which generation, and
  what they ended with. The watcher threads fill it in; the last one finalizes it."""

  def __init__(self, entry: Any, programs: Sequence[dispatch.Program]):
    # entry: the programs.py EagerReshard the call runs (which imports this module).
    self.entry = entry
    self.programs = list(programs)
    self.seq = next(_call_counter)
    self.index = -1                      # the CPU generation
    self.errors: list[BaseException | None] = [None] * len(programs)
    self.dispatched = [False] * len(programs)
    self.error: BaseException | None = None
    self.raised = False                  # raised to the user by jax_m2n already
    self.done = Latch()
    self.issuer: int | None = None       # the issuing thread (see mark_issued)
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
        self.give_up(i, failure_text(e))  # a no-op where the handler ran
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
          f"{API}: {self.name} could not be checked: {failure_text(e)}")
    finally:
      if entry.platform == "cpu":
        entry.site_state().end(self)
      if self.issuer is not None:
        with _issued_lock:
          _issued_calls.remove(self)
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


def run_guarded(prog: dispatch.Program, args: list, outcomes: Outcomes, i: int,
                 call: "Call") -> None:
  """Dispatches program i on its device's worker thread (worker dispatch), its outputs
  or error into `outcomes`; a failure before the handler gives the device's generation
  up at once (its peers, possibly waiting inside their own dispatch, fail now)."""
  try:
    outcomes.results[i] = dispatch.run_device(prog, args)  # tests wrap it
  except BaseException as e:  # noqa: BLE001 - every failure is the call's to raise
    outcomes.errors[i] = e
    try:
      call.give_up(i, failure_text(e))  # a no-op where the handler ran
    except BaseException as give_up_error:  # noqa: BLE001 - raised in e's place
      outcomes.errors[i] = give_up_error
  finally:
    outcomes.finished()
