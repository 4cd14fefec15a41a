"""In-flight dtype conversion: `reshard(x, dst, dtype=d)` against
`jax.device_put(x.astype(d), dst)`, bit for bit.

Covers the scalar conversions through the real transport (every 16- and 8-bit source
value of each fused pair, and f32 rounding boundaries, ties, NaN payloads, subnormals
and overflow), random layouts on every route, eager and both in-jit paths, pytree
prefixes, unfused pairs, gradients, vmap, bad `dtype` arguments, the wire bytes the plan,
the schedule and the emulated NIC count, and the schedule decoder's type-code checks.
"""

import itertools
import time
import warnings

import hypothesis
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n import _ffi
from jax_m2n._src import schedule as schedule_lib
from jax_m2n._src.planner import ROUTES

D = np.array(jax.devices()[:8])
SETTINGS = hypothesis.settings(max_examples=25, deadline=None, derandomize=True,
                               suppress_health_check=list(hypothesis.HealthCheck))

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FUSED = [F32, F16, BF16, E4M3, E5M2]
PAIRS = [(a, b) for a in FUSED for b in FUSED if a != b]
HLO_NAMES = {F32: "f32", F16: "f16", BF16: "bf16", E4M3: "f8e4m3fn", E5M2: "f8e5m2"}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def ns(ids, shape, names, *spec):
  return NamedSharding(Mesh(D[list(ids)].reshape(shape), names), P(*spec))


def bits(a):
  a = np.atleast_1d(np.asarray(a))
  return a.view(UINT[a.dtype.itemsize]) if a.dtype.itemsize in UINT else a


def assert_same(y, ref):
  """Values (bits), dtype, weak_type and layout of y equal ref (device_put's)."""
  assert y.dtype == ref.dtype and y.shape == ref.shape
  assert getattr(y, "weak_type", False) == getattr(ref, "weak_type", False)
  assert y.sharding.is_equivalent_to(ref.sharding, y.ndim), (y.sharding, ref.sharding)
  rs = {s.device: s for s in ref.addressable_shards}
  for s in y.addressable_shards:
    assert s.index == rs[s.device].index
    np.testing.assert_array_equal(bits(s.data), bits(rs[s.device].data),
                                  err_msg=str(s.device))


def every_value(dtype):
  """Every bit pattern of a 1- or 2-byte dtype, as a (rows, 256) array of it."""
  n = 1 << (8 * dtype.itemsize)
  return np.arange(n, dtype=UINT[dtype.itemsize]).view(dtype).reshape(-1, 256)


def f32_boundaries(seed=0):
  """f32 values around every rounding decision of every narrow target: per exponent,
  mantissas whose dropped bits are exactly half (a tie), half +- 1 ulp, with random
  kept bits; NaN payloads, infinities, subnormals, the largest finite values, and random
  bit patterns. Shape (rows, 256)."""
  rng = np.random.default_rng(seed)
  parts = [rng.integers(0, 1 << 32, 1 << 17, dtype=np.uint64).astype(np.uint32)]
  ef = np.arange(256, dtype=np.int64)
  e = np.where(ef > 0, ef - 127, -126)
  for man_bits, bias in ((10, 15), (7, 127), (3, 7), (2, 15)):  # f16 bf16 e4m3 e5m2
    shift = np.clip(23 - man_bits + np.maximum(0, (1 - bias) - e), 1, 25)
    for _ in range(24):
      keep = rng.integers(0, 1 << 23, 256, dtype=np.int64) & ~((1 << shift) - 1)
      tie = (keep | (1 << (shift - 1))) & 0x7FFFFF
      for delta in (-1, 0, 1):
        m = (tie + delta) & 0x7FFFFF
        v = (ef << 23) | m
        parts += [v.astype(np.uint32), (v | (1 << 31)).astype(np.uint32)]
  special = [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x00800000,
             0x7F800001, 0x7FC00000, 0xFFC00001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFF802000,
             0x43E00000, 0x43E80000, 0x43F00000, 0x47800000, 0x477FE000, 0x477FF000]
  parts.append(np.array(special, np.uint32))
  parts.append(rng.integers(0x7F800001, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32))
  v = np.unique(np.concatenate(parts))
  v = np.concatenate([v, np.zeros((-len(v)) % 1024, np.uint32)])
  return v.view(np.float32).reshape(-1, 256)


@pytest.fixture
def fused_only(monkeypatch):
  """Fails a test that would convert with astype instead of in flight."""
  from jax_m2n._src import eager

  def refuse(leaf, dtype):
    raise AssertionError(f"astype fallback used for {leaf.dtype} -> {dtype}")
  monkeypatch.setattr(eager, "astype", refuse)  # the traced path (traced_leaves.py)
  monkeypatch.setattr(eager.delegate, "astype", refuse)  # the eager path


def values_of(dtype):
  return f32_boundaries() if dtype == F32 else every_value(dtype)


# ---------------------------------------------------------------------------------------
# The conversions, exhaustively, through the transport
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS,
                         ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_every_value_converts_like_astype_across_devices(src_dtype, dst_dtype,
                                                         fused_only):
  """Rows on devices 0-3 -> columns on devices 4-7 (strided, cross-device): every
  source value of the pair (f32: the rounding boundaries), bit for bit like astype."""
  host = values_of(src_dtype)
  rows = -(-host.shape[0] // 4) * 4
  host = np.concatenate([host, np.zeros((rows - host.shape[0], 256), src_dtype)])
  x = jax.device_put(host, ns(range(4), (4,), ("x",), "x"))
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  y = jax_m2n.reshard(x, dst, dtype=dst_dtype)
  assert_same(y, jax.device_put(x.astype(dst_dtype), dst))


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS,
                         ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_every_value_converts_in_long_runs(src_dtype, dst_dtype, fused_only):
  """Device 0 -> device 1, 1-D: every source value of the pair in one contiguous run
  (the CPU loops' vector bodies, not only their tails), at two lane offsets (rolled by
  0 and 5, with an odd length), bit for bit like astype."""
  flat = values_of(src_dtype).reshape(-1)
  host = np.concatenate([flat, flat[:13]])
  for shift in (0, 5):
    x = jax.device_put(np.roll(host, shift), D[0])
    dst = jax.sharding.SingleDeviceSharding(D[1])
    y = jax_m2n.reshard(x, dst, dtype=dst_dtype)
    np.testing.assert_array_equal(bits(y), bits(jax.device_put(x.astype(dst_dtype), dst)))
    assert y.dtype == dst_dtype


@pytest.mark.parametrize("dst_dtype", [BF16, E4M3])
def test_local_ops_convert_too(dst_dtype, fused_only):
  """Same devices, new spec: local ops (src_dev == dst_dev) and cross ones."""
  x = jax.device_put(f32_boundaries(1)[:64], ns(range(8), (8,), ("x",), "x"))
  dst = ns(range(8), (2, 4), ("a", "b"), "a", "b")
  assert_same(jax_m2n.reshard(x, dst, dtype=dst_dtype),
              jax.device_put(x.astype(dst_dtype), dst))


# ---------------------------------------------------------------------------------------
# Random layouts, every route, eager and in jit
# ---------------------------------------------------------------------------------------

SPECS_2D = [(), ("x",), (None, "x"), ("x", None), (None, None)]


@st.composite
def cases(draw):
  n_src = draw(st.sampled_from([1, 2, 4]))
  n_dst = draw(st.sampled_from([1, 2, 4]))
  src_first = draw(st.sampled_from([0, 2, 4]))
  dst_first = draw(st.sampled_from([0, 3, 4]))
  src = ns(range(src_first, src_first + n_src), (n_src,), ("x",),
           *draw(st.sampled_from(SPECS_2D)))
  dst = ns(range(dst_first, dst_first + n_dst), (n_dst,), ("x",),
           *draw(st.sampled_from(SPECS_2D)))
  pair = draw(st.sampled_from(PAIRS))
  route = draw(st.sampled_from(ROUTES))
  topology = draw(st.sampled_from([None, 2, 4]))
  chunk = draw(st.sampled_from([None, 64, 4096]))
  shape = (4 * draw(st.integers(1, 3)), 4 * draw(st.integers(1, 5)))
  return src, dst, pair, route, topology, chunk, shape, draw(st.integers(0, 99))


def _host(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  with np.errstate(over="ignore"):  # inf in the narrow types: good test values too
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, shape)).astype(dtype)


@SETTINGS
@hypothesis.given(case=cases())
def test_random_layouts_every_route_eager(case, fused_only):
  src, dst, (a, b), route, topology, chunk, shape, seed = case
  x = jax.device_put(_host(shape, a, seed), src)
  y = jax_m2n.reshard(x, dst, dtype=b, route=route, topology=topology, chunk_bytes=chunk)
  assert_same(y, jax.device_put(x.astype(b), dst))


@SETTINGS
@hypothesis.given(case=cases())
def test_random_layouts_every_route_in_jit(case, fused_only):
  """Both in-jit paths: src_sharding= (shard_map) and custom_partitioning (no source
  layout known at trace time), on the jit's devices."""
  src, dst, (a, b), route, topology, chunk, shape, seed = case
  src = ns(range(8), (8,), ("x",), *src.spec) if src.mesh.size != 8 else src
  dst = NamedSharding(src.mesh, dst.spec)
  x = jax.device_put(_host((8, 8), a, seed), src)
  ref = jax.device_put(x.astype(b), dst)
  kw = dict(dtype=b, route=route, topology=topology, chunk_bytes=chunk)
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, src_sharding=src, **kw))
  g = jax.jit(lambda v: jax_m2n.reshard(v, dst, **kw))
  for fn in (f, g):
    text = fn.lower(x).compile().as_text()
    # The call itself takes the source dtype and returns the destination dtype.
    (call,) = [l for l in text.splitlines() if 'custom_call_target="jax_m2n_reshard"' in l]
    assert " convert(" not in text, text
    assert f"{HLO_NAMES[b]}[" in call.split("custom-call(")[0], call
    assert f"{HLO_NAMES[a]}[" in call.split("custom-call(")[1], call
    assert_same(fn(x), ref)


@pytest.mark.parametrize("given_src", [False, True])
def test_mixed_pytree_in_jit(given_src, fused_only):
  """Converting, keeping and rank-0 leaves in one jitted call (rank 0 goes to XLA's
  partitioner: convert, then a sharding constraint)."""
  m = Mesh(D, ("x",))
  src = NamedSharding(m, P("x"))
  tree = {"a": jax.device_put(_host((8, 8), F32, 1), src),
          "b": jax.device_put(np.arange(64, dtype=np.int32).reshape(8, 8), src),
          "c": jax.device_put(_host((8, 4), F16, 2), src),
          "s": jax.device_put(np.float32(3.25), NamedSharding(m, P()))}
  dtypes = {"a": jnp.bfloat16, "b": None, "c": np.float32, "s": E4M3}
  dst = {"a": NamedSharding(m, P(None, "x")), "b": NamedSharding(m, P(None, "x")),
         "c": NamedSharding(m, P()), "s": NamedSharding(m, P())}
  kw = {"src_sharding": {k: v.sharding for k, v in tree.items()}} if given_src else {}
  out = jax.jit(lambda t: jax_m2n.reshard(t, dst, dtype=dtypes, **kw))(tree)
  for k in tree:
    want = tree[k] if dtypes[k] is None else tree[k].astype(dtypes[k])
    assert_same(out[k], jax.device_put(want, dst[k]))


def test_explicit_axes_in_jit():
  m = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                    devices=D)
  x = jax.device_put(_host((8, 16), F32, 3), NamedSharding(m, P("x")))
  dst = NamedSharding(m, P(None, "x"))
  y = jax.jit(lambda v: jax_m2n.reshard(v, dst, dtype=jnp.bfloat16))(x)
  assert_same(y, jax.device_put(x.astype(jnp.bfloat16), dst))


# ---------------------------------------------------------------------------------------
# Pytrees, prefixes, unfused pairs, delegated leaves
# ---------------------------------------------------------------------------------------

def test_pytree_prefix_of_dtypes_and_destinations():
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (2, 2), ("a", "b"), "b")
  params = {"w": jax.device_put(_host((8, 4), F32, 1), src),
            "b": jax.device_put(_host((8,), F32, 2), src),
            "head": {"k": jax.device_put(_host((8, 2), BF16, 3), src),
                     "n": jax.device_put(np.arange(8, dtype=np.int32), src)},
            "host": np.linspace(-1, 1, 8, dtype=np.float32),
            "scalar": 2.5}
  dtypes = {"w": jnp.bfloat16, "b": None, "head": "float32", "host": E5M2,
            "scalar": jnp.float16}
  dst = {"w": dst, "b": dst, "head": dst, "host": dst, "scalar": D[5]}
  out = jax_m2n.reshard(params, dst, dtype=dtypes)
  ref = jax.device_put(
      {"w": params["w"].astype(jnp.bfloat16), "b": params["b"],
       "head": {"k": params["head"]["k"].astype(np.float32),
                "n": params["head"]["n"].astype(np.float32)},
       "host": params["host"].astype(E5M2),
       "scalar": np.asarray(2.5).astype(np.float16)}, dst)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert_same(a, b)


def test_one_dtype_for_every_leaf_and_shape_dtype_struct_destinations():
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  xs = [jax.device_put(_host((4, 8), F32, i), src) for i in range(3)]
  sds = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16, sharding=dst)
  ys = jax_m2n.reshard(xs, [sds, dst, dst], dtype=jnp.bfloat16)
  for x, y in zip(xs, ys):
    assert_same(y, jax.device_put(x.astype(jnp.bfloat16), dst))
  with pytest.raises(jax_m2n.ReshardValueError, match="must keep its shape and dtype"):
    jax_m2n.reshard(xs[0], sds, dtype=jnp.float16)


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (F32, np.int8), (np.int32, F32), (np.int32, BF16), (F32, np.float64),
    (BF16, np.complex64), (F32, np.dtype(ml_dtypes.float8_e4m3fnuz)), (F16, np.bool_),
    (F32, F32)])
def test_unfused_pairs_are_astype_then_reshard(src_dtype, dst_dtype):
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (2, 2), ("a", "b"), None, "b")
  x = jax.device_put(_host((8, 4), src_dtype, 5), src)
  with warnings.catch_warnings():  # float64 without x64: JAX warns, and truncates
    warnings.simplefilter("ignore")
    assert_same(jax_m2n.reshard(x, dst, dtype=dst_dtype),
                jax.device_put(x.astype(dst_dtype), dst))
    in_jit = NamedSharding(src.mesh, P(None, "x"))
    assert_same(jax.jit(lambda v: jax_m2n.reshard(v, in_jit, dtype=dst_dtype))(x),
                jax.device_put(x.astype(dst_dtype), in_jit))


def test_weak_typed_source_loses_weak_type_like_astype():
  x = jax.device_put(jnp.asarray(1.5), D[0])  # weak f32
  assert x.weak_type
  for dt in (jnp.float32, jnp.bfloat16):
    y = jax_m2n.reshard(x, D[3], dtype=dt)
    assert_same(y, jax.device_put(x.astype(dt), D[3]))
    assert not y.weak_type


def test_donated_source_is_deleted_after_a_conversion():
  src = ns(range(4), (4,), ("x",), "x")
  a = jax.device_put(_host((8, 4), F32, 1), src)
  b = jax.device_put(_host((8, 4), np.int32, 2), src)
  want = [jax.device_put(v.astype(jnp.bfloat16), D[5]) for v in (a, b)]
  ys = jax_m2n.reshard([a, b], D[5], dtype=jnp.bfloat16, donate=True)
  assert a.is_deleted() and b.is_deleted()
  for y, r in zip(ys, want):
    assert_same(y, r)


def test_destination_none_keeps_the_layout_and_converts():
  x = jax.device_put(_host((8, 4), F32, 1), ns(range(4), (4,), ("x",), "x"))
  y = jax_m2n.reshard(x, None, dtype=jnp.bfloat16)
  assert_same(y, jax.device_put(x.astype(jnp.bfloat16), None))


# ---------------------------------------------------------------------------------------
# Transformations
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_jit", [False, True])
def test_grad_converts_the_cotangent_back_to_the_source_dtype(in_jit):
  src = ns(range(8), (8,), ("x",), "x") if in_jit else ns(range(4), (4,), ("x",), "x")
  dst = (NamedSharding(src.mesh, P(None, "x")) if in_jit
         else ns(range(4, 8), (2, 2), ("a", "b"), "a", "b"))
  x = jax.device_put(_host((8, 8), F32, 7), src)
  w = jax.device_put(_host((8, 8), BF16, 8), dst)

  def loss(move):
    return lambda v: jnp.sum((move(v) * w).astype(jnp.float32) ** 2)

  ref = jax.grad(loss(lambda v: jax.device_put(v.astype(jnp.bfloat16), dst)))(x)
  got = jax.grad(loss(lambda v: jax_m2n.reshard(v, dst, dtype=jnp.bfloat16)))
  g = (jax.jit(got) if in_jit else got)(x)
  assert g.dtype == F32
  if not in_jit:  # in jit XLA places the result (no src_sharding= given)
    assert g.sharding.is_equivalent_to(x.sharding, 2)
  np.testing.assert_array_equal(bits(g), bits(ref))
  y, t = jax.jvp(lambda v: jax_m2n.reshard(v, dst, dtype=jnp.bfloat16), (x,), (x,))
  assert y.dtype == BF16 and t.dtype == BF16
  np.testing.assert_array_equal(bits(t), bits(x.astype(jnp.bfloat16)))
  _, pull = jax.vjp(lambda v: jax_m2n.reshard(v, dst, dtype=jnp.bfloat16), x)
  (ct,) = pull(jnp.ones((8, 8), jnp.bfloat16))
  assert ct.dtype == F32 and ct.sharding.is_equivalent_to(x.sharding, 2)
  np.testing.assert_array_equal(np.asarray(ct), np.ones((8, 8), np.float32))


def test_vmap():
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  x = jax.device_put(_host((3, 8, 8), F32, 9), NamedSharding(src.mesh, P(None, "x")))
  y = jax.vmap(lambda v: jax_m2n.reshard(v, dst, dtype=E4M3))(x)
  assert y.dtype == E4M3
  np.testing.assert_array_equal(bits(y), bits(np.asarray(x).astype(E4M3)))


# ---------------------------------------------------------------------------------------
# Bad dtype arguments
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,error,match", [
    (3, jax_m2n.ReshardTypeError, "dtype must be a dtype .*got int 3"),
    (True, jax_m2n.ReshardTypeError, "got bool True"),
    ("nope", jax_m2n.ReshardTypeError, "got str 'nope'"),
    (object, jax_m2n.ReshardTypeError, "got type"),
    (np.dtype("U3"), jax_m2n.ReshardTypeError, "dtype must be a dtype"),
    ({"a": jnp.bfloat16, "b": 2.0}, jax_m2n.ReshardTypeError, "got float 2.0"),
    ({"a": jnp.bfloat16, "c": None}, jax_m2n.ReshardValueError,
     "dtype must be one dtype or a pytree prefix of x"),
])
def test_bad_dtype_arguments(dtype, error, match):
  x = {"a": jax.device_put(np.ones((4,), np.float32), D[0]),
       "b": jax.device_put(np.ones((4,), np.float32), D[1])}
  with pytest.raises(error, match=match):
    jax_m2n.reshard(x, D[2], dtype=dtype)
  with pytest.raises(TypeError if error is jax_m2n.ReshardTypeError else ValueError):
    jax.jit(lambda v: jax_m2n.reshard(v, D[2], dtype=dtype))(x)


# ---------------------------------------------------------------------------------------
# Wire bytes: plan, schedule, workspace, staging and the emulated NIC
# ---------------------------------------------------------------------------------------

def test_plan_and_schedule_count_wire_bytes():
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (2, 2), ("a", "b"), "b", "a")
  x = jax.ShapeDtypeStruct((64, 64), np.float32, sharding=src)
  full = jax_m2n.plan(x, dst)
  for dt, ratio in ((BF16, 2), (E4M3, 4), ("float16", 2)):
    p = jax_m2n.plan(x, dst, dtype=dt)
    assert p.payload_bytes * ratio == full.payload_bytes
    assert {k: v * ratio for k, v in p.bytes_by_link.items()} == full.bytes_by_link
  xb = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=src)  # widening: bf16 wire
  assert jax_m2n.plan(xb, dst, dtype=np.float32).payload_bytes == (
      jax_m2n.plan(xb, dst).payload_bytes)
  p = jax_m2n.plan(x, dst, dtype=BF16)
  itemsizes, types = schedule_lib.wire_itemsizes([F32], [BF16])
  assert itemsizes == [2] and types == ((1, 3),)
  enc = schedule_lib.decode(schedule_lib.encode(p, types=types))
  assert enc["version"] == schedule_lib.SCHEDULE_VERSION
  assert list(enc["tensors"][0][[0, 10, 11]]) == [2, 1, 3]
  summary = _ffi.decode_schedule(np.ascontiguousarray(schedule_lib.encode(p, types=types)))
  assert summary["version"] == schedule_lib.SCHEDULE_VERSION


def test_gather_bcast_workspace_holds_the_wire_type():
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  x = jax.ShapeDtypeStruct((64, 64), np.float32, sharding=src)
  p32 = jax_m2n.plan(x, dst, route="gather_bcast")
  p8 = jax_m2n.plan(x, dst, route="gather_bcast", dtype=E5M2)
  _, types = schedule_lib.wire_itemsizes([F32], [E5M2])
  ws32 = schedule_lib.workspace_bytes(p32)
  ws8 = schedule_lib.workspace_bytes(p8, types=types)
  assert ws8 * 4 == ws32 and ws8 > 0
  xv = jax.device_put(_host((64, 64), F32, 4), src)
  assert_same(jax_m2n.reshard(xv, dst, route="gather_bcast", dtype=E5M2),
              jax.device_put(xv.astype(E5M2), dst))


def test_staging_packs_where_a_cross_device_op_converts():
  """With staging (the CUDA transport), a narrowing op packs on the sender and a
  widening one unpacks on the receiver, even when its box is contiguous."""
  src = ns(range(4), (4,), ("x",), "x")
  dst = ns(range(4, 8), (4,), ("x",), "x")  # rows -> rows: contiguous boxes
  for a, b, side in ((F32, BF16, 9), (BF16, F32, 10)):
    x = jax.ShapeDtypeStruct((64, 64), a, sharding=src)
    itemsizes, types = schedule_lib.wire_itemsizes([a], [b])
    p = jax_m2n.plan(x, dst, dtype=b)
    plain = schedule_lib.decode(schedule_lib.encode(p, staging=True))["ops"]
    ops = schedule_lib.decode(schedule_lib.encode(p, staging=True, types=types))["ops"]
    cross = ops[:, 3] != ops[:, 6]
    assert (plain[cross, 9:11] == -1).all()
    assert (ops[cross, side] >= 0).all() and (ops[cross, 19 - side] == -1).all()
    _ffi.decode_schedule(
        np.ascontiguousarray(schedule_lib.encode(p, staging=True, types=types)))


def test_emulated_nic_charges_wire_bytes():
  """8 MiB of f32 over a slow emulated NIC: as f8 on the wire it takes about a quarter
  of the time (generous bound: under 0.6x), and no less than the plan's estimate."""
  topo = jax_m2n.Topology(domain_size=2, nic_gbps=0.05, emulate_network=True)
  host = _host((2048, 1024), F32, 0)
  x = jax.device_put(host, ns(range(2), (2,), ("x",), "x"))
  dst = ns(range(2, 4), (2,), ("x",), "x")
  times = {}
  for dt in (None, E4M3):
    jax.block_until_ready(jax_m2n.reshard(x, dst, topology=topo, dtype=dt))
    best = float("inf")
    for _ in range(2):
      t = time.perf_counter()
      y = jax.block_until_ready(jax_m2n.reshard(x, dst, topology=topo, dtype=dt))
      best = min(best, time.perf_counter() - t)
    times[dt] = best * 1e3
    est = jax_m2n.plan(x, dst, topology=topo, dtype=dt).route_estimate_ms()
    assert times[dt] >= 0.9 * est, (dt, times[dt], est)
  assert_same(y, jax.device_put(x.astype(E4M3), dst))
  assert times[E4M3] < 0.6 * times[None], times


# ---------------------------------------------------------------------------------------
# The schedule decoder: type codes
# ---------------------------------------------------------------------------------------

def _encoded(a=F32, b=BF16):
  src = ns(range(4), (4,), ("x",), "x")
  x = jax.ShapeDtypeStruct((8, 8), a, sharding=src)
  p = jax_m2n.plan(x, ns(range(4, 8), (4,), ("x",), None, "x"), dtype=b)
  _, types = schedule_lib.wire_itemsizes([a], [b])
  # Version 3 (the encoding is narrow): the fields below are at their version-3 offsets.
  return np.array(schedule_lib.widen(schedule_lib.encode(p, types=types)))


TENSOR_AT = 8 + 2 * 8  # the first tensor record (8 devices)


@pytest.mark.parametrize("field,value,match", [
    (10, 6, r"tensor 0: src_type must be a type code in \[0, 5\].*got 6"),
    (11, -2, r"tensor 0: dst_type must be a type code in \[0, 5\].*got -2"),
    (11, 1, r"src_type and dst_type must both be 0 .*or two different types; got "
            r"src_type = 1, dst_type = 1"),
    (11, 0, r"got src_type = 1, dst_type = 0"),
    (0, 4, r"tensor 0: elem_bytes must be 2 \(the wire type bf16 of a conversion "
           r"f32 -> bf16\); got 4"),
])
def test_decoder_checks_type_codes(field, value, match):
  a = _encoded()
  _ffi.decode_schedule(a)
  a[TENSOR_AT + field] = value
  with pytest.raises(ValueError, match=match):
    _ffi.decode_schedule(a)


@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_decoder_accepts_every_fused_pair(a, b):
  enc = _encoded(a, b)
  assert enc[TENSOR_AT] == min(a.itemsize, b.itemsize)
  _ffi.decode_schedule(enc)


def test_fused_conversion_table():
  for a, b in itertools.product(FUSED + [np.dtype(np.int8), np.dtype(np.float64)],
                                repeat=2):
    fused = a != b and a in FUSED and b in FUSED
    assert schedule_lib.fused_conversion(a, b) == fused
    assert schedule_lib.type_codes(a, b) == (
        (FUSED.index(a) + 1, FUSED.index(b) + 1) if fused else (0, 0))
    assert schedule_lib.wire_dtype(a, b) == (b if fused and b.itemsize <= a.itemsize
                                             else a)


def test_bench_suite_runs_and_agrees():
  """The `dtype` bench suite in its smallest form: every case and method, outputs
  compared bitwise between methods (no timing asserted)."""
  from jax_m2n.bench import dtype as dtype_suite
  doc = dtype_suite.run(jax, 1 << 20, iters=1, warmup=1, memory=False, print_fn=lambda s: 0)
  assert {(r["case"], r["method"]) for r in doc["rows"]} == set(
      itertools.product(dtype_suite.CASES, dtype_suite.METHODS))
  for r in doc["rows"]:
    if r["method"] != "astype_device_put":
      assert r["wire_bytes"] == (1 << 20) // 2, r
  assert "| single | reshard_dtype |" in dtype_suite.markdown(doc)
  mem = dtype_suite.measure_memory("single", "reshard_dtype", 1 << 20)
  assert mem["extra_bytes"] is not None and mem["extra_bytes"] >= 0
