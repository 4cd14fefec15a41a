"""Quantized reshards: `reshard(x, dst, dtype=jax_m2n.Quantize(...))` against
`qwix.quantize(jax.device_put(x, dst), ...)` (qwix's quantize_api), bit for bit.

Covers random layouts x qtypes x tilings on every route, eagerly and inside jit (with
and without src_sharding), values with zeros, subnormals, infinities, NaN and all-zero
tiles; the scale layout (each destination device holds the scales of its own shard);
pytree prefixes mixing quantized, cast and kept leaves in one plan; the wire bytes the
plan counts; the node used without qwix; bad specs, refused naming the leaf before any
data moves; and examples/rl_refit.py --quantize.

NaN: qwix takes jnp.max(|x|) per tile, which by numpy's and StableHLO's rule is NaN for
a tile holding a NaN; XLA:CPU's multi-axis max reductions drop NaN (and with it the
partial maximum it met: the result depends on the layout), so the oracle is qwix's
result with that rule applied to the tiles that hold a NaN (`oracle` below).
"""

import math

import hypothesis
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
from jax_m2n._src import quantize as quantize_lib
from jax_m2n._src.planner import ROUTES

qwix = pytest.importorskip("qwix")

D = np.array(jax.devices()[:8])
SETTINGS = hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                               suppress_health_check=list(hypothesis.HealthCheck))
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SOURCE_DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)]


def ns(ids, shape, names, *spec):
  return NamedSharding(Mesh(D[list(ids)].reshape(shape), names), P(*spec))


def host_values(shape, dtype, seed, specials=True):
  """Normal values over many binades, with zeros, subnormals, +-inf, NaN and all-zero
  tiles where `specials`."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 12, shape)).astype(np.float32)
  if specials and x.size >= 8:
    flat = x.reshape(-1)
    k = max(1, flat.size // 64)
    idx = rng.choice(flat.size, size=5 * k, replace=False)
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    flat[idx[:k]] = 0.0
    flat[idx[k:2 * k]] = -0.0
    flat[idx[2 * k:3 * k]] = tiny * rng.integers(1, 4, k)
    if rng.integers(0, 2):
      flat[idx[3 * k]] = np.inf * (1 if rng.integers(0, 2) else -1)
    if rng.integers(0, 2):
      flat[idx[4 * k]] = np.nan
    if x.ndim and x.shape[0] >= 2:
      x[: x.shape[0] // 2] = 0.0  # all-zero tiles: qwix's scale-of-1 rule
  return x.astype(dtype)


def scale_geometry(shape, tiled, channelwise):
  """Elements per scale along each axis (qwix's rule), negative axes resolved."""
  rank = len(shape)
  tiled = {a % rank: t for a, t in tiled.items()}
  channelwise = {a % rank for a in channelwise}
  tiled = {a: round(shape[a] * t) if isinstance(t, float) else t for a, t in tiled.items()}
  return tuple(1 if i in channelwise else tiled.get(i, d) for i, d in enumerate(shape))


def oracle(x, dst, qtype, tiled, channelwise, scale_dtype):
  """qwix on the unsharded array (one device of dst's platform); tiles holding a NaN
  get NaN scale and values (jnp.max's rule, which XLA:CPU's multi-axis reduction
  breaks). On layouts where a device holds one scale of several, qwix's own result
  differs from this (test_qwix_itself_depends_on_the_layout)."""
  rank = np.ndim(x)
  one = next(iter(dst.device_set))
  ref = qwix.quantize(jax.device_put(np.asarray(x), one), qtype,
                      tiled_axes={a % rank: t for a, t in tiled.items()},
                      channelwise_axes=[a % rank for a in channelwise],
                      scale_dtype=scale_dtype)
  tiles = scale_geometry(np.shape(x), tiled, channelwise)
  host = np.asarray(x).astype(np.float32)
  split = []
  for d, t in zip(host.shape, tiles):
    split += [d // t, t]
  nan = np.isnan(host.reshape(split)).any(axis=tuple(range(1, 2 * rank, 2)))
  scale = np.where(nan, np.nan, np.asarray(ref.scale).astype(np.float32))
  values = np.asarray(ref.qvalue).astype(np.float32)
  wide = nan
  for axis, t in enumerate(tiles):
    wide = np.repeat(wide, t, axis=axis)
  values = np.where(wide, np.nan, values)
  return ref, values, scale


def same_bits(got, want_f32, got_dtype, what):
  """got equals want bit for bit where want is a number; NaN where want is NaN (the
  sign of a NaN made by inf / inf differs between XLA's eager and fused code too)."""
  got = np.asarray(got)
  assert got.dtype == got_dtype, (what, got.dtype, got_dtype)
  want = np.asarray(want_f32).astype(got_dtype)
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
  u = UINT[got.dtype.itemsize]
  bad = np.argwhere((got.view(u) != want.view(u)) & ~nan)
  assert not len(bad), (what, len(bad), tuple(bad[0]), got[tuple(bad[0])],
                        want[tuple(bad[0])])


def assert_scales_cover_own_shard(q):
  """Each device holding a value shard holds the scales of every tile it touches."""
  scales = {s.device: s.index for s in q.scale.addressable_shards}
  tiles = [a // b for a, b in zip(q.qvalue.shape, q.scale.shape)]
  for s in q.qvalue.addressable_shards:
    assert s.device in scales, s.device
    for sl, ssl, t, n, m in zip(s.index, scales[s.device], tiles, q.qvalue.shape,
                                q.scale.shape):
      lo, hi, _ = sl.indices(n)
      slo, shi, _ = ssl.indices(m)
      assert slo <= lo // t and -(-hi // t) <= shi, (s.device, s.index, scales[s.device])


def assert_matches(q, x, dst, qtype, tiled=None, channelwise=(), scale_dtype=None):
  tiled = dict(tiled or {})
  ref, values, scale = oracle(x, dst, qtype, tiled, channelwise, scale_dtype)
  assert isinstance(q, qwix.QArray), type(q)
  assert jax.tree.structure(q) == jax.tree.structure(ref)
  ref = qwix.quantize(jax.device_put(x, dst), qtype, tiled_axes={
      a % q.ndim: t for a, t in tiled.items()} if q.ndim else {}, channelwise_axes=[
          a % q.ndim for a in channelwise], scale_dtype=scale_dtype)  # on dst: fields
  assert q.qtype == ref.qtype and q.zero_point is None
  assert q.qvalue.shape == ref.qvalue.shape and q.scale.shape == ref.scale.shape
  assert q.qvalue.sharding.is_equivalent_to(dst, q.qvalue.ndim), q.qvalue.sharding
  same_bits(q.qvalue, values, ref.qvalue.dtype, "qvalue")
  same_bits(q.scale, scale, ref.scale.dtype, "scale")
  assert_scales_cover_own_shard(q)


# ---------------------------------------------------------------------------------------
# Random layouts x qtypes x tilings
# ---------------------------------------------------------------------------------------

MESHES = [((1,), ("x",)), ((2,), ("x",)), ((4,), ("x",)), ((2, 2), ("x", "y")),
          ((4, 2), ("x", "y")), ((2, 4), ("x", "y"))]
SPECS_2D = [(), (None, None), ("x",), (None, "x"), ("x", "y"), ("y", "x"), (("x", "y"),),
            (None, ("y", "x")), ("y",)]


@st.composite
def layouts(draw, n_max=8, first=(0, 2, 4)):
  shape, names = draw(st.sampled_from([m for m in MESHES if math.prod(m[0]) <= n_max]))
  n = math.prod(shape)
  start = draw(st.sampled_from([f for f in first if f + n <= 8]))
  spec = draw(st.sampled_from([s for s in SPECS_2D
                               if all(a in names for e in s if e
                                      for a in (e if isinstance(e, tuple) else (e,)))]))
  return ns(range(start, start + n), shape, names, *spec)


@st.composite
def quant_specs(draw):
  """(qtype, tiled, channelwise, scale_dtype, shape): a shape the tiles divide and that
  both layouts can hold (dims multiples of 8 * tile)."""
  kind = draw(st.sampled_from(["block", "rows", "channel", "tensor", "mxfp8", "fraction"]))
  qtype = draw(st.sampled_from(["float8_e4m3fn", "float8_e5m2", jnp.float8_e4m3fn]))
  tiled, channelwise = {}, ()
  r, c = 1, draw(st.sampled_from([1, 2]))
  if kind == "block":
    t0, t1 = draw(st.sampled_from([4, 16])), draw(st.sampled_from([8, 32]))
    tiled, shape = {0: t0, 1: t1}, (8 * t0 * r, 8 * t1 * c)
  elif kind == "rows":
    t = draw(st.sampled_from([2, 16]))
    tiled, shape = {-1: t}, (8 * r, 8 * t * c)
  elif kind == "channel":
    channelwise, shape = (draw(st.sampled_from([0, 1, -1])),), (8 * r, 16 * c)
  elif kind == "tensor":
    shape = (8 * r, 8 * c)
  elif kind == "mxfp8":
    qtype = "mxfp8"
    tiled, shape = {1: 32}, (8 * r, 8 * 32 * c)
    if draw(st.booleans()):
      channelwise = (0,)
  else:  # qwix's float tile: 1 / tile count
    tiled, shape = {0: 0.25, 1: 8}, (32 * r, 64 * c)
  scale_dtype = draw(st.sampled_from([None, None, jnp.bfloat16, np.float32]))
  return qtype, tiled, channelwise, scale_dtype, shape


@st.composite
def cases(draw):
  src, dst = draw(layouts()), draw(layouts())
  dtype = draw(st.sampled_from(SOURCE_DTYPES))
  route = draw(st.sampled_from(ROUTES))
  topology = draw(st.sampled_from([None, 2, 4]))
  return src, dst, dtype, route, topology, draw(quant_specs()), draw(st.integers(0, 999))


def _spec(qtype, tiled, channelwise, scale_dtype):
  return jax_m2n.Quantize(qtype, tiled_axes=tiled, channelwise_axes=channelwise,
                          scale_dtype=scale_dtype)


@SETTINGS
@hypothesis.given(case=cases())
def test_random_layouts_match_qwix_eagerly_on_every_route(case):
  src, dst, dtype, route, topology, (qtype, tiled, channelwise, scale_dtype, shape), \
      seed = case
  x = jax.device_put(host_values(shape, dtype, seed), src)
  q = jax_m2n.reshard(x, dst, route=route, topology=topology,
                      dtype=_spec(qtype, tiled, channelwise, scale_dtype))
  assert_matches(q, x, dst, qtype, tiled, channelwise, scale_dtype)


@SETTINGS
@hypothesis.given(case=cases(), given_src=st.booleans())
def test_random_layouts_match_qwix_inside_jit(case, given_src):
  src, dst, dtype, route, topology, (qtype, tiled, channelwise, scale_dtype, shape), \
      seed = case
  dst = NamedSharding(src.mesh, P(*[e if e is None or all(
      a in src.mesh.axis_names for a in (e if isinstance(e, tuple) else (e,))) else None
      for e in dst.spec]))
  x = jax.device_put(host_values(shape, dtype, seed), src)
  spec = _spec(qtype, tiled, channelwise, scale_dtype)
  f = jax.jit(lambda v: jax_m2n.reshard(v, dst, route=route, topology=topology,
                                        dtype=spec,
                                        src_sharding=src if given_src else None))
  assert_matches(f(x), x, dst, qtype, tiled, channelwise, scale_dtype)


@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("qtype,tiled", [("float8_e4m3fn", {0: 128, 1: 128}),
                                         ("float8_e5m2", {1: 128}), ("mxfp8", {1: 32})])
def test_deepseek_blocks_and_mx_tiles_across_shards(dtype, qtype, tiled):
  """128 x 128 tiles cut by the source shards (P over 4 rows of 64) and the destination
  shards (32 columns each): partial maxima combined on the source; every special
  value in the tiles."""
  src = ns(range(4), (4,), ("x",), "x", None)
  dst = ns(range(4, 8), (2, 2), ("x", "y"), None, ("x", "y"))
  host = host_values((256, 256), dtype, 7)
  host[0, 1], host[129, 130], host[3, 200] = np.nan, np.inf, -np.inf
  x = jax.device_put(host, src)
  q = jax_m2n.reshard(x, dst, dtype=jax_m2n.Quantize(qtype, tiled_axes=tiled))
  assert_matches(q, x, dst, qtype, tiled)
  tiles = q.qvalue.shape[1] // q.scale.shape[1]
  if tiles > 64:  # 64-column destination shards cut the tiles: scales replicated on dim 1
    assert q.scale.sharding.spec[1] is None


def test_qwix_itself_depends_on_the_layout():
  """qwix.quantize on a layout where each device holds one of several scales divides
  absmax / qmax exactly there (XLA:CPU keeps a division with nothing to broadcast) and
  by the reciprocal on one device: the two differ; jax_m2n gives the unsharded one on
  every layout."""
  host = (np.random.default_rng(0).standard_normal((64, 128)) * 10).astype(np.float32)
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  sharded = qwix.quantize(jax.device_put(host, dst), "float8_e4m3fn", tiled_axes={1: 32})
  single = qwix.quantize(jax.device_put(host, D[0]), "float8_e4m3fn", tiled_axes={1: 32})
  if jax.default_backend() == "cpu":
    assert not np.array_equal(np.asarray(sharded.scale), np.asarray(single.scale))
  spec = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={1: 32})
  for src in (ns(range(4), (4,), ("x",), "x", None), ns(range(4), (4,), ("x",), None, "x")):
    q = jax_m2n.reshard(jax.device_put(host, src), dst, dtype=spec)
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(single.scale))
    np.testing.assert_array_equal(np.asarray(q.qvalue).view(np.uint8),
                                  np.asarray(single.qvalue).view(np.uint8))


def test_every_e4m3_and_e5m2_value_of_a_scale_one_tile():
  """Every bf16 value, in channelwise rows whose absmax makes the scale exactly 1 or a
  power of two: the cast itself, every boundary and tie, on a layout change."""
  every = np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(256, 256)
  src, dst = ns(range(2), (2,), ("x",), "x", None), ns(range(2, 6), (4,), ("x",), None, "x")
  x = jax.device_put(every, src)
  for qtype in ("float8_e4m3fn", "float8_e5m2", "mxfp8"):
    tiled = {1: 32} if qtype == "mxfp8" else {}
    q = jax_m2n.reshard(x, dst, dtype=jax_m2n.Quantize(qtype, tiled_axes=tiled,
                                                       channelwise_axes=(0,)))
    assert_matches(q, x, dst, qtype, tiled, (0,))


# ---------------------------------------------------------------------------------------
# Pytrees, plans, the node without qwix
# ---------------------------------------------------------------------------------------

def _params():
  src = ns(range(4), (2, 2), ("fsdp", "tp"), "fsdp", "tp")
  norm_src = ns(range(4), (2, 2), ("fsdp", "tp"), "tp")
  return {
      "kernel": jax.device_put(host_values((256, 512), np.float32, 1), src),
      "norm": jax.device_put(host_values((512,), np.float32, 2, False), norm_src),
      "step": jax.device_put(np.int32(3), D[0]),
  }


def test_pytree_prefix_quantizes_kernels_casts_norms_in_one_call():
  params = _params()
  gen = Mesh(D[4:].reshape(2, 2), ("dp", "tp"))
  dst = {"kernel": NamedSharding(gen, P(None, "tp")), "norm": NamedSharding(gen, P()),
         "step": D[5]}
  spec = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={0: 128, 1: 128},
                          scale_dtype=jnp.float32)
  dtypes = {"kernel": spec, "norm": jnp.bfloat16, "step": None}
  out = jax_m2n.reshard(params, dst, dtype=dtypes)
  assert_matches(out["kernel"], params["kernel"], dst["kernel"], "float8_e4m3fn",
                 {0: 128, 1: 128}, (), jnp.float32)
  ref = jax.device_put(params["norm"].astype(jnp.bfloat16), dst["norm"])
  assert out["norm"].dtype == jnp.bfloat16 and out["norm"].sharding == dst["norm"]
  np.testing.assert_array_equal(np.asarray(out["norm"]).view(np.uint16),
                                np.asarray(ref).view(np.uint16))
  assert int(out["step"]) == 3 and out["step"].devices() == {D[5]}
  # The plan counts the FP8 values, the f32 scales and the bf16 norm, one plan.
  p = jax_m2n.plan(params, dst, dtype=dtypes)
  plain = jax_m2n.plan(params, dst)
  kernel_fp8 = jax_m2n.plan(jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn,
                                                 sharding=params["kernel"].sharding),
                            dst["kernel"])
  assert p.bytes_by_link["nvlink"] < plain.bytes_by_link["nvlink"] / 2
  assert p.bytes_by_link["nvlink"] > kernel_fp8.bytes_by_link["nvlink"]
  # The same plan as the expanded call jax_m2n.reshard makes (values, scales, norm, step).
  kernel = out["kernel"]
  expanded = [jax.ShapeDtypeStruct(kernel.qvalue.shape, kernel.qvalue.dtype,
                                   sharding=params["kernel"].sharding),
              jax.ShapeDtypeStruct(kernel.scale.shape, kernel.scale.dtype,
                                   sharding=quantize_lib.scale_sharding(
                                       params["kernel"].sharding,
                                       quantize_lib._resolve_cached(
                                           "plan", spec, (256, 512),
                                           np.dtype(np.float32)))),
              params["norm"], params["step"]]
  want = jax_m2n.plan(expanded, [dst["kernel"], kernel.scale.sharding, dst["norm"],
                                 dst["step"]], dtype=[None, None, jnp.bfloat16, None])
  assert p.bytes_by_link == want.bytes_by_link


def test_plan_bytes_are_a_quarter_of_f32_plus_scales():
  src = ns(range(4), (4,), ("x",), "x", None)
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  x = jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=src)
  f32 = jax_m2n.plan(x, dst).bytes_by_link["nvlink"]
  q = jax_m2n.plan(x, dst, dtype=jax_m2n.Quantize("float8_e4m3fn",
                                                  tiled_axes={0: 128, 1: 128}))
  n_scales = 8 * 8
  # Every device's values and scales cross: 3/4 of each shard, scales of 2 tiles each.
  assert q.bytes_by_link["nvlink"] >= f32 // 4
  assert q.bytes_by_link["nvlink"] <= f32 // 4 + n_scales * 4 * 4


@pytest.mark.parametrize("in_jit", [False, True])
def test_without_qwix_a_quantized_array_node_with_the_same_fields(monkeypatch, in_jit):
  monkeypatch.setattr(quantize_lib, "_qarray_type", lambda: None)
  src = ns(range(4), (4,), ("x",), "x", None)
  dst = ns(range(4), (2, 2), ("x", "y"), None, ("x", "y"))
  x = jax.device_put(host_values((128, 256), np.float32, 3, False), src)
  spec = jax_m2n.Quantize("float8_e5m2", tiled_axes={1: 32})
  move = lambda v: jax_m2n.reshard(v, dst, dtype=spec)  # noqa: E731
  q = jax.jit(move)(x) if in_jit else move(x)
  assert isinstance(q, jax_m2n.QuantizedArray)
  ref = qwix.quantize(jax.device_put(x, dst), "float8_e5m2", tiled_axes={1: 32})
  leaves = jax.tree.leaves(q)
  assert len(leaves) == 2 and leaves[0] is q.qvalue and leaves[1] is q.scale
  assert q.qtype == "float8_e5m2" and q.zero_point is None and q.shape == (128, 256)
  assert q.dtype == np.float32 and q.ndim == 2
  same_bits(q.qvalue, np.asarray(ref.qvalue).astype(np.float32), ref.qvalue.dtype, "v")
  same_bits(q.scale, ref.scale, ref.scale.dtype, "scale")
  np.testing.assert_array_equal(np.asarray(q.dequantize()),
                                np.asarray(qwix.dequantize(ref)))
  again = jax.tree.unflatten(jax.tree.structure(q), leaves)
  assert isinstance(again, jax_m2n.QuantizedArray) and again.qtype == q.qtype


def test_host_data_and_donation():
  dst = ns(range(4, 8), (4,), ("x",), None, "x")
  host = host_values((64, 128), np.float32, 4)
  spec = jax_m2n.Quantize("float8_e4m3fn", tiled_axes={1: 32})
  assert_matches(jax_m2n.reshard(host, dst, dtype=spec), host, dst, "float8_e4m3fn",
                 {1: 32})
  x = jax.device_put(host, ns(range(4), (4,), ("x",), "x", None))
  keep = jax.device_put(host, D[0])
  out = jax_m2n.reshard({"a": x, "b": keep}, dst, dtype=spec,
                        donate={"a": True, "b": False})
  assert x.is_deleted() and not keep.is_deleted()
  assert_matches(out["b"], keep, dst, "float8_e4m3fn", {1: 32})


def test_destination_none_quantizes_in_place_and_rank_zero():
  src = ns(range(4), (2, 2), ("x", "y"), "x", "y")
  x = jax.device_put(host_values((64, 64), jnp.bfloat16, 5), src)
  q = jax_m2n.reshard(x, None, dtype=jax_m2n.Quantize("float8_e4m3fn",
                                                      tiled_axes={0: 16, 1: 16}))
  assert_matches(q, x, src, "float8_e4m3fn", {0: 16, 1: 16})
  s = jax.device_put(np.float32(-3.5), D[1])
  q = jax_m2n.reshard(s, D[2], dtype=jax_m2n.Quantize("float8_e5m2"))
  assert_matches(q, s, jax.sharding.SingleDeviceSharding(D[2]), "float8_e5m2")


def test_spec_is_hashable_immutable_and_reads_like_qwix():
  a = jax_m2n.Quantize("mxfp8", tiled_axes={1: 32}, scale_dtype="bfloat16")
  b = jax_m2n.Quantize("mxfp8", tiled_axes={1: 32}, scale_dtype=jnp.bfloat16)
  assert a == b and hash(a) == hash(b) and a != jax_m2n.Quantize("mxfp8",
                                                                 tiled_axes={0: 32})
  assert dict(a.tiled_axes) == {1: 32} and a.channelwise_axes == ()
  with pytest.raises(AttributeError):
    a.qtype = "float8_e5m2"
  with pytest.raises(TypeError):
    a.tiled_axes[0] = 32
  assert "Quantize('mxfp8'" in repr(a)


# ---------------------------------------------------------------------------------------
# Bad input: refused naming the leaf, before any data moves
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("leaf,spec,error,match", [
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("float8_e4m3fn", tiled_axes={1: 64}),
     jax_m2n.ReshardValueError, r"tile size of axis 1 of x\['w'\] must divide its size 96"),
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("int8"),
     jax_m2n.ReshardValueError, r"qtype of the Quantize spec for x\['w'\] must be one of"),
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("nf4", tiled_axes={1: 32}),
     jax_m2n.ReshardValueError, r"for x\['w'\] must be one of"),
    (np.ones((64, 96), np.int32), jax_m2n.Quantize("float8_e4m3fn"),
     jax_m2n.ReshardTypeError, r"x\['w'\] quantized with dtype=Quantize\(...\) must be"),
    (np.ones((64, 96), ml_dtypes.float8_e5m2), jax_m2n.Quantize("float8_e4m3fn"),
     jax_m2n.ReshardTypeError, r"x\['w'\] quantized .* got float8_e5m2"),
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("mxfp8", tiled_axes={1: 16}),
     jax_m2n.ReshardValueError, r"mxfp8 tiles of x\['w'\] must have 32 elements"),
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("mxfp8"),
     jax_m2n.ReshardValueError, r"mxfp8 Quantize spec for x\['w'\] must tile"),
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("float8_e5m2", tiled_axes={2: 8}),
     jax_m2n.ReshardValueError, r"tiled_axes of the Quantize spec for x\['w'\] must be "
     r"axes of its shape \(64, 96\); got axis 2"),
    (np.ones((64, 96), np.float32), jax_m2n.Quantize("float8_e5m2", tiled_axes={1: 8},
                                                     channelwise_axes=(-1,)),
     jax_m2n.ReshardValueError, r"x\['w'\] must be tiled or channelwise, not both"),
    (np.ones((0, 96), np.float32), jax_m2n.Quantize("float8_e5m2"),
     jax_m2n.ReshardValueError, r"x\['w'\] quantized .* must not be empty"),
])
def test_bad_specs_name_the_leaf_before_any_data_moves(leaf, spec, error, match):
  src = ns(range(2), (2,), ("x",), "x", None)
  keep = jax.device_put(np.ones((4, 4), np.float32), src)
  x = {"keep": keep, "w": jax.device_put(leaf, src) if leaf.size else leaf}
  dst = ns(range(4, 6), (2,), ("x",), None, "x")
  for call in (lambda: jax_m2n.reshard(x, dst, dtype={"keep": None, "w": spec},
                                       donate=True),
               lambda: jax_m2n.plan(x, dst, dtype={"keep": None, "w": spec},
                                    src_sharding=src)):
    with pytest.raises(error, match=match):
      call()
    assert not keep.is_deleted()  # nothing moved, nothing donated


@pytest.mark.parametrize("kwargs,match", [
    ({"tiled_axes": [(0, 128)]}, "tiled_axes must be a mapping"),
    ({"tiled_axes": {"0": 128}}, "must map int axes"),
    ({"tiled_axes": {0: "128"}}, "must map int axes"),
    ({"channelwise_axes": 0}, "channelwise_axes must be a sequence of int axes"),
    ({"scale_dtype": np.int8}, "scale_dtype must be a floating dtype"),
])
def test_malformed_specs_are_type_errors(kwargs, match):
  with pytest.raises(jax_m2n.ReshardTypeError, match=match):
    jax_m2n.Quantize("float8_e4m3fn", **kwargs)


@pytest.mark.parametrize("quantize", ["fp8"])  # mxfp8: the same path, another spec
def test_rl_example_refits_qarrays_equal_to_qwix(quantize):
  """examples/rl_refit.py --quantize: two RL steps on FP8 kernels, each refit checked
  against the trainer's in-place quantization, the last against qwix.quantize of
  jax.device_put; a quarter of the float32 kernel bytes (plus scales) on the wire."""
  from examples import rl_refit  # noqa: PLC0415
  cfg = rl_refit.RefitConfig(layers=1, d_model=32, heads=2, digits=3, batch_size=32,
                             group_size=4, steps=2, timing_reps=0, progress=False,
                             quantize=quantize)
  result = rl_refit.run(cfg, list(D))
  assert all(result.checksums_equal) and result.baseline_equal is True
  kernels = [w for layer in result.generator_params["layers"]
             for n, w in layer.items() if n in rl_refit.KERNELS]
  assert kernels and all(isinstance(w, qwix.QArray) for w in kernels)
  assert all(w.qvalue.dtype == jnp.float8_e4m3fn for w in kernels)
  assert result.wire_bytes["reshard_quantized"] < result.wire_bytes[
      "device_put_float32"] / 2


def test_module_doctests():
  import doctest  # noqa: PLC0415
  result = doctest.testmod(quantize_lib, extraglobs={"jax_m2n": jax_m2n},
                           optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0, result
