"""What a person running weight sync can see of it, as values: the records.

Owns the record types (`PullRecord`: a subscriber's last successful pull; `PullFailure`:
its last failed one; `PublisherStats`: a publisher process's state and counts, with
`HeldVersion` and `PeerSeen`) and `Trace`, the measurements of one pull in flight that
pulling.py fills. Plain values only: it measures nothing itself (watch.py and
counters.py fill the records) and imports nothing of the jobs layer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jax_m2n._src.errors import (PeerFailed, ReshardRuntimeError, ReshardTimeoutError,
                                 ReshardTypeError, ReshardValueError, VersionGone)

# The phases of a pull, in order (their seconds sum to the pull's total).
PHASES = ("wait", "plan", "move", "compose")
# The data paths a pull can take.
PATHS = ("local", "network", "relay", "delta")
# The steps of a local pull (`PullRecord.steps`): waiting for its slot to be committed,
# mapping allocations not mapped yet (GPUs), the copies' addresses, dispatching the
# copies, waiting until they are done, the seqlock's second check, a lent version's
# confirmation round trip, unmapping what retired.
LOCAL_STEPS = ("slot", "map", "addresses", "dispatch", "ready", "check", "confirm",
               "trim")


@dataclasses.dataclass(frozen=True)
class PullRecord:
  """One successful pull on this process (`Subscriber.last_pull`).

  Attributes:
    version: the version pulled.
    path: how its bytes came: "local" (read from the publisher's memory on this host),
      "network" (a full pull over the transport), "relay" (chunks from another
      subscriber job, or from the trainer as a relay's head) or "delta" (only the
      changed elements).
    route: the plan's route ("hierarchical" or "flat"; local and delta pulls run the
      flat route's pieces).
    result_bytes: the result's bytes (every leaf's global size in its delivered dtype;
      values and scales of a quantized leaf).
    wire_bytes: the bytes this process received for it: fetched from the publisher,
      from its own job's other processes and from a relay upstream (network, relay,
      delta), or copied from the publisher's memory (local).
    wait_s: seconds choosing the version (the long poll until one is published).
    plan_s: seconds for the manifest, the request's checks and the plan.
    move_s: seconds on the data path (asking, fetching, forwarding, composing the
      destination shards; a local pull's copies; a delta's decoding and applying).
    compose_s: seconds assembling the global arrays, quantizing and donating.
    total_s: seconds from the call to its return (the four phases sum to it).
    relay_parent: whom a relayed pull was told to pull from (the upstream member's
      transport address, or "the trainer" for a relay's head); None when not relayed.
    delta_ratio: a delta pull's bytes fetched over the dense bytes of the same pieces
      (1.0: nothing saved); None for other paths.
    retries: the causes of what the pull redid, in order: "version gone" (the newest
      was dropped while asked for: the next newest), "plan re-registered" (a publisher
      process forgot the plan), "relay bad chunk" (a chunk from the upstream member
      did not match the publisher's digest), "relay re-route" (an upstream member
      died, stalled or sent a bad chunk: the rest came from the trainer).
    control_calls: control requests this pull sent (all the Subscriber's connections).
    control_bytes_sent, control_bytes_received: their bytes, each way.
    started_at: when the call began (seconds since the epoch, `time.time()`).
    steps: a local pull's data path step by step (seconds; LOCAL_STEPS, in order, each
      inside move_s): where a pull's time goes beyond its copy, for benchmarks and
      tuning. Empty for the other paths.
  """

  version: int
  path: str
  route: str
  result_bytes: int
  wire_bytes: int
  wait_s: float
  plan_s: float
  move_s: float
  compose_s: float
  total_s: float
  relay_parent: str | None
  delta_ratio: float | None
  retries: tuple[str, ...]
  control_calls: int
  control_bytes_sent: int
  control_bytes_received: int
  started_at: float
  steps: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PullFailure:
  """The last failed pull on this process (`Subscriber.last_failure`).

  Attributes:
    cause: a short label of the error's kind (`cause_of`): "timeout", "version_gone",
      "peer_failed", "value", "type", "runtime" or "other".
    error: the exception's type and message.
    at: when it failed (seconds since the epoch).
    seconds: how long the call ran before it failed.
    version: the version it was pulling (0 where none was chosen yet).
    path: the data path it was on ("" where it had not started one).
  """

  cause: str
  error: str
  at: float
  seconds: float
  version: int
  path: str


@dataclasses.dataclass(frozen=True)
class HeldVersion:
  """One version a publisher process holds.

  Attributes:
    version: its number.
    bytes: this process's snapshot of it (its shards in the published dtype).
    published_at: when `publish` returned it (seconds since the epoch).
    offered_bytes: the bytes this process offered subscribers of it through its
      transport (pieces, chunks, deltas), fetched or not.
    held_as: "lent" (the caller's own arrays, read in place: no copy held) or
      "snapshot", with why where lending was asked for and not done ("snapshot (CPU:
      ...)", "snapshot (pooled memory: ...)").
    device_bytes: per device (its name), the bytes this version holds there beside the
      caller's arrays (its snapshot, its wire conversions; 0 where lent).
  """

  version: int
  bytes: int
  published_at: float
  offered_bytes: int
  held_as: str = "snapshot"
  device_bytes: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PeerSeen:
  """One control connection a publisher process has heard from (a subscriber
  process's; a relaying subscriber holds a second one for its forwarding).

  Attributes:
    peer: the connection's id (hex; stable while the connection lives).
    seen_s_ago: seconds since its last request.
    calls: its requests so far.
    last_op: its last request's operation ("versions", "pull", "relay_join"...).
    version: the newest version it pulled (its word after the pull, on every path)
      or asked for (0: none yet).
  """

  peer: str
  seen_s_ago: float
  calls: int
  last_op: str
  version: int


@dataclasses.dataclass(frozen=True)
class PublisherStats:
  """A publisher process's state and counts (`Publisher.stats()`).

  Attributes:
    process: this process's index in the trainer job.
    address: its control address.
    transport: its transport's spec ("net", "net+curve", "transfer_server").
    versions: the versions it holds, oldest first.
    held_bytes: their bytes (the sum of `versions[i].bytes`).
    last_version: the last version published (0 before the first).
    last_published_at: when (seconds since the epoch; None before the first).
    subscribers: control connections heard from within `window_s` (`peers`).
    window_s: that window.
    peers: those connections, most recent first.
    pulls_answered: data requests answered without error (`answered`'s pull, pieces,
      delta and local: a local subscriber asks once per layout set, then reads memory).
    answered: every request answered without error, by operation.
    failures: requests refused or answered with an error, by cause (the error's kind:
      "gone", "unknown_plan", "timeout", "value", "runtime"; "refused": a malformed
      call).
    offered_bytes: every byte offered through the transport since the start.
    served_bytes: bytes the transport sent (the "net" transport counts them; it is
      shared by this process's Publishers and Subscribers); None where it cannot tell.
    exports: the local data plane's exports (one per layout set a local subscriber
      reads, or every held set's on CPU) and `export_bytes`, their memory (CPU: the
      slots, which are the snapshots; GPUs: headers and slot tables only, the versions
      being XLA's own buffers, mapped by readers).
    device_bytes: per device (its name), the device bytes this process holds for weight
      sync beside the caller's own arrays: the held versions' snapshots and wire
      conversions (lent versions hold none).
    lent_allocations: GPUs: the XLA allocations lent to local readers now, and
      `lent_allocation_bytes` their size (what a reader may see: a whole allocation;
      with XLA's preallocation, its pool).
  """

  process: int
  address: str
  transport: str
  versions: tuple[HeldVersion, ...]
  held_bytes: int
  last_version: int
  last_published_at: float | None
  subscribers: int
  window_s: float
  peers: tuple[PeerSeen, ...]
  pulls_answered: int
  answered: dict[str, int]
  failures: dict[str, int]
  offered_bytes: int
  served_bytes: int | None
  exports: int
  export_bytes: int
  device_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  lent_allocations: int = 0
  lent_allocation_bytes: int = 0

  def to_json(self) -> dict[str, Any]:
    """The record as JSON values: dicts, lists, numbers, strings, None (what the
    `status` command prints)."""
    out = dataclasses.asdict(self)
    out["versions"], out["peers"] = list(out["versions"]), list(out["peers"])
    return out


@dataclasses.dataclass
class Trace:
  """The measurements of one pull in flight (pulling.py fills it): laps per phase
  (`lap`; `chose` and `planned` end the first two), what it redid (`retry`), the
  version, the plan and the data path."""

  started: float = dataclasses.field(default_factory=time.perf_counter)
  started_at: float = dataclasses.field(default_factory=time.time)
  phases: dict[str, float] = dataclasses.field(
      default_factory=lambda: dict.fromkeys(PHASES, 0.0))
  retries: list[str] = dataclasses.field(default_factory=list)
  version: int = 0
  plan: Any = None  # planning.PullPlan
  path: str = ""
  steps: dict[str, float] = dataclasses.field(default_factory=dict)  # the data path's
  result_bytes: int | None = None  # where the pull knows them without the result's leaves

  def __post_init__(self):
    self.last = self.started

  def lap(self, phase: str) -> float:
    """Adds the time since the last lap to `phase`; returns now (perf_counter)."""
    now = time.perf_counter()
    self.phases[phase] += now - self.last
    self.last = now
    return now

  def chose(self, version: int) -> None:
    """The version is chosen: the end of the wait phase."""
    self.version = version
    self.lap("wait")

  def planned(self, plan: Any) -> None:
    """The plan is made: the end of the plan phase."""
    self.plan = plan
    self.lap("plan")

  def retry(self, cause: str) -> None:
    self.retries.append(cause)


def cause_of(error: BaseException) -> str:
  """A short, bounded label of an error's kind (a metric's label value)."""
  for kind, cause in _CAUSES:  # most specific first (errors.py's hierarchy)
    if isinstance(error, kind):
      return cause
  return "other"


_CAUSES = ((VersionGone, "version_gone"), (PeerFailed, "peer_failed"),
           (ReshardTimeoutError, "timeout"), (ReshardValueError, "value"),
           (ReshardTypeError, "type"), (ReshardRuntimeError, "runtime"))
