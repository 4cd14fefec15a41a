"""One pull in flight, as one value (`Pull`): what the engines that move its bytes (a
full pull: engine.py; a delta: delta.py; through a relay: relay.py) need, passed whole.

Owns that value and the one bounded wait for arrays a transport fetches (`wait_arrived`).
Moves nothing itself; plans nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTimeoutError
from jax_m2n._src.jobs.connections import Link
from jax_m2n._src.jobs.planning import PullPlan
from jax_m2n._src.jobs.request import PullOptions, PullRequest
from jax_m2n._src.jobs.transport import Pending, Transport

API = "Subscriber.pull"


@dataclasses.dataclass
class Pull:
  """One pull of version `number` on this process.

  Attributes:
    request: what the caller asked (dst, dtypes, options...).
    plan: its plan and this process's part of it.
    number: the version pulled; None for a network pull of the newest version after
      `after` (one message to a single publisher process: engine.request), set once the
      publisher names the version it offered.
    links: per publisher process this pull reads from, its connection.
    transport: this process's transport (fetches, and offers to its job's peers).
    waits: the subscriber job's CallWaits (None in a one-process job).
    salt: the pull's random salt (the tickets of forwards inside the job).
    peers: per process of the subscriber job, its transport's address.
    after: with `number` None, the subscriber's last version.
    steps: what the data path measured of itself (a local pull: records.LOCAL_STEPS).
  """

  request: PullRequest
  plan: PullPlan
  number: int | None
  links: dict[int, Link]
  transport: Transport
  waits: Any = None
  salt: bytes = b""
  peers: dict[int, str] = dataclasses.field(default_factory=dict)
  after: int = 0
  started: float = dataclasses.field(default_factory=time.monotonic)
  steps: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def options(self) -> PullOptions:
    return self.request.options

  @property
  def timeout_s(self) -> float:
    return self.request.options.timeout_s

  @property
  def deadline(self) -> float:
    return self.started + self.timeout_s


def wait_arrived(pull: Pull, pending: Sequence[tuple[str, Pending]], what: str
                 ) -> list[list[jax.Array]]:
  """Waits (bounded by the pull's deadline; in a multi-process job also ended by a
  peer's failure or death) until every fetch is done; returns their arrays, in order.
  A failed fetch is a ReshardRuntimeError naming its sender (`pending`: (sender's
  name, what `Transport.fetch` returned))."""
  left = list(pending)

  def ready() -> bool:
    nonlocal left
    left = [(p, f) for p, f in left if not f.done()]
    return not left

  if pull.waits is not None:
    pull.waits.wait_ready(ready, {}, what)
  else:
    for name, fetch in pending:
      if not fetch.wait(pull.deadline - time.monotonic()):
        ready()
        raise ReshardTimeoutError(
            f"{API}: {what} must arrive within timeout_s={pull.timeout_s:g}; got "
            f"{len(left)} fetch(es) from {name} still missing (the publisher "
            "stalled, or its link is too slow for this timeout).")
  out = []
  for name, fetch in pending:
    try:
      out.append(fetch.result())
    except Exception as e:  # noqa: BLE001 - the transport's failure, named
      raise ReshardRuntimeError(
          f"{API}: the transfer from {name} failed ({what}; it died or closed "
          f"mid-transfer): {type(e).__name__}: {e}") from e
  return out
