"""GPU tests of the CUDA transport (xla_ffi/cuda/): jax_m2n.reshard on 2 or 4 GPUs.

Both engines (`_ffi_cuda.set_engine`): "auto", which in one process takes the direct peer
path (copy-engine peer copies, 2-D/3-D strided copies, the copy kernel over NVLink; the
tests check that it did), and "nccl". Every route, eager (disjoint 2+2 and 1+3 device
sets, overlapping, identical) and inside jit (also between XLA computations), emulated
two-domain topologies (Topology(domain_size=2): the ring-forward stage runs), a pytree in
one call, 1- to 8-byte elements, strided and contiguous boxes on each peer-path engine, a
few random layouts; every result is bitwise equal to jax.device_put of the same array (or
numpy). Cases needing more GPUs than the machine has are skipped (4 for the 2+2 and 1+3
cases); all are skipped without GPUs (CI).

Run on the GPU machine (after building jax_m2n/_ffi_cuda.so):
  NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/gpu_test.py
"""

import gpus  # first: keeps NVLink multicast off before JAX loads NCCL

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m2n  # noqa: E402


GPUS = gpus.devices()
pytestmark = pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 GPUs (4 for most cases)")


def _need(n):
  gpus.need(n, len(GPUS))

ROUTES = ("hierarchical", "flat", "gather_bcast")
ENGINES = ("auto", "nccl")


def _cuda():
  import jax_m2n._ffi_cuda as cuda  # noqa: PLC0415 - only where GPUs exist
  return cuda


class _Engine(str):
  rounds_before = 0

  def check(self):
    """With "auto" the direct peer path ran (one process); with "nccl" it did not."""
    after = _cuda().peer_stats()["rounds"]
    if self == "auto":
      assert after > self.rounds_before, "the direct peer path did not run in one process"
    else:
      assert after == self.rounds_before, "set_engine('nccl') still took the peer path"


@pytest.fixture(params=ENGINES)
def engine(request):
  """Runs the test under one CUDA engine (the test calls engine.check() at its end)."""
  cuda = _cuda()
  cuda.set_engine(request.param)
  e = _Engine(request.param)
  e.rounds_before = cuda.peer_stats()["rounds"]
  try:
    yield e
  finally:
    cuda.set_engine("auto")


def _sharding(ids, mesh_shape, spec, names=("x", "y")):
  devs = np.array([GPUS[i] for i in ids], dtype=object).reshape(mesh_shape)
  return NamedSharding(Mesh(devs, names[:len(mesh_shape)]), spec)


def _random(shape, dtype, seed):
  """Random bit patterns of `dtype` (never zeros: unwritten outputs must show)."""
  rng = np.random.default_rng(seed)
  itemsize = np.dtype(dtype).itemsize
  raw = rng.integers(1, 255, size=int(np.prod(shape, dtype=np.int64)) * itemsize,
                     dtype=np.uint8)
  return raw.view(dtype).reshape(shape)


def _bits(a):
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _check(out, ref, dst):
  """`out` has `dst`'s layout and every shard bitwise equals the reference's."""
  assert out.sharding.is_equivalent_to(dst, out.ndim), (out.sharding, dst)
  by_device = {s.device: s for s in ref.addressable_shards}
  for s in out.addressable_shards:
    r = by_device[s.device]
    assert s.index == r.index
    np.testing.assert_array_equal(_bits(s.data), _bits(r.data),
                                  err_msg=f"shard on {s.device} at {s.index}")


def _run_case(src, dst, shape, dtype, route="hierarchical", topology=None, seed=0):
  x = jax.device_put(_random(shape, dtype, seed), src)
  ref = jax.device_put(x, dst)
  out = jax_m2n.reshard(x, dst, route=route, topology=topology)
  _check(out, ref, dst)
  # A second call reuses the cached programs and plans.
  x2 = jax.device_put(_random(shape, dtype, seed + 1), src)
  _check(jax_m2n.reshard(x2, dst, route=route, topology=topology),
         jax.device_put(x2, dst), dst)


BF16 = ml_dtypes.bfloat16

# (name, src (ids, mesh shape, spec), dst (ids, mesh shape, spec), shape, dtype)
EAGER_CASES = [
    ("1+1 -> copy", ([0], (1,), P()), ([1], (1,), P()), (64, 96), BF16),
    ("1+1 3-D", ([0], (1,), P()), ([1], (1,), P()), (5, 7, 9), np.int8),
    ("2 identical dim0 -> dim1", ([0, 1], (2,), P("x", None)), ([0, 1], (2,), P(None, "x")),
     (64, 96), BF16),
    ("2 identical dim0 -> replicated", ([0, 1], (2,), P("x", None)), ([0, 1], (2,), P()),
     (64, 96), np.float32),
    ("2 swapped", ([0, 1], (2,), P("x", None)), ([1, 0], (2,), P(None, "x")),
     (16, 24, 8), np.int16),
    ("2+2 dim0 -> replicated", ([0, 1], (2,), P("x", None)), ([2, 3], (2,), P()),
     (64, 96), BF16),
    ("2+2 dim0 -> dim1", ([0, 1], (2,), P("x", None)), ([2, 3], (2,), P(None, "x")),
     (64, 96), BF16),
    ("2+2 dim0 -> dim0", ([0, 1], (2,), P("x", None)), ([2, 3], (2,), P("x", None)),
     (64, 96), np.float32),
    ("1+3 -> replicated", ([0], (1,), P()), ([1, 2, 3], (3,), P()), (48, 40), BF16),
    ("1+3 -> dim1", ([0], (1,), P()), ([1, 2, 3], (3,), P(None, "x")), (10, 48), np.int8),
    ("overlap 3 -> 3", ([0, 1, 2], (3,), P("x")), ([1, 2, 3], (3,), P(None, "x")),
     (48, 24), np.float32),
    ("identical dim0 -> dim1", ([0, 1, 2, 3], (4,), P("x", None)),
     ([0, 1, 2, 3], (4,), P(None, "x")), (32, 64), BF16),
    ("identical permuted", ([0, 1, 2, 3], (4,), P("x")), ([3, 2, 1, 0], (4,), P("x")),
     (64,), np.int32),
    ("2x2 mesh -> transposed", ([0, 1, 2, 3], (2, 2), P("x", "y")),
     ([0, 1, 2, 3], (2, 2), P("y", "x")), (8, 12, 6), np.int16),
    ("3-D inner dim", ([0, 1], (2,), P(None, None, "x")), ([2, 3], (2,), P("x", None, None)),
     (4, 6, 10), np.int8),
    ("scalar-like rank 1", ([0], (1,), P()), ([1, 2, 3], (3,), P()), (1,), np.uint32),
    ("1 -> 2 replicated (overlap)", ([0], (1,), P()), ([0, 1], (2,), P()), (40, 24),
     np.complex64),
    ("2 -> 1 gather (overlap)", ([0, 1], (2,), P(None, "x")), ([1], (1,), P()), (12, 40),
     np.uint8),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", EAGER_CASES, ids=[c[0] for c in EAGER_CASES])
def test_eager(case, route, engine):
  _, s, d, shape, dtype = case
  _need(1 + max(s[0] + d[0]))
  _run_case(_sharding(*s), _sharding(*d), shape, dtype, route=route)
  engine.check()


@pytest.mark.parametrize("route", ROUTES)
def test_two_domains_ring_forward(route):
  _need(4)
  # Domains {0,1} and {2,3}: a destination replicated over both gets one injection per
  # domain and ring forwarding between the leaders.
  topo = jax_m2n.Topology(domain_size=2)
  _run_case(_sharding([0], (1,), P()), _sharding([1, 2, 3], (3,), P()), (64, 80), BF16,
            route=route, topology=topo)
  _run_case(_sharding([0, 1], (2,), P("x", None)), _sharding([0, 1, 2, 3], (4,), P()),
            (64, 80), BF16, route=route, topology=topo)
  _run_case(_sharding([0, 2], (2,), P(None, "x")), _sharding([1, 3], (2,), P()),
            (32, 64), np.float32, route=route, topology=topo)


def test_pytree_one_call():
  _need(4)
  src2 = _sharding([0, 1], (2,), P("x", None))
  tree = {
      "w": jax.device_put(_random((64, 32), BF16, 1), src2),
      "b": jax.device_put(_random((16,), np.float32, 2), _sharding([0, 1], (2,), P())),
      "e": jax.device_put(_random((8, 6, 4), np.int8, 3), _sharding([0, 1], (2,), P(None, "x"))),
  }
  dst = {
      "w": _sharding([2, 3], (2,), P(None, "x")),
      "b": _sharding([2, 3], (2,), P("x")),
      "e": _sharding([1, 2, 3], (3,), P(None, "x")),
  }
  out = jax_m2n.reshard(tree, dst)
  for k in tree:
    _check(out[k], jax.device_put(tree[k], dst[k]), dst[k])


@pytest.mark.parametrize("route", ROUTES)
def test_inside_jit(route, engine):
  ids = list(range(min(4, len(GPUS))))
  src = _sharding(ids, (len(ids),), P("x", None))
  for dst_spec in (P(None, "x"), P(), P("x", None)):
    dst = _sharding(ids, (len(ids),), dst_spec)
    f = jax.jit(lambda a, dst=dst: jax_m2n.reshard(a, dst, route=route, src_sharding=src))
    x = jax.device_put(_random((64, 128), BF16, 5), src)
    out = f(x)
    _check(out, jax.device_put(x, dst), dst)
    x2 = jax.device_put(_random((64, 128), BF16, 6), src)
    _check(f(x2), jax.device_put(x2, dst), dst)
  engine.check()


def test_inside_jit_2x2_mesh_and_pytree():
  _need(4)
  devs = np.array(GPUS[:4], dtype=object).reshape(2, 2)
  mesh = Mesh(devs, ("dp", "tp"))
  src = {"a": NamedSharding(mesh, P("dp", "tp")), "b": NamedSharding(mesh, P(("dp", "tp")))}
  dst = {"a": NamedSharding(mesh, P("tp", None)), "b": NamedSharding(mesh, P())}
  x = {"a": jax.device_put(_random((8, 16), np.float32, 7), src["a"]),
       "b": jax.device_put(_random((32,), BF16, 8), src["b"])}
  out = jax.jit(lambda t: jax_m2n.reshard(t, dst, src_sharding=src))(x)
  for k in x:
    _check(out[k], jax.device_put(x[k], dst[k]), dst[k])


def _random_sharding(rng, ids_pool, shape):
  n = int(rng.choice([k for k in (1, 2, 3, 4) if k <= len(ids_pool)]))
  ids = [int(i) for i in rng.permutation(ids_pool)[:n]]
  spec = [None] * len(shape)
  dims = [d for d in range(len(shape)) if shape[d] % n == 0]
  if n > 1 and dims and rng.random() < 0.8:
    spec[int(rng.choice(dims))] = "x"
  return _sharding(ids, (n,), P(*spec))


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts(seed):
  rng = np.random.default_rng(100 + seed)
  shape = tuple(int(v) for v in rng.choice([6, 12, 24], size=int(rng.integers(1, 4))))
  dtype = [np.int8, BF16, np.float32][seed % 3]
  pool = range(min(4, len(GPUS)))
  src = _random_sharding(rng, pool, shape)
  dst = _random_sharding(rng, pool, shape)
  route = ROUTES[seed % 3]
  _run_case(src, dst, shape, dtype, route=route, seed=seed)


def test_large_chunked_and_packed():
  # 64 MiB: several chunks per transfer (default 16 MiB) and packed dim1 boxes.
  src = _sharding([0, 1], (2,), P("x", None))
  dst_ids = [2, 3] if len(GPUS) >= 4 else [1, 0]
  for spec in (P(None, "x"), P()):
    _run_case(src, _sharding(dst_ids, (2,), spec), (4096, 8192), BF16)


# Boxes for each engine of the peer path (docs/cuda_transport.md, "Peer path"), on 2 GPUs:
# (name, src spec, dst spec, shape, dtype, counter that must grow under "auto").
PEER_CASES = [
    # Contiguous boxes: cudaMemcpyPeerAsync.
    ("contiguous 8B", P("x", None), P(None, None), (64, 256), np.complex64, "memcpys"),
    ("contiguous 1B odd", P("x"), P(), (2 * 1001,), np.int8, "memcpys"),
    # Rows of >= 512 bytes, one outer dim: a 2-D copy-engine copy.
    ("2-D strided 2B", P("x", None), P(None, "x"), (512, 1024), BF16, "memcpys_3d"),
    ("2-D strided 4B", P(None, "x"), P("x", None), (256, 512), np.float32, "memcpys_3d"),
    # Two outer dims that do not merge: a 3-D copy-engine copy.
    ("3-D strided 2B", P(None, "x", None), P(None, None, "x"), (4, 64, 1024), BF16,
     "memcpys_3d"),
    # Short rows: the copy kernel reading the peer's memory over NVLink.
    ("kernel 1B rows", P("x", None), P(None, "x"), (64, 48), np.int8, "kernel_tasks"),
    ("kernel 8B", P(None, "x"), P("x", None), (32, 16), np.complex64, "kernel_tasks"),
    ("kernel 4-D", P(None, "x", None, None), P(None, None, None, "x"), (3, 4, 5, 8),
     np.int16, "kernel_tasks"),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", PEER_CASES, ids=[c[0] for c in PEER_CASES])
def test_peer_engines(case, route, engine):
  _, sspec, dspec, shape, dtype, counter = case
  cuda = _cuda()
  before = cuda.peer_stats()[counter]
  for src_ids, dst_ids in (([0, 1], [0, 1]), ([0, 1], [1, 0])):
    _run_case(_sharding(src_ids, (2,), sspec), _sharding(dst_ids, (2,), dspec), shape, dtype,
              route=route)
  if engine == "auto" and route != "gather_bcast":
    assert cuda.peer_stats()[counter] > before, counter
  engine.check()


def test_peer_inside_jit_between_xla_work(engine):
  """The reshard sits between XLA computations on the same streams, twice in one program."""
  ids = [0, 1]
  src = _sharding(ids, (2,), P("x", None))
  dst = _sharding(ids, (2,), P(None, "x"))
  rep = _sharding(ids, (2,), P())

  @jax.jit
  def f(a):
    b = jax_m2n.reshard(a * 3 + 1, dst, src_sharding=src)
    c = jax_m2n.reshard(b ^ 5, rep, src_sharding=dst)
    return b + 1, c * 2

  for seed in (11, 12, 13):
    host = _random((256, 1024), np.int32, seed)
    b, c = f(jax.device_put(host, src))
    np.testing.assert_array_equal(np.asarray(b), host * 3 + 2)
    np.testing.assert_array_equal(np.asarray(c), ((host * 3 + 1) ^ 5) * 2)
  engine.check()


def test_peer_large_both_directions(engine):
  """Chunked 64 MiB exchanges (several ops per step and steps), 2-D copies both ways."""
  src = _sharding([0, 1], (2,), P("x", None))
  for spec in (P(None, "x"), P()):
    _run_case(src, _sharding([0, 1], (2,), spec), (4096, 8192), BF16, seed=21)
  _run_case(_sharding([0], (1,), P()), _sharding([1], (1,), P()), (8192, 4096), BF16,
            seed=22)
  engine.check()


# --- dtype= : conversion in flight (issue 15 item 2; docs/cuda_transport.md) ------------
# Bitwise against jax.device_put(x.astype(d), dst), i.e. XLA GPU's own `convert`, on
# inputs full of special values: every bit pattern of 8- and 16-bit sources (NaNs with
# payloads, infs, subnormals, values that overflow or round to a tie in the target), and
# for f32 the boundaries of every target type plus random bits.

F8E4M3 = ml_dtypes.float8_e4m3fn
F8E5M2 = ml_dtypes.float8_e5m2
CONVERT_TYPES = (np.float32, BF16, np.float16, F8E4M3, F8E5M2)
CONVERT_PAIRS = [(a, b) for a in CONVERT_TYPES for b in CONVERT_TYPES if a is not b]


def _pair_id(pair):
  return f"{np.dtype(pair[0]).name}->{np.dtype(pair[1]).name}"


def _f32_specials():
  """f32 bit patterns at the edges of every target type, around ties, and NaN payloads."""
  vals = [0.0, -0.0, np.inf, -np.inf, 1.0, -1.0]
  for t in CONVERT_TYPES[1:]:
    fi = ml_dtypes.finfo(t)
    for v in (float(fi.max), float(fi.tiny), float(fi.smallest_subnormal), float(fi.eps)):
      for s in (1.0, -1.0):
        vals += [s * v, s * v * 1.5, s * v * 0.5, s * v * 2.0, s * v * 0.75]
  with np.errstate(over="ignore"):
    bits = np.array(vals, dtype=np.float32).view(np.uint32)
  # Each value +-1 and +-2 ulp (ties, just-below/above overflow, rounding boundaries).
  near = (bits[:, None].astype(np.int64) + np.array([-2, -1, 1, 2])).ravel()
  ties = []  # exactly halfway between two values of a target with `keep` mantissa bits
  for keep in (7, 10, 3, 2):  # bf16, f16, e4m3, e5m2
    for i, e in enumerate(range(-20, 20)):
      m = (i * 0x9E37) & ((1 << keep) - 1)
      for sign in (0, 1 << 31):
        ties.append(sign | ((127 + e) << 23) | (m << (23 - keep)) | (1 << (22 - keep)))
  nans = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FA5A5A5,
          0xFFD0000F, 0x7F800100]
  subn = list(range(1, 64)) + [0x007FFFFF, 0x00400000, 0x80000001, 0x807FFFFF]
  out = np.concatenate([bits, near[(near >= 0) & (near < 1 << 32)], ties, nans, subn])
  return out.astype(np.uint32)


def _convert_input(dtype, shape, seed):
  """An array of `dtype` and `shape` holding every bit pattern (8/16-bit) or the f32
  specials, the rest random bits, shuffled."""
  rng = np.random.default_rng(seed)
  n = int(np.prod(shape))
  itemsize = np.dtype(dtype).itemsize
  if itemsize == 4:
    special = _f32_specials()
    raw = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
  else:
    special = np.arange(1 << (8 * itemsize), dtype=np.uint64)
    raw = rng.integers(0, 1 << (8 * itemsize), size=n, dtype=np.uint64)
  k = min(n, len(special))
  raw[:k] = special[rng.permutation(len(special))[:k]]
  raw = raw[rng.permutation(n)].astype(f"u{itemsize}")
  return raw.view(dtype).reshape(shape)


def _check_convert(out, host, dtype, dst, src):
  """Every shard of `out` equals XLA's astype + device_put bitwise; a mismatch names the
  input bits, XLA's result and ours (the first few)."""
  x = jax.device_put(host, src)
  ref = jax.device_put(x.astype(dtype), dst)
  assert out.dtype == np.dtype(dtype), (out.dtype, dtype)
  assert out.sharding.is_equivalent_to(dst, out.ndim), (out.sharding, dst)
  by_device = {s.device: s for s in ref.addressable_shards}
  for s in out.addressable_shards:
    r = by_device[s.device]
    got, want = _bits(s.data), _bits(r.data)
    bad = np.argwhere(got != want)
    if len(bad):
      inp = _bits(host[s.index])
      rows = [f"in {int(inp[tuple(i)]):#x} xla {int(want[tuple(i)]):#x} "
              f"m2n {int(got[tuple(i)]):#x}" for i in bad[:8]]
      pytest.fail(f"{host.dtype}->{np.dtype(dtype)}: {len(bad)} of {got.size} elements "
                  f"differ on {s.device}: " + "; ".join(rows))


def _convert_case(src, dst, host, dtype, **kw):
  x = jax.device_put(host, src)
  out = jax_m2n.reshard(x, dst, dtype=dtype, **kw)
  _check_convert(out, host, dtype, dst, src)


# (name, src (ids, mesh shape, spec), dst (ids, mesh shape, spec)) on 2 GPUs: a contiguous
# cross-device copy, strided boxes both ways plus local ones, contiguous halves swapped.
CONVERT_LAYOUTS = [
    ("1+1 copy", ([0], (1,), P()), ([1], (1,), P())),
    ("dim0 -> dim1", ([0, 1], (2,), P("x", None)), ([0, 1], (2,), P(None, "x"))),
    ("dim0 -> replicated", ([0, 1], (2,), P("x", None)), ([0, 1], (2,), P())),
    ("swapped dim0", ([0, 1], (2,), P("x", None)), ([1, 0], (2,), P("x", None))),
]


@pytest.mark.parametrize("pair", CONVERT_PAIRS, ids=[_pair_id(p) for p in CONVERT_PAIRS])
def test_convert_every_pair(pair, engine):
  """All 20 pairs, both engines: exhaustive 8/16-bit sources, f32 specials."""
  src_t, dst_t = pair
  host = _convert_input(src_t, (256, 320), seed=31)
  cuda = _cuda()
  before = cuda.peer_stats()["converts"]
  for _, s, d in CONVERT_LAYOUTS[:2]:
    _convert_case(_sharding(*s), _sharding(*d), host, dst_t)
  if engine == "auto":
    assert cuda.peer_stats()["converts"] > before
  engine.check()


SOME_PAIRS = [(np.float32, BF16), (BF16, np.float32), (np.float32, F8E4M3),
              (np.float16, F8E5M2), (F8E5M2, np.float16), (BF16, np.float16)]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", CONVERT_LAYOUTS, ids=[c[0] for c in CONVERT_LAYOUTS])
def test_convert_routes(layout, route, engine):
  """Every route and layout, strided and contiguous boxes, odd sizes (unaligned units)."""
  _, s, d = layout
  for i, (src_t, dst_t) in enumerate(SOME_PAIRS):
    shape = (64, 96) if i % 2 == 0 else (18, 14)
    host = _convert_input(src_t, shape, seed=40 + i)
    _convert_case(_sharding(*s), _sharding(*d), host, dst_t, route=route)
  engine.check()


@pytest.mark.parametrize("route", ROUTES)
def test_convert_inside_jit(route, engine):
  ids = [0, 1]
  src = _sharding(ids, (2,), P("x", None))
  for dst_spec in (P(None, "x"), P(), P("x", None)):
    dst = _sharding(ids, (2,), dst_spec)
    for i, (src_t, dst_t) in enumerate(SOME_PAIRS):
      f = jax.jit(lambda a, dst=dst, dst_t=dst_t: jax_m2n.reshard(
          a, dst, dtype=dst_t, route=route, src_sharding=src))
      host = _convert_input(src_t, (64, 128), seed=60 + i)
      _check_convert(f(jax.device_put(host, src)), host, dst_t, dst, src)
  engine.check()


def test_convert_pytree_and_large(engine):
  """A pytree with a dtype per leaf (f32 -> bf16; bf16 -> bf16 moves unconverted) and a
  64 MiB leaf cut in chunks."""
  src = _sharding([0, 1], (2,), P("x", None))
  dst = _sharding([0, 1], (2,), P(None, "x"))
  big = _convert_input(np.float32, (2048, 8192), seed=71)
  keep = _random((64, 32), BF16, 72)
  tree = {"w": jax.device_put(big, src), "k": jax.device_put(keep, src)}
  out = jax_m2n.reshard(tree, {"w": dst, "k": dst}, dtype={"w": BF16, "k": BF16})
  _check_convert(out["w"], big, BF16, dst, src)
  _check(out["k"], jax.device_put(tree["k"], dst), dst)
  engine.check()
