"""reshard against JAX's own calls where they used to differ (issue 22, parts of 26).

Each test states JAX's result (jax.sharding.reshard, with_sharding_constraint,
jax.device_put, jax.jit(out_shardings=)) and checks ours equals it: grad and vmap on
Explicit-axes meshes (result types), random pairs of meshes over one device order inside
jit, uneven shards inside jit, concrete layouts (Format), rank 9, the checking_leaks
config, and the argument errors of reshard and plan (ReshardError classes, the leaf and
argument named, nothing converted before a destination check).
"""

import logging
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import eager
from jax_m2n._src import traced
from jax_m2n._src.eager import delegate

D = jax.devices()
if len(D) < 8:  # conftest.py forces 8 CPU devices unless told otherwise
  pytest.skip(f"needs 8 devices; got {len(D)} {D[0].platform} device(s). Hint: "
              "JAX_PLATFORMS=cpu with XLA_FLAGS=--xla_force_host_platform_device_count=8.",
              allow_module_level=True)


def _explicit_mesh():
  return Mesh(np.array(D).reshape(4, 2), ("x", "y"),
              axis_types=(AxisType.Explicit,) * 2)


def _same(y, ref):
  assert jax.typeof(y) == jax.typeof(ref), (jax.typeof(y), jax.typeof(ref))
  assert y.sharding.is_equivalent_to(ref.sharding, y.ndim), (y.sharding, ref.sharding)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))


# ---------------------------------------------------------------------------------------
# Transformations on Explicit-axes meshes: the types jax.sharding.reshard gives
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True])
def test_grad_on_explicit_axes_gives_the_cotangent_the_source_type(jit):
  """Was (jit): "Expected cotangent type float32[8@x,2@y] but got float32[8@x,2]"."""
  mesh = _explicit_mesh()
  x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("x", "y")))
  dst = NamedSharding(mesh, P("x", None))

  def grad(move):
    g = jax.grad(lambda v: (move(v, dst) * jnp.arange(2.0)).sum())
    return jax.jit(g) if jit else g

  with jax.set_mesh(mesh):
    ref = grad(jax.sharding.reshard)(x)
    y = grad(jax_m2n.reshard)(x)
  _same(y, ref)
  assert jax.typeof(y).sharding.spec == P("x", "y")


@pytest.mark.parametrize("jit", [False, True])
def test_vmap_on_explicit_axes_keeps_the_batch_dims_sharding(jit):
  """Was: float32[4,8,2@y] where jax.sharding.reshard gives float32[4@x,8,2@y]."""
  mesh = _explicit_mesh()
  x = jax.device_put(jnp.arange(64.0).reshape(4, 8, 2),
                     NamedSharding(mesh, P("x", None, None)))

  def run(move):
    f = jax.vmap(lambda v: move(v, NamedSharding(mesh, P(None, "y"))))
    return (jax.jit(f) if jit else f)(x)

  with jax.set_mesh(mesh):
    ref, y = run(jax.sharding.reshard), run(jax_m2n.reshard)
  _same(y, ref)
  assert jax.typeof(y).sharding.spec[0] == "x"


def test_vmap_spmd_axis_name_shards_the_batch_dim_as_with_sharding_constraint():
  mesh = Mesh(np.array(D).reshape(4, 2), ("x", "y"))
  x = jax.device_put(jnp.arange(64.0).reshape(4, 8, 2), NamedSharding(mesh, P()))
  dst = NamedSharding(mesh, P(None, "y"))

  def run(move, jit):
    f = jax.vmap(lambda v: move(v, dst), spmd_axis_name="x")
    return (jax.jit(f) if jit else f)(x)

  for jit in (False, True):
    ref, y = run(jax.lax.with_sharding_constraint, jit), run(jax_m2n.reshard, jit)
    assert y.sharding == ref.sharding == NamedSharding(mesh, P("x", None, "y"))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  hlo = jax.jit(jax.vmap(lambda v: jax_m2n.reshard(v, dst), spmd_axis_name="x")).lower(
      x).compile().as_text()
  assert "jax_m2n_reshard" in hlo
  with pytest.raises(jax_m2n.ReshardValueError, match="spmd_axis_name"):
    jax.jit(jax.vmap(lambda v: jax_m2n.reshard(v, NamedSharding(mesh, P("x"))),
                     spmd_axis_name="x"))(x)


# ---------------------------------------------------------------------------------------
# Inside jit: random pairs of meshes over one device order
# ---------------------------------------------------------------------------------------

def _mesh_pairs(n=16, seed=0):
  """(shape, src, dst): meshes of any shapes / axis orders over random device orders
  (the same order for two pairs in three, so most pairs are ones XLA accepts), specs
  over random axis orders (e.g. (2, 4) P('b', 'a') -> (4, 2) P('d', 'c'))."""
  rng = np.random.default_rng(seed)
  shapes = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8), (2, 1, 4)]
  out = [((16, 24), NamedSharding(Mesh(np.array(D).reshape(2, 4), ("a", "b")),
                                  P("b", "a")),
          NamedSharding(Mesh(np.array(D).reshape(4, 2), ("c", "d")), P("d", "c")))]
  while len(out) < n:
    order = np.array(D)[rng.permutation(8)]
    ms = []
    for names in ("abc", "def"):
      if names == "def" and rng.random() < 1 / 3:
        order = np.array(D)[rng.permutation(8)]
      shape = shapes[rng.integers(len(shapes))]
      mesh = Mesh(order.reshape(shape), tuple(names[:len(shape)]))
      axes = list(mesh.axis_names)
      rng.shuffle(axes)
      cut = rng.integers(len(axes) + 1)
      ms.append(NamedSharding(mesh, P(tuple(axes[:cut]) or None, tuple(axes[cut:]) or None)))
    out.append(((16, 24), ms[0], ms[1]))
  return out


@pytest.mark.parametrize("shape,src,dst", _mesh_pairs())
def test_jit_random_mesh_pairs_move_as_xla_does(shape, src, dst):
  """Where XLA moves the pair inside jit (jit(out_shardings=dst)), ours does, with or
  without out_shardings= and src_sharding=, and its output has dst's layout; the
  (2, 4) P('b', 'a') -> (4, 2) P('d', 'c') pair without out_shardings= was a raw
  IndivisibleError (as JAX's own constraint still is on 0.10.2). Where JAX refuses
  (another device order), ours refuses before anything runs: a ReshardValueError
  with src_sharding=, else JAX's ValueError naming the caller's line."""
  host = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  x = jax.device_put(host, src)
  try:
    ref = jax.jit(lambda v: v, out_shardings=dst)(x)
  except ValueError:
    ref = None
  if ref is None:
    assert list(src.mesh.devices.flat) != list(dst.mesh.devices.flat)
    with pytest.raises(jax_m2n.ReshardValueError, match="same devices in the same order"):
      jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src))(x)
    with pytest.raises(ValueError, match=r"incompatible devices.*parity_test\.py"):
      jax.jit(lambda v: jax_m2n.reshard(v, dst))(x)
  else:
    for kw in ({}, {"src_sharding": src}):
      y = jax.jit(lambda v: jax_m2n.reshard(v, dst, **kw), out_shardings=dst)(x)
      assert y.sharding == dst
      np.testing.assert_array_equal(np.asarray(y), host)
      y = jax.jit(lambda v: jax_m2n.reshard(v, dst, **kw))(x)
      assert y.sharding.is_equivalent_to(dst, len(shape)), (y.sharding, dst)
      np.testing.assert_array_equal(np.asarray(y), host)
  # Uncommitted (host) data: the jit runs on the destination's devices.
  y = jax.jit(lambda v: jax_m2n.reshard(v, dst))(host)
  assert y.sharding.is_equivalent_to(dst, len(shape)), (y.sharding, dst)
  np.testing.assert_array_equal(np.asarray(y), host)


def test_prime_mesh_sharding_keeps_the_layout():
  mesh = Mesh(np.array(D)[::-1].reshape(4, 2), ("c", "d"))
  for spec in (P("d", "c"), P(("c", "d")), P(None, "c"), P()):
    dst = NamedSharding(mesh, spec)
    prime = traced.prime_mesh_sharding(dst)
    assert prime.mesh.devices.shape == (2, 2, 2)
    assert list(prime.mesh.devices.flat) == list(mesh.devices.flat)
    assert prime.is_equivalent_to(dst, 2)
  flat = NamedSharding(Mesh(np.array(D).reshape(2, 2, 2), ("a", "b", "c")), P("a"))
  assert traced.prime_mesh_sharding(flat) is flat


def test_jit_destination_off_the_context_mesh_is_a_reshard_value_error():
  """Under jax.set_mesh the jit's devices are the context mesh's, known at trace time:
  was JAX's plain ValueError for a destination on the same number of other devices."""
  m4, other = Mesh(np.array(D[:4]), ("x",)), Mesh(np.array(D[4:]), ("x",))
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(m4, P("x")))
  with jax.set_mesh(m4), pytest.raises(
      jax_m2n.ReshardValueError, match=r"\[4, 5, 6, 7\] and context mesh devices "
                                       r"\[0, 1, 2, 3\]"):
    jax.jit(lambda v: jax_m2n.reshard(v, NamedSharding(other, P(None, "x"))))(x)
  with jax.set_mesh(m4):
    y = jax.jit(lambda v: jax_m2n.reshard(v, NamedSharding(m4, P(None, "x"))))(x)
  assert y.sharding.is_equivalent_to(NamedSharding(m4, P(None, "x")), 2)


# ---------------------------------------------------------------------------------------
# Uneven shards, concrete layouts, rank 9: what JAX accepts, we accept
# ---------------------------------------------------------------------------------------

def test_uneven_shards_inside_jit_as_with_sharding_constraint(caplog):
  """Was a ReshardValueError; JAX pads such shards inside jit."""
  caplog.set_level(logging.DEBUG, logger="jax_m2n")
  mesh = Mesh(np.array(D), ("x",))
  dst = NamedSharding(mesh, P("x"))
  x = jax.device_put(jnp.arange(113003.0), NamedSharding(mesh, P()))

  def run(move):
    return jax.jit(lambda v: move(v, dst) * 2)(x)

  ref, y = run(jax.lax.with_sharding_constraint), run(jax_m2n.reshard)
  assert "XLA's partitioner (in jit) (uneven shards" in caplog.text
  assert y.sharding == ref.sharding
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  # Eagerly jax.device_put refuses uneven shards (IndivisibleError): so do we.
  with pytest.raises(ValueError):
    jax.device_put(x, dst)
  with pytest.raises(jax_m2n.ReshardValueError, match="divisible"):
    jax_m2n.reshard(x, dst)


def test_format_destinations_as_device_put(caplog):
  """Was a ReshardTypeError; now delegated to jax.device_put (a debug line says so)."""
  caplog.set_level(logging.DEBUG, logger="jax_m2n")
  from jax.experimental.layout import Format, Layout
  mesh = Mesh(np.array(D), ("x",))
  x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x")))
  fmt = Format(Layout(major_to_minor=(0, 1)), NamedSharding(mesh, P(None, None)))
  ref, y = jax.device_put(x, fmt), jax_m2n.reshard(x, fmt)
  assert "concrete layout" in caplog.text
  assert y.format == ref.format
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  out = jax_m2n.reshard({"a": x, "b": x}, {"a": fmt, "b": NamedSharding(mesh, P())})
  assert out["a"].format == ref.format
  assert out["b"].sharding == NamedSharding(mesh, P())
  jy = jax.jit(lambda v: jax_m2n.reshard(v, fmt))(x)
  jref = jax.jit(lambda v: jax.device_put(v, fmt))(x)
  assert jy.format == jref.format


def test_rank_9_as_device_put():
  """Was "reshard: x must have rank at most 8"."""
  mesh = Mesh(np.array(D), ("x",))
  x = jax.device_put(jnp.arange(16.0).reshape((8, 2) + (1,) * 7), NamedSharding(mesh, P()))
  dst = NamedSharding(mesh, P("x"))
  ref = jax.device_put(x, dst)
  _same(jax_m2n.reshard(x, dst), ref)
  _same(jax.jit(lambda v: jax_m2n.reshard(v, dst))(x), ref)
  with pytest.raises(jax_m2n.ReshardValueError, match="does not plan"):
    jax_m2n.plan(x, dst)
  # Under jvp outside jit the leaf goes to jax.device_put's destination too (it was
  # put with destination None there, so it stayed on the source's layout).
  y, t = jax.jvp(lambda v: jax_m2n.reshard(v, dst), (x,), (x,))
  ry, rt = jax.jvp(lambda v: jax.device_put(v, dst), (x,), (x,))
  _same(y, ry)
  _same(t, rt)


def test_unfused_dtype_checks_the_destination_before_astype(monkeypatch):
  calls = []
  real = eager.astype
  spy = lambda v, d: calls.append(d) or real(v, d)  # noqa: E731
  monkeypatch.setattr(eager, "astype", spy)  # read by traced_leaves.py
  monkeypatch.setattr(delegate, "astype", spy)  # read by the eager path
  mesh = Mesh(np.array(D[:3]), ("x",))
  x = jax.device_put(jnp.arange(8, dtype=jnp.int8), D[0])
  bad = NamedSharding(mesh, P(None, "x"))  # rank 2 for a rank-1 leaf
  with pytest.raises(jax_m2n.ReshardValueError, match="one PartitionSpec entry"):
    jax.jit(lambda v: jax_m2n.reshard(v, bad, dtype=jnp.int32))(x)
  with pytest.raises(jax_m2n.ReshardValueError, match="one PartitionSpec entry"):
    jax.vmap(lambda v: jax_m2n.reshard(v, bad, dtype=jnp.int32))(x[None])
  with pytest.raises(jax_m2n.ReshardValueError, match="hold shape"):  # 8 over 3
    jax.vmap(lambda v: jax_m2n.reshard(v, NamedSharding(mesh, P("x")),
                                       dtype=jnp.int32))(x[None])
  for leaf in (x, np.arange(8, dtype=np.int8)):  # eagerly: a device array, host data
    with pytest.raises(jax_m2n.ReshardValueError, match="hold shape"):
      jax_m2n.reshard(leaf, NamedSharding(mesh, P("x")), dtype=jnp.int32)
  assert calls == []


# ---------------------------------------------------------------------------------------
# Config, errors
# ---------------------------------------------------------------------------------------

def test_checking_leaks_around_a_jitted_reshard_without_src_sharding():
  """Was "Leaked trace DynamicJaxprTrace" (the partition callback held the tracers)."""
  mesh = Mesh(np.array(D), ("x",))
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
  dst = NamedSharding(mesh, P(None, "x"))
  with jax.checking_leaks():
    f = jax.jit(lambda v: jax_m2n.reshard(v, dst))
    y = f(x)
    assert "jax_m2n_reshard" in f.lower(x).compile().as_text()
  assert y.sharding == dst
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_argument_errors_name_the_argument_and_the_leaf():
  mesh = Mesh(np.array(D[:4]), ("x",))
  w = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x")))
  with pytest.raises(jax_m2n.ReshardTypeError, match=r"src_sharding of x\['w'\]"):
    jax_m2n.reshard({"w": w}, D[5], src_sharding={"w": "nope"})
  with pytest.raises(jax_m2n.ReshardTypeError, match=r"at x\['s'\]") as e:
    jax_m2n.reshard({"s": np.str_("a")}, D[5])
  assert isinstance(e.value, TypeError)
  with pytest.raises(TypeError):  # JAX refuses it too
    jax.device_put(np.str_("a"), D[5])
  assert not w.is_deleted()


def _plan_cases():
  mesh = Mesh(np.array(D[:4]), ("x",))
  explicit = Mesh(np.array(D[:4]), ("x",), axis_types=(AxisType.Explicit,))
  x = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("x")))
  key = jax.device_put(jax.random.key(0), D[0])
  return [
      ("twice", x, NamedSharding(Mesh(np.array([D[0], D[0]]), ("y",)), P()), {},
       jax_m2n.ReshardValueError, "once"),
      ("abstract", x, NamedSharding(mesh.abstract_mesh, P()), {},
       jax_m2n.ReshardValueError, "AbstractMesh"),
      ("unreduced", x, NamedSharding(explicit, P(None, unreduced={"x"})), {},
       jax_m2n.ReshardValueError, "unreduced"),
      ("key", key, D[1], {}, jax_m2n.ReshardTypeError, "extended dtype"),
      ("chunk_bool", x, D[1], {"chunk_bytes": True}, jax_m2n.ReshardTypeError,
       "chunk_bytes"),
      ("none", x, None, {}, jax_m2n.ReshardValueError, "nothing to plan"),
      ("src", x, D[1], {"src_sharding": "nope"}, jax_m2n.ReshardTypeError,
       "src_sharding"),
  ]


@pytest.mark.parametrize("what,x,dst,kw,kind,match", _plan_cases(),
                         ids=[c[0] for c in _plan_cases()])
def test_plan_refuses_what_reshard_refuses(what, x, dst, kw, kind, match):
  with pytest.raises(kind, match=match):
    jax_m2n.plan(x, dst, **kw)
  if what not in ("key", "none", "src"):  # reshard hands keys to JAX, keeps None
    arr = jax.device_put(jnp.ones(x.shape, x.dtype), x.sharding)
    with pytest.raises(kind):
      jax_m2n.reshard(arr, dst, **kw)


@pytest.mark.parametrize("jit", [False, True])
def test_unreduced_shardings_stay_refused(jit):
  mesh = Mesh(np.array(D[:4]), ("x",), axis_types=(AxisType.Explicit,))
  x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("x")))
  dst = NamedSharding(mesh, P(None, None, unreduced={"x"}))
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst)) if jit else (
      lambda v: jax_m2n.reshard(v, dst))
  with jax.set_mesh(mesh), pytest.raises(jax_m2n.ReshardValueError, match="unreduced"):
    f(x)
  assert not x.is_deleted()


def test_jit_destination_on_other_devices_is_a_reshard_value_error():
  """Was JAX's plain ValueError ("Received incompatible devices") for a subset."""
  m8, m4 = Mesh(np.array(D), ("x",)), Mesh(np.array(D[:4]), ("x",))
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(m8, P("x")))
  f = jax.jit(lambda t: jax_m2n.reshard(t, {"w": NamedSharding(m4, P("x"))}))
  with pytest.raises(jax_m2n.ReshardValueError,
                     match=r"x\['w'\] must be on the jit's devices.*\[0, 1, 2, 3\].*8 "
                           r"devices") as e:
    f({"w": x})
  assert isinstance(e.value, ValueError)
  # Known source layout (src_sharding=): any other device set, the same number too.
  other = NamedSharding(Mesh(np.array(D[4:]), ("x",)), P("x"))
  y = jax.device_put(jnp.ones((8, 8)), NamedSharding(m4, P("x")))
  with pytest.raises(jax_m2n.ReshardValueError, match=r"same devices.*\[4, 5, 6, 7\]"):
    jax.jit(lambda v: jax_m2n.reshard(v, other, src_sharding=y.sharding))(y)
