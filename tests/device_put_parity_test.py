"""jax_m2n.reshard against jax.device_put / jax.sharding.reshard, case by case.

Each case runs JAX's function and reshard on the same input and compares everything a
caller can observe: values, per-shard data and indices, sharding, device order,
committedness, weak_type, dtype and memory kind; donation; and, as properties over
random layouts, gradients (the cotangent equals device_put's) and vmap.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging  # noqa: E402

import hypothesis  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

import jax_m2n  # noqa: E402
from jax_m2n._src import jax_compat  # noqa: E402
import shards  # noqa: E402
from plan_strategies import partition_specs  # noqa: E402

SETTINGS = hypothesis.settings(max_examples=15, deadline=None, derandomize=True,
                               suppress_health_check=list(hypothesis.HealthCheck))
D = np.array(jax.devices())
if len(D) < 8:  # conftest.py forces 8 CPU devices unless told otherwise
  pytest.skip(f"needs 8 devices; got {len(D)} {D[0].platform} device(s). Hint: "
              "JAX_PLATFORMS=cpu with XLA_FLAGS=--xla_force_host_platform_device_count=8.",
              allow_module_level=True)


def mesh(ids, shape, names, explicit=False):
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
  return Mesh(D[list(ids)].reshape(shape), names, axis_types=types)


def ns(ids, shape, names, *spec, explicit=False, memory_kind=None):
  return NamedSharding(mesh(ids, shape, names, explicit), P(*spec), memory_kind=memory_kind)


def data(shape, dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * 100).astype(dtype)


def bits(a):
  a = np.atleast_1d(np.asarray(a))
  return a.view(np.uint8) if a.dtype.itemsize and a.size else a


def assert_same(y, ref):
  """Everything observable about y equals ref (jax.device_put's result)."""
  assert type(y) is type(ref)
  assert y.shape == ref.shape and y.dtype == ref.dtype
  assert getattr(y, "weak_type", False) == getattr(ref, "weak_type", False)
  assert y.committed == ref.committed
  assert y.sharding.is_equivalent_to(ref.sharding, y.ndim), (y.sharding, ref.sharding)
  assert y.sharding.memory_kind == ref.sharding.memory_kind
  assert ([d.id for d in jax_compat.device_assignment(y.sharding)] ==
          [d.id for d in jax_compat.device_assignment(ref.sharding)])
  if jax.dtypes.issubdtype(y.dtype, jax.dtypes.extended):
    y, ref = jax.random.key_data(y), jax.random.key_data(ref)
  shards.assert_same_shards(y, ref)
  np.testing.assert_array_equal(bits(y), bits(ref))


# (name, input maker, destination maker). Makers are called per run (fresh arrays).
CASES = [
    ("disjoint 1d->2d", lambda: jax.device_put(data((8, 6)), ns(range(4), (4,), ("x",), "x")),
     lambda: ns(range(4, 8), (2, 2), ("a", "b"), "b", "a")),
    ("same devices, new spec", lambda: jax.device_put(data((8, 8)), ns(range(8), (8,), ("x",), "x")),
     lambda: ns(range(8), (2, 4), ("a", "b"), None, ("a", "b"))),
    ("reversed device order", lambda: jax.device_put(data((4, 4), np.int32),
                                                     ns(range(4), (4,), ("x",), "x")),
     lambda: ns([3, 2, 1, 0], (4,), ("x",), None, "x")),
    ("to a jax.Device", lambda: jax.device_put(data((6,)), ns(range(2), (2,), ("x",), "x")),
     lambda: D[5]),
    ("to SingleDeviceSharding", lambda: jax.device_put(data((4, 2), np.int8),
                                                       ns(range(4), (4,), ("x",), "x")),
     lambda: SingleDeviceSharding(D[6])),
    ("from SingleDeviceSharding", lambda: jax.device_put(data((8,), np.float16), D[1]),
     lambda: ns(range(2, 6), (4,), ("x",), "x")),
    ("uncommitted", lambda: jnp.arange(16.0).reshape(4, 4),
     lambda: ns(range(4, 8), (4,), ("x",), "x")),
    ("numpy", lambda: data((8, 2), np.int16), lambda: ns(range(8), (8,), ("x",), "x")),
    ("python scalar", lambda: 3.5, lambda: D[2]),
    ("python int", lambda: 7, lambda: ns(range(4), (4,), ("x",))),
    ("weak committed scalar", lambda: jax.device_put(jnp.asarray(2.0), D[0]), lambda: D[7]),
    ("bool", lambda: jax.device_put(data((8,)) > 0, ns(range(4), (4,), ("x",), "x")),
     lambda: ns(range(4, 8), (2, 2), ("a", "b"), ("a", "b"))),
    ("bfloat16", lambda: jax.device_put(data((4, 8), jnp.bfloat16),
                                        ns(range(8), (2, 4), ("a", "b"), "a", "b")),
     lambda: ns(range(8), (8,), ("x",), None, "x")),
    ("zero size", lambda: jax.device_put(np.zeros((0, 4), np.float32),
                                         ns(range(2), (2,), ("x",), None, "x")),
     lambda: ns(range(4, 8), (4,), ("x",))),
    ("prng keys", lambda: jax.device_put(jax.random.split(jax.random.key(1), 8),
                                         ns(range(4), (4,), ("x",), "x")),
     lambda: ns(range(4, 8), (4,), ("x",), "x")),
    ("int4", lambda: jax.device_put(np.arange(8).astype(jnp.int4), ns(range(2), (2,), ("x",), "x")),
     lambda: ns(range(4, 8), (4,), ("x",))),
    ("to pinned_host", lambda: jax.device_put(data((8, 4)), ns(range(4), (4,), ("x",), "x")),
     lambda: ns(range(4), (4,), ("x",), "x", memory_kind="pinned_host")),
    ("from pinned_host", lambda: jax.device_put(
        data((8, 4)), ns(range(4), (4,), ("x",), "x", memory_kind="pinned_host")),
     lambda: ns(range(4, 8), (4,), ("x",), None, "x")),
    ("to unpinned_host", lambda: jax.device_put(data((8,)), ns(range(2), (2,), ("x",), "x")),
     lambda: ns(range(2), (2,), ("x",), memory_kind="unpinned_host")),
    ("explicit axes", lambda: jax.device_put(data((8, 4)),
                                             ns(range(4), (4,), ("x",), "x", explicit=True)),
     lambda: ns(range(4, 8), (2, 2), ("a", "b"), "b", "a", explicit=True)),
]


def _kinds_available():
  return {m.kind for m in D[0].addressable_memories()}


@pytest.mark.parametrize("name,make_x,make_dst", CASES, ids=[c[0] for c in CASES])
def test_eager_matches_device_put(name, make_x, make_dst):
  dst = make_dst()
  kind = getattr(dst, "memory_kind", None)
  if "host" in name and not {"pinned_host", "unpinned_host"} & _kinds_available():
    pytest.skip("no host memory kinds on this backend")
  del kind
  ref = jax.device_put(make_x(), dst)
  y = jax_m2n.reshard(make_x(), dst)
  assert_same(y, ref)


def test_pytree_prefix_none_leaves_and_donation_match_device_put():
  def tree():
    s = ns(range(4), (4,), ("x",), "x")
    return {"w": jax.device_put(data((8, 4), seed=1), s),
            "b": [jax.device_put(data((8,), seed=2), s), jax.device_put(data((4,), seed=3), s)],
            "keep": jax.device_put(data((4,), seed=4), s)}
  dst = {"w": ns(range(4, 8), (2, 2), ("a", "b"), "a"), "b": D[6], "keep": None}
  donate = {"w": True, "b": [False, True], "keep": False}
  xr, xm = tree(), tree()
  ref = jax.device_put(xr, dst, donate=donate)
  y = jax_m2n.reshard(xm, dst, donate=donate)
  for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(ref)):
    assert_same(a, b)
  assert y["keep"] is xm["keep"]  # None: the source layout is kept, as device_put does
  # Only leaves marked True are gone.
  assert xm["w"].is_deleted() and xm["b"][1].is_deleted()
  assert not xm["b"][0].is_deleted() and not xm["keep"].is_deleted()


def test_donate_tuple_prefix():
  s = ns(range(4), (4,), ("x",), "x")
  a, b = jax.device_put(data((8,)), s), jax.device_put(data((8,), seed=5), s)
  jax_m2n.reshard((a, b), ns(range(4, 8), (4,), ("x",)), donate=(True, False))
  assert a.is_deleted() and not b.is_deleted()


def test_partition_spec_under_set_mesh():
  m = mesh(range(4, 8), (2, 2), ("a", "b"))
  x = jax.device_put(data((8, 4)), ns(range(4), (4,), ("x",), "x"))
  with jax.set_mesh(m):
    ref = jax.device_put(x, P("b", "a"))
    y = jax_m2n.reshard(x, P("b", "a"))
  assert_same(y, ref)


def test_weak_type_promotion_matches_device_put():
  w = jax.device_put(jnp.asarray(2.0), D[0])
  assert w.weak_type
  y = jax_m2n.reshard(w, D[3])
  x = jax.device_put(jnp.ones(4, jnp.bfloat16), D[3])
  assert (y * x).dtype == (jax.device_put(w, D[3]) * x).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------
# Inside jit
# ---------------------------------------------------------------------------------------

JIT_CASES = [
    ("auto, src given", ns(range(8), (8,), ("x",), "x"), ns(range(8), (2, 4), ("a", "b"), None, "b"),
     True),
    ("auto, no src, another mesh", ns(range(8), (8,), ("x",), "x"),
     ns(range(8), (2, 4), ("a", "b"), "b", "a"), False),
    ("auto, no src, one mesh (XLA's layout, jax_m2n moves it)",
     ns(range(8), (2, 4), ("a", "b"), "a", "b"), ns(range(8), (2, 4), ("a", "b"), "b", "a"),
     False),
    ("explicit, src from the type", ns(range(8), (2, 4), ("a", "b"), "a", "b", explicit=True),
     ns(range(8), (2, 4), ("a", "b"), "b", None, explicit=True), False),
    ("single device", SingleDeviceSharding(D[0]), SingleDeviceSharding(D[0]), True),
]


@pytest.mark.parametrize("name,src,dst,give_src", JIT_CASES, ids=[c[0] for c in JIT_CASES])
def test_jit_matches_device_put(name, src, dst, give_src):
  x = jax.device_put(data((8, 8)), src)
  kw = {"src_sharding": src} if give_src else {}
  ctx = jax.set_mesh(dst.mesh) if "explicit" in name else None
  if ctx:
    with ctx:
      ref = jax.jit(lambda v: jax.sharding.reshard(v, dst))(x)
      y = jax.jit(lambda v: jax_m2n.reshard(v, dst, **kw))(x)
  else:
    # Inside jit on Auto axes jax.device_put(v, dst) may leave v where it is (XLA's
    # choice); the layout asked for is what with_sharding_constraint pins.
    ref = jax.jit(lambda v: jax.lax.with_sharding_constraint(v, dst))(x)
    y = jax.jit(lambda v: jax_m2n.reshard(v, dst, **kw))(x)
  assert_same(y, ref)


@pytest.mark.parametrize("direction", ["to host", "from host"])
def test_jit_host_memory_kinds_match_device_put(direction):
  if "pinned_host" not in _kinds_available():
    pytest.skip("no pinned_host memory on this backend")
  s = ns(range(4), (4,), ("x",), "x")
  host = s.with_memory_kind("pinned_host")
  src, dst = (s, host) if direction == "to host" else (host, s)
  x = jax.device_put(data((8, 4)), src)
  ref = jax.jit(lambda v: jax.device_put(v, dst))(x)
  y = jax.jit(lambda v: jax_m2n.reshard(v, dst))(x)
  assert_same(y, ref)


def test_jit_paths_are_logged(caplog):
  src = ns(range(8), (8,), ("x",), "x")
  dst = ns(range(8), (8,), ("x",), None, "x")
  x = jax.device_put(data((8, 8)), src)
  with caplog.at_level(logging.DEBUG, logger="jax_m2n"):
    jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src)).lower(x).compile()
    jax.jit(lambda v: jax_m2n.reshard(v, dst)).lower(x).compile()
    scalar = jax.device_put(np.float32(1), ns(range(8), (8,), ("x",)))
    jax.jit(lambda v: jax_m2n.reshard(v, ns(range(8), (8,), ("x",)))).lower(
        scalar).compile()  # rank 0: XLA's partitioner
    jax_m2n.reshard(x, ns(range(4), (4,), ("x",)))
    jax_m2n.reshard(np.ones(3), D[0])
  text = caplog.text
  assert "traced shard_map path" in text
  assert "custom_partitioning path (in jit) for 1 leaves" in text
  assert "delegated 1 leaves to XLA's partitioner" in text
  assert "eager per-device path" in text
  assert "delegated 1 of 1 leaves to jax.device_put" in text
  assert "planned 1 leaves" in text and "in-jit custom call" in text


def test_check_errors_is_quiet_when_nothing_failed():
  assert jax_m2n.check_errors() is None


# ---------------------------------------------------------------------------------------
# Properties over random layouts: gradients and vmap
# ---------------------------------------------------------------------------------------

SPECS_2D = [(), ("x",), (None, "x"), ("x", None)]


@st.composite
def layouts(draw):
  n_src = draw(st.sampled_from([1, 2, 4]))
  n_dst = draw(st.sampled_from([1, 2, 4]))
  src_first = draw(st.sampled_from([0, 4]))
  dst_first = draw(st.sampled_from([0, 2, 4]))
  src = ns(range(src_first, src_first + n_src), (n_src,), ("x",), *draw(st.sampled_from(SPECS_2D)))
  dst = ns(range(dst_first, dst_first + n_dst), (n_dst,), ("x",), *draw(st.sampled_from(SPECS_2D)))
  seed = draw(st.integers(0, 100))
  return src, dst, seed


def _loss(move, dst):
  def f(v, w):
    return jnp.sum(jnp.sin(move(v, dst)) * w)
  return f


@SETTINGS
@hypothesis.given(layouts())
def test_grad_cotangent_equals_device_put(case):
  src, dst, seed = case
  x = jax.device_put(data((4, 4), seed=seed), src)
  w = jax.device_put(data((4, 4), seed=seed + 1), dst)
  g_ref = jax.grad(_loss(jax.device_put, dst))(x, w)
  g = jax.grad(_loss(jax_m2n.reshard, dst))(x, w)
  assert_same(g, g_ref)
  assert g.sharding.is_equivalent_to(x.sharding, 2)  # back in the source layout
  # vjp and jvp directly.
  y, pull = jax.vjp(lambda v: jax_m2n.reshard(v, dst), x)
  (ct,) = pull(jnp.ones_like(y))
  assert ct.sharding.is_equivalent_to(x.sharding, 2)
  _, t = jax.jvp(lambda v: jax_m2n.reshard(v, dst), (x,), (x,))
  assert_same(t, jax.device_put(x, dst))


@SETTINGS
@hypothesis.given(layouts())
def test_grad_in_jit_equals_device_put(case):
  src, dst, seed = case
  dst = NamedSharding(src.mesh, dst.spec)  # inside jit: the jit's devices
  x = jax.device_put(data((4, 4), seed=seed), src)
  w = jax.device_put(data((4, 4), seed=seed + 1), dst)
  g_ref = jax.jit(jax.grad(_loss(jax.device_put, dst)))(x, w)
  move = lambda v, d: jax_m2n.reshard(v, d, src_sharding=src)  # noqa: E731
  g = jax.jit(jax.grad(_loss(move, dst)))(x, w)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
  assert g.sharding.is_equivalent_to(src, 2)
  g2 = jax.grad(jax.jit(_loss(move, dst)))(x, w)
  np.testing.assert_array_equal(np.asarray(g2), np.asarray(g_ref))


@SETTINGS
@hypothesis.given(layouts(), st.integers(0, 1))
def test_vmap_equals_device_put(case, axis):
  src, dst, seed = case
  x = jax.device_put(data((4, 4, 4), seed=seed),
                     NamedSharding(src.mesh, P(None, *src.spec)))
  # Each example lands in dst's layout and the batch dimension stays unsharded, as
  # jax.lax.with_sharding_constraint and jax.sharding.reshard do under vmap
  # (jax.device_put's batching rule instead applies dst's spec to the batch dim).
  batched = NamedSharding(dst.mesh, P(None, *dst.spec))
  ref = jax.device_put(jnp.moveaxis(x, axis, 0), batched)
  y = jax.vmap(lambda v: jax_m2n.reshard(v, dst), in_axes=axis)(x)
  assert_same(y, ref)
  same = NamedSharding(src.mesh, dst.spec)
  yj = jax.jit(jax.vmap(lambda v: jax_m2n.reshard(
      v, same, src_sharding=NamedSharding(src.mesh, P(*src.spec)))))(x)
  np.testing.assert_array_equal(np.asarray(yj), np.asarray(x))
  assert yj.sharding.is_equivalent_to(NamedSharding(src.mesh, P(None, *dst.spec)), 3)


@st.composite
def mixed_trees(draw):
  """A pytree mixing leaf kinds (committed arrays in random layouts, uncommitted, numpy,
  scalars) with per-leaf destinations (NamedSharding, Device, None) and donate flags."""
  n = draw(st.integers(1, 5))
  leaves, dsts, donate = [], [], []
  for i in range(n):
    kind = draw(st.sampled_from(["committed", "committed", "uncommitted", "numpy", "scalar"]))
    k = draw(st.sampled_from([1, 2, 4]))
    first = draw(st.sampled_from([0, 4]))
    src = ns(range(first, first + k), (k,), ("x",), *draw(st.sampled_from(SPECS_2D)))
    dtype = draw(st.sampled_from([np.float32, np.int8, np.uint16, np.bool_]))
    value = data((4, 8), dtype, seed=i)
    leaves.append({"committed": lambda v=value, s=src: jax.device_put(v, s),
                   "uncommitted": lambda v=value: jnp.asarray(v),
                   "numpy": lambda v=value: v,
                   "scalar": lambda: 1.5}[kind])
    dk = draw(st.sampled_from([1, 2, 4]))
    dfirst = draw(st.sampled_from([0, 2, 4]))
    dst = draw(st.sampled_from(["named", "named", "device", "none"]))
    dsts.append({"named": ns(range(dfirst, dfirst + dk), (dk,), ("x",),
                             *(draw(st.sampled_from(SPECS_2D)) if kind != "scalar" else ())),
                 "device": D[dfirst], "none": None}[dst])
    donate.append(kind == "committed" and draw(st.booleans()))
  return leaves, dsts, donate


@SETTINGS
@hypothesis.given(mixed_trees())
def test_random_mixed_pytrees_match_device_put(case):
  makers, dsts, donate = case
  xr = [m() for m in makers]
  xm = [m() for m in makers]
  ref = jax.device_put(xr, dsts, donate=donate)
  y = jax_m2n.reshard(xm, dsts, donate=donate)
  for i, (a, b) in enumerate(zip(y, ref)):
    if isinstance(b, jax.Array):
      assert_same(a, b)
    else:  # device_put(host value, None) keeps the host value
      assert a is xm[i] or np.array_equal(np.asarray(a), np.asarray(b))
  for i, (leaf, flag, dst) in enumerate(zip(xm, donate, dsts)):
    if isinstance(leaf, jax.Array) and not flag:
      assert not leaf.is_deleted()
    if flag and dst is None:  # returned as it is, so kept (the docstring's rule)
      assert y[i] is leaf and not leaf.is_deleted()
    elif flag:
      assert leaf.is_deleted()


# Inside jit, no src_sharding=, Auto axes, source and destination on one mesh: jax_m2n's
# custom call reads the layout XLA's partitioner gives the operand.
ONE_MESHES = [((8,), ("x",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")),
              ((2, 2, 2), ("a", "b", "c"))]
DTYPES = [np.int8, np.bool_, jnp.bfloat16, np.uint16, np.float32, np.int32, np.complex64]


@st.composite
def two_mesh_layouts(draw, one_mesh=False):
  """(src, dst, shape, dtype, seed): layouts on meshes of the same 8 devices (the same
  mesh with one_mesh=True)."""
  src_mesh = mesh(range(8), *draw(st.sampled_from(ONE_MESHES)))
  dst_mesh = src_mesh if one_mesh else mesh(range(8), *draw(st.sampled_from(ONE_MESHES)))
  ndim = draw(st.integers(1, 3))
  shape = tuple(draw(st.sampled_from([8, 16, 24])) for _ in range(ndim))
  return (NamedSharding(src_mesh, draw(partition_specs(src_mesh.axis_names, ndim))),
          NamedSharding(dst_mesh, draw(partition_specs(dst_mesh.axis_names, ndim))), shape,
          draw(st.sampled_from(DTYPES)), draw(st.integers(0, 100)))


@SETTINGS
@hypothesis.given(two_mesh_layouts(one_mesh=True))
def test_jit_without_src_on_one_mesh_runs_jax_m2n_bitwise_like_the_constraint(case):
  src, dst, shape, dtype, seed = case
  x = jax.device_put(data(shape, dtype, seed=seed), src)
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst))
  text = f.lower(x).compile().as_text()
  assert text.count('custom_call_target="jax_m2n_reshard"') == 1, text
  for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce",
             "reduce-scatter"):
    assert op not in text, (op, src, dst)
  ref = jax.jit(lambda v: jax.lax.with_sharding_constraint(v, dst), out_shardings=dst)(x)
  assert_same(f(x), ref)
  assert_same(f(x), jax.device_put(x, dst))


@SETTINGS
@hypothesis.given(two_mesh_layouts())
def test_jit_without_src_across_meshes_grad_and_vmap(case):
  src, dst, shape, dtype, seed = case
  x = jax.device_put(data(shape, dtype, seed=seed), src)
  def like(move, *v):  # JAX's own limit: an output layout it cannot name (Shardy)
    try:
      return move(*v)
    except Exception as e:  # noqa: BLE001
      hypothesis.assume(type(e).__name__ != "IndivisibleError")
      raise

  constrain = lambda v: jax.lax.with_sharding_constraint(v, dst)  # noqa: E731
  # The jit's output has dst's layout, as with out_shardings=dst (JAX's own constraint
  # without it may come out in another layout Shardy chose, or an IndivisibleError).
  ref = jax.jit(constrain, out_shardings=dst)(x)
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst))
  assert 'custom_call_target="jax_m2n_reshard"' in f.lower(x).compile().as_text()
  assert_same(f(x), ref)
  if dtype in (np.float32, jnp.bfloat16):
    w = jax.device_put(data(shape, dtype, seed=seed + 1), dst)
    g_ref = like(jax.jit(jax.grad(_loss(jax.device_put, dst))), x, w)
    g = jax.jit(jax.grad(_loss(jax_m2n.reshard, dst)))(x, w)
    np.testing.assert_array_equal(bits(g), bits(g_ref))
  xb = jax.device_put(data((2,) + shape, dtype, seed=seed),
                      NamedSharding(src.mesh, P(None, *src.spec)))
  # Under vmap in jit the result is what with_sharding_constraint gives there.
  yb_ref = like(jax.jit(jax.vmap(constrain)), xb)
  assert_same(jax.jit(jax.vmap(lambda v: jax_m2n.reshard(v, dst)))(xb), yb_ref)
