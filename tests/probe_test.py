"""Randomized and adversarial tests of jax_m2n.reshard against JAX's own semantics.

Combines what other files test one at a time: random meshes (1-3 axes, permuted device
orders, disjoint / overlapping / identical device sets, several mesh axes on one dim),
rank 0-4, odd dtypes, `dtype=` (fused and unfused pairs), `donate=`, pytrees (None
leaves, empty containers, zero-size and host leaves, prefixes), every route, NVLink
domains and chunk sizes; eagerly and inside jit (src_sharding= or not, Auto and
Explicit meshes), under grad / vjp / jvp / vmap. The oracle is always JAX:
`jax.device_put(x.astype(d), dst)`, `with_sharding_constraint`, `jax.sharding.reshard`.
Also the regressions this file found, error cases (a ReshardError before anything
moves, then a valid call works) and the asynchronous CPU mode in a subprocess.
"""

import math
import os
import textwrap

import hypothesis
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_m2n
import launcher
import shards
from plan_strategies import named_shardings, partition_specs, shard_counts

D = jax.devices()
if len(D) < 8:  # conftest.py forces 8 CPU devices unless told otherwise
  pytest.skip(f"needs 8 devices (random meshes over 8); got {len(D)} {D[0].platform} "
              "device(s). Hint: JAX_PLATFORMS=cpu with "
              "XLA_FLAGS=--xla_force_host_platform_device_count=8.",
              allow_module_level=True)
ROUTES = ("hierarchical", "flat", "gather_bcast")
DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.uint16, np.int32, np.complex64,
                                jnp.bfloat16, ml_dtypes.float8_e4m3fn,
                                ml_dtypes.float8_e5m2, np.float32, np.float16)]
SETTINGS = hypothesis.settings(max_examples=30, deadline=None, derandomize=True,
                               database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


# ---------------------------------------------------------------------------------------
# Helpers: data, the comparison, strategies
# ---------------------------------------------------------------------------------------

def data(shape, dtype, seed=0) -> np.ndarray:
  """Distinct, random bit patterns of any dtype (misplaced bytes show)."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(np.bool_)
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
  n = math.prod(shape)
  if dtype.kind == "c":
    return (rng.standard_normal(n) * 100 + 1j * rng.standard_normal(n)).astype(
        dtype).reshape(shape)
  return (rng.standard_normal(n) * 50).astype(dtype).reshape(shape)


def bits(a) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


def assert_same(y, ref, exact=True):
  """y is ref (JAX's result): dtype, weak_type, committedness, sharding, and every
  shard's index and bytes on every device."""
  assert (y.shape, y.dtype) == (ref.shape, ref.dtype), (y.shape, y.dtype, ref.dtype)
  assert y.weak_type == ref.weak_type
  assert y.committed == ref.committed
  if exact:
    assert y.sharding == ref.sharding, (y.sharding, ref.sharding)
  assert y.sharding.is_equivalent_to(ref.sharding, y.ndim), (y.sharding, ref.sharding)
  shards.assert_same_shards(y, ref)


@st.composite
def device_sets(draw):
  """Source and destination device ids: disjoint, overlapping or identical sets of any
  sizes, in random orders."""
  relation = draw(st.sampled_from(("disjoint", "overlapping", "identical")))
  perm = draw(st.permutations(range(8)))
  if relation == "identical":
    src = list(perm[:draw(st.integers(1, 8))])
    return src, list(draw(st.permutations(src)))
  if relation == "disjoint":
    a = draw(st.integers(1, 7))
    return list(perm[:a]), list(perm[a:a + draw(st.integers(1, 8 - a))])
  a, b = draw(st.integers(2, 8)), draw(st.integers(1, 8))
  common = max(draw(st.integers(1, min(a, b))), a + b - 8)
  return list(perm[:a]), list(draw(st.permutations(perm[a - common:a - common + b])))


def shape_for(draw, src, dst, rank, cap=2048):
  """A shape both layouts can hold: per dim a random multiple of both shard counts
  (so source and destination shards differ in size)."""
  lcms = [math.lcm(a, b)
          for a, b in zip(shard_counts(src, rank), shard_counts(dst, rank))]
  shape = tuple(m * draw(st.integers(1, 3)) for m in lcms)
  return shape if math.prod(shape) <= cap else tuple(lcms)


def convert(v, dtype):
  return v if dtype is None else v.astype(dtype)


def out_dtypes(dtype):
  """dtype= choices for a source dtype: keep (twice as likely) or any other; complex to
  real is left out (JAX deprecates that astype: a ValueError in newer releases)."""
  return st.sampled_from([None, None] + [d for d in DTYPES if np.dtype(dtype).kind != "c"
                                         or d.kind == "c"])


def _log_case(what: str, case) -> None:
  """With JAX_M2N_PROBE_LOG=<file> (scripts/probe_repeat.py), one line per case,
  flushed to disk before the case runs: a process abort leaves its case last."""
  path = os.environ.get("JAX_M2N_PROBE_LOG")
  if not path:
    return
  with open(path, "a") as f:
    f.write(f"{what} {case!r}\n")
    f.flush()
    os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------
# Eager: random layouts x dtype= x donate= x route x domains x chunks
# ---------------------------------------------------------------------------------------

def _placed(shape, dtype, src, domain):
  """A case's input on its source layout, its host copy, and the case's topology."""
  x = jax.device_put(data(shape, dtype), src)
  topology = None if domain is None else jax_m2n.Topology(domain_size=domain)
  return x, np.asarray(x), topology


@st.composite
def eager_cases(draw):
  src_ids, dst_ids = draw(device_sets())
  rank = draw(st.integers(0, 4))
  src = draw(named_shardings(src_ids, rank, explicit=draw(st.booleans())))
  dst = draw(named_shardings(dst_ids, rank, explicit=draw(st.booleans())))
  shape = shape_for(draw, src, dst, rank)
  if rank and draw(st.integers(0, 9)) == 0:
    shape = (0,) + shape[1:]
  dtype = draw(st.sampled_from(DTYPES))
  return (shape, dtype, src, dst, draw(out_dtypes(dtype)), draw(st.sampled_from(ROUTES)),
          draw(st.sampled_from([None, 1, 2, 4])),
          draw(st.sampled_from([None, 1, 7, 64, 4096])), draw(st.booleans()))


@hypothesis.settings(SETTINGS, max_examples=100)
@hypothesis.given(eager_cases())
def test_eager_matches_device_put_of_astype(case):
  shape, dtype, src, dst, out_dtype, route, domain, chunk, donate = case
  x, host, topology = _placed(shape, dtype, src, domain)
  ref = jax.device_put(convert(jax.device_put(host, src), out_dtype), dst)
  y = jax_m2n.reshard(x, dst, route=route, topology=topology, chunk_bytes=chunk,
                      dtype=out_dtype, donate=donate)
  assert_same(y, ref)
  assert jax.typeof(y) == jax.typeof(ref)  # Explicit axes: the layout in the type
  assert x.is_deleted() == donate
  if not donate:
    np.testing.assert_array_equal(bits(x), bits(host))


def test_eager_wide_dtypes_under_x64():
  """int64, float64, complex128 (JAX keeps them only with x64 on) through the
  transport and converted, against device_put."""
  enable_x64 = getattr(jax, "enable_x64", None)
  if enable_x64 is None:
    from jax.experimental import enable_x64  # older JAX
  with enable_x64(True):
    src = NamedSharding(Mesh(np.array(D[:4]).reshape(2, 2), ("a", "b")), P("b", "a"))
    dst = NamedSharding(Mesh(np.array(D[2:8]), ("c",)), P(None, "c"))
    for dtype, out in [(np.int64, None), (np.float64, jnp.bfloat16), (np.complex128, None),
                       (np.int64, np.float32), (np.float32, np.float64)]:
      x = jax.device_put(data((4, 6), dtype), src)
      y = jax_m2n.reshard(x, dst, dtype=out)
      assert_same(y, jax.device_put(convert(x, out), dst))


# ---------------------------------------------------------------------------------------
# Inside jit: Auto and Explicit meshes, with and without src_sharding=
# ---------------------------------------------------------------------------------------

@st.composite
def jit_cases(draw):
  """One device order (jit's device assignment), any two meshes over it: meshes that
  refine a common mesh run jax_m2n's shard_map, others (2x3 vs 3x2) go to XLA."""
  ids = list(draw(st.permutations(range(8))))[:draw(st.integers(1, 8))]
  rank = draw(st.integers(0, 4))
  mode = draw(st.sampled_from(("auto", "auto_src", "explicit", "explicit_src")))
  explicit = mode.startswith("explicit")
  src = draw(named_shardings(ids, rank, explicit))
  dst = draw(named_shardings(ids, rank, explicit, names="xyz"))
  if draw(st.booleans()):
    dst = NamedSharding(src.mesh, draw(partition_specs(src.mesh.axis_names, rank)))
  dtype = draw(st.sampled_from(DTYPES))
  return (mode, shape_for(draw, src, dst, rank), dtype, src, dst, draw(out_dtypes(dtype)),
          draw(st.sampled_from(ROUTES)), draw(st.sampled_from([None, 2, 4])),
          draw(st.sampled_from([None, 7, 4096])))


@hypothesis.settings(SETTINGS, max_examples=60)
@hypothesis.given(jit_cases())
def test_jit_matches_jax(case):
  mode, shape, dtype, src, dst, out_dtype, route, domain, chunk = case
  x, host, topology = _placed(shape, dtype, src, domain)
  kw = dict(route=route, topology=topology, chunk_bytes=chunk, dtype=out_dtype)
  if mode.endswith("_src"):
    kw["src_sharding"] = src
  _log_case("jit", case)  # before XLA compiles it: an abort then names its case
  y = jax.jit(lambda v: jax_m2n.reshard(v, dst, **kw))(x)
  ref = jax.jit(lambda v: convert(v, out_dtype), out_shardings=dst)(x)
  assert_same(y, ref, exact=False)
  if mode.startswith("explicit"):
    assert jax.typeof(y).sharding.spec == jax.typeof(ref).sharding.spec
  np.testing.assert_array_equal(bits(x), bits(host))


# ---------------------------------------------------------------------------------------
# Pytrees: None leaves, empty containers, zero-size and host leaves, prefixes
# ---------------------------------------------------------------------------------------

LEAVES = ("array", "array", "array", "zero", "none", "numpy", "scalar", "uncommitted",
          "empty_dict", "empty_tuple")


@st.composite
def trees(draw, depth=0):
  if depth < 2 and draw(st.integers(0, 2)) == 0:
    kids = [draw(trees(depth + 1)) for _ in range(draw(st.integers(0, 3)))]
    kind = draw(st.sampled_from(("dict", "tuple", "list")))
    return ({f"k{i}": k for i, k in enumerate(kids)} if kind == "dict" else
            tuple(kids) if kind == "tuple" else kids)
  return ("LEAF", draw(st.sampled_from(LEAVES)), draw(st.integers(0, 1 << 20)))


def build(t, src, shape, dtype):
  if isinstance(t, dict):
    return {k: build(v, src, shape, dtype) for k, v in t.items()}
  if isinstance(t, list):
    return [build(v, src, shape, dtype) for v in t]
  if not t or t[0] != "LEAF":
    return tuple(build(v, src, shape, dtype) for v in t)
  _, kind, seed = t
  return {"array": lambda: jax.device_put(data(shape, dtype, seed), src),
          "zero": lambda: jax.device_put(np.zeros((0,) + shape[1:], dtype), src),
          "none": lambda: None,
          "numpy": lambda: data(shape, dtype, seed),
          "scalar": lambda: [3, 2.5, True][seed % 3],
          "uncommitted": lambda: jnp.asarray(data(shape, dtype, seed)),
          "empty_dict": dict, "empty_tuple": tuple}[kind]()


def top_prefix(x, make):
  """A prefix of x: one value per top-level child (x itself if it is a leaf)."""
  if isinstance(x, dict):
    return {k: make() for k in x}
  if isinstance(x, (tuple, list)):
    return type(x)(make() for _ in x)
  return make()


@st.composite
def tree_cases(draw):
  src_ids, dst_ids = draw(device_sets())
  src, dst = draw(named_shardings(src_ids, 2)), draw(named_shardings(dst_ids, 2))
  dtype = draw(st.sampled_from(DTYPES))
  return (draw(trees()), src, dst, shape_for(draw, src, dst, 2, cap=512), dtype,
          draw(out_dtypes(dtype)),
          draw(st.sampled_from(ROUTES)), draw(st.sampled_from(("no", "all", "prefix"))),
          draw(st.booleans()), draw(st.integers(0, 1 << 20)))


@hypothesis.settings(SETTINGS, max_examples=60)
@hypothesis.given(tree_cases())
def test_pytree_prefixes_match_device_put(case):
  """Whatever jax.device_put accepts, reshard returns the same; whatever it refuses,
  reshard refuses with a ReshardError and deletes nothing."""
  t, src, dst, shape, dtype, out_dtype, route, donate, dst_prefix, seed = case
  x, twin = build(t, src, shape, dtype), build(t, src, shape, dtype)
  rng = np.random.default_rng(seed)
  dsts = top_prefix(x, lambda: dst) if dst_prefix else dst
  flags = {"no": False, "all": True,
           "prefix": top_prefix(x, lambda: bool(rng.integers(2)))}[donate]
  host = [None if v is None else np.asarray(v) for v in jax.tree.leaves(x)]
  try:
    ref = jax.device_put(jax.tree.map(
        lambda v: convert(v if hasattr(v, "astype") else np.asarray(v), out_dtype),
        twin), dsts)
  except (ValueError, TypeError) as e:
    with pytest.raises(jax_m2n.ReshardError) as info:
      jax_m2n.reshard(x, dsts, route=route, dtype=out_dtype, donate=flags)
    assert isinstance(info.value, (ValueError, TypeError)), (e, info.value)
    assert not any(isinstance(v, jax.Array) and v.is_deleted()
                   for v in jax.tree.leaves(x))
    return
  y = jax_m2n.reshard(x, dsts, route=route, dtype=out_dtype, donate=flags)
  assert jax.tree.structure(y) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(ref)):
    assert_same(a, b)
  per_leaf = jax.tree.leaves(jax.tree.map(
      lambda f, sub: jax.tree.map(lambda _: f, sub), flags, x)) if not isinstance(
          flags, bool) else [flags] * len(jax.tree.leaves(x))
  for v, f, h in zip(jax.tree.leaves(x), per_leaf, host):
    if isinstance(v, jax.Array) and v.committed and v.size:
      assert v.is_deleted() == f
    if isinstance(v, jax.Array) and not v.is_deleted():
      np.testing.assert_array_equal(bits(v), bits(h))


# ---------------------------------------------------------------------------------------
# Transformations: grad, vjp, jvp, vmap; eager and in jit
# ---------------------------------------------------------------------------------------

FLOATS = [np.dtype(t) for t in (np.float32, np.float16, jnp.bfloat16)]


@st.composite
def transform_cases(draw):
  where = draw(st.sampled_from(("eager", "jit", "jit_src")))
  src_ids, dst_ids = draw(device_sets())
  if where != "eager":
    dst_ids = src_ids
  rank = draw(st.integers(1, 3))
  src = draw(named_shardings(src_ids, rank))
  dst = draw(named_shardings(dst_ids, rank, names="xyz"))
  return (where, draw(st.sampled_from(("grad", "vjp", "jvp", "vmap"))),
          shape_for(draw, src, dst, rank, cap=512), draw(st.sampled_from(FLOATS)),
          draw(st.sampled_from([None] + FLOATS)), src, dst,
          draw(st.sampled_from(ROUTES)))


@hypothesis.settings(SETTINGS, max_examples=40)
@hypothesis.given(transform_cases())
def test_transformations_match_jax(case):
  """Values as plain JAX computes them without any reshard; a cotangent in the source
  layout (where it is known), a vmapped result in the destination layout with the batch
  dim unsharded."""
  where, how, shape, dtype, out_dtype, src, dst, route = case
  x = jax.device_put(data(shape, dtype), src)
  plain = jnp.asarray(np.asarray(x))
  w = jnp.asarray(data(shape, np.float32, 1))
  kw = dict(route=route, dtype=out_dtype)
  if how == "vmap":
    dst = NamedSharding(dst.mesh, P(*tuple(dst.spec)[1:]))
    if where == "jit_src":
      kw["src_sharding"] = NamedSharding(src.mesh, P(*tuple(src.spec)[1:]))
    f = jax.vmap(lambda u: jax_m2n.reshard(u, dst, **kw))
    y = (f if where == "eager" else jax.jit(f))(x)
    np.testing.assert_array_equal(bits(y), bits(convert(plain, out_dtype)))
    assert y.sharding.is_equivalent_to(
        NamedSharding(dst.mesh, P(None, *dst.spec)), y.ndim), y.sharding
    return
  if where == "jit_src":
    kw["src_sharding"] = src
  m = lambda u: jax_m2n.reshard(u, dst, **kw)  # noqa: E731
  r = lambda u: convert(u, out_dtype)  # noqa: E731
  loss = lambda f: lambda u: (f(u).astype(np.float32) * w).sum()  # noqa: E731
  run = {"grad": lambda f, v: jax.grad(loss(f))(v),
         "vjp": lambda f, v: jax.vjp(f, v)[1](f(v)),
         "jvp": lambda f, v: jax.jvp(f, (v,), (v * 2,))}[how]
  got = run(m, x) if where == "eager" else jax.jit(lambda v: run(m, v))(x)
  want = jax.jit(lambda v: run(r, v))(plain)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(bits(a), bits(b))
  if how in ("grad", "vjp") and where != "jit":  # jit without src: XLA's choice
    for a in jax.tree.leaves(got):
      assert a.sharding.is_equivalent_to(x.sharding, x.ndim), (a.sharding, x.sharding)


# ---------------------------------------------------------------------------------------
# Regressions found by this file's searches
# ---------------------------------------------------------------------------------------

def _mesh(ids, shape, names, explicit=False):
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return Mesh(np.array([D[i] for i in ids]).reshape(shape), names, axis_types=types)


def test_none_nodes_of_x_take_any_prefix_entry():
  """jax.device_put({'a': x, 'b': None}, {'a': s, 'b': t}) is fine: a None node has no
  leaves. dst_sharding= and dtype= prefixes naming it were refused."""
  a = jax.device_put(data((4,), np.float32), D[0])
  for dst, dtype in [({"a": D[1], "b": None}, None), ({"a": D[1], "b": D[2]}, None),
                     (D[1], {"a": jnp.bfloat16, "b": None}),
                     (D[1], {"a": jnp.bfloat16, "b": jnp.float16})]:
    y = jax_m2n.reshard({"a": a, "b": None}, dst, dtype=dtype)
    ref = jax.device_put({"a": convert(a, None if dtype is None else dtype["a"]),
                          "b": None}, dst)
    assert y["b"] is None
    assert_same(y["a"], ref["a"])
  assert jax_m2n.reshard({"k": None}, {"k": D[3]}) == {"k": None}


def test_donating_host_data_and_aliased_results():
  """donate=True on numpy / Python leaves (device_put ignores it) raised
  AttributeError; on an uncommitted array that device_put commits in place it deleted
  the result along with the source."""
  host = data((4,), np.float32)
  out = jax_m2n.reshard({"n": host, "s": 3}, D[1], donate=True)
  np.testing.assert_array_equal(np.asarray(out["n"]), host)
  assert int(out["s"]) == 3
  u = jnp.asarray(host)  # uncommitted, on device 0
  y = jax_m2n.reshard(u, D[0], donate=True)
  assert not y.is_deleted()
  np.testing.assert_array_equal(np.asarray(y), host)
  mesh = _mesh([0], (1,), ("a",))
  y = jax_m2n.reshard(jnp.asarray(host), NamedSharding(mesh, P("a")), donate=True)
  np.testing.assert_array_equal(np.asarray(y), host)


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("given_src", [False, True])
def test_jit_meshes_without_common_refinement(explicit, given_src):
  """2x3 -> 3x2 over one device order (and, on Explicit axes, a destination mesh with
  other axis names) inside jit: as jax.sharding.reshard / with_sharding_constraint do
  (was a ReshardValueError 'must refine a common mesh' / 'devices must be known')."""
  src = NamedSharding(_mesh(range(6), (2, 3), ("a", "b"), explicit), P("a", "b"))
  x = jax.device_put(data((6, 6), np.int8), src)
  for dst in (NamedSharding(_mesh(range(6), (3, 2), ("x", "y"), explicit), P("y", "x")),
              NamedSharding(_mesh(range(6), (2, 3), ("x", "y"), explicit), P("y"))):
    kw = dict(src_sharding=src) if given_src else {}
    for dtype in (None, jnp.int32, jnp.bool_):
      y = jax.jit(lambda v: jax_m2n.reshard(v, dst, dtype=dtype, **kw))(x)
      assert_same(y, jax.device_put(convert(x, dtype), dst), exact=False)
      if explicit:
        ref = jax.jit(lambda v: jax.sharding.reshard(convert(v, dtype), dst))(x)
        assert jax.typeof(y).sharding == jax.typeof(ref).sharding


def test_jit_keys_and_int4_land_in_the_destination_layout():
  """Typed PRNG keys and int4 inside jit: jax.device_put there keeps the operand's
  layout; reshard must give the destination's (int4 was a ReshardTypeError)."""
  mesh = _mesh(range(4), (2, 2), ("a", "b"))
  dst = NamedSharding(mesh, P("b"))
  for x in (jax.device_put(jnp.arange(8, dtype=jnp.int4), NamedSharding(mesh, P(("a", "b")))),
            jax.device_put(jax.random.split(jax.random.key(0), 8),
                           NamedSharding(mesh, P(("a", "b"))))):
    y = jax.jit(lambda v: jax_m2n.reshard(v, dst))(x)
    assert y.sharding.is_equivalent_to(dst, 1), y.sharding
    ref = jax.jit(lambda v: jax.lax.with_sharding_constraint(v, dst))(x)
    unwrap = jax.random.key_data if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) \
        else (lambda v: v.astype(jnp.int8))
    np.testing.assert_array_equal(np.asarray(unwrap(y)), np.asarray(unwrap(ref)))


def test_dtype_on_deleted_or_non_numeric_leaves_raises_reshard_errors(monkeypatch):
  """An unfused dtype= used to run astype first: JAX's RuntimeError on a deleted array,
  numpy's TypeError / ValueError on strings."""
  x = jax.device_put(data((8,), np.float32), NamedSharding(_mesh(range(4), (4,), ("a",)),
                                                            P("a")))
  x.delete()
  for dtype in (jnp.int32, jnp.bfloat16):
    with pytest.raises(jax_m2n.ReshardValueError, match="must be a live array"):
      jax_m2n.reshard(x, D[5], dtype=dtype)
  for leaf in ("s", object(), np.array(["a"]), b"x"):
    for dtype in (jnp.int32, jnp.bfloat16):
      with pytest.raises(jax_m2n.ReshardTypeError):
        jax_m2n.reshard({"w": leaf}, D[5], dtype=dtype)
  live = jax.device_put(data((8,), np.float32), D[0])
  assert_same(jax_m2n.reshard(live, D[5], dtype=jnp.int32),
              jax.device_put(live.astype(jnp.int32), D[5]))


def test_python_scalars_converted_to_their_own_dtype_lose_weak_type():
  """dtype=int32 on the Python int 3 (weakly typed int32) is astype's: a strong int32
  (was left weak, since the dtypes already matched)."""
  for dst in (None, D[2]):
    for v, dtype in ((3, jnp.int32), (2.5, jnp.float32), (1j, jnp.complex64),
                     (True, jnp.bool_), (3, jnp.float16)):
      y = jax_m2n.reshard({"v": v}, dst, dtype=dtype)["v"]
      ref = jax.device_put(jnp.asarray(v).astype(dtype), dst)
      assert (y.dtype, y.weak_type, y.committed) == (ref.dtype, ref.weak_type,
                                                     ref.committed), (v, dtype)


# ---------------------------------------------------------------------------------------
# Errors: a ReshardError (TypeError / ValueError) before anything moves, then a valid
# call works
# ---------------------------------------------------------------------------------------

def _good():
  return NamedSharding(_mesh(range(4, 8), (4,), ("b",)), P("b"))


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=_good())


BAD = [  # (what, also a, the arguments)
    ("dst str", TypeError, lambda: dict(dst_sharding="cpu")),
    ("dst int", TypeError, lambda: dict(dst_sharding=3)),
    ("dst indivisible", ValueError,
     lambda: dict(dst_sharding=NamedSharding(_mesh(range(4, 7), (3,), ("b",)), P("b")))),
    ("dst rank", ValueError, lambda: dict(dst_sharding=NamedSharding(_good().mesh, P("b", None)))),
    ("dst abstract", ValueError,
     lambda: dict(dst_sharding=NamedSharding(_good().mesh.abstract_mesh, P("b")))),
    ("dst duplicate device", ValueError, lambda: dict(dst_sharding=NamedSharding(
        Mesh(np.array([D[4], D[4], D[5], D[6]]), ("b",)), P("b")))),
    ("dst spec without mesh", ValueError, lambda: dict(dst_sharding=P("b"))),
    ("dst prefix", ValueError, lambda: dict(dst_sharding=[_good(), _good()])),
    ("sds shape", ValueError, lambda: dict(dst_sharding=_sds((4,), np.float32))),
    ("sds dtype", ValueError, lambda: dict(dst_sharding=_sds((8,), np.int32))),
    ("sds vs dtype=", ValueError,
     lambda: dict(dst_sharding=_sds((8,), np.float32), dtype=jnp.bfloat16)),
    ("dtype name", TypeError, lambda: dict(dtype="foo")),
    ("dtype object", TypeError, lambda: dict(dtype=object)),
    ("dtype int", TypeError, lambda: dict(dtype=3)),
    ("dtype prefix", ValueError, lambda: dict(dtype=[jnp.bfloat16, jnp.bfloat16])),
    ("route", ValueError, lambda: dict(route="ring")),
    ("route None", TypeError, lambda: dict(route=None)),
    ("timeout 0", ValueError, lambda: dict(timeout_s=0)),
    ("timeout nan", ValueError, lambda: dict(timeout_s=float("nan"))),
    ("timeout str", TypeError, lambda: dict(timeout_s="1")),
    ("chunk 0", ValueError, lambda: dict(chunk_bytes=0)),
    ("chunk float", TypeError, lambda: dict(chunk_bytes=1.5)),
    ("chunk bool", TypeError, lambda: dict(chunk_bytes=True)),
    ("topology 0", ValueError, lambda: dict(topology=0)),
    ("topology overlap", ValueError, lambda: dict(topology=[[0, 1], [1, 2]])),
    ("topology str", TypeError, lambda: dict(topology="x")),
    ("donate str", TypeError, lambda: dict(donate="yes")),
    ("donate int", TypeError, lambda: dict(donate=1)),
    ("src_sharding wrong", ValueError, lambda: dict(src_sharding=_good())),
    ("src_sharding str", TypeError, lambda: dict(src_sharding="a")),
    ("dtype= unfused, dst indivisible", ValueError, lambda: dict(
        dst_sharding=NamedSharding(_mesh(range(4, 7), (3,), ("b",)), P("b")),
        dtype=jnp.int32)),
]


@pytest.mark.parametrize("what,kind,make", BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_raise_before_anything_moves(what, kind, make, no_data_moves):
  del what
  kw = make()
  dst = kw.pop("dst_sharding", _good())
  x = jax.device_put(data((8,), np.float32),
                     NamedSharding(_mesh(range(4), (4,), ("a",)), P("a")))
  with pytest.raises(jax_m2n.ReshardError) as info:
    jax_m2n.reshard(x, dst, donate=kw.pop("donate", True), **kw)
  assert isinstance(info.value, kind), (type(info.value).__mro__, kind)
  assert not x.is_deleted()


@pytest.mark.parametrize("what,kind,make", BAD[::6], ids=[c[0] for c in BAD[::6]])
def test_a_valid_call_works_after_a_refused_one(what, kind, make):
  del what, kind
  kw = make()
  x = jax.device_put(data((8,), np.float32),
                     NamedSharding(_mesh(range(4), (4,), ("a",)), P("a")))
  with pytest.raises(jax_m2n.ReshardError):
    jax_m2n.reshard(x, kw.pop("dst_sharding", _good()), **kw)
  assert_same(jax_m2n.reshard(x, _good(), donate=True), jax.device_put(
      jax.device_put(data((8,), np.float32), x.sharding), _good()))
  assert x.is_deleted()


# ---------------------------------------------------------------------------------------
# The asynchronous CPU mode (JAX_M2N_CPU_ASYNC=1), in a subprocess
# ---------------------------------------------------------------------------------------

_ASYNC_SCRIPT = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np, jax.numpy as jnp, jax_m2n
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax_m2n._src import eager
    assert eager.programs._CPU_ASYNC
    D = jax.devices()
    rng = np.random.default_rng(0)
    meshes = [Mesh(np.array(D[:4]).reshape(2, 2), ("a", "b")),
              Mesh(np.array([D[i] for i in (7, 5, 3, 1, 6, 4)]).reshape(3, 2), ("a", "b")),
              Mesh(np.array(D[2:6]), ("a",)), Mesh(np.array(D).reshape(2, 2, 2), ("a", "b", "c"))]
    def spec(mesh):
      names = list(mesh.axis_names)
      rng.shuffle(names)
      return [P(), P(names[0]), P(None, names[0]), P(tuple(names)),
              P(*names[:2])][rng.integers(5)]
    n = 0
    for it in range(25):
      m1, m2 = meshes[rng.integers(4)], meshes[rng.integers(4)]
      s1, s2 = NamedSharding(m1, spec(m1)), NamedSharding(m2, spec(m2))
      dtype = [np.float32, jnp.bfloat16, np.int8, np.bool_][rng.integers(4)]
      out = [None, jnp.bfloat16, np.float32, np.int32][rng.integers(4)]
      host = rng.standard_normal((24, 12)).astype(dtype)
      x = jax.device_put(host, s1)
      # The oracle on one device: no XLA multi-device program runs beside the calls.
      want = np.asarray(jax.device_put(host, D[0]).astype(out or dtype))
      donate = bool(rng.integers(2))
      y = jax_m2n.reshard({"w": x, "k": None, "z": jax.device_put(np.zeros((0, 12), dtype), s1)},
                          {"w": s2, "k": None, "z": s2}, dtype=out, donate=donate,
                          route=["hierarchical", "flat", "gather_bcast"][rng.integers(3)])
      y2 = jax_m2n.reshard(y["w"], s1)  # ordered after the first
      assert x.is_deleted() == donate
      assert y["w"].sharding == s2 and y["k"] is None
      assert {s.device for s in y["w"].addressable_shards} == s2.device_set
      for a in y["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8),
                                      want[a.index].view(np.uint8))
      np.testing.assert_array_equal(np.asarray(y2).view(np.uint8), want.view(np.uint8))
      try:  # 12 columns over 5 devices: refused before anything runs
        jax_m2n.reshard(y["w"], NamedSharding(Mesh(np.array(D[:5]), ("q",)), P(None, "q")))
        raise SystemExit("bad call accepted")
      except jax_m2n.ReshardValueError:
        pass
      n += 1
    print("async ok", n)
""")


def test_async_cpu_mode_random_calls_in_a_subprocess():
  """Chained asynchronous calls (a result resharded again before anyone waits), donation,
  None and zero-size leaves, conversions, and a refused call in between; no XLA
  collective runs concurrently (the mode's documented limit)."""
  proc = launcher.run_python(_ASYNC_SCRIPT, {"JAX_M2N_CPU_ASYNC": "1",
                                             "JAX_PLATFORMS": "cpu"}, timeout_s=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "async ok 25" in proc.stdout
