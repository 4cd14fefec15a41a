"""A Subscriber's records of its pulls: the last successful one and the last failure.

Owns turning one pull's `records.Trace` (pulling.py fills it) and what this process's
engines and control clients counted meanwhile into a `PullRecord` (or a
`PullFailure`), the one log line per pull (INFO) and per failure (WARNING) under the
logger "jax_m2n", and their metrics (metrics.py). Moves nothing, decides nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import jax

from jax_m2n._src.jobs import delta, engine, records, relay
from jax_m2n._src.layout import box_size
from jax_m2n._src.planner.plan import fmt_bytes

logger = logging.getLogger("jax_m2n")
API = "Subscriber.pull"

# What each data path received, as the engines count it (their module counters, this
# process's: two Subscribers pulling at once in one process would mix theirs).
_WIRE = {"network": (engine.stats, ("pulled_bytes", "forwarded_in_bytes")),
         "relay": (relay.stats, ("from_trainer_bytes", "from_peers_bytes")),
         "delta": (delta.stats, ("subscriber_pulled_bytes",))}


class Watch:
  """A Subscriber's last pull and last failure, with their log lines and metrics.

  Args:
    metrics: metrics.Metrics to count each pull into, or None.
  """

  def __init__(self, metrics: Any = None):
    self.last_pull: records.PullRecord | None = None
    self.last_failure: records.PullFailure | None = None
    self._metrics = metrics

  def pull(self, state: Any, run: Callable[[], Any]) -> Any:
    """Runs one pull (`run()`, which fills `state.trace`) and records it."""
    trace = state.trace = records.Trace()
    before = _Counts(state)
    try:
      out = run()
    except Exception as e:
      failure = records.PullFailure(records.cause_of(e), f"{type(e).__name__}: {e}",
                                    time.time(), time.perf_counter() - trace.started,
                                    trace.version, trace.path)
      self.last_failure = failure
      logger.warning("%s: failed after %.3f s (%s): %s", API, failure.seconds,
                     failure.cause, failure.error)
      if self._metrics is not None:
        self._metrics.failed(failure)
      raise
    end = trace.lap("compose")
    r = self.last_pull = before.record(trace, end, out, state)
    logger.info("%s: version %d by %s (%s route): %s, %s received, %.3f s (wait %.3f, "
                "plan %.3f, move %.3f, compose %.3f)%s", API, r.version, r.path, r.route,
                fmt_bytes(r.result_bytes), fmt_bytes(r.wire_bytes), r.total_s, r.wait_s,
                r.plan_s, r.move_s, r.compose_s,
                f"; redid: {', '.join(r.retries)}" if r.retries else "")
    if self._metrics is not None:
      self._metrics.pulled(r)
    return out


class _Counts:
  """The counters a pull's record is the difference of, as they were at its start."""

  def __init__(self, state: Any):
    self.engines = {path: {k: c[k] for k in keys} for path, (c, keys) in _WIRE.items()}
    self.dense = delta.stats["subscriber_dense_bytes"]
    self.relay = {k: relay.stats[k] for k in ("bad_chunks", "reroutes")}
    self.clients = {id(c): (c, dict(c.stats)) for c in state.connections.clients()}

  def _grown(self, path: str) -> int:
    counter, keys = _WIRE[path]
    return sum(counter[k] - self.engines[path][k] for k in keys)

  def record(self, trace: records.Trace, end: float, out: Any, state: Any
             ) -> records.PullRecord:
    pp, path = trace.plan, trace.path
    if path == "local":  # copied from the publisher's memory, in the published dtype
      wire = _local_wire_bytes(pp)
    else:
      wire = self._grown(path)
    ratio = None
    if path == "delta":
      dense = delta.stats["subscriber_dense_bytes"] - self.dense
      ratio = wire / dense if dense else None
    grown = {k: relay.stats[k] - n for k, n in self.relay.items()}
    retries = (list(trace.retries) + ["relay bad chunk"] * grown["bad_chunks"]
               + ["relay re-route"] * grown["reroutes"])
    control = dict.fromkeys(("calls", "sent_bytes", "received_bytes"), 0)
    for c in state.connections.clients():
      known, was = self.clients.get(id(c), (None, {}))
      was = was if known is c else {}  # a client made during the pull: all of it
      for k in control:
        control[k] += c.stats[k] - was.get(k, 0)
    phases = trace.phases
    return records.PullRecord(
        version=trace.version, path=path, route=pp.plan.route,
        result_bytes=(trace.result_bytes if trace.result_bytes is not None else
                      sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(out))),
        wire_bytes=int(wire), wait_s=phases["wait"], plan_s=phases["plan"],
        move_s=phases["move"], compose_s=phases["compose"], total_s=end - trace.started,
        relay_parent=state.relay.upstream if path == "relay" else None,
        delta_ratio=ratio, retries=tuple(retries), control_calls=control["calls"],
        control_bytes_sent=control["sent_bytes"],
        control_bytes_received=control["received_bytes"], started_at=trace.started_at,
        steps=dict(trace.steps))


@functools.lru_cache(maxsize=64)
def _local_wire_bytes(pp: Any) -> int:
  """The bytes a local pull of plan `pp` copies (per plan: its ops' boxes in the
  published dtype; plans hash by identity)."""
  return sum(box_size(op.box) * pp.published[op.tensor].itemsize
             for groups in pp.requests.values() for ops in groups for op in ops)
