"""Layouts: the compact descriptor agrees exactly with JAX's own devices_indices_map."""

import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis
import jax
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_m2n._src.errors import ReshardValueError
from jax_m2n._src.layout import Layout, parse_layout, parse_mesh_spec


def _jax_layout(spec, shape):
  devices = np.array(jax.devices()[spec.first:spec.first + spec.size])
  mesh = Mesh(devices.reshape([s for _, s in spec.axes]), tuple(n for n, _ in spec.axes))
  return Layout.from_sharding(NamedSharding(mesh, spec.jax_spec()), shape)


@st.composite
def descriptors(draw):
  n_axes = draw(st.integers(1, 4))
  sizes = []
  for _ in range(n_axes):
    sizes.append(draw(st.sampled_from([1, 2, 2, 4])))
  while math.prod(sizes) > 8:
    sizes[sizes.index(max(sizes))] //= 2
  names = [f"ax{i}" for i in range(n_axes)]
  ndim = draw(st.integers(0, 5))
  spec = [[] for _ in range(ndim)]
  for name in draw(st.permutations(names)):
    slot = draw(st.integers(-1, ndim - 1)) if ndim else -1
    if slot >= 0:
      spec[slot].append(name)
  first = draw(st.integers(0, 8 - math.prod(sizes)))
  shape = tuple(math.prod(sizes[names.index(a)] for a in e) * draw(st.integers(1, 3))
                for e in spec)
  text = "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)) + ") P(" + ", ".join(
      "None" if not e else (e[0] if len(e) == 1 else "(" + ", ".join(e) + ")")
      for e in spec) + f") @{first}"
  return text, shape


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(descriptors())
def test_descriptor_matches_jax(case):
  text, shape = case
  spec = parse_mesh_spec(text)
  assert spec.layout(shape) == _jax_layout(spec, shape)


def test_eight_dims_and_scalars():
  spec = parse_mesh_spec("mesh(a=2, b=2, c=2) P(a, None, b, None, None, c, None, None) @0")
  shape = (2, 1, 4, 1, 1, 2, 3, 1)
  assert spec.layout(shape) == _jax_layout(spec, shape)
  scalar = parse_mesh_spec("mesh(a=4) P() @4")
  assert scalar.layout(()).boxes == ((),) * 4
  assert scalar.layout(()) == _jax_layout(scalar, ())


def test_other_sharding_types():
  devs = jax.devices()
  single = Layout.from_sharding(jax.sharding.SingleDeviceSharding(devs[3]), (4, 6))
  assert single.devices == (3,) and single.boxes == (((0, 4), (0, 6)),)
  mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b"))
  named = NamedSharding(mesh, P(("b", "a"), None))
  from jax._src.sharding_impls import GSPMDSharding
  gspmd = GSPMDSharding(tuple(mesh.devices.flat), named._to_xla_hlo_sharding(2))
  assert Layout.from_sharding(gspmd, (8, 2)) == Layout.from_sharding(named, (8, 2))
  # Multiple mesh axes on one dim, first axis major, as JAX.
  lay = Layout.from_sharding(named, (8, 2))
  assert lay.box_of(devs[1].id) == ((4, 6), (0, 2))


def test_parse_forms():
  a = parse_mesh_spec("mesh('dp'=2, \"tp\"=2) P(('tp', dp), None)")
  assert a.axes == (("dp", 2), ("tp", 2)) and a.spec == (("tp", "dp"), ()) and a.first == 0
  assert str(parse_mesh_spec(" mesh( x = 4 ) P( x ) @ 3 ")) == "mesh(x=4) P(x) @3"


@pytest.mark.parametrize("text, shape, match", [
    ("mesh(x=4) P(y)", (4,), "unknown axis 'y'"),
    ("mesh(x=4) P(x, x)", (4, 4), "used twice"),
    ("mesh(x=4) P((x, x))", (16,), "used twice"),
    ("mesh(x=4) P(x, None)", (4,), "one entry per tensor dim"),
    ("mesh(x=4) P(x)", (6,), "divide evenly"),
    ("mesh(x=0) P(x)", (4,), "positive"),
    ("mesh(x=2, x=2) P(x)", (4,), "unique"),
    ("mesh(x=2) P(x) @-1", (4,), ">= 0"),
    ("mesh x=2 P(x)", (4,), "must look like"),
    ("mesh(x=2) P(x", (4,), "must look like"),
])
def test_bad_descriptors(text, shape, match):
  with pytest.raises(ReshardValueError, match=match):
    parse_layout(text, shape)


def test_from_sharding_once_per_sharding_and_shape():
  """Equal shardings of one shape share one Layout (a model's repeated leaves, a
  repeated call); another shape gets its own; the boxes are JAX's."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  a = Layout.from_sharding(NamedSharding(mesh, P("a", "b")), (4, 8))
  b = Layout.from_sharding(NamedSharding(mesh, P("a", "b")), [4, 8])
  assert a is b
  c = Layout.from_sharding(NamedSharding(mesh, P("a", "b")), (8, 8))
  assert c is not a and c.shape == (8, 8)
  assert a == parse_layout("mesh(a=2, b=2) P(a, b) @0", (4, 8))
  with pytest.raises(Exception, match="must be a jax.sharding.Sharding"):
    Layout.from_sharding(object(), (4,))


def test_repeated_call_plans_once_and_keeps_its_own_shardings():
  """call_plan.plan_call of an equal call is a lookup: the same Plan; a call with equal
  (not identical) shardings gets them back as its own; another dst plans anew."""
  from jax_m2n._src import call_plan
  from jax_m2n._src.request import Options
  devs = np.array(jax.devices()[:8])
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P())
  first = call_plan.plan_call([(8,)] * 3, [np.float32] * 3, [src] * 3, [dst] * 3,
                              Options(), path="test")
  again = call_plan.plan_call([(8,)] * 3, [np.float32] * 3, [src] * 3, [dst] * 3,
                              Options(), path="test")
  assert again is first
  dst2 = NamedSharding(Mesh(devs[4:], ("x",)), P())  # equal, another object
  equal = call_plan.plan_call([(8,)] * 3, [np.float32] * 3, [src] * 3, [dst2] * 3,
                              Options(), path="test")
  assert equal.plan is first.plan and all(d is dst2 for d in equal.dsts)
  other = call_plan.plan_call([(8,)] * 3, [np.float32] * 3, [src] * 3,
                              [NamedSharding(Mesh(devs[4:], ("x",)), P("x"))] * 3,
                              Options(), path="test")
  assert other.plan is not first.plan


def test_plan_errors_name_the_leaf_after_cached_successes():
  """plan()'s checks keep only successes: a leaf refused after an equal tree planned
  is refused with its own name, and names are formed only for the message."""
  import jax_m2n
  devs = np.array(jax.devices()[:8])
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P())
  tree = {f"w{i}": jax.ShapeDtypeStruct((8,), np.float32, sharding=src) for i in range(50)}
  assert jax_m2n.plan(tree, dst).payload_bytes == 50 * 32
  assert jax_m2n.plan(tree, dst).payload_bytes == 50 * 32
  bad = dict(tree, w7=jax.ShapeDtypeStruct((6,), np.float32, sharding=src))
  with pytest.raises(ReshardValueError, match=r"x\['w7'\]"):
    jax_m2n.plan(bad, dst)
  with pytest.raises(ReshardValueError, match=r"x\['w3'\].*None"):
    jax_m2n.plan(tree, dict({k: dst for k in tree}, w3=None))
