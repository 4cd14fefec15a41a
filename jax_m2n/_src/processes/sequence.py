"""The call sequence of cross-process reshards, the agreement on their arguments, and
every wait of a call.

Owns the call numbers (every process numbers its cross-process calls alike, as it
orders its jit calls), the plan fingerprint each process posts under its call's key,
the call's outcome, and the waits of one call: for peers' keys (blocking gets, woken by
the key itself) and for this process's transfers (local polling only), each bounded by
the call's timeout, woken by a peer's failure, its death or unreachability
(liveness.Watch: beats and reachability probes) or this process being cut off, and
interruptible (Ctrl-C). A call makes a fixed number of key-value operations, none per
chunk and none per second of waiting. Moves no bytes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from jax_m2n._src.errors import API as _API
from jax_m2n._src.errors import (CoordinatorUnreachable, PeerFailed, ReshardError,
                                 ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardValueError)
from jax_m2n._src.processes import bootstrap, liveness, store


_counter = itertools.count(1)
_counter_lock = threading.Lock()
_taken = [0]  # the last call number taken here
_open: set[int] = set()  # the numbers taken for calls this process has not finished


def next_call(takes_part: bool = True) -> int:
  """This process's next cross-process call number (1, 2, ...); one it `takes_part`
  in is open until its CallWaits.finish (the keys of a call stay until every
  participant has finished it)."""
  with _counter_lock:
    n = _taken[0] = next(_counter)
    if takes_part:
      _open.add(n)
    return n


def _finished() -> int:
  """The call number up to which this process has finished (or skipped) every call
  (under _counter_lock)."""
  return min(_open) - 1 if _open else _taken[0]


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


def distinct(values: Sequence[Any], key: Callable[[Any], Any]) -> tuple[list, list[int]]:
  """A fingerprint field of one entry per leaf, spelled compactly: the distinct
  `key(v)` (hashable; computed once per distinct value) in first-appearance order and
  per leaf the index of its key. A function of the keys alone, so equal on every
  process whose leaves have equal keys; a model's leaves repeat a few layouts."""
  memo: dict[Any, int] = {}
  index: dict[Any, int] = {}
  out = []
  for v in values:
    k = memo.get(v)
    if k is None:
      k = memo[v] = index.setdefault(key(v), len(index))
    out.append(k)
  return list(index), out


def mismatch(mine: str, theirs: str) -> list[str]:
  """The FIELDS whose hashes differ between two fingerprints."""
  a, b = mine.split("."), theirs.split(".")
  if len(a) != len(b):
    return ["jax_m2n version"]
  return [f for f, x, y in zip(FIELDS, a, b) if x != y]


class CallWaits:
  """The keys and waits of call number `n`: its prefix in the store, its participants,
  its deadline, and its outcome key (set once: "done" by the last participant to
  finish, or a failure by the first that fails), which a background blocking get
  watches from the start: a peer's failure wakes every wait at once, with no reading
  of the store in between. Every wait raises: a peer's failure (PeerFailed), a dead or
  unreachable peer or this process cut off (ReshardRuntimeError naming it), the
  deadline (ReshardTimeoutError)."""

  # Waits poll local state only (futures, readiness, liveness kept by the beat thread),
  # backing off from 0.1 to 1 ms: Python sleeps, so Ctrl-C interrupts them.
  _POLL_MIN_S = 1e-4
  _POLL_MAX_S = 1e-3
  # A sender none of whose pulls has completed for STALL_S is suspected (_Watch).
  STALL_S = store.SUSPECT_S
  # How long `fail` waits for its post to land (a reachable store answers in ms).
  FAIL_POST_S = 0.5

  def __init__(self, n: int, participants: Sequence[int], timeout_ms: int):
    self.n = n
    self.engine = bootstrap.engine()
    self.kv = self.engine.kv
    self.pid = self.engine.pid
    self.key = f"{bootstrap.PREFIX}/call/{n}"
    self.participants = list(participants)
    self.peers = [p for p in participants if p != self.pid]
    self.started = time.monotonic()
    self.timeout_s = timeout_ms / 1000.0
    self.deadline = self.started + self.timeout_s
    self.watch = liveness.Watch(self.engine.liveness, self.engine.peer_address,
                                self.pid)
    self.outcome = self.kv.get_soon(f"{self.key}/outcome",
                                    self.timeout_s + store.SUSPECT_S)

  def post(self, what: str, value: str = "1") -> None:
    """Posts this process's `what` without waiting for the store's answer (nothing
    this process does next depends on it; a peer waiting for it gets it as soon as it
    lands)."""
    self.kv.post_soon(f"{self.key}/{what}/{self.pid}", value)

  def fail(self, message: str) -> None:
    """Tells the peers this process failed the call (the first failure becomes the
    call's outcome; they fail at once, naming it). Waits at most FAIL_POST_S for the
    store to take it, and not at all where this process is cut off from the store:
    the caller poisons its connections next, and a peer whose pull then fails must
    find this failure (naming the process at fault) posted, not post its own."""
    posted = self.kv.post_soon(f"{self.key}/outcome", f"failed {self.pid} "
                               f"{message[:2000]}", overwrite=False)
    if self.kv.cut_off() is None:
      concurrent.futures.wait([posted], timeout=self.FAIL_POST_S)

  def close_outcome(self) -> None:
    """Ends the outcome's blocking gets of a call that every process fails on its own
    (different arguments): no peer's failure to relay."""
    self.kv.post_soon(f"{self.key}/outcome", "refused", overwrite=False)

  # -- checks shared by the waits -------------------------------------------------------

  def _relay(self) -> None:
    """Raises PeerFailed where a peer's failure is the call's outcome."""
    if not self.outcome.done():
      return
    value = self.outcome.result()
    if value is None or not value.startswith("failed "):
      return
    _, who, message = value.split(" ", 2)
    if int(who) != self.pid:
      raise PeerFailed(
          f"{_API}: process {who} failed cross-process call #{self.n}, so the call "
          f"failed on process {self.pid} too: {message}")

  def _check(self, stage: str, watched: Sequence[int], late: str,
             stalled: Sequence[int] = ()) -> None:
    """A peer's failure, this process's own link, the peers in `watched` (those in
    `stalled` suspected already: their data stalls), and the deadline (`late`: what a
    missed deadline most likely means)."""
    self._relay()
    why = self.kv.cut_off()
    if why is not None:
      raise CoordinatorUnreachable(
          f"{_API}: cross-process call #{self.n} failed on process {self.pid} while "
          f"waiting for {stage}: {why}.")
    lost = [v for p in watched if (v := self.watch.verdict(p, p in stalled))]
    if lost:
      raise ReshardRuntimeError(
          f"{_API}: cross-process call #{self.n} failed on process {self.pid} while "
          f"waiting for {stage}: " + "; ".join(lost) + ".")
    now = time.monotonic()
    if now > self.deadline:
      raise ReshardTimeoutError(
          f"{_API}: cross-process call #{self.n} must complete within "
          f"timeout_s={self.timeout_s:g}; process {self.pid} still waited for {stage} "
          f"after {now - self.started:.1f} s ({late}).")

  def _poll(self, done: Callable[[], bool], check: Callable[[], None]) -> None:
    delay = self._POLL_MIN_S
    while not done():
      check()
      time.sleep(delay)  # Python sleep: Ctrl-C interrupts it
      delay = min(2 * delay, self._POLL_MAX_S)

  # -- the waits ------------------------------------------------------------------------

  def agree(self, fp: str, names: Callable[[], str]) -> None:
    """Waits for every peer's fingerprint (this process posted its own): a peer that
    called with other arguments is a ReshardValueError on every process (each sees
    every fingerprint), before any byte leaves any process. One directory read, then
    one blocking get per peer not there yet."""
    want = {f"{self.key}/fp/{p}": p for p in self.peers}
    theirs = {want[k]: v for k, v in self.kv.dir_get(f"{self.key}/fp/") if k in want}
    pending = {p: self.kv.get_soon(f"{self.key}/fp/{p}", self.timeout_s)
               for p in self.peers if p not in theirs}

    def arrived() -> bool:
      for p, f in list(pending.items()):
        if f.done() and f.result() is not None:
          theirs[p] = pending.pop(p).result()
      return not pending

    def check() -> None:
      missing = sorted(pending)
      who = ("process " if len(missing) == 1 else "processes ") + ", ".join(
          map(str, missing))
      self._check("the argument check (plan fingerprints)", missing,
                  f"{who} alive, but not calling reshard with these devices. Hint: "
                  "every process must make the same sequence of reshard calls")

    self._poll(arrived, check)
    bad = {p: mismatch(fp, v) for p, v in sorted(theirs.items()) if v != fp}
    if bad:
      detail = "; ".join(f"process {p} differs in {', '.join(f)}" for p, f in bad.items())
      raise ReshardValueError(
          f"{_API}: every process must call reshard with the same arguments (the "
          f"multi-controller convention); got different arguments in cross-process call "
          f"#{self.n} on process {self.pid} ({names()}): {detail}. No data moved.")

  def wait_ready(self, ready: Callable[[], bool], senders: dict[int, Callable[[], int]],
                 stage: str) -> None:
    """Waits until `ready()` (this process's transfers and outputs are done), watching
    the senders (the processes this one pulls from, each with a count of its completed
    pulls): one whose pulls stall for STALL_S is suspected and probed."""
    progress = {p: (count(), time.monotonic()) for p, count in senders.items()}

    def check() -> None:
      now = time.monotonic()
      stalled = []
      for p, count in senders.items():
        done = count()
        if done != progress[p][0]:
          progress[p] = (done, now)
        elif now - progress[p][1] > self.STALL_S:
          stalled.append(p)
      self._check(stage, list(senders), "the transfers are still running: a slow "
                  "link, or a timeout_s too small for these bytes", stalled)

    self._poll(ready, check)

  def gather(self, what: str, peers: Sequence[int], stage: str) -> list[str]:
    """Waits for the values `peers` posted under `what` (`post`) and returns them in
    `peers`' order: one blocking get per peer, the peers watched meanwhile (a separate
    job's pull uses it: the version its process 0 chose, a wave's forwards offered)."""
    pending = {p: self.kv.get_soon(f"{self.key}/{what}/{p}", self.timeout_s)
               for p in peers}

    def arrived() -> bool:
      return all(f.done() and f.result() is not None for f in pending.values())

    def check() -> None:
      missing = [p for p, f in pending.items() if not f.done()]
      self._check(stage, missing, "a process alive, but not making the same call")

    self._poll(arrived, check)
    return [pending[p].result() for p in peers]

  def relay_failure(self, sender: int, within_s: float = 1.0) -> None:
    """After a pull from `sender` failed: raises PeerFailed with the call's failure
    where one is posted within `within_s` (a sender that forwards data it failed to get
    posts the original cause), or returns at once where `sender` is gone."""
    until = time.monotonic() + within_s
    while time.monotonic() < until and not self.watch.verdict(sender, True):
      self._relay()
      time.sleep(0.005)

  def end(self) -> None:
    """The end of the call: this process is done; the last of the participants to be
    done makes "done" the outcome, which every one of them waits for (a call succeeds
    on every process or fails on every process, so all of them can handle or retry it
    alike). A counter and one blocking get: no reading per peer."""
    count = self.kv.increment(f"{self.key}/done", 1)
    if count == len(self.participants):
      self.kv.post_soon(f"{self.key}/outcome", "done", overwrite=False)

    def check() -> None:
      self._check("the end of the call (every process done)", self.peers,
                  "a process still moving its bytes, or one that does not call")

    try:
      self._poll(self.outcome.done, check)
    except ReshardError:
      # The outcome may have come while a peer, done and gone, looked lost: it wins.
      if self.kv.try_get(f"{self.key}/outcome") != "done":
        raise
      return
    self._relay()
    if self.outcome.result() != "done":  # the blocking get timed out
      self._check("the end of the call (every process done)", self.peers, "")

  def finish(self, failed: bool = False) -> None:
    """After the call's last wait (or its failure, `failed`: the keys go alike): marks
    it finished here (this process's next beat says so: no key-value operation); its
    lowest participant deletes its keys (on the beat thread) once every participant's
    beat has passed it, or KEYS_KEPT_S after this, whichever is first."""
    with _counter_lock:
      _open.discard(self.n)
      self.engine.finished = _finished()
      if self.pid == min(self.participants):
        _to_delete.append((self.n, tuple(self.participants), time.monotonic()))
        if not _cleanup_installed:
          _cleanup_installed.append(True)
          self.engine.on_beat(_cleanup)


# Calls this process is the lowest participant of, whose keys are not deleted yet:
# (call number, participants, when it finished here). A failed call's keys go after
# KEYS_KEPT_S at the latest (a participant that died never beats past it).
_to_delete: list[tuple[int, tuple[int, ...], float]] = []
_cleanup_installed: list[bool] = []
KEYS_KEPT_S = 600.0


def _cleanup() -> None:
  """Deletes the keys of earlier calls that every participant has finished, as the
  beats just read say (a participant may still read a call's keys until it has passed
  its last wait); runs on the beat thread, after the beat, off every call's path."""
  engine = bootstrap.engine()
  with _counter_lock:
    pending, _to_delete[:] = list(_to_delete), []
  keep = []
  for n, participants, at in pending:
    done = all(engine.liveness.finished(p) >= n for p in participants)
    try:
      if done or time.monotonic() - at > KEYS_KEPT_S:
        engine.kv.delete(f"{bootstrap.PREFIX}/call/{n}")
      else:
        keep.append((n, participants, at))
    except Exception:  # noqa: BLE001 - best effort: stale keys are never read again
      keep.append((n, participants, at))
  with _counter_lock:
    _to_delete.extend(keep)
