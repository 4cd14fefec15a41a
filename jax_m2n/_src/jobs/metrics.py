"""Prometheus metrics of weight sync (the optional `metrics` extra: prometheus-client).

Owns the metrics a registry the user passes gets (`Subscriber(..., metrics=registry)`,
`Publisher(..., metrics=registry)`): made once per registry and shared by the instances
that pass it (their counts sum, as one process's should). A subscriber's are counted
as each pull ends, from its PullRecord or PullFailure; a publisher's are read from its
Counters when the registry is scraped (a collector), so nothing is counted twice.
Opens no port: exposing the registry is the user's one line
(`prometheus_client.start_http_server(9000, registry=registry)`).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError
from jax_m2n._src.jobs import records
from jax_m2n._src.jobs.counters import DATA_OPS

# Pull seconds: from a local pull of a small model (~1 ms) to a cross-host pull of a
# large one (minutes).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           25.0, 60.0, 150.0, 300.0, math.inf)

_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_made_lock = threading.Lock()


def prometheus_module():
  """prometheus_client, or an error saying how to install it."""
  try:
    import prometheus_client
    import prometheus_client.core  # noqa: F401 - the collector's metric families
  except ImportError:
    raise ReshardRuntimeError(
        "jax_m2n jobs: prometheus-client must be installed for metrics=; got no module "
        "prometheus_client. Hint: pip install 'jax_m2n[metrics]'.") from None
  return prometheus_client


def of(api: str, registry: Any) -> "Metrics | None":
  """The metrics in `registry` (made on first use), or None for None.

  Raises:
    ReshardTypeError: `registry` is not a prometheus_client.CollectorRegistry.
    ReshardRuntimeError: prometheus-client is not installed.
  """
  if registry is None:
    return None
  pc = prometheus_module()
  if not isinstance(registry, pc.CollectorRegistry):
    raise ReshardTypeError(f"{api}: metrics must be a prometheus_client."
                           f"CollectorRegistry or None; got {type(registry).__name__}.")
  with _made_lock:
    got = _made.get(registry)
    if got is None:
      got = _made[registry] = Metrics(pc, registry)
    return got


class Metrics:
  """The metrics of one registry (see the module's comment; docs/watching.md lists them)."""

  def __init__(self, pc: Any, registry: Any):
    def counter(name, what, labels):
      return pc.Counter(name, what, labels, registry=registry)

    self.pulls = counter("jax_m2n_pulls", "Successful pulls, by data path.", ["path"])
    self.wire_bytes = counter("jax_m2n_pull_wire_bytes", "Bytes received by pulls "
                              "(fetched, or copied from the publisher's memory), by "
                              "data path.", ["path"])
    self.result_bytes = counter("jax_m2n_pull_result_bytes", "Bytes of the pulls' "
                                "results, by data path.", ["path"])
    self.seconds = pc.Histogram("jax_m2n_pull_seconds", "Seconds per successful pull, "
                                "by data path.", ["path"], registry=registry,
                                buckets=BUCKETS)
    self.phase_seconds = pc.Histogram(
        "jax_m2n_pull_phase_seconds", "Seconds per phase of a successful pull (wait, "
        "plan, move, compose).", ["phase"], registry=registry, buckets=BUCKETS)
    self.retries = counter("jax_m2n_pull_retries", "What pulls redid, by cause.",
                           ["cause"])
    self.failures = counter("jax_m2n_pull_failures", "Failed pulls, by cause.",
                            ["cause"])
    self._publishers: weakref.WeakSet = weakref.WeakSet()
    registry.register(_PublisherCollector(pc, self._publishers))

  def pulled(self, r: records.PullRecord) -> None:
    self.pulls.labels(r.path).inc()
    self.wire_bytes.labels(r.path).inc(r.wire_bytes)
    self.result_bytes.labels(r.path).inc(r.result_bytes)
    self.seconds.labels(r.path).observe(r.total_s)
    for phase in records.PHASES:
      self.phase_seconds.labels(phase).observe(getattr(r, f"{phase}_s"))
    for cause in r.retries:
      self.retries.labels(cause).inc()

  def failed(self, f: records.PullFailure) -> None:
    self.failures.labels(f.cause).inc()

  def watch(self, counters: Any) -> None:
    """Reads a publisher process's Counters at every scrape (while it lives)."""
    self._publishers.add(counters)


class _PublisherCollector:
  """The publishers' metrics, read from their records at scrape time (summed)."""

  def __init__(self, pc: Any, publishers: weakref.WeakSet):
    self._family = pc.core
    self._publishers = publishers

  def collect(self):
    core = self._family
    stats = [c.stats() for c in list(self._publishers) if c.bound]
    yield core.CounterMetricFamily("jax_m2n_versions_published", "Versions published.",
                                   value=sum(s.last_version for s in stats))
    yield core.GaugeMetricFamily("jax_m2n_versions_held", "Versions held now.",
                                 value=sum(len(s.versions) for s in stats))
    yield core.GaugeMetricFamily("jax_m2n_held_bytes", "Bytes of the versions held now.",
                                 value=sum(s.held_bytes for s in stats))
    device = core.GaugeMetricFamily(
        "jax_m2n_publisher_device_bytes", "Device bytes held for weight sync beside the "
        "trainer's own arrays (snapshots, wire conversions), by device.",
        labels=["device"])
    per: dict[str, int] = {}
    for s in stats:
      for d, n in s.device_bytes.items():
        per[d] = per.get(d, 0) + n
    for d in sorted(per):
      device.add_metric([d], per[d])
    yield device
    yield core.GaugeMetricFamily(
        "jax_m2n_lent_allocation_bytes", "Bytes of the XLA allocations lent to local "
        "readers now (what they may see).",
        value=sum(s.lent_allocation_bytes for s in stats))
    yield core.GaugeMetricFamily(
        "jax_m2n_subscribers_connected", "Control connections heard from within the "
        "window (PublisherStats.window_s).", value=sum(s.subscribers for s in stats))
    yield core.CounterMetricFamily("jax_m2n_offered_bytes", "Bytes offered to "
                                   "subscribers through the transport (egress).",
                                   value=sum(s.offered_bytes for s in stats))
    answered = core.CounterMetricFamily("jax_m2n_pulls_answered", "Data requests "
                                        "answered, by operation.", labels=["op"])
    for op in DATA_OPS:
      answered.add_metric([op], sum(s.answered.get(op, 0) for s in stats))
    yield answered
    failures = core.CounterMetricFamily("jax_m2n_publisher_failures", "Requests refused "
                                        "or answered with an error, by cause.",
                                        labels=["cause"])
    for cause in sorted({c for s in stats for c in s.failures}):
      failures.add_metric([cause], sum(s.failures.get(cause, 0) for s in stats))
    yield failures
