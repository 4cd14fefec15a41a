"""Delta sync (`Subscriber.pull(delta=True)`, over the network path: a local pull copies
whole versions at memory speed): the encoding round trip per chunk mode and
dtype; NaN and ±0 as bitwise changes; in one program (publisher on 4 devices, subscriber
on the other 4) random sparse and dense updates across random layouts and dtype
conversions, every version bitwise against a full pull, in place into the donated
previous result; a late joiner, missed versions (held and dropped bases), changed dst
layouts, deleted / elsewhere-donated / kept previous arrays, Quantize (full). Across
separate programs: a trainer job and a generator job of 1 and 2 processes each
(tests/jobs_delta_worker.py; every launch bounded, its processes killed on timeout)."""

import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import codec, delta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import jobs_test  # noqa: E402
from delta_cases import changes  # noqa: E402
from jobs_test import Jobs  # noqa: E402
from multiprocess_cpu_worker import _check, _random_sharding  # noqa: E402

TOKEN = "delta-test-token-0123"
BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(x):
  return np.asarray(x).reshape(-1).view(np.uint8)


# ---------------------------------------------------------------- the encoding


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int8, np.bool_, np.complex64,
                                   np.float64])
@pytest.mark.parametrize("how", ["none", "sparse", "runs", "half", "all"])
def test_encode_decode_round_trip(dtype, how):
  rng = np.random.default_rng(len(how))
  n = 3 * codec.CHUNK + 1234  # a partial last chunk
  old = (rng.standard_normal(n) * 10).astype(dtype)
  mask = changes(rng, n, how)
  new = old.copy()
  new[mask] = (rng.standard_normal(int(mask.sum())) * 10 + 100).astype(dtype)
  if dtype == np.bool_:
    new[mask] = ~old[mask]
  e = codec.encode(new, old)
  assert e.changed == int(codec.changed(new, old).sum())
  at = codec.decode(e.modes, e.bitmaps, e.runs, n)
  rebuilt = old.copy()
  rebuilt[at] = e.values
  assert np.array_equal(_bits(rebuilt), _bits(new))
  assert e.nbytes <= new.nbytes  # never more than dense
  if how == "none":
    assert e.nbytes == 0 and set(e.modes.tolist()) == {codec.NOTHING}
  if how == "sparse":
    assert e.nbytes < new.nbytes / 4, (e.modes, e.nbytes)
  if how == "runs":
    assert codec.RUNS in e.modes.tolist()
  if how == "all":
    assert set(e.modes.tolist()) == {codec.DENSE}
  # No base: every chunk dense, the values are the piece.
  full = codec.encode(new, None)
  assert set(full.modes.tolist()) == {codec.DENSE}
  assert np.array_equal(codec.decode(full.modes, full.bitmaps, full.runs, n), np.arange(n))


def test_nan_and_signed_zero_arechanges():
  old = np.array([0.0, -0.0, np.nan, np.nan, 1.0, 1.0], np.float32)
  new = old.copy()
  new[0] = -0.0                                             # +0 -> -0
  new[1] = 0.0                                              # -0 -> +0
  new[3] = np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]  # other NaN
  assert codec.changed(new, old).tolist() == [True, True, False, True, False, False]
  b_old, b_new = old.astype(BF16), new.astype(BF16)
  assert codec.changed(b_new, b_old).tolist()[:2] == [True, True]
  e = codec.encode(new, old, chunk=8)
  rebuilt = old.copy()
  rebuilt[codec.decode(e.modes, e.bitmaps, e.runs, old.size, chunk=8)] = e.values
  assert np.array_equal(rebuilt.view(np.uint32), new.view(np.uint32))


def test_malformed_deltas_are_refused():
  n = 100
  with pytest.raises(jax_m2n.ReshardRuntimeError, match="must match"):
    codec.decode(np.array([codec.BITMAP], np.int8), np.zeros(8, np.uint8),
                 np.zeros(0, np.int32), n)
  with pytest.raises(jax_m2n.ReshardRuntimeError, match="one mode per chunk"):
    codec.decode(np.array([1, 1], np.int8), np.zeros(0, np.uint8), np.zeros(0, np.int32),
                 n)
  with pytest.raises(jax_m2n.ReshardRuntimeError, match="runs must lie"):
    codec.decode(np.array([codec.RUNS], np.int8), np.zeros(0, np.uint8),
                 np.array([90, 20], np.int32), n)
  with pytest.raises(jax_m2n.ReshardRuntimeError, match="past its piece"):
    bitmap = np.full(13, 255, np.uint8)  # 104 bits for 100 elements
    codec.decode(np.array([codec.BITMAP], np.int8), bitmap, np.zeros(0, np.int32), n)


# ---------------------------------------------------------------- one program, two jobs


@pytest.fixture(scope="module")
def sides():
  devices = jax.devices()
  assert len(devices) >= 8
  return devices[:4], devices[4:8]


def _put(host, sharding):
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i],
                                      dtype=host.dtype)


def _expect(out, hosts, dsts, outs):
  for y, h, s, o in zip(out, hosts, dsts, outs):
    _check(y, h, s, o)


# (shape, published dtype, pulled dtype or None)
LEAVES = [((64, 300), np.float32, BF16), ((8, 6, 70), BF16, np.float32),
          ((40, 40), np.int32, np.float32), ((5,), np.float32, None),
          ((), np.float16, None), ((33, 2 * 8192 + 7), np.float32, None)]


@pytest.mark.parametrize("host_apply,device_encode", [
    (True, False), (False, False), (True, True)],
    ids=["numpy", "compiled", "device_encode"])
def test_random_updates_bitwise_against_full_pull(sides, host_apply, device_encode,
                                                  monkeypatch):
  # On CPU the delta is encoded and applied with numpy; the compiled paths (other
  # platforms: the publisher's compare and encode on the device, programs updating the
  # donated shards in place) are run here too.
  monkeypatch.setattr(codec, "HOST_APPLY", host_apply)
  monkeypatch.setattr(delta, "DEVICE_ENCODE", device_encode)
  trainer, gen = sides
  rng = np.random.default_rng(7)
  pub = jax_m2n.Publisher(token=TOKEN, keep=3)
  sub = jax_m2n.Subscriber(pub.address, token=TOKEN)
  ref = jax_m2n.Subscriber(pub.address, token=TOKEN)  # pulls in full: the oracle
  try:
    srcs = [_random_sharding(jax, rng, s, trainer) for s, _, _ in LEAVES]
    dsts = [_random_sharding(jax, rng, s, gen) for s, _, _ in LEAVES]
    outs = [o for _, _, o in LEAVES]
    hosts = [np.asarray((rng.standard_normal(s) * 4).astype(d) if d != np.int32
                        else rng.integers(-9, 9, s).astype(d)) for s, d, _ in LEAVES]
    prev = None
    for v, how in enumerate(["all", "sparse", "runs", "none", "half", "sparse"]):
      for h in hosts:
        mask = changes(rng, h.size, how).reshape(h.shape)
        h[mask] = (h[mask] + rng.integers(1, 5, int(mask.sum()))).astype(h.dtype)
      pub.publish([_put(h, s) for h, s in zip(hosts, srcs)])
      before = dict(delta.stats)
      out = sub.pull(dsts, dtype=outs, delta=True, path="network", donate=prev)
      full = ref.pull(dsts, dtype=outs, path="network")
      _expect(out, hosts, dsts, outs)
      for a, b in zip(out, full):
        assert np.array_equal(_bits(a), _bits(b))
      delta_pulls = delta.stats["subscriber_delta_pulls"] - before.get(
          "subscriber_delta_pulls", 0)
      assert delta_pulls == (1 if v else 0), (v, how)
      device_streams = delta.stats["publisher_device_streams"] - before.get(
          "publisher_device_streams", 0)
      assert (device_streams > 0) == (device_encode and v > 0), device_streams
      if v:
        assert all(a.is_deleted() for a in prev), "the base was donated in place"
        sent = delta.stats["publisher_encoded_bytes"] - before.get(
            "publisher_encoded_bytes", 0)
        dense = delta.stats["publisher_dense_bytes"] - before.get(
            "publisher_dense_bytes", 0)
        if how == "none":
          assert sent == 0
        elif how == "sparse":
          assert sent < dense / 4, (sent, dense)
      prev = out
  finally:
    sub.close()
    ref.close()
    pub.close()


@contextlib.contextmanager
def _one_leaf(trainer, gen, keep=2):
  """A publisher keeping `keep` versions and a subscriber of it (both closed after),
  with one leaf's source and destination shardings."""
  src = NamedSharding(Mesh(np.array(trainer), ("x",)), P("x"))
  dst = NamedSharding(Mesh(np.array(gen).reshape(2, 2), ("a", "b")), P(None, "b"))
  with jax_m2n.Publisher(token=TOKEN, keep=keep) as pub:
    with jax_m2n.Subscriber(pub.address, token=TOKEN) as sub:
      yield pub, sub, src, dst


def _count(key, fn):
  before = delta.stats[key]
  out = fn()
  return out, delta.stats[key] - before


def test_late_joiner_missed_versions_and_changed_layouts(sides):
  trainer, gen = sides
  with _one_leaf(trainer, gen, keep=3) as (pub, sub, src, dst):
    host = np.arange(8 * 4096, dtype=np.float32).reshape(8, 4096)
    pub.publish(_put(host, src))
    x = sub.pull(dst, delta=True, path="network")
    for v in (2, 3):
      host[v, :10] += 1
      pub.publish(_put(host, src))
    # Missed version 2; base 1 still held (keep=3): one delta carrying both changes.
    y, n = _count("subscriber_delta_pulls",
                  lambda: sub.pull(dst, delta=True, path="network", donate=x))
    assert n == 1 and sub.version == 3
    _check(y, host, dst)
    # A late joiner: no earlier pull, a full copy.
    late = jax_m2n.Subscriber(pub.address, token=TOKEN)
    z, n = _count("subscriber_full_pulls",
                  lambda: late.pull(dst, delta=True, path="network"))
    assert n == 1
    _check(z, host, dst)
    late.close()
    # Missed versions beyond keep: the base is dropped, every chunk crosses dense.
    for v in (4, 5, 6, 7):
      host[v, :10] += 1
      pub.publish(_put(host, src))
    dense = delta.stats["publisher_chunks_dense"]
    y = sub.pull(dst, delta=True, path="network", donate=y)
    assert delta.stats["publisher_chunks_dense"] > dense
    _check(y, host, dst)
    # Another dst layout (or dtype): a full copy.
    other = NamedSharding(dst.mesh, P("a", None))
    host[0, 0] += 1
    pub.publish(_put(host, src))
    w, n = _count("subscriber_full_pulls",
                  lambda: sub.pull(other, delta=True, path="network", donate=y))
    assert n == 1
    _check(w, host, other)
    host[1, 1] += 1
    pub.publish(_put(host, src))
    u, n = _count("subscriber_full_pulls",
                  lambda: sub.pull(other, dtype=jnp.bfloat16, delta=True, path="network",
                                   donate=w))
    assert n == 1
    _check(u, host, other, BF16)


@pytest.mark.parametrize("fate", ["deleted", "donated_elsewhere", "kept"])
def test_previous_arrays_deleted_donated_or_kept(sides, fate):
  trainer, gen = sides
  with _one_leaf(trainer, gen) as (pub, sub, src, dst):
    host = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    pub.publish({"w": _put(host, src)})
    x = sub.pull({"w": dst}, delta=True, path="network")
    old = np.asarray(x["w"]).copy()
    host[3, 3] = -host[3, 3]
    pub.publish({"w": _put(host, src)})
    if fate == "deleted":
      x["w"].delete()
    elif fate == "donated_elsewhere":
      jax.jit(lambda a: a + 1, donate_argnums=0)(x["w"])
      assert x["w"].is_deleted()
    key = "subscriber_delta_pulls" if fate == "kept" else "subscriber_full_pulls"
    y, n = _count(key, lambda: sub.pull({"w": dst}, delta=True, path="network"))
    assert n == 1
    _check(y["w"], host, dst)
    if fate == "kept":  # not donated: applied to a copy, the old result intact
      assert np.array_equal(np.asarray(x["w"]), old)


def test_quantize_pulls_full(sides):
  trainer, gen = sides
  with _one_leaf(trainer, gen) as (pub, sub, src, dst):
    host = np.random.default_rng(2).standard_normal((16, 256)).astype(np.float32)
    q = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={1: 8})
    for v in range(2):
      host[0, v] += 1
      pub.publish(_put(host, src))
      y, n = _count("subscriber_full_pulls",
                    lambda: sub.pull(dst, dtype=q, delta=True, path="network"))
      assert n == 1
      want = jax_m2n.reshard(jax.device_put(host, dst), dst, dtype=q)
      assert np.array_equal(_bits(y.qvalue), _bits(want.qvalue))
      assert np.array_equal(_bits(y.scale), _bits(want.scale))


def test_bad_delta_argument(sides):
  trainer, gen = sides
  with _one_leaf(trainer, gen) as (pub, sub, src, dst):
    pub.publish(_put(np.zeros((8, 8), np.float32), src))
    with pytest.raises(jax_m2n.ReshardValueError,
                       match="delta must be True, False or 'auto'; got 'yes'"):
      sub.pull(dst, delta="yes")
    with pytest.raises(jax_m2n.ReshardTypeError, match="delta must be a bool or 'auto'"):
      sub.pull(dst, delta=1)


# ---------------------------------------------------------------- separate programs


@pytest.fixture
def jobs():
  j = Jobs()
  yield j
  j.kill()


@pytest.mark.parametrize("trainers,generators", [(1, 1), (2, 2)])
def test_separate_jobs_delta_bitwise(jobs, trainers, generators, monkeypatch):
  monkeypatch.setattr(jobs_test, "WORKER", os.path.join(HERE, "jobs_delta_worker.py"))
  found = jobs.run(trainers, generators, "delta", seed=3 + trainers)
  text = jobs.logs()
  for _, f, line in found:
    assert f["ok"] == "1" and int(f["deltas"]) >= 3 and f["in_place"] == "True", line
    assert int(f["delta_bytes"]) * 3 < int(f["full_bytes"]), line
  if generators == 2:  # bases that differ between the processes: an error on both
    mismatch = jobs.results("mismatch")
    assert len(mismatch) == 2 and all(f["ok"] == "1" for _, f, _ in mismatch), text
  auto = jobs.results("auto")  # delta="auto": full, then a delta the job agreed on
  assert len(auto) == generators and all(f["ok"] == "1" for _, f, _ in auto), text
  print("\n".join(line for _, _, line in found + jobs.results("mismatch") + auto))
