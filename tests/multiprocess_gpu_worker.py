"""One process of tests/multiprocess_gpu_test.py: jax.distributed on loopback, 1 GPU each.

Not a test by itself (no `_test` suffix). Usage, one per process, started together:
  python3 tests/multiprocess_gpu_worker.py --process-id I --num-processes 4 --port P \
      --scenario refit|timeout
Prints "RESULT <scenario> process=I ok ..." on success; exits non-zero otherwise.

Scenarios:
  refit    N/2 + N/2 trainer -> generator refit (the RL case; 2 + 2 with 4 processes):
           the first half of the GPUs hold P('x', None), the second half receive it
           replicated, as P(None, 'x'), and over two emulated NVLink domains; every
           route; outputs checked bitwise against numpy.
  timeout  the receiver's peer never calls: the receiving process sees the call fail
           within its timeout (watchdog + ncclCommAbort), not a hang.
  netsocket the multi-node code path on one host (issue 13 item 4): run with NCCL forced
           onto its network transport (the test sets NCCL_P2P_DISABLE=1
           NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo), each process its
           own domain (Topology(domain_size=1)): every route of a 1 -> N-1 refit, the
           colocated P('x', None) -> P(None, 'x') exchange and a replicate over all
           domains (inject, forward, fan-out), bitwise; then the socket bandwidth from a
           64 MiB copy and, per case, measured time / the planner's estimate at that
           bandwidth (printed; not asserted).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _log(pid, what):
  print(f"[{time.strftime('%H:%M:%S')} process {pid}] {what}", file=sys.stderr, flush=True)


def _bits(a):
  import numpy as np
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}")


def _refit(jax, jax_m2n, pid):
  import ml_dtypes
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = jax.devices()
  half = len(devs) // 2
  src = NamedSharding(Mesh(np.array(devs[:half]), ("x",)), P("x", None))
  gen = Mesh(np.array(devs[half:]), ("x",))
  shape = (512, 1024)
  rng = np.random.default_rng(7)
  host = rng.integers(1, 1 << 16, size=shape, dtype=np.uint16).view(ml_dtypes.bfloat16)
  x = jax.make_array_from_callback(shape, src, lambda idx: host[idx], dtype=host.dtype)
  cases = [(P(), "hierarchical", None), (P(None, "x"), "hierarchical", None),
           (P(), "flat", None), (P(), "gather_bcast", None),
           (P(), "hierarchical", jax_m2n.Topology(domain_size=2))]
  times = []
  for spec, route, topo in cases:
    _log(pid, f"reshard {route} {spec} topology={topo}")
    dst = NamedSharding(gen, spec)
    for it in range(3):
      t0 = time.perf_counter()
      y = jax_m2n.reshard(x, dst, route=route, topology=topo)
      jax.block_until_ready(y)
      times.append(time.perf_counter() - t0)
      for s in y.addressable_shards:
        np.testing.assert_array_equal(_bits(s.data), _bits(host[s.index]),
                                      err_msg=f"{route} {spec} process {pid} {s.index}")
  from jax_m2n._src import ffi as m2n_ffi  # noqa: F401
  import jax_m2n._ffi_cuda as cuda
  assert cuda.error() is None, cuda.error()
  return f"cases={len(cases)} last_ms={times[-1] * 1e3:.2f}"


def _timeout(jax, jax_m2n, pid):
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax._src import distributed
  devs = jax.devices()
  client = distributed.global_state.client
  # Every process creates the communicator first (a collective): a tiny 4-device refit.
  src4 = NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))
  z = jax.make_array_from_callback((8,), src4, lambda idx: np.arange(8, dtype=np.float32)[idx],
                                   dtype=np.float32)
  jax.block_until_ready(jax_m2n.reshard(z, NamedSharding(Mesh(np.array(devs[::-1]), ("x",)), P("x"))))
  src = NamedSharding(Mesh(np.array(devs[:1]), ("x",)), P())
  dst = NamedSharding(Mesh(np.array(devs[1:2]), ("x",)), P())
  x = jax.make_array_from_callback((256,), src, lambda idx: np.ones(256, np.float32)[idx],
                                   dtype=np.float32)
  outcome = "idle"
  if pid == 1:  # the receiver; process 0 (the sender) never calls
    import jax_m2n._ffi_cuda as cuda
    t0 = time.perf_counter()
    try:
      y = jax_m2n.reshard(x, dst, timeout_s=3.0)
      jax.block_until_ready(y)
      err = cuda.error()
      outcome = f"returned_after_s={time.perf_counter() - t0:.1f} error={err is not None}"
      if err is None:
        raise AssertionError("no error recorded after the peer never arrived")
    except jax_m2n.ReshardError as e:
      outcome = f"raised_after_s={time.perf_counter() - t0:.1f} {type(e).__name__}"
    # The communicator is aborted: the next reshard fails at once, naming the cause.
    try:
      jax.block_until_ready(jax_m2n.reshard(x, dst, timeout_s=3.0))
      raise AssertionError("a reshard after the abort succeeded")
    except jax_m2n.ReshardError as e:
      assert "timeout" in str(e).lower() or "abort" in str(e).lower(), e
      outcome += " next_call_raised"
  client.wait_at_barrier("jax_m2n_timeout_done", 120_000)
  return outcome


def _netsocket(jax, jax_m2n, pid):
  import ml_dtypes
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = jax.devices()
  n = len(devs)
  all_ = Mesh(np.array(devs), ("x",))
  first = Mesh(np.array(devs[:1]), ("x",))
  rest = Mesh(np.array(devs[1:]), ("x",))

  def make(shape, sharding, seed):
    rng = np.random.default_rng(seed)
    host = rng.integers(1, 1 << 16, size=shape, dtype=np.uint16).view(ml_dtypes.bfloat16)
    return host, jax.make_array_from_callback(shape, sharding, lambda idx: host[idx],
                                              dtype=host.dtype)

  from jax._src import distributed
  client = distributed.global_state.client
  count = [0]

  def run(x, host, dst, route, topo, iters=1):
    ts = []
    for _ in range(iters):
      count[0] += 1  # every call starts behind a barrier: per-process times comparable
      client.wait_at_barrier(f"jax_m2n_netsocket_{count[0]}", 120_000)
      t0 = time.perf_counter()
      y = jax_m2n.reshard(x, dst, route=route, topology=topo)
      jax.block_until_ready(y)
      ts.append(time.perf_counter() - t0)
      for s in y.addressable_shards:
        np.testing.assert_array_equal(_bits(s.data), _bits(host[s.index]),
                                      err_msg=f"{route} {dst} process {pid} {s.index}")
    return ts

  topo = jax_m2n.Topology(domain_size=1)  # every process (GPU) its own domain
  small = (256, 1024)
  cases = [  # (name, src sharding, dst sharding)
      ("1->rest P()", NamedSharding(first, P()), NamedSharding(rest, P())),
      ("1->rest P(None,x)", NamedSharding(first, P()), NamedSharding(rest, P(None, "x"))),
      ("all P(x,None)->P(None,x)", NamedSharding(all_, P("x", None)),
       NamedSharding(all_, P(None, "x"))),
      ("all P(x,None)->P()", NamedSharding(all_, P("x", None)), NamedSharding(all_, P())),
  ]
  for k, (name, src, dst) in enumerate(cases):
    host, x = make(small, src, 10 + k)
    for route in ("hierarchical", "flat", "gather_bcast"):
      _log(pid, f"netsocket {name} {route}")
      run(x, host, dst, route, topo, iters=2)
  import jax_m2n._ffi_cuda as cuda
  assert cuda.error() is None, cuda.error()
  # Socket bandwidth from a 64 MiB point-to-point copy, then the other cases at that size.
  big = (2048, 16384)
  nbytes = big[0] * big[1] * 2
  host, x = make(big, cases[0][1], 99)
  run(x, host, cases[0][2], "hierarchical", topo, iters=2)
  t_copy = min(run(x, host, cases[0][2], "hierarchical", topo, iters=5))
  gbps = nbytes / t_copy / 1e9
  topo_bw = jax_m2n.Topology(domain_size=1, nic_gbps=gbps)
  report = [f"socket_gbps={gbps:.2f}"]
  for name, src, dst in cases[1:] + cases[:1]:
    host, x = make(big, src, 98)
    for route in ("hierarchical", "gather_bcast"):
      run(x, host, dst, route, topo, iters=1)
      t = min(run(x, host, dst, route, topo, iters=3))
      est = jax_m2n.plan(x, dst, route=route, topology=topo_bw).route_estimate_ms()
      report.append(f"[{name} {route}: {t * 1e3:.1f} ms est {est:.1f} ms "
                    f"x{t * 1e3 / est:.2f}]")
  return " ".join(report)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, default=4)
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--scenario", choices=("refit", "timeout", "netsocket"), default="refit")
  a = p.parse_args()
  import jax
  _log(a.process_id, "jax.distributed.initialize")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                             num_processes=a.num_processes, process_id=a.process_id,
                             local_device_ids=[a.process_id],
                             initialization_timeout=120)
  import jax_m2n
  _log(a.process_id, f"devices {jax.devices()} local {jax.local_devices()} "
       f"local_hardware_id {[d.local_hardware_id for d in jax.local_devices()]}")
  fn = {"refit": _refit, "timeout": _timeout, "netsocket": _netsocket}[a.scenario]
  try:
    detail = fn(jax, jax_m2n, a.process_id)
  except BaseException:  # noqa: BLE001 - exit at once: peers must not wait for a barrier
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
  print(f"RESULT {a.scenario} process={a.process_id} ok {detail}", flush=True)
  # Skip NCCL/XLA teardown races at exit: every process is done with the communicator.
  jax.distributed.shutdown()
  os._exit(0)


if __name__ == "__main__":
  main()
