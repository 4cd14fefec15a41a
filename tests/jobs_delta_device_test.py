"""The publisher's delta compare and encode as compiled programs (delta_device.py)
against codec.py's numpy encoding, bit for bit: random data in every wire dtype, every
chunk mode, partial last chunks, NaN payloads and -0.0, pieces cut from 2-D shards,
pieces without a base, pieces held on other devices, both ways of compacting the
values; the power-of-two sizes; and `delta.serve` answering from several threads at
once (every answer decoded and checked, the counters summed exactly). On CPU (these
tests) the programs run on XLA's CPU backend; tests/gpu_delta_test.py runs them on a GPU.
"""

import collections
import doctest
import os
import sys
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src.jobs import codec, delta, delta_auto, delta_device
from jax_m2n._src.jobs.net import NetTransport

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from delta_cases import changes  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
C = codec.CHUNK
TOKEN = "delta-device-test-token-0123"


def _same(got: codec.Encoded, want: codec.Encoded):
  for field in ("modes", "bitmaps", "runs", "values"):
    a, b = getattr(got, field), getattr(want, field)
    assert a.dtype == b.dtype and a.shape == b.shape, (field, a.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), field
  assert got.changed == want.changed


def _random_bits(rng, old, new, mask):
  """Random bit patterns (NaNs of every payload, infinities, subnormals) at some of
  the changed elements of a float `new`, and the same ones at unchanged elements of
  both (equal bits: unchanged)."""
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32}.get(old.dtype.itemsize)
  if width is None or old.dtype.kind in "biuc":
    return
  flat_old, flat_new = old.reshape(-1).view(width), new.reshape(-1).view(width)
  changed = np.flatnonzero(mask.reshape(-1))
  at = rng.choice(changed, min(changed.size, 64), replace=False) if changed.size else []
  flat_new[at] = rng.integers(0, np.iinfo(width).max, len(at), dtype=np.uint64
                              ).astype(width) | 1  # never the old bits by chance
  flat_new[at] ^= (flat_new[at] == flat_old[at]).astype(width) << 1
  same = np.flatnonzero(~mask.reshape(-1))[:64]
  flat_old[same] = flat_new[same] = rng.integers(0, np.iinfo(width).max, same.size,
                                                 dtype=np.uint64).astype(width)


def _changed_copy(rng, old, mask):
  new = old.copy()
  if old.dtype == np.bool_:
    new[mask] = ~old[mask]
  elif old.dtype.kind == "c":
    new[mask] = old[mask] + rng.integers(1, 5, int(mask.sum()))
  else:
    new[mask] = (old[mask].astype(np.float32) + rng.integers(1, 5, int(mask.sum()))
                 ).astype(old.dtype)
  return new


HOWS = ["none", "sparse", "runs", "half", "all", "mixed"]
OTHERS = (np.int8, np.bool_, np.complex64, np.uint16, ml_dtypes.float8_e4m3fn)
CASES = ([(np.dtype(d), h) for d in (np.float32, BF16) for h in HOWS]
         + [(np.dtype(d), h) for d in OTHERS for h in ("none", "mixed")])


@pytest.mark.parametrize("dtype,how", CASES, ids=[f"{d.name}-{h}" for d, h in CASES])
def test_bitwise_against_numpy(dtype, how, monkeypatch):
  """Three 2-D shards (one without a base), cut into pieces whose stream ends in a
  partial chunk; chunks span pieces. Both ways of compacting the values."""
  rng = np.random.default_rng(abs(hash((np.dtype(dtype).name, how))) % 1000)
  shapes = [(3, C + 77), (2, 2 * C + 5), (5, 999)]
  olds = [(rng.standard_normal(s) * 8).astype(dtype) for s in shapes]
  masks = [changes(rng, o.size, how).reshape(o.shape) for o in olds]
  news = [_changed_copy(rng, o, m) for o, m in zip(olds, masks)]
  for o, n, m in zip(olds, news, masks):
    _random_bits(rng, o, n, m)
  cuts = [((0, 1), (3, C + 70)), ((0, 0), (2, 2 * C + 5)), ((1, 0), (4, 999))]
  pieces, ref_new, ref_mask = [], [], []
  for i, (new, old, (lo, hi)) in enumerate(zip(news, olds, cuts)):
    cut = tuple(slice(a, b) for a, b in zip(lo, hi))
    with_base = i != 1
    pieces.append(delta_device.Piece(
        jnp.asarray(new), jnp.asarray(old) if with_base else None, lo, hi,
        delta_device.COMPARE if with_base else delta_device.ALL))
    flat = new[cut].reshape(-1)
    ref_new.append(flat)
    ref_mask.append(codec.changed(flat, old[cut].reshape(-1)) if with_base
                    else np.ones(flat.size, bool))
  want = codec.encode_changes(np.concatenate(ref_new), np.concatenate(ref_mask))
  for search in (True, False):
    monkeypatch.setattr(delta_device, "SEARCH_BELOW", 2.0 if search else -1.0)
    got = delta_device.encode(pieces, jax.devices()[0])
    _same(got.encoded, want)
    assert got.changed == [int(m.sum()) for m in ref_mask]
  if how == "mixed":
    assert set(want.modes.tolist()) >= {codec.BITMAP, codec.RUNS, codec.DENSE}
  if how == "none":  # only the piece without a base crosses
    assert set(want.modes.tolist()) >= {codec.NOTHING}


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, np.complex64],
                         ids=lambda d: np.dtype(d).name)
def test_nan_payloads_and_signed_zero(dtype):
  """Bitwise, never by value: NaN against the same NaN is unchanged, a NaN of another
  payload changed, 0.0 against -0.0 changed (in both parts of a complex)."""
  real = {np.dtype(np.complex64): np.float32}.get(np.dtype(dtype), dtype)
  width = {2: np.uint16, 4: np.uint32}[np.dtype(real).itemsize]
  nan = np.array([np.iinfo(width).max >> 1], width).view(real)[0]  # a quiet NaN, payload
  other = np.array([(np.iinfo(width).max >> 1) - 1], width).view(real)[0]
  base = np.array([0.0, -0.0, nan, nan, 1.0, 1.0, 0.0, 2.0] * 5, real)
  new = base.copy()
  new[0], new[1], new[3] = -0.0, 0.0, other
  if np.dtype(dtype).kind == "c":
    old = (base + 1j * base).astype(dtype)
    new = (base + 1j * new).astype(dtype)  # the changes in the imaginary part only
    old.imag[6], new.imag[6] = 0.0, -0.0
  else:
    old = base
  got = delta_device.encode([delta_device.Piece(jnp.asarray(new), jnp.asarray(old),
                                                (0,), (new.size,), delta_device.COMPARE)],
                            jax.devices()[0])
  want = codec.encode(new, old)
  _same(got.encoded, want)
  assert got.changed == [int(codec.changed(new, old).sum())] and want.changed >= 3


@pytest.mark.parametrize("how", ["runs", "most"])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.complex64],
                         ids=lambda d: np.dtype(d).name)
def test_pieces_held_on_other_devices(dtype, how):
  """Pieces on devices other than the stream's are cut and compared there, then moved
  (their elements' bits and change mask): the same bytes."""
  rng = np.random.default_rng(5)
  devices = jax.devices()[:3]
  olds = [rng.standard_normal((4, C // 2 + 3)).astype(dtype) for _ in devices]
  news = [_changed_copy(rng, o, changes(rng, o.size, how).reshape(o.shape))
          for o in olds]
  pieces = [delta_device.Piece(jax.device_put(n, d), jax.device_put(o, d), (1, 2),
                               (4, C // 2), delta_device.COMPARE)
            for n, o, d in zip(news, olds, devices)]
  pieces[2] = pieces[2]._replace(old=None, kind=delta_device.ALL)
  cut = (slice(1, 4), slice(2, C // 2))
  want = codec.encode_changes(
      np.concatenate([n[cut].reshape(-1) for n in news]),
      np.concatenate([codec.changed(n[cut].reshape(-1), o[cut].reshape(-1))
                      for n, o in zip(news[:2], olds[:2])]
                     + [np.ones(news[2][cut].size, bool)]))
  _same(delta_device.encode(pieces, devices[1]).encoded, want)


def test_sizes_are_powers_of_two():
  assert [delta_device._size(n) for n in (0, 1, 256, 257, 1000, 1024, 5000)] == [
      0, 256, 256, 512, 1024, 1024, 8192]


def test_count_changed_and_supported():
  a = jnp.arange(12.0).reshape(3, 4)
  b = a.at[1, 2].set(-1.0).at[0, 0].set(-0.0)
  assert int(delta_device.count_changed(a, b)) == 2
  assert delta_device.supported(np.float32, 10) and delta_device.supported(BF16, 10)
  assert not delta_device.supported(np.float32, 0)
  assert not delta_device.supported(np.float32, delta_device.MAX_ELEMENTS + 1)
  assert delta_device.supported(np.float64, 10) == bool(jax.config.jax_enable_x64)


@pytest.mark.parametrize("module", [codec, delta_device, delta_auto],
                         ids=["codec", "delta_device", "delta_auto"])
def test_doctests(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result


# ---------------------------------------------------------------- serve on threads


def _put(host, sharding):
  return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i],
                                      dtype=host.dtype)


@pytest.mark.parametrize("device_encode", [False, True], ids=["numpy", "device"])
def test_serve_answers_from_several_threads(device_encode, monkeypatch):
  """`delta.serve` runs on the publisher's worker threads: 4 threads x 3 requests each
  (different pieces and wire dtypes) at once, every answer fetched and decoded to the
  new version's bytes, the publisher's counters the exact sums."""
  monkeypatch.setattr(delta, "DEVICE_ENCODE", device_encode)
  rng = np.random.default_rng(11)
  devices = jax.devices()[:4]
  sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
  hosts = [rng.standard_normal((8, 3000)).astype(np.float32),
           rng.standard_normal((4, 5000)).astype(np.float32)]
  pub = jax_m2n.Publisher(token=TOKEN, keep=3)
  fetcher = NetTransport("127.0.0.1")
  try:
    pub.publish([_put(h, sharding) for h in hosts])
    olds = [h.copy() for h in hosts]
    for h in hosts:
      h.reshape(-1)[rng.integers(0, h.size, h.size // 100)] += 1
    pub.publish([_put(h, sharding) for h in hosts])
    versions = pub._versions
    new, base = versions.get(2), versions.get(1)
    shards = sorted(new.shards.items())

    def body(i):
      """Request i: a few pieces (whole shards or parts), leaf 1 in bfloat16."""
      asked = [(t, k, box) for (t, k), (box, _) in shards if (t + k + i) % 2 == 0]
      if i % 3 == 0:  # a part of a shard
        t, k, box = asked[0]
        asked[0] = (t, k, ((box[0][0], box[0][1]), (box[1][0] + 7, box[1][1] - 5)))
      return {"op": "delta", "version": 2, "base": 1, "timeout_ms": 30_000,
              "wire": [[0, "float32"], [1, "bfloat16"]], "dense": [0] if i % 4 == 1 else [],
              "pieces": [[t, k, *[lo for lo, _ in b], *[hi for _, hi in b]]
                         for t, k, b in asked]}, asked

    before = delta.snapshot()
    answers, errors = {}, []

    def serve(i):
      try:
        b, asked = body(i)
        answers[i] = (delta.serve(new, base, b, pub._transport), asked, b)
      except Exception as e:  # noqa: BLE001 - reported below
        errors.append(e)

    threads = [threading.Thread(target=lambda j=j: [serve(3 * j + r) for r in range(3)])
               for j in range(4)]
    for th in threads:
      th.start()
    for th in threads:
      th.join(120)
    assert not errors and len(answers) == 12, errors
    counts = collections.Counter()
    for i, (reply, asked, b) in sorted(answers.items()):
      streams = {}
      for t, k, box in asked:
        dtype = BF16 if t == 1 else np.dtype(np.float32)
        cut = tuple(slice(lo, hi) for lo, hi in box)
        streams.setdefault(dtype.name, []).append(
            (hosts[t][cut].astype(dtype).reshape(-1),
             olds[t][cut].astype(dtype).reshape(-1), t in b["dense"]))
      specs, expect = [], []
      for head, name in zip(reply["streams"], sorted(streams)):
        parts = streams[name]
        n = sum(p[0].size for p in parts)
        assert head[0] == name
        sizes = [(np.uint8, codec.bitmap_bytes(head[3], n)), (np.int32, 2 * head[2]),
                 (parts[0][0].dtype, head[1])]
        landing = jax.sharding.SingleDeviceSharding(devices[0])
        specs += [jax.ShapeDtypeStruct((m,), d, sharding=landing) for d, m in sizes if m]
        expect.append((parts, head, sizes))
        counts["publisher_elements"] += n
      arrays = iter(fetcher.fetch(pub._transport.address, reply["ticket"],
                                  specs).result()) if specs else iter(())
      for parts, head, sizes in expect:
        got = [np.asarray(next(arrays)) if m else np.zeros(0, d) for d, m in sizes]
        rebuilt = np.concatenate([o for _, o, _ in parts])
        at = codec.decode(np.asarray(head[3], np.int8), got[0], got[1], rebuilt.size)
        rebuilt[at] = got[2]
        want = np.concatenate([x for x, _, _ in parts])
        assert rebuilt.tobytes() == want.tobytes(), i
        start = 0
        for x, _, dense in parts:  # dense pieces cross whole, not compared
          if dense:
            assert np.isin(np.arange(start, start + x.size), at).all()
          start += x.size
      assert {r[0] for r in reply["changed"]} == {t for t, _, _ in asked
                                                   if t not in b["dense"]}
      # this request's seconds per element, unless it compiled a program
      assert reply["encode_s"] is None or reply["encode_s"] >= 0
      assert reply["encode_s"] is not None or device_encode
    after = delta.snapshot()
    assert after["publisher_requests"] - before.get("publisher_requests", 0) == 12
    assert (after["publisher_elements"] - before.get("publisher_elements", 0)
            == counts["publisher_elements"])
    assert (after.get("publisher_device_streams", 0)
            - before.get("publisher_device_streams", 0) > 0) == device_encode
  finally:
    fetcher._close()
    pub.close()
