"""The CPU custom call `jax_m2n_reshard`, driven directly with hand-built schedules.

A second implementation of docs/schedule_format.md (`_encode` below, independent of
jax_m2n/_src/schedule.py) feeds jax.ffi.ffi_call on 8 forced CPU devices: inside jit
through shard_map (one SPMD program), and as per-device jitted programs dispatched from
threads (the eager path). Results are checked bytewise with numpy. Also: bad schedules
fail with clear errors and no crash; a missing participant fails every waiting device
after timeout_ms; a failed generation leaves the site usable.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import itertools
import os
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

TARGET = "jax_m2n_reshard"


def _load_ffi():
  """`jax_m2n._ffi`, or the built .so loaded by path if the package cannot import yet."""
  try:
    return importlib.import_module("jax_m2n._ffi")
  except ImportError:
    pass
  for root in sys.path:
    for path in glob.glob(os.path.join(root or ".", "jax_m2n", "_ffi*.so")):
      spec = importlib.util.spec_from_file_location("jax_m2n._ffi", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      sys.modules["jax_m2n._ffi"] = module
      return module
  raise ImportError("jax_m2n/_ffi*.so not found on sys.path; build //jax_m2n:_ffi.so")


_ffi = _load_ffi()
for _name, _target in _ffi.registrations().items():
  jax.ffi.register_ffi_target(_name, _target, platform="cpu", api_version=1)

# --------------------------------------------------------------------------------------
# The schedule format, written out again from docs/schedule_format.md.
# --------------------------------------------------------------------------------------
MAGIC = 0x4D324E5F
VERSION = 3
MAX_RANK = 8
OP_FIXED = 11  # an op record: these, then (extent, src start, dst start) per dim of its rank
STAGES = ("local", "inject", "forward", "fanout", "gather", "bcast")
OPERAND, RESULT, WORKSPACE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Op:
  step: int
  stage: str
  tensor: int
  src: tuple[int, int, int]  # (device, kind, slot)
  dst: tuple[int, int, int]
  extent: tuple[int, ...]
  src_start: tuple[int, ...]
  dst_start: tuple[int, ...]
  src_pack: int = -1
  dst_pack: int = -1


@dataclasses.dataclass(frozen=True)
class Tensor:
  dtype: np.dtype
  shape: tuple[int, ...]  # global
  types: tuple[int, int] = (0, 0)  # (src_type, dst_type) codes; dtype: the wire type


def _encode(tensors, devices, ops, *, ws=None, n_steps=None, device=None):
  """The `schedule` attribute: every op (SPMD), or only `device`'s (eager)."""
  ws = ws or {}
  n_steps = n_steps if n_steps is not None else max((o.step for o in ops), default=-1) + 1
  ops = sorted(ops, key=lambda o: o.step)  # stable: "sorted by step, then as listed"
  if device is not None:
    ops = [o for o in ops if device in (o.src[0], o.dst[0])]
  out = [MAGIC, VERSION, len(tensors), len(devices), n_steps, len(ops), OP_FIXED, MAX_RANK]
  out += sorted(devices)
  out += [ws.get(d, 0) for d in sorted(devices)]
  for t in tensors:
    out += [np.dtype(t.dtype).itemsize, len(t.shape)]
    out += list(t.shape) + [0] * (MAX_RANK - len(t.shape)) + list(t.types)
  for o in ops:
    out += [o.step, STAGES.index(o.stage), o.tensor, *o.src, *o.dst, o.src_pack, o.dst_pack]
    for d in range(len(tensors[o.tensor].shape)):
      out += [o.extent[d], o.src_start[d], o.dst_start[d]]
  return np.array(out, np.int64)


_site_counter = itertools.count(1000)


def _new_site():
  """A site no other test uses (sites are process-wide rendezvous keys)."""
  return next(_site_counter)


def _call(schedule, result_avals, ws_bytes, site, timeout_ms):
  results = list(result_avals) + [jax.ShapeDtypeStruct((max(1, ws_bytes),), jnp.uint8)]
  call = jax.ffi.ffi_call(TARGET, results, has_side_effect=True)

  def f(*operands):
    return call(*operands, schedule=schedule, site=np.int64(site),
                timeout_ms=np.int64(timeout_ms))
  return f


def _mesh():
  return Mesh(np.array(jax.devices()), ("x",))


def run_spmd(schedule, operands, in_specs, local_results, out_specs, ws_bytes, site,
             timeout_ms=20000, with_workspace=False):
  """One jit(shard_map) over the 8 devices; returns the global results (and, if asked,
  the workspaces as one uint8 array of 8 rows)."""
  f = _call(schedule, [jax.ShapeDtypeStruct(s, d) for s, d in local_results], ws_bytes,
            site, timeout_ms)
  g = jax.jit(jax.shard_map(lambda *xs: tuple(f(*xs)), mesh=_mesh(),
                            in_specs=tuple(in_specs), out_specs=tuple(out_specs) + (P("x"),),
                            check_vma=False))
  out = [np.asarray(o) for o in jax.block_until_ready(g(*operands))]
  if with_workspace:
    return out[:-1] + [out[-1].reshape(8, -1)]
  return out[:-1]


def run_eager(programs, timeout_s=60.0):
  """Runs per-device programs [(device, fn, operands)], one thread each.

  Returns, in the order of `programs`, (results without the workspace, or the exception
  raised, and the seconds the call took).
  """
  out = [None] * len(programs)

  def work(i, fn, operands):
    t0 = time.monotonic()
    try:
      res = jax.block_until_ready(fn(*operands))
      out[i] = ([np.asarray(r) for r in res[:-1]], time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - reported to the test
      out[i] = (e, time.monotonic() - t0)

  threads = [threading.Thread(target=work, args=(i, fn, operands))
             for i, (_, fn, operands) in enumerate(programs)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout_s)
    assert not t.is_alive(), "a per-device program hung"
  return out


def eager_program(device, schedule, local_results, ws_bytes, site, timeout_ms=20000):
  f = _call(schedule, [jax.ShapeDtypeStruct(s, d) for s, d in local_results], ws_bytes,
            site, timeout_ms)
  return jax.jit(f, out_shardings=SingleDeviceSharding(device))


def _bytes_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                                np.ascontiguousarray(b).reshape(-1).view(np.uint8))


def _random(dtype, shape, seed=0):
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, shape).astype(bool)
  if dtype.kind == "c":
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
  if dtype.kind in "iu":
    return rng.integers(-100, 100, shape).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


DEVICES = list(range(8))


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
  assert [d.id for d in jax.devices()] == DEVICES, jax.devices()


# --------------------------------------------------------------------------------------
# Inside jit: shard_map over 8 devices.
# --------------------------------------------------------------------------------------


def test_module_helpers():
  assert _ffi.schedule_version() == VERSION == _ffi.SCHEDULE_VERSION
  stages = _ffi.registrations()[TARGET]
  assert set(stages) == {"instantiate", "execute"}
  (name, reg), = _ffi.type_registrations().items()
  assert set(reg) == {"type_id", "type_info"}, name


def test_ring_allgather_forward_steps():
  """Rows sharded -> replicated, as a ring: step s reads what step s-1 wrote."""
  x = _random(np.float32, (16, 4))
  t = Tensor(np.float32, (16, 4))
  ops = [Op(0, "local", 0, (i, OPERAND, 0), (i, RESULT, 0), (2, 4), (0, 0), (2 * i, 0))
         for i in DEVICES]
  for s in range(1, 8):
    for j in DEVICES:
      b = (j - s) % 8
      ops.append(Op(s, "forward", 0, ((j - 1) % 8, RESULT, 0), (j, RESULT, 0), (2, 4),
                    (2 * b, 0), (2 * b, 0)))
  sched = _encode([t], DEVICES, ops)
  site = _new_site()
  for _ in range(3):  # generations 0, 1, 2 of one site
    (out,) = run_spmd(sched, [x], [P("x")], [((16, 4), np.float32)], [P("x")], 0, site)
    for j in DEVICES:
      _bytes_equal(out[16 * j:16 * (j + 1)], x)


def test_chain_forward_fanout_chunks():
  """0 -inject-> 1 -forward-> 2 -forward-> 3 -fanout-> 4..7, three chunks pipelined."""
  y = _random(np.int32, (6, 10), seed=1)
  operands = np.concatenate([y] + [np.full_like(y, -1)] * 7)  # only device 0's is read
  t = Tensor(np.int32, (6, 10))
  chunks = [(0, 2), (2, 2), (4, 2)]  # (first row, rows)
  ops = []
  for c, (r, n) in enumerate(chunks):
    ops.append(Op(c, "local", 0, (0, OPERAND, 0), (0, RESULT, 0), (n, 10), (r, 0), (r, 0)))
    ops.append(Op(c, "inject", 0, (0, OPERAND, 0), (1, RESULT, 0), (n, 10), (r, 0), (r, 0)))
    for hop in (1, 2):
      ops.append(Op(hop + c, "forward", 0, (hop, RESULT, 0), (hop + 1, RESULT, 0), (n, 10),
                    (r, 0), (r, 0)))
    for j in (4, 5, 6, 7):
      ops.append(Op(3 + c, "fanout", 0, (3, RESULT, 0), (j, RESULT, 0), (n, 10), (r, 0),
                    (r, 0)))
  sched = _encode([t], DEVICES, ops)
  assert _ffi.decode_schedule(sched)["n_steps"] == 6
  (out,) = run_spmd(sched, [operands], [P("x")], [((6, 10), np.int32)], [P("x")], 0,
                    _new_site())
  for j in DEVICES:
    _bytes_equal(out[6 * j:6 * (j + 1)], y)


def test_gather_into_workspace_then_bcast():
  """Rows sharded -> gathered in device 0's workspace (at an offset) -> column shards."""
  z = _random(np.float32, (8, 16), seed=2)
  t = Tensor(np.float32, (8, 16))
  offset = 256
  ws = {0: offset + z.nbytes}
  ops = [Op(0, "gather", 0, (i, OPERAND, 0), (0, WORKSPACE, offset), (1, 16), (0, 0), (i, 0))
         for i in DEVICES]
  ops += [Op(1, "bcast", 0, (0, WORKSPACE, offset), (j, RESULT, 0), (8, 2), (0, 2 * j), (0, 0))
          for j in DEVICES]
  sched = _encode([t], DEVICES, ops, ws=ws)
  (out,) = run_spmd(sched, [z], [P("x")], [((8, 2), np.float32)], [P(None, "x")],
                    ws[0], _new_site())
  _bytes_equal(out, z)


def test_strided_3d_boxes():
  """(8, 6, 8): dim 0 sharded -> dim 2 sharded; boxes strided on both sides, 2 chunks."""
  a = _random(np.int32, (8, 6, 8), seed=3)
  t = Tensor(np.int32, (8, 6, 8))
  ops = [Op(c, "inject", 0, (i, OPERAND, 0), (j, RESULT, 0), (1, 3, 1), (0, 3 * c, j),
            (i, 3 * c, 0))
         for c in range(2) for i in DEVICES for j in DEVICES]
  sched = _encode([t], DEVICES, ops)
  (out,) = run_spmd(sched, [a], [P("x")], [((8, 6, 1), np.int32)], [P(None, None, "x")],
                    0, _new_site())
  _bytes_equal(out, a)


def test_strided_3d_partial_boxes():
  """Inner sub-boxes that are contiguous in neither buffer, in a 3-D box."""
  a = _random(np.float32, (16, 6, 10), seed=4)  # device i: rows [2i, 2i+2)
  t = Tensor(np.float32, (16, 6, 10))
  # Device j receives a [2, 3, 4] box from device (j+1) % 8: global rows of that device,
  # middle dims [1:4), last dims [3:7); into its result at [0:2, 2:5, 1:5] of (2, 8, 6).
  ops = [Op(0, "inject", 0, ((j + 1) % 8, OPERAND, 0), (j, RESULT, 0), (2, 3, 4),
            (0, 1, 3), (0, 2, 1)) for j in DEVICES]
  sched = _encode([t], DEVICES, ops)
  (out,) = run_spmd(sched, [a], [P("x")], [((2, 8, 6), np.float32)], [P("x")], 0,
                    _new_site())
  for j in DEVICES:
    got = out[2 * j:2 * j + 2]
    src = (j + 1) % 8
    _bytes_equal(got[:, 2:5, 1:5], a[2 * src:2 * src + 2, 1:4, 3:7])


@pytest.mark.parametrize("dtype", [np.bool_, jnp.bfloat16, np.int8, np.complex64,
                                   np.float16, np.uint32])
def test_dtypes_rows_to_columns(dtype):
  x = _random(dtype, (8, 16), seed=5)
  t = Tensor(np.dtype(dtype), (8, 16))
  ops = [Op(0, "inject" if i != j else "local", 0, (i, OPERAND, 0), (j, RESULT, 0), (1, 2),
            (0, 2 * j), (i, 0)) for i in DEVICES for j in DEVICES]
  sched = _encode([t], DEVICES, ops)
  (out,) = run_spmd(sched, [x], [P("x")], [((8, 2), dtype)], [P(None, "x")], 0,
                    _new_site())
  _bytes_equal(out, x)


def test_zero_size_tensor_spmd():
  e0 = np.zeros((8, 0), np.float32)
  ops = [Op(0, "inject", 0, (i, OPERAND, 0), ((i + 3) % 8, RESULT, 0), (1, 0), (0, 0), (0, 0))
         for i in DEVICES]
  (out,) = run_spmd(_encode([Tensor(np.float32, (8, 0))], DEVICES, ops), [e0], [P("x")],
                    [((1, 0), np.float32)], [P("x")], 0, _new_site())
  assert out.shape == (8, 0)


def test_pytree_with_zero_size_tensors_eager():
  """Three tensors in one call (variadic operands/results), two of them empty: rows of
  (4, 0) f32 and of (6,) i16 on devices 0, 1 -> replicated on 2, 3; a (0,) i8 from device
  0 -> device 3. Eager programs: XLA 0.11.2 crashes compiling shard_map over a mix of
  empty and non-empty arrays (any custom call or none), so the mix is tested here."""
  v = _random(np.int16, (6,), seed=6)
  tensors = [Tensor(np.float32, (4, 0)), Tensor(np.int8, (0,)), Tensor(np.int16, (6,))]
  ops = [Op(0, "inject", 1, (0, OPERAND, 1), (3, RESULT, 1), (0,), (0,), (0,))]
  for i in (0, 1):
    for j in (2, 3):
      ops.append(Op(0, "inject", 0, (i, OPERAND, 0), (j, RESULT, 0), (2, 0), (0, 0),
                    (2 * i, 0)))
      ops.append(Op(0, "inject", 2, (i, OPERAND, 2 - (i == 1)), (j, RESULT, 2 if j == 3 else 1),
                    (3,), (0,), (3 * i,)))
  participants = [0, 1, 2, 3]
  operands = {0: [np.zeros((2, 0), np.float32), np.zeros((0,), np.int8), v[:3]],
              1: [np.zeros((2, 0), np.float32), v[3:]], 2: [], 3: []}
  results = {0: [], 1: [], 2: [((4, 0), np.float32), ((6,), np.int16)],
             3: [((4, 0), np.float32), ((0,), np.int8), ((6,), np.int16)]}
  devs = jax.devices()
  site = _new_site()
  programs = [(devs[d], eager_program(devs[d], _encode(tensors, participants, ops, device=d),
                                      results[d], 0, site),
               [jax.device_put(a, devs[d]) for a in operands[d]]) for d in participants]
  for _ in range(2):
    out = run_eager(programs)
    for res, _ in out:
      assert not isinstance(res, Exception), res
    r2, r3 = out[2][0], out[3][0]
    assert r2[0].shape == (4, 0) and r3[0].shape == (4, 0) and r3[1].shape == (0,)
    _bytes_equal(r2[1], v)
    _bytes_equal(r3[2], v)


@pytest.mark.parametrize("seed", range(12))
def test_random_boxes(seed):
  """Random shapes and boxes (rank 1-4, extents of 1, full and partial dims): device j's
  result, cut into slabs along dim 0, each filled from a random box of a random device's
  operand; the second tensor then copies slabs of results between devices (step 1)."""
  rng = np.random.default_rng(seed)
  rank = int(rng.integers(1, 5))
  local_src = tuple(int(v) for v in rng.integers(1, 6, rank))
  local_dst = tuple(int(v) for v in rng.integers(1, 6, rank))
  dtype = [np.int8, np.float16, np.float32, np.complex64][seed % 4]
  x = _random(dtype, (8 * local_src[0],) + local_src[1:], seed=seed)
  glob_shape = (8 * max(local_src[0], local_dst[0]),) + tuple(
      max(a, b) for a, b in zip(local_src[1:], local_dst[1:]))
  t = Tensor(np.dtype(dtype), glob_shape)
  ops, want = [], np.zeros((8,) + local_dst, dtype)
  filled = np.zeros((8,) + local_dst, bool)
  for j in DEVICES:
    row = 0
    while row < local_dst[0]:
      extent = [int(rng.integers(1, local_dst[0] - row + 1))]
      extent[0] = min(extent[0], local_src[0])
      for d in range(1, rank):
        extent.append(int(rng.integers(1, min(local_src[d], local_dst[d]) + 1)))
      src_start = [int(rng.integers(0, local_src[d] - extent[d] + 1)) for d in range(rank)]
      dst_start = [row] + [int(rng.integers(0, local_dst[d] - extent[d] + 1))
                           for d in range(1, rank)]
      i = int(rng.integers(0, 8))
      ops.append(Op(0, "inject", 0, (i, OPERAND, 0), (j, RESULT, 0), tuple(extent),
                    tuple(src_start), tuple(dst_start)))
      src_box = tuple(slice(s0, s0 + e) for s0, e in zip(src_start, extent))
      dst_box = (j,) + tuple(slice(s0, s0 + e) for s0, e in zip(dst_start, extent))
      block = x[local_src[0] * i:local_src[0] * (i + 1)][src_box]
      want[dst_box] = block
      filled[dst_box] = True
      row += extent[0]
  # Step 1: device j's whole result -> the full-tensor buffer in device (j + 3) % 8's
  # workspace, at an offset (reads what step 0 wrote).
  offset = 64
  ws_bytes = offset + int(np.prod(glob_shape)) * np.dtype(dtype).itemsize
  for j in DEVICES:
    ops.append(Op(1, "gather", 0, (j, RESULT, 0), ((j + 3) % 8, WORKSPACE, offset),
                  local_dst, (0,) * rank, (0,) * rank))
  sched = _encode([t], DEVICES, ops, ws={d: ws_bytes for d in DEVICES})
  out0, ws = run_spmd(sched, [x], [P("x")], [(local_dst, dtype)], [P("x")], ws_bytes,
                      _new_site(), with_workspace=True)
  out0 = out0.reshape((8,) + local_dst)
  _bytes_equal(out0[filled], want[filled])
  corner = tuple(slice(0, n) for n in local_dst)
  for j in DEVICES:
    full = ws[(j + 3) % 8, offset:].view(dtype).reshape(glob_shape)
    _bytes_equal(full[corner], out0[j])


# --------------------------------------------------------------------------------------
# Eager: one jitted program per device, dispatched from threads.
# --------------------------------------------------------------------------------------


def _eager_case():
  """T0: rows of (4, 6) on devices 0, 1 -> replicated on 2, 3, 4 (inject, then forward
  and fanout); T1: a scalar on device 1 -> devices 2 and 4. Devices 5-7 take no part."""
  x = _random(np.float32, (4, 6), seed=7)
  s = np.array(42, np.int32)
  tensors = [Tensor(np.float32, (4, 6)), Tensor(np.int32, ())]
  ops = [
      Op(0, "inject", 0, (0, OPERAND, 0), (2, RESULT, 0), (2, 6), (0, 0), (0, 0)),
      Op(0, "inject", 0, (1, OPERAND, 0), (3, RESULT, 0), (2, 6), (0, 0), (2, 0)),
      Op(0, "inject", 1, (1, OPERAND, 1), (2, RESULT, 1), (), (), ()),
      Op(1, "forward", 0, (2, RESULT, 0), (3, RESULT, 0), (2, 6), (0, 0), (0, 0)),
      Op(1, "forward", 0, (3, RESULT, 0), (2, RESULT, 0), (2, 6), (2, 0), (2, 0)),
      Op(1, "fanout", 0, (2, RESULT, 0), (4, RESULT, 0), (2, 6), (0, 0), (0, 0)),
      Op(1, "fanout", 0, (3, RESULT, 0), (4, RESULT, 0), (2, 6), (2, 0), (2, 0)),
      Op(1, "fanout", 1, (2, RESULT, 1), (4, RESULT, 1), (), (), ()),
  ]
  participants = [0, 1, 2, 3, 4]
  operands = {0: [x[0:2]], 1: [x[2:4], s], 2: [], 3: [], 4: []}
  results = {0: [], 1: [], 2: [((4, 6), np.float32), ((), np.int32)],
             3: [((4, 6), np.float32)], 4: [((4, 6), np.float32), ((), np.int32)]}
  want = {0: [], 1: [], 2: [x, s], 3: [x], 4: [x, s]}
  return tensors, participants, ops, operands, results, want


def _eager_programs(site, timeout_ms=20000, devices=None):
  tensors, participants, ops, operands, results, want = _eager_case()
  devs = jax.devices()
  programs = {}
  for d in participants:
    sched = _encode(tensors, participants, ops, device=d)
    fn = eager_program(devs[d], sched, results[d], 0, site, timeout_ms)
    args = [jax.device_put(a, devs[d]) for a in operands[d]]
    programs[d] = (devs[d], fn, args)
  return programs, want


def test_eager_per_device_programs_from_threads():
  site = _new_site()
  programs, want = _eager_programs(site)
  for _ in range(3):
    out = dict(zip(programs, run_eager(list(programs.values()))))
    for d, expected in want.items():
      res, _ = out[d]
      assert not isinstance(res, Exception), res
      assert len(res) == len(expected)
      for r, w in zip(res, expected):
        _bytes_equal(r, w)


def test_eager_two_sites_concurrently():
  """Two reshards with distinct sites in flight at once do not meet each other."""
  p1, want = _eager_programs(_new_site())
  p2, _ = _eager_programs(_new_site())
  out = run_eager(list(p1.values()) + list(p2.values()))
  for res, _ in out:
    assert not isinstance(res, Exception), res


# --------------------------------------------------------------------------------------
# Bad schedules: clear errors, no crash, site still usable.
# --------------------------------------------------------------------------------------


def _simple():
  """Device i's row -> device (i+1)'s row of a (8, 4) float32; 1 step."""
  t = Tensor(np.float32, (8, 4))
  ops = [Op(0, "inject", 0, (i, OPERAND, 0), ((i + 1) % 8, RESULT, 0), (1, 4), (0, 0), (0, 0))
         for i in DEVICES]
  return [t], ops


def _run_simple(sched, site, ws_bytes=0, local_result=(1, 4), timeout_ms=20000):
  x = _random(np.float32, (8, 4), seed=8)
  (out,) = run_spmd(sched, [x], [P("x")], [(local_result, np.float32)], [P("x")], ws_bytes,
                    site, timeout_ms)
  return x, out


def _mutate(index, value):
  tensors, ops = _simple()
  a = _encode(tensors, DEVICES, ops).copy()
  a[index] = value
  return a


_OPS_AT = 8 + 2 * 8 + 12  # first op row of _simple()'s encoding


@pytest.mark.parametrize("index,value,match", [
    (0, 0x12345678, "MAGIC must be 0x4d324e5f"),
    (1, 2, "VERSION must be 3"),
    (5, 20, "sizes must add up"),
    (5, 7, "sizes must add up: 17 elements after the last of n_ops = 7"),
    (3, 0, "n_devices must be in"),
    (6, 35, "OP_FIXED must be 11"),
    (7, 4, "MAX_RANK must be 8"),
    (8 + 1, 0, "devices must be sorted ascending"),
    (8 + 8, -1, r"ws\[0\] \(device 0\) must be >= 0"),
    (8 + 16 + 1, 9, "rank must be in"),
    (8 + 16 + 2 + 5, 3, "dim_5 must be 0"),
    (8 + 16 + 10, 6, r"tensor 0: src_type must be a type code in \[0, 5\].*got 6"),
    (8 + 16 + 11, -1, r"tensor 0: dst_type must be a type code in \[0, 5\].*got -1"),
    (8 + 16 + 10, 1, r"src_type and dst_type must both be 0 .*got src_type = 1, "
                     r"dst_type = 0"),
    (_OPS_AT + 0, 1, r"step must be in \[0, n_steps = 1\); got 1"),
    (_OPS_AT + 1, 6, "stage must be in"),
    (_OPS_AT + 2, 1, r"tensor must be in \[0, n_tensors = 1\); got 1"),
    (_OPS_AT + 3, 9, "src_dev = 9 must be one of the devices"),
    (_OPS_AT + 4, 3, "src_kind must be"),
    (_OPS_AT + 7, 0, "dst_kind must be 1 .result. or 2"),
    (_OPS_AT + 8, 5, "dst_slot = 5 is a result index"),
    (_OPS_AT + 7, 2, "workspace offset"),
    (_OPS_AT + 9, 0, "src_pack = 0 must be -1 or a staging area"),
    (_OPS_AT + 11 + 3 * 1 + 0, 5, r"extent\[1\] must be in \[0, 4\]"),
    (_OPS_AT + 11 + 3 * 0 + 1, 8, r"src.start\[0\] = 8 with extent 1 must lie in"),
])
def test_decoder_rejects(index, value, match):
  with pytest.raises(ValueError, match=match):
    _ffi.decode_schedule(_mutate(index, value))


def test_decoder_rejects_unsorted_steps_and_slot_conflicts():
  t = Tensor(np.float32, (8, 4))
  ops = [Op(1, "inject", 0, (0, OPERAND, 0), (1, RESULT, 0), (1, 4), (0, 0), (0, 0)),
         Op(0, "inject", 0, (1, OPERAND, 0), (2, RESULT, 0), (1, 4), (0, 0), (0, 0))]
  a = _encode([t], DEVICES, ops)
  # _encode sorts by step; swap the two op rows back.
  rows = a[_OPS_AT:].reshape(2, OP_FIXED + 3 * 2)[::-1].copy()
  a = np.concatenate([a[:_OPS_AT], rows.reshape(-1)])
  with pytest.raises(ValueError, match="ops must be sorted by step; got step 0 after step 1"):
    _ffi.decode_schedule(a)
  two = [Tensor(np.float32, (8, 4)), Tensor(np.float32, (8, 4))]
  ops = [Op(0, "inject", 0, (0, OPERAND, 0), (1, RESULT, 0), (1, 4), (0, 0), (0, 0)),
         Op(0, "inject", 1, (0, OPERAND, 0), (2, RESULT, 0), (1, 4), (0, 0), (0, 0))]
  with pytest.raises(ValueError, match="one buffer must hold one tensor"):
    _ffi.decode_schedule(_encode(two, DEVICES, ops))
  with pytest.raises(ValueError, match="at least the 8-element header"):
    _ffi.decode_schedule(np.array([MAGIC, 1], np.int64))


def _narrow(a):
  """`a` (version 3) in the narrow form, packed here (not by jax_m2n's encoder): version
  4, each element after the header an int32, two to a little-endian word, an odd count
  padded with -2^31."""
  body = np.asarray(a[8:], np.int64)
  assert body.min(initial=0) > -(1 << 31) and body.max(initial=0) < (1 << 31)
  if len(body) % 2:
    body = np.append(body, -(1 << 31))
  head = np.array(a[:8], np.int64)
  head[1] = 4
  return np.concatenate([head, body.astype("<i4").view("<i8")])


def _same_error_in_both_forms(wide, form):
  """`wide` with op 0's tensor out of range fails to decode with the same message in
  version 3 and in `form` (narrow or packed); returns it."""
  bad = wide.copy()
  bad[_OPS_AT + 2] = 5  # op 0's tensor
  with pytest.raises(ValueError) as wide_error:
    _ffi.decode_schedule(bad)
  with pytest.raises(ValueError) as form_error:
    _ffi.decode_schedule(form(bad))
  assert str(form_error.value) == str(wide_error.value)
  return str(wide_error.value)


def test_a_narrow_schedule_decodes_and_runs_as_its_wide_form():
  """Version 4 is version 3 with int32 elements: the same decoded schedule (fingerprint
  included, so peers may hold either form), the same bytes moved, the same errors
  naming the same fields; an odd count's pad is dropped, a rank-0 op (whose last
  element is its dst_pack, -1) keeps its -1."""
  tensors, ops = _simple()
  wide = _encode(tensors, DEVICES, ops)
  narrow = _narrow(wide)
  assert len(narrow) < len(wide)
  assert _ffi.decode_schedule(narrow) == _ffi.decode_schedule(wide)
  x, out = _run_simple(narrow, _new_site())
  _bytes_equal(out, np.roll(x, 1, axis=0))
  scalar = [Tensor(np.float32, ())]
  for n in (1, 2):  # an odd and an even element count after the header
    ops0 = [Op(0, "inject", 0, (0, OPERAND, 0), (j + 1, RESULT, 0), (), (), ())
            for j in range(n)]
    wide0 = _encode(scalar, DEVICES, ops0)
    assert wide0[-1] == -1
    assert _ffi.decode_schedule(_narrow(wide0)) == _ffi.decode_schedule(wide0)
  assert "tensor" in _same_error_in_both_forms(wide, _narrow)


def _packed(a):
  """`a` (version 3) in the packed form, written here element by element (not by
  jax_m2n's array arithmetic): version 5, the element count, then each element's zigzag
  LEB128 bytes, little-endian words, the last zero-padded."""
  stream = bytearray()
  for v in (int(x) for x in a[8:]):
    z = (v << 1) ^ (v >> 63)  # zigzag; Python ints: -1 -> 1, 1 -> 2
    z &= (1 << 64) - 1
    while True:
      byte, z = z & 0x7F, z >> 7
      stream.append(byte | (0x80 if z else 0))
      if not z:
        break
  stream += bytes(-len(stream) % 8)
  head = np.array(a[:8], np.int64)
  head[1] = 5
  return np.concatenate([head, [len(a) - 8], np.frombuffer(bytes(stream), "<i8")])


def test_a_packed_schedule_decodes_and_runs_as_its_wide_form():
  """Version 5 is version 3's elements as zigzag varints: the same decoded schedule
  (fingerprint included, so peers may hold either form), the same bytes moved, the
  same errors naming the same fields."""
  tensors, ops = _simple()
  wide = _encode(tensors, DEVICES, ops)
  packed = _packed(wide)
  assert len(packed) < len(wide) // 3
  assert _ffi.decode_schedule(packed) == _ffi.decode_schedule(wide)
  x, out = _run_simple(packed, _new_site())
  _bytes_equal(out, np.roll(x, 1, axis=0))
  assert "tensor" in _same_error_in_both_forms(wide, _packed)


def test_the_decoder_rejects_a_malformed_packed_body():
  """A packed body must hold exactly its element count of varints, each at most 10
  bytes, then less than a word of zero padding; the error names the rule."""
  tensors, ops = _simple()
  packed = _packed(_encode(tensors, DEVICES, ops))
  count = int(packed[8])
  cases = []
  more = packed.copy()
  more[8] = count + 1  # a padding byte read as one element more, or none left
  cases.append((more, "cut off|sizes must add up"))
  huge = packed.copy()
  huge[8] = 8 * (len(packed) - 9) + 1
  cases.append((huge, "must lie in"))
  cases.append((packed[:8], "element count"))
  padded = np.concatenate([packed, [0]])  # a whole word of padding
  cases.append((padded, "padding must be less than a word"))
  eleven = bytes([0xFF] * 10 + [1] + [0] * 5)  # one varint of 11 bytes, 2 words
  long = np.concatenate([packed[:8], [1], np.frombuffer(eleven, "<i8")])
  cases.append((long, "runs past 10 bytes"))
  for encoded, message in cases:
    with pytest.raises(ValueError, match=message):
      _ffi.decode_schedule(encoded)
  # A nonzero padding byte: the last word's high byte, where the stream ends earlier.
  tail = _packed(np.concatenate([np.array([MAGIC, 3, 0, 0, 0, 0, OP_FIXED, 8]), [5]]))
  tail[-1] |= 1 << 56
  with pytest.raises(ValueError, match="padding byte 7 must be 0"):
    _ffi.decode_schedule(tail)


def _assert_site_works(site):
  tensors, ops = _simple()
  x, out = _run_simple(_encode(tensors, DEVICES, ops), site)
  _bytes_equal(out, np.roll(x, 1, axis=0))


@pytest.mark.parametrize("index,value,match", [
    (0, 0x12345678, "MAGIC must be 0x4d324e5f"),
    (1, 7, "VERSION must be 3.*got 7"),
])
def test_bad_header_fails_at_instantiate(index, value, match):
  site = _new_site()
  with pytest.raises(jax.errors.JaxRuntimeError, match=match):
    _run_simple(_mutate(index, value), site)
  _assert_site_works(site)


def test_box_outside_local_buffer_fails_at_execute():
  """In the global tensor (decoder passes) but outside the device's (1, 4) shard."""
  tensors, ops = _simple()
  ops[5] = dataclasses.replace(ops[5], src_start=(1, 0))  # row 1 of a 1-row operand
  site = _new_site()
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"source operand 0 of device 5: box start \[1, 0\].*must lie "
                           r"inside the buffer's dims \[1, 4\]"):
    _run_simple(_encode(tensors, DEVICES, ops), site)
  _assert_site_works(site)  # every device consumed the failed generation


def test_workspace_too_small_and_bad_timeout():
  tensors, ops = _simple()
  site = _new_site()
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"workspace \(last result\) of device \d must hold at least"):
    _run_simple(_encode(tensors, DEVICES, ops, ws={d: 64 for d in DEVICES}), site,
                ws_bytes=16)
  with pytest.raises(jax.errors.JaxRuntimeError, match="timeout_ms must be in"):
    _run_simple(_encode(tensors, DEVICES, ops), site, timeout_ms=0)
  _assert_site_works(site)


def test_device_not_in_schedule():
  t = Tensor(np.float32, (8, 4))
  ops = [Op(0, "inject", 0, (i, OPERAND, 0), ((i + 1) % 4, RESULT, 0), (1, 4), (0, 0),
            (0, 0)) for i in range(4)]
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"device [4-7] runs the call but is not one of the schedule's "
                           r"devices \[0, 1, 2, 3\]"):
    _run_simple(_encode([t], [0, 1, 2, 3], ops), _new_site())


def test_result_count_mismatch_fails_fast():
  """A slot beyond the device's results: the device aborts its generation, so its peers
  fail at once rather than after timeout_ms."""
  _, ops = _simple()
  t = Tensor(np.float32, (8, 4))
  ops.append(Op(0, "inject", 1, (0, OPERAND, 1), (6, RESULT, 1), (1, 4), (0, 0), (0, 0)))
  sched = _encode([t, t], DEVICES, ops)
  t0 = time.monotonic()
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"_slot = 1 must name one of the 1 "
                                                       r"(results|operands) of device"):
    _run_simple(sched, _new_site(), timeout_ms=60000)
  assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------------------
# A participant that never arrives.
# --------------------------------------------------------------------------------------

TIMEOUT_MS = 400
SLACK_S = 5.0


def _pair_programs(site, timeout_ms=TIMEOUT_MS):
  """Device 0's (2, 3) int32 -> device 1, two steps (device 1 forwards to itself)."""
  x = np.arange(6, dtype=np.int32).reshape(2, 3)
  t = Tensor(np.int32, (2, 3))
  ops = [Op(0, "inject", 0, (0, OPERAND, 0), (1, WORKSPACE, 0), (2, 3), (0, 0), (0, 0)),
         Op(1, "local", 0, (1, WORKSPACE, 0), (1, RESULT, 0), (2, 3), (0, 0), (0, 0))]
  ws = {1: x.nbytes}
  devs = jax.devices()
  p0 = (devs[0], eager_program(devs[0], _encode([t], [0, 1], ops, ws=ws, device=0), [], 0,
                               site, timeout_ms), [jax.device_put(x, devs[0])])
  p1 = (devs[1], eager_program(devs[1], _encode([t], [0, 1], ops, ws=ws, device=1),
                               [((2, 3), np.int32)], x.nbytes, site, timeout_ms), [])
  return p0, p1, x


def _expect_success(out, x):
  assert not isinstance(out[0][0], Exception), out[0][0]
  assert not isinstance(out[1][0], Exception), out[1][0]
  _bytes_equal(out[1][0][0], x)


def _expect_timeout(result, site, missing):
  err, seconds = result
  assert isinstance(err, jax.errors.JaxRuntimeError), err
  msg = str(err)
  assert f"site {site}" in msg and "step 0" in msg, msg
  assert f"devices [{missing}] did not arrive" in msg, msg
  assert f"timed out after {TIMEOUT_MS} ms" in msg, msg
  assert TIMEOUT_MS / 1000 * 0.9 <= seconds <= TIMEOUT_MS / 1000 + SLACK_S, seconds


def test_timeout_then_late_arriver_then_site_works():
  site = _new_site()
  p0, p1, x = _pair_programs(site)
  run_eager([p1, p0])  # compile and warm up: generation 0 succeeds
  out = run_eager([p0])  # generation 1: device 1 never dispatched
  _expect_timeout(out[0], site, 1)
  # Device 1's generation-1 program, dispatched late: fails at once, copies nothing.
  err, seconds = run_eager([p1])[0]
  assert isinstance(err, jax.errors.JaxRuntimeError), err
  assert "arrived after the generation was aborted" in str(err), err
  assert f"devices [1] did not arrive" in str(err), err
  assert seconds < TIMEOUT_MS / 1000, seconds
  # Generation 2: both in step again.
  _expect_success(run_eager([p0, p1]), x)
  _expect_success(run_eager([p0, p1]), x)


def test_timeout_then_abandon_then_site_works():
  site = _new_site()
  p0, p1, x = _pair_programs(site)
  out = run_eager([p1])  # device 0 never dispatched: device 1 times out
  _expect_timeout(out[0], site, 0)
  _ffi.abandon(site, [0])  # the caller knows device 0's program never ran
  _expect_success(run_eager([p0, p1]), x)


def _released(site, release):
  """Device 0 of a pair waits in the rendezvous (timeout 60 s) for device 1 on a
  thread; `release()` must free it within 10 s: returns (device 0's error, the pair's
  p0, p1, x)."""
  p0, p1, x = _pair_programs(site, timeout_ms=60000)
  result = {}
  waiter = threading.Thread(target=lambda: result.update({0: run_eager([p0])[0]}))
  waiter.start()
  time.sleep(0.5)  # device 0 waits in the rendezvous (or is about to)
  t0 = time.monotonic()
  release()
  waiter.join(60)
  assert time.monotonic() - t0 < 10
  err, _ = result[0]
  return err, (p0, p1, x)


def test_abandon_releases_a_waiting_peer_at_once():
  site = _new_site()
  err, (p0, p1, x) = _released(site, lambda: _ffi.abandon(site, [1]))
  assert isinstance(err, jax.errors.JaxRuntimeError), err
  assert "device 1 did not take part in this generation" in str(err), err
  assert "abandoned by the caller" in str(err), err
  _expect_success(run_eager([p0, p1]), x)


def test_participants_with_different_schedules_fail_fast():
  """Two devices meeting under one site with different tensors tables."""
  site = _new_site()
  p0, _, _ = _pair_programs(site, timeout_ms=60000)
  x = np.zeros((2, 4), np.int32)
  t = Tensor(np.int32, (2, 4))
  ops = [Op(0, "inject", 0, (0, OPERAND, 0), (1, RESULT, 0), (2, 4), (0, 0), (0, 0))]
  dev1 = jax.devices()[1]
  p1 = (dev1, eager_program(dev1, _encode([t], [0, 1], ops, device=1),
                            [((2, 4), np.int32)], 0, site, 60000), [])
  t0 = time.monotonic()
  out = run_eager([p0, p1])
  assert time.monotonic() - t0 < 30
  for err, _ in out:
    assert isinstance(err, jax.errors.JaxRuntimeError), err
    assert "participants must run the same schedule under one site" in str(err), err
  del x


def test_spmd_missing_participant_times_out():
  """A schedule naming device 9, which runs nothing: devices 0-6 wait and time out
  together (device 7, not listed, fails at once)."""
  t = Tensor(np.float32, (8, 4))
  participants = [0, 1, 2, 3, 4, 5, 6, 9]
  ops = [Op(0, "inject", 0, (i, OPERAND, 0), ((i + 1) % 7, RESULT, 0), (1, 4), (0, 0),
            (0, 0)) for i in range(7)]
  t0 = time.monotonic()
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    _run_simple(_encode([t], participants, ops), _new_site(), timeout_ms=TIMEOUT_MS)
  assert time.monotonic() - t0 <= TIMEOUT_MS / 1000 + SLACK_S + 5  # + compile time
  msg = str(info.value)
  assert ("devices [9] did not arrive" in msg or
          "is not one of the schedule's devices" in msg), msg


def test_no_generation_left_behind():
  before = _ffi.pending_generations()
  tensors, ops = _simple()
  _run_simple(_encode(tensors, DEVICES, ops), _new_site())
  assert _ffi.pending_generations() == before


def test_joined_counts_generations_per_device():
  site = _new_site()
  p0, p1, x = _pair_programs(site)
  assert list(_ffi.joined(site, [0, 1, 5])) == [0, 0, 0]
  _expect_success(run_eager([p0, p1]), x)
  _expect_success(run_eager([p0, p1]), x)
  assert list(_ffi.joined(site, [0, 1, 5])) == [2, 2, 0]
  _ffi.abandon(site, [1], "a reason")  # abandoning counts as a join
  assert list(_ffi.joined(site, [0, 1])) == [2, 3]
  _ffi.abandon(site, [0], "catching up")
  _expect_success(run_eager([p0, p1]), x)


def test_abort_releases_a_generation_in_progress_and_one_not_yet_joined():
  site = _new_site()
  # Device 0 waits in generation 0 for device 1.
  err, (p0, p1, x) = _released(
      site, lambda: _ffi.abort(site, 0, [0, 1], "the caller was interrupted"))
  assert isinstance(err, jax.errors.JaxRuntimeError), err
  assert "the caller was interrupted" in str(err), err
  # Device 1 joins the aborted generation 0 later: it fails at once, copying nothing.
  err, seconds = run_eager([p1])[0]
  assert "arrived after the generation was aborted" in str(err), err
  assert seconds < 10
  # Generation 1: abort before anyone joined; both fail at once; generation 2 works.
  _ffi.abort(site, 1, [0, 1], "aborted up front")
  for err, seconds in run_eager([p0, p1]):
    assert "aborted up front" in str(err) and seconds < 10, err
  _expect_success(run_eager([p0, p1]), x)
  # A generation everyone has left: abort is a no-op (nothing pending is created).
  pending = _ffi.pending_generations()
  _ffi.abort(site, 2, [0, 1], "too late")
  assert _ffi.pending_generations() == pending
  _expect_success(run_eager([p0, p1]), x)


def _run_with_attribute(**attribute):
  """Device 0's part of a one-op schedule, with one more attribute for the handler."""
  t = Tensor(np.int32, (2, 3))
  ops = [Op(0, "inject", 0, (0, OPERAND, 0), (1, RESULT, 0), (2, 3), (0, 0), (0, 0))]
  call = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct((1,), jnp.uint8)],
                          has_side_effect=True)
  f = jax.jit(lambda v: call(v, schedule=_encode([t], [0, 1], ops, device=0),
                             site=np.int64(_new_site()), timeout_ms=np.int64(1000),
                             **attribute),
              out_shardings=SingleDeviceSharding(jax.devices()[0]))
  x = jax.device_put(np.zeros((2, 3), np.int32), jax.devices()[0])
  return jax.block_until_ready(f(x))


@pytest.mark.parametrize("network,words", [
    (np.array([1000, 0, 0], np.int64), "2 + n_devices = 4 entries"),
    (np.array([0, 0, 0, 1], np.int64), "bytes_per_s >= 1"),
    (np.array([1000, -1, 0, 1], np.int64), "latency_ns >= 0"),
])
def test_bad_network_attribute_fails_at_instantiate(network, words):
  with pytest.raises(Exception, match="attribute network must have") as info:
    _run_with_attribute(network=network)
  assert words in str(info.value), info.value


def test_unknown_attribute_fails_at_instantiate():
  with pytest.raises(Exception, match="optionally network, tickets; got nic"):
    _run_with_attribute(nic=np.int64(1))
