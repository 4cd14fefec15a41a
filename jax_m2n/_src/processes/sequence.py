"""The call sequence of cross-process reshards and the agreement on their arguments.

Owns the call numbers (every process numbers its cross-process calls alike, as it
orders its jit calls), the plan fingerprint each process posts under its call's key,
and the waits of one call: bounded by the call's timeout, woken by a peer's failure
marker or its death (bootstrap.Liveness), and interruptible (Ctrl-C). Moves no bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from jax_m2n._src.errors import API as _API
from jax_m2n._src.errors import (PeerFailed, ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)
from jax_m2n._src.processes import bootstrap


_counter = itertools.count(1)
_counter_lock = threading.Lock()


def next_call() -> int:
  """This process's next cross-process call number (1, 2, ...)."""
  with _counter_lock:
    return next(_counter)


FIELDS = ("pytree structure", "shapes", "dtypes", "destination dtypes",
          "source shardings", "destination shardings", "route", "topology",
          "chunk_bytes")


def fingerprint(fields: dict[str, Any]) -> str:
  """One short hash per field in FIELDS order, '.'-joined: equal on every process that
  called with the same arguments; the field that differs is named from it."""
  parts = []
  for name in FIELDS:
    h = hashlib.blake2b(repr(fields[name]).encode(), digest_size=6)
    parts.append(h.hexdigest())
  return ".".join(parts)


def mismatch(mine: str, theirs: str) -> list[str]:
  """The FIELDS whose hashes differ between two fingerprints."""
  a, b = mine.split("."), theirs.split(".")
  if len(a) != len(b):
    return ["jax_m2n version"]
  return [f for f, x, y in zip(FIELDS, a, b) if x != y]


class CallWaits:
  """The keys and waits of call number `n`: its prefix in the store, the peers it
  waits for, its deadline. Every wait polls the store (one directory read per round,
  backing off from 0.1 to 1 ms), reads liveness, and raises: a peer's failure marker
  or death as ReshardRuntimeError naming it, the deadline as ReshardTimeoutError."""

  # Polling, not a blocking get: a blocking get cannot also watch for failure markers
  # and dead peers, and cannot be interrupted. A round costs one store read (~0.2 ms
  # on loopback); the 1 ms cap bounds how late a wait sees its key.
  _POLL_MIN_S = 1e-4
  _POLL_MAX_S = 1e-3
  _READ_EVERY_S = 5e-3

  def __init__(self, n: int, peers: Sequence[int], timeout_ms: int):
    self.n = n
    self.engine = bootstrap.engine()
    self.kv = self.engine.kv
    self.pid = self.engine.pid
    self.key = f"{bootstrap.PREFIX}/call/{n}"
    self.peers = [p for p in peers if p != self.pid]
    self.deadline = time.monotonic() + timeout_ms / 1000.0
    self.timeout_s = timeout_ms / 1000.0
    self.liveness = bootstrap.Liveness(self.kv)
    self.started = time.monotonic()

  def post(self, what: str, value: str = "1") -> None:
    self.kv.key_value_set(f"{self.key}/{what}/{self.pid}", value, allow_overwrite=True)

  def fail(self, message: str) -> None:
    """Tells the peers this process failed the call (they fail at once, naming it)."""
    try:
      self.post("failed", message[:2000])
    except Exception:  # noqa: BLE001 - the store is down: the peers see our death
      pass

  def wait(self, what: str, peers: Sequence[int], stage: str,
           ready: Callable[[], bool] | None = None) -> dict[int, str]:
    """Waits until every one of `peers` has posted `what` (and `ready()`, if given,
    is true); returns {peer: value}."""
    peers = [p for p in peers if p != self.pid]
    want = {f"{self.key}/{what}/{p}": p for p in peers}
    got: dict[int, str] = {}
    delay = self._POLL_MIN_S
    read_at = -1.0
    failed: dict[int, str] = {}
    while True:
      # The store is read every round while keys are awaited; while only `ready()` is
      # (transfers in flight), every _READ_EVERY_S (failure markers), not every round.
      if len(got) < len(peers) or time.monotonic() - read_at >= self._READ_EVERY_S:
        read_at = time.monotonic()
        for k, v in self.kv.key_value_dir_get(self.key + "/"):
          if k in want:
            got[want[k]] = v
          elif k.startswith(f"{self.key}/failed/"):
            who = int(k.rsplit("/", 1)[1])
            if who != self.pid:
              failed[who] = v
      if len(got) == len(peers) and (ready is None or ready()):
        return got  # what was awaited came: a later failure is the next wait's
      if failed:
        who, v = min(failed.items())
        raise PeerFailed(
            f"{_API}: process {who} failed cross-process call #{self.n} while this "
            f"process waited for {stage}, so the call failed here too: {v}")
      missing = [p for p in peers if p not in got] or list(self.peers)
      dead = self.liveness.dead(missing)
      if dead:
        raise ReshardRuntimeError(
            f"{_API}: cross-process call #{self.n} failed while waiting for {stage}: "
            + "; ".join(dead.values()) + ".")
      now = time.monotonic()
      if now > self.deadline:
        absent = [p for p in peers if p not in got] or missing
        who = ("process " if len(absent) == 1 else "processes ") + ", ".join(
            map(str, absent))
        raise ReshardTimeoutError(
            f"{_API}: every process of cross-process call #{self.n} must reach "
            f"{stage} within timeout_s={self.timeout_s:g}; got no sign of {who} after "
            f"{now - self.started:.1f} s (alive, but not "
            "calling reshard with these devices). Hint: every process must make the "
            "same sequence of reshard calls.")
      time.sleep(delay)  # Python sleep: Ctrl-C interrupts it
      delay = min(2 * delay, self._POLL_MAX_S)

  def agree(self, fp: str, names: Callable[[], str]) -> None:
    """Posts this process's fingerprint and waits for every peer's: a peer that
    called with other arguments is a ReshardValueError on every process (each sees
    every fingerprint), before any byte moves."""
    self.post("fp", fp)
    theirs = self.wait("fp", self.peers, "the argument check (plan fingerprints)")
    bad = {p: mismatch(fp, v) for p, v in sorted(theirs.items()) if v != fp}
    if bad:
      detail = "; ".join(f"process {p} differs in {', '.join(f)}" for p, f in bad.items())
      raise ReshardValueError(
          f"{_API}: every process must call reshard with the same arguments (the "
          f"multi-controller convention); got different arguments in cross-process call "
          f"#{self.n} on process {self.pid} ({names()}): {detail}. No data moved.")

  def finish(self, participants: Sequence[int]) -> None:
    """After the call's last wait: marks it finished here; its lowest participant
    remembers to delete its keys once every participant has finished it."""
    self.post("fin")
    if self.pid == min(participants):
      with _counter_lock:
        _to_delete.append((self.n, tuple(participants)))

  def cleanup(self) -> None:
    """Deletes the keys of earlier calls that every participant has finished (a
    participant may still read a call's keys until it has passed its last wait)."""
    keep = []
    with _counter_lock:
      pending, _to_delete[:] = list(_to_delete), []
    for n, participants in pending:
      key = f"{bootstrap.PREFIX}/call/{n}"
      try:
        fin = {k for k, _ in self.kv.key_value_dir_get(f"{key}/fin/")}
        if len(fin) >= len(participants):
          self.kv.key_value_delete(key)
        else:
          keep.append((n, participants))
      except Exception:  # noqa: BLE001 - best effort: stale keys are never read again
        pass
    with _counter_lock:
      _to_delete.extend(keep)


# Calls this process is the lowest participant of, whose keys are not deleted yet.
_to_delete: list[tuple[int, tuple[int, ...]]] = []
