"""Liveness of the processes of a job: beats through the key-value store, and the
verdict on a peer that one call waits for (gone, unreachable, or not proven otherwise).

Every process that took part in a cross-process reshard overwrites its beat key every
BEAT_S and reads every peer's (bootstrap's beat thread); a beat is "<count> <finished>":
a counter and the call number up to which the process has finished its calls
(sequence.py deletes a call's keys once every participant's beat has passed it, with
no key-value operation of its own). A peer is *suspected* once its
beat has not changed for store.SUSPECT_S (or, for a sender, its data stalls) and then
probed (store.probe), which its kernel answers even while the process is busy: refused
means gone; two failed probes in a row mean unreachable. Owns no thread and reads no
key itself.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from jax_m2n._src.processes import store

# The coordination service's own heartbeats see a death only after jax.distributed's
# heartbeat_timeout_seconds (100 s by default), and then end every process.
BEAT_S = 0.25
# Failed probes in a row that make a peer unreachable: one lost SYN, or a neighbour
# table still stale right after a link came back, fails one probe, not two.
PROBES_TO_FAIL = 2


class Liveness:
  """What this process knows of its peers, kept by the beat thread: each peer's beat
  and when it last changed, and the processes that left."""

  def __init__(self):
    self._lock = threading.Lock()
    self._seen: dict[int, tuple[str, float]] = {}
    self._finished: dict[int, int] = {}
    self._gone: dict[int, str] = {}
    self.read_at = time.monotonic()

  def update(self, beats: list[tuple[str, str]], gone: list[tuple[str, str]]) -> None:
    now = time.monotonic()
    with self._lock:
      for key, value in beats:
        pid = int(key.rsplit("/", 1)[1])
        last = self._seen.get(pid)
        if last is None or last[0] != value:
          self._seen[pid] = (value, now)
        self._finished[pid] = int(value.split(" ")[1])
      for key, value in gone:
        self._gone[int(key.rsplit("/", 1)[1])] = value
      self.read_at = now

  def finished(self, peer: int) -> int:
    """The call number up to which `peer` has finished its calls, as of this process's
    last read of the beats (0 for a peer never seen beating)."""
    with self._lock:
      return self._finished.get(peer, 0)

  def gone(self, peer: int) -> str | None:
    """Why `peer` left the job (its exit marker), or None."""
    with self._lock:
      return self._gone.get(peer)

  def silent_s(self, peer: int) -> float:
    """For how long `peer`'s beat has not changed, as of this process's last fresh
    read of the store (0 for a peer never seen beating)."""
    with self._lock:
      seen = self._seen.get(peer)
      return 0.0 if seen is None else max(0.0, self.read_at - seen[1])


class Watch:
  """The peers one call waits on: a peer is suspected once its beat has been silent
  for SUSPECT_S or (a sender) its data stalls, and then probed (store.probe, one
  attempt in flight at a time); the probes decide (this module's opening comment)."""

  def __init__(self, liveness: Liveness, address_of: Callable[[int], str], me: int):
    self._liveness = liveness
    self._address_of = address_of
    self._me = me
    self._probes: dict[int, tuple[Any, int, str]] = {}  # peer: (in flight, failed, why)

  def verdict(self, peer: int, stalled: bool) -> str | None:
    """Why `peer` is gone or unreachable, or None (fine, or not proven otherwise)."""
    live = self._liveness
    gone = live.gone(peer)
    if gone is not None:
      return f"process {peer} left the job ({gone})"
    silent = live.silent_s(peer)
    if silent < store.SUSPECT_S and not stalled:
      self._probes.pop(peer, None)
      return None
    address = self._address_of(peer)
    pending, failed, why = self._probes.get(peer, (None, 0, ""))
    if pending is not None and pending.done():
      result, pending = pending.result(), None
      if result is None:
        failed = 0
      else:
        refused, why = result
        failed += 1
        if refused and silent >= store.SUSPECT_S:
          return (f"process {peer} is gone: its transfer server at {address} refuses "
                  f"connections ({why}) and its beat stopped {silent:.1f} s ago")
        if refused:  # alive (it beats), but nothing listens there as seen from here
          return (f"process {peer}'s transfer server at {address} refuses connections "
                  f"from this host ({why}): it listens on an address this host does not "
                  "reach. Hint: unset JAX_M2N_TRANSFER_HOST (each process then binds "
                  "the address that routes to the coordinator) or set it per host")
    if failed >= PROBES_TO_FAIL:
      return (f"process {peer} is unreachable: its transfer server at {address} does "
              f"not answer ({why}; {failed} attempts from process {self._me})"
              + (f" and its beat stopped {silent:.1f} s ago" if silent >= store.SUSPECT_S
                 else " while its data did not arrive"))
    if pending is None:
      timeout = (store.PROBE_TIMEOUT_S if silent >= store.SUSPECT_S
                 else store.STALL_PROBE_TIMEOUT_S)
      pending = store.probe_soon(address, timeout)
    self._probes[peer] = (pending, failed, why)
    return None
