"""The jax.distributed key-value store with every operation bounded, and the
reachability probe (a TCP connection attempt) that decides whether a silent peer or
coordinator is busy or unreachable.

Owns the helper threads that make blocking calls on behalf of a caller that waits a
bounded time, and the count of key-value operations. Knows nothing of calls, plans or
arrays: the processes/ modules above it give the keys their meaning.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

import jax

from jax_m2n._src.errors import CoordinatorUnreachable

_API = "reshard"

# Silence alone proves nothing on a loaded host (a first call's compilation held the
# coordinator's answers back for a second here, on 2 cores): an operation unanswered
# for SUSPECT_S, like a peer whose beat is silent that long (liveness.py), is probed.
SUSPECT_S = 0.5
# One probe: a TCP connection attempt, bounded. Where the other side looks gone (silent)
# PROBE_TIMEOUT_S (answers take < 0.1 s even over 20 ms links); where only its data
# stalls STALL_PROBE_TIMEOUT_S, which outlasts one lost SYN (sent again after 1 s).
PROBE_TIMEOUT_S = 0.5
STALL_PROBE_TIMEOUT_S = 1.2
# A key-value operation unanswered for SUSPECT_S makes this process probe the
# coordinator (the client itself waits without end for an unreachable one): two failed
# probes in a row are CoordinatorUnreachable (one lost SYN is not a cut). A coordinator
# that accepts connections but does not answer for STORE_GIVE_UP_S is one too.
STORE_GIVE_UP_S = float(os.environ.get("JAX_M2N_STORE_TIMEOUT_S", "30"))

# Key-value operations made by the calls (on the calling thread: "kv_ops") and by the
# beat thread ("kv_background_ops").
stats = collections.Counter()


class _Workers:
  """Daemon threads that run blocking calls for a caller that waits a bounded time (a
  call that never returns keeps its thread, never the caller; daemon threads never
  hold up the interpreter's exit). At most `limit` threads: beyond, calls queue until
  one is free (while cut off, the calls in flight hold them; they return once the link
  does)."""

  def __init__(self, limit: int = 16):
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._idle = 0      # threads free for a new job (each job queued takes one)
    self._waiting = 0   # jobs queued with no thread free for them (at the limit)
    self._threads = 0
    self._limit = limit

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      if self._idle > 0:
        self._idle -= 1
      elif self._threads < self._limit:
        self._threads += 1
        threading.Thread(target=self._loop, name="jax_m2n-store", daemon=True).start()
      else:
        self._waiting += 1
    self._jobs.put((future, fn, args))
    return future

  def _loop(self) -> None:
    while True:
      future, fn, args = self._jobs.get()
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
          future.set_exception(e)
      with self._lock:  # free: for a job that waits for a thread, else for the next
        if self._waiting > 0:
          self._waiting -= 1
        else:
          self._idle += 1


def split_address(address: str) -> tuple[str, int]:
  """(host, port) of "host:port" or "[v6 host]:port"."""
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str] | None:
  """None when a TCP connection to `address` (a peer's transfer server, or the
  coordinator) opens within `timeout_s`; else (refused, why): refused is True where
  the host answered that nothing listens there (the process is gone). A check of the
  path, not a transport: it sends nothing."""
  host, port = split_address(address)
  try:
    socket.create_connection((host, port), timeout=timeout_s).close()
  except OSError as e:
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return isinstance(e, ConnectionRefusedError), why
  return None


_probe_workers = _Workers()


def probe_soon(address: str, timeout_s: float = PROBE_TIMEOUT_S
               ) -> concurrent.futures.Future:
  """probe(address, timeout_s) on a helper thread: a Future of its result."""
  return _probe_workers.submit(probe, address, timeout_s)


class Store:
  """The `jax.distributed` key-value store, every operation bounded: one unanswered
  for SUSPECT_S probes the coordinator, and two failed probes (or STORE_GIVE_UP_S)
  are CoordinatorUnreachable. Operations are counted in `stats[counter]`."""

  def __init__(self, client: Any, coordinator: str):
    self._client = client
    self.coordinator = coordinator
    self._workers = _Workers()
    # Blocking gets that last a call (get_soon): one thread each while they wait.
    self._waiters = _Workers(limit=1024)
    # Since when this process has found the coordinator unreachable (None: it is not):
    # set by a failed operation, cleared by an answer or by a probe that gets through
    # (the path is back; the client's own connection may take seconds to recover).
    self.cut_off_since: float | None = None

  def cut_off(self) -> str | None:
    """Why this process is cut off from the coordinator now, or None."""
    since = self.cut_off_since
    if since is None:
      return None
    return (f"this process has not reached the coordinator at {self.coordinator} for "
            f"{time.monotonic() - since:.1f} s (its link or the coordinator's host is "
            "down)")

  def _call(self, counter: str, extra_s: float, fn: Callable, *args) -> Any:
    stats[counter] += 1
    future = self._workers.submit(fn, *args)
    began = time.monotonic()
    probing, failed = None, 0
    while True:
      try:
        result = future.result(timeout=0.05)
        self.cut_off_since = None
        return result
      except TimeoutError:  # concurrent.futures' own since Python 3.11
        pass
      waited = time.monotonic() - began - extra_s
      why = None
      if waited > STORE_GIVE_UP_S:
        why = f"no answer within {STORE_GIVE_UP_S:g} s"
      elif waited > SUSPECT_S:
        if probing is None:
          probing = probe_soon(self.coordinator)
        elif probing.done():  # two failed probes in a row: one lost SYN is not a cut
          result, probing = probing.result(), None
          failed = 0 if result is None else failed + 1
          if result is None:
            self.cut_off_since = None
          if failed >= 2:
            why = f"no answer, and {result[1]} ({failed} probes)"
      if why is not None:
        if self.cut_off_since is None:
          self.cut_off_since = began
        raise CoordinatorUnreachable(
            f"{_API}: process {jax.process_index()} cannot reach the jax.distributed "
            f"coordinator at {self.coordinator} (process 0's key-value store): {why}. "
            "This process is cut off from the job (its link or the coordinator's host "
            "is down).")

  def set(self, key: str, value: str, counter: str = "kv_ops",
          overwrite: bool = True) -> None:
    """Sets `key`; with overwrite=False a key already set keeps its value (the first
    writer wins)."""
    try:
      self._call(counter, 0.0, self._client.key_value_set, key, value, overwrite)
    except CoordinatorUnreachable:
      raise
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process set it first
      if overwrite:
        raise

  def increment(self, key: str, by: int, counter: str = "kv_ops") -> int:
    """Adds `by` to the counter at `key` (atomic in the store); returns the new value."""
    return self._call(counter, 0.0, self._client.key_value_increment, key, by)

  def dir_get(self, prefix: str, counter: str = "kv_ops") -> list[tuple[str, str]]:
    return self._call(counter, 0.0, self._client.key_value_dir_get, prefix)

  def try_get(self, key: str, counter: str = "kv_ops") -> str | None:
    try:
      return self._call(counter, 0.0, self._client.key_value_try_get, key)
    except CoordinatorUnreachable:
      raise
    except Exception:  # noqa: BLE001 - NOT_FOUND: the key is not there (yet)
      return None

  def blocking_get(self, key: str, timeout_s: float, counter: str = "kv_ops"
                   ) -> str | None:
    """The value of `key` as soon as it is set, or None after `timeout_s`."""
    try:
      return self._call(counter, timeout_s, self._client.blocking_key_value_get, key,
                        max(1, int(timeout_s * 1000)))
    except CoordinatorUnreachable:
      raise
    except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED: not set within timeout_s
      return None

  def delete(self, key: str, counter: str = "kv_background_ops") -> None:
    self._call(counter, 0.0, self._client.key_value_delete, key)

  def post_soon(self, key: str, value: str, overwrite: bool = True
                ) -> concurrent.futures.Future:
    """Sets `key` without waiting (a failure from a process that may be cut off: it
    must fail at once, not after a probe); the Future says when it has landed."""
    stats["kv_ops"] += 1
    return self._workers.submit(self._client.key_value_set, key, value, overwrite)

  def get_soon(self, key: str, timeout_s: float) -> concurrent.futures.Future:
    """A Future of the value of `key` as soon as it is set, or of None after
    `timeout_s`: a blocking get on a helper thread, for waits that must watch other
    things meanwhile."""
    stats["kv_ops"] += 1

    def get():
      try:
        return self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
      except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED, or the store is gone
        return None
    return self._waiters.submit(get)
