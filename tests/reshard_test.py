"""End-to-end tests of jax_m2n.reshard on 8 CPU devices, against jax.device_put.

Eager (any device sets: disjoint, overlapping, identical) and inside jit (colocated),
every route, with and without NVLink domains (Topology(domain_size=2/4) makes the
forward stage run), random shapes/dtypes/meshes/specs (hypothesis), the paper's examples,
pytrees, donation and the timeout path. Comparisons are bitwise.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math
import time

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import eager, errors
from jax_m2n._src.request import Options, Request
import shards
from plan_strategies import named_sharding, named_shardings, partition_specs, shard_counts

DTYPES = (np.float32, jnp.bfloat16, np.int8, np.bool_, np.complex64, np.uint32)
ROUTES = ("hierarchical", "flat", "gather_bcast")
TOPOLOGIES = (None, jax_m2n.Topology(domain_size=2), jax_m2n.Topology(domain_size=4))
SETTINGS = hypothesis.settings(
    max_examples=30, deadline=None, derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck))


def devices():
  assert jax.device_count() == 8, jax.devices()
  return jax.devices()


def random_data(shape, dtype, seed=0) -> np.ndarray:
  """Distinct values of any dtype (bit patterns: catches misplaced bytes)."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  n = math.prod(shape)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(np.bool_)
  if dtype.kind in "iu":
    return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=shape,
                        dtype=dtype, endpoint=True)
  if dtype.kind == "c":
    return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype).reshape(shape)
  return rng.standard_normal(n).astype(dtype).reshape(shape)


def bits(a) -> np.ndarray:
  a = np.ascontiguousarray(np.asarray(a))
  return a.reshape(-1).view(np.uint8)


def assert_same_as_device_put(y, x, dst, exact_sharding=True):
  """y equals jax.device_put(x, dst) bitwise, shard by shard, device by device."""
  ref = jax.device_put(x, dst)
  assert y.shape == ref.shape and y.dtype == ref.dtype
  if exact_sharding:
    assert y.sharding == dst, (y.sharding, dst)
  else:
    assert y.sharding.is_equivalent_to(dst, y.ndim), (y.sharding, dst)
  shards.assert_same_shards(y, ref)
  np.testing.assert_array_equal(bits(y), bits(x))


# ---------------------------------------------------------------------------------------
# Strategies: meshes, specs, device subsets
# ---------------------------------------------------------------------------------------

@st.composite
def mesh_and_spec(draw, device_ids, rank):
  """A mesh over device_ids (in that order) and a random PartitionSpec for a rank."""
  return draw(named_shardings(device_ids, rank))


@st.composite
def device_sets(draw):
  """(relation, src ids, dst ids): disjoint, overlapping or identical sets, any order."""
  relation = draw(st.sampled_from(("disjoint", "overlapping", "identical")))
  perm = draw(st.permutations(range(8)))
  if relation == "identical":
    k = draw(st.sampled_from((1, 2, 4, 8)))
    src = list(perm[:k])
    dst = draw(st.permutations(src))
  elif relation == "disjoint":
    a = draw(st.sampled_from((1, 2, 3, 4)))
    b = draw(st.sampled_from([k for k in (1, 2, 3, 4) if k <= 8 - a]))
    src, dst = list(perm[:a]), list(perm[a:a + b])
  else:
    a = draw(st.sampled_from((2, 3, 4, 6)))
    b = draw(st.sampled_from([k for k in (2, 3, 4, 6) if k <= 8 - a + 1]))
    common = draw(st.integers(1, min(a, b) - 1 if min(a, b) > 2 else 1))
    src = list(perm[:a])
    dst = list(perm[a - common:a - common + b])
  return relation, src, dst


@st.composite
def eager_cases(draw):
  relation, src_ids, dst_ids = draw(device_sets())
  rank = draw(st.integers(0, 4))
  src = draw(mesh_and_spec(src_ids, rank))
  dst = draw(mesh_and_spec(dst_ids, rank))
  cs, cd = shard_counts(src, rank), shard_counts(dst, rank)
  shape = tuple(math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(cs, cd))
  if math.prod(shape) > 4096:
    shape = tuple(math.lcm(a, b) for a, b in zip(cs, cd))
  dtype = draw(st.sampled_from(DTYPES))
  route = draw(st.sampled_from(ROUTES))
  topology = draw(st.sampled_from(TOPOLOGIES))
  return relation, shape, dtype, src, dst, route, topology


def _refined_meshes(draw, n: int):
  """Two mesh shapes over n devices that coarsen one chain (so one refines both)."""
  primes = []
  m = n
  for p in (2, 3, 5, 7):
    while m % p == 0:
      primes.append(p)
      m //= p
  primes = list(draw(st.permutations(primes)))

  def coarsen():
    if not primes:
      return (1,)
    cuts = sorted(draw(st.sets(st.integers(1, len(primes) - 1), max_size=2))) if len(
        primes) > 1 else []
    bounds = [0, *cuts, len(primes)]
    return tuple(math.prod(primes[a:b]) for a, b in zip(bounds, bounds[1:]))

  return coarsen(), coarsen()


@st.composite
def jit_cases(draw):
  """Colocated layouts: one device order, two meshes that one mesh refines."""
  n = draw(st.sampled_from((1, 2, 4, 8)))
  ids = list(draw(st.permutations(range(8))))[:n]
  rank = draw(st.integers(0, 4))
  explicit = draw(st.booleans())
  same_mesh = draw(st.booleans())
  s_shape, d_shape = _refined_meshes(draw, n)
  if same_mesh:
    d_shape = s_shape
  names = lambda shape: tuple("abc"[i] for i in range(len(shape)))  # noqa: E731
  src = named_sharding(ids, s_shape, draw(partition_specs(names(s_shape), rank)), explicit)
  dst = named_sharding(ids, d_shape, draw(partition_specs(names(d_shape), rank)), explicit)
  if same_mesh:
    dst = NamedSharding(src.mesh, dst.spec)
  cs, cd = shard_counts(src, rank), shard_counts(dst, rank)
  shape = tuple(math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(cs, cd))
  dtype = draw(st.sampled_from(DTYPES))
  route = draw(st.sampled_from(ROUTES))
  topology = draw(st.sampled_from(TOPOLOGIES))
  return shape, dtype, src, dst, route, topology, explicit


# ---------------------------------------------------------------------------------------
# The paper's examples
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_example_a_trainer_to_generator(route):
  """Example A: mesh (1, 4) P('tp', None) on ranks 0-3 -> mesh (2, 2) on ranks 4-7."""
  devs = np.array(devices())
  trainer = Mesh(devs[:4].reshape(1, 4), ("dp", "tp"))
  generator = Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
  x = jax.device_put(random_data((4, 8), np.float32),
                     NamedSharding(trainer, P("tp", None)))
  before = np.asarray(x).copy()
  dst = NamedSharding(generator, P("tp", None))
  y = jax_m2n.reshard(x, dst, route=route)
  assert_same_as_device_put(y, x, dst)
  np.testing.assert_array_equal(np.asarray(x), before)  # the source is untouched


def test_example_b_two_pipeline_stages_into_one_device():
  """Example B: two PP stages (TP=2 each) each reshard their layer into one device."""
  devs = np.array(devices())
  stage0 = Mesh(devs[0:2], ("tp",))
  stage1 = Mesh(devs[2:4], ("tp",))
  target = NamedSharding(Mesh(devs[6:7], ("tp",)), P())
  w0 = jax.device_put(random_data((8, 6), np.float32, 1), NamedSharding(stage0, P("tp")))
  w1 = jax.device_put(random_data((6, 8), np.float32, 2),
                      NamedSharding(stage1, P(None, "tp")))
  y0 = jax_m2n.reshard(w0, target)
  y1 = jax_m2n.reshard(w1, target)
  assert_same_as_device_put(y0, w0, target)
  assert_same_as_device_put(y1, w1, target)


# ---------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------

@SETTINGS
@hypothesis.given(eager_cases())
def test_eager_matches_device_put(case):
  relation, shape, dtype, src, dst, route, topology = case
  x = jax.device_put(random_data(shape, dtype), src)
  before = bits(x).copy()
  y = jax_m2n.reshard(x, dst, route=route, topology=topology)
  assert_same_as_device_put(y, x, dst)
  np.testing.assert_array_equal(bits(x), before)


@SETTINGS
@hypothesis.given(jit_cases())
def test_jit_matches_device_put(case):
  shape, dtype, src, dst, route, topology, explicit = case
  x = jax.device_put(random_data(shape, dtype, 3), src)
  # Explicit meshes: JAX's types carry the source sharding; Auto: say it.
  given = None if explicit and src.mesh == dst.mesh else src
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, route=route, topology=topology,
                                        src_sharding=given))
  y = f(x)
  assert_same_as_device_put(y, x, dst, exact_sharding=False)


@st.composite
def eager_tree_cases(draw):
  """2-3 leaves, each with its own devices, layouts and dtype: one plan, one call."""
  cases = draw(st.lists(eager_cases(), min_size=2, max_size=3))
  route = draw(st.sampled_from(ROUTES))
  topology = draw(st.sampled_from(TOPOLOGIES))
  return [c[1:5] for c in cases], route, topology


@hypothesis.settings(SETTINGS, max_examples=20)
@hypothesis.given(eager_tree_cases())
def test_eager_pytree_matches_device_put(case):
  leaves, route, topology = case
  x = {f"t{i}": jax.device_put(random_data(shape, dtype, i), src)
       for i, (shape, dtype, src, _) in enumerate(leaves)}
  dst = {f"t{i}": d for i, (_, _, _, d) in enumerate(leaves)}
  y = jax_m2n.reshard(x, dst, route=route, topology=topology)
  for k in x:
    assert_same_as_device_put(y[k], x[k], dst[k])


@st.composite
def jit_tree_cases(draw):
  """2-3 leaves on one pair of meshes (one device order), each with its own specs."""
  shape, dtype, src, dst, route, topology, explicit = draw(jit_cases())
  leaves = [(shape, dtype, src, dst)]
  for _ in range(draw(st.integers(1, 2))):
    rank = draw(st.integers(0, 3))
    s = NamedSharding(src.mesh, draw(partition_specs(src.mesh.axis_names, rank)))
    d = NamedSharding(dst.mesh, draw(partition_specs(dst.mesh.axis_names, rank)))
    cs, cd = shard_counts(s, rank), shard_counts(d, rank)
    leaf_shape = tuple(math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(cs, cd))
    leaves.append((leaf_shape, draw(st.sampled_from(DTYPES)), s, d))
  return leaves, route, topology


@hypothesis.settings(SETTINGS, max_examples=20)
@hypothesis.given(jit_tree_cases())
def test_jit_pytree_matches_device_put(case):
  leaves, route, topology = case
  x = [jax.device_put(random_data(shape, dtype, i), src)
       for i, (shape, dtype, src, _) in enumerate(leaves)]
  src = [s for _, _, s, _ in leaves]
  dst = [d for _, _, _, d in leaves]
  f = jax.jit(lambda t: jax_m2n.reshard(t, dst, route=route, topology=topology,
                                        src_sharding=src))
  assert f.lower(x).as_text().count("@jax_m2n_reshard") == 1
  y = f(x)
  for yl, xl, d in zip(y, x, dst):
    assert_same_as_device_put(yl, xl, d, exact_sharding=False)


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=("one_domain", "domain2", "domain4"))
def test_forward_stage_runs_across_domains(topology):
  """Replicas of one shard in several domains: inject once, forward, fan out."""
  devs = np.array(devices())
  src = NamedSharding(Mesh(devs[:2], ("x",)), P("x", None))
  dst = NamedSharding(Mesh(devs[2:8].reshape(3, 2), ("r", "t")), P(None, "t"))
  p = jax_m2n.plan(jax.ShapeDtypeStruct((6, 4), np.float32, sharding=src), dst,
                   topology=topology)
  if topology is not None and topology.domain_size == 2:
    assert any(x.stage == "forward" for x in p.transfers)
  x = jax.device_put(random_data((6, 4), np.float32, 4), src)
  y = jax_m2n.reshard(x, dst, topology=topology)
  assert_same_as_device_put(y, x, dst)


def test_plan_matches_what_reshard_runs():
  """jax_m2n.plan on arrays or ShapeDtypeStructs gives the plan the eager call caches."""
  devs = np.array(devices())
  src = NamedSharding(Mesh(devs[:4].reshape(1, 4), ("dp", "tp")), P("tp", None))
  dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P("tp", None))
  x = jax.device_put(random_data((4, 8), np.float32, 16), src)
  p = jax_m2n.plan(x, dst)
  assert p.bytes_by_link == {"local": 0, "nvlink": 256, "network": 0}
  assert p.devices == tuple(range(8))
  p2 = jax_m2n.plan(jax.ShapeDtypeStruct((4, 8), np.float32), dst, src_sharding=src)
  assert p2 is p  # plans are cached
  assert jax_m2n.plan(x, dst, route="flat").route == "flat"
  with pytest.raises(jax_m2n.ReshardValueError, match="src_sharding="):
    jax_m2n.plan(jax.ShapeDtypeStruct((4, 8), np.float32), dst)


# ---------------------------------------------------------------------------------------
# Pytrees, caching, donation
# ---------------------------------------------------------------------------------------

def _tree(devs):
  a = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("x", "y")), P("x", "y"))
  b = NamedSharding(Mesh(devs[:4], ("x",)), P())
  tree = {
      "w": jax.device_put(random_data((4, 6), jnp.bfloat16, 5), a),
      "b": [jax.device_put(random_data((8,), np.int8, 6), b),
            jax.device_put(random_data((), np.complex64, 7), b)],
      "mask": jax.device_put(random_data((4, 2), np.bool_, 8), a),
  }
  return tree


def test_pytree_one_plan_one_program_per_device():
  devs = np.array(devices())
  x = _tree(devs)
  gen = Mesh(devs[4:].reshape(2, 2), ("x", "y"))
  dst = {"w": NamedSharding(gen, P(None, "y")), "b": NamedSharding(gen, P()),
         "mask": NamedSharding(gen, P("y", None))}
  y = jax_m2n.reshard(x, dst)
  assert jax.tree.structure(y) == jax.tree.structure(x)
  full = jax.tree.broadcast(dst, x, is_leaf=lambda s: isinstance(s, NamedSharding))
  for yl, xl, d in zip(jax.tree.leaves(y), jax.tree.leaves(x), jax.tree.leaves(full)):
    assert_same_as_device_put(yl, xl, d)
  # One plan for the whole tree, one compiled program per participating device.
  key = next(k for k in eager.eager_cache if k[0] == jax.tree.structure(x))
  entry = eager.eager_cache[key]
  assert len(entry.plan.tensors) == 4
  assert sorted(p.device.id for p in entry.programs) == list(range(8))


def test_devices_of_one_buffer_signature_share_one_lowering():
  # Every device holds shards of the same shapes: the call traces and lowers its
  # program once and compiles one copy per device, each with that device's own
  # schedule (were any device given another's, its bytes would differ or it would
  # wait for peers that never come).
  import jax.monitoring
  devs = np.array(devices())
  mesh = Mesh(devs.reshape(2, 4), ("a", "b"))
  x = {"w": jax.device_put(random_data((16, 24), np.float32, 31),
                           NamedSharding(mesh, P("a", "b"))),
       "v": jax.device_put(random_data((8, 4), np.int16, 32),
                           NamedSharding(mesh, P(None, "b")))}
  dst = {"w": NamedSharding(mesh, P("b", "a")), "v": NamedSharding(mesh, P("b", "a"))}
  counts = {"lowerings": 0, "compiles": 0}
  events = {"/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings",
            "/jax/core/compile/backend_compile_duration": "compiles"}

  def on_event(event, duration, **_):
    if event in events:
      counts[events[event]] += 1

  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    y = jax_m2n.reshard(x, dst, timeout_s=60)
    jax.block_until_ready(y)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  for k in x:
    assert_same_as_device_put(y[k], x[k], dst[k])
  assert counts == {"lowerings": 1, "compiles": 8}, counts


def test_pytree_inside_jit_one_custom_call():
  devs = np.array(devices())
  mesh = Mesh(devs, ("x",))
  m2 = Mesh(devs.reshape(2, 4), ("a", "b"))
  src = {"w": NamedSharding(mesh, P("x", None)), "v": NamedSharding(mesh, P(None, "x"))}
  dst = {"w": NamedSharding(m2, P(None, ("a", "b"))), "v": NamedSharding(m2, P("b", "a"))}
  x = {"w": jax.device_put(random_data((8, 16), np.float32, 9), src["w"]),
       "v": jax.device_put(random_data((8, 8), np.uint32, 10), src["v"])}
  f = jax.jit(lambda t: jax_m2n.reshard(t, dst, src_sharding=src))
  text = f.lower(x).compile().as_text()
  assert text.count('custom_call_target="jax_m2n_reshard"') == 1
  y = f(x)
  for k in x:
    assert_same_as_device_put(y[k], x[k], dst[k], exact_sharding=False)


def test_dst_prefix_and_mixed_dtypes():
  devs = np.array(devices())
  x = _tree(devs)
  dst = NamedSharding(Mesh(devs[3:7], ("z",)), P())
  y = jax_m2n.reshard(x, dst)
  for yl, xl in zip(jax.tree.leaves(y), jax.tree.leaves(x)):
    assert_same_as_device_put(yl, xl, dst)


def test_cached_second_call_builds_nothing():
  devs = np.array(devices())
  src = NamedSharding(Mesh(devs[:2], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[2:5], ("y",)), P())
  x = jax.device_put(random_data((10,), np.float32, 11), src)
  jax_m2n.reshard(x, dst)
  n = len(eager.eager_cache)
  x2 = jax.device_put(random_data((10,), np.float32, 12), src)
  y = jax_m2n.reshard(x2, dst)
  assert len(eager.eager_cache) == n
  assert_same_as_device_put(y, x2, dst)


def test_identity_and_same_devices():
  devs = np.array(devices())
  s = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("x", "y")), P("y", "x"))
  x = jax.device_put(random_data((4, 4), np.int8, 13), s)
  assert_same_as_device_put(jax_m2n.reshard(x, s), x, s)


def test_donate_frees_sources_and_default_keeps_them():
  devs = np.array(devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None))
  x = jax.device_put(random_data((8,), np.float32, 14), src)
  ref = np.asarray(x).copy()
  y = jax_m2n.reshard(x, dst)
  assert not x.is_deleted()
  y = jax_m2n.reshard(x, dst, donate=True)
  assert x.is_deleted()
  np.testing.assert_array_equal(np.asarray(y), ref)


def test_empty_pytree_and_zero_size():
  devs = np.array(devices())
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P())
  assert jax_m2n.reshard({}, dst) == {}
  src = NamedSharding(Mesh(devs[:2], ("x",)), P(None, "x"))
  x = jax.device_put(np.zeros((0, 4), np.float32), src)
  y = jax_m2n.reshard(x, dst)
  assert y.shape == (0, 4) and y.sharding == dst


# ---------------------------------------------------------------------------------------
# Failures inside the handler
# ---------------------------------------------------------------------------------------

def test_timeout_when_a_peer_never_arrives():
  """A rendezvous that cannot complete raises ReshardTimeoutError within the timeout,
  and the next call of the same reshard works (the missing device's turn is abandoned)."""
  devs = np.array(devices())
  shape = (13, 3)  # used by no other test
  src = NamedSharding(Mesh(devs[:2], ("x",)), P())
  dst = NamedSharding(Mesh(devs[5:7], ("x",)), P())
  x = jax.device_put(random_data((13, 4), np.float32, 15)[:, :3], src)
  assert x.shape == shape
  jax_m2n.reshard(x, dst, timeout_s=2)  # builds and caches the programs
  key = eager.eager_key(Request(
      leaves=[x], treedef=jax.tree.structure(x), dsts=[dst], srcs=[None],
      out_dtypes=[None], donate=[False],
      options=Options(route="hierarchical", topology=None, timeout_ms=2000,
                      chunk_bytes=None),
      names=lambda: ["x"]))
  entry = eager.eager_cache[key]
  start = time.monotonic()
  with pytest.raises(jax_m2n.ReshardTimeoutError, match="did not arrive") as e:
    entry([x], False, devices=[0, 1, 5])  # device 6 never runs its program
  assert time.monotonic() - start < 20
  assert "timed out" in str(e.value) or "DEADLINE" in str(e.value)
  assert not x.is_deleted()
  y = jax_m2n.reshard(x, dst, timeout_s=2)
  assert_same_as_device_put(y, x, dst)


def test_native_errors_map_to_the_family():
  timeout = errors.map_native_error(RuntimeError("DEADLINE_EXCEEDED: peer 3 missing"))
  assert isinstance(timeout, jax_m2n.ReshardTimeoutError)
  assert "peer 3 missing" in str(timeout)
  other = errors.map_native_error(RuntimeError("INVALID_ARGUMENT: bad schedule"))
  assert type(other) is jax_m2n.ReshardRuntimeError and "bad schedule" in str(other)
  assert isinstance(other, RuntimeError) and isinstance(timeout, RuntimeError)
  assert isinstance(timeout, TimeoutError)
  # Recognised by the status code, not by a word anywhere in the message.
  mentions = errors.map_native_error(RuntimeError("INTERNAL: the timeout_s field is bad"))
  assert not isinstance(mentions, jax_m2n.ReshardTimeoutError)
  assert isinstance(errors.map_native_error(TimeoutError("x")), jax_m2n.ReshardTimeoutError)


@pytest.mark.parametrize("chunk_bytes", [1, 64, 4096])
def test_chunk_bytes_tunable_many_steps(chunk_bytes):
  devs = jax.devices()
  src = NamedSharding(Mesh(np.array(devs[:2]), ("x",)), P("x", None))
  dst = NamedSharding(Mesh(np.array(devs[4:8]).reshape(2, 2), ("dp", "tp")), P(None, "tp"))
  x = jax.device_put(np.arange(16 * 24, dtype=np.float32).reshape(16, 24), src)
  y = jax_m2n.reshard(x, dst, topology=jax_m2n.Topology(domain_size=2),
                      chunk_bytes=chunk_bytes)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  assert y.sharding == dst
  for shard in y.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-4, ValueError),
                                       (1.5, TypeError), (True, TypeError),
                                       ("64", TypeError)])
def test_chunk_bytes_must_be_positive_int(bad, error):
  devs = jax.devices()
  x = jax.device_put(np.ones((4, 4), np.float32), devs[0])
  with pytest.raises(error, match="chunk_bytes must be a positive int") as e:
    jax_m2n.reshard(x, jax.sharding.SingleDeviceSharding(devs[1]), chunk_bytes=bad)
  assert isinstance(e.value, jax_m2n.ReshardError)


def test_jit_pytree_with_zero_size_leaves():
  """Zero-size leaves stay out of the custom call; the others still move in one call."""
  devs = np.array(jax.devices()[:4])
  src = NamedSharding(Mesh(devs, ("x",)), P("x", None))
  dst = NamedSharding(Mesh(devs.reshape(2, 2), ("a", "b")), P(None, ("a", "b")))
  tree = {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), src),
          "e": jax.device_put(np.zeros((8, 0), np.float32), src)}
  f = jax.jit(lambda t: jax_m2n.reshard(t, dst, src_sharding=src))
  out = f(tree)
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(tree["w"]))
  assert out["e"].shape == (8, 0) and out["w"].sharding.is_equivalent_to(dst, 2)
  hlo = f.lower(tree).compile().as_text()
  assert hlo.count("jax_m2n_reshard") >= 1
  only_empty = jax.jit(lambda t: jax_m2n.reshard(t, dst, src_sharding=src))(
      {"e": tree["e"]})
  assert only_empty["e"].shape == (8, 0)
