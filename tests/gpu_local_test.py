"""The local data plane on one GPU (skipped without one, as on CI): CUDA IPC memory,
jax_m2n_local_store and jax_m2n_local_copy on the XLA stream.

- In one program: arrays stored into this process's IPC memory, then random layouts
  and every fused conversion copied out of it, bitwise against `jnp.astype` on the GPU
  (XLA GPU's rounding and NaN rule); a handle of this process cannot be opened here;
  misaligned pointers are refused before anything runs.
- Two programs on one GPU (XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 each): the publisher
  stores 4 shards into IPC memory, the reader opens the handle and copies 3 outputs
  (f32, f32 -> bf16, f32 -> f16), bitwise; then 256 MiB and 1 GiB timed (min of 10):
  the pull (same dtype and to bfloat16) beside an in-process device copy, and the
  publisher's store.

Run on the GPU machine (after building jax_m2n/_ffi_cuda.so):
  NCCL_NVLS_ENABLE=0 python3 -m pytest -q -s tests/gpu_local_test.py
"""

import gpus  # first: keeps NVLink multicast off before JAX loads NCCL

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import local_cases  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "local_worker.py")
HAVE = gpus.count_without_jax()
pytestmark = pytest.mark.skipif(HAVE < 1, reason="needs a GPU")
ALIGN = 256


def _gpu():
  devices = gpus.devices()
  if not devices:
    pytest.skip("JAX sees no GPU")
  return devices[0]


def _stored(device, sources):
  """The sources stored into a new DeviceSegment at 256-aligned offsets: (segment,
  pointers)."""
  import jax  # noqa: PLC0415
  from jax_m2n._src.local_copy import local_store  # noqa: PLC0415
  from jax_m2n._src.local_memory import DeviceSegment  # noqa: PLC0415
  offsets, at = [], 0
  for _, src in sources:
    offsets.append(at)
    at += max(ALIGN, -(-src.nbytes // ALIGN) * ALIGN)
  seg = DeviceSegment.create(device, at)
  arrays = [jax.device_put(src, device) for _, src in sources]
  local_store(arrays, seg.address, offsets).block_until_ready()
  return seg, [seg.address + o for o in offsets]


def _check(device, sources, outputs, boxes, full):
  import jax.numpy as jnp  # noqa: PLC0415
  from jax_m2n._src.local_copy import Out, local_copy  # noqa: PLC0415
  from local_cases import bits  # noqa: PLC0415
  seg, pointers = _stored(device, sources)
  try:
    got = local_copy(device, pointers, boxes, [Out(s, d) for _, s, d in outputs])
    reference = jnp.asarray(full)  # on the GPU: XLA GPU's convert
    for (start, shape, dtype), out in zip(outputs, got):
      region = tuple(slice(s, s + n) for s, n in zip(start, shape))
      want = np.asarray(reference[region].astype(dtype))
      np.testing.assert_array_equal(bits(np.asarray(out)), bits(want))
  finally:
    seg.close()


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_in_one_program(seed):
  from local_cases import FUSED, case  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  outs = [FUSED[int(i)] for i in rng.integers(0, len(FUSED), 3)]
  _check(_gpu(), *case(rng, FUSED[seed % len(FUSED)], outs))


def test_every_conversion_in_one_program():
  from local_cases import PAIRS, all_values, fill_boxes  # noqa: PLC0415
  device = _gpu()
  for src, dst in PAIRS:
    full = all_values(src, np.random.default_rng(0))
    rows = full.shape[0]
    sources = [((0, 0), np.ascontiguousarray(full[: rows // 2])),
               ((rows // 2, 0), np.ascontiguousarray(full[rows // 2:]))]
    outputs = [((0, 0), full.shape, dst), ((1, 3), (rows - 2, 50), dst)]
    _check(device, sources, outputs, fill_boxes(sources, outputs), full)


def test_own_handle_and_misaligned_pointers_are_refused():
  from jax_m2n._src.errors import ReshardRuntimeError, ReshardValueError  # noqa: PLC0415
  from jax_m2n._src.local_copy import Box, Out, local_copy  # noqa: PLC0415
  from jax_m2n._src.local_memory import DeviceSegment  # noqa: PLC0415
  device = _gpu()
  with DeviceSegment.create(device, 1 << 20) as seg:
    assert len(seg.handle) == 64 and seg.address % ALIGN == 0
    with pytest.raises(ReshardRuntimeError, match="cudaIpcOpenMemHandle"):
      DeviceSegment.open(device, seg.handle, 1 << 20)
    # The failed open leaves no error behind on this thread: an eager converting
    # reshard launches its kernel here next (it once reported "invalid device context").
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import jax_m2n  # noqa: PLC0415
    x = jax.device_put(np.arange(1024, dtype=np.float32) / 7, device)
    y = jax_m2n.reshard(x, jax.sharding.SingleDeviceSharding(device), dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(jnp.bfloat16)))
    box = [Box(0, 0, (4,), np.dtype(np.float32), (0,), (0,), (4,))]
    with pytest.raises(ReshardValueError, match="multiple of 32"):
      local_copy(device, [seg.address + 4], box, [Out((4,), np.dtype(np.float32))])


def _env():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_MEM_FRACTION="0.2",
             NCCL_NVLS_ENABLE="0")
  env.pop("JAX_PLATFORMS", None)
  env.pop("XLA_FLAGS", None)
  return env


def _two_programs(seed, scale=1, time=False, timeout=300):
  """Runs publisher and reader; returns (publisher's JSON, reader's last line)."""
  extra = ["--time"] if time else []
  common = ["--platform", "gpu", "--seed", str(seed), "--scale", str(scale), *extra]
  pub = subprocess.Popen([sys.executable, WORKER, "--role", "publisher", *common],
                         env=_env(), text=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
  try:
    line = pub.stdout.readline()
    assert line, "the publisher printed nothing"
    reader = subprocess.run([sys.executable, WORKER, "--role", "reader", "--info",
                             line.strip(), *common], env=_env(), text=True,
                            capture_output=True, timeout=timeout)
    out = reader.stdout.strip().splitlines()
    assert reader.returncode == 0 and out and out[-1].startswith("OK"), (
        reader.stdout + reader.stderr)
    return json.loads(line), out[-1]
  finally:
    local_cases.end(pub, 60)


def test_two_programs_bitwise():
  _two_programs(seed=3)


@pytest.mark.parametrize("scale,label", [(1 << 14, "256 MiB"), (1 << 16, "1 GiB")])
def test_two_programs_timing(scale, label):
  info, line = _two_programs(seed=4, scale=scale, time=True, timeout=600)
  print(f"\n{label}: {line} store_ms={info['store_ms']:.3f}")
