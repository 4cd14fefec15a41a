"""The repeated eager call (fast_path.key / fast_path.call): a later call with the same
arguments and layouts goes straight to the cached per-device programs, and still gives
exactly what the full path gives, errors included: deleted or uncommitted leaves, an
array donated twice, dead shards, bool arguments, context-mesh destinations, tracing,
an evicted entry, weak types and dtype conversion.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jax_m2n
from jax_m2n._src import eager, fast_path, jax_compat


@pytest.fixture(scope="module")
def devs():
  return np.array(jax.devices()[:8])


def data(shape=(8, 4), seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def same(y, ref):
  assert y.shape == ref.shape and y.dtype == ref.dtype and y.sharding == ref.sharding
  assert y.weak_type == ref.weak_type and y.committed == ref.committed
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  for a, b in zip(y.addressable_shards, ref.addressable_shards):
    assert a.device == b.device and a.index == b.index
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.fixture
def full_path_forbidden(monkeypatch):
  """forbid(): from now on, a call that leaves the fast path fails the test."""
  def forbid():
    def refuse(*args, **kwargs):
      raise AssertionError("the repeated call took the full path")
    monkeypatch.setattr(eager, "reshard", refuse)
  return forbid


def test_repeated_calls_take_the_fast_path(devs, full_path_forbidden):
  src = NamedSharding(Mesh(devs[:2], ("x",)), P("x"))
  dst = {"w": NamedSharding(Mesh(devs[4:8], ("y",)), P(None, "y")), "b": devs[3]}
  def tree(seed):
    return {"w": jax.device_put(data(seed=seed), src),
            "b": jax.device_put(data((4,), seed + 1), devs[1])}
  ref_dst = {"w": dst["w"], "b": SingleDeviceSharding(devs[3])}
  one = jax.device_put(data(seed=9), devs[2])
  jax_m2n.reshard(tree(0), dst)
  jax_m2n.reshard(one, devs[2], dtype=jnp.bfloat16)
  jax_m2n.reshard(one, SingleDeviceSharding(devs[5]), route="flat", timeout_s=30)
  full_path_forbidden()
  for seed in (2, 4):  # new arrays of the same layouts
    x = tree(seed)
    y = jax_m2n.reshard(x, dst)
    for k in x:
      same(y[k], jax.device_put(x[k], ref_dst[k]))
  same(jax_m2n.reshard(one, devs[2], dtype=jnp.bfloat16),
       jax.device_put(one.astype(jnp.bfloat16), devs[2]))
  same(jax_m2n.reshard(one, SingleDeviceSharding(devs[5]), route="flat", timeout_s=30),
       jax.device_put(one, SingleDeviceSharding(devs[5])))


def test_the_fast_path_keeps_every_per_call_check(devs):
  src = NamedSharding(Mesh(devs[:2], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[2:4], ("y",)), P())
  x = jax.device_put(data(seed=3), src)
  jax_m2n.reshard(x, dst)
  jax_m2n.reshard(x, dst)
  # A deleted leaf of a cached layout.
  z = jax.device_put(data(seed=4), src)
  z.delete()
  with pytest.raises(jax_m2n.ReshardValueError, match="live array"):
    jax_m2n.reshard(z, dst)
  # One array donated twice.
  jax_m2n.reshard([jax.device_put(data(seed=5), src), jax.device_put(data(seed=6), src)],
                  dst, donate=True)
  a = jax.device_put(data(seed=5), src)
  jax_m2n.reshard([a, a], dst, donate=True)  # ignored, as by jax.device_put
  assert not a.is_deleted()
  # A shard deleted behind the array's back (x.is_deleted() is still False).
  b = jax.device_put(data(seed=7), src)
  jax_compat.single_device_arrays(b)[1].delete()
  assert not b.is_deleted()
  with pytest.raises(jax_m2n.ReshardValueError, match="alive"):
    jax_m2n.reshard(b, dst)
  # A bool where a number was cached: refused as on the first call.
  jax_m2n.reshard(x, dst, timeout_s=1)
  with pytest.raises(jax_m2n.ReshardTypeError, match="timeout_s"):
    jax_m2n.reshard(x, dst, timeout_s=True)
  jax_m2n.reshard(x, dst, chunk_bytes=1)
  with pytest.raises(jax_m2n.ReshardTypeError, match="chunk_bytes"):
    jax_m2n.reshard(x, dst, chunk_bytes=True)
  # Donation still frees the source after the data moved.
  c = jax.device_put(data(seed=8), src)
  ref = np.asarray(c).copy()
  y = jax_m2n.reshard(c, dst, donate=True)
  assert c.is_deleted()
  np.testing.assert_array_equal(np.asarray(y), ref)


def test_uncommitted_and_weak_leaves_of_a_cached_layout(devs):
  d0 = SingleDeviceSharding(devs[0])
  committed = jax.device_put(jnp.asarray(2.5), d0)  # weakly typed, committed
  assert committed.weak_type and committed.committed
  for _ in range(3):
    same(jax_m2n.reshard(committed, devs[1]), jax.device_put(committed, devs[1]))
  loose = jnp.asarray(3.5)  # the same layout, uncommitted: jax.device_put moves it
  assert not loose.committed and loose.sharding == d0
  same(jax_m2n.reshard(loose, devs[1]), jax.device_put(loose, devs[1]))


def test_context_mesh_destinations_and_tracing_are_not_remembered(devs):
  m1 = Mesh(devs[:4], ("x",))
  m2 = Mesh(devs[4:8], ("x",))
  x = jax.device_put(data(seed=10), NamedSharding(m1, P()))
  for mesh in (m1, m2, m1, m2):
    with jax.set_mesh(mesh):
      y = jax_m2n.reshard(x, P("x"))
    same(y, jax.device_put(x, NamedSharding(mesh, P("x"))))
  dst = NamedSharding(m2, P(None, "x"))
  jax_m2n.reshard(x, dst)
  jax_m2n.reshard(x, dst)
  y = jax.jit(lambda: jax_m2n.reshard(x, dst))()  # x closed over: traced path
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  assert y.sharding.is_equivalent_to(dst, 2)


def test_an_evicted_entry_is_rebuilt(devs):
  x = jax.device_put(data(seed=11), devs[6])
  dst = SingleDeviceSharding(devs[7])
  jax_m2n.reshard(x, dst)
  jax_m2n.reshard(x, dst)
  assert len(fast_path.cache)
  eager.eager_cache.clear()  # the fast path keeps no entry alive by itself
  same(jax_m2n.reshard(x, dst), jax.device_put(x, dst))
  assert len(eager.eager_cache) == 1
  same(jax_m2n.reshard(x, dst), jax.device_put(x, dst))


def test_one_device_leaves_come_from_their_programs_handlers(devs):
  # From the second call on, a leaf whose destination is one device is its program's
  # output itself, made by a result handler of that destination. Two destinations of
  # the same devices (a SingleDeviceSharding or a Device, a NamedSharding of a
  # one-device mesh) share their programs' compiles: each call must still give its own
  # sharding, and a leaf of several devices beside them is assembled as before.
  from jax_m2n._src.eager import programs
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  one = NamedSharding(Mesh(devs[5:6], ("y",)), P(None, "y"))
  several = NamedSharding(Mesh(devs[2:6], ("y",)), P(None, "y"))
  dsts = [{"a": SingleDeviceSharding(devs[5]), "b": devs[6], "c": several},
          {"a": one, "b": NamedSharding(Mesh(devs[6:7], ("z",)), P()), "c": several}]
  x = {"a": jax.device_put(data(seed=20), src), "b": jax.device_put(data(seed=21), src),
       "c": jax.device_put(data(seed=22), src)}
  jax_m2n.reshard(x, dsts[0])
  compiled = len(programs.program_cache)
  jax_m2n.reshard(x, dsts[1])
  assert len(programs.program_cache) == compiled, "the same schedules compiled again"
  for _ in range(3):
    for dst in dsts:
      for dtype in (None, jnp.bfloat16):
        y = jax_m2n.reshard(x, dst, dtype=dtype)
        for k in x:
          v = x[k] if dtype is None else x[k].astype(dtype)
          ref = jax.device_put(v, dst[k])
          same(y[k], ref)
          assert type(y[k].sharding) is type(ref.sharding)
  entry = next(eager.eager_cache[k] for k in eager.eager_cache
               if eager.eager_cache[k].out_avals[0][2] == one)
  assert entry._known[0][1] is None and entry._known[1][1] is None, (
      "a one-device leaf is assembled again: its handler was not taken")
  assert entry._known[2][1] == several
