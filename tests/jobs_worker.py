"""One process of a trainer or a generator job for tests/jobs_test.py (and the jobs
bench): two separate programs that share no jax.distributed cluster; each job is one
process, or a jax.distributed job of its own on 127.0.0.1.

Not a test by itself. Usage, one per process:
  python3 tests/jobs_worker.py --role trainer|generator --process-id I \
      --num-processes N --devices D --port P --dir DIR --scenario S [--seed K]
The trainer's process 0 writes its address to DIR/address; a generator writes
DIR/generator_done when it is finished. Prints "RESULT <what> role=R process=I ..."
lines and "DONE role=R process=I"; every wait is bounded.

Scenarios:
  random    the trainer publishes VERSIONS versions of a CASES-leaf pytree (random
            shapes, dtypes, layouts over its devices); the generator pulls each
            (version=k) into random layouts over its devices, some with dtype=,
            checks every shard bitwise, then pulls the newest again (plans nothing
            new), with donation; with 2 generator processes also a replicated pull by
            both routes, bytes from the trainer against the plan.
  wait      the trainer publishes version 1 and sleeps; the generator pulls it, then
            waits for version 2 (the test kills or closes the trainer): the error and
            the seconds it took.
  close     as wait, but the trainer closes its Publisher once the generator waits.
  die_mid   the generator dies (os._exit) mid-pull, after the pieces were offered.
  again     a generator that pulls version 1 (after another one died mid-pull).
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from jax_m2n.testing import workers  # noqa: E402

TOKEN = "jobs-test-token-0123"
CASES = 30
VERSIONS = 3


def _log(args, what):
  print(f"[{time.strftime('%H:%M:%S')} {args.role} {args.process_id}] {what}",
        file=sys.stderr, flush=True)


def cases(seed):
  """The shared case list: (shape, dtype, out dtype or None) per leaf."""
  import ml_dtypes
  import numpy as np
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(CASES):
    rank = int(rng.integers(0, 4))
    shape = tuple(int(rng.choice([1, 2, 4, 6, 8, 12])) for _ in range(rank))
    dtype = np.dtype(rng.choice([np.float32, np.int8, ml_dtypes.bfloat16, np.int32,
                                 np.float16]))
    conv = None
    if dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)) and rng.random() < 0.4:
      conv = np.dtype(ml_dtypes.bfloat16 if dtype == np.float32 else np.float32)
    elif dtype == np.int32 and rng.random() < 0.2:
      conv = np.dtype(np.float32)  # not fused: converted by the publisher first
    out.append((shape, dtype, conv))
  return out


def values(seed, case, version, shape, dtype):
  import numpy as np
  from multiprocess_cpu_worker import _host
  return _host(np.random.default_rng([seed, case, version]), shape, dtype)


def shardings(jax, seed, devices, shapes):
  """A random sharding per case over random subsets of `devices`."""
  import numpy as np
  from multiprocess_cpu_worker import _random_sharding
  rng = np.random.default_rng(seed)
  out = []
  for shape in shapes:
    n = int(rng.choice([k for k in (1, 2, 4) if k <= len(devices)]))
    pick = [devices[i] for i in sorted(rng.permutation(len(devices))[:n].tolist())]
    out.append(_random_sharding(jax, rng, shape, pick))
  return out


def trainer(jax, jax_m2n, args):
  import numpy as np
  pub = jax_m2n.Publisher(f"{args.host}:0", token=TOKEN, keep=VERSIONS)
  if args.process_id == 0:
    workers.write_file(os.path.join(args.dir, "address"), pub.address)
  table = cases(args.seed)
  srcs = shardings(jax, args.seed + 1, jax.devices(), [s for s, _, _ in table])
  done = os.path.join(args.dir, "generator_done")
  versions = VERSIONS if args.scenario == "random" else 1
  for v in range(1, versions + 1):
    tree = {"leaves": [jax.make_array_from_callback(
        shape, src, lambda i, h=values(args.seed, c, v, shape, dtype): h[i], dtype=dtype)
        for c, ((shape, dtype, _), src) in enumerate(zip(table, srcs))]}
    number = pub.publish(tree)
    assert number == v, (number, v)
    del tree  # the publisher holds its snapshot
  print(f"RESULT published role=trainer process={args.process_id} versions={versions}",
        flush=True)
  if args.scenario == "close":
    workers.wait_file(os.path.join(args.dir, "generator_waiting"), 120)
    time.sleep(0.5)
    pub.close()
    workers.write_file(os.path.join(args.dir, f"closed_{time.time():.6f}"), "")
    print(f"RESULT closed role=trainer process={args.process_id} at={time.time():.6f}",
          flush=True)
  workers.wait_file(done, 240)
  pub.close()
  return 0


def _check(y, host, sharding, dtype):
  from multiprocess_cpu_worker import _check as check
  check(y, host, sharding, dtype)


def generator(jax, jax_m2n, args):
  import numpy as np
  from jax_m2n._src.jobs import engine, planning
  from jax_m2n._src.processes import bootstrap
  address = workers.wait_file(os.path.join(args.dir, "address"), 120)
  if args.scenario == "wrong_token":
    try:
      jax_m2n.Subscriber(address, token="not-the-token-but-long-enough")
      print(f"RESULT wrong_token role=generator process={args.process_id} ok=0", flush=True)
    except jax_m2n.ReshardValueError as e:
      print(f"RESULT wrong_token role=generator process={args.process_id} ok=1 {e}",
            flush=True)
    workers.write_file(os.path.join(args.dir, "generator_done"), "")
    return 0
  sub = jax_m2n.Subscriber(address, token=TOKEN)
  table = cases(args.seed)
  dsts = shardings(jax, args.seed + 2, jax.devices(), [s for s, _, _ in table])
  tree = {"leaves": dsts}
  dtype = {"leaves": [c for _, _, c in table]}
  if args.scenario == "die_mid":
    original = engine.run

    def die(*a, **k):  # the pieces were offered: die before pulling them
      print(f"RESULT die_mid role=generator process={args.process_id} dying=1", flush=True)
      os._exit(3)
    engine.run = die
    sub.pull(tree, dtype=dtype, version=1, timeout_s=60, path="network")
    del original
    return 1
  if args.scenario in ("wait", "close", "again"):
    out = sub.pull(tree, dtype=dtype, version=1, timeout_s=60)
    for c, (shape, dt, conv) in enumerate(table):
      _check(out["leaves"][c], values(args.seed, c, 1, shape, dt), dsts[c], conv)
    print(f"RESULT pulled role=generator process={args.process_id} version=1 ok=1",
          flush=True)
    if args.scenario == "again":
      return 0
    workers.write_file(os.path.join(args.dir, "generator_waiting"), "")
    t0 = time.time()
    try:
      sub.pull(tree, dtype=dtype, timeout_s=120)
      print(f"RESULT waited role=generator process={args.process_id} ok=0 (no error)",
            flush=True)
    except jax_m2n.ReshardRuntimeError as e:
      print(f"RESULT waited role=generator process={args.process_id} ok=1 "
            f"failed_at={time.time():.6f} started={t0:.6f} type={type(e).__name__} {e}",
            flush=True)
    return 0
  ok = 0
  t0 = time.perf_counter()
  for v in range(1, VERSIONS + 1):
    out = sub.pull(tree, dtype=dtype, version=v, timeout_s=120, path=args.path)
    assert sub.version == v
    for c, (shape, dt, conv) in enumerate(table):
      try:
        _check(out["leaves"][c], values(args.seed, c, v, shape, dt), dsts[c], conv)
      except AssertionError as e:
        print(f"RESULT random role=generator process={args.process_id} FAIL version={v} "
              f"case={c} {shape} {dt}->{conv} {dsts[c]}: {e}", flush=True)
        return 1
      ok += 1
  misses = planning.plan_pull.cache_info().misses
  again = sub.pull(tree, dtype=dtype, version=VERSIONS, donate=out, timeout_s=120,
                   path=args.path)
  donated = all(a.is_deleted() for a in out["leaves"])
  for c, (shape, dt, conv) in enumerate(table):
    _check(again["leaves"][c], values(args.seed, c, VERSIONS, shape, dt), dsts[c], conv)
  replanned = planning.plan_pull.cache_info().misses - misses
  print(f"RESULT random role=generator process={args.process_id} ok={ok} "
        f"cases={CASES} versions={VERSIONS} replanned={replanned} donated={donated} "
        f"path={sub._state.path} "
        f"seconds={time.perf_counter() - t0:.1f}", flush=True)
  if jax.process_count() > 1:  # a replicated pull by both routes: bytes from the trainer
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("g",))
    for route in ("hierarchical", "flat"):
      before = engine.stats["pulled_bytes"]
      forwarded = engine.stats["forwarded_in_bytes"]
      y = sub.pull(NamedSharding(mesh, P()), version=VERSIONS, route=route, timeout_s=120,
                   path="network")
      pulled = engine.stats["pulled_bytes"] - before
      received = pulled + engine.stats["forwarded_in_bytes"] - forwarded
      for c, (shape, dt, _) in enumerate(table):
        _check(y["leaves"][c], values(args.seed, c, VERSIONS, shape, dt),
               NamedSharding(mesh, P()), None)
      m = sub._state.manifests[next(reversed(sub._state.manifests))]
      pp = planning.plan_pull(m, tuple([NamedSharding(mesh, P())] * CASES),
                              tuple(np.dtype(d) for _, d, _ in table), route)
      total = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d, _ in table)
      print(f"RESULT route role=generator process={args.process_id} route={route} "
            f"pulled={pulled} plan_from_publisher="
            f"{planning.network_bytes(pp)['from_publisher']} payload={total} "
            f"transfer={sub._state.connections.transport(m).address} "
            f"received={received} record={sub.last_pull.wire_bytes} "
            f"record_route={sub.last_pull.route}", flush=True)
  return generator_done(sub, args)


def generator_done(sub, args) -> int:
  """A generator's end: its subscriber closed, then (process 0) DIR/generator_done."""
  sub.close()
  if args.process_id == 0:
    workers.write_file(os.path.join(args.dir, "generator_done"), "")
  return 0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--role", choices=["trainer", "generator"], required=True)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--devices", type=int, default=4)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--dir", required=True)
  p.add_argument("--scenario", default="random")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--path", default="auto")
  # On emulated hosts (tests/jobs_test.py): the address the trainer serves at, and the
  # address of the job's jax.distributed coordinator (its process 0's host).
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--coordinator", default="127.0.0.1")
  args = p.parse_args()
  workers.run_worker(trainer if args.role == "trainer" else generator, args,
                     f"{args.coordinator}:{args.port}",
                     f"role={args.role} process={args.process_id}")


if __name__ == "__main__":
  main()
