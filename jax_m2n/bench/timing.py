"""Timing: the measurement loop, statistics, and the host's copy bandwidth.

Owns the method of docs/bench_reference.md ("Method"): warm-ups, then >= 10 timed iterations, each the
wall-clock from the call to `block` returning for every output (on one host: the maximum
over devices); mean, min and median kept with every raw time. The loop adds only two
`perf_counter` calls per iteration: outputs are freed and garbage collected outside the
timed region. Knows nothing about engines or cases.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Timing:
  """Raw seconds of one (case, engine): warm-up calls and timed calls."""

  warmup_s: list[float]
  times_s: list[float]


def add_loop_flags(parser: Any, iters: int, warmup: int) -> None:
  """--iters and --warmup, the counts of `time_calls`, on a suite's command line."""
  parser.add_argument("--iters", type=int, default=iters, help="timed calls per case")
  parser.add_argument("--warmup", type=int, default=warmup,
                      help="untimed calls before them")


def stats_ms(times_s: list[float]) -> dict[str, float]:
  """mean, min, median, max, std (sample) of seconds, in milliseconds."""
  if not times_s:
    return {}
  ms = [t * 1e3 for t in times_s]
  return {"mean_ms": statistics.fmean(ms), "min_ms": min(ms),
          "median_ms": statistics.median(ms), "max_ms": max(ms),
          "std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0}


def time_calls(run: Callable[[], Any], block: Callable[[Any], Any], warmup: int,
               iters: int, release: Callable[[Any], None] | None = None,
               before: Callable[[], None] | None = None) -> Timing:
  """Calls `run` warmup + iters times; each time is `run()` until `block(out)` returns.

  `before()` (fresh inputs) runs before the clock starts, `release(out)` (deleting device
  buffers) after it stops. The garbage collector is off for the whole loop (one
  collection before it): a collection never lands inside a measurement, and none runs
  just before one either (a full collection evicts the CPU caches: it added 0.3-0.5 ms
  to the next small call on CPU).
  """
  warm, timed = [], []
  was_enabled = gc.isenabled()
  gc.collect()
  gc.disable()
  try:
    for i in range(warmup + iters):
      if before is not None:
        before()
      t0 = time.perf_counter()
      out = run()
      block(out)
      t1 = time.perf_counter()
      (warm if i < warmup else timed).append(t1 - t0)
      if release is not None:
        release(out)
      del out
  finally:
    if was_enabled:
      gc.enable()
  return Timing(warm, timed)


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> dict[str, float]:
  """numpy copy bandwidth between two pre-faulted buffers (GB/s, 1 GB = 1e9 B).

  The CPU stand-in for per-device link bandwidth: bytes copied per second, one thread.
  Returns the best and the median of `reps` copies.
  """
  src = np.ones(nbytes, dtype=np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # fault the pages in
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return {"best_gbps": nbytes / min(times) / 1e9,
          "median_gbps": nbytes / statistics.median(times) / 1e9, "bytes": nbytes,
          "reps": reps}
