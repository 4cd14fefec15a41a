"""`Subscriber.pull(delta="auto")`: the rule (delta_auto.Estimates, pure: a sparse leaf
over a slow link pays, a dense one or a fast link does not, per leaf within one pull,
the margin, re-measuring stale leaves ever more rarely while they stay full, a new
layout set forgetting all), and end to end in one program (publisher on 4 devices,
subscriber on the other 4): the first pulls full while the rate and the fractions are
measured, then per leaf compared or dense as the measured link makes them pay, every
result bitwise against a full pull, and a local pull never a delta. The multi-process
agreement runs in tests/jobs_delta_test.py's separate jobs (jobs_delta_worker.py).
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import delta, delta_auto

TOKEN = "delta-auto-test-token-0123"
MID = "m1"
GBIT = 125e6  # bytes per second of a 1 Gbit/s link


def _estimates(rate=None, encode_s=None, apply_s=None, fractions=None):
  est = delta_auto.Estimates()
  est.layout(MID)
  if rate is not None:
    est.learn_full(int(rate), 1.0)
  if encode_s is not None:
    est.learn_encode(encode_s)
  if apply_s is not None:
    est.learn_apply(apply_s * 1e6, 10 ** 6)
  if fractions:
    est.learn_changed({t: (int(f * 10 ** 6), 10 ** 6) for t, f in fractions.items()},
                      full=False)
  return est


GIB_F32 = 1 << 28  # elements of a 1 GiB float32 leaf


def test_without_a_measured_rate_it_pulls_full_and_measures():
  est = delta_auto.Estimates()
  est.layout(MID)
  d = est.decide([(0, 100, 4), (1, 100, 2)])
  assert not d.delta and d.measure == {0, 1} and "rate" in d.why


def test_sparse_over_a_slow_link_pays_dense_does_not():
  # A GPU publisher's encode (~5 ms per GiB) and apply: 2% changed saves ~80% of 8.6 s.
  gpu = dict(rate=GBIT, encode_s=5e-3 / GIB_F32, apply_s=1e-11)
  d = _estimates(**gpu, fractions={0: 0.02}).decide([(0, GIB_F32, 4)])
  assert d.delta and d.compare == {0}
  # 80% changed: a bitmap chunk is 0.8 w + 1/8 bytes, saving 17% of the bytes; with a
  # numpy encode (~1 s per GiB) and apply it does not pay.
  cpu = dict(rate=GBIT, encode_s=1.0 / GIB_F32, apply_s=1.0 / GIB_F32)
  d = _estimates(**cpu, fractions={0: 0.8}).decide([(0, GIB_F32, 4)])
  assert not d.delta and not d.measure
  # Over loopback (~2 GB/s) a numpy encode of 4 ns per element costs more than the 4
  # bytes of an element take: full even when nothing changed.
  est = _estimates(rate=2e9, encode_s=4e-9, apply_s=1e-9, fractions={0: 0.0})
  assert not est.decide([(0, 1 << 20, 4)]).delta


def test_per_leaf_within_one_pull():
  est = _estimates(rate=GBIT, encode_s=1e-10, apply_s=1e-10,
                   fractions={0: 0.0, 1: 1.0, 2: 0.01, 3: 0.99})
  d = est.decide([(0, 10 ** 6, 4), (1, 10 ** 6, 4), (2, 10 ** 6, 2), (3, 10, 1)])
  assert d.delta and d.compare == {0, 2}  # 1 and 3 cross dense, not compared
  # The same leaves when the dense ones dominate: applying to all of them costs more
  # than the small sparse leaf saves: a full pull.
  d = est.decide([(0, 10, 4), (1, 10 ** 8, 4), (2, 10, 2), (3, 10 ** 8, 1)])
  assert not d.delta


def test_a_gain_under_the_margin_is_none():
  # Saves (4 - 0.125) / rate per element; costs encode + apply: tuned to save just
  # under the margin, then just over it.
  rate, margin = 1e9, delta_auto.MARGIN
  full_s = 4 / rate
  saved = (4 - 0.125) / rate
  encode_s = saved - (margin - 0.01) * full_s - 1e-12
  est = _estimates(rate=rate, encode_s=encode_s, apply_s=1e-12, fractions={0: 0.0})
  d = est.decide([(0, 10 ** 6, 4)])
  assert not d.delta and f"at most {100 * margin:g}%" in d.why
  d = _estimates(rate=rate, encode_s=encode_s - 0.02 * full_s, apply_s=1e-12,
                 fractions={0: 0.0}).decide([(0, 10 ** 6, 4)])
  assert d.delta


def test_stale_leaves_are_measured_ever_more_rarely_while_full():
  est = _estimates(rate=2e9, encode_s=4e-9, apply_s=1e-9)
  leaves = [(0, 1000, 4)]
  assert est.decide(leaves).measure == {0}  # never measured
  est.learn_changed({0: (900, 1000)}, full=True)
  measured_at = []
  for i in range(1, 200):
    d = est.decide(leaves)
    assert not d.delta
    if d.measure:
      measured_at.append(i)
      est.learn_changed({0: (900, 1000)}, full=True)
  gaps = np.diff([0] + measured_at).tolist()
  assert gaps[:4] == [16, 32, 64, 64], gaps  # 8 doubled per full measurement, capped
  # Measured within a delta pull: back to every STALE_AFTER pulls.
  est.learn_changed({0: (900, 1000)}, full=False)
  assert [est.decide(leaves).measure for _ in range(8)][-1] == {0}


def test_a_delta_slower_than_predicted_is_followed_by_one_full_pull():
  est = _estimates(rate=GBIT, encode_s=1e-10, apply_s=1e-10, fractions={0: 0.01})
  leaves = [(0, 10 ** 6, 4)]
  assert est.decide(leaves).delta  # predicted full: 4 MB / 125 MB/s = 32 ms
  est.learn_delta(0.010)           # 10 ms: it won
  assert est.decide(leaves).delta
  est.learn_delta(0.050)           # 50 ms: it lost
  d = est.decide(leaves)
  assert not d.delta and "more than a full pull's predicted 32.0 ms" in d.why
  est.learn_full(4 * 10 ** 6, 0.032)
  assert est.decide(leaves).delta  # the model again


def test_a_new_layout_set_forgets_everything():
  est = _estimates(rate=GBIT, encode_s=1e-12, apply_s=1e-12, fractions={0: 0.0})
  assert est.decide([(0, 10 ** 6, 4)]).delta
  est.layout(MID)  # the same: kept
  assert est.decide([(0, 10 ** 6, 4)]).delta
  est.layout("another")
  assert not est.decide([(0, 10 ** 6, 4)]).delta
  assert est.rate is None and est.fraction == {}


def test_the_moving_average_and_the_medians():
  est = _estimates(fractions={0: 0.5})
  est.learn_changed({0: (1, 10)}, full=False)
  assert est.fraction[0] == pytest.approx(delta_auto.ALPHA * 0.1
                                          + (1 - delta_auto.ALPHA) * 0.5)
  for seconds in (1.0, 1.1, 9.0, 0.9, 1.0, 1.2):  # one outlier (a slow pull)
    est.learn_full(10 ** 9, seconds)
  assert est.rate == pytest.approx(10 ** 9 / 1.1)  # the median of the last 5
  est.rate = 5.0  # a known rate replaces the measurements
  assert est.rate == 5.0


# ---------------------------------------------------------------- end to end


def _put(host, sharding):
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i],
                                      dtype=host.dtype)


def _bits(x):
  return np.asarray(x).reshape(-1).view(np.uint8)


def test_auto_end_to_end():
  devices = jax.devices()
  src = NamedSharding(Mesh(np.array(devices[:4]), ("x",)), P("x"))
  dst = NamedSharding(Mesh(np.array(devices[4:8]).reshape(2, 2), ("a", "b")),
                      P(None, "b"))
  rng = np.random.default_rng(3)
  # frozen (never changes), dense (every element, every version), sparse (1%)
  hosts = [rng.standard_normal((16, 4096)).astype(np.float32) for _ in range(3)]

  def step():
    hosts[1] += 1
    flat = hosts[2].reshape(-1)
    flat[rng.integers(0, flat.size, flat.size // 100)] += 1
    return pub.publish([_put(h, src) for h in hosts])

  def kind(fn):
    before = delta.snapshot()
    out = fn()
    after = delta.snapshot()
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in after}

  with jax_m2n.Publisher(token=TOKEN, keep=3) as pub, \
       jax_m2n.Subscriber(pub.address, token=TOKEN) as sub, \
       jax_m2n.Subscriber(pub.address, token=TOKEN) as ref:
    est = sub._state.auto
    prev = None

    def pull_both():
      nonlocal prev
      out, got = kind(lambda: sub.pull([dst] * 3, delta="auto", path="network",
                                       donate=prev))
      full = ref.pull([dst] * 3, path="network")
      for a, b, h in zip(out, full, hosts):
        assert np.array_equal(_bits(a), _bits(b))
        assert np.array_equal(np.asarray(a), h)
      prev = out
      return got

    pub.publish([_put(h, src) for h in hosts])
    got = pull_both()  # no base: full (it plans and compiles: no measure of the link)
    assert got.get("subscriber_full_pulls") == 1 and est.rate is None
    step()
    got = pull_both()  # a base, no rate nor fractions yet: full, then both measured
    assert got.get("subscriber_auto_full") == 1 and got.get("publisher_measures") == 1
    assert est.rate is not None
    assert est.fraction[0] == 0.0 and est.fraction[1] == 1.0
    assert 0.005 < est.fraction[2] < 0.02 and est.encode_s is not None
    # A slow link (its rate as a full pull would have measured it: 1 MB/s): the
    # frozen and the sparse leaf pay, the dense one crosses dense, not compared.
    est.rate = 1e6
    step()
    measured = dict(est._measured)
    got = pull_both()
    assert got.get("subscriber_auto_delta") == 1, (est.rate, est.encode_s, est.apply_s)
    assert got.get("subscriber_delta_pulls") == 1
    # leaf 1 whole, leaf 0 nothing, leaf 2 its ~1%: the values that crossed
    assert hosts[1].size <= got["publisher_changed"] < hosts[1].size + hosts[2].size // 50
    assert est._measured[1] == measured[1] and est._measured[0] > measured[0]
    assert got.get("subscriber_pulled_bytes") < hosts[1].nbytes + hosts[2].nbytes // 4
    assert est.apply_s is not None and est.fraction[0] == 0.0
    # A fast link (1 TB/s): nothing pays, the pull is full.
    est.rate = 1e12
    step()
    got = pull_both()
    assert got.get("subscriber_auto_full") == 1 and not got.get("subscriber_delta_pulls")
    # On one host (path="auto" reads the publisher's memory): never a delta.
    est.rate = 1e6
    step()
    _, got = kind(lambda: sub.pull([dst] * 3, delta="auto"))
    assert sub._state.path == "local" and not got.get("subscriber_delta_pulls")
