"""How reshard lowers inside jit: one jax_m2n_reshard custom call per device, no XLA
collective, the SPMD schedule encoding, under both partitioners (Shardy and GSPMD) and
with JAX's Auto and Explicit mesh axis types.
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import schedule
from jax_m2n._src import transforms

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce",
               "reduce-scatter")
CUSTOM_CALL = 'custom_call_target="jax_m2n_reshard"'


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
  old = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
  yield request.param
  jax.config.update("jax_use_shardy_partitioner", old)


def devs():
  assert jax.device_count() == 8
  return np.array(jax.devices())


def mesh(shape, names, explicit=False, ids=None):
  d = devs() if ids is None else devs()[ids]
  n = int(np.prod(shape))
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return Mesh(d[:n].reshape(shape), names, axis_types=types)


def data(shape, dtype=np.float32):
  return (np.arange(np.prod(shape)) * 7 % 251).astype(dtype).reshape(shape)


def check_compiled(f, *args, n_calls=1):
  text = f.lower(*args).compile().as_text()
  assert text.count(CUSTOM_CALL) == n_calls, text
  for op in COLLECTIVES:
    assert op not in text, f"{op} in the compiled program:\n{text}"
  return text


def check_values(y, x, dst):
  ref = jax.device_put(x, dst)
  assert y.sharding.is_equivalent_to(dst, y.ndim), (y.sharding, dst)
  ys = {s.device: s for s in y.addressable_shards}
  for r in ref.addressable_shards:
    assert ys[r.device].index == r.index
    np.testing.assert_array_equal(np.asarray(ys[r.device].data), np.asarray(r.data))


# (name, src mesh, src spec, dst mesh, dst spec, shape): colocated layouts.
CASES = [
    ("fsdp_to_tp", ((8,), ("x",)), P("x", None), ((8,), ("x",)), P(None, "x"), (16, 8)),
    ("shard_to_replicated", ((8,), ("x",)), P("x"), ((8,), ("x",)), P(), (8,)),
    ("4_to_2x2", ((4,), ("a",)), P("a", None), ((2, 2), ("dp", "tp")), P(None, "tp"),
     (4, 8)),
    ("2x4_to_4x2", ((2, 4), ("x", "y")), P("y", "x"), ((4, 2), ("p", "q")),
     P(("q", "p"), None), (8, 8)),
    ("2x2x2_multi_axis", ((2, 2, 2), ("a", "b", "c")), P(("c", "a"), "b"),
     ((8,), ("z",)), P(None, "z"), (4, 16)),
    ("rank0", ((4,), ("a",)), P(), ((2, 2), ("b", "c")), P(), ()),
]


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lowers_to_one_custom_call_and_no_collective(case, explicit, partitioner):
  _, (s_shape, s_names), s_spec, (d_shape, d_names), d_spec, shape = case
  src = NamedSharding(mesh(s_shape, s_names, explicit), s_spec)
  same = (s_shape, s_names) == (d_shape, d_names)
  dst = NamedSharding(src.mesh if same else mesh(d_shape, d_names, explicit), d_spec)
  x = jax.device_put(data(shape), src)
  given = None if explicit and same else src
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=given))
  check_compiled(f, x)
  check_values(f(x), x, dst)


def test_custom_call_operands_are_per_device_shards():
  src = NamedSharding(mesh((8,), ("x",)), P("x", None))
  dst = NamedSharding(src.mesh, P(None, "x"))
  x = jax.device_put(data((16, 8)), src)
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src))
  text = check_compiled(f, x)
  line = next(l for l in text.splitlines() if CUSTOM_CALL in l)
  # Operand f32[2,8] (source shard), results f32[16,1] (destination shard) + workspace.
  assert re.search(r"\(f32\[16,1\]\{[0-9,]*\}, u8\[\d+\]\{0\}\) custom-call\(", line), line
  assert "f32[2,8]" in line


def _ffi_params(jaxpr):
  """Every ffi_call equation's params, recursively; a staged jax_m2n_reshard primitive
  is expanded into what its lowering traces (transforms._lowered)."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ffi_call":
      out.append(eqn.params)
    if eqn.primitive.name == "jax_m2n_reshard":
      structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
      inner = jax.make_jaxpr(functools.partial(transforms._lowered, **eqn.params))(*structs)
      out.extend(_ffi_params(inner.jaxpr))
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out.extend(_ffi_params(inner))
  return out


def _attrs(params):
  attrs = {}
  for k, v in params["attributes"]:
    attrs[k] = getattr(v, "val", v)
  return attrs


def test_spmd_encoding_holds_every_op():
  src = NamedSharding(mesh((4,), ("a",)), P("a", None))
  dst = NamedSharding(mesh((2, 2), ("dp", "tp")), P(None, "tp"))
  x = jax.device_put(data((4, 8)), src)
  jaxpr = jax.make_jaxpr(lambda v: jax_m2n.reshard(v, dst, src_sharding=src,
                                                   timeout_s=7))(x)
  (params,) = _ffi_params(jaxpr.jaxpr)
  attrs = _attrs(params)
  assert params["target_name"] == "jax_m2n_reshard"
  assert int(attrs["timeout_ms"]) == 7000
  want = schedule.encode(jax_m2n.plan(x, dst), None)
  np.testing.assert_array_equal(np.asarray(attrs["schedule"]), want)
  decoded = schedule.decode(attrs["schedule"])
  assert decoded["devices"] == [0, 1, 2, 3]


def test_two_calls_in_one_jit_use_distinct_sites(partitioner):
  """Identical schedules at two call sites must not meet each other's peers."""
  src = NamedSharding(mesh((8,), ("x",)), P("x"))
  dst = NamedSharding(src.mesh, P())
  a = jax.device_put(data((16,)), src)
  b = jax.device_put(data((16,)) + 1, src)

  def f(u, v):
    return (jax_m2n.reshard(u, dst, src_sharding=src),
            jax_m2n.reshard(v, dst, src_sharding=src))

  sites = {int(_attrs(p)["site"]) for p in _ffi_params(jax.make_jaxpr(f)(a, b).jaxpr)}
  assert len(sites) == 2
  g = jax.jit(f)
  check_compiled(g, a, b, n_calls=2)
  for _ in range(3):
    ya, yb = g(a, b)
    check_values(ya, a, dst)
    check_values(yb, b, dst)


def test_explicit_types_and_set_mesh():
  m = mesh((2, 4), ("dp", "tp"), explicit=True)
  src = NamedSharding(m, P("tp", None))
  dst = NamedSharding(m, P(None, ("dp", "tp")))
  x = jax.device_put(data((8, 16)), src)
  with jax.set_mesh(m):
    f = jax.jit(lambda v: jax_m2n.reshard(v, dst))  # src from the type
    check_compiled(f, x)
    y = f(x)
  assert jax.typeof(y).sharding.spec == dst.spec
  check_values(y, x, dst)


def test_explicit_output_type_is_the_destination():
  m4 = mesh((4,), ("a",), explicit=True)
  m22 = mesh((2, 2), ("b", "c"), explicit=True)
  src = NamedSharding(m4, P("a"))
  dst = NamedSharding(m22, P(("c", "b")))
  x = jax.device_put(data((8,)), src)

  def f(v):
    y = jax_m2n.reshard(v, dst, src_sharding=src)
    assert jax.typeof(y).sharding.mesh == m22.abstract_mesh
    return y * 2

  g = jax.jit(f)
  check_compiled(g, x)
  np.testing.assert_array_equal(np.asarray(g(x)), data((8,)) * 2)


def test_composes_with_other_ops_and_out_shardings():
  src = NamedSharding(mesh((8,), ("x",)), P("x", None))
  dst = NamedSharding(mesh((2, 4), ("a", "b")), P(None, ("a", "b")))
  x = jax.device_put(data((8, 8)), src)
  f = jax.jit(lambda v: jax_m2n.reshard(v + 1, dst, src_sharding=src) * 3,
              out_shardings=dst)
  check_compiled(f, x)
  y = f(x)
  assert y.sharding == dst
  np.testing.assert_array_equal(np.asarray(y), (data((8, 8)) + 1) * 3)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_context_mesh_of_another_shape(explicit):
  """Under jax.set_mesh(m) a reshard between two other meshes of m's devices."""
  m22 = mesh((2, 2), ("dp", "tp"), explicit)
  m4 = mesh((4,), ("a",), explicit)
  src = NamedSharding(m4, P("a", None))
  dst = NamedSharding(m22, P(None, "tp"))
  x = jax.device_put(data((4, 8)), src)
  with jax.set_mesh(m22):
    f = jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src))
    check_compiled(f, x)
    y = f(x)
  check_values(y, x, dst)


# ---------------------------------------------------------------------------------------
# No src_sharding= on Auto axes: the layout XLA's partitioner gives the operand
# ---------------------------------------------------------------------------------------

def check_like_constraint(f, x, dst):
  """f(x) holds, shard for shard and bit for bit, what with_sharding_constraint gives
  (pinned as the output layout too: GSPMD may otherwise hand back another one)."""
  ref = jax.jit(lambda v: jax.tree.map(
      lambda a, d: jax.lax.with_sharding_constraint(a, d), v, dst), out_shardings=dst)(x)
  y = f(x)
  for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(ref)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    bs = {s.device: s for s in b.addressable_shards}
    for s in a.addressable_shards:
      assert s.index == bs[s.device].index
      np.testing.assert_array_equal(np.atleast_1d(s.data).view(np.uint8),
                                    np.atleast_1d(bs[s.device].data).view(np.uint8))


# (name, mesh, src spec, dst spec, shape, dtype): source and destination on one mesh.
ONE_MESH_CASES = [
    ("fsdp_to_tp", ((8,), ("x",)), P("x", None), P(None, "x"), (16, 8), np.float32),
    ("2x4_swap", ((2, 4), ("a", "b")), P("a", "b"), P("b", "a"), (8, 8), np.int8),
    ("partial_replication", ((2, 2, 2), ("a", "b", "c")), P(None, "b"), P(("c", "a")),
     (8, 4), np.uint16),
    ("to_replicated", ((4, 2), ("p", "q")), P(("q", "p")), P(), (16,), np.complex64),
    ("six_rows", ((2, 4), ("a", "b")), P("a", None), P(None, "b"), (6, 8), np.float32),
]


@pytest.mark.parametrize("case", ONE_MESH_CASES, ids=[c[0] for c in ONE_MESH_CASES])
def test_without_src_sharding_the_partitioners_layout_feeds_the_custom_call(
    case, partitioner):
  _, (shape_m, names), s_spec, d_spec, shape, dtype = case
  m = mesh(shape_m, names)
  dst = NamedSharding(m, d_spec)
  x = jax.device_put(data(shape, dtype), NamedSharding(m, s_spec))
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst))
  check_compiled(f, x)
  check_like_constraint(f, x, dst)
  check_values(f(x), x, dst)


def test_without_src_sharding_an_intermediate_and_a_pytree(partitioner):
  """The operand's layout is whatever propagation gave an intermediate value; several
  leaves share one custom call."""
  m = mesh((2, 4), ("a", "b"))
  xs = {"w": jax.device_put(data((8, 16)), NamedSharding(m, P("b", "a"))),
        "b": jax.device_put(data((16,), np.int32), NamedSharding(m, P(("a", "b"))))}
  dst = {"w": NamedSharding(m, P(None, ("a", "b"))), "b": NamedSharding(m, P())}
  f = jax.jit(lambda t: jax_m2n.reshard(jax.tree.map(lambda v: v * 2, t), dst))
  check_compiled(f, xs)
  y = f(xs)
  for k in xs:
    check_values(y[k], jax.device_put(xs[k] * 2, xs[k].sharding), dst[k])


def test_without_src_sharding_grad_and_vmap_run_the_custom_call():
  m = mesh((2, 4), ("a", "b"))
  src, dst = NamedSharding(m, P("a", "b")), NamedSharding(m, P("b", None))
  x = jax.device_put(data((8, 8)), src)
  loss = lambda mv: lambda v: (jax.numpy.sin(mv(v, dst)) * 3).sum()  # noqa: E731
  g = jax.jit(jax.grad(loss(jax_m2n.reshard)))
  assert CUSTOM_CALL in g.lower(x).compile().as_text()
  np.testing.assert_array_equal(
      np.asarray(g(x)), np.asarray(jax.jit(jax.grad(loss(jax.device_put)))(x)))
  x3 = jax.device_put(data((4, 8, 8)), NamedSharding(m, P(None, "a", "b")))
  v = jax.jit(jax.vmap(lambda a: jax_m2n.reshard(a, dst)))
  check_compiled(v, x3)
  check_values(v(x3), x3, NamedSharding(m, P(None, "b", None)))


def test_without_src_sharding_another_mesh_of_the_same_devices(partitioner):
  """The operand's mesh (the jit's input) and the destination's differ: the partition
  callback reads the operand's layout as an HLO sharding over the jit's devices."""
  x = jax.device_put(data((8, 8)), NamedSharding(mesh((8,), ("x",)), P("x")))
  for dst in [NamedSharding(mesh((2, 4), ("a", "b")), P(None, ("b", "a"))),
              NamedSharding(mesh((2, 4), ("a", "b")), P("a")),
              NamedSharding(mesh((2, 2, 2), ("a", "b", "c")), P("c", ("a", "b")))]:
    f = jax.jit(lambda v: jax_m2n.reshard(v, dst))
    check_compiled(f, x)
    check_like_constraint(f, x, dst)
    check_values(f(x), x, dst)
    assert f(x).sharding == dst


def test_without_src_sharding_a_scalar_falls_back_to_xla(partitioner, caplog):
  """A rank-0 leaf (nothing to partition) goes through a sharding constraint, logged;
  the other leaf of the call still runs jax_m2n's custom call."""
  m = mesh((2, 4), ("a", "b"))
  xs = (jax.device_put(data((8, 8)), NamedSharding(m, P("a"))),
        jax.device_put(np.float32(3), NamedSharding(m, P())))
  dst = (NamedSharding(m, P("b")), NamedSharding(m, P()))
  f = jax.jit(lambda t: jax_m2n.reshard(t, dst))
  with caplog.at_level("DEBUG", logger="jax_m2n"):
    check_compiled(f, xs)
  assert "delegated 1 leaves to XLA's partitioner" in caplog.text
  check_like_constraint(f, xs, dst)
  y = f(xs)
  check_values(y[0], xs[0], dst[0])
  assert float(y[1]) == 3 and y[1].sharding.is_equivalent_to(dst[1], 0)


def test_without_src_sharding_two_destination_meshes_and_nested_jit(partitioner):
  """Leaves bound for two meshes of the jit's devices: one custom call per mesh; a
  reshard in a jit nested in another lowers the same way."""
  m8, m24 = mesh((8,), ("x",)), mesh((2, 4), ("a", "b"))
  xs = (jax.device_put(data((8, 8)), NamedSharding(m8, P("x"))),
        jax.device_put(data((16,), np.int8), NamedSharding(m8, P("x"))))
  dst = (NamedSharding(m24, P("b", "a")), NamedSharding(m8, P()))
  inner = jax.jit(lambda t: jax_m2n.reshard(t, dst))
  f = jax.jit(lambda t: inner(t))
  check_compiled(f, xs, n_calls=2)
  check_like_constraint(f, xs, dst)
  y = f(xs)
  for a, x, d in zip(y, xs, dst):
    check_values(a, x, d)


def test_without_src_sharding_a_destination_in_another_device_order_is_refused():
  """JAX refuses the program (a jit's shardings share one device order), so no data is
  read in the wrong order."""
  x = jax.device_put(data((8, 8)), NamedSharding(mesh((8,), ("x",)), P("x")))
  dst = NamedSharding(mesh((8,), ("x",), ids=list(range(8))[::-1]), P(None, "x"))
  with pytest.raises(ValueError, match="incompatible devices"):
    jax.jit(lambda v: jax_m2n.reshard(v, dst))(x)
