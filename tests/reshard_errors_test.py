"""Bad input to jax_m2n.reshard fails in Python, before any data moves, naming the leaf.

Every rule of the public API: pytree structure, shape/dtype changes, shardings that
cannot hold the shape, platforms, uncommitted/deleted arrays, non-array leaves, unknown
routes, source shardings, and what jit cannot express.
"""

import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import ffi as m2n_ffi
from jax_m2n._src import checks, eager


@pytest.fixture
def devs():
  assert jax.device_count() == 8
  return np.array(jax.devices())


def sharded(devs, shape=(8, 4), dtype=np.float32, spec=P("x"), ids=slice(0, 4)):
  mesh = Mesh(devs[ids], ("x",))
  return jax.device_put(np.arange(np.prod(shape)).reshape(shape).astype(dtype),
                        NamedSharding(mesh, spec))


def gen(devs, spec=P()):
  return NamedSharding(Mesh(devs[4:], ("y",)), spec)


def test_mismatched_pytree_structure(devs, no_data_moves):
  x = {"a": sharded(devs), "b": sharded(devs)}
  with pytest.raises(jax_m2n.ReshardValueError, match="prefix of x"):
    jax_m2n.reshard(x, {"a": gen(devs), "c": gen(devs)})
  with pytest.raises(jax_m2n.ReshardValueError, match="prefix of x"):
    jax_m2n.reshard([sharded(devs)], [gen(devs), gen(devs)])


def test_shape_or_dtype_change(devs, no_data_moves):
  x = {"w": sharded(devs)}
  bad_shape = jax.ShapeDtypeStruct((4, 8), np.float32, sharding=gen(devs))
  with pytest.raises(jax_m2n.ReshardValueError, match=r"x\['w'\].*shape and dtype"):
    jax_m2n.reshard(x, {"w": bad_shape})
  bad_dtype = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=gen(devs))
  with pytest.raises(jax_m2n.ReshardValueError, match="float32.*bfloat16"):
    jax_m2n.reshard(x, {"w": bad_dtype})
  no_sharding = jax.ShapeDtypeStruct((8, 4), np.float32)
  with pytest.raises(jax_m2n.ReshardTypeError, match="must carry a sharding"):
    jax_m2n.reshard(x, {"w": no_sharding})


def test_good_shape_dtype_struct_is_accepted(devs):
  x = sharded(devs)
  dst = gen(devs, P(None, "y"))
  y = jax_m2n.reshard(x, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dst))
  assert y.sharding == dst
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_dst_cannot_hold_the_shape(devs, no_data_moves):
  x = {"odd": sharded(devs, shape=(6, 4), spec=P())}
  with pytest.raises(jax_m2n.ReshardValueError, match=r"x\['odd'\].*hold shape"):
    jax_m2n.reshard(x, gen(devs, P("y")))  # 6 rows over 4 devices
  with pytest.raises(jax_m2n.ReshardValueError, match=r"one PartitionSpec entry per dim"):
    jax_m2n.reshard(x, gen(devs, P(None, None, "y")))


def test_not_a_sharding(devs, no_data_moves):
  x = sharded(devs)
  with pytest.raises(jax_m2n.ReshardValueError, match="under a mesh context"):
    jax_m2n.reshard(x, P("x"))  # a bare PartitionSpec needs jax.set_mesh
  with pytest.raises(jax_m2n.ReshardTypeError, match="must be a jax.sharding.Sharding"):
    jax_m2n.reshard(x, "cpu:4")
  with pytest.raises(TypeError, match="must be a jax.sharding.Sharding"):
    jax_m2n.reshard({"a": x}, {"a": 3})


def test_devices_of_another_platform(devs, no_data_moves):
  class OtherPlatform:
    platform = "tpu"
    id = 99
    process_index = 0

  class TpuSharding(jax.sharding.SingleDeviceSharding):
    @property
    def device_set(self):
      return {OtherPlatform()}

  x = sharded(devs)
  dst = TpuSharding(devs[5])
  with pytest.raises(jax_m2n.ReshardValueError, match="source's platform"):
    jax_m2n.reshard(x, dst)


def test_platform_without_a_handler():
  with pytest.raises(jax_m2n.ReshardValueError, match="platform 'tpu'"):
    m2n_ffi.ensure_registered("tpu")


def test_uncommitted_array_goes_through_device_put(devs, no_data_moves):
  x = {"u": jnp.arange(8.0)}
  assert not x["u"].committed
  y = jax_m2n.reshard(x, gen(devs))
  want = jax.device_put(x["u"], gen(devs))
  assert y["u"].committed and y["u"].sharding == want.sharding
  np.testing.assert_array_equal(np.asarray(y["u"]), np.asarray(want))


def test_deleted_array(devs, no_data_moves):
  x = [sharded(devs), sharded(devs)]
  x[1].delete()
  with pytest.raises(jax_m2n.ReshardValueError, match=r"x\[1\] must be a live array"):
    jax_m2n.reshard(x, gen(devs))


def test_deleted_array_after_a_cached_call(devs):
  x = sharded(devs, shape=(8, 2))
  jax_m2n.reshard(x, gen(devs))
  x.delete()
  with pytest.raises(jax_m2n.ReshardValueError, match="must be a live array"):
    jax_m2n.reshard(x, gen(devs))


@pytest.mark.parametrize("leaf", ["text", object()], ids=["str", "object"])
def test_non_array_leaves(devs, no_data_moves, leaf):
  with pytest.raises(jax_m2n.ReshardTypeError, match=r"x\['bad'\]"):
    jax_m2n.reshard({"ok": sharded(devs), "bad": leaf}, gen(devs))


def test_host_data_goes_through_device_put(devs, no_data_moves):
  y = jax_m2n.reshard({"n": np.ones(4), "f": 3.0}, gen(devs))
  assert y["n"].sharding == gen(devs) and y["f"].sharding == gen(devs)
  assert y["f"].weak_type and y["f"].dtype == jax.device_put(3.0, gen(devs)).dtype


def test_keys_and_sub_byte_dtypes_go_through_device_put(devs, no_data_moves):
  keys = jax.device_put(jax.random.split(jax.random.key(0), 8),
                        NamedSharding(Mesh(devs[:4], ("x",)), P("x")))
  y = jax_m2n.reshard({"k": keys}, gen(devs))
  assert y["k"].sharding.is_equivalent_to(gen(devs), 1)
  np.testing.assert_array_equal(jax.random.key_data(y["k"]), jax.random.key_data(keys))
  nibbles = jax.device_put(np.arange(8).astype(jnp.int4),
                           NamedSharding(Mesh(devs[:4], ("x",)), P()))
  z = jax_m2n.reshard(nibbles, gen(devs))
  assert z.sharding == gen(devs) and z.dtype == jnp.int4
  np.testing.assert_array_equal(np.asarray(z), np.asarray(nibbles))


def test_unknown_route(devs, no_data_moves):
  with pytest.raises(jax_m2n.ReshardValueError, match="route must be one of"):
    jax_m2n.reshard(sharded(devs), gen(devs), route="ring")
  with pytest.raises(jax_m2n.ReshardTypeError, match="route must be a str"):
    jax_m2n.reshard(sharded(devs), gen(devs), route=3)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), 1e-9, 0.0004])
def test_bad_timeout(devs, no_data_moves, timeout):
  with pytest.raises(jax_m2n.ReshardValueError, match="timeout_s must be in"):
    jax_m2n.reshard(sharded(devs), gen(devs), timeout_s=timeout)


# Every bad `topology=` of issue 14: (value, error class, words of the message).
BAD_TOPOLOGIES = [
    ("nvlink", jax_m2n.ReshardTypeError, "got str 'nvlink'"),
    ([[0, "a"]], jax_m2n.ReshardTypeError, "a device id must be an int; got 'a'"),
    ({"a": 1}, jax_m2n.ReshardTypeError, "got dict"),
    ([0, 1], jax_m2n.ReshardTypeError, "every domain must be a list of device ids"),
    (True, jax_m2n.ReshardTypeError, "got the bool True"),
    (0, jax_m2n.ReshardValueError, "domain_size must be a positive int64"),
    (-1, jax_m2n.ReshardValueError, "domain_size must be a positive int64"),
    (2**70, jax_m2n.ReshardValueError, "domain_size must be a positive int64"),
    ([[0, 1], [1, 2]], jax_m2n.ReshardValueError, "device 1 is in domains 0 and 1"),
    ([[0, -1]], jax_m2n.ReshardValueError, "a device id must be in [0, 2^63)"),
    ([[0, 2**64]], jax_m2n.ReshardValueError, "a device id must be in [0, 2^63)"),
    ([[]], jax_m2n.ReshardValueError, "domain 0 is empty"),
    (1.5, jax_m2n.ReshardTypeError, "got float 1.5"),
]


@pytest.mark.parametrize("topology,error,words", BAD_TOPOLOGIES,
                         ids=[repr(t) for t, _, _ in BAD_TOPOLOGIES])
def test_bad_topology(devs, no_data_moves, topology, error, words):
  with pytest.raises(error, match=re.escape(words)) as info:
    jax_m2n.reshard(sharded(devs), gen(devs), topology=topology)
  assert str(info.value).startswith("reshard: topology"), info.value
  # Also inside jit.
  x = sharded(devs)
  with pytest.raises(error, match=re.escape(words)):
    jax.jit(lambda v: jax_m2n.reshard(v, x.sharding, topology=topology,
                                      src_sharding=x.sharding))(x)


@pytest.mark.parametrize("timeout", ["10", True, None.__class__, [1]])
def test_timeout_of_the_wrong_type(devs, no_data_moves, timeout):
  with pytest.raises(jax_m2n.ReshardTypeError, match="timeout_s must be a number"):
    jax_m2n.reshard(sharded(devs), gen(devs), timeout_s=timeout)


@pytest.mark.parametrize("donate", ["no", 1, None, {"w": "yes"}])
def test_donate_of_the_wrong_type(devs, no_data_moves, donate):
  x = {"w": sharded(devs)}
  with pytest.raises(jax_m2n.ReshardTypeError, match="donate must be a bool"):
    jax_m2n.reshard(x, gen(devs), donate=donate)
  assert not x["w"].is_deleted()


def test_destination_mesh_listing_a_device_twice(devs, no_data_moves):
  twice = Mesh(np.array([devs[4], devs[5], devs[4], devs[6]]), ("y",))
  with pytest.raises(jax_m2n.ReshardValueError, match=r"each device once; got devices \[4\]"):
    jax_m2n.reshard(sharded(devs), NamedSharding(twice, P()))


def test_abstract_mesh_destination(devs, no_data_moves):
  abstract = jax.sharding.AbstractMesh((4,), ("y",))
  with pytest.raises(jax_m2n.ReshardValueError, match="concrete Mesh"):
    jax_m2n.reshard(sharded(devs), NamedSharding(abstract, P()))


def test_unreduced_shardings_are_refused_by_name(devs, no_data_moves):
  mesh = Mesh(devs[4:], ("y",), axis_types=(AxisType.Explicit,))
  dst = NamedSharding(mesh, P(None, unreduced={"y"}))
  with pytest.raises(jax_m2n.ReshardValueError, match="must not be unreduced"):
    jax_m2n.reshard(sharded(devs), dst)


def test_src_sharding_must_match_the_array(devs, no_data_moves):
  x = {"w": sharded(devs)}
  wrong = NamedSharding(Mesh(devs[:4], ("x",)), P(None, "x"))
  with pytest.raises(jax_m2n.ReshardValueError, match=r"src_sharding of x\['w'\]"):
    jax_m2n.reshard(x, gen(devs), src_sharding=wrong)


def test_donating_one_array_twice_is_ignored_as_device_put_does(devs):
  a = sharded(devs)
  out = jax_m2n.reshard([a, a], gen(devs), donate=True)
  assert not a.is_deleted()  # jax.device_put([a, a], ..., donate=True) keeps a too
  assert all(np.array_equal(np.asarray(y), np.asarray(a)) for y in out)


def test_errors_are_raised_before_data_moves(devs):
  """A bad leaf anywhere in the tree: nothing is built, the sources are untouched."""
  n = len(eager.eager_cache)
  x = {"a": sharded(devs), "b": sharded(devs, shape=(5,), spec=P())}
  with pytest.raises(jax_m2n.ReshardValueError, match=r"x\['b'\]"):
    jax_m2n.reshard(x, gen(devs, P("y")), donate=True)
  assert len(eager.eager_cache) == n
  assert not x["a"].is_deleted()


# ---------------------------------------------------------------------------------------
# Inside jit
# ---------------------------------------------------------------------------------------

def test_jit_cross_device_set(devs):
  x = sharded(devs)
  src = x.sharding
  with pytest.raises(jax_m2n.ReshardValueError, match="outside jit"):
    jax.jit(lambda v: jax_m2n.reshard(v, gen(devs), src_sharding=src))(x)


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host", "device"])
def test_jit_cross_device_set_to_any_memory_kind(devs, kind):
  """The device-set rule comes before the memory-kind delegation: a host-memory
  destination on other devices is the same ReshardValueError, not JAX's ValueError."""
  x = sharded(devs)
  dst = NamedSharding(gen(devs).mesh, gen(devs).spec, memory_kind=kind)
  with pytest.raises(jax_m2n.ReshardValueError, match="outside jit"):
    jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=x.sharding))(x)


def test_jit_explicit_source_to_auto_destination(devs):
  mesh = Mesh(devs[:4], ("x",), axis_types=(AxisType.Explicit,))
  x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("x")))
  auto = NamedSharding(Mesh(devs[:4], ("x",)), P(None, "x"))
  with pytest.raises(jax_m2n.ReshardValueError, match="destination on Explicit axes"):
    jax.jit(lambda v: jax_m2n.reshard(v, auto))(x)


def test_jit_src_sharding_must_match_the_type(devs):
  mesh = Mesh(devs[:4], ("x",), axis_types=(AxisType.Explicit,))
  x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("x")))
  dst = NamedSharding(mesh, P(None, "x"))
  wrong = NamedSharding(mesh, P(None, "x"))
  with pytest.raises(jax_m2n.ReshardValueError, match="match the sharding in its type"):
    jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=wrong))(x)


def test_jit_uneven_or_unrefinable_layouts(devs):
  m6a = Mesh(devs[:6].reshape(2, 3), ("a", "b"))
  m6b = Mesh(devs[:6].reshape(3, 2), ("c", "d"))
  src = NamedSharding(m6a, P("a", "b"))
  dst = NamedSharding(m6b, P("c", "d"))
  x = jax.device_put(np.zeros((6, 6), np.float32), src)
  # No common refinement for one shard_map: XLA moves it, as with_sharding_constraint.
  y = jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src))(x)
  assert y.sharding.is_equivalent_to(dst, 2)
  # The eager path takes the same layouts.
  y = jax_m2n.reshard(x, dst)
  assert y.sharding == dst


def test_jit_different_device_order(devs):
  a = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  b = NamedSharding(Mesh(devs[[1, 0, 2, 3]], ("x",)), P("x"))
  x = jax.device_put(np.zeros((8,), np.float32), a)
  with pytest.raises(jax_m2n.ReshardValueError, match="outside jit"):
    jax.jit(lambda v: jax_m2n.reshard(v, b, src_sharding=a))(x)


def test_jit_non_array_leaf(devs):
  x = sharded(devs)
  with pytest.raises(jax_m2n.ReshardTypeError, match=r"x\[1\]"):
    jax.jit(lambda v: jax_m2n.reshard([v, "s"], x.sharding, src_sharding=x.sharding))(x)


def test_inside_shard_map(devs):
  mesh = Mesh(devs[:4], ("x",))
  x = jax.device_put(np.zeros((8,), np.float32), NamedSharding(mesh, P("x")))
  dst = NamedSharding(mesh, P())
  f = jax.shard_map(lambda v: jax_m2n.reshard(v, dst, src_sharding=dst), mesh=mesh,
                    in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(jax_m2n.ReshardValueError, match="outside shard_map"):
    jax.jit(f)(x)


def test_eager_grad_errors_do_not_say_inside_jit(devs):
  x = sharded(devs)
  bad = jax.ShapeDtypeStruct((4, 8), np.float32, sharding=gen(devs))
  with pytest.raises(jax_m2n.ReshardValueError) as e:
    jax.grad(lambda v: jax_m2n.reshard(v, bad).sum())(x)
  assert "inside jit" not in str(e.value)
  # Across device sets under eager grad: allowed (no jit device assignment applies).
  mesh = Mesh(devs[:4], ("x",), axis_types=(AxisType.Explicit,))
  xe = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("x")))
  g = jax.grad(lambda v: jax_m2n.reshard(v, gen(devs)).sum())(xe)
  assert g.sharding.is_equivalent_to(xe.sharding, 2)
