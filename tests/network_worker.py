"""One process of tests/network_test.py: a jax.distributed job whose processes each run
in their own emulated host (jax_m2n.testing.hosts), with no address configured.

Not a test by itself (no `_test` suffix). Usage, one per process, started together in
hosts 0..N-1 (the coordinator on host 0):
  python3 tests/network_worker.py --process-id I --num-processes N \
      --coordinator HOST:PORT --scenario S --sync DIR [--mib M]
The case: Figure 4's move, 2 source devices in process 0 (P('x', None)) -> TP2 x DP
over the other processes (P(None, 'tp')), M MiB of float32, default arguments. Prints
"ADDRESS process=I address=A" (its transfer server), "CALL process=I" right before the
call the test disturbs, "RESULT <what> process=I ..." per check and "DONE process=I";
exits non-zero on a failed check. Every wait is bounded.

Scenarios (the test does the disturbing, once every process printed CALL):
  fault     a warm call, then the disturbed call must fail on every process (its time
            and error printed); once DIR/healed exists, the same call must work.
  lossy     calls over lossy, delayed links: bitwise, with their times.
  killed    the test kills the last process mid-call: the others fail; then a call
            over the remaining processes works.
  address   JAX_M2N_TRANSFER_HOST=127.0.0.1 in every process (a multi-host job with a
            wrong override): the first call fails within seconds, naming the process
            and the address that cannot be reached.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_m2n.testing import workers  # noqa: E402


def _case(jax, mib, procs):
  """(host array, source array, destination sharding) of Figure 4's move from process
  0's devices to those of `procs`."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  by_proc = {p: [d for d in jax.devices() if d.process_index == p]
             for p in range(jax.process_count())}
  rows = int(mib * (1 << 20)) // 4 // 1024
  host = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
  src = NamedSharding(Mesh(np.array(by_proc[0]), ("x",)), P("x", None))
  gen = Mesh(np.array([d for p in procs for d in by_proc[p]]).reshape(len(procs), -1),
             ("dp", "tp"))
  dst = NamedSharding(gen, P(None, "tp"))
  x = jax.make_array_from_callback(host.shape, src, lambda i: host[i], dtype=host.dtype)
  return host, x, dst


def _result(what, pid, **fields):
  body = " ".join(f"{k}={v}" for k, v in fields.items())
  print(f"RESULT {what} process={pid} {body}", flush=True)


def _call(jax, jax_m2n, pid, what, host, x, dst, timeout_s=60.0) -> bool:
  """One reshard that must work: bitwise on every shard of this process."""
  from multiprocess_cpu_worker import _check
  t0 = time.perf_counter()
  try:
    y = jax_m2n.reshard(x, dst, timeout_s=timeout_s)
    _check(y, host, dst)
  except Exception as e:  # noqa: BLE001 - reported
    _result(what, pid, FAIL=f"{type(e).__name__}: {str(e)[:1500]!r}")
    return False
  _result(what, pid, ok=1, seconds=f"{time.perf_counter() - t0:.3f}")
  return True


def _disturbed(jax, jax_m2n, pid, what, x, dst, timeout_s=30.0) -> None:
  """The call the test disturbs: it must fail; prints when (wall clock) and why."""
  print(f"CALL process={pid}", flush=True)
  t0 = time.perf_counter()
  try:
    jax_m2n.reshard(x, dst, timeout_s=timeout_s)
    _result(what, pid, FAIL="no error")
  except jax_m2n.ReshardError as e:
    _result(what, pid, ok=1, at=f"{time.time():.3f}",
            seconds=f"{time.perf_counter() - t0:.3f}", type=type(e).__name__,
            error=repr(str(e)[:1500]))


def _warm_then_disturbed(jax, jax_m2n, pid, args, what):
  """The case over processes 1.. called once ("warm"), then again while the test
  disturbs it (`what`); (processes, host, x, dst), or None if the warm call failed."""
  procs = list(range(1, jax.process_count()))
  host, x, dst = _case(jax, args.mib, procs)
  if not _call(jax, jax_m2n, pid, "warm", host, x, dst):
    return None
  _disturbed(jax, jax_m2n, pid, what, x, dst)
  return procs, host, x, dst


def scenario_fault(jax, jax_m2n, pid, args) -> int:
  case = _warm_then_disturbed(jax, jax_m2n, pid, args, "fault")
  if case is None:
    return 1
  _, host, x, dst = case
  workers.wait_file(os.path.join(args.sync, "healed"), 120)
  return 0 if _call(jax, jax_m2n, pid, "next_call", host, x, dst) else 1


def scenario_lossy(jax, jax_m2n, pid, args) -> int:
  procs = list(range(1, jax.process_count()))
  host, x, dst = _case(jax, args.mib, procs)
  ok = all(_call(jax, jax_m2n, pid, f"lossy{i}", host, x, dst, timeout_s=120)
           for i in range(3))
  return 0 if ok else 1


def scenario_killed(jax, jax_m2n, pid, args) -> int:
  case = _warm_then_disturbed(jax, jax_m2n, pid, args, "killed")
  if case is None:
    return 1
  rest = case[0][:-1]  # the killed process is the last
  host, x, dst = _case(jax, args.mib, rest)
  if pid in [0, *rest]:
    return 0 if _call(jax, jax_m2n, pid, "next_call", host, x, dst) else 1
  return 0


def scenario_address(jax, jax_m2n, pid, args) -> int:
  procs = list(range(1, jax.process_count()))
  host, x, dst = _case(jax, args.mib, procs)
  _disturbed(jax, jax_m2n, pid, "address", x, dst)
  return 0


SCENARIOS = {"fault": scenario_fault, "lossy": scenario_lossy,
             "killed": scenario_killed, "address": scenario_address}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--num-processes", type=int, required=True)
  ap.add_argument("--coordinator", required=True)
  ap.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
  ap.add_argument("--sync", required=True)
  ap.add_argument("--mib", type=float, default=16)
  args = ap.parse_args()
  pid = args.process_id
  if args.scenario == "address":
    os.environ["JAX_M2N_TRANSFER_HOST"] = "127.0.0.1"
  jax = workers.start_jax(2, args.num_processes, pid, args.coordinator)
  import jax_m2n
  from jax_m2n._src.processes import bootstrap
  print(f"ADDRESS process={pid} address={bootstrap.engine().address}", flush=True)
  rc = SCENARIOS[args.scenario](jax, jax_m2n, pid, args)
  print(f"DONE process={pid}", flush=True)
  # Process 0 leaves last, but does not wait for a killed process's end.
  workers.leave_job(pid, args.num_processes, rc,
                    expected=args.num_processes - (args.scenario == "killed"))


if __name__ == "__main__":
  main()
