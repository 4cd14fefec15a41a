"""`delta="auto"`: per leaf, delta or full, from what earlier pulls measured.

Owns a subscriber's estimates (per leaf the fraction of its elements whose wire bits
changed per version, a moving average; the rate of its full network pulls, the
publisher's encode seconds per compared element and this process's apply seconds per
element, each the median of its last few measurements) and the rule that chooses (docs/jobs.md, "Delta sync"). Pure: no sockets, no
arrays, no clocks; delta.py feeds it measurements and asks it before each pull.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Sequence

# The weight of a new measurement in a leaf's fraction: it follows the learning-rate
# schedule, so recent pulls count most (the counts are exact: no outliers).
ALPHA = 0.5
# Times are noisy (a pull of the RL example's model took 13-120 ms on a loaded host):
# the rate and the costs are the median of this many last measurements.
RECENT = 5
# A leaf's fraction is measured again after this many pulls without a measurement of it,
# the interval doubling (up to MAX_STALE) each time a measurement leaves the choice full:
# a measurement costs the publisher a compare (~0.1 s per GiB with numpy on CPU, well
# under 1 ms on a GPU), so a pull that stays full pays it rarely.
STALE_AFTER = 8
MAX_STALE = 64
# A delta pull must be predicted this much faster than a full one (a fraction of the full
# pull's time): near even the model's error would pick the slower one half the time.
MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class Decision:
  """What one pull does.

  Attributes:
    delta: a delta pull (else full).
    compare: in a delta pull, the leaves the publisher compares and encodes (the others
      cross dense, not compared).
    measure: after a full pull, the leaves whose change fraction to ask for.
    why: the reason, for logs and the bench.
  """

  delta: bool
  compare: frozenset[int]
  measure: frozenset[int]
  why: str


class Estimates:
  """A subscriber's estimates for one published layout set (reset when it changes).

  Attributes:
    fraction: per leaf, the moving average of its changed fraction.
    rate: bytes per second of this process's full network pulls.
    encode_s: the publisher's compare + encode seconds per compared element.
    apply_s: this process's seconds per element of the leaves a delta pull applies to.
    (The last three: None before a measurement, else the median of the last RECENT;
    setting one replaces its measurements, e.g. with a link's known rate.)

  Example (1 GiB of float32, 2% changed, over 1 Gbit/s: a delta; over 10 GB/s, not):
    >>> est = Estimates()
    >>> est.layout("a layout set")
    >>> est.learn_full(125_000_000, 1.0)
    >>> est.learn_encode(4e-9)
    >>> est.learn_apply(0.1, 10 ** 8)
    >>> est.learn_changed({0: (2, 100)}, full=True)
    >>> d = est.decide([(0, 1 << 28, 4)])
    >>> d.delta, sorted(d.compare)
    (True, [0])
    >>> est.rate = 10e9
    >>> est.decide([(0, 1 << 28, 4)]).delta
    False
  """

  rate = property(lambda self: self._median("rate"),
                  lambda self, v: self._set("rate", v))
  encode_s = property(lambda self: self._median("encode_s"),
                      lambda self, v: self._set("encode_s", v))
  apply_s = property(lambda self: self._median("apply_s"),
                     lambda self, v: self._set("apply_s", v))

  def __init__(self):
    self._reset("")

  def _reset(self, manifest_id: str) -> None:
    self.manifest_id = manifest_id
    self.fraction: dict[int, float] = {}
    self._measured: dict[int, int] = {}  # leaf -> the pull count of its last measure
    self._stale: dict[int, int] = {}     # leaf -> its current re-measure interval
    self.pulls = 0
    self._full_s = 0.0    # the last decision's predicted full pull, in seconds
    self._lost = ""       # why the last delta lost against it ("": it did not)
    self._recent: dict[str, collections.deque] = {
        k: collections.deque(maxlen=RECENT) for k in ("rate", "encode_s", "apply_s")}

  def _median(self, what: str) -> float | None:
    got = self._recent[what]
    return statistics.median(got) if got else None

  def _set(self, what: str, value: float | None) -> None:
    self._recent[what].clear()
    if value is not None:
      self._recent[what].append(value)

  def layout(self, manifest_id: str) -> None:
    """The layout set the next pull is of: another than the last forgets everything
    (leaf numbers, sizes and the link may all differ)."""
    if manifest_id != self.manifest_id:
      self._reset(manifest_id)

  def decide(self, leaves: Sequence[tuple[int, int, int]]) -> Decision:
    """The choice for a pull of `leaves` ((leaf, elements, wire itemsize)) that has a
    base (a previous result the delta would apply to).

    Per leaf, comparing it pays when the bytes it saves outweigh the publisher's
    encode: elements x ((w - sent) / rate - encode_s), sent = min(w, f w + 1/8) the
    bytes per element of a bitmap chunk at fraction f (a dense chunk's w). A delta pull
    pays when the leaves that pay save more than applying costs over every leaf
    (elements x apply_s), by MARGIN of the full pull's time. Leaves never measured, or
    not for their interval, are measured: compared within a delta pull, asked for after
    a full one. After a delta that took longer than the full pull predicted
    (`learn_delta`), one full pull: it measures the link again.
    """
    self.pulls += 1
    stale = frozenset(t for t, _, _ in leaves if t not in self.fraction or (
        self.pulls - self._measured[t] >= self._stale.get(t, STALE_AFTER)))
    if self.rate is None:
      return Decision(False, frozenset(), stale, "the link's rate is not measured yet "
                      "(by a full network pull)")
    if self._lost:
      why, self._lost = self._lost, ""
      return Decision(False, frozenset(), stale, why)
    encode_s, apply_s = self.encode_s or 0.0, self.apply_s or 0.0
    compare, saved, applying, full_s = set(), 0.0, 0.0, 0.0
    for t, n, w in leaves:
      full_s += n * w / self.rate
      applying += n * apply_s
      f = self.fraction.get(t)
      if f is None:
        continue
      gain = n * ((w - min(w, f * w + 0.125)) / self.rate - encode_s)
      if gain > 0:
        compare.add(t)
        saved += gain
    self._full_s = full_s
    if compare and saved - applying > MARGIN * full_s:
      return Decision(True, frozenset(compare) | stale, frozenset(),
                      f"delta saves ~{1e3 * (saved - applying):.1f} ms of "
                      f"~{1e3 * full_s:.1f} ms")
    return Decision(False, frozenset(), stale,
                    f"delta would save {1e3 * (saved - applying):.1f} ms of "
                    f"~{1e3 * full_s:.1f} ms (at most {100 * MARGIN:g}% counts as none)")

  def learn_changed(self, changed: dict[int, tuple[int, int]], full: bool) -> None:
    """Per leaf (changed, compared) elements of one version against the base. `full`:
    measured after a full pull (the leaf's interval doubles: a pull that stays full
    pays measurements ever more rarely); else within a delta pull (the interval
    resets)."""
    for t, (c, n) in changed.items():
      if n <= 0:
        continue
      f = c / n
      old = self.fraction.get(t)
      self.fraction[t] = f if old is None else ALPHA * f + (1 - ALPHA) * old
      self._measured[t] = self.pulls
      interval = self._stale.get(t, STALE_AFTER)
      self._stale[t] = min(MAX_STALE, 2 * interval) if full else STALE_AFTER

  def learn_full(self, nbytes: int, seconds: float) -> None:
    """A full network pull moved `nbytes` in `seconds` (its data path, end to end)."""
    if nbytes > 0 and seconds > 0:
      self._recent["rate"].append(nbytes / seconds)

  def learn_delta(self, seconds: float) -> None:
    """A delta pull (no program compiled for it) took `seconds`: longer than the full
    pull its decision predicted, the next pull is full."""
    if seconds > self._full_s > 0:
      self._lost = (f"the last delta took {1e3 * seconds:.1f} ms, more than a full "
                    f"pull's predicted {1e3 * self._full_s:.1f} ms: a full pull measures "
                    "the link again")

  def learn_encode(self, seconds_per_element: float) -> None:
    """The publisher's compare + encode seconds per element, as it reported them."""
    if seconds_per_element >= 0:
      self._recent["encode_s"].append(seconds_per_element)

  def learn_apply(self, seconds: float, elements: int) -> None:
    """A delta pull applied to `elements` elements of leaves in `seconds`."""
    if elements > 0 and seconds >= 0:
      self._recent["apply_s"].append(seconds / elements)
