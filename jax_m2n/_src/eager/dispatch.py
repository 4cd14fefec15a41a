"""The eager path's device threads: one worker per device that dispatches (and compiles)
its programs, and the waits on them.

Owns the threads and the waiting primitives only; what a call is, how its failures
reach the caller and what its programs hold live in calls.py and programs.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from typing import Any, Callable, Protocol, Sequence

import jax

from jax_m2n._src.errors import API, ReshardValueError



class Program(Protocol):
  """What dispatching a device's program reads of it (programs.py's DeviceProgram,
  which imports this module: described here, not imported)."""

  device: Any                                  # jax.Device
  call: Callable[..., Any]                     # the compiled per-device program
  operands: tuple[tuple[int, int], ...]        # (leaf, index into leaf's shards)

logger = logging.getLogger("jax_m2n")


class _Worker:
  """A thread of one device: its "dev" worker dispatches its programs where a dispatch
  may wait for the device's peers (and compiles them); its "watch" worker waits for
  their completion, in order, and records their errors.

  A handler that waits for its peers inside the dispatch (CUDA's host rendezvous; CPU
  where XLA runs the program inline) needs the programs of one reshard dispatched
  concurrently: dispatched one after another from one Python thread they run one after
  another and the first waits forever (docs/design.md, "Dispatch"). One thread per device,
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


def executor_of(device_id: int) -> _Worker:
  """Device `device_id`'s worker, made on first use."""
  ex = executors.get(device_id)
  if ex is None:
    with executors_lock:
      ex = executors.get(device_id)
      if ex is None:
        ex = executors[device_id] = _Worker(device_id)
  return ex


executors: dict[int, _Worker] = {}
executors_lock = threading.Lock()


def build_pool(role: str) -> concurrent.futures.ThreadPoolExecutor:
  """The threads the per-device programs are built on, made on first use: "lower",
  one thread (tracing and lowering hold the GIL), and "compile", one per core (XLA
  compiles without it; more threads than cores only contend)."""
  pool = build_pools.get(role)
  if pool is None:
    with executors_lock:
      pool = build_pools.get(role)
      if pool is None:
        workers = 1 if role == "lower" else max(1, os.cpu_count() or 1)
        pool = build_pools[role] = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"jax_m2n-{role}")
  return pool


build_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def gather_outcomes(futures: Sequence[concurrent.futures.Future]
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


def wait_interruptibly(event: "threading.Event | Latch") -> None:
  """Waits for `event` in Python, waking every _WAIT_PERIOD_S (Ctrl-C raises)."""
  while not event.wait(_WAIT_PERIOD_S):
    pass


class Latch:
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


class Outcomes:
  """What the worker threads report of one call's programs (worker dispatch): each
  program's outputs or error; the last one to finish wakes the caller (one Event:
  cheaper than waiting on futures)."""

  def __init__(self, n: int):
    self.results: list[Any] = [None] * n
    self.errors: list[BaseException | None] = [None] * n
    self._left = n
    self._lock = threading.Lock()
    self.done = Latch()
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


def run_device(prog: Program, args: list) -> list:
  """Dispatches one device's program; returns its outputs (not yet ready: errors of
  the transfer surface when they are waited on)."""
  if _fault_hook is not None:
    _fault_hook(prog.device.id, "dispatch")
  check_live(prog, args)
  if _DEBUG_NANS.value or _DEBUG_INFS.value:
    # Moving bytes is no arithmetic: NaN and inf pass through as jax.device_put passes
    # them (the checkers would raise on the outputs). Read per dispatch (0.1-0.3 us):
    # a jax.debug_nans context is the dispatching thread's own.
    with jax.debug_nans(False), jax.debug_infs(False):
      return prog.call(*args)
  return prog.call(*args)


# jax_debug_nans / jax_debug_infs (public config states: `.value` is the calling
# thread's view, a context's or the global one).
_DEBUG_NANS = jax.debug_nans
_DEBUG_INFS = jax.debug_infs


def check_live(prog: Program, args: list) -> None:
  """Every input buffer of a device's program must be alive: a shard deleted behind the
  global array's back (its buffer donated to another jit; `x.is_deleted()` is then still
  False) would otherwise fail inside JAX, before the handler."""
  for (leaf, _), a in zip(prog.operands, args):
    if a.is_deleted():
      raise ReshardValueError(
          f"{API}: every source shard must be alive; got a deleted buffer for leaf "
          f"{leaf} on device {prog.device.id} (deleted or donated behind the array's "
          "back, e.g. by another jit's donate_argnums).")
