"""GPU tests that need only one GPU: the CUDA conversion kernels and the asynchronous
eager call, on a single device (a one-GPU workstation runs these; tests/gpu_test.py needs
2 or 4 GPUs for the cross-device cases).

- Every fused dtype pair (f32, f16, bf16, f8_e4m3fn, f8_e5m2), every value of the narrow
  types and random f32 bit patterns (NaNs, infinities, subnormals included):
  `reshard(x, dst, dtype=d)` equals `jax.device_put(x.astype(d), dst)` bit for bit,
  both on the GPU (XLA GPU's rounding and NaN rule), eagerly and inside jit.
- The eager call on CUDA returns arrays that later work waits for: back-to-back
  dependent calls, a pytree, a donated source.
All are skipped without a GPU (CI).

Run on the GPU machine (after building jax_m2n/_ffi_cuda.so):
  NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/gpu_one_test.py
"""

import gpus  # first: keeps NVLink multicast off before JAX loads NCCL

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m2n  # noqa: E402


GPUS = gpus.devices()
pytestmark = pytest.mark.skipif(not GPUS, reason="needs a GPU")

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FUSED = (F32, F16, BF16, E4M3, E5M2)
PAIRS = [(a, b) for a in FUSED for b in FUSED if a != b]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _values(dtype, n_f32=1 << 20):
  """Every value of a 1- or 2-byte type; for f32, random bit patterns of every class."""
  if dtype.itemsize < 4:
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32).astype(UINT[dtype.itemsize])
  else:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, n_f32, dtype=np.uint64).astype(np.uint32)
    # Values next to every rounding boundary of the narrow types.
    near = np.arange(-(1 << 16), 1 << 16, dtype=np.int64).astype(np.uint32) << 13
    bits = np.concatenate([bits, near, near + 1, near - 1])
  bits = bits[: bits.size // 256 * 256]
  return bits.view(dtype).reshape(-1, 256)


def _assert_bits_equal(y, ref):
  assert y.dtype == ref.dtype and y.shape == ref.shape, (y.dtype, ref.dtype)
  assert y.sharding.is_equivalent_to(ref.sharding, y.ndim), (y.sharding, ref.sharding)
  a, b = np.asarray(y), np.asarray(ref)
  ua, ub = a.view(UINT[a.dtype.itemsize]), b.view(UINT[b.dtype.itemsize])
  bad = np.flatnonzero(ua != ub)
  assert bad.size == 0, (f"{bad.size} values differ; first at {bad[0]}: "
                         f"{ua.flat[bad[0]]:#x} vs astype's {ub.flat[bad[0]]:#x}")


def _one():
  return NamedSharding(Mesh(np.array(GPUS[:1]), ("x",)), P())


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS,
                         ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
@pytest.mark.parametrize("in_jit", [False, True], ids=["eager", "jit"])
def test_every_value_converts_like_astype_on_the_gpu(src_dtype, dst_dtype, in_jit):
  dst = _one()
  x = jax.device_put(_values(src_dtype), dst)
  if in_jit:
    y = jax.jit(lambda a: jax_m2n.reshard(a, dst, dtype=dst_dtype, src_sharding=dst))(x)
  else:
    y = jax_m2n.reshard(x, dst, dtype=dst_dtype)
  _assert_bits_equal(y, jax.device_put(x.astype(dst_dtype), dst))


def test_back_to_back_dependent_calls_see_each_others_results():
  """Each call reads the previous call's output before it is ready (async eager)."""
  dst = _one()
  host = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)
  x = jax.device_put(host, dst)
  a = jax_m2n.reshard(x, dst, dtype=BF16)
  b = jax_m2n.reshard(a, dst, dtype=F32)
  c = jax_m2n.reshard(b, dst, dtype=F16)
  ref = jax.device_put(host.astype(BF16).astype(F32).astype(F16), dst)
  _assert_bits_equal(c, ref)
  _assert_bits_equal(b, jax.device_put(host.astype(BF16).astype(F32), dst))


def test_pytree_with_a_prefix_of_dtypes_and_a_donated_source():
  dst = _one()
  rng = np.random.default_rng(2)
  host = {"w": rng.standard_normal((1024, 512)).astype(np.float32),
          "b": rng.standard_normal((512,)).astype(np.float32),
          "e": rng.standard_normal((64, 64)).astype(np.float16)}
  tree = jax.device_put(host, dst)
  out = jax_m2n.reshard(tree, dst, dtype={"w": BF16, "b": None, "e": E5M2},
                        donate={"w": True, "b": False, "e": False})
  assert tree["w"].is_deleted() and not tree["b"].is_deleted()
  _assert_bits_equal(out["w"], jax.device_put(host["w"].astype(BF16), dst))
  _assert_bits_equal(out["b"], jax.device_put(host["b"], dst))
  _assert_bits_equal(out["e"], jax.device_put(host["e"].astype(E5M2), dst))


def test_large_conversion_result_is_waited_for_by_later_work():
  """256 Mi f32 -> bf16: the call may return before the kernel ran; jnp work and
  block_until_ready on its result wait for it."""
  dst = _one()
  x = jax.device_put(jax.numpy.arange(1 << 28, dtype=jax.numpy.float32), dst)
  y = jax_m2n.reshard(x, dst, dtype=BF16)
  total = jax.jit(lambda v: v[::4096].astype(F32).sum())(y)
  ref = jax.jit(lambda v: v.astype(BF16)[::4096].astype(F32).sum())(x)
  assert float(total) == float(ref)
  y.block_until_ready()
  assert y.is_ready()
