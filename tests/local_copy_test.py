"""The local data plane's copies on CPU (jax_m2n/_src/local_copy.py, xla_ffi/local_copy.cc).

- Random layouts: a global array of rank 0-4 cut into random source shards (host
  buffers), outputs that are random regions of it, boxes = their intersections with the
  shards; every output bitwise equal to numpy slicing + `jnp.astype` (XLA's convert).
- Every same-dtype copy the jobs layer publishes (manifest.DTYPES; the 64-bit ones under
  jax_enable_x64), every fused conversion over every value of the narrow types and
  random f32 bit patterns (NaNs, infinities, subnormals).
- Bad schedules are refused before anything runs, naming the rule (gaps, overlaps, boxes
  outside their shards, dtype pairs, ranks, pointers).
- Two processes: one stores arrays into a memfd segment, the other fetches the fd with a
  ticket and local_copies its outputs (with conversions), bitwise.
- The timing of 256 MiB from a mapped segment into a fresh output beside one np.copyto
  into fresh memory (printed; bounded loosely: CI's 2 cores are shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_m2n._src.errors import ReshardRuntimeError, ReshardTypeError, ReshardValueError
from jax_m2n._src.jobs.manifest import DTYPES
from jax_m2n._src.local_copy import Box, Out, local_copy, local_store
from jax_m2n._src.local_memory import Segment
import local_cases
from local_cases import (BF16, F32, FUSED, PAIRS, all_values, bits, case, cut,
                         fill_boxes, min_ms, random_values)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "local_worker.py")

def _check(device, sources, outputs, boxes, full):
  pointers = [src.ctypes.data for _, src in sources]
  outs = [Out(shape, dtype) for _, shape, dtype in outputs]
  got = local_copy(device, pointers, boxes, outs)
  for (start, shape, dtype), out in zip(outputs, got):
    region = tuple(slice(s, s + n) for s, n in zip(start, shape))
    want = np.asarray(jnp.asarray(full)[region].astype(dtype))
    assert out.devices() == {device}
    assert out.dtype == dtype and out.shape == shape
    np.testing.assert_array_equal(bits(np.asarray(out)), bits(want))


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts(seed):
  rng = np.random.default_rng(seed)
  src = FUSED[seed % len(FUSED)]
  outs = [FUSED[int(i)] for i in rng.integers(0, len(FUSED), int(rng.integers(1, 4)))]
  device = jax.devices()[seed % len(jax.devices())]
  _check(device, *case(rng, src, outs))


@pytest.mark.parametrize("name", DTYPES)
def test_same_dtype_copies(name):
  dtype = np.dtype(jnp.dtype(name))
  with jax.enable_x64(dtype.itemsize == 8 or name == "complex128"):
    for seed in range(4):
      rng = np.random.default_rng(seed)
      _check(jax.devices()[0], *case(rng, dtype, [dtype, dtype], rank=seed + 1))


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a.name}-{b.name}" for a, b in PAIRS])
def test_every_conversion(src, dst):
  full = all_values(src, np.random.default_rng(0))
  rows = full.shape[0]
  # Two shards (top and bottom halves), a strided box from each into one output.
  sources = [((0, 0), np.ascontiguousarray(full[: rows // 2])),
             ((rows // 2, 0), np.ascontiguousarray(full[rows // 2:]))]
  boxes = [Box(0, 0, sources[0][1].shape, src, (0, 0), (0, 0), (rows // 2, 64)),
           Box(0, 1, sources[1][1].shape, src, (0, 0), (rows // 2, 0),
               (rows - rows // 2, 64))]
  _check(jax.devices()[1], sources, [((0, 0), full.shape, dst)], boxes, full)


def test_large_calls_split_over_threads():
  """32 MiB from 6 shards into two outputs (one converting): above 8 MiB per thread the
  CPU handler splits boxes into slabs over threads; the result is the same."""
  rng = np.random.default_rng(3)
  shape = (2048, 4096)
  full = random_values(rng, shape, F32)
  sources = []
  for start, extent in cut(rng, shape, 6):
    region = tuple(slice(s, s + e) for s, e in zip(start, extent))
    sources.append((start, np.array(full[region], order="C")))
  outputs = [((0, 0), shape, BF16), ((100, 7), (1500, 4000), F32)]
  _check(jax.devices()[4], sources, outputs, fill_boxes(sources, outputs), full)


def _refused(match, boxes, outs, pointers=None, error=ReshardValueError):
  pointers = [1 << 20] * 4 if pointers is None else pointers
  with pytest.raises(error, match=match):
    local_copy(jax.devices()[0], pointers, boxes, outs)


def test_bad_schedules_are_refused():
  out = [Out((4, 6), F32)]
  half = Box(0, 0, (4, 6), F32, (0, 0), (0, 0), (2, 6))
  _refused("cover every element exactly once; they cover 12 of 24", [half], out)
  _refused("boxes 0 and 1 must be disjoint", [half, half._replace(extent=(3, 6))], out)
  _refused(r"src_start\[0\] \+ extent = 5 must be <= src_dims = 4",
           [half._replace(src_start=(3, 0))], out)
  _refused(r"dst_start\[1\] \+ extent = 7 must be <= the output's dim = 6",
           [half._replace(dst_start=(0, 1))], out)
  _refused("slot must be in", [half._replace(slot=7)], out)
  _refused("src_dtype must equal its output's dtype int32 or both",
           [half._replace(src_dtype=F32)], [Out((4, 6), np.dtype(np.int32))])
  _refused("must have its output's rank 2", [half._replace(extent=(2,))], out)
  _refused("out must be in", [half._replace(out=1)], out)
  _refused("pointers must be a 1-D integer array", [half], out, pointers=[[1]],
           error=ReshardTypeError)
  _refused("boxes must be local_copy.Box", [tuple(half)], out, error=ReshardTypeError)
  _refused("dtype must be one JAX holds as is", [], [Out((0,), np.dtype(np.int64))])


def test_null_pointer_fails_at_run_time():
  box = Box(0, 0, (2,), F32, (0,), (0,), (2,))
  with pytest.raises(ReshardRuntimeError, match="pointer table entry 0 .* must not be null"):
    local_copy(jax.devices()[0], [0], [box], [Out((2,), F32)])[0].block_until_ready()


def test_empty_and_scalar_outputs():
  x = np.asarray(3.5, np.float32)
  got = local_copy(jax.devices()[2], [x.ctypes.data],
                   [Box(1, 0, (), F32, (), (), ())],
                   [Out((0, 3), F32), Out((), BF16)])
  assert got[0].shape == (0, 3)
  assert float(got[1]) == 3.5 and got[1].dtype == BF16


def test_box_fields_may_be_lists():
  a = np.arange(6, dtype=np.int8).reshape(2, 3)
  box = Box(0, 0, [2, 3], np.dtype(np.int8), [0, 1], [0, 0], [2, 2])
  out, = local_copy(jax.devices()[0], [a.ctypes.data], [box], [Out([2, 2], np.int8)])
  assert np.asarray(out).tolist() == [[1, 2], [4, 5]]


def test_program_is_reused_for_new_addresses():
  a = np.arange(8, dtype=np.float32)
  b = a + 100
  box = [Box(0, 0, (8,), F32, (2,), (0,), (4,))]
  out = [Out((4,), F32)]
  from jax_m2n._src import local_copy as module  # noqa: PLC0415
  first = local_copy(jax.devices()[0], [a.ctypes.data], box, out)[0]
  compiled = module._executable.cache_info()
  second = local_copy(jax.devices()[0], [b.ctypes.data], box, out)[0]
  assert np.asarray(first).tolist() == [2, 3, 4, 5]
  assert np.asarray(second).tolist() == [102, 103, 104, 105]
  now = module._executable.cache_info()  # the second call compiled nothing
  assert now.hits == compiled.hits + 1 and now.misses == compiled.misses


def test_copy_all_of_several_devices_new_and_repeated_addresses():
  """copy_all over copiers of several devices, int64 pointer arrays as a pull passes
  them: new addresses (checked, sent), the same again (the tables held on the
  devices), then some devices' new and others' repeated in one call; each job gets
  its own device's outputs, bitwise."""
  from jax_m2n._src import local_copy as module  # noqa: PLC0415
  devices = jax.devices()[:3]
  box = [Box(0, 0, (8,), F32, (1,), (0,), (6,))]
  copiers = [module.copier(d, box, [Out((6,), F32)], 1) for d in devices]
  sources = [np.arange(8, dtype=np.float32) + 10 * k for k in range(6)]
  for round_, picks in enumerate(((0, 1, 2), (0, 1, 2), (0, 4, 2), (5, 4, 2))):
    jobs = [(c, np.array([sources[i].ctypes.data], np.int64))
            for c, i in zip(copiers, picks)]
    for i, outs, device in zip(picks, module.copy_all(jobs), devices):
      assert outs[0].devices() == {device}, round_
      np.testing.assert_array_equal(np.asarray(outs[0]), sources[i][1:7])


def test_many_like_outputs_share_programs_and_keep_their_order():
  """900 outputs of three kinds, interleaved, each read from its own place: outputs
  come back in order, bitwise, from one program per kind and PROGRAM_OUTPUTS (starts
  folded into pointers on CPU, so like outputs at other places share a program)."""
  from jax_m2n._src import local_copy as module  # noqa: PLC0415
  src = np.arange(900 * 12, dtype=np.float32).reshape(900, 12)
  kinds = [((12,), (12,)), ((2, 3), (3, 4)), ((5,), (12,))]
  boxes, outs, want = [], [], []
  for i in range(900):
    shape, held = kinds[i % 3]
    if len(shape) == 1:
      boxes.append(Box(i, 0, (900, 12), F32, (i, 0), (0, 0), (1, shape[0])))
      outs.append(Out((1, shape[0]), F32))
      want.append(src[i:i + 1, :shape[0]])
    else:  # rows 1..2, columns 1..3 of the row seen as a (3, 4) shard: a strided box
      boxes.append(Box(i, i, held, F32, (1, 1), (0, 0), shape))
      outs.append(Out(shape, F32))
      want.append(src[i].reshape(held)[1:3, 1:4])
  pointers = [src[i].ctypes.data if i % 3 == 1 else src.ctypes.data for i in range(900)]
  programs = module._programs(tuple(boxes), tuple(outs), jax.devices()[1])
  assert len({id(p[0]) for p in programs}) <= 3 * 2  # per kind: a full program, a tail
  got = module.copier(jax.devices()[1], boxes, outs, 900)(pointers)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), w)


def test_a_callers_transfer_guard_does_not_refuse_the_copys_own_tables():
  """The pointer tables a copy sends to its device are jax_m2n's, not the caller's data:
  a caller that disallows explicit host -> device transfers (tunix syncs weights so)
  still copies."""
  src = np.arange(64, dtype=np.float32) + 0.5  # new addresses: the tables are sent
  box = [Box(0, 0, (64,), F32, (8,), (0,), (16,))]
  with jax.transfer_guard_host_to_device("disallow_explicit"):
    got = local_copy(jax.devices()[2], [src.ctypes.data], box, [Out((16,), F32)])[0]
  np.testing.assert_array_equal(np.asarray(got), src[8:24])


def test_local_store_into_a_segment():
  device = jax.devices()[3]
  arrays = [jax.device_put(np.arange(n, dtype=np.int32) * (i + 1), device)
            for i, n in enumerate((5, 0, 7))]
  with Segment.create(4096) as seg:
    done = local_store(arrays, seg.address, [0, 64, 128])
    assert done.block_until_ready().is_ready()
    assert seg.array[:20].view(np.int32).tolist() == list(range(5))
    assert seg.array[128:156].view(np.int32).tolist() == [3 * i for i in range(7)]
  with pytest.raises(ReshardValueError, match="one entry per array"):
    local_store(arrays, 0, [0])
  with pytest.raises(ReshardValueError, match="all live on one device"):
    local_store([arrays[0], jax.device_put(1, jax.devices()[0])], 0, [0, 8])


def _run(argv, timeout=180, **kwargs):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen([sys.executable, WORKER, *argv], env=env, text=True, **kwargs)


def test_two_processes_bitwise():
  """A publisher program stores 4 shards into a memfd segment; a reader program fetches
  the fd with its ticket and copies 3 outputs (f32, f32 -> bf16, f32 -> f16) out of it."""
  pub = _run(["--role", "publisher", "--seed", "7"], stdin=subprocess.PIPE,
             stdout=subprocess.PIPE)
  try:
    line = pub.stdout.readline()
    assert line, "the publisher printed nothing"
    json.loads(line)
    reader = _run(["--role", "reader", "--seed", "7", "--info", line.strip()],
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = reader.communicate(timeout=180)
    assert reader.returncode == 0 and out.strip().endswith("OK"), out
  finally:
    local_cases.end(pub, 30)


def test_timing_256mib_against_one_memcpy():
  """One local_copy of 256 MiB out of a mapped segment into a fresh output beside one
  np.copyto into fresh memory, min of 10 each (issue 42's goal: <= 1.5x the copy).
  Bounded at 3x here: the 2 CPU cores are shared with other work."""
  nbytes = 256 << 20
  rows = nbytes // 4 // 4096
  src = np.random.default_rng(0).integers(0, 1 << 32, (rows, 4096), dtype=np.uint32)
  with Segment.create(nbytes) as seg:
    seg.array[:] = src.view(np.uint8).ravel()
    with Segment.open(seg.read_only_fd(), nbytes) as reader:
      box = [Box(0, 0, (rows, 4096), F32, (0, 0), (0, 0), (rows, 4096))]
      out = [Out((rows, 4096), F32)]
      device = jax.devices()[0]
      pull = lambda: local_copy(device, [reader.address], box, out)[0].block_until_ready()
      got = local_copy(device, [reader.address], box, out)[0]
      assert np.array_equal(np.asarray(got).view(np.uint32), src)
      del got
      pull_ms = min_ms(pull)
      copy_ms = min_ms(lambda: np.copyto(np.empty_like(src), src))
  print(f"\n256 MiB: local_copy from a mapped segment {pull_ms:.1f} ms, one np.copyto "
        f"into fresh memory {copy_ms:.1f} ms ({pull_ms / copy_ms:.2f}x; "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
  assert pull_ms <= 3 * copy_ms
